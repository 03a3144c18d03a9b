//! The `--json` output of `solve` and `simulate` (docs/cli.md) and the human summary.

use drum_common::model::Problem;
use drum_common::solver::Solution;
use serde::Serialize;
use std::collections::BTreeMap;

#[derive(Serialize)]
pub struct SolutionReport {
    pub algorithm: &'static str,
    pub iterations: usize,
    pub converged: bool,
    pub objective: f64,
    pub upper_bound: f64,
    pub gap: f64,
    /// Gap over the activation value of the allocation (the strict measure).
    pub relative_gap: f64,
    /// Gap over |objective| (the objective, which includes every app's floor utility).
    pub relative_gap_objective: f64,
    pub primal_residual: f64,
    pub wall_ms: f64,
    pub rho: Option<f64>,
    pub prices: BTreeMap<String, f64>,
    pub rounds: Vec<RoundRow>,
    pub polish: PolishRow,
    pub hosts: Vec<HostRow>,
}

/// What the verified local search after the rounds did (docs/model.md, "Selection").
#[derive(Serialize)]
pub struct PolishRow {
    pub trials: usize,
    pub moves: usize,
    pub iterations: usize,
    pub settled: bool,
}

#[derive(Serialize)]
pub struct RoundRow {
    pub round: usize,
    pub iterations: usize,
    pub lower_bound: f64,
    pub upper_bound: f64,
    pub relative_gap: f64,
    pub swaps: usize,
}

#[derive(Serialize)]
pub struct HostRow {
    pub id: String,
    pub apps: Vec<AppRow>,
}

#[derive(Serialize)]
pub struct AppRow {
    pub id: String,
    pub active: bool,
    pub rate: f64,
    pub poll_rate: f64,
}

impl SolutionReport {
    pub fn new(
        problem: &Problem,
        s: &Solution,
        wall_ms: f64,
        rho: Option<f64>,
        with_hosts: bool,
    ) -> Self {
        let hosts = if with_hosts {
            s.hosts
                .iter()
                .map(|h| {
                    let host = &problem.hosts[h.host];
                    let mut rate = vec![None; host.pairs.len()];
                    for (&p, &x) in h.active.iter().zip(&h.x) {
                        rate[p - host.pairs.start] = Some(x);
                    }
                    HostRow {
                        id: host.id.clone(),
                        apps: host
                            .pairs
                            .clone()
                            .zip(rate)
                            .map(|(p, r)| {
                                let pair = &problem.pairs[p];
                                AppRow {
                                    id: problem.app_names[pair.app as usize].clone(),
                                    active: r.is_some(),
                                    rate: r.unwrap_or(0.0),
                                    poll_rate: r.unwrap_or(0.0) * pair.cqe_per_wqe,
                                }
                            })
                            .collect(),
                    }
                })
                .collect()
        } else {
            Vec::new()
        };
        Self {
            algorithm: s.algorithm.name(),
            iterations: s.iterations,
            converged: s.converged,
            objective: s.objective,
            upper_bound: s.upper_bound(),
            gap: s.gap,
            relative_gap: s.relative_gap,
            relative_gap_objective: s.gap / s.objective.abs().max(f64::MIN_POSITIVE),
            primal_residual: s.primal_residual,
            wall_ms,
            rho,
            prices: problem
                .facilities
                .iter()
                .zip(&s.prices)
                .map(|(f, &p)| (f.id.clone(), p))
                .collect(),
            rounds: s
                .rounds
                .iter()
                .map(|r| RoundRow {
                    round: r.round,
                    iterations: r.iterations,
                    lower_bound: r.lower_bound,
                    upper_bound: r.upper_bound,
                    relative_gap: r.relative_gap(),
                    swaps: r.swaps,
                })
                .collect(),
            polish: PolishRow {
                trials: s.polish.trials,
                moves: s.polish.moves,
                iterations: s.polish.iterations,
                settled: s.polish.settled,
            },
            hosts,
        }
    }

    pub fn summary(&self) -> String {
        let active: usize = self
            .hosts
            .iter()
            .map(|h| h.apps.iter().filter(|a| a.active).count())
            .sum();
        let mut out = format!(
            "{}: {} iterations ({}), objective {:.6}, certified gap {:.4} ({:.3}% of the activation value, {:.3}% of |objective|), primal residual {:.2e}, {:.1} ms\n",
            self.algorithm,
            self.iterations,
            if self.converged { "converged" } else { "iteration cap reached" },
            self.objective,
            self.gap,
            100.0 * self.relative_gap,
            100.0 * self.relative_gap_objective,
            self.primal_residual,
            self.wall_ms
        );
        if !self.hosts.is_empty() {
            out += &format!(
                "{} hosts, {} active (host, app) pairs\n",
                self.hosts.len(),
                active
            );
        }
        let mut prices: Vec<_> = self.prices.iter().filter(|(_, p)| **p > 0.0).collect();
        prices.sort_by(|a, b| b.1.total_cmp(a.1));
        if !prices.is_empty() {
            let shown: Vec<String> = prices
                .iter()
                .take(5)
                .map(|(f, p)| format!("{f}={p:.4}"))
                .collect();
            out += &format!(
                "{} facilities priced; highest: {}\n",
                prices.len(),
                shown.join(", ")
            );
        }
        out
    }
}
