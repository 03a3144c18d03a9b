use super::consts::*;
use super::*;
use std::mem::{offset_of, size_of};

/// Compile a C probe against the installed `<infiniband/verbs.h>` and compare every size
/// and offset it prints with the Rust declaration.
#[test]
fn layout_matches_public_headers() {
    let q = |off: usize| QP_EX_TAIL + off;
    let c = |off: usize| CQ_EX_TAIL + off;
    let checks: Vec<(&str, usize)> = vec![
        ("sizeof ibv_device", size_of::<IbvDevice>()),
        ("ibv_device.name", offset_of!(IbvDevice, name)),
        ("ibv_device.ibdev_path", offset_of!(IbvDevice, ibdev_path)),
        ("sizeof ibv_context", size_of::<IbvContext>()),
        ("ibv_context.cmd_fd", offset_of!(IbvContext, cmd_fd)),
        ("ibv_context.async_fd", offset_of!(IbvContext, async_fd)),
        ("ibv_context.mutex", offset_of!(IbvContext, mutex)),
        ("ibv_context.abi_compat", offset_of!(IbvContext, abi_compat)),
        ("sizeof verbs_context", size_of::<VerbsContext>()),
        ("verbs_context.priv", offset_of!(VerbsContext, priv_)),
        (
            "verbs_context.query_device_ex",
            offset_of!(VerbsContext, ops_tail),
        ),
        ("verbs_context.sz", offset_of!(VerbsContext, sz)),
        ("verbs_context.context", offset_of!(VerbsContext, context)),
        ("sizeof ibv_pd", size_of::<IbvPd>()),
        ("sizeof ibv_mr", size_of::<IbvMr>()),
        ("sizeof ibv_mw", size_of::<IbvMw>()),
        ("ibv_mw.rkey", offset_of!(IbvMw, rkey)),
        ("ibv_mw.type", offset_of!(IbvMw, type_)),
        ("sizeof ibv_mw_bind", size_of::<IbvMwBind>()),
        ("ibv_mw_bind.bind_info", offset_of!(IbvMwBind, bind_info)),
        (
            "ibv_mw_bind.bind_info.mw_access_flags",
            offset_of!(IbvMwBind, bind_info) + offset_of!(IbvMwBindInfo, mw_access_flags),
        ),
        ("ibv_send_wr.bind_mw.mw", offset_of!(IbvSendWr, bind_mw)),
        (
            "ibv_send_wr.bind_mw.rkey",
            offset_of!(IbvSendWr, bind_mw) + offset_of!(IbvSendWrBindMw, rkey),
        ),
        (
            "ibv_send_wr.bind_mw.bind_info.mr",
            offset_of!(IbvSendWr, bind_mw) + offset_of!(IbvSendWrBindMw, bind_info),
        ),
        (
            "ibv_send_wr.bind_mw.bind_info.length",
            offset_of!(IbvSendWr, bind_mw)
                + offset_of!(IbvSendWrBindMw, bind_info)
                + offset_of!(IbvMwBindInfo, length),
        ),
        (
            "ibv_send_wr.bind_mw.bind_info.mw_access_flags",
            offset_of!(IbvSendWr, bind_mw)
                + offset_of!(IbvSendWrBindMw, bind_info)
                + offset_of!(IbvMwBindInfo, mw_access_flags),
        ),
        ("ibv_mr.lkey", offset_of!(IbvMr, lkey)),
        ("ibv_mr.rkey", offset_of!(IbvMr, rkey)),
        ("sizeof ibv_comp_channel", size_of::<IbvCompChannel>()),
        ("ibv_comp_channel.fd", offset_of!(IbvCompChannel, fd)),
        (
            "ibv_comp_channel.refcnt",
            offset_of!(IbvCompChannel, refcnt),
        ),
        ("sizeof ibv_cq", size_of::<IbvCq>()),
        ("ibv_cq.cqe", offset_of!(IbvCq, cqe)),
        ("ibv_cq.cond", offset_of!(IbvCq, cond)),
        (
            "ibv_cq.async_events_completed",
            offset_of!(IbvCq, async_events_completed),
        ),
        ("sizeof ibv_qp", size_of::<IbvQp>()),
        ("ibv_qp.qp_num", offset_of!(IbvQp, qp_num)),
        ("ibv_qp.qp_type", offset_of!(IbvQp, qp_type)),
        (
            "ibv_qp.events_completed",
            offset_of!(IbvQp, events_completed),
        ),
        (
            "ibv_qp_ex.comp_mask",
            offset_of!(VerbsQp, ex) + offset_of!(QpExTail, comp_mask),
        ),
        ("sizeof ibv_qp_init_attr_ex", size_of::<IbvQpInitAttrEx>()),
        (
            "ibv_qp_init_attr_ex.comp_mask",
            offset_of!(IbvQpInitAttrEx, comp_mask),
        ),
        ("ibv_qp_init_attr_ex.pd", offset_of!(IbvQpInitAttrEx, pd)),
        (
            "ibv_qp_init_attr_ex.create_flags",
            offset_of!(IbvQpInitAttrEx, create_flags),
        ),
        (
            "ibv_qp_init_attr_ex.rx_hash_conf",
            offset_of!(IbvQpInitAttrEx, rx_hash_conf),
        ),
        (
            "ibv_qp_init_attr_ex.send_ops_flags",
            offset_of!(IbvQpInitAttrEx, send_ops_flags),
        ),
        (
            "ibv_device_attr_ex.completion_timestamp_mask",
            DEVICE_ATTR_EX_TS_MASK,
        ),
        (
            "ibv_device_attr_ex.hca_core_clock",
            DEVICE_ATTR_EX_CORE_CLOCK,
        ),
        (
            "ibv_device_attr_ex.odp_caps.general_caps",
            DEVICE_ATTR_EX_ODP_GENERAL,
        ),
        (
            "ibv_device_attr_ex.odp_caps.per_transport_caps.rc_odp_caps",
            DEVICE_ATTR_EX_ODP_RC,
        ),
        (
            "ibv_device_attr_ex.odp_caps.per_transport_caps.uc_odp_caps",
            DEVICE_ATTR_EX_ODP_UC,
        ),
        (
            "ibv_device_attr_ex.odp_caps.per_transport_caps.ud_odp_caps",
            DEVICE_ATTR_EX_ODP_UD,
        ),
        ("ibv_device_attr_ex.xrc_odp_caps", DEVICE_ATTR_EX_ODP_XRC),
        ("ibv_device_attr_ex.max_dm_size", DEVICE_ATTR_EX_MAX_DM_SIZE),
        (
            "ibv_device_attr_ex.device_cap_flags_ex",
            DEVICE_ATTR_EX_CAP_FLAGS_EX,
        ),
        (
            "ibv_device_attr_ex.phys_port_cnt_ex",
            DEVICE_ATTR_EX_PHYS_PORT_CNT,
        ),
        (
            "ibv_device_attr_ex.packet_pacing_caps",
            DEVICE_ATTR_EX_PACKET_PACING,
        ),
        (
            "sizeof ibv_qp_rate_limit_attr",
            size_of::<IbvQpRateLimitAttr>(),
        ),
        (
            "ibv_qp_rate_limit_attr.typical_pkt_sz",
            offset_of!(IbvQpRateLimitAttr, typical_pkt_sz),
        ),
        (
            "ibv_qp_rate_limit_attr.comp_mask",
            offset_of!(IbvQpRateLimitAttr, comp_mask),
        ),
        ("sizeof ibv_dm", size_of::<IbvDm>()),
        ("ibv_dm.memcpy_to_dm", offset_of!(IbvDm, memcpy_to_dm)),
        ("ibv_dm.memcpy_from_dm", offset_of!(IbvDm, memcpy_from_dm)),
        ("ibv_dm.comp_mask", offset_of!(IbvDm, comp_mask)),
        ("ibv_dm.handle", offset_of!(IbvDm, handle)),
        ("sizeof ibv_alloc_dm_attr", size_of::<IbvAllocDmAttr>()),
        (
            "ibv_alloc_dm_attr.log_align_req",
            offset_of!(IbvAllocDmAttr, log_align_req),
        ),
        (
            "ibv_alloc_dm_attr.comp_mask",
            offset_of!(IbvAllocDmAttr, comp_mask),
        ),
        ("sizeof ibv_ah", size_of::<IbvAh>()),
        ("ibv_ah.handle", offset_of!(IbvAh, handle)),
        ("ibv_send_wr.wr.ud.ah", offset_of!(IbvSendWr, wr)),
        (
            "ibv_send_wr.wr.ud.remote_qpn",
            offset_of!(IbvSendWr, wr) + 8,
        ),
        (
            "ibv_send_wr.wr.ud.remote_qkey",
            offset_of!(IbvSendWr, wr) + 12,
        ),
        ("sizeof ibv_srq", size_of::<IbvSrq>()),
        ("ibv_srq.handle", offset_of!(IbvSrq, handle)),
        ("ibv_srq.cond", offset_of!(IbvSrq, cond)),
        (
            "ibv_srq.events_completed",
            offset_of!(IbvSrq, events_completed),
        ),
        ("sizeof ibv_srq_attr", size_of::<IbvSrqAttr>()),
        ("ibv_srq_attr.srq_limit", offset_of!(IbvSrqAttr, srq_limit)),
        ("sizeof ibv_srq_init_attr", size_of::<IbvSrqInitAttr>()),
        ("ibv_srq_init_attr.attr", offset_of!(IbvSrqInitAttr, attr)),
        ("sizeof ibv_srq_init_attr_ex", size_of::<IbvSrqInitAttrEx>()),
        (
            "ibv_srq_init_attr_ex.comp_mask",
            offset_of!(IbvSrqInitAttrEx, comp_mask),
        ),
        (
            "ibv_srq_init_attr_ex.srq_type",
            offset_of!(IbvSrqInitAttrEx, srq_type),
        ),
        ("ibv_srq_init_attr_ex.pd", offset_of!(IbvSrqInitAttrEx, pd)),
        (
            "ibv_srq_init_attr_ex.xrcd",
            offset_of!(IbvSrqInitAttrEx, xrcd),
        ),
        ("ibv_srq_init_attr_ex.cq", offset_of!(IbvSrqInitAttrEx, cq)),
        (
            "ibv_srq_init_attr_ex.tm_cap",
            offset_of!(IbvSrqInitAttrEx, tm_cap),
        ),
        ("sizeof ibv_qp_open_attr", size_of::<IbvQpOpenAttr>()),
        ("ibv_qp_open_attr.xrcd", offset_of!(IbvQpOpenAttr, xrcd)),
        (
            "ibv_qp_open_attr.qp_context",
            offset_of!(IbvQpOpenAttr, qp_context),
        ),
        (
            "ibv_qp_open_attr.qp_type",
            offset_of!(IbvQpOpenAttr, qp_type),
        ),
        ("sizeof ibv_xrcd_init_attr", size_of::<IbvXrcdInitAttr>()),
        ("ibv_xrcd_init_attr.fd", offset_of!(IbvXrcdInitAttr, fd)),
        (
            "ibv_xrcd_init_attr.oflags",
            offset_of!(IbvXrcdInitAttr, oflags),
        ),
        ("sizeof ibv_sge", size_of::<IbvSge>()),
        ("sizeof ibv_send_wr", size_of::<IbvSendWr>()),
        ("ibv_send_wr.opcode", offset_of!(IbvSendWr, opcode)),
        ("ibv_send_wr.send_flags", offset_of!(IbvSendWr, send_flags)),
        ("ibv_send_wr.imm_data", offset_of!(IbvSendWr, imm_data)),
        ("ibv_send_wr.wr.rdma.remote_addr", offset_of!(IbvSendWr, wr)),
        ("ibv_send_wr.wr.rdma.rkey", offset_of!(IbvSendWr, wr) + 8),
        ("ibv_send_wr.wr.atomic.rkey", offset_of!(IbvSendWr, wr) + 24),
        (
            "ibv_send_wr.qp_type",
            offset_of!(IbvSendWr, qp_type_xrc_remote_srqn),
        ),
        ("ibv_send_wr.bind_mw", offset_of!(IbvSendWr, bind_mw)),
        ("sizeof ibv_recv_wr", size_of::<IbvRecvWr>()),
        ("sizeof ibv_wc", size_of::<IbvWc>()),
        ("ibv_wc.byte_len", offset_of!(IbvWc, byte_len)),
        ("ibv_wc.imm_data", offset_of!(IbvWc, imm_data)),
        ("ibv_wc.wc_flags", offset_of!(IbvWc, wc_flags)),
        ("ibv_wc.dlid_path_bits", offset_of!(IbvWc, dlid_path_bits)),
        ("sizeof ibv_qp_init_attr", size_of::<IbvQpInitAttr>()),
        ("ibv_qp_init_attr.cap", offset_of!(IbvQpInitAttr, cap)),
        (
            "ibv_qp_init_attr.sq_sig_all",
            offset_of!(IbvQpInitAttr, sq_sig_all),
        ),
        ("sizeof ibv_qp_attr", size_of::<IbvQpAttr>()),
        ("ibv_qp_attr.cap", offset_of!(IbvQpAttr, cap)),
        ("ibv_qp_attr.ah_attr", offset_of!(IbvQpAttr, ah_attr)),
        ("ibv_qp_attr.pkey_index", offset_of!(IbvQpAttr, pkey_index)),
        ("ibv_qp_attr.timeout", offset_of!(IbvQpAttr, timeout)),
        ("ibv_qp_attr.rate_limit", offset_of!(IbvQpAttr, rate_limit)),
        ("sizeof ibv_ah_attr", size_of::<IbvAhAttr>()),
        ("sizeof ibv_global_route", size_of::<IbvGlobalRoute>()),
        ("ibv_ah_attr.dlid", offset_of!(IbvAhAttr, dlid)),
        ("ibv_ah_attr.is_global", offset_of!(IbvAhAttr, is_global)),
        (
            "ibv_ah_attr.grh.sgid_index",
            offset_of!(IbvGlobalRoute, sgid_index),
        ),
        ("sizeof ibv_port_attr", size_of::<IbvPortAttr>()),
        (
            "ibv_port_attr.link_layer",
            offset_of!(IbvPortAttr, link_layer),
        ),
        (
            "ibv_port_attr.port_cap_flags2",
            offset_of!(IbvPortAttr, port_cap_flags2),
        ),
        ("sizeof ibv_device_attr", size_of::<IbvDeviceAttr>()),
        (
            "ibv_device_attr.node_guid",
            offset_of!(IbvDeviceAttr, node_guid),
        ),
        ("ibv_device_attr.max_qp", offset_of!(IbvDeviceAttr, max_qp)),
        (
            "ibv_device_attr.max_pkeys",
            offset_of!(IbvDeviceAttr, max_pkeys),
        ),
        (
            "ibv_device_attr.phys_port_cnt",
            offset_of!(IbvDeviceAttr, phys_port_cnt),
        ),
        // What the shim reads and replaces.
        ("sizeof ibv_context_ops", size_of::<IbvContextOps>()),
        (
            "ibv_context_ops.poll_cq",
            offset_of!(IbvContextOps, poll_cq),
        ),
        (
            "ibv_context_ops.req_notify_cq",
            offset_of!(IbvContextOps, req_notify_cq),
        ),
        (
            "ibv_context_ops.post_srq_recv",
            offset_of!(IbvContextOps, post_srq_recv),
        ),
        (
            "ibv_context_ops.post_send",
            offset_of!(IbvContextOps, post_send),
        ),
        (
            "ibv_context_ops.post_recv",
            offset_of!(IbvContextOps, post_recv),
        ),
        ("ibv_context.ops", offset_of!(IbvContext, ops)),
        ("back verbs_context.create_cq_ex", CREATE_CQ_EX_BACK),
        ("back verbs_context.create_qp_ex", CREATE_QP_EX_BACK),
        ("back verbs_context.sz", SZ_BACK),
        ("ibv_qp.context", offset_of!(IbvQp, context)),
        ("ibv_qp.srq", offset_of!(IbvQp, srq)),
        ("ibv_qp.state", offset_of!(IbvQp, state)),
        (
            "ibv_qp_init_attr.send_cq",
            offset_of!(IbvQpInitAttr, send_cq),
        ),
        (
            "ibv_qp_init_attr.recv_cq",
            offset_of!(IbvQpInitAttr, recv_cq),
        ),
        (
            "ibv_qp_init_attr.qp_type",
            offset_of!(IbvQpInitAttr, qp_type),
        ),
        ("ibv_qp_attr.path_mtu", offset_of!(IbvQpAttr, path_mtu)),
        (
            "ibv_qp_attr.dest_qp_num",
            offset_of!(IbvQpAttr, dest_qp_num),
        ),
        (
            "ibv_qp_attr.qp_access_flags",
            offset_of!(IbvQpAttr, qp_access_flags),
        ),
        (
            "ibv_qp_attr.ah_attr.grh.dgid",
            offset_of!(IbvQpAttr, ah_attr) + offset_of!(IbvAhAttr, grh),
        ),
        ("ibv_cq.context", offset_of!(IbvCq, context)),
        ("ibv_cq.channel", offset_of!(IbvCq, channel)),
        ("ibv_cq.cq_context", offset_of!(IbvCq, cq_context)),
        ("ibv_srq.context", offset_of!(IbvSrq, context)),
        ("sizeof ibv_async_event", size_of::<IbvAsyncEvent>()),
        (
            "ibv_async_event.event_type",
            offset_of!(IbvAsyncEvent, event_type),
        ),
        ("ibv_sge.length", offset_of!(IbvSge, length)),
        ("ibv_send_wr.next", offset_of!(IbvSendWr, next)),
        ("ibv_send_wr.sg_list", offset_of!(IbvSendWr, sg_list)),
        ("ibv_send_wr.num_sge", offset_of!(IbvSendWr, num_sge)),
        ("ibv_recv_wr.next", offset_of!(IbvRecvWr, next)),
        ("ibv_recv_wr.sg_list", offset_of!(IbvRecvWr, sg_list)),
        ("ibv_recv_wr.num_sge", offset_of!(IbvRecvWr, num_sge)),
        ("ibv_wc.status", offset_of!(IbvWc, status)),
        ("ibv_wc.opcode", offset_of!(IbvWc, opcode)),
        ("ibv_wc.qp_num", offset_of!(IbvWc, qp_num)),
        // The extended structures: `ibv_qp_ex` and `ibv_cq_ex` continue their basic ones.
        ("sizeof ibv_qp", QP_EX_TAIL),
        ("sizeof ibv_cq", CQ_EX_TAIL),
        ("sizeof ibv_qp_ex", size_of::<IbvQpEx>()),
        ("ibv_qp_ex.comp_mask", offset_of!(IbvQpEx, ex)),
        ("ibv_qp_ex.wr_id", q(offset_of!(QpExTail, wr_id))),
        ("ibv_qp_ex.wr_flags", q(offset_of!(QpExTail, wr_flags))),
        (
            "ibv_qp_ex.wr_atomic_cmp_swp",
            q(offset_of!(QpExTail, wr_atomic_cmp_swp)),
        ),
        ("ibv_qp_ex.wr_send", q(offset_of!(QpExTail, wr_send))),
        ("ibv_qp_ex.wr_set_sge", q(offset_of!(QpExTail, wr_set_sge))),
        ("ibv_qp_ex.wr_start", q(offset_of!(QpExTail, wr_start))),
        (
            "ibv_qp_ex.wr_complete",
            q(offset_of!(QpExTail, wr_complete)),
        ),
        ("ibv_qp_ex.wr_abort", q(offset_of!(QpExTail, wr_abort))),
        (
            "ibv_qp_ex.wr_atomic_write",
            q(offset_of!(QpExTail, wr_atomic_write)),
        ),
        ("sizeof ibv_cq_ex", c(size_of::<CqExTail>())),
        ("ibv_cq_ex.comp_mask", c(offset_of!(CqExTail, comp_mask))),
        ("ibv_cq_ex.wr_id", c(offset_of!(CqExTail, wr_id))),
        ("ibv_cq_ex.start_poll", c(offset_of!(CqExTail, start_poll))),
        (
            "ibv_cq_ex.read_completion_ts",
            c(offset_of!(CqExTail, read_completion_ts)),
        ),
        (
            "ibv_cq_ex.read_completion_wallclock_ns",
            c(offset_of!(CqExTail, read_completion_wallclock_ns)),
        ),
        ("sizeof ibv_data_buf", size_of::<IbvDataBuf>()),
        ("sizeof ibv_cq_init_attr_ex", size_of::<IbvCqInitAttrEx>()),
        (
            "ibv_cq_init_attr_ex.channel",
            offset_of!(IbvCqInitAttrEx, channel),
        ),
        (
            "ibv_cq_init_attr_ex.wc_flags",
            offset_of!(IbvCqInitAttrEx, wc_flags),
        ),
        (
            "ibv_cq_init_attr_ex.comp_mask",
            offset_of!(IbvCqInitAttrEx, comp_mask),
        ),
        (
            "ibv_cq_init_attr_ex.parent_domain",
            offset_of!(IbvCqInitAttrEx, parent_domain),
        ),
    ];
    drum_test_support::assert_c_layout(&checks);
    // Both sides embed whole `ibv_qp` and `ibv_cq`s in front of the extended tails.
    assert_eq!(size_of::<IbvQp>(), QP_EX_TAIL);
    assert_eq!(size_of::<IbvCq>(), CQ_EX_TAIL);
}

/// Private ABI (driver.h is not installed): numbers obtained by compiling rdma-core 44's
/// own definitions of these structures on x86_64 (see docs/softrnic.md).
#[test]
fn layout_matches_rdma_core_44_private_abi() {
    assert_eq!(size_of::<VerbsMatchEnt>(), 24);
    assert_eq!(offset_of!(VerbsMatchEnt, u), 8);
    assert_eq!(offset_of!(VerbsMatchEnt, vendor), 16);
    assert_eq!(offset_of!(VerbsMatchEnt, kind), 20);

    assert_eq!(size_of::<VerbsSysfsDev>(), 992);
    assert_eq!(offset_of!(VerbsSysfsDev, match_), 24);
    assert_eq!(offset_of!(VerbsSysfsDev, sysfs_name), 36);
    assert_eq!(offset_of!(VerbsSysfsDev, sysfs_cdev), 104);
    assert_eq!(offset_of!(VerbsSysfsDev, ibdev_name), 112);
    assert_eq!(offset_of!(VerbsSysfsDev, ibdev_path), 176);
    assert_eq!(offset_of!(VerbsSysfsDev, modalias), 432);
    assert_eq!(offset_of!(VerbsSysfsDev, node_guid), 944);
    assert_eq!(offset_of!(VerbsSysfsDev, driver_id), 952);
    assert_eq!(offset_of!(VerbsSysfsDev, node_type), 956);
    assert_eq!(offset_of!(VerbsSysfsDev, ibdev_idx), 960);
    assert_eq!(offset_of!(VerbsSysfsDev, num_ports), 964);
    assert_eq!(offset_of!(VerbsSysfsDev, abi_ver), 968);
    assert_eq!(offset_of!(VerbsSysfsDev, time_created), 976);

    assert_eq!(size_of::<VerbsDeviceOps>(), 72);
    assert_eq!(offset_of!(VerbsDeviceOps, match_min_abi_version), 8);
    assert_eq!(offset_of!(VerbsDeviceOps, match_table), 16);
    assert_eq!(offset_of!(VerbsDeviceOps, match_device), 32);
    assert_eq!(offset_of!(VerbsDeviceOps, alloc_context), 40);
    assert_eq!(offset_of!(VerbsDeviceOps, alloc_device), 56);
    assert_eq!(offset_of!(VerbsDeviceOps, uninit_device), 64);

    assert_eq!(size_of::<VerbsDevice>(), 712);
    assert_eq!(offset_of!(VerbsDevice, ops), 664);
    assert_eq!(offset_of!(VerbsDevice, refcount), 672);
    assert_eq!(offset_of!(VerbsDevice, entry), 680);
    assert_eq!(offset_of!(VerbsDevice, sysfs), 696);
    assert_eq!(offset_of!(VerbsDevice, core_support), 704);

    assert_eq!(size_of::<VerbsMr>(), 56);
    assert_eq!(offset_of!(VerbsMr, mr_type), 48);
    assert_eq!(offset_of!(VerbsMr, access), 52);

    assert_eq!(size_of::<VerbsQp>(), 368);
    assert_eq!(offset_of!(VerbsQp, comp_mask), 352);

    assert_eq!(size_of::<VerbsXrcd>(), 16);
    assert_eq!(offset_of!(VerbsXrcd, comp_mask), 8);
    assert_eq!(offset_of!(VerbsXrcd, handle), 12);
    assert_eq!(size_of::<VerbsSrq>(), 160);
    assert_eq!(offset_of!(VerbsSrq, srq_type), 128);
    assert_eq!(offset_of!(VerbsSrq, xrcd), 136);
    assert_eq!(offset_of!(VerbsSrq, cq), 144);
    assert_eq!(offset_of!(VerbsSrq, srq_num), 152);

    assert_eq!(size_of::<VerbsContextOps>(), 608);
    let off = |n: &str| VerbsContextOps::index(n) * 8;
    assert_eq!(off("alloc_pd"), 40);
    assert_eq!(off("create_cq"), 120);
    assert_eq!(off("create_qp"), 152);
    assert_eq!(off("dealloc_pd"), 208);
    assert_eq!(off("dereg_mr"), 224);
    assert_eq!(off("destroy_cq"), 248);
    assert_eq!(off("destroy_qp"), 272);
    assert_eq!(off("free_context"), 312);
    assert_eq!(off("modify_qp"), 376);
    assert_eq!(off("poll_cq"), 424);
    assert_eq!(off("post_recv"), 432);
    assert_eq!(off("post_send"), 440);
    assert_eq!(off("query_device_ex"), 464);
    assert_eq!(off("query_port"), 480);
    assert_eq!(off("query_qp"), 488);
    assert_eq!(off("reg_mr"), 544);
    assert_eq!(off("req_notify_cq"), 552);
    assert_eq!(off("unimport_pd"), 600);
}

#[test]
fn mtu_enum() {
    assert_eq!(mtu_bytes(1), Some(256));
    assert_eq!(mtu_bytes(5), Some(4096));
    assert_eq!(mtu_bytes(0), None);
}
