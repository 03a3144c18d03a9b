//! A host's budget of QPs with work on the NIC at once (its QP-context cache), shared among its
//! apps as their QP gates (the shim's `max_active_qps`). Past the cache an app with many QPs
//! makes every app's QPs miss (the DRUM paper's Fig. 2(c)); the live optimiser's `k` counts apps,
//! not QPs, so the budget is split here: weighted max-min fair (water-filling) over the QPs each
//! app holds. An app holding fewer QPs than its share keeps them all, the rest is shared by
//! weight, and every app keeps at least one slot so none is starved.

/// What one app holds and weighs.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct QpDemand {
    /// The app's weight (the live policy's); non-finite or non-positive counts as 1.
    pub weight: f64,
    /// Connected QPs the app holds.
    pub qps: u64,
}

/// Each app's gate: at most this many of its QPs active at once (≥ 1). Every app gets one
/// slot first; the rest of the budget is water-filled by weight over what each holds beyond
/// it. The gates sum to at most `budget`, unless there are more apps than slots.
pub fn qp_gates(budget: u64, apps: &[QpDemand]) -> Vec<u64> {
    let wants: Vec<u64> = apps.iter().map(|a| a.qps.max(1) - 1).collect();
    let weights: Vec<f64> = apps
        .iter()
        .map(|a| {
            if a.weight.is_finite() && a.weight > 0.0 {
                a.weight
            } else {
                1.0
            }
        })
        .collect();
    let extra = water_fill(budget.saturating_sub(apps.len() as u64), &wants, &weights);
    extra.into_iter().map(|e| e + 1).collect()
}

/// Integer weighted max-min fair shares of `budget` for demands `wants`.
fn water_fill(budget: u64, wants: &[u64], weights: &[f64]) -> Vec<u64> {
    let mut share = vec![0u64; wants.len()];
    let mut open: Vec<usize> = (0..wants.len()).filter(|&i| wants[i] > 0).collect();
    let mut left = budget as f64;
    // Whoever wants less than its share at this level is satisfied; the level then rises.
    while !open.is_empty() {
        let total: f64 = open.iter().map(|&i| weights[i]).sum();
        let (done, rest): (Vec<usize>, Vec<usize>) = open
            .iter()
            .partition(|&&i| wants[i] as f64 <= left * weights[i] / total);
        if done.is_empty() {
            break;
        }
        for i in done {
            share[i] = wants[i];
            left -= wants[i] as f64;
        }
        open = rest;
    }
    // The rest share what is left by weight, rounded down, the remainder by largest fraction.
    let total: f64 = open.iter().map(|&i| weights[i]).sum();
    let mut fractions: Vec<(f64, usize)> = Vec::with_capacity(open.len());
    let mut given = 0u64;
    for &i in &open {
        let exact = left * weights[i] / total;
        share[i] = exact.floor() as u64;
        given += share[i];
        fractions.push((exact - exact.floor(), i));
    }
    let mut spare = (left.max(0.0).floor() as u64).saturating_sub(given);
    fractions.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
    for &(_, i) in &fractions {
        if spare == 0 {
            break;
        }
        share[i] += 1;
        spare -= 1;
    }
    share
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn d(weight: f64, qps: u64) -> QpDemand {
        QpDemand { weight, qps }
    }

    #[test]
    fn a_small_app_keeps_its_qps_and_a_large_one_gets_the_rest() {
        // The isolation scenario: a victim with one QP against an attacker with 64, a
        // 20-context cache.
        assert_eq!(qp_gates(20, &[d(1.0, 1), d(1.0, 64)]), vec![1, 19]);
    }

    #[test]
    fn large_apps_share_by_weight() {
        assert_eq!(qp_gates(22, &[d(1.0, 64), d(3.0, 64)]), vec![6, 16]);
        assert_eq!(
            qp_gates(20, &[d(1.0, 64), d(1.0, 64), d(1.0, 64)]),
            vec![7, 7, 6]
        );
    }

    #[test]
    fn within_the_budget_every_app_keeps_every_qp() {
        assert_eq!(
            qp_gates(20, &[d(1.0, 4), d(1.0, 8), d(1.0, 0)]),
            vec![4, 8, 1]
        );
    }

    #[test]
    fn more_apps_than_slots_still_get_one_each() {
        assert_eq!(
            qp_gates(2, &[d(1.0, 5), d(1.0, 5), d(1.0, 5)]),
            vec![1, 1, 1]
        );
    }

    proptest! {
        #[test]
        fn gates_are_within_the_budget_and_max_min_fair(
            budget in 1u64..200,
            apps in prop::collection::vec((0.1f64..10.0, 0u64..100), 1..12),
        ) {
            let apps: Vec<QpDemand> = apps.into_iter().map(|(w, q)| d(w, q)).collect();
            let g = qp_gates(budget, &apps);
            let sum: u64 = g.iter().sum();
            prop_assert!(sum <= budget.max(apps.len() as u64), "{g:?}");
            for (a, &gi) in apps.iter().zip(&g) {
                prop_assert!(gi >= 1);
                prop_assert!(gi <= a.qps.max(1) || a.qps == 0, "{g:?} for {apps:?}");
            }
            // Beyond the first slot, nobody held below what it wants has a weighted level
            // below anyone else's by more than rounding (max-min fairness).
            for (i, a) in apps.iter().enumerate() {
                if g[i] < a.qps.max(1) {
                    for (j, b) in apps.iter().enumerate() {
                        prop_assert!(
                            (g[j] as f64 - 2.0) / b.weight <= g[i] as f64 / a.weight + 1e-9,
                            "{g:?} for {apps:?}: {i} starved by {j}"
                        );
                    }
                    if budget >= apps.len() as u64 {
                        prop_assert_eq!(sum, budget, "{:?}: slots left over", g);
                    }
                }
            }
        }
    }
}
