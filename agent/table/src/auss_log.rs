//! The `auss_log` lines of `softrnic stats`: when each NIC saw `N` change, and when it
//! started and stopped sending data to a destination, in CLOCK_MONOTONIC ns (the clock of
//! [`crate::nic_auss::monotonic_ns`], every engine's on one machine). softrnic writes them
//! (its `auss::timeline`); the testbed reads them to time the count's arrival at the
//! senders as Dart does. One line per event: `auss_log KIND T_NS PEER N`, `-` for no peer.
//!
//! - `count`: this host as receiver; its `N` became `n`;
//! - `cap`: as sender; the newest stamp of destination `peer` says `N` = `n`;
//! - `start` / `stop`: as sender; its first data packet to `peer` after a silence, and its
//!   last one before a silence (`n` 0).

use std::net::Ipv4Addr;

/// Events a NIC keeps of each class (counts, caps, spells): the newest. A class holding this
/// many may have lost older ones.
pub const KEPT: usize = 512;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Count,
    Cap,
    Start,
    Stop,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Event {
    pub kind: Kind,
    pub t_ns: u64,
    pub peer: Option<Ipv4Addr>,
    pub n: u32,
}

impl Event {
    /// Its line, newline included.
    pub fn line(&self) -> String {
        let kind = match self.kind {
            Kind::Count => "count",
            Kind::Cap => "cap",
            Kind::Start => "start",
            Kind::Stop => "stop",
        };
        let peer = self.peer.map_or("-".to_string(), |p| p.to_string());
        format!("auss_log {kind} {} {peer} {}\n", self.t_ns, self.n)
    }
}

/// Parses the `auss_log` lines of a stats text (other lines are skipped).
pub fn parse(stats: &str) -> Vec<Event> {
    stats
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            let [tag, kind, t, peer, n] = f[..] else {
                return None;
            };
            if tag != "auss_log" {
                return None;
            }
            Some(Event {
                kind: match kind {
                    "count" => Kind::Count,
                    "cap" => Kind::Cap,
                    "start" => Kind::Start,
                    "stop" => Kind::Stop,
                    _ => return None,
                },
                t_ns: t.parse().ok()?,
                peer: if peer == "-" {
                    None
                } else {
                    Some(peer.parse().ok()?)
                },
                n: n.parse().ok()?,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lines_read_back_and_other_lines_are_skipped() {
        let events = [
            Event {
                kind: Kind::Count,
                t_ns: 5,
                peer: None,
                n: 2,
            },
            Event {
                kind: Kind::Cap,
                t_ns: 7,
                peer: Some(Ipv4Addr::new(10, 77, 0, 1)),
                n: 2,
            },
            Event {
                kind: Kind::Start,
                t_ns: 9,
                peer: Some(Ipv4Addr::new(10, 77, 0, 1)),
                n: 0,
            },
            Event {
                kind: Kind::Stop,
                t_ns: 11,
                peer: Some(Ipv4Addr::new(10, 77, 0, 1)),
                n: 0,
            },
        ];
        let text: String = events.iter().map(Event::line).collect();
        let noisy = format!("rx_packets 5\n{text}auss_log bogus 1 - 2\nauss_log cap x - 1\n");
        assert_eq!(parse(&noisy), events);
    }
}
