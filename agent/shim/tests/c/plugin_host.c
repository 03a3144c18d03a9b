/* Loads a plugin with RTLD_LOCAL, as Python loads extension modules and UCX or MPI their
 * components, and runs its plugin_main with the remaining arguments. It does not link
 * libibverbs: only the plugin does, so libibverbs is outside the global scope.
 * Usage: plugin_host PLUGIN.so ARGS... */
#include <dlfcn.h>
#include <stdio.h>

int main(int argc, char **argv) {
	if (argc < 2) { fprintf(stderr, "usage: plugin_host PLUGIN.so ARGS...\n"); return 2; }
	void *p = dlopen(argv[1], RTLD_NOW | RTLD_LOCAL);
	if (!p) { fprintf(stderr, "plugin_host: %s\n", dlerror()); return 2; }
	int (*plugin_main)(int, char **) = (int (*)(int, char **))dlsym(p, "plugin_main");
	if (!plugin_main) { fprintf(stderr, "plugin_host: %s\n", dlerror()); return 2; }
	return plugin_main(argc - 1, argv + 1);
}
