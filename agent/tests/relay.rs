//! A coordinator (the service code, in this process), a relay (`drum-coordinator relay`, a
//! process of its own) and real `drum-agent` processes behind it, on 127.0.0.1 with mutual
//! TLS as `dev-certs` issues it: the agents reach `solve`'s allocation through the relay,
//! selection schedule included (priced restart and damped swap rounds, each host's proposal
//! decided at its own rank), as they do talking to the coordinator directly; a relay killed
//! with SIGKILL leaves them fail-static with their rates, and a restarted relay brings them
//! back. The rack assembles more slowly than the coordinator's join timeout.
//!
//! The relay is the `drum-coordinator` binary of this build (`cargo test --workspace` builds
//! it; alone: `cargo build --release -p drum-coordinator` first).

use drum_agent::rate_table::{LinkState, RateTable, TableFile};
use drum_common::generator::{generate, GeneratorConfig};
use drum_common::instance::Instance;
use drum_common::solver::{solve, SolveOptions};
use drum_coordinator::dev_ca::{dev_certs, issue_relay, DevCa};
use drum_coordinator::server::{ServeOptions, ServeSettings, Server};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TIMEOUT_MS: u64 = 3000;

/// A child process killed (SIGKILL) and reaped on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn wait_for(what: &str, limit: Duration, mut ok: impl FnMut() -> bool) {
    let t = Instant::now();
    while !ok() {
        assert!(
            t.elapsed() < limit,
            "timed out after {limit:?} waiting for {what}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn coordinator_binary() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let bin = exe
        .parent()
        .unwrap()
        .parent()
        .unwrap()
        .join("drum-coordinator");
    assert!(
        bin.exists(),
        "{} is missing: build it first (cargo build --release -p drum-coordinator)",
        bin.display()
    );
    bin
}

fn relay(dir: &Path, listen: SocketAddr, upstream: SocketAddr, agents: usize) -> Proc {
    let certs = dir.join("certs");
    let config = dir.join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "host = \"relay-a\"\nlisten = \"{listen}\"\nupstream = \"{upstream}\"\n\
             server_name = \"localhost\"\ninstance = \"instance.json\"\nmin_agents = {agents}\n\
             round_deadline_ms = 150\nmax_staleness = 0\nheartbeat_ms = 100\n\
             member_timeout_ms = {TIMEOUT_MS}\ncoordinator_timeout_ms = {TIMEOUT_MS}\n\
             [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/relay-relay-a.pem\"\nkey = \"certs/relay-relay-a.key\"\n\
             [upstream_tls]\nca = \"certs/ca.pem\"\ncert = \"certs/agent-relay-a.pem\"\nkey = \"certs/agent-relay-a.key\"\n"
        ),
    )
    .unwrap();
    assert!(certs.join("relay-relay-a.pem").exists());
    Proc(
        Command::new(coordinator_binary())
            .args(["relay", "--config"])
            .arg(&config)
            .env("DRUM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join("relay.log")).unwrap())
            .spawn()
            .expect("start the relay"),
    )
}

fn agent(dir: &Path, id: &str, relay: SocketAddr) -> Proc {
    let config = dir.join(format!("agent-{id}.toml"));
    std::fs::write(
        &config,
        format!(
            "host = {id:?}\ninstance = \"instance.json\"\ncoordinator = \"{relay}\"\n\
             rate_table = \"rates-{id}.json\"\nheartbeat_ms = 100\n\
             coordinator_timeout_ms = {TIMEOUT_MS}\nbackoff_min_ms = 50\nbackoff_max_ms = 400\n\
             [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/agent-{id}.pem\"\nkey = \"certs/agent-{id}.key\"\n"
        ),
    )
    .unwrap();
    Proc(
        Command::new(env!("CARGO_BIN_EXE_drum-agent"))
            .arg("--config")
            .arg(&config)
            .env("DRUM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(dir.join(format!("agent-{id}.log"))).unwrap())
            .spawn()
            .expect("start drum-agent"),
    )
}

#[test]
fn agents_behind_a_relay_converge_fail_static_when_it_dies_and_return_with_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let problem = generate(&GeneratorConfig {
        k: 2,
        seed: 11,
        ..GeneratorConfig::new(4, 6)
    });
    std::fs::write(
        d.join("instance.json"),
        Instance::from_problem(&problem).to_json(),
    )
    .unwrap();
    let hosts: Vec<String> = problem.hosts.iter().map(|h| h.id.clone()).collect();
    let sans: Vec<String> = vec!["localhost".into(), "127.0.0.1".into()];
    let certs = dev_certs(&d.join("certs"), &sans, &hosts).unwrap();
    issue_relay(&DevCa::open(&d.join("certs")).unwrap(), "relay-a", &sans).unwrap();

    // The coordinator: `solve`'s schedule (priced restart, 10 damped swap rounds) with tight
    // tolerances, synchronous rounds, stops after the iterations `solve` took.
    let options = ServeOptions {
        eps_primal: 1e-11,
        eps_dual: 1e-11,
        selection_period_ms: 0,
        ..ServeOptions::default()
    };
    let reference = solve(
        &problem,
        &SolveOptions {
            max_iter: 5000,
            ..options.solve_options()
        },
    );
    assert!(reference.converged);
    let swaps: usize = reference.rounds.iter().map(|r| r.swaps).sum();
    assert!(swaps > 0, "the instance must exercise selection");
    let iterations = (options.iters_per_round as usize + reference.iterations) as u64;
    let settings = ServeSettings {
        listen: "127.0.0.1:0".parse().unwrap(),
        instance: Some(d.join("instance.json")),
        tls: certs.coordinator.clone(),
        admin_listen: Some("127.0.0.1:0".parse().unwrap()),
        rho: None,
        min_members: 1,
        round_deadline_ms: 1000,
        max_staleness: 0,
        round_interval_ms: 0,
        heartbeat_ms: 100,
        member_timeout_ms: TIMEOUT_MS,
        max_iterations: Some(iterations),
        bind_host_to_certificate: true,
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    let server = rt.block_on(Server::bind_with(settings, options)).unwrap();
    let upstream = server.local_addr().unwrap();
    let admin = server.admin_addr().unwrap();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let coordinator = rt.spawn(server.run(async {
        let _ = stopped.await;
    }));
    let status = || -> serde_json::Value {
        let (_, body) = drum_coordinator::admin::request(admin, "GET", "/status").unwrap();
        serde_json::from_str(&body).unwrap()
    };

    let listen = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let mut relay_proc = relay(d, listen, upstream, hosts.len());
    // The rack assembles more slowly than the coordinator's join timeout, which closes the
    // relay waiting for it: the first agent waits on through that, and the rack joins.
    let mut agents: Vec<Proc> = vec![agent(d, &hosts[0], listen)];
    std::thread::sleep(Duration::from_millis(TIMEOUT_MS + 1500));
    agents.extend(hosts[1..].iter().map(|h| agent(d, h, listen)));
    let table =
        |h: &str| -> Option<TableFile> { RateTable::read(&d.join(format!("rates-{h}.json"))).ok() };
    wait_for(
        "every agent at the last iteration through the relay",
        Duration::from_secs(30),
        || {
            hosts
                .iter()
                .all(|h| table(h).is_some_and(|t| t.iteration == iterations))
        },
    );
    // `solve`'s allocation, which the direct cluster reproduces too
    // (cluster::agents_converge_to_the_in_process_allocation).
    for r in &reference.hosts {
        let h = &hosts[r.host];
        let t = table(h).unwrap();
        assert_eq!(t.state, LinkState::Live);
        for (app, p) in t.apps.iter().zip(problem.hosts[r.host].pairs.clone()) {
            let want = r.active.binary_search(&p).map_or(0.0, |i| r.x[i]);
            assert_eq!(
                app.active,
                r.active.contains(&p),
                "host {h} app {}: active set differs from solve's",
                app.app
            );
            assert!(
                (app.rate - want).abs() <= 1e-6,
                "host {h} app {}: {} through the relay vs solve {want}",
                app.app,
                app.rate
            );
        }
    }
    let s = status();
    assert_eq!(s["selection"]["exchanges_done"].as_u64(), Some(11), "{s:#}");
    let log = std::fs::read_to_string(d.join("relay.log")).unwrap();
    assert!(!log.contains("not supported"), "{log}");
    let s = status();
    let members: Vec<&str> = s["members"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| m["host"].as_str().unwrap())
        .collect();
    assert_eq!(
        members,
        vec!["relay-a"],
        "the coordinator sees the relay only"
    );

    // SIGKILL the relay: every agent fails static with its rates.
    let frozen: Vec<TableFile> = hosts.iter().map(|h| table(h).unwrap()).collect();
    let _ = relay_proc.0.kill();
    let _ = relay_proc.0.wait();
    wait_for("every agent fail-static", Duration::from_secs(15), || {
        hosts
            .iter()
            .all(|h| table(h).is_some_and(|t| t.state == LinkState::FailStatic))
    });
    for (h, f) in hosts.iter().zip(&frozen) {
        let rates = |t: &TableFile| t.apps.iter().map(|a| a.rate).collect::<Vec<_>>();
        assert_eq!(rates(&table(h).unwrap()), rates(f), "{h} kept its rates");
    }
    // The coordinator drops the silent relay; a restarted one brings the rack back.
    wait_for(
        "the coordinator dropped the relay",
        Duration::from_secs(10),
        || status()["members"].as_array().unwrap().is_empty(),
    );
    relay_proc = relay(d, listen, upstream, hosts.len());
    wait_for("every agent live again", Duration::from_secs(15), || {
        hosts
            .iter()
            .all(|h| table(h).is_some_and(|t| t.state == LinkState::Live))
    });
    assert_eq!(status()["members"].as_array().unwrap().len(), 1);
    drop(relay_proc);
    let _ = stop.send(());
    rt.block_on(coordinator).unwrap().unwrap();
}
