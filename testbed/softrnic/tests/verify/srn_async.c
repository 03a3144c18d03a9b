/*
 * srn_async: asynchronous events over libibverbs (used by softrnic's integration tests; plain
 * verbs, so it runs on any RoCE device with SRQ limit events).
 *
 *   srn_async server PORT
 *   srn_async client SERVER_IP PORT
 *
 * The server has an SRQ of SRQ_WR receives and an RC QP that takes its receives from it; the
 * QP is left in RTR (it only receives). The client connects an RC QP and, on each command
 * from the server over TCP (a count), posts that many SENDs and reports when they completed.
 * The server checks, waiting for each event with poll() on the context's async_fd and a
 * timeout:
 *   1. 11 SENDs (5 receives left, limit 4): IBV_EVENT_COMM_EST for the QP (first packet in
 *      RTR), and no SRQ limit event;
 *   2. 2 SENDs (3 left): IBV_EVENT_SRQ_LIMIT_REACHED with element.srq the SRQ, and
 *      ibv_query_srq then reports the limit disarmed (0);
 *   3. 2 SENDs more (1 left): no second event (one per arming);
 *   4. 8 receives posted, limit re-armed at 8, 2 SENDs (9 -> 7 left): the event again;
 *      meanwhile the receive CQ, armed with ibv_req_notify_cq(cq, 1) (solicited only) on a
 *      completion channel, got no completion event for these 17 unsolicited SENDs; one SEND
 *      with IBV_SEND_SOLICITED then fires it;
 *   5. the QP moved to the error state: IBV_EVENT_QP_LAST_WQE_REACHED with element.qp the QP,
 *      acknowledged, then the QP destroyed;
 *   6. a second QP of the SRQ moved to error and destroyed without reading its event: the
 *      destroy returns and the event is never delivered (it went with the QP);
 *   7. a third one moved to error, its event read but not acknowledged: ibv_destroy_qp (in a
 *      thread) waits until ibv_ack_async_event, then returns 0 — as on a kernel device.
 * An alarm fails the program if anything hangs. Exit status 0 and a final line "OK ..." when
 * everything matched; otherwise a message and 1.
 */
#define _GNU_SOURCE
#include <poll.h>
#include <pthread.h>

#include "srn_common.h"

#define SRQ_WR 16
#define BUF 64
#define EVENT_WAIT_MS 5000
#define QUIET_MS 300
#define SOLICITED 0x80000000u /* in a command: the SENDs carry IBV_SEND_SOLICITED */

struct qpinfo {
	uint32_t qpn, psn;
	uint8_t gid[16];
};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static struct ibv_comp_channel *channel; /* the server's, for solicited events */
static struct ibv_mr *mr;
static uint8_t *buf;
static enum ibv_mtu mtu;

static void open_dev(int with_channel)
{
	ctx = open_first_device();
	mtu = port_mtu(ctx);
	pd = ibv_alloc_pd(ctx);
	if (with_channel && !(channel = ibv_create_comp_channel(ctx)))
		die("create_comp_channel");
	cq = ibv_create_cq(ctx, 4 * SRQ_WR, NULL, channel, 0);
	if (!pd || !cq)
		die("pd/cq");
	if (posix_memalign((void **)&buf, 4096, 4 * SRQ_WR * BUF))
		die("malloc");
	mr = ibv_reg_mr(pd, buf, 4 * SRQ_WR * BUF, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		die("reg_mr");
}

static struct ibv_qp *make_qp(struct ibv_srq *srq)
{
	struct ibv_qp *qp = create_rc_qp(pd, cq, cq, srq, SRQ_WR, srq ? 0 : 1);
	qp_to_init(qp, 0);
	return qp;
}

static void my_info(struct ibv_qp *qp, struct qpinfo *mine)
{
	mine->qpn = qp->qp_num;
	mine->psn = (uint32_t)(lrand48() & 0xffffff);
	local_gid(ctx, mine->gid);
}

static void to_err(struct ibv_qp *qp)
{
	struct ibv_qp_attr a = {.qp_state = IBV_QPS_ERR};
	if (ibv_modify_qp(qp, &a, IBV_QP_STATE))
		die("to ERR");
}

/* Whether fd (the async fd, a completion channel) is readable within ms milliseconds. */
static int readable(int fd, int ms)
{
	struct pollfd p = {.fd = fd, .events = POLLIN};
	int n = poll(&p, 1, ms);
	if (n < 0)
		die("poll");
	return n > 0;
}

static int event_ready(int ms)
{
	return readable(ctx->async_fd, ms);
}

/* Read the next event: it must be `type` about `element` (a QP, SRQ or CQ pointer). */
static void expect_event(enum ibv_event_type type, void *element, struct ibv_async_event *ev)
{
	if (!event_ready(EVENT_WAIT_MS)) {
		fprintf(stderr, "FAIL: no %s within %d ms\n", ibv_event_type_str(type),
			EVENT_WAIT_MS);
		exit(1);
	}
	if (ibv_get_async_event(ctx, ev))
		die("ibv_get_async_event");
	void *got = type == IBV_EVENT_SRQ_LIMIT_REACHED ? (void *)ev->element.srq
						       : (void *)ev->element.qp;
	if (ev->event_type != type || got != element) {
		fprintf(stderr, "FAIL: got %s about %p, expected %s about %p\n",
			ibv_event_type_str(ev->event_type), got, ibv_event_type_str(type), element);
		exit(1);
	}
}

static void expect_and_ack(enum ibv_event_type type, void *element)
{
	struct ibv_async_event ev;
	expect_event(type, element, &ev);
	ibv_ack_async_event(&ev);
}

static void expect_quiet(const char *when)
{
	if (event_ready(QUIET_MS)) {
		struct ibv_async_event ev;
		ibv_get_async_event(ctx, &ev);
		fprintf(stderr, "FAIL: unexpected %s %s\n", ibv_event_type_str(ev.event_type),
			when);
		exit(1);
	}
}

static void post_srq(struct ibv_srq *srq, int n, int first)
{
	for (int i = 0; i < n; i++) {
		struct ibv_sge s = {.addr = (uintptr_t)(buf + (size_t)(first + i) * BUF),
				    .length = BUF,
				    .lkey = mr->lkey};
		struct ibv_recv_wr wr = {.wr_id = (uint64_t)(first + i), .sg_list = &s, .num_sge = 1},
				   *bad;
		if (ibv_post_srq_recv(srq, &wr, &bad))
			die("post_srq_recv");
	}
}

static void arm(struct ibv_srq *srq, uint32_t limit)
{
	struct ibv_srq_attr a = {.srq_limit = limit};
	if (ibv_modify_srq(srq, &a, IBV_SRQ_LIMIT))
		die("modify_srq IBV_SRQ_LIMIT");
	if (ibv_query_srq(srq, &a) || a.srq_limit != limit)
		die("query_srq after arming");
}

/* Have the client send n messages; returns once they completed on its side. */
static void client_sends(int fd, uint32_t n)
{
	xfer(fd, &n, sizeof n, 1);
	uint32_t done;
	xfer(fd, &done, sizeof done, 0);
	n &= ~SOLICITED;
	if (done != n)
		die("client reported another count");
}

static void *destroy_thread(void *qp)
{
	return (void *)(intptr_t)ibv_destroy_qp(qp);
}

static int server(int port)
{
	open_dev(1);
	struct ibv_srq_init_attr si = {.attr = {.max_wr = SRQ_WR, .max_sge = 1}};
	struct ibv_srq *srq = ibv_create_srq(pd, &si);
	if (!srq)
		die("create_srq");
	post_srq(srq, SRQ_WR, 0);
	struct ibv_qp *qp = make_qp(srq);
	int fd = tcp_accept(tcp_listen(port, 1));
	struct qpinfo mine, peer;
	xfer(fd, &peer, sizeof peer, 0);
	my_info(qp, &mine);
	/* Only receives: RTR is enough, and the first packet then establishes communication. */
	qp_to_rtr(qp, mtu, peer.qpn, peer.psn, peer.gid, 1);
	xfer(fd, &mine, sizeof mine, 1);
	arm(srq, 4);
	if (ibv_req_notify_cq(cq, 1))
		die("req_notify_cq solicited-only");

	client_sends(fd, 11); /* 5 left */
	expect_and_ack(IBV_EVENT_COMM_EST, qp);
	expect_quiet("with 5 receives left and the limit at 4");

	client_sends(fd, 2); /* 3 left */
	expect_and_ack(IBV_EVENT_SRQ_LIMIT_REACHED, srq);
	struct ibv_srq_attr a;
	if (ibv_query_srq(srq, &a) || a.srq_limit != 0)
		die("the limit is still armed after its event");

	client_sends(fd, 2); /* 1 left */
	expect_quiet("after the limit event, before re-arming");

	post_srq(srq, 8, SRQ_WR); /* 9 queued */
	arm(srq, 8);
	client_sends(fd, 2); /* 7 left */
	expect_and_ack(IBV_EVENT_SRQ_LIMIT_REACHED, srq);

	if (readable(channel->fd, 0))
		die("a completion event for unsolicited SENDs on a solicited-only CQ");
	client_sends(fd, 1 | SOLICITED); /* 6 left */
	if (!readable(channel->fd, EVENT_WAIT_MS))
		die("no completion event for a solicited SEND");
	struct ibv_cq *ev_cq;
	void *ev_ctx;
	if (ibv_get_cq_event(channel, &ev_cq, &ev_ctx) || ev_cq != cq)
		die("ibv_get_cq_event");
	ibv_ack_cq_events(cq, 1);

	to_err(qp);
	expect_and_ack(IBV_EVENT_QP_LAST_WQE_REACHED, qp);
	if (ibv_destroy_qp(qp))
		die("destroy_qp after its events were acknowledged");

	/* An event nobody read goes with its QP. */
	struct ibv_qp *qp2 = make_qp(srq);
	to_err(qp2);
	if (!event_ready(EVENT_WAIT_MS))
		die("no event for the second QP");
	if (ibv_destroy_qp(qp2))
		die("destroy_qp with an unread event");
	expect_quiet("after destroying the QP it was about");

	/* An event read but not acknowledged holds the destroy back until it is. */
	struct ibv_qp *qp3 = make_qp(srq);
	to_err(qp3);
	struct ibv_async_event ev;
	expect_event(IBV_EVENT_QP_LAST_WQE_REACHED, qp3, &ev);
	pthread_t t;
	if (pthread_create(&t, NULL, destroy_thread, qp3))
		die("pthread_create");
	usleep(QUIET_MS * 1000);
	if (pthread_tryjoin_np(t, NULL) == 0)
		die("destroy_qp returned before the event was acknowledged");
	ibv_ack_async_event(&ev);
	void *ret;
	if (pthread_join(t, &ret) || ret != NULL)
		die("destroy_qp after the acknowledgement");

	uint32_t end = 0;
	xfer(fd, &end, sizeof end, 1);
	close(fd);
	if (ibv_destroy_srq(srq))
		die("destroy_srq");
	printf("OK async events: COMM_EST, SRQ_LIMIT_REACHED once per arming (twice), "
	       "QP_LAST_WQE_REACHED x3; destroy dropped an unread event and waited for an "
	       "unacknowledged one; solicited-only CQ event fired by the solicited SEND only\n");
	return 0;
}

static int client(const char *ip, int port)
{
	open_dev(0);
	struct ibv_qp *qp = make_qp(NULL);
	struct qpinfo mine, peer;
	my_info(qp, &mine);
	int fd = tcp_connect(ip, port);
	xfer(fd, &mine, sizeof mine, 1);
	xfer(fd, &peer, sizeof peer, 0);
	qp_to_rtr(qp, mtu, peer.qpn, peer.psn, peer.gid, 1);
	qp_to_rts(qp, mine.psn, 1);
	uint32_t total = 0;
	for (;;) {
		uint32_t n;
		xfer(fd, &n, sizeof n, 0);
		if (n == 0)
			break;
		int flags = IBV_SEND_SIGNALED | (n & SOLICITED ? IBV_SEND_SOLICITED : 0);
		n &= ~SOLICITED;
		for (uint32_t i = 0; i < n; i++) {
			struct ibv_sge s = {.addr = (uintptr_t)buf, .length = 8, .lkey = mr->lkey};
			struct ibv_send_wr wr = {.wr_id = i,
						 .sg_list = &s,
						 .num_sge = 1,
						 .opcode = IBV_WR_SEND,
						 .send_flags = flags},
					   *bad;
			if (ibv_post_send(qp, &wr, &bad))
				die("post_send");
			struct ibv_wc wc;
			int got;
			while ((got = ibv_poll_cq(cq, 1, &wc)) == 0)
				;
			if (got < 0 || wc.status != IBV_WC_SUCCESS)
				die("send completion");
		}
		total += n;
		xfer(fd, &n, sizeof n, 1);
	}
	printf("OK client: %u SENDs\n", total);
	return 0;
}

int main(int argc, char **argv)
{
	alarm(60); /* a hang (a destroy waiting for ever, a lost event) fails the program */
	srand48(getpid());
	if (argc == 3 && !strcmp(argv[1], "server"))
		return server(atoi(argv[2]));
	if (argc == 4 && !strcmp(argv[1], "client"))
		return client(argv[2], atoi(argv[3]));
	fprintf(stderr, "usage: srn_async server PORT | client SERVER_IP PORT\n");
	return 2;
}
