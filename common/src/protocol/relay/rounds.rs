//! The relay's rounds ([`super::Relay`]): a `Round` goes down with each agent's own
//! facilities, and one `Contribution` with the rack's sums goes up when every agent has
//! answered or the stragglers' last contributions may be reused.

use super::*;

impl Relay {
    pub(super) fn round_down(
        &mut self,
        now: Duration,
        epoch: u64,
        iteration: u64,
        d: Vec<FacilityTerm>,
        out: &mut Vec<RelayAction>,
    ) {
        let Upstream::Member {
            epoch: e,
            iteration: i,
            ..
        } = &mut self.up
        else {
            return;
        };
        *e = (*e).max(epoch);
        *i = (*i).max(iteration);
        let mut waiting = BTreeSet::new();
        for (&id, a) in self.agents.iter().filter(|(_, a)| a.welcomed) {
            let mine: Option<Vec<FacilityTerm>> = a
                .pairs
                .iter()
                .map(|&(f, _)| {
                    d.binary_search_by_key(&f, |t| t.facility)
                        .ok()
                        .map(|k| d[k])
                })
                .collect();
            // A round sent before the coordinator heard of this agent's facilities (its
            // `Update` is on its way, and starts a new epoch): the agent sits it out.
            if let Some(mine) = mine {
                waiting.insert(id);
                out.push(RelayAction::Down(
                    id,
                    CoordMsg::Round {
                        epoch,
                        iteration,
                        d: mine,
                    },
                ));
            }
        }
        self.sent = self.sent.max((epoch, iteration));
        self.round = Some(Round {
            epoch,
            iteration,
            started: now,
            waiting,
        });
        self.maybe_complete(now, 0, out);
    }

    pub(super) fn maybe_complete(
        &mut self,
        now: Duration,
        stale: usize,
        out: &mut Vec<RelayAction>,
    ) {
        if self.round.as_ref().is_some_and(|r| r.waiting.is_empty()) {
            let r = self.round.take().expect("checked");
            let entries = sum(self.agents.values().map(|a| a.entries.iter().copied()));
            out.push(RelayAction::Up(AgentMsg::Contribution(ContributionMsg {
                epoch: r.epoch,
                iteration: r.iteration,
                entries,
            })));
            out.push(RelayAction::Event(RelayEvent::RoundUp {
                iteration: r.iteration,
                stale,
                took: now.saturating_sub(r.started),
            }));
        }
    }

    pub(super) fn contribution(
        &mut self,
        now: Duration,
        from: MemberId,
        c: ContributionMsg,
        out: &mut Vec<RelayAction>,
    ) {
        if let Err(e) = check_usage("contribution entries", &c.entries, self.nf) {
            self.violation(from, e, out);
            return;
        }
        if (c.epoch, c.iteration) > self.sent {
            self.violation(
                from,
                format!(
                    "contribution for epoch {} iteration {} from the future",
                    c.epoch, c.iteration
                ),
                out,
            );
            return;
        }
        let for_round = self.round.as_ref().is_some_and(|r| {
            r.epoch == c.epoch && r.iteration == c.iteration && r.waiting.contains(&from)
        });
        let a = self.agents.get_mut(&from).expect("a member");
        if for_round {
            a.entries = c.entries;
            a.entries_iteration = c.iteration;
            a.stale = 0;
            self.round.as_mut().expect("checked").waiting.remove(&from);
            self.maybe_complete(now, 0, out);
        } else if c.iteration > a.entries_iteration {
            // Late but newer than what the relay holds: the freshest word on this host.
            a.entries = c.entries;
            a.entries_iteration = c.iteration;
        }
    }
}
