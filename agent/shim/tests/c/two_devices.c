/* Two RDMA devices of one host in one process: a context on each of the first two devices,
 * each with its own PD, CQs and memory, and QP pairs across them (device 0 sends to device
 * 1, and device 1 to device 0), MESSAGES signalled SENDs each way, a window of 8, every
 * payload and the order checked. Each round posts on both devices before polling either. Prints "devices ok" and exits 0 on success.
 * Usage: two_devices MESSAGES */
#include <infiniband/verbs.h>
#include "loopback.h"
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIZE 128
#define WINDOW 8

struct side {
	struct ibv_context *ctx;
	struct ibv_pd *pd;
	struct ibv_cq *scq, *rcq;
	struct ibv_mr *mr;
	char *buf; /* WINDOW send slots, then WINDOW receive slots */
	union ibv_gid gid;
	struct ibv_qp *tx, *rx; /* tx sends to the other side's rx */
	int sent, acked, got;
};

static void die(const char *m) { perror(m); exit(2); }

static void fill(char *p, int dev, int seq) {
	for (int i = 0; i < SIZE; i++) p[i] = (char)(dev * 17 + seq * 3 + i);
}

static void post_recv(struct side *s, int slot) {
	struct ibv_sge sg = { (uintptr_t)(s->buf + (WINDOW + slot) * SIZE), SIZE, s->mr->lkey };
	struct ibv_recv_wr w = { .wr_id = slot, .sg_list = &sg, .num_sge = 1 }, *bad;
	if (ibv_post_recv(s->rx, &w, &bad)) die("post_recv");
}

int main(int argc, char **argv) {
	if (argc != 2) { fprintf(stderr, "usage: two_devices MESSAGES\n"); return 2; }
	int msgs = atoi(argv[1]), n;
	struct ibv_device **l = ibv_get_device_list(&n);
	if (!l || n < 2) { fprintf(stderr, "needs two devices, found %d\n", l ? n : 0); return 2; }
	struct side s[2];
	memset(s, 0, sizeof s);
	for (int d = 0; d < 2; d++) {
		s[d].ctx = ibv_open_device(l[d]);
		if (!s[d].ctx) die("open");
		s[d].pd = ibv_alloc_pd(s[d].ctx);
		s[d].scq = ibv_create_cq(s[d].ctx, WINDOW, 0, 0, 0);
		s[d].rcq = ibv_create_cq(s[d].ctx, WINDOW, 0, 0, 0);
		s[d].buf = calloc(2 * WINDOW, SIZE);
		if (!s[d].pd || !s[d].scq || !s[d].rcq || !s[d].buf || ibv_query_gid(s[d].ctx, 1, 0, &s[d].gid))
			die("setup");
		s[d].mr = ibv_reg_mr(s[d].pd, s[d].buf, 2 * WINDOW * SIZE, IBV_ACCESS_LOCAL_WRITE);
		struct ibv_qp_init_attr ia = { .send_cq = s[d].scq, .recv_cq = s[d].rcq, .qp_type = IBV_QPT_RC,
			.cap = { .max_send_wr = WINDOW, .max_recv_wr = WINDOW, .max_send_sge = 1, .max_recv_sge = 1 } };
		s[d].tx = ibv_create_qp(s[d].pd, &ia);
		s[d].rx = ibv_create_qp(s[d].pd, &ia);
		if (!s[d].mr || !s[d].tx || !s[d].rx) die("mr/qp");
	}
	for (int d = 0; d < 2; d++) {
		struct side *me = &s[d], *peer = &s[1 - d];
		const char *failed = loopback_connect(me->tx, peer->rx->qp_num, &peer->gid, 0);
		if (!failed) failed = loopback_connect(me->rx, peer->tx->qp_num, &peer->gid, 0);
		if (failed) die(failed);
		for (int k = 0; k < WINDOW; k++) post_recv(me, k);
	}
	for (int done = 0; done < 2;) {
		for (int d = 0; d < 2; d++) {
			struct side *me = &s[d];
			while (me->sent < msgs && me->sent - me->acked < WINDOW) {
				char *src = me->buf + (me->sent % WINDOW) * SIZE;
				fill(src, d, me->sent);
				struct ibv_sge sg = { (uintptr_t)src, SIZE, me->mr->lkey };
				struct ibv_send_wr w = { .wr_id = me->sent, .sg_list = &sg, .num_sge = 1,
					.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
				if (ibv_post_send(me->tx, &w, &bad)) die("post_send");
				me->sent++;
			}
		}
		/* Both devices post before either polls: both have work in flight at once. */
		for (int d = 0; d < 2; d++) {
			struct side *me = &s[d];
			struct ibv_wc wc[8];
			int k = ibv_poll_cq(me->scq, 8, wc);
			for (int i = 0; i < k; i++) {
				if (wc[i].status) { fprintf(stderr, "send status %d\n", wc[i].status); return 1; }
				me->acked++;
			}
			k = ibv_poll_cq(me->rcq, 8, wc);
			for (int i = 0; i < k; i++) {
				char want[SIZE], *at = me->buf + (WINDOW + wc[i].wr_id) * SIZE;
				fill(want, 1 - d, me->got);
				if (wc[i].status || wc[i].byte_len != SIZE || memcmp(at, want, SIZE)) {
					fprintf(stderr, "device %d: receive %d wrong\n", d, me->got);
					return 1;
				}
				post_recv(me, (int)wc[i].wr_id);
				if (++me->got == msgs) done++;
			}
		}
	}
	for (int d = 0; d < 2; d++) {
		while (s[d].acked < msgs) {
			struct ibv_wc wc;
			int k = ibv_poll_cq(s[d].scq, 1, &wc);
			if (k < 0 || (k && wc.status)) die("send completion");
			s[d].acked += k;
		}
		if (ibv_destroy_qp(s[d].tx) || ibv_destroy_qp(s[d].rx) || ibv_dereg_mr(s[d].mr) ||
		    ibv_destroy_cq(s[d].scq) || ibv_destroy_cq(s[d].rcq) || ibv_dealloc_pd(s[d].pd) ||
		    ibv_close_device(s[d].ctx))
			die("teardown");
	}
	ibv_free_device_list(l);
	printf("devices ok\n");
	return 0;
}
