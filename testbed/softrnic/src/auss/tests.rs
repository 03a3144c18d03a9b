use super::*;
use proptest::prelude::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

const EXPIRY: Duration = Duration::from_millis(2000);
const A: u64 = 0x0a4d_0002;
const B: u64 = 0x0a4d_0003;

/// ENDs at once (no hold): the set's logic apart from the damping.
fn set() -> ActiveSenders<u64> {
    ActiveSenders::new(EXPIRY, Duration::ZERO, 7)
}

const HOLD: Duration = Duration::from_millis(1);

fn held() -> ActiveSenders<u64> {
    ActiveSenders::new(EXPIRY, HOLD, 7)
}

fn long(sender: SenderId, qpn: u32) -> Request {
    Request {
        sender,
        qpn,
        msg_len: 1 << 20,
        idle: false,
    }
}

fn idle(sender: SenderId, qpn: u32) -> Request {
    Request {
        idle: true,
        ..long(sender, qpn)
    }
}

#[test]
fn a_second_sender_makes_n_two_and_both_are_told_at_once() {
    let mut s = set();
    assert_eq!(
        s.stamp(),
        Stamp {
            n: 0,
            epoch: 0,
            incarnation: 7
        }
    );
    assert_eq!(s.on_request(ms(0), A, long(A, 0x11)), vec![A]);
    assert_eq!(
        s.stamp(),
        Stamp {
            n: 1,
            epoch: 1,
            incarnation: 7
        }
    );
    // The first packet of B's first long message: N = 2 and both senders are notified
    // while that packet is handled (the next ACK to either carries it too).
    assert_eq!(s.on_request(ms(1), B, long(B, 0x11)), vec![A, B]);
    assert_eq!(
        s.stamp(),
        Stamp {
            n: 2,
            epoch: 2,
            incarnation: 7
        }
    );
    // B's QP goes idle: N = 1, A (still a member) is told; B, no longer one, is not.
    assert_eq!(s.on_request(ms(2), B, idle(B, 0x11)), vec![A]);
    assert_eq!(
        s.stamp(),
        Stamp {
            n: 1,
            epoch: 3,
            incarnation: 7
        }
    );
}

#[test]
fn a_silent_sender_leaves_after_the_expiry_and_the_others_are_told() {
    let mut s = set();
    s.on_request(ms(0), A, long(A, 0x11));
    s.on_request(ms(0), B, long(B, 0x12));
    // A keeps sending (its packets refresh it every expiry/4); B was SIGKILLed at 0.
    for t in (100..=2000).step_by(100) {
        s.on_request(ms(t), A, long(A, 0x11));
        let told = s.tick(ms(t));
        if t < 2000 {
            assert_eq!(s.n(), 2, "at {t} ms");
            assert!(told.is_empty());
        } else {
            assert_eq!(s.n(), 1, "B expired at {t} ms");
            assert_eq!(told, vec![A]);
        }
    }
    assert_eq!(s.next_deadline(), Some(ms(2000) + EXPIRY));
}

#[test]
fn a_sender_with_two_qps_in_two_overlapping_incasts_counts_once() {
    let mut s = set();
    assert_eq!(s.on_request(ms(0), A, long(A, 0x11)), vec![A]);
    // A second application of host A (another incast into this host) opens a second QP:
    // A is counted already, nothing changes, nobody is told.
    assert!(s.on_request(ms(1), A, long(A, 0x12)).is_empty());
    assert_eq!(s.stamp().n, 1);
    assert!(s.on_request(ms(2), B, long(B, 0x11)).len() == 2);
    assert_eq!(s.stamp().n, 2);
    // One of A's QPs goes idle: A still has the other open.
    assert!(s.on_request(ms(3), A, idle(A, 0x11)).is_empty());
    assert_eq!(
        s.stamp(),
        Stamp {
            n: 2,
            epoch: 2,
            incarnation: 7
        }
    );
    assert_eq!(s.on_request(ms(4), A, idle(A, 0x12)), vec![B]);
    assert_eq!(s.stamp().n, 1);
}

#[test]
fn short_messages_and_packets_between_refreshes_change_nothing() {
    let mut s = set();
    let short = Request {
        msg_len: MIN_ACTIVE_MESSAGE - 1,
        ..long(A, 0x11)
    };
    assert!(s.on_request(ms(0), A, short).is_empty());
    assert!(s
        .on_request(
            ms(0),
            A,
            Request {
                idle: true,
                ..short
            }
        )
        .is_empty());
    assert_eq!(s.stamp().epoch, 0);
    s.on_request(ms(0), A, long(A, 0x11));
    // Packets within a refresh period are not announced; the set's activity time is the
    // last refresh's, so a sender stays as long as it sends.
    for t in 1..500 {
        assert!(s.on_request(ms(t), A, long(A, 0x11)).is_empty());
    }
    assert_eq!(s.next_deadline(), Some(EXPIRY));
    s.on_request(ms(500), A, long(A, 0x11));
    assert_eq!(s.next_deadline(), Some(ms(500) + EXPIRY));
    assert_eq!(
        s.stamp(),
        Stamp {
            n: 1,
            epoch: 1,
            incarnation: 7
        }
    );
}

#[test]
fn a_qp_number_reused_after_an_end_opens_again() {
    let mut s = set();
    s.on_request(ms(0), A, long(A, 0x11));
    s.on_request(ms(1), A, idle(A, 0x11));
    assert_eq!(s.n(), 0);
    // A new QP with the same number (or the same QP busy again): newer than the END.
    assert_eq!(s.on_request(ms(2), A, long(A, 0x11)), vec![A]);
    assert_eq!(s.n(), 1);
}

/// `ib_write_bw`'s send queue runs empty for a moment while it waits for completions: its
/// END and the next message's START within the hold move neither `N` nor the epoch.
#[test]
fn an_end_followed_by_a_start_within_the_hold_changes_nothing() {
    let mut s = held();
    assert_eq!(s.on_request(ms(0), A, long(A, 0x11)), vec![A]);
    assert_eq!(s.on_request(ms(0), B, long(B, 0x12)), vec![A, B]);
    let before = s.stamp();
    assert_eq!((before.n, before.epoch), (2, 2));
    let t = ms(10);
    for gap in 0..5u32 {
        let end = t + HOLD * gap * 2;
        assert!(s.on_request(end, A, idle(A, 0x11)).is_empty());
        assert_eq!(s.next_deadline(), Some(end + HOLD));
        assert!(s.tick(end + HOLD / 2).is_empty());
        assert!(s.on_request(end + HOLD / 2, A, long(A, 0x11)).is_empty());
        assert!(s.tick(end + HOLD * 2).is_empty());
        assert_eq!(s.stamp(), before, "gap {gap}");
    }
    // Short messages (and their ENDs) within the hold do not cancel it.
    let end = ms(20);
    assert!(s.on_request(end, A, idle(A, 0x11)).is_empty());
    let short = Request {
        msg_len: 4096,
        ..idle(A, 0x11)
    };
    assert!(s.on_request(end + HOLD / 2, A, short).is_empty());
    assert_eq!(s.next_deadline(), Some(end + HOLD));
    assert_eq!(s.tick(end + HOLD), vec![B]);
    assert_eq!((s.n(), s.stamp().epoch), (1, 3));
}

/// An END followed by silence: the sender leaves at the end of the hold, once (one epoch),
/// and the others are told; a new sender's START is counted at once, hold or not.
#[test]
fn an_end_followed_by_silence_leaves_after_the_hold_and_a_start_counts_at_once() {
    let mut s = held();
    assert_eq!(s.on_request(ms(0), A, long(A, 0x11)), vec![A]);
    assert_eq!((s.n(), s.stamp().epoch), (1, 1));
    // B starts: counted with its first packet, both told.
    assert_eq!(s.on_request(ms(1), B, long(B, 0x12)), vec![A, B]);
    assert_eq!((s.n(), s.stamp().epoch), (2, 2));
    // A's queue runs empty and stays so.
    let end = ms(5);
    assert!(s.on_request(end, A, idle(A, 0x11)).is_empty());
    assert!(s.tick(end + HOLD - Duration::from_nanos(1)).is_empty());
    assert_eq!((s.n(), s.stamp().epoch), (2, 2), "within the hold");
    assert_eq!(s.tick(end + HOLD), vec![B]);
    assert_eq!((s.n(), s.stamp().epoch), (1, 3));
    assert!(s.tick(end + HOLD * 10).is_empty());
    assert_eq!((s.n(), s.stamp().epoch), (1, 3), "the epoch moved once");
    assert_eq!(s.next_deadline(), Some(ms(1) + EXPIRY), "B's expiry only");
    // A starts again after the hold: a START, counted at once.
    assert_eq!(s.on_request(ms(50), A, long(A, 0x11)), vec![A, B]);
    assert_eq!((s.n(), s.stamp().epoch), (2, 4));
}

/// A held END does not keep a sender that dies: its expiry still applies.
#[test]
fn a_sender_that_dies_expires_as_without_the_hold() {
    let mut s = held();
    s.on_request(ms(0), A, long(A, 0x11));
    s.on_request(ms(0), B, long(B, 0x12));
    for t in (400..=EXPIRY.as_millis() as u64).step_by(400) {
        s.on_request(ms(t), B, long(B, 0x12));
        s.tick(ms(t));
    }
    assert_eq!(s.n(), 1, "A, silent since 0, expired");
    assert_eq!(s.tick(ms(5000)), Vec::<u64>::new());
    assert_eq!(s.n(), 0);
}

#[test]
fn stamps_travel_and_forged_or_truncated_ones_are_refused() {
    let st = Stamp {
        n: 2,
        epoch: 9,
        incarnation: 1_700_000_000_000,
    };
    let b = st.encode();
    assert_eq!(b.len(), STAMP_LEN);
    assert_eq!(Stamp::decode(&b, 2), Ok(st));
    for len in 0..STAMP_LEN {
        assert_eq!(Stamp::decode(&b[..len], 2), Err(StampError::Length(len)));
    }
    let mut long = b.clone();
    long.push(0);
    assert_eq!(Stamp::decode(&long, 2), Err(StampError::Length(25)));
    let mut bad = b.clone();
    bad[0] ^= 1;
    assert!(matches!(Stamp::decode(&bad, 2), Err(StampError::Tag(_))));
    let forge = |n, epoch, incarnation| {
        Stamp {
            n,
            epoch,
            incarnation,
        }
        .encode()
    };
    assert_eq!(
        Stamp::decode(&forge(1, 1, 0), 2),
        Err(StampError::Incarnation)
    );
    assert_eq!(
        Stamp::decode(&forge(1, 0, 5), 2),
        Err(StampError::EpochZero(1))
    );
    assert_eq!(
        Stamp::decode(&forge(3, 1, 5), 2),
        Err(StampError::TooMany { n: 3, max: 2 })
    );
    // N = 0 at epoch 0 is a receiver nobody is active at yet.
    assert!(Stamp::decode(&forge(0, 0, 5), 2).is_ok());
}

#[test]
fn the_requester_keeps_the_newest_stamp_and_refuses_stale_replayed_and_conflicting_ones() {
    let mut l = Latest::<u32>::default();
    let s = |n, epoch, incarnation| Stamp {
        n,
        epoch,
        incarnation,
    };
    assert_eq!(l.apply(1, s(1, 1, 5)), Applied::Newer);
    assert_eq!(l.apply(1, s(2, 2, 5)), Applied::Newer);
    // A delayed ACK of epoch 1 after the notification of epoch 2, or a replay of it.
    assert_eq!(l.apply(1, s(1, 1, 5)), Applied::Stale);
    assert_eq!(l.apply(1, s(2, 2, 5)), Applied::Same);
    // Epoch 2 said N = 2; another N for it is a forgery.
    assert_eq!(l.apply(1, s(1, 2, 5)), Applied::Conflicting);
    assert_eq!(l.get(1), Some(s(2, 2, 5)));
    // The receiver's engine restarted: epochs start again, its new life wins.
    assert_eq!(l.apply(1, s(1, 1, 6)), Applied::Newer);
    assert_eq!(l.apply(1, s(3, 40, 5)), Applied::Stale);
    assert_eq!(l.get(1), Some(s(1, 1, 6)));
    // Destinations are apart.
    assert_eq!(l.get(2), None);
    assert_eq!(l.apply(2, s(1, 1, 5)), Applied::Newer);
}

proptest! {
    #[test]
    fn decoding_arbitrary_bytes_never_panics(b in proptest::collection::vec(any::<u8>(), 0..40), max in 0u32..8) {
        if let Ok(s) = Stamp::decode(&b, max) {
            prop_assert_eq!(s.encode(), b);
            prop_assert!(s.n <= max);
        }
    }

    /// Whatever the requests and ticks, `N` counts the senders with an open QP heard from
    /// within the expiry, and every change of it moves the epoch on.
    #[test]
    fn n_counts_open_unique_senders(ops in proptest::collection::vec((0u64..3, 0u32..3, any::<bool>(), 0u64..700), 1..60), hold_ms in 0u64..3) {
        let mut s = ActiveSenders::new(EXPIRY, ms(hold_ms), 7);
        let mut now = 0;
        let mut last = s.stamp();
        for (sender, qpn, is_idle, dt) in ops {
            now += dt;
            let r = Request { sender, qpn, msg_len: 1 << 20, idle: is_idle };
            s.on_request(ms(now), sender, r);
            s.tick(ms(now));
            let st = s.stamp();
            prop_assert!(st.n <= 3);
            prop_assert!(st.epoch >= last.epoch);
            if st.n != last.n {
                prop_assert!(st.epoch > last.epoch);
            }
            last = st;
        }
    }
}

#[test]
fn a_dasr_cap_is_the_line_over_n_less_the_headroom_and_none_for_no_sender() {
    assert_eq!(dasr_cap_kbps(1.0, 0), None);
    // a lone sender too keeps the headroom, so a queue its bursts built drains
    assert_eq!(dasr_cap_kbps(1.0, 1), Some(970_000));
    assert_eq!(dasr_cap_kbps(1.0, 2), Some(485_000));
    assert_eq!(dasr_cap_kbps(0.2, 16), Some(12_125));
    assert_eq!(dasr_cap_kbps(0.0, 4), None);
    assert_eq!(dasr_cap_kbps(1e-9, u32::MAX), Some(1));
}
