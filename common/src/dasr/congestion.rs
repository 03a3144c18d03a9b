//! The per-receiver congestion state machine of DESIGN §4, fed with measured rates.
//!
//! - **No congestion** → **Receiver congestion** when congestion is signalled (ECN marks, CNPs,
//!   queueing delay — whatever the caller measures) while the receive rate is at line rate
//!   (≥ `at_line_rate` × line rate): the receiver's link is the bottleneck, DASR caps apply.
//! - → **Non-receiver congestion** when congestion is signalled below line rate: the bottleneck
//!   is elsewhere in the network, so the DASR cap is turned off and congestion control is left
//!   to the transport.
//! - Either congested state → **No congestion** after `quiet` with no congestion signal.
//!
//! A new signal moves directly between the two congested states as the rate crosses the
//! threshold.

use std::time::Duration;

#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum CongestionState {
    NoCongestion,
    ReceiverCongestion,
    NonReceiverCongestion,
}

impl CongestionState {
    /// Whether DASR caps apply in this state.
    pub fn cap_enabled(self) -> bool {
        self != CongestionState::NonReceiverCongestion
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct CongestionConfig {
    /// The receiver's line rate, in the unit of the observed rates.
    pub line_rate: f64,
    /// Fraction of line rate that counts as "at line rate" (default 0.95: measured rates of
    /// a saturated link jitter a few percent below nominal).
    pub at_line_rate: f64,
    /// Time without a congestion signal before returning to No congestion (default 1 s).
    pub quiet: Duration,
}

impl CongestionConfig {
    pub fn new(line_rate: f64) -> Self {
        Self {
            line_rate,
            at_line_rate: 0.95,
            quiet: Duration::from_secs(1),
        }
    }
}

#[derive(Clone, Debug)]
pub struct CongestionDetector {
    cfg: CongestionConfig,
    state: CongestionState,
    last_signal: Option<Duration>,
}

impl CongestionDetector {
    pub fn new(cfg: CongestionConfig) -> Self {
        Self {
            cfg,
            state: CongestionState::NoCongestion,
            last_signal: None,
        }
    }

    pub fn state(&self) -> CongestionState {
        self.state
    }

    /// The receiver's line rate changed (e.g. the configured `R`).
    pub fn set_line_rate(&mut self, line_rate: f64) {
        self.cfg.line_rate = line_rate;
    }

    /// One measurement: the receive rate over the last interval and whether congestion was
    /// signalled in it. Returns the new state if it changed.
    pub fn observe(
        &mut self,
        now: Duration,
        rx_rate: f64,
        congestion_signalled: bool,
    ) -> Option<CongestionState> {
        let next = if congestion_signalled {
            self.last_signal = Some(now);
            if rx_rate >= self.cfg.at_line_rate * self.cfg.line_rate {
                CongestionState::ReceiverCongestion
            } else {
                CongestionState::NonReceiverCongestion
            }
        } else {
            match self.last_signal {
                Some(t) if now.saturating_sub(t) < self.cfg.quiet => self.state,
                _ => CongestionState::NoCongestion,
            }
        };
        (next != self.state).then(|| {
            self.state = next;
            next
        })
    }

    /// Returns to No congestion once the quiet period has passed without measurements.
    pub fn tick(&mut self, now: Duration) -> Option<CongestionState> {
        match self.last_signal {
            Some(t)
                if self.state != CongestionState::NoCongestion
                    && now.saturating_sub(t) >= self.cfg.quiet =>
            {
                self.state = CongestionState::NoCongestion;
                Some(self.state)
            }
            _ => None,
        }
    }

    /// When [`CongestionDetector::tick`] would change the state.
    pub fn next_deadline(&self) -> Option<Duration> {
        match (self.state, self.last_signal) {
            (CongestionState::NoCongestion, _) | (_, None) => None,
            (_, Some(t)) => Some(t + self.cfg.quiet),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::CongestionState::*;
    use super::*;
    use proptest::prelude::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    fn det() -> CongestionDetector {
        CongestionDetector::new(CongestionConfig::new(100.0))
    }

    #[test]
    fn transitions() {
        let mut d = det();
        assert_eq!(d.observe(ms(0), 100.0, false), None);
        assert_eq!(d.observe(ms(1), 99.0, true), Some(ReceiverCongestion));
        assert!(d.state().cap_enabled());
        assert_eq!(d.observe(ms(2), 99.0, true), None);
        assert_eq!(d.observe(ms(3), 40.0, true), Some(NonReceiverCongestion));
        assert!(!d.state().cap_enabled());
        assert_eq!(
            d.observe(ms(500), 40.0, false),
            None,
            "not quiet long enough"
        );
        assert_eq!(d.next_deadline(), Some(ms(1003)));
        assert_eq!(d.observe(ms(1003), 40.0, false), Some(NoCongestion));
        assert_eq!(d.next_deadline(), None);
        // Below line rate without a signal is simply no congestion.
        assert_eq!(d.observe(ms(1004), 10.0, false), None);
    }

    #[test]
    fn tick_ends_congestion_without_measurements() {
        let mut d = det();
        d.observe(ms(0), 100.0, true);
        assert_eq!(d.tick(ms(999)), None);
        assert_eq!(d.tick(ms(1000)), Some(NoCongestion));
        assert_eq!(d.tick(ms(2000)), None);
    }

    proptest! {
        /// The state is always the one implied by the last signal and the time since it.
        #[test]
        fn state_follows_last_signal(obs in proptest::collection::vec((0u64..700, 0f64..120.0, any::<bool>()), 0..50)) {
            let mut d = det();
            let mut now = Duration::ZERO;
            let mut last: Option<(Duration, f64)> = None;
            for (dt, rate, sig) in obs {
                now += Duration::from_millis(dt);
                d.observe(now, rate, sig);
                if sig {
                    last = Some((now, rate));
                }
                let want = match last {
                    Some((t, r)) if now - t < Duration::from_secs(1) => {
                        if r >= 95.0 { ReceiverCongestion } else { NonReceiverCongestion }
                    }
                    _ => NoCongestion,
                };
                prop_assert_eq!(d.state(), want);
            }
        }
    }
}
