//! `drum-testbed`: DRUM's testbed on one machine. `cluster` brings up a DRUM cluster of
//! emulated hosts (softrnic), a coordinator and one agent per host, and runs unmodified RDMA
//! programs on it under the shim; `run`, `report` and `check` reproduce the DRUM paper's
//! experiments (docs/testbed.md).

mod arrival;
mod chaos;
mod cluster;
mod configs;
mod convergence;
mod daemons;
mod fonts;
mod host_cpu;
mod meta;
mod plot;
mod profile;
mod programs;
mod record;
mod report;
mod runner;
mod sampler;
mod scenarios;
mod stats;
mod summary;

use anyhow::Result;
use clap::{Parser, Subcommand};
use cluster::Cluster;
use profile::Profile;
use scenarios::Mode;
use std::path::PathBuf;

#[derive(Parser)]
#[command(name = "drum-testbed", version, about)]
struct Cli {
    /// State directory of the cluster (default: $DRUM_TESTBED_DIR, else /run/drum-testbed).
    #[arg(long, global = true)]
    dir: Option<PathBuf>,
    #[command(subcommand)]
    command: Top,
}

#[derive(Subcommand)]
enum Top {
    /// A DRUM cluster of emulated hosts on this machine.
    #[command(subcommand)]
    Cluster(ClusterCmd),
    /// Every scenario and the paper's figure it reproduces.
    List,
    /// Run scenarios in RAW, SHARE and DRUM modes; resumes into an existing --out.
    Run {
        /// Scenarios (see `list`); `all` for every one.
        #[arg(required = true)]
        scenarios: Vec<String>,
        #[arg(long, value_delimiter = ',', default_value = "raw,share,drum")]
        modes: Vec<Mode>,
        #[arg(long, value_enum, default_value = "quick")]
        profile: Profile,
        /// Repeats of every point (default: the profile's).
        #[arg(long)]
        repeats: Option<u32>,
        #[arg(long, default_value_t = 1)]
        seed: u64,
        #[arg(long, default_value = "out/testbed")]
        out: PathBuf,
    },
    /// A fault soak: a cluster with applications under the shim while daemons are killed,
    /// stopped and restarted, links flap and rate-table writes fail; exits non-zero naming
    /// the first broken invariant (docs/chaos.md).
    Chaos {
        /// How long faults are injected (reconvergence is measured after).
        #[arg(long)]
        minutes: f64,
        /// Seed of the fault schedule: the same seed, the same faults.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Write the figures (faults, reconvergence, stalls) to this JSON file.
        #[arg(long)]
        json: Option<PathBuf>,
    },
    /// Rebuild every output of DIR (CSV, plots, report.html) from its raw runs.
    Report { dir: PathBuf },
    /// Print every criterion with the measured and the paper's value; fail if one fails.
    Check { dir: PathBuf },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Bring up N emulated hosts, a coordinator (on h1) and an agent on every host.
    Up {
        #[arg(long)]
        hosts: usize,
        /// The emulated NICs' line rate, which the agents report.
        #[arg(long, default_value_t = 25.0)]
        line_rate_gbps: f64,
        /// Further options for `softrnic up` (e.g. --loss 0.01 --qp-cache 20).
        #[arg(trailing_var_arg = true, allow_hyphen_values = true)]
        softrnic: Vec<String>,
    },
    /// Run CMD on host H under the shim as app NAME.
    Exec {
        #[arg(long)]
        host: String,
        #[arg(long)]
        app: String,
        #[arg(last = true, required = true)]
        cmd: Vec<String>,
    },
    /// Print host H's address.
    Addr { host: String },
    /// The coordinator's view: members, apps with their rates and active flags, facilities.
    Status {
        #[arg(long)]
        json: bool,
    },
    /// Stop every process of the cluster and remove its hosts and state.
    Down,
    /// Write the live problem as an instance file (`drum-coordinator snapshot`).
    Snapshot {
        #[arg(long)]
        out: PathBuf,
    },
    /// Kill a daemon at once, as a crash would: `coordinator` or a host's agent (`h2`).
    Kill { daemon: String },
    /// Start a daemon that is not running: `coordinator` or a host's agent (`h2`).
    Start { daemon: String },
    /// Cut a host's agent off from the coordinator (`cut`; its NIC's traffic flows on), or
    /// heal it (`heal`).
    Partition {
        host: String,
        #[arg(value_parser = ["cut", "heal"])]
        action: String,
    },
}

fn daemon(name: &str) -> cluster::Daemon {
    match name {
        "coordinator" => cluster::Daemon::Coordinator,
        h => cluster::Daemon::Agent(h.to_string()),
    }
}

fn main() {
    let cli = Cli::parse();
    if let Err(e) = run(cli) {
        eprintln!("drum-testbed: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let dir = cli
        .dir
        .or_else(|| std::env::var_os("DRUM_TESTBED_DIR").map(PathBuf::from))
        .unwrap_or_else(|| PathBuf::from("/run/drum-testbed"));
    let cluster = Cluster::new(&dir)?;
    match cli.command {
        Top::Cluster(c) => match c {
            ClusterCmd::Up {
                hosts,
                line_rate_gbps,
                softrnic,
            } => cluster.up(hosts, line_rate_gbps, &softrnic),
            ClusterCmd::Exec { host, app, cmd } => cluster.exec(&host, &app, &cmd),
            ClusterCmd::Addr { host } => {
                println!("{}", cluster.addr(&host)?);
                Ok(())
            }
            ClusterCmd::Status { json } => cluster.status(json),
            ClusterCmd::Down => cluster.down(),
            ClusterCmd::Snapshot { out } => cluster.snapshot(&out),
            ClusterCmd::Kill { daemon: d } => cluster.kill(&daemon(&d)),
            ClusterCmd::Start { daemon: d } => cluster.start(&daemon(&d)),
            ClusterCmd::Partition { host, action } => cluster.partition(&host, action == "cut"),
        },
        Top::List => {
            for s in scenarios::all() {
                println!("{:<10} {:<16} {}", s.name, s.figure, s.title);
            }
            Ok(())
        }
        Top::Run {
            scenarios: names,
            modes,
            profile,
            repeats,
            seed,
            out,
        } => {
            let names = if names.iter().any(|n| n == "all") {
                scenarios::all()
                    .iter()
                    .map(|s| s.name.to_string())
                    .collect()
            } else {
                names
            };
            runner::run(&runner::RunOptions {
                scenarios: names,
                modes,
                profile,
                repeats,
                seed,
                out,
            })
        }
        Top::Chaos {
            minutes,
            seed,
            json,
        } => chaos::run(
            &dir,
            &chaos::ChaosOptions {
                minutes,
                seed,
                json,
            },
        ),
        Top::Report { dir } => report::build(&dir),
        Top::Check { dir } => report::check(&dir),
    }
}
