//! The exact optimum of small instances, by trying every choice of active sets: the yardstick
//! selection is measured against (docs/benchmarks.md, "Selection against the exact optimum").
//!
//! Each choice of active sets is a concave problem that sharing ADMM solves to high accuracy,
//! so the best of them is the true optimum of the mixed problem up to that accuracy. The count
//! of choices is `Π_i Σ_{s≤k} C(m_i, s)`, so this is for a handful of hosts and apps only.

use crate::generator::{generate, GeneratorConfig};
use crate::model::Problem;
use crate::rng::SplitMix64;
use crate::solver::{activation_value, default_rho, feasible, fixed_set_trace, Algorithm};
use rayon::prelude::*;

/// Iteration cap and residual tolerance of each fixed-set solve: ADMM reaches 1e-9 in a few
/// hundred iterations on these sizes, far below the shortfalls being measured.
const FIXED_SET_ITERS: usize = 4000;
const FIXED_SET_EPS: f64 = 1e-9;

/// Every subset of `items` with at most `k` elements, the empty one included, ascending.
pub fn subsets_up_to(items: &[usize], k: usize) -> Vec<Vec<usize>> {
    let mut out = vec![Vec::new()];
    for &item in items {
        let longer: Vec<Vec<usize>> = out
            .iter()
            .filter(|s| s.len() < k)
            .map(|s| {
                let mut t = s.clone();
                t.push(item);
                t
            })
            .collect();
        out.extend(longer);
    }
    out
}

/// How many choices of active sets [`optimum`] would try.
pub fn choices(problem: &Problem) -> usize {
    (0..problem.hosts.len())
        .map(|h| {
            let m = problem.hosts[h].pairs.len();
            (0..=problem.slots(h))
                .map(|s| binomial(m, s))
                .sum::<usize>()
        })
        .product()
}

fn binomial(n: usize, k: usize) -> usize {
    (0..k).fold(1, |acc, i| acc * (n - i) / (i + 1))
}

/// The best activation value over every choice of active sets, and those sets. Choices that
/// overload a facility at `x_min` have no feasible allocation and are skipped.
pub fn optimum(problem: &Problem) -> (f64, Vec<Vec<usize>>) {
    let per_host: Vec<Vec<Vec<usize>>> = (0..problem.hosts.len())
        .map(|h| {
            let pairs: Vec<usize> = problem.hosts[h].pairs.clone().collect();
            subsets_up_to(&pairs, problem.slots(h))
        })
        .collect();
    let total = per_host.iter().map(Vec::len).product::<usize>();
    let rho = default_rho(problem);
    (0..total)
        .into_par_iter()
        .filter_map(|mut index| {
            // Mixed-radix decoding of `index` into one subset per host.
            let sets: Vec<Vec<usize>> = per_host
                .iter()
                .map(|options| {
                    let s = options[index % options.len()].clone();
                    index /= options.len();
                    s
                })
                .collect();
            if !floors_fit(problem, &sets) {
                return None;
            }
            let (_, hosts) = fixed_set_trace(
                problem,
                sets.clone(),
                Algorithm::Admm,
                rho,
                FIXED_SET_ITERS,
                FIXED_SET_EPS,
            );
            Some((activation_value(problem, &feasible(problem, &hosts)), sets))
        })
        .max_by(|a, b| a.0.total_cmp(&b.0))
        .expect("the empty choice is always feasible")
}

/// Whether every facility carries its members at `x_min`.
fn floors_fit(problem: &Problem, sets: &[Vec<usize>]) -> bool {
    let mut floor = vec![0.0; problem.facilities.len()];
    for &p in sets.iter().flatten() {
        for &(f, b) in &problem.pairs[p].uses {
            floor[f as usize] += b * problem.params.x_min;
        }
    }
    floor
        .iter()
        .zip(&problem.facilities)
        .all(|(&y, f)| y <= f.capacity)
}

/// A small random instance for comparisons with [`optimum`]: 2–3 hosts, k = 1–3, more apps than
/// `k` (up to 6, so that there is something to choose), the generator's random weights, `a`,
/// demands and budgets, and facility capacities scaled by a random 0.5–1.5 so that they bind
/// to different degrees; sizes whose enumeration would exceed `max_choices` are redrawn.
pub fn random_small(seed: u64, max_choices: usize) -> Problem {
    let mut rng = SplitMix64::fork(seed, 0x005e_1ec7);
    loop {
        let hosts = 2 + rng.below(2);
        let k = 1 + rng.below(3);
        let apps = k + 1 + rng.below(6 - k);
        let mut problem = generate(&GeneratorConfig {
            k,
            seed: rng.next_u64(),
            ..GeneratorConfig::new(hosts, apps)
        });
        let floor = 2.0 * problem.params.x_min * 1.5;
        for f in &mut problem.facilities {
            f.capacity = (f.capacity * rng.range(0.5, 1.5)).max(floor);
        }
        if choices(&problem) <= max_choices {
            return problem;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn subsets_are_all_there_once() {
        let s = subsets_up_to(&[4, 5, 6, 7], 2);
        assert_eq!(s.len(), 1 + 4 + 6);
        let mut sorted = s.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), s.len());
        assert!(s
            .iter()
            .all(|t| t.len() <= 2 && t.windows(2).all(|w| w[0] < w[1])));
        assert_eq!(binomial(6, 3), 20);
    }

    #[test]
    fn random_small_instances_respect_the_bounds() {
        for seed in 0..50 {
            let p = random_small(seed, 5000);
            assert!((2..=3).contains(&p.hosts.len()) && p.params.k <= 3);
            let apps = p.hosts[0].pairs.len();
            assert!(apps > p.params.k && apps <= 6);
            assert!(choices(&p) <= 5000);
        }
    }
}
