/*
 * vectorAdd: C = A + B on the device, checked on the host.
 * Uses the primary context, a stream, async copies and timing events.
 */
#include "common.h"
#include <math.h>

int main(int argc, char **argv) {
    int n = argc > 1 ? atoi(argv[1]) : 50000;
    size_t bytes = (size_t)n * sizeof(float);
    float *a = malloc(bytes), *b = malloc(bytes), *c = malloc(bytes);
    for (int i = 0; i < n; i++) {
        a[i] = (float)rand() / (float)RAND_MAX;
        b[i] = (float)rand() / (float)RAND_MAX;
    }

    CUdevice dev;
    CUcontext ctx;
    char name[256];
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuDeviceGetName(name, sizeof name, dev));
    CHECK(cuDevicePrimaryCtxRetain(&ctx, dev));
    CHECK(cuCtxSetCurrent(ctx));

    CUmodule mod;
    CUfunction fn;
    char *ptx = load_ptx("vectorAdd.ptx");
    CHECK(cuModuleLoadData(&mod, ptx));
    CHECK(cuModuleGetFunction(&fn, mod, "vectorAdd"));

    CUdeviceptr da, db, dc;
    CUstream s;
    CUevent start, stop;
    CHECK(cuMemAlloc(&da, bytes));
    CHECK(cuMemAlloc(&db, bytes));
    CHECK(cuMemAlloc(&dc, bytes));
    CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
    CHECK(cuEventCreate(&start, CU_EVENT_DEFAULT));
    CHECK(cuEventCreate(&stop, CU_EVENT_DEFAULT));
    CHECK(cuMemcpyHtoDAsync(da, a, bytes, s));
    CHECK(cuMemcpyHtoDAsync(db, b, bytes, s));

    int threads = 256, blocks = (n + threads - 1) / threads;
    void *args[] = {&da, &db, &dc, &n};
    CHECK(cuEventRecord(start, s));
    CHECK(cuLaunchKernel(fn, blocks, 1, 1, threads, 1, 1, 0, s, args, NULL));
    CHECK(cuEventRecord(stop, s));
    CHECK(cuMemcpyDtoHAsync(c, dc, bytes, s));
    CHECK(cuStreamSynchronize(s));
    float ms = 0;
    CHECK(cuEventElapsedTime(&ms, start, stop));

    for (int i = 0; i < n; i++) {
        if (fabsf(a[i] + b[i] - c[i]) > 1e-5f) {
            fprintf(stderr, "vectorAdd: FAILED at %d: %f + %f != %f\n", i, a[i], b[i], c[i]);
            return 1;
        }
    }
    CHECK(cuEventDestroy(start));
    CHECK(cuEventDestroy(stop));
    CHECK(cuStreamDestroy(s));
    CHECK(cuMemFree(da));
    CHECK(cuMemFree(db));
    CHECK(cuMemFree(dc));
    CHECK(cuModuleUnload(mod));
    CHECK(cuDevicePrimaryCtxRelease(dev));
    printf("vectorAdd: PASSED n=%d kernel=%.3f ms on %s\n", n, ms, name);
    return 0;
}
