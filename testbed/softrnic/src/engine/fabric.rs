//! Where this NIC meets the network: its port (up or down), its address and the run's other
//! hosts, the packets waiting to leave, and the faults injected on their way out. The socket
//! itself belongs to the I/O around the state (`host_io`), which sends what waits here.

use super::*;

/// Egress fault injection: one injector per destination, and the held packets.
pub(super) struct Injection {
    pub(super) cfg: FaultConfig,
    pub(super) host: String,
    pub(super) links: HashMap<SocketAddr, LinkInjector>,
    /// Packets held back, with their destinations.
    pub(super) held: crate::due::DueQueue<(SocketAddr, Packet)>,
}

pub(super) struct Fabric {
    /// The port's link (`softrnic link`): while down, nothing is sent or received.
    pub(super) up: bool,
    /// This host's address (the destination in the GRH of received UD datagrams).
    pub(super) me: Ipv4Addr,
    /// Every host of the run, to which multicast datagrams are replicated.
    pub(super) peers: Vec<Ipv4Addr>,
    /// Packets waiting to be sent (built under the lock, sent by whoever holds it).
    pub(super) out: Vec<(SocketAddr, Packet)>,
    /// Fault injection, when configured.
    pub(super) inject: Option<Injection>,
}

impl Default for Fabric {
    fn default() -> Self {
        Fabric {
            up: true,
            me: Ipv4Addr::LOCALHOST,
            peers: Vec::new(),
            out: Vec::new(),
            inject: None,
        }
    }
}

impl Fabric {
    /// Queue `p` for `dst`; the network replicates a multicast one to every host.
    pub(super) fn send(&mut self, dst: SocketAddr, p: Packet) {
        if multicast::is_group_addr(dst) {
            for d in self.fanout(dst) {
                self.out.push((d, p.clone()));
            }
        } else {
            self.out.push((dst, p));
        }
    }

    /// Where a packet for `dst` goes: a multicast destination to every host of the run.
    pub(super) fn fanout(&self, dst: SocketAddr) -> Vec<SocketAddr> {
        if !multicast::is_group_addr(dst) {
            return vec![dst];
        }
        let mut hosts: BTreeSet<Ipv4Addr> = self.peers.iter().copied().collect();
        hosts.insert(self.me);
        hosts
            .into_iter()
            .map(|ip| SocketAddr::V4(SocketAddrV4::new(ip, dst.port())))
            .collect()
    }

    /// Take the queued packets addressed to `me` (this engine), leaving the others queued;
    /// None when there are none.
    pub(super) fn take_local(&mut self, me: SocketAddr) -> Option<Vec<Packet>> {
        if !self.out.iter().any(|(d, _)| *d == me) {
            return None;
        }
        let (local, rest): (Vec<_>, Vec<_>) = self.out.drain(..).partition(|(d, _)| *d == me);
        self.out = rest;
        Some(local.into_iter().map(|(_, p)| p).collect())
    }

    /// The other hosts of the run: the most senders a receiver here can count.
    pub(super) fn others(&self) -> u32 {
        self.peers.iter().filter(|p| **p != self.me).count() as u32
    }
}
