//! Scale run: N agents speaking the real protocol over loopback QUIC with mutual TLS to one
//! coordinator, all in this process (one QUIC endpoint per agent, as on real hosts). Prints the
//! coordinator's round latency quantiles (from a round's first send to its last contribution),
//! rounds per second and the residuals, and checks the allocation against the in-process solver.
//!
//! `cargo run --release -p drum-agent --example scale -- --agents 1000 --rounds 300`

use anyhow::{Context, Result};
use clap::Parser;
use drum_agent::AgentSettings;
use drum_common::generator::{generate, GeneratorConfig};
use drum_common::instance::Instance;
use drum_common::protocol::fixed_active_sets;
use drum_coordinator::net;
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
}

fn metric(text: &str, prefix: &str) -> Option<f64> {
    text.lines()
        .find_map(|l| l.strip_prefix(prefix))
        .and_then(|v| v.trim().parse().ok())
}

fn main() -> Result<()> {
    let args = Args::parse();
    let dir = tempfile::tempdir()?;
    let t = Instant::now();
    let problem = generate(&GeneratorConfig {
        k: args.k,
        seed: args.seed,
        ..GeneratorConfig::new(args.agents, args.apps)
    });
    let instance = dir.path().join("instance.json");
    std::fs::write(&instance, Instance::from_problem(&problem).to_json())?;
    let certs = net::dev_certs(
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
    rt.block_on(async {
        let server = Server::bind(ServeSettings {
            listen: "127.0.0.1:0".parse()?,
            instance: Some(instance.clone()),
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
        .await?;
        let addr = server.local_addr()?;
        let admin = server.admin_addr().context("admin endpoint")?;
        tokio::spawn(server.run(std::future::pending()));
        let tls = certs.agents[0].1.clone();
        let joined = Instant::now();
        for (h, a) in active.iter().enumerate() {
            let settings = AgentSettings {
                host: problem.hosts[h].id.clone(),
                instance: Some(instance.clone()),
                coordinator: addr,
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
                break;
            }
        }
        Ok::<_, anyhow::Error>(())
    })?;
    rt.shutdown_timeout(Duration::from_secs(1));
    Ok(())
}
