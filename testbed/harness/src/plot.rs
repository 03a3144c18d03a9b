//! One figure per scenario: the median of its measure against x for every series, the
//! interquartile range as error bars, and the paper's points, in real-time-equivalent units
//! so the two can be read against each other. SVG (for the report, inline) and PNG; both
//! measure text with the registered font.

use anyhow::{anyhow, Result};
use plotters::coord::Shift;
use plotters::prelude::*;
use std::path::Path;

/// A line of the figure: (x, median, q1, q3) per point.
pub struct Line {
    pub name: String,
    pub points: Vec<(f64, f64, f64, f64)>,
}

pub struct Figure<'a> {
    pub title: &'a str,
    pub x_label: &'a str,
    pub y_label: String,
    pub lines: Vec<Line>,
    /// The paper's points: (series, x, y).
    pub paper: Vec<(String, f64, f64)>,
}

const SIZE: (u32, u32) = (900, 560);
const COLOURS: [RGBColor; 6] = [
    RGBColor(0, 90, 181),
    RGBColor(220, 50, 32),
    RGBColor(26, 133, 57),
    RGBColor(153, 79, 0),
    RGBColor(93, 58, 155),
    RGBColor(64, 64, 64),
];

impl Figure<'_> {
    fn bounds(&self) -> ((f64, f64), (f64, f64)) {
        let xs = self
            .lines
            .iter()
            .flat_map(|l| l.points.iter().map(|p| p.0))
            .chain(self.paper.iter().map(|p| p.1));
        let ys = self
            .lines
            .iter()
            .flat_map(|l| l.points.iter().flat_map(|p| [p.1, p.3]))
            .chain(self.paper.iter().map(|p| p.2));
        let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
        let y1 = ys.fold(0.0f64, f64::max);
        let x1 = if x1 > x0 { x1 } else { x0 + 1.0 };
        (
            (x0.min(0.0), x1 * 1.05),
            (0.0, if y1 > 0.0 { y1 * 1.15 } else { 1.0 }),
        )
    }

    fn draw<DB: DrawingBackend>(&self, root: DrawingArea<DB, Shift>) -> Result<()>
    where
        DB::ErrorType: 'static,
    {
        // Text is measured with the font, in SVG too.
        crate::fonts::register()?;
        let err = |e: DrawingAreaErrorKind<DB::ErrorType>| anyhow!("drawing {}: {e}", self.title);
        root.fill(&WHITE).map_err(err)?;
        let ((x0, x1), (y0, y1)) = self.bounds();
        let mut chart = ChartBuilder::on(&root)
            .caption(self.title, ("sans-serif", 20))
            .margin(12)
            .x_label_area_size(44)
            .y_label_area_size(64)
            .build_cartesian_2d(x0..x1, y0..y1)
            .map_err(err)?;
        chart
            .configure_mesh()
            .x_desc(self.x_label)
            .y_desc(self.y_label.as_str())
            .draw()
            .map_err(err)?;
        for (i, line) in self.lines.iter().enumerate() {
            let c = COLOURS[i % COLOURS.len()];
            chart
                .draw_series(LineSeries::new(
                    line.points.iter().map(|p| (p.0, p.1)),
                    c.stroke_width(2),
                ))
                .map_err(err)?
                .label(line.name.clone())
                .legend(move |(x, y)| PathElement::new([(x, y), (x + 18, y)], c.stroke_width(2)));
            chart
                .draw_series(
                    line.points
                        .iter()
                        .map(|p| ErrorBar::new_vertical(p.0, p.2, p.1, p.3, c.filled(), 6)),
                )
                .map_err(err)?;
        }
        if !self.paper.is_empty() {
            chart
                .draw_series(
                    self.paper
                        .iter()
                        .map(|p| Cross::new((p.1, p.2), 7, BLACK.stroke_width(2))),
                )
                .map_err(err)?
                .label("paper")
                .legend(|(x, y)| Cross::new((x + 9, y), 6, BLACK.stroke_width(2)));
        }
        chart
            .configure_series_labels()
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .position(SeriesLabelPosition::UpperLeft)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
        Ok(())
    }

    pub fn svg(&self) -> Result<String> {
        let mut s = String::new();
        self.draw(SVGBackend::with_string(&mut s, SIZE).into_drawing_area())?;
        Ok(s)
    }

    pub fn png(&self, path: &Path) -> Result<()> {
        self.draw(BitMapBackend::new(path, SIZE).into_drawing_area())
    }
}
