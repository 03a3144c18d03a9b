/* Takes the hardware queues of its QP and CQ with direct verbs, as an mlx5 program does
 * before it posts and polls them itself: opens the first device, creates a CQ and an RC QP,
 * and calls mlx5dv_init_obj for both at once. The function is looked up with
 * dlsym(RTLD_DEFAULT), so the program links without libmlx5; under the shim that finds the
 * shim's export. Prints "init_obj RC" (the call's answer) and then holds the device for up
 * to 60 s (until killed).
 * Usage: direct_queues */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <infiniband/mlx5dv.h>
#include <infiniband/verbs.h>
#include <stdio.h>
#include <unistd.h>

static int fail(const char *m) { fprintf(stderr, "direct_queues: %s\n", m); return 2; }

int main(void) {
	struct ibv_device **devs = ibv_get_device_list(NULL);
	if (!devs || !devs[0]) return fail("no device");
	struct ibv_context *ctx = ibv_open_device(devs[0]);
	if (!ctx) return fail("ibv_open_device");
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, 0);
	if (!pd || !cq) return fail("pd or cq");
	struct ibv_qp_init_attr a = { .send_cq = cq, .recv_cq = cq, .qp_type = IBV_QPT_RC,
		.cap = { .max_send_wr = 8, .max_recv_wr = 8, .max_send_sge = 1, .max_recv_sge = 1 } };
	struct ibv_qp *qp = ibv_create_qp(pd, &a);
	if (!qp) return fail("ibv_create_qp");
	int (*init_obj)(struct mlx5dv_obj *, uint64_t) =
		(int (*)(struct mlx5dv_obj *, uint64_t))dlsym(RTLD_DEFAULT, "mlx5dv_init_obj");
	if (!init_obj) return fail("no mlx5dv_init_obj (neither the shim nor libmlx5 is loaded)");
	struct mlx5dv_qp dv_qp;
	struct mlx5dv_cq dv_cq;
	struct mlx5dv_obj obj = { .qp = { qp, &dv_qp }, .cq = { cq, &dv_cq } };
	printf("init_obj %d\n", init_obj(&obj, MLX5DV_OBJ_QP | MLX5DV_OBJ_CQ));
	fflush(stdout);
	sleep(60);
	return 0;
}
