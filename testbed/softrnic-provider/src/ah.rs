//! Address handles (provider-side only: an AH is just the destination's address).

use super::*;

/// An address handle: libibverbs' `ibv_ah` followed by the destination IPv4 address.
#[repr(C)]
pub(super) struct SrAh {
    ah: IbvAh,
    /// The destination: an IPv4 address, or a multicast group key ([`device::mcast_group`]).
    pub(super) dest: u64,
}

/// Address handles alive in this process (bounded by `max_ah`).
pub(super) static AH_COUNT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

pub(super) unsafe extern "C" fn create_ah(pd: *mut IbvPd, attr: *mut IbvAhAttr) -> *mut IbvAh {
    guard(null_mut(), || {
        // SAFETY: pd is ours; attr is valid.
        let (ctx, a) = unsafe { ((*pd).context, &*attr) };
        // The port is RoCE-like: the destination is a GRH with an IPv4-mapped GID.
        let dgid = &a.grh.dgid;
        let dest = device::ip_of_gid(dgid)
            .map(|ip| u64::from(u32::from(ip)))
            .or_else(|| device::mcast_group(dgid));
        let dest = match dest {
            Some(d) if a.is_global == 1 && a.port_num == 1 && a.grh.sgid_index == 0 => d,
            _ => {
                set_errno(libc::EINVAL);
                return null_mut();
            }
        };
        let n = AH_COUNT.fetch_add(1, Ordering::Relaxed);
        if n >= device::MAX_AH {
            AH_COUNT.fetch_sub(1, Ordering::Relaxed);
            set_errno(libc::ENOMEM);
            return null_mut();
        }
        let b = Box::new(SrAh {
            ah: IbvAh {
                context: ctx,
                pd,
                handle: n,
            },
            dest,
        });
        Box::into_raw(b) as *mut IbvAh
    })
}

pub(super) unsafe extern "C" fn destroy_ah(ah: *mut IbvAh) -> c_int {
    guard(libc::EIO, || {
        // SAFETY: allocated by create_ah as a boxed SrAh.
        drop(unsafe { Box::from_raw(ah as *mut SrAh) });
        AH_COUNT.fetch_sub(1, Ordering::Relaxed);
        0
    })
}
