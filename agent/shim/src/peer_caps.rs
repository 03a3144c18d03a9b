//! The per-receiver caps (DASR, docs/dasr.md) and where each comes from. A destination whose
//! NIC stamps its active unique senders into ACKs (softrnic with `--auss-expiry-ms`) is capped
//! at `R/N` from the NIC's table (`drum_table::nic_auss`), whose slot for it every admission
//! reads (`cap_route`, without a lock; here when it changed), so a new `N` is in force at the
//! next post after its ACK arrived — no agent round trip. Any other
//! destination keeps the cap the agents' UDP channel put in the agent's table. The NIC's word
//! wins where it has one: it is newer by the agents' round trip, and it is the same count.
//! docs/shim.md, "Caps from the NIC".
//!
//! No threads, clocks or system calls: time is passed in, and the NIC's table is shared
//! memory read with a bounded seqlock read.

use crate::pacer::Gcra;
use drum_table::nic_auss::Reader;
use std::net::Ipv4Addr;
use std::sync::Arc;

/// How long a destination the NIC's table does not list is not looked for again: it gets its
/// slot with its first stamped ACK, so this bounds the time its cap comes late, and the cost
/// of looking (a scan of the table's used slots) per post.
pub const LOOK_AGAIN_PS: u64 = 50_000_000;

/// The burst a NIC cap allows: two 64 KiB messages (Dart's long message). The agents' caps
/// keep the limiter's default of 5 ms at the rate; a cap meant to act within round trips must
/// not let a sender run at line rate for milliseconds after it is told to share. Two, not
/// one: the NIC paces the QP at the cap (`nic_pace::cap_kbps`), and the shim's limiter must
/// run a message ahead of it so that the NIC's send queue is never empty between messages.
pub const NIC_CAP_BURST: u64 = 2 * 64 * 1024;

/// What the NIC's table said of a destination when its cap was last settled: what a QP that
/// keeps the cap (`cap_route::Route`) watches to know that it must be settled again.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FromNic {
    /// Not listed (no stamped ACK from it yet): look again from this instant (ps).
    Unlisted { look_at: u64 },
    /// Listed in `slot`; the stamp (incarnation, epoch) last applied and its `N`.
    Listed {
        slot: usize,
        stamp: (u64, u64),
        n: u32,
    },
}

/// A destination's cap as [`PeerCaps::read`] settled it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Settled {
    /// The limiter in force (None: not capped).
    pub gcra: Option<Gcra>,
    /// What the NIC's table said of it; None while no table is read.
    pub nic: Option<FromNic>,
    /// The limiter changed at this read: what becomes of the destination's TAT.
    pub carry: Option<Carry>,
}

/// A change of limiter at `at` (ps), which carries the debt over: what was sent at the old
/// rate is owed at the new one, so a cut takes effect at once and a raise does not forgive
/// what was sent.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Carry {
    from: Option<Gcra>,
    to: Gcra,
    at: u64,
}

impl Carry {
    /// The destination's TAT under the new limiter, from its TAT under the old.
    pub fn tat(&self, tat: u64) -> u64 {
        self.to.carry_over(self.from, tat, self.at)
    }
}

struct Peer {
    gid: [u8; 16],
    /// The agent's cap (bytes/s), if it gave one.
    agent: Option<u64>,
    nic: FromNic,
    /// The limiter in force.
    gcra: Option<Gcra>,
}

/// Counters of the NIC's caps, for the summary.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct NicCapCounts {
    /// Destinations found in the NIC's table.
    pub listed: u64,
    /// Stamps applied (a new `N` or a new epoch).
    pub stamps: u64,
    /// Of those, the ones that changed the cap in force.
    pub changes: u64,
}

/// Every destination's cap, and the NIC's table when the device has one. The destinations'
/// TATs are not here: the posting threads advance them without a lock (`cap_route`).
pub struct PeerCaps {
    peers: Vec<Peer>,
    nic: Option<Arc<Reader>>,
    pub counts: NicCapCounts,
}

impl PeerCaps {
    pub const fn new() -> PeerCaps {
        PeerCaps {
            peers: Vec::new(),
            nic: None,
            counts: NicCapCounts {
                listed: 0,
                stamps: 0,
                changes: 0,
            },
        }
    }

    /// Replaces the agent's caps (`(gid, bytes/s)`; empty: none). The TATs are kept as they
    /// are: the agent's caps change once per agent round, not at a post.
    pub fn set_agent(&mut self, caps: &[([u8; 16], u64)]) {
        for p in &mut self.peers {
            p.agent = None;
        }
        for &(gid, rate) in caps {
            let i = self.find(gid).unwrap_or_else(|| self.add(gid));
            self.peers[i].agent = Some(rate);
        }
        for i in 0..self.peers.len() {
            self.settle(i, None);
        }
        self.forget_idle();
    }

    /// The NIC's table found, replaced by a new engine's, or gone (None): what it said is
    /// forgotten, and destinations are looked up again at the next post.
    pub fn set_nic(&mut self, table: Option<Reader>) {
        self.nic = table.map(Arc::new);
        for p in &mut self.peers {
            p.nic = FromNic::Unlisted { look_at: 0 };
        }
        for i in 0..self.peers.len() {
            self.settle(i, None);
        }
        self.forget_idle();
    }

    /// The NIC's table read now (shared with the routes that read it without a lock).
    pub fn table(&self) -> Option<&Arc<Reader>> {
        self.nic.as_ref()
    }

    /// The inode of the NIC's table mapped (to notice a new engine).
    pub fn nic_inode(&self) -> Option<u64> {
        self.nic.as_deref().map(Reader::inode)
    }

    /// Some destination is capped now.
    pub fn any_in_force(&self) -> bool {
        self.peers.iter().any(|p| p.gcra.is_some())
    }

    /// The agent's caps, or the NIC's table, are there to consult.
    pub fn consulted(&self) -> bool {
        self.nic.is_some() || self.peers.iter().any(|p| p.agent.is_some())
    }

    /// Whether destination `gid` has a cap or is watched.
    pub fn knows(&self, gid: [u8; 16]) -> bool {
        self.find(gid).is_some()
    }

    /// Destination `gid` at `now` (ps), after reading the NIC's word on it; None when
    /// nothing may cap it.
    pub fn read(&mut self, gid: [u8; 16], now: u64) -> Option<Settled> {
        let watch = self.nic.is_some() && ipv4_of(&gid).is_some();
        let i = self.find(gid).or_else(|| watch.then(|| self.add(gid)))?;
        let carry = self.read_nic(i, now);
        let p = &self.peers[i];
        Some(Settled {
            gcra: p.gcra,
            nic: self.nic.is_some().then_some(p.nic),
            carry,
        })
    }

    /// The rate (bytes/s) of the cap in force towards `gid`, as last read.
    pub fn rate_of(&self, gid: [u8; 16]) -> Option<u64> {
        let p = &self.peers[self.find(gid)?];
        p.gcra.map(|g| 1_000_000_000_000 / g.interval_ps().max(1))
    }

    fn find(&self, gid: [u8; 16]) -> Option<usize> {
        self.peers.iter().position(|p| p.gid == gid)
    }

    /// A new destination, neither capped nor looked up yet.
    fn add(&mut self, gid: [u8; 16]) -> usize {
        self.peers.push(Peer {
            gid,
            agent: None,
            nic: FromNic::Unlisted { look_at: 0 },
            gcra: None,
        });
        self.peers.len() - 1
    }

    /// Refreshes destination `i` from the NIC's table; the carry-over when its cap changed.
    fn read_nic(&mut self, i: usize, now: u64) -> Option<Carry> {
        let t = self.nic.as_deref()?;
        let p = &self.peers[i];
        let ip = ipv4_of(&p.gid)?;
        let entry = match p.nic {
            FromNic::Listed { slot, .. } => t.slot(slot).map(|e| (slot, e)),
            FromNic::Unlisted { look_at } if now >= look_at => {
                let found = t.find(ip);
                if found.is_some() {
                    self.counts.listed += 1;
                }
                found
            }
            FromNic::Unlisted { .. } => return None,
        };
        let p = &mut self.peers[i];
        let Some((slot, e)) = entry else {
            // Not listed yet; a listed slot mid-update keeps what it said.
            if let FromNic::Unlisted { .. } = p.nic {
                p.nic = FromNic::Unlisted {
                    look_at: now + LOOK_AGAIN_PS,
                };
            }
            return None;
        };
        let stamp = (e.incarnation, e.epoch);
        if matches!(p.nic, FromNic::Listed { stamp: s, .. } if s == stamp) {
            return None;
        }
        p.nic = FromNic::Listed {
            slot,
            stamp,
            n: e.n,
        };
        self.counts.stamps += 1;
        let before = self.peers[i].gcra;
        let carry = self.settle(i, Some(now));
        if self.peers[i].gcra != before {
            self.counts.changes += 1;
        }
        carry
    }

    /// Puts destination `i`'s cap in force; `at`: the instant a change of rate carries the
    /// debt over from (None: its TAT is kept as it is).
    fn settle(&mut self, i: usize, at: Option<u64>) -> Option<Carry> {
        let rate = self.nic_rate(i);
        let p = &mut self.peers[i];
        let (rate, burst) = match (p.nic, rate) {
            (FromNic::Listed { .. }, r) => (r, NIC_CAP_BURST),
            (FromNic::Unlisted { .. }, _) => {
                let r = p.agent;
                (r, r.map_or(0, |r| Gcra::default_burst(r as f64)))
            }
        };
        let new = rate.and_then(|r| Gcra::new(r as f64, burst));
        if new == p.gcra {
            return None;
        }
        let from = std::mem::replace(&mut p.gcra, new);
        Some(Carry {
            from,
            to: new?,
            at: at?,
        })
    }

    /// `R/N` for a listed destination with at least two senders; None otherwise (a sender
    /// alone at a receiver is not capped by it).
    fn nic_rate(&self, i: usize) -> Option<u64> {
        let r = self.nic.as_deref().map_or(0, Reader::rate);
        match self.peers[i].nic {
            FromNic::Listed { n, .. } => share(r, n),
            FromNic::Unlisted { .. } => None,
        }
    }

    /// Drops destinations nothing caps or watches any more.
    fn forget_idle(&mut self) {
        let watching = self.nic.is_some();
        self.peers.retain(|p| watching || p.agent.is_some());
    }
}

/// The part of a receiver's line rate its senders' caps add up to. Caps that fill the line
/// exactly leave a standing queue at the receiver with any jitter (ECN marks, then DCQCN's
/// cuts on top of the caps: measured, two senders at exactly R/2 got 40–43 MB/s of 62);
/// HPCC's target utilisation (η = 95 %) leaves room the same way.
pub const UTILISATION: f64 = 0.97;

/// A sender's share of a receiver of rate `r` with `n` active senders: `UTILISATION · r/n`
/// for `n ≥ 2`; None (no cap) for one sender or none, or a rate the NIC did not give.
pub fn share(r: u64, n: u32) -> Option<u64> {
    (n >= 2 && r > 0).then(|| (r as f64 * UTILISATION) as u64 / u64::from(n))
}

/// The IPv4 address of an IPv4-mapped GID (RoCE v2, softrnic), None for any other.
pub fn ipv4_of(gid: &[u8; 16]) -> Option<Ipv4Addr> {
    (gid[..10].iter().all(|b| *b == 0) && gid[10..12] == [0xff, 0xff])
        .then(|| Ipv4Addr::new(gid[12], gid[13], gid[14], gid[15]))
}

/// What the tests of this module and of `cap_route` build their caps from.
#[cfg(test)]
pub(crate) mod fixtures {
    use drum_table::nic_auss::Writer;

    /// A receiver's line rate, bytes/s (1 Gb/s).
    pub const R: u64 = 125_000_000;

    /// The IPv4-mapped GID of `ip`.
    pub fn gid(ip: [u8; 4]) -> [u8; 16] {
        let mut g = [0u8; 16];
        g[10] = 0xff;
        g[11] = 0xff;
        g[12..].copy_from_slice(&ip);
        g
    }

    /// A NIC's AUSS table at `<dir>/auss` for a test called `name` (unique in the crate),
    /// and the directory to remove.
    pub fn table(name: &str) -> (std::path::PathBuf, Writer) {
        let dir = std::env::temp_dir().join(format!("drum-caps-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let w = Writer::create(&dir.join("auss"), R).unwrap();
        (dir, w)
    }
}

#[cfg(test)]
mod tests {
    use super::fixtures::{gid, table, R};
    use super::*;

    fn interval(c: &mut PeerCaps, g: [u8; 16], now: u64) -> Option<u64> {
        c.read(g, now)?.gcra.map(|g| g.interval_ps())
    }

    #[test]
    fn shares_and_mapped_gids() {
        assert_eq!(share(R, 0), None);
        assert_eq!(share(R, 1), None);
        assert_eq!(share(R, 2), Some((R as f64 * UTILISATION) as u64 / 2));
        assert_eq!(share(0, 4), None);
        assert_eq!(
            ipv4_of(&gid([10, 0, 0, 7])),
            Some(Ipv4Addr::new(10, 0, 0, 7))
        );
        let mut ib = gid([10, 0, 0, 7]);
        ib[0] = 0xfe;
        assert_eq!(ipv4_of(&ib), None);
    }

    /// The NIC's `N` is in force at the first admission after it was published, halves and
    /// restores the cap, and wins over the agent's cap for the destinations it lists.
    #[test]
    fn a_new_n_in_the_nic_table_is_in_force_at_the_next_admission() {
        let (dir, mut w) = table("n");
        let (d1, d2) = ([10, 0, 0, 1], [10, 0, 0, 2]);
        let mut c = PeerCaps::new();
        c.set_agent(&[(gid(d2), R / 10)]);
        assert_eq!(
            interval(&mut c, gid(d1), 0),
            None,
            "no NIC: only the agent's"
        );
        assert_eq!(interval(&mut c, gid(d2), 0), Some(80_000));
        c.set_nic(Some(
            drum_table::nic_auss::Reader::open(&dir.join("auss")).unwrap(),
        ));
        assert!(c.nic_inode().is_some());
        // Unlisted: the agent's cap stays; d1 is looked for once per LOOK_AGAIN_PS.
        assert_eq!(interval(&mut c, gid(d1), 1), None);
        assert_eq!(interval(&mut c, gid(d2), 1), Some(80_000));
        w.publish(d1.into(), 2, 1, 9);
        assert_eq!(interval(&mut c, gid(d1), 2), None, "not looked for yet");
        let t = 1 + LOOK_AGAIN_PS;
        let half = 1e12 / (R as f64 * UTILISATION / 2.0);
        assert_eq!(
            interval(&mut c, gid(d1), t),
            Some(half.round() as u64),
            "R/2"
        );
        assert_eq!(c.counts.listed, 1);
        // Listed: every admission reads the slot.
        w.publish(d1.into(), 4, 2, 9);
        let quarter = 1e12 / ((R as f64 * UTILISATION) as u64 / 4) as f64;
        assert_eq!(
            interval(&mut c, gid(d1), t + 1),
            Some(quarter.round() as u64),
            "R/4"
        );
        w.publish(d1.into(), 1, 3, 9);
        assert_eq!(interval(&mut c, gid(d1), t + 2), None, "alone: no cap");
        assert_eq!((c.counts.stamps, c.counts.changes), (3, 3));
        // The NIC lists d2 with one sender: its word (no cap) wins over the agent's.
        w.publish(d2.into(), 1, 1, 9);
        assert_eq!(interval(&mut c, gid(d2), t + LOOK_AGAIN_PS * 2), None);
        // The table gone (engine stopped): back to the agent's caps.
        c.set_nic(None);
        assert_eq!(interval(&mut c, gid(d2), 0), Some(80_000));
        assert_eq!(interval(&mut c, gid(d1), 0), None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A cut carries the debt over: what was sent at the old rate is owed at the new one.
    #[test]
    fn a_cut_carries_the_debt_over() {
        let (dir, mut w) = table("cut");
        let d = [10, 0, 0, 3];
        let mut c = PeerCaps::new();
        c.set_nic(Some(
            drum_table::nic_auss::Reader::open(&dir.join("auss")).unwrap(),
        ));
        w.publish(d.into(), 2, 1, 9);
        let half = c.read(gid(d), 0).unwrap();
        let g = half.gcra.unwrap();
        let owed_at_half = g.advance(0, 0, 1 << 20);
        w.publish(d.into(), 4, 2, 9);
        let quarter = c.read(gid(d), 0).unwrap();
        assert_eq!(quarter.gcra.unwrap().interval_ps(), 2 * g.interval_ps());
        assert_eq!(
            quarter.carry.unwrap().tat(owed_at_half),
            2 * owed_at_half,
            "the debt at a quarter takes twice as long"
        );
        // The same stamp read again changes nothing, so nothing is carried twice.
        assert_eq!(c.read(gid(d), 1).unwrap().carry, None);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn without_the_nic_only_agent_caps_are_kept() {
        let mut c = PeerCaps::new();
        assert!(!c.consulted());
        c.set_agent(&[(gid([10, 0, 0, 1]), R)]);
        assert!(c.consulted() && c.any_in_force());
        c.set_agent(&[]);
        assert!(!c.consulted() && !c.any_in_force());
        assert_eq!(interval(&mut c, gid([10, 0, 0, 1]), 0), None);
    }

    /// The agent's caps change between posts: the TAT is kept as it is (no carry-over), and
    /// without the NIC's table there is nothing of the NIC's to watch.
    #[test]
    fn agent_caps_carry_nothing_and_watch_no_table() {
        let g1 = gid([10, 0, 0, 1]);
        let mut c = PeerCaps::new();
        c.set_agent(&[(g1, R)]);
        let s = c.read(g1, 5).unwrap();
        assert_eq!((s.nic, s.carry), (None, None));
        assert!(c.knows(g1) && !c.knows(gid([10, 0, 0, 2])));
        c.set_agent(&[(g1, R / 2)]);
        let s = c.read(g1, 6).unwrap();
        assert_eq!(
            s.gcra,
            Gcra::new((R / 2) as f64, Gcra::default_burst((R / 2) as f64))
        );
        assert_eq!(s.carry, None);
    }
}
