//! Convergence plots (objective and primal residual per iteration), like the DRUM paper's
//! Figs. 4–5. PNG text needs a TrueType font; Debian's fonts-dejavu-core provides one.

use anyhow::{bail, Context, Result};
use drum_common::solver::TraceRow;
use plotters::prelude::*;
use std::path::Path;
use std::sync::Once;

const FONT_PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
];

fn register_font() -> Result<()> {
    static ONCE: Once = Once::new();
    let mut result = Ok(());
    ONCE.call_once(|| {
        let Some(bytes) = FONT_PATHS.iter().find_map(|p| std::fs::read(p).ok()) else {
            result = Err(anyhow::anyhow!(
                "no TrueType font for the plot's text (looked for {}); install fonts-dejavu-core",
                FONT_PATHS.join(", ")
            ));
            return;
        };
        let bytes: &'static [u8] = Box::leak(bytes.into_boxed_slice());
        if plotters::style::register_font("sans-serif", FontStyle::Normal, bytes).is_err() {
            result = Err(anyhow::anyhow!(
                "the font file is not a usable TrueType font"
            ));
        }
    });
    result
}

/// Draws `series` (name, trace) into a PNG with two panels: objective and primal residual.
pub fn convergence_png(
    path: &Path,
    title: &str,
    reference: f64,
    series: &[(&str, &[TraceRow])],
) -> Result<()> {
    register_font()?;
    if series.iter().all(|(_, t)| t.is_empty()) {
        bail!("nothing to plot: the traces are empty");
    }
    let root = BitMapBackend::new(path, (1100, 900)).into_drawing_area();
    root.fill(&WHITE)?;
    let root = root.titled(title, ("sans-serif", 24))?;
    let (top, bottom) = root.split_vertically(440);
    let max_iter = series
        .iter()
        .map(|(_, t)| t.len())
        .max()
        .unwrap_or(1)
        .max(2);
    let colours = [
        RGBColor(0, 90, 181),
        RGBColor(220, 50, 32),
        RGBColor(0, 140, 70),
        RGBColor(150, 60, 170),
        RGBColor(100, 170, 230),
        RGBColor(240, 150, 130),
        RGBColor(200, 150, 220),
    ];

    // Objective as relative error to the reference optimum, on a log scale: the raw objective
    // spans too little to tell the methods apart after a few iterations.
    let err = |t: &TraceRow| ((t.objective - reference).abs() / reference.abs()).max(1e-9);
    let max_err = series
        .iter()
        .flat_map(|(_, t)| t.iter().map(err))
        .fold(1e-8, f64::max);
    let mut chart = ChartBuilder::on(&top)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .caption(
            "relative objective error |f − f*| / |f*|",
            ("sans-serif", 18),
        )
        .build_cartesian_2d(1..max_iter, (1e-9..max_err * 2.0).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("iteration")
        .y_label_formatter(&|v| format!("{v:.0e}"))
        .draw()?;
    for (i, (name, trace)) in series.iter().enumerate() {
        let c = colours[i % colours.len()];
        chart
            .draw_series(LineSeries::new(
                trace.iter().map(|t| (t.iteration, err(t))),
                c.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;

    let res = |t: &TraceRow| t.primal_residual.max(1e-12);
    let max_res = series
        .iter()
        .flat_map(|(_, t)| t.iter().map(res))
        .fold(1e-10, f64::max);
    let mut chart = ChartBuilder::on(&bottom)
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .caption("primal residual", ("sans-serif", 18))
        .build_cartesian_2d(1..max_iter, (1e-12..max_res * 2.0).log_scale())?;
    chart
        .configure_mesh()
        .x_desc("iteration")
        .y_label_formatter(&|v| format!("{v:.0e}"))
        .draw()?;
    for (i, (name, trace)) in series.iter().enumerate() {
        let c = colours[i % colours.len()];
        chart
            .draw_series(LineSeries::new(
                trace.iter().map(|t| (t.iteration, res(t))),
                c.stroke_width(2),
            ))?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(2)));
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()?;
    root.present()
        .with_context(|| format!("writing {}", path.display()))?;
    Ok(())
}
