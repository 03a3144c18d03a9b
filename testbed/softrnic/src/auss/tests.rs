use super::*;
use proptest::prelude::*;

fn ms(n: u64) -> Duration {
    Duration::from_millis(n)
}

const EXPIRY: Duration = Duration::from_millis(2000);
const A: u64 = 0x0a4d_0002;
const B: u64 = 0x0a4d_0003;

fn set() -> ActiveSenders<u64> {
    ActiveSenders::new(EXPIRY, 7)
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
    fn n_counts_open_unique_senders(ops in proptest::collection::vec((0u64..3, 0u32..3, any::<bool>(), 0u64..700), 1..60)) {
        let mut s = set();
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
