//! perftest's output, parsed: the bandwidth tests' average and the latency tests' every
//! iteration (`-H`).

use anyhow::{bail, Result};

/// The "BW average[MB/sec]" column of an `ib_*_bw` report (perftest's MB is MiB).
pub fn bw_average_mib(out: &str) -> Result<f64> {
    let mut lines = out.lines();
    while let Some(l) = lines.next() {
        if l.contains("BW average") {
            let row = lines.next().unwrap_or("");
            let f: Vec<&str> = row.split_whitespace().collect();
            if let Some(v) = f.get(3).and_then(|v| v.parse().ok()) {
                return Ok(v);
            }
        }
    }
    bail!("no BW average in perftest's output:\n{out}")
}

/// Every iteration's latency (µs) of an `ib_*_lat -H` report.
pub fn latencies_us(out: &str) -> Result<Vec<f64>> {
    let v: Vec<f64> = out
        .lines()
        .filter_map(|l| {
            let (i, us) = l.split_once(", ")?;
            i.trim().parse::<u64>().ok()?;
            us.trim().parse().ok()
        })
        .collect();
    if v.is_empty() {
        bail!("no latencies in perftest's output (-H):\n{out}");
    }
    // With -F, a perftest that could not fit its CPU clock on a loaded machine prints
    // latencies divided by a frequency of 0 ("inf", "-nan") instead of exiting.
    if v.iter().any(|us| !us.is_finite()) {
        bail!("perftest could not time its iterations (latencies not finite: its CPU-clock fit failed)");
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bandwidth_and_latencies_are_read_from_perftest_reports() {
        let bw =
            " #bytes     #iterations    BW peak[MB/sec]    BW average[MB/sec]   MsgRate[Mpps]\n \
                  1024       235600           0.00               115.03 \t\t   0.117794\n";
        assert_eq!(bw_average_mib(bw).unwrap(), 115.03);
        assert!(bw_average_mib("nothing").is_err());
        let lat = "#, usec\n1, 45.5476\n2, 47.1649\n 1024    50   45.55\n";
        assert_eq!(latencies_us(lat).unwrap(), [45.5476, 47.1649]);
        assert!(latencies_us("#, usec\n").is_err());
        assert!(latencies_us("#, usec\n1, inf\n2, -nan\n").is_err());
    }
}
