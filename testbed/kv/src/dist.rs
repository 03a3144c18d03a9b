//! The client's random choices: value sizes, keys, operations and batch sizes, each parsed
//! from its command-line form and drawn from a seeded generator, so a run is reproducible.

use crate::slot::mix64;

/// A seeded generator (splitmix64).
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(mix64(seed))
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        mix64(self.0)
    }

    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    /// Uniform in [lo, hi].
    pub fn between(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo + 1)
    }
}

/// A malformed distribution.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ParseError(String);

fn err(what: &str, s: &str) -> ParseError {
    ParseError(format!("bad {what} `{s}`"))
}

/// A byte count: `N`, `NK`/`NKi`/`NKiB`, `NM`…, `NG`… (binary units).
pub fn parse_bytes(s: &str) -> Result<u64, ParseError> {
    let t = s.trim();
    let digits = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let n: u64 = t[..digits].parse().map_err(|_| err("byte count", s))?;
    let unit = match t[digits..].to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "ki" | "kib" | "kb" => 1 << 10,
        "m" | "mi" | "mib" | "mb" => 1 << 20,
        "g" | "gi" | "gib" | "gb" => 1 << 30,
        _ => return Err(err("byte count", s)),
    };
    n.checked_mul(unit).ok_or_else(|| err("byte count", s))
}

fn parse_range(s: &str, what: &str) -> Result<(u64, u64), ParseError> {
    let (a, b) = s.split_once("..").ok_or_else(|| err(what, s))?;
    let (a, b) = (parse_bytes(a)?, parse_bytes(b)?);
    if a == 0 || a > b {
        return Err(err(what, s));
    }
    Ok((a, b))
}

/// `fixed:N`, `uniform:A..B` or `loguniform:A..B` (bytes, 1 ≤ A ≤ B).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum SizeDist {
    Fixed(u64),
    Uniform(u64, u64),
    LogUniform(u64, u64),
}

impl std::str::FromStr for SizeDist {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, ParseError> {
        let (kind, arg) = s.split_once(':').ok_or_else(|| err("size", s))?;
        match kind {
            "fixed" => {
                let n = parse_bytes(arg)?;
                if n == 0 {
                    return Err(err("size", s));
                }
                Ok(SizeDist::Fixed(n))
            }
            "uniform" => parse_range(arg, "size").map(|(a, b)| SizeDist::Uniform(a, b)),
            "loguniform" => parse_range(arg, "size").map(|(a, b)| SizeDist::LogUniform(a, b)),
            _ => Err(err("size", s)),
        }
    }
}

impl SizeDist {
    pub fn max(&self) -> u64 {
        match *self {
            SizeDist::Fixed(n) => n,
            SizeDist::Uniform(_, b) | SizeDist::LogUniform(_, b) => b,
        }
    }

    pub fn draw(&self, rng: &mut Rng) -> u64 {
        match *self {
            SizeDist::Fixed(n) => n,
            SizeDist::Uniform(a, b) => rng.between(a, b),
            SizeDist::LogUniform(a, b) => {
                let (la, lb) = ((a as f64).ln(), (b as f64).ln());
                ((la + (lb - la) * rng.unit()).exp().round() as u64).clamp(a, b)
            }
        }
    }
}

/// `uniform` or `zipf:θ` (0 < θ; key 0 the most popular).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum KeySpec {
    Uniform,
    Zipf(f64),
}

impl std::str::FromStr for KeySpec {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, ParseError> {
        if s == "uniform" {
            return Ok(KeySpec::Uniform);
        }
        let theta: f64 = s
            .strip_prefix("zipf:")
            .and_then(|t| t.parse().ok())
            .ok_or_else(|| err("key distribution", s))?;
        if !(theta > 0.0 && theta.is_finite()) {
            return Err(err("key distribution", s));
        }
        Ok(KeySpec::Zipf(theta))
    }
}

/// Keys drawn from a [`KeySpec`] over `0..keys`.
#[derive(Debug, Clone)]
pub enum KeyDist {
    Uniform(u64),
    /// The cumulative distribution of the ranks (searched by bisection).
    Zipf(Vec<f64>),
}

impl KeyDist {
    pub fn new(spec: KeySpec, keys: u64) -> KeyDist {
        match spec {
            KeySpec::Uniform => KeyDist::Uniform(keys),
            KeySpec::Zipf(theta) => {
                let mut cdf: Vec<f64> = (1..=keys)
                    .scan(0.0, |acc, k| {
                        *acc += 1.0 / (k as f64).powf(theta);
                        Some(*acc)
                    })
                    .collect();
                let total = *cdf.last().unwrap_or(&1.0);
                cdf.iter_mut().for_each(|c| *c /= total);
                KeyDist::Zipf(cdf)
            }
        }
    }

    pub fn draw(&self, rng: &mut Rng) -> u64 {
        match self {
            KeyDist::Uniform(n) => rng.next_u64() % n,
            KeyDist::Zipf(cdf) => {
                let u = rng.unit();
                (cdf.partition_point(|&c| c < u) as u64).min(cdf.len() as u64 - 1)
            }
        }
    }
}

/// The operation mix: `read` (GET by one-sided READ), `get` (GET RPC), `put` (PUT RPC), or
/// `mix:P` (a PUT RPC with probability P, else a READ GET).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OpMix {
    Read,
    Get,
    Put,
    Mix(f64),
}

/// One operation to issue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum OpKind {
    Read,
    Get,
    Put,
}

impl std::str::FromStr for OpMix {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, ParseError> {
        match s {
            "read" => Ok(OpMix::Read),
            "get" => Ok(OpMix::Get),
            "put" => Ok(OpMix::Put),
            _ => {
                let p: f64 = s
                    .strip_prefix("mix:")
                    .and_then(|p| p.parse().ok())
                    .ok_or_else(|| err("operation", s))?;
                if !(0.0..=1.0).contains(&p) {
                    return Err(err("operation", s));
                }
                Ok(OpMix::Mix(p))
            }
        }
    }
}

impl OpMix {
    pub fn draw(&self, rng: &mut Rng) -> OpKind {
        match *self {
            OpMix::Read => OpKind::Read,
            OpMix::Get => OpKind::Get,
            OpMix::Put => OpKind::Put,
            OpMix::Mix(p) if rng.unit() < p => OpKind::Put,
            OpMix::Mix(_) => OpKind::Read,
        }
    }

    /// Whether any operation is an RPC (the connection then needs receive buffers).
    pub fn uses_rpc(&self) -> bool {
        !matches!(self, OpMix::Read)
    }
}

/// `B` or `A..B`: work requests per batch (at least 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WrNum(pub u32, pub u32);

impl std::str::FromStr for WrNum {
    type Err = ParseError;
    fn from_str(s: &str) -> Result<Self, ParseError> {
        let parse = |t: &str| t.parse::<u32>().map_err(|_| err("wr-num", s));
        let (a, b) = match s.split_once("..") {
            Some((a, b)) => (parse(a)?, parse(b)?),
            None => (parse(s)?, parse(s)?),
        };
        if a == 0 || a > b {
            return Err(err("wr-num", s));
        }
        Ok(WrNum(a, b))
    }
}

impl WrNum {
    pub fn draw(&self, rng: &mut Rng) -> u32 {
        rng.between(self.0 as u64, self.1 as u64) as u32
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_and_stay_in_range() {
        assert_eq!("fixed:32".parse(), Ok(SizeDist::Fixed(32)));
        assert_eq!("fixed:4K".parse(), Ok(SizeDist::Fixed(4096)));
        assert_eq!(
            "uniform:32..1MiB".parse(),
            Ok(SizeDist::Uniform(32, 1 << 20))
        );
        for bad in [
            "32",
            "fixed:0",
            "uniform:9..3",
            "loguniform:0..5",
            "fixed:1Q",
            "x:1",
        ] {
            assert!(bad.parse::<SizeDist>().is_err(), "{bad}");
        }
        let d: SizeDist = "loguniform:32..1M".parse().unwrap();
        let mut rng = Rng::new(1);
        let draws: Vec<u64> = (0..10_000).map(|_| d.draw(&mut rng)).collect();
        assert!(draws.iter().all(|&s| (32..=1 << 20).contains(&s)));
        // log-uniform: about half the draws below the geometric mean (5.8 KiB)
        let below = draws.iter().filter(|&&s| s < 5793).count();
        assert!((4500..5500).contains(&below), "{below}");
    }

    #[test]
    fn zipf_favours_low_keys_and_uniform_covers_all() {
        let mut rng = Rng::new(7);
        let z = KeyDist::new("zipf:0.99".parse().unwrap(), 1000);
        let draws: Vec<u64> = (0..20_000).map(|_| z.draw(&mut rng)).collect();
        assert!(draws.iter().all(|&k| k < 1000));
        let zeros = draws.iter().filter(|&&k| k == 0).count();
        assert!(zeros > 1500, "{zeros}"); // ≈ 13 % for θ = 0.99 over 1000 keys
        let u = KeyDist::new(KeySpec::Uniform, 4);
        let mut seen = [false; 4];
        (0..100).for_each(|_| seen[u.draw(&mut rng) as usize] = true);
        assert_eq!(seen, [true; 4]);
        assert!("zipf:-1".parse::<KeySpec>().is_err());
        assert!("zipf".parse::<KeySpec>().is_err());
    }

    #[test]
    fn mixes_and_batches_parse() {
        assert_eq!("mix:0.25".parse(), Ok(OpMix::Mix(0.25)));
        assert!("mix:2".parse::<OpMix>().is_err());
        assert!("write".parse::<OpMix>().is_err());
        let mut rng = Rng::new(3);
        let m = OpMix::Mix(0.25);
        let puts = (0..4000)
            .filter(|_| m.draw(&mut rng) == OpKind::Put)
            .count();
        assert!((800..1200).contains(&puts), "{puts}");
        assert_eq!("8".parse(), Ok(WrNum(8, 8)));
        assert_eq!("1..20".parse(), Ok(WrNum(1, 20)));
        assert!("0".parse::<WrNum>().is_err());
        assert!("5..2".parse::<WrNum>().is_err());
    }

    #[test]
    fn a_seed_makes_a_run_reproducible() {
        let a: Vec<u64> = {
            let mut r = Rng::new(42);
            (0..5).map(|_| r.next_u64()).collect()
        };
        let mut r = Rng::new(42);
        assert!(a.iter().all(|&x| x == r.next_u64()));
    }
}
