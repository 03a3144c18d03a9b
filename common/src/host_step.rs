//! One host's allocation problem, the building block of every algorithm here:
//!
//! maximise `Σ_j U_j(x_j) − lin_j·x_j − (q_j/2)(x_j − t_j)²` over `x_j ∈ [x_min, x̄_j]`,
//! subject to `Σ x_j ≤ Q` and `Σ a_j x_j ≤ C`.
//!
//! ADMM's x-step is the case `lin = 0, q = ρb², t = x_old − d/b`; dual decomposition's is
//! `lin = π·b, q = 0`; a surplus at given prices is a single app with `q = 0`. For fixed
//! multipliers `μ` (for `Q`) and `ν` (for `C`) each `x_j` is the unique root of a strictly
//! decreasing function, clamped to its box; `μ` and `ν` come from nested safeguarded Newton on
//! the budgets (the partial dual in `ν` is convex, so the outer search is on a monotone function).

use crate::roots::newton_decreasing;
use crate::utility::Utility;

/// One active app's term in a host problem.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AppTerm {
    pub u: Utility,
    pub lin: f64,
    pub q: f64,
    pub t: f64,
    /// Upper bound of the box (the demand cap `x̄`); the lower bound is `x_min`.
    pub hi: f64,
}

impl AppTerm {
    /// Derivative of the app's objective term at `x`, before multipliers.
    pub fn marginal(&self, x: f64) -> f64 {
        self.u.d1(x) - self.lin - self.q * (x - self.t)
    }

    /// Maximiser of the term minus `shift·x` over the box.
    pub fn best_response(&self, shift: f64, guess: f64) -> f64 {
        let lo = self.u.shape.x_min;
        let h = |x: f64| self.marginal(x) - shift;
        if h(lo) <= 0.0 {
            return lo;
        }
        if h(self.hi) >= 0.0 {
            return self.hi;
        }
        let guess = if guess > lo && guess < self.hi {
            guess
        } else if self.q == 0.0 {
            self.u.inverse_marginal_guess(self.lin + shift)
        } else {
            0.5 * (lo + self.hi)
        };
        newton_decreasing(|x| (h(x), self.u.d2(x) - self.q), lo, self.hi, guess)
    }

    /// The smallest shift at which the best response sits at `x_min`.
    fn shift_to_floor(&self) -> f64 {
        self.marginal(self.u.shape.x_min).max(0.0)
    }

    /// The term's value at `x` (without multipliers).
    pub fn value(&self, x: f64) -> f64 {
        let dx = x - self.t;
        self.u.value(x) - self.lin * x - 0.5 * self.q * dx * dx
    }
}

/// Host multipliers of the solution.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct Multipliers {
    pub mu: f64,
    pub nu: f64,
}

/// Budget usage at given multipliers, with the derivatives Newton's method needs. Only apps
/// strictly inside their box move with the multipliers: `dx_j/dshift = 1/h'_j` with
/// `h'_j = U''_j − q_j < 0`.
#[derive(Clone, Copy, Debug, Default)]
struct Usage {
    sum: f64,
    poll: f64,
    /// `Σ 1/h'`, `Σ a/h'`, `Σ a²/h'` over interior apps.
    inv: f64,
    a_inv: f64,
    a2_inv: f64,
}

fn respond(terms: &[AppTerm], mu: f64, nu: f64, x: &mut [f64]) -> Usage {
    let mut u = Usage::default();
    for (term, xj) in terms.iter().zip(x.iter_mut()) {
        let a = term.u.a;
        *xj = term.best_response(mu + nu * a, *xj);
        u.sum += *xj;
        u.poll += a * *xj;
        if *xj > term.u.shape.x_min && *xj < term.hi {
            let inv = 1.0 / (term.u.d2(*xj) - term.q);
            u.inv += inv;
            u.a_inv += a * inv;
            u.a2_inv += a * a * inv;
        }
    }
    u
}

/// Solves the host problem; `x` holds warm-start guesses on entry and the solution on exit,
/// `warm` the previous multipliers (a starting point only).
pub fn solve_host(
    terms: &[AppTerm],
    wqe_budget: f64,
    poll_budget: f64,
    x: &mut [f64],
    warm: Multipliers,
) -> Multipliers {
    assert_eq!(terms.len(), x.len());
    // μ for a given ν: zero if the WQE budget is slack, else the root that makes it tight.
    let mu_for = |nu: f64, guess: f64, x: &mut [f64]| -> f64 {
        if respond(terms, 0.0, nu, x).sum <= wqe_budget {
            return 0.0;
        }
        let mu_hi = terms
            .iter()
            .map(|t| (t.shift_to_floor() - nu * t.u.a).max(0.0))
            .fold(0.0, f64::max)
            * (1.0 + 1e-9)
            + f64::MIN_POSITIVE;
        newton_decreasing(
            |mu| {
                let u = respond(terms, mu, nu, x);
                (u.sum - wqe_budget, u.inv)
            },
            0.0,
            mu_hi,
            guess,
        )
    };
    let mu0 = mu_for(0.0, warm.mu, x);
    if respond(terms, mu0, 0.0, x).poll <= poll_budget {
        return Multipliers { mu: mu0, nu: 0.0 };
    }
    let nu_hi = terms
        .iter()
        .map(|t| t.shift_to_floor() / t.u.a)
        .fold(0.0, f64::max)
        * (1.0 + 1e-9)
        + f64::MIN_POSITIVE;
    let mut mu = warm.mu;
    let nu = newton_decreasing(
        |nu| {
            mu = mu_for(nu, mu, x);
            let u = respond(terms, mu, nu, x);
            // With μ > 0 the WQE budget stays tight as ν moves, which moves μ too.
            let slope = if mu > 0.0 && u.inv != 0.0 {
                u.a2_inv - u.a_inv * u.a_inv / u.inv
            } else {
                u.a2_inv
            };
            (u.poll - poll_budget, slope)
        },
        0.0,
        nu_hi,
        warm.nu,
    );
    let mu = mu_for(nu, mu, x);
    respond(terms, mu, nu, x);
    Multipliers { mu, nu }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::utility::Shape;
    use proptest::prelude::*;

    /// An app from `(w, a, x̄, q, t, lin)` with the given utility shape.
    fn term(
        (w, a, hi, q, t, lin): (f64, f64, f64, f64, f64, f64),
        alpha: f64,
        beta: f64,
    ) -> AppTerm {
        AppTerm {
            u: Utility {
                w,
                a,
                shape: Shape {
                    alpha,
                    beta,
                    x_min: 0.01,
                },
            },
            lin,
            q,
            t,
            hi,
        }
    }

    /// KKT conditions of the host problem, with tolerances relative to the data's scale.
    fn assert_kkt(terms: &[AppTerm], q_budget: f64, c_budget: f64, x: &[f64], m: Multipliers) {
        let sum: f64 = x.iter().sum();
        let poll: f64 = terms.iter().zip(x).map(|(t, x)| t.u.a * x).sum();
        assert!(
            sum <= q_budget * (1.0 + 1e-9),
            "WQE budget: {sum} > {q_budget}"
        );
        assert!(
            poll <= c_budget * (1.0 + 1e-9),
            "poll budget: {poll} > {c_budget}"
        );
        assert!(m.mu >= 0.0 && m.nu >= 0.0);
        let scale = terms
            .iter()
            .zip(x)
            .map(|(t, &x)| t.u.d1(x).abs())
            .fold(1.0, f64::max);
        assert!(
            m.mu * (q_budget - sum) <= 1e-6 * scale * q_budget,
            "μ slack: μ={} slack={}",
            m.mu,
            q_budget - sum
        );
        assert!(
            m.nu * (c_budget - poll) <= 1e-6 * scale * c_budget,
            "ν slack: ν={} slack={}",
            m.nu,
            c_budget - poll
        );
        for (t, &xj) in terms.iter().zip(x) {
            let lo = t.u.shape.x_min;
            assert!(xj >= lo && xj <= t.hi, "box: {xj} not in [{lo}, {}]", t.hi);
            let g = t.marginal(xj) - m.mu - m.nu * t.u.a;
            let tol = 1e-6 * scale;
            if xj > lo * (1.0 + 1e-12) && xj < t.hi * (1.0 - 1e-12) {
                assert!(g.abs() <= tol, "stationarity: g={g} at x={xj}");
            } else if xj <= lo * (1.0 + 1e-12) {
                assert!(g <= tol, "lower bound: g={g}");
            } else {
                assert!(g >= -tol, "upper bound: g={g}");
            }
        }
    }

    #[test]
    fn slack_budgets_give_unconstrained_optimum() {
        let terms = [term((1.0, 1.0, 0.9, 0.0, 0.0, 4.0), 1.0, 0.0)];
        let mut x = [0.0];
        let m = solve_host(&terms, 10.0, 10.0, &mut x, Multipliers::default());
        assert!((x[0] - 0.25).abs() < 1e-12);
        assert_eq!(m, Multipliers::default());
    }

    #[test]
    fn both_budgets_binding() {
        let terms: Vec<_> = (0..5)
            .map(|j| {
                let w = 1.0 + j as f64;
                term((w, w, 0.8, 0.0, 0.0, 0.1), 1.0, 1e-4)
            })
            .collect();
        // With only the WQE budget binding, usage of the polling budget is 1.82.
        let mut x = vec![0.0; 5];
        let m = solve_host(&terms, 0.5, 1.5, &mut x, Multipliers::default());
        assert!(m.mu > 0.0 && m.nu > 0.0, "{m:?}");
        assert_kkt(&terms, 0.5, 1.5, &x, m);
    }

    proptest! {
        #[test]
        fn host_step_satisfies_kkt(
            apps in prop::collection::vec((0.1f64..10.0, 1.0f64..10.0, 0.02f64..1.0, 0.0f64..50.0, -0.5f64..1.0, 0.0f64..20.0), 1..25),
            alpha in prop::sample::select(vec![0.5, 1.0, 2.0]),
            beta in prop::sample::select(vec![0.0, 1e-4, 1e-2]),
            q_budget in 0.3f64..3.0,
            c_budget in 2.0f64..30.0,
        ) {
            let terms: Vec<_> = apps
                .iter()
                .map(|&app| term(app, alpha, beta))
                .collect();
            // Keep the instance floor-feasible, as validation guarantees.
            let floor_poll: f64 = terms.iter().map(|t| t.u.a * 0.01).sum();
            prop_assume!(terms.len() as f64 * 0.01 <= q_budget && floor_poll <= c_budget);
            let mut x = vec![0.0; terms.len()];
            let m = solve_host(&terms, q_budget, c_budget, &mut x, Multipliers::default());
            assert_kkt(&terms, q_budget, c_budget, &x, m);
        }
    }
}
