//! The soak's applications, unmodified and under the shim: an `ib_write_bw` pair that
//! prints its bandwidth every second for ever (`--run_infinitely`), and a `drum-kv` store
//! whose client checks every value it reads against its checksum and whose server prints
//! what it served every second. Their output lines are their progress counters.

use crate::cluster::Cluster;
use anyhow::{bail, Context, Result};
use serde_json::Value;
use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A running program of the workload and what it printed.
pub struct App {
    /// The app's name under DRUM (`DRUM_APP`) and its host.
    pub name: &'static str,
    pub host: &'static str,
    child: Child,
    /// Moves whenever the program reports progress (if `watched`).
    pub progress: Arc<AtomicU64>,
    /// Whether its output shows progress: a client's, or the server's for its client.
    pub watched: bool,
    output: Arc<Mutex<Vec<String>>>,
    /// What it printed on stdout alone (the key-value client's summary).
    stdout: Arc<Mutex<String>>,
}

impl App {
    fn start(
        cluster: &Cluster,
        name: &'static str,
        host: &'static str,
        cmd: &[String],
        counts: Option<fn(&str, u64) -> Option<u64>>,
    ) -> Result<App> {
        let mut child = cluster
            .governed(host, name, cmd)?
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .with_context(|| format!("starting {name} on {host}"))?;
        let progress = Arc::new(AtomicU64::new(0));
        let output = Arc::new(Mutex::new(Vec::new()));
        let out = child.stdout.take().expect("piped");
        let err = child.stderr.take().expect("piped");
        let stdout = Arc::new(Mutex::new(String::new()));
        for (stream, counts, whole) in [
            (
                Box::new(out) as Box<dyn Read + Send>,
                counts,
                Some(stdout.clone()),
            ),
            (Box::new(err) as Box<dyn Read + Send>, None, None),
        ] {
            let (progress, output) = (progress.clone(), output.clone());
            std::thread::spawn(move || {
                for line in BufReader::new(stream).lines().map_while(Result::ok) {
                    if let Some(v) = counts.and_then(|c| c(&line, progress.load(Relaxed))) {
                        progress.store(v, Relaxed);
                    }
                    if let Some(w) = &whole {
                        let mut w = w.lock().expect("not poisoned");
                        w.push_str(&line);
                        w.push('\n');
                    }
                    output.lock().expect("not poisoned").push(line);
                }
            });
        }
        Ok(App {
            name,
            host,
            child,
            progress,
            watched: counts.is_some(),
            output,
            stdout,
        })
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// Asks it to stop (SIGINT).
    fn interrupt(&self) {
        // SAFETY: signalling our own child, which has not been waited for.
        unsafe { libc::kill(self.child.id() as i32, libc::SIGINT) };
    }

    /// Waits at most `limit` for it to exit by itself.
    pub fn wait(&mut self, limit: Duration) -> Option<std::process::ExitStatus> {
        let t = std::time::Instant::now();
        while t.elapsed() < limit {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        None
    }

    /// The last `n` lines it printed (stdout and stderr), without the frames of a panic's
    /// backtrace, which would hide the message above them.
    pub fn tail(&self, n: usize) -> String {
        let out = self.output.lock().expect("not poisoned");
        let frame = |l: &&String| {
            let t = l.trim_start();
            t.starts_with("at ")
                || t.split_once(": ")
                    .is_some_and(|(n, _)| n.parse::<u32>().is_ok())
        };
        let kept: Vec<&String> = out.iter().filter(|l| !frame(l)).collect();
        kept[kept.len().saturating_sub(n)..]
            .iter()
            .map(|l| l.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }

    /// Everything it printed on stdout.
    pub fn stdout(&self) -> String {
        self.stdout.lock().expect("not poisoned").clone()
    }
}

impl Drop for App {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A perftest report line (`#bytes #iterations BW peak BW average …`: its first field is a
/// number) counts one more report after `seen`.
fn perftest_line(line: &str, seen: u64) -> Option<u64> {
    line.split_whitespace()
        .next()?
        .parse::<u64>()
        .ok()
        .map(|_| seen + 1)
}

/// The requests a `drum-kv server --stats-interval` line counts (RPCs served, plus the
/// bytes received, which READ-only clients do not move but PUTs and GETs do).
fn kv_stats_line(line: &str, _: u64) -> Option<u64> {
    let v: Value = serde_json::from_str(line).ok()?;
    Some(v["gets"].as_u64()? + v["puts"].as_u64()? + v["request_bytes"].as_u64()?)
}

/// The soak's workload.
pub struct Workload {
    pub apps: Vec<App>,
    /// Index of the drum-kv client in `apps`: its exit status and summary say whether data
    /// was lost.
    pub kv_client: usize,
}

/// Ports on h1 (its own network namespace, so no other cluster's runs collide with them).
const PERFTEST_PORT: &str = "18515";
const KV_PORT: u16 = 7471;

impl Workload {
    /// Starts the servers on h1, a bulk writer on h2 and the store's client on h3 (for
    /// `kv_secs`). Both clients send to h1, so they share its receive link.
    pub fn start(cluster: &Cluster, kv_secs: u64) -> Result<Workload> {
        let h1 = cluster.addr("h1")?;
        let kv = cluster.tool_path("drum-kv")?.to_string_lossy().to_string();
        let s = |v: &[&str]| v.iter().map(|x| x.to_string()).collect::<Vec<_>>();
        let perftest = s(&[
            "ib_write_bw",
            "-x",
            "0",
            "-s",
            "65536",
            "-D",
            "1",
            "--run_infinitely",
            // A transport timeout of 1 s a retry (4.096 µs · 2^18) rather than perftest's
            // 67 ms: a loaded 2-core machine can deschedule softrnic's engines for longer
            // than the default 7 retries cover (a 10-minute soak with a build running beside
            // it ended in IBV_WC_RETRY_EXC_ERR), which tests the machine, not DRUM.
            "-u",
            "18",
            // perftest times its reports in TSC cycles and samples the cycles' frequency
            // against gettimeofday for every report line; when the sampling is descheduled
            // (r^2 < 0.9) it prints "Can't produce a report" and exits 1 unless -F is given.
            // Under load that ended a CI run: the client exited, so the server's end-of-run
            // TCP read failed ("Failed to exchange data between server and clients").
            "-F",
            "-p",
            PERFTEST_PORT,
        ]);
        let mut apps = vec![
            // perftest's write server is passive: it prints nothing until the end.
            App::start(cluster, "bulk-sink", "h1", &perftest, None)?,
            App::start(
                cluster,
                "kv-server",
                "h1",
                &s(&[
                    &kv,
                    "server",
                    "--listen",
                    &format!("{h1}:{KV_PORT}"),
                    "--keys",
                    "256",
                    "--max-value",
                    "4K",
                    "--stats-interval",
                    "1",
                ]),
                Some(kv_stats_line),
            )?,
        ];
        // perftest's and drum-kv's clients do not retry a server that is not listening yet.
        std::thread::sleep(Duration::from_secs(1));
        let mut client = perftest.clone();
        client.push(h1.to_string());
        apps.push(App::start(
            cluster,
            "bulk",
            "h2",
            &client,
            Some(perftest_line),
        )?);
        apps.push(App::start(
            cluster,
            "kv",
            "h3",
            &[
                kv.clone(),
                "client".into(),
                "--server".into(),
                format!("{h1}:{KV_PORT}"),
                "--conns".into(),
                "4".into(),
                "--op".into(),
                "mix:0.3".into(),
                "--size".into(),
                "uniform:32..4096".into(),
                "--window".into(),
                "4".into(),
                "--poll".into(),
                "event".into(),
                "--duration".into(),
                kv_secs.to_string(),
                "--json".into(),
            ],
            // Its progress shows in the server's counts; its summary comes at the end.
            None,
        )?);
        Ok(Workload { apps, kv_client: 3 })
    }

    /// The apps that must hold a grant in a settled cluster: the senders.
    pub fn senders(&self) -> Vec<(&'static str, &'static str)> {
        vec![("h2", "bulk"), ("h3", "kv")]
    }

    /// Stops the store's client (SIGINT: it finishes what is in flight and prints its
    /// summary) and checks the summary: it exited 0 and counted no error.
    pub fn stop_kv(&mut self, limit: Duration) -> Result<Value> {
        let c = &mut self.apps[self.kv_client];
        if let Some(s) = c.exited() {
            bail!(
                "the drum-kv client ended before it was stopped, with {s}:\n{}",
                c.tail(20)
            );
        }
        c.interrupt();
        let Some(status) = c.wait(limit) else {
            bail!("the drum-kv client did not finish within {limit:?}");
        };
        // `--json`: the summary is all it prints on stdout (pretty-printed).
        let summary: Option<Value> = serde_json::from_str(&c.stdout()).ok();
        let errors = summary.as_ref().and_then(|v| v["errors"].as_u64());
        if !status.success() || errors != Some(0) {
            bail!(
                "the drum-kv client exited with {status} and {errors:?} errors:\n{}",
                c.tail(20)
            );
        }
        Ok(summary.expect("errors came from it"))
    }
}
