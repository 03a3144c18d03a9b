/* UD receives on a CQ made with ibv_create_cq_ex asking for no optional field
 * (wc_flags = 0) and read with plain ibv_poll_cq, as UCX's ud_verbs transport does. It sends
 * MESSAGES datagrams of distinct sizes and contents from one UD QP to another of the same
 * device, in rounds of 16; every other round it leaves the CQs alone for 100 ms before
 * polling (the shim's engine thread, passing at least every 20 ms, collects a CQ its
 * application leaves alone for 2 ms).
 * Every receive must carry what arrived: status, opcode, byte length (GRH included),
 * QP numbers, the GRH flag and the payload. Prints "ud ok" and exits 0 on success.
 * Usage: ud_cq_ex MESSAGES */
#include <infiniband/verbs.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#define ROUND 16
#define GRH 40
#define MAX 512
#define QKEY 0x11111111

static void die(const char *m) { fprintf(stderr, "ud_cq_ex: %s\n", m); exit(2); }

static struct ibv_cq *create_cq_ex(struct ibv_context *ctx) {
	struct ibv_cq_init_attr_ex a = { .cqe = 2 * ROUND, .wc_flags = 0 };
	struct ibv_cq_ex *cq = ibv_create_cq_ex(ctx, &a);
	if (!cq) die("ibv_create_cq_ex");
	return ibv_cq_ex_to_cq(cq);
}

static void to_rts(struct ibv_qp *qp) {
	struct ibv_qp_attr a = { .qp_state = IBV_QPS_INIT, .port_num = 1, .qkey = QKEY };
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_PKEY_INDEX | IBV_QP_PORT | IBV_QP_QKEY)) die("init");
	a.qp_state = IBV_QPS_RTR;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE)) die("rtr");
	a.qp_state = IBV_QPS_RTS; a.sq_psn = 1;
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE | IBV_QP_SQ_PSN)) die("rts");
}

static int size_of(int seq) { return 1 + (seq * 37) % MAX; }
static void fill(char *p, int seq) {
	for (int i = 0; i < size_of(seq); i++) p[i] = (char)(seq * 7 + i + 1);
}

/* Polls `cq` until `n` completions arrived, into `wc`. */
static void poll_n(struct ibv_cq *cq, int n, struct ibv_wc *wc) {
	for (int got = 0; got < n;) {
		int k = ibv_poll_cq(cq, n - got, wc + got);
		if (k < 0) die("poll");
		got += k;
	}
}

int main(int argc, char **argv) {
	if (argc != 2) { fprintf(stderr, "usage: ud_cq_ex MESSAGES\n"); return 2; }
	int msgs = atoi(argv[1]), n;
	struct ibv_device **l = ibv_get_device_list(&n);
	if (!l || n < 1) die("no device");
	struct ibv_context *ctx = ibv_open_device(l[0]);
	union ibv_gid gid;
	if (!ctx || ibv_query_gid(ctx, 1, 0, &gid)) die("open/gid");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *scq = create_cq_ex(ctx), *rcq = create_cq_ex(ctx);
	size_t slot = GRH + MAX;
	char *buf = calloc(2 * ROUND, slot);
	if (!pd || !buf) die("pd/buf");
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, 2 * ROUND * slot, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_qp_init_attr ia = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_UD,
		.cap = { .max_send_wr = ROUND, .max_recv_wr = ROUND, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *tx = ibv_create_qp(pd, &ia), *rx = ibv_create_qp(pd, &ia);
	if (!mr || !tx || !rx) die("mr/qp");
	to_rts(tx);
	to_rts(rx);
	struct ibv_ah_attr aa = { .is_global = 1, .port_num = 1,
		.grh = { .dgid = gid, .hop_limit = 1 } };
	struct ibv_ah *ah = ibv_create_ah(pd, &aa);
	if (!ah) die("ah");
	char *rbuf = buf + ROUND * slot;
	struct ibv_wc wc[ROUND];
	for (int base = 0; base < msgs; base += ROUND) {
		int count = msgs - base < ROUND ? msgs - base : ROUND;
		for (int i = 0; i < count; i++) {
			struct ibv_sge sg = { (uintptr_t)(rbuf + i * slot), slot, mr->lkey };
			struct ibv_recv_wr w = { .wr_id = i, .sg_list = &sg, .num_sge = 1 }, *bad;
			if (ibv_post_recv(rx, &w, &bad)) die("post_recv");
		}
		for (int i = 0; i < count; i++) {
			char *src = buf + i * slot;
			fill(src, base + i);
			struct ibv_sge sg = { (uintptr_t)src, size_of(base + i), mr->lkey };
			struct ibv_send_wr w = { .wr_id = i, .sg_list = &sg, .num_sge = 1,
				.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED,
				.wr.ud = { .ah = ah, .remote_qpn = rx->qp_num, .remote_qkey = QKEY } }, *bad;
			if (ibv_post_send(tx, &w, &bad)) die("post_send");
		}
		if ((base / ROUND) % 2) usleep(100000);
		poll_n(scq, count, wc);
		for (int i = 0; i < count; i++)
			if (wc[i].status || wc[i].opcode != IBV_WC_SEND || wc[i].qp_num != tx->qp_num)
				die("send completion");
		poll_n(rcq, count, wc);
		for (int i = 0; i < count; i++) {
			int seq = base + (int)wc[i].wr_id;
			char want[MAX];
			fill(want, seq);
			if (wc[i].status || wc[i].opcode != IBV_WC_RECV) die("receive status or opcode");
			if (wc[i].byte_len != (unsigned)(GRH + size_of(seq))) {
				fprintf(stderr, "ud_cq_ex: message %d: byte_len %u, sent %d + GRH\n", seq,
					wc[i].byte_len, size_of(seq));
				exit(2);
			}
			if (wc[i].qp_num != rx->qp_num || wc[i].src_qp != tx->qp_num) die("QP numbers");
			if (!(wc[i].wc_flags & IBV_WC_GRH)) die("GRH flag");
			if (memcmp(rbuf + wc[i].wr_id * slot + GRH, want, size_of(seq))) die("payload");
		}
	}
	if (ibv_destroy_ah(ah) || ibv_destroy_qp(tx) || ibv_destroy_qp(rx) || ibv_dereg_mr(mr) ||
	    ibv_destroy_cq(scq) || ibv_destroy_cq(rcq) || ibv_dealloc_pd(pd) || ibv_close_device(ctx))
		die("teardown");
	ibv_free_device_list(l);
	printf("ud ok\n");
	return 0;
}
