//! The DRUM paper's motivation (Fig. 2), with unmodified perftest programs on the bare
//! emulated NIC: (a) a foreground's latency while a co-runner posts ever larger batches,
//! (c) throughput against the number of active connections. These two calibrate the
//! dilated NIC profile (profile.rs); the test cases never do.

use super::perftest::{bw_average_mib, latencies_us};
use super::{Measured, RunCtx, Scenario, Unit, Verdict};
use crate::profile::Profile;
use crate::programs::{await_listening, finish, pair, spawn, LISTEN_LIMIT};
use crate::stats::quantile;
use crate::summary::Summary;
use anyhow::Result;
use std::collections::BTreeMap;
use std::time::Duration;

/// Engine counters of `host` that tell the mechanism: fetches, misses, retransmissions.
fn counters(ctx: &RunCtx, host: &str) -> Result<BTreeMap<String, f64>> {
    ctx.cluster.stats(host)
}

fn delta(after: &BTreeMap<String, f64>, before: &BTreeMap<String, f64>, k: &str) -> f64 {
    after.get(k).copied().unwrap_or(0.0) - before.get(k).copied().unwrap_or(0.0)
}

/// The mechanism behind a run on `host`'s NIC, from its counters before and after.
pub(super) fn mechanism(
    before: &BTreeMap<String, f64>,
    after: &BTreeMap<String, f64>,
    m: &mut Measured,
) {
    let d = |k| delta(after, before, k);
    let (hits, misses) = (d("qp_cache_hits"), d("qp_cache_misses"));
    if hits + misses > 0.0 {
        m.mechanism
            .insert("qp_cache_miss_ratio".into(), misses / (hits + misses));
    }
    if d("wqe_fetch_reads") > 0.0 {
        m.mechanism.insert(
            "wqes_per_fetch".into(),
            d("wqe_fetches") / d("wqe_fetch_reads"),
        );
    }
    let retx = d("retransmits");
    m.mechanism.insert("retransmits".into(), retx);
    if retx > 0.0 {
        m.flags.push("retransmissions".into());
    }
}

fn args(list: &[&str]) -> Vec<String> {
    list.iter().map(|s| s.to_string()).collect()
}

pub fn fig2a() -> Scenario {
    Scenario {
        name: "fig2a",
        figure: "DRUM Fig. 2(a)",
        title: "A foreground's latency while a co-runner's WQE batch grows",
        claim: "the foreground's 80th-percentile completion time grows 3.9x, from about 20 µs \
                to 78 µs, as the co-located application's batch grows from 20 to 100",
        x_label: "co-runner batch (WQEs per post; 0: none)",
        metric: "p80_us",
        unit: Unit::Micros,
        y_label: "foreground p80 latency (µs, dilated)",
        hosts: |_| 2,
        series: |_| vec!["raw"],
        xs: |p| match p {
            Profile::Full => vec![0.0, 20.0, 40.0, 60.0, 80.0, 100.0],
            Profile::Quick => vec![0.0, 20.0, 100.0],
            Profile::Smoke => vec![100.0],
        },
        paper: &[("raw", 20.0, 20.0), ("raw", 100.0, 78.0)],
        run: run_fig2a,
        criteria: criteria_fig2a,
        setup: super::Setup::Drum,
        figures: |_| Vec::new(),
    }
}

/// Foreground: `ib_write_lat` of 1 KiB, h2 → h1, every iteration's latency. Co-runner:
/// `ib_write_bw` of 64 B on its own QP from the same NIC, `batch` work requests per
/// `ibv_post_send` (`-l`), running throughout.
fn run_fig2a(ctx: &RunCtx, _series: &str, batch: f64) -> Result<Measured> {
    let c = ctx.cluster;
    let ip = c.addr("h1")?.to_string();
    let iters = ctx.profile.length(2000).to_string();
    let before = counters(ctx, "h2")?;
    let corunner = if batch > 0.0 {
        let b = (batch as u32).to_string();
        let depth = (2 * batch as u32).max(128).to_string();
        let mut a = args(&["ib_write_bw", "-x", "0", "-F", "-s", "64", "-p", "18611"]);
        a.extend(args(&["-l", &b, "-t", &depth, "-D", "30"]));
        let mut server = spawn(&mut c.raw("h1", &a)?)?;
        if let Err(e) = await_listening(&mut server, 18611, LISTEN_LIMIT) {
            let _ = finish(server, Duration::ZERO);
            return Err(e);
        }
        a.push(ip.clone());
        let client = spawn(&mut c.raw("h2", &a)?)?;
        // Past the co-runner's connection setup, so the foreground meets it running.
        std::thread::sleep(Duration::from_millis(800));
        Some((server, client))
    } else {
        None
    };
    let mut a = args(&[
        "ib_write_lat",
        "-x",
        "0",
        "-F",
        "-s",
        "1024",
        "-H",
        "-p",
        "18612",
    ]);
    a.extend(args(&["-n", &iters]));
    let server = c.raw("h1", &a);
    a.push(ip);
    let fg = pair(
        &mut server?,
        18612,
        &mut c.raw("h2", &a)?,
        Duration::from_secs(120),
    );
    if let Some((server, client)) = corunner {
        // The co-runner's -D bounds it; it is stopped as soon as the foreground is done.
        for child in [client, server] {
            let mut child = child;
            let _ = child.kill();
            let _ = finish(child, Duration::from_secs(5));
        }
    }
    let mut lat = latencies_us(&String::from_utf8_lossy(&fg?.stdout))?;
    let after = counters(ctx, "h2")?;
    let mut m = Measured::default();
    for (k, q) in [("p50_us", 0.5), ("p80_us", 0.8), ("p99_us", 0.99)] {
        m.metrics
            .insert(k.into(), quantile(&mut lat, q).unwrap_or(f64::NAN));
    }
    mechanism(&before, &after, &mut m);
    m.samples = lat;
    Ok(m)
}

fn criteria_fig2a(s: &Summary) -> Vec<Verdict> {
    let at = |x| s.median("fig2a", "raw", x, "p80_us");
    let ratio = at(100.0).zip(at(20.0)).map(|(a, b)| a / b);
    vec![Verdict {
        scenario: "fig2a",
        criterion: "calibration: p80 at batch 100 ≥ 2× p80 at batch 20".into(),
        measured: ratio.map_or("not run".into(), |r| format!("{r:.2}×")),
        paper: "3.9× (20 → 78 µs)".into(),
        pass: ratio.map(|r| r >= 2.0),
    }]
}

pub fn fig2c() -> Scenario {
    Scenario {
        name: "fig2c",
        figure: "DRUM Fig. 2(c)",
        title: "Throughput against the number of active connections",
        claim: "beyond about 20 connections the NIC cannot cache every RC and UC connection's \
                context and the average throughput drops significantly; UD does not",
        x_label: "active connections (QPs)",
        metric: "mib_per_s",
        unit: Unit::MibPerS,
        y_label: "aggregate throughput (MiB/s, dilated)",
        hosts: |_| 2,
        series: |_| vec!["RC", "UC", "UD"],
        xs: |p| match p {
            Profile::Full => vec![1.0, 5.0, 10.0, 15.0, 20.0, 25.0, 30.0, 40.0, 60.0, 80.0],
            Profile::Quick => vec![1.0, 10.0, 20.0, 40.0, 80.0],
            Profile::Smoke => vec![20.0],
        },
        paper: &[],
        run: run_fig2c,
        criteria: criteria_fig2c,
        setup: super::Setup::Drum,
        figures: |_| Vec::new(),
    }
}

/// `conns` connections of one transport, h2 → h1, 1 KiB messages: one QP each for RC and UC
/// (`ib_write_bw -q`); for UD (`ib_send_bw`, UD has no RDMA write) the connections are
/// destinations of one QP, as UD applications serve every peer from one QP — so, with one
/// peer host, the same message count over one QP. A UD QP per connection would be cached
/// like any other QP, by a real NIC and by the model.
fn run_fig2c(ctx: &RunCtx, transport: &str, conns: f64) -> Result<Measured> {
    let c = ctx.cluster;
    let ip = c.addr("h1")?.to_string();
    let q = if transport == "UD" { 1 } else { conns as u64 };
    let per_qp = (ctx.profile.length(8000) / conns as u64).max(20) * (conns as u64 / q);
    let per_qp = per_qp.to_string();
    let prog = if transport == "UD" {
        "ib_send_bw"
    } else {
        "ib_write_bw"
    };
    let qs = q.to_string();
    let mut a = args(&[
        prog, "-x", "0", "-F", "-s", "1024", "-p", "18621", "-c", transport,
    ]);
    a.extend(args(&["-q", &qs, "-n", &per_qp]));
    let before = counters(ctx, "h2")?;
    let server = c.raw("h1", &a);
    a.push(ip);
    let out = pair(
        &mut server?,
        18621,
        &mut c.raw("h2", &a)?,
        Duration::from_secs(180),
    )?;
    let after = counters(ctx, "h2")?;
    let bw = bw_average_mib(&String::from_utf8_lossy(&out.stdout))?;
    let mut m = Measured::default();
    m.metrics.insert("mib_per_s".into(), bw);
    m.metrics.insert("per_conn_mib_per_s".into(), bw / conns);
    mechanism(&before, &after, &mut m);
    Ok(m)
}

fn criteria_fig2c(s: &Summary) -> Vec<Verdict> {
    ["RC", "UC", "UD"]
        .into_iter()
        .map(|t| {
            let xs = s.xs("fig2c", t);
            let at20 = s.median("fig2c", t, 20.0, "mib_per_s");
            let last = xs.last().copied().filter(|x| *x > 20.0);
            let end = last.and_then(|x| s.median("fig2c", t, x, "mib_per_s"));
            let ratio = end.zip(at20).map(|(e, b)| e / b);
            let (criterion, pass): (String, Option<bool>) = if t == "UD" {
                (
                    "calibration: UD keeps ≥ 0.8 of its throughput at 20 connections".into(),
                    ratio.map(|r| r >= 0.8),
                )
            } else {
                (
                    format!("calibration: {t} throughput past 20 connections ≤ 0.6 of it at 20"),
                    ratio.map(|r| r <= 0.6),
                )
            };
            Verdict {
                scenario: "fig2c",
                criterion,
                measured: match (ratio, last) {
                    (Some(r), Some(x)) => format!("{r:.2} at {x} connections"),
                    _ => "not run".into(),
                },
                paper: if t == "UD" {
                    "no drop"
                } else {
                    "significant drop"
                }
                .into(),
                pass,
            }
        })
        .collect()
}
