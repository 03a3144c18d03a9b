use super::*;

fn nic() -> NicParams {
    NicParams {
        line_rate_gbps: 10.0,
        max_active: 4,
        wqe_budget: 1.0,
        poll_budget: 16.0,
    }
}

fn links() -> Vec<LiveFacility> {
    ["h1", "h2"]
        .iter()
        .enumerate()
        .map(|(i, h)| LiveFacility {
            id: link_id(h),
            host: h.to_string(),
            line_rate_gbps: 40.0,
            capacity: 1.0,
            gids: vec![[i as u8 + 1; 16]],
        })
        .collect()
}

#[test]
fn coefficients_are_shares_of_connections_times_the_line_rate() {
    let mut policy = LivePolicy::default();
    policy.set_weight("b", Some(3.0));
    let apps = [
        LiveApp {
            name: "b".into(),
            peers: vec![([1; 16], 3.0), ([2; 16], 1.0), ([9; 16], 4.0)],
            own: 0.0,
        },
        LiveApp {
            name: "a".into(),
            peers: vec![],
            own: 0.0,
        },
    ];
    let (p, unknown) = host_problem("h0", &nic(), &policy, &links(), &apps);
    assert_eq!(p.app_names, ["a", "b"]);
    assert!(p.pairs[0].uses.is_empty(), "no connections: no facility");
    assert_eq!(p.pairs[0].weight, 1.0, "the default weight");
    assert_eq!(p.pairs[1].weight, 3.0);
    // 8 QPs: 3 to h1, 1 to h2, 4 to a GID no agent owns; 10 Gb/s into 40 Gb/s links.
    assert_eq!(p.pairs[1].uses, vec![(0, 0.09375), (1, 0.03125)]);
    assert_eq!(
        unknown,
        vec![UnknownPeer {
            app: "b".into(),
            gid: [9; 16]
        }]
    );
}

#[test]
fn byte_shares_weigh_the_links_and_read_data_loads_the_own_link() {
    let policy = LivePolicy::default();
    // On h1: 3 parts written to h2 for 1 part read from it (READ data comes back to h1).
    let apps = [LiveApp {
        name: "r".into(),
        peers: vec![([2; 16], 0.75)],
        own: 0.25,
    }];
    let (p, unknown) = host_problem("h1", &nic(), &policy, &links(), &apps);
    assert!(unknown.is_empty());
    assert_eq!(p.pairs[0].uses, vec![(0, 0.0625), (1, 0.1875)]);
    // A pure reader loads only its own link; a host not yet in the table, nothing.
    let reader = [LiveApp {
        name: "r".into(),
        peers: vec![([2; 16], 0.0)],
        own: 1.0,
    }];
    let (p, _) = host_problem("h1", &nic(), &policy, &links(), &reader);
    assert_eq!(p.pairs[0].uses, vec![(0, 0.25)]);
    let (p, _) = host_problem("h9", &nic(), &policy, &links(), &reader);
    assert!(p.pairs[0].uses.is_empty());
}

#[test]
fn policy_refuses_weights_out_of_range() {
    for w in [0.0, f64::NAN, 1e308, -1.0, f64::INFINITY] {
        let mut p = LivePolicy::default();
        p.set_weight("x", Some(w));
        let e = p.check().unwrap_err();
        assert!(e.contains("app \"x\""), "{e}");
        let p = LivePolicy {
            default_weight: w,
            ..LivePolicy::default()
        };
        assert!(p.check().unwrap_err().contains("default_weight"));
    }
    assert_eq!(LivePolicy::default().check(), Ok(()));
}

#[test]
fn a_snapshot_is_a_valid_instance_of_the_reported_rows() {
    let policy = LivePolicy::default();
    let apps = [LiveApp {
        name: "a".into(),
        peers: vec![([2; 16], 1.0)],
        own: 0.0,
    }];
    let (p, _) = host_problem("h1", &nic(), &policy, &links(), &apps);
    let report = HostReport::of(&p, 10.0, &[[1; 16]], &|_| Some(0.5), &BTreeMap::new());
    assert_eq!(report.check(2), Ok(()));
    // Who runs the app is carried, bounded; a report beyond the bounds is refused.
    let id = |uid| AppIdentity {
        uid,
        gid: uid,
        cgroup: "/".into(),
        processes: 1,
    };
    let ids = BTreeMap::from([("a".to_string(), (0..20).map(id).collect())]);
    let mut with_ids = HostReport::of(&p, 10.0, &[[1; 16]], &|_| Some(0.5), &ids);
    let a = &with_ids.apps[0];
    assert_eq!((a.identities.len(), a.more_identities), (8, 12));
    assert_eq!(with_ids.check(2), Ok(()));
    with_ids.apps[0].identities = (0..20).map(id).collect();
    assert!(with_ids.check(2).unwrap_err().contains("identities"));
    let facilities: Vec<Facility> = p.facilities.clone();
    let inst = snapshot(&policy, &facilities, &[("h1".into(), report)]);
    let q = inst.into_problem().expect("valid");
    assert_eq!(q.pairs[0].uses, vec![(1, 0.25)]);
    assert_eq!(q.hosts[0].id, "h1");
}

/// An app that arrives while the coordinator has not yet heard the host's `Update` (the
/// exchange carries no price for the app's link) keeps asking for exchanges until one
/// decides. Settled on that empty answer, it stayed parked until some unrelated change:
/// 35 s in CI after an agent restart.
#[test]
fn an_arrival_answered_before_its_prices_asks_again() {
    use crate::admm::HostState;
    use crate::protocol::agent::AgentConfig;
    use crate::protocol::wire::SelectionParams;
    use crate::protocol::{CoordMsg, Shard};
    use std::time::Duration;
    let ms = Duration::from_millis(1);
    let mut host = LiveHost::new("h1", nic(), vec![[1; 16]]);
    host.facilities = links();
    let mut problem = host.problem().0;
    let cfg = AgentConfig {
        heartbeat_interval: 100 * ms,
        coordinator_timeout: 1000 * ms,
        backoff_min: 10 * ms,
        backoff_max: 100 * ms,
    };
    let mut core = AgentCore::new(&problem, HostState::new(&problem, 0, Vec::new()), cfg);
    core.set_live("h1");
    core.on_connected(Duration::ZERO, &problem);
    let welcome = CoordMsg::Welcome {
        epoch: 1,
        iteration: 0,
        heartbeat_ms: 100,
        shard: Shard::WHOLE,
    };
    core.on_message(ms, &problem, welcome);
    let asks = |out: &[AgentAction]| {
        out.iter()
            .any(|a| matches!(a, AgentAction::Send(AgentMsg::Reselect { .. })))
    };
    // A writer into h2 (facility 1) arrives.
    host.apps = vec![LiveApp {
        name: "w".into(),
        peers: vec![([2; 16], 1.0)],
        own: 0.0,
    }];
    assert!(asks(&host.rebuild(&mut core, &mut problem).actions));
    let select = |exchange: u32, prices: Vec<(u32, f64)>| CoordMsg::Select {
        exchange,
        round: exchange - 1,
        prices,
        options: SelectionParams {
            swap_prob: 1.0,
            hysteresis: 0.0,
            fairness: 0.0,
            discount: 0.5,
            seed: 1,
        },
    };
    let proposal = |out: &[AgentAction]| {
        out.iter().find_map(|a| match a {
            AgentAction::Send(AgentMsg::Proposal(p)) => Some(p.clone()),
            _ => None,
        })
    };
    // Exchange 1 comes before the coordinator priced the link: an empty answer, and the
    // host asks again.
    let out = core.on_message(2 * ms, &problem, select(1, Vec::new()));
    assert_eq!(proposal(&out).expect("an answer").activate, None);
    let out = core.on_message(
        3 * ms,
        &problem,
        CoordMsg::Verdict {
            exchange: 1,
            activate: false,
        },
    );
    assert!(asks(&out), "settled with the arrival parked: {out:?}");
    // Exchange 2 has the price: the writer takes the free slot, and the host is settled.
    let out = core.on_message(4 * ms, &problem, select(2, vec![(1, 0.0)]));
    assert!(proposal(&out).expect("an answer").activate.is_some());
    let out = core.on_message(
        5 * ms,
        &problem,
        CoordMsg::Verdict {
            exchange: 2,
            activate: true,
        },
    );
    assert_eq!(core.state().active, [0]);
    assert!(!asks(&out), "{out:?}");
}

/// Three live hosts (h2 the busy receiver: three writers on h0 and h1 send into it, an idle
/// app on h1, a server on h2 answering both) with their problems and agents' cores.
fn three_live_hosts() -> (
    Vec<LiveHost>,
    Vec<Problem>,
    Vec<crate::protocol::agent::AgentCore>,
) {
    use crate::admm::HostState;
    use crate::protocol::agent::{AgentConfig, AgentCore};
    let ms = std::time::Duration::from_millis(1);
    let gid = |h: u8| [h + 1; 16];
    let app = |name: &str, peers: &[(u8, f64)]| LiveApp {
        name: name.into(),
        peers: peers.iter().map(|&(h, n)| (gid(h), n)).collect(),
        own: 0.0,
    };
    let apps = [
        vec![app("w1", &[(2, 2.0)]), app("w2", &[(2, 1.0), (1, 1.0)])],
        vec![app("w3", &[(2, 1.0)]), app("idle", &[])],
        vec![app("srv", &[(0, 3.0), (1, 1.0)])],
    ];
    let hosts: Vec<LiveHost> = (0..3u8)
        .map(|h| {
            let mut l = LiveHost::new(&format!("h{h}"), nic(), vec![gid(h)]);
            l.apps = apps[h as usize].clone();
            l
        })
        .collect();
    let problems: Vec<Problem> = hosts.iter().map(|h| h.problem().0).collect();
    let acfg = AgentConfig {
        heartbeat_interval: 100 * ms,
        coordinator_timeout: 1000 * ms,
        backoff_min: 10 * ms,
        backoff_max: 100 * ms,
    };
    let agents = problems
        .iter()
        .zip(&hosts)
        .map(|(p, h)| {
            let mut a = AgentCore::new(p, HostState::new(p, 0, Vec::new()), acfg.clone());
            a.set_live(&h.host);
            a
        })
        .collect();
    (hosts, problems, agents)
}

/// `solve`'s options the live cluster is compared with: tight, the swap rounds only (the
/// control plane runs them, not the verified search; docs/model.md).
fn tight_solve_options() -> crate::solver::SolveOptions {
    crate::solver::SolveOptions {
        eps_primal: 1e-12,
        eps_dual: 1e-12,
        max_iter: 20_000,
        certificate_iters: 0,
        polish_trials: 0,
        ..Default::default()
    }
}

/// Host `i`'s agent actions as its driver handles them: the policy and the table rebuild
/// the host (whose own actions are handled in turn); the messages to send are returned.
fn drive_live(
    i: usize,
    mut acts: Vec<AgentAction>,
    hosts: &mut [LiveHost],
    agents: &mut [crate::protocol::agent::AgentCore],
    problems: &mut [Problem],
) -> Vec<crate::protocol::AgentMsg> {
    let mut sends = Vec::new();
    while let Some(act) = (!acts.is_empty()).then(|| acts.remove(0)) {
        match act {
            AgentAction::Send(m) => sends.push(m),
            AgentAction::Policy(p) => {
                hosts[i].policy = p;
                acts.extend(hosts[i].rebuild(&mut agents[i], &mut problems[i]).actions);
            }
            AgentAction::Facilities(f) => {
                hosts[i].facilities = f;
                acts.extend(hosts[i].rebuild(&mut agents[i], &mut problems[i]).actions);
            }
            _ => {}
        }
    }
    sends
}

/// The live cluster against `solve` on its snapshot: the same active sets, rates within
/// 1e-6, host by host.
fn assert_snapshot_solves_to(
    snapshot: &Problem,
    agents: &[crate::protocol::agent::AgentCore],
    opts: &crate::solver::SolveOptions,
) {
    let solution = crate::solver::solve(snapshot, opts);
    assert!(solution.converged);
    for (h, agent) in agents.iter().enumerate() {
        let live = agent.state();
        let off = &solution.hosts[h];
        assert_eq!(snapshot.hosts[h].id, format!("h{h}"));
        let first = snapshot.hosts[h].pairs.start;
        let offline: Vec<usize> = off.active.iter().map(|p| p - first).collect();
        assert_eq!(live.active, offline, "host h{h}");
        for (x, y) in live.x.iter().zip(&off.x) {
            assert!((x - y).abs() <= 1e-6, "host h{h}: live {x} vs solve {y}");
        }
    }
}

/// Three live agents and a live coordinator, back to back in memory: the hosts join with
/// nothing but their NICs and apps, learn the facility table, report their rows, and the
/// cluster converges; `solve` on the snapshot reaches the same allocation.
#[test]
fn a_live_cluster_converges_to_the_allocation_solve_gives_on_its_snapshot() {
    use crate::protocol::coordinator::{
        Action, Coordinator, CoordinatorConfig, MemberId, SelectionSchedule,
    };
    use crate::protocol::{CoordMsg, Shard};
    use std::time::Duration;
    let ms = Duration::from_millis(1);
    let (mut hosts, mut problems, mut agents) = three_live_hosts();
    let opts = tight_solve_options();
    let coordinator = |max_iterations| {
        Coordinator::new_live(
            CoordinatorConfig {
                rho: 10.0,
                facility_digest: 0,
                heartbeat_interval: 100 * ms,
                member_timeout: 1000 * ms,
                round_deadline: 50 * ms,
                max_staleness: 0,
                round_interval: Duration::ZERO,
                min_members: 3,
                max_iterations: Some(max_iterations),
                selection: SelectionSchedule::from_solve(&opts),
                shard: Shard::WHOLE,
            },
            LivePolicy::default(),
        )
    };
    let mut coord = coordinator(3000);
    let now = Duration::ZERO;
    let run = |coord: &mut Coordinator,
               agents: &mut Vec<AgentCore>,
               hosts: &mut Vec<LiveHost>,
               problems: &mut Vec<Problem>,
               mut inbox: Vec<(MemberId, CoordMsg)>| {
        let sends = |out: Vec<Action>| -> Vec<(MemberId, CoordMsg)> {
            out.into_iter()
                .filter_map(|a| match a {
                    Action::Send(id, m) => Some((id, m)),
                    _ => None,
                })
                .collect()
        };
        while !inbox.is_empty() {
            for (id, msg) in std::mem::take(&mut inbox) {
                let i = id as usize;
                let acts = agents[i].on_message(now, &problems[i], msg);
                for m in drive_live(i, acts, hosts, agents, problems) {
                    inbox.extend(sends(coord.on_message(now, id, m)));
                }
            }
        }
    };
    // The agents connect in `order`; what the coordinator answers their joins.
    let connect = |coord: &mut Coordinator,
                   agents: &mut Vec<AgentCore>,
                   problems: &[Problem],
                   order: &[usize]| {
        let mut inbox = Vec::new();
        for &i in order {
            for act in agents[i].on_connected(now, &problems[i]) {
                if let AgentAction::Send(m) = act {
                    inbox.extend(
                        coord
                            .on_message(now, i as MemberId, m)
                            .into_iter()
                            .filter_map(|a| match a {
                                Action::Send(id, m) => Some((id, m)),
                                _ => None,
                            }),
                    );
                }
            }
        }
        inbox
    };
    let inbox = connect(&mut coord, &mut agents, &problems, &[0, 1, 2]);
    run(&mut coord, &mut agents, &mut hosts, &mut problems, inbox);
    assert_eq!(coord.iteration(), 3000);
    let status = coord.status();
    let ids: Vec<&str> = status.facilities.iter().map(|f| f.id.as_str()).collect();
    assert_eq!(ids, ["rx:h0", "rx:h1", "rx:h2"]);
    let rx2 = &status.facilities[2];
    assert!(
        rx2.usage > 0.999 && rx2.price > 0.0,
        "the busy link binds: {rx2:?}"
    );
    let active: Vec<usize> = agents.iter().map(|a| a.state().active.len()).collect();
    assert_eq!(active, [2, 2, 1], "every app active (k = 4)");
    let snapshot = coord
        .snapshot()
        .expect("live")
        .into_problem()
        .expect("valid");
    assert_eq!(snapshot.pairs.len(), 5);
    assert_snapshot_solves_to(&snapshot, &agents, &opts);

    // The coordinator restarts; the hosts come back in the reverse order, so the new
    // table numbers the links differently. Their `Update`s carry the terms they last
    // stepped with, by link id: after one round the busy link's price is where it was.
    let price = |c: &Coordinator, id: &str| {
        let s = c.status();
        s.facilities.iter().find(|f| f.id == id).expect(id).price
    };
    let before = price(&coord, "rx:h2");
    let mut coord = coordinator(1);
    for h in &mut hosts {
        // The new coordinator's table replaces the old before the agent rebuilds (its
        // driver handles `Welcome`, `Policy` and `Facilities` as one batch).
        h.facilities.clear();
    }
    let inbox = connect(&mut coord, &mut agents, &problems, &[2, 1, 0]);
    run(&mut coord, &mut agents, &mut hosts, &mut problems, inbox);
    let ids: Vec<String> = coord
        .status()
        .facilities
        .into_iter()
        .map(|f| f.id)
        .collect();
    assert_eq!(ids, ["rx:h2", "rx:h1", "rx:h0"]);
    let after = price(&coord, "rx:h2");
    assert!(
        (after / before - 1.0).abs() < 0.05,
        "the busy link's price {before} before the restart, {after} after one round"
    );
}

/// The live problem through a relay: h0 and h1 behind one relay, h2 connected directly.
/// The relay passes the coordinator's policy and table down and each agent's report up
/// named, so every host gets its own link, and the cluster reaches the allocation `solve`
/// gives on the snapshot, as the direct wiring does (the test above).
#[test]
fn a_live_cluster_behind_a_relay_converges_to_the_allocation_solve_gives() {
    use crate::protocol::coordinator::{
        Action, Coordinator, CoordinatorConfig, MemberId, SelectionSchedule,
    };
    use crate::protocol::relay::{Relay, RelayAction, RelayConfig};
    use crate::protocol::{AgentMsg, CoordMsg, Shard};
    use std::time::Duration;
    let ms = Duration::from_millis(1);
    let (mut hosts, mut problems, mut agents) = three_live_hosts();
    let opts = tight_solve_options();
    let mut coord = Coordinator::new_live(
        CoordinatorConfig {
            rho: 10.0,
            facility_digest: 0,
            heartbeat_interval: 100 * ms,
            member_timeout: 1000 * ms,
            round_deadline: 50 * ms,
            max_staleness: 0,
            round_interval: Duration::ZERO,
            min_members: 2,
            max_iterations: Some(3000),
            selection: SelectionSchedule::from_solve(&opts),
            shard: Shard::WHOLE,
        },
        LivePolicy::default(),
    );
    let mut relay = Relay::new(RelayConfig {
        host: "rack".into(),
        facility_digest: 0,
        facilities: 0,
        live: true,
        heartbeat_interval: 100 * ms,
        member_timeout: 1000 * ms,
        upstream_timeout: 1000 * ms,
        round_deadline: 40 * ms,
        max_staleness: 0,
        min_agents: 2,
        backoff_min: 10 * ms,
        backoff_max: 100 * ms,
    });
    // Coordinator members: 0 is the relay (hosts 0 and 1), 2 is h2.
    enum Msg {
        Coord(MemberId, AgentMsg),
        Relay(MemberId, AgentMsg),
        Agent(usize, CoordMsg),
    }
    let now = Duration::ZERO;
    let mut inbox: Vec<Msg> = Vec::new();
    assert!(relay.on_upstream_connected(now).is_empty());
    let from_agent = |h: usize, m: AgentMsg| {
        if h == 2 {
            Msg::Coord(2, m)
        } else {
            Msg::Relay(h as MemberId, m)
        }
    };
    for h in [1, 2, 0] {
        for act in agents[h].on_connected(now, &problems[h]) {
            if let AgentAction::Send(m) = act {
                inbox.push(from_agent(h, m));
            }
        }
    }
    while !inbox.is_empty() {
        for msg in std::mem::take(&mut inbox) {
            match msg {
                Msg::Coord(id, m) => {
                    for a in coord.on_message(now, id, m) {
                        match a {
                            Action::Send(0, m) => {
                                for r in relay.on_upstream(now, m) {
                                    match r {
                                        RelayAction::Up(m) => inbox.push(Msg::Coord(0, m)),
                                        RelayAction::Down(h, m) => {
                                            inbox.push(Msg::Agent(h as usize, m))
                                        }
                                        RelayAction::Event(_) => {}
                                        r => panic!("{r:?}"),
                                    }
                                }
                            }
                            Action::Send(to, m) => inbox.push(Msg::Agent(to as usize, m)),
                            _ => {}
                        }
                    }
                }
                Msg::Relay(h, m) => {
                    for r in relay.on_agent(now, h, m) {
                        match r {
                            RelayAction::Up(m) => inbox.push(Msg::Coord(0, m)),
                            RelayAction::Down(h, m) => inbox.push(Msg::Agent(h as usize, m)),
                            RelayAction::Event(_) => {}
                            r => panic!("{r:?}"),
                        }
                    }
                }
                Msg::Agent(i, m) => {
                    let acts = agents[i].on_message(now, &problems[i], m);
                    for m in drive_live(i, acts, &mut hosts, &mut agents, &mut problems) {
                        inbox.push(from_agent(i, m));
                    }
                }
            }
        }
    }
    assert_eq!(coord.iteration(), 3000);
    let status = coord.status();
    let mut ids: Vec<&str> = status.facilities.iter().map(|f| f.id.as_str()).collect();
    ids.sort_unstable();
    assert_eq!(
        ids,
        ["rx:h0", "rx:h1", "rx:h2"],
        "a link per host, not per relay"
    );
    let members: Vec<(&str, Vec<&str>)> = status
        .members
        .iter()
        .map(|m| {
            (
                m.host.as_str(),
                m.rack.iter().map(|r| r.host.as_str()).collect(),
            )
        })
        .collect();
    assert_eq!(members, [("rack", vec!["h0", "h1"]), ("h2", vec![])]);
    let active: Vec<usize> = agents.iter().map(|a| a.state().active.len()).collect();
    assert_eq!(active, [2, 2, 1], "every app active (k = 4)");
    let snapshot = coord
        .snapshot()
        .expect("live")
        .into_problem()
        .expect("valid");
    assert_eq!(snapshot.pairs.len(), 5);
    assert_snapshot_solves_to(&snapshot, &agents, &opts);
    // An agent leaving the relay takes its report with it.
    for r in relay.on_agent_gone(now, 1, false) {
        if let RelayAction::Up(m) = r {
            coord.on_message(now, 0, m);
        }
    }
    assert_eq!(coord.status().members[0].rack.len(), 1);
    // A relay reporting a host that is a member of its own keeps nothing of it: refused,
    // logged, and the relay stays.
    let out = coord.on_message(
        now,
        0,
        AgentMsg::RackHost(crate::protocol::wire::RackHostMsg {
            host: "h2".into(),
            report: match hosts[2].report(&agents[2], &problems[2]) {
                AgentMsg::Host(r) => Some(r),
                m => panic!("{m:?}"),
            },
        }),
    );
    assert!(
        out.iter().any(|a| matches!(a, Action::Event(_)))
            && !out.iter().any(|a| matches!(a, Action::Close(..))),
        "{out:?}"
    );
    assert_eq!(coord.status().members[0].rack.len(), 1);
}
