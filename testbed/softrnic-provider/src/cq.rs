//! CQs: creation on a completion channel, polling the completion ring (or the engine), arming.

use super::*;

/// CLOCK_MONOTONIC_COARSE in milliseconds (a vDSO read, no system call).
pub(super) fn coarse_ms() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: t is a valid out-parameter.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC_COARSE, &mut t) };
    t.tv_sec as u64 * 1000 + t.tv_nsec as u64 / 1_000_000
}

pub(super) unsafe extern "C" fn create_cq(
    ctx: *mut IbvContext,
    cqe: c_int,
    channel: *mut c_void,
    comp_vector: c_int,
) -> *mut IbvCq {
    guard(null_mut(), || {
        // SAFETY: ctx is ours; alloc_context set num_comp_vectors.
        let vectors = unsafe { (*ctx).num_comp_vectors };
        if !(0..vectors).contains(&comp_vector) {
            // As the kernel's CREATE_CQ refuses a vector the device does not have.
            set_errno(libc::EINVAL);
            return null_mut();
        }
        let channel_id = if channel.is_null() {
            0
        } else {
            match channel_id(channel) {
                Some(id) => id,
                None => {
                    // Not made by our ibv_create_comp_channel (is the library preloaded?).
                    set_errno(libc::EINVAL);
                    return null_mut();
                }
            }
        };
        if cqe < 1 {
            set_errno(libc::EINVAL);
            return null_mut();
        }
        // SAFETY: ctx is ours.
        let st = unsafe { state(ctx) };
        let cq = Box::into_raw(Box::new(SrCq {
            // SAFETY: ibv_cq is plain C data; all-zero is a valid initial state for its
            // pointers, counters, and glibc's pthread mutex/cond (static initialisers are
            // all-zero). libibverbs' verbs_init_cq fills the rest.
            cq: unsafe { std::mem::zeroed::<IbvCq>() },
            // SAFETY: all-zero is valid: no ops, no current completion.
            ex: unsafe { std::mem::zeroed::<CqExTail>() },
            cur: Mutex::default(),
            ring: None,
            poll: Mutex::new(()),
            empty: std::sync::atomic::AtomicU32::new(0),
            checked_ms: std::sync::atomic::AtomicU64::new(coarse_ms()),
        })) as *mut IbvCq;
        let req = Req::CreateCq {
            cqe: cqe as u32,
            channel: channel_id,
            user: cq as u64,
        };
        let fail = |e| {
            // SAFETY: allocated just above and not handed out.
            drop(unsafe { Box::from_raw(cq as *mut SrCq) });
            set_errno(e);
            null_mut()
        };
        match st.call(&req) {
            Ok(Resp::Cq { handle, cqe }) => {
                // SAFETY: cq is a valid, exclusively owned allocation.
                unsafe {
                    (*cq).context = ctx;
                    (*cq).handle = handle;
                    (*cq).cqe = cqe as c_int;
                    if let Some(m) = share_ring(st, 0, handle, ring::cq_len(cqe)) {
                        (*(cq as *mut SrCq)).ring = Some((
                            m,
                            Ring {
                                off: 0,
                                n: cqe,
                                slot: ring::WC_SIZE,
                            },
                        ));
                    }
                }
                cq
            }
            Ok(_) => fail(libc::EIO),
            Err(e) => fail(e),
        }
    })
}

pub(super) unsafe extern "C" fn destroy_cq(cq: *mut IbvCq) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: cq was made by create_cq.
        let (st, h) = unsafe { (state((*cq).context), (*cq).handle) };
        match st.call(&Req::DestroyCq { cq: h }) {
            Ok(r) => {
                // SAFETY: cq is live until freed below; its fields are libibverbs'.
                unsafe {
                    let c = &mut *cq;
                    settle_events(
                        c.context,
                        r,
                        &mut c.mutex,
                        &mut c.cond,
                        &c.async_events_completed,
                    );
                }
                // SAFETY: allocated by create_cq as a boxed SrCq.
                drop(unsafe { Box::from_raw(cq as *mut SrCq) });
                0
            }
            Err(e) => e,
        }
    })
}

pub(super) unsafe extern "C" fn poll_cq(cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
    guard(-1, || {
        if n <= 0 {
            return 0;
        }
        // SAFETY: cq was made by create_cq, as an SrCq.
        let sr = unsafe { &*(cq as *const SrCq) };
        if let Some((m, r)) = &sr.ring {
            // Local memory only: copy what the engine published, then release the slots.
            let _g = sr.poll.lock().unwrap_or_else(|p| p.into_inner());
            let cons = r.cons(m).load(Ordering::Relaxed);
            let prod = r.prod(m).load(Ordering::Acquire);
            let k = prod.wrapping_sub(cons).min(r.n).min(n as u32);
            let mut b = [0u8; ring::WC_SIZE];
            for i in 0..k {
                m.read(r.slot_off(cons.wrapping_add(i)), &mut b);
                // SAFETY: the caller provides n >= k writable ibv_wc entries at wc.
                unsafe { wc.add(i as usize).write(ring::wc_from(&b)) };
            }
            r.cons(m).store(cons.wrapping_add(k), Ordering::Release);
            if k == 0 {
                // The "NIC" is threads of the engine process sharing these CPUs: a program
                // spinning on an empty CQ gives them the CPU (a real NIC needs none).
                // SAFETY: sched_yield has no preconditions.
                unsafe { libc::sched_yield() };
                // Every 64 empty polls, and at most every 200 ms, check that the engine is
                // still there.
                let e = sr.empty.fetch_add(1, Ordering::Relaxed);
                if e % 64 == 63 {
                    let now = coarse_ms();
                    if now.saturating_sub(sr.checked_ms.load(Ordering::Relaxed)) >= 200 {
                        sr.checked_ms.store(now, Ordering::Relaxed);
                        // SAFETY: cq was made by create_cq; its context is ours.
                        if !unsafe { state((*cq).context) }.engine_alive() {
                            return -1;
                        }
                    }
                }
            } else {
                sr.empty.store(0, Ordering::Relaxed);
            }
            return k as c_int;
        }
        // SAFETY: cq was made by create_cq.
        let (st, h) = unsafe { (state((*cq).context), (*cq).handle) };
        match st.call(&Req::PollCq {
            cq: h,
            max: n as u32,
        }) {
            Ok(Resp::Wcs(v)) => {
                let k = v.len().min(n as usize);
                // SAFETY: the caller provides n writable ibv_wc entries at wc.
                unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), wc, k) };
                k as c_int
            }
            _ => -1,
        }
    })
}

pub(super) unsafe extern "C" fn req_notify_cq(cq: *mut IbvCq, solicited_only: c_int) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: cq was made by create_cq.
        if unsafe { (*cq).channel.is_null() } {
            // Arming a CQ without a completion channel has no observable effect.
            return 0;
        }
        // SAFETY: cq was made by create_cq, as an SrCq.
        if let Some((m, r)) = &unsafe { &*(cq as *const SrCq) }.ring {
            // Widening a solicited-only arming to any completion, never narrowing it.
            let arm = r.arm(m);
            if solicited_only == 0 {
                arm.store(ring::ARM_ANY, Ordering::SeqCst);
            } else {
                let _ = arm.compare_exchange(
                    0,
                    ring::ARM_SOLICITED,
                    Ordering::SeqCst,
                    Ordering::SeqCst,
                );
            }
            // Pairs with the engine's fence after publishing a completion (see `ring`).
            std::sync::atomic::fence(Ordering::SeqCst);
            return 0;
        }
        // SAFETY: cq was made by create_cq.
        let (st, h) = unsafe { (state((*cq).context), (*cq).handle) };
        match st.call(&Req::ReqNotifyCq {
            cq: h,
            solicited_only: solicited_only != 0,
        }) {
            Ok(_) => 0,
            Err(e) => e,
        }
    })
}
