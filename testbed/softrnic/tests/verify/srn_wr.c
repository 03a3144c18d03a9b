/*
 * srn_wr: the ibv_wr_* posting interface (ibv_create_qp_ex + ibv_qp_to_qp_ex) over
 * libibverbs, for what ibv_rc_pingpong -N does not exercise (used by softrnic's
 * integration tests; plain verbs, so it runs on any device with the new post-send API).
 *
 *   srn_wr server PORT
 *   srn_wr client SERVER_IP PORT
 *
 * The server owns a 4 KiB MR (remote write, read, atomic) and a QP created the old way; the
 * client's QP comes from ibv_create_qp_ex with every basic send op, and posts only with
 * ibv_wr_*:
 *   1. one batch: RDMA WRITE of 256 bytes (SGE) to offset 0, RDMA WRITE of 16 inline bytes to
 *      offset 512 (the source buffer is overwritten right after ibv_wr_set_inline_data),
 *      FETCH_AND_ADD +5 at 1024, CMP_AND_SWP 0 -> 0x77 at 1032; four completions, in order,
 *      with the right opcodes, and the atomics' original values (0, 0);
 *   2. one batch of two RDMA READs that return what step 1 wrote;
 *   3. a batch aborted with ibv_wr_abort, an empty batch, a ibv_wr_set_sge before any
 *      request (EINVAL), and a batch whose second request has more inline data than the QP
 *      allows (EINVAL): none of them posts anything (offset 2048 is never written, and no
 *      completion comes);
 *   4. SEND_WITH_IMM of 32 bytes: the server's receive reports IBV_WC_WITH_IMM, the
 *      immediate and the bytes.
 * Both CQs come from ibv_create_cq_ex (byte length, immediate, QP number, timestamp): the
 * client reads its own with ibv_poll_cq; the server reads the receive with ibv_start_poll
 * and the ibv_wc_read_* functions (after an ibv_start_poll on the empty CQ said ENOENT).
 * The server then checks its memory: offsets 0 and 512 as written, 1024 = 5, 1032 = 0x77,
 * 2048 untouched.
 *
 * Exit status 0 and a final line "OK ..." when everything matched; otherwise a message and 1.
 */
#define _GNU_SOURCE
#include "srn_common.h"
#include <errno.h>

struct info {
	uint32_t qpn, psn, rkey, pad;
	uint64_t addr;
	uint8_t gid[16];
};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq_ex *cqx; /* read with ibv_start_poll by the server, ibv_poll_cq by the client */
static struct ibv_cq *cq;
static uint8_t *buf;
static struct ibv_mr *mr;

static void setup(void)
{
	ctx = open_first_device();
	pd = ibv_alloc_pd(ctx);
	struct ibv_cq_init_attr_ex ca = {.cqe = 64,
					 .wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_IMM |
						     IBV_WC_EX_WITH_QP_NUM |
						     IBV_WC_EX_WITH_COMPLETION_TIMESTAMP};
	cqx = ibv_create_cq_ex(ctx, &ca);
	cq = cqx ? ibv_cq_ex_to_cq(cqx) : NULL;
	buf = aligned_alloc(4096, 4096);
	memset(buf, 0, 4096);
	mr = ibv_reg_mr(pd, buf, 4096,
			IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
				IBV_ACCESS_REMOTE_ATOMIC);
	if (!pd || !cq || !mr)
		die("resources");
}

static struct ibv_wc wait_one(void)
{
	struct ibv_wc wc;
	for (int spins = 0; spins < 20000000; spins++) {
		int n = ibv_poll_cq(cq, 1, &wc);
		if (n < 0)
			die("poll_cq");
		if (n == 1) {
			if (wc.status != IBV_WC_SUCCESS) {
				fprintf(stderr, "completion %llu: %s\n", (unsigned long long)wc.wr_id,
					ibv_wc_status_str(wc.status));
				exit(1);
			}
			return wc;
		}
	}
	die("no completion");
	return wc;
}

static void connect_qp(struct ibv_qp *qp, int fd, int server, struct info *peer)
{
	struct info me = {.qpn = qp->qp_num, .psn = 1, .rkey = mr->rkey, .addr = (uintptr_t)buf};
	local_gid(ctx, me.gid);
	xfer(fd, server ? peer : &me, sizeof me, !server);
	xfer(fd, server ? &me : peer, sizeof me, server);
	qp_to_init(qp, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	qp_to_rtr(qp, port_mtu(ctx), peer->qpn, peer->psn, peer->gid, 4);
	qp_to_rts(qp, me.psn, 4);
}

static int server(int port)
{
	setup();
	struct ibv_qp *qp = create_rc_qp(pd, cq, cq, NULL, 16, 16);
	struct ibv_poll_cq_attr empty = {0};
	if (ibv_start_poll(cqx, &empty) != ENOENT)
		die("start_poll on an empty CQ");
	int ls = tcp_listen(port, 1), fd = tcp_accept(ls);
	struct info peer;
	connect_qp(qp, fd, 1, &peer);
	/* Long before the client's SEND (step 4). */
	struct ibv_sge sge = {(uintptr_t)(buf + 3072), 64, mr->lkey};
	struct ibv_recv_wr rwr = {.wr_id = 9, .sg_list = &sge, .num_sge = 1}, *bad;
	if (ibv_post_recv(qp, &rwr, &bad))
		die("post_recv");
	struct ibv_poll_cq_attr pa = {0};
	int rc;
	while ((rc = ibv_start_poll(cqx, &pa)) == ENOENT)
		;
	if (rc)
		die("start_poll");
	if (cqx->status != IBV_WC_SUCCESS || cqx->wr_id != 9 ||
	    ibv_wc_read_opcode(cqx) != IBV_WC_RECV || !(ibv_wc_read_wc_flags(cqx) & IBV_WC_WITH_IMM) ||
	    ntohl(ibv_wc_read_imm_data(cqx)) != 0xabcd || ibv_wc_read_byte_len(cqx) != 32 ||
	    ibv_wc_read_qp_num(cqx) != qp->qp_num || ibv_wc_read_completion_ts(cqx) == 0)
		die("SEND_WITH_IMM read wrong through ibv_cq_ex");
	if (ibv_next_poll(cqx) != ENOENT)
		die("a second completion");
	ibv_end_poll(cqx);
	char done;
	xfer(fd, &done, 1, 0);
	for (int i = 0; i < 256; i++)
		if (buf[i] != (uint8_t)(i * 7 + 1))
			die("RDMA WRITE data");
	if (memcmp(buf + 512, "inline-data-1234", 16))
		die("inline RDMA WRITE data");
	uint64_t fa, cas;
	memcpy(&fa, buf + 1024, 8);
	memcpy(&cas, buf + 1032, 8);
	if (fa != 5 || cas != 0x77)
		die("atomics");
	for (int i = 2048; i < 2304; i++)
		if (buf[i])
			die("a batch that must not post wrote memory");
	for (int i = 0; i < 32; i++)
		if (buf[3072 + i] != (uint8_t)(0xa0 + i))
			die("SEND data");
	printf("OK wr api: server memory as written; SEND_WITH_IMM read through ibv_cq_ex\n");
	return 0;
}

static int client(const char *ip, int port)
{
	setup();
	struct ibv_qp_init_attr_ex ia = {0};
	ia.send_cq = cq;
	ia.recv_cq = cq;
	ia.qp_type = IBV_QPT_RC;
	ia.cap.max_send_wr = 16;
	ia.cap.max_recv_wr = 16;
	ia.cap.max_send_sge = 1;
	ia.cap.max_recv_sge = 1;
	ia.cap.max_inline_data = 64;
	ia.comp_mask = IBV_QP_INIT_ATTR_PD | IBV_QP_INIT_ATTR_SEND_OPS_FLAGS;
	ia.pd = pd;
	ia.send_ops_flags = IBV_QP_EX_WITH_RDMA_WRITE | IBV_QP_EX_WITH_SEND |
			    IBV_QP_EX_WITH_SEND_WITH_IMM | IBV_QP_EX_WITH_RDMA_READ |
			    IBV_QP_EX_WITH_ATOMIC_CMP_AND_SWP | IBV_QP_EX_WITH_ATOMIC_FETCH_AND_ADD;
	struct ibv_qp *qp = ibv_create_qp_ex(ctx, &ia);
	if (!qp)
		die("create_qp_ex");
	struct ibv_qp_ex *x = ibv_qp_to_qp_ex(qp);
	if (!x)
		die("qp_to_qp_ex");
	int fd = tcp_connect(ip, port);
	struct info peer;
	connect_qp(qp, fd, 0, &peer);

	/* 1. writes and atomics in one batch */
	for (int i = 0; i < 256; i++)
		buf[i] = (uint8_t)(i * 7 + 1);
	char src[17] = "inline-data-1234";
	ibv_wr_start(x);
	x->wr_flags = IBV_SEND_SIGNALED;
	x->wr_id = 1;
	ibv_wr_rdma_write(x, peer.rkey, peer.addr);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)buf, 256);
	x->wr_id = 2;
	ibv_wr_rdma_write(x, peer.rkey, peer.addr + 512);
	ibv_wr_set_inline_data(x, src, 16);
	memset(src, 'x', 16); /* inline data was copied at the call */
	x->wr_id = 3;
	ibv_wr_atomic_fetch_add(x, peer.rkey, peer.addr + 1024, 5);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)(buf + 1024), 8);
	x->wr_id = 4;
	ibv_wr_atomic_cmp_swp(x, peer.rkey, peer.addr + 1032, 0, 0x77);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)(buf + 1032), 8);
	if (ibv_wr_complete(x))
		die("complete (writes, atomics)");
	enum ibv_wc_opcode want[] = {IBV_WC_RDMA_WRITE, IBV_WC_RDMA_WRITE, IBV_WC_FETCH_ADD,
				     IBV_WC_COMP_SWAP};
	for (int i = 0; i < 4; i++) {
		struct ibv_wc wc = wait_one();
		if (wc.wr_id != (uint64_t)i + 1 || wc.opcode != want[i])
			die("completions of the first batch");
	}
	uint64_t fa, cas;
	memcpy(&fa, buf + 1024, 8);
	memcpy(&cas, buf + 1032, 8);
	if (fa != 0 || cas != 0)
		die("atomics' original values");

	/* 2. reads back */
	ibv_wr_start(x);
	x->wr_id = 5;
	ibv_wr_rdma_read(x, peer.rkey, peer.addr);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)(buf + 1536), 256);
	x->wr_id = 6;
	ibv_wr_rdma_read(x, peer.rkey, peer.addr + 512);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)(buf + 1800), 16);
	if (ibv_wr_complete(x))
		die("complete (reads)");
	for (int i = 0; i < 2; i++)
		if (wait_one().opcode != IBV_WC_RDMA_READ)
			die("read completion");
	if (memcmp(buf + 1536, buf, 256) || memcmp(buf + 1800, "inline-data-1234", 16))
		die("read data");

	/* 3. batches that post nothing */
	ibv_wr_start(x);
	x->wr_id = 7;
	ibv_wr_rdma_write(x, peer.rkey, peer.addr + 2048);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)buf, 256);
	ibv_wr_abort(x);
	ibv_wr_start(x);
	if (ibv_wr_complete(x))
		die("an empty batch failed");
	ibv_wr_start(x);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)buf, 8);
	if (ibv_wr_complete(x) != EINVAL)
		die("set_sge without a request was accepted");
	/* One byte more than the QP holds (create_qp_ex reported its real limit). */
	size_t nbig = ia.cap.max_inline_data + 1;
	char *big = malloc(nbig);
	memset(big, 1, nbig);
	ibv_wr_start(x);
	x->wr_id = 8;
	ibv_wr_rdma_write(x, peer.rkey, peer.addr + 2048);
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)buf, 256);
	x->wr_id = 9;
	ibv_wr_rdma_write(x, peer.rkey, peer.addr + 2048);
	ibv_wr_set_inline_data(x, big, nbig);
	if (ibv_wr_complete(x) != EINVAL)
		die("inline data beyond max_inline_data was accepted");
	usleep(100000);
	struct ibv_wc wc;
	if (ibv_poll_cq(cq, 1, &wc) != 0)
		die("a batch that must not post completed something");

	/* 4. SEND_WITH_IMM */
	for (int i = 0; i < 32; i++)
		buf[2560 + i] = (uint8_t)(0xa0 + i);
	ibv_wr_start(x);
	x->wr_id = 10;
	ibv_wr_send_imm(x, htonl(0xabcd));
	ibv_wr_set_sge(x, mr->lkey, (uintptr_t)(buf + 2560), 32);
	if (ibv_wr_complete(x))
		die("complete (send)");
	if (wait_one().opcode != IBV_WC_SEND)
		die("send completion");
	char done = 1;
	xfer(fd, &done, 1, 1);
	printf("OK wr api: writes, inline, atomics, reads, aborted and refused batches, send with immediate\n");
	return 0;
}

int main(int argc, char **argv)
{
	if (argc == 3 && !strcmp(argv[1], "server"))
		return server(atoi(argv[2]));
	if (argc == 4 && !strcmp(argv[1], "client"))
		return client(argv[2], atoi(argv[3]));
	fprintf(stderr, "usage: srn_wr server PORT | srn_wr client SERVER_IP PORT\n");
	return 2;
}
