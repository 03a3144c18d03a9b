//! drum-agent: the per-host control-plane daemon (docs/control-plane.md).

use anyhow::{Context, Result};
use clap::Parser;
use std::path::PathBuf;
use std::sync::Arc;

#[derive(Parser)]
#[command(
    name = "drum-agent",
    version,
    about = "DRUM agent: the host's part of the optimiser"
)]
struct Cli {
    /// TOML configuration (docs/control-plane.md).
    #[arg(long)]
    config: PathBuf,
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("drum-agent: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("DRUM_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .init();
    let settings = drum_agent::AgentSettings::load(&cli.config)?;
    let problem = drum_coordinator::server::load_problem(&settings.instance)?;
    let (host, active) = drum_agent::host_and_active(&problem, &settings.host)?;
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(drum_agent::run(
        settings,
        Arc::new(problem),
        host,
        active,
        async {
            use tokio::signal::unix::{signal, SignalKind};
            let mut term = signal(SignalKind::terminate()).expect("SIGTERM handler");
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                _ = term.recv() => {}
            }
        },
    ))
}
