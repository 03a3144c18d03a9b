//! Dual decomposition (price gradient), the baseline: every facility keeps a price, hosts
//! best-respond to it, and prices move with the facility's excess usage.

use crate::model::Facility;

#[derive(Clone, Copy, Debug, PartialEq)]
pub enum DualStep {
    /// The DRUM paper's diminishing step `η_k = 10⁻³/√k` on the raw gradient `s − Y`.
    Paper,
    /// A scale-free constant step: `Δπ_f = η·π_ref·(s_f − Y_f)/Y_f`, `π_ref` a typical marginal
    /// utility of the instance (so one `η` fits every size); the best we found for this model.
    Normalised { eta: f64, price_ref: f64 },
}

#[derive(Clone, Debug, PartialEq)]
pub struct DualState {
    pub step: DualStep,
    pub prices: Vec<f64>,
    pub iteration: usize,
}

impl DualState {
    pub fn new(step: DualStep, facilities: usize) -> Self {
        Self {
            step,
            prices: vec![0.0; facilities],
            iteration: 0,
        }
    }

    /// One projected gradient step on the prices; returns the relative price change.
    pub fn update(&mut self, facilities: &[Facility], sums: &[f64]) -> f64 {
        self.iteration += 1;
        let (mut dp2, mut p2) = (0.0, 0.0);
        for ((price, spec), &s) in self.prices.iter_mut().zip(facilities).zip(sums) {
            let excess = s - spec.capacity;
            let delta = match self.step {
                DualStep::Paper => 1e-3 / (self.iteration as f64).sqrt() * excess,
                DualStep::Normalised { eta, price_ref } => eta * price_ref * excess / spec.capacity,
            };
            let next = (*price + delta).max(0.0);
            dp2 += (next - *price).powi(2);
            p2 += next * next;
            *price = next;
        }
        dp2.sqrt() / (1.0 + p2.sqrt())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prices_rise_with_excess_and_stay_non_negative() {
        let fac = [
            Facility {
                id: "a".into(),
                capacity: 1.0,
                cost: 0.0,
            },
            Facility {
                id: "b".into(),
                capacity: 1.0,
                cost: 0.0,
            },
        ];
        let mut d = DualState::new(
            DualStep::Normalised {
                eta: 0.5,
                price_ref: 2.0,
            },
            2,
        );
        d.update(&fac, &[2.0, 0.0]);
        assert_eq!(d.prices, vec![1.0, 0.0]);
        let mut d = DualState::new(DualStep::Paper, 1);
        d.update(&fac[..1], &[1001.0]);
        assert!((d.prices[0] - 1.0).abs() < 1e-12);
    }
}
