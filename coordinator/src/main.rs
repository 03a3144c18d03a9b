//! drum-coordinator: offline `solve` and `simulate`, the control-plane service (`serve`), and
//! operator commands (`dev-certs`, `status`, `set-capacity`); docs/control-plane.md.

#![forbid(unsafe_code)]

mod plot;
mod report;
mod simulate;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use drum_common::dual::DualStep;
use drum_common::generator::GeneratorConfig;
use drum_common::instance::Instance;
use drum_common::lossy::Loss;
use drum_common::solver::{default_rho, price_reference, solve, Algorithm, SolveOptions, TraceRow};
use report::SolutionReport;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "drum-coordinator",
    version,
    about = "DRUM coordinator: solve and simulate the NUM problem, or serve the control plane"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Clone, Copy, ValueEnum)]
enum AlgorithmArg {
    Admm,
    Dual,
}

#[derive(clap::Args)]
struct SolverArgs {
    /// ADMM penalty ρ (default: the median-curvature rule, docs/model.md).
    #[arg(long)]
    rho: Option<f64>,
    /// Cap on inner iterations in total.
    #[arg(long, default_value_t = 1000)]
    max_iter: usize,
    /// Top-k selection rounds.
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Inner iterations between two selection rounds.
    #[arg(long, default_value_t = 20)]
    iters_per_round: usize,
    /// Seed of the selection's coin flips.
    #[arg(long, default_value_t = 1)]
    selection_seed: u64,
    /// Tolerance on both residuals: a selection round's inner loop, and the last one, stop
    /// once the primal and the dual residual are both at most this.
    #[arg(long, default_value_t = 1e-4)]
    eps: f64,
    /// Trial re-solves of the verified local search after the selection rounds (0: none;
    /// docs/model.md, "Selection").
    #[arg(long, default_value_t = SolveOptions::default().polish_trials)]
    polish_trials: usize,
    /// Subgradient steps that tighten the final certificate's upper bound (0: none;
    /// docs/model.md, "Feasible allocations and the certificate").
    #[arg(long, default_value_t = SolveOptions::default().certificate_iters)]
    certificate_iters: usize,
    /// Most sweeps of the certificate's coordinate descent after its subgradient steps (0:
    /// none; docs/model.md, "Feasible allocations and the certificate").
    #[arg(long, default_value_t = SolveOptions::default().certificate_sweeps)]
    certificate_sweeps: usize,
}

#[derive(Subcommand)]
enum Command {
    /// Solve an instance file (JSON, docs/instance-format.md).
    Solve {
        #[arg(long)]
        instance: PathBuf,
        #[arg(long, value_enum, default_value = "admm")]
        algorithm: AlgorithmArg,
        #[command(flatten)]
        solver: SolverArgs,
        /// Print the full result as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Generate an instance like the DRUM paper's simulation and solve it with ADMM; compare
    /// ADMM with the baselines (dual decomposition, NUMFabric's xWI) on the final active sets.
    Simulate {
        #[arg(long)]
        hosts: usize,
        #[arg(long)]
        apps: usize,
        #[arg(long, default_value_t = 20)]
        k: usize,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[command(flatten)]
        solver: SolverArgs,
        /// Iterations each algorithm gets in the cold-start comparison on the final active sets.
        #[arg(long, default_value_t = 300)]
        compare_iters: usize,
        #[arg(long)]
        json: bool,
        /// Per-iteration trace of the comparison (CSV).
        #[arg(long)]
        trace: Option<PathBuf>,
        /// Convergence plot of the comparison (PNG).
        #[arg(long)]
        plot: Option<PathBuf>,
        /// Also write the generated instance as JSON.
        #[arg(long)]
        write_instance: Option<PathBuf>,
        /// Leave the per-host allocation out of the JSON (large instances).
        #[arg(long)]
        no_hosts: bool,
        /// Also run the comparison with each host's update lost with probability P per
        /// iteration, the coordinator reusing the host's last one; reports the final error.
        #[arg(long, value_name = "P")]
        drop: Option<f64>,
        /// Seed of the pattern of lost updates.
        #[arg(long, default_value_t = 1)]
        drop_seed: u64,
    },
    /// Run the control-plane service: Allreduce and price update for the agents over QUIC.
    Serve {
        /// TOML configuration (docs/control-plane.md).
        #[arg(long)]
        config: PathBuf,
        /// Serve only shard I of N: the facilities whose id hashes to I (FNV-1a mod N).
        /// Shards share nothing; agents list every shard's address.
        #[arg(long, value_name = "I/N")]
        shard: Option<drum_common::protocol::Shard>,
    },
    /// Run a relay for one rack: its agents connect to it as to a coordinator, and it is one
    /// member of the coordinator with the rack's sums (docs/control-plane.md, "Relays").
    Relay {
        /// TOML configuration (docs/control-plane.md, "Relays").
        #[arg(long)]
        config: PathBuf,
    },
    /// Create a throw-away CA and certificates for a test cluster; or, with `--revoke` or
    /// `--reissue`, revoke or replace a host's certificate of the CA already in `--out`.
    DevCerts {
        #[arg(long)]
        out: PathBuf,
        /// Names and addresses the coordinator's certificate is valid for.
        #[arg(long, value_delimiter = ',', default_value = "localhost,127.0.0.1")]
        san: Vec<String>,
        /// Agent names; one client certificate `agent-NAME.pem` each.
        #[arg(long, value_delimiter = ',', default_value = "agent")]
        agents: Vec<String>,
        /// Relay names; each gets `agent-NAME.pem` (upstream, a client certificate naming
        /// NAME) and `relay-NAME.pem` (downstream, a server certificate for `--san` and NAME).
        #[arg(long, value_delimiter = ',')]
        relays: Vec<String>,
        /// Add the current certificate of host HOST (`agent-HOST.pem`) to the CA's
        /// `crl.pem`; daemons with `tls.crl` refuse it after a reload (SIGHUP).
        #[arg(long, value_name = "HOST", conflicts_with_all = ["reissue", "san", "agents", "relays"])]
        revoke: Option<String>,
        /// Add the coordinator's current certificate (`coordinator.pem`) to `crl.pem`;
        /// agents with `tls.crl` leave it after a reload (SIGHUP).
        #[arg(long, conflicts_with_all = ["revoke", "reissue", "san", "agents"])]
        revoke_coordinator: bool,
        /// With `--revoke` or `--revoke-coordinator`: days until the new CRL's next update.
        /// Daemons refuse a CRL past it, and every peer it would vouch for, until a fresh one
        /// is installed.
        #[arg(long, value_name = "DAYS")]
        crl_days: Option<u32>,
        /// Issue host HOST a new key and certificate (`agent-HOST.pem/.key`), e.g. after a
        /// revocation; its agent uses them after a reload (SIGHUP).
        #[arg(long, value_name = "HOST", conflicts_with_all = ["san", "agents"])]
        reissue: Option<String>,
        /// Issue the coordinator a new key and certificate (`coordinator.pem/.key`, valid for
        /// `--san`), e.g. after `--revoke-coordinator`; it uses them after a reload (SIGHUP).
        #[arg(long, conflicts_with_all = ["revoke", "reissue", "revoke_coordinator", "agents"])]
        reissue_coordinator: bool,
    },
    /// Show a running coordinator's members, facilities, iteration, residuals and prices.
    Status {
        /// The coordinator's admin endpoint (`admin_listen` in its config).
        #[arg(long, default_value = "127.0.0.1:9464")]
        admin: std::net::SocketAddr,
        #[arg(long)]
        json: bool,
    },
    /// Write the live problem (hosts, apps with their measured values, facilities, weights,
    /// k) as an instance file, which `solve` takes (docs/live-problem.md).
    Snapshot {
        /// Where to write the instance (JSON).
        #[arg(long)]
        out: PathBuf,
        #[arg(long, default_value = "127.0.0.1:9464")]
        admin: std::net::SocketAddr,
    },
    /// Take a host out of the optimisation (its agent keeps its last rates) until `undrain-host`.
    DrainHost {
        host: String,
        /// The coordinator's admin socket (`admin_socket` in its config): operator commands
        /// go there only, its file permissions decide who may send them.
        #[arg(long, default_value = DEFAULT_ADMIN_SOCKET)]
        socket: PathBuf,
    },
    /// Let a drained host join again.
    UndrainHost {
        host: String,
        /// The coordinator's admin socket (`admin_socket` in its config): operator commands
        /// go there only, its file permissions decide who may send them.
        #[arg(long, default_value = DEFAULT_ADMIN_SOCKET)]
        socket: PathBuf,
    },
    /// Change an app's weight on every host (finite, > 0; the app must exist).
    SetWeight {
        app: String,
        weight: f64,
        /// The coordinator's admin socket (`admin_socket` in its config): operator commands
        /// go there only, its file permissions decide who may send them.
        #[arg(long, default_value = DEFAULT_ADMIN_SOCKET)]
        socket: PathBuf,
    },
    /// Change a facility's capacity on a running coordinator.
    SetCapacity {
        facility: String,
        capacity: f64,
        /// The coordinator's admin socket (`admin_socket` in its config): operator commands
        /// go there only, its file permissions decide who may send them.
        #[arg(long, default_value = DEFAULT_ADMIN_SOCKET)]
        socket: PathBuf,
    },
}

fn options(args: &SolverArgs, algorithm: Algorithm) -> Result<SolveOptions> {
    if let Some(rho) = args.rho {
        if !(rho.is_finite() && rho > 0.0) {
            bail!("--rho must be a positive finite number, got {rho}");
        }
    }
    if args.max_iter == 0 {
        bail!("--max-iter must be at least 1");
    }
    if !(args.eps.is_finite() && args.eps >= 0.0) {
        bail!("--eps must be finite and non-negative, got {}", args.eps);
    }
    let mut opts = SolveOptions {
        algorithm,
        rho: args.rho,
        max_iter: args.max_iter,
        rounds: args.rounds,
        iters_per_round: args.iters_per_round,
        eps_primal: args.eps,
        eps_dual: args.eps,
        polish_trials: args.polish_trials,
        certificate_iters: args.certificate_iters,
        certificate_sweeps: args.certificate_sweeps,
        ..SolveOptions::default()
    };
    opts.selection.seed = args.selection_seed;
    Ok(opts)
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("drum-coordinator: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Solve {
            instance,
            algorithm,
            solver,
            json,
        } => {
            let text = std::fs::read_to_string(&instance)
                .with_context(|| format!("reading {}", instance.display()))?;
            let problem = Instance::from_json(&text)
                .and_then(Instance::into_problem)
                .with_context(|| format!("in {}", instance.display()))?;
            let algorithm = match algorithm {
                AlgorithmArg::Admm => Algorithm::Admm,
                AlgorithmArg::Dual => Algorithm::Dual(DualStep::Normalised {
                    eta: simulate::DUAL_ETA,
                    price_ref: price_reference(&problem),
                }),
            };
            let opts = options(&solver, algorithm)?;
            let rho = matches!(algorithm, Algorithm::Admm)
                .then(|| solver.rho.unwrap_or_else(|| default_rho(&problem)));
            let t = Instant::now();
            let solution = solve(&problem, &SolveOptions { rho, ..opts });
            let report = SolutionReport::new(
                &problem,
                &solution,
                t.elapsed().as_secs_f64() * 1e3,
                rho,
                true,
            );
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.summary());
            }
        }
        Command::Simulate {
            hosts,
            apps,
            k,
            seed,
            solver,
            compare_iters,
            json,
            trace,
            plot,
            write_instance,
            no_hosts,
            drop,
            drop_seed,
        } => {
            if hosts == 0 || apps == 0 || k == 0 {
                bail!("--hosts, --apps and --k must be at least 1");
            }
            if drop.is_some_and(|p| !(0.0..=1.0).contains(&p)) {
                bail!("--drop is a probability, from 0 to 1");
            }
            let pairs = hosts.checked_mul(apps).filter(|p| *p <= 200_000_000);
            if pairs.is_none() {
                bail!("--hosts × --apps = {hosts} × {apps} is more than the 200 million pairs this command holds in memory");
            }
            let cfg = GeneratorConfig {
                k,
                seed,
                ..GeneratorConfig::new(hosts, apps)
            };
            let opts = options(&solver, Algorithm::Admm)?;
            let loss = drop.map(|probability| Loss {
                probability,
                seed: drop_seed,
            });
            let sim = simulate::run(&cfg, &opts, compare_iters.max(1), loss);
            if let Some(path) = &write_instance {
                std::fs::write(path, Instance::from_problem(&sim.problem).to_json())
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(path) = &trace {
                write_trace(path, &sim)?;
            }
            if let Some(path) = &plot {
                let mut series: Vec<(String, &[TraceRow])> = vec![
                    ("ADMM".into(), &sim.admm_trace),
                    (
                        "dual decomposition (normalised step)".into(),
                        &sim.dual_trace,
                    ),
                    (
                        "dual decomposition (paper's 1e-3/sqrt(k))".into(),
                        &sim.paper_trace,
                    ),
                    ("NUMFabric xWI".into(), &sim.xwi_trace),
                ];
                if let (Some(p), Some(traces)) = (drop, &sim.drop_traces) {
                    for (name, trace) in ["ADMM", "dual (normalised)", "xWI"].iter().zip(traces) {
                        series.push((format!("{name}, {:.0}% of updates lost", 100.0 * p), trace));
                    }
                }
                let series: Vec<(&str, &[TraceRow])> =
                    series.iter().map(|(n, t)| (n.as_str(), *t)).collect();
                plot::convergence_png(
                    path,
                    &format!("n = {hosts} hosts, m = {apps} apps, k = {k}: fixed final active sets, cold start"),
                    sim.comparison.reference_objective,
                    &series,
                )?;
            }
            let report = SimulateReport {
                hosts,
                apps,
                k,
                seed,
                pairs: hosts * apps,
                generate_ms: sim.generate_ms,
                peak_rss_mib: peak_rss_mib(),
                admm: SolutionReport::new(
                    &sim.problem,
                    &sim.solution,
                    sim.solve_ms,
                    Some(sim.rho),
                    !no_hosts,
                ),
                comparison: sim.comparison,
            };
            if json {
                println!("{}", serde_json::to_string_pretty(&report)?);
            } else {
                print!("{}", report.summary());
            }
        }
        Command::Serve { config, shard } => serve(&config, shard)?,
        Command::Relay { config } => relay(&config)?,
        Command::DevCerts {
            out,
            san,
            agents,
            relays,
            revoke,
            revoke_coordinator,
            crl_days,
            reissue,
            reissue_coordinator,
        } => {
            for a in agents.iter().chain(&relays).chain(&revoke).chain(&reissue) {
                if a.is_empty()
                    || !a
                        .chars()
                        .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c))
                {
                    bail!("agent name {a:?} may only hold letters, digits, '-', '_' and '.'");
                }
            }
            if crl_days.is_some() && revoke.is_none() && !revoke_coordinator {
                bail!("--crl-days applies to --revoke and --revoke-coordinator");
            }
            let crl_days = crl_days.unwrap_or(drum_coordinator::dev_ca::CRL_DAYS);
            if revoke_coordinator {
                let crl = drum_coordinator::dev_ca::DevCa::open(&out)?
                    .with_crl_days(crl_days)
                    .revoke("coordinator")?;
                println!("revoked the coordinator's certificate: {}", crl.display());
                return Ok(());
            }
            if let Some(host) = revoke {
                let crl = drum_coordinator::dev_ca::DevCa::open(&out)?
                    .with_crl_days(crl_days)
                    .revoke_agent(&host)?;
                println!("revoked agent {host}: {}", crl.display());
                return Ok(());
            }
            if let Some(host) = reissue {
                let f = drum_coordinator::dev_ca::DevCa::open(&out)?.issue_agent(&host)?;
                println!("agent {host}: {} {}", f.cert.display(), f.key.display());
                return Ok(());
            }
            if reissue_coordinator {
                let f = drum_coordinator::dev_ca::DevCa::open(&out)?.issue(
                    "coordinator",
                    san,
                    rcgen::ExtendedKeyUsagePurpose::ServerAuth,
                )?;
                println!("coordinator: {} {}", f.cert.display(), f.key.display());
                return Ok(());
            }
            // A second CA in the same place would replace the first and wipe its CRL: every
            // certificate it issued would stop working, revoked ones would be trusted again.
            if out.join("ca.key").exists() {
                bail!(
                    "{} already holds a dev CA (ca.key): creating another would replace it and wipe its CRL. \
                     Use --reissue HOST (also for a new host), --reissue-coordinator, --revoke, or another directory",
                    out.display()
                );
            }
            let certs = drum_coordinator::dev_ca::dev_certs(&out, &san, &agents)?;
            println!("CA: {}", certs.ca.display());
            println!("CRL (empty): {}", out.join("crl.pem").display());
            println!(
                "coordinator: {} {}",
                certs.coordinator.cert.display(),
                certs.coordinator.key.display()
            );
            for (name, f) in &certs.agents {
                println!("agent {name}: {} {}", f.cert.display(), f.key.display());
            }
            for name in &relays {
                let ca = drum_coordinator::dev_ca::DevCa::open(&out)?;
                let (up, down) = drum_coordinator::dev_ca::issue_relay(&ca, name, &san)?;
                println!(
                    "relay {name}: upstream {} {}, downstream {} {}",
                    up.cert.display(),
                    up.key.display(),
                    down.cert.display(),
                    down.key.display()
                );
            }
            println!("DASR key: {}", certs.dasr_key.display());
        }
        Command::Status { admin, json } => {
            let body = admin_call(admin, "GET", "/status")?;
            if json {
                print!("{body}");
            } else {
                print!("{}", status_table(&body)?);
            }
        }
        Command::Snapshot { out, admin } => {
            let body = admin_call(admin, "GET", "/snapshot")?;
            // What is written must be what `solve` reads.
            Instance::from_json(&body)
                .and_then(Instance::into_problem)
                .context("the coordinator's snapshot is not a valid instance")?;
            std::fs::write(&out, body).with_context(|| format!("writing {}", out.display()))?;
            println!("live problem written to {}", out.display());
        }
        Command::SetCapacity {
            facility,
            capacity,
            socket,
        } => {
            let target = format!(
                "/set-capacity?facility={}&value={capacity}",
                drum_coordinator::admin::percent_encode(&facility)
            );
            print!("{}", operator_call(&socket, &target)?);
        }
        Command::SetWeight {
            app,
            weight,
            socket,
        } => {
            let target = format!(
                "/set-weight?app={}&value={weight}",
                drum_coordinator::admin::percent_encode(&app)
            );
            print!("{}", operator_call(&socket, &target)?);
        }
        Command::DrainHost { host, socket } => {
            let target = format!(
                "/drain?host={}",
                drum_coordinator::admin::percent_encode(&host)
            );
            print!("{}", operator_call(&socket, &target)?);
        }
        Command::UndrainHost { host, socket } => {
            let target = format!(
                "/undrain?host={}",
                drum_coordinator::admin::percent_encode(&host)
            );
            print!("{}", operator_call(&socket, &target)?);
        }
    }
    std::io::stdout().flush()?;
    Ok(())
}

fn serve(config: &std::path::Path, shard: Option<drum_common::protocol::Shard>) -> Result<()> {
    drum_net::config::init_logging();
    let (settings, mut options) =
        drum_coordinator::server::ServeSettings::load_with_options(config)?;
    if let Some(shard) = shard {
        options.shard = shard;
    }
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    let tls = settings.tls.clone();
    rt.block_on(async {
        let stop = shutdown_signal()?;
        let server = drum_coordinator::server::Server::bind_with(settings, options).await?;
        if let Some(a) = server.admin_addr() {
            tracing::info!(admin = %a, "admin endpoint listening");
        }
        // SIGHUP, or a change of one of the files: read the certificate, key, CA and CRL
        // again, without a restart.
        let reload = server.reloader();
        tls.watch(reload.clone());
        let mut hup = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::hangup())
            .context("installing the SIGHUP handler")?;
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                reload.notify_one();
            }
        });
        server.run(stop).await
    })
}

fn relay(config: &std::path::Path) -> Result<()> {
    drum_net::config::init_logging();
    let settings = drum_coordinator::relay::RelaySettings::load(config)?;
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async {
        let stop = shutdown_signal()?;
        drum_coordinator::relay::run(settings, stop).await
    })
}

/// SIGINT or SIGTERM (systemd's stop), registered now rather than when first polled, so that
/// a stop during the start is not the default action (death with status 143).
fn shutdown_signal() -> Result<impl std::future::Future<Output = ()>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
    let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
    Ok(async move {
        tokio::select! {
            _ = int.recv() => {}
            _ = term.recv() => {}
        }
    })
}

fn admin_call(admin: std::net::SocketAddr, method: &str, target: &str) -> Result<String> {
    let (code, body) = drum_coordinator::admin::request(admin, method, target)
        .with_context(|| format!("asking the coordinator's admin endpoint at {admin}"))?;
    if code != 200 {
        bail!("coordinator answered {code}: {}", body.trim());
    }
    Ok(body)
}

/// Where the deployed coordinator's admin socket is (`RuntimeDirectory=drum-coordinator`).
const DEFAULT_ADMIN_SOCKET: &str = "/run/drum-coordinator/admin.sock";

/// An operator command over the admin socket.
fn operator_call(socket: &std::path::Path, target: &str) -> Result<String> {
    let (code, body) =
        drum_coordinator::admin::request_unix(socket, "POST", target).with_context(|| {
            format!(
                "asking the coordinator's admin socket {} (admin_socket in its config)",
                socket.display()
            )
        })?;
    if code != 200 {
        bail!("coordinator answered {code}: {}", body.trim());
    }
    Ok(body)
}

/// Who runs a live app, as its host's agent learnt from the kernel: one line, empty when the
/// agent reported nobody (an instance file, or an agent without shims).
fn identities_line(app: &serde_json::Value) -> String {
    let ids = app["identities"].as_array().cloned().unwrap_or_default();
    let more = app["more_identities"].as_u64().unwrap_or(0);
    if ids.is_empty() && more == 0 {
        return String::new();
    }
    let mut parts: Vec<String> = ids
        .iter()
        .map(|i| {
            let n = i["processes"].as_u64().unwrap_or(0);
            format!(
                "uid {} gid {} cgroup {} ({n} process{})",
                i["uid"],
                i["gid"],
                i["cgroup"].as_str().unwrap_or("?"),
                if n == 1 { "" } else { "es" }
            )
        })
        .collect();
    if more > 0 {
        parts.push(format!("{more} more"));
    }
    format!("      identities: {}\n", parts.join("; "))
}

fn status_table(json: &str) -> Result<String> {
    let v: serde_json::Value = serde_json::from_str(json).context("status reply is not JSON")?;
    let num = |v: &serde_json::Value| v.as_f64().unwrap_or(f64::NAN);
    let mut out = format!(
        "shard {}  epoch {}  iteration {}  rho {:.4}  primal residual {:.3e}  dual residual {:.3e}\n",
        v["shard"].as_str().unwrap_or("?"),
        v["epoch"],
        v["iteration"],
        num(&v["rho"]),
        num(&v["primal_residual"]),
        num(&v["dual_residual"])
    );
    let members = v["members"].as_array().cloned().unwrap_or_default();
    out += &format!(
        "hosts ({}):\n  {:<24} {:>8} {:>10} {:>14} {:>6}\n",
        members.len(),
        "host",
        "member",
        "facilities",
        "last iteration",
        "stale"
    );
    for m in &members {
        out += &format!(
            "  {:<24} {:>8} {:>10} {:>14} {:>6}\n",
            m["host"].as_str().unwrap_or("?"),
            // serde_json's Display ignores width; format the text instead.
            m["member"].to_string(),
            m["facilities"].to_string(),
            m["last_iteration"].to_string(),
            m["stale"].to_string()
        );
        // The live problem: the host's apps as its agent reports them.
        for a in m["apps"].as_array().into_iter().flatten() {
            out += &format!(
                "    app {:<20} {:<7} rate {:.6}  weight {}  demand {:.4}  a {:.3}\n",
                a["app"].as_str().unwrap_or("?"),
                if a["active"].as_bool() == Some(true) {
                    "active"
                } else {
                    "parked"
                },
                num(&a["rate"]),
                a["weight"],
                num(&a["demand"]),
                num(&a["cqe_per_wqe"])
            );
            out += &identities_line(a);
        }
    }
    let facilities = v["facilities"].as_array().cloned().unwrap_or_default();
    out += &format!(
        "facilities ({}):\n  {:<24} {:>10} {:>6} {:>12} {:>12}\n",
        facilities.len(),
        "facility",
        "capacity",
        "pairs",
        "usage",
        "price"
    );
    for f in &facilities {
        out += &format!(
            "  {:<24} {:>10.4} {:>6} {:>12.6} {:>12.6}\n",
            f["id"].as_str().unwrap_or("?"),
            num(&f["capacity"]),
            f["pairs"].to_string(),
            num(&f["usage"]),
            num(&f["price"])
        );
    }
    let sel = &v["selection"];
    let after = match sel["period_ms"].as_u64() {
        Some(ms) => format!("then every {ms} ms if something changed, and when apps change"),
        None => "then when apps change".into(),
    };
    out += &format!(
        "selection: {} exchanges done ({} in the schedule, {after}){}; parks {}  activations {}  \
         refused activations {}  re-selection requests {}\n",
        sel["exchanges_done"],
        sel["exchanges_planned"],
        if sel["in_progress"].as_bool() == Some(true) {
            " (one in progress)"
        } else {
            ""
        },
        v["counters"]["parks"],
        v["counters"]["activations"],
        v["counters"]["refused_activations"],
        v["counters"]["reselect_requests"]
    );
    if let Some(d) = v["drained"].as_array().filter(|d| !d.is_empty()) {
        let names: Vec<&str> = d.iter().filter_map(|h| h.as_str()).collect();
        out += &format!("drained: {}\n", names.join(", "));
    }
    if let Some(p) = v["policy"].as_object() {
        let weights: Vec<String> = p["weights"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|w| format!("{}={}", w[0].as_str().unwrap_or("?"), w[1]))
            .collect();
        out += &format!(
            "policy: default weight {}; weights {}\n",
            p["default_weight"],
            if weights.is_empty() {
                "none".into()
            } else {
                weights.join(" ")
            }
        );
    }
    let c = &v["counters"];
    out += &format!(
        "rounds {}  stale reuses {}  late {}  duplicates {}  timeouts {}  refused {}\n",
        c["rounds"], c["stale_reuses"], c["late"], c["duplicates"], c["timeouts"], c["refused"]
    );
    Ok(out)
}

#[derive(Serialize)]
struct SimulateReport {
    hosts: usize,
    apps: usize,
    k: usize,
    seed: u64,
    pairs: usize,
    generate_ms: f64,
    peak_rss_mib: Option<f64>,
    admm: SolutionReport,
    comparison: simulate::Comparison,
}

impl SimulateReport {
    fn summary(&self) -> String {
        let c = &self.comparison;
        let it = |v: Option<usize>| {
            v.map_or(format!("not within {} iterations", c.cap), |n| {
                n.to_string()
            })
        };
        let mut out = format!(
            "instance: {} hosts × {} apps (k = {}, seed {}), generated in {:.0} ms\n",
            self.hosts, self.apps, self.k, self.seed, self.generate_ms
        );
        out += &self.admm.summary();
        out += &format!(
            "cold start on the final active sets, iterations to {}% of the optimum ({:.6}):\n  ADMM {}   dual (normalised step) {}   dual (paper step) {}   xWI {}\n  ms per iteration: ADMM {:.2}, dual {:.2}, xWI {:.2}\n",
            100.0 * c.accuracy,
            c.reference_objective,
            it(c.admm_iterations),
            it(c.dual_iterations),
            it(c.dual_paper_step_iterations),
            it(c.xwi_iterations),
            c.admm_ms_per_iteration,
            c.dual_ms_per_iteration,
            c.xwi_ms_per_iteration
        );
        if let Some(d) = &c.drop {
            out += &format!(
                "with {}% of host updates lost (seed {}), after {} iterations:\n",
                100.0 * d.probability,
                d.seed,
                d.iterations
            );
            for (name, r) in [("ADMM", &d.admm), ("dual", &d.dual), ("xWI", &d.xwi)] {
                out += &format!(
                    "  {name}: final error {:.4}%, iterations to {}%: {}, {} updates lost\n",
                    100.0 * r.final_error,
                    100.0 * c.accuracy,
                    it(r.iterations_to_accuracy),
                    r.lost
                );
            }
        }
        if let Some(m) = self.peak_rss_mib {
            out += &format!("peak memory: {m:.0} MiB\n");
        }
        out
    }
}

fn write_trace(path: &std::path::Path, sim: &simulate::Simulation) -> Result<()> {
    let mut out = String::from("algorithm,iteration,objective,primal_residual,dual_residual\n");
    let mut traces = vec![
        ("admm", &sim.admm_trace),
        ("dual", &sim.dual_trace),
        ("dual-paper-step", &sim.paper_trace),
        ("xwi", &sim.xwi_trace),
    ];
    if let Some([admm, dual, xwi]) = &sim.drop_traces {
        traces.extend([("admm-drop", admm), ("dual-drop", dual), ("xwi-drop", xwi)]);
    }
    for (name, trace) in traces {
        for t in trace {
            out += &format!(
                "{name},{},{},{},{}\n",
                t.iteration, t.objective, t.primal_residual, t.dual_residual
            );
        }
    }
    std::fs::write(path, out).with_context(|| format!("writing {}", path.display()))
}

/// Peak resident memory of this process (Linux `VmHWM`).
fn peak_rss_mib() -> Option<f64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: f64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib / 1024.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_status_table_names_who_runs_each_live_app() {
        let app = |ids: &str, more: u32| {
            format!(
                r#"{{"app":"kv","active":true,"rate":0.5,"weight":1.0,"demand":1.0,"cqe_per_wqe":1.0,"identities":{ids},"more_identities":{more}}}"#
            )
        };
        let one = r#"[{"uid":1001,"gid":100,"cgroup":"/kv.slice","processes":2},{"uid":0,"gid":0,"cgroup":"/","processes":1}]"#;
        let line = identities_line(&serde_json::from_str(&app(one, 3)).unwrap());
        assert_eq!(
            line,
            "      identities: uid 1001 gid 100 cgroup /kv.slice (2 processes); uid 0 gid 0 cgroup / (1 process); 3 more\n"
        );
        assert_eq!(
            identities_line(&serde_json::from_str(&app("[]", 0)).unwrap()),
            ""
        );
    }
}
