//! The cluster's long-running processes: started detached (their own session, logs to a
//! file, a pid file), stopped by pid file — and only if the process is still the one the
//! file names, so a stale file never kills a stranger that reused the pid.

use anyhow::{Context, Result};
use std::os::unix::process::CommandExt;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// Starts `cmd` detached, logging to `DIR/NAME.log` (appended to: a daemon started again
/// keeps the log of its previous run, which says why it went), its pid in `DIR/NAME.pid`.
pub fn start(dir: &Path, name: &str, cmd: &mut Command) -> Result<u32> {
    let log = std::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(dir.join(format!("{name}.log")))
        .with_context(|| format!("creating {name}.log in {}", dir.display()))?;
    let child = cmd
        .stdin(Stdio::null())
        .stdout(log.try_clone()?)
        .stderr(log)
        // Its own session: the terminal's Ctrl-C goes to `drum-testbed`, which tears the
        // cluster down in order, not to every daemon at once.
        .process_group(0)
        .spawn()
        .with_context(|| format!("starting {name} ({:?})", cmd.get_program()))?;
    let pid = child.id();
    std::fs::write(dir.join(format!("{name}.pid")), format!("{pid}\n"))?;
    Ok(pid)
}

/// Whether process `pid` is alive and its command line mentions `marker`.
fn ours(pid: i32, marker: &str) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline"))
        .map(|c| String::from_utf8_lossy(&c).contains(marker))
        .unwrap_or(false)
}

fn pid(dir: &Path, name: &str) -> Option<i32> {
    std::fs::read_to_string(dir.join(format!("{name}.pid")))
        .ok()
        .and_then(|s| s.trim().parse::<i32>().ok())
}

/// Whether the daemon of `DIR/NAME.pid` runs (and is ours: mentions `marker`).
pub fn running(dir: &Path, name: &str, marker: &str) -> bool {
    running_pid(dir, name, marker).is_some()
}

/// The pid of the daemon of `DIR/NAME.pid` if it runs and is ours (reaping it first if it
/// exited as this process's child, so that a zombie does not look alive).
pub fn running_pid(dir: &Path, name: &str, marker: &str) -> Option<i32> {
    let p = pid(dir, name)?;
    reap(p);
    ours(p, marker).then_some(p)
}

/// Stops the daemon of `DIR/NAME.pid` (SIGTERM, then SIGKILL after `grace`) if it is still
/// ours: its command line mentions `marker`. Returns whether one was running.
pub fn stop(dir: &Path, name: &str, marker: &str, grace: Duration) -> bool {
    let file = dir.join(format!("{name}.pid"));
    let Some(pid) = pid(dir, name) else {
        return false;
    };
    let running = ours(pid, marker);
    if running {
        // SAFETY: signalling a process we started (checked by its command line).
        unsafe { libc::kill(pid, libc::SIGTERM) };
        let t = Instant::now();
        while ours(pid, marker) && t.elapsed() < grace {
            reap(pid);
            std::thread::sleep(Duration::from_millis(20));
        }
        if ours(pid, marker) {
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
        }
        reap(pid);
    }
    let _ = std::fs::remove_file(file);
    running
}

/// Kills (SIGKILL) every process whose environment holds `var` (a `NAME=value` prefix):
/// the programs a cluster ran, which no pid file names.
pub fn kill_marked_env(var: &str) {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    for e in dir.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|n| n.parse::<i32>().ok()) else {
            continue;
        };
        let env = std::fs::read(e.path().join("environ")).unwrap_or_default();
        if env
            .split(|b| *b == 0)
            .any(|kv| kv.starts_with(var.as_bytes()))
        {
            // SAFETY: signalling a process this cluster started (its environment says so).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            reap(pid);
        }
    }
}

/// Collects `pid` if it is a child of this process (started by this very invocation), so
/// that it does not linger as a zombie that still looks alive.
fn reap(pid: i32) {
    let mut status = 0;
    // SAFETY: non-blocking wait for one pid; fails harmlessly for a non-child.
    unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
}
