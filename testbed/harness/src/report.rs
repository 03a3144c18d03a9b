//! `drum-testbed report DIR`: every output rebuilt from the raw runs — `runs.csv`,
//! `summary.csv`, one SVG and PNG per figure, and `report.html`, self-contained (inline SVG,
//! no network), with the paper's numbers, the criteria and their verdicts beside ours.

use crate::meta::{self, Meta};
use crate::plot::{Figure, Line};
use crate::record::RunRecord;
use crate::scenarios::{self, Scenario, Unit, Verdict};
use crate::summary::Summary;
use anyhow::{bail, Context, Result};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::Path;

fn unit_name(unit: Unit) -> &'static str {
    match unit {
        Unit::Micros => "µs",
        Unit::Millis => "ms",
        Unit::MibPerS => "MiB/s",
    }
}

/// Every criterion of every scenario with data.
pub fn verdicts(summary: &Summary) -> Vec<Verdict> {
    scenarios::all()
        .iter()
        .filter(|s| !summary.series(s.name).is_empty())
        .flat_map(|s| (s.criteria)(summary))
        .collect()
}

pub fn build(out: &Path) -> Result<()> {
    let meta = meta::read(out)?;
    let runs = RunRecord::load_all(out)?;
    if runs.is_empty() {
        bail!(
            "no runs in {} (drum-testbed run … --out DIR)",
            out.display()
        );
    }
    let summary = Summary::of(&runs);
    std::fs::write(out.join("runs.csv"), runs_csv(&runs))?;
    std::fs::write(out.join("summary.csv"), summary_csv(&summary))?;
    let mut sections = String::new();
    for s in scenarios::all() {
        if summary.series(s.name).is_empty() {
            continue;
        }
        let fig = figure(&s, &summary);
        let svg = fig.svg()?;
        std::fs::write(out.join(format!("{}.svg", s.name)), &svg)?;
        fig.png(&out.join(format!("{}.png", s.name)))
            .with_context(|| format!("{}.png", s.name))?;
        let mut extra = Vec::new();
        for (i, f) in (s.figures)(&runs).into_iter().enumerate() {
            let name = format!("{}-{}", s.name, i + 2);
            let svg = f.svg()?;
            std::fs::write(out.join(format!("{name}.svg")), &svg)?;
            f.png(&out.join(format!("{name}.png")))
                .with_context(|| format!("{name}.png"))?;
            extra.push(svg);
        }
        sections.push_str(&section(&s, &summary, &runs, &svg, &extra));
    }
    let html = page(&meta, &runs, &verdicts(&summary), &sections);
    std::fs::write(out.join("report.html"), html)?;
    println!("{}", out.join("report.html").display());
    Ok(())
}

fn runs_csv(runs: &[RunRecord]) -> String {
    let metrics: BTreeSet<&String> = runs.iter().flat_map(|r| r.metrics.keys()).collect();
    let mech: BTreeSet<&String> = runs.iter().flat_map(|r| r.mechanism.keys()).collect();
    let mut s = String::from(
        "scenario,series,x,repeat,seed,started_unix_s,elapsed_s,load_before,load_after,flags",
    );
    for k in metrics.iter().chain(&mech) {
        let _ = write!(s, ",{k}");
    }
    s.push('\n');
    for r in runs {
        let _ = write!(
            s,
            "{},{},{},{},{},{:.3},{:.3},{:.2},{:.2},\"{}\"",
            r.scenario,
            r.series,
            r.x,
            r.repeat,
            r.seed,
            r.started_unix_s,
            r.elapsed_s,
            r.load_before,
            r.load_after,
            r.flags.join("; ").replace('"', "'")
        );
        for k in &metrics {
            let _ = write!(
                s,
                ",{}",
                r.metrics.get(*k).map_or(String::new(), f64::to_string)
            );
        }
        for k in &mech {
            let _ = write!(
                s,
                ",{}",
                r.mechanism.get(*k).map_or(String::new(), f64::to_string)
            );
        }
        s.push('\n');
    }
    s
}

fn summary_csv(summary: &Summary) -> String {
    let mut s = String::from("scenario,series,x,measure,n,median,q1,q3,min,max\n");
    for (sc, series, x, m, v) in summary.rows() {
        let _ = writeln!(
            s,
            "{sc},{series},{x},{m},{},{},{},{},{},{}",
            v.n, v.median, v.q1, v.q3, v.min, v.max
        );
    }
    s
}

/// The scenario's figure in real-time-equivalent units, with the paper's points.
fn figure<'a>(s: &'a Scenario, summary: &Summary) -> Figure<'a> {
    let lines = summary
        .series(s.name)
        .into_iter()
        .map(|series| Line {
            points: summary
                .xs(s.name, &series)
                .into_iter()
                .filter_map(|x| {
                    let v = summary.spread(s.name, &series, x, s.metric)?;
                    let r = |v| s.unit.real(s.setup.nic(), v);
                    Some((x, r(v.median), r(v.q1), r(v.q3)))
                })
                .collect(),
            name: series,
        })
        .filter(|l| !l.points.is_empty())
        .collect();
    Figure {
        title: s.title,
        x_label: s.x_label,
        y_label: s.unit.real_label(s.setup.nic()),
        lines,
        paper: s
            .paper
            .iter()
            .map(|(l, x, y)| (l.to_string(), *x, *y))
            .collect(),
    }
}

fn esc(s: &str) -> String {
    s.replace('&', "&amp;")
        .replace('<', "&lt;")
        .replace('>', "&gt;")
        .replace('"', "&quot;")
}

fn verdict_cell(pass: Option<bool>) -> &'static str {
    match pass {
        Some(true) => "<td class=pass>reproduced</td>",
        Some(false) => "<td class=fail>not reproduced</td>",
        None => "<td class=na>no data</td>",
    }
}

fn verdict_rows(vs: &[Verdict]) -> String {
    let mut s = String::new();
    for v in vs {
        let _ = write!(
            s,
            "<tr><td>{}</td><td>{}</td><td>{}</td><td>{}</td>{}</tr>",
            esc(v.scenario),
            esc(&v.criterion),
            esc(&v.measured),
            esc(&v.paper),
            verdict_cell(v.pass)
        );
    }
    s
}

fn section(
    s: &Scenario,
    summary: &Summary,
    runs: &[RunRecord],
    svg: &str,
    extra: &[String],
) -> String {
    let unit = unit_name(s.unit);
    let mut t = String::new();
    let _ = write!(
        t,
        "<section id={name}><h2>{fig}: {title}</h2><p class=claim>Paper: {claim}.</p>\
         <figure>{svg}<figcaption>{name}: {y}. Lines: medians over repeats, bars: interquartile \
         range; crosses: the paper's points.</figcaption></figure>{extras}\
         <table><tr><th>series</th><th>x</th><th>n</th><th>median (dilated, {unit})</th>\
         <th>real-time equivalent ({unit})</th><th>IQR (dilated)</th><th>min – max (dilated)</th>\
         <th>mechanism (medians)</th></tr>",
        name = s.name,
        fig = esc(s.figure),
        title = esc(s.title),
        claim = esc(s.claim),
        y = esc(s.y_label),
        extras = extra
            .iter()
            .map(|f| format!("<figure>{f}</figure>"))
            .collect::<String>(),
    );
    for series in summary.series(s.name) {
        for x in summary.xs(s.name, &series) {
            let Some(v) = summary.spread(s.name, &series, x, s.metric) else {
                continue;
            };
            let mech: Vec<String> = ["qp_cache_miss_ratio", "wqes_per_fetch", "retransmits"]
                .iter()
                .filter_map(|m| {
                    let v = summary.median(s.name, &series, x, m)?;
                    Some(format!("{m} {v:.3}"))
                })
                .collect();
            let _ = write!(
                t,
                "<tr><td>{}</td><td>{x}</td><td>{}</td><td>{:.2}</td><td>{:.2}</td>\
                 <td>{:.2} – {:.2}</td><td>{:.2} – {:.2}</td><td>{}</td></tr>",
                esc(&series),
                v.n,
                v.median,
                s.unit.real(s.setup.nic(), v.median),
                v.q1,
                v.q3,
                v.min,
                v.max,
                mech.join(", ")
            );
        }
    }
    t.push_str("</table>");
    let flagged: Vec<String> = runs
        .iter()
        .filter(|r| r.scenario == s.name && !r.flags.is_empty())
        .map(|r| {
            format!(
                "<li>{} x={} r{}: {}</li>",
                esc(&r.series),
                r.x,
                r.repeat,
                esc(&r.flags.join("; "))
            )
        })
        .collect();
    if !flagged.is_empty() {
        let _ = write!(
            t,
            "<p>Flagged runs:</p><ul class=flags>{}</ul>",
            flagged.join("")
        );
    }
    let _ = write!(
        t,
        "<table class=verdicts><tr><th>scenario</th><th>criterion</th><th>measured</th>\
         <th>paper</th><th>verdict</th></tr>{}</table></section>",
        verdict_rows(&(s.criteria)(summary))
    );
    t
}

fn page(meta: &Meta, runs: &[RunRecord], vs: &[Verdict], sections: &str) -> String {
    let failed = runs
        .iter()
        .filter(|r| r.flags.iter().any(|f| f.starts_with("failed")))
        .count();
    let loaded = runs
        .iter()
        .filter(|r| r.flags.iter().any(|f| f.starts_with("under load")))
        .count();
    let saturated = runs
        .iter()
        .filter(|r| r.flags.iter().any(|f| f.starts_with("CPU saturated")))
        .count();
    format!(
        "<!DOCTYPE html><html lang=en><head><meta charset=utf-8><title>DRUM testbed report</title>\
         <style>body{{font-family:sans-serif;max-width:1000px;margin:2em auto;color:#222}}\
         table{{border-collapse:collapse;margin:1em 0}}td,th{{border:1px solid #bbb;padding:3px 7px;\
         font-size:90%}}.pass{{background:#d9f2d9}}.fail{{background:#f8d4d0}}.na{{background:#eee}}\
         figure{{margin:0}}svg{{max-width:100%;height:auto}}.claim{{font-style:italic}}</style></head>\
         <body><h1>DRUM testbed: RAW vs SHARE vs DRUM</h1>\
         <p id=stamp>Commit <code>{commit}</code>, profile <b>{profile}</b>, seed {seed}; {nics}; \
         machine: {machine}. {n} runs ({failed} failed, {loaded} started under load, {saturated} with \
         every CPU busy).</p>\
         <h2>Verdicts</h2><table class=verdicts><tr><th>scenario</th><th>criterion</th>\
         <th>measured</th><th>paper</th><th>verdict</th></tr>{rows}</table>{sections}\
         <p>Raw data: <code>runs/</code>, <code>runs.csv</code>, <code>summary.csv</code>; \
         rebuilt by <code>drum-testbed report DIR</code>.</p></body></html>\n",
        commit = esc(&meta.commit),
        profile = meta.profile.name(),
        seed = meta.seed,
        nics = nic_stamp(&meta.nics),
        machine = esc(&meta.machine),
        n = runs.len(),
        rows = verdict_rows(vs),
    )
}

/// The NICs a report's runs emulate, for its stamp.
fn nic_stamp(nics: &[meta::NicMeta]) -> String {
    nics.iter()
        .map(|n| {
            format!(
                "NIC of {} <b>{}</b> (softrnic {}; times dilated {d}×: real-time equivalent = \
                 dilated ÷ {d})",
                esc(&n.experiments),
                esc(&n.name),
                esc(&n.softrnic_args.join(" ")),
                d = n.dilation
            )
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// `drum-testbed check DIR`: every criterion with the measured value and the paper's; an
/// error when one fails.
pub fn check(out: &Path) -> Result<()> {
    let runs = RunRecord::load_all(out)?;
    if runs.is_empty() {
        bail!("no runs in {}", out.display());
    }
    let vs = verdicts(&Summary::of(&runs));
    let mut failed = 0;
    for v in &vs {
        let word = match v.pass {
            Some(true) => "PASS",
            Some(false) => {
                failed += 1;
                "FAIL"
            }
            None => "N/A ",
        };
        println!(
            "{word} {}: {} — measured {}; paper {}",
            v.scenario, v.criterion, v.measured, v.paper
        );
    }
    if failed > 0 {
        bail!("{failed} of {} criteria failed", vs.len());
    }
    Ok(())
}
