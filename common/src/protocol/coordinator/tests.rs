use super::*;
use crate::generator::{generate, GeneratorConfig};
use crate::model::Problem;
use crate::protocol::agent::{AgentAction, AgentCore};
use crate::protocol::facility_digest;
use crate::solver::{default_rho, fixed_set_trace, Algorithm};

const MS: Duration = Duration::from_millis(1);

fn cfg(digest: u64, rho: f64, min_members: usize) -> CoordinatorConfig {
    CoordinatorConfig {
        rho,
        facility_digest: digest,
        heartbeat_interval: 100 * MS,
        member_timeout: 1000 * MS,
        round_deadline: 50 * MS,
        max_staleness: 2,
        round_interval: Duration::ZERO,
        min_members,
        max_iterations: None,
        selection: SelectionSchedule::fixed(),
        shard: Shard::WHOLE,
    }
}

fn sends(out: &[Action]) -> Vec<(MemberId, CoordMsg)> {
    out.iter()
        .filter_map(|a| match a {
            Action::Send(id, m) => Some((*id, m.clone())),
            _ => None,
        })
        .collect()
}

fn facility(id: &str) -> Facility {
    Facility {
        id: id.into(),
        capacity: 1.0,
        cost: 0.0,
    }
}

fn join(host: &str, digest: u64, f: u32, v: f64) -> AgentMsg {
    AgentMsg::Join(Join {
        host: host.into(),
        facility_digest: digest,
        pairs: vec![(f, 1)],
        entries: vec![(f, v)],
        last_iteration: 0,
        last_d: Vec::new(),
        rank: 0,
        interest: vec![f],
        floor: vec![(f, 0.0)],
        exchanges: 0,
    })
}

fn contrib(epoch: u64, iteration: u64, f: u32, v: f64) -> AgentMsg {
    AgentMsg::Contribution(ContributionMsg {
        epoch,
        iteration,
        entries: vec![(f, v)],
    })
}

/// Two hosts on facilities 0 and 1: the coordinator waits for both, then rounds go out with
/// only each host's own facility.
#[test]
fn rounds_start_at_min_members_and_carry_only_own_facilities() {
    let mut c = Coordinator::new(cfg(7, 1.0, 2), vec![facility("a"), facility("b")]);
    let out = c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.5));
    assert!(sends(&out)
        .iter()
        .all(|(_, m)| matches!(m, CoordMsg::Welcome { .. })));
    let out = c.on_message(MS, 2, join("h2", 7, 1, 2.0));
    let rounds: Vec<_> = sends(&out)
        .into_iter()
        .filter(|(_, m)| matches!(m, CoordMsg::Round { .. }))
        .collect();
    assert_eq!(rounds.len(), 2);
    for (id, m) in rounds {
        let CoordMsg::Round { d, iteration, .. } = m else {
            unreachable!()
        };
        assert_eq!(iteration, 1);
        assert_eq!(d.len(), 1);
        assert_eq!(d[0].facility, (id - 1) as u32);
    }
    // Facility b is over capacity (2 > 1): its price is positive.
    assert!(c.price(1) > 0.0 && c.price(0) == 0.0);
}

#[test]
fn wrong_digest_and_bad_entries_are_refused() {
    let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
    let out = c.on_message(Duration::ZERO, 1, join("h1", 8, 0, 0.5));
    assert!(out.iter().any(|a| matches!(a, Action::Close(1, _))));
    assert_eq!(c.members(), 0);
    let out = c.on_message(Duration::ZERO, 2, join("h2", 7, 5, 0.5));
    assert!(out.iter().any(|a| matches!(a, Action::Close(2, _))));
    let out = c.on_message(Duration::ZERO, 3, join("h3", 7, 0, f64::NAN));
    assert!(out.iter().any(|a| matches!(a, Action::Close(3, _))));
    let out = c.on_message(Duration::ZERO, 4, AgentMsg::Heartbeat { seq: 1 });
    assert!(out.iter().any(|a| matches!(a, Action::Close(4, _))));
    assert_eq!(c.counters().refused, 4);
}

#[test]
fn late_duplicate_and_future_contributions_are_told_apart_by_number() {
    let mut c = Coordinator::new(cfg(7, 1.0, 2), vec![facility("a")]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.2));
    let e = c.epoch();
    c.on_message(MS, 1, contrib(e, 1, 0, 0.3));
    // A repeat of the same round is a duplicate and changes nothing.
    c.on_message(MS, 1, contrib(e, 1, 0, 9.0));
    assert_eq!(c.counters().duplicates, 1);
    assert_eq!(c.iteration(), 0);
    c.on_message(MS, 2, contrib(e, 1, 0, 0.3));
    assert_eq!(c.iteration(), 1);
    assert!((c.status().facilities[0].usage - 0.6).abs() < 1e-12);
    // Round 1 again, now that round 2 runs: a duplicate of a number already held.
    c.on_message(2 * MS, 2, contrib(e, 1, 0, 0.3));
    assert_eq!(c.counters().duplicates, 2);
    // Round 5 does not exist yet: a protocol violation closes the connection.
    assert_eq!(c.iteration(), 1);
    let out = c.on_message(2 * MS, 2, contrib(e, 5, 0, 0.3));
    assert!(out.iter().any(|a| matches!(a, Action::Close(2, _))));
    assert_eq!(c.members(), 1);
}

#[test]
fn stragglers_are_reused_up_to_the_bound_then_waited_for() {
    let mut c = Coordinator::new(cfg(7, 1.0, 2), vec![facility("a")]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.2));
    let e = c.epoch();
    let mut now = Duration::ZERO;
    // h2 never answers; h1 answers every round (and heartbeats keep h2 alive).
    for it in 1..=2 {
        c.on_message(now, 1, contrib(e, it, 0, 0.3));
        c.on_message(now, 2, AgentMsg::Heartbeat { seq: it });
        now += 60 * MS;
        let out = c.tick(now);
        assert!(out
            .iter()
            .any(|a| matches!(a, Action::Event(Event::RoundDone { stale: 1, .. }))));
        assert_eq!(c.iteration(), it);
    }
    // Third round: h2 has been reused twice (the bound), so the round waits.
    c.on_message(now, 1, contrib(e, 3, 0, 0.3));
    c.on_message(now, 2, AgentMsg::Heartbeat { seq: 3 });
    now += 60 * MS;
    c.tick(now);
    assert_eq!(c.iteration(), 2);
    assert_eq!(c.counters().stale_reuses, 2);
    // h2's answer to round 1 is late: kept as its latest, not counted for round 3.
    c.on_message(now, 2, contrib(e, 1, 0, 0.25));
    assert_eq!(c.counters().late, 1);
    assert_eq!(c.iteration(), 2);
    c.on_message(now, 2, contrib(e, 3, 0, 0.25));
    assert_eq!(c.iteration(), 3);
}

#[test]
fn silent_member_is_dropped_after_the_timeout_and_its_contribution_removed() {
    let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.7));
    let e = c.epoch();
    c.on_message(MS, 1, contrib(e, 1, 0, 0.3));
    c.on_message(MS, 2, contrib(e, 1, 0, 0.7));
    assert!((c.status().facilities[0].usage - 1.0).abs() < 1e-12);
    // Only h1 keeps talking.
    let mut now = MS;
    while now < 1500 * MS {
        now += 100 * MS;
        c.on_message(now, 1, AgentMsg::Heartbeat { seq: 0 });
        c.tick(now);
    }
    assert_eq!(c.members(), 1);
    assert_eq!(c.counters().timeouts, 1);
    assert!(c.epoch() > e);
    let s = c.status();
    assert_eq!(s.facilities[0].pairs, 1);
    assert_eq!(s.members[0].host, "h1");
    // The next completed round sums h1 alone.
    let it = c.iteration();
    c.on_message(now, 1, contrib(c.epoch(), it + 1, 0, 0.4));
    assert!((c.status().facilities[0].usage - 0.4).abs() < 1e-12);
}

/// Issue 19, item 9 (log volume): a live host whose reports (every 250 ms) carry a GID
/// another host's link owns is told so once per change, not at every report.
#[test]
fn a_gid_owned_elsewhere_is_reported_once_per_change() {
    let mut c = Coordinator::new_live(cfg(0, 1.0, 1), LivePolicy::default());
    let live_join = |host: &str| {
        AgentMsg::Join(Join {
            host: host.into(),
            facility_digest: 0,
            pairs: Vec::new(),
            entries: Vec::new(),
            last_iteration: 0,
            last_d: Vec::new(),
            rank: 0,
            interest: Vec::new(),
            floor: Vec::new(),
            exchanges: 0,
        })
    };
    let report = |gids: Vec<Gid>| {
        AgentMsg::Host(HostReport {
            line_rate_gbps: 10.0,
            gids,
            max_active: 4,
            wqe_budget: 1.0,
            poll_budget: 16.0,
            apps: Vec::new(),
        })
    };
    let (lo, a, b) = ([1u8; 16], [2u8; 16], [3u8; 16]);
    c.on_message(Duration::ZERO, 1, live_join("h1"));
    c.on_message(Duration::ZERO, 2, live_join("h2"));
    c.on_message(MS, 1, report(vec![lo, a]));
    let refusals = |out: &[Action]| {
        out.iter()
            .filter(|x| matches!(x, Action::Event(Event::Refused { member: 2, .. })))
            .count()
    };
    let counts: Vec<usize> = [vec![lo, b], vec![lo, b], vec![lo, b], vec![b], vec![lo, b]]
        .into_iter()
        .enumerate()
        .map(|(i, g)| refusals(&c.on_message((2 + i as u32) * MS, 2, report(g))))
        .collect();
    assert_eq!(counts, vec![1, 0, 0, 0, 1]);
}

/// Issue 19, item 9: a member whose connection the transport's idle timeout ended is
/// counted as a member timeout, as one the scan finds; a closed connection is not.
#[test]
fn a_member_lost_to_the_idle_timeout_counts_as_a_timeout() {
    let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.2));
    c.on_disconnect(MS, 2);
    assert_eq!(c.counters().timeouts, 0);
    c.on_silence(1000 * MS, 1);
    assert_eq!(c.counters().timeouts, 1);
    assert_eq!(c.members(), 0);
    c.on_silence(1001 * MS, 1);
    assert_eq!(c.counters().timeouts, 1, "once");
}

#[test]
fn timeout_of_a_member_the_round_waits_for_starts_a_new_epoch() {
    let mut c = Coordinator::new(cfg(7, 1.0, 2), vec![facility("a")]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.2));
    let e = c.epoch();
    c.on_message(MS, 1, contrib(e, 1, 0, 0.3));
    // h2 never answers (h1 stays alive); one late tick passes h2's timeout and the deadline.
    c.on_message(1500 * MS, 1, AgentMsg::Heartbeat { seq: 1 });
    let out = c.tick(2000 * MS);
    // Closed as expired, not as a violation.
    assert!(out.iter().any(|a| matches!(a, Action::Expire(2))));
    assert!(!out.iter().any(|a| matches!(a, Action::Close(2, _))));
    assert_eq!(c.members(), 1);
    assert!(c.epoch() > e);
    // The round restarts for h1 alone under the new epoch.
    let rounds: Vec<_> = sends(&out)
        .into_iter()
        .filter(|(_, m)| matches!(m, CoordMsg::Round { .. }))
        .collect();
    assert_eq!(rounds.len(), 1);
    assert_eq!(rounds[0].0, 1);
}

#[test]
fn answer_to_a_round_abandoned_at_an_epoch_change_is_not_a_violation() {
    let mut c = Coordinator::new(
        CoordinatorConfig {
            round_interval: 10 * MS,
            ..cfg(7, 1.0, 1)
        },
        vec![facility("a")],
    );
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    let e = c.epoch();
    // Round 1 runs; h2 joins, which abandons it, and the next round waits for the interval.
    c.on_message(MS, 2, join("h2", 7, 0, 0.2));
    assert_eq!(c.iteration(), 0);
    let out = c.on_message(2 * MS, 1, contrib(e, 1, 0, 0.3));
    assert!(
        !out.iter().any(|a| matches!(a, Action::Close(..))),
        "{out:?}"
    );
    assert_eq!(c.members(), 2);
}

#[test]
fn rejoin_of_a_host_replaces_its_old_connection() {
    let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    // Silent for more than two heartbeat intervals (100 ms): a reconnection.
    let out = c.on_message(201 * MS, 2, join("h1", 7, 0, 0.2));
    assert!(out.iter().any(|a| matches!(a, Action::Close(1, _))));
    assert_eq!(c.members(), 1);
    assert_eq!(c.status().members[0].member, 2);
}

/// Issue 19, item 3: a running shard takes a joining agent's higher round number (the
/// highest any shard sent it), so that a shard restarted alone and the others number
/// their rounds alike again; an unsharded coordinator keeps its own numbering.
#[test]
fn a_running_shard_aligns_its_rounds_with_a_join() {
    for (count, want) in [(2, 500), (1, 3)] {
        let shard = Shard {
            index: crate::protocol::shard_of("a", count),
            count,
        };
        let mut c = Coordinator::new(
            CoordinatorConfig {
                shard,
                ..cfg(7, 1.0, 1)
            },
            vec![facility("a")],
        );
        c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
        for it in 1..=3 {
            c.on_message(it * MS, 1, contrib(c.epoch(), it as u64, 0, 0.2));
        }
        assert_eq!(c.iteration(), 3);
        let AgentMsg::Join(mut j) = join("h2", 7, 0, 0.2) else {
            unreachable!()
        };
        j.last_iteration = 500;
        c.on_message(10 * MS, 2, AgentMsg::Join(j));
        assert_eq!(c.iteration(), want, "{count} shards");
    }
}

/// Issue 19, item 4: a second agent with a host id whose member is alive is refused, with
/// an event naming both connections; the incumbent stays and the epoch does not move.
#[test]
fn a_second_agent_with_a_live_host_id_is_refused() {
    let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    c.on_message(150 * MS, 1, AgentMsg::Heartbeat { seq: 1 });
    let epoch = c.epoch();
    for (id, at) in [(2, 200), (3, 350)] {
        let out = c.on_message(at * MS, id, join("h1", 7, 0, 0.2));
        assert!(out.iter().any(|a| matches!(
            a,
            Action::Event(Event::DuplicateHost { member, incumbent: 1, host, .. })
                if *member == id && host == "h1"
        )));
        assert!(sends(&out).iter().any(|(to, m)| *to == id
            && matches!(m, CoordMsg::Refused { reason } if reason.contains("second agent"))));
        assert!(out
            .iter()
            .any(|a| matches!(a, Action::Close(i, _) if *i == id)));
        assert!(!out.iter().any(|a| matches!(a, Action::Close(1, _))));
        assert_eq!(c.status().members[0].member, 1);
        assert_eq!(c.epoch(), epoch);
    }
    assert_eq!(c.counters().duplicate_joins, 2);
}

#[test]
fn drained_host_is_removed_and_refused_until_undrained() {
    let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.5));
    let e = c.epoch();
    let out = c.drain(MS, "h2").unwrap();
    assert!(out.iter().any(|a| matches!(a, Action::Close(2, _))));
    assert_eq!(c.members(), 1);
    assert!(c.epoch() > e);
    assert_eq!(c.status().facilities[0].pairs, 1);
    let out = c.on_message(2 * MS, 3, join("h2", 7, 0, 0.5));
    assert!(out.iter().any(|a| matches!(a, Action::Close(3, _))));
    assert_eq!(c.members(), 1);
    assert!(c.undrain("h2"));
    c.on_message(3 * MS, 4, join("h2", 7, 0, 0.5));
    assert_eq!(c.members(), 2);
}

#[test]
fn restarted_coordinator_rebuilds_prices_from_the_agents_last_d() {
    let fac = vec![facility("a")];
    let mut c = Coordinator::new(cfg(7, 2.0, 2), fac.clone());
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.8));
    c.on_message(Duration::ZERO, 2, join("h2", 7, 0, 0.8));
    // Over capacity: iterate with constant usage until the price settles.
    for it in 1..=50 {
        let e = c.epoch();
        c.on_message(MS, 1, contrib(e, it, 0, 0.5));
        c.on_message(MS, 2, contrib(e, it, 0, 0.5));
    }
    let price = c.price(0);
    assert!(price > 0.0);
    let d = c.admm.term(0);
    // A new coordinator; both agents rejoin with their last d and current usage.
    let mut r = Coordinator::new(cfg(7, 2.0, 2), fac);
    for (id, host) in [(1, "h1"), (2, "h2")] {
        r.on_message(
            Duration::ZERO,
            id,
            AgentMsg::Join(Join {
                host: host.into(),
                facility_digest: 7,
                pairs: vec![(0, 1)],
                entries: vec![(0, 0.5)],
                last_iteration: 50,
                last_d: vec![d],
                rank: id as u32,
                interest: vec![0],
                floor: vec![(0, 0.0)],
                exchanges: 0,
            }),
        );
    }
    assert_eq!(r.iteration(), 50);
    assert!(
        (r.price(0) - price).abs() <= 1e-9 * price.max(1.0),
        "{} vs {price}",
        r.price(0)
    );
}

/// Runs coordinator and agents back to back, delivering every message at once, until no
/// message is left (the coordinator stops at its `max_iterations`).
fn run_in_memory(problem: &Problem, coord: &mut Coordinator) -> Vec<AgentCore> {
    let active = crate::protocol::fixed_active_sets(problem);
    let mut agents = crate::protocol::test_agents(problem, &active);
    let now = Duration::ZERO;
    let mut inbox: Vec<(MemberId, CoordMsg)> = Vec::new();
    // Join in reverse order: verdicts must follow the hosts' ranks, not member ids.
    for (i, a) in agents.iter_mut().enumerate().rev() {
        for act in a.on_connected(now, problem) {
            if let AgentAction::Send(m) = act {
                inbox.extend(sends(&coord.on_message(now, i as MemberId, m)));
            }
        }
    }
    while !inbox.is_empty() {
        let batch = std::mem::take(&mut inbox);
        for (id, msg) in batch {
            for act in agents[id as usize].on_message(now, problem, msg) {
                if let AgentAction::Send(m) = act {
                    inbox.extend(sends(&coord.on_message(now, id, m)));
                }
            }
        }
    }
    agents
}

/// With selection, the pure machines wired back to back reproduce `solver::solve` (the
/// priced restart and every damped swap round) and end at its allocation.
#[test]
fn in_memory_cluster_with_selection_matches_solve() {
    let (problem, opts, solution) = crate::protocol::selection_case();
    let rho = default_rho(&problem);
    let total = (opts.iters_per_round + solution.iterations) as u64;
    let mut coord = Coordinator::new(
        CoordinatorConfig {
            max_iterations: Some(total),
            selection: SelectionSchedule::from_solve(&opts),
            ..cfg(facility_digest(&problem), rho, problem.hosts.len())
        },
        problem.facilities.clone(),
    );
    let agents = run_in_memory(&problem, &mut coord);
    assert_eq!(coord.iteration(), total);
    assert_eq!(coord.exchanges_done(), opts.rounds as u32 + 1);
    assert!(coord.counters().parks + coord.counters().activations > 0);
    crate::protocol::assert_agents_match(&agents, &solution);
}

/// After the schedule (and without a period) the sets stay, until an agent's apps change:
/// its request starts an exchange at the next round boundary, where an arrived app takes
/// a free slot and a departed one is parked.
#[test]
fn apps_arriving_and_leaving_after_the_schedule_start_an_exchange() {
    let problem = generate(&GeneratorConfig {
        k: 2,
        seed: 9,
        ..GeneratorConfig::new(3, 6)
    });
    let mut coord = Coordinator::new(
        CoordinatorConfig {
            selection: SelectionSchedule {
                priced_start: false,
                rounds: 2,
                iters_per_round: 5,
                options: crate::selection::SelectionOptions {
                    swap_prob: 1.0,
                    ..Default::default()
                }
                .into(),
                ..SelectionSchedule::from_solve(&Default::default())
            },
            ..cfg(facility_digest(&problem), default_rho(&problem), 3)
        },
        problem.facilities.clone(),
    );
    let mut active = crate::protocol::fixed_active_sets(&problem);
    // Host 0 runs none of its apps yet.
    active[0].clear();
    let mut agents = crate::protocol::test_agents(&problem, &active);
    let n0 = problem.hosts[0].pairs.len();
    agents[0].set_present(&problem, vec![false; n0]);
    let now = Duration::ZERO;
    let mut inbox: Vec<(MemberId, CoordMsg)> = Vec::new();
    let deliver = |coord: &mut Coordinator,
                   id: usize,
                   acts: Vec<AgentAction>,
                   inbox: &mut Vec<(MemberId, CoordMsg)>| {
        for act in acts {
            if let AgentAction::Send(m) = act {
                inbox.extend(sends(&coord.on_message(now, id as MemberId, m)));
            }
        }
    };
    for (i, a) in agents.iter_mut().enumerate() {
        let acts = a.on_connected(now, &problem);
        deliver(&mut coord, i, acts, &mut inbox);
    }
    let pump = |coord: &mut Coordinator,
                agents: &mut Vec<AgentCore>,
                inbox: &mut Vec<(MemberId, CoordMsg)>,
                until: u64| {
        while coord.iteration() < until {
            let batch = std::mem::take(inbox);
            assert!(!batch.is_empty(), "the cluster stalled");
            for (id, msg) in batch {
                let acts = agents[id as usize].on_message(now, &problem, msg);
                deliver(coord, id as usize, acts, inbox);
            }
        }
    };
    pump(&mut coord, &mut agents, &mut inbox, 60);
    assert_eq!(coord.exchanges_done(), 3, "the schedule: exchanges 1 and 2");
    assert!(agents[0].state().active.is_empty());
    // An app arrives on host 0: one exchange, and it takes a free slot.
    let app = problem.hosts[0].pairs.start + 1;
    let mut present = vec![false; n0];
    present[1] = true;
    let acts = agents[0].set_present(&problem, present);
    assert!(acts
        .iter()
        .any(|a| matches!(a, AgentAction::Send(AgentMsg::Reselect { iteration: 61 }))));
    deliver(&mut coord, 0, acts, &mut inbox);
    pump(&mut coord, &mut agents, &mut inbox, 90);
    assert_eq!(coord.exchanges_done(), 4);
    assert_eq!(agents[0].state().active, vec![app]);
    assert!(agents[0].state().x[0] >= problem.params.x_min);
    // It leaves again: parked at the next exchange, without waiting for a period.
    let acts = agents[0].set_present(&problem, vec![false; n0]);
    deliver(&mut coord, 0, acts, &mut inbox);
    pump(&mut coord, &mut agents, &mut inbox, 120);
    assert_eq!(coord.exchanges_done(), 5);
    assert!(agents[0].state().active.is_empty());
    // Three requests: the join of host 0 (its apps changed before it joined), the arrival
    // and the departure.
    assert_eq!(coord.counters().reselect_requests, 3);
    assert_eq!(
        coord
            .status()
            .members
            .iter()
            .find(|m| m.host == problem.hosts[0].id)
            .unwrap()
            .facilities,
        0
    );
}

/// A proposal for an exchange that has not been sent is a violation; a stale one is not.
#[test]
fn exchange_answers_are_told_apart_by_number() {
    let mut c = Coordinator::new(
        CoordinatorConfig {
            selection: SelectionSchedule {
                iters_per_round: 1,
                ..SelectionSchedule::from_solve(&Default::default())
            },
            ..cfg(7, 1.0, 1)
        },
        vec![facility("a"), facility("b")],
    );
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    let e = c.epoch();
    // One round, then the priced restart (exchange 0) goes out and rounds pause.
    let out = c.on_message(MS, 1, contrib(e, 1, 0, 0.3));
    assert!(sends(&out)
        .iter()
        .any(|(_, m)| matches!(m, CoordMsg::Restart { exchange: 0, .. })));
    assert!(c.selecting());
    let out = c.on_message(MS, 1, contrib(e, 2, 0, 0.3));
    // A contribution to a round not sent (rounds pause) is a violation; h1 is gone and the
    // restart completes without it.
    assert!(
        out.iter().any(|a| matches!(a, Action::Close(1, _))),
        "{out:?}"
    );
    assert!(!c.selecting());
    // An answer to an exchange not yet sent is a violation too.
    c.on_message(2 * MS, 2, join("h2", 7, 0, 0.2));
    let out = c.on_message(
        3 * MS,
        2,
        AgentMsg::Proposal(ProposalMsg {
            exchange: 3,
            park: None,
            activate: None,
        }),
    );
    assert!(out.iter().any(|a| matches!(a, Action::Close(2, _))));
    c.on_message(4 * MS, 3, join("h3", 7, 0, 0.2));
    // A stale answer (exchange 0 is over) is ignored, not a violation.
    assert!(!c.selecting());
    assert_eq!(c.exchanges_done(), 1);
    let out = c.on_message(
        5 * MS,
        3,
        AgentMsg::Selected(SelectedMsg {
            exchange: 0,
            pairs: vec![(1, 1)],
            floor: vec![(1, 0.0)],
            entries: vec![(1, 0.1)],
        }),
    );
    assert!(
        !out.iter().any(|a| matches!(a, Action::Close(..))),
        "stale: {out:?}"
    );
    assert_eq!(c.status().facilities[1].pairs, 0);
}

/// `set_weight` is checked, reaches every member at once and every later joiner after
/// its welcome; the operator state round-trips, and a bad one is refused whole.
#[test]
fn weights_reach_members_and_joiners_and_operator_state_round_trips() {
    let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a"), facility("b")]);
    c.set_apps(vec!["x".into(), "y".into()]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    assert!(c.set_weight("z", 1.0).unwrap_err().contains("no app"));
    for bad in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert!(c.set_weight("x", bad).is_err(), "{bad}");
    }
    let out = c.set_weight("y", 2.5).unwrap();
    assert_eq!(
        sends(&out),
        vec![(
            1,
            CoordMsg::SetWeight {
                app: "y".into(),
                weight: 2.5
            }
        )]
    );
    let out = c.on_message(MS, 2, join("h2", 7, 1, 0.2));
    let to2: Vec<CoordMsg> = sends(&out)
        .into_iter()
        .filter(|(id, _)| *id == 2)
        .map(|(_, m)| m)
        .collect();
    assert!(matches!(to2[0], CoordMsg::Welcome { .. }));
    assert!(to2.contains(&CoordMsg::SetWeight {
        app: "y".into(),
        weight: 2.5
    }));
    c.set_capacity("b", 0.5).unwrap();
    c.drain(2 * MS, "h2").unwrap();
    let st = c.operator_state();
    assert_eq!(st.capacities, BTreeMap::from([("b".to_string(), 0.5)]));
    assert_eq!(st.weights, BTreeMap::from([("y".to_string(), 2.5)]));
    assert_eq!(st.drained, vec!["h2".to_string()]);
    let mut r = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a"), facility("b")]);
    r.set_apps(vec!["x".into(), "y".into()]);
    assert!(r.restore(&st).is_empty());
    assert_eq!(r.operator_state(), st);
    assert_eq!(r.status().facilities[1].capacity, 0.5);
    // A state with changes that do not fit: those that fit are applied, the others
    // reported (the caller sets the file aside), never an error that stops the start.
    let mut bad = st.clone();
    bad.weights.insert("nope".into(), 1.0);
    bad.capacities.insert("a".into(), 1e308);
    bad.drained.push(String::new());
    let mut q = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a"), facility("b")]);
    q.set_apps(vec!["x".into(), "y".into()]);
    let refused = q.restore(&bad);
    assert_eq!(refused.len(), 3, "{refused:?}");
    assert!(
        refused.iter().any(|r| r.contains("\"nope\"")),
        "{refused:?}"
    );
    assert!(refused.iter().any(|r| r.contains("1e308")), "{refused:?}");
    assert!(
        refused.iter().any(|r| r.contains("host id \"\"")),
        "{refused:?}"
    );
    assert_eq!(q.operator_state(), st);
}

/// Issue 19, items 1 and 5: an operator command may not store what a restart would
/// refuse, nor values the instance validation refuses.
#[test]
fn operator_commands_refuse_what_a_restart_or_the_instance_would() {
    let mut c = Coordinator::new(cfg(7, 1.0, 1), vec![facility("a")]);
    c.set_hosts(vec!["h1".into(), "h2".into()]);
    c.on_message(Duration::ZERO, 1, join("h1", 7, 0, 0.2));
    for bad in ["", "h 1", "../h1", &"h".repeat(65)] {
        assert!(c.drain(MS, bad).unwrap_err().contains("host id"), "{bad:?}");
    }
    assert!(c.drain(MS, "h9").unwrap_err().contains("no host \"h9\""));
    assert_eq!(c.members(), 1);
    assert!(c.operator_state().drained.is_empty());
    assert!(
        c.drain(MS, "h2").is_ok(),
        "a host of the instance, not a member"
    );
    for bad in [1e308, 5e-324, 1e-300, 0.0, -1.0, f64::NAN, f64::INFINITY] {
        let e = c.set_capacity("a", bad).unwrap_err();
        assert!(e.contains("[1e-9, 1e9]"), "{bad}: {e}");
    }
    c.set_capacity("a", 1e-9).unwrap();
    c.set_capacity("a", 1e9).unwrap();
    // The live problem knows no host list: any well-formed name may be drained.
    let mut l = Coordinator::new_live(cfg(0, 1.0, 1), LivePolicy::default());
    assert!(l.drain(MS, "later").is_ok());
    assert!(l.drain(MS, "").is_err());
}

/// Verdicts follow the hosts' ranks: with room for one more pair at x_min, the
/// lower-ranked host's activation wins, the other is refused; parks always hold.
#[test]
fn activations_are_decided_in_rank_order_against_the_floor() {
    let fac = vec![
        Facility {
            id: "a".into(),
            capacity: 1.0,
            cost: 0.0,
        },
        Facility {
            id: "b".into(),
            capacity: 0.75,
            cost: 0.0,
        },
    ];
    let mut c = Coordinator::new(
        CoordinatorConfig {
            selection: SelectionSchedule {
                priced_start: false,
                iters_per_round: 1,
                ..SelectionSchedule::from_solve(&Default::default())
            },
            ..cfg(7, 1.0, 2)
        },
        fac,
    );
    let j = |rank: u32| {
        AgentMsg::Join(Join {
            host: format!("h{rank}"),
            facility_digest: 7,
            pairs: vec![(0, 1), (1, 1)],
            entries: vec![(0, 0.2), (1, 0.1)],
            last_iteration: 0,
            last_d: Vec::new(),
            rank,
            interest: vec![0, 1],
            floor: vec![(0, 0.25), (1, 0.25)],
            exchanges: 0,
        })
    };
    // Member 1 has rank 5, member 2 rank 3: member 2 decides first.
    c.on_message(Duration::ZERO, 1, j(5));
    c.on_message(Duration::ZERO, 2, j(3));
    let e = c.epoch();
    c.on_message(MS, 1, contrib(e, 1, 0, 0.2));
    let out = c.on_message(MS, 2, contrib(e, 1, 0, 0.2));
    let selects: Vec<_> = sends(&out)
        .into_iter()
        .filter(|(_, m)| matches!(m, CoordMsg::Select { exchange: 1, .. }))
        .collect();
    assert_eq!(selects.len(), 2);
    let CoordMsg::Select { prices, .. } = &selects[0].1 else {
        unreachable!()
    };
    assert_eq!(prices.len(), 2);
    // Facility b holds 0.5 of 0.75 at the floor: room for one more 0.25, not two.
    let propose = |park| {
        AgentMsg::Proposal(ProposalMsg {
            exchange: 1,
            park,
            activate: Some(vec![(1, 0.25)]),
        })
    };
    c.on_message(2 * MS, 1, propose(Some(vec![(0, 0.25)])));
    let out = c.on_message(2 * MS, 2, propose(None));
    let verdicts: BTreeMap<MemberId, bool> = sends(&out)
        .into_iter()
        .filter_map(|(id, m)| match m {
            CoordMsg::Verdict { activate, .. } => Some((id, activate)),
            _ => None,
        })
        .collect();
    assert_eq!(verdicts, BTreeMap::from([(1, false), (2, true)]));
    let s = c.status();
    assert_eq!(s.counters.parks, 0, "counted when the exchange completes");
    for (id, pairs) in [(1u64, vec![(1, 1)]), (2, vec![(0, 1), (1, 2)])] {
        c.on_message(
            3 * MS,
            id,
            AgentMsg::Selected(SelectedMsg {
                exchange: 1,
                floor: pairs.iter().map(|&(f, n)| (f, 0.25 * n as f64)).collect(),
                entries: pairs.iter().map(|&(f, _)| (f, 0.1)).collect(),
                pairs,
            }),
        );
    }
    let s = c.status();
    assert!(!s.selection.in_progress);
    assert_eq!(s.selection.exchanges_done, 2);
    assert_eq!(
        (
            s.counters.parks,
            s.counters.activations,
            s.counters.refused_activations
        ),
        (1, 1, 1)
    );
    assert_eq!(s.facilities[1].pairs, 3);
    assert_eq!(s.facilities[0].pairs, 1);
}

/// The pure machines wired back to back equal the in-process solver on fixed active sets.
#[test]
fn in_memory_cluster_matches_the_in_process_solver() {
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
    let digest = facility_digest(&problem);
    let mut coord = Coordinator::new(
        CoordinatorConfig {
            max_iterations: Some(iters as u64),
            ..cfg(digest, rho, problem.hosts.len())
        },
        problem.facilities.clone(),
    );
    let mut agents = crate::protocol::test_agents(&problem, &active);
    let now = Duration::ZERO;
    let mut inbox: Vec<(MemberId, CoordMsg)> = Vec::new();
    for (i, a) in agents.iter_mut().enumerate() {
        for act in a.on_connected(now, &problem) {
            if let AgentAction::Send(m) = act {
                inbox.extend(sends(&coord.on_message(now, i as MemberId, m)));
            }
        }
    }
    while !inbox.is_empty() {
        let batch = std::mem::take(&mut inbox);
        for (id, msg) in batch {
            for act in agents[id as usize].on_message(now, &problem, msg) {
                if let AgentAction::Send(m) = act {
                    inbox.extend(sends(&coord.on_message(now, id, m)));
                }
            }
        }
    }
    assert_eq!(coord.iteration(), iters as u64);
    for (a, r) in agents.iter().zip(&reference) {
        assert_eq!(a.state().active, r.active);
        for (x, y) in a.state().x.iter().zip(&r.x) {
            assert!((x - y).abs() < 1e-9, "{x} vs {y}");
        }
    }
}
