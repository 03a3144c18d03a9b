use super::*;
use crate::generator::{generate, GeneratorConfig};
use crate::model::Problem;
use crate::protocol::agent::{AgentAction, AgentCore};
use crate::protocol::coordinator::{Action, Coordinator, CoordinatorConfig, SelectionSchedule};
use crate::protocol::facility_digest;
use crate::solver::{default_rho, fixed_set_trace, Algorithm};
use proptest::prelude::*;

const MS: Duration = Duration::from_millis(1);

fn cfg(min_agents: usize) -> RelayConfig {
    RelayConfig {
        host: "relay-a".into(),
        facility_digest: 7,
        facilities: 4,
        live: false,
        heartbeat_interval: 100 * MS,
        member_timeout: 1000 * MS,
        upstream_timeout: 1000 * MS,
        round_deadline: 40 * MS,
        max_staleness: 1,
        min_agents,
        backoff_min: 10 * MS,
        backoff_max: 100 * MS,
    }
}

fn join(host: &str, pairs: Vec<(u32, u32)>, entries: Vec<(u32, f64)>) -> AgentMsg {
    AgentMsg::Join(Join {
        host: host.into(),
        facility_digest: 7,
        interest: pairs.iter().map(|p| p.0).collect(),
        floor: pairs.iter().map(|p| (p.0, 0.001)).collect(),
        pairs,
        entries,
        last_iteration: 0,
        last_d: Vec::new(),
        rank: 0,
        exchanges: 0,
    })
}

fn contrib(epoch: u64, iteration: u64, entries: Vec<(u32, f64)>) -> AgentMsg {
    AgentMsg::Contribution(ContributionMsg {
        epoch,
        iteration,
        entries,
    })
}

fn ups(out: &[RelayAction]) -> Vec<AgentMsg> {
    out.iter()
        .filter_map(|a| match a {
            RelayAction::Up(m) => Some(m.clone()),
            _ => None,
        })
        .collect()
}

fn downs(out: &[RelayAction]) -> Vec<(MemberId, CoordMsg)> {
    out.iter()
        .filter_map(|a| match a {
            RelayAction::Down(id, m) => Some((*id, m.clone())),
            _ => None,
        })
        .collect()
}

fn closed(out: &[RelayAction]) -> Vec<MemberId> {
    out.iter()
        .filter_map(|a| match a {
            RelayAction::CloseDown(id, _) => Some(*id),
            _ => None,
        })
        .collect()
}

fn expired(out: &[RelayAction]) -> Vec<MemberId> {
    out.iter()
        .filter_map(|a| match a {
            RelayAction::ExpireDown(id) => Some(*id),
            _ => None,
        })
        .collect()
}

fn welcome(epoch: u64, iteration: u64) -> CoordMsg {
    CoordMsg::Welcome {
        epoch,
        iteration,
        heartbeat_ms: 100,
        shard: Shard::WHOLE,
    }
}

fn term(facility: u32, d: f64) -> FacilityTerm {
    FacilityTerm {
        facility,
        d,
        rho: 1.0,
    }
}

/// A relay with agents 1 (facilities 0, 1) and 2 (facilities 1, 2), a member upstream.
fn two_agent_relay() -> Relay {
    let mut r = Relay::new(cfg(2));
    assert!(r.connect_due(Duration::ZERO));
    assert!(r.on_upstream_connected(Duration::ZERO).is_empty());
    let out = r.on_agent(
        MS,
        1,
        join("h1", vec![(0, 1), (1, 2)], vec![(0, 0.5), (1, 1.0)]),
    );
    assert!(ups(&out).is_empty(), "waits for min_agents");
    let out = r.on_agent(
        MS,
        2,
        join("h2", vec![(1, 1), (2, 1)], vec![(1, 0.25), (2, 2.0)]),
    );
    let AgentMsg::Join(j) = &ups(&out)[0] else {
        panic!("{out:?}")
    };
    assert_eq!(j.host, "relay-a");
    assert_eq!(j.pairs, vec![(0, 1), (1, 3), (2, 1)]);
    assert_eq!(j.entries, vec![(0, 0.5), (1, 1.25), (2, 2.0)]);
    assert_eq!(j.interest, vec![0, 1, 2]);
    let out = r.on_upstream(2 * MS, welcome(3, 10));
    let w = downs(&out);
    assert_eq!(w.len(), 2);
    assert!(w.iter().all(|(_, m)| *m == welcome(3, 10)));
    assert!(ups(&out).is_empty(), "nothing changed since the join");
    r
}

#[test]
fn a_round_goes_down_with_each_agents_terms_and_up_as_one_sum() {
    let mut r = two_agent_relay();
    let d = vec![term(0, 0.1), term(1, 0.2), term(2, 0.3)];
    let out = r.on_upstream(
        3 * MS,
        CoordMsg::Round {
            epoch: 3,
            iteration: 11,
            d,
        },
    );
    let mut rounds = downs(&out);
    rounds.sort_by_key(|r| r.0);
    assert_eq!(
        rounds,
        vec![
            (
                1,
                CoordMsg::Round {
                    epoch: 3,
                    iteration: 11,
                    d: vec![term(0, 0.1), term(1, 0.2)]
                }
            ),
            (
                2,
                CoordMsg::Round {
                    epoch: 3,
                    iteration: 11,
                    d: vec![term(1, 0.2), term(2, 0.3)]
                }
            ),
        ]
    );
    assert!(ups(&r.on_agent(4 * MS, 1, contrib(3, 11, vec![(0, 0.75), (1, 0.5)]))).is_empty());
    let out = r.on_agent(5 * MS, 2, contrib(3, 11, vec![(1, 0.5), (2, 1.0)]));
    assert_eq!(
        ups(&out),
        vec![contrib(3, 11, vec![(0, 0.75), (1, 1.0), (2, 1.0)])]
    );
    // A repeat changes nothing; a number never sent is a violation.
    assert!(ups(&r.on_agent(6 * MS, 2, contrib(3, 11, vec![(1, 9.0)]))).is_empty());
    let out = r.on_agent(7 * MS, 2, contrib(3, 12, vec![(1, 9.0)]));
    assert_eq!(closed(&out), vec![2]);
}

/// An agent that leaves or dies mid-round: the coordinator hears the rack's new sums at once
/// (without the departed host, as it would drop a departed host's contribution), which starts
/// a new epoch there; the abandoned round's answers are kept as the agents' latest.
#[test]
fn an_agent_leaving_mid_round_updates_the_coordinator_at_once() {
    let mut r = two_agent_relay();
    let d = vec![term(0, 0.1), term(1, 0.2), term(2, 0.3)];
    r.on_upstream(
        3 * MS,
        CoordMsg::Round {
            epoch: 3,
            iteration: 11,
            d,
        },
    );
    r.on_agent(4 * MS, 1, contrib(3, 11, vec![(0, 0.75), (1, 0.5)]));
    let out = r.on_agent(5 * MS, 2, AgentMsg::Leave);
    let up = ups(&out);
    assert_eq!(up.len(), 1, "{out:?}");
    let AgentMsg::Update(u) = &up[0] else {
        panic!("{up:?}")
    };
    assert_eq!(u.pairs, vec![(0, 1), (1, 2)]);
    assert_eq!(u.entries, vec![(0, 0.75), (1, 0.5)]);
    assert_eq!(r.agents(), 1);

    // A silent agent (killed): dropped after the member timeout, with the same update.
    let d = vec![term(0, 0.1), term(1, 0.2)];
    r.on_upstream(
        10 * MS,
        CoordMsg::Round {
            epoch: 4,
            iteration: 12,
            d,
        },
    );
    r.on_upstream(1090 * MS, CoordMsg::HeartbeatAck { seq: 1 });
    let out = r.tick(1100 * MS);
    assert_eq!(expired(&out), vec![1], "expired, not closed as a violation");
    assert!(closed(&out).is_empty(), "{out:?}");
    let AgentMsg::Update(u) = &ups(&out)[0] else {
        panic!("{out:?}")
    };
    assert!(u.pairs.is_empty() && u.entries.is_empty());
}

#[test]
fn stragglers_are_reused_up_to_the_bound_then_waited_for() {
    let mut r = two_agent_relay();
    let round = |it| CoordMsg::Round {
        epoch: 3,
        iteration: it,
        d: vec![term(0, 0.1), term(1, 0.2), term(2, 0.3)],
    };
    r.on_upstream(10 * MS, round(11));
    r.on_agent(11 * MS, 1, contrib(3, 11, vec![(0, 1.0)]));
    assert!(
        !ups(&r.tick(30 * MS))
            .iter()
            .any(|m| matches!(m, AgentMsg::Contribution(_))),
        "before the deadline"
    );
    // Agent 2's join entries stand in for it once.
    assert_eq!(
        ups(&r.tick(50 * MS)),
        vec![contrib(3, 11, vec![(0, 1.0), (1, 0.25), (2, 2.0)])]
    );
    r.on_upstream(60 * MS, round(12));
    r.on_agent(61 * MS, 1, contrib(3, 12, vec![(0, 2.0)]));
    // Reused once already (max_staleness 1): the round waits.
    assert!(!ups(&r.tick(200 * MS))
        .iter()
        .any(|m| matches!(m, AgentMsg::Contribution(_))));
    let out = r.on_agent(210 * MS, 2, contrib(3, 12, vec![(2, 1.0)]));
    assert_eq!(ups(&out), vec![contrib(3, 12, vec![(0, 2.0), (2, 1.0)])]);
}

/// The relay loses the coordinator: every agent's connection closes (they fail static), joins
/// are refused while it is away, and once it is back the agents rejoin through the relay.
#[test]
fn losing_the_coordinator_fails_the_rack_static_until_it_returns() {
    let mut r = two_agent_relay();
    let out = r.on_upstream_lost(100 * MS, "connection lost");
    assert!(out.iter().any(|a| matches!(
        a,
        RelayAction::Event(RelayEvent::UpstreamLost {
            agents: 2,
            joined: true,
            ..
        })
    )));
    let mut c = closed(&out);
    c.sort();
    assert_eq!(c, vec![1, 2]);
    assert_eq!(r.agents(), 0);
    assert!(!r.connect_due(100 * MS));
    let out = r.on_agent(101 * MS, 3, join("h1", vec![(0, 1)], vec![(0, 0.5)]));
    assert!(matches!(downs(&out)[0].1, CoordMsg::Refused { .. }));
    assert_eq!(closed(&out), vec![3]);
    // Back off, reconnect, rejoin: the relay joins again once min_agents are in.
    assert!(r.connect_due(200 * MS));
    r.on_connect_failed(200 * MS);
    assert!(!r.connect_due(210 * MS));
    assert!(r.connect_due(300 * MS));
    r.on_upstream_connected(300 * MS);
    r.on_agent(301 * MS, 4, join("h1", vec![(0, 1)], vec![(0, 0.5)]));
    let out = r.on_agent(302 * MS, 5, join("h2", vec![(1, 1)], vec![(1, 0.5)]));
    assert!(matches!(ups(&out)[0], AgentMsg::Join(_)));
    let out = r.on_upstream(303 * MS, welcome(1, 11));
    assert_eq!(downs(&out).len(), 2);
    // A coordinator that goes silent is lost too.
    let out = r.tick(2000 * MS);
    assert_eq!(closed(&out).len(), 2);
    assert!(out.iter().any(|a| matches!(a, RelayAction::CloseUp(_))));
}

/// A relay up before its rack waits for it without taking the coordinator's silence (it has
/// asked nothing yet) for a loss; refusals back off.
#[test]
fn a_relay_waits_for_its_rack_and_backs_off_when_refused() {
    let mut r = Relay::new(cfg(2));
    r.on_upstream_connected(Duration::ZERO);
    assert_eq!(r.next_wakeup(), None);
    assert!(r.tick(10_000 * MS).is_empty());
    r.on_agent(10_001 * MS, 1, join("h1", vec![(0, 1)], vec![(0, 0.5)]));
    let out = r.on_agent(10_002 * MS, 2, join("h2", vec![(1, 1)], vec![(1, 0.5)]));
    assert!(matches!(ups(&out)[0], AgentMsg::Join(_)));
    let refused = CoordMsg::Refused {
        reason: "host relay-a is drained".into(),
    };
    let out = r.on_upstream(10_003 * MS, refused.clone());
    assert_eq!(closed(&out).len(), 2, "the rack fails static");
    assert!(!r.connect_due(10_020 * MS));
    assert!(r.connect_due(10_023 * MS));
    r.on_upstream_connected(10_023 * MS);
    r.on_agent(10_024 * MS, 3, join("h1", vec![(0, 1)], vec![(0, 0.5)]));
    r.on_agent(10_024 * MS, 4, join("h2", vec![(1, 1)], vec![(1, 0.5)]));
    r.on_upstream(10_025 * MS, refused);
    assert!(
        !r.connect_due(10_060 * MS),
        "the second refusal waits longer"
    );
    assert!(r.connect_due(10_065 * MS));
}

/// A rack that assembles more slowly than the coordinator's join timeout: the coordinator
/// closes the relay that has not joined, and the agents already waiting wait on, so the
/// rack's last agent completes it.
#[test]
fn agents_waiting_for_their_first_welcome_survive_a_lost_coordinator() {
    let mut r = Relay::new(cfg(3));
    r.on_upstream_connected(Duration::ZERO);
    r.on_agent(MS, 1, join("h1", vec![(0, 1)], vec![(0, 0.5)]));
    r.on_agent(2 * MS, 2, join("h2", vec![(1, 1)], vec![(1, 0.5)]));
    let out = r.on_upstream_lost(3_000 * MS, "no stream within 3s");
    assert!(closed(&out).is_empty(), "{out:?}");
    assert!(
        out.iter().any(|a| matches!(
            a,
            RelayAction::Event(RelayEvent::UpstreamLost {
                agents: 0,
                waiting: 2,
                joined: false,
                ..
            })
        )),
        "told apart from a loss (the driver logs it at INFO): {out:?}"
    );
    assert_eq!(r.agents(), 2);
    assert!(r.connect_due(3_020 * MS));
    r.on_upstream_connected(3_020 * MS);
    let out = r.on_agent(4_000 * MS, 3, join("h3", vec![(2, 1)], vec![(2, 0.5)]));
    let [AgentMsg::Join(j)] = &ups(&out)[..] else {
        panic!("{out:?}")
    };
    assert_eq!(j.pairs, vec![(0, 1), (1, 1), (2, 1)]);
    // Once welcomed, a lost coordinator fails them static.
    let out = r.on_upstream(4_001 * MS, welcome(1, 0));
    assert_eq!(downs(&out).len(), 3);
    assert_eq!(closed(&r.on_upstream_lost(5_000 * MS, "silent")).len(), 3);
}

#[test]
fn joins_are_checked_and_a_live_duplicate_is_refused() {
    let mut r = two_agent_relay();
    let mut bad = join("h3", vec![(0, 1)], vec![(0, 0.5)]);
    if let AgentMsg::Join(j) = &mut bad {
        j.facility_digest = 8;
    }
    assert_eq!(closed(&r.on_agent(3 * MS, 3, bad)), vec![3]);
    let out = r.on_agent(3 * MS, 4, join("h1", vec![(0, 1)], vec![(0, 0.5)]));
    assert_eq!(closed(&out), vec![4], "h1 is alive on connection 1");
    assert_eq!(
        closed(&r.on_agent(3 * MS, 5, contrib(3, 1, vec![]))),
        vec![5]
    );
}

fn select(exchange: u32, prices: Vec<(u32, f64)>) -> CoordMsg {
    CoordMsg::Select {
        exchange,
        round: exchange - 1,
        prices,
        options: crate::selection::SelectionOptions::default().into(),
    }
}

fn proposal(
    exchange: u32,
    park: Option<Vec<(u32, f64)>>,
    activate: Option<Vec<(u32, f64)>>,
) -> AgentMsg {
    AgentMsg::Proposal(ProposalMsg {
        exchange,
        park,
        activate,
    })
}

fn selected(exchange: u32, pairs: Vec<(u32, u32)>) -> AgentMsg {
    AgentMsg::Selected(SelectedMsg {
        exchange,
        floor: pairs.iter().map(|p| (p.0, 0.001)).collect(),
        entries: pairs.iter().map(|p| (p.0, 0.5)).collect(),
        pairs,
    })
}

#[test]
fn selection_passes_the_relay_host_by_host() {
    let mut r = two_agent_relay();
    // Each agent is sent the prices of its own facilities.
    let out = r.on_upstream(3 * MS, select(1, vec![(0, 0.1), (1, 0.2), (2, 0.3)]));
    let mut sent = downs(&out);
    sent.sort_by_key(|d| d.0);
    let prices: Vec<_> = sent
        .iter()
        .map(|(id, m)| match m {
            CoordMsg::Select { prices, .. } => (*id, prices.clone()),
            m => panic!("{m:?}"),
        })
        .collect();
    assert_eq!(
        prices,
        vec![(1, vec![(0, 0.1), (1, 0.2)]), (2, vec![(1, 0.2), (2, 0.3)])]
    );
    // Nothing goes up until both proposed; then one message, each agent at its rank.
    let out = r.on_agent(4 * MS, 2, proposal(1, None, Some(vec![(2, 0.001)])));
    assert!(ups(&out).is_empty());
    let out = r.on_agent(4 * MS, 1, proposal(1, Some(vec![(0, 0.001)]), None));
    let [AgentMsg::RackProposals(p)] = &ups(&out)[..] else {
        panic!("{out:?}")
    };
    assert_eq!(p.exchange, 1);
    assert_eq!(p.hosts.len(), 2);
    assert_eq!(p.hosts[0].park, Some(vec![(0, 0.001)]));
    assert_eq!(p.hosts[1].activate, Some(vec![(2, 0.001)]));
    // The verdicts go to their agents; their new sets go up as the rack's sums.
    let out = r.on_upstream(
        5 * MS,
        CoordMsg::RackVerdicts {
            exchange: 1,
            activate: vec![false, true],
        },
    );
    let mut v = downs(&out);
    v.sort_by_key(|d| d.0);
    assert_eq!(
        v,
        vec![
            (
                1,
                CoordMsg::Verdict {
                    exchange: 1,
                    activate: false
                }
            ),
            (
                2,
                CoordMsg::Verdict {
                    exchange: 1,
                    activate: true
                }
            ),
        ]
    );
    assert!(ups(&r.on_agent(6 * MS, 1, selected(1, vec![(1, 2)]))).is_empty());
    let out = r.on_agent(6 * MS, 2, selected(1, vec![(1, 1), (2, 2)]));
    let [AgentMsg::Selected(s)] = &ups(&out)[..] else {
        panic!("{out:?}")
    };
    assert_eq!((s.exchange, s.pairs.clone()), (1, vec![(1, 3), (2, 2)]));
    assert_eq!(s.entries, vec![(1, 1.0), (2, 0.5)]);
    // A late answer to a finished exchange is ignored; one to an exchange never sent is not.
    assert!(closed(&r.on_agent(7 * MS, 1, selected(1, vec![(1, 2)]))).is_empty());
    assert_eq!(
        closed(&r.on_agent(7 * MS, 1, proposal(9, None, None))),
        vec![1]
    );
    // Requests for re-selection go up as they came.
    let out = r.on_agent(8 * MS, 2, AgentMsg::Reselect { iteration: 12 });
    assert_eq!(ups(&out)[0], AgentMsg::Reselect { iteration: 12 });
}

#[test]
fn an_agent_silent_in_an_exchange_is_dropped_and_the_rack_answers_without_it() {
    let mut r = two_agent_relay();
    r.on_upstream(3 * MS, select(1, vec![(0, 0.1), (1, 0.2), (2, 0.3)]));
    assert!(ups(&r.on_agent(4 * MS, 1, proposal(1, None, None))).is_empty());
    // Agent 2 heartbeats but does not answer: at a third of the member timeout it goes.
    r.on_agent(300 * MS, 2, AgentMsg::Heartbeat { seq: 1 });
    assert!(r.next_wakeup().unwrap() <= 3 * MS + 1000 * MS / 3);
    let out = r.tick(3 * MS + 1000 * MS / 3);
    assert_eq!(closed(&out), vec![2]);
    let up = ups(&out);
    assert!(
        matches!(&up[0], AgentMsg::RackProposals(p) if p.hosts.len() == 1),
        "{up:?}"
    );
    assert!(matches!(&up[1], AgentMsg::Update(u) if u.pairs == vec![(0, 1), (1, 2)]));
    // Verdicts that do not match the proposals are the coordinator's fault: the relay leaves.
    let out = r.on_upstream(
        400 * MS,
        CoordMsg::RackVerdicts {
            exchange: 1,
            activate: vec![true, true],
        },
    );
    assert!(out.iter().any(|a| matches!(a, RelayAction::CloseUp(_))));
    assert_eq!(closed(&out), vec![1]);
}

#[test]
fn a_restart_goes_to_every_agent_and_a_bad_proposal_closes_only_its_agent() {
    let mut r = two_agent_relay();
    let prices = vec![(0, 0.1), (1, 0.2), (2, 0.3), (3, 0.4)];
    let out = r.on_upstream(
        3 * MS,
        CoordMsg::Restart {
            exchange: 0,
            prices: prices.clone(),
        },
    );
    assert_eq!(downs(&out).len(), 2);
    assert!(downs(&out)
        .iter()
        .all(|(_, m)| matches!(m, CoordMsg::Restart { prices: p, .. } if *p == prices)));
    r.on_agent(4 * MS, 1, selected(0, vec![(0, 2)]));
    let out = r.on_agent(4 * MS, 2, selected(0, vec![(2, 1)]));
    assert!(matches!(&ups(&out)[0], AgentMsg::Selected(s) if s.pairs == vec![(0, 2), (2, 1)]));
    r.on_upstream(5 * MS, select(1, vec![(0, 0.1), (1, 0.2), (2, 0.3)]));
    let out = r.on_agent(6 * MS, 2, proposal(1, None, Some(vec![(2, f64::NAN)])));
    assert_eq!(closed(&out), vec![2]);
    let out = r.on_agent(6 * MS, 1, proposal(1, None, None));
    assert!(
        matches!(&ups(&out)[0], AgentMsg::RackProposals(p) if p.hosts.len() == 1),
        "{out:?}"
    );
}

proptest! {
    /// Whatever the agents send, the coordinator gets exactly their per-facility sum.
    #[test]
    fn the_aggregate_is_the_sum_of_what_the_agents_sent(
        contribs in prop::collection::vec(
            prop::collection::btree_map(0u32..4, 0.0f64..1e3, 0..4), 1..8),
    ) {
        let mut r = Relay::new(cfg(contribs.len()));
        r.on_upstream_connected(Duration::ZERO);
        for (i, _) in contribs.iter().enumerate() {
            let all: Vec<(u32, u32)> = (0..4).map(|f| (f, 1)).collect();
            r.on_agent(MS, i as MemberId, join(&format!("h{i}"), all, vec![]));
        }
        r.on_upstream(MS, welcome(1, 0));
        let d = (0..4).map(|f| term(f, 0.0)).collect();
        r.on_upstream(MS, CoordMsg::Round { epoch: 1, iteration: 1, d });
        let mut up = Vec::new();
        for (i, c) in contribs.iter().enumerate() {
            let e = c.iter().map(|(&f, &v)| (f, v)).collect();
            up.extend(ups(&r.on_agent(MS, i as MemberId, contrib(1, 1, e))));
        }
        let mut want = [0.0f64; 4];
        let mut present = [false; 4];
        for c in &contribs {
            for (&f, &v) in c {
                want[f as usize] += v;
                present[f as usize] = true;
            }
        }
        let AgentMsg::Contribution(got) = &up[0] else { panic!("{up:?}") };
        prop_assert_eq!(up.len(), 1);
        let want: Vec<(u32, f64)> =
            (0..4).filter(|&f| present[f as usize]).map(|f| (f, want[f as usize])).collect();
        prop_assert_eq!(got.entries.len(), want.len());
        for (g, w) in got.entries.iter().zip(&want) {
            prop_assert_eq!(g.0, w.0);
            prop_assert!((g.1 - w.1).abs() <= 1e-9 * w.1.max(1.0));
        }
    }
}

/// Wires `coord` → two relays (hosts 0..3 behind the first, the rest behind the second) →
/// the agents of `problem` on its fixed active sets, and runs until no message is left.
fn run_behind_relays(problem: &Problem, coord: &mut Coordinator) -> Vec<AgentCore> {
    let digest = facility_digest(problem);
    let mut relays: Vec<Relay> = (0..2)
        .map(|i| {
            Relay::new(RelayConfig {
                host: format!("relay-{i}"),
                facility_digest: digest,
                facilities: problem.facilities.len() as u32,
                min_agents: 3,
                ..cfg(3)
            })
        })
        .collect();
    let active = crate::protocol::fixed_active_sets(problem);
    let mut agents = crate::protocol::test_agents(problem, &active);
    let now = Duration::ZERO;
    let relay_of = |h: usize| (h / 3).min(1);
    // Messages in flight: to the coordinator (from relay r), to relay r (from the coordinator
    // or from host h), to host h.
    enum Msg {
        Coord(usize, AgentMsg),
        RelayUp(usize, CoordMsg),
        RelayDown(usize, MemberId, AgentMsg),
        Agent(usize, CoordMsg),
    }
    let mut inbox: Vec<Msg> = Vec::new();
    for r in relays.iter_mut() {
        assert!(r.on_upstream_connected(now).is_empty());
    }
    // Join in reverse order: verdicts must follow the hosts' ranks, not arrival.
    for (h, a) in agents.iter_mut().enumerate().rev() {
        for act in a.on_connected(now, problem) {
            if let AgentAction::Send(m) = act {
                inbox.push(Msg::RelayDown(relay_of(h), h as MemberId, m));
            }
        }
    }
    let route_relay = |r: usize, out: Vec<RelayAction>, inbox: &mut Vec<Msg>| {
        for a in out {
            match a {
                RelayAction::Up(m) => inbox.push(Msg::Coord(r, m)),
                RelayAction::Down(h, m) => inbox.push(Msg::Agent(h as usize, m)),
                RelayAction::CloseDown(..)
                | RelayAction::ExpireDown(_)
                | RelayAction::CloseUp(_)
                | RelayAction::Event(RelayEvent::Unsupported(_)) => panic!("{a:?}"),
                RelayAction::Event(_) => {}
            }
        }
    };
    while !inbox.is_empty() {
        for msg in std::mem::take(&mut inbox) {
            match msg {
                Msg::Coord(r, m) => {
                    for a in coord.on_message(now, r as MemberId, m) {
                        if let Action::Send(to, m) = a {
                            inbox.push(Msg::RelayUp(to as usize, m));
                        }
                    }
                }
                Msg::RelayUp(r, m) => {
                    let out = relays[r].on_upstream(now, m);
                    route_relay(r, out, &mut inbox);
                }
                Msg::RelayDown(r, h, m) => {
                    let out = relays[r].on_agent(now, h, m);
                    route_relay(r, out, &mut inbox);
                }
                Msg::Agent(h, m) => {
                    for act in agents[h].on_message(now, problem, m) {
                        if let AgentAction::Send(m) = act {
                            inbox.push(Msg::RelayDown(relay_of(h), h as MemberId, m));
                        }
                    }
                }
            }
        }
    }
    assert_eq!(
        coord.status().members.len(),
        2,
        "the coordinator sees the relays only"
    );
    agents
}

/// The pure machines wired coordinator → two relays → agents reproduce the in-process solver
/// on fixed active sets, as the direct wiring does (`in_memory_cluster_matches_…`).
#[test]
fn a_cluster_behind_relays_matches_the_in_process_solver() {
    let problem = generate(&GeneratorConfig {
        k: 3,
        seed: 5,
        ..GeneratorConfig::new(6, 5)
    });
    let active = crate::protocol::fixed_active_sets(&problem);
    let rho = default_rho(&problem);
    let iters = 60;
    let (_, reference) =
        fixed_set_trace(&problem, active.clone(), Algorithm::Admm, rho, iters, 0.0);
    let mut coord = Coordinator::new(
        CoordinatorConfig {
            max_iterations: Some(iters as u64),
            selection: SelectionSchedule::fixed(),
            ..coord_cfg(&problem, rho)
        },
        problem.facilities.clone(),
    );
    let agents = run_behind_relays(&problem, &mut coord);
    assert_eq!(coord.iteration(), iters as u64);
    for (a, r) in agents.iter().zip(&reference) {
        assert_eq!(a.state().active, r.active);
        for (x, y) in a.state().x.iter().zip(&r.x) {
            assert!((x - y).abs() < 1e-9, "{x} vs {y}");
        }
    }
}

/// With selection through the relays, the cluster reproduces `solver::solve` (the priced
/// restart and every damped swap round, each host's proposal decided at its own rank) and
/// ends at its allocation, as the direct wiring does (`in_memory_cluster_with_selection_…`).
#[test]
fn a_cluster_behind_relays_with_selection_matches_solve() {
    let (problem, opts, solution) = crate::protocol::selection_case();
    let total = (opts.iters_per_round + solution.iterations) as u64;
    let mut coord = Coordinator::new(
        CoordinatorConfig {
            max_iterations: Some(total),
            selection: SelectionSchedule::from_solve(&opts),
            ..coord_cfg(&problem, default_rho(&problem))
        },
        problem.facilities.clone(),
    );
    let agents = run_behind_relays(&problem, &mut coord);
    assert_eq!(coord.iteration(), total);
    assert_eq!(coord.exchanges_done(), opts.rounds as u32 + 1);
    assert!(coord.counters().parks + coord.counters().activations > 0);
    crate::protocol::assert_agents_match(&agents, &solution);
}

fn coord_cfg(problem: &Problem, rho: f64) -> CoordinatorConfig {
    CoordinatorConfig {
        rho,
        facility_digest: facility_digest(problem),
        heartbeat_interval: 100 * MS,
        member_timeout: 1000 * MS,
        round_deadline: 50 * MS,
        max_staleness: 0,
        round_interval: Duration::ZERO,
        min_members: 2,
        max_iterations: None,
        selection: SelectionSchedule::fixed(),
        shard: Shard::WHOLE,
    }
}

#[test]
fn a_live_relay_passes_the_table_down_and_the_reports_up_named() {
    use crate::live::{HostReport, LiveFacility, LivePolicy};
    let mut r = Relay::new(RelayConfig {
        facility_digest: 0,
        facilities: 0,
        live: true,
        ..cfg(1)
    });
    r.on_upstream_connected(Duration::ZERO);
    let live_join = |host: &str| {
        let mut j = join(host, vec![], vec![]);
        if let AgentMsg::Join(j) = &mut j {
            j.facility_digest = 0;
        }
        j
    };
    r.on_agent(MS, 1, live_join("h1"));
    r.on_upstream(MS, welcome(1, 0));
    let table = CoordMsg::Facilities(vec![LiveFacility {
        id: "rx:h1".into(),
        host: "h1".into(),
        line_rate_gbps: 8.0,
        capacity: 1.0,
        gids: vec![[1; 16]],
    }]);
    let policy = CoordMsg::Policy(LivePolicy::default());
    assert_eq!(
        downs(&r.on_upstream(MS, policy.clone())),
        vec![(1, policy.clone())]
    );
    assert_eq!(
        downs(&r.on_upstream(MS, table.clone())),
        vec![(1, table.clone())]
    );
    // A later agent gets both after its welcome, as from the coordinator.
    let out = r.on_agent(2 * MS, 2, live_join("h2"));
    assert_eq!(
        downs(&out),
        vec![(2, welcome(1, 0)), (2, policy), (2, table)]
    );
    // Its update changes the rack's sums; its report goes up named.
    let out = r.on_agent(
        3 * MS,
        2,
        AgentMsg::Update(UpdateMsg {
            pairs: vec![(0, 1)],
            entries: vec![(0, 0.5)],
            interest: vec![0],
            floor: vec![(0, 0.005)],
            last_d: vec![],
        }),
    );
    assert!(matches!(&ups(&out)[..], [AgentMsg::Update(u)] if u.pairs == vec![(0, 1)]));
    let report = HostReport {
        line_rate_gbps: 8.0,
        gids: vec![[2; 16]],
        max_active: 4,
        wqe_budget: 1.0,
        poll_budget: 1.0,
        apps: vec![],
    };
    let out = r.on_agent(3 * MS, 2, AgentMsg::Host(report.clone()));
    assert_eq!(
        ups(&out),
        vec![AgentMsg::RackHost(RackHostMsg {
            host: "h2".into(),
            report: Some(report.clone()),
        })]
    );
    // A report out of range closes that agent only, and its host's report goes.
    let mut bad = report;
    bad.line_rate_gbps = f64::NAN;
    let out = r.on_agent(4 * MS, 2, AgentMsg::Host(bad));
    assert_eq!(closed(&out), vec![2]);
    assert!(ups(&out).contains(&AgentMsg::RackHost(RackHostMsg {
        host: "h2".into(),
        report: None,
    })));
    // A relay with an instance file refuses the live problem.
    let mut r = two_agent_relay();
    assert_eq!(
        closed(&r.on_agent(
            5 * MS,
            1,
            AgentMsg::Host(HostReport {
                line_rate_gbps: 8.0,
                gids: vec![],
                max_active: 4,
                wqe_budget: 1.0,
                poll_budget: 1.0,
                apps: vec![],
            })
        )),
        vec![1]
    );
}
