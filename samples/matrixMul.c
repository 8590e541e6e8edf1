/*
 * matrixMul: tiled C = A * B (16x16 shared-memory tiles), compared with a
 * host reference. Uses cuCtxCreate (the CUDA 13 _v4 form) and kernelParams.
 */
#include "common.h"
#include <math.h>

int main(int argc, char **argv) {
    int dim = argc > 1 ? atoi(argv[1]) : 256;
    if (dim <= 0 || dim % 16) {
        fprintf(stderr, "matrixMul: size must be a positive multiple of 16\n");
        return 2;
    }
    int hA = dim, wA = dim, wB = dim;
    size_t sa = (size_t)hA * wA, sb = (size_t)wA * wB, sc = (size_t)hA * wB;
    float *a = malloc(sa * 4), *b = malloc(sb * 4), *c = malloc(sc * 4);
    for (size_t i = 0; i < sa; i++) a[i] = (float)((i * 7) % 13) / 13.0f - 0.5f;
    for (size_t i = 0; i < sb; i++) b[i] = (float)((i * 5) % 11) / 11.0f;

    CUdevice dev;
    CUcontext ctx;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&ctx, NULL, 0, dev));

    CUmodule mod;
    CUfunction fn;
    CHECK(cuModuleLoadData(&mod, load_ptx("matrixMul.ptx")));
    CHECK(cuModuleGetFunction(&fn, mod, "matrixMul"));

    CUdeviceptr da, db, dc;
    CHECK(cuMemAlloc(&da, sa * 4));
    CHECK(cuMemAlloc(&db, sb * 4));
    CHECK(cuMemAlloc(&dc, sc * 4));
    CHECK(cuMemcpyHtoD(da, a, sa * 4));
    CHECK(cuMemcpyHtoD(db, b, sb * 4));
    CHECK(cuMemsetD32(dc, 0xFFFFFFFFu, sc));

    CUevent start, stop;
    CHECK(cuEventCreate(&start, 0));
    CHECK(cuEventCreate(&stop, 0));
    void *args[] = {&dc, &da, &db, &wA, &wB};
    CHECK(cuEventRecord(start, NULL));
    CHECK(cuLaunchKernel(fn, wB / 16, hA / 16, 1, 16, 16, 1, 0, NULL, args, NULL));
    CHECK(cuEventRecord(stop, NULL));
    CHECK(cuCtxSynchronize());
    CHECK(cuMemcpyDtoH(c, dc, sc * 4));
    float ms = 0;
    CHECK(cuEventElapsedTime(&ms, start, stop));

    for (int r = 0; r < hA; r++) {
        for (int col = 0; col < wB; col++) {
            double ref = 0;
            for (int k = 0; k < wA; k++) ref += (double)a[r * wA + k] * (double)b[k * wB + col];
            double got = c[r * wB + col];
            if (fabs(got - ref) > 1e-3 * (1.0 + fabs(ref))) {
                fprintf(stderr, "matrixMul: FAILED at [%d][%d]: %f vs reference %f\n", r, col, got, ref);
                return 1;
            }
        }
    }
    CHECK(cuMemFree(da));
    CHECK(cuMemFree(db));
    CHECK(cuMemFree(dc));
    CHECK(cuCtxDestroy(ctx));
    printf("matrixMul: PASSED %dx%d kernel=%.1f ms (%.3f GFLOP/s)\n", dim, dim, ms, 2.0 * hA * wA * wB / (ms * 1e6));
    return 0;
}
