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
    #[arg(long, required_unless_present = "local", conflicts_with = "local")]
    config: Option<PathBuf>,
    /// Run without a cluster: only the shim link, with the grants of this TOML file
    /// (docs/shim.md, "The agent link").
    #[arg(long)]
    local: Option<PathBuf>,
}

fn main() {
    if let Err(e) = run(Cli::parse()) {
        eprintln!("drum-agent: {e:#}");
        std::process::exit(1);
    }
}

fn run(cli: Cli) -> Result<()> {
    drum_net::config::init_logging();
    if let Some(path) = cli.local {
        return run_local(&path);
    }
    let config = cli.config.expect("clap requires --config without --local");
    let (settings, options) = drum_agent::AgentSettings::load_with_options(&config)?;
    let instance = match &settings.instance {
        Some(path) => {
            let problem = drum_net::config::load_problem(path)?;
            let (host, active) = drum_agent::host_and_active(&problem, &settings.host)?;
            Some((problem, host, active))
        }
        None => None,
    };
    let rt = tokio::runtime::Runtime::new().context("starting the async runtime")?;
    rt.block_on(async {
        use tokio::signal::unix::{signal, SignalKind};
        // SIGHUP, or a change of one of the files: read the certificate, key, CA and CRL
        // again, without a restart.
        let reload = Arc::new(tokio::sync::Notify::new());
        settings.tls.watch(reload.clone());
        let mut hup = signal(SignalKind::hangup()).context("installing the SIGHUP handler")?;
        let notify = reload.clone();
        tokio::spawn(async move {
            while hup.recv().await.is_some() {
                notify.notify_one();
            }
        });
        // Registered now, not when `stop` is first polled (after the TLS files and the shim
        // link are set up): a SIGTERM meanwhile killed the agent with status 143, no Leave
        // and no `agent stopped`.
        let mut term = signal(SignalKind::terminate()).context("installing the SIGTERM handler")?;
        let mut int = signal(SignalKind::interrupt()).context("installing the SIGINT handler")?;
        let stop = async move {
            tokio::select! {
                _ = int.recv() => {}
                _ = term.recv() => {}
            }
        };
        match instance {
            Some((problem, host, active)) => {
                drum_agent::run_with_reload(
                    settings,
                    options,
                    Arc::new(problem),
                    host,
                    active,
                    stop,
                    reload,
                )
                .await
            }
            None => drum_agent::run_live(settings, options, stop, reload).await,
        }
    })
}

/// `--local`: the shim hub alone, until SIGINT or SIGTERM.
fn run_local(path: &std::path::Path) -> Result<()> {
    use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
    static STOP: AtomicBool = AtomicBool::new(false);
    extern "C" fn on_signal(_: libc::c_int) {
        STOP.store(true, Relaxed);
    }
    let settings = drum_agent::local::LocalSettings::load(path)?;
    // SAFETY: installs a handler that only stores to an atomic (async-signal-safe).
    unsafe {
        libc::signal(libc::SIGINT, on_signal as *const () as libc::sighandler_t);
        libc::signal(libc::SIGTERM, on_signal as *const () as libc::sighandler_t);
    }
    drum_agent::local::run(settings, || STOP.load(Relaxed))
}
