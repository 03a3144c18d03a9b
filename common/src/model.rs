//! The validated, compact form of an instance the optimisers work on.
//!
//! Pairs (host, app) are stored contiguously per host in one vector (struct of plain numbers,
//! names interned), so memory is linear in the number of pairs and a host's data is one slice.

use crate::utility::{Shape, Utility};
use std::ops::Range;

#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Params {
    pub alpha: f64,
    pub beta: f64,
    pub k: usize,
    pub x_min: f64,
}

impl Params {
    pub fn shape(&self) -> Shape {
        Shape {
            alpha: self.alpha,
            beta: self.beta,
            x_min: self.x_min,
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Facility {
    pub id: String,
    pub capacity: f64,
    /// Coefficient `c` of the optional convex cost `G(y) = c·y²/2`.
    pub cost: f64,
}

impl Facility {
    /// `argmin_{0≤y≤Y} G(y) + (κ/2)(y − v)²`.
    pub fn prox(&self, v: f64, kappa: f64) -> f64 {
        (kappa * v / (self.cost + kappa)).clamp(0.0, self.capacity)
    }

    pub fn cost_of(&self, y: f64) -> f64 {
        0.5 * self.cost * y * y
    }

    /// `sup_{0≤y≤Y} π·y − G(y)`, the facility's share of the weak-duality bound.
    pub fn conjugate(&self, price: f64) -> f64 {
        if price <= 0.0 {
            return 0.0;
        }
        let y = if self.cost > 0.0 {
            (price / self.cost).min(self.capacity)
        } else {
            self.capacity
        };
        price * y - self.cost_of(y)
    }
}

/// One application present on one host.
#[derive(Clone, Debug, PartialEq)]
pub struct Pair {
    /// Index into [`Problem::app_names`].
    pub app: u32,
    pub weight: f64,
    /// Completions per WQE (`a`).
    pub cqe_per_wqe: f64,
    /// Demand cap `x̄`.
    pub demand: f64,
    /// `(f, b_f)`: how much of facility `f` one unit of this app's rate uses; sorted by
    /// facility, each facility once, every `b_f > 0`. Empty: the pair loads no shared resource
    /// (only its host's budgets bound it).
    pub uses: Vec<(u32, f64)>,
}

impl Pair {
    /// `Σ_f b_f²`, the curvature one unit of rate adds to the pair's ADMM penalty.
    pub fn coeff_norm2(&self) -> f64 {
        self.uses.iter().map(|&(_, b)| b * b).sum()
    }

    /// `Σ_f π_f b_f`: what one unit of rate costs at facility prices `price`.
    pub fn charge(&self, price: impl Fn(u32) -> f64) -> f64 {
        self.uses.iter().map(|&(f, b)| price(f) * b).sum()
    }

    /// The largest rate every facility of the pair could carry with the pair alone on it.
    pub fn alone_cap(&self, facilities: &[Facility]) -> f64 {
        self.uses
            .iter()
            .map(|&(f, b)| facilities[f as usize].capacity / b)
            .fold(f64::INFINITY, f64::min)
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Host {
    pub id: String,
    /// `Q_i`.
    pub wqe_budget: f64,
    /// `C_i`.
    pub poll_budget: f64,
    /// This host's `k`, where it differs from [`Params::k`] (live hosts report their own).
    pub k: Option<usize>,
    pub pairs: Range<usize>,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Problem {
    pub params: Params,
    pub facilities: Vec<Facility>,
    pub app_names: Vec<String>,
    pub hosts: Vec<Host>,
    pub pairs: Vec<Pair>,
}

impl Problem {
    pub fn host_pairs(&self, host: usize) -> &[Pair] {
        &self.pairs[self.hosts[host].pairs.clone()]
    }

    pub fn utility(&self, pair: &Pair) -> Utility {
        Utility {
            w: pair.weight,
            a: pair.cqe_per_wqe,
            shape: self.params.shape(),
        }
    }

    /// How many apps host `host` may keep active: `k`, or fewer if fewer are present.
    pub fn slots(&self, host: usize) -> usize {
        let h = &self.hosts[host];
        h.k.unwrap_or(self.params.k).min(h.pairs.len())
    }
}
