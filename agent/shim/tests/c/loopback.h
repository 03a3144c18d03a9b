/* Shared by the shim's C probes: connects an RC QP to another QP of the same device
 * (loopback) through INIT and RTR to RTS. Returns NULL, or the name of the step that
 * failed. A probe that does not link libibverbs defines LOOPBACK_MODIFY_QP as the
 * ibv_modify_qp it looked up before including this. */
#include <infiniband/verbs.h>
#include <stdint.h>
#include <string.h>

#ifndef LOOPBACK_MODIFY_QP
#define LOOPBACK_MODIFY_QP ibv_modify_qp
#endif

static const char *loopback_connect(struct ibv_qp *qp, uint32_t dest, const union ibv_gid *gid,
				    int access) {
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qp_access_flags = access };
	if (LOOPBACK_MODIFY_QP(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		return "init";
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTR; a.path_mtu = IBV_MTU_1024; a.dest_qp_num = dest; a.rq_psn = 1;
	a.max_dest_rd_atomic = 1; a.min_rnr_timer = 12;
	a.ah_attr.is_global = 1; a.ah_attr.grh.dgid = *gid; a.ah_attr.grh.hop_limit = 1; a.ah_attr.port_num = 1;
	if (LOOPBACK_MODIFY_QP(qp, &a, IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
			  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		return "rtr";
	memset(&a, 0, sizeof a);
	a.qp_state = IBV_QPS_RTS; a.timeout = 14; a.retry_cnt = 7; a.rnr_retry = 7; a.sq_psn = 1; a.max_rd_atomic = 1;
	if (LOOPBACK_MODIFY_QP(qp, &a, IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
			  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		return "rts";
	return NULL;
}
