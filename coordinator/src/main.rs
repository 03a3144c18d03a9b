//! drum-coordinator: offline `solve` and `simulate` (this crate will also carry the service).

mod plot;
mod report;
mod simulate;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use drum_common::dual::DualStep;
use drum_common::generator::GeneratorConfig;
use drum_common::instance::Instance;
use drum_common::solver::{default_rho, price_reference, solve, Algorithm, SolveOptions};
use report::SolutionReport;
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "drum-coordinator",
    version,
    about = "DRUM coordinator: solve and simulate the NUM problem"
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
    /// Generate an instance like the DRUM paper's simulation and solve it with ADMM and the
    /// dual-decomposition baseline.
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
    let mut opts = SolveOptions {
        algorithm,
        rho: args.rho,
        max_iter: args.max_iter,
        rounds: args.rounds,
        iters_per_round: args.iters_per_round,
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
        } => {
            if hosts == 0 || apps == 0 || k == 0 {
                bail!("--hosts, --apps and --k must be at least 1");
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
            let sim = simulate::run(&cfg, &opts, compare_iters.max(1));
            if let Some(path) = &write_instance {
                std::fs::write(path, Instance::from_problem(&sim.problem).to_json())
                    .with_context(|| format!("writing {}", path.display()))?;
            }
            if let Some(path) = &trace {
                write_trace(path, &sim)?;
            }
            if let Some(path) = &plot {
                plot::convergence_png(
                    path,
                    &format!("n = {hosts} hosts, m = {apps} apps, k = {k}: fixed final active sets, cold start"),
                    sim.comparison.reference_objective,
                    &[
                        ("ADMM", &sim.admm_trace),
                        ("dual decomposition (normalised step)", &sim.dual_trace),
                        ("dual decomposition (paper's 1e-3/sqrt(k))", &sim.paper_trace),
                    ],
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
    }
    std::io::stdout().flush()?;
    Ok(())
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
            "cold start on the final active sets, iterations to {}% of the optimum ({:.6}):\n  ADMM {}   dual (normalised step) {}   dual (paper step) {}\n  ms per iteration: ADMM {:.2}, dual {:.2}\n",
            100.0 * c.accuracy,
            c.reference_objective,
            it(c.admm_iterations),
            it(c.dual_iterations),
            it(c.dual_paper_step_iterations),
            c.admm_ms_per_iteration,
            c.dual_ms_per_iteration
        );
        if let Some(m) = self.peak_rss_mib {
            out += &format!("peak memory: {m:.0} MiB\n");
        }
        out
    }
}

fn write_trace(path: &std::path::Path, sim: &simulate::Simulation) -> Result<()> {
    let mut out = String::from("algorithm,iteration,objective,primal_residual,dual_residual\n");
    for (name, trace) in [
        ("admm", &sim.admm_trace),
        ("dual", &sim.dual_trace),
        ("dual-paper-step", &sim.paper_trace),
    ] {
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
