/*
 * reduction: sums a vector with a shared-memory tree, shfl.sync.down and
 * atomicAdd (f32 and u32), then checks a butterfly warp all-reduce. Entry
 * points come from cuGetProcAddress and the launch uses the `extra` form.
 */
#include "common.h"
#include <math.h>

typedef CUresult (*alloc_fn)(CUdeviceptr *, size_t);

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : (1 << 20);
    float *x = malloc((size_t)n * 4);
    double want = 0;
    for (int i = 0; i < n; i++) {
        x[i] = (float)(i % 101) * 0.25f;
        want += x[i];
    }

    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&ctx, NULL, 0, dev));

    alloc_fn alloc = NULL;
    CUdriverProcAddressQueryResult st;
    CHECK(cuGetProcAddress("cuMemAlloc", (void **)&alloc, 12000, CU_GET_PROC_ADDRESS_DEFAULT, &st));
    if (!alloc || st != CU_GET_PROC_ADDRESS_SUCCESS) {
        fprintf(stderr, "reduction: FAILED: cuGetProcAddress(cuMemAlloc)\n");
        return 1;
    }

    CUmodule mod;
    CUfunction reduce, bfly;
    CHECK(cuModuleLoadData(&mod, load_ptx("reduction.ptx")));
    CHECK(cuModuleGetFunction(&reduce, mod, "reduce"));
    CHECK(cuModuleGetFunction(&bfly, mod, "warpSumBfly"));

    CUdeviceptr dx, dout, dblocks;
    CHECK(alloc(&dx, (size_t)n * 4));
    CHECK(alloc(&dout, 4));
    CHECK(alloc(&dblocks, 4));
    CHECK(cuMemcpyHtoD(dx, x, (size_t)n * 4));
    CHECK(cuMemsetD32(dout, 0, 1));
    CHECK(cuMemsetD32(dblocks, 0, 1));

    /* Packed parameter buffer, as the `extra` form takes it. */
    struct {
        CUdeviceptr in, out, blocks;
        int n;
        int pad;
    } p = {dx, dout, dblocks, n, 0};
    size_t psize = 28;
    void *extra[] = {CU_LAUNCH_PARAM_BUFFER_POINTER, &p, CU_LAUNCH_PARAM_BUFFER_SIZE, &psize, CU_LAUNCH_PARAM_END};
    int grid = 64;
    CHECK(cuLaunchKernel(reduce, grid, 1, 1, 256, 1, 1, 0, NULL, NULL, extra));
    float got = 0;
    unsigned blocks = 0;
    CHECK(cuMemcpyDtoH(&got, dout, 4));
    CHECK(cuMemcpyDtoH(&blocks, dblocks, 4));
    if (fabs(got - want) > 1e-4 * want || blocks != (unsigned)grid) {
        fprintf(stderr, "reduction: FAILED: sum %f (want %f), blocks %u (want %d)\n", got, want, blocks, grid);
        return 1;
    }

    /* Butterfly: every lane ends with its warp's total. */
    int m = 256;
    int *iv = malloc(m * 4), *ov = malloc(m * 4);
    for (int i = 0; i < m; i++) iv[i] = i * 3 + 1;
    CUdeviceptr din, dbo;
    CHECK(alloc(&din, m * 4));
    CHECK(alloc(&dbo, m * 4));
    CHECK(cuMemcpyHtoD(din, iv, m * 4));
    void *args[] = {&din, &dbo};
    CHECK(cuLaunchKernel(bfly, m / 64, 1, 1, 64, 1, 1, 0, NULL, args, NULL));
    CHECK(cuMemcpyDtoH(ov, dbo, m * 4));
    for (int i = 0; i < m; i++) {
        int w = i / 32, s = 0;
        for (int j = w * 32; j < w * 32 + 32; j++) s += iv[j];
        if (ov[i] != s) {
            fprintf(stderr, "reduction: FAILED: butterfly lane %d = %d, want %d\n", i, ov[i], s);
            return 1;
        }
    }
    CHECK(cuCtxDestroy(ctx));
    printf("reduction: PASSED n=%d sum=%.1f blocks=%u\n", n, got, blocks);
    return 0;
}
