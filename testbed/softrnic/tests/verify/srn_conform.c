/*
 * srn_conform: what a kernel RDMA device (and mlx5, the reference provider) does that
 * rdma-core's pyverbs tests and UCX rely on, checked on one host (used by softrnic's
 * integration tests; plain verbs).
 *
 *   srn_conform [CHILDREN ROUNDS]
 *
 *   1. a CQ on a completion vector the device does not have (ibv_create_cq and
 *      ibv_create_cq_ex) is refused with EINVAL;
 *   2. ibv_query_device_ex reports phys_port_cnt_ex as phys_port_cnt, device_cap_flags_ex
 *      with device_cap_flags in its low bits, and multicast limits;
 *   3. copies to and from device memory need 4-byte aligned offset and length (EINVAL;
 *      EFAULT first past the end), and a device memory MR may be empty;
 *   5. ibv_import_device on the uverbs node finds the device (EOPNOTSUPP: it cannot import,
 *      not ENODEV);
 *   9. a completion channel used by ibv_create_cq_ex holds one reference while the CQ lives
 *      and can be destroyed after it;
 *  10. GID 0 is RoCE v2 on the host's network device (ibv_query_gid_ex, from sysfs'
 *      gid_attrs/types and gid_attrs/ndevs), and /sys/class/infiniband/DEV/device/net lists
 *      that device (exec shows the device's sysfs at /sys);
 *   6. CHILDREN (default 16) forked children each make and destroy a PD, an MR on their own
 *      memory, a CQ and device memory ROUNDS (default 50) times on the one context they
 *      inherited, all at once; every one succeeds, and the parent works afterwards.
 * Exit status 0 and a final line "OK ..." when everything matched; otherwise a message and 1.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <sys/wait.h>

#include "srn_common.h"

static void expect_errno(const void *made, int want, const char *what)
{
	if (made || errno != want) {
		fprintf(stderr, "FAIL: %s: %s, errno %d (want %d)\n", what,
			made ? "made" : "refused", errno, want);
		exit(1);
	}
}

static void expect_rc(int rc, int want, const char *what)
{
	if (rc != want) {
		fprintf(stderr, "FAIL: %s: %d (want %d)\n", what, rc, want);
		exit(1);
	}
}

static void comp_vectors(struct ibv_context *ctx)
{
	errno = 0;
	expect_errno(ibv_create_cq(ctx, 16, NULL, NULL, ctx->num_comp_vectors), EINVAL,
		     "ibv_create_cq on vector num_comp_vectors");
	errno = 0;
	expect_errno(ibv_create_cq(ctx, 16, NULL, NULL, -1), EINVAL, "ibv_create_cq on vector -1");
	struct ibv_cq_init_attr_ex a = {.cqe = 16, .comp_vector = ctx->num_comp_vectors};
	errno = 0;
	expect_errno(ibv_create_cq_ex(ctx, &a), EINVAL, "ibv_create_cq_ex on a missing vector");
	struct ibv_cq *cq = ibv_create_cq(ctx, 16, NULL, NULL, ctx->num_comp_vectors - 1);
	if (!cq || ibv_destroy_cq(cq))
		die("ibv_create_cq on the last vector");
}

static void device_attrs(struct ibv_context *ctx)
{
	struct ibv_device_attr_ex a;
	if (ibv_query_device_ex(ctx, NULL, &a))
		die("ibv_query_device_ex");
	if (a.phys_port_cnt_ex != a.orig_attr.phys_port_cnt || a.phys_port_cnt_ex != 1)
		die("phys_port_cnt_ex");
	if ((uint32_t)a.device_cap_flags_ex != a.orig_attr.device_cap_flags ||
	    !a.orig_attr.device_cap_flags)
		die("device_cap_flags_ex");
	if (a.orig_attr.max_mcast_grp <= 0 || a.orig_attr.max_mcast_qp_attach <= 0 ||
	    a.orig_attr.max_total_mcast_qp_attach < a.orig_attr.max_mcast_qp_attach)
		die("multicast limits");
}

static void device_memory(struct ibv_context *ctx, struct ibv_pd *pd)
{
	struct ibv_alloc_dm_attr da = {.length = 64};
	struct ibv_dm *dm = ibv_alloc_dm(ctx, &da);
	if (!dm)
		die("ibv_alloc_dm");
	uint8_t buf[128] = {1, 2, 3, 4, 5, 6, 7, 8}, back[128];
	expect_rc(ibv_memcpy_to_dm(dm, 1, buf, 4), EINVAL, "copy to an unaligned offset");
	expect_rc(ibv_memcpy_to_dm(dm, 4, buf, 3), EINVAL, "copy of an unaligned length");
	expect_rc(ibv_memcpy_from_dm(back, dm, 2, 4), EINVAL, "copy from an unaligned offset");
	expect_rc(ibv_memcpy_from_dm(back, dm, 0, 6), EINVAL, "copy of an unaligned length back");
	expect_rc(ibv_memcpy_to_dm(dm, 68, buf, 4), EFAULT, "copy past the end");
	expect_rc(ibv_memcpy_to_dm(dm, 0, buf, 68), EFAULT, "copy longer than the DM");
	expect_rc(ibv_memcpy_to_dm(dm, 61, buf, 4), EFAULT, "past the end before unaligned");
	expect_rc(ibv_memcpy_to_dm(dm, 4, buf, 8), 0, "aligned copy");
	expect_rc(ibv_memcpy_from_dm(back, dm, 4, 8), 0, "aligned copy back");
	if (memcmp(back, buf, 8))
		die("device memory data");
	int access = IBV_ACCESS_ZERO_BASED | IBV_ACCESS_LOCAL_WRITE;
	struct ibv_mr *empty = ibv_reg_dm_mr(pd, dm, 0, 0, access);
	if (!empty)
		die("ibv_reg_dm_mr of 0 bytes");
	if (ibv_dereg_mr(empty) || ibv_free_dm(dm))
		die("releasing device memory");
	errno = 0;
	expect_errno(ibv_reg_mr(pd, buf, 0, IBV_ACCESS_LOCAL_WRITE), EINVAL,
		     "ibv_reg_mr of 0 bytes");
}

static void import_device(void)
{
	int fd = open("/dev/infiniband/uverbs0", O_RDWR | O_CLOEXEC);
	if (fd < 0)
		die("open /dev/infiniband/uverbs0");
	errno = 0;
	expect_errno(ibv_import_device(fd), EOPNOTSUPP, "ibv_import_device");
	close(fd);
}

static void channel_refcount(struct ibv_context *ctx)
{
	struct ibv_comp_channel *ch = ibv_create_comp_channel(ctx);
	if (!ch)
		die("ibv_create_comp_channel");
	struct ibv_cq_init_attr_ex a = {.cqe = 16, .channel = ch};
	struct ibv_cq_ex *cq = ibv_create_cq_ex(ctx, &a);
	if (!cq)
		die("ibv_create_cq_ex on a channel");
	expect_rc(ch->refcnt, 1, "the channel's references while its CQ lives");
	expect_rc(ibv_destroy_comp_channel(ch), EBUSY, "destroying a channel in use");
	if (ibv_destroy_cq(ibv_cq_ex_to_cq(cq)))
		die("ibv_destroy_cq");
	expect_rc(ibv_destroy_comp_channel(ch), 0, "destroying the channel after its CQ");
}

static void gid_netdev(struct ibv_context *ctx)
{
	struct ibv_gid_entry e;
	if (ibv_query_gid_ex(ctx, 1, 0, &e, 0))
		die("ibv_query_gid_ex");
	if (e.gid_type != IBV_GID_TYPE_ROCE_V2)
		die("GID 0 is not RoCE v2");
	if (!e.ndev_ifindex)
		die("GID 0 has no network device");
	char dir[256], name[IF_NAMESIZE];
	snprintf(dir, sizeof dir, "/sys/class/infiniband/%s/device/net",
		 ibv_get_device_name(ctx->device));
	DIR *d = opendir(dir);
	if (!d)
		die("no /sys/class/infiniband/DEV/device/net");
	struct dirent *de;
	int found = 0;
	while ((de = readdir(d)))
		found |= de->d_name[0] != '.' &&
			 if_nametoindex(de->d_name) == e.ndev_ifindex;
	closedir(d);
	if (!found)
		die("device/net does not list the GID's network device");
	printf("GID 0: RoCE v2 on %s\n", if_indextoname(e.ndev_ifindex, name));
}

/* One forked child's work on the context it inherited. */
static int child_rounds(struct ibv_context *ctx, int rounds)
{
	static uint8_t mem[4096];
	for (int i = 0; i < rounds; i++) {
		struct ibv_pd *pd = ibv_alloc_pd(ctx);
		if (!pd)
			return 1;
		struct ibv_mr *mr = ibv_reg_mr(pd, mem, sizeof mem, IBV_ACCESS_LOCAL_WRITE);
		struct ibv_cq *cq = ibv_create_cq(ctx, 8, NULL, NULL, 0);
		struct ibv_alloc_dm_attr da = {.length = 64};
		struct ibv_dm *dm = ibv_alloc_dm(ctx, &da);
		if (!mr || !cq || !dm || ibv_memcpy_to_dm(dm, 0, mem, 64))
			return 2;
		if (ibv_free_dm(dm) || ibv_destroy_cq(cq) || ibv_dereg_mr(mr) ||
		    ibv_dealloc_pd(pd))
			return 3;
	}
	return 0;
}

static void forked_children(struct ibv_context *ctx, int children, int rounds)
{
	pid_t pids[256];
	for (int c = 0; c < children; c++) {
		pids[c] = fork();
		if (pids[c] < 0)
			die("fork");
		if (!pids[c])
			_exit(child_rounds(ctx, rounds));
	}
	int failed = 0;
	for (int c = 0; c < children; c++) {
		int st;
		if (waitpid(pids[c], &st, 0) != pids[c] || !WIFEXITED(st) || WEXITSTATUS(st)) {
			fprintf(stderr, "child %d: status %#x\n", c, st);
			failed++;
		}
	}
	if (failed)
		die("forked children");
	if (child_rounds(ctx, 3))
		die("the parent after its children");
}

int main(int argc, char **argv)
{
	int children = argc > 2 ? atoi(argv[1]) : 16, rounds = argc > 2 ? atoi(argv[2]) : 50;
	if (children < 1 || children > 256 || rounds < 1)
		die("usage: srn_conform [CHILDREN ROUNDS]");
	setvbuf(stdout, NULL, _IONBF, 0);
	struct ibv_context *ctx = open_first_device();
	struct ibv_pd *pd = ibv_alloc_pd(ctx);
	if (!pd)
		die("ibv_alloc_pd");
	comp_vectors(ctx);
	device_attrs(ctx);
	device_memory(ctx, pd);
	import_device();
	channel_refcount(ctx);
	gid_netdev(ctx);
	forked_children(ctx, children, rounds);
	printf("OK conformance: %d forked children x %d rounds on one context\n", children,
	       rounds);
	return 0;
}
