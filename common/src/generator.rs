//! Instances like the DRUM paper's simulation (docs/generator.md): `n` hosts, each running the
//! same `m` applications, one facility per application (its serving endpoint), `k = 20` active
//! apps per host by default, and budgets and capacities drawn so that they bind.

use crate::model::{Facility, Host, Pair, Params, Problem};
use crate::rng::SplitMix64;
use rayon::prelude::*;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct GeneratorConfig {
    pub hosts: usize,
    pub apps: usize,
    pub k: usize,
    pub seed: u64,
    pub alpha: f64,
    pub beta: f64,
    pub x_min: f64,
}

impl GeneratorConfig {
    pub fn new(hosts: usize, apps: usize) -> Self {
        Self {
            hosts,
            apps,
            k: 20,
            seed: 1,
            alpha: 1.0,
            beta: 1e-4,
            x_min: 0.005,
        }
    }
}

/// Ranges of the drawn values; see docs/generator.md for why these.
const APP_WEIGHT: (f64, f64) = (1.0, 4.0);
const HOST_WEIGHT_JITTER: (f64, f64) = (0.8, 1.25);
const CQE_PER_WQE: (f64, f64) = (1.0, 10.0);
const DEMAND: (f64, f64) = (0.02, 0.3);
const FACILITY_COEFF: (f64, f64) = (0.5, 1.5);
const WQE_BUDGET: (f64, f64) = (0.8, 1.0);
const POLL_BUDGET: (f64, f64) = (2.5, 4.5);
/// Capacity as a fraction of the load a facility would see if every host spread its budget
/// evenly over `k` uniformly chosen apps.
const CAPACITY_FRACTION: (f64, f64) = (0.3, 0.8);

pub fn generate(cfg: &GeneratorConfig) -> Problem {
    assert!(
        cfg.hosts > 0 && cfg.apps > 0 && cfg.k > 0,
        "generator needs hosts, apps and k > 0"
    );
    let mut rng = SplitMix64::new(cfg.seed);
    let app_weight: Vec<f64> = (0..cfg.apps)
        .map(|_| rng.range(APP_WEIGHT.0, APP_WEIGHT.1))
        .collect();
    let slots = cfg.k.min(cfg.apps) as f64;
    let active_per_facility = cfg.hosts as f64 * slots / cfg.apps as f64;
    let mean_rate = 0.5 * (WQE_BUDGET.0 + WQE_BUDGET.1) / slots;
    let mean_coeff = 0.5 * (FACILITY_COEFF.0 + FACILITY_COEFF.1);
    let facilities: Vec<Facility> = (0..cfg.apps)
        .map(|j| {
            let even_load = active_per_facility * mean_rate * mean_coeff;
            let capacity = (rng.range(CAPACITY_FRACTION.0, CAPACITY_FRACTION.1) * even_load)
                .max(2.0 * FACILITY_COEFF.1 * cfg.x_min);
            Facility {
                id: format!("f{j}"),
                capacity,
                cost: 0.0,
            }
        })
        .collect();
    let hosts: Vec<Host> = (0..cfg.hosts)
        .map(|i| Host {
            id: format!("h{i}"),
            wqe_budget: rng.range(WQE_BUDGET.0, WQE_BUDGET.1),
            poll_budget: rng.range(POLL_BUDGET.0, POLL_BUDGET.1),
            k: None,
            pairs: i * cfg.apps..(i + 1) * cfg.apps,
        })
        .collect();
    let mut pairs = vec![
        Pair {
            app: 0,
            weight: 0.0,
            cqe_per_wqe: 0.0,
            demand: 0.0,
            uses: Vec::new(),
        };
        cfg.hosts * cfg.apps
    ];
    pairs
        .par_chunks_mut(cfg.apps)
        .enumerate()
        .for_each(|(i, chunk)| {
            let mut rng = SplitMix64::fork(cfg.seed, i as u64 + 1);
            for (j, pair) in chunk.iter_mut().enumerate() {
                *pair = Pair {
                    app: j as u32,
                    weight: app_weight[j] * rng.range(HOST_WEIGHT_JITTER.0, HOST_WEIGHT_JITTER.1),
                    cqe_per_wqe: rng.range(CQE_PER_WQE.0, CQE_PER_WQE.1),
                    demand: rng.range(DEMAND.0, DEMAND.1).max(cfg.x_min),
                    uses: vec![(j as u32, rng.range(FACILITY_COEFF.0, FACILITY_COEFF.1))],
                };
            }
        });
    Problem {
        params: Params {
            alpha: cfg.alpha,
            beta: cfg.beta,
            k: cfg.k,
            x_min: cfg.x_min,
        },
        facilities,
        app_names: (0..cfg.apps).map(|j| format!("app{j}")).collect(),
        hosts,
        pairs,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::instance::Instance;

    #[test]
    fn generated_instances_validate_and_are_reproducible() {
        let cfg = GeneratorConfig::new(30, 40);
        let p = generate(&cfg);
        assert_eq!(p, generate(&cfg));
        let again = Instance::from_problem(&p)
            .into_problem()
            .expect("generated instance validates");
        assert_eq!(again, p);
        assert_ne!(generate(&GeneratorConfig { seed: 2, ..cfg }), p);
    }
}
