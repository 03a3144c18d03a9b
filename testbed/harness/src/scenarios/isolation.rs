//! Performance isolation in the style of the Husky suite: a victim (bandwidth-bound, or
//! bound by its message rate) shares the client NIC with an attacker that takes one
//! resource (the link with large messages on many QPs, the WQE fetch unit with floods of
//! small operations in long batches, the QP-context cache with many QPs); each with and
//! without DRUM. The score is the victim's throughput against its fair share.

use super::perftest::bw_average_mib;
use super::{Measured, Mode, RunCtx, Scenario, Unit, Verdict};
use crate::profile::Profile;
use crate::programs::{check, finish, spawn};
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

fn perftest(
    ctx: &RunCtx,
    drum: bool,
    host: &str,
    app: &str,
    port: &str,
    args: &[&str],
    secs: u32,
) -> Result<Command> {
    let mut a: Vec<String> = ["ib_write_bw", "-x", "0", "-p", port, "-D"]
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
        children.push(spawn(&mut perftest(
            ctx,
            drum,
            "h1",
            "attacker",
            "18702",
            a,
            secs + 4,
        )?)?);
        std::thread::sleep(Duration::from_millis(400));
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
    let server = spawn(&mut perftest(ctx, drum, "h1", "victim", "18701", v, secs)?)?;
    std::thread::sleep(Duration::from_millis(400));
    let client = spawn(&mut perftest(ctx, drum, "h2", "victim", "18701", v, secs)?)?;
    let limit = Duration::from_secs(secs as u64 + 60);
    let out = finish(client, limit)?;
    let _ = finish(server, limit);
    for c in children {
        let _ = finish(c, limit);
    }
    check(&out, "the victim")?;
    let mib = bw_average_mib(&String::from_utf8_lossy(&out.stdout))?;
    let after = ctx.cluster.stats("h2")?;
    let mut m = Measured::default();
    m.metrics.insert("victim_mib_per_s".into(), mib);
    super::fig2::mechanism(&before, &after, &mut m);
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
        hosts: 2,
        series,
        xs: |p| match p {
            Profile::Smoke => vec![1.0],
            _ => vec![0.0, 1.0, 2.0, 3.0],
        },
        paper: &[],
        run: run_isolation,
        criteria: criteria_isolation,
    }
}

/// The victim's fair share against attacker `x`: for two equal-weight apps bound by the
/// same resource, half of what the victim gets alone; else all of it, since the victim
/// does not need what the attacker takes. The bandwidth victim shares the one link with
/// the bandwidth attacker and with the QP-cache attacker (64 QPs writing 1 KiB messages as
/// fast as they can: once its QPs no longer thrash the cache, it is bound by the link).
fn fair_share(victim: &str, x: f64, alone: f64) -> f64 {
    if victim == "bw" && (x == 1.0 || x == 3.0) {
        alone / 2.0
    } else {
        alone
    }
}

fn criteria_isolation(s: &Summary) -> Vec<Verdict> {
    let mut v = Vec::new();
    for victim in ["bw", "rate"] {
        for (i, (name, _)) in ATTACKERS.iter().enumerate() {
            let x = (i + 1) as f64;
            let score = |mode: &str| -> Option<f64> {
                let series = format!("{mode}/{victim}");
                let alone = s.median("isolation", &series, 0.0, "victim_mib_per_s")?;
                let with = s.median("isolation", &series, x, "victim_mib_per_s")?;
                Some(with / fair_share(victim, x, alone))
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
