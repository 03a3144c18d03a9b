//! `libdrum_shim.so`: DRUM's data-plane shim, loaded into unmodified verbs applications with
//! `LD_PRELOAD`.
//!
//! The data-path verbs (`ibv_post_send`, `ibv_post_recv`, `ibv_post_srq_recv`, `ibv_poll_cq`,
//! `ibv_req_notify_cq`) are `static inline` in `<infiniband/verbs.h>` and call through
//! `ctx->ops`, so no symbol of theirs can be interposed. The shim instead exports the
//! (unversioned) `ibv_open_device` and `ibv_close_device`, which bind the application's
//! versioned references; it forwards to the real ones found with
//! `dlvsym(RTLD_NEXT, name, "IBVERBS_1.1")` and swaps the governed op pointers of every
//! context returned. The originals live in a per-context entry that is immutable once
//! published; the data path finds it with atomic loads only (`context::lookup`).
//!
//! Failure policy: nothing may unwind into C and nothing may crash the application. Every
//! entry point runs its own logic under `catch_unwind`; on trouble the context (or the
//! counting) falls back to pass-through and one line on stderr says so.
//!
//! It counts (WQEs, bytes, completions per context and QP), registers with the host's
//! `drum-agent` and enforces its grant (`govern`, `engine`): byte and WQE rates, top-k QP
//! gating, per-receiver caps. See docs/shim.md.
//!
//! The modules form layers, each using only those below it (no import cycle:
//! `scripts/shim-module-cycles.py`), from the application's call down to the NIC:
//!
//! * entry points: this root (open/close a device, fork handlers), `dl` (`dlsym`),
//!   `qp_verbs`, `cq_verbs`, `extended`, `wr_api` (`ibv_wr_*`), `direct` (`mlx5dv`),
//!   `summary` (exit line), and `engine`, the thread that talks to the agent;
//! * the governed ops in `ctx->ops` (`ops`) and an `ibv_cq_ex`'s polling pointers
//!   (`cq_ex_poll`);
//! * `drain`: serving the software send queues (the engine's passes, an empty poll's help);
//! * `vcq`: the virtual CQs, over the provider's `ibv_cq_ex` pointers (`cq_ex`);
//! * `govern`: a post admitted or queued, completions followed, the gate, the pending list
//!   and the agent's events;
//! * state: `context` (the contexts' slots, the cold lock, totals), `qp` (each QP's record),
//!   `counters`, `stats`, `wr_batch`, `wake` (the engine thread's handle);
//! * limits and leaves: `limits` (the grant's limits, admission against them), `cap_route`
//!   (each QP's way to its peer's cap without the caps' lock), the pure `peer_caps`, `gate`,
//!   `inflight`, `pacer`, `nic_pace`, and `sendq`, `link`, `ffi`, `real`, `trouble`, `spin`.

mod cap_route;
mod context;
pub mod counters;
mod cq_ex;
mod cq_ex_poll;
mod cq_verbs;
mod direct;
#[cfg(target_arch = "x86_64")]
mod dl;
mod drain;
mod engine;
pub mod extended;
pub mod ffi;
pub mod gate;
mod govern;
pub mod inflight;
mod limits;
mod link;
pub mod nic_pace;
mod nic_table;
mod ops;
pub mod pacer;
mod peer_caps;
mod qp;
mod qp_verbs;
mod real;
pub mod sendq;
mod spin;
mod stats;
mod summary;
mod trouble;
pub(crate) mod vcq;
mod wake;
mod wr_api;
mod wr_batch;

pub use context::{qp_bytes, totals, with_qps, Totals};
use context::{
    ContextState, Orig, CLOSED, CLOSED_QPS, COLD, GOVERNED, HIGH, PASS_THROUGH, QPS_PER_CONTEXT,
    SLOTS,
};
use counters::Counters;
pub use cq_verbs::*;
use ffi::*;
use libc::{c_int, c_void};
use ops::{drum_poll_cq, drum_post_recv, drum_post_send, drum_post_srq_recv, drum_req_notify_cq};
use qp::QpTable;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::ptr;
use std::sync::atomic::Ordering::{Acquire, Relaxed, Release};
pub use summary::summary_line;
use trouble::{set_errno, warn_once, Trouble};

/// Every lock a forking thread must hold across `fork`, in the order they are taken.
extern "C" fn fork_prepare() {
    COLD.acquire();
    wake::lock_for_fork();
    govern::lock_for_fork();
    vcq::lock_for_fork();
}

extern "C" fn fork_release() {
    vcq::unlock_after_fork();
    govern::unlock_after_fork();
    wake::unlock_after_fork();
    COLD.release();
}

extern "C" fn at_load() {
    // SAFETY: registers plain functions that only touch atomics; no unwinding possible.
    unsafe { libc::pthread_atfork(Some(fork_prepare), Some(fork_release), Some(fork_release)) };
}

/// Runs when the library is loaded, before the application's `main`.
#[used]
#[link_section = ".init_array"]
static INIT: extern "C" fn() = at_load;

// ---------------------------------------------------------------------------------------------
// Exported entry points
// ---------------------------------------------------------------------------------------------

/// Interposes libibverbs' `ibv_open_device`: opens through the real one, then governs the
/// returned context (or leaves it pass-through and says why).
///
/// # Safety
/// Called by C code with a device from `ibv_get_device_list`, as the real function is.
#[no_mangle]
pub unsafe extern "C" fn ibv_open_device(device: *mut c_void) -> *mut IbvContext {
    let Some(real) = real::OPEN_DEVICE.optional() else {
        warn_once(
            Trouble::NoRealSymbol,
            "libibverbs' ibv_open_device not found (libibverbs.so.1 cannot be loaded); no device opened",
        );
        set_errno(libc::ENOSYS);
        return ptr::null_mut();
    };
    // SAFETY: forwarding the caller's argument unchanged.
    let ctx = unsafe { real(device) };
    if ctx.is_null() {
        return ctx;
    }
    match catch_unwind(AssertUnwindSafe(|| {
        // SAFETY: `ctx` was just returned by the real ibv_open_device and is not yet visible
        // to any other thread of the application.
        unsafe { install(ctx) }
    })) {
        Ok(Ok(())) => {
            GOVERNED.fetch_add(1, Relaxed);
            // SAFETY: the device the application opened, from its device list.
            if catch_unwind(|| unsafe { nic_table::watch(device.cast()) }).is_err() {
                warn_once(
                    Trouble::NicTable,
                    "internal error looking for the NIC's AUSS table",
                );
            }
            // Outside the cold lock: the engine's first pass reads the contexts.
            if catch_unwind(engine::ensure_started).is_err() {
                warn_once(Trouble::Engine, "internal error starting the engine thread");
            }
        }
        Ok(Err((kind, why))) => {
            PASS_THROUGH.fetch_add(1, Relaxed);
            warn_once(kind, &format!("{why}; this context runs ungoverned"));
        }
        Err(_) => {
            PASS_THROUGH.fetch_add(1, Relaxed);
            warn_once(
                Trouble::Install,
                "internal error while governing a context; it runs ungoverned",
            );
        }
    }
    ctx
}

/// Interposes `ibv_close_device`: restores the context's original ops, folds its counters
/// into the process totals, then closes through the real function.
///
/// # Safety
/// Called by C code with a context from `ibv_open_device`, as the real function is.
#[no_mangle]
pub unsafe extern "C" fn ibv_close_device(ctx: *mut IbvContext) -> c_int {
    let Some(real) = real::CLOSE_DEVICE.optional() else {
        warn_once(
            Trouble::NoRealSymbol,
            "libibverbs' ibv_close_device not found; context not closed",
        );
        return libc::ENOSYS;
    };
    if !ctx.is_null()
        && catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: `ctx` is an open context the application is closing; no other thread
            // may use it now.
            unsafe { uninstall(ctx) }
        }))
        .is_err()
    {
        warn_once(
            Trouble::Uninstall,
            "internal error while releasing a context",
        );
    }
    // SAFETY: forwarding the caller's argument unchanged.
    let rc = unsafe { real(ctx) };
    if rc != 0 {
        warn_once(
            Trouble::CloseFailed,
            "ibv_close_device failed; that context stays open but ungoverned",
        );
    }
    rc
}

/// Publishes the context's state, then swaps its ops.
///
/// # Safety
/// `ctx` is a valid open context no other thread uses yet.
unsafe fn install(ctx: *mut IbvContext) -> Result<(), (Trouble, &'static str)> {
    let _g = COLD.lock();
    // SAFETY: valid per the contract; `addr_of_mut!` avoids a reference into C memory.
    let ops = unsafe { &mut *ptr::addr_of_mut!((*ctx).ops) };
    let ours = ops.post_send.map(|f| f as usize) == Some(drum_post_send as *const () as usize)
        || ops.poll_cq.map(|f| f as usize) == Some(drum_poll_cq as *const () as usize);
    if ours {
        // Forwarding to ourselves would recurse forever.
        return Err((
            Trouble::AlreadySwapped,
            "context ops already point into the shim (loaded twice?)",
        ));
    }
    let slot = SLOTS
        .iter()
        .position(|s| s.key.load(Relaxed) == 0 && s.state.load(Relaxed).is_null())
        .ok_or((Trouble::TableFull, "more than 64 open contexts"))?;
    let orig = Orig {
        post_send: ops.post_send,
        post_recv: ops.post_recv,
        post_srq_recv: ops.post_srq_recv,
        poll_cq: ops.poll_cq,
        req_notify_cq: ops.req_notify_cq,
    };
    // SAFETY: `ctx` is valid and not yet visible to other threads.
    let ext = unsafe { extended::install(ctx) };
    let state = Box::into_raw(Box::new(ContextState {
        key: ctx as usize,
        index: slot,
        orig,
        ext,
        counters: Counters::new(),
        qps: QpTable::with_capacity(QPS_PER_CONTEXT),
    }));
    SLOTS[slot].state.store(state, Release);
    SLOTS[slot].key.store(ctx as usize, Release);
    HIGH.fetch_max(slot + 1, Release);
    // Only ops that exist are swapped: a wrapper always has an original to forward to.
    if orig.post_send.is_some() {
        ops.post_send = Some(drum_post_send);
    }
    if orig.post_recv.is_some() {
        ops.post_recv = Some(drum_post_recv);
    }
    if orig.post_srq_recv.is_some() {
        ops.post_srq_recv = Some(drum_post_srq_recv);
    }
    if orig.poll_cq.is_some() {
        ops.poll_cq = Some(drum_poll_cq);
    }
    if orig.req_notify_cq.is_some() {
        ops.req_notify_cq = Some(drum_req_notify_cq);
    }
    Ok(())
}

/// Restores the original ops and releases the context's state.
///
/// # Safety
/// `ctx` is a valid open context that no other thread uses any more.
unsafe fn uninstall(ctx: *mut IbvContext) {
    let _g = COLD.lock();
    let Some(slot) = SLOTS.iter().find(|s| s.key.load(Relaxed) == ctx as usize) else {
        return; // a pass-through context
    };
    let p = slot.state.load(Acquire);
    // SAFETY: published by `install` and freed only here, under the same lock.
    let Some(st) = (unsafe { p.as_ref() }) else {
        return;
    };
    // SAFETY: valid per the contract.
    let ops = unsafe { &mut *ptr::addr_of_mut!((*ctx).ops) };
    ops.post_send = st.orig.post_send;
    ops.post_recv = st.orig.post_recv;
    ops.post_srq_recv = st.orig.post_srq_recv;
    ops.poll_cq = st.orig.poll_cq;
    ops.req_notify_cq = st.orig.req_notify_cq;
    // SAFETY: valid per the contract.
    unsafe { extended::uninstall(ctx, &st.ext) };
    slot.key.store(0, Release);
    slot.state.store(ptr::null_mut(), Release);
    CLOSED.add(&st.counters.snapshot());
    CLOSED_QPS.fetch_add(st.qps.entries().len() as u64, Relaxed);
    // SAFETY: `p` came from Box::into_raw in `install`; its key is cleared, so no lookup can
    // reach it any more (a concurrent use of this context would be the app's own bug).
    drop(unsafe { Box::from_raw(p) });
}

#[cfg(test)]
mod tests;
