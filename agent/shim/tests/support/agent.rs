//! A real `drum-agent --local` for the shim's integration tests.

use super::{built, Run};
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant, SystemTime};

/// A shim as the agent's status lists it: (pid, app, send_bytes, applied_generation).
pub type Shim = (u64, String, u64, u64);

/// A `drum-agent --local` with its own config, socket and status file; killed on drop.
pub struct Agent {
    child: Option<Child>,
    pub config: PathBuf,
    pub socket: PathBuf,
    pub status: PathBuf,
    /// `softrnic exec --host H --` for an agent on an emulated host (used once).
    launcher: Option<Command>,
}

impl Agent {
    pub fn start(dir: &Path, name: &str, line_rate_gbps: f64, pins: &str) -> Agent {
        Agent::start_on(None, dir, name, line_rate_gbps, "", pins)
    }

    /// An agent on emulated host `host` (inside its namespaces, so that DASR can bind the
    /// host's address), with `extra` top-level settings (e.g. a `[dasr]` table after the
    /// pins).
    pub fn start_on(
        host: Option<(&Run, &str)>,
        dir: &Path,
        name: &str,
        line_rate_gbps: f64,
        shim_extra: &str,
        pins: &str,
    ) -> Agent {
        std::fs::create_dir_all(dir).unwrap();
        let config = dir.join(format!("{name}.toml"));
        let socket = dir.join(format!("{name}.sock"));
        let status = dir.join(format!("{name}-status.json"));
        std::fs::write(
            &config,
            format!(
                "status_file = \"{name}-status.json\"\n[shim]\nsocket = \"{name}.sock\"\n\
                 line_rate_gbps = {line_rate_gbps}\n{shim_extra}\n{pins}"
            ),
        )
        .unwrap();
        let mut a = Agent {
            child: None,
            config,
            socket,
            status,
            launcher: host.map(|(run, h)| {
                let mut c = run.cmd();
                c.args(["exec", "--host", h, "--"]);
                c
            }),
        };
        a.restart();
        a
    }

    pub fn restart(&mut self) {
        // What a killed agent left behind must not pass for the new one's: its status file
        // (the test would read stale counters) and its socket (taken for the new one's).
        let _ = std::fs::remove_file(&self.status);
        let _ = std::fs::remove_file(&self.socket);
        let agent = built("drum-agent");
        let mut c = match self.launcher.take() {
            Some(mut l) => {
                l.arg(&agent);
                l
            }
            None => Command::new(&agent),
        };
        let child = c
            .arg("--local")
            .arg(&self.config)
            .env("DRUM_LOG", "warn")
            .env_remove("LD_PRELOAD")
            .stdin(std::process::Stdio::null())
            .spawn()
            .expect("spawn drum-agent");
        self.child = Some(child);
        let t = Instant::now();
        while !self.socket.exists() {
            assert!(
                t.elapsed() < Duration::from_secs(10),
                "agent socket never appeared"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// The shims the agent lists.
    pub fn shims(&self) -> Vec<Shim> {
        self.shims_written()
            .map_or_else(Vec::new, |(shims, _)| shims)
    }

    /// [`Self::shims`] and when the agent wrote them.
    pub fn shims_written(&self) -> Option<(Vec<Shim>, SystemTime)> {
        let (text, written) = drum_test_support::read_written(&self.status)?;
        let v: serde_json::Value = serde_json::from_str(&text).expect("status is JSON");
        let shims = v["shims"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| {
                (
                    s["pid"].as_u64().unwrap(),
                    s["app"].as_str().unwrap().to_string(),
                    s["send_bytes"].as_u64().unwrap(),
                    s["applied_generation"].as_u64().unwrap(),
                )
            })
            .collect();
        Some((shims, written))
    }

    /// What the shims of `app` send per second (`total` of their byte counters) over at
    /// least `secs`, between two writes of the agent's status (about every 100 ms, later on
    /// a loaded machine: a tenth of a one-second window).
    pub fn send_rate(&self, app: &str, secs: f64, total: fn(&[u64]) -> u64) -> Option<f64> {
        let sample = || {
            let (shims, at) = self.shims_written()?;
            let bytes: Vec<u64> = shims.iter().filter(|s| s.1 == app).map(|s| s.2).collect();
            (!bytes.is_empty()).then(|| (total(&bytes), at))
        };
        let (b0, t0) = sample()?;
        std::thread::sleep(Duration::from_secs_f64(secs));
        // A status written after the sleep began, a full window after the first one.
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            let (b1, t1) = sample()?;
            let span = t1.duration_since(t0).unwrap_or_default().as_secs_f64();
            if span >= secs {
                return Some(b1.saturating_sub(b0) as f64 / span);
            }
            if Instant::now() > deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// The DASR caps in force for this host's shims: (peer GID hex, bytes/s, senders).
    pub fn caps(&self) -> Vec<(String, u64, u64)> {
        let Ok(text) = std::fs::read_to_string(&self.status) else {
            return Vec::new();
        };
        let Ok(v) = serde_json::from_str::<serde_json::Value>(&text) else {
            return Vec::new();
        };
        v["caps"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|c| {
                        (
                            c["peer"].as_str().unwrap_or("").to_string(),
                            c["cap_bytes_per_s"].as_u64().unwrap_or(0),
                            c["senders"].as_u64().unwrap_or(0),
                        )
                    })
                    .collect()
            })
            .unwrap_or_default()
    }

    pub fn env<'a>(&'a self, app: &'a str) -> Vec<(&'a str, &'a str)> {
        vec![
            ("DRUM_AGENT_SOCKET", self.socket.to_str().unwrap()),
            ("DRUM_APP", app),
        ]
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        self.kill();
    }
}
