//! Scalar root finding for strictly decreasing functions on a bracket.
//!
//! Every root the optimiser needs is of this kind: the best response `x` of one app (the
//! derivative of a strictly concave objective), and the host multipliers `μ`, `ν` (usage falls as
//! a price rises). The finder keeps a bracket, so it cannot diverge whatever the data.

/// Root of a strictly decreasing `f` in `[lo, hi]` with `f(lo) > 0 > f(hi)`, by Newton steps that
/// fall back to bisection whenever a step would leave the bracket or stall. `f` returns the
/// value and the derivative. `x0` is a starting guess (clamped into the bracket).
pub fn newton_decreasing(
    mut f: impl FnMut(f64) -> (f64, f64),
    mut lo: f64,
    mut hi: f64,
    x0: f64,
) -> f64 {
    let mut x = if x0 > lo && x0 < hi {
        x0
    } else {
        0.5 * (lo + hi)
    };
    // rtsafe: take the Newton step unless it leaves the bracket or shrinks it too slowly.
    let mut dx_old = hi - lo;
    for _ in 0..200 {
        let (v, dv) = f(x);
        if v == 0.0 {
            return x;
        }
        if v > 0.0 {
            lo = x;
        } else {
            hi = x;
        }
        let step = v / dv;
        if dv < 0.0 && step.abs() <= 1e-14 * x.abs() {
            // Converged to rounding: the Newton step no longer moves x.
            return x - step;
        }
        let newton = x - step;
        let dx = if dv < 0.0 && newton > lo && newton < hi && (2.0 * v).abs() <= (dx_old * dv).abs()
        {
            newton - x
        } else {
            0.5 * (lo + hi) - x
        };
        dx_old = dx;
        x += dx;
        if dx.abs() <= 1e-14 * x.abs() || hi - lo <= 4.0 * f64::EPSILON * hi.abs() {
            return x;
        }
    }
    0.5 * (lo + hi)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn newton_finds_roots_of_steep_functions() {
        let r = newton_decreasing(|x| (1.0 / x - 4.0, -1.0 / (x * x)), 1e-6, 10.0, 5.0);
        assert!((r - 0.25).abs() < 1e-12);
        let r = newton_decreasing(
            |x| (1.0 / (x * x * x) - 8.0, -3.0 / x.powi(4)),
            1e-3,
            1.0,
            0.9,
        );
        assert!((r - 0.5).abs() < 1e-12);
    }
}
