//! The extended verbs: `ibv_create_cq_ex` (whose completions are read with
//! `ibv_start_poll`/`ibv_next_poll` through the CQ's own function pointers),
//! `ibv_create_qp_ex`, and `ibv_qp_to_qp_ex` (whose `ibv_wr_*` posts go through the QP's
//! own pointers). A QP from `ibv_create_qp_ex` is bound and recorded as `ibv_create_qp`
//! does, and its `ibv_wr_*` pointers are wrapped (`wr_api`). A CQ from `ibv_create_cq_ex`
//! is not virtual; rather than let such an application look governed, the shim reports it
//! (once on stderr, and counted in the summary).
//!
//! The first two are reached through `struct verbs_context`, which sits *before*
//! `struct ibv_context` and exists only when `ctx->abi_compat == __VERBS_ABI_IS_EXTENDED`;
//! an op exists only within the size the provider recorded in `vctx->sz` (libibverbs'
//! own `verbs_get_ctx_op` rule). The shim wraps the two creation ops there.

use crate::context::{lookup, ExtOrig};
use crate::ffi::{
    CreateCqExFn, CreateQpExFn, IbvCompChannel, IbvContext, IbvCq, IbvCqInitAttrEx, IbvQp,
    IbvQpInitAttr, CREATE_CQ_EX_BACK, CREATE_QP_EX_BACK, SZ_BACK,
};
use crate::trouble::{warn_once, Trouble};
use libc::c_void;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// `IBV_CQ_INIT_ATTR_MASK_PD`: the CQ belongs to a parent domain.
const CQ_INIT_ATTR_MASK_PD: u32 = 1 << 1;

/// Extended objects the application created (each bypasses the shim).
pub static USES: AtomicU64 = AtomicU64::new(0);

/// Where the `verbs_context` op `back` bytes before `ctx` lives, if this context has it.
///
/// # Safety
/// `ctx` is a valid open context.
unsafe fn op_slot(ctx: *mut IbvContext, back: usize) -> Option<*mut usize> {
    // SAFETY: a valid context's field.
    if unsafe { (*ctx).abi_compat } as usize != usize::MAX {
        return None;
    }
    // SAFETY: an extended context is preceded by its verbs_context, whose `sz` is there.
    let sz = unsafe { *((ctx as *const u8).sub(SZ_BACK) as *const usize) };
    if sz < back + std::mem::size_of::<IbvContext>() {
        return None;
    }
    // SAFETY: within the verbs_context the provider allocated (checked against `sz`).
    Some(unsafe { (ctx as *mut u8).sub(back) } as *mut usize)
}

/// Swaps the creation ops of an extended context for reporting wrappers.
///
/// # Safety
/// `ctx` is a valid open context no other thread uses yet.
pub unsafe fn install(ctx: *mut IbvContext) -> ExtOrig {
    let mut o = ExtOrig::default();
    // SAFETY: per the contract.
    if let Some(p) = unsafe { op_slot(ctx, CREATE_CQ_EX_BACK) } {
        // SAFETY: the op slot holds a function pointer (or 0).
        let f = unsafe { *p };
        if f != 0 && f != drum_create_cq_ex as *const () as usize {
            // SAFETY: a non-null op of this type.
            o.create_cq_ex = Some(unsafe { std::mem::transmute::<usize, CreateCqExFn>(f) });
            // SAFETY: as above.
            unsafe { *p = drum_create_cq_ex as *const () as usize };
        }
    }
    // SAFETY: per the contract.
    if let Some(p) = unsafe { op_slot(ctx, CREATE_QP_EX_BACK) } {
        // SAFETY: as above.
        let f = unsafe { *p };
        if f != 0 && f != drum_create_qp_ex as *const () as usize {
            // SAFETY: as above.
            o.create_qp_ex = Some(unsafe { std::mem::transmute::<usize, CreateQpExFn>(f) });
            // SAFETY: as above.
            unsafe { *p = drum_create_qp_ex as *const () as usize };
        }
    }
    o
}

/// Puts the original ops back.
///
/// # Safety
/// `ctx` is the valid context `o` was taken from, no longer used by other threads.
pub unsafe fn uninstall(ctx: *mut IbvContext, o: &ExtOrig) {
    // SAFETY: `ctx` is the caller's valid context (this function's contract).
    if let (Some(f), Some(p)) = (o.create_cq_ex, unsafe { op_slot(ctx, CREATE_CQ_EX_BACK) }) {
        // SAFETY: the slot we swapped.
        unsafe { *p = f as usize };
    }
    // SAFETY: as above.
    if let (Some(f), Some(p)) = (o.create_qp_ex, unsafe { op_slot(ctx, CREATE_QP_EX_BACK) }) {
        // SAFETY: the slot we swapped.
        unsafe { *p = f as usize };
    }
}

fn note(what: &str) {
    USES.fetch_add(1, Relaxed);
    warn_once(
        Trouble::Extended,
        &format!(
            "the application uses {what}, which bypasses the shim: that traffic is not governed"
        ),
    );
}

unsafe extern "C" fn drum_create_cq_ex(ctx: *mut IbvContext, attr: *mut c_void) -> *mut c_void {
    let Some(f) = lookup(ctx).and_then(|st| st.ext.create_cq_ex) else {
        return std::ptr::null_mut();
    };
    if attr.is_null() {
        // SAFETY: forwarding unchanged; the provider refuses it.
        return unsafe { f(ctx, attr) };
    }
    let a = attr.cast::<IbvCqInitAttrEx>();
    // The application's channel is the shim's: the provider must see the real one behind
    // it (whose events the shim's `ibv_get_cq_event` hands on).
    // SAFETY: the caller's attributes.
    let app_ch = unsafe { (*a).channel }.cast::<IbvCompChannel>();
    let real = crate::vcq::real_channel(app_ch);
    // A parent domain's CQ is the domain's business: not made virtual.
    // SAFETY: as above.
    let plain = unsafe { (*a).comp_mask } & CQ_INIT_ATTR_MASK_PD == 0;
    // The dedicated CQ reads every plain field (see `cq_ex::STANDARD_FLAGS`), or at least
    // the QP number where the provider has no reader for some of them.
    let dedicated_flags = [crate::cq_ex::STANDARD_FLAGS, crate::cq_ex::WITH_QP_NUM];
    let make = |app: bool| -> *mut IbvCq {
        // SAFETY: the caller's attributes; a copy for the dedicated CQ.
        let mut mine = unsafe { std::ptr::read(a) };
        let create = |target: *mut IbvCqInitAttrEx| {
            if let Some(r) = real {
                // SAFETY: as above; the application's copy is restored below.
                unsafe { (*target).channel = r.cast() };
            }
            // SAFETY: forwarding to the provider's op.
            let cq = unsafe { f(ctx, target.cast()) }.cast::<IbvCq>();
            // SAFETY: as above.
            unsafe { (*a).channel = app_ch.cast() };
            cq
        };
        if app {
            return create(a);
        }
        mine.cq_context = std::ptr::null_mut();
        let wanted = mine.wc_flags;
        dedicated_flags
            .iter()
            .map(|more| {
                mine.wc_flags = wanted | more;
                create(&mut mine)
            })
            .find(|cq| !cq.is_null())
            .unwrap_or(std::ptr::null_mut())
    };
    let cq = if plain {
        // SAFETY: `make` creates CQs on `ctx` on the real channel behind `app_ch`.
        let (cq, adopted) = unsafe { crate::vcq::create_cq_ex(ctx, app_ch, make) };
        if adopted {
            // SAFETY: the application's new virtual `ibv_cq_ex`, not handed out yet.
            unsafe { crate::cq_ex_poll::wrap(cq) };
        }
        cq
    } else {
        make(true)
    };
    if !cq.is_null() && crate::vcq::find(cq).is_none() {
        let _ =
            std::panic::catch_unwind(|| note("ibv_create_cq_ex (ibv_start_poll/ibv_next_poll)"));
    }
    cq.cast()
}

unsafe extern "C" fn drum_create_qp_ex(ctx: *mut IbvContext, attr: *mut c_void) -> *mut IbvQp {
    let Some(f) = lookup(ctx).and_then(|st| st.ext.create_qp_ex) else {
        return std::ptr::null_mut();
    };
    // `ibv_qp_init_attr_ex` starts like `ibv_qp_init_attr`: the QP is bound to the
    // dedicated CQs as `ibv_create_qp` binds it.
    let attr_cqs = attr as *mut IbvQpInitAttr;
    // SAFETY: the caller's attributes.
    let app_cqs = unsafe { crate::vcq::bind_dedicated(attr_cqs) };
    // SAFETY: forwarding to the provider's op.
    let qp = unsafe { f(ctx, attr) };
    // SAFETY: as above.
    unsafe { crate::vcq::unbind(attr_cqs, app_cqs) };
    // Its `ibv_post_send` goes through `ctx->ops` and its `ibv_wr_*` through `wr_api`: it is
    // governed as a QP from `ibv_create_qp` is.
    // SAFETY: the QP just created from the caller's attributes.
    unsafe { crate::qp_verbs::new_qp(qp, attr_cqs) };
    qp
}

/// Interposes `ibv_qp_to_qp_ex`: an application that gets the `ibv_wr_*` interface of a
/// QP posts around `ctx->ops`.
///
/// # Safety
/// Called by C code with the real function's argument.
#[no_mangle]
pub unsafe extern "C" fn ibv_qp_to_qp_ex(qp: *mut IbvQp) -> *mut c_void {
    let Some(f) = crate::real::QP_TO_QP_EX.get() else {
        return std::ptr::null_mut();
    };
    // SAFETY: the real function has this signature; forwarding unchanged.
    let r = unsafe { f(qp) };
    if !r.is_null() {
        let _ = std::panic::catch_unwind(|| {
            // SAFETY: the `ibv_qp_ex` of the application's live QP.
            if !unsafe { crate::wr_api::wrap(r.cast()) } {
                note("ibv_qp_to_qp_ex (ibv_wr_* posting)");
            }
        });
    }
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[repr(C)]
    struct FakeExtended {
        before: [usize; 40], // 320 bytes: the verbs_context part before the context
        ctx: IbvContext,
    }

    static MADE: AtomicU64 = AtomicU64::new(0);

    unsafe extern "C" fn fake_cq_ex(_: *mut IbvContext, _: *mut c_void) -> *mut c_void {
        MADE.fetch_add(1, Relaxed);
        8 as *mut c_void
    }

    /// An extended context's create_cq_ex is wrapped, its use reported and counted, and
    /// the original restored; a context that is too small for the op is left alone.
    #[test]
    fn extended_creation_ops_are_wrapped_reported_and_restored() {
        // SAFETY: plain C data; all-zero is valid.
        let mut f: Box<FakeExtended> = Box::new(unsafe { std::mem::zeroed() });
        let ctx: *mut IbvContext = &mut f.ctx;
        f.ctx.abi_compat = usize::MAX as *mut c_void;
        let sz_idx = 40 - SZ_BACK / 8;
        let cq_idx = 40 - CREATE_CQ_EX_BACK / 8;
        f.before[sz_idx] = 320 + std::mem::size_of::<IbvContext>();
        f.before[cq_idx] = fake_cq_ex as *const () as usize;
        // SAFETY: the fake context is valid and ours.
        let o = unsafe { install(ctx) };
        assert_eq!(f.before[cq_idx], drum_create_cq_ex as *const () as usize);
        assert!(o.create_qp_ex.is_none(), "a null op stays null");
        // The wrapper needs the context's state: call the original through `o` as it would.
        let before = USES.load(Relaxed);
        // SAFETY: the fake op ignores its arguments.
        let r = unsafe { o.create_cq_ex.unwrap()(ctx, std::ptr::null_mut()) };
        assert!(!r.is_null() && MADE.load(Relaxed) == 1);
        note("test");
        assert_eq!(USES.load(Relaxed), before + 1);
        // SAFETY: as above.
        unsafe { uninstall(ctx, &o) };
        assert_eq!(f.before[cq_idx], fake_cq_ex as *const () as usize);

        f.before[sz_idx] = 100 + std::mem::size_of::<IbvContext>();
        // SAFETY: as above.
        let o = unsafe { install(ctx) };
        assert!(o.create_cq_ex.is_none(), "op beyond the recorded size");
        assert_eq!(f.before[cq_idx], fake_cq_ex as *const () as usize);
    }
}
