//! Sender side: announcements to each destination (retransmitted until ACKed, bounded
//! retries), periodic refresh of in-flight messages (so the receiver's soft state does not expire
//! under a long message and a restarted receiver relearns it), and the newest cap per
//! destination.
//!
//! Caps are ordered by `(receiver incarnation, epoch)`: an ACK or push from an older epoch than
//! the one already applied is ignored, so a delayed ACK never undoes a newer push. A cap not
//! confirmed by any ACK for `cap_ttl` reverts to "no cap" (the receiver stopped answering).
//! A destination with no message in flight has no cap.

use super::wire::{Ack, Announce, Lookahead, Phase};
use super::SenderId;
use std::collections::BTreeMap;
use std::time::Duration;

#[derive(Clone, Debug, PartialEq)]
pub struct SenderConfig {
    pub sender: SenderId,
    /// Must grow across restarts (the agent uses its start time).
    pub incarnation: u64,
    /// ω_i announced with every message.
    pub weight: f64,
    /// Retransmit an unacknowledged announcement after this long (default 10 ms).
    pub ack_timeout: Duration,
    /// Retransmissions after the first send before giving up (default 5).
    pub retries: u32,
    /// Re-announce in-flight messages this often (default 500 ms, a quarter of the receiver's
    /// default 2 s expiry).
    pub refresh: Duration,
    /// A cap no ACK confirmed for this long is dropped (default 2 s).
    pub cap_ttl: Duration,
}

impl SenderConfig {
    pub fn new(sender: SenderId, incarnation: u64) -> Self {
        Self {
            sender,
            incarnation,
            weight: 1.0,
            ack_timeout: Duration::from_millis(10),
            retries: 5,
            refresh: Duration::from_millis(500),
            cap_ttl: Duration::from_secs(2),
        }
    }
}

/// What the sender knows about one destination while it has messages in flight there.
#[derive(Clone, Copy, Debug, PartialEq, serde::Serialize)]
pub struct CapView {
    /// Unique senders at the receiver (its `N`).
    pub n: u32,
    pub omega: f64,
    pub epoch: u64,
    /// `R·ω/Ω`; `None` when the receiver turned its cap off (non-receiver congestion).
    pub cap: Option<f64>,
}

#[derive(Clone, Debug, PartialEq)]
pub enum SenderAction<D> {
    /// Send (or resend) this announcement to `to`.
    Send { to: D, announce: Announce },
    /// The cap view of `dest` changed; `None`: no cap (no message in flight, or no live answer).
    CapChanged { dest: D, view: Option<CapView> },
    /// An announcement went unanswered after every retry.
    GaveUp { dest: D, seq: u64 },
}

#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct SenderStats {
    pub announcements: u64,
    pub retransmits: u64,
    pub refreshes: u64,
    pub give_ups: u64,
    pub acks: u64,
    /// ACKs or pushes from an older epoch (or receiver life) than the cap applied.
    pub stale_acks: u64,
    /// ACKs for another life of this sender or from a destination with nothing outstanding.
    pub foreign_acks: u64,
    pub cap_expiries: u64,
}

#[derive(Clone, Debug)]
struct Pending {
    announce: Announce,
    deadline: Duration,
    sends: u32,
}

#[derive(Clone, Debug)]
struct Known {
    receiver_incarnation: u64,
    epoch: u64,
    n: u32,
    omega: f64,
    cap: f64,
    cap_off: bool,
    at: Duration,
}

#[derive(Clone, Debug, Default)]
struct Dest {
    inflight: BTreeMap<u64, Option<Lookahead>>,
    outstanding: BTreeMap<u64, Pending>,
    known: Option<Known>,
    next_refresh: Duration,
    shown: Option<CapView>,
}

impl Dest {
    fn view(&self) -> Option<CapView> {
        if self.inflight.is_empty() {
            return None;
        }
        self.known.as_ref().map(|k| CapView {
            n: k.n,
            omega: k.omega,
            epoch: k.epoch,
            cap: (!k.cap_off).then_some(k.cap),
        })
    }
}

#[derive(Clone, Debug)]
pub struct SenderCore<D> {
    cfg: SenderConfig,
    next_seq: u64,
    dests: BTreeMap<D, Dest>,
    stats: SenderStats,
}

impl<D: Clone + Ord> SenderCore<D> {
    pub fn new(cfg: SenderConfig) -> Self {
        Self {
            cfg,
            next_seq: 1,
            dests: BTreeMap::new(),
            stats: SenderStats::default(),
        }
    }

    pub fn config(&self) -> &SenderConfig {
        &self.cfg
    }
    pub fn stats(&self) -> &SenderStats {
        &self.stats
    }

    /// The cap for `dest`, `None` = no cap (unknown, off, or nothing in flight).
    pub fn cap_for(&self, dest: &D) -> Option<f64> {
        self.view(dest).and_then(|v| v.cap)
    }
    pub fn view(&self, dest: &D) -> Option<CapView> {
        self.dests.get(dest).and_then(Dest::view)
    }
    /// Every destination with a cap view.
    pub fn views(&self) -> impl Iterator<Item = (&D, CapView)> + '_ {
        self.dests
            .iter()
            .filter_map(|(d, s)| s.view().map(|v| (d, v)))
    }
    /// Messages in flight to `dest`.
    pub fn in_flight(&self, dest: &D) -> usize {
        self.dests.get(dest).map_or(0, |d| d.inflight.len())
    }
    /// Announcements awaiting an ACK, all destinations.
    pub fn outstanding(&self) -> usize {
        self.dests.values().map(|d| d.outstanding.len()).sum()
    }

    pub fn message_started(&mut self, now: Duration, dest: D, msg_id: u64) -> Vec<SenderAction<D>> {
        self.message_started_with(now, dest, msg_id, None)
    }

    /// As [`SenderCore::message_started`], with an incast-group look-ahead.
    pub fn message_started_with(
        &mut self,
        now: Duration,
        dest: D,
        msg_id: u64,
        lookahead: Option<Lookahead>,
    ) -> Vec<SenderAction<D>> {
        let refresh = self.cfg.refresh;
        let st = self.dests.entry(dest.clone()).or_default();
        if st.inflight.contains_key(&msg_id) {
            return Vec::new();
        }
        if st.inflight.is_empty() {
            st.next_refresh = now + refresh;
        }
        st.inflight.insert(msg_id, lookahead);
        let mut out = vec![self.announce(now, &dest, Phase::Start, msg_id, lookahead)];
        self.show(&dest, &mut out);
        out
    }

    pub fn message_ended(&mut self, now: Duration, dest: D, msg_id: u64) -> Vec<SenderAction<D>> {
        let Some(st) = self.dests.get_mut(&dest) else {
            return Vec::new();
        };
        if st.inflight.remove(&msg_id).is_none() {
            return Vec::new();
        }
        let mut out = vec![self.announce(now, &dest, Phase::End, msg_id, None)];
        self.show(&dest, &mut out);
        out
    }

    /// Handles an ACK or push received from `from`.
    pub fn on_ack(&mut self, now: Duration, from: &D, ack: &Ack) -> Vec<SenderAction<D>> {
        let Some(st) = self.dests.get_mut(from) else {
            self.stats.foreign_acks += 1;
            return Vec::new();
        };
        if ack.sender_incarnation != self.cfg.incarnation {
            self.stats.foreign_acks += 1;
            return Vec::new();
        }
        self.stats.acks += 1;
        if !ack.push {
            st.outstanding.remove(&ack.acked_seq);
        }
        let newer = match &st.known {
            None => true,
            Some(k) => {
                ack.receiver_incarnation > k.receiver_incarnation
                    || (ack.receiver_incarnation == k.receiver_incarnation && ack.epoch >= k.epoch)
            }
        };
        if newer {
            st.known = Some(Known {
                receiver_incarnation: ack.receiver_incarnation,
                epoch: ack.epoch,
                n: ack.n,
                omega: ack.omega,
                cap: ack.cap,
                cap_off: ack.cap_off,
                at: now,
            });
        } else {
            self.stats.stale_acks += 1;
        }
        let mut out = Vec::new();
        self.show(from, &mut out);
        self.collect(from);
        out
    }

    /// Retransmissions, refreshes and cap expiry due at `now`.
    pub fn tick(&mut self, now: Duration) -> Vec<SenderAction<D>> {
        let mut out = Vec::new();
        let keys: Vec<D> = self.dests.keys().cloned().collect();
        for dest in keys {
            let (ack_timeout, retries, refresh, ttl) = (
                self.cfg.ack_timeout,
                self.cfg.retries,
                self.cfg.refresh,
                self.cfg.cap_ttl,
            );
            let st = self.dests.get_mut(&dest).expect("key just listed");
            let mut gave_up = Vec::new();
            for (seq, p) in st.outstanding.iter_mut() {
                if p.deadline > now {
                    continue;
                }
                if p.sends > retries {
                    gave_up.push(*seq);
                } else {
                    p.sends += 1;
                    p.deadline = now + ack_timeout;
                    self.stats.retransmits += 1;
                    out.push(SenderAction::Send {
                        to: dest.clone(),
                        announce: p.announce,
                    });
                }
            }
            for seq in gave_up {
                st.outstanding.remove(&seq);
                self.stats.give_ups += 1;
                out.push(SenderAction::GaveUp {
                    dest: dest.clone(),
                    seq,
                });
            }
            if st.known.as_ref().is_some_and(|k| now >= k.at + ttl) {
                st.known = None;
                self.stats.cap_expiries += 1;
            }
            let due: Vec<(u64, Option<Lookahead>)> =
                if !st.inflight.is_empty() && now >= st.next_refresh {
                    st.next_refresh = now + refresh;
                    st.inflight.iter().map(|(m, l)| (*m, *l)).collect()
                } else {
                    Vec::new()
                };
            for (m, l) in due {
                self.stats.refreshes += 1;
                out.push(self.announce(now, &dest, Phase::Start, m, l));
            }
            self.show(&dest, &mut out);
            self.collect(&dest);
        }
        out
    }

    /// The next time [`SenderCore::tick`] has something to do.
    pub fn next_deadline(&self) -> Option<Duration> {
        let ttl = self.cfg.cap_ttl;
        self.dests
            .values()
            .flat_map(|st| {
                let retx = st.outstanding.values().map(|p| p.deadline).min();
                let refresh = (!st.inflight.is_empty()).then_some(st.next_refresh);
                let expiry = st.known.as_ref().map(|k| k.at + ttl);
                [retx, refresh, expiry]
            })
            .flatten()
            .min()
    }

    fn announce(
        &mut self,
        now: Duration,
        dest: &D,
        phase: Phase,
        msg_id: u64,
        lookahead: Option<Lookahead>,
    ) -> SenderAction<D> {
        let seq = self.next_seq;
        self.next_seq += 1;
        let announce = Announce {
            sender: self.cfg.sender,
            incarnation: self.cfg.incarnation,
            seq,
            phase,
            msg_id,
            weight: self.cfg.weight,
            lookahead,
        };
        self.stats.announcements += 1;
        let st = self.dests.entry(dest.clone()).or_default();
        st.outstanding.insert(
            seq,
            Pending {
                announce,
                deadline: now + self.cfg.ack_timeout,
                sends: 1,
            },
        );
        SenderAction::Send {
            to: dest.clone(),
            announce,
        }
    }

    /// Emits `CapChanged` when the view of `dest` differs from the last one shown.
    fn show(&mut self, dest: &D, out: &mut Vec<SenderAction<D>>) {
        if let Some(st) = self.dests.get_mut(dest) {
            let v = st.view();
            if v != st.shown {
                st.shown = v;
                out.push(SenderAction::CapChanged {
                    dest: dest.clone(),
                    view: v,
                });
            }
        }
    }

    /// Forgets a destination with nothing in flight and nothing outstanding.
    fn collect(&mut self, dest: &D) {
        if self
            .dests
            .get(dest)
            .is_some_and(|st| st.inflight.is_empty() && st.outstanding.is_empty())
        {
            self.dests.remove(dest);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::auss::{Auss, AussAction, AussConfig};
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    const MS: Duration = Duration::from_millis(1);

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn core(id: SenderId) -> SenderCore<&'static str> {
        SenderCore::new(SenderConfig::new(id, 5))
    }

    fn sends<D: Clone>(out: &[SenderAction<D>]) -> Vec<Announce> {
        out.iter()
            .filter_map(|a| match a {
                SenderAction::Send { announce, .. } => Some(*announce),
                _ => None,
            })
            .collect()
    }

    fn ack(seq: u64, epoch: u64, n: u32, cap: f64) -> Ack {
        Ack {
            receiver_incarnation: 1,
            sender_incarnation: 5,
            epoch,
            n,
            omega: n as f64,
            cap,
            acked_seq: seq,
            push: false,
            cap_off: false,
        }
    }

    #[test]
    fn announce_ack_cap_and_end() {
        let mut s = core(1);
        let out = s.message_started(ms(0), "r", 9);
        let a = sends(&out);
        assert_eq!(a.len(), 1);
        assert_eq!((a[0].seq, a[0].phase, a[0].msg_id), (1, Phase::Start, 9));
        assert_eq!(s.cap_for(&"r"), None, "no cap before the first ACK");
        // Calling start twice for the same message does nothing.
        assert!(s.message_started(ms(0), "r", 9).is_empty());
        let out = s.on_ack(ms(1), &"r", &ack(1, 3, 2, 50.0));
        assert_eq!(
            out,
            vec![SenderAction::CapChanged {
                dest: "r",
                view: Some(CapView {
                    n: 2,
                    omega: 2.0,
                    epoch: 3,
                    cap: Some(50.0)
                })
            }]
        );
        assert_eq!(s.outstanding(), 0);
        // A stale (older epoch) push is ignored; a newer one applies.
        let mut old = ack(0, 2, 3, 33.0);
        old.push = true;
        assert!(s.on_ack(ms(2), &"r", &old).is_empty());
        assert_eq!(s.stats().stale_acks, 1);
        assert_eq!(s.cap_for(&"r"), Some(50.0));
        let mut new = ack(0, 4, 1, 100.0);
        new.push = true;
        s.on_ack(ms(3), &"r", &new);
        assert_eq!(s.cap_for(&"r"), Some(100.0));
        // A new receiver life (epochs restart) is accepted.
        let mut reborn = ack(0, 1, 2, 50.0);
        reborn.receiver_incarnation = 2;
        s.on_ack(ms(4), &"r", &reborn);
        assert_eq!(s.cap_for(&"r"), Some(50.0));
        // End: no cap any more; the END is outstanding until ACKed, then the state is gone.
        let out = s.message_ended(ms(5), "r", 9);
        assert_eq!(sends(&out)[0].phase, Phase::End);
        assert!(out.contains(&SenderAction::CapChanged {
            dest: "r",
            view: None
        }));
        assert_eq!(s.outstanding(), 1);
        let mut a = ack(sends(&out)[0].seq, 2, 1, 50.0);
        a.receiver_incarnation = 2;
        s.on_ack(ms(6), &"r", &a);
        assert_eq!(s.outstanding(), 0);
        assert_eq!(s.next_deadline(), None);
        // Ending an unknown message is a no-op.
        assert!(s.message_ended(ms(7), "r", 9).is_empty());
    }

    #[test]
    fn retransmits_then_gives_up_and_caps_expire() {
        let mut s = core(1);
        s.message_started(ms(0), "r", 1);
        s.on_ack(ms(1), &"r", &ack(1, 1, 1, 10.0));
        s.message_ended(ms(100), "r", 1);
        s.message_started(ms(100), "r", 2);
        assert_eq!(s.next_deadline(), Some(ms(110)));
        let mut now = ms(100);
        let mut retx = 0;
        let mut gave_up = 0;
        while now < ms(300) {
            now = s.next_deadline().unwrap().min(ms(300));
            for a in s.tick(now) {
                match a {
                    SenderAction::Send { announce, .. } => {
                        assert!(
                            matches!(announce.seq, 2 | 3),
                            "retransmission keeps its seq"
                        );
                        retx += 1;
                    }
                    SenderAction::GaveUp { .. } => gave_up += 1,
                    SenderAction::CapChanged { .. } => {}
                }
            }
        }
        assert_eq!((retx, gave_up), (2 * 5, 2));
        assert_eq!(s.stats().give_ups, 2);
        assert_eq!(s.cap_for(&"r"), Some(10.0), "cap lives until its TTL");
        // No answer at all: the refresh at 600 ms re-announces, the cap expires at 2001 ms.
        let out = s.tick(ms(2001));
        assert!(out.contains(&SenderAction::CapChanged {
            dest: "r",
            view: None
        }));
        assert_eq!(s.cap_for(&"r"), None);
        assert_eq!(s.stats().cap_expiries, 1);
    }

    #[test]
    fn refresh_reannounces_in_flight_messages() {
        let mut s = core(1);
        s.message_started(ms(0), "r", 1);
        s.message_started(ms(0), "r", 2);
        s.on_ack(ms(1), &"r", &ack(1, 1, 1, 10.0));
        s.on_ack(ms(1), &"r", &ack(2, 1, 1, 10.0));
        assert_eq!(s.next_deadline(), Some(ms(500)));
        let out = s.tick(ms(500));
        let a = sends(&out);
        assert_eq!(a.len(), 2);
        assert!(a.iter().all(|a| a.phase == Phase::Start && a.seq > 2));
        assert_eq!(s.stats().refreshes, 2);
    }

    #[test]
    fn foreign_and_unknown_acks_are_ignored() {
        let mut s = core(1);
        assert!(s.on_ack(ms(0), &"x", &ack(1, 1, 1, 1.0)).is_empty());
        s.message_started(ms(0), "r", 1);
        let mut other_life = ack(1, 1, 1, 1.0);
        other_life.sender_incarnation = 4;
        assert!(s.on_ack(ms(0), &"r", &other_life).is_empty());
        assert_eq!(s.stats().foreign_acks, 2);
        assert_eq!(s.outstanding(), 1);
    }

    #[test]
    fn cap_off_means_no_cap() {
        let mut s = core(1);
        s.message_started(ms(0), "r", 1);
        let mut a = ack(1, 1, 1, 10.0);
        a.cap_off = true;
        s.on_ack(ms(0), &"r", &a);
        assert_eq!(s.cap_for(&"r"), None);
        assert_eq!(s.view(&"r").unwrap().n, 1);
    }

    enum Pkt {
        Up(usize, Announce),
        Down(usize, Ack),
    }

    /// Senders and a receiver wired through a lossy (10 %), duplicating, reordering network
    /// (0.1–3 ms delays) driven by a seed.
    struct Sim {
        x: u64,
        now: Duration,
        cores: Vec<SenderCore<u32>>,
        rx: Auss<usize>,
        net: Vec<(Duration, Pkt)>,
    }

    impl Sim {
        fn rnd(&mut self, m: u64) -> u64 {
            self.x = self
                .x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (self.x >> 33) % m
        }
        fn delay(&mut self) -> Duration {
            self.now + Duration::from_micros(100 + self.rnd(3000))
        }
        fn up(&mut self, i: usize, acts: Vec<SenderAction<u32>>) {
            for a in acts {
                if let SenderAction::Send { announce, .. } = a {
                    if self.rnd(10) == 0 {
                        continue;
                    }
                    let copies = if self.rnd(10) == 0 { 2 } else { 1 };
                    for _ in 0..copies {
                        let t = self.delay();
                        self.net.push((t, Pkt::Up(i, announce)));
                    }
                }
            }
        }
        fn down(&mut self, acts: Vec<AussAction<usize>>) {
            for act in acts {
                let (to, ack) = act.target();
                let (to, ack) = (*to, *ack);
                if self.rnd(10) != 0 {
                    let t = self.delay();
                    self.net.push((t, Pkt::Down(to, ack)));
                }
            }
        }
        /// Advances 1 ms: deliveries due, then timers.
        fn step(&mut self) {
            self.now += MS;
            let now = self.now;
            self.net.sort_by_key(|(t, _)| *t);
            let due = self.net.iter().take_while(|(t, _)| *t <= now).count();
            let pkts: Vec<_> = self.net.drain(..due).collect();
            for (_, p) in pkts {
                match p {
                    Pkt::Up(i, a) => {
                        let acts = self.rx.on_announce(now, i, &a);
                        self.down(acts);
                    }
                    Pkt::Down(i, k) => {
                        let acts = self.cores[i].on_ack(now, &0, &k);
                        self.up(i, acts);
                    }
                }
            }
            let acts = self.rx.tick(now);
            self.down(acts);
            for i in 0..self.cores.len() {
                let acts = self.cores[i].tick(now);
                self.up(i, acts);
            }
        }
        fn gave_up(&self) -> bool {
            self.cores.iter().any(|c| c.stats().give_ups > 0)
        }
    }

    /// Random starts and ends for `steps` ms; then quiet for 1.5 s: every sender with an open
    /// message has cap R/N, N the number of such senders; then all end: after 400 ms the set is
    /// empty, and after the expiry it is empty whatever was lost.
    fn simulate(seed: u64, senders: usize, steps: usize) -> Result<(), TestCaseError> {
        let mut sim = Sim {
            x: seed | 1,
            now: Duration::ZERO,
            cores: (0..senders)
                .map(|i| SenderCore::new(SenderConfig::new(i as u64 + 1, 1)))
                .collect(),
            rx: Auss::new(
                AussConfig {
                    rate: 120.0,
                    ..AussConfig::default()
                },
                1,
            ),
            net: Vec::new(),
        };
        let mut open: Vec<BTreeSet<u64>> = vec![BTreeSet::new(); senders];
        let mut next_msg = 1;
        for _ in 0..steps {
            sim.step();
            if sim.rnd(4) == 0 {
                let i = sim.rnd(senders as u64) as usize;
                let now = sim.now;
                let acts = if !open[i].is_empty() && sim.rnd(2) == 0 {
                    let m = *open[i].iter().next().unwrap();
                    open[i].remove(&m);
                    sim.cores[i].message_ended(now, 0, m)
                } else {
                    open[i].insert(next_msg);
                    next_msg += 1;
                    sim.cores[i].message_started(now, 0, next_msg - 1)
                };
                sim.up(i, acts);
            }
        }
        for _ in 0..1500 {
            sim.step();
        }
        let active = open.iter().filter(|o| !o.is_empty()).count();
        if !sim.gave_up() {
            prop_assert_eq!(sim.rx.n() as usize, active);
            for (i, o) in open.iter().enumerate() {
                let want = (!o.is_empty()).then_some(120.0 / active as f64);
                prop_assert_eq!(sim.cores[i].cap_for(&0), want, "sender {}", i);
            }
        }
        for (i, o) in open.iter_mut().enumerate() {
            for m in std::mem::take(o) {
                let now = sim.now;
                let acts = sim.cores[i].message_ended(now, 0, m);
                sim.up(i, acts);
            }
            prop_assert_eq!(sim.cores[i].cap_for(&0), None);
        }
        for _ in 0..400 {
            sim.step();
        }
        if !sim.gave_up() {
            prop_assert_eq!(sim.rx.n(), 0);
            for c in &sim.cores {
                prop_assert_eq!(c.outstanding(), 0);
            }
        }
        for _ in 0..2000 {
            sim.step();
        }
        prop_assert_eq!(sim.rx.n(), 0);
        prop_assert!(sim.rx.stats().starts > 0 && sim.rx.stats().ends > 0);
        Ok(())
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(48))]
        #[test]
        fn lossy_network_converges_to_empty(seed in any::<u64>(), senders in 1usize..5) {
            simulate(seed, senders, 300)?;
        }
    }
}
