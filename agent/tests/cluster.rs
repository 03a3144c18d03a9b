//! A coordinator (the service code, in this process, on real QUIC sockets) and real
//! `drum-agent` processes on 127.0.0.1: convergence to the in-process solver, refusals of bad
//! peers and frames, an agent killed, the coordinator stopped and restarted. Every process and
//! server a test starts is stopped by a Drop guard; every wait is bounded.

use drum_agent::rate_table::{AppRate, LinkState, RateTable, TableFile};
use drum_common::generator::{generate, GeneratorConfig};
use drum_common::instance::Instance;
use drum_common::model::Problem;
use drum_common::protocol::wire::{encode, MAGIC, PROTOCOL_VERSION};
use drum_common::protocol::AgentMsg;
use drum_common::solver::{solve, SolveOptions};
use drum_coordinator::dev_ca::{dev_certs, issue_relay, DevCa};
use drum_coordinator::server::{ServeOptions, ServeSettings, Server};
use drum_net::{quic, TlsFiles};
use std::io::Write;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

/// Log lines of the in-process coordinators (all tests share the subscriber).
fn logs() -> Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let buf = Arc::new(Mutex::new(Vec::new()));
        let writer = buf.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || LogWriter(writer.clone()))
            .init();
        buf
    })
    .clone()
}

struct LogWriter(Arc<Mutex<Vec<u8>>>);

impl Write for LogWriter {
    fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(b);
        Ok(b.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log_text() -> String {
    String::from_utf8_lossy(&logs().lock().unwrap()).into_owned()
}

struct Cluster {
    dir: tempfile::TempDir,
    problem: Problem,
    instance: PathBuf,
    coordinator_tls: TlsFiles,
    /// The live problem: no instance in any config (the file above is then unused).
    live: bool,
}

impl Cluster {
    fn new(hosts: usize, apps: usize, k: usize, seed: u64) -> Self {
        let dir = tempfile::tempdir().unwrap();
        let problem = generate(&GeneratorConfig {
            k,
            seed,
            ..GeneratorConfig::new(hosts, apps)
        });
        let instance = dir.path().join("instance.json");
        std::fs::write(&instance, Instance::from_problem(&problem).to_json()).unwrap();
        let names: Vec<String> = problem.hosts.iter().map(|h| h.id.clone()).collect();
        let certs = dev_certs(
            &dir.path().join("certs"),
            &["localhost".into(), "127.0.0.1".into()],
            &names,
        )
        .unwrap();
        Self {
            dir,
            problem,
            instance,
            coordinator_tls: certs.coordinator,
            live: false,
        }
    }

    /// Hosts `h0` … without an instance: the live problem.
    fn live(hosts: usize) -> Self {
        Self {
            live: true,
            ..Self::new(hosts, 1, 1, 1)
        }
    }

    fn settings(&self, listen: SocketAddr) -> ServeSettings {
        ServeSettings {
            listen,
            instance: (!self.live).then(|| self.instance.clone()),
            tls: self.coordinator_tls.clone(),
            admin_listen: Some("127.0.0.1:0".parse().unwrap()),
            rho: None,
            min_members: 1,
            round_deadline_ms: 200,
            max_staleness: 3,
            round_interval_ms: 2,
            heartbeat_ms: 100,
            // 800 ms dropped live agents of these tests when the machine was loaded (load
            // average 26 on 2 cores: member timeouts, epoch changes, parks after the schedule).
            member_timeout_ms: MEMBER_TIMEOUT_MS,
            max_iterations: None,
            bind_host_to_certificate: true,
        }
    }

    fn rate_path(&self, host: usize) -> PathBuf {
        self.dir.path().join(format!("rates-{host}.json"))
    }

    /// Starts `drum-agent` for host index `host`; `tls` overrides its certificate.
    fn agent(&self, host: usize, coordinator: SocketAddr, tls: Option<TlsFiles>) -> Agent {
        self.agent_tagged(&host.to_string(), host, coordinator, tls, "")
    }

    /// As [`Self::agent`], with its config, log and rate table named by `tag`.
    fn agent_tagged(
        &self,
        tag: &str,
        host: usize,
        coordinator: SocketAddr,
        tls: Option<TlsFiles>,
        extra: &str,
    ) -> Agent {
        let id = &self.problem.hosts[host].id;
        let certs = self.dir.path().join("certs");
        let tls = tls.unwrap_or(TlsFiles {
            ca: certs.join("ca.pem"),
            cert: certs.join(format!("agent-{id}.pem")),
            key: certs.join(format!("agent-{id}.key")),
            crl: None,
        });
        let config = self.dir.path().join(format!("agent-{tag}.toml"));
        let instance = if self.live {
            String::new()
        } else {
            format!("instance = {:?}\n", self.instance)
        };
        let toml = format!(
            "host = {id:?}\n{instance}coordinator = \"{coordinator}\"\nrate_table = {:?}\n\
             heartbeat_ms = 100\ncoordinator_timeout_ms = {MEMBER_TIMEOUT_MS}\nbackoff_min_ms = 50\nbackoff_max_ms = 400\n\
             {extra}\n[tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n{}",
            self.dir.path().join(format!("rates-{tag}.json")),
            tls.ca,
            tls.cert,
            tls.key,
            tls.crl
                .as_ref()
                .map_or(String::new(), |c| format!("crl = {c:?}\n")),
        );
        std::fs::write(&config, toml).unwrap();
        let log = self.dir.path().join(format!("agent-{tag}.log"));
        let child = Command::new(env!("CARGO_BIN_EXE_drum-agent"))
            .arg("--config")
            .arg(&config)
            .env("DRUM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("start drum-agent");
        Agent { child, log }
    }

    fn table(&self, host: usize) -> Option<TableFile> {
        RateTable::read(&self.rate_path(host)).ok()
    }
}

struct Agent {
    child: Child,
    log: PathBuf,
}

impl Agent {
    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}

/// A coordinator service on its own runtime thread; stopped on drop.
struct Coord {
    addr: SocketAddr,
    admin: SocketAddr,
    /// The admin socket, which alone takes operator commands, and its directory.
    socket: PathBuf,
    _socket_dir: tempfile::TempDir,
    reload: Arc<tokio::sync::Notify>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Coord {
    fn start(settings: ServeSettings) -> Self {
        Self::start_with(settings, ServeOptions::default())
    }

    fn start_with(settings: ServeSettings, options: ServeOptions) -> Self {
        logs();
        let socket_dir = tempfile::tempdir().unwrap();
        let socket = socket_dir.path().join("admin.sock");
        let options = ServeOptions {
            admin_socket: Some(socket.clone()),
            ..options
        };
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Runtime::new().unwrap();
            rt.block_on(async move {
                let server = Server::bind_with(settings, options).await.unwrap();
                ready_tx
                    .send((
                        server.local_addr().unwrap(),
                        server.admin_addr().unwrap(),
                        server.reloader(),
                    ))
                    .unwrap();
                server
                    .run(async {
                        let _ = stop_rx.await;
                    })
                    .await
                    .unwrap();
            });
        });
        let (addr, admin, reload) = ready_rx.recv_timeout(Duration::from_secs(10)).unwrap();
        Self {
            addr,
            admin,
            socket,
            _socket_dir: socket_dir,
            reload,
            stop: Some(stop),
            thread: Some(thread),
        }
    }

    fn status(&self) -> serde_json::Value {
        let (code, body) = drum_coordinator::admin::request(self.admin, "GET", "/status").unwrap();
        assert_eq!(code, 200, "{body}");
        serde_json::from_str(&body).unwrap()
    }

    fn metrics(&self) -> String {
        drum_coordinator::admin::request(self.admin, "GET", "/metrics")
            .unwrap()
            .1
    }
}

impl Drop for Coord {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// How long the coordinator keeps a silent member and an agent a silent coordinator: 30
/// heartbeats, so that a loaded machine descheduling a process does not look like its death.
const MEMBER_TIMEOUT_MS: u64 = 3000;

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

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("{name} ")))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
}

fn localhost() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// Fixed active sets: the fault tests below are about membership, not selection.
fn fixed_sets() -> ServeOptions {
    ServeOptions {
        priced_start: false,
        selection_rounds: 0,
        selection_period_ms: 0,
        ..ServeOptions::default()
    }
}

#[test]
fn agents_converge_to_the_in_process_allocation() {
    let c = Cluster::new(4, 6, 2, 11);
    // The schedule of `drum-coordinator solve` (priced restart, 10 damped swap rounds of 20
    // iterations), with tight tolerances so that both ends converge far below 1e-6.
    let options = ServeOptions {
        eps_primal: 1e-11,
        eps_dual: 1e-11,
        // `solve` has no re-selection after its schedule.
        selection_period_ms: 0,
        ..ServeOptions::default()
    };
    let reference = solve(
        &c.problem,
        &SolveOptions {
            max_iter: 5000,
            ..options.solve_options()
        },
    );
    assert!(reference.converged);
    let swaps: usize = reference.rounds.iter().map(|r| r.swaps).sum();
    assert!(swaps > 0, "the instance must exercise selection");
    // `solve` counts the iterations after its priced restart; the service counts all.
    let iterations = (options.iters_per_round as usize + reference.iterations) as u64;
    let coord = Coord::start_with(
        ServeSettings {
            min_members: 4,
            max_iterations: Some(iterations),
            round_interval_ms: 0,
            // Synchronous rounds: the iterates must equal the in-process ones exactly.
            max_staleness: 0,
            ..c.settings(localhost())
        },
        options.clone(),
    );
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let mut agents: Vec<Agent> = (1..4).map(|h| c.agent(h, coord.addr, None)).collect();
    agents.push(c.agent_tagged(
        "0",
        0,
        coord.addr,
        None,
        &format!("metrics_listen = \"{metrics_addr}\""),
    ));
    wait_for(
        "every agent at the last iteration",
        Duration::from_secs(30),
        || (0..4).all(|h| c.table(h).is_some_and(|t| t.iteration == iterations)),
    );
    let mut worst = 0.0f64;
    for r in &reference.hosts {
        let h = r.host;
        let t = c.table(h).unwrap();
        assert_eq!(t.state, LinkState::Live);
        let pairs = c.problem.hosts[h].pairs.clone();
        for (app, p) in t.apps.iter().zip(pairs) {
            let want = r.active.binary_search(&p).map_or(0.0, |i| r.x[i]);
            assert_eq!(
                app.active,
                r.active.contains(&p),
                "host {h} app {}: active set differs from solve's",
                app.app
            );
            assert!(
                (app.rate - want).abs() <= 1e-6,
                "host {h} app {}: {} vs solve {want}",
                app.app,
                app.rate
            );
            worst = worst.max((app.rate - want).abs());
        }
    }
    let s = coord.status();
    eprintln!(
        "{iterations} iterations, {swaps} swaps in solve, parks {} activations {} over the \
         network; largest rate difference {worst:.2e}",
        s["counters"]["parks"], s["counters"]["activations"]
    );
    assert_eq!(s["iteration"], iterations);
    assert_eq!(s["counters"]["stale_reuses"], 0);
    assert_eq!(
        s["selection"]["exchanges_done"],
        options.selection_rounds + 1
    );
    let moved =
        s["counters"]["parks"].as_u64().unwrap() + s["counters"]["activations"].as_u64().unwrap();
    assert!(moved > 0, "{s:#}");
    let (code, m) = drum_coordinator::admin::request(metrics_addr, "GET", "/metrics").unwrap();
    assert_eq!(code, 200);
    let host0 = &c.problem.hosts[0].id;
    assert!(
        m.contains(&format!(
            "drum_agent_rounds_total{{host=\"{host0}\"}} {iterations}"
        )),
        "{m}"
    );
    assert!(
        m.contains(&format!(
            "drum_agent_selection_exchanges_total{{host=\"{host0}\"}} {}",
            options.selection_rounds + 1
        )),
        "{m}"
    );
    assert!(
        m.contains(&format!("drum_agent_live{{host=\"{host0}\"}} 1")),
        "{m}"
    );
    assert_eq!(s["members"].as_array().unwrap().len(), 4);
}

/// Two coordinator shards of the 4-host cluster `c`, each expecting the hosts that own one of
/// its facilities (`settings(members)`), and the four agents, which talk to every shard they
/// need.
fn two_shards(
    c: &Cluster,
    options: &ServeOptions,
    settings: impl Fn(usize) -> ServeSettings,
) -> (Vec<Coord>, Vec<Agent>) {
    use drum_common::protocol::shard::ShardMux;
    use drum_common::protocol::Shard;
    let links: Vec<Vec<u32>> = (0..4)
        .map(|h| ShardMux::new(&c.problem, h, 2).links().to_vec())
        .collect();
    assert!(
        links.iter().any(|l| l.len() == 2),
        "some host talks to both"
    );
    let coords: Vec<Coord> = (0..2u32)
        .map(|index| {
            let members = links.iter().filter(|l| l.contains(&index)).count();
            assert!(members > 0, "shard {index} owns some host's facility");
            Coord::start_with(
                settings(members),
                ServeOptions {
                    shard: Shard { index, count: 2 },
                    ..options.clone()
                },
            )
        })
        .collect();
    let extra = format!("coordinator_shards = [\"{}\"]", coords[1].addr);
    let agents = (0..4)
        .map(|h| c.agent_tagged(&h.to_string(), h, coords[0].addr, None, &extra))
        .collect();
    (coords, agents)
}

/// Two coordinator shards that share nothing, and agents that talk to every shard owning one
/// of their facilities: the same allocation as `solve` (and as one coordinator), to 1e-6.
#[test]
fn two_shards_converge_to_the_same_allocation() {
    let c = Cluster::new(4, 6, 2, 11);
    let options = ServeOptions {
        eps_primal: 1e-11,
        eps_dual: 1e-11,
        // `solve` has no re-selection after its schedule.
        selection_period_ms: 0,
        ..ServeOptions::default()
    };
    let reference = solve(
        &c.problem,
        &SolveOptions {
            max_iter: 5000,
            ..options.solve_options()
        },
    );
    assert!(reference.converged);
    let iterations = (options.iters_per_round as usize + reference.iterations) as u64;
    let (coords, _agents) = two_shards(&c, &options, |members| ServeSettings {
        min_members: members,
        max_iterations: Some(iterations),
        round_interval_ms: 0,
        max_staleness: 0,
        ..c.settings(localhost())
    });
    wait_for(
        "every agent at the last iteration",
        Duration::from_secs(30),
        || (0..4).all(|h| c.table(h).is_some_and(|t| t.iteration == iterations)),
    );
    let mut worst = 0.0f64;
    for r in &reference.hosts {
        let t = c.table(r.host).unwrap();
        assert_eq!(t.state, LinkState::Live);
        for (app, p) in t.apps.iter().zip(c.problem.hosts[r.host].pairs.clone()) {
            let want = r.active.binary_search(&p).map_or(0.0, |i| r.x[i]);
            assert_eq!(
                app.active,
                r.active.contains(&p),
                "host {} app {}",
                r.host,
                app.app
            );
            assert!(
                (app.rate - want).abs() <= 1e-6,
                "host {} app {}: {} vs solve {want}",
                r.host,
                app.app,
                app.rate
            );
            worst = worst.max((app.rate - want).abs());
        }
    }
    // `status` per shard: each shows its own facilities, together all of them.
    let mut owned = 0;
    for (index, coord) in coords.iter().enumerate() {
        let s = coord.status();
        assert_eq!(s["shard"], format!("{index}/2"));
        assert_eq!(s["iteration"], iterations);
        assert_eq!(
            s["selection"]["exchanges_done"],
            options.selection_rounds + 1
        );
        let facilities = s["facilities"].as_array().unwrap();
        assert!(facilities.iter().all(|f| {
            drum_common::protocol::shard_of(f["id"].as_str().unwrap(), 2) == index as u32
        }));
        owned += facilities.len();
    }
    assert_eq!(owned, c.problem.facilities.len());
    eprintln!("two shards: {iterations} iterations; largest rate difference to solve {worst:.2e}");
}

/// `set-weight` reaches every member at once, and an agent that joins later after its
/// welcome; the agents then converge to the optimum of the instance with the new weight.
#[test]
fn set_weight_reaches_every_agent_and_moves_the_allocation() {
    use drum_common::solver::{default_rho, fixed_set_trace, Algorithm};
    let c = Cluster::new(2, 8, 4, 15);
    let coord = Coord::start_with(
        ServeSettings {
            min_members: 2,
            ..c.settings(localhost())
        },
        fixed_sets(),
    );
    let mut agents: Vec<Agent> = (0..2).map(|h| c.agent(h, coord.addr, None)).collect();
    wait_for("rounds running", Duration::from_secs(15), || {
        (0..2).all(|h| c.table(h).is_some_and(|t| t.iteration > 20))
    });
    // Host 0's first active app gets 8 times its weight, on every host.
    let active = drum_common::protocol::fixed_active_sets(&c.problem);
    let pair = active[0][0];
    let app_index = c.problem.pairs[pair].app;
    let app = c.problem.app_names[app_index as usize].clone();
    let weight = 8.0 * c.problem.pairs[pair].weight;
    let (code, body) = drum_coordinator::admin::request_unix(
        &coord.socket,
        "POST",
        &format!(
            "/set-weight?app={}&value={weight}",
            drum_coordinator::admin::percent_encode(&app)
        ),
    )
    .unwrap();
    assert_eq!(code, 200, "{body}");
    wait_for(
        "both agents took the weight",
        Duration::from_secs(10),
        || {
            agents
                .iter()
                .all(|a| a.log().contains("operator set a weight"))
        },
    );
    let mut changed = c.problem.clone();
    drum_common::protocol::agent::AgentCore::apply_weight(&mut changed, app_index, weight);
    let rho = default_rho(&c.problem);
    let (_, want) = fixed_set_trace(&changed, active.clone(), Algorithm::Admm, rho, 3000, 1e-13);
    let (_, old) = fixed_set_trace(&c.problem, active, Algorithm::Admm, rho, 3000, 1e-13);
    let moved = (want[0].x[0] - old[0].x[0]).abs();
    assert!(moved > 1e-3, "the weight must matter here: {moved}");
    wait_for(
        "the optimum of the new weights",
        Duration::from_secs(20),
        || {
            want.iter().all(|r| {
                c.table(r.host).is_some_and(|t| {
                    let pairs = c.problem.hosts[r.host].pairs.clone();
                    t.apps.iter().zip(pairs).all(|(a, p)| {
                        let x = r.active.binary_search(&p).map_or(0.0, |i| r.x[i]);
                        (a.rate - x).abs() <= 1e-6
                    })
                })
            })
        },
    );
    assert_eq!(coord.status()["weights"][&app], weight);
    // A host that joins after the change hears of it after its welcome.
    agents[1].kill();
    let late = c.agent_tagged("1-late", 1, coord.addr, None, "");
    wait_for(
        "the late agent took the weight",
        Duration::from_secs(10),
        || late.log().contains("operator set a weight"),
    );
}

/// A QUIC client with a valid certificate that sends raw bytes on its stream.
fn raw_client(c: &Cluster, coordinator: SocketAddr, bytes: Vec<u8>) {
    let id = &c.problem.hosts[0].id;
    let certs = c.dir.path().join("certs");
    let tls = TlsFiles {
        ca: certs.join("ca.pem"),
        cert: certs.join(format!("agent-{id}.pem")),
        key: certs.join(format!("agent-{id}.key")),
        crl: None,
    };
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let ep = quic::client_endpoint(&tls, Duration::from_secs(2)).unwrap();
        let conn = ep.connect(coordinator, "localhost").unwrap().await.unwrap();
        let (mut send, _recv) = conn.open_bi().await.unwrap();
        send.write_all(&bytes).await.unwrap();
        let _ = send.finish();
        // The coordinator closes the connection on a bad frame.
        let _ = tokio::time::timeout(Duration::from_secs(3), conn.closed()).await;
        ep.close(0u32.into(), b"");
    });
}

#[test]
fn bad_peers_and_frames_are_refused_without_disturbing_rounds() {
    let c = Cluster::new(2, 4, 2, 12);
    let coord = Coord::start(ServeSettings {
        min_members: 2,
        ..c.settings(localhost())
    });
    let _agents: Vec<Agent> = (0..2).map(|h| c.agent(h, coord.addr, None)).collect();
    wait_for("rounds running", Duration::from_secs(15), || {
        coord.status()["iteration"].as_u64().unwrap() > 5
    });
    let epoch = coord.status()["epoch"].clone();

    // 1. An agent whose certificate comes from another CA.
    let other = dev_certs(&c.dir.path().join("other-ca"), &[], &["intruder".into()]).unwrap();
    let mut intruder_tls = other.agents[0].1.clone();
    intruder_tls.ca = c.dir.path().join("certs/ca.pem");
    let intruder = c.agent_tagged("intruder", 0, coord.addr, Some(intruder_tls), "");
    wait_for("the handshake refusal", Duration::from_secs(10), || {
        metric(
            &coord.metrics(),
            "drum_coordinator_refused_handshakes_total",
        ) >= 1.0
    });
    wait_for(
        "the intruder's own log line",
        Duration::from_secs(5),
        // TLS 1.3: the client's handshake completes before the server has checked the
        // client's certificate, so the refusal reaches the agent as the connection's end.
        || {
            let l = intruder.log();
            l.contains("handshake failed") && l.contains("invalid peer certificate")
        },
    );
    drop(intruder);

    // 1b. A valid certificate of host 0 claiming to be host 1.
    let certs = c.dir.path().join("certs");
    let h0 = &c.problem.hosts[0].id;
    let impostor_tls = TlsFiles {
        ca: certs.join("ca.pem"),
        cert: certs.join(format!("agent-{h0}.pem")),
        key: certs.join(format!("agent-{h0}.key")),
        crl: None,
    };
    let impostor = c.agent_tagged("impostor", 1, coord.addr, Some(impostor_tls), "");
    wait_for("the impostor refused", Duration::from_secs(10), || {
        impostor.log().contains("not issued to host")
    });
    drop(impostor);
    assert!(metric(&coord.metrics(), "drum_coordinator_refused_joins_total") >= 1.0);

    // 2. Frames: garbage, an unknown version, an oversized length, a truncated frame.
    let mut unknown_version = encode(&AgentMsg::Leave).unwrap();
    unknown_version[2..4].copy_from_slice(&(PROTOCOL_VERSION + 1).to_be_bytes());
    let mut oversized = Vec::from(MAGIC);
    oversized.extend_from_slice(&PROTOCOL_VERSION.to_be_bytes());
    oversized.extend_from_slice(&u32::MAX.to_be_bytes());
    let mut truncated = encode(&AgentMsg::Heartbeat { seq: 1 }).unwrap();
    truncated.pop();
    for bytes in [
        b"GET / HTTP/1.1\r\n\r\n".to_vec(),
        unknown_version,
        oversized,
        truncated,
    ] {
        raw_client(&c, coord.addr, bytes);
    }
    wait_for("four refused frames", Duration::from_secs(10), || {
        metric(&coord.metrics(), "drum_coordinator_refused_frames_total") >= 4.0
    });

    // 2b. A valid client that opens no stream (issue 19, item 9: such connections were held
    // for ever): closed after the join timeout, with the coordinator's reason.
    let id = &c.problem.hosts[0].id;
    let tls = TlsFiles {
        ca: certs.join("ca.pem"),
        cert: certs.join(format!("agent-{id}.pem")),
        key: certs.join(format!("agent-{id}.key")),
        crl: None,
    };
    let closed = tokio::runtime::Runtime::new().unwrap().block_on(async {
        let ep = quic::client_endpoint(&tls, Duration::from_secs(10)).unwrap();
        let conn = ep.connect(coord.addr, "localhost").unwrap().await.unwrap();
        let why = tokio::time::timeout(Duration::from_secs(5), conn.closed()).await;
        ep.close(0u32.into(), b"");
        why.map(|e| e.to_string())
    });
    let closed = closed.expect("the coordinator closes a connection without a stream");
    assert!(closed.contains("no stream"), "{closed}");

    // 3. A plain UDP client: not QUIC, dropped by the endpoint.
    let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    for _ in 0..20 {
        udp.send_to(b"hello, are you DNS?", coord.addr).unwrap();
    }

    // Rounds went on with both members and no membership change.
    let before = coord.status()["iteration"].as_u64().unwrap();
    wait_for("more rounds", Duration::from_secs(10), || {
        coord.status()["iteration"].as_u64().unwrap() > before + 20
    });
    let s = coord.status();
    assert_eq!(s["members"].as_array().unwrap().len(), 2);
    assert_eq!(s["epoch"], epoch, "membership never changed");
    let logs = log_text();
    assert!(logs.contains("refused connection"), "{logs}");
    assert!(
        logs.contains("refused join: the client certificate is not issued to host"),
        "{logs}"
    );
    assert!(logs.contains("unsupported protocol version"), "{logs}");
    assert!(logs.contains("exceeds the limit"), "{logs}");
    assert!(logs.contains("bad magic"), "{logs}");
    assert!(logs.contains("stream ended inside a frame"), "{logs}");
}

#[test]
fn killed_agent_is_dropped_after_the_timeout() {
    let c = Cluster::new(3, 4, 2, 13);
    let coord = Coord::start_with(
        ServeSettings {
            min_members: 3,
            ..c.settings(localhost())
        },
        fixed_sets(),
    );
    let mut agents: Vec<Agent> = (0..3).map(|h| c.agent(h, coord.addr, None)).collect();
    wait_for("three members in rounds", Duration::from_secs(15), || {
        coord.status()["iteration"].as_u64().unwrap() > 5
    });
    let pairs = |s: &serde_json::Value| -> u64 {
        s["facilities"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["pairs"].as_u64().unwrap())
            .sum()
    };
    let before = pairs(&coord.status());
    let killed = Instant::now();
    agents[2].kill();
    wait_for("the dead agent dropped", Duration::from_secs(15), || {
        coord.status()["members"].as_array().unwrap().len() == 2
    });
    // Not before the member timeout less two heartbeats: silence, not luck, removed it.
    assert!(
        killed.elapsed() >= Duration::from_millis(MEMBER_TIMEOUT_MS - 200),
        "{:?}",
        killed.elapsed()
    );
    let s = coord.status();
    assert!(pairs(&s) < before, "its pairs left the facility counts");
    // Counted as a member timeout whether the coordinator's scan or the QUIC idle timeout
    // noticed the silence first (issue 19, item 9).
    assert_eq!(s["counters"]["timeouts"], 1, "{s:#}");
    assert!(s["members"]
        .as_array()
        .unwrap()
        .iter()
        .all(|m| m["host"] != c.problem.hosts[2].id.as_str()));
    // The survivors keep iterating.
    let it = s["iteration"].as_u64().unwrap();
    wait_for("rounds after the drop", Duration::from_secs(5), || {
        coord.status()["iteration"].as_u64().unwrap() > it + 10
    });
    assert!(agents[0].log().contains("joined the coordinator"));

    // An operator drains host 1: removed at once, its agent keeps its rates, its rejoins refused.
    let host1 = c.problem.hosts[1].id.clone();
    let (code, body) = drum_coordinator::admin::request_unix(
        &coord.socket,
        "POST",
        &format!(
            "/drain?host={}",
            drum_coordinator::admin::percent_encode(&host1)
        ),
    )
    .unwrap();
    assert_eq!(code, 200, "{body}");
    let s = coord.status();
    assert_eq!(s["members"].as_array().unwrap().len(), 1, "{s:#}");
    assert_eq!(s["drained"][0], host1.as_str());
    wait_for(
        "the drained agent fail-static",
        Duration::from_secs(15),
        || c.table(1).is_some_and(|t| t.state == LinkState::FailStatic),
    );
    wait_for("a refused rejoin", Duration::from_secs(15), || {
        agents[1].log().contains("is drained")
    });
    assert_eq!(coord.status()["members"].as_array().unwrap().len(), 1);
}

#[test]
fn coordinator_loss_is_fail_static_and_agents_rejoin_a_restarted_one() {
    let c = Cluster::new(2, 4, 2, 14);
    let settings = ServeSettings {
        min_members: 2,
        ..c.settings(localhost())
    };
    // No periodic re-selection: the restarted coordinator must be seen to run no exchange.
    let options = ServeOptions {
        selection_period_ms: 0,
        ..ServeOptions::default()
    };
    let coord = Coord::start_with(settings.clone(), options.clone());
    let addr = coord.addr;
    let _agents: Vec<Agent> = (0..2).map(|h| c.agent(h, addr, None)).collect();
    // Selection runs (the default schedule); stop the coordinator once it is over.
    wait_for(
        "the selection schedule done",
        Duration::from_secs(20),
        || {
            let s = coord.status();
            s["selection"]["exchanges_done"] == s["selection"]["exchanges_planned"]
                && s["iteration"].as_u64().unwrap() > 240
        },
    );
    let prices = |s: &serde_json::Value| -> Vec<f64> {
        s["facilities"]
            .as_array()
            .unwrap()
            .iter()
            .map(|f| f["price"].as_f64().unwrap())
            .collect()
    };
    let before = prices(&coord.status());
    drop(coord);
    wait_for("both agents fail-static", Duration::from_secs(15), || {
        (0..2).all(|h| c.table(h).is_some_and(|t| t.state == LinkState::FailStatic))
    });
    let frozen: Vec<TableFile> = (0..2).map(|h| c.table(h).unwrap()).collect();
    assert!(frozen.iter().all(|t| t.apps.iter().any(|a| a.rate > 0.0)));
    std::thread::sleep(Duration::from_millis(600));
    for (h, f) in frozen.iter().enumerate() {
        let now = c.table(h).unwrap();
        let rates = |t: &TableFile| t.apps.iter().map(|a| a.rate).collect::<Vec<_>>();
        assert_eq!(
            rates(&now),
            rates(f),
            "rates are kept while the coordinator is away"
        );
    }
    // A new coordinator on the same address: agents rejoin with their rates and numbering.
    let coord = Coord::start_with(
        ServeSettings {
            listen: addr,
            ..settings
        },
        options,
    );
    wait_for("both agents rejoined", Duration::from_secs(10), || {
        coord.status()["members"].as_array().unwrap().len() == 2
    });
    // The duals were rebuilt from the agents' last d: prices did not restart from zero.
    let after = prices(&coord.status());
    let (f, &top) = before
        .iter()
        .enumerate()
        .max_by(|a, b| a.1.total_cmp(b.1))
        .unwrap();
    assert!(top > 0.0, "some facility is priced: {before:?}");
    assert!(
        after[f] >= 0.5 * top && after[f] <= 2.0 * top,
        "price of facility {f}: {top} before the restart, {} after",
        after[f]
    );
    wait_for("both agents live again", Duration::from_secs(10), || {
        (0..2).all(|h| c.table(h).is_some_and(|t| t.state == LinkState::Live))
    });
    wait_for("rounds after the restart", Duration::from_secs(10), || {
        let s = coord.status();
        s["members"].as_array().unwrap().len() == 2
            && s["iteration"].as_u64().unwrap() > frozen[0].iteration + 10
    });
    // The restarted coordinator resumed the selection schedule where the agents left it
    // (done), rather than re-selecting from scratch.
    let s = coord.status();
    assert_eq!(
        s["selection"]["exchanges_done"], s["selection"]["exchanges_planned"],
        "{s:#}"
    );
    assert_eq!(s["counters"]["exchanges"], 0, "{s:#}");
}

/// Connects to an agent's shim socket as a shim would, registers as `app`, and returns the
/// table the agent sends back (the socket stays open for as long as the registration).
fn register_as_shim(
    socket: &std::path::Path,
    app: &str,
) -> (std::os::fd::OwnedFd, drum_table::mapping::Mapping) {
    use std::os::fd::AsRawFd;
    let fd = drum_table::socket::connect(socket).expect("connect to the agent's shim socket");
    let hello = drum_table::message::ShimMsg::Hello {
        pid: std::process::id(),
        app: app.into(),
        exe: "/test".into(),
    }
    .encode();
    drum_table::socket::send(fd.as_raw_fd(), hello.as_bytes()).unwrap();
    let mut buf = [0u8; 512];
    let (n, table) = drum_table::mapping::recv_with_fd(fd.as_raw_fd(), &mut buf).unwrap();
    assert!(
        buf[..n].starts_with(b"DRUM1 WELCOME"),
        "{}",
        String::from_utf8_lossy(&buf[..n])
    );
    let map = drum_table::mapping::Mapping::open(table.unwrap().as_raw_fd()).unwrap();
    (fd, map)
}

/// The optimiser's rates reach the host's shims: an agent with `[shim]` grants each app that
/// registers its rate from the rounds (as a fraction of the configured line rate), and an
/// app the selection parked a trickle.
#[test]
fn optimiser_rates_reach_the_shims_registered_with_an_agent() {
    let c = Cluster::new(2, 4, 2, 5);
    let coord = Coord::start(ServeSettings {
        min_members: 2,
        max_iterations: Some(150),
        ..c.settings(localhost())
    });
    let socket = c.dir.path().join("shim-0.sock");
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let metrics_addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let shim = format!(
        "metrics_listen = \"{metrics_addr}\"\n[shim]\nsocket = {socket:?}\nline_rate_gbps = 8.0\n\
         [dasr]\nlisten = \"127.0.0.1:0\"\n"
    );
    let _a0 = c.agent_tagged("0", 0, coord.addr, None, &shim);
    let _a1 = c.agent(1, coord.addr, None);
    wait_for(
        "both agents at the last iteration",
        Duration::from_secs(30),
        || (0..2).all(|h| c.table(h).is_some_and(|t| t.iteration == 150)),
    );
    let table = c.table(0).unwrap();
    let line = 8.0e9 / 8.0;
    let mut parked = 0;
    for app in &table.apps {
        let (_sock, map) = register_as_shim(&socket, &app.app);
        let g = map.table().read_grant().unwrap();
        let want = if app.active {
            app.rate * line
        } else {
            0.01 * line
        };
        parked += usize::from(!app.active);
        assert!(
            (g.rate_bytes_per_s as f64 - want).abs() <= 1.0,
            "{}: granted {} B/s, rate table says {want}",
            app.app,
            g.rate_bytes_per_s
        );
    }
    assert!(
        parked > 0 && parked < table.apps.len(),
        "k = 2 of 4 apps: some parked, some not"
    );
    // The agent's metrics show the registered process and its app (with the process's part
    // of the app's grant: all of it, as its only process), and DASR's counters.
    let app = &table.apps[0].app;
    let whole_part = |m: &str| {
        m.lines().any(|l| {
            l.starts_with("drum_agent_process_grant_part{")
                && l.contains(&format!("app=\"{app}\"}}"))
                && l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) == Some(1.0)
        })
    };
    let (_sock, map) = register_as_shim(&socket, app);
    map.table()
        .shim
        .send_bytes
        .store(4096, std::sync::atomic::Ordering::Relaxed);
    wait_for("the metrics list the shim", Duration::from_secs(5), || {
        let m = drum_coordinator::admin::request(metrics_addr, "GET", "/metrics")
            .map(|r| r.1)
            .unwrap_or_default();
        let host = &c.problem.hosts[0].id;
        m.contains(&format!("drum_agent_shims{{host=\"{host}\"}} 1\n"))
            && m.contains(&format!(
                "drum_agent_app_send_bytes_total{{host=\"{}\",app=\"{app}\"}} 4096",
                c.problem.hosts[0].id
            ))
            && m.contains("drum_dasr_")
            && whole_part(&m)
    });
}

/// The shims' counters become the optimiser's demand: an app whose registered process sends
/// far less than its grant gets, within a few measuring intervals, a grant near its usage
/// (its demand cap becomes its usage plus 25 %), and the rest goes to others. Its measured
/// completions per WQE become the model's `a` (the rate table's `poll_rate / rate`), and the
/// shim's polling grant is `a·x` in completions per second at the measured WQE size.
#[test]
fn shim_counters_become_the_optimisers_demand_and_polling_grant() {
    use std::sync::atomic::Ordering::Relaxed;
    let c = Cluster::new(2, 4, 2, 5);
    // No periodic re-selection: an app whose demand falls to 1 % may rightly be parked for an
    // outsider, and a parked app (rate 0) has no `a` and no polling grant to check (seen
    // under load, where the exchange came before the grant's check).
    let coord = Coord::start_with(
        ServeSettings {
            min_members: 2,
            ..c.settings(localhost())
        },
        ServeOptions {
            selection_period_ms: 0,
            ..ServeOptions::default()
        },
    );
    let socket = c.dir.path().join("shim-0.sock");
    // Each 4 KiB WQE is one packet of 82 header bytes more on the wire: the rates the
    // optimiser hands out are wire bytes (docs/live-problem.md, "Rates are NIC time").
    let shim = format!(
        "[shim]\nsocket = {socket:?}\nline_rate_gbps = 8.0\nmtu = 4096\npacket_overhead_bytes = 82\n"
    );
    let wire_per_wqe = 4096.0 + 82.0;
    let _a0 = c.agent_tagged("0", 0, coord.addr, None, &shim);
    let _a1 = c.agent(1, coord.addr, None);
    wait_for(
        "host 0 live past the selection schedule",
        Duration::from_secs(30),
        || {
            c.table(0)
                .is_some_and(|t| t.state == LinkState::Live && t.iteration > 300)
        },
    );
    let before = c.table(0).unwrap();
    let app = before
        .apps
        .iter()
        .filter(|a| a.active)
        .max_by(|a, b| a.rate.total_cmp(&b.rate))
        .expect("an active app")
        .clone();
    assert!(app.rate > 0.05, "{app:?}");
    // A process of that app sends 1 % of the line (10 MB/s of 1 GB/s), as its shim reports.
    let (_sock, map) = register_as_shim(&socket, &app.app);
    let usage = 0.01;
    let line = 8.0e9 / 8.0;
    let t0 = Instant::now();
    // An app no longer active is no grant near its usage (NaN fails every comparison).
    let rate_now = || {
        c.table(0)
            .and_then(|t| t.apps.into_iter().find(|a| a.app == app.app))
            .filter(|a| a.active)
            .map_or(f64::NAN, |a| a.rate)
    };
    while t0.elapsed() < Duration::from_secs(20) {
        let sent = (t0.elapsed().as_secs_f64() * usage * line) as u64;
        // 4 KiB WQEs, one in four signalled: a = 0.25.
        map.table().shim.send_wqes.store(sent / 4096, Relaxed);
        map.table().shim.completions.store(sent / 4096 / 4, Relaxed);
        map.table()
            .shim
            .send_bytes
            .store(sent / 4096 * 4096, Relaxed);
        if rate_now() <= usage * wire_per_wqe / 4096.0 * 1.25 * 1.05 {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let after = rate_now();
    eprintln!(
        "{}: rate {:.4} before, {after:.4} after reporting {usage} of the line for {:?}",
        app.app,
        app.rate,
        t0.elapsed()
    );
    assert!(
        after <= usage * wire_per_wqe / 4096.0 * 1.25 * 1.05,
        "{}: still granted {after} while using {usage}",
        app.app
    );
    let now = || {
        c.table(0)
            .and_then(|t| t.apps.into_iter().find(|a| a.app == app.app))
            .expect("the app in the rate table")
    };
    let a = |r: &AppRate| r.poll_rate / r.rate;
    assert!((a(&now()) - 0.25).abs() < 0.01, "a = {:?}", now());
    // The table and the grant are published in the same step; read both until they agree.
    let want = |r: &AppRate| (r.rate * line / wire_per_wqe * 0.25 * 1.25).ceil();
    wait_for(
        "the polling grant a·x at 4 KiB (and 82 header bytes) per WQE",
        Duration::from_secs(5),
        || {
            let r = now();
            let got = map.table().read_grant().unwrap().rate_cqe_per_s as f64;
            (got - want(&r)).abs() <= 0.02 * want(&r)
        },
    );
}

/// Selection after the schedule: an agent whose apps come from its shims (`apps_from_shims`)
/// starts with every app parked. Once the schedule is over, an app registers (arrives): the
/// agent asks for a re-selection, and the app takes a slot with at least `x_min`. Its shim
/// goes (the app leaves): it is parked again, and nothing else of the cluster stops.
#[test]
fn an_app_arriving_after_the_schedule_is_selected_and_parked_when_it_leaves() {
    let c = Cluster::new(3, 4, 2, 5);
    let options = ServeOptions {
        selection_rounds: 2,
        iters_per_round: 10,
        selection_period_ms: 200,
        ..ServeOptions::default()
    };
    let coord = Coord::start_with(
        ServeSettings {
            min_members: 3,
            ..c.settings(localhost())
        },
        options.clone(),
    );
    let socket = c.dir.path().join("shim-0.sock");
    let shim =
        format!("apps_from_shims = true\n[shim]\nsocket = {socket:?}\nline_rate_gbps = 8.0\n");
    let a0 = c.agent_tagged("0", 0, coord.addr, None, &shim);
    let _others: Vec<Agent> = (1..3).map(|h| c.agent(h, coord.addr, None)).collect();
    let planned = u64::from(options.selection_rounds + 1);
    // A static cluster runs no exchange after the schedule (nothing changed).
    wait_for("the selection schedule", Duration::from_secs(20), || {
        let s = coord.status();
        s["selection"]["exchanges_done"].as_u64().unwrap() >= planned
            && !s["selection"]["in_progress"].as_bool().unwrap()
    });
    let t = c.table(0).unwrap();
    assert_eq!(t.state, LinkState::Live);
    assert!(t.apps.iter().all(|a| !a.active && a.rate == 0.0), "{t:?}");
    let requests = |s: &serde_json::Value| s["counters"]["reselect_requests"].as_u64().unwrap();
    let before = requests(&coord.status());
    // The app arrives: host 0's app with the highest weight.
    let pairs = c.problem.hosts[0].pairs.clone();
    let p = pairs
        .clone()
        .max_by(|&a, &b| {
            c.problem.pairs[a]
                .weight
                .total_cmp(&c.problem.pairs[b].weight)
        })
        .unwrap();
    let app = c.problem.app_names[c.problem.pairs[p].app as usize].clone();
    let (sock, _map) = register_as_shim(&socket, &app);
    let active_rate = || {
        c.table(0)
            .and_then(|t| t.apps.into_iter().find(|a| a.app == app))
            .filter(|a| a.active)
            .map(|a| a.rate)
    };
    wait_for("the arrived app active", Duration::from_secs(10), || {
        active_rate().is_some()
    });
    assert!(requests(&coord.status()) > before, "the agent asked for it");
    let x_min = c.problem.params.x_min;
    wait_for(
        "the arrived app at its rate",
        Duration::from_secs(5),
        || {
            active_rate()
                .is_some_and(|r| r >= x_min * (1.0 - 1e-9) && r <= c.problem.pairs[p].demand)
        },
    );
    let t = c.table(0).unwrap();
    assert_eq!(t.apps.iter().filter(|a| a.active).count(), 1, "{t:?}");
    assert!(a0.log().contains("apps changed; asking for a re-selection"));
    assert!(log_text().contains("re-selection requested: the host's apps changed"));
    // It leaves: parked at the next exchange (no coin for a departed app).
    drop(sock);
    wait_for("the departed app parked", Duration::from_secs(10), || {
        c.table(0)
            .is_some_and(|t| t.apps.iter().all(|a| !a.active && a.rate == 0.0))
    });
    wait_for("every host still a member", Duration::from_secs(5), || {
        coord.status()["members"].as_array().unwrap().len() == 3
            && (1..3).all(|h| c.table(h).is_some_and(|t| t.state == LinkState::Live))
    });
}

/// Periodic re-selection with two shards: both count `T_sel` in iterations (100 ms at one
/// round per 2 ms: 50), so they start every exchange at the same iteration and agents that
/// talk to both never wait on one shard's exchange while the other sends rounds.
#[test]
fn two_shards_reselect_in_step_after_the_schedule() {
    let c = Cluster::new(4, 6, 2, 11);
    let options = ServeOptions {
        selection_rounds: 2,
        iters_per_round: 10,
        selection_period_ms: 100,
        ..ServeOptions::default()
    };
    let (coords, _agents) = two_shards(&c, &options, |members| ServeSettings {
        min_members: members,
        round_interval_ms: 2,
        ..c.settings(localhost())
    });
    let planned = u64::from(options.selection_rounds + 1);
    let done = |i: usize| {
        coords[i].status()["selection"]["exchanges_done"]
            .as_u64()
            .unwrap()
    };
    wait_for(
        "three re-selections on both shards",
        Duration::from_secs(20),
        || done(0) >= planned + 3 && done(1) >= planned + 3,
    );
    for coord in &coords {
        let s = coord.status();
        assert_eq!(s["selection"]["period_ms"], 100);
        assert_eq!(s["counters"]["timeouts"], 0, "{s:#}");
        assert_eq!(s["counters"]["refused"], 0, "{s:#}");
        // Every host joined once: one epoch per join, none from a drop and rejoin.
        let members = s["members"].as_array().unwrap().len() as u64;
        assert_eq!(s["epoch"].as_u64().unwrap(), members, "{s:#}");
    }
    assert!((0..4).all(|h| c.table(h).is_some_and(|t| t.state == LinkState::Live)));
}

/// Certificate revocation and rotation without a restart. Every party reads `crl.pem` from
/// the start (`dev-certs` writes it empty). A CRL that does not load leaves the coordinator as
/// it was. Host 1's certificate is revoked and the coordinator reloads: host 1's connection
/// is closed and its reconnections are refused, while the others go on without losing their
/// connections. Host 1 gets a new certificate, its agent reloads on SIGHUP, and it rejoins.
#[test]
fn a_revoked_agent_is_refused_and_rejoins_with_a_rotated_certificate() {
    let c = Cluster::new(3, 4, 2, 21);
    let certs = c.dir.path().join("certs");
    let crl = certs.join("crl.pem");
    let coord = Coord::start_with(
        ServeSettings {
            min_members: 3,
            tls: TlsFiles {
                crl: Some(crl.clone()),
                ..c.coordinator_tls.clone()
            },
            ..c.settings(localhost())
        },
        fixed_sets(),
    );
    let tls = |h: usize| {
        let id = &c.problem.hosts[h].id;
        Some(TlsFiles {
            ca: certs.join("ca.pem"),
            cert: certs.join(format!("agent-{id}.pem")),
            key: certs.join(format!("agent-{id}.key")),
            crl: Some(crl.clone()),
        })
    };
    let agents: Vec<Agent> = (0..3).map(|h| c.agent(h, coord.addr, tls(h))).collect();
    let members = || coord.status()["members"].as_array().unwrap().len();
    let iteration = || coord.status()["iteration"].as_u64().unwrap();
    wait_for("three members iterating", Duration::from_secs(10), || {
        members() == 3 && iteration() > 20
    });
    // A CRL file that does not load: the reload is refused, nothing changes.
    let good = std::fs::read(&crl).unwrap();
    std::fs::write(&crl, "not a CRL").unwrap();
    coord.reload.notify_one();
    wait_for("the failed reload logged", Duration::from_secs(5), || {
        log_text().contains("TLS reload failed, keeping the previous certificates")
    });
    std::fs::write(&crl, good).unwrap();
    assert_eq!(members(), 3);
    // Revoke host 1 and reload: its connection goes, its reconnections are refused.
    let h1 = c.problem.hosts[1].id.clone();
    drum_coordinator::dev_ca::DevCa::open(&certs)
        .unwrap()
        .revoke_agent(&h1)
        .unwrap();
    let epoch = coord.status()["epoch"].as_u64().unwrap();
    coord.reload.notify_one();
    // (Other tests share the log: look for this test's lines.)
    wait_for("host 1 closed and refused", Duration::from_secs(10), || {
        let log = log_text();
        log.contains("refused connection after the reload")
            && log
                .lines()
                .any(|l| l.contains("refused connection: ") && l.contains("Revoked"))
            && members() == 2
    });
    for l in log_text().lines().filter(|l| {
        l.contains("after the reload")
            || (l.contains("refused connection: ") && l.contains("Revoked"))
    }) {
        eprintln!("{l}");
    }
    wait_for("host 1 fail-static", Duration::from_secs(5), || {
        c.table(1).is_some_and(|t| t.state == LinkState::FailStatic)
    });
    // The others go on: rounds continue on their connections of before the reload.
    let before = iteration();
    wait_for("rounds without host 1", Duration::from_secs(5), || {
        iteration() > before + 20
    });
    assert_eq!(
        coord.status()["epoch"].as_u64().unwrap(),
        epoch + 1,
        "one departure"
    );
    for h in [0, 2] {
        assert!(
            !agents[h].log().contains("fail-static"),
            "{}",
            agents[h].log()
        );
    }
    // A new certificate for host 1, and SIGHUP to its agent: it rejoins.
    drum_coordinator::dev_ca::DevCa::open(&certs)
        .unwrap()
        .issue_agent(&h1)
        .unwrap();
    assert_eq!(
        // SAFETY: kill(2) on the pid of a child this test started and still owns.
        unsafe { libc::kill(agents[1].child.id() as i32, libc::SIGHUP) },
        0
    );
    wait_for("host 1 back", Duration::from_secs(10), || {
        members() == 3 && c.table(1).is_some_and(|t| t.state == LinkState::Live)
    });
    assert!(agents[1].log().contains("reloaded the TLS files"));
}

/// The agent's side of revocation: the coordinator's certificate is revoked while agents are
/// connected, and one agent reloads its TLS files (SIGHUP). That agent checks its established
/// connection against the new CRL, closes it at once, keeps its last rates (fail-static) and
/// cannot reconnect (the handshake is refused); the agent that did not reload goes on.
#[test]
fn an_agent_leaves_a_coordinator_revoked_while_connected() {
    let c = Cluster::new(2, 4, 2, 22);
    let certs = c.dir.path().join("certs");
    let crl = certs.join("crl.pem");
    let coord = Coord::start_with(
        ServeSettings {
            tls: TlsFiles {
                crl: Some(crl.clone()),
                ..c.coordinator_tls.clone()
            },
            ..c.settings(localhost())
        },
        fixed_sets(),
    );
    let tls = |h: usize| {
        let id = &c.problem.hosts[h].id;
        Some(TlsFiles {
            ca: certs.join("ca.pem"),
            cert: certs.join(format!("agent-{id}.pem")),
            key: certs.join(format!("agent-{id}.key")),
            crl: Some(crl.clone()),
        })
    };
    let agents: Vec<Agent> = (0..2).map(|h| c.agent(h, coord.addr, tls(h))).collect();
    let members = || coord.status()["members"].as_array().unwrap().len();
    wait_for("two members iterating", Duration::from_secs(10), || {
        members() == 2 && coord.status()["iteration"].as_u64().unwrap() > 20
    });
    drum_coordinator::dev_ca::DevCa::open(&certs)
        .unwrap()
        .revoke("coordinator")
        .unwrap();
    assert_eq!(
        // SAFETY: kill(2) on the pid of a child this test started and still owns.
        unsafe { libc::kill(agents[0].child.id() as i32, libc::SIGHUP) },
        0
    );
    wait_for(
        "host 0 closed its connection and went fail-static",
        Duration::from_secs(10),
        || {
            agents[0]
                .log()
                .contains("certificate is no longer accepted after the reload")
                && c.table(0).is_some_and(|t| t.state == LinkState::FailStatic)
        },
    );
    wait_for(
        "host 0's reconnection refused",
        Duration::from_secs(10),
        || {
            agents[0]
                .log()
                .lines()
                .any(|l| l.contains("unreachable") && l.contains("Revoked"))
        },
    );
    wait_for("host 0 dropped", Duration::from_secs(10), || members() == 1);
    let log = agents[1].log();
    assert!(!log.contains("fail-static"), "{log}");
    assert!(c.table(1).is_some_and(|t| t.state == LinkState::Live));
}

/// A registered shim that connects QPs to `peers` and, while it lives, sends exactly what the
/// agent grants it (as a saturating application would), in 4 KiB WQEs, each signalled.
struct SendingShim {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    map: Arc<drum_table::mapping::Mapping>,
}

impl SendingShim {
    fn start(socket: &std::path::Path, app: &str, peers: &[&str], sends: bool) -> Self {
        use std::os::fd::AsRawFd;
        use std::sync::atomic::Ordering::Relaxed;
        let (fd, map) = register_as_shim(socket, app);
        for (i, peer) in peers.iter().enumerate() {
            let up = drum_table::message::ShimMsg::QpUp {
                qpn: 100 + i as u32,
                peer: drum_table::message::gid_of_ipv4(peer.parse().unwrap()),
                peer_qpn: 7,
            }
            .encode();
            drum_table::socket::send(fd.as_raw_fd(), up.as_bytes()).unwrap();
        }
        let map = Arc::new(map);
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let thread = {
            let (map, stop) = (map.clone(), stop.clone());
            std::thread::spawn(move || {
                let _registration = fd;
                let t = map.table();
                let mut last = Instant::now();
                while !stop.load(Relaxed) {
                    std::thread::sleep(Duration::from_millis(10));
                    let dt = last.elapsed().as_secs_f64();
                    last = Instant::now();
                    let rate = t.read_grant().map_or(0, |g| g.rate_bytes_per_s) as f64;
                    let wqes = if sends {
                        (rate * dt / 4096.0) as u64
                    } else {
                        0
                    };
                    t.shim.send_wqes.fetch_add(wqes, Relaxed);
                    t.shim.completions.fetch_add(wqes, Relaxed);
                    t.shim.send_bytes.fetch_add(wqes * 4096, Relaxed);
                }
            })
        };
        Self {
            stop,
            thread: Some(thread),
            map,
        }
    }

    fn granted_bytes_per_s(&self) -> u64 {
        self.map.table().read_grant().unwrap().rate_bytes_per_s
    }
}

impl Drop for SendingShim {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// `(active, rate)` of `app` on `host` in the coordinator's status, if listed.
fn live_app(s: &serde_json::Value, host: &str, app: &str) -> Option<(bool, f64)> {
    let m = s["members"]
        .as_array()?
        .iter()
        .find(|m| m["host"] == host)?;
    let a = m["apps"].as_array()?.iter().find(|a| a["app"] == app)?;
    Some((a["active"].as_bool()?, a["rate"].as_f64()?))
}

fn facility<'a>(s: &'a serde_json::Value, id: &str) -> Option<&'a serde_json::Value> {
    s["facilities"].as_array()?.iter().find(|f| f["id"] == id)
}

/// The live problem, end to end with real agents and no instance file: three hosts join with
/// their NICs; two writers on h0 and h1 that no config names connect to h2 and send what they
/// are granted, a server on h2 connects back and answers them (and to a GID no agent owns,
/// which its agent logs, naming app and GID). The coordinator learns the
/// three receive links, the writers share h2's link (it binds), their grants reach their
/// shims, a weight set at run time reaches every agent and moves the split, `solve` on the
/// snapshot gives the live allocation to 1e-6, and a writer that stops leaves the problem.
#[test]
fn the_live_problem_is_learnt_from_the_shims_and_its_snapshot_solves_to_the_live_allocation() {
    let c = Cluster::live(3);
    let coord = Coord::start(ServeSettings {
        min_members: 3,
        ..c.settings(localhost())
    });
    let gid = |h: usize| format!("10.9.0.{}", h + 1);
    let socket = |h: usize| c.dir.path().join(format!("shim-{h}.sock"));
    let agents: Vec<Agent> = (0..3)
        .map(|h| {
            let extra = format!(
                "[shim]\nsocket = {:?}\nline_rate_gbps = 8.0\n[nic]\ngids = [\"{}\"]\n",
                socket(h),
                gid(h)
            );
            c.agent_tagged(&h.to_string(), h, coord.addr, None, &extra)
        })
        .collect();
    wait_for("three receive links", Duration::from_secs(20), || {
        let s = coord.status();
        (0..3).all(|h| facility(&s, &format!("rx:h{h}")).is_some())
    });
    let writer_a = SendingShim::start(&socket(0), "writer-a", &[&gid(2), &gid(2)], true);
    let writer_b = SendingShim::start(&socket(1), "writer-b", &[&gid(2)], true);
    // The server answers both writers (its traffic loads h0's and h1's links). An app that
    // sends nothing has the floor as its demand and no value in being active, so whether it
    // is active is a tie that live selection and `solve` may break differently.
    // One of its connections ends at a GID no agent owns: logged, and it loads no link.
    let _server = SendingShim::start(&socket(2), "server", &[&gid(0), &gid(1), "10.9.9.9"], true);
    let both_share_h2 = |s: &serde_json::Value| {
        let (Some((true, a)), Some((true, b))) =
            (live_app(s, "h0", "writer-a"), live_app(s, "h1", "writer-b"))
        else {
            return false;
        };
        let rx2 = facility(s, "rx:h2").unwrap();
        let usage = rx2["usage"].as_f64().unwrap();
        // While the writers' measured demand still ramps up the link can be 98 % full and
        // not yet priced; the link binds only once its price has risen.
        let priced = rx2["price"].as_f64().unwrap() > 0.0;
        (a + b - usage).abs() < 1e-3 && usage > 0.98 && usage < 1.0 + 1e-3 && priced
    };
    wait_for(
        "both writers granted, sharing h2's link",
        Duration::from_secs(30),
        || both_share_h2(&coord.status()),
    );
    wait_for("the unknown peer logged", Duration::from_secs(5), || {
        agents[2].log().contains(
            "a connection of this app ends at a GID no agent's host owns; its traffic loads no receive link app=server peer=00000000000000000000ffff0a090909",
        )
    });
    // The grant reaches the shim after the round the coordinator reports, and the rates still
    // move while the price settles: a status and a grant read at different times need not
    // agree, so the two are read together until they do.
    let mut seen = (0.0, f64::NAN);
    let granted_its_rate = |seen: &mut (f64, f64)| {
        let granted = writer_a.granted_bytes_per_s() as f64;
        let Some((_, a)) = live_app(&coord.status(), "h0", "writer-a") else {
            return false;
        };
        *seen = (granted, a);
        (granted - a * 1e9).abs() <= 0.02 * a * 1e9
    };
    let t = Instant::now();
    while !granted_its_rate(&mut seen) {
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "writer-a granted {} B/s for a rate of {} of 8 Gb/s",
            seen.0,
            seen.1
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // A weight at run time: every agent steps with it and `status` shows it.
    let (code, body) = drum_coordinator::admin::request_unix(
        &coord.socket,
        "POST",
        "/set-weight?app=writer-a&value=3",
    )
    .unwrap();
    assert_eq!(code, 200, "{body}");
    assert_eq!(coord.status()["policy"]["weights"][0][1], 3.0);
    wait_for(
        "writer-a gets three times writer-b",
        Duration::from_secs(30),
        || {
            let s = coord.status();
            match (
                live_app(&s, "h0", "writer-a"),
                live_app(&s, "h1", "writer-b"),
            ) {
                (Some((_, a)), Some((_, b))) => both_share_h2(&s) && (a / b - 3.0).abs() < 0.05,
                _ => false,
            }
        },
    );
    // Settled (two reports in a row agree), the snapshot solved offline is the live allocation.
    let rates = |s: &serde_json::Value| -> Vec<(String, String, f64)> {
        let mut v = Vec::new();
        for m in s["members"].as_array().unwrap() {
            for a in m["apps"].as_array().unwrap() {
                let host = m["host"].as_str().unwrap().to_string();
                v.push((
                    host,
                    a["app"].as_str().unwrap().into(),
                    a["rate"].as_f64().unwrap(),
                ));
            }
        }
        v.sort_by(|x, y| (&x.0, &x.1).cmp(&(&y.0, &y.1)));
        v
    };
    let mut live = rates(&coord.status());
    wait_for(
        "the live allocation settles",
        Duration::from_secs(30),
        || {
            std::thread::sleep(Duration::from_millis(300));
            let now = rates(&coord.status());
            let same = now.len() == live.len()
                && now.iter().zip(&live).all(|(x, y)| (x.2 - y.2).abs() < 1e-9);
            live = now;
            same
        },
    );
    let (code, body) = drum_coordinator::admin::request(coord.admin, "GET", "/snapshot").unwrap();
    assert_eq!(code, 200, "{body}");
    let snapshot = Instance::from_json(&body).unwrap().into_problem().unwrap();
    let solution = solve(
        &snapshot,
        &SolveOptions {
            eps_primal: 1e-12,
            eps_dual: 1e-12,
            max_iter: 20_000,
            // The service runs the swap rounds only, not `solve`'s verified local search.
            polish_trials: 0,
            ..SolveOptions::default()
        },
    );
    assert!(solution.converged);
    let mut offline = Vec::new();
    for (h, st) in solution.hosts.iter().enumerate() {
        let host = &snapshot.hosts[h];
        for p in host.pairs.clone() {
            let x = st.active.binary_search(&p).map_or(0.0, |i| st.x[i]);
            let app = snapshot.app_names[snapshot.pairs[p].app as usize].clone();
            offline.push((host.id.clone(), app, x));
        }
    }
    offline.sort_by(|x, y| (&x.0, &x.1).cmp(&(&y.0, &y.1)));
    assert_eq!(live.len(), 3, "{live:?}");
    for (l, o) in live.iter().zip(&offline) {
        assert_eq!((&l.0, &l.1), (&o.0, &o.1));
        assert!((l.2 - o.2).abs() <= 1e-6, "{l:?} live vs {o:?} solved");
    }
    eprintln!("live allocation {live:?} = solve on the snapshot {offline:?}");
    // writer-b stops: gone from h1, and writer-a takes the link.
    drop(writer_b);
    wait_for(
        "writer-b leaves and writer-a takes the link",
        Duration::from_secs(30),
        || {
            let s = coord.status();
            live_app(&s, "h1", "writer-b").is_none()
                && live_app(&s, "h0", "writer-a").is_some_and(|(_, a)| a > 0.9)
        },
    );
}

/// A static cluster settles: with the default selection configuration (priced restart, 10
/// damped swap rounds, `T_sel` = 100 ms) and the deployed round timing, 4 agents × 6 apps with
/// k = 2 run the schedule, and then no app is parked or activated — not on the coordinator, not
/// on any agent — for 30 s. A weight change afterwards is a change: it re-opens selection.
#[test]
fn a_static_cluster_settles_after_the_selection_schedule() {
    let c = Cluster::new(4, 6, 2, 3);
    let coord = Coord::start(ServeSettings {
        min_members: 4,
        round_interval_ms: 10,
        round_deadline_ms: 50,
        ..c.settings(localhost())
    });
    let agents: Vec<Agent> = (0..4)
        .map(|h| {
            let metrics = format!("metrics_listen = \"127.0.0.1:{}\"", 19470 + h);
            c.agent_tagged(&h.to_string(), h, coord.addr, None, &metrics)
        })
        .collect();
    let planned = coord.status()["selection"]["exchanges_planned"]
        .as_u64()
        .unwrap();
    assert_eq!(planned, 11);
    wait_for("the selection schedule", Duration::from_secs(60), || {
        let s = coord.status();
        s["selection"]["exchanges_done"].as_u64().unwrap() >= planned
            && !s["selection"]["in_progress"].as_bool().unwrap()
    });
    let swaps = |s: &serde_json::Value| {
        let c = &s["counters"];
        (
            c["parks"].as_u64().unwrap(),
            c["activations"].as_u64().unwrap(),
        )
    };
    let agent_swaps = |h: usize| {
        let text = drum_coordinator::admin::request(
            format!("127.0.0.1:{}", 19470 + h).parse().unwrap(),
            "GET",
            "/metrics",
        )
        .map(|r| r.1)
        .unwrap_or_default();
        let get = |name: &str| {
            text.lines()
                .find(|l| l.starts_with(name))
                .and_then(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .unwrap_or(f64::NAN)
        };
        (
            get("drum_agent_selection_parks_total"),
            get("drum_agent_selection_activations_total"),
        )
    };
    let before = swaps(&coord.status());
    let before_agents: Vec<_> = (0..4).map(agent_swaps).collect();
    let iteration = coord.status()["iteration"].as_u64().unwrap();
    std::thread::sleep(Duration::from_secs(31));
    let s = coord.status();
    assert!(
        s["iteration"].as_u64().unwrap() > iteration + 1000,
        "rounds went on: {s:#}"
    );
    assert_eq!(s["members"].as_array().unwrap().len(), 4);
    assert_eq!(
        swaps(&s),
        before,
        "parks and activations after the schedule: {s:#}"
    );
    for (h, before) in before_agents.iter().enumerate() {
        let now = agent_swaps(h);
        assert!(!now.0.is_nan(), "agent {h}'s metrics");
        assert_eq!(now, *before, "agent {h} swapped after the schedule");
    }
    eprintln!(
        "schedule: {} parks, {} activations; none in the 31 s after it ({} iterations)",
        before.0,
        before.1,
        s["iteration"].as_u64().unwrap() - iteration
    );
    // A change re-opens selection: the next period runs an exchange.
    let exchanges = s["counters"]["exchanges"].as_u64().unwrap();
    let app = c.problem.app_names[0].clone();
    let (code, body) = drum_coordinator::admin::request_unix(
        &coord.socket,
        "POST",
        &format!("/set-weight?app={app}&value=5"),
    )
    .unwrap();
    assert_eq!(code, 200, "{body}");
    wait_for(
        "an exchange after the change",
        Duration::from_secs(10),
        || coord.status()["counters"]["exchanges"].as_u64().unwrap() > exchanges,
    );
    drop(agents);
}

/// The live problem survives its coordinator: stopped, the agents go fail-static and the
/// writer keeps its grant (fail-static, not fail-closed); a new coordinator on the same
/// address knows nothing, learns the links and the app again from the rejoining agents, and
/// the writer is granted again.
#[test]
fn a_live_cluster_relearns_its_problem_from_a_restarted_coordinator() {
    let c = Cluster::live(2);
    let settings = ServeSettings {
        min_members: 2,
        ..c.settings(localhost())
    };
    let coord = Coord::start(settings.clone());
    let addr = coord.addr;
    let socket = |h: usize| c.dir.path().join(format!("shim-{h}.sock"));
    let agents: Vec<Agent> = (0..2)
        .map(|h| {
            let extra = format!(
                "[shim]\nsocket = {:?}\nline_rate_gbps = 8.0\n[nic]\ngids = [\"10.9.1.{}\"]\n",
                socket(h),
                h + 1
            );
            c.agent_tagged(&h.to_string(), h, addr, None, &extra)
        })
        .collect();
    wait_for("two links", Duration::from_secs(20), || {
        facility(&coord.status(), "rx:h1").is_some()
    });
    let writer = SendingShim::start(&socket(0), "writer", &["10.9.1.2"], true);
    wait_for("the writer granted", Duration::from_secs(30), || {
        live_app(&coord.status(), "h0", "writer").is_some_and(|(on, r)| on && r > 0.5)
    });
    drop(coord);
    wait_for("fail-static", Duration::from_secs(15), || {
        c.table(0).is_some_and(|t| t.state == LinkState::FailStatic)
    });
    let kept = writer.granted_bytes_per_s();
    assert!(
        kept > 0,
        "the writer keeps its grant while the coordinator is gone"
    );
    let coord = Coord::start(ServeSettings {
        listen: addr,
        ..settings
    });
    wait_for(
        "the restarted coordinator relearns the links and the writer",
        Duration::from_secs(30),
        || {
            let s = coord.status();
            facility(&s, "rx:h0").is_some()
                && facility(&s, "rx:h1").is_some_and(|f| f["pairs"] == 1)
                && live_app(&s, "h0", "writer").is_some_and(|(on, r)| on && r > 0.5)
        },
    );
    // The table is written by its own task, a little after the rounds it reports.
    wait_for("host 0's table live", Duration::from_secs(5), || {
        c.table(0).is_some_and(|t| t.state == LinkState::Live)
    });
    // Found by the chaos soak: the first report to the new coordinator named the old one's
    // facility numbers, which it refused, closing the connection.
    for a in &agents {
        assert!(!a.log().contains("bad host report"), "{}", a.log());
    }
}

/// A port free now, for an agent's `metrics_listen`.
fn free_addr() -> SocketAddr {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
}

/// Issue 19, item 2: a rate table that cannot be written (here a directory where its
/// temporary file goes) does not end the agent: it joins and steps, warns naming the path
/// that failed, counts the failures in its metrics, retries, and writes the table once the
/// obstacle is gone. On SIGTERM it leaves the coordinator and its table says `stopped`.
#[test]
fn an_unwritable_rate_table_does_not_stop_the_agent() {
    let c = Cluster::new(2, 4, 2, 31);
    let coord = Coord::start_with(c.settings(localhost()), fixed_sets());
    let tmp = c.dir.path().join("rates-0.json.tmp");
    std::fs::create_dir(&tmp).unwrap();
    let metrics_addr = free_addr();
    let mut agent = c.agent_tagged(
        "0",
        0,
        coord.addr,
        None,
        &format!("metrics_listen = \"{metrics_addr}\""),
    );
    let host0 = c.problem.hosts[0].id.clone();
    let metrics = || {
        drum_coordinator::admin::request(metrics_addr, "GET", "/metrics")
            .map(|r| r.1)
            .unwrap_or_default()
    };
    wait_for("the agent in rounds", Duration::from_secs(10), || {
        coord.status()["iteration"].as_u64().unwrap() > 20
    });
    assert!(agent.child.try_wait().unwrap().is_none(), "{}", agent.log());
    wait_for("the failure in the metrics", Duration::from_secs(5), || {
        metrics().contains(&format!("drum_agent_rate_table_ok{{host=\"{host0}\"}} 0"))
    });
    let log = agent.log();
    assert!(
        log.contains("could not write the rate table") && log.contains("rates-0.json.tmp"),
        "{log}"
    );
    assert_eq!(
        log.matches("could not write the rate table").count(),
        1,
        "one warning per distinct error: {log}"
    );
    assert!(c.table(0).is_none());
    std::fs::remove_dir(&tmp).unwrap();
    wait_for("the table written, live", Duration::from_secs(5), || {
        c.table(0).is_some_and(|t| t.state == LinkState::Live)
    });
    // The writer task sets the gauge after the file is in place, when it runs again.
    wait_for(
        "the recovery in the metrics",
        Duration::from_secs(5),
        || metrics().contains(&format!("drum_agent_rate_table_ok{{host=\"{host0}\"}} 1")),
    );
    let m = metrics();
    assert!(!m.contains(&format!(
        "drum_agent_rate_table_write_failures_total{{host=\"{host0}\"}} 0\n"
    )));
    wait_for("the recovery logged", Duration::from_secs(5), || {
        agent.log().contains("the rate table is written again")
    });
    assert_eq!(
        // SAFETY: kill(2) on the pid of a child this test started and still owns.
        unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) },
        0
    );
    let status = agent.child.wait().unwrap();
    assert!(status.success(), "{status:?}: {}", agent.log());
    assert!(agent.log().contains("agent stopped"));
    assert_eq!(c.table(0).unwrap().state, LinkState::Stopped);
    wait_for("the agent's Leave", Duration::from_secs(5), || {
        log_text().contains(&format!("host=\"{host0}\" why=Leave"))
    });
}

/// Issue 19, item 4: a second agent started with the id of a live host is refused, with a
/// WARN naming both connections; the incumbent keeps its place and the epoch stays (before,
/// the two replaced each other about 8 times a second for ever).
#[test]
fn a_second_agent_with_a_live_host_id_is_refused() {
    let c = Cluster::new(2, 4, 2, 32);
    let coord = Coord::start_with(c.settings(localhost()), fixed_sets());
    let _first = c.agent(0, coord.addr, None);
    let _other = c.agent(1, coord.addr, None);
    wait_for("both agents in rounds", Duration::from_secs(10), || {
        let s = coord.status();
        s["members"].as_array().unwrap().len() == 2 && s["iteration"].as_u64().unwrap() > 20
    });
    let member = |s: &serde_json::Value| -> u64 {
        s["members"]
            .as_array()
            .unwrap()
            .iter()
            .find(|m| m["host"] == c.problem.hosts[0].id.as_str())
            .unwrap()["member"]
            .as_u64()
            .unwrap()
    };
    let before = coord.status();
    let second = c.agent_tagged("0b", 0, coord.addr, None, "");
    wait_for(
        "the second agent refused twice",
        Duration::from_secs(10),
        || second.log().matches("coordinator refused us: host").count() >= 2,
    );
    let after = coord.status();
    assert_eq!(after["epoch"], before["epoch"], "no membership change");
    assert_eq!(member(&after), member(&before), "the incumbent stays");
    assert!(after["counters"]["duplicate_joins"].as_u64().unwrap() >= 2);
    let log = log_text();
    let host0 = &c.problem.hosts[0].id;
    assert!(
        log.lines().any(|l| l.contains("WARN")
            && l.contains(&format!("refused join: host {host0} is already a member"))
            && l.contains("newcomer_remote=")
            && l.contains("incumbent_remote=")),
        "{log}"
    );
    assert_eq!(
        c.table(0).unwrap().state,
        LinkState::Live,
        "the incumbent's table"
    );
}

/// Issue 19, item 3: one of two shards restarted alone (the other keeps running). The
/// cluster should recover: both shards run rounds in step again, re-select together, and
/// nobody is dropped for not answering an exchange once the agents are back. It does not
/// yet: the running shard starts its next periodic exchange at its own count of iterations
/// since its last one, the restarted shard at another, so the agents hold one shard's
/// `Select` while the other sends rounds, until the exchange's timeout drops them all; the
/// shard that timed out completes the exchange alone and the shards' exchange numbers part.
#[test]

fn a_shard_restarted_alone_recovers() {
    use drum_common::protocol::Shard;
    let c = Cluster::new(4, 6, 2, 11);
    let options = ServeOptions {
        selection_rounds: 2,
        iters_per_round: 10,
        selection_period_ms: 100,
        ..ServeOptions::default()
    };
    let settings = |members: usize| ServeSettings {
        min_members: members,
        round_interval_ms: 2,
        ..c.settings(localhost())
    };
    let (mut coords, _agents) = two_shards(&c, &options, settings);
    let planned = u64::from(options.selection_rounds + 1);
    let num = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap();
    let done = |s: &serde_json::Value| s["selection"]["exchanges_done"].as_u64().unwrap();
    wait_for(
        "both shards past the schedule",
        Duration::from_secs(20),
        || done(&coords[0].status()) >= planned + 2 && done(&coords[1].status()) >= planned + 2,
    );
    let members1 = coords[1].status()["members"].as_array().unwrap().len();
    let addr1 = coords[1].addr;
    drop(coords.pop());
    std::thread::sleep(Duration::from_millis(300));
    coords.push(Coord::start_with(
        ServeSettings {
            listen: addr1,
            ..settings(members1)
        },
        ServeOptions {
            shard: Shard { index: 1, count: 2 },
            ..options.clone()
        },
    ));
    wait_for(
        "the agents back on the new shard",
        Duration::from_secs(20),
        || {
            coords[1].status()["members"].as_array().unwrap().len() == members1
                && num(&coords[1].status(), "iteration") > 0
        },
    );
    // Recovered: from here on, 3 more exchanges on both shards, and no timeout anywhere.
    let t0: Vec<u64> = coords
        .iter()
        .map(|c| c.status()["counters"]["timeouts"].as_u64().unwrap())
        .collect();
    let x0: Vec<u64> = coords.iter().map(|c| done(&c.status())).collect();
    wait_for(
        "three re-selections on both shards",
        Duration::from_secs(30),
        || (0..2).all(|i| done(&coords[i].status()) >= x0[i] + 3),
    );
    for (i, coord) in coords.iter().enumerate() {
        let s = coord.status();
        assert_eq!(s["counters"]["timeouts"], t0[i], "shard {i}: {s:#}");
    }
    assert!((0..4).all(|h| c.table(h).is_some_and(|t| t.state == LinkState::Live)));
}

/// Issue 19, item 9: SIGTERM while the agent is connecting (here to a UDP socket that never
/// answers, with a 60 s timeout) stops it at once, cleanly (`agent stopped`, status 0, the
/// table `stopped`), instead of waiting out the attempt.
#[test]
fn sigterm_while_connecting_stops_the_agent_at_once() {
    let c = Cluster::new(1, 2, 1, 33);
    let mute = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let id = &c.problem.hosts[0].id;
    let certs = c.dir.path().join("certs");
    let config = c.dir.path().join("agent-mute.toml");
    let rates = c.dir.path().join("rates-mute.json");
    std::fs::write(
        &config,
        format!(
            "host = {id:?}\ninstance = {:?}\ncoordinator = \"{}\"\nrate_table = {rates:?}\n\
             heartbeat_ms = 1000\ncoordinator_timeout_ms = 60000\n\
             [tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
            c.instance,
            mute.local_addr().unwrap(),
            certs.join("ca.pem"),
            certs.join(format!("agent-{id}.pem")),
            certs.join(format!("agent-{id}.key")),
        ),
    )
    .unwrap();
    let log = c.dir.path().join("agent-mute.log");
    let mut agent = Agent {
        child: Command::new(env!("CARGO_BIN_EXE_drum-agent"))
            .arg("--config")
            .arg(&config)
            .env("DRUM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .unwrap(),
        log,
    };
    // The attempt is under way once the handshake's first datagram arrives.
    let mut buf = [0u8; 2048];
    mute.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    mute.recv_from(&mut buf)
        .expect("the agent's first QUIC datagram");
    assert_eq!(
        // SAFETY: kill(2) on the pid of a child this test started and still owns.
        unsafe { libc::kill(agent.child.id() as i32, libc::SIGTERM) },
        0
    );
    let t = Instant::now();
    let status = loop {
        if let Some(s) = agent.child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "still connecting: {}",
            agent.log()
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}: {}", agent.log());
    assert!(agent.log().contains("agent stopped"), "{}", agent.log());
    let table = RateTable::read(&rates).unwrap();
    assert_eq!(table.state, LinkState::Stopped);
    agent.kill();
}

/// Registers with the shim socket `socket` as app `app` from a process of user `uid` (a
/// numeric uid through `setpriv`: no account needed), which holds its registration until its
/// standard input closes. Returns once the agent welcomed it, with the name it was granted.
fn register_as_user(socket: &std::path::Path, uid: u32, app: &str) -> (Child, String) {
    use std::io::{BufRead, BufReader};
    const REGISTER_AND_HOLD: &str = "import os, socket, sys\n\
s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)\n\
s.connect(sys.argv[1])\n\
s.send(('DRUM1 HELLO pid=%d app=%s exe=/usr/bin/python3' % (os.getpid(), sys.argv[2])).encode())\n\
print(s.recvmsg(512, socket.CMSG_SPACE(4))[0].decode(), flush=True)\n\
sys.stdin.read()\n";
    let mut child = Command::new("setpriv")
        .args([
            &format!("--reuid={uid}"),
            &format!("--regid={uid}"),
            "--clear-groups",
            "--",
            "/usr/bin/python3",
            "-c",
            REGISTER_AND_HOLD,
        ])
        .arg(socket)
        .arg(app)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .expect("setpriv python3");
    let mut line = String::new();
    BufReader::new(child.stdout.as_mut().unwrap())
        .read_line(&mut line)
        .unwrap();
    let granted = line
        .trim()
        .strip_prefix("DRUM1 WELCOME app=")
        .unwrap_or_else(|| panic!("uid {uid} not welcomed: {line:?}"))
        .to_string();
    (child, granted)
}

/// `(uid, gid, cgroup, processes)` of app `app` on `host` in the coordinator's status.
fn identities(s: &serde_json::Value, host: &str, app: &str) -> Vec<(u64, u64, String, u64)> {
    let Some(a) = s["members"]
        .as_array()
        .into_iter()
        .flatten()
        .filter(|m| m["host"] == host)
        .flat_map(|m| m["apps"].as_array().cloned().unwrap_or_default())
        .find(|a| a["app"] == app)
    else {
        return Vec::new();
    };
    let mut out: Vec<_> = a["identities"]
        .as_array()
        .into_iter()
        .flatten()
        .map(|i| {
            (
                i["uid"].as_u64().unwrap(),
                i["gid"].as_u64().unwrap(),
                i["cgroup"].as_str().unwrap().to_string(),
                i["processes"].as_u64().unwrap(),
            )
        })
        .collect();
    out.sort();
    out
}

/// Who runs each live app, as the host's agent learnt it from the kernel, reaches the
/// coordinator's `status`: real processes of three users register with one agent as `kv`;
/// tenant rules give `kv` to root and uid 42101, so those two share it, and uid 42102, which
/// no rule names, runs as `uid-42102`. The coordinator shows `kv` with both identities
/// and their process counts, and `uid-42102` with its own; when a process leaves, its
/// identity goes.
#[test]
fn the_coordinators_status_shows_who_runs_each_app() {
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    let have = |tool: &str| {
        Command::new(tool)
            .arg("--version")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    // The system's interpreter: one under root's home is not every user's to run.
    if !root || !have("setpriv") || !have("/usr/bin/python3") {
        eprintln!(
            "SKIPPED: needs root, setpriv and /usr/bin/python3 to run processes of other users"
        );
        return;
    }
    let c = Cluster::live(1);
    // Other users reach the agent's socket in the test's directory.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(c.dir.path(), std::fs::Permissions::from_mode(0o755)).unwrap();
    let coord = Coord::start(c.settings(localhost()));
    let socket = c.dir.path().join("shim-0.sock");
    let extra = format!(
        "[shim]\nsocket = {socket:?}\nline_rate_gbps = 8.0\n[nic]\ngids = [\"10.9.0.1\"]\n\
         [[shim.tenants.rules]]\nuid = 0\napps = [\"kv\"]\n\
         [[shim.tenants.rules]]\nuid = 42101\napps = [\"kv\"]\n"
    );
    let agent = c.agent_tagged("0", 0, coord.addr, None, &extra);
    wait_for("the shim socket", Duration::from_secs(20), || {
        socket.exists()
    });
    let (_fd, _map) = register_as_shim(&socket, "kv");
    let (mut a1, granted1) = register_as_user(&socket, 42101, "kv");
    let (mut a2, granted2) = register_as_user(&socket, 42101, "kv");
    let (mut b, granted_b) = register_as_user(&socket, 42102, "kv");
    assert_eq!(
        (&*granted1, &*granted2, &*granted_b),
        ("kv", "kv", "uid-42102")
    );
    let h = &c.problem.hosts[0].id;
    let cgroup = |pid: u32| {
        let text = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).unwrap();
        text.lines()
            .find_map(|l| l.strip_prefix("0::"))
            .unwrap_or("/")
            .to_string()
    };
    let (me, theirs) = (cgroup(std::process::id()), cgroup(a1.id()));
    let want_kv = {
        let mut v = vec![(0, 0, me, 1), (42101, 42101, theirs.clone(), 2)];
        v.sort();
        v
    };
    wait_for(
        "kv's and uid-42102's identities in status",
        Duration::from_secs(30),
        || {
            let s = coord.status();
            identities(&s, h, "kv") == want_kv
                && identities(&s, h, "uid-42102") == vec![(42102, 42102, theirs.clone(), 1)]
        },
    );
    let s = coord.status();
    let kv = s["members"][0]["apps"]
        .as_array()
        .unwrap()
        .iter()
        .find(|a| a["app"] == "kv")
        .unwrap()
        .clone();
    assert_eq!(kv["more_identities"], 0, "{kv:#}");
    eprintln!("kv in status: {kv}");
    // One of uid 42101's processes leaves: its identity counts one process.
    drop(a2.stdin.take());
    let _ = a2.wait();
    wait_for(
        "uid 42101 down to one process",
        Duration::from_secs(30),
        || {
            identities(&coord.status(), h, "kv")
                .iter()
                .any(|i| i.0 == 42101 && i.3 == 1)
        },
    );
    drop(b.stdin.take());
    drop(a1.stdin.take());
    let _ = (b.wait(), a1.wait());
    wait_for("uid-42102 gone", Duration::from_secs(30), || {
        identities(&coord.status(), h, "uid-42102").is_empty()
    });
    assert!(
        agent.log().contains("requested=kv granted=uid-42102"),
        "{}",
        agent.log()
    );
}

/// The live problem through a relay: a `drum-coordinator relay` process without an instance
/// file between a live coordinator and two live agents. The relay passes the policy and the
/// facility table down and each agent's report up named, so the coordinator makes a link per
/// host (not per relay) and lists the rack's hosts; a writer on h0 into h1 is granted h1's
/// link and its shim gets the grant; an agent that stops takes its host's report with it.
#[test]
fn the_live_problem_passes_a_relay() {
    let c = Cluster::live(2);
    let coord = Coord::start(c.settings(localhost()));
    let certs = c.dir.path().join("certs");
    let sans = ["localhost".to_string(), "127.0.0.1".to_string()];
    issue_relay(&DevCa::open(&certs).unwrap(), "rack", &sans).unwrap();
    let listen = std::net::UdpSocket::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap();
    let config = c.dir.path().join("relay.toml");
    std::fs::write(
        &config,
        format!(
            "host = \"rack\"\nlisten = \"{listen}\"\nupstream = \"{}\"\n\
             server_name = \"localhost\"\nmin_agents = 2\nheartbeat_ms = 100\n\
             member_timeout_ms = {MEMBER_TIMEOUT_MS}\ncoordinator_timeout_ms = {MEMBER_TIMEOUT_MS}\n\
             [tls]\nca = \"certs/ca.pem\"\ncert = \"certs/relay-rack.pem\"\nkey = \"certs/relay-rack.key\"\n\
             [upstream_tls]\nca = \"certs/ca.pem\"\ncert = \"certs/agent-rack.pem\"\nkey = \"certs/agent-rack.key\"\n",
            coord.addr
        ),
    )
    .unwrap();
    let relay_bin =
        std::path::Path::new(env!("CARGO_BIN_EXE_drum-agent")).with_file_name("drum-coordinator");
    let relay_log = c.dir.path().join("relay.log");
    let relay = Agent {
        child: Command::new(&relay_bin)
            .args(["relay", "--config"])
            .arg(&config)
            .env("DRUM_LOG", "info")
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&relay_log).unwrap())
            .spawn()
            .expect("start the relay (cargo build --release -p drum-coordinator)"),
        log: relay_log,
    };
    let gid = |h: usize| format!("10.9.2.{}", h + 1);
    let socket = |h: usize| c.dir.path().join(format!("shim-{h}.sock"));
    let mut agents: Vec<Agent> = (0..2)
        .map(|h| {
            let extra = format!(
                "[shim]\nsocket = {:?}\nline_rate_gbps = 8.0\n[nic]\ngids = [\"{}\"]\n",
                socket(h),
                gid(h)
            );
            c.agent_tagged(&h.to_string(), h, listen, None, &extra)
        })
        .collect();
    let rack = |s: &serde_json::Value| -> Vec<String> {
        s["members"][0]["rack"]
            .as_array()
            .map(|r| {
                r.iter()
                    .map(|h| h["host"].as_str().unwrap().to_string())
                    .collect()
            })
            .unwrap_or_default()
    };
    wait_for(
        "a link per host, through the relay",
        Duration::from_secs(20),
        || {
            let s = coord.status();
            facility(&s, "rx:h0").is_some()
                && facility(&s, "rx:h1").is_some()
                && s["members"].as_array().unwrap().len() == 1
                && rack(&s) == ["h0", "h1"]
        },
    );
    assert_eq!(coord.status()["members"][0]["host"], "rack");
    let writer = SendingShim::start(&socket(0), "writer", &[&gid(1)], true);
    let granted = |s: &serde_json::Value| {
        s["members"][0]["rack"].as_array().and_then(|r| {
            let h0 = r.iter().find(|h| h["host"] == "h0")?;
            let a = h0["apps"]
                .as_array()?
                .iter()
                .find(|a| a["app"] == "writer")?;
            Some((a["active"].as_bool()?, a["rate"].as_f64()?))
        })
    };
    wait_for(
        "the writer granted h1's link",
        Duration::from_secs(30),
        || {
            granted(&coord.status()).is_some_and(|(on, r)| on && r > 0.9)
                && writer.granted_bytes_per_s() > 0
        },
    );
    let rx1 = facility(&coord.status(), "rx:h1").unwrap().clone();
    assert!(rx1["usage"].as_f64().unwrap() > 0.9, "{rx1}");
    agents[1].kill();
    wait_for(
        "h1's report gone with its agent",
        Duration::from_secs(20),
        || rack(&coord.status()) == ["h0"],
    );
    let log = relay.log();
    assert!(!log.contains("not supported"), "{log}");
}
