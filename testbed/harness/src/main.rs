//! `drum-testbed`: DRUM's testbed on one machine. `cluster` brings up a DRUM cluster of
//! emulated hosts (softrnic), a coordinator and one agent per host, and runs unmodified RDMA
//! programs on it under the shim (docs/testbed.md).

mod cluster;
mod configs;
mod daemons;

use anyhow::Result;
use clap::{Parser, Subcommand};
use cluster::Cluster;
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
        },
    }
}
