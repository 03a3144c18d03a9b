//! `drum-testbed run`: every run of the scenarios asked for, modes interleaved within each
//! repeat, each seeded and kept as raw data; resumable (a run whose record exists is not
//! run again) and interruptible (Ctrl-C tears the hosts down and keeps what finished).

use crate::cluster::{catch_interrupts, interrupted, Cluster};
use crate::host_cpu;
use crate::profile::Profile;
use crate::programs::load_average;
use crate::record::RunRecord;
use crate::scenarios::{self, Mode, RunCtx, Scenario, Setup};
use anyhow::{anyhow, bail, Context, Result};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Instant, SystemTime, UNIX_EPOCH};

pub struct RunOptions {
    pub scenarios: Vec<String>,
    pub modes: Vec<Mode>,
    pub profile: Profile,
    pub repeats: Option<u32>,
    pub seed: u64,
    pub out: PathBuf,
}

/// One run to do.
struct Planned {
    scenario: usize,
    repeat: u32,
    x: f64,
    series: &'static str,
}

/// The order of the runs: per scenario, repeat after repeat, and within a repeat every point
/// with every series (mode) one after the other, so that slow drift on a shared machine
/// touches every mode alike.
fn plan(scenarios: &[Scenario], modes: &[Mode], profile: Profile, repeats: u32) -> Vec<Planned> {
    let mut v = Vec::new();
    for (i, s) in scenarios.iter().enumerate() {
        for repeat in 0..repeats {
            for x in (s.xs)(profile) {
                for series in (s.series)(modes) {
                    v.push(Planned {
                        scenario: i,
                        repeat,
                        x,
                        series,
                    });
                }
            }
        }
    }
    v
}

/// A run's seed: the run's seed mixed with where the run is, so every run differs and a
/// rerun of the same point repeats it.
fn run_seed(seed: u64, scenario: &str, series: &str, x: f64, repeat: u32) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325 ^ seed;
    let key = format!("{scenario}/{series}/{x}/{repeat}");
    for b in key.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// Whether `out` already has a successful record of this run.
fn done(out: &Path, s: &Scenario, p: &Planned) -> bool {
    let path = RunRecord::path(out, s.name, p.series, p.x, p.repeat);
    std::fs::read(path)
        .ok()
        .and_then(|b| serde_json::from_slice::<RunRecord>(&b).ok())
        .is_some_and(|r| !r.flags.iter().any(|f| f.starts_with("failed")))
}

pub fn run(opts: &RunOptions) -> Result<()> {
    let scenarios = opts
        .scenarios
        .iter()
        .map(|n| {
            scenarios::find(n).ok_or_else(|| {
                let names: Vec<_> = scenarios::all().iter().map(|s| s.name).collect();
                anyhow!("no scenario {n:?} (scenarios: {})", names.join(", "))
            })
        })
        .collect::<Result<Vec<_>>>()?;
    if scenarios.is_empty() {
        bail!("no scenario given (drum-testbed list shows them)");
    }
    if opts.modes.is_empty() {
        bail!("--modes is empty");
    }
    let repeats = opts.repeats.unwrap_or(opts.profile.default_repeats());
    if !(1..=100).contains(&repeats) {
        bail!("--repeats must be 1 to 100, got {repeats}");
    }
    std::fs::create_dir_all(&opts.out)
        .with_context(|| format!("creating {}", opts.out.display()))?;
    crate::meta::write_or_check(&opts.out, opts.profile, opts.seed)?;
    catch_interrupts();
    let todo = plan(&scenarios, &opts.modes, opts.profile, repeats);
    let total = todo.len();
    let pending: Vec<&Planned> = todo
        .iter()
        .filter(|p| !done(&opts.out, &scenarios[p.scenario], p))
        .collect();
    println!(
        "{} runs, {} already in {}",
        total,
        total - pending.len(),
        opts.out.display()
    );
    let started = Instant::now();
    let mut finished = 0usize;
    let mut by_scenario: BTreeMap<usize, Vec<&Planned>> = BTreeMap::new();
    for p in pending.iter().copied() {
        by_scenario.entry(p.scenario).or_default().push(p);
    }
    let left = pending.len();
    for (i, runs) in by_scenario {
        let s = &scenarios[i];
        let cluster = Hosts::up(&opts.out, s, &opts.modes, opts.profile)?;
        for p in runs {
            if interrupted() {
                bail!("interrupted; `run` again with the same --out resumes");
            }
            let t = Instant::now();
            let rec = one(&cluster.0, s, p, opts)?;
            rec.write(&opts.out)?;
            finished += 1;
            let per = started.elapsed().as_secs_f64() / finished as f64;
            println!(
                "[{}/{}] {} {} x={} r{}: {:.1} s{}; elapsed {:.0} s, about {:.0} s left",
                total - left + finished,
                total,
                s.name,
                p.series,
                p.x,
                p.repeat,
                t.elapsed().as_secs_f64(),
                if rec.flags.is_empty() {
                    String::new()
                } else {
                    format!(" [{}]", rec.flags.join("; "))
                },
                started.elapsed().as_secs_f64(),
                per * (left - finished) as f64,
            );
        }
    }
    crate::report::build(&opts.out)
}

/// Every host's NIC counters (those not zero) and what its engine logged about stalled QPs,
/// so that a failed run says what its NICs were doing: retransmissions, pauses, drops, QPs
/// with work that made no progress.
fn engine_counters(cluster: &Cluster) -> Vec<String> {
    let hosts = std::fs::read_to_string(cluster.dir().join("hosts")).unwrap_or_default();
    let mut out = Vec::new();
    for h in hosts.split_whitespace() {
        out.push(match cluster.stats(h) {
            Ok(c) => {
                let set: Vec<String> = c
                    .iter()
                    .filter(|(_, v)| **v != 0.0)
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect();
                format!(
                    "engine counters of {h} after the failure: {}",
                    set.join(" ")
                )
            }
            Err(e) => format!("engine counters of {h}: {e:#}"),
        });
        let log = cluster.engine_log(h);
        let stalls: Vec<&str> = log
            .lines()
            .filter(|l| l.starts_with("softrnic engine: "))
            .collect();
        if !stalls.is_empty() {
            let last = &stalls[stalls.len().saturating_sub(40)..];
            out.push(format!("engine of {h}: {}", last.join("; ")));
        }
    }
    out
}

/// One run, measured and recorded; a failed run is recorded as such (and run again by a
/// later `run`), an interrupted one is not recorded at all.
fn one(cluster: &Cluster, s: &Scenario, p: &Planned, opts: &RunOptions) -> Result<RunRecord> {
    let seed = run_seed(opts.seed, s.name, p.series, p.x, p.repeat);
    let ctx = RunCtx {
        cluster,
        profile: opts.profile,
        seed,
    };
    let load_before = load_average();
    let cpu_before = host_cpu::CpuTimes::now();
    let started_unix_s = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64());
    let t = Instant::now();
    let attempt = || (s.run)(&ctx, p.series, p.x).and_then(finite);
    let mut result = attempt();
    let mut retried = false;
    // One failed measurement is taken again before the run counts as failed: on this
    // machine perftest's CPU-clock fit fails now and then under load, which says nothing
    // about the NICs (a CI smoke run, 2026-11-27: fig2a's foreground timed nothing).
    if let Err(e) = &result {
        if !interrupted() {
            eprintln!(
                "{} {} x={} r{}: {e:#}; measuring again",
                s.name, p.series, p.x, p.repeat
            );
            retried = true;
            result = attempt();
        }
    }
    if interrupted() {
        bail!("interrupted; `run` again with the same --out resumes");
    }
    let elapsed_s = t.elapsed().as_secs_f64();
    let load_after = load_average();
    let mut m = result.unwrap_or_else(|e| {
        let mut m = scenarios::Measured::default();
        m.flags.push(format!("failed: {e:#}"));
        m.flags.extend(engine_counters(cluster));
        m
    });
    if retried {
        m.flags
            .push("measured twice (the first attempt failed)".into());
    }
    // More runnable threads than cores before the run started: something else competed.
    if load_before > cores() {
        m.flags.push(format!("under load ({load_before:.2})"));
    }
    let cpu_busy = cpu_before
        .zip(host_cpu::CpuTimes::now())
        .and_then(|(a, b)| host_cpu::busy(a, b));
    if let Some(b) = cpu_busy {
        m.mechanism.insert("host_cpu_busy".into(), b);
        if b >= host_cpu::SATURATED {
            m.flags
                .push(format!("CPU saturated ({:.0} % busy)", b * 100.0));
        }
    }
    Ok(RunRecord {
        scenario: s.name.into(),
        series: p.series.into(),
        x: p.x,
        repeat: p.repeat,
        seed,
        started_unix_s,
        elapsed_s,
        load_before,
        load_after,
        flags: m.flags,
        metrics: m.metrics,
        mechanism: m.mechanism,
        samples: m.samples,
    })
}

/// A measurement whose every value can be recorded: a NaN or infinity would be written as
/// `null`, and the run's file could not be read back.
fn finite(m: scenarios::Measured) -> Result<scenarios::Measured> {
    for (k, v) in m.metrics.iter().chain(&m.mechanism) {
        if !v.is_finite() {
            bail!("{k} is not a number ({v})");
        }
    }
    Ok(m)
}

fn cores() -> f64 {
    std::thread::available_parallelism().map_or(1.0, |n| n.get() as f64)
}

/// The emulated hosts of one scenario, on the dilated NIC; torn down when dropped (also
/// on an error or an interruption).
struct Hosts(Cluster);

impl Hosts {
    fn up(out: &Path, s: &Scenario, modes: &[Mode], profile: Profile) -> Result<Hosts> {
        let cluster = Cluster::new(&out.join("cluster"))?;
        // A cluster an earlier, killed run left behind.
        cluster.down()?;
        let nic = s.setup.nic();
        let args: Vec<String> = nic.softrnic_args().into_iter().skip(2).collect();
        match s.setup {
            Setup::Drum => cluster.bring_up(
                (s.hosts)(profile),
                nic.line_rate_gbps,
                &args,
                s.needs_drum(modes),
            )?,
            Setup::Dart => cluster.bring_up_dart((s.hosts)(profile), nic.line_rate_gbps, &args)?,
        }
        Ok(Hosts(cluster))
    }
}

impl Drop for Hosts {
    fn drop(&mut self) {
        if let Err(e) = self.0.down() {
            eprintln!("drum-testbed: tearing the hosts down: {e:#}");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn modes_are_interleaved_within_each_repeat() {
        let all = scenarios::all();
        let s: Vec<Scenario> = all.into_iter().filter(|s| s.name == "fig2c").collect();
        let p = plan(&s, &[Mode::Raw], Profile::Smoke, 2);
        let order: Vec<(u32, f64, &str)> = p.iter().map(|p| (p.repeat, p.x, p.series)).collect();
        assert_eq!(order.len(), 2 * 3);
        assert_eq!(
            order[0..3],
            [(0, 20.0, "RC"), (0, 20.0, "UC"), (0, 20.0, "UD")]
        );
        assert_eq!(order[3], (1, 20.0, "RC"));
    }

    #[test]
    fn every_run_has_its_own_repeatable_seed() {
        let a = run_seed(1, "tc1", "raw", 20.0, 0);
        assert_eq!(a, run_seed(1, "tc1", "raw", 20.0, 0));
        assert_ne!(a, run_seed(1, "tc1", "raw", 20.0, 1));
        assert_ne!(a, run_seed(1, "tc1", "drum", 20.0, 0));
        assert_ne!(a, run_seed(2, "tc1", "raw", 20.0, 0));
    }
}
