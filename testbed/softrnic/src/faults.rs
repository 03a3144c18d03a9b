//! Fault injection in the engine's UDP transport: loss, duplication, reordering and delay,
//! seeded and configurable per link (one direction: from a host to a peer address).
//!
//! `softrnic up` writes the configuration to `<run>/faults`; each engine reads it at start and
//! applies it to the packets it sends (so a link `h1 → h2` is faulted by h1's engine):
//!
//! ```text
//! seed 42
//! default loss 0.01 dup 0.01 reorder 0.01 delay_us 0
//! link h1 10.77.0.2 loss 0.05 dup 0 reorder 0 delay_us 200
//! ```
//!
//! Per packet, with the link's own pseudo-random stream (seeded from the seed, the sending host
//! and the destination): it is dropped with probability `loss`; otherwise it is held back for
//! a random 0.2–2 ms with probability `reorder` (packets sent after it overtake it); every
//! packet is delayed by `delay_us`; with probability `dup` a second copy is sent after a random
//! 0–2 ms more (a late replay of a valid packet).

use std::net::Ipv4Addr;
use std::time::Duration;

use thiserror::Error;

/// Hold time of a reordered packet, and the furthest a duplicate lags: `[MIN, MAX)` µs.
const REORDER_MIN_US: u64 = 200;
const REORDER_MAX_US: u64 = 2_000;
const DUP_MAX_LAG_US: u64 = 2_000;

#[derive(Debug, Error, PartialEq)]
pub enum FaultError {
    #[error("{what} must be a probability between 0 and 1, got {got}")]
    Probability { what: &'static str, got: String },
    #[error("bad fault setting {0:?} (expected loss=P, dup=P, reorder=P or delay_us=N)")]
    Setting(String),
    #[error("bad link fault {0:?} (expected SRC:DST:key=value,... e.g. h1:h2:loss=0.05)")]
    Link(String),
    #[error("bad line in faults file: {0:?}")]
    Line(String),
}

/// The faults of one link direction.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Faults {
    pub loss: f64,
    pub dup: f64,
    pub reorder: f64,
    pub delay_us: u64,
}

impl Faults {
    pub fn is_none(&self) -> bool {
        self.loss == 0.0 && self.dup == 0.0 && self.reorder == 0.0 && self.delay_us == 0
    }

    /// Set one `key value` pair.
    pub fn set(&mut self, key: &str, value: &str) -> Result<(), FaultError> {
        let prob = |what: &'static str| -> Result<f64, FaultError> {
            match value.parse::<f64>() {
                Ok(p) if (0.0..=1.0).contains(&p) => Ok(p),
                _ => Err(FaultError::Probability {
                    what,
                    got: value.to_string(),
                }),
            }
        };
        match key {
            "loss" => self.loss = prob("loss")?,
            "dup" => self.dup = prob("dup")?,
            "reorder" => self.reorder = prob("reorder")?,
            "delay_us" => {
                self.delay_us = value
                    .parse()
                    .map_err(|_| FaultError::Setting(format!("{key}={value}")))?
            }
            _ => return Err(FaultError::Setting(format!("{key}={value}"))),
        }
        Ok(())
    }

    fn encode(&self) -> String {
        format!(
            "loss {} dup {} reorder {} delay_us {}",
            self.loss, self.dup, self.reorder, self.delay_us
        )
    }

    fn decode(fields: &[&str], line: &str) -> Result<Faults, FaultError> {
        if fields.len() % 2 != 0 {
            return Err(FaultError::Line(line.to_string()));
        }
        let mut f = Faults::default();
        for kv in fields.chunks(2) {
            f.set(kv[0], kv[1])?;
        }
        Ok(f)
    }
}

/// A link override as given on the command line: `SRC:DST:key=value,...` (host names).
#[derive(Debug, Clone, PartialEq)]
pub struct LinkSpec {
    pub src: String,
    pub dst: String,
    pub faults: Faults,
}

impl std::str::FromStr for LinkSpec {
    type Err = FaultError;
    fn from_str(s: &str) -> Result<Self, FaultError> {
        let mut it = s.splitn(3, ':');
        let (Some(src), Some(dst), Some(kvs)) = (it.next(), it.next(), it.next()) else {
            return Err(FaultError::Link(s.to_string()));
        };
        if src.is_empty() || dst.is_empty() || kvs.is_empty() {
            return Err(FaultError::Link(s.to_string()));
        }
        let mut faults = Faults::default();
        for kv in kvs.split(',') {
            let (k, v) = kv
                .split_once('=')
                .ok_or_else(|| FaultError::Setting(kv.to_string()))?;
            faults.set(k, v)?;
        }
        Ok(LinkSpec {
            src: src.to_string(),
            dst: dst.to_string(),
            faults,
        })
    }
}

/// The whole configuration of a run (`<run>/faults`).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct FaultConfig {
    pub seed: u64,
    pub default: Faults,
    /// (sending host name, destination address, faults)
    pub links: Vec<(String, Ipv4Addr, Faults)>,
}

impl FaultConfig {
    pub fn encode(&self) -> String {
        let mut s = format!("seed {}\ndefault {}\n", self.seed, self.default.encode());
        for (h, ip, f) in &self.links {
            s.push_str(&format!("link {h} {ip} {}\n", f.encode()));
        }
        s
    }

    pub fn decode(s: &str) -> Result<FaultConfig, FaultError> {
        let mut c = FaultConfig::default();
        for line in s.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            match f.as_slice() {
                [] => {}
                ["seed", v] => c.seed = v.parse().map_err(|_| FaultError::Line(line.into()))?,
                ["default", rest @ ..] => c.default = Faults::decode(rest, line)?,
                ["link", h, ip, rest @ ..] => {
                    let ip = ip.parse().map_err(|_| FaultError::Line(line.into()))?;
                    c.links
                        .push((h.to_string(), ip, Faults::decode(rest, line)?));
                }
                _ => return Err(FaultError::Line(line.to_string())),
            }
        }
        Ok(c)
    }

    /// The faults applied by `host` to packets for `dst`.
    pub fn for_link(&self, host: &str, dst: Ipv4Addr) -> Faults {
        self.links
            .iter()
            .find(|(h, ip, _)| h == host && *ip == dst)
            .map(|(_, _, f)| *f)
            .unwrap_or(self.default)
    }

    pub fn is_none(&self) -> bool {
        self.default.is_none() && self.links.iter().all(|(_, _, f)| f.is_none())
    }
}

/// splitmix64: small, fast, good enough for fault decisions, and reproducible.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Rng {
        Rng(seed)
    }
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    /// Uniform in [0, 1).
    pub fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
    /// Uniform in [lo, hi).
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next_u64() % (hi - lo).max(1)
    }
}

/// What happens to one packet: the delays after which copies of it are sent (none: lost).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct Fate {
    pub sends: Vec<Duration>,
    pub dropped: bool,
    pub duplicated: bool,
    pub reordered: bool,
}

/// The injector of one link direction.
#[derive(Debug, Clone)]
pub struct LinkInjector {
    pub faults: Faults,
    rng: Rng,
}

impl LinkInjector {
    /// The stream depends on the seed, the sending host and the destination only.
    pub fn new(cfg: &FaultConfig, host: &str, dst: Ipv4Addr) -> LinkInjector {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in host.bytes().chain(dst.octets()) {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        LinkInjector {
            faults: cfg.for_link(host, dst),
            rng: Rng::new(cfg.seed ^ h),
        }
    }

    pub fn fate(&mut self) -> Fate {
        let f = self.faults;
        let mut fate = Fate::default();
        // Draw every decision each time so the stream stays aligned whatever the outcome.
        let (l, r, d) = (self.rng.unit(), self.rng.unit(), self.rng.unit());
        let hold = self.rng.range(REORDER_MIN_US, REORDER_MAX_US);
        let lag = self.rng.range(0, DUP_MAX_LAG_US);
        if l < f.loss {
            fate.dropped = true;
            return fate;
        }
        let mut first = f.delay_us;
        if r < f.reorder {
            fate.reordered = true;
            first += hold;
        }
        fate.sends.push(Duration::from_micros(first));
        if d < f.dup {
            fate.duplicated = true;
            fate.sends.push(Duration::from_micros(first + lag));
        }
        fate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_roundtrip_and_link_lookup() {
        let c = FaultConfig {
            seed: 7,
            default: Faults {
                loss: 0.01,
                dup: 0.02,
                reorder: 0.03,
                delay_us: 0,
            },
            links: vec![(
                "h1".into(),
                Ipv4Addr::new(10, 77, 0, 2),
                Faults {
                    delay_us: 250,
                    ..Default::default()
                },
            )],
        };
        let d = FaultConfig::decode(&c.encode()).unwrap();
        assert_eq!(d, c);
        assert_eq!(d.for_link("h1", Ipv4Addr::new(10, 77, 0, 2)).delay_us, 250);
        assert_eq!(d.for_link("h2", Ipv4Addr::new(10, 77, 0, 1)), c.default);
        assert!(!d.is_none());
        assert!(FaultConfig::default().is_none());
        assert!(FaultConfig::decode("seed x\n").is_err());
        assert!(FaultConfig::decode("default loss 2\n").is_err());
        assert!(FaultConfig::decode("nonsense\n").is_err());
    }

    #[test]
    fn link_specs_parse_with_clear_errors() {
        let l: LinkSpec = "h1:h2:loss=0.05,delay_us=100".parse().unwrap();
        assert_eq!((l.src.as_str(), l.dst.as_str()), ("h1", "h2"));
        assert_eq!(l.faults.loss, 0.05);
        assert_eq!(l.faults.delay_us, 100);
        assert!(matches!(
            "h1:h2:loss=1.5".parse::<LinkSpec>(),
            Err(FaultError::Probability { .. })
        ));
        assert!(matches!(
            "h1:h2:jitter=3".parse::<LinkSpec>(),
            Err(FaultError::Setting(_))
        ));
        assert!(matches!(
            "h1:loss=1".parse::<LinkSpec>(),
            Err(FaultError::Link(_))
        ));
    }

    #[test]
    fn fates_are_seeded_and_match_the_rates() {
        let cfg = FaultConfig {
            seed: 42,
            default: Faults {
                loss: 0.1,
                dup: 0.1,
                reorder: 0.1,
                delay_us: 50,
            },
            links: vec![],
        };
        let ip = Ipv4Addr::new(10, 77, 0, 2);
        let mut a = LinkInjector::new(&cfg, "h1", ip);
        let mut b = LinkInjector::new(&cfg, "h1", ip);
        let mut other = LinkInjector::new(&cfg, "h2", ip);
        let n = 20_000;
        let (mut lost, mut dup, mut re, mut both_lost) = (0, 0, 0, 0);
        for _ in 0..n {
            let f = a.fate();
            assert_eq!(f, b.fate(), "same seed and link, same decisions");
            if f.dropped && other.fate().dropped {
                both_lost += 1;
            }
            lost += f.dropped as u32;
            dup += f.duplicated as u32;
            re += f.reordered as u32;
            if !f.dropped {
                assert!(f.sends[0] >= Duration::from_micros(50));
                assert_eq!(f.sends.len(), 1 + f.duplicated as usize);
            } else {
                assert!(f.sends.is_empty());
            }
        }
        for (what, k) in [("loss", lost), ("dup", dup), ("reorder", re)] {
            // 10% of 20000 (dup/reorder only among survivors: ~9%); allow wide slack.
            assert!((1_400..2_400).contains(&k), "{what}: {k}");
        }
        // Independent streams lose the same packet about 1% of the time, not 10%.
        assert!(both_lost < 600, "links have their own streams: {both_lost}");
    }
}
