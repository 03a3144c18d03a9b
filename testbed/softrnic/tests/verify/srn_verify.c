/*
 * srn_verify: a data-verifying RC test over libibverbs (used by softrnic's integration tests,
 * works on any RoCE device).
 *
 *   srn_verify server PORT NQPS ROUNDS
 *   srn_verify client SERVER_IP PORT NQPS ROUNDS SEED
 *
 * NQPS RC QPs between the two processes. In every round the client starts one operation on
 * every QP at once, chosen and sized by a seeded pseudo-random stream:
 *   WRITE: RDMA WRITE of random bytes (1 B .. 64 KiB) to a random offset of the server's
 *          per-QP write region, then a SEND announcing offset, length and checksum; the server
 *          checksums its memory on arrival (RC ordering: the WRITE is placed before the SEND);
 *   READ:  RDMA READ of a random range of the server's read region, whose contents are a known
 *          function of (QP, offset); the client compares every byte; then an announcing SEND;
 *   SEND:  a SEND of random length (up to 16 KiB) whose header carries the payload checksum.
 * Every announcing SEND carries a per-QP sequence number: the server checks that it sees each
 * exactly once and in order (no loss, no duplication), verifies, and answers with a SEND of
 * its verdict; the client waits for all answers before the next round. Work completions must
 * all be IBV_WC_SUCCESS with the right opcode and byte count. The TCP connection exchanges the
 * QP parameters and, at the end, the server's totals.
 *
 * Exit status 0 and a final line "OK ..." when everything matched; otherwise a message and 1.
 */
#define _GNU_SOURCE
#include "srn_common.h"

#define MAXQ 64
#define WREG (64 * 1024 + 4096)  /* write region per QP */
#define RREG (64 * 1024 + 4096)  /* read region per QP */
#define MAXW (64 * 1024)
#define MAXS (16 * 1024)
#define RBUF (MAXS + 64)
#define NRECV 2

enum { OP_WRITE = 1, OP_READ = 2, OP_SEND = 3, OP_DONE = 4, OP_VERDICT = 5 };

struct msg {
	uint32_t op, seq, off, len;
	uint64_t csum;
	uint32_t ok, pad;
};

struct qpinfo {
	uint32_t qpn, psn, wrkey, rrkey;
	uint64_t waddr, raddr;
	uint8_t gid[16];
};

static uint64_t fnv(const uint8_t *p, size_t n)
{
	uint64_t h = 1469598103934665603ULL;
	for (size_t i = 0; i < n; i++) {
		h ^= p[i];
		h *= 1099511628211ULL;
	}
	return h;
}

static uint64_t rng_next(uint64_t *s)
{
	/* splitmix64 */
	uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
	return z ^ (z >> 31);
}

static uint8_t read_pattern(int q, uint32_t off)
{
	return (uint8_t)((off * 2654435761u) >> 13) ^ (uint8_t)(q * 37 + 11);
}

static struct ibv_context *ctx;
static struct ibv_pd *pd;
static struct ibv_cq *scq, *rcq;
static struct ibv_qp *qp[MAXQ];
static uint8_t *wreg, *rreg, *sbuf, *rbuf;
static struct ibv_mr *wmr, *rmr, *smr, *rbmr;
static int nq;
static enum ibv_mtu mtu;

static void post_recv(int q, int slot)
{
	struct ibv_sge sge = {(uintptr_t)(rbuf + ((size_t)q * NRECV + slot) * RBUF), RBUF,
			      rbmr->lkey};
	struct ibv_recv_wr wr = {.wr_id = (uint64_t)q * NRECV + slot, .sg_list = &sge,
				 .num_sge = 1};
	struct ibv_recv_wr *bad;
	if (ibv_post_recv(qp[q], &wr, &bad))
		die("post_recv");
}

static void post_send(int q, int opcode, void *laddr, uint32_t len, uint32_t lkey,
		      uint64_t raddr, uint32_t rkey, uint64_t wr_id)
{
	struct ibv_sge sge = {(uintptr_t)laddr, len, lkey};
	struct ibv_send_wr wr = {0}, *bad;
	wr.wr_id = wr_id;
	wr.sg_list = &sge;
	wr.num_sge = 1;
	wr.opcode = opcode;
	wr.send_flags = IBV_SEND_SIGNALED;
	wr.wr.rdma.remote_addr = raddr;
	wr.wr.rdma.rkey = rkey;
	if (ibv_post_send(qp[q], &wr, &bad))
		die("post_send");
}

/* Poll one completion from cq, checking its status. */
static struct ibv_wc poll1(struct ibv_cq *cq)
{
	struct ibv_wc wc;
	int n;
	while ((n = ibv_poll_cq(cq, 1, &wc)) == 0)
		;
	if (n < 0)
		die("poll_cq");
	if (wc.status != IBV_WC_SUCCESS) {
		fprintf(stderr, "FAIL: completion status %s (%d) wr_id %llu opcode %d\n",
			ibv_wc_status_str(wc.status), wc.status, (unsigned long long)wc.wr_id,
			wc.opcode);
		exit(1);
	}
	return wc;
}

static void setup(int n)
{
	ctx = open_first_device();
	mtu = port_mtu(ctx);
	pd = ibv_alloc_pd(ctx);
	scq = ibv_create_cq(ctx, 4 * MAXQ, NULL, NULL, 0);
	rcq = ibv_create_cq(ctx, 4 * MAXQ, NULL, NULL, 0);
	if (!pd || !scq || !rcq)
		die("pd/cq");
	nq = n;
	wreg = calloc((size_t)n, WREG);
	rreg = calloc((size_t)n, RREG);
	sbuf = calloc((size_t)n, MAXW + 64);
	rbuf = calloc((size_t)n * NRECV, RBUF);
	if (!wreg || !rreg || !sbuf || !rbuf)
		die("malloc");
	int acc = IBV_ACCESS_LOCAL_WRITE | IBV_ACCESS_REMOTE_WRITE | IBV_ACCESS_REMOTE_READ;
	wmr = ibv_reg_mr(pd, wreg, (size_t)n * WREG, acc);
	rmr = ibv_reg_mr(pd, rreg, (size_t)n * RREG, acc);
	smr = ibv_reg_mr(pd, sbuf, (size_t)n * (MAXW + 64), IBV_ACCESS_LOCAL_WRITE);
	rbmr = ibv_reg_mr(pd, rbuf, (size_t)n * NRECV * RBUF, IBV_ACCESS_LOCAL_WRITE);
	if (!wmr || !rmr || !smr || !rbmr)
		die("reg_mr");
	for (int q = 0; q < n; q++) {
		qp[q] = create_rc_qp(pd, scq, rcq, NULL, 8, NRECV + 1);
		qp_to_init(qp[q], acc);
		for (int s = 0; s < NRECV; s++)
			post_recv(q, s);
	}
}

static void connect_qps(struct qpinfo *mine, struct qpinfo *peer)
{
	for (int q = 0; q < nq; q++) {
		qp_to_rtr(qp[q], mtu, peer[q].qpn, peer[q].psn, peer[q].gid, 1);
		qp_to_rts(qp[q], mine[q].psn, 1);
	}
}

static void my_info(struct qpinfo *mine)
{
	uint8_t gid[16];
	local_gid(ctx, gid);
	for (int q = 0; q < nq; q++) {
		mine[q].qpn = qp[q]->qp_num;
		mine[q].psn = (uint32_t)(lrand48() & 0xffffff);
		mine[q].wrkey = wmr->rkey;
		mine[q].rrkey = rmr->rkey;
		mine[q].waddr = (uintptr_t)(wreg + (size_t)q * WREG);
		mine[q].raddr = (uintptr_t)(rreg + (size_t)q * RREG);
		memcpy(mine[q].gid, gid, 16);
	}
}

static struct msg *rmsg(uint64_t wr_id)
{
	return (struct msg *)(rbuf + wr_id * RBUF);
}

static int server(int port, int rounds)
{
	struct qpinfo mine[MAXQ], peer[MAXQ];
	for (int q = 0; q < nq; q++)
		for (uint32_t o = 0; o < RREG; o++)
			rreg[(size_t)q * RREG + o] = read_pattern(q, o);
	my_info(mine);
	int fd = tcp_accept(tcp_listen(port, 1));
	xfer(fd, peer, sizeof(struct qpinfo) * nq, 0);
	xfer(fd, mine, sizeof(struct qpinfo) * nq, 1);
	connect_qps(mine, peer);
	char go = 1;
	xfer(fd, &go, 1, 1);
	uint32_t expect[MAXQ] = {0};
	uint64_t counts[4] = {0}, bad = 0, bytes = 0;
	int done = 0;
	while (done < nq) {
		struct ibv_wc wc = poll1(rcq);
		int q = (int)(wc.wr_id / NRECV), slot = (int)(wc.wr_id % NRECV);
		if (wc.opcode != IBV_WC_RECV || q >= nq)
			die("unexpected receive completion");
		struct msg m = *rmsg(wc.wr_id);
		uint32_t ok = 1;
		if (m.seq != expect[q]) {
			fprintf(stderr, "FAIL: QP %d: sequence %u, expected %u (lost or duplicated)\n",
				q, m.seq, expect[q]);
			exit(1);
		}
		expect[q]++;
		if (m.op == OP_WRITE) {
			if (m.off + m.len > WREG || fnv(wreg + (size_t)q * WREG + m.off, m.len) != m.csum)
				ok = 0;
			bytes += m.len;
		} else if (m.op == OP_SEND) {
			if (wc.byte_len != sizeof m + m.len || m.len > MAXS ||
			    fnv((uint8_t *)rmsg(wc.wr_id) + sizeof m, m.len) != m.csum)
				ok = 0;
			bytes += m.len;
		} else if (m.op == OP_DONE) {
			done++;
		} else if (m.op != OP_READ) {
			ok = 0;
		}
		if (m.op >= 1 && m.op <= 3)
			counts[m.op]++;
		if (!ok) {
			bad++;
			fprintf(stderr, "FAIL: QP %d seq %u op %u off %u len %u: checksum mismatch\n", q,
				m.seq, m.op, m.off, m.len);
		}
		post_recv(q, slot);
		if (m.op == OP_DONE)
			continue;
		struct msg *v = (struct msg *)(sbuf + (size_t)q * (MAXW + 64));
		memset(v, 0, sizeof *v);
		v->op = OP_VERDICT;
		v->seq = m.seq;
		v->ok = ok;
		post_send(q, IBV_WR_SEND, v, sizeof *v, smr->lkey, 0, 0, (uint64_t)q);
		struct ibv_wc s = poll1(scq);
		if (s.opcode != IBV_WC_SEND)
			die("verdict completion opcode");
	}
	uint64_t tot[5] = {counts[OP_WRITE], counts[OP_READ], counts[OP_SEND], bad, bytes};
	xfer(fd, tot, sizeof tot, 1);
	/* Keep the QPs until the client has its last completions: an ACK lost on the way to it
	 * must be answerable by a retransmission. */
	char bye;
	xfer(fd, &bye, 1, 0);
	printf("server: %llu writes, %llu reads, %llu sends verified, %llu bad, %llu bytes\n",
	       (unsigned long long)tot[0], (unsigned long long)tot[1], (unsigned long long)tot[2],
	       (unsigned long long)bad, (unsigned long long)bytes);
	(void)rounds;
	return bad ? 1 : 0;
}

static int client(const char *ip, int port, int rounds, uint64_t seed)
{
	struct qpinfo mine[MAXQ], peer[MAXQ];
	my_info(mine);
	int fd = tcp_connect(ip, port);
	xfer(fd, mine, sizeof(struct qpinfo) * nq, 1);
	xfer(fd, peer, sizeof(struct qpinfo) * nq, 0);
	connect_qps(mine, peer);
	char go;
	xfer(fd, &go, 1, 0);
	uint64_t rng = seed;
	uint64_t counts[4] = {0}, bytes = 0, read_checked = 0;
	uint32_t seq[MAXQ] = {0};
	for (int r = 0; r <= rounds; r++) {
		int expect_sends = 0;
		uint32_t rop[MAXQ], roff[MAXQ], rlen[MAXQ];
		/* Phase 1: start one operation on every QP. */
		for (int q = 0; q < nq; q++) {
			uint8_t *buf = sbuf + (size_t)q * (MAXW + 64);
			struct msg *m = (struct msg *)buf;
			uint32_t op = r == rounds ? OP_DONE : 1 + (uint32_t)(rng_next(&rng) % 3);
			uint32_t len = 0, off = 0;
			rop[q] = op;
			if (op == OP_WRITE || op == OP_READ) {
				/* Mostly small, sometimes large: 1 B .. 64 KiB. */
				uint64_t x = rng_next(&rng);
				len = 1 + (uint32_t)((x & 3) ? (x >> 8) % 4096 : (x >> 8) % MAXW);
				off = (uint32_t)(rng_next(&rng) % (WREG - len + 1));
			} else if (op == OP_SEND) {
				len = (uint32_t)(rng_next(&rng) % (MAXS + 1));
			}
			roff[q] = off;
			rlen[q] = len;
			if (op == OP_WRITE) {
				uint8_t *d = buf + 64;
				for (uint32_t i = 0; i < len; i++)
					d[i] = (uint8_t)rng_next(&rng);
				post_send(q, IBV_WR_RDMA_WRITE, d, len, smr->lkey, peer[q].waddr + off,
					  peer[q].wrkey, ((uint64_t)q << 8) | OP_WRITE);
				expect_sends++;
			} else if (op == OP_READ) {
				uint8_t *d = buf + 64;
				memset(d, 0xee, len);
				post_send(q, IBV_WR_RDMA_READ, d, len, smr->lkey, peer[q].raddr + off,
					  peer[q].rrkey, ((uint64_t)q << 8) | OP_READ);
				expect_sends++;
			}
			/* The announcing SEND (after a READ: once the READ is done, below). */
			if (op != OP_READ) {
				memset(m, 0, sizeof *m);
				m->op = op;
				m->seq = seq[q]++;
				m->off = off;
				m->len = len;
				uint32_t total = sizeof *m;
				if (op == OP_WRITE) {
					m->csum = fnv(buf + 64, len);
					/* The SEND carries only the header; copy it out of the way of the
					 * WRITE's source bytes, which follow it in buf. */
				} else if (op == OP_SEND) {
					uint8_t *d = buf + sizeof *m;
					for (uint32_t i = 0; i < len; i++)
						d[i] = (uint8_t)rng_next(&rng);
					m->csum = fnv(d, len);
					total += len;
				}
				post_send(q, IBV_WR_SEND, m, total, smr->lkey, 0, 0,
					  ((uint64_t)q << 8) | 0x80 | op);
				expect_sends++;
			}
		}
		/* Phase 2: completions; READs are checked and announced as they complete. */
		int verdicts = 0;
		while (expect_sends > 0 || verdicts < (r == rounds ? 0 : nq)) {
			struct ibv_wc wc;
			int n = ibv_poll_cq(scq, 1, &wc);
			if (n < 0)
				die("poll_cq");
			if (n == 1) {
				if (wc.status != IBV_WC_SUCCESS) {
					fprintf(stderr, "FAIL: send completion %s wr_id %llx\n",
						ibv_wc_status_str(wc.status),
						(unsigned long long)wc.wr_id);
					exit(1);
				}
				int q = (int)(wc.wr_id >> 8), kind = (int)(wc.wr_id & 0xff);
				expect_sends--;
				if (kind == OP_READ) {
					if (wc.opcode != IBV_WC_RDMA_READ || wc.byte_len != rlen[q])
						die("READ completion opcode or length");
					uint8_t *d = sbuf + (size_t)q * (MAXW + 64) + 64;
					for (uint32_t i = 0; i < rlen[q]; i++)
						if (d[i] != read_pattern(q, roff[q] + i)) {
							fprintf(stderr,
								"FAIL: QP %d READ off %u len %u: byte %u is %02x, "
								"want %02x\n",
								q, roff[q], rlen[q], i, d[i],
								read_pattern(q, roff[q] + i));
							exit(1);
						}
					read_checked += rlen[q];
					struct msg *m = (struct msg *)(sbuf + (size_t)q * (MAXW + 64));
					memset(m, 0, sizeof *m);
					m->op = OP_READ;
					m->seq = seq[q]++;
					m->off = roff[q];
					m->len = rlen[q];
					post_send(q, IBV_WR_SEND, m, sizeof *m, smr->lkey, 0, 0,
						  ((uint64_t)q << 8) | 0x80 | OP_READ);
					expect_sends++;
				} else if (kind == OP_WRITE && wc.opcode != IBV_WC_RDMA_WRITE) {
					die("WRITE completion opcode");
				} else if ((kind & 0x80) && wc.opcode != IBV_WC_SEND) {
					die("SEND completion opcode");
				}
			}
			if (r == rounds)
				continue;
			n = ibv_poll_cq(rcq, 1, &wc);
			if (n < 0)
				die("poll_cq");
			if (n == 1) {
				if (wc.status != IBV_WC_SUCCESS || wc.opcode != IBV_WC_RECV)
					die("verdict receive failed");
				int q = (int)(wc.wr_id / NRECV);
				struct msg v = *rmsg(wc.wr_id);
				if (v.op != OP_VERDICT || v.seq != seq[q] - 1) {
					fprintf(stderr, "FAIL: QP %d verdict op %u seq %u, want seq %u\n", q,
						v.op, v.seq, seq[q] - 1);
					exit(1);
				}
				if (!v.ok) {
					fprintf(stderr, "FAIL: QP %d: server found op %u seq %u corrupt\n", q,
						rop[q], v.seq);
					exit(1);
				}
				post_recv(q, (int)(wc.wr_id % NRECV));
				verdicts++;
			}
		}
		if (r < rounds)
			for (int q = 0; q < nq; q++) {
				counts[rop[q]]++;
				bytes += rlen[q];
			}
	}
	uint64_t tot[5];
	xfer(fd, tot, sizeof tot, 0);
	char bye = 1;
	xfer(fd, &bye, 1, 1);
	if (tot[0] != counts[OP_WRITE] || tot[1] != counts[OP_READ] || tot[2] != counts[OP_SEND] ||
	    tot[3] != 0) {
		fprintf(stderr, "FAIL: server verified %llu/%llu/%llu (bad %llu), client did %llu/%llu/%llu\n",
			(unsigned long long)tot[0], (unsigned long long)tot[1],
			(unsigned long long)tot[2], (unsigned long long)tot[3],
			(unsigned long long)counts[1], (unsigned long long)counts[2],
			(unsigned long long)counts[3]);
		return 1;
	}
	printf("OK %d QPs %d rounds: %llu WRITEs, %llu READs, %llu SENDs, %llu bytes, "
	       "%llu read bytes compared\n",
	       nq, rounds, (unsigned long long)counts[1], (unsigned long long)counts[2],
	       (unsigned long long)counts[3], (unsigned long long)bytes,
	       (unsigned long long)read_checked);
	return 0;
}

int main(int argc, char **argv)
{
	alarm(120);
	srand48(getpid());
	if (argc == 5 && !strcmp(argv[1], "server")) {
		int n = atoi(argv[3]);
		if (n < 1 || n > MAXQ)
			die("NQPS must be 1..64");
		setup(n);
		return server(atoi(argv[2]), atoi(argv[4]));
	}
	if (argc == 7 && !strcmp(argv[1], "client")) {
		int n = atoi(argv[4]);
		if (n < 1 || n > MAXQ)
			die("NQPS must be 1..64");
		setup(n);
		return client(argv[2], atoi(argv[3]), atoi(argv[5]), strtoull(argv[6], NULL, 0));
	}
	fprintf(stderr, "usage: %s server PORT NQPS ROUNDS\n"
			"       %s client SERVER_IP PORT NQPS ROUNDS SEED\n",
		argv[0], argv[0]);
	return 2;
}
