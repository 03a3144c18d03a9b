//! The TrueType font PNG plots need for their text (SVG text needs none). Debian's
//! fonts-dejavu-core provides it; the setup script installs it.

use anyhow::{anyhow, Result};
use plotters::style::FontStyle;
use std::sync::OnceLock;

const PATHS: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
];

/// Registers the font once; every later call gives the first call's outcome.
pub fn register() -> Result<()> {
    static DONE: OnceLock<Result<(), String>> = OnceLock::new();
    DONE.get_or_init(|| {
        let bytes = PATHS
            .iter()
            .find_map(|p| std::fs::read(p).ok())
            .ok_or_else(|| {
                format!(
                    "no font for PNG text ({}); install fonts-dejavu-core",
                    PATHS.join(", ")
                )
            })?;
        plotters::style::register_font(
            "sans-serif",
            FontStyle::Normal,
            Box::leak(bytes.into_boxed_slice()),
        )
        .map_err(|_| "the font is not a usable TrueType font".to_string())
    })
    .clone()
    .map_err(|e| anyhow!(e))
}
