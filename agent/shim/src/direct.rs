//! Direct verbs (`mlx5dv`): a program that asks for the hardware queues of a QP or CQ with
//! `mlx5dv_init_obj` then posts and polls them itself, past `ctx->ops` and so past the shim.
//! That cannot be governed; the shim exports `mlx5dv_init_obj` to say so (once, and counted
//! as `extended_verbs`), publishes how many queues were asked for in its table
//! (`direct_verbs_queues`: the agent reports the process as partly ungoverned) and forwards
//! the call unchanged. Queues count when asked for, before the provider answers: a program
//! that would take them is reported wherever it runs, also where the provider refuses (no
//! libmlx5, another NIC). Other providers' direct verbs are not detected.

use crate::extended;
use crate::trouble::{warn_once, Trouble};
use libc::{c_int, c_void};
use std::panic::catch_unwind;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

/// Queues asked for so far: one per queue object type of each call.
pub(crate) static QUEUES_TAKEN: AtomicU64 = AtomicU64::new(0);

/// `MLX5DV_OBJ_QP | MLX5DV_OBJ_CQ | MLX5DV_OBJ_SRQ | MLX5DV_OBJ_RWQ`: the objects whose
/// queues a program can then work directly.
const QUEUES: u64 = 0b1111;

/// Interposes `mlx5dv_init_obj`: reported when it hands out queues, then forwarded.
///
/// # Safety
/// Called by C code with the real function's arguments.
#[no_mangle]
pub unsafe extern "C" fn mlx5dv_init_obj(obj: *mut c_void, obj_type: u64) -> c_int {
    let queues = (obj_type & QUEUES).count_ones();
    if queues != 0 {
        let _ = catch_unwind(|| {
            extended::USES.fetch_add(1, Relaxed);
            QUEUES_TAKEN.fetch_add(u64::from(queues), Relaxed);
            warn_once(
                Trouble::DirectVerbs,
                "the application takes hardware queues with mlx5dv_init_obj (direct verbs), \
                 which bypass the shim: their traffic is not governed",
            );
        });
    }
    match crate::real::MLX5DV_INIT_OBJ.optional() {
        // SAFETY: forwarding unchanged.
        Some(f) => unsafe { f(obj, obj_type) },
        None => {
            warn_once(
                Trouble::NoMlx5,
                "libmlx5 is not loaded, so direct verbs (mlx5dv_init_obj) are refused with \
                 EOPNOTSUPP",
            );
            libc::EOPNOTSUPP
        }
    }
}
