//! Running the workloads' programs on emulated hosts: children with deadlines (a hung
//! program is killed, never waited for forever) and client/server pairs.

use anyhow::{bail, Context, Result};
use std::io::Read;
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

/// Starts `cmd` with its output captured.
pub fn spawn(cmd: &mut Command) -> Result<Child> {
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("starting {:?}", cmd.get_program()))
}

/// Waits for `child` at most `limit`, killing it past that; its output either way.
pub fn finish(mut child: Child, limit: Duration) -> Result<Output> {
    // Drained on their own threads: a chatty child must not block on a full pipe.
    let drain = |r: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut v = Vec::new();
            if let Some(mut r) = r {
                let _ = r.read_to_end(&mut v);
            }
            v
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|r| Box::new(r) as Box<dyn Read + Send>),
    );
    let t = Instant::now();
    let status = loop {
        if let Some(s) = child.try_wait()? {
            break s;
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            break child.wait()?;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    Ok(Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    })
}

/// Fails with the program's output unless it succeeded.
pub fn check(o: &Output, what: &str) -> Result<()> {
    if !o.status.success() {
        bail!(
            "{what} failed ({}):\n{}{}",
            o.status,
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
    }
    Ok(())
}

/// A server started first and a client run against it (perftest's pattern): the client's
/// output, after both succeeded.
pub fn pair(server: &mut Command, client: &mut Command, limit: Duration) -> Result<Output> {
    let s = spawn(server)?;
    // perftest's server listens within milliseconds; its client does not retry.
    std::thread::sleep(Duration::from_millis(400));
    let c = finish(spawn(client)?, limit)?;
    let s = finish(s, Duration::from_secs(10))?;
    check(&c, "client")?;
    check(&s, "server")?;
    Ok(c)
}

/// The one-minute load average.
pub fn load_average() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(f64::NAN)
}
