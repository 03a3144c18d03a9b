//! UD multicast (`ibv_attach_mcast`): a group is known by its key (`device::mcast_group`: the
//! IPv4 address of an IPv4-mapped group GID, as the RDMA CM makes them, or a hash of an
//! IB-style MGID), which every multicast datagram carries. The sending engine charges the
//! NIC model for one packet and replicates it to every host of the run, itself included — what
//! the switch does for a NIC — and each engine hands a copy to every local QP attached to the
//! group, as a NIC's multicast filter does; hosts without members drop it silently. Raw-packet
//! QPs join Ethernet multicast MACs in the same table (keys of `device::mac_group`), and
//! `raw.rs` delivers frames to them.

use std::net::{Ipv4Addr, SocketAddr};

use super::*;

/// Whether `dst` is a multicast address, which the network replicates to every host.
pub(super) fn is_group_addr(dst: SocketAddr) -> bool {
    matches!(dst, SocketAddr::V4(a) if a.ip().is_multicast())
}

impl State {
    pub(super) fn attach_mcast(&mut self, conn: u64, qpn: u32, group: u64, attach: bool) -> Resp {
        let fits = self.qps.get(&qpn).is_some_and(|q| {
            q.conn == conn
                && match q.qpt {
                    IBV_QPT_UD => device::is_group(group),
                    IBV_QPT_RAW_PACKET => group & device::MAC_GROUP != 0,
                    _ => false,
                }
        });
        if !fits {
            return err(libc::EINVAL);
        }
        let ud = group & device::MAC_GROUP == 0;
        let ud_groups = || {
            self.mcast
                .keys()
                .filter(|g| *g & device::MAC_GROUP == 0)
                .count()
        };
        if attach
            && ud
            && !self.mcast.contains_key(&group)
            && ud_groups() >= device::MAX_MCAST_GRP as usize
        {
            return err(libc::ENOMEM);
        }
        let members = self.mcast.entry(group).or_default();
        if attach
            && ud
            && !members.contains(&qpn)
            && members.len() >= device::MAX_MCAST_QP_ATTACH as usize
        {
            return err(libc::ENOMEM);
        }
        let changed = if attach {
            members.insert(qpn)
        } else {
            members.remove(&qpn)
        };
        if members.is_empty() {
            self.mcast.remove(&group);
        }
        // Attaching twice is harmless; leaving a group not joined is an error, as on mlx5.
        if !attach && !changed {
            return err(libc::EINVAL);
        }
        Resp::Unit
    }

    /// A destroyed QP leaves its groups.
    pub(super) fn leave_all_mcast(&mut self, qpn: u32) {
        self.mcast.retain(|_, m| {
            m.remove(&qpn);
            !m.is_empty()
        });
    }

    /// A datagram to a multicast group: a copy for every local QP attached to it.
    pub(super) fn mcast_rx(&mut self, from: SocketAddr, p: &Packet, now: Instant) {
        let group = p.remote_addr;
        if !device::is_group(group) {
            self.counters.rx_dropped_malformed += 1;
            return;
        }
        // The GRH names an IPv4 group; an IB-style MGID has no IPv4 form.
        let grh_dst = u32::try_from(group).map_or(Ipv4Addr::UNSPECIFIED, Ipv4Addr::from);
        let members: Vec<u32> = self
            .mcast
            .get(&group)
            .map(|m| m.iter().copied().collect())
            .unwrap_or_default();
        for qpn in members {
            self.touch_qp(qpn, now);
            self.ud_deliver(qpn, from, p, grh_dst);
        }
    }
}
