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
/// ours: its command line mentions `marker`. Returns whether one was running. A daemon this
/// process started is collected, killed or already exited, so that it does not stay a zombie
/// until this process exits.
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
        let mut collected = false;
        while !collected && ours(pid, marker) && t.elapsed() < grace {
            collected = reap(pid);
            std::thread::sleep(Duration::from_millis(20));
        }
        if !collected {
            if ours(pid, marker) {
                // SAFETY: as above.
                unsafe { libc::kill(pid, libc::SIGKILL) };
            }
            await_child(pid);
        }
    } else {
        // It exited by itself (an exiting process's command line is empty, so it no longer
        // looks ours): collect it if it is our child, also while it is still exiting, before
        // it is a zombie (CI caught that window).
        await_child(pid);
    }
    let _ = std::fs::remove_file(file);
    running
}

/// Kills (SIGKILL) every process whose environment holds `var` (a `NAME=value` prefix):
/// the programs a cluster ran, which no pid file names. Those that are children of this
/// process are collected once they have died: collected right after the kill, a drum-kv
/// client was still running and stayed behind as a zombie.
pub fn kill_marked_env(var: &str) {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return;
    };
    let mut killed = Vec::new();
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
            killed.push(pid);
        }
    }
    // All killed first, so that they die together and the waits overlap.
    for pid in killed {
        await_child(pid);
    }
}

/// Collects `pid` if it is a child of this process (started by this very invocation) that
/// has exited, so that it does not linger as a zombie that still looks alive. Whether it was
/// collected now.
fn reap(pid: i32) -> bool {
    let mut status = 0;
    // SAFETY: non-blocking wait for one pid; fails harmlessly (ECHILD) for a non-child.
    unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) == pid }
}

/// How long a child sent SIGKILL may take to be collectable; the kernel delivers the signal
/// asynchronously, so a wait right after `kill` may find it still running.
const KILL_REAP_LIMIT: Duration = Duration::from_secs(2);

/// Collects `pid`, just sent SIGKILL or exiting, once it has exited (within
/// [`KILL_REAP_LIMIT`]), if it is a child of this process that nobody collected yet (so its
/// pid cannot have been reused); returns at once for any other pid.
fn await_child(pid: i32) {
    let t = Instant::now();
    loop {
        let mut status = 0;
        // SAFETY: non-blocking wait for one pid; fails harmlessly (ECHILD) for a non-child.
        let r = unsafe { libc::waitpid(pid, &mut status, libc::WNOHANG) };
        if r != 0 || t.elapsed() >= KILL_REAP_LIMIT {
            return;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Whether `pid` is still a child of this process that nobody collected (running or a
    /// zombie).
    fn uncollected(pid: u32) -> bool {
        let mut status = 0;
        // SAFETY: non-blocking wait for one pid; a collected or foreign pid fails with ECHILD.
        let r = unsafe { libc::waitpid(pid as i32, &mut status, libc::WNOHANG) };
        r == 0 || r == pid as i32
    }

    /// `sh -c SCRIPT MARKER`, started as a daemon named `name` in a fresh directory: the
    /// marker is the shell's `$0`, so its command line mentions it.
    fn daemon(name: &str, script: &str) -> (std::path::PathBuf, String, u32) {
        let dir =
            std::env::temp_dir().join(format!("drum-daemons-test-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let marker = dir.to_string_lossy().to_string();
        let pid = start(&dir, name, Command::new("sh").args(["-c", script, &marker])).unwrap();
        (dir, marker, pid)
    }

    #[test]
    fn a_daemon_that_ignores_sigterm_is_killed_and_collected() {
        let (dir, marker, pid) = daemon("stubborn", "trap '' TERM; while :; do sleep 0.05; done");
        std::thread::sleep(Duration::from_millis(200));
        assert!(stop(&dir, "stubborn", &marker, Duration::from_millis(100)));
        assert!(!uncollected(pid), "left a zombie");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_daemon_killed_without_grace_is_collected() {
        let (dir, marker, pid) = daemon("crashed", "while :; do sleep 0.05; done");
        std::thread::sleep(Duration::from_millis(200));
        assert!(stop(&dir, "crashed", &marker, Duration::ZERO));
        assert!(!uncollected(pid), "left a zombie");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    fn a_daemon_that_exited_by_itself_is_collected_when_stopped() {
        let (dir, marker, pid) = daemon("quitter", "exit 3");
        let t = Instant::now();
        while ours(pid as i32, &marker) && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(10));
        }
        assert!(!stop(&dir, "quitter", &marker, Duration::from_secs(1)));
        assert!(!uncollected(pid), "left a zombie");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[test]
    // The children are deliberately not waited for here: `kill_marked_env` must collect them.
    #[allow(clippy::zombie_processes)]
    fn programs_marked_in_their_environment_are_killed_and_collected() {
        let mark = format!("DRUM_DAEMONS_TEST={}", std::process::id());
        let (name, value) = mark.split_once('=').unwrap();
        let pids: Vec<u32> = (0..3)
            .map(|_| {
                let c = Command::new("sh")
                    .args(["-c", "while :; do sleep 0.05; done"])
                    .env(name, value)
                    .spawn()
                    .unwrap();
                c.id() // dropped, not waited for: as the cluster's programs are
            })
            .collect();
        std::thread::sleep(Duration::from_millis(200));
        kill_marked_env(&mark);
        for pid in pids {
            assert!(!uncollected(pid), "left {pid} running or a zombie");
        }
    }
}
