//! The relay's part of a selection exchange ([`super::Relay`]): a `Select` or `Restart` goes
//! down to every agent, their proposals go up as one `RackProposals`, the coordinator's
//! `RackVerdicts` go down as each agent's `Verdict`, and their `Selected` go up as one.

use super::*;

impl Relay {
    /// A `Select` (then `phase` is `Propose`) or `Restart` (`Apply`) from the coordinator:
    /// `msg` for each welcomed agent.
    pub(super) fn select_down(
        &mut self,
        now: Duration,
        index: u32,
        phase: RackPhase,
        msg: impl Fn(&Agent) -> CoordMsg,
        out: &mut Vec<RelayAction>,
    ) {
        if !self.is_member() {
            return;
        }
        let mut waiting = BTreeSet::new();
        for (&id, a) in self.agents.iter().filter(|(_, a)| a.welcomed) {
            out.push(RelayAction::Down(id, msg(a)));
            waiting.insert(id);
        }
        self.sent_exchange = self.sent_exchange.max(Some(index));
        self.exchange = Some(RackExchange {
            index,
            phase,
            started: now,
            waiting,
            proposals: BTreeMap::new(),
            order: Vec::new(),
        });
        self.exchange_progress(out);
    }

    /// The coordinator's verdicts on the rack's proposals: each to its agent.
    pub(super) fn verdicts_down(
        &mut self,
        now: Duration,
        index: u32,
        activate: Vec<bool>,
        out: &mut Vec<RelayAction>,
    ) {
        let Some(x) = self
            .exchange
            .as_mut()
            .filter(|x| x.index == index && x.phase == RackPhase::Verdicts)
        else {
            out.push(self.unsupported(format!(
                "selection exchange {index}: verdicts for no proposals of this relay; ignored"
            )));
            return;
        };
        if activate.len() != x.order.len() {
            let reason = format!(
                "selection exchange {index}: {} verdicts for {} proposals",
                activate.len(),
                x.order.len()
            );
            out.extend(self.on_upstream_lost(now, &reason));
            out.push(RelayAction::CloseUp(reason));
            return;
        }
        x.phase = RackPhase::Apply;
        x.started = now;
        for (&id, activate) in x.order.iter().zip(activate) {
            // An agent gone since it proposed: the coordinator hears of it by the `Update`.
            if self.agents.contains_key(&id) {
                x.waiting.insert(id);
                out.push(RelayAction::Down(
                    id,
                    CoordMsg::Verdict {
                        exchange: index,
                        activate,
                    },
                ));
            }
        }
        self.exchange_progress(out);
    }

    /// Sends a phase's answers up once every agent still in the exchange has given its own.
    pub(super) fn exchange_progress(&mut self, out: &mut Vec<RelayAction>) {
        let Some(x) = self.exchange.as_mut().filter(|x| x.waiting.is_empty()) else {
            return;
        };
        match x.phase {
            RackPhase::Propose => {
                let proposals = std::mem::take(&mut x.proposals);
                let mut hosts = Vec::new();
                for (id, p) in proposals {
                    if let Some(a) = self.agents.get(&id) {
                        x.order.push(id);
                        hosts.push(HostProposal {
                            rank: a.rank,
                            park: p.park,
                            activate: p.activate,
                        });
                    }
                }
                x.phase = RackPhase::Verdicts;
                out.push(RelayAction::Event(RelayEvent::ExchangeUp {
                    exchange: x.index,
                    proposals: Some(hosts.len()),
                }));
                out.push(RelayAction::Up(AgentMsg::RackProposals(RackProposalsMsg {
                    exchange: x.index,
                    hosts,
                })));
            }
            RackPhase::Verdicts => {}
            RackPhase::Apply => {
                let exchange = x.index;
                self.exchange = None;
                let j = self.aggregate();
                out.push(RelayAction::Event(RelayEvent::ExchangeUp {
                    exchange,
                    proposals: None,
                }));
                out.push(RelayAction::Up(AgentMsg::Selected(SelectedMsg {
                    exchange,
                    pairs: j.pairs,
                    floor: j.floor,
                    entries: j.entries,
                })));
            }
        }
    }

    /// Where an agent's answer to exchange `index` belongs: `Ok(true)` if the phase in
    /// progress is `phase` and the agent owes it, `Ok(false)` if it is stale (ignored), an
    /// error for an exchange never sent.
    pub(super) fn exchange_answer(
        &self,
        from: MemberId,
        index: u32,
        phase: RackPhase,
    ) -> Result<bool, String> {
        if self.sent_exchange.is_none_or(|s| index > s) {
            return Err(format!("answer to selection exchange {index}, never sent"));
        }
        Ok(self
            .exchange
            .as_ref()
            .is_some_and(|x| x.index == index && x.phase == phase && x.waiting.contains(&from)))
    }

    pub(super) fn proposal(&mut self, from: MemberId, p: ProposalMsg, out: &mut Vec<RelayAction>) {
        if !floor_use_ok(&p.park, self.nf) || !floor_use_ok(&p.activate, self.nf) {
            // Checked here, so that one agent's bad proposal costs the coordinator nothing
            // and does not close the rack.
            self.violation(from, format!("bad proposal {p:?}"), out);
            return;
        }
        match self.exchange_answer(from, p.exchange, RackPhase::Propose) {
            Err(e) => self.violation(from, e, out),
            Ok(false) => {}
            Ok(true) => {
                let x = self.exchange.as_mut().expect("checked");
                x.waiting.remove(&from);
                x.proposals.insert(from, p);
                self.exchange_progress(out);
            }
        }
    }

    pub(super) fn selected(
        &mut self,
        from: MemberId,
        sel: SelectedMsg,
        out: &mut Vec<RelayAction>,
    ) {
        let checked = sel.check_shape(self.nf);
        if let Err(e) = checked {
            self.violation(from, e, out);
            return;
        }
        match self.exchange_answer(from, sel.exchange, RackPhase::Apply) {
            Err(e) => self.violation(from, e, out),
            Ok(false) => {}
            Ok(true) => {
                let iteration = self.sent.1;
                let a = self.agents.get_mut(&from).expect("a member");
                a.pairs = sel.pairs;
                a.floor = sel.floor;
                a.entries = sel.entries;
                // Older contributions still in flight are now duplicates, not news.
                a.entries_iteration = a.entries_iteration.max(iteration);
                a.exchanges = sel.exchange + 1;
                a.stale = 0;
                self.exchange
                    .as_mut()
                    .expect("checked")
                    .waiting
                    .remove(&from);
                self.exchange_progress(out);
            }
        }
    }

    /// How long an agent may take over one phase of a selection exchange: a third of the
    /// member timeout, so that both of its phases end before the coordinator, which gives
    /// the relay the member timeout for the whole exchange, drops the rack.
    pub(super) fn exchange_deadline(&self) -> Duration {
        self.cfg.member_timeout / 3
    }
}
