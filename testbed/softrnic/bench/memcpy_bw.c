/* memcpy bandwidth of this machine, in the same units as perftest (MiB/s): 64 KiB copies
 * walking 64 MiB source and destination buffers (so the data comes from DRAM, as a NIC's
 * DMA would), for about one second; best of three. */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

int main(void)
{
	const size_t total = 64u << 20, blk = 64u << 10;
	char *src = malloc(total), *dst = malloc(total);
	if (!src || !dst)
		return 1;
	memset(src, 1, total);
	memset(dst, 2, total);
	double best = 0;
	for (int rep = 0; rep < 3; rep++) {
		double t0 = now(), t;
		size_t bytes = 0, off = 0;
		do {
			memcpy(dst + off, src + off, blk);
			off = (off + blk) % total;
			bytes += blk;
		} while ((t = now()) - t0 < 0.33);
		double mib = bytes / (t - t0) / (1 << 20);
		if (mib > best)
			best = mib;
	}
	printf("%.0f\n", best);
	return dst[12345] == 1 ? 0 : 1;
}
