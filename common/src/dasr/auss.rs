//! Receiver side: the Active Unique Sender Set (Dart's AUSS) and the ACKs it answers with.
//!
//! One record per sender id. A sender is a *member* while it has at least one message in
//! flight; `N` counts members (plus, with look-ahead, group members not heard from yet) and
//! `Ω` sums their weights. A sender with several in-flight messages, even in two overlapping
//! incasts, is one member. Every change of `N` or `Ω` (or of the receiver's rate or cap mode)
//! increments the epoch and pushes a fresh ACK to every member.
//!
//! Announcements are idempotent and order-insensitive: per message id the receiver keeps the
//! phase of the announcement with the highest sequence number seen (a last-writer-wins register
//! ordered by the sender's `seq`). A retransmission (same `seq`) or a reordered older
//! announcement changes nothing — a START arriving after its END is recognised and ignored —
//! an END for an unknown message only leaves a tombstone, and a refresh (a new START of an
//! in-flight message) only renews the sender's activity time. A message id may be reused once
//! its END is sent: the new START has a higher `seq`. Records idle for `expiry` are dropped
//! (soft state).

use super::wire::{Ack, Announce, Lookahead, Phase};
use super::SenderId;
use std::collections::{BTreeMap, BTreeSet, VecDeque};
use std::time::Duration;

#[derive(Clone, Debug, PartialEq)]
pub struct AussConfig {
    /// `R`, the receiver's rate that caps apportion (any unit; caps come out in the same unit).
    pub rate: f64,
    /// A sender not heard from for this long leaves the set (default 2 s).
    pub expiry: Duration,
    /// Count announced incast-group members not heard from yet (default off).
    pub lookahead: bool,
    /// Ended message ids remembered per sender to recognise late STARTs (default 1024; an
    /// evicted tombstone only risks a very late START counting until `expiry`).
    pub tombstones: usize,
}

impl Default for AussConfig {
    fn default() -> Self {
        Self {
            rate: 1.0,
            expiry: Duration::from_secs(2),
            lookahead: false,
            tombstones: 1024,
        }
    }
}

/// What the receiver must send.
#[derive(Clone, Debug, PartialEq)]
pub enum AussAction<A> {
    /// The answer to an announcement from `to`.
    Ack { to: A, ack: Ack },
    /// Unsolicited: `N` or `Ω` changed; `to` is a member.
    Push { to: A, ack: Ack },
}

impl<A> AussAction<A> {
    pub fn target(&self) -> (&A, &Ack) {
        match self {
            AussAction::Ack { to, ack } | AussAction::Push { to, ack } => (to, ack),
        }
    }
}

/// How each announcement was classified (and expiries), for metrics.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct AussStats {
    pub announcements: u64,
    pub starts: u64,
    pub ends: u64,
    /// Repeated STARTs of in-flight messages (retransmissions, refreshes) and repeated ENDs.
    pub duplicates: u64,
    /// Announcements older than one already applied for their message (reordered), e.g. a
    /// START arriving after its END.
    pub reordered: u64,
    /// ENDs of messages never seen started.
    pub unknown_ends: u64,
    /// Announcements from an older incarnation of a sender.
    pub stale_incarnation: u64,
    /// Senders restarting with a newer incarnation (their old record was reset).
    pub restarts: u64,
    /// Members removed because they were idle for `expiry`.
    pub expiries: u64,
    pub acks: u64,
    pub pushes: u64,
    pub epoch_changes: u64,
}

#[derive(Clone, Debug)]
struct Record<A> {
    addr: A,
    incarnation: u64,
    weight: f64,
    /// Open messages: id → (seq of the last START applied, look-ahead).
    inflight: BTreeMap<u64, (u64, Option<Lookahead>)>,
    /// Tombstones of ended messages: id → seq of the END, and their age order.
    ended: BTreeMap<u64, u64>,
    ended_order: VecDeque<u64>,
    last_activity: Duration,
}

impl<A> Record<A> {
    fn member(&self) -> bool {
        !self.inflight.is_empty()
    }
}

/// The receiver's AUSS. `A` is whatever addresses a sender (a `SocketAddr` in the agent).
#[derive(Clone, Debug)]
pub struct Auss<A> {
    cfg: AussConfig,
    incarnation: u64,
    epoch: u64,
    n: u32,
    omega: f64,
    cap_enabled: bool,
    records: BTreeMap<SenderId, Record<A>>,
    stats: AussStats,
}

impl<A: Clone> Auss<A> {
    /// `incarnation` must grow across restarts of the receiver (the agent uses its start time)
    /// so that senders accept the new life's epochs, which start again at 0.
    pub fn new(cfg: AussConfig, incarnation: u64) -> Self {
        Self {
            cfg,
            incarnation,
            epoch: 0,
            n: 0,
            omega: 0.0,
            cap_enabled: true,
            records: BTreeMap::new(),
            stats: AussStats::default(),
        }
    }

    pub fn n(&self) -> u32 {
        self.n
    }
    pub fn omega(&self) -> f64 {
        self.omega
    }
    pub fn epoch(&self) -> u64 {
        self.epoch
    }
    pub fn rate(&self) -> f64 {
        self.cfg.rate
    }
    pub fn incarnation(&self) -> u64 {
        self.incarnation
    }
    pub fn stats(&self) -> &AussStats {
        &self.stats
    }
    pub fn config(&self) -> &AussConfig {
        &self.cfg
    }
    /// Members with their weight and number of in-flight messages.
    pub fn members(&self) -> impl Iterator<Item = (SenderId, f64, usize)> + '_ {
        self.records
            .iter()
            .filter(|(_, r)| r.member())
            .map(|(id, r)| (*id, r.weight, r.inflight.len()))
    }
    pub fn is_member(&self, sender: SenderId) -> bool {
        self.records.get(&sender).is_some_and(Record::member)
    }

    /// The cap a sender of weight `weight` gets: `R·ω/Ω` for a member, the share it would get
    /// on joining (`R·ω/(Ω+ω)`) for anyone else.
    pub fn cap_for_weight(&self, weight: f64, member: bool) -> f64 {
        let omega = if member {
            self.omega
        } else {
            self.omega + weight
        };
        if omega > 0.0 {
            self.cfg.rate * weight / omega
        } else {
            self.cfg.rate
        }
    }

    fn ack_for(&self, sender: SenderId, acked_seq: u64, push: bool) -> Option<(A, Ack)> {
        let r = self.records.get(&sender)?;
        Some((
            r.addr.clone(),
            Ack {
                receiver_incarnation: self.incarnation,
                sender_incarnation: r.incarnation,
                epoch: self.epoch,
                n: self.n,
                omega: self.omega,
                cap: self.cap_for_weight(r.weight, r.member()),
                acked_seq,
                push,
                cap_off: !self.cap_enabled,
            },
        ))
    }

    /// Handles one announcement received from `from` (where the ACK and later pushes go).
    pub fn on_announce(&mut self, now: Duration, from: A, a: &Announce) -> Vec<AussAction<A>> {
        self.stats.announcements += 1;
        match self.records.get(&a.sender) {
            Some(r) if a.incarnation < r.incarnation => {
                // A previous life of this sender: it is dead; answering would only confuse.
                self.stats.stale_incarnation += 1;
                return Vec::new();
            }
            Some(r) if a.incarnation > r.incarnation => {
                self.stats.restarts += 1;
                self.records.remove(&a.sender);
            }
            _ => {}
        }
        let tombstones = self.cfg.tombstones;
        let rec = self.records.entry(a.sender).or_insert_with(|| Record {
            addr: from.clone(),
            incarnation: a.incarnation,
            weight: a.weight,
            inflight: BTreeMap::new(),
            ended: BTreeMap::new(),
            ended_order: VecDeque::new(),
            last_activity: now,
        });
        rec.addr = from;
        rec.last_activity = now;
        rec.weight = a.weight;
        // The newest announcement applied for this message id, if any.
        let last = rec
            .inflight
            .get(&a.msg_id)
            .map(|(q, _)| *q)
            .or_else(|| rec.ended.get(&a.msg_id).copied());
        match last {
            Some(q) if a.seq == q => self.stats.duplicates += 1,
            Some(q) if a.seq < q => self.stats.reordered += 1,
            _ => match a.phase {
                Phase::Start => {
                    rec.ended.remove(&a.msg_id);
                    if rec
                        .inflight
                        .insert(a.msg_id, (a.seq, a.lookahead))
                        .is_some()
                    {
                        self.stats.duplicates += 1; // a refresh
                    } else {
                        self.stats.starts += 1;
                    }
                }
                Phase::End => {
                    if rec.inflight.remove(&a.msg_id).is_some() {
                        self.stats.ends += 1;
                    } else {
                        self.stats.unknown_ends += 1;
                    }
                    if rec.ended.insert(a.msg_id, a.seq).is_none() {
                        rec.ended_order.push_back(a.msg_id);
                    }
                    while rec.ended_order.len() > tombstones {
                        if let Some(old) = rec.ended_order.pop_front() {
                            // An id reused since keeps its newer place in the queue.
                            if !rec.ended_order.contains(&old) {
                                rec.ended.remove(&old);
                            }
                        }
                    }
                }
            },
        }
        let mut out = self.recount(Some(a.sender));
        if let Some((to, ack)) = self.ack_for(a.sender, a.seq, false) {
            self.stats.acks += 1;
            out.insert(0, AussAction::Ack { to, ack });
        }
        out
    }

    /// Expires idle senders; call at [`Auss::next_deadline`] (or any time).
    pub fn tick(&mut self, now: Duration) -> Vec<AussAction<A>> {
        let expiry = self.cfg.expiry;
        let mut expired = 0;
        self.records.retain(|_, r| {
            let idle = now.saturating_sub(r.last_activity) >= expiry;
            if idle && r.member() {
                expired += 1;
            }
            !idle
        });
        self.stats.expiries += expired;
        self.recount(None)
    }

    /// When the next record would expire.
    pub fn next_deadline(&self) -> Option<Duration> {
        self.records
            .values()
            .map(|r| r.last_activity + self.cfg.expiry)
            .min()
    }

    /// Changes `R` (e.g. measured line rate); pushes new caps to every member.
    pub fn set_rate(&mut self, rate: f64) -> Vec<AussAction<A>> {
        if rate == self.cfg.rate || !rate.is_finite() || rate < 0.0 {
            return Vec::new();
        }
        self.cfg.rate = rate;
        self.bump_and_push(None)
    }

    /// Turns the cap on or off (off in non-receiver congestion, DESIGN §4).
    pub fn set_cap_enabled(&mut self, on: bool) -> Vec<AussAction<A>> {
        if on == self.cap_enabled {
            return Vec::new();
        }
        self.cap_enabled = on;
        self.bump_and_push(None)
    }

    pub fn cap_enabled(&self) -> bool {
        self.cap_enabled
    }

    /// Recomputes `N` and `Ω`; on a change, a new epoch and a push to every member but `skip`.
    fn recount(&mut self, skip: Option<SenderId>) -> Vec<AussAction<A>> {
        let mut n: u64 = 0;
        let mut omega = 0.0;
        // (tenant, group) -> (announced size, members present)
        let mut groups: BTreeMap<(u32, u64), (u16, u64)> = BTreeMap::new();
        for r in self.records.values().filter(|r| r.member()) {
            n += 1;
            omega += r.weight;
            if self.cfg.lookahead {
                let mine: BTreeSet<(u32, u64, u16)> = r
                    .inflight
                    .values()
                    .filter_map(|(_, l)| l.as_ref())
                    .map(|l| (l.tenant, l.group, l.members))
                    .collect();
                let mut seen = BTreeSet::new();
                for (t, g, m) in mine {
                    let e = groups.entry((t, g)).or_insert((0, 0));
                    e.0 = e.0.max(m);
                    if seen.insert((t, g)) {
                        e.1 += 1;
                    }
                }
            }
        }
        // Announced members not heard from yet count with the default weight 1.
        let missing: u64 = groups
            .values()
            .map(|(m, present)| u64::from(*m).saturating_sub(*present))
            .sum();
        n += missing;
        omega += missing as f64;
        let n = u32::try_from(n).unwrap_or(u32::MAX);
        if n == self.n && omega == self.omega {
            return Vec::new();
        }
        self.n = n;
        self.omega = omega;
        self.bump_and_push(skip)
    }

    fn bump_and_push(&mut self, skip: Option<SenderId>) -> Vec<AussAction<A>> {
        self.epoch += 1;
        self.stats.epoch_changes += 1;
        let ids: Vec<SenderId> = self
            .records
            .iter()
            .filter(|(id, r)| r.member() && Some(**id) != skip)
            .map(|(id, _)| *id)
            .collect();
        let mut out = Vec::with_capacity(ids.len());
        for id in ids {
            if let Some((to, ack)) = self.ack_for(id, 0, true) {
                self.stats.pushes += 1;
                out.push(AussAction::Push { to, ack });
            }
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn ann(sender: SenderId, seq: u64, phase: Phase, msg_id: u64) -> Announce {
        Announce {
            sender,
            incarnation: 1,
            seq,
            phase,
            msg_id,
            weight: 1.0,
            lookahead: None,
        }
    }

    fn auss() -> Auss<u32> {
        Auss::new(
            AussConfig {
                rate: 100.0,
                ..AussConfig::default()
            },
            77,
        )
    }

    fn ack_of(out: &[AussAction<u32>]) -> Ack {
        match &out[0] {
            AussAction::Ack { ack, .. } => *ack,
            o => panic!("first action is not the ACK: {o:?}"),
        }
    }

    fn pushes(out: &[AussAction<u32>]) -> Vec<(u32, Ack)> {
        out.iter()
            .filter_map(|a| match a {
                AussAction::Push { to, ack } => Some((*to, *ack)),
                _ => None,
            })
            .collect()
    }

    #[test]
    fn start_end_counts_and_caps() {
        let mut s = auss();
        let out = s.on_announce(ms(0), 10, &ann(1, 1, Phase::Start, 5));
        let a = ack_of(&out);
        assert_eq!((a.n, a.epoch, a.cap, a.acked_seq), (1, 1, 100.0, 1));
        assert_eq!(a.receiver_incarnation, 77);
        assert!(pushes(&out).is_empty(), "nobody else to push to");
        // Sender 2 joins: ACK to 2, push to 1, both at R/2.
        let out = s.on_announce(ms(1), 20, &ann(2, 1, Phase::Start, 9));
        let a = ack_of(&out);
        assert_eq!((a.n, a.epoch, a.cap), (2, 2, 50.0));
        assert_eq!(pushes(&out).len(), 1);
        let (to, p) = pushes(&out)[0];
        assert_eq!(
            (to, p.n, p.epoch, p.cap, p.push, p.acked_seq),
            (10, 2, 2, 50.0, true, 0)
        );
        // A second message of sender 1 (overlapping incast): still one member, no push.
        let out = s.on_announce(ms(2), 10, &ann(1, 2, Phase::Start, 6));
        assert_eq!(ack_of(&out).n, 2);
        assert!(pushes(&out).is_empty());
        assert_eq!(s.epoch(), 2);
        // Sender 1 ends one of two: still a member.
        let out = s.on_announce(ms(3), 10, &ann(1, 3, Phase::End, 5));
        assert_eq!(ack_of(&out).n, 2);
        assert!(s.is_member(1));
        // Sender 2 ends: N = 1, push to 1 with cap R.
        let out = s.on_announce(ms(4), 20, &ann(2, 2, Phase::End, 9));
        let a = ack_of(&out);
        assert_eq!((a.n, a.epoch), (1, 3));
        assert_eq!(
            a.cap, 50.0,
            "a non-member is told the share it would get on joining"
        );
        assert_eq!(
            pushes(&out),
            vec![(
                10,
                Ack {
                    cap: 100.0,
                    ..pushes(&out)[0].1
                }
            )]
        );
        let out = s.on_announce(ms(5), 10, &ann(1, 4, Phase::End, 6));
        assert_eq!(ack_of(&out).n, 0);
        assert_eq!((s.n(), s.omega()), (0, 0.0));
    }

    #[test]
    fn duplicates_and_reordering_are_recognised() {
        let mut s = auss();
        s.on_announce(ms(0), 1, &ann(1, 1, Phase::Start, 5));
        let out = s.on_announce(ms(1), 1, &ann(1, 1, Phase::Start, 5));
        assert_eq!((ack_of(&out).n, ack_of(&out).epoch), (1, 1));
        assert_eq!(s.stats().duplicates, 1);
        // END for an unknown message: harmless.
        s.on_announce(ms(2), 1, &ann(1, 2, Phase::End, 99));
        assert_eq!((s.n(), s.stats().unknown_ends), (1, 1));
        // END before START (reordered): the late START is ignored.
        s.on_announce(ms(3), 2, &ann(2, 2, Phase::End, 7));
        let out = s.on_announce(ms(4), 2, &ann(2, 1, Phase::Start, 7));
        assert_eq!(ack_of(&out).n, 1);
        assert_eq!(s.stats().reordered, 1);
        assert!(!s.is_member(2));
        // Duplicate END.
        s.on_announce(ms(5), 1, &ann(1, 3, Phase::End, 5));
        s.on_announce(ms(6), 1, &ann(1, 3, Phase::End, 5));
        assert_eq!(s.n(), 0);
        assert_eq!(s.stats().duplicates, 2);
    }

    #[test]
    fn message_ids_may_be_reused() {
        let mut s = auss();
        s.on_announce(ms(0), 1, &ann(1, 1, Phase::Start, 5));
        s.on_announce(ms(1), 1, &ann(1, 2, Phase::End, 5));
        s.on_announce(ms(2), 1, &ann(1, 3, Phase::Start, 5));
        assert_eq!((s.n(), s.stats().starts), (1, 2));
        // The first life's END delivered again (or late): older than the new START.
        s.on_announce(ms(3), 1, &ann(1, 2, Phase::End, 5));
        assert_eq!(s.n(), 1);
        // Reordered: an END (seq 6) overtakes the START it follows (seq 5).
        s.on_announce(ms(4), 1, &ann(1, 6, Phase::End, 5));
        s.on_announce(ms(5), 1, &ann(1, 5, Phase::Start, 5));
        assert_eq!(s.n(), 0);
        assert_eq!(s.stats().reordered, 2);
    }

    #[test]
    fn tombstones_are_bounded() {
        let mut s = Auss::new(
            AussConfig {
                tombstones: 4,
                ..AussConfig::default()
            },
            1,
        );
        for i in 0..100u64 {
            s.on_announce(ms(i), 1, &ann(1, 2 * i + 1, Phase::Start, i % 3));
            s.on_announce(ms(i), 1, &ann(1, 2 * i + 2, Phase::End, i % 3));
        }
        let r = &s.records[&1];
        assert!(r.ended.len() <= 4 && r.ended_order.len() <= 4);
        assert_eq!(s.n(), 0);
    }

    #[test]
    fn idle_senders_expire_and_the_rest_get_a_push() {
        let mut s = auss();
        s.on_announce(ms(0), 1, &ann(1, 1, Phase::Start, 5));
        s.on_announce(ms(500), 2, &ann(2, 1, Phase::Start, 5));
        assert_eq!(s.next_deadline(), Some(ms(2000)));
        assert!(s.tick(ms(1999)).is_empty());
        // Sender 2 refreshes (repeated START) and stays.
        s.on_announce(ms(1900), 2, &ann(2, 2, Phase::Start, 5));
        let out = s.tick(ms(2000));
        assert_eq!(s.n(), 1);
        assert_eq!(s.stats().expiries, 1);
        assert_eq!(pushes(&out).len(), 1);
        assert_eq!(pushes(&out)[0].0, 2);
        assert_eq!(pushes(&out)[0].1.cap, 100.0);
        assert_eq!(s.next_deadline(), Some(ms(3900)));
        s.tick(ms(3900));
        assert_eq!((s.n(), s.next_deadline()), (0, None));
    }

    #[test]
    fn weights_apportion_and_restarts_reset() {
        let mut s = auss();
        let mut a = ann(1, 1, Phase::Start, 5);
        a.weight = 3.0;
        s.on_announce(ms(0), 1, &a);
        let out = s.on_announce(ms(0), 2, &ann(2, 1, Phase::Start, 5));
        assert_eq!(ack_of(&out).cap, 25.0);
        assert_eq!(pushes(&out)[0].1.cap, 75.0);
        assert_eq!(s.omega(), 4.0);
        // Sender 1 restarts (new incarnation) with a different message: old state is gone.
        let mut b = ann(1, 1, Phase::Start, 8);
        b.incarnation = 2;
        s.on_announce(ms(1), 1, &b);
        assert_eq!(s.stats().restarts, 1);
        assert_eq!(s.members().find(|m| m.0 == 1).unwrap().2, 1);
        assert_eq!(s.omega(), 2.0);
        // The dead life's END is ignored.
        assert!(s
            .on_announce(ms(2), 1, &ann(1, 9, Phase::End, 8))
            .is_empty());
        assert_eq!(s.stats().stale_incarnation, 1);
        assert!(s.is_member(1));
    }

    #[test]
    fn rate_and_cap_mode_changes_push() {
        let mut s = auss();
        s.on_announce(ms(0), 1, &ann(1, 1, Phase::Start, 5));
        let out = s.set_rate(40.0);
        assert_eq!(pushes(&out)[0].1.cap, 40.0);
        assert_eq!(s.epoch(), 2);
        let out = s.set_cap_enabled(false);
        assert!(pushes(&out)[0].1.cap_off);
        assert!(s.set_cap_enabled(false).is_empty());
    }

    #[test]
    fn lookahead_counts_announced_group_members() {
        let mut s = Auss::new(
            AussConfig {
                rate: 100.0,
                lookahead: true,
                ..AussConfig::default()
            },
            1,
        );
        let la = Some(Lookahead {
            tenant: 1,
            group: 4,
            members: 4,
        });
        let out = s.on_announce(
            ms(0),
            1,
            &Announce {
                lookahead: la,
                ..ann(1, 1, Phase::Start, 5)
            },
        );
        assert_eq!((ack_of(&out).n, ack_of(&out).cap), (4, 25.0));
        // A second member of the group: still 4, no new epoch.
        s.on_announce(
            ms(0),
            2,
            &Announce {
                lookahead: la,
                ..ann(2, 1, Phase::Start, 5)
            },
        );
        assert_eq!((s.n(), s.epoch()), (4, 1));
        // Off by default: the same announcement counts one.
        let mut plain = auss();
        plain.on_announce(
            ms(0),
            1,
            &Announce {
                lookahead: la,
                ..ann(1, 1, Phase::Start, 5)
            },
        );
        assert_eq!(plain.n(), 1);
    }

    /// One sender's announcements in the order it sends them: per message START then END,
    /// sequence numbers increasing.
    fn script(senders: u64, msgs: u64) -> Vec<Announce> {
        let mut out = Vec::new();
        for s in 1..=senders {
            let mut seq = 0;
            for m in 1..=msgs {
                // Ids are reused (1, 2, 1, 2, ...): ordering is by seq, not by id.
                let id = m % 2 + 1;
                seq += 1;
                out.push(ann(s, seq, Phase::Start, id));
                seq += 1;
                out.push(ann(s, seq, Phase::End, id));
            }
        }
        out
    }

    fn check_invariants(s: &Auss<u32>) {
        let members: Vec<_> = s.members().collect();
        assert_eq!(s.n() as usize, members.len());
        assert_eq!(s.omega(), members.iter().map(|m| m.1).sum::<f64>());
    }

    proptest! {
        /// Any interleaving, duplication and reordering of the announcements: counts stay
        /// consistent, epochs only grow and move exactly when N changes, and once every END has
        /// been delivered N is 0.
        #[test]
        fn any_delivery_order_ends_empty(
            senders in 1u64..5,
            msgs in 1u64..5,
            picks in proptest::collection::vec(any::<prop::sample::Index>(), 0..60),
            perm_seed in any::<u64>(),
        ) {
            let base = script(senders, msgs);
            let mut deliveries: Vec<Announce> = base.clone();
            for p in &picks {
                deliveries.push(*p.get(&base));
            }
            // Fisher–Yates with a tiny LCG so the permutation is a function of the seed.
            let mut x = perm_seed | 1;
            for i in (1..deliveries.len()).rev() {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                let j = (x >> 33) as usize % (i + 1);
                deliveries.swap(i, j);
            }
            let mut s = auss();
            let mut last = (s.epoch(), s.n());
            for (t, a) in deliveries.iter().enumerate() {
                let out = s.on_announce(Duration::from_micros(t as u64), a.sender as u32, a);
                check_invariants(&s);
                let (e, n) = (s.epoch(), s.n());
                prop_assert!(e >= last.0);
                prop_assert_eq!(e != last.0, n != last.1);
                let others = s.members().any(|m| m.0 != a.sender);
                prop_assert_eq!(!pushes(&out).is_empty(), e != last.0 && others);
                prop_assert!(n as u64 <= senders);
                last = (e, n);
            }
            prop_assert_eq!(s.n(), 0);
            prop_assert_eq!(s.omega(), 0.0);
        }

        /// Delivered in order with arbitrary duplicates, N always equals the number of senders
        /// with an open message.
        #[test]
        fn in_order_with_duplicates_matches_the_model(
            ops in proptest::collection::vec((0u64..4, 0u64..3, any::<bool>(), 1usize..3), 0..80),
        ) {
            let mut s = auss();
            let mut open: BTreeMap<u64, BTreeSet<u64>> = BTreeMap::new();
            let mut seq: BTreeMap<u64, u64> = BTreeMap::new();
            for (t, (sender, msg, start, copies)) in ops.into_iter().enumerate() {
                let q = seq.entry(sender).or_insert(0);
                *q += 1;
                let phase = if start { Phase::Start } else { Phase::End };
                let a = ann(sender, *q, phase, msg);
                for _ in 0..copies {
                    s.on_announce(Duration::from_millis(t as u64), sender as u32, &a);
                }
                let o = open.entry(sender).or_default();
                // In order, the last announcement of a message id decides (ids may be reused).
                if start {
                    o.insert(msg);
                } else {
                    o.remove(&msg);
                }
                let model = open.values().filter(|o| !o.is_empty()).count();
                prop_assert_eq!(s.n() as usize, model);
                check_invariants(&s);
            }
        }

        /// However senders go quiet, after `expiry` with no traffic the set is empty and the
        /// records are gone.
        #[test]
        fn everything_expires(
            ops in proptest::collection::vec((0u64..6, 0u64..3, any::<bool>(), 0u64..3000), 0..40),
        ) {
            let mut s = auss();
            let mut now = Duration::ZERO;
            for (i, (sender, msg, start, dt)) in ops.into_iter().enumerate() {
                now += Duration::from_millis(dt);
                s.tick(now);
                let phase = if start { Phase::Start } else { Phase::End };
                s.on_announce(now, sender as u32, &ann(sender, i as u64 + 1, phase, msg));
                if let Some(d) = s.next_deadline() {
                    prop_assert!(d > now);
                }
            }
            let deadline = now + s.config().expiry;
            s.tick(deadline);
            prop_assert_eq!(s.n(), 0);
            prop_assert_eq!(s.next_deadline(), None);
        }
    }
}
