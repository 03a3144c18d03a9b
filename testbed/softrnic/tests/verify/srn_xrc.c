/*
 * srn_xrc: XRC between two hosts, with an XRC domain shared by two processes of the
 * receiving host (used by softrnic's integration tests; plain verbs, so it runs on any
 * device with XRC).
 *
 *   srn_xrc server PORT [DOMAIN_FILE]
 *   srn_xrc client SERVER_IP PORT
 *
 * The server forks a sibling before touching the device. Both open the XRC domain through
 * DOMAIN_FILE (default: a file in /tmp that the server removes at the end); each makes its own PD, CQ, 4 KiB MR (remote write, read, atomic) and XRC SRQ
 * with four receives posted. The server alone makes the two XRC target QPs. The client
 * makes two XRC initiator QPs connected to them and, on the first:
 *   1. SEND 100 bytes to the server's SRQ and 200 bytes to the sibling's SRQ — the
 *      sibling's receive completes on the sibling's CQ, naming the server's target QP;
 *   2. RDMA WRITE 256 bytes into the server's MR (naming its SRQ) and RDMA WRITE_WITH_IMM 64
 *      bytes into the sibling's MR (naming the sibling's SRQ, whose receive it consumes);
 *   3. RDMA READ both back, and FETCH_AND_ADD +7 on the server's MR (original 0);
 *   4. the sibling opened the first target QP (ibv_open_qp) at the start; the server now
 *      destroys its own handle of it, and a SEND of 50 bytes to the sibling's SRQ still
 *      arrives through it;
 *   5. an RDMA WRITE into the sibling's MR naming the server's SRQ: the SRQ's PD is not the
 *      MR's, so it completes with IBV_WC_REM_ACCESS_ERR and nothing is written (the sibling's
 *      handle then shows the target QP in the error state);
 * and on the second, a SEND naming an SRQ number that is not an XRC SRQ of the domain:
 * IBV_WC_REM_INV_REQ_ERR. Every completion is checked (status, opcode, length, immediate,
 * QP number) and each side checks its memory afterwards.
 *
 * With SRN_CQ_EX=1 in the environment every CQ is an ibv_cq_ex (ibv_create_cq_ex) read with
 * ibv_start_poll and the ibv_wc_read_* functions.
 *
 * Exit status 0 and a final line "OK ..." when everything matched; otherwise a message and 1.
 */
#define _GNU_SOURCE
#include "srn_common.h"
#include <errno.h>
#include <fcntl.h>
#include <sys/wait.h>

enum { MRLEN = 4096, NRECV = 4, WRONG_SRQN = 0xfffff0 };

/* What one side of the receiving host tells the client: its SRQ and MR. */
struct side {
	uint32_t srqn, rkey;
	uint64_t addr;
};

struct server_info {
	uint32_t tgt[2], psn;
	uint8_t gid[16];
	struct side own, sib;
};

struct client_info {
	uint32_t ini[2], psn;
	uint8_t gid[16];
};

/* One receiving process's objects: domain, PD, CQ, MR and XRC SRQ. */
struct rx {
	struct ibv_context *ctx;
	struct ibv_xrcd *xrcd;
	struct ibv_pd *pd;
	struct ibv_cq *cq;
	struct ibv_srq *srq;
	struct ibv_mr *mr;
	uint8_t *buf;
};

static struct ibv_cq *make_cq(struct ibv_context *ctx)
{
	if (!getenv("SRN_CQ_EX"))
		return ibv_create_cq(ctx, 16, NULL, NULL, 0);
	struct ibv_cq_init_attr_ex a = {.cqe = 16,
					.wc_flags = IBV_WC_EX_WITH_BYTE_LEN | IBV_WC_EX_WITH_QP_NUM |
						    IBV_WC_EX_WITH_IMM};
	struct ibv_cq_ex *cq = ibv_create_cq_ex(ctx, &a);
	return cq ? ibv_cq_ex_to_cq(cq) : NULL;
}

/* One completion, if there is one: 1, 0 or -1 as ibv_poll_cq. */
static int poll_one(struct ibv_cq *cq, struct ibv_wc *wc)
{
	if (!getenv("SRN_CQ_EX"))
		return ibv_poll_cq(cq, 1, wc);
	struct ibv_cq_ex *x = (struct ibv_cq_ex *)cq;
	struct ibv_poll_cq_attr pa = {0};
	int rc = ibv_start_poll(x, &pa);
	if (rc == ENOENT)
		return 0;
	if (rc)
		return -1;
	memset(wc, 0, sizeof *wc);
	wc->wr_id = x->wr_id;
	wc->status = x->status;
	wc->opcode = ibv_wc_read_opcode(x);
	wc->byte_len = ibv_wc_read_byte_len(x);
	wc->qp_num = ibv_wc_read_qp_num(x);
	wc->wc_flags = ibv_wc_read_wc_flags(x);
	if (wc->wc_flags & IBV_WC_WITH_IMM)
		wc->imm_data = ibv_wc_read_imm_data(x);
	ibv_end_poll(x);
	return 1;
}

static void rx_setup(struct rx *r, const char *domain_file)
{
	r->ctx = open_first_device();
	int fd = open(domain_file, O_RDONLY | O_CREAT, 0600);
	if (fd < 0)
		die("open domain file");
	struct ibv_xrcd_init_attr xa = {.comp_mask = IBV_XRCD_INIT_ATTR_FD |
						     IBV_XRCD_INIT_ATTR_OFLAGS,
					.fd = fd,
					.oflags = O_CREAT};
	r->xrcd = ibv_open_xrcd(r->ctx, &xa);
	r->pd = ibv_alloc_pd(r->ctx);
	r->cq = make_cq(r->ctx);
	r->buf = aligned_alloc(4096, MRLEN);
	if (!r->xrcd || !r->pd || !r->cq || !r->buf)
		die("receiver setup");
	memset(r->buf, 0, MRLEN);
	r->mr = ibv_reg_mr(r->pd, r->buf, MRLEN,
			   IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE |
				   IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_ATOMIC);
	struct ibv_srq_init_attr_ex sa = {0};
	sa.attr.max_wr = NRECV;
	sa.attr.max_sge = 1;
	sa.comp_mask = IBV_SRQ_INIT_ATTR_TYPE | IBV_SRQ_INIT_ATTR_XRCD | IBV_SRQ_INIT_ATTR_CQ |
		       IBV_SRQ_INIT_ATTR_PD;
	sa.srq_type = IBV_SRQT_XRC;
	sa.xrcd = r->xrcd;
	sa.cq = r->cq;
	sa.pd = r->pd;
	r->srq = ibv_create_srq_ex(r->ctx, &sa);
	if (!r->mr || !r->srq)
		die("XRC SRQ");
	/* Receives land in the MR's upper half, 512 bytes apart. */
	for (int i = 0; i < NRECV; i++) {
		struct ibv_sge sg = {.addr = (uintptr_t)r->buf + 2048 + 512 * i,
				     .length = 512,
				     .lkey = r->mr->lkey};
		struct ibv_recv_wr w = {.wr_id = 100 + i, .sg_list = &sg, .num_sge = 1}, *bad;
		if (ibv_post_srq_recv(r->srq, &w, &bad))
			die("post_srq_recv");
	}
}

static struct side rx_side(struct rx *r)
{
	struct side s = {.rkey = r->mr->rkey, .addr = (uintptr_t)r->buf};
	if (ibv_get_srq_num(r->srq, &s.srqn))
		die("get_srq_num");
	return s;
}

static void fill(uint8_t *p, size_t n, uint8_t seed)
{
	for (size_t i = 0; i < n; i++)
		p[i] = (uint8_t)(seed + i * 7);
}

static int same(const uint8_t *p, size_t n, uint8_t seed)
{
	for (size_t i = 0; i < n; i++)
		if (p[i] != (uint8_t)(seed + i * 7))
			return 0;
	return 1;
}

static struct ibv_wc wait_wc(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	for (int spins = 0; spins < 20000000; spins++) {
		int n = poll_one(cq, &wc);
		if (n < 0)
			die("poll_cq");
		if (n == 1)
			return wc;
		if (spins > 1000)
			usleep(10);
	}
	die("no completion");
	return wc;
}

static void expect_recv(struct ibv_cq *cq, uint32_t qpn, enum ibv_wc_opcode op, uint32_t len,
			const char *what)
{
	struct ibv_wc wc = wait_wc(cq);
	if (wc.status != IBV_WC_SUCCESS || wc.opcode != op || wc.byte_len != len ||
	    wc.qp_num != qpn) {
		fprintf(stderr, "%s: status %d opcode %d len %u qp 0x%x (target 0x%x)\n", what,
			wc.status, wc.opcode, wc.byte_len, wc.qp_num, qpn);
		die(what);
	}
	if (op == IBV_WC_RECV_RDMA_WITH_IMM &&
	    (!(wc.wc_flags & IBV_WC_WITH_IMM) || ntohl(wc.imm_data) != 0x1234))
		die("immediate");
}

/* The sibling: its own receiver objects in the shared domain, and its own handle of the
 * server's first target QP; checks what arrived. */
static int sibling(int ch, const char *domain_file)
{
	struct rx r;
	rx_setup(&r, domain_file);
	struct side s = rx_side(&r);
	xfer(ch, &s, sizeof s, 1);
	uint32_t tgt;
	xfer(ch, &tgt, sizeof tgt, 0);
	struct ibv_qp_open_attr oa = {.comp_mask = IBV_QP_OPEN_ATTR_NUM | IBV_QP_OPEN_ATTR_XRCD |
						   IBV_QP_OPEN_ATTR_TYPE,
				      .qp_num = tgt,
				      .xrcd = r.xrcd,
				      .qp_type = IBV_QPT_XRC_RECV};
	struct ibv_qp *opened = ibv_open_qp(r.ctx, &oa);
	if (!opened || opened->qp_num != tgt)
		die("ibv_open_qp");
	uint8_t ok = 1;
	xfer(ch, &ok, 1, 1);
	xfer(ch, &ok, 1, 0); /* the client is done */
	expect_recv(r.cq, tgt, IBV_WC_RECV, 200, "sibling SEND");
	expect_recv(r.cq, tgt, IBV_WC_RECV_RDMA_WITH_IMM, 64, "sibling WRITE_WITH_IMM");
	expect_recv(r.cq, tgt, IBV_WC_RECV, 50, "SEND through the opened target QP");
	struct ibv_wc extra;
	if (poll_one(r.cq, &extra) != 0)
		die("sibling: an extra completion");
	if (!same(r.buf + 2048, 200, 2) || !same(r.buf + 1024, 64, 4) ||
	    !same(r.buf + 3072, 50, 5))
		die("sibling memory");
	for (int i = 0; i < 1024; i++)
		if (r.buf[i] != 0)
			die("sibling memory written through the wrong PD");
	struct ibv_qp_attr qa;
	struct ibv_qp_init_attr qi;
	if (ibv_query_qp(opened, &qa, IBV_QP_STATE, &qi) || qa.qp_state != IBV_QPS_ERR)
		die("the opened target QP's state after the access error");
	if (ibv_destroy_qp(opened))
		die("destroy the opened target QP");
	return 0;
}

static void connect_tgt(struct ibv_qp *qp, uint32_t ini, uint32_t psn, const uint8_t gid[16],
			enum ibv_mtu mtu)
{
	qp_to_init(qp, IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ |
			       IBV_ACCESS_REMOTE_ATOMIC);
	qp_to_rtr(qp, mtu, ini, psn, gid, 4);
}

static int server(int port, const char *domain_file, int remove_file)
{
	int ch[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, ch))
		die("socketpair");
	pid_t kid = fork();
	if (kid == 0) {
		close(ch[0]);
		exit(sibling(ch[1], domain_file));
	}
	close(ch[1]);
	struct rx r;
	rx_setup(&r, domain_file);
	struct server_info si = {.psn = 0x1111, .own = rx_side(&r)};
	xfer(ch[0], &si.sib, sizeof si.sib, 0);
	if (si.sib.srqn == si.own.srqn)
		die("SRQ numbers of one domain collide");
	struct ibv_qp *tgt[2];
	for (int i = 0; i < 2; i++) {
		struct ibv_qp_init_attr_ex qa = {0};
		qa.qp_type = IBV_QPT_XRC_RECV;
		qa.comp_mask = IBV_QP_INIT_ATTR_XRCD;
		qa.xrcd = r.xrcd;
		tgt[i] = ibv_create_qp_ex(r.ctx, &qa);
		if (!tgt[i])
			die("create XRC target QP");
		si.tgt[i] = tgt[i]->qp_num;
	}
	uint8_t ready = 1, done;
	xfer(ch[0], &si.tgt[0], sizeof si.tgt[0], 1);
	xfer(ch[0], &done, 1, 0); /* the sibling opened it */
	local_gid(r.ctx, si.gid);
	int ls = tcp_listen(port, 1);
	int fd = tcp_accept(ls);
	struct client_info ci;
	xfer(fd, &si, sizeof si, 1);
	xfer(fd, &ci, sizeof ci, 0);
	for (int i = 0; i < 2; i++)
		connect_tgt(tgt[i], ci.ini[i], ci.psn, ci.gid, port_mtu(r.ctx));
	xfer(fd, &ready, 1, 1);
	xfer(fd, &done, 1, 0); /* steps 1-3 done: let go of the first target QP */
	if (ibv_destroy_qp(tgt[0]))
		die("destroy target QP");
	xfer(fd, &ready, 1, 1);
	xfer(fd, &done, 1, 0);
	xfer(ch[0], &ready, 1, 1);
	expect_recv(r.cq, si.tgt[0], IBV_WC_RECV, 100, "server SEND");
	struct ibv_wc extra;
	if (poll_one(r.cq, &extra) != 0)
		die("server: an extra completion");
	if (!same(r.buf + 2048, 100, 1) || !same(r.buf, 256, 3))
		die("server memory");
	uint64_t word;
	memcpy(&word, r.buf + 1536, 8);
	if (word != 7)
		die("FETCH_AND_ADD result in memory");
	int st;
	if (waitpid(kid, &st, 0) != kid || !WIFEXITED(st) || WEXITSTATUS(st) != 0)
		die("sibling failed");
	if (ibv_destroy_qp(tgt[1]))
		die("destroy target QP");
	if (ibv_destroy_srq(r.srq) || ibv_close_xrcd(r.xrcd))
		die("destroy SRQ, close domain");
	if (remove_file)
		unlink(domain_file);
	xfer(fd, &ready, 1, 1);
	printf("OK server: both SRQs of the shared domain served through one target QP, which "
	       "outlived its creator's handle\n");
	return 0;
}

/* Post one work request on an XRC initiator QP and return its completion. */
static struct ibv_wc run(struct ibv_qp *qp, struct ibv_cq *cq, enum ibv_wr_opcode op,
			 uint32_t srqn, struct ibv_sge sg, uint64_t raddr, uint32_t rkey)
{
	struct ibv_send_wr w = {0}, *bad;
	w.wr_id = op;
	w.sg_list = &sg;
	w.num_sge = 1;
	w.opcode = op;
	w.send_flags = IBV_SEND_SIGNALED;
	w.qp_type.xrc.remote_srqn = srqn;
	if (op == IBV_WR_ATOMIC_FETCH_AND_ADD) {
		w.wr.atomic.remote_addr = raddr;
		w.wr.atomic.rkey = rkey;
		w.wr.atomic.compare_add = 7;
	} else {
		w.wr.rdma.remote_addr = raddr;
		w.wr.rdma.rkey = rkey;
	}
	if (op == IBV_WR_RDMA_WRITE_WITH_IMM)
		w.imm_data = htonl(0x1234);
	if (ibv_post_send(qp, &w, &bad))
		die("post_send");
	return wait_wc(cq);
}

static void ok(struct ibv_wc wc, const char *what)
{
	if (wc.status != IBV_WC_SUCCESS) {
		fprintf(stderr, "%s: status %d\n", what, wc.status);
		die(what);
	}
}

static int client(const char *ip, int port)
{
	struct ibv_context *ctx = open_first_device();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = make_cq(ctx);
	uint8_t *buf = aligned_alloc(4096, MRLEN);
	if (!pd || !cq || !buf)
		die("client setup");
	memset(buf, 0, MRLEN);
	struct ibv_mr *mr = ibv_reg_mr(pd, buf, MRLEN, IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		die("reg_mr");
	struct client_info ci = {.psn = 0x2222};
	struct ibv_qp *ini[2];
	for (int i = 0; i < 2; i++) {
		struct ibv_qp_init_attr_ex qa = {0};
		qa.qp_type = IBV_QPT_XRC_SEND;
		qa.send_cq = cq;
		qa.cap.max_send_wr = 8;
		qa.cap.max_send_sge = 1;
		qa.comp_mask = IBV_QP_INIT_ATTR_PD;
		qa.pd = pd;
		ini[i] = ibv_create_qp_ex(ctx, &qa);
		if (!ini[i])
			die("create XRC initiator QP");
		ci.ini[i] = ini[i]->qp_num;
	}
	local_gid(ctx, ci.gid);
	int fd = tcp_connect(ip, port);
	struct server_info si;
	xfer(fd, &si, sizeof si, 0);
	xfer(fd, &ci, sizeof ci, 1);
	for (int i = 0; i < 2; i++) {
		qp_to_init(ini[i], 0);
		qp_to_rtr(ini[i], port_mtu(ctx), si.tgt[i], si.psn, si.gid, 0);
		qp_to_rts(ini[i], ci.psn, 4);
	}
	uint8_t ready;
	xfer(fd, &ready, 1, 0);
	struct ibv_sge sg = {.addr = (uintptr_t)buf, .lkey = mr->lkey};
	fill(buf, 100, 1);
	sg.length = 100;
	ok(run(ini[0], cq, IBV_WR_SEND, si.own.srqn, sg, 0, 0), "SEND to the server's SRQ");
	fill(buf, 200, 2);
	sg.length = 200;
	ok(run(ini[0], cq, IBV_WR_SEND, si.sib.srqn, sg, 0, 0), "SEND to the sibling's SRQ");
	fill(buf, 256, 3);
	sg.length = 256;
	ok(run(ini[0], cq, IBV_WR_RDMA_WRITE, si.own.srqn, sg, si.own.addr, si.own.rkey),
	   "RDMA WRITE");
	fill(buf, 64, 4);
	sg.length = 64;
	ok(run(ini[0], cq, IBV_WR_RDMA_WRITE_WITH_IMM, si.sib.srqn, sg, si.sib.addr + 1024,
	       si.sib.rkey),
	   "RDMA WRITE_WITH_IMM");
	memset(buf, 0, MRLEN);
	sg.length = 256;
	ok(run(ini[0], cq, IBV_WR_RDMA_READ, si.own.srqn, sg, si.own.addr, si.own.rkey),
	   "RDMA READ (server)");
	sg.addr = (uintptr_t)buf + 256;
	sg.length = 64;
	ok(run(ini[0], cq, IBV_WR_RDMA_READ, si.sib.srqn, sg, si.sib.addr + 1024, si.sib.rkey),
	   "RDMA READ (sibling)");
	if (!same(buf, 256, 3) || !same(buf + 256, 64, 4))
		die("RDMA READ data");
	sg.addr = (uintptr_t)buf + 512;
	sg.length = 8;
	ok(run(ini[0], cq, IBV_WR_ATOMIC_FETCH_AND_ADD, si.own.srqn, sg, si.own.addr + 1536,
	       si.own.rkey),
	   "FETCH_AND_ADD");
	uint64_t orig;
	memcpy(&orig, buf + 512, 8);
	if (orig != 0)
		die("FETCH_AND_ADD original value");
	uint8_t done = 1;
	xfer(fd, &done, 1, 1);
	xfer(fd, &ready, 1, 0); /* the server destroyed its handle of the first target QP */
	sg.addr = (uintptr_t)buf;
	fill(buf, 50, 5);
	sg.length = 50;
	ok(run(ini[0], cq, IBV_WR_SEND, si.sib.srqn, sg, 0, 0), "SEND through the opened QP");
	sg.length = 16;
	struct ibv_wc wc = run(ini[0], cq, IBV_WR_RDMA_WRITE, si.own.srqn, sg, si.sib.addr,
			       si.sib.rkey);
	if (wc.status != IBV_WC_REM_ACCESS_ERR)
		die("a write through another PD's SRQ was not refused");
	wc = run(ini[1], cq, IBV_WR_SEND, WRONG_SRQN, sg, 0, 0);
	if (wc.status != IBV_WC_REM_INV_REQ_ERR)
		die("a SEND to an SRQ outside the domain was not refused");
	xfer(fd, &done, 1, 1);
	xfer(fd, &ready, 1, 0);
	printf("OK client: 9 requests through XRC, 2 refused as expected\n");
	return 0;
}

int main(int argc, char **argv)
{
	setvbuf(stdout, NULL, _IONBF, 0);
	if (argc == 4 && !strcmp(argv[1], "server"))
		return server(atoi(argv[2]), argv[3], 0);
	if (argc == 3 && !strcmp(argv[1], "server")) {
		char f[64];
		snprintf(f, sizeof f, "/tmp/srn_xrc.%d.domain", (int)getpid());
		return server(atoi(argv[2]), f, 1);
	}
	if (argc == 4 && !strcmp(argv[1], "client"))
		return client(argv[2], atoi(argv[3]));
	fprintf(stderr, "usage: srn_xrc server PORT [DOMAIN_FILE] | client SERVER_IP PORT\n");
	return 2;
}
