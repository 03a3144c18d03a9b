//! Order statistics of measurements: percentiles of one run's samples, and the spread of a
//! measure over repeats (median, interquartile range, extremes) as the report shows it.

use serde::{Deserialize, Serialize};

/// The `q`-quantile (0 ≤ q ≤ 1) of `v` by linear interpolation between closest ranks;
/// `None` for no samples. Sorts `v`.
pub fn quantile(v: &mut [f64], q: f64) -> Option<f64> {
    if v.is_empty() || !(0.0..=1.0).contains(&q) {
        return None;
    }
    v.sort_by(f64::total_cmp);
    let pos = q * (v.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    Some(v[lo] + (v[hi] - v[lo]) * (pos - lo as f64))
}

/// A measure over the repeats of one point.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
pub struct Spread {
    pub n: usize,
    pub median: f64,
    pub q1: f64,
    pub q3: f64,
    pub min: f64,
    pub max: f64,
}

impl Spread {
    /// The spread of the finite values of `v`; `None` when there are none.
    pub fn of(v: &[f64]) -> Option<Spread> {
        let mut v: Vec<f64> = v.iter().copied().filter(|x| x.is_finite()).collect();
        Some(Spread {
            n: v.len(),
            median: quantile(&mut v, 0.5)?,
            q1: quantile(&mut v, 0.25)?,
            q3: quantile(&mut v, 0.75)?,
            min: v[0],
            max: v[v.len() - 1],
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn quantiles_interpolate_between_ranks() {
        let mut v = vec![4.0, 1.0, 3.0, 2.0, 5.0];
        assert_eq!(quantile(&mut v, 0.5), Some(3.0));
        assert_eq!(quantile(&mut v, 0.8), Some(4.2));
        assert_eq!(quantile(&mut v, 0.0), Some(1.0));
        assert_eq!(quantile(&mut v, 1.0), Some(5.0));
        assert_eq!(quantile(&mut [], 0.5), None);
        assert_eq!(quantile(&mut v, 1.5), None);
    }

    #[test]
    fn the_spread_ignores_values_that_are_not_numbers() {
        let s = Spread::of(&[f64::NAN, 10.0, 30.0, 20.0, f64::INFINITY]).unwrap();
        assert_eq!((s.n, s.median, s.min, s.max), (3, 20.0, 10.0, 30.0));
        assert_eq!((s.q1, s.q3), (15.0, 25.0));
        assert!(Spread::of(&[f64::NAN]).is_none());
    }
}
