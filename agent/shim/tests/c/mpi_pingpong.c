/* An MPI ping-pong between ranks 0 and 1 that checks every byte: rank 0 sends ITERS messages
 * of 8 B, 4 KiB, 64 KiB and 1 MiB (contents vary with size and iteration), rank 1 checks and
 * echoes each, rank 0 checks the echo. Rank 0 prints each size's half round trip, then
 * "mpi ok". Any mismatch aborts the job with code 3. */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define ITERS 100

static void expect(const unsigned char *got, const unsigned char *want, size_t len, const char *what) {
	if (memcmp(got, want, len)) {
		fprintf(stderr, "mpi_pingpong: %s differs\n", what);
		MPI_Abort(MPI_COMM_WORLD, 3);
	}
}

int main(int argc, char **argv) {
	MPI_Init(&argc, &argv);
	int rank;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	const size_t sizes[] = { 8, 4096, 65536, 1 << 20 };
	for (int s = 0; s < 4; s++) {
		size_t len = sizes[s];
		unsigned char *b = malloc(len), *want = malloc(len);
		if (!b || !want) MPI_Abort(MPI_COMM_WORLD, 2);
		double t0 = MPI_Wtime();
		for (int i = 0; i < ITERS; i++) {
			for (size_t k = 0; k < len; k++) want[k] = (unsigned char)(k * 31 + i * 7 + s);
			if (rank == 0) {
				memcpy(b, want, len);
				MPI_Send(b, (int)len, MPI_BYTE, 1, i, MPI_COMM_WORLD);
				memset(b, 0, len);
				MPI_Recv(b, (int)len, MPI_BYTE, 1, i, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				expect(b, want, len, "echo");
			} else if (rank == 1) {
				MPI_Recv(b, (int)len, MPI_BYTE, 0, i, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
				expect(b, want, len, "message");
				MPI_Send(b, (int)len, MPI_BYTE, 0, i, MPI_COMM_WORLD);
			}
		}
		if (rank == 0) printf("size %zu half-rtt %.1f us\n", len, (MPI_Wtime() - t0) / ITERS / 2 * 1e6);
		free(b);
		free(want);
	}
	if (rank == 0) printf("mpi ok\n");
	MPI_Finalize();
	return 0;
}
