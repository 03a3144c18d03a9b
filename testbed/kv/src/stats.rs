//! Latency histograms and the client's summary: what it measured, as text or JSON, with the
//! histograms serialised so the summaries of several clients can be merged.

use crate::in_flight::{InFlightSummary, InFlightTime};
use base64::Engine;
use hdrhistogram::serialization::{Deserializer, Serializer, V2DeflateSerializer};
use hdrhistogram::Histogram;
use serde::{Deserialize, Serialize};

/// A histogram of nanoseconds, 1 ns to an hour, three significant digits.
pub fn histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid bounds")
}

/// What one client thread counted.
pub struct Recorder {
    pub ops: Histogram<u64>,
    pub batches: Histogram<u64>,
    pub lock_wait: Histogram<u64>,
    pub wrong_values: u64,
    pub error_replies: u64,
    pub failed_completions: u64,
    pub torn_retries: u64,
    /// GETs that returned a value a PUT wrote (not the initial fill).
    pub updated_values: u64,
    /// Operations still in flight when the drain time after the run ran out.
    pub abandoned: u64,
    pub batch_in_flight: InFlightTime,
}

impl Default for Recorder {
    fn default() -> Self {
        Recorder {
            ops: histogram(),
            batches: histogram(),
            lock_wait: histogram(),
            wrong_values: 0,
            error_replies: 0,
            failed_completions: 0,
            torn_retries: 0,
            updated_values: 0,
            abandoned: 0,
            batch_in_flight: InFlightTime::default(),
        }
    }
}

impl Recorder {
    pub fn record(h: &mut Histogram<u64>, ns: u64) {
        h.saturating_record(ns.max(1));
    }

    pub fn merge(&mut self, o: &Recorder) {
        self.ops.add(&o.ops).expect("same bounds");
        self.batches.add(&o.batches).expect("same bounds");
        self.lock_wait.add(&o.lock_wait).expect("same bounds");
        self.wrong_values += o.wrong_values;
        self.error_replies += o.error_replies;
        self.failed_completions += o.failed_completions;
        self.torn_retries += o.torn_retries;
        self.updated_values += o.updated_values;
        self.abandoned += o.abandoned;
        self.batch_in_flight.merge(&o.batch_in_flight);
    }

    pub fn errors(&self) -> u64 {
        self.wrong_values + self.error_replies + self.failed_completions
    }
}

/// Percentiles of a histogram in microseconds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Latency {
    pub count: u64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p80_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
}

impl Latency {
    pub fn of(h: &Histogram<u64>) -> Latency {
        let us = |ns: u64| ns as f64 / 1000.0;
        Latency {
            count: h.len(),
            mean_us: if h.is_empty() { 0.0 } else { h.mean() / 1000.0 },
            p50_us: us(h.value_at_quantile(0.5)),
            p80_us: us(h.value_at_quantile(0.8)),
            p99_us: us(h.value_at_quantile(0.99)),
            p999_us: us(h.value_at_quantile(0.999)),
            max_us: us(h.max()),
        }
    }
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct ConnThroughput {
    pub conn: u32,
    pub ops: u64,
    pub bytes: u64,
    pub ops_per_s: f64,
    pub mib_per_s: f64,
}

/// The client's summary (`--json`).
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub struct Summary {
    pub mode: String,
    pub op: String,
    pub conns: u32,
    pub threads: u32,
    pub share: u32,
    /// Requests sent several to a SEND (`--coalesce`).
    #[serde(default)]
    pub coalesce: bool,
    pub seconds: f64,
    pub ops: u64,
    pub bytes: u64,
    pub ops_per_s: f64,
    pub mib_per_s: f64,
    pub mean_us: f64,
    pub p50_us: f64,
    pub p80_us: f64,
    pub p99_us: f64,
    pub p999_us: f64,
    pub max_us: f64,
    pub errors: u64,
    pub wrong_values: u64,
    pub error_replies: u64,
    pub failed_completions: u64,
    pub torn_retries: u64,
    /// GETs that returned a value a PUT wrote (not the initial fill).
    pub updated_values: u64,
    /// Operations in flight when the run stopped that did not complete within `--drain`:
    /// neither counted nor errors.
    #[serde(default)]
    pub abandoned: u64,
    /// Completed batches only: a batch in flight when the run stops is not in it.
    pub batch: Latency,
    /// How long a batch is in flight by Little's law, batches cut off by the run's end
    /// included (`in_flight.rs`).
    #[serde(default)]
    pub batch_in_flight: InFlightSummary,
    /// Time spent acquiring the QP lock (uncontended in RAW mode).
    pub lock_wait: Latency,
    pub lock_wait_total_us: f64,
    pub per_conn: Vec<ConnThroughput>,
    /// The operation latency histogram (ns), HdrHistogram V2 + deflate, base64.
    pub histogram: String,
    pub batch_histogram: String,
}

pub fn encode(h: &Histogram<u64>) -> String {
    let mut v = Vec::new();
    V2DeflateSerializer::new()
        .serialize(h, &mut v)
        .expect("serialise to memory");
    base64::engine::general_purpose::STANDARD.encode(v)
}

pub fn decode(s: &str) -> anyhow::Result<Histogram<u64>> {
    let b = base64::engine::general_purpose::STANDARD.decode(s)?;
    Deserializer::new()
        .deserialize(&mut &b[..])
        .map_err(|e| anyhow::anyhow!("histogram: {e:?}"))
}

/// Identity of the run a summary describes.
pub struct RunInfo {
    pub mode: String,
    pub op: String,
    pub conns: u32,
    pub threads: u32,
    pub share: u32,
    pub coalesce: bool,
}

pub fn summarize(
    info: RunInfo,
    r: &Recorder,
    per_conn: Vec<ConnThroughput>,
    seconds: f64,
) -> Summary {
    let ops: u64 = per_conn.iter().map(|c| c.ops).sum();
    let bytes: u64 = per_conn.iter().map(|c| c.bytes).sum();
    let l = Latency::of(&r.ops);
    let lw = Latency::of(&r.lock_wait);
    Summary {
        mode: info.mode,
        op: info.op,
        conns: info.conns,
        threads: info.threads,
        share: info.share,
        coalesce: info.coalesce,
        seconds,
        ops,
        bytes,
        ops_per_s: ops as f64 / seconds.max(1e-9),
        mib_per_s: bytes as f64 / (1 << 20) as f64 / seconds.max(1e-9),
        mean_us: l.mean_us,
        p50_us: l.p50_us,
        p80_us: l.p80_us,
        p99_us: l.p99_us,
        p999_us: l.p999_us,
        max_us: l.max_us,
        errors: r.errors(),
        wrong_values: r.wrong_values,
        error_replies: r.error_replies,
        failed_completions: r.failed_completions,
        torn_retries: r.torn_retries,
        updated_values: r.updated_values,
        abandoned: r.abandoned,
        batch: Latency::of(&r.batches),
        batch_in_flight: r.batch_in_flight.summary(),
        lock_wait_total_us: lw.mean_us * lw.count as f64,
        lock_wait: lw,
        per_conn,
        histogram: encode(&r.ops),
        batch_histogram: encode(&r.batches),
    }
}

/// Merges the summaries of clients that ran at the same time: counts and rates add up,
/// percentiles come from the merged histograms.
pub fn merge(all: &[Summary]) -> anyhow::Result<Summary> {
    let first = all
        .first()
        .ok_or_else(|| anyhow::anyhow!("nothing to merge"))?;
    let mut r = Recorder::default();
    let mut per_conn = Vec::new();
    let (mut lock_us, mut lock_n) = (0.0, 0);
    for s in all {
        r.ops.add(decode(&s.histogram)?)?;
        r.batches.add(decode(&s.batch_histogram)?)?;
        r.wrong_values += s.wrong_values;
        r.error_replies += s.error_replies;
        r.failed_completions += s.failed_completions;
        r.torn_retries += s.torn_retries;
        r.updated_values += s.updated_values;
        r.abandoned += s.abandoned;
        lock_us += s.lock_wait_total_us;
        lock_n += s.lock_wait.count;
        per_conn.extend(s.per_conn.iter().cloned());
    }
    let seconds = all.iter().map(|s| s.seconds).fold(0.0, f64::max);
    let info = RunInfo {
        mode: first.mode.clone(),
        op: first.op.clone(),
        conns: all.iter().map(|s| s.conns).sum(),
        threads: all.iter().map(|s| s.threads).sum(),
        share: first.share,
        coalesce: first.coalesce,
    };
    let mut m = summarize(info, &r, per_conn, seconds);
    // rates of concurrent clients add up (each over its own measured time)
    m.ops_per_s = all.iter().map(|s| s.ops_per_s).sum();
    m.mib_per_s = all.iter().map(|s| s.mib_per_s).sum();
    m.batch_in_flight = InFlightSummary::merge(all.iter().map(|s| s.batch_in_flight));
    m.lock_wait_total_us = lock_us;
    m.lock_wait.count = lock_n;
    m.lock_wait.mean_us = if lock_n > 0 {
        lock_us / lock_n as f64
    } else {
        0.0
    };
    Ok(m)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn summary(latencies_us: &[u64], conn: u32) -> Summary {
        let mut r = Recorder::default();
        for &l in latencies_us {
            Recorder::record(&mut r.ops, l * 1000);
        }
        let per_conn = vec![ConnThroughput {
            conn,
            ops: latencies_us.len() as u64,
            bytes: 32 * latencies_us.len() as u64,
            ops_per_s: latencies_us.len() as f64,
            mib_per_s: 0.0,
        }];
        let info = RunInfo {
            mode: "raw".into(),
            op: "read".into(),
            conns: 1,
            threads: 1,
            share: 1,
            coalesce: false,
        };
        summarize(info, &r, per_conn, 1.0)
    }

    #[test]
    fn percentiles_and_rates_come_from_the_histogram() {
        let s = summary(&(1..=100).collect::<Vec<_>>(), 0);
        assert_eq!(s.ops, 100);
        assert_eq!(s.bytes, 3200);
        assert!((s.p50_us - 50.0).abs() < 0.1, "{}", s.p50_us);
        assert!((s.p80_us - 80.0).abs() < 0.1);
        assert!((s.p99_us - 99.0).abs() < 0.1);
        assert!((s.mean_us - 50.5).abs() < 0.1);
        assert_eq!(s.errors, 0);
    }

    #[test]
    fn summaries_merge_through_their_json() {
        let mut a = summary(&[10; 50], 0);
        let mut b = summary(&[30; 50], 1);
        a.batch_in_flight = InFlightSummary::new(4.0, 2.0);
        b.batch_in_flight = InFlightSummary::new(2.0, 2.0);
        let a: Summary = serde_json::from_str(&serde_json::to_string(&a).unwrap()).unwrap();
        let m = merge(&[a, b]).unwrap();
        assert_eq!(m.batch_in_flight, InFlightSummary::new(6.0, 4.0));
        assert_eq!(m.ops, 100);
        assert_eq!(m.conns, 2);
        assert_eq!(m.per_conn.len(), 2);
        assert!((m.mean_us - 20.0).abs() < 0.1);
        assert!((m.p80_us - 30.0).abs() < 0.1);
        assert!((m.ops_per_s - 100.0).abs() < 1e-9);
        assert!(merge(&[]).is_err());
    }
}
