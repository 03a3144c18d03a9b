//! Flow-steering rules of raw-packet QPs (`ibv_create_flow`): the application's
//! `struct ibv_flow_attr` and the specs that follow it, parsed from bytes (the engine gets
//! them from another process: every malformed input is an error, never a panic), and the
//! test whether an Ethernet frame matches a rule.
//!
//! Layouts (rdma-core 44; filter values are in network byte order, as on the wire, so they
//! are compared with frame bytes directly):
//! * `ibv_flow_attr` (20 bytes): comp_mask u32, type u32, size u16, priority u16,
//!   num_of_specs u8, port u8, 2 pad bytes, flags u32; `num_of_specs` specs follow. As in
//!   libibverbs (whose command the kernel reads), `comp_mask` and `size` are not read: the
//!   specs' own headers delimit them (perftest leaves `size` 0 in its sniffer and promiscuous
//!   rules);
//! * every spec starts with type u32 and size u16;
//! * ETH (40 bytes): value at 6, mask at 22, each dst_mac[6], src_mac[6], ether_type,
//!   vlan_tag;
//! * IPV4 (24): value at 8, mask at 16, each src_ip[4], dst_ip[4];
//! * IPV4_EXT (32): value at 8, mask at 20, each src_ip, dst_ip, proto, tos, ttl, flags;
//! * IPV6 (88): value at 8, mask at 48, each src_ip[16], dst_ip[16], flow_label (u32,
//!   network order), next_hdr, traffic_class, hop_limit (and a pad byte);
//! * TCP/UDP (16): value at 6, mask at 10, each dst_port[2], src_port[2].

use std::fmt;

use softrnic_abi::proto::MAX_FLOW_ATTR_BYTES as MAX_ATTR_BYTES;

pub const FLOW_ATTR_NORMAL: u32 = 0;
pub const FLOW_ATTR_ALL_DEFAULT: u32 = 1;
pub const FLOW_ATTR_MC_DEFAULT: u32 = 2;
pub const FLOW_ATTR_SNIFFER: u32 = 3;
/// Most specs in one rule.
const MAX_SPECS: usize = 8;
const ATTR_LEN: usize = 20;

const SPEC_ETH: u32 = 0x20;
const SPEC_IPV4: u32 = 0x30;
const SPEC_IPV4_EXT: u32 = 0x32;
const SPEC_IPV6: u32 = 0x31;
const SPEC_TCP: u32 = 0x40;
const SPEC_UDP: u32 = 0x41;

const ETHERTYPE_IPV4: [u8; 2] = [0x08, 0x00];
const ETHERTYPE_IPV6: [u8; 2] = [0x86, 0xdd];
const IPV6_HEADER: usize = 40;
const ETHERTYPE_VLAN: [u8; 2] = [0x81, 0x00];

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FlowError {
    /// The bytes are not a well-formed rule (`EINVAL`).
    Malformed(&'static str),
    /// A well-formed rule softrnic does not steer by (`EOPNOTSUPP`).
    Unsupported(&'static str),
}

impl FlowError {
    pub fn errno(&self) -> i32 {
        match self {
            FlowError::Malformed(_) => libc::EINVAL,
            FlowError::Unsupported(_) => libc::EOPNOTSUPP,
        }
    }
}

impl fmt::Display for FlowError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FlowError::Malformed(w) => write!(f, "malformed flow rule: {w}"),
            FlowError::Unsupported(w) => write!(f, "unsupported flow rule: {w}"),
        }
    }
}

/// A field as value and mask, compared bytewise: `(field & mask) == (value & mask)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Masked<const N: usize> {
    val: [u8; N],
    mask: [u8; N],
}

impl<const N: usize> Masked<N> {
    fn new(b: &[u8], val_at: usize, mask_at: usize) -> Self {
        let mut m = Masked {
            val: [0; N],
            mask: [0; N],
        };
        m.val.copy_from_slice(&b[val_at..val_at + N]);
        m.mask.copy_from_slice(&b[mask_at..mask_at + N]);
        m
    }

    fn accepts(&self, field: &[u8]) -> bool {
        field.len() == N && (0..N).all(|i| field[i] & self.mask[i] == self.val[i] & self.mask[i])
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
enum Spec {
    Eth {
        dst: Masked<6>,
        src: Masked<6>,
        ether_type: Masked<2>,
        vlan: Masked<2>,
    },
    Ipv4 {
        src: Masked<4>,
        dst: Masked<4>,
        /// IPV4_EXT only: proto, tos, ttl, flags.
        ext: Option<Masked<4>>,
    },
    Ipv6 {
        src: Masked<16>,
        dst: Masked<16>,
        flow_label: Masked<4>,
        /// next_hdr, traffic_class, hop_limit.
        ext: Masked<3>,
    },
    L4 {
        protocol: u8,
        dst_port: Masked<2>,
        src_port: Masked<2>,
    },
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FlowRule {
    pub kind: u32,
    pub priority: u16,
    specs: Vec<Spec>,
}

fn u16_at(b: &[u8], o: usize) -> u16 {
    u16::from_le_bytes([b[o], b[o + 1]])
}

fn u32_at(b: &[u8], o: usize) -> u32 {
    u32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]])
}

impl FlowRule {
    /// Parses an `ibv_flow_attr` with its specs; bytes after the last spec are ignored.
    pub fn parse(bytes: &[u8]) -> Result<FlowRule, FlowError> {
        Self::parse_prefix(bytes).map(|(rule, _)| rule)
    }

    /// [`FlowRule::parse`], and how many bytes the attribute and its specs took.
    pub fn parse_prefix(bytes: &[u8]) -> Result<(FlowRule, usize), FlowError> {
        use FlowError::{Malformed, Unsupported};
        if bytes.len() < ATTR_LEN {
            return Err(Malformed("shorter than struct ibv_flow_attr"));
        }
        let kind = u32_at(bytes, 4);
        let priority = u16_at(bytes, 10);
        let (n_specs, port, flags) = (usize::from(bytes[12]), bytes[13], u32_at(bytes, 16));
        if flags != 0 {
            return Err(Unsupported("flags (DONT_TRAP, EGRESS)"));
        }
        if kind > FLOW_ATTR_SNIFFER {
            return Err(Malformed("unknown rule type"));
        }
        if port != 1 {
            return Err(Malformed("no such port"));
        }
        if n_specs > MAX_SPECS {
            return Err(Malformed("too many specs"));
        }
        let b = &bytes[..bytes.len().min(MAX_ATTR_BYTES)];
        let mut at = ATTR_LEN;
        let mut specs = Vec::with_capacity(n_specs);
        for _ in 0..n_specs {
            if b.len() < at + 6 {
                return Err(Malformed("fewer specs than num_of_specs"));
            }
            let (ty, len) = (u32_at(b, at), usize::from(u16_at(b, at + 4)));
            let want = match ty {
                SPEC_ETH => 40,
                SPEC_IPV4 => 24,
                SPEC_IPV4_EXT => 32,
                SPEC_IPV6 => 88,
                SPEC_TCP | SPEC_UDP => 16,
                _ => return Err(Unsupported("spec type (tunnels, inner headers, actions)")),
            };
            if len != want {
                return Err(Malformed("spec size does not fit its type"));
            }
            if b.len() < at + len {
                return Err(Malformed("a spec beyond the attribute"));
            }
            let s = &b[at..at + len];
            specs.push(match ty {
                SPEC_ETH => Spec::Eth {
                    dst: Masked::new(s, 6, 22),
                    src: Masked::new(s, 12, 28),
                    ether_type: Masked::new(s, 18, 34),
                    vlan: Masked::new(s, 20, 36),
                },
                SPEC_IPV4 => Spec::Ipv4 {
                    src: Masked::new(s, 8, 16),
                    dst: Masked::new(s, 12, 20),
                    ext: None,
                },
                SPEC_IPV4_EXT => Spec::Ipv4 {
                    src: Masked::new(s, 8, 20),
                    dst: Masked::new(s, 12, 24),
                    ext: Some(Masked::new(s, 16, 28)),
                },
                SPEC_IPV6 => Spec::Ipv6 {
                    src: Masked::new(s, 8, 48),
                    dst: Masked::new(s, 24, 64),
                    flow_label: Masked::new(s, 40, 80),
                    ext: Masked::new(s, 44, 84),
                },
                _ => Spec::L4 {
                    protocol: if ty == SPEC_TCP { 6 } else { 17 },
                    dst_port: Masked::new(s, 6, 10),
                    src_port: Masked::new(s, 8, 12),
                },
            });
            at += len;
        }
        let rule = FlowRule {
            kind,
            priority,
            specs,
        };
        Ok((rule, at))
    }

    /// Whether every spec of the rule accepts `frame` (a whole Ethernet frame, no FCS).
    pub fn matches(&self, frame: &[u8]) -> bool {
        let Some(f) = Frame::parse(frame) else {
            return false;
        };
        self.specs.iter().all(|s| match s {
            Spec::Eth {
                dst,
                src,
                ether_type,
                vlan,
            } => {
                dst.accepts(&frame[0..6])
                    && src.accepts(&frame[6..12])
                    && ether_type.accepts(&f.ether_type)
                    && vlan.accepts(&f.vlan)
            }
            Spec::Ipv4 { src, dst, ext } => f.ipv4.is_some_and(|ip| {
                let h = &frame[ip..];
                src.accepts(&h[12..16])
                    && dst.accepts(&h[16..20])
                    && ext.is_none_or(|e| e.accepts(&[h[9], h[1], h[8], h[6] >> 5]))
            }),
            Spec::Ipv6 {
                src,
                dst,
                flow_label,
                ext,
            } => f.ipv6.is_some_and(|ip| {
                let h = &frame[ip..];
                let first = u32::from_be_bytes([h[0], h[1], h[2], h[3]]);
                let traffic_class = (first >> 20) as u8;
                src.accepts(&h[8..24])
                    && dst.accepts(&h[24..40])
                    && flow_label.accepts(&(first & 0xf_ffff).to_be_bytes())
                    && ext.accepts(&[h[6], traffic_class, h[7]])
            }),
            Spec::L4 {
                protocol,
                dst_port,
                src_port,
            } => f.l4(frame, *protocol).is_some_and(|l4| {
                src_port.accepts(&frame[l4..l4 + 2]) && dst_port.accepts(&frame[l4 + 2..l4 + 4])
            }),
        })
    }
}

/// Where the layers of a frame are.
struct Frame {
    ether_type: [u8; 2],
    /// The VLAN tag's TCI (0 when untagged).
    vlan: [u8; 2],
    /// Offset of a well-formed IPv4 header.
    ipv4: Option<usize>,
    /// Offset of an IPv6 header.
    ipv6: Option<usize>,
}

impl Frame {
    fn parse(frame: &[u8]) -> Option<Frame> {
        if frame.len() < 14 {
            return None;
        }
        let outer = [frame[12], frame[13]];
        let (ether_type, vlan, l3) = if outer == ETHERTYPE_VLAN {
            if frame.len() < 18 {
                return None;
            }
            ([frame[16], frame[17]], [frame[14], frame[15]], 18)
        } else {
            (outer, [0, 0], 14)
        };
        let ipv4 = (ether_type == ETHERTYPE_IPV4
            && frame.len() >= l3 + 20
            && frame[l3] >> 4 == 4
            && usize::from(frame[l3] & 0x0f) * 4 >= 20)
            .then_some(l3);
        let ipv6 = (ether_type == ETHERTYPE_IPV6
            && frame.len() >= l3 + IPV6_HEADER
            && frame[l3] >> 4 == 6)
            .then_some(l3);
        Some(Frame {
            ether_type,
            vlan,
            ipv4,
            ipv6,
        })
    }

    /// Offset of the TCP or UDP header (`protocol` 6 or 17), with room for both ports: right
    /// after the IPv4 header, or after an IPv6 header whose next header it is (extension
    /// headers are not walked).
    fn l4(&self, frame: &[u8], protocol: u8) -> Option<usize> {
        let l4 = match (self.ipv4, self.ipv6) {
            (Some(ip), _) if frame[ip + 9] == protocol => ip + usize::from(frame[ip] & 0x0f) * 4,
            (_, Some(ip)) if frame[ip + 6] == protocol => ip + IPV6_HEADER,
            _ => return None,
        };
        (frame.len() >= l4 + 4).then_some(l4)
    }
}

/// The destination MAC is a multicast or broadcast one (the group bit of its first byte).
pub fn is_multicast_frame(frame: &[u8]) -> bool {
    frame.first().is_some_and(|b| b & 1 == 1)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const SERVER_MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
    const CLIENT_MAC: [u8; 6] = [2, 0, 0, 0, 0, 2];
    const SERVER_IP: [u8; 4] = [10, 77, 0, 1];
    const CLIENT_IP: [u8; 4] = [10, 77, 0, 2];

    /// `struct ibv_flow_attr` followed by `specs`.
    fn attr(kind: u32, priority: u16, specs: &[Vec<u8>]) -> Vec<u8> {
        let size = ATTR_LEN + specs.iter().map(Vec::len).sum::<usize>();
        let mut b = vec![0u8; ATTR_LEN];
        b[4..8].copy_from_slice(&kind.to_le_bytes());
        b[8..10].copy_from_slice(&(size as u16).to_le_bytes());
        b[10..12].copy_from_slice(&priority.to_le_bytes());
        b[12] = specs.len() as u8;
        b[13] = 1;
        for s in specs {
            b.extend_from_slice(s);
        }
        b
    }

    fn header(ty: u32, size: usize) -> Vec<u8> {
        let mut s = vec![0u8; size];
        s[0..4].copy_from_slice(&ty.to_le_bytes());
        s[4..6].copy_from_slice(&(size as u16).to_le_bytes());
        s
    }

    /// An ETH spec on the destination MAC and, when given, the ether type.
    fn eth(dst: [u8; 6], ether_type: Option<[u8; 2]>) -> Vec<u8> {
        let mut s = header(SPEC_ETH, 40);
        s[6..12].copy_from_slice(&dst);
        s[22..28].fill(0xff);
        if let Some(t) = ether_type {
            s[18..20].copy_from_slice(&t);
            s[34..36].fill(0xff);
        }
        s
    }

    fn ipv4(src: [u8; 4], dst: [u8; 4]) -> Vec<u8> {
        let mut s = header(SPEC_IPV4, 24);
        s[8..12].copy_from_slice(&src);
        s[12..16].copy_from_slice(&dst);
        s[16..24].fill(0xff);
        s
    }

    fn ipv4_ext_proto(proto: u8) -> Vec<u8> {
        let mut s = header(SPEC_IPV4_EXT, 32);
        s[16] = proto;
        s[28] = 0xff;
        s
    }

    fn l4(udp: bool, dst_port: u16, src_port: u16) -> Vec<u8> {
        let mut s = header(if udp { SPEC_UDP } else { SPEC_TCP }, 16);
        s[6..8].copy_from_slice(&dst_port.to_be_bytes());
        s[8..10].copy_from_slice(&src_port.to_be_bytes());
        s[10..14].fill(0xff);
        s
    }

    /// Ethernet (optionally VLAN-tagged) + IPv4 + an 8-byte L4 header + payload.
    fn frame(
        dst: [u8; 6],
        vlan: Option<u16>,
        src_ip: [u8; 4],
        proto: u8,
        ports: (u16, u16),
    ) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&dst);
        f.extend_from_slice(&CLIENT_MAC);
        if let Some(tci) = vlan {
            f.extend_from_slice(&ETHERTYPE_VLAN);
            f.extend_from_slice(&tci.to_be_bytes());
        }
        f.extend_from_slice(&ETHERTYPE_IPV4);
        let mut ip = [0u8; 20];
        ip[0] = 0x45;
        ip[8] = 64;
        ip[9] = proto;
        ip[12..16].copy_from_slice(&src_ip);
        ip[16..20].copy_from_slice(&SERVER_IP);
        f.extend_from_slice(&ip);
        f.extend_from_slice(&ports.0.to_be_bytes());
        f.extend_from_slice(&ports.1.to_be_bytes());
        f.extend_from_slice(&[0u8; 4]);
        f.extend_from_slice(b"payload");
        f
    }

    /// An IPV6 spec on both addresses, the flow label and the next header.
    fn ipv6(src: [u8; 16], dst: [u8; 16], flow_label: u32, next: u8) -> Vec<u8> {
        let mut s = header(SPEC_IPV6, 88);
        s[8..24].copy_from_slice(&src);
        s[24..40].copy_from_slice(&dst);
        s[40..44].copy_from_slice(&flow_label.to_be_bytes());
        s[44] = next;
        s[48..84].fill(0xff);
        s[84] = 0xff;
        s
    }

    /// Ethernet + IPv6 (traffic class 0x2e, flow label 0x12345) + UDP ports + payload.
    fn frame6(src: [u8; 16], dst: [u8; 16], next: u8, ports: (u16, u16)) -> Vec<u8> {
        let mut f = Vec::new();
        f.extend_from_slice(&SERVER_MAC);
        f.extend_from_slice(&CLIENT_MAC);
        f.extend_from_slice(&ETHERTYPE_IPV6);
        let first: u32 = 6 << 28 | 0x2e << 20 | 0x12345;
        f.extend_from_slice(&first.to_be_bytes());
        f.extend_from_slice(&[0, 16, next, 64]);
        f.extend_from_slice(&src);
        f.extend_from_slice(&dst);
        f.extend_from_slice(&ports.0.to_be_bytes());
        f.extend_from_slice(&ports.1.to_be_bytes());
        f.extend_from_slice(&[0u8; 4]);
        f.extend_from_slice(b"payload");
        f
    }

    /// perftest's `--raw_ipv6` rule (ETH, IPV6 addresses, UDP ports), plus flow labels, the
    /// next header and TCP.
    #[test]
    fn ipv6_rules_match_addresses_flow_label_next_header_and_ports() {
        let (a, b) = ([0xfd; 16], [0xfe; 16]);
        let mut v6 = ipv6(a, b, 0, 0);
        v6[80..88].fill(0); // neither flow label nor next header nor class nor hop limit
        let perftest = FlowRule::parse(&attr(
            FLOW_ATTR_NORMAL,
            0,
            &[eth(SERVER_MAC, None), v6, l4(true, 5000, 5001)],
        ))
        .unwrap();
        let good = frame6(a, b, 17, (5001, 5000));
        assert!(perftest.matches(&good));
        assert!(!perftest.matches(&frame6(b, a, 17, (5001, 5000))));
        assert!(!perftest.matches(&frame6(a, b, 17, (5001, 5009))));
        assert!(
            !perftest.matches(&frame6(a, b, 6, (5001, 5000))),
            "UDP only"
        );
        let v4 = frame(SERVER_MAC, None, CLIENT_IP, 17, (5001, 5000));
        assert!(!perftest.matches(&v4), "not an IPv6 frame");
        let labelled = |label, next| {
            let mut s = ipv6(a, b, label, next);
            s[86..88].fill(0); // class and hop limit not checked
            FlowRule::parse(&attr(FLOW_ATTR_NORMAL, 0, &[s])).unwrap()
        };
        assert!(labelled(0x12345, 17).matches(&good));
        assert!(!labelled(0x12346, 17).matches(&good));
        assert!(!labelled(0x12345, 6).matches(&good));
        let tcp = FlowRule::parse(&attr(FLOW_ATTR_NORMAL, 0, &[l4(false, 5000, 5001)])).unwrap();
        assert!(tcp.matches(&frame6(a, b, 6, (5001, 5000))) && !tcp.matches(&good));
        // Cut inside the IPv6 header or before both ports: nothing.
        for n in 0..58 {
            assert!(!perftest.matches(&good[..n]), "{n}");
        }
        assert!(perftest.matches(&good[..58]));
    }

    /// The rule perftest's `raw_ethernet_bw --server` installs with -J, -j, -K and -k.
    fn perftest_rule() -> FlowRule {
        let b = attr(
            FLOW_ATTR_NORMAL,
            0,
            &[
                eth(SERVER_MAC, None),
                ipv4(CLIENT_IP, SERVER_IP),
                l4(true, 5000, 5001),
            ],
        );
        assert_eq!(b.len(), 20 + 40 + 24 + 16);
        FlowRule::parse(&b).unwrap()
    }

    #[test]
    fn perftests_rule_matches_its_frames_and_nothing_else() {
        let r = perftest_rule();
        assert_eq!((r.kind, r.priority), (FLOW_ATTR_NORMAL, 0));
        let good = frame(SERVER_MAC, None, CLIENT_IP, 17, (5001, 5000));
        assert!(r.matches(&good));
        assert!(r.matches(&frame(SERVER_MAC, Some(7), CLIENT_IP, 17, (5001, 5000))));
        assert!(!r.matches(&frame(CLIENT_MAC, None, CLIENT_IP, 17, (5001, 5000))));
        assert!(!r.matches(&frame(SERVER_MAC, None, [10, 77, 0, 3], 17, (5001, 5000))));
        assert!(!r.matches(&frame(SERVER_MAC, None, CLIENT_IP, 17, (5001, 5009))));
        assert!(!r.matches(&frame(SERVER_MAC, None, CLIENT_IP, 6, (5001, 5000))));
        let mut not_ip = good.clone();
        not_ip[12..14].copy_from_slice(&[0x86, 0xdd]);
        assert!(!r.matches(&not_ip));
        // A frame cut before both ports are there (14 + 20 + 4 bytes) matches nothing.
        for n in 0..38 {
            assert!(!r.matches(&good[..n]), "{n}");
        }
        assert!(r.matches(&good[..38]));
    }

    #[test]
    fn masked_out_fields_are_ignored_and_ext_specs_check_the_protocol() {
        let any_dst = FlowRule::parse(&attr(FLOW_ATTR_NORMAL, 3, &[eth([0; 6], None)])).unwrap();
        let mut spec = eth([0; 6], Some(ETHERTYPE_IPV4));
        spec[22..28].fill(0);
        let ipv4_only = FlowRule::parse(&attr(FLOW_ATTR_NORMAL, 0, &[spec])).unwrap();
        let tcp_only = FlowRule::parse(&attr(FLOW_ATTR_NORMAL, 0, &[ipv4_ext_proto(6)])).unwrap();
        let udp = frame(CLIENT_MAC, None, CLIENT_IP, 17, (1, 2));
        let tcp = frame(CLIENT_MAC, None, CLIENT_IP, 6, (1, 2));
        assert!(!any_dst.matches(&udp), "the MAC mask is all ones");
        assert!(ipv4_only.matches(&udp) && ipv4_only.matches(&tcp));
        assert!(tcp_only.matches(&tcp) && !tcp_only.matches(&udp));
        let everything = FlowRule::parse(&attr(FLOW_ATTR_NORMAL, 0, &[])).unwrap();
        assert!(everything.matches(&udp));
        let sniffer = FlowRule::parse(&attr(FLOW_ATTR_SNIFFER, 0, &[])).unwrap();
        assert_eq!(sniffer.kind, FLOW_ATTR_SNIFFER);
        assert!(is_multicast_frame(&[0x01, 0, 0x5e]) && !is_multicast_frame(&udp));
    }

    #[test]
    fn malformed_and_unsupported_rules_are_refused() {
        let good = attr(
            FLOW_ATTR_NORMAL,
            0,
            &[eth(SERVER_MAC, None), l4(true, 1, 2)],
        );
        assert!(FlowRule::parse(&good).is_ok());
        let bad = |f: &dyn Fn(&mut Vec<u8>)| {
            let mut b = good.clone();
            f(&mut b);
            FlowRule::parse(&b)
        };
        let malformed = |r: Result<FlowRule, FlowError>| {
            assert!(matches!(r, Err(FlowError::Malformed(_))), "{r:?}");
            assert_eq!(r.unwrap_err().errno(), libc::EINVAL);
        };
        malformed(bad(&|b| b.truncate(50)));
        malformed(bad(&|b| b[12] = 3));
        malformed(bad(&|b| b[13] = 0));
        malformed(bad(&|b| b[4] = 9));
        malformed(bad(&|b| b[24] = 39));
        malformed(bad(&|b| b[12] = 9));
        // One spec fewer than given: the second is not the rule's.
        let first = FlowRule::parse(&attr(FLOW_ATTR_NORMAL, 0, &[eth(SERVER_MAC, None)]));
        assert_eq!(bad(&|b| b[12] = 1), first);
        // comp_mask and size are not read, as libibverbs reads neither.
        for f in [
            &|b: &mut Vec<u8>| b[0] = 1,
            &|b: &mut Vec<u8>| b[8..10].copy_from_slice(&[0, 0]),
            &|b: &mut Vec<u8>| b[8..10].copy_from_slice(&2000u16.to_le_bytes()),
        ] as [&dyn Fn(&mut Vec<u8>); 3]
        {
            assert_eq!(bad(f), FlowRule::parse(&good));
        }
        malformed(FlowRule::parse(&good[..19]));
        for r in [
            bad(&|b| b[16] = 2),
            bad(&|b| b[20] = 0x50),
            bad(&|b| b[21] = 0x01),
            bad(&|b| b[20..24].copy_from_slice(&0x1000u32.to_le_bytes())),
        ] {
            assert!(matches!(r, Err(FlowError::Unsupported(_))), "{r:?}");
            assert_eq!(r.unwrap_err().errno(), libc::EOPNOTSUPP);
        }
        // Bytes after the last spec are not the rule's.
        let mut longer = good.clone();
        longer.extend_from_slice(&[0xAB; 30]);
        assert_eq!(FlowRule::parse(&longer), FlowRule::parse(&good));
    }

    proptest! {
        #[test]
        fn parsing_anything_never_panics(b in proptest::collection::vec(any::<u8>(), 0..200)) {
            let _ = FlowRule::parse(&b);
        }

        #[test]
        fn parsing_specs_after_a_valid_header_never_panics(
            tail in proptest::collection::vec(any::<u8>(), 0..120),
            n in 0u8..10,
        ) {
            let mut b = attr(FLOW_ATTR_NORMAL, 0, &[]);
            b[12] = n;
            b[8..10].copy_from_slice(&((ATTR_LEN + tail.len()) as u16).to_le_bytes());
            b.extend_from_slice(&tail);
            let _ = FlowRule::parse(&b);
        }

        #[test]
        fn matching_any_frame_never_panics(f in proptest::collection::vec(any::<u8>(), 0..100)) {
            let r = perftest_rule();
            let _ = r.matches(&f);
            let tcp = FlowRule::parse(&attr(FLOW_ATTR_NORMAL, 0, &[ipv4_ext_proto(6), l4(false, 1, 2)])).unwrap();
            let _ = tcp.matches(&f);
        }
    }
}
