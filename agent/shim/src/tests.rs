//! Unit tests of the crate root: a context installed over a fake provider forwards and counts
//! its posts and polls, and uninstalling restores its ops.

use super::*;
use crate::context::lookup;

unsafe extern "C" fn fake_post_send(
    qp: *mut IbvQp,
    wr: *mut IbvSendWr,
    bad: *mut *mut IbvSendWr,
) -> c_int {
    // SAFETY: test fixtures below; the fake provider refuses WRs whose wr_id is 99.
    unsafe {
        let mut w = wr;
        while !w.is_null() {
            if (*w).wr_id == 99 {
                *bad = w;
                return libc::ENOMEM;
            }
            w = (*w).next;
        }
        (*qp).handle += 1;
    }
    0
}

unsafe extern "C" fn fake_poll_cq(_cq: *mut IbvCq, n: c_int, wc: *mut IbvWc) -> c_int {
    let k = n.min(3);
    for i in 0..k {
        // SAFETY: the caller's array holds n entries.
        unsafe {
            *wc.add(i as usize) = IbvWc {
                qp_num: 0x11,
                status: if i == 2 { 5 } else { 0 },
                ..IbvWc::default()
            }
        };
    }
    k
}

/// A context whose ops are fakes: install swaps them, the swapped ops forward and count,
/// uninstall restores the originals and keeps the counts in the closed totals.
#[test]
fn install_forwards_counts_and_uninstall_restores() {
    // SAFETY: an all-zero ibv_context is a valid value for these plain C fields.
    let mut ctx: Box<IbvContext> = Box::new(unsafe { std::mem::zeroed() });
    ctx.ops.post_send = Some(fake_post_send);
    ctx.ops.poll_cq = Some(fake_poll_cq);
    let cp: *mut IbvContext = &mut *ctx;
    // SAFETY: cp is valid and used by this thread only.
    unsafe { install(cp) }.unwrap();
    assert_eq!(
        ctx.ops.post_send.map(|f| f as usize),
        Some(drum_post_send as *const () as usize)
    );
    assert!(ctx.ops.post_recv.is_none(), "absent ops stay absent");
    assert!(
        // SAFETY: as above.
        unsafe { install(cp) }.is_err(),
        "a second install would recurse"
    );

    // SAFETY: an all-zero ibv_qp is a valid value for these plain C fields.
    let mut qp: IbvQp = unsafe { std::mem::zeroed() };
    (qp.context, qp.qp_num, qp.state, qp.qp_type) = (cp, 0x11, IBV_QPS_RTS, 2);
    let mut sge = [
        IbvSge {
            addr: 0,
            length: 100,
            lkey: 0,
        },
        IbvSge {
            addr: 0,
            length: 28,
            lkey: 0,
        },
    ];
    // SAFETY: an all-zero send WR is valid.
    let mut w2: IbvSendWr = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut w1: IbvSendWr = unsafe { std::mem::zeroed() };
    w1.sg_list = sge.as_mut_ptr();
    w1.num_sge = 2;
    let w2p: *mut IbvSendWr = &mut w2;
    w1.next = w2p;
    let mut bad = ptr::null_mut();
    let post = ctx.ops.post_send.unwrap();
    // SAFETY: valid fixtures.
    assert_eq!(unsafe { post(&mut qp, &mut w1, &mut bad) }, 0);
    assert_eq!(qp.handle, 1, "forwarded to the original");
    // SAFETY: w2p points to w2, alive until the end of the test.
    unsafe { (*w2p).wr_id = 99 };
    // SAFETY: valid fixtures; the fake refuses w2, so only w1 counts.
    assert_eq!(unsafe { post(&mut qp, &mut w1, &mut bad) }, libc::ENOMEM);

    // SAFETY: an all-zero ibv_cq is a valid value for these plain C fields.
    let mut cq: IbvCq = unsafe { std::mem::zeroed() };
    (cq.context, cq.cqe) = (cp, 1);
    let mut wc = [IbvWc::default(); 8];
    let poll = ctx.ops.poll_cq.unwrap();
    // SAFETY: valid fixtures.
    assert_eq!(unsafe { poll(&mut cq, 8, wc.as_mut_ptr()) }, 3);

    let st = lookup(cp).unwrap();
    let s = st.counters.snapshot();
    assert_eq!((s.send_wqes, s.send_bytes), (3, 256));
    assert_eq!(
        (s.completions, s.completion_errors, s.poll_calls),
        (3, 1, 1)
    );
    assert_eq!(st.qps.entries(), vec![(0x11, 3, 256, 0, 3)]);

    let before = CLOSED.snapshot();
    // SAFETY: as above.
    unsafe { uninstall(cp) };
    assert_eq!(
        ctx.ops.post_send.map(|f| f as usize),
        Some(fake_post_send as *const () as usize)
    );
    assert!(lookup(cp).is_none());
    assert_eq!(CLOSED.snapshot().send_wqes - before.send_wqes, 3);
}
