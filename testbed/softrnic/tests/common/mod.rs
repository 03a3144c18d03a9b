//! What the integration tests share: a run directory torn down on drop, and running a server
//! on h1 with its client on h2.

#![allow(dead_code)] // each test crate uses its own subset

use drum_test_support::{run_timeout, spawn, text, wait_timeout};
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub const BIN: &str = env!("CARGO_BIN_EXE_softrnic");

pub fn privileged() -> Result<(), String> {
    drum_test_support::privileged(&["ibv_devices", "ibv_devinfo", "ibv_rc_pingpong", "ip"])
}

macro_rules! require_privileges {
    () => {
        if let Err(why) = privileged() {
            eprintln!("SKIPPED: {why}");
            return;
        }
    };
}

/// A run directory that is torn down (`softrnic down`) when dropped.
pub struct Run {
    pub dir: PathBuf,
    /// Run every `softrnic` command as this unprivileged user (uid = gid), through `setpriv`.
    pub user: Option<u32>,
}

impl Run {
    pub fn new(name: &str) -> Run {
        let dir = std::env::temp_dir().join(format!("softrnic-test-{}-{name}", std::process::id()));
        Run { dir, user: None }
    }

    /// A run of user `uid`, in a run directory that user owns.
    pub fn unprivileged(name: &str, uid: u32) -> Run {
        let mut run = Run::new(name);
        std::fs::create_dir_all(&run.dir).unwrap();
        std::os::unix::fs::chown(&run.dir, Some(uid), Some(uid)).unwrap();
        run.user = Some(uid);
        run
    }

    pub fn cmd(&self) -> Command {
        let mut c = match self.user {
            Some(uid) => {
                let mut c = Command::new("setpriv");
                c.arg(format!("--reuid={uid}"))
                    .arg(format!("--regid={uid}"))
                    .args(["--clear-groups", BIN]);
                c
            }
            None => Command::new(BIN),
        };
        c.arg("--run-dir").arg(&self.dir);
        c
    }

    pub fn up(&self, args: &[&str]) -> String {
        let out = run_timeout(self.cmd().arg("up").args(args), Duration::from_secs(60));
        assert!(out.status.success(), "up failed: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).into_owned()
    }

    pub fn addr(&self, host: &str) -> String {
        let out = run_timeout(self.cmd().args(["addr", host]), Duration::from_secs(10));
        assert!(out.status.success(), "addr failed: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }

    pub fn exec(&self, host: &str, prog: &[&str]) -> Command {
        let mut c = self.cmd();
        c.args(["exec", "--host", host, "--"]).args(prog);
        c
    }

    pub fn stats(&self, host: &str) -> std::collections::HashMap<String, u64> {
        drum_test_support::softrnic_stats(self.cmd().args(["stats", host]))
    }

    pub fn state(&self) -> String {
        std::fs::read_to_string(self.dir.join("state")).unwrap_or_default()
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        let out = run_timeout(self.cmd().arg("down"), Duration::from_secs(30));
        if !out.status.success() {
            eprintln!("softrnic down failed: {}", text(&out));
        }
    }
}

/// Run `args` as a server on h1 and as a client (`args` + h1's address) on h2.
pub fn pair(run: &Run, sargs: &[&str]) -> (Output, Output) {
    let server_ip = run.addr("h1");
    let server = spawn(&mut run.exec("h1", sargs));
    let mut cargs = sargs.to_vec();
    cargs.push(&server_ip);
    let client = client_retrying(run, "h2", &cargs);
    let server = wait_timeout(server, Duration::from_secs(60));
    (server, client)
}

/// Run client `args` on `host`, again while it cannot connect because its server does not
/// listen yet (for up to 10 s).
pub fn client_retrying(run: &Run, host: &str, args: &[&str]) -> Output {
    let t = Instant::now();
    loop {
        std::thread::sleep(Duration::from_millis(200));
        let client = run_timeout(&mut run.exec(host, args), Duration::from_secs(60));
        let refused = drum_test_support::server_not_listening_yet(&client);
        if !refused || t.elapsed() > Duration::from_secs(10) {
            return client;
        }
    }
}

pub fn pairs_succeed(run: &Run, cases: &[&[&str]], want: &str) {
    for args in cases {
        let (server, client) = pair(run, args);
        assert!(
            server.status.success(),
            "{args:?} server: {}",
            text(&server)
        );
        assert!(
            client.status.success(),
            "{args:?} client: {}",
            text(&client)
        );
        let c = String::from_utf8_lossy(&client.stdout);
        assert!(c.contains(want), "{args:?}: no {want:?} in:\n{c}");
    }
}
