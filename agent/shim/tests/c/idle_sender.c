/* A sender that never polls its send CQ while it waits: it posts one signalled SEND on each
 * of QPS loopback QP pairs of one context, then polls only the receive CQ until every
 * message has arrived (or 5 s pass), and only then collects the send completions. Under
 * top-k gating with fewer slots than QPs, the later QPs get a slot only once the shim has
 * seen the earlier ones' completions, so the messages arrive only if the shim collects
 * completions itself rather than waiting for the application to poll them.
 * With "ex" the CQs are ibv_cq_ex with completion timestamps, read with ibv_start_poll, and
 * every completion must carry a timestamp (the shim must keep what it moved intact).
 * Prints "idle ok MS" (milliseconds until the last receive) and exits 0 on success.
 * Usage: idle_sender QPS [ex] */
#include <infiniband/verbs.h>
#include "loopback.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <errno.h>
#include <string.h>
#include <time.h>

#define SIZE 64

static int use_ex;

static void die(const char *m) { perror(m); exit(2); }

static struct ibv_cq *make_cq(struct ibv_context *ctx, int n) {
	if (!use_ex) return ibv_create_cq(ctx, n, 0, 0, 0);
	struct ibv_cq_init_attr_ex a = { .cqe = n,
		.wc_flags = IBV_WC_EX_WITH_QP_NUM | IBV_WC_EX_WITH_COMPLETION_TIMESTAMP };
	struct ibv_cq_ex *cq = ibv_create_cq_ex(ctx, &a);
	return cq ? ibv_cq_ex_to_cq(cq) : NULL;
}

/* Up to n completions, as ibv_poll_cq; with "ex" read through ibv_start_poll. */
static int poll_some(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
	if (!use_ex) return ibv_poll_cq(cq, n, wc);
	struct ibv_cq_ex *x = (struct ibv_cq_ex *)cq;
	struct ibv_poll_cq_attr pa = { 0 };
	int k = 0, rc = ibv_start_poll(x, &pa);
	if (rc == ENOENT) return 0;
	if (rc) return -1;
	while (!rc && k < n) {
		if (!ibv_wc_read_completion_ts(x)) { fprintf(stderr, "a completion without its timestamp\n"); exit(1); }
		wc[k] = (struct ibv_wc){ .wr_id = x->wr_id, .status = x->status, .qp_num = ibv_wc_read_qp_num(x) };
		k++;
		if (k < n) rc = ibv_next_poll(x);
	}
	ibv_end_poll(x);
	return k;
}

static double now_ms(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec * 1e3 + t.tv_nsec / 1e6;
}

int main(int argc, char **argv) {
	if (argc < 2 || argc > 3 || atoi(argv[1]) < 1 || (argc == 3 && strcmp(argv[2], "ex"))) {
		fprintf(stderr, "usage: idle_sender QPS [ex]\n");
		return 2;
	}
	use_ex = argc == 3;
	int nq = atoi(argv[1]), n;
	struct ibv_device **l = ibv_get_device_list(&n);
	if (!l || n < 1) { fprintf(stderr, "no device\n"); return 2; }
	struct ibv_context *ctx = ibv_open_device(l[0]);
	if (!ctx) die("open");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	union ibv_gid gid;
	if (!pd || ibv_query_gid(ctx, 1, 0, &gid)) die("pd/gid");
	struct ibv_cq *scq = make_cq(ctx, nq), *rcq = make_cq(ctx, nq);
	char *buf = calloc(2 * nq, SIZE);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 2 * nq * SIZE, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_qp **tx = calloc(nq, sizeof *tx), **rx = calloc(nq, sizeof *rx);
	if (!scq || !rcq || !buf || !mr || !tx || !rx) die("setup");
	for (int q = 0; q < nq; q++) {
		struct ibv_qp_init_attr ia = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
			.cap = { .max_send_wr = 4, .max_recv_wr = 4, .max_send_sge = 1, .max_recv_sge = 1 } };
		tx[q] = ibv_create_qp(pd, &ia);
		rx[q] = ibv_create_qp(pd, &ia);
		if (!tx[q] || !rx[q]) die("qp");
		const char *failed = loopback_connect(tx[q], rx[q]->qp_num, &gid, 0);
		if (!failed) failed = loopback_connect(rx[q], tx[q]->qp_num, &gid, 0);
		if (failed) die(failed);
		struct ibv_sge s = { (uintptr_t)(buf + (nq + q) * SIZE), SIZE, mr->lkey };
		struct ibv_recv_wr w = { .wr_id = q, .sg_list = &s, .num_sge = 1 }, *bad;
		if (ibv_post_recv(rx[q], &w, &bad)) die("post_recv");
	}
	double t0 = now_ms();
	for (int q = 0; q < nq; q++) {
		snprintf(buf + q * SIZE, SIZE, "message %d", q);
		struct ibv_sge s = { (uintptr_t)(buf + q * SIZE), SIZE, mr->lkey };
		struct ibv_send_wr w = { .wr_id = q, .sg_list = &s, .num_sge = 1,
			.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
		if (ibv_post_send(tx[q], &w, &bad)) die("post_send");
	}
	int got = 0;
	while (got < nq && now_ms() - t0 < 5000) {
		struct ibv_wc wc[8];
		int k = poll_some(rcq, 8, wc);
		if (k < 0) die("poll recv");
		for (int i = 0; i < k; i++) {
			char want[SIZE];
			snprintf(want, SIZE, "message %d", (int)wc[i].wr_id);
			if (wc[i].status || strcmp(buf + (nq + wc[i].wr_id) * SIZE, want)) {
				fprintf(stderr, "receive %d: status %d, data '%s'\n", (int)wc[i].wr_id,
					wc[i].status, buf + (nq + wc[i].wr_id) * SIZE);
				return 1;
			}
		}
		got += k;
	}
	double took = now_ms() - t0;
	if (got < nq) {
		fprintf(stderr, "%d of %d messages arrived while the sender did not poll\n", got, nq);
		return 1;
	}
	for (int done = 0; done < nq;) {
		struct ibv_wc wc;
		int k = poll_some(scq, 1, &wc);
		if (k < 0 || (k == 1 && wc.status)) die("send completion");
		done += k;
	}
	for (int q = 0; q < nq; q++) { ibv_destroy_qp(tx[q]); ibv_destroy_qp(rx[q]); }
	ibv_dereg_mr(mr);
	ibv_destroy_cq(scq); ibv_destroy_cq(rcq);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(l);
	printf("idle ok %.1f\n", took);
	return 0;
}
