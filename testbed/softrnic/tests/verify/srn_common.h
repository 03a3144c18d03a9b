/*
 * srn_common.h: what softrnic's C checkers (srn_verify, srn_atomic, srn_async, srn_mw, srn_wr,
 * srn_xrc) share —
 * failing, the TCP side channel that carries connection data, opening the device, creating RC
 * QPs and moving them through INIT, RTR and RTS. Included with quotes, so compiling a checker needs no -I
 * flag (the shim's tests compile srn_async.c from its own path). The functions are
 * `static inline` so that a checker not using one of them stays -Wall -Werror clean.
 */
#ifndef SRN_COMMON_H
#define SRN_COMMON_H

#include <arpa/inet.h>
#include <infiniband/verbs.h>
#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static inline void die(const char *m)
{
	fprintf(stderr, "FAIL: %s\n", m);
	exit(1);
}

/* Send (send_it) or receive exactly n bytes over the TCP side channel. */
static inline void xfer(int fd, void *buf, size_t n, int send_it)
{
	uint8_t *p = buf;
	while (n) {
		ssize_t r = send_it ? write(fd, p, n) : read(fd, p, n);
		if (r <= 0)
			die("tcp exchange");
		p += r;
		n -= (size_t)r;
	}
}

/* A TCP socket listening on every address at `port`. */
static inline int tcp_listen(int port, int backlog)
{
	int ls = socket(AF_INET, SOCK_STREAM, 0), one = 1;
	setsockopt(ls, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
	if (bind(ls, (struct sockaddr *)&sa, sizeof sa) || listen(ls, backlog))
		die("listen");
	return ls;
}

static inline int tcp_accept(int ls)
{
	int fd = accept(ls, NULL, NULL);
	if (fd < 0)
		die("accept");
	return fd;
}

/* Connect to the server, retrying for about 10 s: it may still be starting. */
static inline int tcp_connect(const char *ip, int port)
{
	struct sockaddr_in sa = {.sin_family = AF_INET, .sin_port = htons(port)};
	inet_pton(AF_INET, ip, &sa.sin_addr);
	for (int tries = 0; tries < 100; tries++) {
		int fd = socket(AF_INET, SOCK_STREAM, 0);
		if (connect(fd, (struct sockaddr *)&sa, sizeof sa) == 0)
			return fd;
		close(fd);
		usleep(100000);
	}
	die("connect");
	return -1;
}

/* The first RDMA device, opened. */
static inline struct ibv_context *open_first_device(void)
{
	struct ibv_device **list = ibv_get_device_list(NULL);
	if (!list || !list[0])
		die("no RDMA device");
	struct ibv_context *ctx = ibv_open_device(list[0]);
	if (!ctx)
		die("open_device");
	return ctx;
}

/* Port 1's active MTU, the path MTU every checker uses. */
static inline enum ibv_mtu port_mtu(struct ibv_context *ctx)
{
	struct ibv_port_attr pa;
	if (ibv_query_port(ctx, 1, &pa))
		die("query_port");
	return pa.active_mtu;
}

/* GID 0 of port 1 (RoCE v2: the host's address), raw. */
static inline void local_gid(struct ibv_context *ctx, uint8_t gid[16])
{
	union ibv_gid g;
	if (ibv_query_gid(ctx, 1, 0, &g))
		die("query_gid");
	memcpy(gid, g.raw, 16);
}

/* An RC QP with one SGE per work request, on an SRQ if `srq` is not NULL. */
static inline struct ibv_qp *create_rc_qp(struct ibv_pd *pd, struct ibv_cq *send_cq,
					  struct ibv_cq *recv_cq, struct ibv_srq *srq,
					  uint32_t max_send_wr, uint32_t max_recv_wr)
{
	struct ibv_qp_init_attr ia = {0};
	ia.send_cq = send_cq;
	ia.recv_cq = recv_cq;
	ia.srq = srq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = max_send_wr;
	ia.cap.max_recv_wr = max_recv_wr;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	struct ibv_qp *qp = ibv_create_qp(pd, &ia);
	if (!qp)
		die("create_qp");
	return qp;
}

static inline void qp_to_init(struct ibv_qp *qp, int access)
{
	struct ibv_qp_attr a = {0};
	a.qp_state = IBV_QPS_INIT;
	a.port_num = 1;
	a.qp_access_flags = access;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_ACCESS_FLAGS))
		die("to INIT");
}

/* RTR towards the peer's QP `dest_qpn` at `gid`, expecting its PSN `rq_psn`. */
static inline void qp_to_rtr(struct ibv_qp *qp, enum ibv_mtu mtu, uint32_t dest_qpn,
			     uint32_t rq_psn, const uint8_t gid[16], uint8_t max_dest_rd_atomic)
{
	struct ibv_qp_attr a = {0};
	a.qp_state = IBV_QPS_RTR;
	a.path_mtu = mtu;
	a.dest_qp_num = dest_qpn;
	a.rq_psn = rq_psn;
	a.max_dest_rd_atomic = max_dest_rd_atomic;
	a.min_rnr_timer = 1;
	a.ah_attr.is_global = 1;
	memcpy(a.ah_attr.grh.dgid.raw, gid, 16);
	a.ah_attr.grh.hop_limit = 1;
	a.ah_attr.port_num = 1;
	if (ibv_modify_qp(qp, &a,
			  IBV_QP_STATE | IBV_QP_AV | IBV_QP_PATH_MTU | IBV_QP_DEST_QPN |
				  IBV_QP_RQ_PSN | IBV_QP_MAX_DEST_RD_ATOMIC | IBV_QP_MIN_RNR_TIMER))
		die("to RTR");
}

/* RTS sending from PSN `sq_psn`, with the retry counts at their maximum. */
static inline void qp_to_rts(struct ibv_qp *qp, uint32_t sq_psn, uint8_t max_rd_atomic)
{
	struct ibv_qp_attr a = {0};
	a.qp_state = IBV_QPS_RTS;
	a.timeout = 14;
	a.retry_cnt = 7;
	a.rnr_retry = 7;
	a.sq_psn = sq_psn;
	a.max_rd_atomic = max_rd_atomic;
	if (ibv_modify_qp(qp, &a,
			  IBV_QP_STATE | IBV_QP_TIMEOUT | IBV_QP_RETRY_CNT | IBV_QP_RNR_RETRY |
				  IBV_QP_SQ_PSN | IBV_QP_MAX_QP_RD_ATOMIC))
		die("to RTS");
}

#endif
