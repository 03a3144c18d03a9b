//! The host's GIDs for the live problem: connections to any of them land on this host's
//! receive link. RoCE v2 (and softrnic) derive a port's GIDs from its interfaces' IP addresses
//! (IPv4-mapped), so those are the default.

use anyhow::{bail, Result};
use drum_common::live::Gid;
use drum_table::message::gid_of_ipv4;
use std::net::Ipv4Addr;

/// A GID from an IPv4 address (`10.0.0.1`) or 32 hex digits.
pub fn parse(s: &str) -> Result<Gid> {
    if let Ok(ip) = s.parse::<Ipv4Addr>() {
        return Ok(gid_of_ipv4(ip));
    }
    if s.len() != 32 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        bail!("{s:?} is neither an IPv4 address nor 32 hex digits");
    }
    let mut g = [0u8; 16];
    for (i, b) in g.iter_mut().enumerate() {
        *b = u8::from_str_radix(&s[2 * i..2 * i + 2], 16)?;
    }
    Ok(g)
}

/// The IPv4-mapped GIDs of every IPv4 address of the host's interfaces, loopback included
/// (softrnic's single-namespace mode runs its hosts on 127.0.0.x).
pub fn local_ipv4_gids() -> Result<Vec<Gid>> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list that freeifaddrs releases below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Err(std::io::Error::last_os_error().into());
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: `cur` is a node of the list getifaddrs returned, not yet freed.
        let ifa = unsafe { &*cur };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: a non-null ifa_addr points to a sockaddr whose family says its type.
            let family = unsafe { (*ifa.ifa_addr).sa_family };
            if family as i32 == libc::AF_INET {
                // SAFETY: AF_INET addresses are sockaddr_in.
                let sin = unsafe { &*(ifa.ifa_addr as *const libc::sockaddr_in) };
                let ip = Ipv4Addr::from(u32::from_be(sin.sin_addr.s_addr));
                let gid = gid_of_ipv4(ip);
                if !out.contains(&gid) {
                    out.push(gid);
                }
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: `head` came from getifaddrs and is freed once.
    unsafe { libc::freeifaddrs(head) };
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gids_parse_from_addresses_and_hex_and_loopback_is_local() {
        let g = parse("10.0.0.1").unwrap();
        assert_eq!(&g[10..], &[0xff, 0xff, 10, 0, 0, 1]);
        assert_eq!(parse("0000000000000000000000000a000001").unwrap()[15], 1);
        assert!(parse("fe80::1").is_err());
        assert!(parse("12").is_err());
        let local = local_ipv4_gids().unwrap();
        assert!(local.contains(&gid_of_ipv4(Ipv4Addr::LOCALHOST)));
    }
}
