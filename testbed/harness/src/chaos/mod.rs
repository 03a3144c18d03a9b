//! `drum-testbed chaos`: a fault soak of a whole DRUM cluster. Three emulated hosts run a
//! coordinator (on h1), an agent each and unmodified applications under the shim, while a
//! seeded schedule ([`schedule`]) kills, stops and restarts the daemons, flaps the hosts'
//! NIC links and makes the agents' rate-table writes fail. Every [`TICK`] the driver checks
//! the invariants ([`invariants`]) and stops at the first broken one, naming it:
//!
//! - `fail-static`: while no coordinator is reachable, no agent changes a grant in its
//!   shared-memory tables;
//! - `service-exit`: no daemon exits unless the schedule stopped it (a supervisor would
//!   restart it, and a daemon that exits by itself is what crash-loops);
//! - `app-stall` / `app-exit`: every application keeps making progress and keeps running;
//! - `data-loss`: the key-value client read every value intact (checksums) and failed no
//!   operation;
//! - `reconvergence`: after the last fault every host is a member again and every sending
//!   app holds a steady grant within [`RECONVERGE_LIMIT`];
//! - `panic`, `protocol`: no daemon's log shows a panic, nor a connection the coordinator
//!   closed as a protocol violation.

mod invariants;
mod schedule;
mod tables;
mod workload;

use crate::cluster::{catch_interrupts, interrupted, Cluster, Daemon};
use crate::configs::Layout;
use crate::programs::load_average;
use anyhow::{anyhow, bail, Context, Result};
use invariants::{changed_grant, describe, rates, steady, unsettled, Grants, Progress, Rates};
use schedule::{Kind, Step, Target};
use serde_json::json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};
use workload::Workload;

pub struct ChaosOptions {
    /// How long faults are injected.
    pub minutes: f64,
    pub seed: u64,
    /// Where to write the figures as JSON.
    pub json: Option<PathBuf>,
}

const HOSTS: usize = 3;
/// The emulated NICs' line rate: low, so the applications do not take the machine's cores
/// from the daemons (two cores are shared by everything here).
const LINE_RATE_GBPS: f64 = 1.0;
/// How often the invariants are checked.
const TICK: Duration = Duration::from_millis(250);
/// A grant may still change this long after the coordinator went away: a round it sent just
/// before (rounds run every few ms) may be on its way. 1 s is 100 rounds' worth.
const GRACE: Duration = Duration::from_secs(1);
/// After an agent's set of tables changed (a shim registered or left, the agent restarted),
/// its grants settle for this long before they are held still: registering one process
/// reshares the host's QP budget among all of them.
const SETTLE: Duration = Duration::from_secs(1);
/// The longest an application's progress may stand still. Its longest legitimate pause:
/// a stopped agent holds its shims for the shim's 2 s heartbeat timeout, a link flap of
/// 300 ms costs retransmissions; the rest is margin for a loaded 2-core machine, where one
/// second's report can come late.
const STALL_LIMIT: Duration = Duration::from_secs(15);
/// How long a daemon may seem gone before it counts as exited (see `check_daemons`).
const EXEC_GAP: Duration = Duration::from_secs(1);
/// How long a daemon may take to die of SIGKILL: its exit runs at its own niceness, which
/// on a loaded machine took over 0.4 s (a restart 0.44 s after a kill found it running).
const DEATH_LIMIT: Duration = Duration::from_secs(10);
/// How long the cluster has to settle at the start, and again after the last fault.
const CONVERGE_LIMIT: Duration = Duration::from_secs(60);
const RECONVERGE_LIMIT: Duration = Duration::from_secs(40);
/// Two readings of the grants this far apart that agree within [`STEADY_TOLERANCE`] make a
/// settled allocation.
const STEADY_GAP: Duration = Duration::from_secs(1);
const STEADY_TOLERANCE: f64 = 0.05;
/// How long the key-value client may take to finish its operations in flight and print its
/// summary once asked to stop (SIGINT) after reconvergence.
const KV_FINISH: Duration = Duration::from_secs(30);

/// A broken invariant: its name and what was seen.
fn broken(invariant: &str, detail: impl std::fmt::Display) -> anyhow::Error {
    anyhow!("invariant broken: {invariant}: {detail}")
}

/// Runs the soak in state directory `dir`; `Err` names the first broken invariant.
pub fn run(dir: &Path, o: &ChaosOptions) -> Result<()> {
    if !(o.minutes.is_finite() && o.minutes > 0.0 && o.minutes <= 24.0 * 60.0) {
        bail!("--minutes must be in (0, 1440], got {}", o.minutes);
    }
    // SAFETY: geteuid has no preconditions.
    if unsafe { libc::geteuid() } != 0 {
        bail!("the chaos soak needs root (network namespaces for the emulated hosts)");
    }
    let period = Duration::from_secs_f64(o.minutes * 60.0);
    let plan = schedule::plan(o.seed, period, HOSTS);
    let cluster = Cluster::new(dir)?;
    cluster.bring_up(HOSTS, LINE_RATE_GBPS, &[], true)?;
    catch_interrupts();
    let down = TearDown(&cluster);
    let r = soak(&cluster, o, period, &plan);
    if r.is_err() {
        down.keep_logs();
    }
    r
}

/// The soak on a cluster that is up.
fn soak(
    cluster: &Cluster,
    o: &ChaosOptions,
    period: Duration,
    plan: &[schedule::Fault],
) -> Result<()> {
    // The client runs until it is stopped after reconvergence: a fixed run, counted from its
    // start, ended before the faults did when the first settling was slow (49 s in CI). Its
    // own duration, every limit put together, is only the backstop.
    let longest = CONVERGE_LIMIT + period + RECONVERGE_LIMIT + KV_FINISH;
    let mut work = Workload::start(cluster, longest.as_secs())?;
    let r = soak_with(cluster, &mut work, o, period, plan);
    if r.is_err() {
        let keep = logs_dir(cluster.dir());
        let _ = std::fs::create_dir_all(&keep);
        for a in &work.apps {
            let _ = std::fs::write(keep.join(format!("app-{}.log", a.name)), a.tail(usize::MAX));
        }
    }
    r
}

/// The soak with the workload running.
fn soak_with(
    cluster: &Cluster,
    work: &mut Workload,
    o: &ChaosOptions,
    period: Duration,
    plan: &[schedule::Fault],
) -> Result<()> {
    let load_before = load_average();
    let t0 = Instant::now();
    let first = settle(cluster, work, CONVERGE_LIMIT)
        .map_err(|e| broken("convergence", format!("before any fault: {e}")))?;
    println!(
        "chaos: cluster settled in {:.1} s; {} faults over {:.0} s (seed {})",
        first.as_secs_f64(),
        plan.len(),
        period.as_secs_f64(),
        o.seed
    );
    let mut soak = Soak::new(cluster);
    soak.run(&schedule::steps(plan), period, work)?;
    let reconverged =
        settle(cluster, work, RECONVERGE_LIMIT).map_err(|e| broken("reconvergence", e))?;
    println!(
        "chaos: reconverged {:.1} s after the last fault",
        reconverged.as_secs_f64()
    );
    check_logs(cluster)?;
    let kv = work
        .stop_kv(KV_FINISH)
        .map_err(|e| broken("data-loss", format!("{e}\n{}", grants_now(cluster))))?;
    let bulk = work
        .apps
        .iter_mut()
        .find(|a| a.name == "bulk")
        .expect("the workload has a bulk writer");
    if let Some(s) = bulk.exited() {
        return Err(broken(
            "app-exit",
            format!("bulk on h2 exited with {s}:\n{}", bulk.tail(20)),
        ));
    }
    let figures = json!({
        "seed": o.seed,
        "minutes": o.minutes,
        "faults": plan.len(),
        "faults_by_kind": soak.by_kind,
        "settled_s": first.as_secs_f64(),
        "reconverged_s": reconverged.as_secs_f64(),
        // The period's end may come a few seconds after the last fault was undone.
        "reconverged_since_last_undo_s": reconverged.as_secs_f64()
            + (period - plan.iter().map(|f| f.ends()).max().unwrap_or_default()).as_secs_f64(),
        "reconverge_limit_s": RECONVERGE_LIMIT.as_secs_f64(),
        "fail_static_windows": soak.windows,
        "fail_static_checked_s": soak.checked.as_secs_f64(),
        "fail_static_table_reads": soak.reads,
        "longest_stall_s": soak.stalls.iter().map(|(k, p)| (k.clone(), p.longest_stall.as_secs_f64())).collect::<BTreeMap<_, _>>(),
        "stall_limit_s": STALL_LIMIT.as_secs_f64(),
        "kv_ops": kv["ops"],
        "kv_errors": kv["errors"],
        "load_average": [load_before, load_average()],
        "wall_s": t0.elapsed().as_secs_f64(),
    });
    println!("{}", serde_json::to_string_pretty(&figures)?);
    if let Some(p) = &o.json {
        std::fs::write(p, serde_json::to_string_pretty(&figures)? + "\n")
            .with_context(|| format!("writing {}", p.display()))?;
    }
    println!("chaos: every invariant held");
    Ok(())
}

/// Takes the cluster down however the soak ends (an error, a broken invariant, Ctrl-C).
struct TearDown<'a>(&'a Cluster);

impl TearDown<'_> {
    /// Copies the daemons' logs to `DIR.logs` (the state directory goes with the cluster),
    /// for the post-mortem of a broken invariant.
    fn keep_logs(&self) {
        let dir = self.0.dir();
        let keep = logs_dir(dir);
        let _ = std::fs::create_dir_all(&keep);
        for e in std::fs::read_dir(dir).into_iter().flatten().flatten() {
            if e.path().extension().is_some_and(|x| x == "log") {
                let _ = std::fs::copy(e.path(), keep.join(e.file_name()));
            }
        }
        eprintln!(
            "drum-testbed chaos: the daemons' logs are in {}",
            keep.display()
        );
    }
}

impl Drop for TearDown<'_> {
    fn drop(&mut self) {
        if let Err(e) = self.0.down() {
            eprintln!("drum-testbed chaos: cluster down: {e:#}");
        }
    }
}

/// Where a failed soak keeps the daemons' and applications' logs: `DIR.logs`.
fn logs_dir(dir: &Path) -> PathBuf {
    let mut keep = dir.as_os_str().to_owned();
    keep.push(".logs");
    PathBuf::from(keep)
}

/// Waits until every host is a member and every sending app holds a steady grant; how long
/// that took.
fn settle(cluster: &Cluster, work: &mut Workload, limit: Duration) -> Result<Duration> {
    let t = Instant::now();
    let mut last: Option<(Instant, Rates)> = None;
    let mut why = String::from("the coordinator did not answer");
    while t.elapsed() < limit {
        if interrupted() {
            bail!("interrupted");
        }
        // Apps that finished by themselves (the key-value client at its end) are not waited
        // for; one that failed is reported by the checks that follow.
        let running: Vec<(&str, &str)> = work
            .apps
            .iter_mut()
            .filter_map(|a| a.exited().is_none().then_some((a.host, a.name)))
            .collect();
        let senders: Vec<(&str, &str)> = work
            .senders()
            .into_iter()
            .filter(|s| running.contains(s))
            .collect();
        if let Some(status) = cluster.status_json()? {
            match unsettled(&status, HOSTS, &running, &senders) {
                Some(w) => {
                    if w != why {
                        // What it waits for, as it changes: a slow settling says why.
                        println!("chaos: {:5.1} s  waiting: {w}", t.elapsed().as_secs_f64());
                    }
                    why = w;
                    last = None;
                }
                None => {
                    let now = rates(&status);
                    match &last {
                        Some((at, before)) if at.elapsed() >= STEADY_GAP => {
                            if steady(before, &now, STEADY_TOLERANCE) {
                                return Ok(t.elapsed());
                            }
                            why = format!("grants still moving: {before:?} then {now:?}");
                            last = Some((Instant::now(), now));
                        }
                        Some(_) => {}
                        None => last = Some((Instant::now(), now)),
                    }
                }
            }
        }
        std::thread::sleep(Duration::from_millis(250));
    }
    bail!("not settled within {limit:?}: {why}")
}

/// A fail-static window: the coordinator is unreachable (down, or cut off by a partition),
/// and each agent it covers has its grants held against a baseline.
struct Window {
    since: Instant,
    /// Per host: the agent's pid, when its set of tables last changed, and its grants.
    baselines: BTreeMap<usize, (i32, Instant, Grants)>,
}

impl Window {
    fn new() -> Window {
        Window {
            since: Instant::now(),
            baselines: BTreeMap::new(),
        }
    }
}

/// The soak's state while faults run.
struct Soak<'a> {
    cluster: &'a Cluster,
    /// Daemons the schedule has killed and not yet started again.
    killed: Vec<Daemon>,
    /// Daemons the schedule has stopped (SIGSTOP) and not yet continued.
    stopped: Vec<Daemon>,
    /// While the coordinator is down: every agent's grants are held.
    window: Option<Window>,
    /// Per host cut off from the coordinator by a partition: its agent's grants are held.
    cut_off: BTreeMap<usize, Window>,
    /// Daemons found not running, since when.
    missing: BTreeMap<String, Instant>,
    windows: u64,
    checked: Duration,
    reads: u64,
    stalls: BTreeMap<String, Progress>,
    by_kind: BTreeMap<String, u64>,
}

fn daemon(t: Target) -> Daemon {
    match t {
        Target::Coordinator => Daemon::Coordinator,
        Target::Agent(h) | Target::Link(h) | Target::Table(h) | Target::Control(h) => {
            Daemon::Agent(host(h))
        }
    }
}

fn host(i: usize) -> String {
    format!("h{}", i + 1)
}

impl<'a> Soak<'a> {
    fn new(cluster: &'a Cluster) -> Self {
        Soak {
            cluster,
            killed: Vec::new(),
            stopped: Vec::new(),
            window: None,
            cut_off: BTreeMap::new(),
            missing: BTreeMap::new(),
            windows: 0,
            checked: Duration::ZERO,
            reads: 0,
            stalls: BTreeMap::new(),
            by_kind: BTreeMap::new(),
        }
    }

    fn run(&mut self, steps: &[Step], period: Duration, work: &mut Workload) -> Result<()> {
        let start = Instant::now();
        for a in work.apps.iter().filter(|a| a.watched) {
            self.stalls.insert(
                format!("{}@{}", a.name, a.host),
                Progress::new(Duration::ZERO),
            );
        }
        let mut next = 0;
        while start.elapsed() < period || next < steps.len() {
            if interrupted() {
                bail!("interrupted");
            }
            while next < steps.len() && steps[next].at <= start.elapsed() {
                self.apply(&steps[next])?;
                next += 1;
            }
            self.check_daemons()?;
            self.check_fail_static()?;
            self.check_apps(start.elapsed(), work)?;
            std::thread::sleep(TICK);
        }
        Ok(())
    }

    fn apply(&mut self, s: &Step) -> Result<()> {
        let f = s.fault;
        let d = daemon(f.target);
        let label = format!("{:?} {:?}", f.kind, f.target);
        if !s.undo {
            *self.by_kind.entry(format!("{:?}", f.kind)).or_default() += 1;
            println!(
                "chaos: {:6.1} s  {label} for {:.2} s",
                f.at.as_secs_f64(),
                f.lasts.as_secs_f64()
            );
        }
        match (f.kind, s.undo) {
            (Kind::Kill, false) => {
                self.signal(&d, libc::SIGKILL)?;
                self.await_death(&d)?;
                self.killed.push(d);
            }
            (Kind::Kill, true) => {
                self.killed.retain(|k| *k != d);
                self.missing.remove(&d.name());
                self.cluster.start(&d)?;
            }
            (Kind::Stop, false) => {
                self.signal(&d, libc::SIGSTOP)?;
                self.stopped.push(d);
            }
            (Kind::Stop, true) => {
                self.signal(&d, libc::SIGCONT)?;
                self.stopped.retain(|k| *k != d);
            }
            (Kind::Restart, _) => self.cluster.restart(&d)?,
            (Kind::LinkFlap, undo) => self.cluster.link(&host(host_of(f.target)), undo)?,
            (Kind::TableBlock, false) => block_table(&self.table_tmp(f.target))?,
            (Kind::TableBlock, true) => std::fs::remove_dir(self.table_tmp(f.target))
                .context("removing the rate table's blocker")?,
            (Kind::Partition, undo) => {
                let h = host_of(f.target);
                self.cluster.partition(&host(h), !undo)?;
                if undo {
                    if let Some(w) = self.cut_off.remove(&h) {
                        self.windows += 1;
                        self.checked += w.since.elapsed().saturating_sub(GRACE);
                    }
                } else {
                    self.cut_off.insert(h, Window::new());
                }
            }
        }
        let down = self
            .killed
            .iter()
            .chain(&self.stopped)
            .any(|d| *d == Daemon::Coordinator);
        match (&self.window, down) {
            (None, true) => self.window = Some(Window::new()),
            (Some(w), false) => {
                self.windows += 1;
                self.checked += w.since.elapsed().saturating_sub(GRACE);
                self.window = None;
            }
            _ => {}
        }
        Ok(())
    }

    fn table_tmp(&self, t: Target) -> PathBuf {
        let mut p = Layout::rate_table(self.cluster.dir(), &host(host_of(t))).into_os_string();
        p.push(".tmp");
        PathBuf::from(p)
    }

    fn signal(&self, d: &Daemon, sig: libc::c_int) -> Result<()> {
        let pid = self
            .cluster
            .pid(d)
            .ok_or_else(|| broken("service-exit", format!("{} is not running", d.name())))?;
        // SAFETY: signalling a daemon of this cluster (its pid file and command line say so).
        unsafe { libc::kill(pid, sig) };
        Ok(())
    }

    /// Waits until a killed daemon is gone, so that starting it again starts a new one.
    fn await_death(&self, d: &Daemon) -> Result<()> {
        let t = Instant::now();
        while self.cluster.pid(d).is_some() {
            if t.elapsed() > DEATH_LIMIT {
                bail!("{} still runs {DEATH_LIMIT:?} after SIGKILL", d.name());
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    /// Every daemon the schedule has not killed runs. One missing for less than
    /// [`EXEC_GAP`] may be between the `exec`s that start it (`softrnic exec`, then the
    /// daemon), when its command line reads empty.
    fn check_daemons(&mut self) -> Result<()> {
        let all =
            std::iter::once(Daemon::Coordinator).chain((0..HOSTS).map(|h| Daemon::Agent(host(h))));
        for d in all {
            if self.killed.contains(&d) || self.cluster.pid(&d).is_some() {
                self.missing.remove(&d.name());
                continue;
            }
            let since = *self.missing.entry(d.name()).or_insert_with(Instant::now);
            if since.elapsed() >= EXEC_GAP {
                return Err(broken(
                    "service-exit",
                    format!(
                        "{} exited by itself; its log ends:\n{}",
                        d.name(),
                        self.cluster.log_tail(&d, 15)
                    ),
                ));
            }
        }
        Ok(())
    }

    /// While the coordinator is down, every agent's grants stay as they were; while a host is
    /// cut off from it, that host's do.
    fn check_fail_static(&mut self) -> Result<()> {
        if let Some(w) = &mut self.window {
            let why = "after the coordinator went away";
            hold(self.cluster, &mut self.reads, w, 0..HOSTS, why)?;
        }
        for (h, w) in &mut self.cut_off {
            let why = "after it was cut off from the coordinator";
            hold(self.cluster, &mut self.reads, w, [*h], why)?;
        }
        Ok(())
    }

    fn check_apps(&mut self, now: Duration, work: &mut Workload) -> Result<()> {
        // Every app that is gone is named: a server whose client died exits too, and the
        // client's last words are the cause.
        let mut gone = Vec::new();
        for a in &mut work.apps {
            if let Some(s) = a.exited() {
                gone.push(format!(
                    "{} on {} exited with {s}:\n{}",
                    a.name,
                    a.host,
                    a.tail(20)
                ));
            }
        }
        if !gone.is_empty() {
            return Err(broken(
                "app-exit",
                format!("{}\n{}", gone.join("\n"), grants_now(self.cluster)),
            ));
        }
        for a in &mut work.apps {
            if let Some(p) = self.stalls.get_mut(&format!("{}@{}", a.name, a.host)) {
                p.observe(now, a.progress.load(Relaxed));
                if p.stalled(now) > STALL_LIMIT {
                    return Err(broken(
                        "app-stall",
                        format!(
                            "{} on {} made no progress for {:.1} s:\n{}\n{}",
                            a.name,
                            a.host,
                            p.stalled(now).as_secs_f64(),
                            a.tail(10),
                            grants_now(self.cluster)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// What the daemons' logs must not say, with the invariant it breaks: a panic, or the
/// coordinator closing an agent's connection as a protocol violation (QUIC code 1), which
/// a well-behaved agent never commits, faults or not.
const LOG_FAULTS: [(&str, &str); 2] = [("panicked", "panic"), ("(code 1)", "protocol")];

/// Checks every daemon's log (kept across its restarts) for [`LOG_FAULTS`].
fn check_logs(cluster: &Cluster) -> Result<()> {
    let all =
        std::iter::once(Daemon::Coordinator).chain((0..HOSTS).map(|h| Daemon::Agent(host(h))));
    for d in all {
        let log = std::fs::read_to_string(cluster.dir().join(format!("{}.log", d.name())))
            .unwrap_or_default();
        for (pattern, invariant) in LOG_FAULTS {
            if let Some(line) = log.lines().find(|l| l.contains(pattern)) {
                return Err(broken(invariant, format!("{}: {line}", d.name())));
            }
        }
    }
    Ok(())
}

/// Every agent's grants now, for the report of an application that stalled or failed:
/// whether DRUM held it back.
fn grants_now(cluster: &Cluster) -> String {
    let mut out = String::from("the agents' grants now:");
    for h in 0..HOSTS {
        let Some(pid) = cluster.pid(&Daemon::Agent(host(h))) else {
            out.push_str(&format!("\n  {}: no agent", host(h)));
            continue;
        };
        for (table, g) in tables::grants(pid) {
            out.push_str(&format!("\n  {} {table}: {}", host(h), describe(&g)));
        }
    }
    out
}

/// Checks that the agents of `hosts` kept their grants since `w` began (after [`GRACE`], and
/// [`SETTLE`] after their set of tables changed): fail-static, byte for byte.
fn hold(
    cluster: &Cluster,
    reads: &mut u64,
    w: &mut Window,
    hosts: impl IntoIterator<Item = usize>,
    why: &str,
) -> Result<()> {
    if w.since.elapsed() < GRACE {
        return Ok(());
    }
    for h in hosts {
        let Some(pid) = cluster.pid(&Daemon::Agent(host(h))) else {
            w.baselines.remove(&h);
            continue;
        };
        let now = tables::grants(pid);
        *reads += 1;
        let rebase = match w.baselines.get(&h) {
            None => true,
            Some((p, changed, before)) => {
                *p != pid || !before.keys().eq(now.keys()) || changed.elapsed() < SETTLE
            }
        };
        if rebase {
            let changed = match w.baselines.get(&h) {
                Some((p, c, before)) if *p == pid && before.keys().eq(now.keys()) => *c,
                _ => Instant::now(),
            };
            w.baselines.insert(h, (pid, changed, now));
            continue;
        }
        let before = &w.baselines[&h].2;
        if let Some(t) = changed_grant(before, &now) {
            return Err(broken(
                "fail-static",
                format!(
                    "{}'s agent changed the grant of {t} {:.1} s {why}: {} -> {}",
                    host(h),
                    w.since.elapsed().as_secs_f64(),
                    describe(&before[t]),
                    describe(&now[t])
                ),
            ));
        }
    }
    Ok(())
}

fn host_of(t: Target) -> usize {
    match t {
        Target::Coordinator => 0,
        Target::Agent(h) | Target::Link(h) | Target::Table(h) | Target::Control(h) => h,
    }
}

/// Puts a directory where the agent writes its table's temporary file, so that creating it
/// fails. A temporary file already there is removed first: one a killed agent left behind
/// stays for ever, and one being written makes that write fail, which is the fault anyway.
fn block_table(tmp: &Path) -> Result<()> {
    for _ in 0..50 {
        match std::fs::create_dir(tmp) {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {
                let _ = std::fs::remove_file(tmp);
            }
            Err(e) => return Err(e).with_context(|| format!("creating {}", tmp.display())),
        }
    }
    bail!("{} stayed taken", tmp.display())
}
