//! Each QP's way to its destination's cap (DASR) on the post path, so that posting threads do
//! not serialise on the caps' lock. A QP's destination is fixed once it is connected, so the
//! QP keeps what [`PeerCaps`] settled for it (a [`Route`], under the QP's own lock): the
//! limiter, the destination's theoretical arrival time (one atomic shared by every QP towards
//! it, advanced with compare-and-swap like the app's byte limiter) and which slot of the
//! NIC's table to watch. A post reads that slot (a bounded seqlock read, no lock) and takes
//! the caps' lock only when something the route rests on changed: a new stamp in the slot,
//! an unlisted destination due to be looked for again, or the agent's caps or the NIC's table
//! replaced ([`Caps::generation`]). docs/shim.md, "Caps from the NIC".

use crate::pacer::Gcra;
use crate::peer_caps::{FromNic, PeerCaps};
use drum_table::nic_auss::Reader;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::Arc;

/// Every destination's cap and each one's TAT (under `limits::CAPS`).
pub struct Caps {
    pub peers: PeerCaps,
    tats: Vec<([u8; 16], Arc<AtomicU64>)>,
    /// Bumped whenever the agent's caps or the NIC's table are replaced: every route is
    /// settled again at its next post. Starts at 1 (a route of generation 0 was never
    /// settled).
    pub generation: u64,
}

impl Caps {
    pub const fn new() -> Caps {
        Caps {
            peers: PeerCaps::new(),
            tats: Vec::new(),
            generation: 1,
        }
    }

    /// Replaces the agent's caps (`(gid, bytes/s)`; empty: none).
    pub fn set_agent(&mut self, caps: &[([u8; 16], u64)]) {
        self.peers.set_agent(caps);
        self.replaced();
    }

    /// The NIC's table found, replaced, or gone (None).
    pub fn set_nic(&mut self, table: Option<Reader>) {
        self.peers.set_nic(table);
        self.replaced();
    }

    fn replaced(&mut self) {
        self.generation += 1;
        let peers = &self.peers;
        self.tats.retain(|(gid, _)| peers.knows(*gid));
    }

    /// Settles destination `gid`'s cap at `now` and the route a QP keeps to it; true when
    /// its cap changed. The caller replaces its route after releasing the caps' lock (the
    /// old one may hold the last reference to an old table, whose unmapping is a system
    /// call).
    pub fn route(&mut self, gid: [u8; 16], now: u64) -> (Route, bool) {
        let changes = self.peers.counts.changes;
        let Some(s) = self.peers.read(gid, now) else {
            return (
                Route {
                    gid,
                    generation: self.generation,
                    ..Route::default()
                },
                false,
            );
        };
        let tat = match self.tats.iter().find(|(g, _)| *g == gid) {
            Some((_, t)) => t.clone(),
            None => {
                let t = Arc::new(AtomicU64::new(0));
                self.tats.push((gid, t.clone()));
                t
            }
        };
        if let Some(c) = s.carry {
            let _ = tat.fetch_update(Relaxed, Relaxed, |t| Some(c.tat(t)));
        }
        let route = Route {
            gid,
            generation: self.generation,
            gcra: s.gcra,
            tat: Some(tat),
            table: s.nic.and(self.peers.table().cloned()),
            nic: s.nic,
        };
        (route, self.peers.counts.changes != changes)
    }
}

/// What a QP keeps of its destination's cap (in its governance state, under its lock).
#[derive(Default)]
pub struct Route {
    /// The destination it leads to (a QP taken back to RESET may connect elsewhere).
    gid: [u8; 16],
    /// The [`Caps::generation`] it was settled in (0: never).
    generation: u64,
    gcra: Option<Gcra>,
    tat: Option<Arc<AtomicU64>>,
    /// The NIC's table and what it said of the destination, while a table is read.
    table: Option<Arc<Reader>>,
    nic: Option<FromNic>,
}

impl Route {
    /// Whether the route to `gid` still holds at `now` with the caps at `generation`: it
    /// leads there, nothing was replaced, the destination's slot in the NIC's table shows the stamp applied (a slot
    /// in the middle of an update keeps what it said), and an unlisted destination is not
    /// due to be looked for again.
    pub fn holds(&self, gid: [u8; 16], generation: u64, now: u64) -> bool {
        if self.generation != generation || self.gid != gid {
            return false;
        }
        match (self.nic, &self.table) {
            (Some(FromNic::Listed { slot, stamp, .. }), Some(t)) => t
                .slot(slot)
                .is_none_or(|e| (e.incarnation, e.epoch) == stamp),
            (Some(FromNic::Unlisted { look_at }), _) => now < look_at,
            _ => true,
        }
    }

    /// The cap in force towards the destination, None when it is not capped.
    pub fn cap(&self) -> Option<Cap<'_>> {
        Some(Cap {
            gcra: self.gcra?,
            tat: self.tat.as_deref()?,
        })
    }
}

/// A destination's limiter and its TAT, shared by the QPs that send to it.
pub struct Cap<'a> {
    gcra: Gcra,
    tat: &'a AtomicU64,
}

impl Cap<'_> {
    /// How long a post at `now` must wait (ps).
    pub fn wait(&self, now: u64) -> u64 {
        self.gcra.wait(self.tat.load(Relaxed), now)
    }

    /// Takes `bytes` at `now` if they conform; otherwise how long to wait (ps), and nothing
    /// is taken.
    pub fn take(&self, now: u64, bytes: u64) -> Result<(), u64> {
        self.tat
            .fetch_update(Relaxed, Relaxed, |t| self.gcra.try_admit(t, now, bytes))
            .map(|_| ())
            .map_err(|t| self.gcra.wait(t, now).max(1))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::peer_caps::fixtures::{gid, table, R};
    use crate::peer_caps::{share, LOOK_AGAIN_PS};

    fn interval(r: &Route) -> Option<u64> {
        r.cap().map(|c| c.gcra.interval_ps())
    }

    /// A route holds until the NIC publishes a new stamp for its destination; settled again,
    /// the new `N` is in force, and two QPs towards one destination share its TAT.
    #[test]
    fn a_route_holds_until_its_slot_shows_a_new_stamp() {
        let (dir, mut w) = table("stamp");
        let d = [10, 0, 0, 1];
        let mut c = Caps::new();
        c.set_nic(Some(Reader::open(&dir.join("auss")).unwrap()));
        w.publish(d.into(), 2, 1, 9);
        let (a, changed) = c.route(gid(d), 0);
        assert!(changed);
        let (b, changed) = c.route(gid(d), 0);
        assert!(!changed, "the second QP finds the stamp applied");
        let g = c.generation;
        assert!(a.holds(gid(d), g, 1) && b.holds(gid(d), g, 1));
        let half = 1e12 / (share(R, 2).unwrap() as f64);
        assert_eq!(interval(&a), Some(half.round() as u64));
        // One TAT for the destination: what one QP takes, the other owes.
        a.cap().unwrap().take(0, NIC_BURST).unwrap();
        assert!(b.cap().unwrap().wait(0) > 0);
        assert!(b.cap().unwrap().take(0, 1).is_err());
        // The same stamp published again (another ACK of the epoch) leaves the route alone.
        w.publish(d.into(), 2, 1, 9);
        assert!(a.holds(gid(d), g, 2));
        w.publish(d.into(), 4, 2, 9);
        assert!(!a.holds(gid(d), g, 2), "a new stamp");
        let (a, changed) = c.route(gid(d), 2);
        assert!(changed && a.holds(gid(d), g, 3));
        assert_eq!(interval(&a), Some(2 * half.round() as u64));
        // The table replaced (a new engine): every route is settled again.
        c.set_nic(Some(Reader::open(&dir.join("auss")).unwrap()));
        assert!(!a.holds(gid(d), c.generation, 3));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    const NIC_BURST: u64 = crate::peer_caps::NIC_CAP_BURST;

    /// An unlisted destination keeps its route until it is due to be looked for again; a
    /// destination nothing may cap (no table, no agent cap) keeps an empty route for good.
    #[test]
    fn unlisted_and_uncapped_routes() {
        let (dir, _w) = table("unlisted");
        let d = gid([10, 0, 0, 2]);
        let mut c = Caps::new();
        let (r, _) = c.route(d, 0);
        assert!(r.cap().is_none() && r.holds(d, c.generation, u64::MAX));
        assert!(
            !r.holds(gid([10, 0, 0, 3]), c.generation, 0),
            "another destination"
        );
        c.set_agent(&[(d, R)]);
        assert!(!r.holds(d, c.generation, 0));
        c.set_nic(Some(Reader::open(&dir.join("auss")).unwrap()));
        let (r, _) = c.route(d, 7);
        assert!(
            r.cap().is_some(),
            "the agent's cap while the NIC does not list it"
        );
        assert!(r.holds(d, c.generation, 6 + LOOK_AGAIN_PS));
        assert!(!r.holds(d, c.generation, 7 + LOOK_AGAIN_PS));
        // Its TAT survives the agent's caps being replaced, and goes with its last cap.
        c.set_agent(&[(d, R / 2)]);
        let (again, _) = c.route(d, 8);
        assert!(Arc::ptr_eq(
            again.tat.as_ref().unwrap(),
            r.tat.as_ref().unwrap()
        ));
        c.set_nic(None);
        c.set_agent(&[]);
        assert!(c.tats.is_empty());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
