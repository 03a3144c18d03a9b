//! Multicast groups: joining and leaving them, and what leaving frees.

use super::*;

impl Cm {
    /// JOIN_IP_MCAST: UD id `h`, bound to the device, joins IPv4 multicast `group`; the
    /// MULTICAST_JOIN event carries the group's address vector, QPN 0xFFFFFF and the Q_Key
    /// (librdmacm then attaches the id's QP).
    pub fn join_mcast(&mut self, ch: Channel, h: Handle, uid: u64, group: Ipv4Addr) -> R<Handle> {
        let id = self.id(ch, h)?;
        let bound = matches!(id.state, State::Bound | State::AddrResolved) && id.has_device();
        if !id.ud() || !bound || !group.is_multicast() || self.dev.is_none() {
            return Err(libc::EINVAL);
        }
        let tos = id.tos;
        let m = self.new_handle();
        self.mcs.insert(
            m,
            Mc {
                id: h,
                events_reported: 0,
            },
        );
        if let Some(q) = self.queues.get_mut(&ch) {
            q.push_back(Event {
                handle: m,
                uid,
                event: event::MULTICAST_JOIN,
                status: 0,
                param: Param::Ud {
                    qp_num: softrnic_abi::device::MCAST_QPN,
                    qkey: abi::UDP_QKEY,
                    ah: Some(ah_to(device::gid_for(group), tos)),
                    private: Vec::new(),
                },
                counted_by: h,
                mc: Some(m),
            });
        }
        Ok(m)
    }

    /// LEAVE_MCAST: how many events the program was given about the membership.
    pub fn leave_mcast(&mut self, ch: Channel, m: Handle) -> R<u32> {
        let id = self.mcs.get(&m).ok_or(libc::ENOENT)?.id;
        self.id(ch, id)?;
        Ok(self.drop_mc(ch, m))
    }

    pub(super) fn drop_mc(&mut self, ch: Channel, m: Handle) -> u32 {
        if let Some(q) = self.queues.get_mut(&ch) {
            q.retain(|e| e.mc != Some(m));
        }
        self.mcs.remove(&m).map_or(0, |m| m.events_reported)
    }

    // -- from the peer --------------------------------------------------------------------
}
