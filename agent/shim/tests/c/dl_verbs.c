/* A verbs program that does not link libibverbs: it dlopens it with RTLD_LOCAL and takes
 * every function it calls from the handle with dlsym, as NCCL does; posting and polling are
 * the inline verbs (through the context's ops). It connects QPS loopback QP pairs of one
 * context, sends MESSAGES SENDs on each (signalled, a window of 8 per QP), and checks that
 * every one arrives with its bytes, in order per QP. Prints "dl ok" and exits 0 on success.
 * Usage: dl_verbs QPS MESSAGES
 *
 * Built with -DPLUGIN -shared -fPIC -libverbs it is a plugin instead, whose plugin_main
 * calls the functions it links, and which plugin_host loads with RTLD_LOCAL, as Python loads
 * extension modules (pyverbs) and UCX or MPI their components: libibverbs then sits outside
 * the global scope, where the shim's exports still catch the plugin's calls. */
#include <infiniband/verbs.h>
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define SIZE 256
#define WINDOW 8

static struct ibv_device **(*get_device_list)(int *);
static void (*free_device_list)(struct ibv_device **);
static struct ibv_context *(*open_device)(struct ibv_device *);
static int (*close_device)(struct ibv_context *);
static struct ibv_pd *(*alloc_pd)(struct ibv_context *);
static int (*dealloc_pd)(struct ibv_pd *);
static struct ibv_mr *(*reg_mr)(struct ibv_pd *, void *, size_t, int);
static int (*dereg_mr)(struct ibv_mr *);
static struct ibv_cq *(*create_cq)(struct ibv_context *, int, void *, struct ibv_comp_channel *, int);
static int (*destroy_cq)(struct ibv_cq *);
static struct ibv_qp *(*create_qp)(struct ibv_pd *, struct ibv_qp_init_attr *);
static int (*destroy_qp)(struct ibv_qp *);
static int (*modify_qp)(struct ibv_qp *, struct ibv_qp_attr *, int);
static int (*query_gid)(struct ibv_context *, uint8_t, int, union ibv_gid *);

#define LOOPBACK_MODIFY_QP modify_qp
#include "loopback.h"

static void die(const char *m) { fprintf(stderr, "dl_verbs: %s\n", m); exit(2); }

#ifdef PLUGIN
#define BIND(var, fn) var = fn
#else
static void *need(void *lib, const char *name) {
	void *f = dlsym(lib, name);
	if (!f) die(name);
	return f;
}
#define BIND(var, fn) var = need(lib, #fn)
#endif

static void connect_qp(struct ibv_qp *qp, uint32_t dest, const union ibv_gid *gid) {
	const char *failed = loopback_connect(qp, dest, gid, 0);
	if (failed) die(failed);
}

static void fill(char *p, int q, int seq) {
	for (int i = 0; i < SIZE; i++) p[i] = (char)(q * 13 + seq * 5 + i);
}

#ifdef PLUGIN
int plugin_main(int argc, char **argv) {
#else
int main(int argc, char **argv) {
#endif
	if (argc != 3) { fprintf(stderr, "usage: dl_verbs QPS MESSAGES\n"); return 2; }
	int nq = atoi(argv[1]), msgs = atoi(argv[2]), n;
#ifndef PLUGIN
	void *lib = dlopen("libibverbs.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!lib) die(dlerror());
#endif
	BIND(get_device_list, ibv_get_device_list);
	BIND(free_device_list, ibv_free_device_list);
	BIND(open_device, ibv_open_device);
	BIND(close_device, ibv_close_device);
	BIND(alloc_pd, ibv_alloc_pd);
	BIND(dealloc_pd, ibv_dealloc_pd);
	BIND(reg_mr, ibv_reg_mr);
	BIND(dereg_mr, ibv_dereg_mr);
	BIND(create_cq, ibv_create_cq);
	BIND(destroy_cq, ibv_destroy_cq);
	BIND(create_qp, ibv_create_qp);
	BIND(destroy_qp, ibv_destroy_qp);
	BIND(modify_qp, ibv_modify_qp);
	BIND(query_gid, ibv_query_gid);

	struct ibv_device **l = get_device_list(&n);
	if (!l || n < 1) die("no device");
	struct ibv_context *ctx = open_device(l[0]);
	if (!ctx) die("open");
	struct ibv_pd *pd = alloc_pd(ctx);
	union ibv_gid gid;
	if (!pd || query_gid(ctx, 1, 0, &gid)) die("pd/gid");
	struct ibv_cq *scq = create_cq(ctx, nq * WINDOW, NULL, NULL, 0);
	struct ibv_cq *rcq = create_cq(ctx, nq * WINDOW, NULL, NULL, 0);
	char *buf = calloc((size_t)nq * 2 * WINDOW, SIZE);
	if (!scq || !rcq || !buf) die("cq/buf");
	struct ibv_mr *mr = reg_mr(pd, buf, (size_t)nq * 2 * WINDOW * SIZE, IBV_ACCESS_LOCAL_WRITE);
	struct ibv_qp **tx = calloc(nq, sizeof *tx), **rx = calloc(nq, sizeof *rx);
	int *sent = calloc(nq, sizeof(int)), *acked = calloc(nq, sizeof(int)), *got = calloc(nq, sizeof(int));
	if (!mr || !tx || !rx || !sent || !acked || !got) die("setup");
	for (int q = 0; q < nq; q++) {
		struct ibv_qp_init_attr ia = { .send_cq = scq, .recv_cq = rcq, .qp_type = IBV_QPT_RC,
			.cap = { .max_send_wr = WINDOW, .max_recv_wr = WINDOW, .max_send_sge = 1, .max_recv_sge = 1 } };
		tx[q] = create_qp(pd, &ia);
		rx[q] = create_qp(pd, &ia);
		if (!tx[q] || !rx[q]) die("qp");
		connect_qp(tx[q], rx[q]->qp_num, &gid);
		connect_qp(rx[q], tx[q]->qp_num, &gid);
		for (int s = 0; s < WINDOW; s++) {
			struct ibv_sge sg = { (uintptr_t)(buf + ((size_t)(2 * q + 1) * WINDOW + s) * SIZE), SIZE, mr->lkey };
			struct ibv_recv_wr w = { .wr_id = s, .sg_list = &sg, .num_sge = 1 }, *bad;
			if (ibv_post_recv(rx[q], &w, &bad)) die("post_recv");
		}
	}
	for (int done = 0; done < nq;) {
		for (int q = 0; q < nq; q++) {
			while (sent[q] < msgs && sent[q] - acked[q] < WINDOW) {
				char *src = buf + ((size_t)2 * q * WINDOW + sent[q] % WINDOW) * SIZE;
				fill(src, q, sent[q]);
				struct ibv_sge sg = { (uintptr_t)src, SIZE, mr->lkey };
				struct ibv_send_wr w = { .wr_id = sent[q], .sg_list = &sg, .num_sge = 1,
					.opcode = IBV_WR_SEND, .send_flags = IBV_SEND_SIGNALED }, *bad;
				if (ibv_post_send(tx[q], &w, &bad)) die("post_send");
				sent[q]++;
			}
		}
		struct ibv_wc wc[16];
		int k = ibv_poll_cq(scq, 16, wc);
		for (int i = 0; i < k; i++) {
			if (wc[i].status) die("send completion");
			for (int q = 0; q < nq; q++)
				if (tx[q]->qp_num == wc[i].qp_num) acked[q]++;
		}
		k = ibv_poll_cq(rcq, 16, wc);
		for (int i = 0; i < k; i++) {
			int q = 0;
			while (q < nq && rx[q]->qp_num != wc[i].qp_num) q++;
			if (q == nq || wc[i].status || wc[i].byte_len != SIZE) die("receive completion");
			char want[SIZE], *at = buf + ((size_t)(2 * q + 1) * WINDOW + wc[i].wr_id) * SIZE;
			fill(want, q, got[q]);
			if (memcmp(at, want, SIZE)) die("payload or order");
			struct ibv_sge sg = { (uintptr_t)at, SIZE, mr->lkey };
			struct ibv_recv_wr w = { .wr_id = wc[i].wr_id, .sg_list = &sg, .num_sge = 1 }, *bad;
			if (ibv_post_recv(rx[q], &w, &bad)) die("post_recv");
			if (++got[q] == msgs) done++;
		}
	}
	for (int q = 0; q < nq; q++)
		while (acked[q] < msgs) {
			struct ibv_wc wc;
			int k = ibv_poll_cq(scq, 1, &wc);
			if (k < 0 || (k && wc.status)) die("send completion");
			for (int r = 0; k && r < nq; r++)
				if (tx[r]->qp_num == wc.qp_num) acked[r]++;
		}
	for (int q = 0; q < nq; q++)
		if (destroy_qp(tx[q]) || destroy_qp(rx[q])) die("destroy qp");
	if (dereg_mr(mr) || destroy_cq(scq) || destroy_cq(rcq) || dealloc_pd(pd) || close_device(ctx))
		die("teardown");
	free_device_list(l);
	printf("dl ok\n");
	return 0;
}
