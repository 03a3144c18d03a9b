//! Unit tests of virtual CQs over a fake provider: the lock-free index, order of completions
//! moved by the poller and the collector, and injected failed completions.

use super::*;
use std::cell::RefCell;

thread_local! {
    /// What the fake provider's dedicated CQ holds.
    static DEDICATED: RefCell<VecDeque<u64>> = const { RefCell::new(VecDeque::new()) };
}

unsafe extern "C" fn fake_poll(_: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
    let mut k = 0;
    DEDICATED.with(|d| {
        while k < n {
            let Some(id) = d.borrow_mut().pop_front() else {
                break;
            };
            // SAFETY: the caller's array holds n entries.
            unsafe {
                wc.add(k as usize).write(IbvWc {
                    wr_id: id,
                    ..IbvWc::default()
                })
            };
            k += 1;
        }
    });
    k
}

fn vcq(app: usize) -> Arc<Vcq> {
    vcq_with(app, fake_poll)
}

fn vcq_with(app: usize, poll: PollCqFn) -> Arc<Vcq> {
    Arc::new(Vcq {
        app,
        dedicated: app + 8,
        ctx: 0,
        extended: false,
        poll,
        notify: None,
        capacity: AtomicUsize::new(16),
        app_polled: AtomicBool::new(false),
        quiet_since_ps: AtomicU64::new(0),
        channel: None,
        inner: SpinLock::new(Inner::default()),
    })
}

/// The lock-free index finds what was inserted, forgets what was removed, and reuses
/// the tombstone. Addresses that share a home slot probe past each other.
#[test]
fn index_finds_inserted_and_forgets_removed() {
    let a = vcq(0x7000_0000);
    let twin = (1..)
        .map(|i| a.app + 16 * i)
        .find(|k| home(*k) == home(a.app))
        .unwrap();
    let b = vcq(twin);
    assert!(index_insert(&a) && index_insert(&b));
    let found = |v: &Arc<Vcq>| find(v.app as *mut IbvCq).map(|f| f.app);
    assert_eq!((found(&a), found(&b)), (Some(a.app), Some(b.app)));
    index_remove(a.app);
    assert_eq!((found(&a), found(&b)), (None, Some(b.app)));
    assert!(index_insert(&a));
    assert_eq!(found(&a), Some(a.app));
    index_remove(a.app);
    index_remove(b.app);
    assert!(find(a.app as *mut IbvCq).is_none());
}

/// A CQ fed by a producer thread, shared by every thread (the fake provider above is
/// per thread).
static SHARED: std::sync::Mutex<VecDeque<u64>> = std::sync::Mutex::new(VecDeque::new());

unsafe extern "C" fn shared_poll(_: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
    let mut q = SHARED.lock().unwrap();
    let mut k = 0;
    while k < n {
        let Some(id) = q.pop_front() else { break };
        // SAFETY: the caller's array holds n entries.
        unsafe {
            wc.add(k as usize).write(IbvWc {
                wr_id: id,
                ..IbvWc::default()
            })
        };
        k += 1;
    }
    k
}

/// The application polling while the engine thread collects: every completion reaches
/// the application once, in order.
#[test]
fn collecting_beside_a_poller_keeps_order() {
    let v = vcq_with(0x5000_0000, shared_poll);
    let total = 200_000u64;
    let producer = std::thread::spawn(move || {
        for i in 0..total {
            SHARED.lock().unwrap().push_back(i);
            if i % 64 == 0 {
                std::thread::yield_now();
            }
        }
    });
    let stop = Arc::new(AtomicBool::new(false));
    let (v2, stop2) = (v.clone(), stop.clone());
    let collector = std::thread::spawn(move || {
        while !stop2.load(Relaxed) {
            v2.collect();
        }
    });
    let mut next = 0;
    let mut wc = [IbvWc::default(); 32];
    while next < total {
        // SAFETY: an array of 32.
        let p = unsafe { v.poll(None, 32, wc.as_mut_ptr()) };
        for w in &wc[..p.rc.max(0) as usize] {
            assert_eq!(w.wr_id, next, "out of order");
            next += 1;
        }
    }
    stop.store(true, Relaxed);
    producer.join().unwrap();
    collector.join().unwrap();
}

/// An error completion the shim makes comes after the completions of earlier WRs that
/// are still in the dedicated CQ, and polling returns everything in order.
#[test]
fn injected_error_follows_earlier_completions() {
    let v = vcq(0x6000_0000);
    DEDICATED.with(|d| d.borrow_mut().extend([1, 2]));
    v.inject(IbvWc {
        wr_id: 3,
        status: IBV_WC_LOC_QP_OP_ERR,
        ..IbvWc::default()
    });
    DEDICATED.with(|d| d.borrow_mut().push_back(4));
    let mut wc = [IbvWc::default(); 8];
    // SAFETY: an array of 8.
    let p = unsafe { v.poll(None, 8, wc.as_mut_ptr()) };
    let ids: Vec<u64> = wc[..p.rc as usize].iter().map(|w| w.wr_id).collect();
    assert_eq!(ids, [1, 2, 3, 4]);
    assert_eq!(wc[2].status, IBV_WC_LOC_QP_OP_ERR);
}
