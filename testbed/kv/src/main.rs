//! `drum-kv`: an RDMA key-value store (`server`), its load generator (`client`), and the merge
//! of several clients' summaries (`merge`). An ordinary verbs application: it knows nothing
//! of DRUM, which governs it from outside (the shim in `LD_PRELOAD`).

mod abuse;
mod batch;
mod client;
mod cm;
mod coalesce;
mod dist;
mod in_flight;
mod interrupt;
mod metrics;
mod proto;
mod schedule;
mod server;
mod shared_qp;
mod slot;
mod stats;
mod store;
mod verbs;
mod wake;
mod wrid;

use clap::{Parser, Subcommand};
use std::net::SocketAddrV4;
use std::time::Duration;

#[derive(Parser)]
#[command(
    name = "drum-kv",
    version,
    about = "An RDMA key-value store and its load generator"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve a store of fixed slots: GETs by one-sided READ, GET/PUT RPCs over SEND/RECV.
    Server {
        /// Address (IPv4) and port to listen on (port 0: any free port).
        #[arg(long, default_value = "0.0.0.0:7471")]
        listen: SocketAddrV4,
        /// Number of keys (slots).
        #[arg(long, default_value_t = 1024)]
        keys: u64,
        /// Largest value a slot holds (bytes; K/M suffixes).
        #[arg(long, default_value = "64K", value_parser = parse_u32_bytes)]
        max_value: u32,
        /// Seed of the initial values (clients learn it when they connect).
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Most client connections that may share one QP (SHARE mode).
        #[arg(long, default_value_t = 5)]
        share: u16,
        /// Threads polling the connections' completion queues.
        #[arg(long, default_value_t = 1)]
        pollers: usize,
        /// Write the server's metrics (JSON) to this file when it stops (SIGTERM/SIGINT).
        #[arg(long)]
        stats_json: Option<std::path::PathBuf>,
        /// Print the metrics as one JSON line on stdout every this many seconds.
        #[arg(long)]
        stats_interval: Option<f64>,
    },
    /// Load the server and report latency and throughput.
    Client(ClientArgs),
    /// Merge the JSON summaries of clients that ran together into one.
    Merge {
        /// Summary files (`drum-kv client --json` output).
        files: Vec<std::path::PathBuf>,
    },
    /// Send the server one malformed request (for robustness tests) and report its answer.
    #[command(hide = true)]
    Abuse {
        #[arg(long)]
        server: SocketAddrV4,
        /// truncated | unknown-op | bad-key | bad-size | bad-checksum | oversized | vanish
        #[arg(long)]
        case: abuse::Case,
    },
}

#[derive(clap::Args)]
struct ClientArgs {
    /// The server's address.
    #[arg(long)]
    server: SocketAddrV4,
    /// Connections (cc).
    #[arg(long, default_value_t = 1)]
    conns: u32,
    /// Threads driving the connections (connection c runs on thread c mod T).
    #[arg(long, default_value_t = 1)]
    threads: u32,
    /// read (GET by READ) | get (GET RPC) | put (PUT RPC) | mix:P (PUT with probability P,
    /// else READ).
    #[arg(long, default_value = "read")]
    op: dist::OpMix,
    /// fixed:N | uniform:A..B | loguniform:A..B (value bytes).
    #[arg(long, default_value = "fixed:32")]
    size: dist::SizeDist,
    /// uniform | zipf:THETA.
    #[arg(long, default_value = "uniform")]
    keys: dist::KeySpec,
    /// Work requests per batch (wr_num): B or A..B.
    #[arg(long, default_value = "1")]
    wr_num: dist::WrNum,
    /// Operations in flight per connection at most.
    #[arg(long, default_value_t = 16)]
    window: u32,
    /// Measure for this many seconds (default 5, unless --ops or --bytes is given). SIGINT or
    /// SIGTERM ends the run sooner, with its summary.
    #[arg(long)]
    duration: Option<f64>,
    /// Seconds that operations still in flight when the run stops (at the end of --duration,
    /// or on SIGINT/SIGTERM) get to complete; the rest are abandoned (counted as `abandoned`,
    /// not as errors) and their QPs torn down.
    #[arg(long, default_value_t = 1.0)]
    drain: f64,
    /// Stop after this many operations in all, split equally among the connections.
    #[arg(long)]
    ops: Option<u64>,
    /// Stop after this many value bytes in all, split equally among the connections (K/M/G
    /// suffixes).
    #[arg(long, value_parser = parse_bytes)]
    bytes: Option<u64>,
    /// Seconds to run before measuring.
    #[arg(long, default_value_t = 0.0)]
    warmup: f64,
    /// Seed of the client's choices of keys, sizes and operations.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// busy (poll the CQs) | event (sleep on completion channels when there is nothing to do).
    #[arg(long, default_value = "busy")]
    poll: Poll,
    /// Connections sharing one QP behind a lock (SHARE mode; 1 = RAW).
    #[arg(long, default_value_t = 1)]
    share: u16,
    /// Print the summary as JSON.
    #[arg(long)]
    json: bool,
    /// Fill the window at every pass and send the RPC requests posted together several to a
    /// SEND (inline, as one batch message); off by default, since it changes what a work
    /// request is in the paper's loop.
    #[arg(long)]
    coalesce: bool,
    /// Post one batch per connection every this many ms, on the wall clock, instead of
    /// whenever the window has room (Dart's periodic incasts; needs --start-unix-ms).
    #[arg(long, requires = "start_unix_ms")]
    period_ms: Option<f64>,
    /// With --period-ms: each batch a uniform 0..=this many µs late.
    #[arg(long, default_value_t = 0.0, requires = "period_ms")]
    jitter_us: f64,
    /// With --period-ms: when the first batch is due (ms since the Unix epoch); the client
    /// fails if it connects after that, having missed it.
    #[arg(long, requires = "period_ms")]
    start_unix_ms: Option<u64>,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum Poll {
    Busy,
    Event,
}

fn parse_bytes(s: &str) -> Result<u64, String> {
    dist::parse_bytes(s).map_err(|e| e.to_string())
}

fn parse_u32_bytes(s: &str) -> Result<u32, String> {
    u32::try_from(parse_bytes(s)?).map_err(|_| format!("{s} is too large"))
}

fn seconds(s: f64, what: &str) -> anyhow::Result<Duration> {
    Duration::try_from_secs_f64(s).map_err(|_| anyhow::anyhow!("bad {what} {s}"))
}

fn main() -> anyhow::Result<()> {
    match Cli::parse().cmd {
        Cmd::Server {
            listen,
            keys,
            max_value,
            seed,
            share,
            pollers,
            stats_json,
            stats_interval,
        } => server::run(server::Config {
            listen,
            keys,
            max_value,
            seed,
            share,
            pollers,
            stats_json,
            stats_interval: stats_interval
                .map(|s| match seconds(s, "--stats-interval")? {
                    d if d.is_zero() => anyhow::bail!("--stats-interval must be more than 0"),
                    d => Ok(d),
                })
                .transpose()?,
        }),
        Cmd::Client(a) => {
            let duration = match (a.duration, a.ops, a.bytes) {
                (Some(d), _, _) => Some(seconds(d, "--duration")?),
                (None, None, None) => Some(Duration::from_secs(5)),
                _ => None,
            };
            let json = a.json;
            let s = client::run(client::Config {
                server: a.server,
                conns: a.conns,
                threads: a.threads,
                op: a.op,
                size: a.size,
                keys: a.keys,
                wr_num: a.wr_num,
                window: a.window,
                duration,
                ops: a.ops,
                bytes: a.bytes,
                warmup: seconds(a.warmup, "--warmup")?,
                seed: a.seed,
                events: matches!(a.poll, Poll::Event),
                share: a.share,
                coalesce: a.coalesce,
                drain: seconds(a.drain, "--drain")?,
                schedule: match (a.period_ms, a.start_unix_ms) {
                    (Some(p), Some(t)) => {
                        anyhow::ensure!(
                            p > 0.0
                                && p.is_finite()
                                && a.jitter_us >= 0.0
                                && a.jitter_us.is_finite(),
                            "--period-ms must be > 0 and --jitter-us ≥ 0"
                        );
                        Some(schedule::Schedule {
                            start_unix_ns: t.saturating_mul(1_000_000),
                            period_ns: (p * 1e6) as u64,
                            jitter_ns: (a.jitter_us * 1e3) as u64,
                        })
                    }
                    _ => None,
                },
            })?;
            print_summary(&s, json)?;
            anyhow::ensure!(s.errors == 0, "{} errors", s.errors);
            Ok(())
        }
        Cmd::Merge { files } => {
            let all = files
                .iter()
                .map(|f| {
                    let t = std::fs::read_to_string(f)?;
                    serde_json::from_str(&t).map_err(|e| anyhow::anyhow!("{}: {e}", f.display()))
                })
                .collect::<anyhow::Result<Vec<stats::Summary>>>()?;
            print_summary(&stats::merge(&all)?, true)
        }
        Cmd::Abuse { server, case } => abuse::run(server, case),
    }
}

fn print_summary(s: &stats::Summary, json: bool) -> anyhow::Result<()> {
    if json {
        println!("{}", serde_json::to_string_pretty(s)?);
    } else {
        println!(
            "{} {} conns={} threads={} share={}: {} ops {} bytes in {:.2} s: {:.0} ops/s {:.2} MiB/s; \
             latency us mean {:.1} p50 {:.1} p80 {:.1} p99 {:.1} p99.9 {:.1}; batch p50 {:.1} us, in flight {:.1} us; \
             lock wait {:.0} us total; errors {} (wrong values {}, error replies {}, failed {}); torn retries {}; updated values read {}; \
             abandoned {}",
            s.mode, s.op, s.conns, s.threads, s.share, s.ops, s.bytes, s.seconds, s.ops_per_s,
            s.mib_per_s, s.mean_us, s.p50_us, s.p80_us, s.p99_us, s.p999_us, s.batch.p50_us,
            s.batch_in_flight.mean_us,
            s.lock_wait_total_us, s.errors, s.wrong_values, s.error_replies, s.failed_completions,
            s.torn_retries, s.updated_values, s.abandoned
        );
    }
    Ok(())
}
