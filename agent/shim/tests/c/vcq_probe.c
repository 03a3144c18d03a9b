/* What an application may rely on from CQs and completion channels, checked on one device
 * with a QP connected to another QP of the same process (loopback). It must pass on the
 * bare device and through the shim's virtual CQs alike:
 *  - ibv_query_qp reports the CQs the application created;
 *  - a channel's fd is pollable; made non-blocking, ibv_get_cq_event says EAGAIN when
 *    nothing is pending;
 *  - one channel serving two armed CQs yields an event for each, naming the right CQ and
 *    its cq_context;
 *  - MESSAGES SEND_WITH_IMM, a window of them in flight, driven by events only, arrive
 *    complete and in order with the right bytes; then the completion rate is printed;
 *  - a channel with CQs and a CQ with a QP cannot be destroyed; in the right order they
 *    can;
 *  - a CQ that overruns is named by its asynchronous event (IBV_EVENT_CQ_ERR), and once
 *    the event is acknowledged the CQ can be destroyed.
 * Prints "rate R" then "vcq ok" and exits 0 on success.
 * Usage: vcq_probe MESSAGES */
#include <infiniband/verbs.h>
#include "loopback.h"
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define DEPTH 32
#define SIZE 256

static union ibv_gid gid;

static void die(const char *m) { fprintf(stderr, "vcq_probe: %s (errno %d)\n", m, errno); exit(2); }

static double now(void) {
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void connect_qp(struct ibv_qp *qp, uint32_t dest) {
	const char *failed = loopback_connect(qp, dest, &gid, 0);
	if (failed) die(failed);
}

static char *buf;
static struct ibv_mr *mr;
static struct ibv_qp *tx, *rx;

static void fill(char *p, int seq) {
	for (int i = 0; i < SIZE; i++) p[i] = (char)(seq * 13 + i);
}

static void post_recv(int slot) {
	struct ibv_sge s = { (uintptr_t)(buf + (DEPTH + slot) * SIZE), SIZE, mr->lkey };
	struct ibv_recv_wr w = { .wr_id = slot, .sg_list = &s, .num_sge = 1 }, *bad;
	if (ibv_post_recv(rx, &w, &bad)) die("post_recv");
}

static void post_send(int seq) {
	int slot = seq % DEPTH;
	fill(buf + slot * SIZE, seq);
	struct ibv_sge s = { (uintptr_t)(buf + slot * SIZE), SIZE, mr->lkey };
	struct ibv_send_wr w = { .wr_id = seq, .sg_list = &s, .num_sge = 1,
		.opcode = IBV_WR_SEND_WITH_IMM, .send_flags = IBV_SEND_SIGNALED,
		.imm_data = htobe32(seq) }, *bad;
	if (ibv_post_send(tx, &w, &bad)) die("post_send");
}

/* Waits up to 5 s for the channel, then takes one event. Readiness may be spurious, as
 * select(2) warns: the non-blocking fd may then say EAGAIN, and the wait goes on. */
static struct ibv_cq *next_event(struct ibv_comp_channel *ch, void **cq_ctx) {
	double end = now() + 5;
	for (;;) {
		struct pollfd p = { .fd = ch->fd, .events = POLLIN };
		int left = (int)((end - now()) * 1000);
		if (left <= 0 || poll(&p, 1, left) != 1) die("no event within 5 s");
		struct ibv_cq *cq;
		if (ibv_get_cq_event(ch, &cq, cq_ctx) == 0) return cq;
		if (errno != EAGAIN) die("ibv_get_cq_event after POLLIN");
	}
}

/* Fills a 4-entry CQ that nobody polls with 64 completions and waits for its overrun event. */
static void overrun(struct ibv_context *ctx, struct ibv_pd *pd) {
	struct ibv_cq *small = ibv_create_cq(ctx, 4, NULL, NULL, 0);
	if (!small) die("small cq");
	struct ibv_qp_init_attr ia = { .send_cq = small, .recv_cq = small, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = DEPTH, .max_recv_wr = DEPTH, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *a = ibv_create_qp(pd, &ia), *b = ibv_create_qp(pd, &ia);
	if (!a || !b) die("overrun qps");
	connect_qp(a, b->qp_num);
	connect_qp(b, a->qp_num);
	struct ibv_sge sg = { (uintptr_t)buf, SIZE, mr->lkey };
	for (int i = 0; i < DEPTH; i++) {
		struct ibv_recv_wr r = { .wr_id = i, .sg_list = &sg, .num_sge = 1 }, *badr;
		struct ibv_send_wr w = { .wr_id = i, .sg_list = &sg, .num_sge = 1, .opcode = IBV_WR_SEND,
			.send_flags = IBV_SEND_SIGNALED }, *bads;
		if (ibv_post_recv(b, &r, &badr) || ibv_post_send(a, &w, &bads)) die("overrun posts");
	}
	struct ibv_async_event ev;
	for (;;) {
		struct pollfd p = { .fd = ctx->async_fd, .events = POLLIN };
		if (poll(&p, 1, 5000) != 1) die("no CQ overrun event within 5 s");
		if (ibv_get_async_event(ctx, &ev)) die("ibv_get_async_event");
		int mine = ev.event_type == IBV_EVENT_CQ_ERR && ev.element.cq == small;
		if (ev.event_type == IBV_EVENT_CQ_ERR && !mine) die("the overrun event names another CQ");
		ibv_ack_async_event(&ev);
		if (mine) break;
	}
	if (ibv_destroy_qp(a) || ibv_destroy_qp(b) || ibv_destroy_cq(small)) die("overrun teardown");
}

int main(int argc, char **argv) {
	int msgs = argc > 1 ? atoi(argv[1]) : 1000;
	struct ibv_device **devs = ibv_get_device_list(NULL);
	if (!devs || !devs[0]) die("no device");
	struct ibv_context *ctx = ibv_open_device(devs[0]);
	if (!ctx) die("open");
	if (ibv_query_gid(ctx, 1, 0, &gid)) die("gid");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	if (!pd || !ch) die("pd/channel");
	int tag_s, tag_r;
	struct ibv_cq *scq = ibv_create_cq(ctx, DEPTH, &tag_s, ch, 0);
	struct ibv_cq *rcq = ibv_create_cq(ctx, DEPTH, &tag_r, ch, 0);
	if (!scq || !rcq) die("cq");
	buf = calloc(2 * DEPTH, SIZE);
	mr = ibv_reg_mr(pd, buf, 2 * DEPTH * SIZE, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_qp_init_attr ia = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = DEPTH, .max_recv_wr = DEPTH, .max_send_sge = 1, .max_recv_sge = 1 } };
	tx = ibv_create_qp(pd, &ia);
	if (ia.send_cq != scq || ia.recv_cq != rcq) die("ibv_create_qp changed the caller's attributes");
	rx = ibv_create_qp(pd, &ia);
	if (!mr || !tx || !rx) die("mr/qp");
	connect_qp(tx, rx->qp_num);
	connect_qp(rx, tx->qp_num);

	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	if (ibv_query_qp(tx, &qa, IBV_QP_STATE, &qi)) die("query_qp");
	if (qi.send_cq != scq || qi.recv_cq != rcq) die("ibv_query_qp names other CQs");

	int fl = fcntl(ch->fd, F_GETFL);
	if (fl < 0 || fcntl(ch->fd, F_SETFL, fl | O_NONBLOCK)) die("fcntl");
	struct ibv_cq *cq;
	void *cq_ctx;
	errno = 0;
	if (ibv_get_cq_event(ch, &cq, &cq_ctx) != -1 || errno != EAGAIN) die("an idle non-blocking channel must say EAGAIN");

	/* Both CQs armed on one channel: one message gives one event each. */
	for (int i = 0; i < DEPTH; i++) post_recv(i);
	if (ibv_req_notify_cq(scq, 0) || ibv_req_notify_cq(rcq, 0)) die("arm");
	post_send(0);
	int seen_s = 0, seen_r = 0;
	while (!(seen_s && seen_r)) {
		cq = next_event(ch, &cq_ctx);
		if (cq == scq && cq_ctx == &tag_s) seen_s++;
		else if (cq == rcq && cq_ctx == &tag_r) seen_r++;
		else die("event names a CQ or context the application did not create");
		ibv_ack_cq_events(cq, 1);
	}
	if (seen_s != 1 || seen_r != 1) die("one event per armed CQ expected");
	struct ibv_wc wc[DEPTH];
	int n;
	do n = ibv_poll_cq(scq, DEPTH, wc); while (n == 0);
	if (n != 1 || wc[0].status || wc[0].wr_id != 0 || wc[0].opcode != IBV_WC_SEND) die("send completion");
	do n = ibv_poll_cq(rcq, DEPTH, wc); while (n == 0);
	if (n != 1 || wc[0].status || be32toh(wc[0].imm_data) != 0 || wc[0].byte_len != SIZE) die("receive completion");
	post_recv((int)wc[0].wr_id);

	/* Streaming, events only. */
	int sent = 1, sdone = 1, rdone = 1;
	double t0 = now();
	if (ibv_req_notify_cq(scq, 0) || ibv_req_notify_cq(rcq, 0)) die("arm");
	while (sent < msgs && sent - sdone < DEPTH / 2) post_send(sent++);
	while (sdone < msgs || rdone < msgs) {
		cq = next_event(ch, &cq_ctx);
		ibv_ack_cq_events(cq, 1);
		if (ibv_req_notify_cq(cq, 0)) die("re-arm");
		while ((n = ibv_poll_cq(cq, DEPTH, wc)) > 0) {
			for (int i = 0; i < n; i++) {
				if (wc[i].status) die("completion error");
				if (cq == scq) {
					if ((int)wc[i].wr_id != sdone++) die("send completions out of order");
				} else {
					char want[SIZE];
					int slot = (int)wc[i].wr_id;
					fill(want, rdone);
					if (be32toh(wc[i].imm_data) != (uint32_t)rdone) die("receives out of order");
					if (memcmp(want, buf + (DEPTH + slot) * SIZE, SIZE)) die("payload differs");
					rdone++;
					post_recv(slot);
				}
			}
		}
		if (n < 0) die("poll");
		while (sent < msgs && sent - sdone < DEPTH / 2 && sent - rdone < DEPTH / 2) post_send(sent++);
	}
	double secs = now() - t0;
	printf("rate %.0f\n", 2.0 * (msgs - 1) / secs);

	if (ibv_destroy_comp_channel(ch) == 0) die("a channel with CQs was destroyed");
	if (ibv_destroy_cq(scq) == 0) die("a CQ with a QP was destroyed");
	if (ibv_destroy_qp(tx) || ibv_destroy_qp(rx)) die("destroy qp");
	if (ibv_destroy_cq(scq) || ibv_destroy_cq(rcq)) die("destroy cq");
	if (ibv_destroy_comp_channel(ch)) die("destroy channel");
	overrun(ctx, pd);
	if (ibv_dereg_mr(mr) || ibv_dealloc_pd(pd) || ibv_close_device(ctx)) die("teardown");
	ibv_free_device_list(devs);
	printf("vcq ok\n");
	return 0;
}
