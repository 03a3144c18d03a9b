//! Performance isolation in the style of the Husky suite: a victim (bandwidth-bound, or
//! bound by its message rate) shares the client NIC with an attacker that takes one
//! resource (the link with large messages on many QPs, the WQE fetch unit with floods of
//! small operations in long batches, the QP-context cache with many QPs); each with and
//! without DRUM. The score is the victim's throughput against its fair share.

use super::perftest::bw_average_mib;
use super::{Measured, Mode, RunCtx, Scenario, Setup, Unit, Verdict};
use crate::profile::{Nic, Profile};
use crate::programs::{await_listening, check, finish, spawn, LISTEN_LIMIT};
use crate::summary::Summary;
use anyhow::{bail, Result};
use std::process::Command;
use std::time::Duration;

/// The attackers, by x: 0 is the victim alone.
const ATTACKERS: [(&str, &[&str]); 3] = [
    ("bandwidth", &["-s", "65536", "-q", "8"]),
    ("small operations", &["-s", "64", "-l", "64", "-t", "128"]),
    ("QP cache", &["-s", "1024", "-q", "64"]),
];

/// The victims' message sizes.
fn victim_bytes(victim: &str) -> Option<u64> {
    match victim {
        "bw" => Some(65536),
        "rate" => Some(64),
        _ => None,
    }
}

/// The victims: a bandwidth-bound one and one bound by its message rate.
fn victim_args(victim: &str) -> Result<&'static [&'static str]> {
    Ok(match victim {
        "bw" => &["-s", "65536"],
        "rate" => &["-s", "64"],
        v => bail!("no victim {v:?}"),
    })
}

fn series(modes: &[Mode]) -> Vec<&'static str> {
    let mut v = Vec::new();
    for m in [Mode::Raw, Mode::Drum] {
        if modes.contains(&m) {
            v.extend(match m {
                Mode::Raw => ["raw/bw", "raw/rate"],
                _ => ["drum/bw", "drum/rate"],
            });
        }
    }
    v
}

/// `ib_write_bw` on `host` (the client on h2, to h1). `-F`: perftest exits 1 without a
/// report when its CPU-clock check fails on a loaded machine (docs/chaos.md); that failed a
/// victim of the full profile's isolation run.
fn perftest(
    ctx: &RunCtx,
    drum: bool,
    host: &str,
    app: &str,
    port: &str,
    args: &[&str],
    secs: u32,
) -> Result<Command> {
    let mut a: Vec<String> = ["ib_write_bw", "-x", "0", "-F", "-p", port, "-D"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.push(secs.to_string());
    a.extend(args.iter().map(|s| s.to_string()));
    if host == "h2" {
        a.push(ctx.cluster.addr("h1")?.to_string());
    }
    let mut c = if drum {
        ctx.cluster.governed(host, app, &a)?
    } else {
        ctx.cluster.raw(host, &a)?
    };
    c.env("DRUM_SHIM_LOG", "1");
    Ok(c)
}

fn run_isolation(ctx: &RunCtx, series: &str, attacker: f64) -> Result<Measured> {
    let (mode, victim) = series.split_once('/').unwrap_or((series, ""));
    let drum = mode == "drum";
    let secs = match ctx.profile {
        Profile::Smoke => 2,
        Profile::Quick => 3,
        Profile::Full => 6,
    };
    let attack = (attacker as usize)
        .checked_sub(1)
        .map(|i| ATTACKERS.get(i).map(|a| a.1))
        .unwrap_or(None);
    let before = ctx.cluster.stats("h2")?;
    let mut children = Vec::new();
    if let Some(a) = attack {
        let mut server = spawn(&mut perftest(
            ctx,
            drum,
            "h1",
            "attacker",
            "18702",
            a,
            secs + 4,
        )?)?;
        if let Err(e) = await_listening(&mut server, 18702, LISTEN_LIMIT) {
            let _ = finish(server, Duration::ZERO);
            return Err(e);
        }
        children.push(server);
        children.push(spawn(&mut perftest(
            ctx,
            drum,
            "h2",
            "attacker",
            "18702",
            a,
            secs + 4,
        )?)?);
        std::thread::sleep(Duration::from_millis(1500));
    }
    let v = victim_args(victim)?;
    let mut server = spawn(&mut perftest(ctx, drum, "h1", "victim", "18701", v, secs)?)?;
    if let Err(e) = await_listening(&mut server, 18701, LISTEN_LIMIT) {
        let _ = finish(server, Duration::ZERO);
        for c in children {
            let _ = finish(c, Duration::ZERO);
        }
        return Err(e);
    }
    let client = spawn(&mut perftest(ctx, drum, "h2", "victim", "18701", v, secs)?)?;
    let limit = Duration::from_secs(secs as u64 + 60);
    let out = finish(client, limit)?;
    let _ = finish(server, limit);
    // The attackers run longer than the victim so that it never runs alone; once it is done
    // they have nothing left to show (a smoke run waited 3 s of 7.4 for them).
    for c in children {
        let _ = finish(c, Duration::ZERO);
    }
    check(&out, "the victim")?;
    let mib = bw_average_mib(&String::from_utf8_lossy(&out.stdout))?;
    let after = ctx.cluster.stats("h2")?;
    let mut m = Measured::default();
    m.metrics.insert("victim_mib_per_s".into(), mib);
    super::fig2::mechanism(&before, &after, &mut m);
    // What DRUM granted the victim and how long its shim held its work back (the attackers
    // are killed when it is done, so they leave no summary).
    let shim = super::shim_summary(&String::from_utf8_lossy(&out.stderr));
    for k in [
        "rate_bytes_per_s",
        "rate_wqe_per_s",
        "deferred_wqes",
        "queue_delay_us",
    ] {
        if let Some(v) = shim.get(k) {
            m.mechanism.insert(format!("victim_{k}"), *v);
        }
    }
    Ok(m)
}

pub fn isolation() -> Scenario {
    Scenario {
        name: "isolation",
        figure: "Husky-style matrix",
        title: "Isolation: a victim's throughput against attackers of each resource",
        claim: "(not in the DRUM paper) a tenant sharing a NIC keeps its fair share whatever \
                the other does: the Husky suite found RAW NICs break isolation in every \
                resource class",
        x_label: "attacker (0 alone, 1 bandwidth, 2 small operations, 3 QP cache)",
        metric: "victim_mib_per_s",
        unit: Unit::MibPerS,
        y_label: "victim throughput (MiB/s, dilated)",
        hosts: |_| 2,
        series,
        xs: |p| match p {
            Profile::Smoke => vec![1.0],
            _ => vec![0.0, 1.0, 2.0, 3.0],
        },
        paper: &[],
        run: run_isolation,
        criteria: criteria_isolation,
        setup: Setup::Drum,
        figures: |_| Vec::new(),
    }
}

/// The NIC the matrix emulates.
const NIC: Nic = Setup::Drum.nic();

/// The victim's fair share against a greedy attacker, in MiB/s. In softrnic's model a WQE's
/// fetch, its packets and QP-context misses all take time on the one clock of the NIC's
/// pipeline, so that time is the resource every victim and every attacker here needs; two
/// equal-weight apps get half of it each (max-min): a victim that needs less than half of
/// it alone keeps all its throughput, one that needs more keeps what half the NIC's time
/// gives it. Both victims need nearly all of it alone (the 64 KiB victim 0.96, the 64 B
/// victim 0.97 in the quick run of docs/testbed.md: a WQE's fetch takes 50 ns of real time).
fn fair_share(victim_bytes: u64, alone_mib: f64) -> f64 {
    let wqes_per_s = alone_mib * MIB / victim_bytes as f64;
    let usage = wqes_per_s * NIC.wqe_time_ns(victim_bytes) * 1e-9;
    if usage > 0.5 {
        alone_mib * 0.5 / usage
    } else {
        alone_mib
    }
}

/// perftest's MB.
const MIB: f64 = 1024.0 * 1024.0;

fn criteria_isolation(s: &Summary) -> Vec<Verdict> {
    let mut v = Vec::new();
    for victim in ["bw", "rate"] {
        for (i, (name, _)) in ATTACKERS.iter().enumerate() {
            let x = (i + 1) as f64;
            let score = |mode: &str| -> Option<f64> {
                let series = format!("{mode}/{victim}");
                let alone = s.median("isolation", &series, 0.0, "victim_mib_per_s")?;
                let with = s.median("isolation", &series, x, "victim_mib_per_s")?;
                Some(with / fair_share(victim_bytes(victim)?, alone))
            };
            let (drum, raw) = (score("drum"), score("raw"));
            v.push(Verdict {
                scenario: "isolation",
                criterion: format!(
                    "under DRUM the {victim} victim keeps ≥ 0.85 of its fair share against the {name} attacker"
                ),
                measured: match (drum, raw) {
                    (Some(d), Some(r)) => format!("DRUM {d:.2}, RAW {r:.2}"),
                    (Some(d), None) => format!("DRUM {d:.2}"),
                    _ => "not run".into(),
                },
                paper: "Husky: RAW breaks isolation".into(),
                pass: drum.map(|d| d >= 0.85),
            });
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_victim_keeps_half_the_nics_time_or_all_it_needs() {
        // Throughputs measured at 200× (docs/testbed.md), on this NIC's dilation.
        let on_this_nic = |mib_at_200: f64| mib_at_200 * 200.0 / NIC.time_scale;
        // The 64 KiB victim alone at 20.9 MiB/s (200×) keeps the dilated NIC 96 % busy.
        let alone = on_this_nic(20.9);
        let bw = fair_share(65536, alone);
        let usage = alone * MIB / 65536.0 * NIC.wqe_time_ns(65536) * 1e-9;
        assert!((usage - 0.957).abs() < 0.005, "{usage}");
        assert!((bw - alone * 0.5 / usage).abs() < 1e-9);
        // The 64 B victim spends 50 ns (real time) fetching each WQE and 31 ns sending it.
        let alone = on_this_nic(3.65);
        let rate = fair_share(64, alone);
        assert!((rate / alone - 0.52).abs() < 0.01, "{rate}");
        // A victim that needs less than half of the NIC needs nothing from the attacker.
        let little = on_this_nic(0.5);
        assert_eq!(fair_share(64, little), little);
    }
}
