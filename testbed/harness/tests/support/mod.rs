//! What the harness's integration tests share: the workspace's binaries and a
//! `drum-testbed cluster` in its own state directory, taken down when dropped (with the
//! agents' logs on stderr when a test fails).

use drum_test_support::{run_timeout, text};
use serde_json::Value;
use std::path::PathBuf;
use std::process::Command;
use std::time::Duration;

pub use drum_test_support::workspace_bin as bin;

/// perftest's `-u` for the tests whose cluster runs perftest for seconds: 1.07 s per transport
/// retry instead of its default 67 ms. The emulated NICs are user-space engines, and a loaded
/// 2-core machine starved them past perftest's eight 67 ms tries (RETRY_EXC_ERR in 2 of 7
/// runs of `cluster.rs` on 2026-11-28; in a CI run of `ungoverned.rs` on 2026-11-29, "handing
/// 2 packets to the kernel took 864 ms" in an engine's log, after which every perftest of the
/// test had ended). These tests are about the control plane, not the transport.
const PERFTEST_RETRY_TIMEOUT: &str = "18";

/// A perftest bandwidth run's options: 64 KiB messages for `secs` seconds on `port`, with the
/// retry timeout above.
pub fn bandwidth_options<'a>(secs: &'a str, port: &'a str) -> [&'a str; 8] {
    [
        "-s",
        "65536",
        "-D",
        secs,
        "-p",
        port,
        "-u",
        PERFTEST_RETRY_TIMEOUT,
    ]
}

pub struct Cluster {
    pub dir: PathBuf,
}

impl Cluster {
    pub fn cmd(&self) -> Command {
        let mut c = Command::new(bin("drum-testbed"));
        c.arg("--dir").arg(&self.dir).arg("cluster");
        c
    }

    /// `cluster ARGS…`, which must succeed; its standard output.
    pub fn ok(&self, args: &[&str]) -> String {
        let out = run_timeout(self.cmd().args(args), Duration::from_secs(120));
        assert!(out.status.success(), "cluster {args:?}: {}", text(&out));
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    // Each test binary compiles this module; not every one calls every helper.
    #[allow(dead_code)]
    pub fn status(&self) -> Value {
        self.try_status()
            .unwrap_or_else(|e| panic!("cluster [\"status\", \"--json\"]: {e}"))
    }

    /// The status, or why there is none yet (a coordinator just started may not listen yet).
    pub fn try_status(&self) -> Result<Value, String> {
        let out = run_timeout(
            self.cmd().args(["status", "--json"]),
            Duration::from_secs(120),
        );
        if !out.status.success() {
            return Err(text(&out));
        }
        serde_json::from_slice(&out.stdout).map_err(|e| format!("status JSON: {e}"))
    }

    pub fn agent_log(&self, host: &str) -> String {
        std::fs::read_to_string(self.dir.join(format!("agent-{host}.log"))).unwrap_or_default()
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for host in ["h1", "h2", "h3"] {
                let log = self.agent_log(host);
                if !log.is_empty() {
                    eprintln!("--- agent-{host}.log:\n{log}");
                }
                let engine = self
                    .dir
                    .join("softrnic/hosts")
                    .join(host)
                    .join("engine.log");
                let log = std::fs::read_to_string(engine).unwrap_or_default();
                if !log.is_empty() {
                    eprintln!("--- softrnic engine of {host}:\n{log}");
                }
            }
        }
        let out = run_timeout(self.cmd().arg("down"), Duration::from_secs(60));
        if !out.status.success() {
            eprintln!("cluster down: {}", text(&out));
        }
    }
}
