//! The runs of an output directory summed up: the spread of every measure over repeats, per
//! scenario, series and point — what the plots, `summary.csv` and the criteria read.

use crate::record::RunRecord;
use crate::stats::Spread;
use std::collections::BTreeMap;

/// (scenario, series, x in thousandths, measure).
type Key = (String, String, i64, String);

pub struct Summary {
    rows: BTreeMap<Key, Spread>,
}

fn milli(x: f64) -> i64 {
    (x * 1000.0).round() as i64
}

impl Summary {
    pub fn of(runs: &[RunRecord]) -> Summary {
        let mut values: BTreeMap<Key, Vec<f64>> = BTreeMap::new();
        for r in runs {
            for (k, v) in r.metrics.iter().chain(&r.mechanism) {
                values
                    .entry((r.scenario.clone(), r.series.clone(), milli(r.x), k.clone()))
                    .or_default()
                    .push(*v);
            }
        }
        Summary {
            rows: values
                .into_iter()
                .filter_map(|(k, v)| Some((k, Spread::of(&v)?)))
                .collect(),
        }
    }

    pub fn spread(&self, scenario: &str, series: &str, x: f64, metric: &str) -> Option<Spread> {
        let key = (scenario.into(), series.into(), milli(x), metric.into());
        self.rows.get(&key).copied()
    }

    pub fn median(&self, scenario: &str, series: &str, x: f64, metric: &str) -> Option<f64> {
        self.spread(scenario, series, x, metric).map(|s| s.median)
    }

    /// The points run for a series, in order.
    pub fn xs(&self, scenario: &str, series: &str) -> Vec<f64> {
        let mut xs: Vec<i64> = self
            .rows
            .keys()
            .filter(|(s, l, _, _)| s == scenario && l == series)
            .map(|k| k.2)
            .collect();
        xs.dedup();
        xs.into_iter().map(|x| x as f64 / 1000.0).collect()
    }

    /// The series run for a scenario, in order.
    pub fn series(&self, scenario: &str) -> Vec<String> {
        let mut v: Vec<String> = self
            .rows
            .keys()
            .filter(|k| k.0 == scenario)
            .map(|k| k.1.clone())
            .collect();
        v.dedup();
        v
    }

    /// Every row: (scenario, series, x, measure, spread).
    pub fn rows(&self) -> impl Iterator<Item = (&str, &str, f64, &str, &Spread)> {
        self.rows
            .iter()
            .map(|((s, l, x, m), v)| (s.as_str(), l.as_str(), *x as f64 / 1000.0, m.as_str(), v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(series: &str, x: f64, repeat: u32, v: f64) -> RunRecord {
        RunRecord {
            scenario: "s".into(),
            series: series.into(),
            x,
            repeat,
            seed: 0,
            started_unix_s: 0.0,
            elapsed_s: 0.0,
            load_before: 0.0,
            load_after: 0.0,
            flags: vec![],
            metrics: [("m".to_string(), v)].into(),
            mechanism: [("retransmits".to_string(), 0.0)].into(),
            samples: vec![],
        }
    }

    #[test]
    fn repeats_of_a_point_are_summed_up_together() {
        let s = Summary::of(&[
            run("raw", 20.0, 0, 3.0),
            run("raw", 20.0, 1, 1.0),
            run("raw", 20.0, 2, 2.0),
            run("raw", 0.5, 0, 9.0),
            run("drum", 20.0, 0, 5.0),
        ]);
        let sp = s.spread("s", "raw", 20.0, "m").unwrap();
        assert_eq!((sp.n, sp.median, sp.min, sp.max), (3, 2.0, 1.0, 3.0));
        assert_eq!(s.xs("s", "raw"), [0.5, 20.0]);
        assert_eq!(s.series("s"), ["drum", "raw"]);
        assert_eq!(s.median("s", "drum", 20.0, "m"), Some(5.0));
        assert_eq!(s.median("s", "drum", 20.0, "retransmits"), Some(0.0));
        assert!(s.median("s", "raw", 40.0, "m").is_none());
        assert_eq!(s.rows().count(), 6);
    }
}
