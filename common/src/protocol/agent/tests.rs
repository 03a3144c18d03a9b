use super::*;
use crate::generator::{generate, GeneratorConfig};

const MS: Duration = Duration::from_millis(1);

fn setup() -> (Problem, AgentCore) {
    let problem = generate(&GeneratorConfig {
        k: 2,
        seed: 3,
        ..GeneratorConfig::new(2, 4)
    });
    let active = crate::protocol::fixed_active_sets(&problem);
    let state = HostState::new(&problem, 0, active[0].clone());
    let cfg = AgentConfig {
        heartbeat_interval: 100 * MS,
        coordinator_timeout: 300 * MS,
        backoff_min: 10 * MS,
        backoff_max: 400 * MS,
    };
    let core = AgentCore::new(&problem, state, cfg);
    (problem, core)
}

fn term(facility: u32, d: f64) -> FacilityTerm {
    FacilityTerm {
        facility,
        d,
        rho: 1.0,
    }
}

fn d_for(problem: &Problem, core: &AgentCore, v: f64) -> Vec<FacilityTerm> {
    let mut d: Vec<FacilityTerm> = core
        .state()
        .active
        .iter()
        .flat_map(|&p| problem.pairs[p].uses.iter().map(move |u| term(u.0, v)))
        .collect();
    d.sort_by_key(|e| e.facility);
    d.dedup_by_key(|e| e.facility);
    d
}

fn welcome(core: &mut AgentCore, problem: &Problem, now: Duration) {
    core.on_connected(now, problem);
    core.on_message(
        now,
        problem,
        CoordMsg::Welcome {
            epoch: 1,
            iteration: 0,
            heartbeat_ms: 100,
            shard: super::super::Shard::WHOLE,
        },
    );
}

/// Issue 19, item 8: a coordinator heartbeat interval above the agent's timeout is
/// shortened to a third of the timeout, with an event saying so, and the agent, hearing
/// only heartbeat answers, stays a member.
#[test]
fn a_heartbeat_longer_than_the_timeout_is_shortened() {
    let (problem, mut core) = setup();
    core.on_connected(Duration::ZERO, &problem);
    let out = core.on_message(
        Duration::ZERO,
        &problem,
        CoordMsg::Welcome {
            epoch: 1,
            iteration: 0,
            heartbeat_ms: 10_000,
            shard: super::super::Shard::WHOLE,
        },
    );
    assert!(
        out.contains(&AgentAction::Event(AgentEvent::HeartbeatShortened {
            offered: 10_000 * MS,
            used: 100 * MS,
            timeout: 300 * MS,
        }))
    );
    // Ten timeouts with no round: every heartbeat answered, never fail-static.
    let mut now = Duration::ZERO;
    while now < 3000 * MS {
        now = core.next_wakeup();
        for a in core.tick(now) {
            assert!(
                !matches!(a, AgentAction::Event(AgentEvent::FailStatic(_))),
                "fail-static at {now:?}"
            );
            if let AgentAction::Send(AgentMsg::Heartbeat { seq }) = a {
                core.on_message(now, &problem, CoordMsg::HeartbeatAck { seq });
            }
        }
    }
    assert!(core.is_member());
    // An interval that fits is taken as it is.
    let (problem, mut core) = setup();
    welcome(&mut core, &problem, Duration::ZERO);
    assert_eq!(core.next_wakeup(), 100 * MS);
}

/// A material change of the host's inputs is reported once (`Changed`), noise never, and
/// the next exchange measures changes afresh.
#[test]
fn material_input_changes_are_reported_once_per_exchange() {
    let (mut problem, mut core) = setup();
    welcome(&mut core, &problem, Duration::ZERO);
    // Every facility's d: the exchange below changes the active set.
    let d: Vec<FacilityTerm> = (0..problem.facilities.len() as u32)
        .map(|f| term(f, 0.01))
        .collect();
    let mut it = 0;
    let mut step = |core: &mut AgentCore, problem: &Problem| {
        it += 1;
        let out = core.on_message(
            MS,
            problem,
            CoordMsg::Round {
                epoch: 1,
                iteration: it,
                d: d.clone(),
            },
        );
        out.iter()
            .filter(|a| matches!(a, AgentAction::Send(AgentMsg::Changed)))
            .count()
    };
    let first = problem.hosts[0].pairs.start;
    assert_eq!(step(&mut core, &problem), 0, "nothing changed");
    problem.pairs[first].demand *= 1.05;
    assert_eq!(step(&mut core, &problem), 0, "5 % is noise");
    problem.pairs[first].weight *= 1.5;
    assert_eq!(step(&mut core, &problem), 1, "50 % is a change");
    assert_eq!(step(&mut core, &problem), 0, "said once");
    let prices: Vec<(u32, f64)> = (0..problem.facilities.len() as u32)
        .map(|f| (f, 0.0))
        .collect();
    core.on_message(
        MS,
        &problem,
        CoordMsg::Select {
            exchange: 1,
            round: 1,
            prices,
            options: SelectionParams::from(crate::selection::SelectionOptions::default()),
        },
    );
    core.on_message(
        MS,
        &problem,
        CoordMsg::Verdict {
            exchange: 1,
            activate: true,
        },
    );
    assert_eq!(step(&mut core, &problem), 0, "the exchange saw it");
    problem.pairs[first].cqe_per_wqe *= 0.5;
    assert_eq!(step(&mut core, &problem), 1);
}

#[test]
fn rounds_are_stepped_once_and_in_order() {
    let (problem, mut core) = setup();
    welcome(&mut core, &problem, Duration::ZERO);
    let round = |it, d: Vec<FacilityTerm>| CoordMsg::Round {
        epoch: 1,
        iteration: it,
        d,
    };
    let d = d_for(&problem, &core, 0.01);
    let out = core.on_message(MS, &problem, round(1, d.clone()));
    assert!(matches!(
        out[0],
        AgentAction::Send(AgentMsg::Contribution(_))
    ));
    let x = core.state().x.clone();
    // The same round again, and an older one, change nothing.
    for it in [1, 0] {
        let out = core.on_message(MS, &problem, round(it, d.clone()));
        assert!(matches!(
            out[0],
            AgentAction::Event(AgentEvent::IgnoredRound { .. })
        ));
    }
    assert_eq!(core.state().x, x);
    // A restarted round under a newer epoch is taken.
    let out = core.on_message(
        MS,
        &problem,
        CoordMsg::Round {
            epoch: 2,
            iteration: 1,
            d,
        },
    );
    assert!(matches!(
        out[0],
        AgentAction::Send(AgentMsg::Contribution(_))
    ));
}

#[test]
fn rounds_of_a_restarted_coordinator_are_taken_despite_lower_epochs() {
    let (problem, mut core) = setup();
    welcome(&mut core, &problem, Duration::ZERO);
    let d = d_for(&problem, &core, 0.01);
    let round = |epoch, iteration| CoordMsg::Round {
        epoch,
        iteration,
        d: d.clone(),
    };
    core.on_message(MS, &problem, round(7, 10));
    assert_eq!(core.iteration(), 10);
    core.on_disconnected(2 * MS, "coordinator restarted");
    core.on_connected(3 * MS, &problem);
    core.on_message(
        3 * MS,
        &problem,
        CoordMsg::Welcome {
            epoch: 1,
            iteration: 10,
            heartbeat_ms: 100,
            shard: super::super::Shard::WHOLE,
        },
    );
    let out = core.on_message(4 * MS, &problem, round(1, 11));
    assert!(matches!(
        out[0],
        AgentAction::Send(AgentMsg::Contribution(_))
    ));
    assert_eq!(core.iteration(), 11);
}

#[test]
fn round_without_the_hosts_facilities_is_refused() {
    let (problem, mut core) = setup();
    welcome(&mut core, &problem, Duration::ZERO);
    let x = core.state().x.clone();
    let out = core.on_message(
        MS,
        &problem,
        CoordMsg::Round {
            epoch: 1,
            iteration: 1,
            d: vec![],
        },
    );
    assert!(out.iter().any(|a| matches!(a, AgentAction::Disconnect(_))));
    assert_eq!(core.state().x, x);
}

#[test]
fn silence_means_fail_static_then_backoff_and_rejoin_with_current_rates() {
    let (problem, mut core) = setup();
    welcome(&mut core, &problem, Duration::ZERO);
    let d = d_for(&problem, &core, 0.02);
    core.on_message(
        MS,
        &problem,
        CoordMsg::Round {
            epoch: 1,
            iteration: 1,
            d,
        },
    );
    let x = core.state().x.clone();
    // Heartbeats go out while the coordinator is silent, then the timeout fires.
    let out = core.tick(100 * MS);
    assert!(matches!(
        out[0],
        AgentAction::Send(AgentMsg::Heartbeat { seq: 1 })
    ));
    let out = core.tick(301 * MS);
    assert!(out
        .iter()
        .any(|a| matches!(a, AgentAction::Event(AgentEvent::FailStatic(_)))));
    assert!(!core.is_member());
    assert_eq!(core.state().x, x, "rates are kept");
    // Backoff grows with each failed attempt and stays under the cap (with jitter ≤ 1.5).
    let mut now = 301 * MS;
    let mut waits = Vec::new();
    for _ in 0..6 {
        now = core.next_wakeup();
        assert!(core.connect_due(now));
        core.on_connect_failed(now);
        waits.push(core.next_wakeup() - now);
    }
    assert!(waits[1] > waits[0] && waits[2] > waits[1]);
    assert!(waits.iter().all(|w| *w <= 600 * MS));
    // The rejoin reports the current rates and the last iteration.
    let out = core.on_connected(now, &problem);
    let AgentAction::Send(AgentMsg::Join(j)) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(j.entries, core.state().contribution(&problem).entries);
    assert_eq!(j.last_iteration, 1);
    assert_eq!(j.last_d, d_for(&problem, &core, 0.02));
}

#[test]
fn selection_exchange_parks_on_its_verdict_and_reports_the_new_set() {
    let (problem, mut core) = setup();
    welcome(&mut core, &problem, Duration::ZERO);
    let options: SelectionParams = SelectionOptions {
        swap_prob: 1.0,
        ..SelectionOptions::default()
    }
    .into();
    let select = |exchange, prices| CoordMsg::Select {
        exchange,
        round: exchange - 1,
        prices,
        options,
    };
    // Prices must cover every facility of the host's apps.
    let out = core.on_message(MS, &problem, select(1, vec![]));
    assert!(out.iter().any(|a| matches!(a, AgentAction::Disconnect(_))));
    welcome(&mut core, &problem, 2 * MS);
    // A prohibitive price on the active pairs' facilities: the worst member is parked.
    let before = core.state().active.clone();
    assert!(!before.is_empty());
    let active_f: Vec<u32> = before
        .iter()
        .flat_map(|&p| problem.pairs[p].uses.iter().map(|u| u.0))
        .collect();
    let AgentMsg::Join(j) = core.join_msg(&problem) else {
        unreachable!()
    };
    let prices: Vec<(u32, f64)> = j
        .interest
        .iter()
        .map(|&f| (f, if active_f.contains(&f) { 1e6 } else { 0.0 }))
        .collect();
    let out = core.on_message(3 * MS, &problem, select(1, prices));
    let [AgentAction::Send(AgentMsg::Proposal(p))] = &out[..] else {
        panic!("{out:?}")
    };
    assert_eq!(p.exchange, 1);
    let [(f, need)] = p.park.as_deref().expect("a park") else {
        panic!("generated pairs use one facility each")
    };
    assert!(active_f.contains(f));
    let parked = before
        .iter()
        .find(|&&q| problem.pairs[q].uses[0].0 == *f)
        .unwrap();
    assert_eq!(
        *need,
        problem.pairs[*parked].uses[0].1 * problem.params.x_min
    );
    // A verdict for another exchange is ignored; the right one applies the swap.
    assert!(core
        .on_message(
            4 * MS,
            &problem,
            CoordMsg::Verdict {
                exchange: 7,
                activate: true
            }
        )
        .is_empty());
    assert_eq!(core.state().active, before);
    let out = core.on_message(
        4 * MS,
        &problem,
        CoordMsg::Verdict {
            exchange: 1,
            activate: false,
        },
    );
    let AgentAction::Send(AgentMsg::Selected(sel)) = &out[0] else {
        panic!("{out:?}")
    };
    assert_eq!(core.state().active.len(), before.len() - 1);
    assert_eq!(core.state().active.len(), core.state().x.len());
    assert_eq!(sel.exchange, 1);
    assert_eq!(
        sel.pairs.iter().map(|e| e.1).sum::<u32>() as usize,
        before.len() - 1
    );
    assert_eq!(sel.entries, core.state().contribution(&problem).entries);
    assert_eq!(core.exchanges(), 2);
}

#[test]
fn weight_changes_become_actions_for_known_apps_only() {
    let (mut problem, mut core) = setup();
    welcome(&mut core, &problem, Duration::ZERO);
    let app = problem.app_names[1].clone();
    let out = core.on_message(
        MS,
        &problem,
        CoordMsg::SetWeight {
            app: app.clone(),
            weight: 4.0,
        },
    );
    assert_eq!(
        out[0],
        AgentAction::SetWeight {
            app: 1,
            weight: 4.0
        }
    );
    AgentCore::apply_weight(&mut problem, 1, 4.0);
    assert!(problem
        .pairs
        .iter()
        .filter(|p| p.app == 1)
        .all(|p| p.weight == 4.0));
    for (app, weight) in [("no-such-app".to_string(), 1.0), (app, -1.0)] {
        let out = core.on_message(MS, &problem, CoordMsg::SetWeight { app, weight });
        assert!(matches!(
            out[..],
            [AgentAction::Event(AgentEvent::IgnoredWeight { .. })]
        ));
    }
}

#[test]
fn changed_apps_ask_for_a_reselection_once_a_member() {
    let (problem, mut core) = setup();
    let n = problem.hosts[0].pairs.len();
    let first = problem.hosts[0].pairs.start;
    let reselects = |out: &[AgentAction]| {
        out.iter()
            .filter(|a| matches!(a, AgentAction::Send(AgentMsg::Reselect { .. })))
            .count()
    };
    // Not a member: the change is noted, the request waits for the welcome.
    let mut present = vec![true; n];
    present[0] = false;
    let out = core.set_present(&problem, present.clone());
    assert_eq!(
        out,
        vec![AgentAction::Event(AgentEvent::AppsChanged {
            arrived: vec![],
            left: vec![first],
        })]
    );
    assert!(!core.is_present(&problem, first));
    core.on_connected(Duration::ZERO, &problem);
    let out = core.on_message(
        MS,
        &problem,
        CoordMsg::Welcome {
            epoch: 1,
            iteration: 7,
            heartbeat_ms: 100,
            shard: super::super::Shard::WHOLE,
        },
    );
    assert!(out.contains(&AgentAction::Send(AgentMsg::Reselect { iteration: 8 })));
    // No change, no request; a change as a member asks at once.
    assert!(core.set_present(&problem, present.clone()).is_empty());
    present[0] = true;
    assert_eq!(reselects(&core.set_present(&problem, present)), 1);
    // A list of the wrong length is not a change.
    assert!(core.set_present(&problem, vec![false; n + 1]).is_empty());
}

#[test]
fn refusal_disconnects_and_keeps_rates() {
    let (problem, mut core) = setup();
    core.on_connected(Duration::ZERO, &problem);
    let x = core.state().x.clone();
    let out = core.on_message(
        MS,
        &problem,
        CoordMsg::Refused {
            reason: "facility list differs".into(),
        },
    );
    assert!(out.iter().any(|a| matches!(a, AgentAction::Disconnect(_))));
    assert_eq!(core.state().x, x);
    // Repeated refusals (a drained host) are retried ever less often.
    let t1 = core.next_wakeup();
    core.on_connected(t1, &problem);
    core.on_message(
        t1,
        &problem,
        CoordMsg::Refused {
            reason: "drained".into(),
        },
    );
    assert!(core.next_wakeup() - t1 > t1 - MS);
}
