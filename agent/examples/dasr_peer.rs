//! One DASR service (receiver and sender roles) from the command line; prints its address, cap
//! changes and counter changes as JSON lines with wall-clock timestamps (`t_us`, µs since the
//! Unix epoch, comparable across processes on one machine). docs/dasr.md shows a session.
//!
//! ```sh
//! cargo run --release -p drum-agent --example dasr_peer -- --rate 1000            # receiver
//! cargo run --release -p drum-agent --example dasr_peer -- --send-to 127.0.0.1:PORT  # sender
//! ```
//!
//! As a sender it announces one long message to `--send-to` at start; the message ends after
//! `--duration-ms`, or when stdin closes. Closing stdin also ends the program (after
//! `--linger-ms`, so the END is acknowledged); so do `--run-ms` and Ctrl-C.
//! agent/tests/dasr.rs runs this very code as real processes.

use anyhow::{Context, Result};
use clap::Parser;
use drum_agent::dasr::{CapMap, DasrConfig, DasrService};
use serde_json::{json, Value};
use std::io::Write;
use std::net::SocketAddr;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

#[derive(Parser, Debug)]
#[command(about = "Run one DASR service; print cap changes as JSON lines")]
pub struct Args {
    /// UDP address to listen on.
    #[arg(long, default_value = "127.0.0.1:0")]
    listen: SocketAddr,
    /// R, the receive rate apportioned among senders (unit of your choice; 1.0 = line rate).
    #[arg(long, default_value_t = 1.0)]
    rate: f64,
    #[arg(long, default_value_t = 2000)]
    expiry_ms: u64,
    #[arg(long, default_value_t = 10)]
    ack_timeout_ms: u64,
    #[arg(long, default_value_t = 5)]
    retries: u32,
    /// Default: expiry / 4.
    #[arg(long)]
    refresh_ms: Option<u64>,
    #[arg(long)]
    host_id: Option<u64>,
    /// ω of this host as a sender.
    #[arg(long, default_value_t = 1.0)]
    weight: f64,
    /// The cluster's DASR key (`[dasr] key_file`): authenticated datagrams (docs/dasr.md).
    #[arg(long)]
    key_file: Option<std::path::PathBuf>,
    /// Announce a long message to the DASR service at this address.
    #[arg(long)]
    send_to: Option<SocketAddr>,
    #[arg(long, default_value_t = 1)]
    msg_id: u64,
    /// End the message after this long (default: when stdin closes).
    #[arg(long)]
    duration_ms: Option<u64>,
    /// After stdin closes, keep running this long (so the END is acknowledged).
    #[arg(long, default_value_t = 200)]
    linger_ms: u64,
    /// Exit after this long.
    #[arg(long)]
    run_ms: Option<u64>,
    /// Do not watch stdin (run until --run-ms or Ctrl-C).
    #[arg(long)]
    no_stdin: bool,
}

fn main() -> Result<()> {
    run(
        std::env::args().skip(1).collect(),
        Box::new(std::io::stdout()),
    )
}

fn t_us() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_micros() as u64)
        .unwrap_or(0)
}

struct Out(Box<dyn Write + Send>);

impl Out {
    fn emit(&mut self, event: &str, mut fields: Value) {
        let obj = fields.as_object_mut().expect("fields are an object");
        obj.insert("t_us".into(), json!(t_us()));
        obj.insert("event".into(), json!(event));
        let _ = writeln!(self.0, "{fields}");
        let _ = self.0.flush();
    }
}

/// Runs the peer with `args` (without the program name), writing JSON lines to `out`.
pub fn run(args: Vec<String>, out: Box<dyn Write + Send>) -> Result<()> {
    let args = Args::try_parse_from(std::iter::once("dasr_peer".to_string()).chain(args))?;
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("starting the runtime")?
        .block_on(peer(args, Out(out)))
}

async fn peer(args: Args, mut out: Out) -> Result<()> {
    let cfg = DasrConfig {
        receiver_rate: args.rate,
        expiry_ms: args.expiry_ms,
        ack_timeout_ms: args.ack_timeout_ms,
        retries: args.retries,
        refresh_ms: args.refresh_ms,
        host_id: args.host_id,
        weight: args.weight,
        key_file: args.key_file,
        ..DasrConfig::new(args.listen)
    };
    let svc = DasrService::bind(cfg).await?;
    out.emit(
        "listening",
        json!({"addr": svc.local_addr().to_string(), "host_id": svc.host_id()}),
    );
    let (eof_tx, mut eof_rx) = tokio::sync::mpsc::unbounded_channel::<()>();
    if !args.no_stdin {
        std::thread::spawn(move || {
            let _ = std::io::copy(&mut std::io::stdin().lock(), &mut std::io::sink());
            let _ = eof_tx.send(());
        });
    } else {
        std::mem::forget(eof_tx); // never closes
    }
    let mut caps = svc.caps();
    let mut shown = CapMap::new();
    let metrics = svc.metrics();
    let mut last_counters = metrics.snapshot();
    let mut poll = tokio::time::interval(Duration::from_millis(50));
    let far = Duration::from_secs(365 * 24 * 3600);
    let start = tokio::time::Instant::now();
    let mut sending = args.send_to;
    if let Some(dest) = sending {
        out.emit(
            "start",
            json!({"dest": dest.to_string(), "msg_id": args.msg_id}),
        );
        svc.message_started(dest, args.msg_id);
    }
    let end_at = start + args.duration_ms.map_or(far, Duration::from_millis);
    let mut exit_at = start + args.run_ms.map_or(far, Duration::from_millis);
    let ctrl_c = tokio::signal::ctrl_c();
    tokio::pin!(ctrl_c);
    let mut stdin_open = true;
    loop {
        tokio::select! {
            r = caps.changed() => {
                if r.is_err() {
                    break;
                }
                let now = caps.borrow_and_update().clone();
                for (dest, v) in &now {
                    if shown.get(dest) != Some(v) {
                        out.emit("cap", json!({"dest": dest.to_string(), "n": v.n, "omega": v.omega,
                            "epoch": v.epoch, "cap": v.cap}));
                    }
                }
                for dest in shown.keys().filter(|d| !now.contains_key(d)) {
                    out.emit("cap", json!({"dest": dest.to_string(), "n": null, "omega": null,
                        "epoch": null, "cap": null}));
                }
                shown = now;
            }
            _ = poll.tick() => {
                let c = metrics.snapshot();
                if c != last_counters {
                    out.emit("metrics", serde_json::to_value(&c)?);
                    last_counters = c;
                }
            }
            _ = tokio::time::sleep_until(end_at), if sending.is_some() => {
                end(&svc, &mut sending, args.msg_id, &mut out);
            }
            r = eof_rx.recv(), if stdin_open => {
                let _ = r;
                stdin_open = false;
                end(&svc, &mut sending, args.msg_id, &mut out);
                exit_at = exit_at.min(tokio::time::Instant::now() + Duration::from_millis(args.linger_ms));
            }
            _ = &mut ctrl_c => {
                end(&svc, &mut sending, args.msg_id, &mut out);
                tokio::time::sleep(Duration::from_millis(args.linger_ms)).await;
                break;
            }
            _ = tokio::time::sleep_until(exit_at) => break,
        }
    }
    out.emit("exit", json!({"counters": metrics.snapshot()}));
    svc.shutdown().await;
    Ok(())
}

fn end(svc: &DasrService, sending: &mut Option<SocketAddr>, msg_id: u64, out: &mut Out) {
    if let Some(dest) = sending.take() {
        out.emit("end", json!({"dest": dest.to_string(), "msg_id": msg_id}));
        svc.message_ended(dest, msg_id);
    }
}
