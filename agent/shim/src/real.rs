//! The real functions the shim wraps, as one typed table: each entry names its symbol once,
//! with its C type, and is resolved once (the version applications link, see
//! [`crate::resolve`]). A caller gets a typed function pointer or `None`, never an address to
//! convert; the exported `dlsym` (`dl.rs`) fills the same entries from a program's handle.

use crate::ffi::*;
use crate::{warn_once, Trouble};
use std::ffi::CStr;
use std::marker::PhantomData;
use std::panic::catch_unwind;
use std::sync::atomic::AtomicUsize;

/// The real function `name` of C type `F`, resolved on first use.
pub(crate) struct RealFn<F> {
    name: &'static CStr,
    addr: AtomicUsize,
    _type: PhantomData<F>,
}

impl<F: Copy> RealFn<F> {
    /// `F` is the C type of `name`, a function pointer (its size is checked when the table
    /// is compiled).
    const fn new(name: &'static CStr) -> Self {
        assert!(
            std::mem::size_of::<F>() == std::mem::size_of::<usize>(),
            "a real function's type must be a function pointer"
        );
        RealFn {
            name,
            addr: AtomicUsize::new(0),
            _type: PhantomData,
        }
    }

    pub(crate) fn name(&self) -> &'static CStr {
        self.name
    }

    /// Where its address is kept once known (0 until then).
    pub(crate) fn cache(&self) -> &AtomicUsize {
        &self.addr
    }

    /// The real function, or `None`, reported once per process.
    pub(crate) fn get(&self) -> Option<F> {
        let f = self.optional();
        if f.is_none() {
            warn_once(
                Trouble::NoRealSymbol,
                &format!("libibverbs' {} not found", self.name.to_string_lossy()),
            );
        }
        f
    }

    /// The real function, or `None` without a word: for a caller that explains the absence
    /// itself, or a library the program may not load at all (libmlx5).
    pub(crate) fn optional(&self) -> Option<F> {
        let (name, addr) = (self.name, &self.addr);
        let p = catch_unwind(|| crate::resolve(name, addr)).unwrap_or(0);
        // SAFETY: `F` is pointer-sized (checked in `new`) and the C type of the symbol the
        // entry names (the table below), whose address `p` is.
        (p != 0).then(|| unsafe { std::mem::transmute_copy::<usize, F>(&p) })
    }
}

pub(crate) static OPEN_DEVICE: RealFn<OpenFn> = RealFn::new(c"ibv_open_device");
pub(crate) static CLOSE_DEVICE: RealFn<CloseFn> = RealFn::new(c"ibv_close_device");
pub(crate) static CREATE_QP: RealFn<CreateQpFn> = RealFn::new(c"ibv_create_qp");
pub(crate) static MODIFY_QP: RealFn<ModifyQpFn> = RealFn::new(c"ibv_modify_qp");
pub(crate) static DESTROY_QP: RealFn<DestroyQpFn> = RealFn::new(c"ibv_destroy_qp");
pub(crate) static QUERY_QP: RealFn<QueryQpFn> = RealFn::new(c"ibv_query_qp");
pub(crate) static QP_TO_QP_EX: RealFn<QpToQpExFn> = RealFn::new(c"ibv_qp_to_qp_ex");
pub(crate) static CREATE_CQ: RealFn<CreateCqFn> = RealFn::new(c"ibv_create_cq");
pub(crate) static DESTROY_CQ: RealFn<DestroyCqFn> = RealFn::new(c"ibv_destroy_cq");
pub(crate) static RESIZE_CQ: RealFn<ResizeCqFn> = RealFn::new(c"ibv_resize_cq");
pub(crate) static CREATE_CHANNEL: RealFn<CreateChannelFn> = RealFn::new(c"ibv_create_comp_channel");
pub(crate) static DESTROY_CHANNEL: RealFn<DestroyChannelFn> =
    RealFn::new(c"ibv_destroy_comp_channel");
pub(crate) static GET_CQ_EVENT: RealFn<GetCqEventFn> = RealFn::new(c"ibv_get_cq_event");
pub(crate) static ACK_CQ_EVENTS: RealFn<AckCqEventsFn> = RealFn::new(c"ibv_ack_cq_events");
pub(crate) static GET_ASYNC_EVENT: RealFn<GetAsyncEventFn> = RealFn::new(c"ibv_get_async_event");
pub(crate) static ACK_ASYNC_EVENT: RealFn<AckAsyncEventFn> = RealFn::new(c"ibv_ack_async_event");
/// libmlx5's, for direct verbs (`direct.rs`).
pub(crate) static MLX5DV_INIT_OBJ: RealFn<InitObjFn> = RealFn::new(c"mlx5dv_init_obj");
