//! Dart's receiver state (Dart §III-C, Fig. 5): what a notification point does with a
//! CE-marked packet when its senders cap themselves at the receiver's `R/N` (DASR).
//!
//! DCQCN alone answers every marked packet with a CNP (at most one per QP per interval).
//! Dart observes that under receiver congestion the receiver's port runs at line rate
//! however the senders are throttled — they are serialised on its last hop anyway — and
//! that cutting their rates on top of DASR's apportioning over-throttles them. So in its
//! "receiver congestion" state (marks while the receiver sees line rate) it suppresses the
//! marks and lets `N` do the work; only marks while the receiver sees less than line rate
//! ("non-receiver congestion": a queue upstream, not at this port) reach DCQCN.
//!
//! A softrnic receive port marks a packet only when its own queue stands at the threshold,
//! so such a mark is receiver congestion by construction; a packet that arrives already
//! marked (set upstream: no switch in softrnic sets it, but the wire carries it) is judged
//! by whether the port has run at line rate for a whole CNP interval.
//!
//! Pure: the engine passes the port's busy time and reads the decision.

use std::time::Duration;

/// How a receiving NIC answers marked packets, chosen per host at run time
/// (`softrnic receiver NAME dcqcn|dart`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// DCQCN's notification point: a CNP for every marked packet (within the interval).
    #[default]
    Dcqcn,
    /// Dart's state machine: marks under receiver congestion are suppressed.
    Dart,
}

impl Policy {
    pub fn name(self) -> &'static str {
        match self {
            Policy::Dcqcn => "dcqcn",
            Policy::Dart => "dart",
        }
    }

    /// The policy a host's `receiver` file names (surrounding white space ignored).
    pub fn parse(text: &str) -> Option<Policy> {
        match text.trim() {
            "dcqcn" => Some(Policy::Dcqcn),
            "dart" => Some(Policy::Dart),
            _ => None,
        }
    }
}

/// What one marked packet says about where the congestion is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Congestion {
    /// At this receiver's port: it runs at line rate.
    Receiver,
    /// Elsewhere: the port does not run at line rate.
    NonReceiver,
}

/// Where the congestion a marked packet reports is: `marked_here` when this port set the
/// mark; `busy_for`, how long the port has run at line rate; `window`, how long that must
/// have lasted for a mark set upstream to count as receiver congestion.
pub fn classify(marked_here: bool, busy_for: Duration, window: Duration) -> Congestion {
    if marked_here || busy_for >= window {
        Congestion::Receiver
    } else {
        Congestion::NonReceiver
    }
}

/// Whether the notification point answers a marked packet with a CNP under `policy`.
pub fn answers_with_cnp(policy: Policy, congestion: Congestion) -> bool {
    policy == Policy::Dcqcn || congestion == Congestion::NonReceiver
}

/// Dart's parts of a NIC, set at run time (`softrnic receiver`, `softrnic dasr`), and what
/// its receiver did.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct DartNic {
    /// How the notification point answers marked packets.
    pub receiver: Policy,
    /// Whether the requester caps each RC QP at `R/N` of its destination's newest stamp
    /// (Dart's rate limiter in the NIC).
    pub caps: bool,
    /// Marked packets that drew no CNP because the congestion was at this receiver.
    pub cnps_suppressed: u64,
    /// Marked packets judged non-receiver congestion under Dart (answered as DCQCN does).
    pub non_receiver_marks: u64,
}

impl DartNic {
    /// `name value` lines for the stats file.
    pub fn lines(&self) -> String {
        format!(
            "dart_receiver {}\ndart_cnps_suppressed {}\ndart_non_receiver_marks {}\n\
             dasr_caps {}\n",
            u8::from(self.receiver == Policy::Dart),
            self.cnps_suppressed,
            self.non_receiver_marks,
            u8::from(self.caps)
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: Duration = Duration::from_micros(50);

    #[test]
    fn a_mark_this_port_set_is_receiver_congestion() {
        assert_eq!(classify(true, Duration::ZERO, W), Congestion::Receiver);
    }

    #[test]
    fn a_mark_set_upstream_is_receiver_congestion_only_at_line_rate_for_a_window() {
        assert_eq!(classify(false, W, W), Congestion::Receiver);
        assert_eq!(
            classify(false, W - Duration::from_nanos(1), W),
            Congestion::NonReceiver
        );
        assert_eq!(classify(false, Duration::ZERO, W), Congestion::NonReceiver);
    }

    #[test]
    fn dcqcn_answers_every_mark_and_dart_only_those_not_at_the_receiver() {
        for c in [Congestion::Receiver, Congestion::NonReceiver] {
            assert!(answers_with_cnp(Policy::Dcqcn, c));
        }
        assert!(!answers_with_cnp(Policy::Dart, Congestion::Receiver));
        assert!(answers_with_cnp(Policy::Dart, Congestion::NonReceiver));
    }

    #[test]
    fn policies_parse_from_their_names_and_nothing_else() {
        for p in [Policy::Dcqcn, Policy::Dart] {
            assert_eq!(Policy::parse(&format!("{}\n", p.name())), Some(p));
        }
        for bad in ["", "DART", "dart dcqcn", "off"] {
            assert_eq!(Policy::parse(bad), None, "{bad:?}");
        }
        assert_eq!(Policy::default(), Policy::Dcqcn);
    }
}
