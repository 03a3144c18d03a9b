/* Many threads, each posting on many QPs of one context at once: every QP pair is
 * connected to itself through the device (loopback), every message is a SEND_WITH_IMM
 * carrying its sequence number and a payload derived from it, some inline, most
 * unsignalled. The receiver checks that every QP's messages arrive complete, in order,
 * with the right bytes. Exit status 0 and "mt ok" on success. With "wr", the sending QPs
 * are created with ibv_create_qp_ex and post with the ibv_wr_* interface instead.
 * Usage: mt_qps THREADS QPS_PER_THREAD MESSAGES SIZE [wr] */
#include <infiniband/verbs.h>
#include "loopback.h"
#include <pthread.h>
#include <stdint.h>
#include <arpa/inet.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define DEPTH 64
#define SIGNAL_EVERY 8

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static union ibv_gid gid;
static int nq, msgs, size, use_wr;

struct pair {
	struct ibv_qp *tx, *rx;
	struct ibv_qp_ex *txx; /* with "wr" */
	char *buf; /* DEPTH send slots then DEPTH receive slots */
	struct ibv_mr *mr;
};

static void die(const char *m) { perror(m); exit(2); }

static void fill(char *p, int q, int seq) {
	for (int i = 0; i < size; i++) p[i] = (char)(q * 31 + seq * 7 + i);
}

static void connect_qp(struct ibv_qp *qp, uint32_t dest) {
	const char *failed = loopback_connect(qp, dest, &gid, IBV_ACCESS_REMOTE_WRITE);
	if (failed) die(failed);
}

static void post_recv(struct pair *p, int slot) {
	struct ibv_sge s = { (uintptr_t)(p->buf + (DEPTH + slot) * size), size, p->mr->lkey };
	struct ibv_recv_wr w = { .wr_id = slot, .sg_list = &s, .num_sge = 1 }, *bad;
	if (ibv_post_recv(p->rx, &w, &bad)) die("post_recv");
}

static void *worker(void *arg) {
	int t = (int)(intptr_t)arg;
	struct ibv_cq *scq = ibv_create_cq(ctx, nq * DEPTH, 0, 0, 0);
	struct ibv_cq *rcq = ibv_create_cq(ctx, nq * DEPTH, 0, 0, 0);
	if (!scq || !rcq) die("cq");
	struct pair *ps = calloc(nq, sizeof *ps);
	for (int q = 0; q < nq; q++) {
		struct pair *p = &ps[q];
		p->buf = calloc(2 * DEPTH, size);
		p->mr = ibv_reg_mr(pd, p->buf, 2 * DEPTH * size, IBV_ACCESS_LOCAL_WRITE);
		struct ibv_qp_init_attr ia = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
			.cap = { .max_send_wr = DEPTH, .max_recv_wr = DEPTH, .max_send_sge = 1,
				 .max_recv_sge = 1, .max_inline_data = 64 } };
		if (use_wr) {
			struct ibv_qp_init_attr_ex ix = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
				.cap = ia.cap, .pd = pd,
				.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS,
				.send_ops_flags = IBV_QP_EX_WITH_SEND_WITH_IMM };
			p->tx = ibv_create_qp_ex(ctx, &ix);
			if (p->tx && !(p->txx = ibv_qp_to_qp_ex(p->tx))) die("qp_to_qp_ex");
		} else
			p->tx = ibv_create_qp(pd, &ia);
		p->rx = ibv_create_qp(pd, &ia);
		if (!p->mr || !p->tx || !p->rx) die("qp");
		connect_qp(p->tx, p->rx->qp_num);
		connect_qp(p->rx, p->tx->qp_num);
		for (int s = 0; s < DEPTH; s++) post_recv(p, s);
	}
	int *sent = calloc(nq, sizeof(int)), *got = calloc(nq, sizeof(int)), *acked = calloc(nq, sizeof(int));
	int done = 0;
	while (done < nq) {
		for (int q = 0; q < nq; q++) {
			struct pair *p = &ps[q];
			/* Half the window at a time, as one list of WRs. */
			if (sent[q] >= msgs || sent[q] - acked[q] > DEPTH / 2) continue;
			struct ibv_send_wr w[DEPTH / 2], *bad;
			struct ibv_sge s[DEPTH / 2];
			int n = 0;
			while (n < DEPTH / 2 && sent[q] + n < msgs && sent[q] - acked[q] + n < DEPTH - SIGNAL_EVERY) {
				int seq = sent[q] + n, slot = seq % DEPTH;
				char *src = p->buf + slot * size;
				fill(src, t * 1000 + q, seq);
				s[n] = (struct ibv_sge){ (uintptr_t)src, size, p->mr->lkey };
				w[n] = (struct ibv_send_wr){ .wr_id = seq, .sg_list = &s[n], .num_sge = 1,
					.opcode = IBV_WR_SEND_WITH_IMM, .imm_data = htonl(seq),
					.send_flags = ((seq + 1) % SIGNAL_EVERY == 0 || seq + 1 == msgs ? IBV_SEND_SIGNALED : 0)
						      | (size <= 64 ? IBV_SEND_INLINE : 0),
					.next = 0 };
				if (n) w[n - 1].next = &w[n];
				n++;
			}
			if (n && use_wr) {
				/* The same requests, one batch. */
				ibv_wr_start(p->txx);
				for (int i = 0; i < n; i++) {
					p->txx->wr_id = w[i].wr_id;
					p->txx->wr_flags = w[i].send_flags & IBV_SEND_SIGNALED;
					ibv_wr_send_imm(p->txx, w[i].imm_data);
					if (w[i].send_flags & IBV_SEND_INLINE)
						ibv_wr_set_inline_data(p->txx, (void *)(uintptr_t)s[i].addr, s[i].length);
					else
						ibv_wr_set_sge(p->txx, s[i].lkey, s[i].addr, s[i].length);
				}
				if (ibv_wr_complete(p->txx)) die("wr_complete");
			} else if (n && ibv_post_send(p->tx, w, &bad)) die("post_send");
			/* Inline data is copied at post time: scribble over it now. */
			if (size <= 64) for (int i = 0; i < n; i++) memset((char *)(uintptr_t)s[i].addr, 0xEE, size);
			sent[q] += n;
		}
		struct ibv_wc wc[32];
		int k = ibv_poll_cq(scq, 32, wc);
		for (int i = 0; i < k; i++) {
			if (wc[i].status) { fprintf(stderr, "send wc status %d\n", wc[i].status); exit(1); }
			for (int q = 0; q < nq; q++)
				if (ps[q].tx->qp_num == wc[i].qp_num) acked[q] = (int)wc[i].wr_id + 1;
		}
		k = ibv_poll_cq(rcq, 32, wc);
		for (int i = 0; i < k; i++) {
			if (wc[i].status) { fprintf(stderr, "recv wc status %d\n", wc[i].status); exit(1); }
			int q = 0;
			while (q < nq && ps[q].rx->qp_num != wc[i].qp_num) q++;
			int seq = ntohl(wc[i].imm_data);
			if (q == nq || seq != got[q] || (int)wc[i].byte_len != size) {
				fprintf(stderr, "thread %d qp %d: got seq %d len %u, expected %d\n", t, q, seq, wc[i].byte_len, got[q]);
				exit(1);
			}
			char want[size];
			fill(want, t * 1000 + q, seq);
			if (memcmp(ps[q].buf + (DEPTH + (int)wc[i].wr_id) * size, want, size)) {
				fprintf(stderr, "thread %d qp %d seq %d: payload differs\n", t, q, seq);
				exit(1);
			}
			post_recv(&ps[q], (int)wc[i].wr_id);
			if (++got[q] == msgs) done++;
		}
	}
	for (int q = 0; q < nq; q++) {
		while (acked[q] < msgs) {
			struct ibv_wc wc;
			if (ibv_poll_cq(scq, 1, &wc) == 1) {
				if (wc.status) exit(1);
				for (int r = 0; r < nq; r++) if (ps[r].tx->qp_num == wc.qp_num) acked[r] = (int)wc.wr_id + 1;
			}
		}
	}
	for (int q = 0; q < nq; q++) {
		ibv_destroy_qp(ps[q].tx); ibv_destroy_qp(ps[q].rx); ibv_dereg_mr(ps[q].mr); free(ps[q].buf);
	}
	ibv_destroy_cq(scq); ibv_destroy_cq(rcq);
	return 0;
}

int main(int argc, char **argv) {
	if (argc != 5 && !(argc == 6 && !strcmp(argv[5], "wr"))) {
		fprintf(stderr, "usage: mt_qps THREADS QPS MESSAGES SIZE [wr]\n");
		return 2;
	}
	int nt = atoi(argv[1]); nq = atoi(argv[2]); msgs = atoi(argv[3]); size = atoi(argv[4]);
	use_wr = argc == 6;
	int n;
	struct ibv_device **l = ibv_get_device_list(&n);
	if (!l || n < 1) { fprintf(stderr, "no device\n"); return 2; }
	ctx = ibv_open_device(l[0]);
	if (!ctx) die("open");
	pd = ibv_alloc_pd(ctx);
	if (!pd || ibv_query_gid(ctx, 1, 0, &gid)) die("pd/gid");
	pthread_t th[nt];
	for (int t = 0; t < nt; t++) pthread_create(&th[t], 0, worker, (void *)(intptr_t)t);
	for (int t = 0; t < nt; t++) pthread_join(th[t], 0);
	ibv_dealloc_pd(pd);
	ibv_close_device(ctx);
	ibv_free_device_list(l);
	printf("mt ok\n");
	return 0;
}
