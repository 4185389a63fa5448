/* Open MPI reference for `nexar bench`: MPI_Allreduce (float sum) timed the way
 * `nexar bench` times it: a barrier before every iteration, warm-up iterations first,
 * the median of the timed ones (the slowest rank's time per iteration; of an even count,
 * the lower of the middle two, as nexar takes), algbw and busbw with nccl-tests' factor
 * 2(n-1)/n, and `ok` only if every rank's results were right. One line per size on
 * rank 0.
 *
 *   mpicc -O2 -o allreduce bench/openmpi/allreduce.c
 *   mpirun --allow-run-as-root --oversubscribe -np 4 --mca btl tcp,self \
 *       --mca btl_tcp_if_include lo ./allreduce 4096 4194304 67108864
 */
#include <mpi.h>
#include <stdio.h>
#include <stdlib.h>

static int cmp(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank, n;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &n);
    int iters = getenv("ITERS") ? atoi(getenv("ITERS")) : 20;
    int warmup = getenv("WARMUP") ? atoi(getenv("WARMUP")) : 5;
    if (iters < 1) iters = 1;
    if (rank == 0)
        printf("%12s %10s %12s %10s %10s %4s\n", "bytes", "world", "time_us", "algbw", "busbw", "ok");
    for (int a = 1; a < argc; a++) {
        long bytes = atol(argv[a]);
        long count = bytes / 4;
        float *buf = malloc(count * sizeof(float));
        double *times = malloc(iters * sizeof(double));
        int ok = 1;
        for (int it = 0; it < warmup + iters; it++) {
            for (long i = 0; i < count; i++) buf[i] = (float)(rank + 1 + (i % 7));
            MPI_Barrier(MPI_COMM_WORLD);
            double t0 = MPI_Wtime();
            MPI_Allreduce(MPI_IN_PLACE, buf, (int)count, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
            double dt = MPI_Wtime() - t0, worst;
            MPI_Allreduce(&dt, &worst, 1, MPI_DOUBLE, MPI_MAX, MPI_COMM_WORLD);
            if (it >= warmup) times[it - warmup] = worst;
            for (long i = 0; i < count; i++) {
                float want = (float)(n * (n + 1) / 2 + n * (i % 7));
                if (buf[i] != want) ok = 0;
            }
        }
        int all_ok;
        MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
        qsort(times, iters, sizeof(double), cmp);
        double med = times[(iters - 1) / 2];
        double algbw = bytes / med / 1e9;
        if (rank == 0)
            printf("%12ld %10d %12.1f %10.3f %10.3f %4s\n", bytes, n, med * 1e6, algbw,
                   algbw * 2.0 * (n - 1) / n, all_ok ? "ok" : "BAD");
        free(buf);
        free(times);
    }
    MPI_Finalize();
    return 0;
}
