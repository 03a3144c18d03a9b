/* Calls mlx5dv_init_obj (from the library LIB, linked) for a QP, then for a CQ through
 * dlopen(LIB) and dlsym, then for a PD (no queues), and prints the three answers.
 * Usage: direct_verbs LIB */
#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

int mlx5dv_init_obj(void *obj, uint64_t obj_type);

int main(int argc, char **argv) {
	if (argc != 2) { fprintf(stderr, "usage: direct_verbs LIB\n"); return 2; }
	int linked = mlx5dv_init_obj(0, 1); /* MLX5DV_OBJ_QP */
	void *h = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	if (!h) { fprintf(stderr, "%s\n", dlerror()); return 2; }
	int (*f)(void *, uint64_t) = (int (*)(void *, uint64_t))dlsym(h, "mlx5dv_init_obj");
	int looked_up = f ? f(0, 2) : -1; /* MLX5DV_OBJ_CQ */
	int other = mlx5dv_init_obj(0, 1 << 6); /* MLX5DV_OBJ_PD */
	printf("direct %d %d %d\n", linked, looked_up, other);
	return 0;
}
