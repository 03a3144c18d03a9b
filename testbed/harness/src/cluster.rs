//! A DRUM cluster of emulated hosts on one machine: softrnic's hosts, a coordinator, and
//! one agent per host with its shim link, with throw-away certificates. Everything lives in
//! one state directory, and `down` removes all of it: processes, namespaces, mounts, files.
//!
//! It runs the project's own binaries as they are (`softrnic`, `drum-coordinator`,
//! `drum-agent`, `libdrum_shim.so`), found beside `drum-testbed` or in `$DRUM_BIN_DIR`.

use crate::configs::{Layout, ADMIN, COORDINATOR_PORT};
use crate::daemons;
use anyhow::{anyhow, bail, Context, Result};
use std::net::Ipv4Addr;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering::Relaxed};
use std::time::{Duration, Instant};

/// How long `up` waits for the coordinator and every agent to be serving.
const READY_TIMEOUT: Duration = Duration::from_secs(30);
/// What Dart's experiments add to `softrnic up`: ECN marking at DCQCN's K_max for 40 Gb/s
/// (200 KB; docs/softrnic-congestion.md), so DCQCN, on by default, acts; AUSS in the NIC's
/// ACKs with a 500 ms expiry; the END hold at 5 µs of NIC time, i.e. 1 ms of wall-clock time
/// at the time scale of 200 of Dart's NIC (`profile::DART_DILATED`). The hold covers an
/// engine's wake-up, which is not dilated: the default 1,000 µs would hold a finished sender
/// for 200 ms, longer than a whole incast of the scenarios.
pub const DART_NIC: [&str; 6] = [
    "--ecn-threshold-kib",
    "200",
    "--auss-expiry-ms",
    "500",
    "--auss-hold-us",
    "5",
];
/// The END hold of [`DART_NIC`], in µs of NIC time.
pub fn dart_hold_us() -> f64 {
    DART_NIC
        .windows(2)
        .find(|w| w[0] == "--auss-hold-us")
        .and_then(|w| w[1].parse().ok())
        .expect("DART_NIC sets the hold")
}

/// How long a daemon has to exit after SIGTERM.
const STOP_GRACE: Duration = Duration::from_secs(5);

/// A daemon of the cluster.
#[derive(Clone, Debug, PartialEq)]
pub enum Daemon {
    Coordinator,
    /// The agent of a host.
    Agent(String),
}

impl Daemon {
    /// Its name in the state directory (`NAME.pid`, `NAME.log`).
    pub fn name(&self) -> String {
        match self {
            Daemon::Coordinator => "coordinator".into(),
            Daemon::Agent(h) => format!("agent-{h}"),
        }
    }
}

pub struct Cluster {
    dir: PathBuf,
    bin: PathBuf,
}

/// Set by SIGINT or SIGTERM while `up` runs: it stops and tears down what it started.
static INTERRUPTED: AtomicBool = AtomicBool::new(false);

extern "C" fn on_signal(_: libc::c_int) {
    INTERRUPTED.store(true, Relaxed);
}

/// Makes SIGINT and SIGTERM set a flag that long operations check (see [`interrupted`]).
pub fn catch_interrupts() {
    for sig in [libc::SIGINT, libc::SIGTERM] {
        // SAFETY: the handler only stores to an atomic, which is async-signal-safe.
        unsafe { libc::signal(sig, on_signal as *const () as libc::sighandler_t) };
    }
}

/// Whether SIGINT or SIGTERM arrived since [`catch_interrupts`].
pub fn interrupted() -> bool {
    INTERRUPTED.load(Relaxed)
}

fn check_interrupted() -> Result<()> {
    if interrupted() {
        bail!("interrupted");
    }
    Ok(())
}

impl Cluster {
    /// The cluster of state directory `dir` (made absolute).
    pub fn new(dir: &Path) -> Result<Cluster> {
        let dir = std::path::absolute(dir)?;
        let bin = match std::env::var_os("DRUM_BIN_DIR") {
            Some(d) => PathBuf::from(d),
            None => std::env::current_exe()?
                .parent()
                .ok_or_else(|| anyhow!("drum-testbed has no directory"))?
                .to_path_buf(),
        };
        Ok(Cluster { dir, bin })
    }

    /// One of the project's binaries (or libraries) beside `drum-testbed`.
    pub fn tool_path(&self, name: &str) -> Result<PathBuf> {
        self.tool(name)
    }

    fn tool(&self, name: &str) -> Result<PathBuf> {
        let p = self.bin.join(name);
        if !p.is_file() {
            bail!(
                "{} not found (build the workspace: cargo build --workspace --release; or set DRUM_BIN_DIR)",
                p.display()
            );
        }
        Ok(p)
    }

    fn softrnic_dir(&self) -> PathBuf {
        self.dir.join("softrnic")
    }

    fn softrnic(&self) -> Result<Command> {
        let mut c = Command::new(self.tool("softrnic")?);
        c.env("SOFTRNIC_RUN_DIR", self.softrnic_dir());
        Ok(c)
    }

    /// `softrnic exec --host HOST -- PROGRAM`.
    fn on_host(&self, host: &str, program: &Path) -> Result<Command> {
        let mut c = self.softrnic()?;
        c.args(["exec", "--host", host, "--"]).arg(program);
        Ok(c)
    }

    fn is_up(&self) -> bool {
        self.dir.join("hosts").is_file()
    }

    fn hosts(&self) -> Result<Vec<String>> {
        let text = std::fs::read_to_string(self.dir.join("hosts")).with_context(|| {
            format!(
                "no cluster in {} (drum-testbed cluster up)",
                self.dir.display()
            )
        })?;
        Ok(text.lines().map(str::to_string).collect())
    }

    fn check_host(&self, host: &str) -> Result<()> {
        let hosts = self.hosts()?;
        if !hosts.iter().any(|h| h == host) {
            bail!("no host {host:?} (hosts: {})", hosts.join(", "));
        }
        Ok(())
    }

    /// Brings up `hosts` emulated hosts (`softrnic_args` go to `softrnic up`), a coordinator
    /// on the first, and an agent on each; on failure or interruption, tears down what it
    /// started.
    pub fn up(&self, hosts: usize, line_rate_gbps: f64, softrnic_args: &[String]) -> Result<()> {
        self.bring_up(hosts, line_rate_gbps, softrnic_args, true)
    }

    /// [`up`](Self::up); without `drum`, the hosts alone (for runs that never use the shim).
    pub fn bring_up(
        &self,
        hosts: usize,
        line_rate_gbps: f64,
        softrnic_args: &[String],
        drum: bool,
    ) -> Result<()> {
        if !(1..=64).contains(&hosts) {
            bail!("--hosts must be 1 to 64, got {hosts}");
        }
        if !(line_rate_gbps.is_finite() && line_rate_gbps > 0.0 && line_rate_gbps <= 400.0) {
            bail!("--line-rate-gbps must be in (0, 400], got {line_rate_gbps}");
        }
        if self.is_up() || self.softrnic_dir().exists() {
            bail!(
                "a cluster is already up in {} (drum-testbed cluster down)",
                self.dir.display()
            );
        }
        catch_interrupts();
        let r = self.launch(hosts, line_rate_gbps, softrnic_args, drum);
        if r.is_err() {
            self.down()?;
        }
        r
    }

    /// The hosts of Dart's experiments: the NIC with ECN marking (DCQCN's default
    /// threshold) and AUSS in its ACKs, and a local agent with a DASR channel on every
    /// host (no coordinator). On failure or interruption, tears down what it started.
    pub fn bring_up_dart(
        &self,
        hosts: usize,
        line_rate_gbps: f64,
        softrnic_args: &[String],
    ) -> Result<()> {
        if self.is_up() || self.softrnic_dir().exists() {
            bail!(
                "a cluster is already up in {} (drum-testbed cluster down)",
                self.dir.display()
            );
        }
        catch_interrupts();
        let r = self.launch_dart(hosts, line_rate_gbps, softrnic_args);
        if r.is_err() {
            self.down()?;
        }
        r
    }

    fn launch_dart(&self, n: usize, line_rate_gbps: f64, softrnic_args: &[String]) -> Result<()> {
        let mut args = softrnic_args.to_vec();
        args.extend(DART_NIC.iter().map(|a| a.to_string()));
        self.launch(n, line_rate_gbps, &args, false)?;
        let names = self.hosts()?;
        let hosts = names
            .iter()
            .map(|h| Ok((h.clone(), self.addr(h)?)))
            .collect::<Result<Vec<(String, Ipv4Addr)>>>()?;
        let layout = Layout {
            hosts: &hosts,
            line_rate_gbps,
            qp_budget: 0,
            gate_quantum_us: 0,
            mtu: Layout::mtu(softrnic_args).map_err(anyhow::Error::msg)?,
            wqe_fetch_ns: 0,
            dir: &self.dir,
        };
        for (h, ip) in &hosts {
            std::fs::create_dir_all(self.dir.join(h))?;
            let config = self.dir.join(format!("agent-{h}.toml"));
            std::fs::write(&config, layout.dasr_agent_toml(h, *ip))?;
            let mut c = self.on_host(h, &self.tool("drum-agent")?)?;
            c.arg("--local").arg(&config);
            daemons::start(&self.dir, &format!("agent-{h}"), &mut c)?;
        }
        let t = Instant::now();
        while !hosts.iter().all(|(h, _)| layout.shim_socket(h).exists()) {
            check_interrupted()?;
            if t.elapsed() > READY_TIMEOUT {
                bail!(
                    "the agents did not serve their shims within {READY_TIMEOUT:?}; logs in {}",
                    self.dir.display()
                );
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Ok(())
    }

    /// softrnic's run state (`<run>/state`: hosts, addresses, namespaces, engine pids).
    pub fn softrnic_state(&self) -> Result<String> {
        let p = self.softrnic_dir().join("state");
        std::fs::read_to_string(&p).with_context(|| format!("reading {}", p.display()))
    }

    fn launch(
        &self,
        n: usize,
        line_rate_gbps: f64,
        softrnic_args: &[String],
        drum: bool,
    ) -> Result<()> {
        std::fs::create_dir_all(&self.dir)
            .with_context(|| format!("creating {}", self.dir.display()))?;
        let names: Vec<String> = (1..=n).map(|i| format!("h{i}")).collect();
        let rate = line_rate_gbps.to_string();
        run(self
            .softrnic()?
            .args(["up", "--hosts", &n.to_string(), "--line-rate-gbps", &rate])
            .args(softrnic_args)
            .process_group(0))
        .context("softrnic up")?;
        std::fs::write(self.dir.join("hosts"), names.join("\n") + "\n")?;
        check_interrupted()?;
        if !drum {
            return Ok(());
        }
        let hosts = names
            .iter()
            .map(|h| Ok((h.clone(), self.addr(h)?)))
            .collect::<Result<Vec<(String, Ipv4Addr)>>>()?;
        let layout = Layout {
            hosts: &hosts,
            line_rate_gbps,
            qp_budget: Layout::qp_budget_for(
                Layout::qp_cache(softrnic_args).map_err(anyhow::Error::msg)?,
            ),
            gate_quantum_us: Layout::gate_quantum_us_for(
                Layout::qp_miss_ns(softrnic_args).map_err(anyhow::Error::msg)?,
            ),
            mtu: Layout::mtu(softrnic_args).map_err(anyhow::Error::msg)?,
            wqe_fetch_ns: Layout::wqe_fetch_ns(softrnic_args).map_err(anyhow::Error::msg)?,
            dir: &self.dir,
        };
        run(Command::new(self.tool("drum-coordinator")?)
            .arg("dev-certs")
            .arg("--out")
            .arg(self.dir.join("certs"))
            .arg("--agents")
            .arg(names.join(",")))
        .context("drum-coordinator dev-certs")?;
        std::fs::write(self.dir.join("coordinator.toml"), layout.coordinator_toml())?;
        for h in &names {
            std::fs::create_dir_all(self.dir.join(h))?;
            std::fs::write(
                self.dir.join(format!("agent-{h}.toml")),
                layout.agent_toml(h),
            )?;
        }
        check_interrupted()?;
        self.start_daemon(&Daemon::Coordinator, &names)?;
        for h in &names {
            self.start_daemon(&Daemon::Agent(h.clone()), &names)?;
        }
        self.wait_ready(&layout)
    }

    fn start_daemon(&self, d: &Daemon, hosts: &[String]) -> Result<()> {
        let mut c = match d {
            Daemon::Coordinator => {
                let mut c = self.on_host(&hosts[0], &self.tool("drum-coordinator")?)?;
                c.arg("serve")
                    .arg("--config")
                    .arg(self.dir.join("coordinator.toml"));
                c
            }
            Daemon::Agent(h) => {
                let mut c = self.on_host(h, &self.tool("drum-agent")?)?;
                c.arg("--config")
                    .arg(self.dir.join(format!("agent-{h}.toml")));
                c
            }
        };
        daemons::start(&self.dir, &d.name(), &mut c)?;
        Ok(())
    }

    /// Kills a daemon of the cluster at once (SIGKILL: a crash, not a shutdown).
    pub fn kill(&self, d: &Daemon) -> Result<()> {
        self.check_daemon(d)?;
        let marker = self.dir.to_string_lossy().to_string();
        if !daemons::stop(&self.dir, &d.name(), &marker, Duration::ZERO) {
            bail!("{} is not running", d.name());
        }
        Ok(())
    }

    /// Starts a daemon of the cluster that is not running (after `kill`, or a crash).
    pub fn start(&self, d: &Daemon) -> Result<()> {
        self.check_daemon(d)?;
        let marker = self.dir.to_string_lossy().to_string();
        if daemons::running(&self.dir, &d.name(), &marker) {
            bail!("{} is already running", d.name());
        }
        self.start_daemon(d, &self.hosts()?)
    }

    /// The process id of a running daemon of the cluster.
    pub fn pid(&self, d: &Daemon) -> Option<i32> {
        let marker = self.dir.to_string_lossy().to_string();
        daemons::running_pid(&self.dir, &d.name(), &marker)
    }

    /// Stops a daemon as an operator's restart does (SIGTERM, SIGKILL after a grace) and
    /// starts it again.
    pub fn restart(&self, d: &Daemon) -> Result<()> {
        self.check_daemon(d)?;
        let marker = self.dir.to_string_lossy().to_string();
        daemons::stop(&self.dir, &d.name(), &marker, STOP_GRACE);
        self.start_daemon(d, &self.hosts()?)
    }

    /// The last `lines` lines of a daemon's log.
    pub fn log_tail(&self, d: &Daemon, lines: usize) -> String {
        let text =
            std::fs::read_to_string(self.dir.join(format!("{}.log", d.name()))).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// `softrnic link HOST up|down`.
    pub fn link(&self, host: &str, up: bool) -> Result<()> {
        self.check_host(host)?;
        run(self
            .softrnic()?
            .args(["link", host, if up { "up" } else { "down" }]))
        .context("softrnic link")
    }

    /// Cuts `host`'s agent off from the coordinator (`cut`), or heals the cut: its datagrams
    /// to the coordinator's port are dropped in its namespace, and the coordinator's to it in
    /// the coordinator's host's, by policy-routing rules (`ip rule … blackhole`), which need
    /// neither netfilter nor a traffic-control classifier, the kernels here having neither.
    /// The NIC's traffic between the hosts flows on. The coordinator's own host cannot be cut
    /// off: its agent reaches it without a network.
    pub fn partition(&self, host: &str, cut: bool) -> Result<()> {
        self.check_host(host)?;
        let hosts = self.hosts()?;
        if hosts[0] == host {
            bail!("{host} runs the coordinator: it cannot be cut off from it");
        }
        let port = COORDINATOR_PORT.to_string();
        let to = format!("{}/32", self.addr(host)?);
        let verb = if cut { "add" } else { "del" };
        let rules: [(&str, Vec<&str>); 2] = [
            (host, vec!["ipproto", "udp", "dport", &port]),
            (&hosts[0], vec!["to", &to, "ipproto", "udp", "sport", &port]),
        ];
        for (on, selector) in rules {
            let mut c = self.on_host(on, Path::new("ip"))?;
            c.args(["rule", verb]).args(&selector).arg("blackhole");
            run(&mut c).with_context(|| format!("ip rule {verb} on {on}"))?;
        }
        Ok(())
    }

    /// The state directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    fn check_daemon(&self, d: &Daemon) -> Result<()> {
        match d {
            Daemon::Agent(h) => self.check_host(h),
            Daemon::Coordinator => self.hosts().map(|_| ()),
        }
    }

    /// The live problem as an instance file (`drum-coordinator snapshot`).
    pub fn snapshot(&self, out: &Path) -> Result<()> {
        let hosts = self.hosts()?;
        let out = std::path::absolute(out)?;
        run(self
            .on_host(&hosts[0], &self.tool("drum-coordinator")?)?
            .args(["snapshot", "--admin", ADMIN, "--out"])
            .arg(&out))
        .context("drum-coordinator snapshot")
    }

    /// Waits until every agent serves its shims and the coordinator counts every host.
    fn wait_ready(&self, layout: &Layout) -> Result<()> {
        let t = Instant::now();
        loop {
            check_interrupted()?;
            let sockets = layout
                .hosts
                .iter()
                .all(|(h, _)| layout.shim_socket(h).exists());
            if sockets && self.members()? == layout.hosts.len() {
                return Ok(());
            }
            if t.elapsed() > READY_TIMEOUT {
                bail!(
                    "the cluster did not come up within {READY_TIMEOUT:?}; logs in {}",
                    self.dir.display()
                );
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The hosts the coordinator counts as members (0 while it does not answer).
    fn members(&self) -> Result<usize> {
        Ok(self
            .status_json()?
            .map_or(0, |s| s["members"].as_array().map_or(0, Vec::len)))
    }

    /// `drum-coordinator status --json`; `None` while the coordinator does not answer.
    pub fn status_json(&self) -> Result<Option<serde_json::Value>> {
        let out = self
            .status_command(true)?
            .stderr(std::process::Stdio::null())
            .output()?;
        if !out.status.success() {
            return Ok(None);
        }
        serde_json::from_slice(&out.stdout)
            .map(Some)
            .context("drum-coordinator status --json printed no JSON")
    }

    fn status_command(&self, json: bool) -> Result<Command> {
        let hosts = self.hosts()?;
        let mut c = self.on_host(&hosts[0], &self.tool("drum-coordinator")?)?;
        c.args(["status", "--admin", ADMIN]);
        if json {
            c.arg("--json");
        }
        Ok(c)
    }

    /// Runs `cmd` on `host` under the shim as app `app`, in place of this process.
    pub fn exec(&self, host: &str, app: &str, cmd: &[String]) -> Result<()> {
        self.check_host(host)?;
        if cmd.is_empty() {
            bail!("no command given (drum-testbed cluster exec --host H --app NAME -- CMD…)");
        }
        let mut c = self.governed(host, app, cmd)?;
        Err(anyhow!("exec softrnic: {}", c.exec()))
    }

    /// `cmd` on `host` as it is (no shim).
    pub fn raw(&self, host: &str, cmd: &[String]) -> Result<Command> {
        let mut c = self.softrnic()?;
        c.args(["exec", "--host", host, "--"])
            .args(cmd)
            .env_remove("LD_PRELOAD");
        Ok(c)
    }

    /// `cmd` on `host` under the shim as app `app`, governed by the host's agent.
    pub fn governed(&self, host: &str, app: &str, cmd: &[String]) -> Result<Command> {
        let shim = self.tool("libdrum_shim.so")?;
        let preload = match std::env::var("LD_PRELOAD") {
            Ok(p) if !p.is_empty() => format!("{} {p}", shim.display()),
            _ => shim.display().to_string(),
        };
        let mut c = self.raw(host, cmd)?;
        c.env("LD_PRELOAD", preload)
            .env("DRUM_AGENT_SOCKET", self.dir.join(host).join("shim.sock"))
            .env("DRUM_APP", app);
        Ok(c)
    }

    /// What host `host`'s NIC engine has logged so far (empty if there is no log).
    pub fn engine_log(&self, host: &str) -> String {
        let path = self
            .softrnic_dir()
            .join("hosts")
            .join(host)
            .join("engine.log");
        std::fs::read_to_string(path).unwrap_or_default()
    }

    /// `softrnic stats HOST` as name → value.
    pub fn stats(&self, host: &str) -> Result<std::collections::BTreeMap<String, f64>> {
        Ok(self
            .stats_text(host)?
            .lines()
            .filter_map(|l| {
                let mut f = l.split_whitespace();
                Some((f.next()?.to_string(), f.next()?.parse().ok()?))
            })
            .collect())
    }

    /// `softrnic stats HOST` as printed (the counters, and AUSS's timeline: `auss_log` lines).
    pub fn stats_text(&self, host: &str) -> Result<String> {
        let out = self.softrnic()?.args(["stats", host]).output()?;
        if !out.status.success() {
            bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Sets every host NIC's congestion settings — how it answers ECN-marked packets
    /// (`softrnic receiver`: `dcqcn` or `dart`) and whether it caps its QPs at the `R/N` its
    /// destinations stamp (`softrnic dasr`) — and waits until each engine's stats show them
    /// (`dart_receiver`, `dasr_caps`), at most 3 s.
    pub fn set_congestion(&self, receiver: &str, dasr_caps: bool) -> Result<()> {
        let dasr = if dasr_caps { "on" } else { "off" };
        let want = [
            ("dart_receiver", f64::from(u8::from(receiver == "dart"))),
            ("dasr_caps", f64::from(u8::from(dasr_caps))),
        ];
        let hosts = self.hosts()?;
        for h in &hosts {
            for args in [["receiver", h, receiver], ["dasr", h, dasr]] {
                let out = self.softrnic()?.args(args).output()?;
                if !out.status.success() {
                    bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
                }
            }
        }
        let deadline = Instant::now() + Duration::from_secs(3);
        for h in &hosts {
            loop {
                let stats = self.stats(h)?;
                if want.iter().all(|(k, v)| stats.get(*k) == Some(v)) {
                    break;
                }
                if Instant::now() > deadline {
                    bail!("{h}'s NIC did not take receiver {receiver}, dasr {dasr} within 3 s");
                }
                std::thread::sleep(Duration::from_millis(50));
            }
        }
        Ok(())
    }

    /// Host `host`'s address.
    pub fn addr(&self, host: &str) -> Result<Ipv4Addr> {
        let out = self.softrnic()?.args(["addr", host]).output()?;
        if !out.status.success() {
            bail!("{}", String::from_utf8_lossy(&out.stderr).trim());
        }
        let text = String::from_utf8_lossy(&out.stdout);
        text.trim()
            .parse()
            .with_context(|| format!("softrnic addr {host} printed {text:?}"))
    }

    /// The coordinator's view (`drum-coordinator status`), in place of this process.
    pub fn status(&self, json: bool) -> Result<()> {
        let mut c = self.status_command(json)?;
        Err(anyhow!("exec softrnic: {}", c.exec()))
    }

    /// Stops the agents and the coordinator, removes the hosts and the state directory.
    /// Does what it can of a cluster left half up, and succeeds on one already down.
    pub fn down(&self) -> Result<()> {
        if !self.dir.exists() {
            return Ok(());
        }
        let marker = self.dir.to_string_lossy().to_string();
        // Programs `exec` started (their shim's agent socket is in this directory) would
        // outlive their hosts otherwise.
        daemons::kill_marked_env(&format!("DRUM_AGENT_SOCKET={marker}/"));
        let hosts = self.hosts().unwrap_or_default();
        for h in &hosts {
            daemons::stop(&self.dir, &format!("agent-{h}"), &marker, STOP_GRACE);
        }
        daemons::stop(&self.dir, "coordinator", &marker, STOP_GRACE);
        if self.softrnic_dir().exists() {
            run(self.softrnic()?.arg("down")).context("softrnic down")?;
        }
        std::fs::remove_dir_all(&self.dir)
            .with_context(|| format!("removing {}", self.dir.display()))
    }
}

/// Runs `cmd` to completion; its output is shown only if it fails.
fn run(cmd: &mut Command) -> Result<()> {
    let out = cmd
        .output()
        .with_context(|| format!("running {:?}", cmd.get_program()))?;
    if !out.status.success() {
        bail!(
            "{:?} failed ({}): {}{}",
            cmd.get_program(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(())
}
