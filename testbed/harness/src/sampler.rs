//! Byte counters of emulated hosts sampled over time: a thread reads the transmit counters
//! of each host's network namespace (`/proc/PID/net/dev` of a process in it, the host's
//! NIC engine) every few hundred µs. softrnic's engines carry the NICs' packets as UDP
//! datagrams between the namespaces, so these counters are the emulated wire's bytes, and
//! the kernel counts them per packet — softrnic's own stats file is rewritten only every
//! 200 ms, too coarse for rates over a few round trips.

use anyhow::{bail, Context, Result};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bytes transmitted by every interface but loopback in a `/proc/net/dev` table.
pub fn tx_bytes(table: &str) -> Option<u64> {
    let mut sum = 0u64;
    let mut seen = false;
    for row in table.lines().skip(2) {
        let (name, fields) = row.split_once(':')?;
        if name.trim() == "lo" {
            continue;
        }
        // receive: bytes packets errs drop fifo frame compressed multicast; then transmit
        sum += fields.split_whitespace().nth(8)?.parse::<u64>().ok()?;
        seen = true;
    }
    seen.then_some(sum)
}

/// Samples per host: `(µs since the sampler started, bytes)`.
pub type Series = Vec<(f64, f64)>;

pub struct Sampler {
    stop: Arc<AtomicBool>,
    started: Instant,
    handle: JoinHandle<Result<Vec<Series>>>,
}

impl Sampler {
    /// Samples the namespaces of `pids` every `every` until [`Sampler::finish`].
    pub fn start(pids: Vec<i32>, every: Duration) -> Result<Sampler> {
        for p in &pids {
            let t = std::fs::read_to_string(format!("/proc/{p}/net/dev"))
                .with_context(|| format!("reading /proc/{p}/net/dev"))?;
            if tx_bytes(&t).is_none() {
                bail!("/proc/{p}/net/dev has no interface but loopback");
            }
        }
        let stop = Arc::new(AtomicBool::new(false));
        let started = Instant::now();
        let s = stop.clone();
        let handle = std::thread::spawn(move || {
            let mut out = vec![Vec::new(); pids.len()];
            while !s.load(Ordering::Relaxed) {
                for (i, p) in pids.iter().enumerate() {
                    let t = std::fs::read_to_string(format!("/proc/{p}/net/dev"))
                        .with_context(|| format!("reading /proc/{p}/net/dev"))?;
                    let at = started.elapsed().as_secs_f64() * 1e6;
                    if let Some(b) = tx_bytes(&t) {
                        out[i].push((at, b as f64));
                    }
                }
                std::thread::sleep(every);
            }
            Ok(out)
        });
        Ok(Sampler {
            stop,
            started,
            handle,
        })
    }

    /// µs since the sampler started (the samples' time base).
    pub fn now_us(&self) -> f64 {
        self.started.elapsed().as_secs_f64() * 1e6
    }

    pub fn finish(self) -> Result<Vec<Series>> {
        self.stop.store(true, Ordering::Relaxed);
        self.handle
            .join()
            .map_err(|_| anyhow::anyhow!("the sampler panicked"))?
    }
}

/// The NIC engine's pid of each host of a softrnic run (its `state` file: `host NAME IP NS
/// PID` lines).
pub fn engine_pids(state: &str) -> Vec<(String, i32)> {
    state
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            match f.as_slice() {
                ["host", name, _, _, pid] => Some((name.to_string(), pid.parse().ok()?)),
                _ => None,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transmitted_bytes_are_summed_over_interfaces_but_loopback() {
        let t = "Inter-|   Receive                                                |  Transmit\n \
 face |bytes    packets errs drop fifo frame compressed multicast|bytes    packets errs drop fifo colls carrier compressed\n    \
    lo:     100       1    0    0    0     0          0         0      200       2    0    0    0     0       0          0\n  \
eth0: 5000      50    0    0    0     0          0         0    70000     700    0    0    0     0       0          0\n  \
 v1: 1 1 0 0 0 0 0 0 30 1 0 0 0 0 0 0\n";
        assert_eq!(tx_bytes(t), Some(70_030));
        assert_eq!(
            tx_bytes("h\nh\n    lo: 1 1 0 0 0 0 0 0 2 2 0 0 0 0 0 0\n"),
            None
        );
    }

    #[test]
    fn this_processs_namespace_is_sampled() {
        let me = std::process::id() as i32;
        let table = std::fs::read_to_string(format!("/proc/{me}/net/dev")).unwrap();
        if tx_bytes(&table).is_none() {
            eprintln!("SKIPPED: no interface but loopback here");
            return;
        }
        let s = Sampler::start(vec![me], Duration::from_millis(1)).unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let v = s.finish().unwrap();
        assert!(v[0].len() >= 5, "{}", v[0].len());
        assert!(v[0].windows(2).all(|w| w[0].0 < w[1].0 && w[0].1 <= w[1].1));
    }

    #[test]
    fn engine_pids_come_from_the_state_file() {
        let st = "mode root\nhost h1 10.77.0.1 srn-h1 42\nhost h2 10.77.0.2 srn-h2 43\n";
        assert_eq!(
            engine_pids(st),
            [("h1".to_string(), 42), ("h2".to_string(), 43)]
        );
    }
}
