//! Where an app's bytes go, measured: the live problem's facility coefficients
//! (docs/live-problem.md, "Facilities: receive links"). The shims count, per connected QP,
//! the bytes posted towards the peer (SEND, WRITE, atomics) and the bytes asked back
//! (RDMA READ lengths, whose data flows from the responder to the requester, so onto this
//! host's own receive link). This turns those cumulative counters into smoothed byte rates
//! per destination and publishes each app's shares of them — only when one moved by more
//! than [`SHARE_NOISE`], so that the optimiser's input does not jump every round. Pure: the
//! caller passes the time.

use std::collections::BTreeMap;

pub type Gid = [u8; 16];

/// Where bytes land.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Dest {
    /// This host's own receive link (the data of the app's RDMA READs).
    Own,
    /// The receive link of the host that owns this GID.
    Peer(Gid),
}

/// Cumulative bytes of one app over its connections to one peer.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct PeerBytes {
    /// Posted towards the peer (its link carries them).
    pub out: u64,
    /// Read from the peer (this host's link carries them).
    pub back: u64,
}

/// Rates are measured over at least this long (s): shorter intervals are mostly noise.
pub const MIN_INTERVAL_S: f64 = 0.2;
/// Weight of the newest interval in the smoothed rate.
pub const SMOOTHING: f64 = 0.5;
/// A share moves the published ones only by more than this (the agent core treats 5 % as
/// noise too, `inputs_moved`).
pub const SHARE_NOISE: f64 = 0.05;
/// Destinations whose smoothed rate fell below this fraction of the app's are dropped.
const NEGLIGIBLE: f64 = 1e-4;

#[derive(Default)]
struct AppTraffic {
    last: BTreeMap<Gid, PeerBytes>,
    at: Option<f64>,
    rate: BTreeMap<Dest, f64>,
    /// Published shares, summing to 1; empty until the app has sent anything.
    shares: Vec<(Dest, f64)>,
}

/// Per app: smoothed byte rates per destination and the published shares.
#[derive(Default)]
pub struct TrafficShares {
    apps: BTreeMap<String, AppTraffic>,
}

impl TrafficShares {
    /// Takes `app`'s cumulative counters per peer at time `now_s` (seconds, any origin).
    /// Counters that went backwards (a process left) count as no traffic for the interval.
    pub fn observe(&mut self, app: &str, counters: &BTreeMap<Gid, PeerBytes>, now_s: f64) {
        let t = self.apps.entry(app.to_string()).or_default();
        let Some(at) = t.at else {
            t.last = counters.clone();
            t.at = Some(now_s);
            return;
        };
        let dt = now_s - at;
        if dt < MIN_INTERVAL_S {
            return;
        }
        let mut fresh: BTreeMap<Dest, f64> = BTreeMap::new();
        for (gid, c) in counters {
            let before = t.last.get(gid).copied().unwrap_or_default();
            let out = c.out.saturating_sub(before.out) as f64 / dt;
            let back = c.back.saturating_sub(before.back) as f64 / dt;
            *fresh.entry(Dest::Peer(*gid)).or_default() += out;
            *fresh.entry(Dest::Own).or_default() += back;
        }
        t.last = counters.clone();
        t.at = Some(now_s);
        for d in fresh
            .keys()
            .chain(t.rate.keys())
            .copied()
            .collect::<Vec<_>>()
        {
            let new = fresh.get(&d).copied().unwrap_or(0.0);
            let r = t.rate.entry(d).or_insert(0.0);
            *r = (1.0 - SMOOTHING) * *r + SMOOTHING * new;
        }
        let total: f64 = t.rate.values().sum();
        if total <= 0.0 {
            // Nothing sent yet, or not since long enough to say: the published shares stay.
            t.rate.clear();
            return;
        }
        t.rate.retain(|_, r| *r > NEGLIGIBLE * total);
        let total: f64 = t.rate.values().sum();
        let candidate: Vec<(Dest, f64)> = t.rate.iter().map(|(d, r)| (*d, r / total)).collect();
        if moved(&t.shares, &candidate) {
            t.shares = candidate;
        }
    }

    /// `app`'s published shares per destination (summing to 1), `None` until it has sent.
    pub fn shares(&self, app: &str) -> Option<&[(Dest, f64)]> {
        self.apps
            .get(app)
            .map(|t| t.shares.as_slice())
            .filter(|s| !s.is_empty())
    }

    /// Forgets the apps `keep` rejects (their last process left).
    pub fn retain(&mut self, keep: impl Fn(&str) -> bool) {
        self.apps.retain(|a, _| keep(a));
    }
}

/// Whether `new` differs materially from `old`: a destination's share moved by more than
/// [`SHARE_NOISE`] (one that appears or vanishes counts from 0).
fn moved(old: &[(Dest, f64)], new: &[(Dest, f64)]) -> bool {
    if old.is_empty() {
        return true;
    }
    let share = |v: &[(Dest, f64)], d: Dest| v.iter().find(|x| x.0 == d).map_or(0.0, |x| x.1);
    old.iter()
        .chain(new)
        .any(|&(d, _)| (share(old, d) - share(new, d)).abs() > SHARE_NOISE)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gid(h: u8) -> Gid {
        [h; 16]
    }

    fn counters(v: &[(u8, u64, u64)]) -> BTreeMap<Gid, PeerBytes> {
        v.iter()
            .map(|&(h, out, back)| (gid(h), PeerBytes { out, back }))
            .collect()
    }

    fn share(s: &TrafficShares, app: &str, d: Dest) -> f64 {
        s.shares(app)
            .unwrap()
            .iter()
            .find(|x| x.0 == d)
            .map_or(0.0, |x| x.1)
    }

    #[test]
    fn shares_follow_bytes_and_reads_load_the_own_link() {
        let mut s = TrafficShares::default();
        s.observe("w", &counters(&[(1, 0, 0), (2, 0, 0)]), 0.0);
        assert!(s.shares("w").is_none(), "a baseline says nothing");
        s.observe("w", &counters(&[(1, 0, 0), (2, 0, 0)]), 1.0);
        assert!(s.shares("w").is_none(), "nothing sent: no shares");
        // 3× more to host 1 than to host 2.
        s.observe("w", &counters(&[(1, 3000, 0), (2, 1000, 0)]), 2.0);
        assert!((share(&s, "w", Dest::Peer(gid(1))) - 0.75).abs() < 1e-12);
        assert!((share(&s, "w", Dest::Peer(gid(2))) - 0.25).abs() < 1e-12);
        // A reader: its READ data lands on its own link, not the responder's.
        s.observe("r", &counters(&[(1, 0, 0)]), 0.0);
        s.observe("r", &counters(&[(1, 0, 5000)]), 1.0);
        assert_eq!(s.shares("r").unwrap(), &[(Dest::Own, 1.0)]);
        s.retain(|a| a == "r");
        assert!(s.shares("w").is_none());
    }

    #[test]
    fn noise_does_not_move_the_shares_but_a_real_change_does() {
        let mut s = TrafficShares::default();
        let (mut a, mut b) = (0u64, 0u64);
        s.observe("w", &counters(&[(1, a, 0), (2, b, 0)]), 0.0);
        let mut t = 0.0;
        let mut step = |s: &mut TrafficShares, da: u64, db: u64| {
            (a, b, t) = (a + da, b + db, t + 0.25);
            s.observe("w", &counters(&[(1, a, 0), (2, b, 0)]), t);
        };
        step(&mut s, 500, 500);
        let first = s.shares("w").unwrap().to_vec();
        // ±8 % per interval around an even split, smoothed: below the noise threshold.
        for i in 0..40 {
            let j = if i % 2 == 0 { 40 } else { -40 };
            step(&mut s, (500 + j) as u64, (500 - j) as u64);
            assert_eq!(s.shares("w").unwrap(), first.as_slice(), "interval {i}");
        }
        // The app turns to host 1: the shares follow within a few intervals.
        for _ in 0..10 {
            step(&mut s, 900, 100);
        }
        assert!((share(&s, "w", Dest::Peer(gid(1))) - 0.9).abs() <= SHARE_NOISE);
        // An interval shorter than the minimum is skipped.
        let before = s.shares("w").unwrap().to_vec();
        s.observe("w", &counters(&[(1, 0, 0), (2, 0, 0)]), t + 0.01);
        assert_eq!(s.shares("w").unwrap(), before.as_slice());
    }
}
