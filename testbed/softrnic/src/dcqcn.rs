//! DCQCN (Zhu et al., "Congestion Control for Large-Scale RDMA Deployments", SIGCOMM 2015),
//! the congestion control RoCE NICs run for RC traffic: the receiving NIC (notification
//! point, NP) answers packets that arrive ECN-marked (CE) with congestion notification
//! packets (CNPs) to their sender, at most one per QP per CNP interval; the sending NIC's
//! per-QP reaction point (RP) cuts the QP's rate on each CNP and recovers it by timer and
//! byte counter (fast recovery, additive increase, hyper increase).
//!
//! Pure: times are ns on the caller's clock, passed in; no I/O. The defaults are the
//! published ones for a 40 Gb/s NIC, scaled to softrnic's line rate and time scale (see
//! docs/softrnic-congestion.md).

/// The reference NIC the published rate parameters are given for, in Gb/s.
const REFERENCE_GBPS: f64 = 40.0;

/// DCQCN's parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DcqcnConfig {
    /// The line rate, the ceiling of every RP rate, in bit/s.
    pub line_bps: f64,
    /// The floor no decrease goes below, in bit/s.
    pub min_bps: f64,
    /// Gain of the alpha estimate (g).
    pub g: f64,
    /// NP: least time between two CNPs for one QP.
    pub cnp_interval_ns: u64,
    /// RP: alpha decays once per this period without a CNP (K).
    pub alpha_timer_ns: u64,
    /// RP: a rate-increase event per this period after a decrease (T).
    pub increase_timer_ns: u64,
    /// RP: a rate-increase event per this many bytes sent after a decrease (B).
    pub byte_counter: u64,
    /// Increase events of fast recovery before additive increase (F).
    pub fast_recovery_steps: u32,
    /// Additive (R_AI) and hyper (R_HAI) increase of the target rate, in bit/s.
    pub rate_ai_bps: f64,
    pub rate_hai_bps: f64,
}

impl DcqcnConfig {
    /// The published defaults at 40 Gb/s (g = 1/256, 50 µs between CNPs, alpha timer 55 µs,
    /// increase timer 300 µs, byte counter 10 MB, F = 5, R_AI 40 Mb/s, R_HAI 400 Mb/s,
    /// floor 40 Mb/s), for a NIC of `line_rate_gbps` whose time runs `time_scale` times
    /// slower than real time (1: not dilated). Rates scale with the line rate, so that a
    /// step is the same fraction of the line; times scale with the time scale; the byte
    /// counter with both, so that it stands for the same line time as at 40 Gb/s.
    pub fn scaled(line_rate_gbps: f64, time_scale: f64) -> DcqcnConfig {
        let line_bps = line_rate_gbps * 1e9;
        let of_line = line_rate_gbps / REFERENCE_GBPS;
        let time = |us: f64| (us * 1000.0 * time_scale) as u64;
        DcqcnConfig {
            line_bps,
            min_bps: 40e6 * of_line,
            g: 1.0 / 256.0,
            cnp_interval_ns: time(50.0),
            alpha_timer_ns: time(55.0),
            increase_timer_ns: time(300.0),
            byte_counter: ((10e6 * of_line * time_scale) as u64).max(1),
            fast_recovery_steps: 5,
            rate_ai_bps: 40e6 * of_line,
            rate_hai_bps: 400e6 * of_line,
        }
    }
}

/// NP: whether a CE-marked packet arriving at `now` for a QP that last sent a CNP at
/// `last_cnp` (None: never) is answered with a CNP.
pub fn np_sends_cnp(cfg: &DcqcnConfig, last_cnp: Option<u64>, now: u64) -> bool {
    last_cnp.is_none_or(|t| now.saturating_sub(t) >= cfg.cnp_interval_ns)
}

/// RP: one QP's rate state.
#[derive(Debug, Clone, PartialEq)]
pub struct Rp {
    cfg: DcqcnConfig,
    /// Current (RC) and target (RT) rate, bit/s.
    rc: f64,
    rt: f64,
    alpha: f64,
    /// End of the running alpha period, and whether a CNP came within it.
    alpha_at: u64,
    cnp_in_period: bool,
    /// End of the running increase period; increase events by timer and by bytes since
    /// the last decrease, and the bytes sent towards the next byte event.
    timer_at: u64,
    timer_events: u32,
    byte_events: u32,
    bytes: u64,
}

impl Rp {
    /// A QP at line rate (as a QP starts: DCQCN has no slow start).
    pub fn new(cfg: DcqcnConfig, now: u64) -> Rp {
        Rp {
            cfg,
            rc: cfg.line_bps,
            rt: cfg.line_bps,
            alpha: 1.0,
            alpha_at: now + cfg.alpha_timer_ns,
            cnp_in_period: false,
            timer_at: now + cfg.increase_timer_ns,
            timer_events: 0,
            byte_events: 0,
            bytes: 0,
        }
    }

    /// The rate the QP may send at, bit/s.
    pub fn rate_bps(&self) -> f64 {
        self.rc
    }

    /// Below the line rate: the QP's packets are paced.
    pub fn limited(&self) -> bool {
        self.rc < self.cfg.line_bps
    }

    pub fn alpha(&self) -> f64 {
        self.alpha
    }

    /// A CNP arrived: cut the rate by alpha / 2 and remember where it was as the target.
    pub fn on_cnp(&mut self, now: u64) {
        self.advance(now);
        self.rt = self.rc;
        self.rc = (self.rc * (1.0 - self.alpha / 2.0)).max(self.cfg.min_bps);
        self.alpha = (1.0 - self.cfg.g) * self.alpha + self.cfg.g;
        self.cnp_in_period = true;
        self.timer_at = now + self.cfg.increase_timer_ns;
        self.timer_events = 0;
        self.byte_events = 0;
        self.bytes = 0;
    }

    /// `bytes` left on the wire for this QP at `now`.
    pub fn on_sent(&mut self, bytes: u64, now: u64) {
        self.advance(now);
        if !self.limited() {
            return;
        }
        self.bytes += bytes;
        while self.bytes >= self.cfg.byte_counter && self.limited() {
            self.bytes -= self.cfg.byte_counter;
            self.byte_events = self.byte_events.saturating_add(1);
            self.increase();
        }
    }

    /// Run the timers up to `now` (the caller's clock may jump: an engine wakes late).
    pub fn advance(&mut self, now: u64) {
        if now >= self.alpha_at {
            let k = self.cfg.alpha_timer_ns.max(1);
            let periods = (now - self.alpha_at) / k + 1;
            // The first period ending may have seen a CNP; the later ones did not.
            let decays = periods - u64::from(self.cnp_in_period);
            self.alpha *= (1.0 - self.cfg.g).powf(decays as f64);
            self.alpha_at += periods * k;
            self.cnp_in_period = false;
        }
        let t = self.cfg.increase_timer_ns.max(1);
        while now >= self.timer_at && self.limited() {
            self.timer_at += t;
            self.timer_events = self.timer_events.saturating_add(1);
            self.increase();
        }
        if now >= self.timer_at {
            // At line rate nothing is counted; the next decrease restarts the timer.
            self.timer_at = now + t;
        }
    }

    /// One rate-increase event (timer or byte counter): the first F are fast recovery (the
    /// rate halves its distance to the target), then the target grows by R_AI, and by
    /// R_HAI per event beyond F once both counters are past F.
    fn increase(&mut self) {
        let f = self.cfg.fast_recovery_steps;
        let (t, b) = (self.timer_events, self.byte_events);
        if t.min(b) > f {
            self.rt += f64::from(t.min(b) - f) * self.cfg.rate_hai_bps;
        } else if t.max(b) > f {
            self.rt += self.cfg.rate_ai_bps;
        }
        let line = self.cfg.line_bps;
        self.rt = self.rt.min(line);
        self.rc = ((self.rt + self.rc) / 2.0).min(line);
        // Halving the gap to the line never closes it: a QP this close is at line rate.
        if line - self.rc < line * 1e-6 {
            self.rc = line;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const US: u64 = 1000;

    fn cfg() -> DcqcnConfig {
        DcqcnConfig::scaled(40.0, 1.0)
    }

    #[test]
    fn defaults_at_40g_are_the_published_ones_and_scale() {
        let c = cfg();
        assert_eq!(c.line_bps, 40e9);
        assert_eq!(c.rate_ai_bps, 40e6);
        assert_eq!(c.byte_counter, 10_000_000);
        assert_eq!(
            (c.cnp_interval_ns, c.alpha_timer_ns, c.increase_timer_ns),
            (50 * US, 55 * US, 300 * US)
        );
        // 1 Gb/s dilated 200×: a 40th of the rates, 200× the times, the byte counter the
        // same line time (10 MB at 40 Gb/s is 2 ms; 50 KB at 1 Gb/s is 0.4 ms, × 200).
        let d = DcqcnConfig::scaled(1.0, 200.0);
        assert_eq!(d.rate_ai_bps, 1e6);
        assert_eq!(d.increase_timer_ns, 60_000 * US);
        assert_eq!(d.byte_counter, 50_000_000);
    }

    #[test]
    fn np_answers_at_most_once_per_interval() {
        let c = cfg();
        assert!(np_sends_cnp(&c, None, 0));
        assert!(!np_sends_cnp(&c, Some(100 * US), 149 * US));
        assert!(np_sends_cnp(&c, Some(100 * US), 150 * US));
    }

    #[test]
    fn a_cnp_halves_a_fresh_qp_then_fast_recovery_halves_the_gap() {
        let c = cfg();
        let mut rp = Rp::new(c, 0);
        rp.on_cnp(0);
        // alpha starts at 1: RC = line / 2, RT = line.
        assert_eq!(rp.rate_bps(), 20e9);
        assert!(rp.limited());
        rp.advance(300 * US);
        assert_eq!(rp.rate_bps(), 30e9);
        rp.advance(600 * US);
        assert_eq!(rp.rate_bps(), 35e9);
        // Alpha: raised by the CNP, then decayed once per 55 µs without one.
        let a = (1.0 - c.g) + c.g;
        let periods = 600 / 55;
        let expected = a * (1.0 - c.g).powi(periods - 1);
        assert!((rp.alpha() - expected).abs() < 1e-9, "{}", rp.alpha());
    }

    #[test]
    fn after_fast_recovery_the_target_grows_additively_then_hyper() {
        let c = cfg();
        let mut rp = Rp::new(c, 0);
        rp.on_cnp(0);
        rp.on_cnp(1);
        let rt = 20e9;
        // Five timer events of fast recovery towards 20 Gb/s, then R_AI per event.
        rp.advance(1 + 5 * 300 * US);
        let fast = rp.rate_bps();
        assert!(fast < rt && fast > 19e9, "{fast}");
        rp.advance(1 + 6 * 300 * US);
        assert_eq!(rp.rt, rt + c.rate_ai_bps);
        // Byte events too: both counters past F → hyper increase.
        let rt = rp.rt;
        rp.on_sent(6 * c.byte_counter, 1 + 6 * 300 * US);
        assert!(rp.rt > rt + c.rate_hai_bps, "{} {}", rp.rt, rt);
    }

    fn within_bounds(rp: &Rp) -> bool {
        rp.rate_bps() <= rp.cfg.line_bps && rp.rate_bps() >= rp.cfg.min_bps
    }

    proptest! {
        /// Whatever CNPs, sends and clock jumps come, the rate stays between the floor and
        /// the line rate; and with no more CNPs it is back at the line rate.
        #[test]
        fn rate_stays_bounded_and_recovers_without_cnps(
            line_gbps in 0.1f64..100.0,
            events in proptest::collection::vec((0u8..3, 0u64..400_000, 0u64..20_000_000), 1..300),
        ) {
            let c = DcqcnConfig::scaled(line_gbps, 1.0);
            let mut rp = Rp::new(c, 0);
            let mut now = 0;
            for (kind, dt, bytes) in events {
                now += dt;
                match kind {
                    0 => rp.on_cnp(now),
                    1 => rp.on_sent(bytes, now),
                    _ => rp.advance(now),
                }
                prop_assert!(within_bounds(&rp), "rate {}", rp.rate_bps());
            }
            // From the floor: F fast-recovery events, then (line / R_AI) additive ones at
            // most; 2,000 increase periods are more than enough.
            rp.advance(now + 2_000 * c.increase_timer_ns);
            prop_assert_eq!(rp.rate_bps(), c.line_bps);
            prop_assert!(!rp.limited());
        }
    }

    /// A fluid simulation of N flows into one bottleneck of the line rate: the queue grows
    /// by what the flows send beyond the line, packets are marked while it is above the
    /// threshold and each flow's NP answers them. From unequal starts (flow i cut i times)
    /// the flows' shares come together — window by window Jain's fairness index rises, to
    /// near 1 — and the link stays used. (DCQCN converges slowly: fast recovery returns each
    /// flow to its own earlier rate, only the additive steps, equal for all, even them out.)
    fn simulate(n: usize, windows: usize, window_ns: u64) -> Vec<(f64, f64)> {
        let c = cfg();
        let step = US;
        let mut rps: Vec<Rp> = (0..n).map(|_| Rp::new(c, 0)).collect();
        for (i, rp) in rps.iter_mut().enumerate() {
            for k in 0..i {
                rp.on_cnp(k as u64);
            }
        }
        let mut last_cnp = vec![None; n];
        let mut queue = 0.0f64;
        let threshold = 200e3;
        let mut out = Vec::new();
        let mut now = 0;
        for _ in 0..windows {
            let mut sent = vec![0.0f64; n];
            let end = now + window_ns;
            while now < end {
                now += step;
                let mut in_bytes = 0.0;
                for (i, rp) in rps.iter_mut().enumerate() {
                    let b = rp.rate_bps() * step as f64 / 8e9;
                    in_bytes += b;
                    sent[i] += b;
                    rp.on_sent(b as u64, now);
                    if queue >= threshold && np_sends_cnp(&c, last_cnp[i], now) {
                        last_cnp[i] = Some(now);
                        rp.on_cnp(now);
                    }
                }
                queue = (queue + in_bytes - c.line_bps * step as f64 / 8e9).max(0.0);
            }
            let total: f64 = sent.iter().sum();
            let jain = total * total / (n as f64 * sent.iter().map(|s| s * s).sum::<f64>());
            out.push((jain, total / (c.line_bps * window_ns as f64 / 8e9)));
        }
        out
    }

    #[test]
    fn flows_on_one_bottleneck_converge_to_fair_shares() {
        for n in [2usize, 4, 8] {
            let w = simulate(n, 8, 250_000 * US);
            for pair in w.windows(2) {
                assert!(pair[1].0 > pair[0].0, "{n} flows: fairness fell: {w:?}");
            }
            let (jain, used) = w[w.len() - 1];
            assert!(jain > 0.85, "{n} flows: Jain index {jain} after 2 s: {w:?}");
            assert!(
                w.iter().all(|&(_, u)| u > 0.95),
                "{n} flows: link idle: {w:?}"
            );
            assert!(used <= 1.01);
        }
    }

    /// The link's use by 4 flows starting together at the line rate into one bottleneck
    /// marked from `threshold` bytes, over the second half of 1 s — a fluid simulation like
    /// [`simulate`]'s, but a mark reaches its flow only when the marked packet leaves the
    /// queue, as the notification point sees it at the receiver: the queue's delay is part
    /// of the loop.
    fn utilisation(line_gbps: f64, threshold: f64) -> f64 {
        let c = DcqcnConfig::scaled(line_gbps, 1.0);
        let n = 4;
        let mut rps: Vec<Rp> = (0..n).map(|_| Rp::new(c, 0)).collect();
        let mut last_cnp = vec![None; n];
        let mut marks = std::collections::VecDeque::new();
        let (step, end) = (US, 1_000_000 * US);
        let (mut queue, mut now, mut sent) = (0.0f64, 0, 0.0);
        while now < end {
            now += step;
            let delay = (queue * 8e9 / c.line_bps) as u64;
            let mut in_bytes = 0.0;
            for (i, rp) in rps.iter_mut().enumerate() {
                let b = rp.rate_bps() * step as f64 / 8e9;
                in_bytes += b;
                rp.on_sent(b as u64, now);
                if queue >= threshold {
                    marks.push_back((now + delay, i));
                }
            }
            while let Some(&(due, i)) = marks.front().filter(|(due, _)| *due <= now) {
                marks.pop_front();
                if np_sends_cnp(&c, last_cnp[i], due) {
                    last_cnp[i] = Some(due);
                    rps[i].on_cnp(due);
                }
            }
            if now > end / 2 {
                sent += in_bytes;
            }
            queue = (queue + in_bytes - c.line_bps * step as f64 / 8e9).max(0.0);
        }
        sent / (c.line_bps * (end / 2) as f64 / 8e9)
    }

    /// DCQCN's defaults assume the marking threshold is a short time of the line: K_max =
    /// 200 KB is 40 µs at 40 Gb/s. The same 200 KB at 1 Gb/s is 1.6 ms, 32 CNP intervals:
    /// a flow is cut again and again before its first cut drains the queue, and the link
    /// runs at about 60 % (the softrnic incast test's configuration, tests/incast.rs). The
    /// threshold scaled to the same line time (5 KB) keeps it used.
    #[test]
    fn a_threshold_long_in_line_time_costs_utilisation() {
        let at_40g = utilisation(40.0, 200e3);
        let deep = utilisation(1.0, 200e3);
        let scaled = utilisation(1.0, 5e3);
        assert!(at_40g > 0.95, "{at_40g}");
        assert!(scaled > 0.95, "{scaled}");
        assert!(deep > 0.5 && deep < 0.7, "{deep}");
    }
}
