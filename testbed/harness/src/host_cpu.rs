//! How busy the machine's CPUs were during a run. softrnic's NICs are threads on the same
//! cores as the applications, agents and coordinator; when those cores are all busy the
//! emulator, not the NIC model, decides a result (docs/testbed.md, "The attacker keeps to
//! its grant": the rate victim lost half its throughput to two busy loops that sent
//! nothing). The load average, read before a run, misses load the run itself creates;
//! `/proc/stat` over the run does not.

/// Cumulative CPU time of all cores, in the kernel's ticks: what was spent idle (idle and
/// iowait) and in all.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct CpuTimes {
    pub idle: u64,
    pub total: u64,
}

/// The share of the machine's CPU time above which a run is flagged: every core busy.
pub const SATURATED: f64 = 0.95;

impl CpuTimes {
    /// The machine's times now (None where `/proc/stat` cannot be read).
    pub fn now() -> Option<CpuTimes> {
        parse(&std::fs::read_to_string("/proc/stat").ok()?)
    }
}

/// The aggregate `cpu` line of `/proc/stat`: user nice system idle iowait irq softirq steal
/// (guest time is already in user and nice).
pub fn parse(stat: &str) -> Option<CpuTimes> {
    let line = stat.lines().find(|l| l.starts_with("cpu "))?;
    let v: Vec<u64> = line
        .split_whitespace()
        .skip(1)
        .take(8)
        .map(|f| f.parse().ok())
        .collect::<Option<_>>()?;
    if v.len() < 5 {
        return None;
    }
    Some(CpuTimes {
        idle: v[3] + v[4],
        total: v.iter().sum(),
    })
}

/// The busy share of the CPU time between two readings; None when no time passed.
pub fn busy(before: CpuTimes, after: CpuTimes) -> Option<f64> {
    let total = after.total.checked_sub(before.total)?;
    let idle = after.idle.checked_sub(before.idle)?;
    (total > 0).then(|| 1.0 - idle.min(total) as f64 / total as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cpu_line_gives_idle_and_total_ticks() {
        let stat = "cpu  100 5 50 800 20 3 2 10 0 0\ncpu0 50 2 25 400 10 1 1 5 0 0\nintr 1 2\n";
        assert_eq!(
            parse(stat),
            Some(CpuTimes {
                idle: 820,
                total: 990
            })
        );
        assert_eq!(parse("cpu0 1 2 3 4 5\n"), None);
        assert_eq!(parse("cpu  1 2 x 4 5\n"), None);
        assert_eq!(parse("cpu  1 2 3\n"), None);
    }

    #[test]
    fn busy_is_the_share_of_ticks_not_idle() {
        let a = CpuTimes {
            idle: 800,
            total: 1000,
        };
        let b = CpuTimes {
            idle: 850,
            total: 1200,
        };
        assert_eq!(busy(a, b), Some(0.75));
        assert_eq!(busy(a, a), None);
        // Counters that went backwards (a reading of another machine) say nothing.
        assert_eq!(busy(b, a), None);
    }

    #[test]
    fn this_machine_can_be_read() {
        let t = CpuTimes::now().expect("/proc/stat");
        assert!(t.total >= t.idle);
    }
}
