/*
 * srn_atomic: exactly-once and atomicity check of RC atomics over libibverbs (used by
 * softrnic's integration tests; plain verbs, so it runs on any RoCE device whose atomics use
 * host byte order, as rxe and siw do).
 *
 *   srn_atomic server PORT NCLIENTS NQPS OPS
 *   srn_atomic client SERVER_IP PORT NQPS OPS
 *
 * The server owns two 8-byte words in one MR (REMOTE_ATOMIC): a counter starting at
 * FA_BASE (just below 2^32, so the additions carry into the upper half) and a CAS word
 * starting at CAS_BASE. NCLIENTS clients (other processes, typically on other hosts) each
 * connect NQPS RC QPs and, all at the same time:
 *   1. post OPS IBV_WR_ATOMIC_FETCH_AND_ADD of +1 on the counter per QP, up to WINDOW
 *      posted per QP (eight times max_rd_atomic, so the requester must hold atomics back
 *      while a lost response is recovered), each returning the original value into its own
 *      8-byte slot;
 *   2. increment the CAS word OPS times per QP with IBV_WR_ATOMIC_CMP_AND_SWP loops
 *      (compare with the last value seen, swap in value + 1; success when the returned
 *      original equals the compare value).
 * Then every client sends all its fetched values and its CAS success count to the server,
 * which checks: the counter is FA_BASE + total, the union of all fetched values is exactly
 * {FA_BASE, ..., FA_BASE + total - 1} (each addition executed once, atomically: a lost,
 * duplicated or re-executed request, or two interleaved ones, breaks this), and the CAS word
 * is CAS_BASE + the sum of successes (a re-executed CAS would succeed unseen). Every
 * completion must be IBV_WC_SUCCESS with the right opcode and byte_len 8.
 *
 * Exit status 0 and a final line "OK ..." when everything matched; otherwise a message and 1.
 */
#define _GNU_SOURCE
#include "srn_common.h"

#define MAXQ 32
#define MAXC 8
#define WINDOW 64  /* atomics posted and not yet completed, per QP */
#define RD_ATOMIC 8  /* max_rd_atomic: far fewer than posted, so the NIC must hold some back */
#define FA_BASE 0xffffff00ULL
#define CAS_BASE 0x1234000000000000ULL

struct qpinfo {
	uint32_t qpn, psn, rkey, pad;
	uint64_t addr;
	uint8_t gid[16];
};

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *cq;
static enum ibv_mtu mtu;

static void open_dev(void)
{
	ctx = open_first_device();
	struct ibv_device_attr da;
	if (ibv_query_device(ctx, &da))
		die("query_device");
	if (da.atomic_cap == IBV_ATOMIC_NONE)
		die("device reports no atomics");
	mtu = port_mtu(ctx);
	pd = ibv_alloc_pd(ctx);
	cq = ibv_create_cq(ctx, MAXC * MAXQ * (WINDOW + 1), NULL, NULL, 0);
	if (!pd || !cq)
		die("pd/cq");
}

static struct ibv_qp *make_qp(int access)
{
	struct ibv_qp *qp = create_rc_qp(pd, cq, cq, NULL, WINDOW + 1, 1);
	qp_to_init(qp, access);
	return qp;
}

static void my_info(struct ibv_qp *qp, struct qpinfo *mine)
{
	mine->qpn = qp->qp_num;
	mine->psn = (uint32_t)(lrand48() & 0xffffff);
	local_gid(ctx, mine->gid);
}

static void connect_qp(struct ibv_qp *qp, struct qpinfo *mine, struct qpinfo *peer)
{
	qp_to_rtr(qp, mtu, peer->qpn, peer->psn, peer->gid, RD_ATOMIC);
	qp_to_rts(qp, mine->psn, RD_ATOMIC);
}

static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static int server(int port, int nclients, int nq, int ops)
{
	uint64_t *words;
	if (posix_memalign((void **)&words, 4096, 4096))
		die("malloc");
	memset(words, 0, 4096);
	words[0] = FA_BASE;
	words[8] = CAS_BASE;
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_ATOMIC | IBV_ACCESS_REMOTE_READ;
	struct ibv_mr *mr = ibv_reg_mr(pd, words, 4096, acc);
	if (!mr)
		die("reg_mr");
	int ls = tcp_listen(port, MAXC);
	int fds[MAXC];
	for (int c = 0; c < nclients; c++) {
		fds[c] = tcp_accept(ls);
		struct qpinfo mine[MAXQ], peer[MAXQ];
		xfer(fds[c], peer, sizeof(struct qpinfo) * nq, 0);
		for (int q = 0; q < nq; q++) {
			/* Kept until the end: the clients' last responses may need resending. */
			struct ibv_qp *qp = make_qp(acc);
			my_info(qp, &mine[q]);
			mine[q].rkey = mr->rkey;
			mine[q].addr = (uintptr_t)words;
			connect_qp(qp, &mine[q], &peer[q]);
		}
		xfer(fds[c], mine, sizeof(struct qpinfo) * nq, 1);
	}
	/* Start everyone at once: the clients' atomics overlap on the responder. */
	char go = 1;
	for (int c = 0; c < nclients; c++)
		xfer(fds[c], &go, 1, 1);
	size_t per = (size_t)nq * ops, total = per * nclients;
	uint64_t *all = malloc(total * sizeof(uint64_t)), cas_ok = 0, cas_tries = 0;
	if (!all)
		die("malloc");
	for (int c = 0; c < nclients; c++) {
		uint64_t counts[2];
		xfer(fds[c], all + per * c, per * sizeof(uint64_t), 0);
		xfer(fds[c], counts, sizeof counts, 0);
		cas_ok += counts[0];
		cas_tries += counts[1];
	}
	qsort(all, total, sizeof(uint64_t), cmp_u64);
	size_t bad = 0;
	for (size_t i = 0; i < total; i++)
		if (all[i] != FA_BASE + i)
			bad++;
	volatile uint64_t *w = words;
	if (w[0] != FA_BASE + total) {
		fprintf(stderr, "FAIL: counter %#llx, expected %#llx\n", (unsigned long long)w[0],
			(unsigned long long)(FA_BASE + total));
		bad++;
	}
	if (w[8] != CAS_BASE + cas_ok) {
		fprintf(stderr, "FAIL: CAS word %#llx, expected %#llx\n", (unsigned long long)w[8],
			(unsigned long long)(CAS_BASE + cas_ok));
		bad++;
	}
	char verdict = bad == 0;
	for (int c = 0; c < nclients; c++)
		xfer(fds[c], &verdict, 1, 1);
	printf("%s %d clients x %d QPs: %zu FETCH_ADDs, fetched values %s, counter %#llx; "
	       "%llu CMP_SWAPs succeeded of %llu tried, CAS word %#llx; %zu bad\n",
	       bad ? "FAIL" : "OK", nclients, nq, total, bad ? "WRONG" : "a permutation",
	       (unsigned long long)w[0], (unsigned long long)cas_ok,
	       (unsigned long long)cas_tries, (unsigned long long)w[8], bad);
	return bad ? 1 : 0;
}

static void post_atomic(struct ibv_qp *qp, int opcode, uint64_t *local, uint32_t lkey,
			struct qpinfo *peer, uint64_t raddr, uint64_t cmp_add, uint64_t swap,
			uint64_t wr_id)
{
	struct ibv_sge sge = {(uintptr_t)local, 8, lkey};
	struct ibv_send_wr wr = {0}, *bad;
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = opcode;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.atomic.remote_addr = raddr;
	wr.wr.atomic.compare_add = cmp_add;
	wr.wr.atomic.swap = swap;
	wr.wr.atomic.rkey = peer->rkey;
	if (ibv_post_send(qp, &wr, &bad))
		die("post_send");
}

static struct ibv_wc poll1(int opcode)
{
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	if (n < 0)
		die("poll_cq");
	if (wc.status != IBV_WC_SUCCESS || (int)wc.opcode != opcode || wc.byte_len != 8) {
		fprintf(stderr, "FAIL: completion status %s (%d) opcode %d byte_len %u wr_id %llu\n",
			ibv_wc_status_str(wc.status), wc.status, wc.opcode, wc.byte_len,
			(unsigned long long)wc.wr_id);
		exit(1);
	}
	return wc;
}

static int client(const char *ip, int port, int nq, int ops)
{
	struct ibv_qp *qp[MAXQ];
	struct qpinfo mine[MAXQ], peer[MAXQ];
	size_t per = (size_t)nq * ops;
	/* Fetched values, then one CAS result slot per QP. */
	uint64_t *res = calloc(per + nq, sizeof(uint64_t));
	if (!res)
		die("malloc");
	struct ibv_mr *mr = ibv_reg_mr(pd, res, (per + nq) * sizeof(uint64_t),
				       IBV_ACCESS_LOCAL_WRITE);
	if (!mr)
		die("reg_mr");
	for (int q = 0; q < nq; q++) {
		qp[q] = make_qp(IBV_ACCESS_LOCAL_WRITE);
		my_info(qp[q], &mine[q]);
	}
	int fd = tcp_connect(ip, port);
	xfer(fd, mine, sizeof(struct qpinfo) * nq, 1);
	xfer(fd, peer, sizeof(struct qpinfo) * nq, 0);
	for (int q = 0; q < nq; q++)
		connect_qp(qp[q], &mine[q], &peer[q]);
	char go;
	xfer(fd, &go, 1, 0);

	/* 1. FETCH_AND_ADD +1, WINDOW outstanding per QP. */
	int posted[MAXQ] = {0}, out[MAXQ] = {0};
	size_t done = 0;
	while (done < per) {
		for (int q = 0; q < nq; q++)
			while (posted[q] < ops && out[q] < WINDOW) {
				uint64_t id = (uint64_t)q * ops + posted[q]++;
				post_atomic(qp[q], IBV_WR_ATOMIC_FETCH_AND_ADD, &res[id], mr->lkey,
					    &peer[q], peer[q].addr, 1, 0, id);
				out[q]++;
			}
		struct ibv_wc wc = poll1(IBV_WC_FETCH_ADD);
		out[wc.wr_id / ops]--;
		done++;
	}

	/* 2. CMP_AND_SWAP increments, one outstanding per QP, all QPs competing. */
	uint64_t guess[MAXQ], ok[MAXQ] = {0}, tries = 0, cas_addr = peer[0].addr + 64;
	for (int q = 0; q < nq; q++) {
		guess[q] = CAS_BASE;
		post_atomic(qp[q], IBV_WR_ATOMIC_CMP_AND_SWP, &res[per + q], mr->lkey, &peer[q],
			    cas_addr, guess[q], guess[q] + 1, q);
		tries++;
	}
	int running = nq;
	while (running) {
		struct ibv_wc wc = poll1(IBV_WC_COMP_SWAP);
		int q = (int)wc.wr_id;
		uint64_t v = res[per + q];
		if (v == guess[q]) {
			ok[q]++;
			guess[q] = v + 1;
		} else {
			guess[q] = v;
		}
		if (ok[q] == (uint64_t)ops) {
			running--;
			continue;
		}
		post_atomic(qp[q], IBV_WR_ATOMIC_CMP_AND_SWP, &res[per + q], mr->lkey, &peer[q],
			    cas_addr, guess[q], guess[q] + 1, q);
		tries++;
	}
	uint64_t counts[2] = {0, tries};
	for (int q = 0; q < nq; q++)
		counts[0] += ok[q];
	xfer(fd, res, per * sizeof(uint64_t), 1);
	xfer(fd, counts, sizeof counts, 1);
	char verdict;
	xfer(fd, &verdict, 1, 0);
	if (!verdict)
		die("server found the atomics' results wrong");
	printf("OK %d QPs: %zu FETCH_ADDs, %llu CMP_SWAPs (%llu tried)\n", nq, per,
	       (unsigned long long)counts[0], (unsigned long long)tries);
	return 0;
}

int main(int argc, char **argv)
{
	srand48(getpid());
	if (argc == 6 && !strcmp(argv[1], "server")) {
		int nc = atoi(argv[3]), nq = atoi(argv[4]), ops = atoi(argv[5]);
		if (nc < 1 || nc > MAXC || nq < 1 || nq > MAXQ || ops < 1)
			die("bad arguments");
		open_dev();
		return server(atoi(argv[2]), nc, nq, ops);
	}
	if (argc == 6 && !strcmp(argv[1], "client")) {
		int nq = atoi(argv[4]), ops = atoi(argv[5]);
		if (nq < 1 || nq > MAXQ || ops < 1)
			die("bad arguments");
		open_dev();
		return client(argv[2], atoi(argv[3]), nq, ops);
	}
	fprintf(stderr, "usage: srn_atomic server PORT NCLIENTS NQPS OPS\n"
			"       srn_atomic client SERVER_IP PORT NQPS OPS\n");
	return 2;
}
