/*
 * srn_mw: memory windows over libibverbs (used by softrnic's integration tests; plain verbs,
 * so it runs on any RoCE device with type 1 and type 2B windows).
 *
 *   srn_mw server PORT
 *   srn_mw client SERVER_IP PORT
 *
 * The server registers one 8 KiB MR (remote read and write, MW_BIND) but never tells the
 * client its rkey: the client only gets windows, and one more MR over [6144, 7168) that is
 * named by an IO virtual address of its own (ibv_reg_mr_iova). NQP RC QPs are connected
 * between the two; an access error sends a requester QP to the error state, so every expected
 * failure uses a fresh client QP (1..8), and QP 0 does everything that must succeed. In
 * lockstep over TCP:
 *   1. the server binds a type 1 window (ibv_bind_mw, a signalled IBV_WC_BIND_MW completion)
 *      over [1024, 2048) read-only, and a type 2 window (IBV_WR_BIND_MW on QP 0, rkey chosen
 *      with ibv_inc_rkey) over [4096, 4608) read-write (both binds also ask for
 *      IBV_ACCESS_LOCAL_WRITE, as pyverbs' tests do: mlx5 ignores it and so must we, and it
 *      grants nothing remote), and registers the IOVA MR; it
 *      allocates device memory (ibv_alloc_dm; more than the device reports fails with ENOMEM),
 *      copies a pattern in (a copy past its end fails with EFAULT) and registers part of it
 *      zero-based for remote READ (not zero-based: EINVAL; freeing it under the MR: EBUSY);
 *   2. the client READs the whole type 1 range (data checked); READ one byte past it, and
 *      WRITE into it, each fail with IBV_WC_REM_ACCESS_ERR; it WRITEs the type 2 range through
 *      QP 0 and READs it back; the same rkey through another QP fails (type 2B windows belong
 *      to the QP that bound them); it READs the IOVA MR at its IOVA (data checked), and
 *      READing it at its process address fails; it READs the device memory MR from remote
 *      address 0 (data checked);
 *   3. the server binds the type 1 window again, zero-based (IBV_ACCESS_ZERO_BASED: remote
 *      addresses are offsets into the window): its old rkey fails; the new one READs the
 *      window from remote address 0 (data checked), and one byte beyond its length fails;
 *   4. the server invalidates the type 2 window (IBV_WR_LOCAL_INV, IBV_WC_LOCAL_INV): its
 *      rkey fails;
 *   5. the server binds it again with the next rkey; the client sends IBV_WR_SEND_WITH_INV
 *      naming it: the server's receive completes with IBV_WC_WITH_INV and that rkey in
 *      invalidated_rkey, and the rkey fails afterwards;
 *   6. the server checks the bytes the client wrote in step 2, and that each of its QPs 1..7
 *      reported the access violation it refused with IBV_EVENT_QP_ACCESS_ERR (in the order of
 *      the steps).
 * Exit status 0 and a final line "OK ..." when everything matched; otherwise a message and 1.
 */
#define _GNU_SOURCE
#include <poll.h>

#include "srn_common.h"

#define NQP 9
#define BUF 8192
#define W1_OFF 1024
#define W1_LEN 1024
#define W2_OFF 4096
#define W2_LEN 512
#define M3_OFF 6144
#define M3_LEN 1024
#define M3_IOVA 0x5eed00000000ull
#define DM_LEN 512
#define DM_OFF 64

struct qpinfo {
	uint32_t qpn, psn;
	uint8_t gid[16];
};

/* What the server tells the client after each step. */
struct keys {
	uint64_t base;
	uint32_t rkey1, rkey2, rkey3, rkey4;
};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static struct ibv_mr *mr;
static struct ibv_qp *qps[NQP];
static uint8_t *buf;

static void setup(int mr_access, int qp_access)
{
	ctx = open_first_device();
	pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, 64, NULL, NULL, 0);
	if (!pd || !cq || posix_memalign((void **)&buf, 4096, BUF))
		die("pd/cq/buffer");
	mr = ibv_reg_mr(pd, buf, BUF, mr_access);
	if (!mr)
		die("reg_mr");
	for (int i = 0; i < NQP; i++) {
		qps[i] = create_rc_qp(pd, cq, cq, NULL, 8, 2);
		qp_to_init(qps[i], qp_access);
	}
}

static void connect_all(int fd, int send_first)
{
	uint8_t gid[16];
	local_gid(ctx, gid);
	enum ibv_mtu mtu = port_mtu(ctx);
	struct qpinfo mine[NQP], peer[NQP];
	for (int i = 0; i < NQP; i++) {
		mine[i].qpn = qps[i]->qp_num;
		mine[i].psn = (uint32_t)(lrand48() & 0xffffff);
		memcpy(mine[i].gid, gid, 16);
	}
	xfer(fd, send_first ? (void *)mine : (void *)peer, sizeof mine, send_first);
	xfer(fd, send_first ? (void *)peer : (void *)mine, sizeof mine, !send_first);
	for (int i = 0; i < NQP; i++) {
		qp_to_rtr(qps[i], mtu, peer[i].qpn, peer[i].psn, peer[i].gid, 1);
		qp_to_rts(qps[i], mine[i].psn, 1);
	}
}

static struct ibv_wc wait_wc(void)
{
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	if (n < 0)
		die("poll_cq");
	return wc;
}

/* Post one WR on QP q and return its completion's status (the expected opcode checked). */
static int run(int q, struct ibv_send_wr *wr, enum ibv_wc_opcode op)
{
	struct ibv_send_wr *bad;
	wr->send_flags |= IBV_SEND_SIGNALED;
	if (ibv_post_send(qps[q], wr, &bad))
		die("post_send");
	struct ibv_wc wc = wait_wc();
	if (wc.status == IBV_WC_SUCCESS && wc.opcode != op) {
		fprintf(stderr, "FAIL: completion opcode %d, expected %d\n", wc.opcode, op);
		exit(1);
	}
	return wc.status;
}

static void expect(int status, int want, const char *what)
{
	if (status != want) {
		fprintf(stderr, "FAIL: %s: %s, expected %s\n", what, ibv_wc_status_str(status),
			ibv_wc_status_str(want));
		exit(1);
	}
}

/* Client: an RDMA READ or WRITE of len bytes at base + off through rkey, on QP q. */
static int rdma(int q, enum ibv_wr_opcode op, const struct keys *k, uint32_t rkey, int off,
		int len, int local_off)
{
	struct ibv_sge s = {.addr = (uintptr_t)(buf + local_off), .length = len, .lkey = mr->lkey};
	struct ibv_send_wr wr = {.sg_list = &s, .num_sge = 1, .opcode = op};
	wr.wr.rdma.remote_addr = k->base + off;
	wr.wr.rdma.rkey = rkey;
	return run(q, &wr, op == IBV_WR_RDMA_READ ? IBV_WC_RDMA_READ : IBV_WC_RDMA_WRITE);
}

static void bind_type2(struct ibv_mw *mw, uint32_t rkey)
{
	struct ibv_send_wr wr = {.wr_id = 2, .opcode = IBV_WR_BIND_MW};
	wr.bind_mw.mw = mw;
	wr.bind_mw.rkey = rkey;
	wr.bind_mw.bind_info.mr = mr;
	wr.bind_mw.bind_info.addr = (uintptr_t)(buf + W2_OFF);
	wr.bind_mw.bind_info.length = W2_LEN;
	wr.bind_mw.bind_info.mw_access_flags =
		IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
	expect(run(0, &wr, IBV_WC_BIND_MW), IBV_WC_SUCCESS, "type 2 bind");
	mw->rkey = rkey;
}

static void bind_type1(struct ibv_mw *mw, int zero_based)
{
	struct ibv_mw_bind b = {.wr_id = 1, .send_flags = IBV_SEND_SIGNALED};
	b.bind_info.mr = mr;
	b.bind_info.addr = (uintptr_t)(buf + W1_OFF);
	b.bind_info.length = W1_LEN;
	b.bind_info.mw_access_flags = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ |
				      (zero_based ? IBV_ACCESS_ZERO_BASED : 0);
	uint32_t old = mw->rkey;
	if (ibv_bind_mw(qps[0], mw, &b))
		die("ibv_bind_mw");
	struct ibv_wc wc = wait_wc();
	if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_BIND_MW || wc.wr_id != 1)
		die("type 1 bind completion");
	if (mw->rkey == old)
		die("ibv_bind_mw kept the old rkey");
}

static void sync_step(int fd, int server)
{
	uint8_t b = 1;
	xfer(fd, &b, 1, !server);
}

static int server(int port)
{
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE;
	setup(acc | IBV_ACCESS_MW_BIND, IBV_ACCESS_REMOTE_READ | IBV_ACCESS_REMOTE_WRITE);
	for (int i = 0; i < BUF; i++)
		buf[i] = (uint8_t)(i * 7);
	int fd = tcp_accept(tcp_listen(port, 1));
	connect_all(fd, 0);
	struct ibv_mw *mw1 = ibv_alloc_mw(pd, IBV_MW_TYPE_1);
	struct ibv_mw *mw2 = ibv_alloc_mw(pd, IBV_MW_TYPE_2);
	if (!mw1 || !mw2)
		die("alloc_mw");
	bind_type1(mw1, 0);
	bind_type2(mw2, ibv_inc_rkey(mw2->rkey));
	struct ibv_mr *mr3 = ibv_reg_mr_iova(pd, buf + M3_OFF, M3_LEN, M3_IOVA,
					     IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_READ);
	if (!mr3)
		die("ibv_reg_mr_iova");
	struct ibv_device_attr_ex dev;
	if (ibv_query_device_ex(ctx, NULL, &dev) || dev.max_dm_size < DM_LEN)
		die("ibv_query_device_ex: no device memory");
	struct ibv_alloc_dm_attr dma = {.length = dev.max_dm_size + 1};
	if (ibv_alloc_dm(ctx, &dma) || errno != ENOMEM)
		die("more device memory than the device has");
	dma.length = DM_LEN;
	struct ibv_dm *dm = ibv_alloc_dm(ctx, &dma);
	if (!dm)
		die("ibv_alloc_dm");
	uint8_t pattern[DM_LEN];
	for (int i = 0; i < DM_LEN; i++)
		pattern[i] = (uint8_t)(0x3c ^ i);
	if (ibv_memcpy_to_dm(dm, 0, pattern, DM_LEN))
		die("ibv_memcpy_to_dm");
	if (ibv_memcpy_to_dm(dm, DM_LEN - 1, pattern, 2) != EFAULT)
		die("ibv_memcpy_to_dm past the end");
	if (ibv_reg_dm_mr(pd, dm, 0, DM_LEN, IBV_ACCESS_REMOTE_READ) || errno != EINVAL)
		die("a device memory MR that is not zero-based");
	struct ibv_mr *dmr = ibv_reg_dm_mr(pd, dm, DM_OFF, DM_LEN - DM_OFF,
					   IBV_ACCESS_ZERO_BASED | IBV_ACCESS_REMOTE_READ);
	if (!dmr)
		die("ibv_reg_dm_mr");
	if (ibv_free_dm(dm) != EBUSY)
		die("ibv_free_dm under an MR");
	struct keys k = {.base = (uintptr_t)buf,
			 .rkey1 = mw1->rkey,
			 .rkey2 = mw2->rkey,
			 .rkey3 = mr3->rkey,
			 .rkey4 = dmr->rkey};
	xfer(fd, &k, sizeof k, 1);

	sync_step(fd, 1); /* step 2 done */
	bind_type1(mw1, 1);
	k.rkey1 = mw1->rkey;
	xfer(fd, &k, sizeof k, 1);

	sync_step(fd, 1); /* step 3 done */
	struct ibv_send_wr inv = {.wr_id = 3, .opcode = IBV_WR_LOCAL_INV};
	inv.invalidate_rkey = mw2->rkey;
	expect(run(0, &inv, IBV_WC_LOCAL_INV), IBV_WC_SUCCESS, "local invalidate");
	xfer(fd, &k, sizeof k, 1);

	sync_step(fd, 1); /* step 4 done */
	struct ibv_sge rs = {.addr = (uintptr_t)(buf + BUF - 64), .length = 64, .lkey = mr->lkey};
	struct ibv_recv_wr rwr = {.wr_id = 9, .sg_list = &rs, .num_sge = 1}, *rbad;
	if (ibv_post_recv(qps[0], &rwr, &rbad))
		die("post_recv");
	bind_type2(mw2, ibv_inc_rkey(mw2->rkey));
	k.rkey2 = mw2->rkey;
	xfer(fd, &k, sizeof k, 1);
	struct ibv_wc wc = wait_wc();
	if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RECV || wc.wr_id != 9)
		die("receive of the SEND with invalidate");
	if (!(wc.wc_flags & IBV_WC_WITH_INV) || wc.invalidated_rkey != mw2->rkey)
		die("the receive does not report the invalidated rkey");
	sync_step(fd, 0); /* tell the client */

	sync_step(fd, 1); /* step 5 done */
	for (int i = 0; i < W2_LEN; i++)
		if (buf[W2_OFF + i] != (uint8_t)(0xa0 + i))
			die("the bytes written through the type 2 window");
	for (int i = W2_OFF + W2_LEN; i < BUF - 64; i++)
		if (buf[i] != (uint8_t)(i * 7))
			die("memory outside the windows changed");
	static const int refused_in_order[] = {1, 2, 3, 8, 4, 7, 5, 6};
	for (int i = 0; i < NQP - 1; i++) {
		int q = refused_in_order[i];
		struct pollfd p = {.fd = ctx->async_fd, .events = POLLIN};
		struct ibv_async_event ev;
		if (poll(&p, 1, 5000) != 1 || ibv_get_async_event(ctx, &ev))
			die("no asynchronous event for a refused access");
		if (ev.event_type != IBV_EVENT_QP_ACCESS_ERR || ev.element.qp != qps[q]) {
			fprintf(stderr, "FAIL: %s for QP %p, expected QP_ACCESS_ERR for %p\n",
				ibv_event_type_str(ev.event_type), (void *)ev.element.qp,
				(void *)qps[q]);
			exit(1);
		}
		ibv_ack_async_event(&ev);
	}
	if (ibv_dealloc_mw(mw1) || ibv_dealloc_mw(mw2) || ibv_dereg_mr(mr3) || ibv_dereg_mr(dmr))
		die("dealloc_mw/dereg_mr");
	uint8_t back[DM_LEN];
	if (ibv_memcpy_from_dm(back, dm, 0, DM_LEN) || memcmp(back, pattern, DM_LEN))
		die("ibv_memcpy_from_dm");
	if (ibv_free_dm(dm))
		die("ibv_free_dm");
	printf("OK memory windows: type 1 and 2 binds, zero-based, range, rights, QP, rebind, "
	       "local and remote invalidation enforced; an MR named by its IOVA; device memory; "
	       "QP_ACCESS_ERR "
	       "for each refused access\n");
	return 0;
}

static int client(const char *ip, int port)
{
	setup(IBV_ACCESS_LOCAL_WRITE, 0);
	int fd = tcp_connect(ip, port);
	connect_all(fd, 1);
	struct keys k;
	xfer(fd, &k, sizeof k, 0);
	int ok = IBV_WC_SUCCESS, denied = IBV_WC_REM_ACCESS_ERR;
	/* Step 2. */
	expect(rdma(0, IBV_WR_RDMA_READ, &k, k.rkey1, W1_OFF, W1_LEN, 0), ok, "READ the window");
	for (int i = 0; i < W1_LEN; i++)
		if (buf[i] != (uint8_t)((W1_OFF + i) * 7))
			die("the bytes read through the type 1 window");
	expect(rdma(1, IBV_WR_RDMA_READ, &k, k.rkey1, W1_OFF + 1, W1_LEN, 0), denied,
	       "READ one byte beyond the window");
	expect(rdma(2, IBV_WR_RDMA_WRITE, &k, k.rkey1, W1_OFF, 8, 0), denied,
	       "WRITE into a read-only window");
	for (int i = 0; i < W2_LEN; i++)
		buf[2048 + i] = (uint8_t)(0xa0 + i);
	expect(rdma(0, IBV_WR_RDMA_WRITE, &k, k.rkey2, W2_OFF, W2_LEN, 2048), ok,
	       "WRITE the type 2 window");
	memset(buf, 0, W2_LEN);
	expect(rdma(0, IBV_WR_RDMA_READ, &k, k.rkey2, W2_OFF, W2_LEN, 0), ok,
	       "READ the type 2 window");
	if (memcmp(buf, buf + 2048, W2_LEN))
		die("read back what was written through the type 2 window");
	expect(rdma(3, IBV_WR_RDMA_WRITE, &k, k.rkey2, W2_OFF, 8, 0), denied,
	       "a type 2 window through another QP");
	struct keys iova = k;
	iova.base = M3_IOVA;
	memset(buf, 0, M3_LEN);
	expect(rdma(0, IBV_WR_RDMA_READ, &iova, k.rkey3, 0, M3_LEN, 0), ok,
	       "READ an MR at its IOVA");
	for (int i = 0; i < M3_LEN; i++)
		if (buf[i] != (uint8_t)((M3_OFF + i) * 7))
			die("the bytes read through the IOVA MR");
	expect(rdma(8, IBV_WR_RDMA_READ, &k, k.rkey3, M3_OFF, 8, 0), denied,
	       "an IOVA MR at its process address");
	struct keys dmk = k;
	dmk.base = 0;
	memset(buf, 0, DM_LEN);
	expect(rdma(0, IBV_WR_RDMA_READ, &dmk, k.rkey4, 0, DM_LEN - DM_OFF, 0), ok,
	       "READ device memory");
	for (int i = 0; i < DM_LEN - DM_OFF; i++)
		if (buf[i] != (uint8_t)(0x3c ^ (DM_OFF + i)))
			die("the bytes read from device memory");
	uint32_t old1 = k.rkey1, old2 = k.rkey2;
	sync_step(fd, 0);
	/* Step 3. */
	xfer(fd, &k, sizeof k, 0);
	expect(rdma(4, IBV_WR_RDMA_READ, &k, old1, W1_OFF, 8, 0), denied, "the rkey before a rebind");
	struct keys zero = k;
	zero.base = 0;
	memset(buf, 0, W1_LEN);
	expect(rdma(0, IBV_WR_RDMA_READ, &zero, k.rkey1, 0, W1_LEN, 0), ok,
	       "READ a zero-based window from offset 0");
	for (int i = 0; i < W1_LEN; i++)
		if (buf[i] != (uint8_t)((W1_OFF + i) * 7))
			die("the bytes read through the zero-based window");
	expect(rdma(7, IBV_WR_RDMA_READ, &zero, k.rkey1, 1, W1_LEN, 0), denied,
	       "READ one byte beyond a zero-based window");
	sync_step(fd, 0);
	/* Step 4. */
	xfer(fd, &k, sizeof k, 0);
	expect(rdma(5, IBV_WR_RDMA_WRITE, &k, old2, W2_OFF, 8, 0), denied,
	       "a window after local invalidation");
	sync_step(fd, 0);
	/* Step 5. */
	xfer(fd, &k, sizeof k, 0);
	struct ibv_sge s = {.addr = (uintptr_t)buf, .length = 16, .lkey = mr->lkey};
	struct ibv_send_wr wr = {.sg_list = &s, .num_sge = 1, .opcode = IBV_WR_SEND_WITH_INV};
	wr.invalidate_rkey = k.rkey2;
	expect(run(0, &wr, IBV_WC_SEND), ok, "SEND with invalidate");
	sync_step(fd, 1); /* the server saw the invalidation */
	expect(rdma(6, IBV_WR_RDMA_WRITE, &k, k.rkey2, W2_OFF, 8, 0), denied,
	       "a window after remote invalidation");
	sync_step(fd, 0);
	printf("OK client: 8 accesses refused as expected, 7 allowed\n");
	return 0;
}

int main(int argc, char **argv)
{
	alarm(60);
	srand48(getpid());
	if (argc == 3 && !strcmp(argv[1], "server"))
		return server(atoi(argv[2]));
	if (argc == 4 && !strcmp(argv[1], "client"))
		return client(argv[2], atoi(argv[3]));
	fprintf(stderr, "usage: srn_mw server PORT | client SERVER_IP PORT\n");
	return 2;
}
