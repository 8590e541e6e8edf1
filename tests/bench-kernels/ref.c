/*
 * ptx-bench's plain-C reference: the computations of the bench's PTX
 * kernels (matrixMul.ptx, reduction.ptx, saxpy.ptx, hash.ptx) as
 * straightforward scalar loops on one core, with the same inputs.
 * ptx-bench builds it with `cc -O2 -fno-tree-vectorize` (no SIMD, no
 * threads), so it does the work of one GPU thread after another.
 *
 * Usage: ref <matmul_n> <reduce_n> <saxpy_n> <hash_threads> <hash_iters> <reps>
 * Prints one line per kernel: <name> <best seconds> <median seconds> <checksum>
 * (the checksum lets ptx-bench check that it computed the same thing).
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define BLOCK 256

static double now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cmp(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

/* Functions are noinline and take their arrays by pointer, and every result
 * feeds a checksum, so the compiler can neither delete nor hoist the work
 * out of the repetition loop. */
__attribute__((noinline)) static void matmul(float *c, const float *a, const float *b, int n)
{
    for (int i = 0; i < n; i++)
        for (int j = 0; j < n; j++) {
            float s = 0.0f;
            for (int k = 0; k < n; k++)
                s += a[i * n + k] * b[k * n + j];
            c[i * n + j] = s;
        }
}

__attribute__((noinline)) static void reduce(const float *in, float *partial, unsigned n)
{
    unsigned blocks = (n + BLOCK - 1) / BLOCK;
    for (unsigned blk = 0; blk < blocks; blk++) {
        float s = 0.0f;
        for (unsigned i = blk * BLOCK; i < blk * BLOCK + BLOCK && i < n; i++)
            s += in[i];
        partial[blk] = s;
    }
}

__attribute__((noinline)) static void saxpy(int n, float a, const float *x, float *y)
{
    for (int i = 0; i < n; i++)
        y[i] = a * x[i] + y[i];
}

__attribute__((noinline)) static void hash(unsigned *out, unsigned threads, unsigned iters)
{
    for (unsigned i = 0; i < threads; i++) {
        unsigned x = i;
        for (unsigned k = 0; k < iters; k++) {
            x = x * 1664525u + 1013904223u;
            x ^= x >> 13;
            x ^= x << 7;
        }
        out[i] = x;
    }
}

static volatile double sink;
/* Read at run time so the compiler cannot specialise saxpy for a = 2. */
static volatile float saxpy_a = 2.0f;

static void report(const char *name, double *t, int reps, double checksum)
{
    qsort(t, reps, sizeof *t, cmp);
    printf("%s %.9f %.9f %.17g\n", name, t[0], t[reps / 2], checksum);
    sink = checksum;
}

int main(int argc, char **argv)
{
    if (argc != 7) {
        fprintf(stderr, "usage: %s matmul_n reduce_n saxpy_n hash_threads hash_iters reps\n", argv[0]);
        return 2;
    }
    int mn = atoi(argv[1]);
    unsigned rn = (unsigned)strtoul(argv[2], 0, 10);
    int sn = atoi(argv[3]);
    unsigned ht = (unsigned)strtoul(argv[4], 0, 10);
    unsigned hi = (unsigned)strtoul(argv[5], 0, 10);
    int reps = atoi(argv[6]);
    double *t = malloc(sizeof(double) * reps);

    /* matrixMul: same inputs as ptx-bench. */
    {
        size_t w = (size_t)mn * mn;
        float *a = malloc(w * 4), *b = malloc(w * 4), *c = malloc(w * 4);
        for (size_t i = 0; i < w; i++) {
            a[i] = (float)(i % 7) * 0.5f;
            b[i] = (float)(i % 5) * 0.25f;
        }
        for (int r = 0; r < reps; r++) {
            double s = now();
            matmul(c, a, b, mn);
            t[r] = now() - s;
        }
        double sum = 0;
        for (size_t i = 0; i < w; i++)
            sum += c[i];
        report("matrixMul", t, reps, sum);
        free(a), free(b), free(c);
    }

    /* reduction */
    {
        unsigned blocks = (rn + BLOCK - 1) / BLOCK;
        float *in = malloc((size_t)rn * 4), *p = malloc((size_t)blocks * 4);
        for (unsigned i = 0; i < rn; i++)
            in[i] = (float)(i % 17) * 0.25f;
        for (int r = 0; r < reps; r++) {
            double s = now();
            reduce(in, p, rn);
            t[r] = now() - s;
        }
        double sum = 0;
        for (unsigned i = 0; i < blocks; i++)
            sum += p[i];
        report("reduction", t, reps, sum);
        free(in), free(p);
    }

    /* saxpy: y is reset (untimed) before each repetition. */
    {
        float *x = malloc((size_t)sn * 4), *y = malloc((size_t)sn * 4), *y0 = malloc((size_t)sn * 4);
        for (int i = 0; i < sn; i++) {
            x[i] = (float)(i % 13) * 0.5f;
            y0[i] = (float)(i % 7) * 0.25f;
        }
        float a = saxpy_a;
        for (int r = 0; r < reps; r++) {
            memcpy(y, y0, (size_t)sn * 4);
            double s = now();
            saxpy(sn, a, x, y);
            t[r] = now() - s;
        }
        double sum = 0;
        for (int i = 0; i < sn; i++)
            sum += y[i];
        report("saxpy", t, reps, sum);
        free(x), free(y), free(y0);
    }

    /* hash */
    {
        unsigned *out = malloc((size_t)ht * 4);
        for (int r = 0; r < reps; r++) {
            double s = now();
            hash(out, ht, hi);
            t[r] = now() - s;
        }
        double sum = 0;
        for (unsigned i = 0; i < ht; i++)
            sum += out[i];
        report("hash", t, reps, sum);
        free(out);
    }
    free(t);
    return 0;
}
