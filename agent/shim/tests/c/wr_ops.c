/* Every ibv_wr_* request kind a shim can hold back, checked end to end: each round posts one
 * batch on an RC QP (RDMA WRITE from an SGE, WRITE_WITH_IMM with inline data, SEND from
 * a list of two SGEs, FETCH_ADD, CMP_SWP, RDMA READ of what the WRITE wrote) and one on a
 * UD QP (SEND with an address set by ibv_wr_set_ud_addr, inline), both looped back to
 * QPs of the same device, and checks the bytes, the immediate data, the atomics' results,
 * and that every completion arrives in order without error. Inline buffers are scribbled
 * over as soon as they are handed over. Exit status 0 and "wr ok" on success.
 * Usage: wr_ops ROUNDS */
#include <infiniband/verbs.h>
#include "loopback.h"
#include <arpa/inet.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define QKEY 0x11111111u

static void die(const char *m) { fprintf(stderr, "wr_ops: %s\n", m); exit(2); }

static void fill(char *p, int n, int seed) {
	for (int i = 0; i < n; i++) p[i] = (char)(seed * 13 + i * 3 + 1);
}

/* Local layout: [0,64) write source, [64,128) read target, [128,136) fetch_add result,
 * [136,144) cmp_swp result, [144,208) send source. Remote: [0,64) written, [64,80) inline
 * write, [128,136) add counter, [136,144) swap word, [256,320) receives. */
static char lbuf[1024] __attribute__((aligned(64))), rbuf[1024] __attribute__((aligned(64)));

static struct ibv_wc wait_one(struct ibv_cq *cq) {
	struct ibv_wc wc;
	for (long spins = 0;; spins++) {
		int k = ibv_poll_cq(cq, 1, &wc);
		if (k < 0) die("poll_cq");
		if (k == 1) break;
		if (spins > 2000000000L) die("no completion");
	}
	if (wc.status) {
		fprintf(stderr, "wr_ops: completion %llu status %d\n", (unsigned long long)wc.wr_id, wc.status);
		exit(1);
	}
	return wc;
}

static void post_recv(struct ibv_qp *qp, struct ibv_mr *mr, char *at, int len, uint64_t id) {
	struct ibv_sge s = { (uintptr_t)at, len, mr->lkey };
	struct ibv_recv_wr w = { .wr_id = id, .sg_list = &s, .num_sge = 1 }, *bad;
	if (ibv_post_recv(qp, &w, &bad)) die("post_recv");
}

static void ud_ready(struct ibv_qp *qp) {
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = QKEY };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY)) die("ud init");
	a.qp_state = IBV_QPS_RTR;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE)) die("ud rtr");
	a.qp_state = IBV_QPS_RTS; a.sq_psn = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN)) die("ud rts");
}

int main(int argc, char **argv) {
	if (argc != 2) { fprintf(stderr, "usage: wr_ops ROUNDS\n"); return 2; }
	int rounds = atoi(argv[1]), n;
	struct ibv_device **l = ibv_get_device_list(&n);
	if (!l || n < 1) die("no device");
	struct ibv_context *ctx = ibv_open_device(l[0]);
	if (!ctx) die("open");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	union ibv_gid gid;
	if (!pd || ibv_query_gid(ctx, 1, 0, &gid)) die("pd/gid");
	struct ibv_cq *scq = ibv_create_cq(ctx, 64, 0, 0, 0), *rcq = ibv_create_cq(ctx, 64, 0, 0, 0);
	if (!scq || !rcq) die("cq");
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
		  IBV_ACCESS_REMOTE_ATOMIC;
	struct ibv_mr *lmr = ibv_reg_mr(pd, lbuf, sizeof lbuf, acc), *rmr = ibv_reg_mr(pd, rbuf, sizeof rbuf, acc);
	if (!lmr || !rmr) die("mr");

	struct ibv_qp_init_attr_ex ix = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 16, .max_recv_wr = 16, .max_send_sge = 2, .max_recv_sge = 1,
			 .max_inline_data = 64 },
		.pd = pd, .comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
		.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_RDMA_WRITE_WITH_IMM |
				  IBV_QP_EX_WITH_SEND | IBV_QP_EX_WITH_RDMA_READ |
				  IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD };
	struct ibv_qp *a = ibv_create_qp_ex(ctx, &ix);
	struct ibv_qp_init_attr ia = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC, .cap = ix.cap };
	struct ibv_qp *b = ibv_create_qp(pd, &ia);
	if (!a || !b) die("rc qp");
	const char *failed = loopback_connect(a, b->qp_num, &gid, acc);
	if (!failed) failed = loopback_connect(b, a->qp_num, &gid, acc);
	if (failed) die(failed);
	struct ibv_qp_ex *ax = ibv_qp_to_qp_ex(a);

	ix.qp_type = IBV_QPT_UD;
	ix.send_ops_flags = IBV_QP_EX_WITH_SEND;
	struct ibv_qp *u1 = ibv_create_qp_ex(ctx, &ix);
	ia.qp_type = IBV_QPT_UD;
	struct ibv_qp *u2 = ibv_create_qp(pd, &ia);
	if (!u1 || !u2 || !ax) die("ud qp");
	ud_ready(u1);
	ud_ready(u2);
	struct ibv_qp_ex *ux = ibv_qp_to_qp_ex(u1);
	struct ibv_ah_attr aa = { .is_global = 1, .grh = { .dgid = gid, .hop_limit = 1 }, .port_num = 1 };
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	if (!ux || !ah) die("ud ex/ah");

	for (int r = 0; r < rounds; r++) {
		char inl[16], want[64], inl_ud[8];
		post_recv(b, rmr, rbuf + 512, 64, 1000 + r); /* the WRITE_WITH_IMM's */
		post_recv(b, rmr, rbuf + 256, 64, 2000 + r); /* the SEND's */
		post_recv(u2, rmr, rbuf + 600, 40 + 8, 3000 + r);
		fill(lbuf, 64, r);
		fill(lbuf + 144, 64, r + 1000);
		fill(inl, 16, r + 500);
		memset(lbuf + 64, 0, 64);

		ibv_wr_start(ax);
		ax->wr_flags = IBV_SEND_SIGNALED;
		ax->wr_id = 1;
		ibv_wr_rdma_write(ax, rmr->rkey, (uintptr_t)rbuf);
		ibv_wr_set_sge(ax, lmr->lkey, (uintptr_t)lbuf, 64);
		ax->wr_id = 2;
		ibv_wr_rdma_write_imm(ax, rmr->rkey, (uintptr_t)rbuf + 64, htonl(r));
		ibv_wr_set_inline_data(ax, inl, 16);
		memset(inl, 0xEE, sizeof inl);
		ax->wr_id = 3;
		ibv_wr_send(ax);
		struct ibv_sge two[2] = { { (uintptr_t)lbuf + 144, 32, lmr->lkey },
					  { (uintptr_t)lbuf + 176, 32, lmr->lkey } };
		ibv_wr_set_sge_list(ax, 2, two);
		ax->wr_id = 4;
		ibv_wr_atomic_fetch_add(ax, rmr->rkey, (uintptr_t)rbuf + 128, 1);
		ibv_wr_set_sge(ax, lmr->lkey, (uintptr_t)lbuf + 128, 8);
		ax->wr_id = 5;
		ibv_wr_atomic_cmp_swp(ax, rmr->rkey, (uintptr_t)rbuf + 136, r, r + 1);
		ibv_wr_set_sge(ax, lmr->lkey, (uintptr_t)lbuf + 136, 8);
		ax->wr_id = 6;
		ibv_wr_rdma_read(ax, rmr->rkey, (uintptr_t)rbuf);
		ibv_wr_set_sge(ax, lmr->lkey, (uintptr_t)lbuf + 64, 64);
		if (ibv_wr_complete(ax)) die("wr_complete (rc)");

		ibv_wr_start(ux);
		ux->wr_id = 7;
		ux->wr_flags = IBV_SEND_SIGNALED;
		ibv_wr_send(ux);
		ibv_wr_set_ud_addr(ux, ah, u2->qp_num, QKEY);
		fill(inl_ud, 8, r + 700);
		ibv_wr_set_inline_data(ux, inl_ud, 8);
		memset(inl_ud, 0xEE, sizeof inl_ud);
		if (ibv_wr_complete(ux)) die("wr_complete (ud)");

		/* In order per QP (two QPs share the CQ: no order between them). */
		for (uint64_t next_rc = 1, ud_done = 0; next_rc <= 6 || !ud_done;) {
			struct ibv_wc wc = wait_one(scq);
			uint64_t want_id = wc.qp_num == u1->qp_num ? 7 : next_rc;
			if (wc.wr_id != want_id) {
				fprintf(stderr, "wr_ops: round %d: completion %llu, expected %llu\n", r,
					(unsigned long long)wc.wr_id, (unsigned long long)want_id);
				return 1;
			}
			if (want_id == 7) ud_done = 1; else next_rc++;
		}
		int saw_imm = 0, saw_send = 0, saw_ud = 0;
		for (int i = 0; i < 3; i++) {
			struct ibv_wc wc = wait_one(rcq);
			if (wc.wr_id == (uint64_t)(1000 + r)) {
				saw_imm = (wc.wc_flags & IBV_WC_WITH_IMM) && ntohl(wc.imm_data) == (uint32_t)r;
			} else if (wc.wr_id == (uint64_t)(2000 + r)) {
				saw_send = wc.byte_len == 64 && !memcmp(rbuf + 256, lbuf + 144, 64);
			} else if (wc.wr_id == (uint64_t)(3000 + r)) {
				fill(want, 8, r + 700);
				saw_ud = wc.byte_len == 48 && !memcmp(rbuf + 640, want, 8);
			}
		}
		if (!saw_imm || !saw_send || !saw_ud) {
			fprintf(stderr, "wr_ops: round %d: receives imm %d send %d ud %d\n", r, saw_imm, saw_send, saw_ud);
			return 1;
		}
		fill(want, 64, r);
		if (memcmp(rbuf, want, 64) || memcmp(lbuf + 64, want, 64)) {
			fprintf(stderr, "wr_ops: round %d: written or read bytes differ\n", r);
			return 1;
		}
		fill(want, 16, r + 500);
		if (memcmp(rbuf + 64, want, 16)) {
			fprintf(stderr, "wr_ops: round %d: inline write differs\n", r);
			return 1;
		}
		uint64_t added, swapped;
		memcpy(&added, lbuf + 128, 8);
		memcpy(&swapped, lbuf + 136, 8);
		if (added != (uint64_t)r || swapped != (uint64_t)r) {
			fprintf(stderr, "wr_ops: round %d: fetch_add %llu cmp_swp %llu\n", r,
				(unsigned long long)added, (unsigned long long)swapped);
			return 1;
		}
	}
	ibv_destroy_ah(ah);
	ibv_destroy_qp(u1); ibv_destroy_qp(u2); ibv_destroy_qp(a); ibv_destroy_qp(b);
	ibv_dereg_mr(lmr); ibv_dereg_mr(rmr);
	ibv_destroy_cq(scq); ibv_destroy_cq(rcq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(l);
	printf("wr ok\n");
	return 0;
}
