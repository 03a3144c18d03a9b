//! What the emulated device reports: names, identifiers, limits and the GID encoding.
//!
//! The limits are the ones the engine (or, for address handles, the provider) enforces;
//! features not implemented (tag matching, RSS, TSO) are reported as absent (zero).

use std::net::Ipv4Addr;

use drum_verbs_abi::{consts::*, IbvDeviceAttr, IbvPortAttr};

/// Kernel-side name of a host's first device (as in /sys/class/infiniband).
pub const IBDEV_NAME: &str = "softrnic0";
/// Most devices a host offers (`softrnic up --devices`): functions of its one NIC.
pub const MAX_DEVICES: usize = 4;

/// Kernel-side name of device `i` of a host.
pub fn ibdev_name(i: usize) -> String {
    format!("softrnic{i}")
}

/// Name of device `i`'s uverbs node (as in /sys/class/infiniband_verbs and /dev/infiniband).
pub fn uverbs_name(i: usize) -> String {
    format!("uverbs{i}")
}
/// uverbs ABI version written to sysfs (rdma-core 44 accepts the provider's min..max).
pub const UVERBS_ABI: u32 = 6;
/// The UDP port the engines listen on (RoCEv2's port, on the emulated hosts' addresses).
pub const ENGINE_UDP_PORT: u16 = 4791;
/// Version string reported as the firmware version.
pub const FW_VER: &str = concat!("softrnic ", env!("CARGO_PKG_VERSION"));

pub const MAX_QP: u32 = 4096;
pub const MAX_QP_WR: u32 = 16384;
pub const MAX_SGE: u32 = 32;
pub const MAX_CQ: u32 = 4096;
pub const MAX_CQE: u32 = 65536;
pub const MAX_MR: u32 = 65536;
/// On-demand paging (`ibv_device_attr_ex.odp_caps`): supported, implicit MRs too
/// (IBV_ODP_SUPPORT | IBV_ODP_SUPPORT_IMPLICIT).
pub const ODP_GENERAL_CAPS: u64 = 1 | 2;
/// Per transport: SEND 1, RECV 2, WRITE 4, READ 8, ATOMIC 16, SRQ_RECV 32 — what each
/// transport executes.
pub const ODP_RC_CAPS: u32 = 1 | 2 | 4 | 8 | 16 | 32;
pub const ODP_UC_CAPS: u32 = 1 | 2 | 4 | 32;
pub const ODP_UD_CAPS: u32 = 1 | 2 | 32;
pub const MAX_MW: u32 = 65536;
/// Device memory of the host (`ibv_device_attr_ex.max_dm_size`), shared by its processes:
/// 256 KiB, the size of ConnectX-6's on-chip memory (MEMIC) that mlx5 offers.
pub const MAX_DM_SIZE: u64 = 256 << 10;
/// Packet pacing (`ibv_device_attr_ex.packet_pacing_caps`): per-QP rates from 1 kb/s to
/// 100 Gb/s (ConnectX-5's range), on the QP types that send.
pub const PP_RATE_MIN_KBPS: u32 = 1;
pub const PP_RATE_MAX_KBPS: u32 = 100_000_000;
pub const PP_QP_TYPES: [i32; 5] = [
    IBV_QPT_RC,
    IBV_QPT_UC,
    IBV_QPT_UD,
    IBV_QPT_RAW_PACKET,
    IBV_QPT_XRC_SEND,
];

/// Whether `kbps` is a rate a QP of type `qpt` may be paced at (0: not paced).
pub fn pacing_allowed(qpt: i32, kbps: u32) -> bool {
    kbps == 0
        || (PP_QP_TYPES.contains(&qpt) && (PP_RATE_MIN_KBPS..=PP_RATE_MAX_KBPS).contains(&kbps))
}
pub const MAX_PD: u32 = 4096;
pub const MAX_RD_ATOM: u32 = 16;
pub const MAX_SRQ: u32 = 4096;
/// XRC domains per host (the verbs report no such limit; a bound on what one engine keeps).
pub const MAX_XRCD: u32 = 4096;
/// Address handles per process (they live in the provider: an AH is an address).
pub const MAX_AH: u32 = 65536;
pub const MAX_SRQ_WR: u32 = 16384;
pub const MAX_INLINE: u32 = 256;
/// IBV_DEVICE_RC_RNR_NAK_GEN: the responder generates RNR NAKs; MEM_WINDOW and
/// MEM_WINDOW_TYPE_2B: memory windows of type 1 and 2 (2B: bound to one QP); XRC. The
/// extended attributes' `device_cap_flags_ex` holds the same bits, as the kernel's do.
pub const DEVICE_CAP_FLAGS: u64 = 1 << 12 | 1 << 17 | 1 << 20 | 1 << 24;
/// UD multicast groups the engine keeps, and QPs attached to one group (the engine refuses
/// more with `ENOMEM`); every group may hold that many, so the total is their product.
pub const MAX_MCAST_GRP: u32 = 4096;
pub const MAX_MCAST_QP_ATTACH: u32 = 256;
/// Largest message (bytes) the port accepts: 2 GiB - 1, as rxe and mlx5 report.
pub const MAX_MSG_SZ: u32 = 0x7fff_ffff;
/// The QPN a multicast group is addressed by (IBTA: 0xFFFFFF).
pub const MCAST_QPN: u32 = 0xFF_FFFF;
/// The RDMA CM command ABI `class/misc/rdma_cm/abi_version` reports (`<rdma/rdma_user_cm.h>`,
/// version 4, the one librdmacm 44 speaks), which the provider's connection manager implements.
pub const RDMA_CM_ABI_VERSION: u32 = 4;

/// IB MTU enum value (`IBV_MTU_*`) of a byte size.
pub fn mtu_enum(bytes: u32) -> Option<i32> {
    match bytes {
        256 => Some(1),
        512 => Some(2),
        1024 => Some(3),
        2048 => Some(4),
        4096 => Some(5),
        _ => None,
    }
}

/// IPv4-mapped GID (`::ffff:a.b.c.d`), as RoCEv2 devices report for IPv4 addresses.
#[inline]
pub fn gid_for(ip: Ipv4Addr) -> [u8; 16] {
    let mut g = [0u8; 16];
    g[10] = 0xff;
    g[11] = 0xff;
    g[12..].copy_from_slice(&ip.octets());
    g
}

/// The IPv4 address in an IPv4-mapped GID.
#[inline]
pub fn ip_of_gid(g: &[u8; 16]) -> Option<Ipv4Addr> {
    if g[..10].iter().all(|b| *b == 0) && g[10] == 0xff && g[11] == 0xff {
        Some(Ipv4Addr::new(g[12], g[13], g[14], g[15]))
    } else {
        None
    }
}

/// Marks a multicast group key that stands for an IB-style MGID (`ff…`), not an IPv4 group.
pub const HASHED_GROUP: u64 = 1 << 63;

/// The key a multicast GID is known by between provider and engines: an IPv4-mapped group's
/// IPv4 address, or for an IB-style MGID (first byte 0xff; perftest's `--mcg` default) a
/// 64-bit FNV-1a hash of it with [`HASHED_GROUP`] set. None for unicast GIDs.
#[inline]
pub fn mcast_group(g: &[u8; 16]) -> Option<u64> {
    match ip_of_gid(g) {
        Some(ip) if ip.is_multicast() => Some(u64::from(u32::from(ip))),
        Some(_) => None,
        None if g[0] == 0xff => {
            let h = g.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
                (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3)
            });
            Some(h | HASHED_GROUP)
        }
        None => None,
    }
}

/// Marks a group key that stands for an Ethernet multicast MAC, which raw-packet QPs join.
pub const MAC_GROUP: u64 = 1 << 62;

/// The key of the Ethernet multicast group a raw-packet QP joins with `ibv_attach_mcast`: a
/// GID holding a multicast MAC in its last six bytes after ten zero bytes (mlx4/mlx5's form,
/// which perftest's `raw_ethernet_bw --raw_mcast` uses), or an IPv4-mapped multicast GID, whose
/// MAC is 01:00:5e and the group's low 23 bits (RFC 1112). None for anything else.
#[inline]
pub fn mac_group(g: &[u8; 16]) -> Option<u64> {
    let mac: [u8; 6] = match ip_of_gid(g) {
        Some(ip) if ip.is_multicast() => {
            let o = ip.octets();
            [0x01, 0x00, 0x5e, o[1] & 0x7f, o[2], o[3]]
        }
        Some(_) => return None,
        None if g[..10].iter().all(|b| *b == 0) && g[10] & 1 == 1 => {
            g[10..].try_into().expect("six bytes")
        }
        None => return None,
    };
    Some(mac_group_key(&mac))
}

/// The group key of a destination MAC (a frame's first six bytes).
#[inline]
pub fn mac_group_key(mac: &[u8; 6]) -> u64 {
    mac.iter().fold(0, |k, b| k << 8 | u64::from(*b)) | MAC_GROUP
}

/// Whether `key` (a UD destination) names a multicast group.
#[inline]
pub fn is_group(key: u64) -> bool {
    key & HASHED_GROUP != 0 || u32::try_from(key).is_ok_and(|ip| Ipv4Addr::from(ip).is_multicast())
}

/// GID in the sysfs text form (`0000:0000:...`, eight groups of four hex digits).
pub fn gid_sysfs(g: &[u8; 16]) -> String {
    g.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// Parse the sysfs text form of a GID.
pub fn parse_gid_sysfs(s: &str) -> Option<[u8; 16]> {
    let parts: Vec<&str> = s.trim().split(':').collect();
    if parts.len() != 8 {
        return None;
    }
    let mut g = [0u8; 16];
    for (i, p) in parts.iter().enumerate() {
        let v = u16::from_str_radix(p, 16).ok()?;
        g[2 * i] = (v >> 8) as u8;
        g[2 * i + 1] = v as u8;
    }
    Some(g)
}

/// Node GUID derived from the host address (EUI-64 style, locally administered).
pub fn node_guid(ip: Ipv4Addr) -> u64 {
    device_guid(ip, 0)
}

/// The node GUID of device `i` of the host at `ip` (device 0's is [`node_guid`]).
pub fn device_guid(ip: Ipv4Addr, i: usize) -> u64 {
    let o = ip.octets();
    u64::from_be_bytes([0x02, 0x53, 0x52, 0xff - i as u8, o[0], o[1], o[2], o[3]])
}

/// sysfs form of a GUID (`xxxx:xxxx:xxxx:xxxx`).
pub fn guid_sysfs(guid: u64) -> String {
    let b = guid.to_be_bytes();
    b.chunks(2)
        .map(|c| format!("{:02x}{:02x}", c[0], c[1]))
        .collect::<Vec<_>>()
        .join(":")
}

/// Fill `ibv_device_attr` (the caller has zeroed it).
pub fn fill_device_attr(a: &mut IbvDeviceAttr, guid: u64) {
    for (d, s) in a.fw_ver.iter_mut().zip(FW_VER.bytes()) {
        *d = s as libc::c_char;
    }
    // __be64 fields hold the GUID in network byte order.
    a.node_guid = guid.to_be();
    a.sys_image_guid = guid.to_be();
    a.max_mr_size = u64::MAX >> 1;
    a.page_size_cap = 0xffff_f000;
    a.vendor_id = 0x5352; // "SR"; no IEEE OUI: this is a software device
    a.vendor_part_id = 1;
    a.hw_ver = 1;
    a.max_qp = MAX_QP as i32;
    a.max_qp_wr = MAX_QP_WR as i32;
    a.device_cap_flags = DEVICE_CAP_FLAGS as u32;
    a.max_sge = MAX_SGE as i32;
    a.max_sge_rd = MAX_SGE as i32;
    a.max_cq = MAX_CQ as i32;
    a.max_cqe = MAX_CQE as i32;
    a.max_mr = MAX_MR as i32;
    a.max_mw = MAX_MW as i32;
    a.max_pd = MAX_PD as i32;
    a.max_qp_rd_atom = MAX_RD_ATOM as i32;
    a.max_res_rd_atom = (MAX_RD_ATOM * MAX_QP) as i32;
    a.max_qp_init_rd_atom = MAX_RD_ATOM as i32;
    // IBV_ATOMIC_HCA: atomics are atomic against other atomics through this NIC (the engine
    // serialises them), not against the target process's own CPU accesses.
    a.atomic_cap = 1;
    a.max_ah = MAX_AH as i32;
    a.max_srq = MAX_SRQ as i32;
    a.max_srq_wr = MAX_SRQ_WR as i32;
    a.max_srq_sge = MAX_SGE as i32;
    a.max_mcast_grp = MAX_MCAST_GRP as i32;
    a.max_mcast_qp_attach = MAX_MCAST_QP_ATTACH as i32;
    a.max_total_mcast_qp_attach = (MAX_MCAST_GRP * MAX_MCAST_QP_ATTACH) as i32;
    a.max_pkeys = 1;
    a.local_ca_ack_delay = 15;
    a.phys_port_cnt = 1;
}

/// Fill `ibv_port_attr` for port 1 (the caller has zeroed it); `active_mtu` is the NIC
/// model's MTU (an `IBV_MTU_*` value), `up` whether the link is up (see [`port_state_text`]).
pub fn fill_port_attr(p: &mut IbvPortAttr, active_mtu: i32, up: bool) {
    p.state = if up { IBV_PORT_ACTIVE } else { IBV_PORT_DOWN };
    p.max_mtu = IBV_MTU_4096;
    p.active_mtu = active_mtu;
    p.gid_tbl_len = 1;
    p.max_msg_sz = MAX_MSG_SZ;
    p.pkey_tbl_len = 1;
    p.max_vl_num = 1;
    p.active_width = 1; // 1X
    p.active_speed = 32; // EDR (25 Gb/s per lane)
    p.phys_state = if up { 5 } else { 3 }; // LinkUp, Disabled
    p.link_layer = IBV_LINK_LAYER_ETHERNET;
}

/// Port 1's directory under a host's sysfs root.
pub fn port_dir(sysfs_root: &std::path::Path) -> std::path::PathBuf {
    sysfs_root
        .join("class/infiniband")
        .join(IBDEV_NAME)
        .join("ports/1")
}

/// The sysfs `state` and `phys_state` of a port whose link is up or down, as the kernel
/// writes them. The `state` file is also where `softrnic link` tells the engine and the
/// provider: it is the port's one source of truth.
pub fn port_state_text(up: bool) -> (&'static str, &'static str) {
    if up {
        ("4: ACTIVE\n", "5: LinkUp\n")
    } else {
        ("1: DOWN\n", "3: Disabled\n")
    }
}

/// Whether a sysfs port `state` says the link is up (anything unreadable counts as up, as
/// `up` wrote it).
pub fn port_is_up(state: &str) -> bool {
    !state.trim_start().starts_with('1')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn port_state_text_round_trips_and_drives_query_port() {
        for up in [true, false] {
            let (state, _) = port_state_text(up);
            assert_eq!(port_is_up(state), up);
            // SAFETY: plain C data; all-zero is what query_port starts from.
            let mut p: IbvPortAttr = unsafe { std::mem::zeroed() };
            fill_port_attr(&mut p, IBV_MTU_4096, up);
            assert_eq!(p.state, if up { IBV_PORT_ACTIVE } else { IBV_PORT_DOWN });
        }
        assert!(port_is_up(""), "an unreadable state counts as up");
    }

    #[test]
    fn multicast_gids_have_group_keys_and_unicast_ones_none() {
        let v4 = gid_for(Ipv4Addr::new(239, 1, 1, 1));
        assert_eq!(mcast_group(&v4), Some(0xef01_0101));
        assert_eq!(mcast_group(&gid_for(Ipv4Addr::new(10, 0, 0, 1))), None);
        let ib = [0xff, 1, 0, 0, 0, 2, 0xc9, 0x85, 0, 0, 0, 0, 0, 0, 0, 0];
        let k = mcast_group(&ib).unwrap();
        assert!(k & HASHED_GROUP != 0 && is_group(k));
        let mut other = ib;
        other[15] = 1;
        assert_ne!(mcast_group(&other), Some(k));
        assert_eq!(mcast_group(&[0; 16]), None);
        assert!(is_group(0xef01_0101) && !is_group(0x0a00_0001) && !is_group(0));
        // Raw-packet QPs: a multicast MAC in the last six bytes, or an IPv4 group's MAC.
        let mac = [0x01, 0x00, 0x5e, 0x4d, 0x00, 0x01];
        let mut raw = [0u8; 16];
        raw[10..].copy_from_slice(&mac);
        let key = mac_group(&raw).unwrap();
        assert_eq!(key, mac_group_key(&mac));
        assert!(key & MAC_GROUP != 0 && !is_group(key), "not a UD group");
        let v4_mac = mac_group(&gid_for(Ipv4Addr::new(239, 205, 0, 1)));
        assert_eq!(v4_mac, Some(key), "the low 23 bits of 239.205.0.1");
        raw[10] = 0x02;
        assert_eq!(mac_group(&raw), None, "a unicast MAC");
        assert_eq!(mac_group(&v4), Some(mac_group_key(&[1, 0, 0x5e, 1, 1, 1])));
        assert_eq!(mac_group(&gid_for(Ipv4Addr::new(10, 0, 0, 1))), None);
        assert_eq!(mac_group(&ib), None);
    }

    #[test]
    fn gid_roundtrip() {
        let ip = Ipv4Addr::new(10, 77, 0, 2);
        let g = gid_for(ip);
        assert_eq!(ip_of_gid(&g), Some(ip));
        let s = gid_sysfs(&g);
        assert_eq!(s, "0000:0000:0000:0000:0000:ffff:0a4d:0002");
        assert_eq!(parse_gid_sysfs(&s), Some(g));
        assert_eq!(ip_of_gid(&[0; 16]), None);
        assert_eq!(guid_sysfs(node_guid(ip)), "0253:52ff:0a4d:0002");
    }
}
