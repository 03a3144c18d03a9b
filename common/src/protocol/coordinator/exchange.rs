//! Selection exchanges: when one is due, the `Select` (or priced `Restart`) sent to every
//! member, the floor check that decides each proposal's verdict, and the new active sets put
//! in force.

use super::*;
use crate::protocol::wire::HostProposal;

/// A pair's `(facility, b_f·x_min)` list in a proposal, if the host proposes that change.
type FloorUse = Option<Vec<(u32, f64)>>;

/// What a member proposed: its own swap, or a relay's, one per agent behind it.
#[derive(Clone, Debug)]
pub(super) enum Proposed {
    Host(ProposalMsg),
    Rack(Vec<HostProposal>),
}

impl Proposed {
    fn len(&self) -> usize {
        match self {
            Proposed::Host(_) => 1,
            Proposed::Rack(h) => h.len(),
        }
    }

    /// The `i`-th host's park and activation.
    fn swap(&self, i: usize) -> (&FloorUse, &FloorUse) {
        match self {
            Proposed::Host(p) => (&p.park, &p.activate),
            Proposed::Rack(h) => (&h[i].park, &h[i].activate),
        }
    }
}

impl Coordinator {
    /// Whether the schedule, or re-selection after it, calls for a selection exchange now
    /// (between two rounds).
    pub(super) fn exchange_due(&self, now: Duration) -> bool {
        let sel = &self.cfg.selection;
        let next = self.exchange_next;
        // Shards see only their own residuals and must select at the same iteration, so
        // a sharded coordinator selects every `iters_per_round` iterations, without the
        // early stop on convergence.
        let converged = self.cfg.shard.count == 1
            && self.residuals.primal <= sel.eps_primal
            && self.residuals.dual <= sel.eps_dual;
        if next == 0 {
            sel.priced_start && self.iters_since >= sel.iters_per_round
        } else if next <= sel.rounds {
            self.iters_since >= sel.iters_per_round || (self.iters_since >= 1 && converged)
        } else {
            self.reselect
                .due(now, self.iteration, self.iters_since, converged)
        }
    }

    /// An agent's apps changed: it asks for an exchange at `iteration` (its last + 1). A
    /// number beyond the next round (an agent that stepped with a coordinator that counted
    /// further before a restart) is served at the next round rather than waited for.
    pub(super) fn reselect_request(
        &mut self,
        from: MemberId,
        iteration: u64,
        out: &mut Vec<Action>,
    ) {
        let Some(m) = self.members.get(&from) else {
            self.violation(from, "re-selection request before join".into(), out);
            return;
        };
        let iteration = iteration.min(self.iteration.max(self.sent_iteration) + 1);
        let host = m.host.clone();
        let taken = self.reselect.request(iteration);
        self.counters.reselect_requests += 1;
        out.push(Action::Event(Event::ReselectRequested {
            member: from,
            host,
            iteration,
            taken,
        }));
    }

    pub(super) fn start_exchange(&mut self, now: Duration, out: &mut Vec<Action>) {
        let sel = &self.cfg.selection;
        if self.exchange_next > sel.rounds {
            // With shards, periodic exchanges are numbered by their iteration (see
            // `Reselection::sharded_index`); never below the next number, never reused.
            if let Some(i) = self.reselect.sharded_index(sel.exchanges(), self.iteration) {
                self.exchange_next = self.exchange_next.max(i);
            }
        }
        let index = self.exchange_next;
        let phase = if index == 0 {
            let prices: Vec<(u32, f64)> = (0..self.facilities.len() as u32)
                .filter(|&f| self.owned[f as usize])
                .map(|f| (f, self.admm.price(f)))
                .collect();
            for &id in self.members.keys() {
                out.push(Action::Send(
                    id,
                    CoordMsg::Restart {
                        exchange: index,
                        prices: prices.clone(),
                    },
                ));
            }
            ExchangePhase::Apply
        } else {
            for (&id, m) in &self.members {
                let prices = m
                    .interest
                    .iter()
                    .map(|&f| (f, self.admm.price(f)))
                    .collect();
                out.push(Action::Send(
                    id,
                    CoordMsg::Select {
                        exchange: index,
                        round: index - 1,
                        prices,
                        options: self.cfg.selection.options,
                    },
                ));
            }
            ExchangePhase::Propose
        };
        self.reselect.started(self.iteration);
        out.push(Action::Event(Event::SelectionStarted {
            exchange: index,
            round: index.checked_sub(1),
            iteration: self.iteration,
        }));
        self.exchange = Some(Exchange {
            index,
            phase,
            started: now,
            waiting: self.members.keys().copied().collect(),
            proposals: BTreeMap::new(),
            parks: 0,
            activations: 0,
            refused: 0,
        });
    }

    /// Every member answered the exchange's current phase: decide the verdicts, or put the new
    /// active sets in force.
    pub(super) fn exchange_step(&mut self, now: Duration, out: &mut Vec<Action>) {
        let mut x = self.exchange.take().expect("an exchange in progress");
        match x.phase {
            ExchangePhase::Propose => {
                // The floor check of the in-process solver's `apply_swaps`: hosts in instance
                // order, a park frees its floor at once, an activation is accepted only if its
                // facility still carries every member at x_min. Facilities are independent,
                // so a shard owning some of them decides exactly as one process would.
                let mut floor = vec![0.0; self.facilities.len()];
                let mut order: Vec<(u32, MemberId)> =
                    self.members.iter().map(|(&id, m)| (m.rank, id)).collect();
                order.sort_unstable();
                for &(_, id) in &order {
                    for &(f, v) in &self.members[&id].floor {
                        floor[f as usize] += v;
                    }
                }
                // Every host's proposal in rank order, a relay's agents at their own ranks,
                // so a rack is decided exactly as its hosts would be if wired directly.
                let mut queue: Vec<(u32, MemberId, usize)> = Vec::new();
                for (&id, p) in &x.proposals {
                    match p {
                        Proposed::Host(_) => queue.push((self.members[&id].rank, id, 0)),
                        Proposed::Rack(hosts) => {
                            queue.extend(hosts.iter().enumerate().map(|(i, h)| (h.rank, id, i)))
                        }
                    }
                }
                queue.sort_unstable();
                let mut verdicts: BTreeMap<MemberId, Vec<bool>> = x
                    .proposals
                    .iter()
                    .map(|(&id, p)| (id, vec![false; p.len()]))
                    .collect();
                for &(_, id, i) in &queue {
                    let (park, activate) = x.proposals[&id].swap(i);
                    if let Some(park) = park {
                        for &(f, need) in park {
                            floor[f as usize] -= need;
                        }
                        x.parks += 1;
                    }
                    if let Some(activate) = activate {
                        let fits = activate.iter().all(|&(f, need)| {
                            floor[f as usize] + need <= self.facilities[f as usize].capacity
                        });
                        if fits {
                            for &(f, need) in activate {
                                floor[f as usize] += need;
                            }
                            verdicts.get_mut(&id).expect("every proposer")[i] = true;
                            x.activations += 1;
                        } else {
                            x.refused += 1;
                        }
                    }
                }
                for &(_, id) in &order {
                    let Some(v) = verdicts.remove(&id) else {
                        continue;
                    };
                    let msg = match x.proposals[&id] {
                        Proposed::Host(_) => CoordMsg::Verdict {
                            exchange: x.index,
                            activate: v[0],
                        },
                        Proposed::Rack(_) => CoordMsg::RackVerdicts {
                            exchange: x.index,
                            activate: v,
                        },
                    };
                    out.push(Action::Send(id, msg));
                }
                x.waiting = x.proposals.keys().copied().collect();
                x.phase = ExchangePhase::Apply;
                self.exchange = Some(x);
                if self.exchange.as_ref().is_some_and(|x| x.waiting.is_empty()) {
                    self.exchange_step(now, out);
                }
            }
            ExchangePhase::Apply => {
                let counts = self.counts();
                let sums = self.sums();
                if x.index == 0 {
                    // The priced restart re-runs the cold start on the new sets, as `solve`
                    // builds a new engine for them.
                    self.admm = self.fresh_admm();
                    self.admm.set_counts(&counts);
                    self.residuals = self.admm.update(&self.facilities, &sums, None);
                } else {
                    self.admm.set_counts(&counts);
                    self.admm.set_sums(&sums);
                }
                self.exchange_next = x.index + 1;
                self.iters_since = 0;
                self.reselect.finished(now);
                self.counters.exchanges += 1;
                self.counters.parks += x.parks as u64;
                self.counters.activations += x.activations as u64;
                self.counters.refused_activations += x.refused as u64;
                out.push(Action::Event(Event::SelectionDone {
                    exchange: x.index,
                    parks: x.parks,
                    activations: x.activations,
                    refused: x.refused,
                }));
            }
        }
    }

    /// Sorts out an exchange message's number: `Ok(true)` if it belongs to the exchange phase
    /// in progress and the member owes it, `Ok(false)` if it is stale (ignored).
    pub(super) fn exchange_message(
        &self,
        from: MemberId,
        exchange: u32,
        phase: ExchangePhase,
    ) -> Result<bool, String> {
        match &self.exchange {
            Some(x) if x.index == exchange => Ok(x.phase == phase && x.waiting.contains(&from)),
            Some(x) if exchange > x.index => Err(format!(
                "answer to selection exchange {exchange} from the future"
            )),
            None if exchange >= self.exchange_next => Err(format!(
                "answer to selection exchange {exchange} from the future"
            )),
            _ => Ok(false),
        }
    }

    pub(super) fn proposal(
        &mut self,
        from: MemberId,
        exchange: u32,
        p: Proposed,
        out: &mut Vec<Action>,
    ) {
        if !self.members.contains_key(&from) {
            self.violation(from, "proposal before join".into(), out);
            return;
        }
        let nf = self.facilities.len() as u32;
        let owned = &self.owned;
        let bad = |e: &FloorUse| {
            !crate::protocol::wire::floor_use_ok(e, nf)
                || e.iter().flatten().any(|&(f, _)| !owned[f as usize])
        };
        if (0..p.len()).any(|i| {
            let (park, activate) = p.swap(i);
            bad(park) || bad(activate)
        }) {
            self.violation(from, format!("bad proposal {p:?}"), out);
            return;
        }
        match self.exchange_message(from, exchange, ExchangePhase::Propose) {
            Err(e) => self.violation(from, e, out),
            Ok(false) => {}
            Ok(true) => {
                let x = self.exchange.as_mut().expect("checked");
                x.waiting.remove(&from);
                x.proposals.insert(from, p);
            }
        }
    }

    pub(super) fn selected(&mut self, from: MemberId, sel: SelectedMsg, out: &mut Vec<Action>) {
        if !self.members.contains_key(&from) {
            self.violation(from, "selection before join".into(), out);
            return;
        }
        if let Err(e) = self
            .check_active(&sel.pairs, &sel.floor)
            .and_then(|()| self.check_entries(&sel.entries))
        {
            self.violation(from, e, out);
            return;
        }
        match self.exchange_message(from, sel.exchange, ExchangePhase::Apply) {
            Err(e) => self.violation(from, e, out),
            Ok(false) => {}
            Ok(true) => {
                let iteration = self.iteration;
                let m = self.members.get_mut(&from).expect("checked");
                m.pairs = sel.pairs;
                m.floor = sel.floor;
                m.entries = sel.entries;
                // Older contributions still in flight are now duplicates, not news.
                m.entries_iteration = m.entries_iteration.max(iteration);
                m.exchanges = sel.exchange + 1;
                m.stale = 0;
                self.exchange
                    .as_mut()
                    .expect("checked")
                    .waiting
                    .remove(&from);
            }
        }
    }
}
