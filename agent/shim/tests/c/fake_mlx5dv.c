/* Stands in for libmlx5's direct verbs in the shim's tests: mlx5dv_init_obj answers
 * 40 + the object types asked for, so a caller can tell the call reached it. */
#include <stdint.h>

int mlx5dv_init_obj(void *obj, uint64_t obj_type);

int mlx5dv_init_obj(void *obj, uint64_t obj_type) {
	(void)obj;
	return 40 + (int)obj_type;
}
