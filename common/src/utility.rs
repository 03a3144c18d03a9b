//! The per-application utility of docs/design.md §3 and its derivatives.
//!
//! `U(x) = w·x^(1−α)/(1−α) − β/x²` (`w·ln x` for α = 1). The DRUM paper's CQ utility is
//! `−β/(a·x)²` with the polling rate `a·x`; this model drops `a` from it, so that an app
//! cannot gain rate by signalling fewer of its work requests (docs/model.md, "The polling
//! term"); `a` still counts against the host's polling budget. Because rates are fractions of line
//! rate, `U` is negative for every α ≥ 1, so "how much does activating this app add" cannot be
//! `U` itself (parking every app would look best, and heavier apps would look worse). Selection
//! therefore ranks by the *activation value* `V(x) = U(x) − w·x_min^(1−α)/(1−α)`, which is `U`
//! shifted by a per-app constant: zero rate-utility at the floor rate, positive above it. For fixed
//! active sets `U` and `V` have the same maximisers; see docs/model.md.

/// The shape parameters shared by every application of an instance.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Shape {
    pub alpha: f64,
    pub beta: f64,
    pub x_min: f64,
}

/// One application's utility on one host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Utility {
    pub w: f64,
    pub a: f64,
    pub shape: Shape,
}

impl Utility {
    fn rate_term(&self, x: f64) -> f64 {
        let alpha = self.shape.alpha;
        if alpha == 1.0 {
            self.w * x.ln()
        } else {
            self.w * x.powf(1.0 - alpha) / (1.0 - alpha)
        }
    }

    /// `U(x)`, the objective's term for an active app at rate `x > 0`.
    pub fn value(&self, x: f64) -> f64 {
        self.rate_term(x) - self.shape.beta / (x * x)
    }

    /// `V(x) = U(x) − U_rate(x_min)`: what activating the app at rate `x` adds.
    pub fn activation_value(&self, x: f64) -> f64 {
        self.value(x) - self.rate_term(self.shape.x_min)
    }

    /// The constant `U(x) − V(x)`.
    pub fn activation_offset(&self) -> f64 {
        self.rate_term(self.shape.x_min)
    }

    /// `U'(x) > 0`.
    pub fn d1(&self, x: f64) -> f64 {
        let rate = if self.shape.alpha == 1.0 {
            self.w / x
        } else {
            self.w * x.powf(-self.shape.alpha)
        };
        rate + 2.0 * self.shape.beta / (x * x * x)
    }

    /// `U''(x) < 0`.
    pub fn d2(&self, x: f64) -> f64 {
        let rate = if self.shape.alpha == 1.0 {
            -self.w / (x * x)
        } else {
            -self.shape.alpha * self.w * x.powf(-self.shape.alpha - 1.0)
        };
        let x2 = x * x;
        rate - 6.0 * self.shape.beta / (x2 * x2)
    }

    /// A cheap guess of the root of `U'(x) = c`, exact when β = 0.
    pub fn inverse_marginal_guess(&self, c: f64) -> f64 {
        if self.shape.alpha == 1.0 {
            self.w / c
        } else {
            (self.w / c).powf(1.0 / self.shape.alpha)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn numeric_derivative(f: impl Fn(f64) -> f64, x: f64) -> f64 {
        let h = x * 1e-6;
        (f(x + h) - f(x - h)) / (2.0 * h)
    }

    #[test]
    fn derivatives_match_finite_differences() {
        for &alpha in &[0.5, 1.0, 2.0, 3.5] {
            let u = Utility {
                w: 2.5,
                a: 3.0,
                shape: Shape {
                    alpha,
                    beta: 1e-3,
                    x_min: 0.01,
                },
            };
            for &x in &[0.02, 0.1, 0.5, 0.9] {
                let d1 = numeric_derivative(|x| u.value(x), x);
                assert!(
                    (d1 - u.d1(x)).abs() <= 1e-5 * u.d1(x).abs(),
                    "α={alpha} x={x}"
                );
                let d2 = numeric_derivative(|x| u.d1(x), x);
                assert!(
                    (d2 - u.d2(x)).abs() <= 1e-5 * u.d2(x).abs(),
                    "α={alpha} x={x}"
                );
                assert!(u.d1(x) > 0.0 && u.d2(x) < 0.0);
            }
            let floor = u.shape.x_min;
            let beta_part = -u.shape.beta / (floor * floor);
            assert!((u.activation_value(floor) - beta_part).abs() < 1e-9);
        }
    }

    /// Signalling fewer work requests (a smaller `a`) buys no rate: the marginal utility,
    /// which sets the rate at a given price, does not depend on `a`. The paper's
    /// `−β/(a x)²` gave an app signalling one WR in a hundred 10⁴ times the polling term's
    /// marginal, and with it most of a shared link.
    #[test]
    fn the_marginal_utility_does_not_reward_signalling_less() {
        let u = |a| Utility {
            w: 1.0,
            a,
            shape: Shape {
                alpha: 1.0,
                beta: 1e-4,
                x_min: 0.005,
            },
        };
        for x in [0.01, 0.1, 0.5, 1.0] {
            assert_eq!(u(0.01).d1(x), u(1.0).d1(x), "x = {x}");
            assert_eq!(u(0.01).value(x), u(1.0).value(x), "x = {x}");
        }
    }

    #[test]
    fn guess_is_exact_without_polling_term() {
        let u = Utility {
            w: 3.0,
            a: 2.0,
            shape: Shape {
                alpha: 2.0,
                beta: 0.0,
                x_min: 0.01,
            },
        };
        let x = u.inverse_marginal_guess(12.0);
        assert!((u.d1(x) - 12.0).abs() < 1e-9);
    }
}
