/*
 * A CUDA runtime API program, as application code is written: it links
 * NVIDIA's libcudart (from PyPI), compiles its kernels at run time with
 * NVRTC, loads them with cudaLibraryLoadData and launches them with
 * cudaLaunchKernel. It exercises device queries, allocation, copies
 * (pageable, pinned, 2D, device to device, unified), memsets, streams,
 * events, host functions, stream-ordered allocation and memory pools, and
 * the memory quota. Each check prints
 * "ok <name>"; any failure prints "FAIL <name>: <why>" and exits 1.
 *
 * NVRTC is loaded at run time (dlopen), as CuPy and numba do, so the
 * program also runs where it is absent: `runtime_probe --ptx FILE` loads
 * PTX compiled elsewhere (`runtime_probe --emit-ptx FILE compute_XY`
 * writes it), which is how the nested test's VM guests run it.
 */
#include <cuda_runtime_api.h>
#include <dlfcn.h>
#include <nvrtc.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime_check.h"

static int failures;

static void check(int ok, const char *name, const char *why) {
    if (ok) {
        printf("ok %s\n", name);
    } else {
        printf("FAIL %s: %s\n", name, why);
        failures++;
    }
}

static const char *SOURCE =
    "extern \"C\" __global__ void axpy(float a, const float *x, float *y, int n) {\n"
    "    int i = blockIdx.x * blockDim.x + threadIdx.x;\n"
    "    if (i < n) y[i] = a * x[i] + y[i];\n"
    "}\n"
    "__device__ unsigned int hits;\n"
    "extern \"C\" __global__ void block_sums(const int *in, int *out, int n) {\n"
    "    extern __shared__ int part[];\n"
    "    int t = threadIdx.x, i = blockIdx.x * blockDim.x + t;\n"
    "    part[t] = i < n ? in[i] : 0;\n"
    "    __syncthreads();\n"
    "    for (int s = blockDim.x / 2; s > 0; s >>= 1) {\n"
    "        if (t < s) part[t] += part[t + s];\n"
    "        __syncthreads();\n"
    "    }\n"
    "    if (t == 0) { out[blockIdx.x] = part[0]; atomicAdd(&hits, 1u); }\n"
    "}\n";

/* NVRTC's entry points, resolved from libnvrtc.so.12 at run time. */
static struct {
    nvrtcResult (*create)(nvrtcProgram *, const char *, const char *, int, const char *const *, const char *const *);
    nvrtcResult (*compile)(nvrtcProgram, int, const char *const *);
    nvrtcResult (*log_size)(nvrtcProgram, size_t *);
    nvrtcResult (*log)(nvrtcProgram, char *);
    nvrtcResult (*ptx_size)(nvrtcProgram, size_t *);
    nvrtcResult (*ptx)(nvrtcProgram, char *);
    nvrtcResult (*destroy)(nvrtcProgram *);
} nv;

static void load_nvrtc(void) {
    void *h = dlopen("libnvrtc.so.12", RTLD_NOW);
    if (!h) {
        printf("FAIL nvrtc: %s\n", dlerror());
        exit(1);
    }
#define SYM(field, name) *(void **)&nv.field = dlsym(h, name)
    SYM(create, "nvrtcCreateProgram");
    SYM(compile, "nvrtcCompileProgram");
    SYM(log_size, "nvrtcGetProgramLogSize");
    SYM(log, "nvrtcGetProgramLog");
    SYM(ptx_size, "nvrtcGetPTXSize");
    SYM(ptx, "nvrtcGetPTX");
    SYM(destroy, "nvrtcDestroyProgram");
#undef SYM
    if (!nv.create || !nv.compile || !nv.log_size || !nv.log || !nv.ptx_size || !nv.ptx || !nv.destroy) {
        printf("FAIL nvrtc: missing entry points\n");
        exit(1);
    }
}

static char *compile(const char *arch_name) {
    load_nvrtc();
    nvrtcProgram prog;
    if (nv.create(&prog, SOURCE, "probe.cu", 0, NULL, NULL) != NVRTC_SUCCESS) {
        printf("FAIL nvrtc: create\n");
        exit(1);
    }
    char arch[64];
    snprintf(arch, sizeof arch, "--gpu-architecture=%s", arch_name);
    const char *opts[] = {arch};
    nvrtcResult r = nv.compile(prog, 1, opts);
    if (r != NVRTC_SUCCESS) {
        size_t n = 0;
        nv.log_size(prog, &n);
        char *log = malloc(n + 1);
        nv.log(prog, log);
        printf("FAIL nvrtc: error %d\n%s\n", (int)r, log);
        exit(1);
    }
    size_t n = 0;
    nv.ptx_size(prog, &n);
    char *ptx = malloc(n);
    nv.ptx(prog, ptx);
    nv.destroy(&prog);
    printf("ok nvrtc (%s, %zu bytes of PTX)\n", arch, n);
    return ptx;
}

static char *read_file(const char *path) {
    FILE *f = fopen(path, "rb");
    if (!f) {
        printf("FAIL read %s\n", path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *b = calloc(n + 1, 1);
    if (fread(b, 1, n, f) != (size_t)n) {
        printf("FAIL read %s\n", path);
        exit(1);
    }
    fclose(f);
    return b;
}

static dim3 d3(unsigned x) {
    dim3 d = {x, 1, 1};
    return d;
}

struct host_mark {
    cudaStream_t stream;
    const int *data;
    int seen;
};

static void CUDART_CB on_host(void *p) {
    struct host_mark *m = p;
    m->seen = m->data[0];
}

int main(int argc, char **argv) {
    if (argc == 4 && strcmp(argv[1], "--emit-ptx") == 0) {
        char *ptx = compile(argv[3]);
        FILE *f = fopen(argv[2], "wb");
        if (!f || fwrite(ptx, 1, strlen(ptx), f) != strlen(ptx) || fclose(f) != 0) {
            printf("FAIL writing %s\n", argv[2]);
            return 1;
        }
        return 0;
    }
    const char *ptx_file = argc == 3 && strcmp(argv[1], "--ptx") == 0 ? argv[2] : NULL;
    int count = 0, driver = 0, runtime = 0;
    CK(cudaGetDeviceCount(&count));
    CK(cudaDriverGetVersion(&driver));
    CK(cudaRuntimeGetVersion(&runtime));
    check(count == 1, "device count", "expected one vGPU");
    struct cudaDeviceProp prop;
    CK(cudaGetDeviceProperties(&prop, 0));
    printf("device: %s, compute %d.%d, %d SMs, %zu MiB, driver %d, runtime %d\n", prop.name, prop.major, prop.minor,
           prop.multiProcessorCount, prop.totalGlobalMem >> 20, driver, runtime);
    CK(cudaSetDevice(0));
    size_t free_b = 0, total_b = 0;
    CK(cudaMemGetInfo(&free_b, &total_b));
    check(total_b == prop.totalGlobalMem && free_b <= total_b, "memory info is the quota", "cudaMemGetInfo disagrees with totalGlobalMem");
    printf("quota: total %zu bytes, free %zu bytes\n", total_b, free_b);

    char arch[32];
    snprintf(arch, sizeof arch, "compute_%d%d", prop.major, prop.minor);
    char *ptx = ptx_file ? read_file(ptx_file) : compile(arch);
    cudaLibrary_t lib;
    CK(cudaLibraryLoadData(&lib, ptx, NULL, NULL, 0, NULL, NULL, 0));
    cudaKernel_t axpy, sums;
    CK(cudaLibraryGetKernel(&axpy, lib, "axpy"));
    CK(cudaLibraryGetKernel(&sums, lib, "block_sums"));
    check(cudaLibraryGetKernel(&sums, lib, "no_such_kernel") != cudaSuccess, "unknown kernel is an error", "lookup succeeded");
    cudaGetLastError();

    /* axpy over pageable memory, synchronous copies. */
    const int n = 1 << 16;
    float *hx = malloc(n * sizeof(float)), *hy = malloc(n * sizeof(float));
    for (int i = 0; i < n; i++) { hx[i] = (float)i; hy[i] = 1.0f; }
    float *dx, *dy;
    CK(cudaMalloc((void **)&dx, n * sizeof(float)));
    CK(cudaMalloc((void **)&dy, n * sizeof(float)));
    CK(cudaMemcpy(dx, hx, n * sizeof(float), cudaMemcpyHostToDevice));
    CK(cudaMemcpy(dy, hy, n * sizeof(float), cudaMemcpyDefault));
    float a = 2.0f;
    int nn = n;
    void *args[] = {&a, &dx, &dy, &nn};
    CK(cudaLaunchKernel((const void *)axpy, d3((n + 255) / 256), d3(256), args, 0, 0));
    CK(cudaGetLastError());
    CK(cudaMemcpy(hy, dy, n * sizeof(float), cudaMemcpyDeviceToHost));
    int bad = 0;
    for (int i = 0; i < n; i++) bad += hy[i] != 2.0f * i + 1.0f;
    check(bad == 0, "axpy through cudaLaunchKernel", "wrong results");

    /* A driver CUfunction (cuModuleGetFunction, reached through
       cudaGetDriverEntryPoint) launched by cudaLaunchKernel, which NVIDIA's
       runtime accepts since CUDA 12: z = 1 * x + 0. (Looked up by version:
       cudaGetDriverEntryPoint is deprecated in CUDA 13.) */
    {
        typedef int (*load_fn)(void **, const void *);
        typedef int (*get_fn)(void **, void *, const char *);
        typedef int (*unload_fn)(void *);
        load_fn load = NULL;
        get_fn get = NULL;
        unload_fn unload = NULL;
        enum cudaDriverEntryPointQueryResult q;
        CK(cudaGetDriverEntryPointByVersion("cuModuleLoadData", (void **)&load, 12000, cudaEnableDefault, &q));
        CK(cudaGetDriverEntryPointByVersion("cuModuleGetFunction", (void **)&get, 12000, cudaEnableDefault, &q));
        CK(cudaGetDriverEntryPointByVersion("cuModuleUnload", (void **)&unload, 12000, cudaEnableDefault, &q));
        void *mod = NULL, *fn = NULL;
        int found = load && get && load(&mod, ptx) == 0 && get(&fn, mod, "axpy") == 0;
        check(found, "a driver module and function", "cuModuleLoadData or cuModuleGetFunction failed");
        if (found) {
            float *dz, one = 1.0f;
            CK(cudaMalloc((void **)&dz, n * sizeof(float)));
            CK(cudaMemset(dz, 0, n * sizeof(float)));
            void *fargs[] = {&one, &dx, &dz, &nn};
            cudaError_t e = cudaLaunchKernel((const void *)fn, d3((n + 255) / 256), d3(256), fargs, 0, 0);
            float *hz = malloc(n * sizeof(float));
            CK(cudaMemcpy(hz, dz, n * sizeof(float), cudaMemcpyDeviceToHost));
            bad = 0;
            for (int i = 0; i < n; i++) bad += hz[i] != (float)i;
            check(e == cudaSuccess && bad == 0, "a driver CUfunction through cudaLaunchKernel", cudaGetErrorString(e));
            free(hz);
            CK(cudaFree(dz));
        }
        check(!mod || (unload && unload(mod) == 0), "the driver module unloads", "cuModuleUnload failed");
    }

    /* Device to device, memset, and a unified-address copy back. */
    CK(cudaMemcpy(dx, dy, n * sizeof(float), cudaMemcpyDeviceToDevice));
    CK(cudaMemset(dy, 0, n * sizeof(float)));
    CK(cudaMemcpy(hx, dx, n * sizeof(float), cudaMemcpyDefault));
    CK(cudaMemcpy(hy, dy, n * sizeof(float), cudaMemcpyDefault));
    bad = 0;
    for (int i = 0; i < n; i++) bad += hx[i] != 2.0f * i + 1.0f || hy[i] != 0.0f;
    check(bad == 0, "device copy, memset, unified copies", "wrong contents");
    struct cudaPointerAttributes pa;
    CK(cudaPointerGetAttributes(&pa, dx));
    check(pa.type == cudaMemoryTypeDevice && pa.device == 0, "pointer attributes", "dx is not device memory");

    /* Block sums with dynamic shared memory on a stream, pinned buffers,
       events and a host function in stream order. */
    const int blocks = 64, threads = 128, m = blocks * threads;
    int *hin, *hout;
    CK(cudaMallocHost((void **)&hin, m * sizeof(int)));
    CK(cudaHostAlloc((void **)&hout, blocks * sizeof(int), cudaHostAllocDefault));
    for (int i = 0; i < m; i++) hin[i] = i % 7;
    int *din, *dout;
    CK(cudaMalloc((void **)&din, m * sizeof(int)));
    CK(cudaMalloc((void **)&dout, blocks * sizeof(int)));
    cudaStream_t s;
    CK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
    cudaEvent_t t0, t1;
    CK(cudaEventCreate(&t0));
    CK(cudaEventCreate(&t1));
    CK(cudaEventRecord(t0, s));
    CK(cudaMemcpyAsync(din, hin, m * sizeof(int), cudaMemcpyHostToDevice, s));
    int mm = m;
    void *sargs[] = {&din, &dout, &mm};
    CK(cudaLaunchKernel((const void *)sums, d3(blocks), d3(threads), sargs, threads * sizeof(int), s));
    CK(cudaMemcpyAsync(hout, dout, blocks * sizeof(int), cudaMemcpyDeviceToHost, s));
    struct host_mark mark = {s, hout, -1};
    CK(cudaLaunchHostFunc(s, on_host, &mark));
    CK(cudaEventRecord(t1, s));
    CK(cudaStreamSynchronize(s));
    float ms = -1;
    CK(cudaEventElapsedTime(&ms, t0, t1));
    bad = 0;
    for (int b = 0; b < blocks; b++) {
        int want = 0;
        for (int i = b * threads; i < (b + 1) * threads; i++) want += i % 7;
        bad += hout[b] != want;
    }
    check(bad == 0, "shared-memory block sums on a stream", "wrong sums");
    check(mark.seen == hout[0], "host function runs in stream order", "it ran before the copy finished");
    check(ms >= 0, "event timing", "negative elapsed time");
    unsigned int hits = 0;
    void *hits_addr = NULL;
    size_t hits_size = 0;
    cudaLibraryGetGlobal(&hits_addr, &hits_size, lib, "hits");
    CK(cudaMemcpy(&hits, hits_addr, sizeof hits, cudaMemcpyDeviceToHost));
    check(hits == (unsigned)blocks && hits_size == sizeof hits, "atomics on a module global", "wrong hit count");

    /* A CUDA graph, made by capturing a stream: two kernel launches and a
       copy back, replayed three times. */
    {
        const int g = 4096;
        float *gx, *gy, *hg;
        CK(cudaMalloc((void **)&gx, g * sizeof(float)));
        CK(cudaMalloc((void **)&gy, g * sizeof(float)));
        CK(cudaMallocHost((void **)&hg, g * sizeof(float)));
        for (int i = 0; i < g; i++) hg[i] = (float)(i % 100);
        CK(cudaMemcpy(gx, hg, g * sizeof(float), cudaMemcpyHostToDevice));
        CK(cudaMemset(gy, 0, g * sizeof(float)));
        cudaStream_t cs;
        CK(cudaStreamCreateWithFlags(&cs, cudaStreamNonBlocking));
        CK(cudaStreamBeginCapture(cs, cudaStreamCaptureModeGlobal));
        enum cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
        CK(cudaStreamIsCapturing(cs, &st));
        float ga = 1.5f;
        int gn = g;
        void *gargs[] = {&ga, &gx, &gy, &gn};
        CK(cudaLaunchKernel((const void *)axpy, d3(g / 256), d3(256), gargs, 0, cs));
        CK(cudaLaunchKernel((const void *)axpy, d3(g / 256), d3(256), gargs, 0, cs));
        CK(cudaMemcpyAsync(hg, gy, g * sizeof(float), cudaMemcpyDeviceToHost, cs));
        cudaGraph_t graph;
        CK(cudaStreamEndCapture(cs, &graph));
        size_t nodes = 0;
        CK(cudaGraphGetNodes(graph, NULL, &nodes));
        cudaGraphExec_t exec;
        CK(cudaGraphInstantiate(&exec, graph, 0));
        for (int r = 0; r < 3; r++) CK(cudaGraphLaunch(exec, cs));
        CK(cudaStreamSynchronize(cs));
        int gbad = 0;
        for (int i = 0; i < g; i++) gbad += hg[i] != 9.0f * (float)(i % 100);
        check(st == cudaStreamCaptureStatusActive && nodes == 3 && gbad == 0, "stream capture and graph replay", "wrong capture status, node count or results");
        CK(cudaGraphExecDestroy(exec));
        CK(cudaGraphDestroy(graph));
        CK(cudaStreamDestroy(cs));
        CK(cudaFree(gx));
        CK(cudaFree(gy));
        CK(cudaFreeHost(hg));
    }

    /* A pitched 2D copy. */
    size_t pitch = 0;
    int *d2;
    const int w = 100, h = 30;
    CK(cudaMallocPitch((void **)&d2, &pitch, w * sizeof(int), h));
    int *h2 = malloc(w * h * sizeof(int)), *back = calloc(w * h, sizeof(int));
    for (int i = 0; i < w * h; i++) h2[i] = i * 3;
    CK(cudaMemcpy2D(d2, pitch, h2, w * sizeof(int), w * sizeof(int), h, cudaMemcpyHostToDevice));
    CK(cudaMemcpy2D(back, w * sizeof(int), d2, pitch, w * sizeof(int), h, cudaMemcpyDeviceToHost));
    check(pitch >= w * sizeof(int) && memcmp(h2, back, w * h * sizeof(int)) == 0, "pitched 2D copies", "rows differ");

    /* Stream-ordered allocation: cudaMallocAsync from the device's current
       pool on a stream, used by a kernel queued after it, freed in stream
       order; a pool of its own; the quota holds for pools too. */
    {
        cudaMemPool_t pool, def;
        CK(cudaDeviceGetDefaultMemPool(&def, 0));
        CK(cudaDeviceGetMemPool(&pool, 0));
        check(pool == def, "the current pool is the default pool", "they differ");
        float *da = NULL;
        CK(cudaMallocAsync((void **)&da, n * sizeof(float), s));
        unsigned long long used = 0;
        CK(cudaMemPoolGetAttribute(def, cudaMemPoolAttrUsedMemCurrent, &used));
        float two = 2.0f;
        CK(cudaMemsetAsync(da, 0, n * sizeof(float), s));
        void *aargs[] = {&two, &dx, &da, &nn};
        CK(cudaLaunchKernel((const void *)axpy, d3((n + 255) / 256), d3(256), aargs, 0, s));
        float *ha = malloc(n * sizeof(float)), *hx2 = malloc(n * sizeof(float));
        CK(cudaMemcpyAsync(ha, da, n * sizeof(float), cudaMemcpyDeviceToHost, s));
        CK(cudaMemcpy(hx2, dx, n * sizeof(float), cudaMemcpyDeviceToHost));
        CK(cudaFreeAsync(da, s));
        CK(cudaStreamSynchronize(s));
        bad = 0;
        for (int i = 0; i < n; i++) bad += ha[i] != 2.0f * hx2[i];
        check(bad == 0 && used >= n * sizeof(float), "cudaMallocAsync, a kernel and cudaFreeAsync in stream order", "wrong results or pool usage");
        unsigned long long after = 1;
        CK(cudaMemPoolGetAttribute(def, cudaMemPoolAttrUsedMemCurrent, &after));
        check(after == 0, "the pool's usage goes back to 0", "memory still counted in the pool");
        free(ha);
        free(hx2);

        struct cudaMemPoolProps props;
        memset(&props, 0, sizeof props);
        props.allocType = cudaMemAllocationTypePinned;
        props.location.type = cudaMemLocationTypeDevice;
        props.location.id = 0;
        cudaMemPool_t mine;
        CK(cudaMemPoolCreate(&mine, &props));
        unsigned long long threshold = 1 << 20;
        CK(cudaMemPoolSetAttribute(mine, cudaMemPoolAttrReleaseThreshold, &threshold));
        void *pa = NULL, *over = NULL;
        CK(cudaMallocFromPoolAsync(&pa, 4096, mine, s));
        cudaError_t oe = cudaMallocFromPoolAsync(&over, total_b + (1 << 20), mine, s);
        check(oe == cudaErrorMemoryAllocation, "a pool allocation past the quota fails", cudaGetErrorName(oe));
        cudaGetLastError();
        CK(cudaFreeAsync(pa, s));
        CK(cudaStreamSynchronize(s));
        CK(cudaMemPoolDestroy(mine));
    }

    /* The quota: an allocation past it fails cleanly, and memory comes back. */
    void *big = NULL;
    cudaError_t e = cudaMalloc(&big, total_b + (1 << 20));
    check(e == cudaErrorMemoryAllocation, "allocation past the quota fails", cudaGetErrorName(e));
    cudaGetLastError();

    CK(cudaFree(d2));
    CK(cudaFree(din));
    CK(cudaFree(dout));
    CK(cudaFree(dx));
    CK(cudaFree(dy));
    CK(cudaFree(NULL));
    CK(cudaFreeHost(hin));
    CK(cudaFreeHost(hout));
    CK(cudaStreamDestroy(s));
    CK(cudaEventDestroy(t0));
    CK(cudaEventDestroy(t1));
    CK(cudaLibraryUnload(lib));
    CK(cudaDeviceSynchronize());
    size_t free_after = 0;
    CK(cudaMemGetInfo(&free_after, &total_b));
    check(free_after == free_b, "all memory returned", "free memory differs after the frees");
    printf(failures ? "runtime probe: %d FAILED\n" : "runtime probe: all passed\n", failures);
    return failures ? 1 : 0;
}
