//! Scale run: N agents speaking the real protocol over loopback QUIC with mutual TLS to one
//! coordinator, all in this process (one QUIC endpoint per agent, as on real hosts). Prints the
//! coordinator's round latency quantiles (from a round's first send to its last contribution),
//! rounds per second and the residuals, and checks the allocation against the in-process solver.
//!
//! `cargo run --release -p drum-agent --example scale -- --agents 1000 --rounds 300`
//!
//! With `--coordinator-process` the coordinator is the `drum-coordinator serve` binary next to
//! this example's directory, in a process of its own, with fixed active sets (no selection
//! exchanges): the run then also prints the coordinator's own CPU time (utime + stime from
//! `/proc`) per agent per round, measured between the first `--warmup` rounds and the last
//! — the cost that decides how many hosts one coordinator serves (docs/control-plane.md).
//! `--relays R` puts the agents behind R relays (`drum-coordinator relay`), each in a process
//! of its own, and reports their CPU per agent-round too.

use anyhow::{Context, Result};
use clap::Parser;
use drum_agent::AgentSettings;
use drum_common::generator::{generate, GeneratorConfig};
use drum_common::instance::Instance;
use drum_common::protocol::fixed_active_sets;
use drum_coordinator::dev_ca;
use drum_coordinator::server::{ServeSettings, Server};
use std::sync::Arc;
use std::time::{Duration, Instant};

#[derive(Parser)]
struct Args {
    #[arg(long, default_value_t = 1000)]
    agents: usize,
    #[arg(long, default_value_t = 20)]
    apps: usize,
    #[arg(long, default_value_t = 4)]
    k: usize,
    #[arg(long, default_value_t = 300)]
    rounds: u64,
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Runtime worker threads (default: one per core).
    #[arg(long)]
    threads: Option<usize>,
    /// Run the coordinator as its own process (`drum-coordinator serve`, fixed active sets)
    /// and report its CPU per agent per round.
    #[arg(long)]
    coordinator_process: bool,
    /// With `--coordinator-process`: rounds before the CPU measurement starts.
    #[arg(long, default_value_t = 50)]
    warmup: u64,
    /// With `--coordinator-process`: put the agents behind this many relays
    /// (`drum-coordinator relay`, each in a process of its own, agent h behind relay h mod R)
    /// and report the relays' CPU per agent-round too.
    #[arg(long, default_value_t = 0)]
    relays: usize,
}

/// The coordinator process's CPU time (user + system) in seconds, from `/proc/PID/stat`.
fn cpu_seconds(pid: u32) -> Result<f64> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
    // Fields after the command name, which is in parentheses and may hold spaces.
    let rest = stat.rsplit_once(')').context("malformed stat")?.1;
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f[11].parse::<f64>()? + f[12].parse::<f64>()?;
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) } as f64;
    Ok(ticks / hz)
}

/// Kills the coordinator (or a relay) process when the run ends, however it ends: dropped
/// on a return or a panic, and killed by the kernel if this process dies of a signal
/// (`PR_SET_PDEATHSIG` fires when the spawning thread ends: they are spawned on the main
/// thread, in `block_on`, which lives as long as the process).
struct Child(std::process::Child);

impl Child {
    fn spawn(cmd: &mut std::process::Command) -> std::io::Result<Child> {
        use std::os::unix::process::CommandExt as _;
        // SAFETY: the closure runs in the forked child before exec and only calls prctl,
        // which is async-signal-safe.
        unsafe {
            cmd.pre_exec(|| {
                if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) != 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        cmd.spawn().map(Child)
    }
}

/// On SIGINT or SIGTERM, removes the run's directory (the instance, certificates and
/// configs) and exits; the children die with this process.
async fn clean_up_on_signal(dir: std::path::PathBuf) {
    use tokio::signal::unix::{signal, SignalKind};
    let (Ok(mut int), Ok(mut term)) = (
        signal(SignalKind::interrupt()),
        signal(SignalKind::terminate()),
    ) else {
        return;
    };
    // The shell's status for a death by the signal.
    let status = tokio::select! {
        _ = int.recv() => 130,
        _ = term.recv() => 143,
    };
    let _ = std::fs::remove_dir_all(&dir);
    std::process::exit(status);
}

impl Drop for Child {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The coordinator service in this process, as the run has always used it.
async fn in_process(
    args: &Args,
    instance: &std::path::Path,
    certs: &dev_ca::DevCerts,
) -> Result<Server> {
    Server::bind(ServeSettings {
        listen: "127.0.0.1:0".parse()?,
        instance: Some(instance.to_path_buf()),
        tls: certs.coordinator.clone(),
        admin_listen: Some("127.0.0.1:0".parse()?),
        rho: None,
        min_members: args.agents,
        round_deadline_ms: 1000,
        max_staleness: 0,
        round_interval_ms: 0,
        heartbeat_ms: 2000,
        member_timeout_ms: 30_000,
        max_iterations: Some(args.rounds),
        // One certificate serves every simulated host.
        bind_host_to_certificate: false,
    })
    .await
}

fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|v| v.trim().parse().ok())
}

fn main() -> Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.relays == 0 || args.coordinator_process,
        "--relays needs --coordinator-process"
    );
    let dir = tempfile::tempdir()?;
    let t = Instant::now();
    let problem = generate(&GeneratorConfig {
        k: args.k,
        seed: args.seed,
        ..GeneratorConfig::new(args.agents, args.apps)
    });
    let instance = dir.path().join("instance.json");
    std::fs::write(&instance, Instance::from_problem(&problem).to_json())?;
    let certs = dev_ca::dev_certs(
        &dir.path().join("certs"),
        &["localhost".into(), "127.0.0.1".into()],
        &["scale".into()],
    )?;
    let active = fixed_active_sets(&problem);
    eprintln!(
        "instance: {} hosts × {} apps, k = {}; set up in {:.1} s",
        args.agents,
        args.apps,
        args.k,
        t.elapsed().as_secs_f64()
    );
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = args.threads {
        rt.worker_threads(n);
    }
    let rt = rt.enable_all().build()?;
    let problem = Arc::new(problem);
    let exe = std::env::current_exe()?;
    let bin = exe
        .parent()
        .and_then(|d| d.parent())
        .context("the example's directory")?
        .join("drum-coordinator");
    rt.block_on(async {
        tokio::spawn(clean_up_on_signal(dir.path().to_path_buf()));
        let mut coordinator: Option<Child> = None;
        let (addr, admin) = if args.coordinator_process {
            let free = || -> Result<std::net::SocketAddr> {
                Ok(std::net::TcpListener::bind("127.0.0.1:0")?.local_addr()?)
            };
            let admin = free()?;
            let listen = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?;
            let config = dir.path().join("coordinator.toml");
            std::fs::write(
                &config,
                format!(
                    "listen = \"{listen}\"\ninstance = {instance:?}\nadmin_listen = \"{admin}\"\n\
                     min_members = {}\nround_deadline_ms = 1000\nmax_staleness = 0\nround_interval_ms = 0\n\
                     heartbeat_ms = 2000\nmember_timeout_ms = 30000\nmax_iterations = {}\n\
                     bind_host_to_certificate = false\npriced_start = false\nselection_rounds = 0\n\
                     selection_period_ms = 0\n[tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
                    if args.relays > 0 { args.relays } else { args.agents },
                    args.rounds,
                    certs.coordinator.ca,
                    certs.coordinator.cert,
                    certs.coordinator.key,
                ),
            )?;
            coordinator = Some(
                Child::spawn(
                    std::process::Command::new(&bin)
                        .args(["serve", "--config"])
                        .arg(&config)
                        .env("DRUM_LOG", "warn"),
                )
                .with_context(|| format!("starting {}", bin.display()))?,
            );
            // Wait for its admin endpoint.
            let t = Instant::now();
            while std::net::TcpStream::connect(admin).is_err() {
                anyhow::ensure!(t.elapsed() < Duration::from_secs(30), "coordinator did not start");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            (listen, admin)
        } else {
            let server = in_process(&args, &instance, &certs).await?;
            let addr = server.local_addr()?;
            let admin = server.admin_addr().context("admin endpoint")?;
            tokio::spawn(server.run(std::future::pending()));
            (addr, admin)
        };
        let pid = coordinator.as_ref().map(|c| c.0.id());
        // Relay r serves agents r, r + R, r + 2R, ...
        let mut relays: Vec<(std::net::SocketAddr, Child)> = Vec::new();
        for r in 0..args.relays {
            let listen = std::net::UdpSocket::bind("127.0.0.1:0")?.local_addr()?;
            let config = dir.path().join(format!("relay-{r}.toml"));
            let agents = (args.agents + args.relays - 1 - r) / args.relays;
            let (up, down) = (&certs.agents[0].1, &certs.coordinator);
            std::fs::write(
                &config,
                format!(
                    "host = \"relay-{r}\"\nlisten = \"{listen}\"\nupstream = \"{addr}\"\n\
                     server_name = \"localhost\"\ninstance = {instance:?}\nmin_agents = {agents}\n\
                     round_deadline_ms = 500\nmax_staleness = 0\nheartbeat_ms = 2000\n\
                     member_timeout_ms = 30000\ncoordinator_timeout_ms = 30000\n\
                     bind_host_to_certificate = false\n\
                     [tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n\
                     [upstream_tls]\nca = {:?}\ncert = {:?}\nkey = {:?}\n",
                    down.ca, down.cert, down.key, up.ca, up.cert, up.key,
                ),
            )?;
            let child = Child::spawn(
                std::process::Command::new(&bin)
                    .args(["relay", "--config"])
                    .arg(&config)
                    .env("DRUM_LOG", "warn"),
            )
            .with_context(|| format!("starting relay {r}"))?;
            relays.push((listen, child));
        }
        // Each relay holds its port before the agents start: they bind ephemeral ports, and
        // one could take a port a relay has not bound yet.
        let t = Instant::now();
        for (r, (listen, child)) in relays.iter_mut().enumerate() {
            while std::net::UdpSocket::bind(*listen).is_ok() {
                anyhow::ensure!(
                    child.0.try_wait()?.is_none(),
                    "relay {r} exited before it listened"
                );
                anyhow::ensure!(t.elapsed() < Duration::from_secs(60), "relay {r} did not start");
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
        let relay_cpu = || -> Result<f64> {
            relays.iter().map(|(_, c)| cpu_seconds(c.0.id())).sum()
        };
        let mut relay_mark = 0.0;
        let mut cpu_mark: Option<(f64, u64)> = None;
        let tls = certs.agents[0].1.clone();
        let joined = Instant::now();
        for (h, a) in active.iter().enumerate() {
            let settings = AgentSettings {
                host: problem.hosts[h].id.clone(),
                instance: Some(instance.clone()),
                coordinator: if relays.is_empty() { addr } else { relays[h % relays.len()].0 },
                server_name: "localhost".into(),
                tls: tls.clone(),
                rate_table: None,
                heartbeat_ms: 2000,
                coordinator_timeout_ms: 30_000,
                backoff_min_ms: 200,
                backoff_max_ms: 2000,
                metrics_listen: None,
            };
            tokio::spawn(drum_agent::run(
                settings,
                problem.clone(),
                h,
                a.clone(),
                std::future::pending(),
            ));
        }
        let status = |path: &'static str| {
            tokio::task::spawn_blocking(move || {
                drum_coordinator::admin::request(admin, "GET", path)
            })
        };
        let mut started: Option<(Instant, u64)> = None;
        loop {
            tokio::time::sleep(Duration::from_millis(100)).await;
            let (_, body) = status("/status").await??;
            let s: serde_json::Value = serde_json::from_str(&body)?;
            let it = s["iteration"].as_u64().unwrap_or(0);
            if let (Some(pid), None) = (pid, cpu_mark) {
                if it >= args.warmup {
                    relay_mark = relay_cpu()?;
                    cpu_mark = Some((cpu_seconds(pid)?, it));
                }
            }
            if started.is_none() && it > 0 {
                eprintln!(
                    "all {} agents joined and rounds began after {:.1} s",
                    args.agents,
                    joined.elapsed().as_secs_f64()
                );
                started = Some((Instant::now(), it));
            }
            if it >= args.rounds {
                let (t0, it0) = started.expect("rounds ran");
                let secs = t0.elapsed().as_secs_f64();
                let (_, m) = status("/metrics").await??;
                let q = |q: &str| {
                    metric(
                        &m,
                        &format!("drum_coordinator_round_recent_seconds{{quantile=\"{q}\"}} "),
                    )
                    .map_or(f64::NAN, |v| v * 1e3)
                };
                println!("agents: {}", args.agents);
                println!(
                    "rounds: {} ({:.0} per second)",
                    it,
                    (it - it0) as f64 / secs
                );
                println!(
                    "round latency (ms): p50 {:.2}  p90 {:.2}  p99 {:.2}",
                    q("0.5"),
                    q("0.9"),
                    q("0.99")
                );
                println!(
                    "residuals after {} rounds: primal {:.2e}  dual {:.2e}",
                    it,
                    s["primal_residual"].as_f64().unwrap_or(f64::NAN),
                    s["dual_residual"].as_f64().unwrap_or(f64::NAN)
                );
                println!(
                    "stale reuses {}  refused {}",
                    s["counters"]["stale_reuses"], s["counters"]["refused"]
                );
                if let (Some(pid), Some((cpu0, it0))) = (pid, cpu_mark) {
                    let cpu = cpu_seconds(pid)? - cpu0;
                    let rounds = (it - it0).max(1);
                    println!(
                        "coordinator process: {cpu:.2} s CPU over rounds {it0}..{it}: {:.2} ms per round, {:.2} µs per agent-round",
                        cpu / rounds as f64 * 1e3,
                        cpu / (rounds * args.agents as u64) as f64 * 1e6
                    );
                    if !relays.is_empty() {
                        let cpu = relay_cpu()? - relay_mark;
                        println!(
                            "{} relay processes: {cpu:.2} s CPU over rounds {it0}..{it}: {:.2} ms per round in all, {:.2} µs per agent-round",
                            relays.len(),
                            cpu / rounds as f64 * 1e3,
                            cpu / (rounds * args.agents as u64) as f64 * 1e6
                        );
                    }
                }
                break;
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    rt.shutdown_timeout(Duration::from_secs(1));
    drop(dir);
    Ok(())
}
