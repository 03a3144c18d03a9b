//! The engine's packet and work counters, as `softrnic stats` prints them.

#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Counters {
    pub rx_packets: u64,
    pub rx_dropped_malformed: u64,
    pub rx_dropped_unknown_qp: u64,
    /// Valid packets for a known QP that were stale or outside the window (duplicates,
    /// replays): re-acknowledged or ignored, never applied twice.
    pub rx_duplicate: u64,
    pub rx_stale: u64,
    pub rx_handler_panics: u64,
    pub tx_packets: u64,
    pub retransmits: u64,
    /// READs asked again from a missing response on (the rest only, at once; also counted
    /// in `retransmits`).
    pub read_requests_again: u64,
    pub fault_dropped: u64,
    pub fault_duplicated: u64,
    pub fault_reordered: u64,
    pub fault_delayed: u64,
    /// QP-context cache of the NIC model: lookups that hit and that missed.
    pub qp_cache_hits: u64,
    pub qp_cache_misses: u64,
    /// Work requests fetched by the transmitter (each costs `wqe_fetch_ns`), and the reads
    /// that fetched them (one per doorbell batch, see [`crate::nic::fetch_count`]).
    pub wqe_fetches: u64,
    pub wqe_fetch_reads: u64,
    /// Work requests taken from shared rings (send, receive), completions written to rings,
    /// and posts/polls that came over the socket instead (programs whose rings could not be
    /// set up, and tests).
    pub ring_send_wqes: u64,
    pub ring_recv_wqes: u64,
    pub ring_cqes: u64,
    pub socket_posts_polls: u64,
    /// UD datagrams dropped for a wrong Q_Key, and UD/UC messages dropped because no
    /// receive was posted (those transports have no RNR: the message is lost).
    pub rx_dropped_qkey: u64,
    pub rx_dropped_no_recv: u64,
    /// Ethernet frames (raw-packet QPs) that no flow rule of this host wants.
    pub rx_dropped_no_flow: u64,
    /// UC packets dropped because an earlier packet of their message was lost.
    pub rx_uc_broken: u64,
    /// Packets not sent or not taken because the port's link was down.
    pub port_down_dropped: u64,
    /// WRITE and SEND data and READ responses placed into applications, one
    /// `process_vm_writev` each (the packets of a message are combined, see `placement`).
    pub rx_placements: u64,
}

impl Counters {
    /// `name value` lines (the stats file, `softrnic stats`).
    pub fn encode(&self) -> String {
        let mut s = String::new();
        for (k, v) in [
            ("rx_packets", self.rx_packets),
            ("rx_dropped_malformed", self.rx_dropped_malformed),
            ("rx_dropped_unknown_qp", self.rx_dropped_unknown_qp),
            ("rx_duplicate", self.rx_duplicate),
            ("rx_stale", self.rx_stale),
            ("rx_handler_panics", self.rx_handler_panics),
            ("tx_packets", self.tx_packets),
            ("retransmits", self.retransmits),
            ("read_requests_again", self.read_requests_again),
            ("fault_dropped", self.fault_dropped),
            ("fault_duplicated", self.fault_duplicated),
            ("fault_reordered", self.fault_reordered),
            ("fault_delayed", self.fault_delayed),
            ("qp_cache_hits", self.qp_cache_hits),
            ("qp_cache_misses", self.qp_cache_misses),
            ("wqe_fetches", self.wqe_fetches),
            ("wqe_fetch_reads", self.wqe_fetch_reads),
            ("ring_send_wqes", self.ring_send_wqes),
            ("ring_recv_wqes", self.ring_recv_wqes),
            ("ring_cqes", self.ring_cqes),
            ("socket_posts_polls", self.socket_posts_polls),
            ("rx_dropped_qkey", self.rx_dropped_qkey),
            ("rx_dropped_no_recv", self.rx_dropped_no_recv),
            ("rx_dropped_no_flow", self.rx_dropped_no_flow),
            ("rx_uc_broken", self.rx_uc_broken),
            ("port_down_dropped", self.port_down_dropped),
            ("rx_placements", self.rx_placements),
        ] {
            s.push_str(&format!("{k} {v}\n"));
        }
        s
    }
}
