//! The verbs of CQs and completion channels on a governed context, which the interposed
//! entry points (`cq_verbs`, `extended`) hand over: the application's CQ made virtual over
//! its dedicated CQ, its channel made the shim's over the real one, their events, resizing
//! and destruction.

use super::*;

/// `ibv_create_comp_channel` for a governed context: the real channel behind the
/// application's.
///
/// # Safety
/// `ctx` is an open context.
pub unsafe fn create_channel(ctx: *mut IbvContext) -> *mut IbvCompChannel {
    let Some(f) = crate::real::CREATE_CHANNEL.get() else {
        crate::trouble::set_errno(libc::ENOSYS);
        return ptr::null_mut();
    };
    // SAFETY: the real function with the caller's argument.
    let realch = unsafe { f(ctx) };
    if realch.is_null() || !enabled() || crate::context::lookup(ctx).is_none() {
        return realch;
    }
    // SAFETY: the real channel just made.
    match unsafe { channel_over(ctx, realch) } {
        Some(app) => app,
        None => {
            warn_once(
                Trouble::Completions,
                "could not make a completion channel of the shim; that channel's CQs get \
                 their completions directly",
            );
            realch
        }
    }
}

/// The application's channel over `realch`: an epoll fd over the real channel's fd and a
/// semaphore eventfd (one read per raised event).
///
/// # Safety
/// `realch` is a live real channel of `ctx`.
unsafe fn channel_over(
    ctx: *mut IbvContext,
    realch: *mut IbvCompChannel,
) -> Option<*mut IbvCompChannel> {
    // SAFETY: plain fd-creating syscalls.
    let (efd, tfd, epfd) = unsafe {
        (
            libc::eventfd(
                0,
                libc::EFD_CLOEXEC | libc::EFD_SEMAPHORE | libc::EFD_NONBLOCK,
            ),
            libc::timerfd_create(
                libc::CLOCK_MONOTONIC,
                libc::TFD_CLOEXEC | libc::TFD_NONBLOCK,
            ),
            libc::epoll_create1(libc::EPOLL_CLOEXEC),
        )
    };
    let watch = |fd: c_int| {
        let mut ev = libc::epoll_event {
            events: libc::EPOLLIN as u32,
            u64: fd as u64,
        };
        // SAFETY: valid fds and event.
        unsafe { libc::epoll_ctl(epfd, libc::EPOLL_CTL_ADD, fd, &mut ev) == 0 }
    };
    let made = efd >= 0 && tfd >= 0 && epfd >= 0;
    // SAFETY: the real channel's fd; `realch` is the app's live channel.
    if !made || !watch(efd) || !watch(tfd) || !watch(unsafe { (*realch).fd }) {
        // SAFETY: closing what was made here (close(-1) is harmless).
        unsafe {
            libc::close(efd);
            libc::close(tfd);
            libc::close(epfd);
        }
        return None;
    }
    let app = Box::into_raw(Box::new(IbvCompChannel {
        context: ctx,
        fd: epfd,
        refcnt: 0,
    }));
    let ch = Arc::new(Channel {
        real: realch as usize,
        efd,
        tfd,
        timer_set: AtomicBool::new(false),
        epfd,
        queue: SpinLock::new(VecDeque::new()),
        taking: SpinLock::new(()),
        cqs: AtomicUsize::new(0),
    });
    CHANNELS
        .lock()
        .get_or_insert_with(HashMap::new)
        .insert(app as usize, ch);
    Some(app)
}

/// `ibv_destroy_comp_channel`; `None` when the channel is not the shim's.
///
/// # Safety
/// `ch` is a channel of the application.
pub unsafe fn destroy_channel(ch: *mut IbvCompChannel) -> Option<c_int> {
    let c = channel(ch)?;
    if c.cqs.load(Relaxed) > 0 {
        return Some(libc::EBUSY);
    }
    CHANNELS.lock().as_mut().map(|m| m.remove(&(ch as usize)));
    exclusive(&c);
    let rc = match crate::real::DESTROY_CHANNEL.get() {
        // SAFETY: the real channel, without CQs.
        Some(f) => unsafe { f(c.real as *mut IbvCompChannel) },
        None => libc::ENOSYS,
    };
    // SAFETY: ours; the application gives its channel up with this call.
    unsafe {
        libc::close(c.efd);
        libc::close(c.tfd);
        libc::close(c.epfd);
        drop(Box::from_raw(ch));
    }
    Some(rc)
}

/// `ibv_get_cq_event`; `None` when the channel is not the shim's. Blocks like the real
/// one unless the application made the channel's fd non-blocking.
///
/// # Safety
/// The application's arguments.
pub unsafe fn get_event(
    ch: *mut IbvCompChannel,
    cq: *mut *mut IbvCq,
    cq_context: *mut *mut c_void,
) -> Option<c_int> {
    let c = channel(ch)?;
    let app = loop {
        // Held-back events that fell due are raised by the thread that waits for them.
        run_due();
        c.refresh_timer();
        if let Some(app) = c.raised() {
            break app as *mut IbvCq;
        }
        if let Some(got) = c.real_event() {
            match owner(got as usize) {
                Some(v) => {
                    if let Some(ack) = crate::real::ACK_CQ_EVENTS.get() {
                        // SAFETY: the one event just taken, on the CQ it named.
                        unsafe { ack(got, 1) };
                    }
                    v.take_event();
                    break v.app as *mut IbvCq;
                }
                // Not a virtual CQ: the application acknowledges the event itself.
                None => break got,
            }
        }
        // SAFETY: the channel's epoll fd.
        let flags = unsafe { libc::fcntl(c.epfd, libc::F_GETFL) };
        if flags >= 0 && flags & libc::O_NONBLOCK != 0 {
            crate::trouble::set_errno(libc::EAGAIN);
            return Some(-1);
        }
        let mut ev = libc::epoll_event { events: 0, u64: 0 };
        // SAFETY: waits on our epoll fd until a source (real channel, raised event, timer)
        // has something.
        if unsafe { libc::epoll_wait(c.epfd, &mut ev, 1, -1) } < 0 {
            return Some(-1);
        }
    };
    EVENTS.fetch_add(1, Relaxed);
    // SAFETY: the application's CQ (alive: it has an unacknowledged event) and out-pointers.
    unsafe {
        *cq = app;
        *cq_context = (*app).cq_context;
    }
    Some(0)
}

/// `ibv_ack_cq_events`: the shim acknowledged the real events of a virtual CQ when it
/// took them. `false` when `cq` is not virtual.
pub fn ack(cq: *mut IbvCq) -> bool {
    find(cq).is_some()
}

/// `ibv_create_cq_ex` on a governed context: as [`create_cq`], with `create(app)` making
/// the application's `ibv_cq_ex` (`true`) or the dedicated one (`false`) through the
/// provider. Returns the application's CQ and whether it is virtual, in which case the caller
/// swaps its polling pointers (`cq_ex_poll::wrap`) before handing it out.
///
/// # Safety
/// `create` makes CQs on `ctx` on the real channel behind `app_ch`.
pub unsafe fn create_cq_ex(
    ctx: *mut IbvContext,
    app_ch: *mut IbvCompChannel,
    mut create: impl FnMut(bool) -> *mut IbvCq,
) -> (*mut IbvCq, bool) {
    let chan = if app_ch.is_null() {
        None
    } else {
        channel(app_ch)
    };
    let st = crate::context::lookup(ctx);
    let app = create(true);
    let usable = enabled() && (app_ch.is_null() || chan.is_some());
    // SAFETY: a non-null CQ the provider just made as an `ibv_cq_ex`.
    if st.is_none() || app.is_null() || !usable || !unsafe { crate::cq_ex::wrappable(app) } {
        return (app, false);
    }
    let Some(st) = st else {
        return (app, false);
    };
    let Some(poll) = st.orig.poll_cq else {
        return (app, false);
    };
    let dedicated = create(false);
    if dedicated.is_null() {
        warn_once(
            Trouble::Completions,
            "could not create a dedicated CQ; the application's CQs get their completions \
             directly",
        );
        return (app, false);
    }
    // SAFETY: both just created on the real channel behind the application's.
    let adopted = unsafe { adopt(poll, st.orig.req_notify_cq, (app, dedicated), true, chan) };
    (app, adopted)
}

/// `ibv_create_cq` on a governed context: the application's CQ and its dedicated CQ.
///
/// # Safety
/// The application's arguments.
pub unsafe fn create_cq(
    ctx: *mut IbvContext,
    cqe: c_int,
    cq_context: *mut c_void,
    ch: *mut IbvCompChannel,
    vector: c_int,
) -> *mut IbvCq {
    let Some(f) = crate::real::CREATE_CQ.get() else {
        crate::trouble::set_errno(libc::ENOSYS);
        return ptr::null_mut();
    };
    let chan = if ch.is_null() { None } else { channel(ch) };
    let st = crate::context::lookup(ctx);
    let virtualise = enabled() && (ch.is_null() || chan.is_some());
    let (Some(st), true) = (st, virtualise) else {
        // SAFETY: forwarding unchanged.
        return unsafe { f(ctx, cqe, cq_context, ch, vector) };
    };
    let realch = chan
        .as_ref()
        .map_or(ptr::null_mut(), |c| c.real as *mut IbvCompChannel);
    // SAFETY: the application's arguments, with the real channel behind its channel.
    let app = unsafe { f(ctx, cqe, cq_context, realch, vector) };
    if app.is_null() {
        return app;
    }
    let Some(poll) = st.orig.poll_cq else {
        return app;
    };
    // SAFETY: as above; the dedicated CQ has no context value of the application's.
    let dedicated = unsafe { f(ctx, cqe, ptr::null_mut(), realch, vector) };
    if dedicated.is_null() {
        warn_once(
            Trouble::Completions,
            "could not create a dedicated CQ; the application's CQs get their completions \
             directly",
        );
        return app;
    }
    // SAFETY: the CQs just created, on the real channel behind `chan`.
    unsafe { adopt(poll, st.orig.req_notify_cq, (app, dedicated), false, chan) };
    app
}

/// Makes `app` virtual over `dedicated`. When the index is full
/// the dedicated CQ is destroyed and `app` stays an ordinary CQ; returns whether it is
/// virtual.
///
/// # Safety
/// `app` and `dedicated` are CQs just created on the same context and real channel.
unsafe fn adopt(
    poll: PollCqFn,
    notify: Option<ReqNotifyCqFn>,
    (app, dedicated): (*mut IbvCq, *mut IbvCq),
    extended: bool,
    chan: Option<Arc<Channel>>,
) -> bool {
    let v = Arc::new(Vcq {
        app: app as usize,
        dedicated: dedicated as usize,
        // SAFETY: the CQ just created.
        ctx: unsafe { (*app).context } as usize,
        extended,
        poll,
        notify,
        // SAFETY: the CQ just created; the provider rounds its size up.
        capacity: AtomicUsize::new(unsafe { (*app).cqe }.max(1) as usize),
        app_polled: AtomicBool::new(false),
        quiet_since_ps: AtomicU64::new(0),
        channel: chan.clone(),
        inner: SpinLock::new(Inner::default()),
    });
    let mut reg = REG.lock();
    if !index_insert(&v) {
        drop(reg);
        warn_once(
            Trouble::Completions,
            "more than 4096 CQs; further ones get their completions directly",
        );
        if let Some(d) = crate::real::DESTROY_CQ.get() {
            // SAFETY: our own, unused dedicated CQ.
            unsafe { d(dedicated) };
        }
        return false;
    }
    let m = reg.get_or_insert_with(HashMap::new);
    m.insert(app as usize, v.clone());
    m.insert(dedicated as usize, v);
    drop(reg);
    if let Some(c) = chan {
        c.cqs.fetch_add(1, Relaxed);
    }
    CREATED.fetch_add(1, Relaxed);
    true
}

/// `ibv_destroy_cq`; `None` when `cq` is not virtual.
///
/// # Safety
/// The application's CQ, which it no longer uses.
pub unsafe fn destroy_cq(cq: *mut IbvCq) -> Option<c_int> {
    let v = owner(cq as usize).filter(|v| v.app == cq as usize)?;
    let Some(f) = crate::real::DESTROY_CQ.get() else {
        return Some(libc::ENOSYS);
    };
    let unregister = || {
        let mut reg = REG.lock();
        index_remove(v.app);
        if let Some(m) = reg.as_mut() {
            m.remove(&v.app);
            m.remove(&v.dedicated);
        }
        drop(reg);
        DEFERRED.lock().retain(|(_, x)| !Arc::ptr_eq(x, &v));
    };
    unregister();
    exclusive(&v);
    // SAFETY: the dedicated CQ; the provider refuses while QPs are bound to it.
    let rc = unsafe { f(v.dedicated as *mut IbvCq) };
    if rc != 0 {
        let mut reg = REG.lock();
        index_insert(&v);
        let m = reg.get_or_insert_with(HashMap::new);
        m.insert(v.app, v.clone());
        m.insert(v.dedicated, v.clone());
        return Some(rc);
    }
    // SAFETY: the application's CQ, which it destroys.
    let rc = unsafe { f(cq) };
    if let Some(c) = &v.channel {
        c.cqs.fetch_sub(1, Relaxed);
    }
    Some(rc)
}

/// `ibv_resize_cq`; `None` when `cq` is not virtual.
///
/// # Safety
/// The application's arguments.
pub unsafe fn resize_cq(cq: *mut IbvCq, cqe: c_int) -> Option<c_int> {
    let v = find(cq)?;
    let Some(f) = crate::real::RESIZE_CQ.get() else {
        return Some(libc::ENOSYS);
    };
    // SAFETY: our dedicated CQ, then the application's.
    let rc = unsafe { f(v.dedicated as *mut IbvCq, cqe) };
    if rc != 0 {
        return Some(rc);
    }
    // SAFETY: as above.
    let rc = unsafe { f(cq, cqe) };
    // SAFETY: the application's CQ, just resized.
    v.capacity
        .store(unsafe { (*cq).cqe }.max(1) as usize, Relaxed);
    Some(rc)
}
