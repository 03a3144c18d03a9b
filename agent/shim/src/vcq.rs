//! Virtual CQs: the shim's dedicated CQs between the NIC and the application.
//!
//! For every CQ the application creates on a governed context the shim creates a second CQ
//! of the same size, the *dedicated CQ*, on the same real completion channel, and binds the
//! application's QPs to it instead (`ibv_create_qp`). The application's own CQ stays a real
//! provider object, so every verb that takes it keeps working, but it receives completions
//! only from QPs bound by a path the shim does not wrap (`ibv_create_qp_ex`, `ibv_create_wq`),
//! which a virtual CQ therefore drains as well, under the same grant. Completions reach the
//! application only
//! through the shim, at the granted polling rate (`rate_cqe_per_s`; unmetered without one):
//!
//! * polling: the application's own `ibv_poll_cq` moves completions from the dedicated CQ,
//!   as many as the grant admits — no thread hop, so a busy poller's latency is unchanged;
//! * collection: the shim's engine thread moves them into the ring of a virtual CQ its
//!   application leaves alone ([`harvest`]), so the gate sees work complete even then;
//! * events: the application's completion channel is the shim's. Its `fd` is an epoll fd
//!   watching the real channel (where the dedicated CQs' events arrive), an eventfd for
//!   events the shim raises, and a timerfd, so `poll`/`epoll` on it work as on a real
//!   channel. `ibv_get_cq_event`, in the application's own thread, takes a real event,
//!   acknowledges it, and hands it on as the application's CQ. Completions the grant holds
//!   back are announced by an event the shim raises when the grant admits them: the
//!   channel's timer is set to that moment, so the thread waiting on the channel wakes then
//!   and raises it itself — no thread of the shim's in the path.
//!
//! Rules that keep an application from stalling: an armed virtual CQ whose completions were
//! held back by the grant is looked at again when the grant next admits one; a readable
//! channel yields an event; failures are caught per call and reported once;
//! `DRUM_SHIM_VIRTUAL_CQ=0` turns the whole mechanism off (completions then go straight to
//! the application's CQs).

mod verbs;

pub use verbs::*;

use crate::context::ContextState;
use crate::cq_ex::Moved;
use crate::ffi::*;
use crate::spin::SpinLock;
use crate::trouble::{warn_once, Trouble};
use crate::{govern, limits, stats};
use libc::{c_int, c_void};
use std::collections::{HashMap, VecDeque};
use std::panic::catch_unwind;
use std::ptr;
use std::sync::atomic::{
    AtomicBool, AtomicPtr, AtomicU64, AtomicUsize,
    Ordering::{Acquire, Relaxed, Release},
};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// Virtual CQs created, events handed to the application, and how many of those the
/// polling grant delayed (for the exit summary).
pub static CREATED: AtomicU64 = AtomicU64::new(0);
pub static EVENTS: AtomicU64 = AtomicU64::new(0);
pub static DELAYED_EVENTS: AtomicU64 = AtomicU64::new(0);

/// Whether virtual CQs are on (`DRUM_SHIM_VIRTUAL_CQ=0` turns them off).
pub fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var("DRUM_SHIM_VIRTUAL_CQ").map_or(true, |v| v.trim() != "0"))
}

/// One application CQ made virtual.
pub struct Vcq {
    /// The application's `ibv_cq *` and the dedicated one (the shim's).
    pub app: usize,
    pub dedicated: usize,
    /// The context both CQs belong to.
    ctx: usize,
    /// Both are `ibv_cq_ex`: the engine thread reads them with their own poll functions
    /// and readers (see [`harvest`]).
    extended: bool,
    poll: PollCqFn,
    notify: Option<ReqNotifyCqFn>,
    capacity: AtomicUsize,
    /// The application polled it since the engine thread's last pass (set by the
    /// application, cleared by the engine: no clock reading on the poll path).
    app_polled: AtomicBool,
    /// The engine thread's: since when the application has left it alone (see [`harvest`]).
    quiet_since_ps: AtomicU64,
    channel: Option<Arc<Channel>>,
    inner: SpinLock<Inner>,
}

#[derive(Default)]
struct Inner {
    /// Completions moved for an event or by the engine thread, not yet polled.
    ring: VecDeque<Moved>,
    /// Armed by the application (`ibv_req_notify_cq`; the dedicated CQ is armed alike).
    armed: bool,
    /// The grant may have left completions in the dedicated CQ.
    backlog: bool,
    /// `ibv_cq_ex` only: the completion being read came from `ring` (or the application's
    /// CQ), not the dedicated CQ.
    current: Option<Moved>,
    /// `ibv_cq_ex` only: a poll of the dedicated CQ is open (its `end_poll` is owed).
    dedicated_polling: bool,
}

/// One application completion channel: the real channel behind it, the eventfd for events
/// the shim raises itself, and the epoll fd over both that the application holds as `fd`.
pub struct Channel {
    real: usize,
    efd: c_int,
    /// Fires when a held-back event of one of its CQs falls due, so that whoever waits on
    /// the channel wakes and raises it.
    tfd: c_int,
    /// The timer is set (so that an idle channel costs no timer call per event).
    timer_set: AtomicBool,
    epfd: c_int,
    /// Application CQs with a raised event to collect, in order.
    queue: SpinLock<VecDeque<usize>>,
    /// One taker of real events at a time (a check for readiness, then a read).
    taking: SpinLock<()>,
    /// CQs created on it (it cannot be destroyed before them).
    cqs: AtomicUsize,
}

// SAFETY: the raw pointers inside are addresses the application and provider own; the shim
// only passes them to thread-safe verbs.
unsafe impl Send for Vcq {}
// SAFETY: as above; mutable state is behind locks and atomics.
unsafe impl Sync for Vcq {}

impl Channel {
    fn raise(&self, cq: usize) {
        self.queue.lock().push_back(cq);
        let one: u64 = 1;
        // SAFETY: writing 8 bytes to our own eventfd.
        unsafe { libc::write(self.efd, (&one as *const u64).cast(), 8) };
    }

    /// Sets the timer to the earliest deferred look at one of this channel's CQs (or
    /// disarms it); setting it also clears an expiry already signalled.
    fn refresh_timer(self: &Arc<Self>) {
        let first = DEFERRED
            .lock()
            .iter()
            .filter(|(_, v)| v.channel.as_ref().is_some_and(|c| Arc::ptr_eq(c, self)))
            .map(|(t, _)| *t)
            .min();
        if !self.timer_set.swap(first.is_some(), Relaxed) && first.is_none() {
            return;
        }
        let ns = first.map_or(0, |t| (t.saturating_sub(limits::now_ps()) / 1000).max(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec {
                tv_sec: 0,
                tv_nsec: 0,
            },
            it_value: libc::timespec {
                tv_sec: (ns / 1_000_000_000) as libc::time_t,
                tv_nsec: (ns % 1_000_000_000) as libc::c_long,
            },
        };
        // SAFETY: our own timerfd and a valid specification.
        unsafe { libc::timerfd_settime(self.tfd, 0, &spec, ptr::null_mut()) };
    }

    /// An event the shim raised, if any.
    fn raised(&self) -> Option<usize> {
        let mut v = 0u64;
        // SAFETY: our own non-blocking semaphore eventfd.
        let n = unsafe { libc::read(self.efd, (&mut v as *mut u64).cast(), 8) };
        if n != 8 {
            return None;
        }
        self.queue.lock().pop_front()
    }

    /// A real event, if one is ready: the CQ it names.
    fn real_event(&self) -> Option<*mut IbvCq> {
        let _one = self.taking.lock();
        let realch = self.real as *mut IbvCompChannel;
        let mut pfd = libc::pollfd {
            // SAFETY: the real channel, alive as long as `self`.
            fd: unsafe { (*realch).fd },
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd, no waiting.
        if unsafe { libc::poll(&mut pfd, 1, 0) } != 1 {
            return None;
        }
        let get = crate::real::GET_CQ_EVENT.get()?;
        let mut cq: *mut IbvCq = ptr::null_mut();
        let mut ctx: *mut c_void = ptr::null_mut();
        // SAFETY: libibverbs' ibv_get_cq_event on the real channel, which has an event.
        let rc = unsafe { get(realch, &mut cq, &mut ctx) };
        (rc == 0 && !cq.is_null()).then_some(cq)
    }
}

// ---------------------------------------------------------------------------------------------
// Registries
// ---------------------------------------------------------------------------------------------

/// The data path's index: application CQ address → its `Vcq`, open addressing, lock-free
/// reads. Entries are written under `REG`'s lock; a removed entry becomes a tombstone.
const INDEX: usize = 4096;
const TOMB: usize = usize::MAX;
static KEYS: [AtomicUsize; INDEX] = [const { AtomicUsize::new(0) }; INDEX];
static VALS: [AtomicPtr<Vcq>; INDEX] = [const { AtomicPtr::new(ptr::null_mut()) }; INDEX];
static LIVE: AtomicUsize = AtomicUsize::new(0);

/// Owners: application and dedicated CQ address → `Vcq`; application channel → `Channel`.
type Owners = Option<HashMap<usize, Arc<Vcq>>>;
static REG: SpinLock<Owners> = SpinLock::new(None);
static CHANNELS: SpinLock<Option<HashMap<usize, Arc<Channel>>>> = SpinLock::new(None);
/// Armed virtual CQs to look at again when the grant admits a completion: (when, which).
static DEFERRED: SpinLock<Vec<(u64, Arc<Vcq>)>> = SpinLock::new(Vec::new());

fn home(key: usize) -> usize {
    ((key as u64 >> 4).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 52) as usize % INDEX
}

/// The virtual CQ behind an application CQ, found without locks.
pub fn find(cq: *mut IbvCq) -> Option<&'static Vcq> {
    if LIVE.load(Relaxed) == 0 {
        return None;
    }
    let key = cq as usize;
    let mut i = home(key);
    for _ in 0..INDEX {
        match KEYS[i].load(Acquire) {
            0 => return None,
            k if k == key => {
                // SAFETY: a value is stored before its key and freed only after the key is
                // a tombstone and no other holder is left (`destroy_cq`).
                return unsafe { VALS[i].load(Acquire).as_ref() };
            }
            _ => i = (i + 1) % INDEX,
        }
    }
    None
}

fn index_insert(v: &Arc<Vcq>) -> bool {
    let mut i = home(v.app);
    for _ in 0..INDEX {
        let k = KEYS[i].load(Relaxed);
        if k == 0 || k == TOMB {
            VALS[i].store(Arc::as_ptr(v).cast_mut(), Release);
            KEYS[i].store(v.app, Release);
            LIVE.fetch_add(1, Relaxed);
            return true;
        }
        i = (i + 1) % INDEX;
    }
    false
}

fn index_remove(app: usize) {
    let mut i = home(app);
    for _ in 0..INDEX {
        match KEYS[i].load(Relaxed) {
            0 => return,
            k if k == app => {
                KEYS[i].store(TOMB, Release);
                VALS[i].store(ptr::null_mut(), Release);
                LIVE.fetch_sub(1, Relaxed);
                return;
            }
            _ => i = (i + 1) % INDEX,
        }
    }
}

fn owner(cq: usize) -> Option<Arc<Vcq>> {
    REG.lock().as_ref()?.get(&cq).cloned()
}

fn channel(ch: *mut IbvCompChannel) -> Option<Arc<Channel>> {
    CHANNELS.lock().as_ref()?.get(&(ch as usize)).cloned()
}

/// The real channel behind an application channel that is the shim's; `None` for any other.
pub fn real_channel(ch: *mut IbvCompChannel) -> Option<*mut IbvCompChannel> {
    channel(ch).map(|c| c.real as *mut IbvCompChannel)
}

/// Waits until `a` has no holder but the caller (another thread may be using it), for at
/// most a second: a thread still inside after that uses a CQ or channel the application is
/// destroying, which is the application's own error.
fn exclusive<T>(a: &Arc<T>) {
    for _ in 0..100_000 {
        if Arc::strong_count(a) == 1 {
            return;
        }
        std::thread::sleep(Duration::from_micros(10));
    }
}

pub fn lock_for_fork() {
    REG.acquire();
    CHANNELS.acquire();
    DEFERRED.acquire();
}

pub fn unlock_after_fork() {
    DEFERRED.release();
    CHANNELS.release();
    REG.release();
}

/// Puts an error completion for a send WR of `qp` into its virtual send CQ; `false` when
/// the QP has none.
///
/// # Safety
/// `qp` is a live QP.
pub unsafe fn fail_send(qp: *mut IbvQp, wc: IbvWc) -> bool {
    // SAFETY: per the contract.
    let cq = unsafe { (*qp).send_cq } as usize;
    match owner(cq).filter(|v| v.dedicated == cq) {
        Some(v) => {
            v.inject(wc);
            true
        }
        None => false,
    }
}

/// The dedicated CQ's application CQ (for `ibv_query_qp`), or `cq` itself.
pub fn app_cq_of(cq: *mut IbvCq) -> *mut IbvCq {
    match owner(cq as usize) {
        Some(v) if v.dedicated == cq as usize => v.app as *mut IbvCq,
        _ => cq,
    }
}

/// The dedicated CQ behind the application's `cq` (to bind a QP to, or to acknowledge an
/// asynchronous event on), or `cq` itself.
pub fn dedicated_of(cq: *mut IbvCq) -> *mut IbvCq {
    find(cq).map_or(cq, |v| v.dedicated as *mut IbvCq)
}

/// The application's CQs of a QP about to be created (to give back afterwards).
pub type AppCqs = (*mut IbvCq, *mut IbvCq);

/// Points QP creation attributes (`ibv_qp_init_attr`, or the same prefix of
/// `ibv_qp_init_attr_ex`) at the dedicated CQs of the application's virtual CQs.
///
/// # Safety
/// `attr` is null or the caller's valid attributes.
pub unsafe fn bind_dedicated(attr: *mut IbvQpInitAttr) -> Option<AppCqs> {
    // SAFETY: per the contract.
    let a = unsafe { attr.as_mut() }?;
    let app = (a.send_cq, a.recv_cq);
    if let Ok((s, r)) = catch_unwind(|| (dedicated_of(app.0), dedicated_of(app.1))) {
        (a.send_cq, a.recv_cq) = (s, r);
    }
    Some(app)
}

/// Gives the application its attributes back as they were.
///
/// # Safety
/// `attr` is what [`bind_dedicated`] returned `app` for.
pub unsafe fn unbind(attr: *mut IbvQpInitAttr, app: Option<AppCqs>) {
    if let Some((s, r)) = app {
        // SAFETY: per the contract, not null.
        unsafe { ((*attr).send_cq, (*attr).recv_cq) = (s, r) };
    }
}

// ---------------------------------------------------------------------------------------------
// The data path
// ---------------------------------------------------------------------------------------------

/// What a poll of a virtual CQ found.
pub struct Polled {
    pub rc: c_int,
    /// The grant held completions back.
    pub held: bool,
}

impl Vcq {
    /// `ibv_poll_cq` on the application's CQ of the context `st`. Follows (counts, and
    /// tells the gate of) what it hands over that the shim has not followed yet.
    ///
    /// # Safety
    /// `wc` holds `n` entries.
    pub unsafe fn poll(&self, st: Option<&ContextState>, n: c_int, wc: *mut IbvWc) -> Polled {
        let n = n.max(0) as usize;
        self.note_app_poll();
        let mut inner = self.inner.lock();
        let mut got = 0usize;
        // Moved by an event, not followed yet (rare: allocates only then).
        let mut unfollowed = Vec::new();
        while got < n {
            let Some(m) = inner.ring.pop_front() else {
                break;
            };
            // SAFETY: got < n, within the caller's array.
            unsafe { wc.add(got).write(m.wc) };
            if !m.followed {
                unfollowed.push(m.wc);
            }
            got += 1;
        }
        let from_ring = got;
        let mut held = false;
        let mut rc = None;
        if got < n {
            let want = (n - got) as u64;
            let metered = limits::completions_metered();
            let allow = if metered {
                limits::completion_allowance(limits::now_ps(), want).unwrap_or(0)
            } else {
                want
            };
            if allow > 0 {
                // SAFETY: the dedicated CQ is ours and alive while `self` is registered;
                // room for `allow` entries remains in the caller's array.
                let r = unsafe {
                    (self.poll)(self.dedicated as *mut IbvCq, allow as c_int, wc.add(got))
                };
                if r < 0 {
                    rc = Some(if got > 0 { got as c_int } else { r });
                } else {
                    if metered {
                        limits::consume_completions(limits::now_ps(), r as u64);
                    }
                    inner.backlog = metered && r as u64 == allow && allow < want;
                    got += r as usize;
                }
            } else {
                inner.backlog = true;
            }
            held = allow < want && inner.backlog;
        }
        if got == 0 && rc.is_none() {
            // Completions of QPs bound to the application's CQ by a path the shim does not
            // wrap (an XRC SRQ's receives, `ibv_create_wq`): metered like the others. Under
            // the lock, so that none overtakes one the engine thread moves into the ring.
            let metered = limits::completions_metered();
            let allow = if metered {
                limits::completion_allowance(limits::now_ps(), n as u64).unwrap_or(0) as usize
            } else {
                n
            };
            if allow > 0 {
                // SAFETY: the application's own CQ and array (`allow` ≤ `n` entries).
                let r = unsafe { (self.poll)(self.app as *mut IbvCq, allow as c_int, wc) };
                if metered && r > 0 {
                    limits::consume_completions(limits::now_ps(), r as u64);
                }
                held |= metered && r as usize == allow && allow < n;
                if r < 0 {
                    rc = Some(r);
                } else {
                    got = r as usize;
                }
            }
        }
        // Armed with completions left behind: the real channel will not report them again.
        let look_again = held && inner.armed && self.channel.is_some();
        drop(inner);
        if look_again {
            if let Some(me) = owner(self.app) {
                defer(limits::now_ps(), me);
            }
        }
        if let Some(st) = st {
            // SAFETY: entries from_ring..got were just written by the provider.
            let direct = unsafe { std::slice::from_raw_parts(wc.add(from_ring), got - from_ring) };
            govern::follow(st, &unfollowed);
            govern::follow(st, direct);
        }
        if held {
            stats::STATS.held_polls.fetch_add(1, Relaxed);
        }
        Polled {
            rc: rc.unwrap_or(got as c_int),
            held,
        }
    }

    /// `ibv_start_poll` (`start`) or `ibv_next_poll` on a virtual `ibv_cq_ex`: the next
    /// completion becomes the current one, from the ring of moved completions first, then
    /// from the dedicated CQ as the polling grant admits, then from the application's own
    /// CQ. Returns 0, `ENOENT` (none, or held back by the grant), or the provider's error;
    /// with 0, the completion (from the ring or the application's CQ, else `None`: read it
    /// from the dedicated CQ); and whether the grant held completions back.
    ///
    /// # Safety
    /// Both CQs are `ibv_cq_ex`; `attr` is the application's `ibv_poll_cq_attr` (or null).
    pub unsafe fn poll_ex(&self, start: bool, attr: *mut c_void) -> (c_int, Option<Moved>, bool) {
        self.note_app_poll();
        let mut inner = self.inner.lock();
        if start {
            inner.dedicated_polling = false;
        }
        if let Some(m) = inner.ring.pop_front() {
            inner.current = Some(m);
            // SAFETY: the application's `ibv_cq_ex`.
            unsafe { crate::cq_ex::set_current(self.app as *mut IbvCq, m.wc.wr_id, m.wc.status) };
            return (0, Some(m), false);
        }
        inner.current = None;
        let now = limits::now_ps();
        let metered = limits::completions_metered();
        if metered && limits::completion_allowance(now, 1).unwrap_or(0) == 0 {
            stats::STATS.held_polls.fetch_add(1, Relaxed);
            inner.backlog = true;
            let look_again = inner.armed && self.channel.is_some();
            drop(inner);
            if look_again {
                if let Some(me) = owner(self.app) {
                    defer(now, me);
                }
            }
            return (libc::ENOENT, None, true);
        }
        let ded = self.dedicated as *mut IbvCq;
        // SAFETY: our dedicated `ibv_cq_ex`, alive while `self` is registered; a poll of it
        // is started once and continued until the application ends its own.
        let rc = unsafe {
            if inner.dedicated_polling {
                crate::cq_ex::next_poll(ded)
            } else {
                crate::cq_ex::start_poll(ded, attr)
            }
        };
        if rc == 0 {
            inner.dedicated_polling = true;
            if metered {
                limits::consume_completions(now, 1);
            }
            // SAFETY: as above, and the application's `ibv_cq_ex`.
            unsafe { crate::cq_ex::copy_current(ded, self.app as *mut IbvCq) };
        } else if rc == libc::ENOENT {
            inner.backlog = false;
            // Then what reaches the application's own CQ directly (an XRC SRQ's receives):
            // read with the plain verb, its own poll pointers being the shim's, and handed
            // over as a completion of the shim's (so its timestamps read 0).
            let mut w = IbvWc::default();
            // SAFETY: the application's CQ, alive while `self` is registered; room for one.
            if unsafe { (self.poll)(self.app as *mut IbvCq, 1, &mut w) } == 1 {
                if metered {
                    limits::consume_completions(now, 1);
                }
                let m = Moved::unfollowed(w);
                inner.current = Some(m);
                // SAFETY: the application's `ibv_cq_ex`.
                unsafe { crate::cq_ex::set_current(self.app as *mut IbvCq, w.wr_id, w.status) };
                return (0, Some(m), false);
            }
        }
        (rc, None, false)
    }

    /// The application polls: the engine thread leaves the CQ to it. Written only when it
    /// changes, so a busy poller does not dirty the line at every poll.
    fn note_app_poll(&self) {
        if !self.app_polled.load(Relaxed) {
            self.app_polled.store(true, Relaxed);
        }
    }

    /// Whether the application has left this CQ alone for [`LEFT_ALONE_PS`] (the engine
    /// thread's pass, at `now`).
    fn left_alone(&self, now: u64) -> bool {
        if self.app_polled.swap(false, Relaxed) {
            self.quiet_since_ps.store(now, Relaxed);
            return false;
        }
        now.saturating_sub(self.quiet_since_ps.load(Relaxed)) >= LEFT_ALONE_PS
    }

    /// `ibv_end_poll` on a virtual `ibv_cq_ex`.
    pub fn end_poll_ex(&self) {
        let mut inner = self.inner.lock();
        inner.current = None;
        if std::mem::take(&mut inner.dedicated_polling) {
            // SAFETY: our dedicated `ibv_cq_ex`, whose poll is open.
            unsafe { crate::cq_ex::end_poll(self.dedicated as *mut IbvCq) };
        }
    }

    /// The current completion when it came from the ring (`None`: read the dedicated CQ).
    pub fn current_ex(&self) -> Option<Moved> {
        self.inner.lock().current
    }

    /// Delivers `wc` (an error completion the shim makes for a WR it held back and the
    /// provider then refused) after what is already in the ring.
    fn inject(&self, wc: IbvWc) {
        let mut inner = self.inner.lock();
        // Completions of WRs posted before it come first, as the device would order them:
        // moved regardless of the grant (a rare path).
        let mut buf = [IbvWc::default(); MOVE_BATCH];
        loop {
            // SAFETY: the dedicated CQ is alive while registered; `buf` has room.
            let r = unsafe {
                (self.poll)(
                    self.dedicated as *mut IbvCq,
                    MOVE_BATCH as c_int,
                    buf.as_mut_ptr(),
                )
            };
            inner.ring.extend(
                buf[..r.max(0) as usize]
                    .iter()
                    .map(|w| Moved::unfollowed(*w)),
            );
            if r < MOVE_BATCH as c_int {
                break;
            }
        }
        inner.ring.push_back(Moved::unfollowed(wc));
        let raise = inner.armed;
        inner.armed = false;
        drop(inner);
        if let (true, Some(ch)) = (raise, &self.channel) {
            ch.raise(self.app);
        }
    }

    /// `ibv_req_notify_cq` on the application's CQ.
    pub fn arm(&self, solicited_only: c_int) -> c_int {
        let Some(notify) = self.notify else {
            return libc::EOPNOTSUPP;
        };
        let backlog = {
            let mut inner = self.inner.lock();
            inner.armed = true;
            inner.backlog
        };
        // Outside the lock: arming may cost the provider a round trip. The application's
        // own CQ is armed too: completions of QPs the shim did not bind (XRC SRQs' CQ,
        // `ibv_create_wq`) arrive there, and its events come on the same real channel.
        // SAFETY: both CQs are alive while `self` is registered.
        let rc = unsafe {
            match notify(self.dedicated as *mut IbvCq, solicited_only) {
                0 => notify(self.app as *mut IbvCq, solicited_only),
                e => e,
            }
        };
        if rc != 0 {
            self.inner.lock().armed = false;
            return rc;
        }
        if backlog && self.channel.is_some() {
            if let Some(me) = owner(self.app) {
                defer(limits::now_ps(), me);
            }
        }
        0
    }

    /// Moves what the grant admits from the dedicated CQ into the ring, marked `followed`
    /// or not; `Err(wait_ps)` when it admits nothing yet.
    fn refill(&self, inner: &mut Inner, followed: bool) -> Result<usize, u64> {
        let room = self.capacity.load(Relaxed).saturating_sub(inner.ring.len()) as u64;
        let now = limits::now_ps();
        let allow = limits::completion_allowance(now, room.min(MOVE_BATCH as u64))?;
        if allow == 0 {
            return Ok(0);
        }
        let mut buf = [IbvWc::default(); MOVE_BATCH];
        // SAFETY: the dedicated CQ is alive while registered; `buf` has room for `allow`.
        let r = unsafe {
            (self.poll)(
                self.dedicated as *mut IbvCq,
                allow as c_int,
                buf.as_mut_ptr(),
            )
        };
        let mut r = r.max(0) as usize;
        if r < allow as usize {
            // Then those that reach the application's own CQ directly (see `poll`).
            // SAFETY: the application's CQ is alive while `self` is registered; `buf` has
            // room for `allow - r` more.
            let more = unsafe {
                (self.poll)(
                    self.app as *mut IbvCq,
                    (allow as usize - r) as c_int,
                    buf[r..].as_mut_ptr(),
                )
            };
            r += more.max(0) as usize;
        }
        limits::consume_completions(now, r as u64);
        inner.ring.extend(buf[..r].iter().map(|w| Moved {
            followed,
            ..Moved::unfollowed(*w)
        }));
        inner.backlog = r as u64 == allow;
        Ok(r)
    }

    /// A real event for one of this virtual CQ's two CQs was taken by the application,
    /// which gets it at once: a readable channel must yield an event. Under a polling grant
    /// its completions move into the ring as far as the grant admits; what it holds back is
    /// announced by a later event once admitted (the application re-arms after each event).
    fn take_event(&self) {
        let mut inner = self.inner.lock();
        inner.armed = false;
        if limits::completions_metered() && self.refill(&mut inner, false).is_err() {
            inner.backlog = true;
        }
    }

    /// The deferred look at an armed virtual CQ whose completions the grant held back:
    /// raises the application's event once it has moved some.
    fn examine(self: &Arc<Self>) {
        let mut inner = self.inner.lock();
        if !inner.armed {
            return;
        }
        // What is in the ring now has had no event: the engine thread may have moved the
        // held-back completions before this look.
        let moved = self.refill(&mut inner, false);
        if inner.ring.is_empty() {
            drop(inner);
            if let Err(wait) = moved {
                defer(limits::now_ps() + wait, self.clone());
            }
            return;
        }
        inner.armed = false;
        drop(inner);
        if let Some(ch) = &self.channel {
            ch.raise(self.app);
            DELAYED_EVENTS.fetch_add(1, Relaxed);
        }
    }

    /// The engine thread's pass over this virtual CQ (see [`harvest`]): moves what the
    /// grant admits into the ring, marked followed, and returns it to be followed.
    fn collect(&self) -> Vec<IbvWc> {
        let Some(mut inner) = self.inner.try_lock() else {
            // The application is polling it at this moment.
            return Vec::new();
        };
        let before = inner.ring.len();
        if self.extended {
            self.collect_ex(&mut inner);
        } else {
            while matches!(self.refill(&mut inner, true), Ok(r) if r > 0 && inner.backlog) {}
        }
        inner.ring.iter().skip(before).map(|m| m.wc).collect()
    }

    /// [`collect`](Self::collect) for an `ibv_cq_ex`: a poll of the dedicated CQ of its own,
    /// every field read while it is current, timestamps included.
    fn collect_ex(&self, inner: &mut Inner) {
        if inner.dedicated_polling {
            // The application's own poll of the dedicated CQ is open.
            return;
        }
        let room = self.capacity.load(Relaxed).saturating_sub(inner.ring.len()) as u64;
        let now = limits::now_ps();
        let allow = match limits::completion_allowance(now, room.min(MOVE_BATCH as u64)) {
            Ok(a) if a > 0 => a,
            _ => return,
        };
        let ded = self.dedicated as *mut IbvCq;
        // `struct ibv_poll_cq_attr` with no comp_mask.
        let mut attr = 0u32;
        // SAFETY: our dedicated `ibv_cq_ex`, alive while `self` is registered, no poll of it
        // open; a poll started is ended below.
        let mut rc = unsafe { crate::cq_ex::start_poll(ded, (&mut attr as *mut u32).cast()) };
        if rc != 0 {
            return;
        }
        let mut moved = 0;
        while rc == 0 {
            // SAFETY: the poll just gave a current completion.
            let m = unsafe { crate::cq_ex::read_all(ded) };
            inner.ring.push_back(Moved {
                followed: true,
                ..m
            });
            moved += 1;
            if moved == allow {
                break;
            }
            // SAFETY: the poll is open.
            rc = unsafe { crate::cq_ex::next_poll(ded) };
        }
        // SAFETY: the poll started above.
        unsafe { crate::cq_ex::end_poll(ded) };
        limits::consume_completions(now, moved);
        inner.backlog = moved == allow;
    }
}

/// Completions moved into a ring at once.
const MOVE_BATCH: usize = 64;

/// How long an application must have left a virtual CQ alone before the engine thread
/// collects it: a poller that is there takes its completions itself.
const LEFT_ALONE_PS: u64 = 2_000_000_000;

/// The engine thread's collection has failed once: applications' polls collect alone.
static HARVEST_OFF: AtomicBool = AtomicBool::new(false);

/// The engine thread's pass over every virtual CQ that its application has not polled for
/// [`LEFT_ALONE_PS`]: moves what the polling grant admits from the dedicated CQ (and from
/// the application's own, for what reaches it directly) into the ring and follows it at
/// once, so that the gate hands slots on, and the agent's counters see completions, while
/// the application is not polling. A polling application moves its completions itself: no
/// thread hop on a busy poller's path, and no contention for its CQs.
///
/// Called with the cold lock held, which keeps the contexts open.
pub fn harvest() {
    if HARVEST_OFF.load(Relaxed) || LIVE.load(Relaxed) == 0 {
        return;
    }
    let pass = catch_unwind(std::panic::AssertUnwindSafe(|| {
        let all: Vec<Arc<Vcq>> = match REG.lock().as_ref() {
            Some(m) => m
                .iter()
                .filter(|(k, v)| **k == v.app)
                .map(|(_, v)| v.clone())
                .collect(),
            None => return,
        };
        let now = limits::now_ps();
        for v in all {
            if !v.left_alone(now) {
                continue;
            }
            // A context closed with its CQs still alive: they are not to be touched.
            if let Some(st) = crate::context::lookup(v.ctx as *mut IbvContext) {
                govern::follow(st, &v.collect());
            }
        }
    }));
    if pass.is_err() {
        HARVEST_OFF.store(true, Relaxed);
        warn_once(
            Trouble::Completions,
            "internal error while the engine collected completions; the application's polls \
             collect them from now on",
        );
    }
}

/// The virtual CQs holding completions the application has not taken yet: `app CQ: moved
/// in the ring, backlog left in the dedicated CQ` (a diagnostic; a CQ whose lock is busy
/// this instant is skipped rather than waited for).
pub fn held_report() -> String {
    let Some(reg) = REG.try_lock() else {
        return "virtual CQs busy".into();
    };
    let all: Vec<Arc<Vcq>> = reg.as_ref().map_or_else(Vec::new, |m| {
        m.iter()
            .filter(|(k, v)| **k == v.app)
            .map(|(_, v)| v.clone())
            .collect()
    });
    drop(reg);
    let held: Vec<String> = all
        .iter()
        .filter_map(|v| {
            let i = v.inner.try_lock()?;
            (!i.ring.is_empty() || i.backlog)
                .then(|| format!("{:#x}: ring={} backlog={}", v.app, i.ring.len(), i.backlog))
        })
        .collect();
    format!("{} virtual CQs, holding: [{}]", all.len(), held.join(", "))
}

fn defer(when: u64, v: Arc<Vcq>) {
    let ch = v.channel.clone();
    {
        let mut d = DEFERRED.lock();
        match d.iter_mut().find(|(_, x)| Arc::ptr_eq(x, &v)) {
            Some(e) => e.0 = e.0.min(when),
            None => d.push((when, v)),
        }
    }
    if let Some(ch) = ch {
        ch.refresh_timer();
    }
}

/// Looks at every deferred virtual CQ that is due.
fn run_due() {
    let now = limits::now_ps();
    let due: Vec<Arc<Vcq>> = {
        let mut d = DEFERRED.lock();
        let (due, keep): (Vec<_>, Vec<_>) = d.drain(..).partition(|(t, _)| *t <= now);
        *d = keep;
        due.into_iter().map(|(_, v)| v).collect()
    };
    for v in due {
        v.examine();
    }
}

#[cfg(test)]
mod tests;
