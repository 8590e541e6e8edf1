/*
 * tenant_probe: small tenant-side checks the test suite drives.
 *   quota BYTES         allocations up to BYTES succeed, one byte more fails with
 *                       CUDA_ERROR_OUT_OF_MEMORY; cuMemGetInfo reports BYTES total
 *   fill BYTES          allocate, fill with 0xA5, print "ptr=0x..", free, exit
 *   check BYTES         allocate, print "ptr=0x..", verify the bytes read back zero
 *   hold BYTES          allocate, fill 0x5A, print "ptr=0x..", wait for a line on
 *                       stdin, then verify the pattern is intact
 *   steal PTR           use another tenant's pointer in copies and a kernel; every
 *                       attempt must fail; prints each result
 *   ptx FILE KERNEL     load a PTX file and launch KERNEL<<<1,1>>>() without
 *                       parameters; prints the result name
 *   fault OFFSET        a kernel writes OFFSET bytes past a 256-byte allocation;
 *                       prints the launch result, what the context says after it,
 *                       and whether a context created after destroying it works
 *   relive SIZE         allocates SIZE bytes, prints "ready", waits for a line on
 *                       stdin (meanwhile the device's side may end), then prints
 *                       what the old context says, and whether a context created
 *                       after destroying it works
 *   storm N             N launches of a kernel that adds 1 to a counter, then one
 *                       cuCtxSynchronize; prints the counter and what the
 *                       connection cost the transport (vgpuGetConnectionStats)
 *   link FILE           link FILE (a fatbin) with cuLink*, load the result and
 *                       launch its bump kernel (adds 1 to a u32); prints what
 *                       each step returned and the counter
 *   reuse N             N rounds of: allocate the whole quota, a kernel on it,
 *                       cuCtxSynchronize, free; after each free cuMemGetInfo must
 *                       report the whole quota free again (the next round's
 *                       allocation needs it); prints the rounds that saw less
 *   streams N           N launches of the bump kernel on each of two streams,
 *                       and between them allocations whose bytes must read
 *                       back zero; then each counter must be N
 *   copies N            N-byte copies to the device and back, from and to
 *                       pageable buffers at several offsets in their pages
 *                       and from pinned memory; prints "copies=ok" if every
 *                       byte came back, else the first that did not
 *   graph K N           captures on a stream: a memset, K bump launches, a
 *                       device-to-device copy, a copy into pinned host
 *                       memory, K more bumps; instantiates it and launches
 *                       it N times; prints the counter (2*K*N if right), the
 *                       copied and host values (7 if right) and what the
 *                       launches cost the transport (vgpuGetConnectionStats);
 *                       then what one launch of a graph that captured a
 *                       launch of it added to the counter (2*K if right)
 */
#include "common.h"

static CUcontext ctx;

static void init(void) {
    CUdevice dev;
    CHECK(cuInit(0));
    CHECK(cuDeviceGet(&dev, 0));
    CHECK(cuCtxCreate(&ctx, NULL, 0, dev));
}

/* A kernel that adds 1 to the u32 its parameter points at. */
static const char bump_ptx[] =
    ".version 7.0\n.target sm_70\n.address_size 64\n"
    ".visible .entry bump(.param .u64 p)\n{\n"
    "    .reg .u64 %rd<1>;\n    .reg .u32 %r<2>;\n"
    "    ld.param.u64 %rd0, [p];\n    ld.global.u32 %r0, [%rd0];\n"
    "    add.u32 %r1, %r0, 1;\n    st.global.u32 [%rd0], %r1;\n    ret;\n}\n";

/* The bump kernel of a module image. */
static CUfunction bump_in(const void *image) {
    CUmodule mod;
    CUfunction bump;
    CHECK(cuModuleLoadData(&mod, image));
    CHECK(cuModuleGetFunction(&bump, mod, "bump"));
    return bump;
}

/* A device u32 holding `value`. */
static CUdeviceptr counter_of(unsigned int value) {
    CUdeviceptr counter;
    CHECK(cuMemAlloc(&counter, 4));
    CHECK(cuMemsetD32(counter, value, 1));
    return counter;
}

static const char *name_of(CUresult r) {
    const char *s = "?";
    cuGetErrorName(r, &s);
    return s;
}

int main(int argc, char **argv) {
    if (argc < 3) {
        fprintf(stderr, "usage: tenant_probe MODE ARG\n");
        return 2;
    }
    const char *mode = argv[1];
    init();
    if (!strcmp(mode, "quota")) {
        size_t quota = strtoull(argv[2], NULL, 0), free_b = 0, total = 0;
        CHECK(cuMemGetInfo(&free_b, &total));
        if (total != quota) {
            fprintf(stderr, "quota: total %zu != quota %zu\n", total, quota);
            return 1;
        }
        CUdeviceptr half, rest, over;
        CHECK(cuMemAlloc(&half, quota / 2));
        CHECK(cuMemAlloc(&rest, quota - quota / 2));
        CUresult r = cuMemAlloc(&over, 1);
        printf("over_quota=%s\n", name_of(r));
        CHECK(cuMemGetInfo(&free_b, &total));
        printf("free_after=%zu total=%zu\n", free_b, total);
        CHECK(cuMemFree(half));
        CUresult again = cuMemAlloc(&over, quota / 2);
        printf("after_free=%s\n", name_of(again));
        return r == CUDA_ERROR_OUT_OF_MEMORY && again == CUDA_SUCCESS && free_b == 0 ? 0 : 1;
    }
    if (!strcmp(mode, "link")) {
        CUlinkState link;
        CHECK(cuLinkCreate(0, NULL, NULL, &link));
        CUresult r = cuLinkAddFile(link, CU_JIT_INPUT_FATBINARY, argv[2], 0, NULL, NULL);
        printf("add=%s\n", name_of(r));
        void *image = NULL;
        size_t size = 0;
        if (r == CUDA_SUCCESS) {
            r = cuLinkComplete(link, &image, &size);
            printf("complete=%s\n", name_of(r));
        }
        if (r == CUDA_SUCCESS) {
            CUfunction bump = bump_in(image);
            CUdeviceptr counter = counter_of(41);
            void *args[] = {&counter};
            CHECK(cuLaunchKernel(bump, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
            unsigned int got = 0;
            CHECK(cuMemcpyDtoH(&got, counter, 4));
            printf("counter=%u\n", got);
        }
        CHECK(cuLinkDestroy(link));
        return 0;
    }
    if (!strcmp(mode, "reuse")) {
        int n = atoi(argv[2]), stale = 0, failed = 0;
        CUfunction bump = bump_in(bump_ptx);
        size_t free_b = 0, total = 0;
        CHECK(cuMemGetInfo(&free_b, &total));
        for (int i = 0; i < n; i++) {
            CUdeviceptr all;
            CUresult r = cuMemAlloc(&all, free_b);
            if (r != CUDA_SUCCESS) {
                printf("round %d: allocating %zu bytes: %s\n", i, free_b, name_of(r));
                failed++;
                continue;
            }
            void *args[] = {&all};
            CHECK(cuLaunchKernel(bump, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
            CHECK(cuCtxSynchronize());
            CHECK(cuMemFree(all));
            size_t now = 0;
            CHECK(cuMemGetInfo(&now, &total));
            stale += now != free_b;
        }
        printf("reuse rounds=%d stale=%d failed=%d\n", n, stale, failed);
        return stale || failed ? 1 : 0;
    }
    if (!strcmp(mode, "copies")) {
        size_t n = strtoull(argv[2], NULL, 10);
        static const size_t offs[] = {0, 16, 2040, 4080};
        unsigned char *src = malloc(n + 4096), *back = malloc(n + 4096), *pinned_base = NULL;
        CUdeviceptr d;
        if (!src || !back) {
            fprintf(stderr, "out of host memory\n");
            return 1;
        }
        CHECK(cuMemAlloc(&d, n));
        CHECK(cuMemAllocHost((void **)&pinned_base, n + 4096));
        for (int i = 0; i < 4; i++) {
            unsigned char *s = src + offs[i], *b = back + offs[3 - i], *pinned = pinned_base + offs[i];
            for (size_t k = 0; k < n; k++) s[k] = (unsigned char)(k * 7 + i * 31 + (k >> 12));
            memset(b, 0, n);
            CHECK(cuMemcpyHtoD(d, s, n));
            CHECK(cuMemcpyDtoH(b, d, n));
            for (size_t k = 0; k < n; k++) {
                if (b[k] != s[k]) {
                    printf("copies: pageable, offsets %zu/%zu: byte %zu is %u, not %u\n", offs[i], offs[3 - i], k, b[k], s[k]);
                    return 1;
                }
            }
            /* Through pinned memory, at the same offset in its pages. */
            CHECK(cuMemcpyHtoD(d, s, n));
            memset(pinned, 0, n);
            CHECK(cuMemcpyDtoH(pinned, d, n));
            CHECK(cuMemsetD8(d, 0, n));
            CHECK(cuMemcpyHtoD(d, pinned, n));
            memset(b, 0, n);
            CHECK(cuMemcpyDtoH(b, d, n));
            for (size_t k = 0; k < n; k++) {
                if (b[k] != s[k]) {
                    printf("copies: through pinned memory, offset %zu: byte %zu is %u, not %u\n", offs[i], k, b[k], s[k]);
                    return 1;
                }
            }
        }
        printf("copies=ok\n");
        return 0;
    }
    if (!strcmp(mode, "streams")) {
        int n = atoi(argv[2]), dirty = 0;
        CUfunction bump = bump_in(bump_ptx);
        CUdeviceptr c[2] = {counter_of(0), counter_of(0)};
        CUstream s[2];
        for (int k = 0; k < 2; k++) CHECK(cuStreamCreate(&s[k], CU_STREAM_NON_BLOCKING));
        for (int i = 0; i < n; i++) {
            for (int k = 0; k < 2; k++) {
                void *args[] = {&c[k]};
                CHECK(cuLaunchKernel(bump, 1, 1, 1, 1, 1, 1, 0, s[k], args, NULL));
            }
            if (i % (n / 4 + 1) == 0) {
                /* Allocated while both streams have kernels queued. */
                unsigned char buf[4096];
                CUdeviceptr p;
                CHECK(cuMemAlloc(&p, sizeof buf));
                CHECK(cuMemcpyDtoH(buf, p, sizeof buf));
                for (size_t b = 0; b < sizeof buf; b++) dirty += buf[b] != 0;
                CHECK(cuMemsetD8(p, 0x5A, sizeof buf));
                CHECK(cuMemFree(p));
            }
        }
        for (int k = 0; k < 2; k++) CHECK(cuStreamSynchronize(s[k]));
        unsigned int got[2] = {0, 0};
        for (int k = 0; k < 2; k++) CHECK(cuMemcpyDtoH(&got[k], c[k], 4));
        printf("streams launches=%d counters=%u,%u dirty=%d\n", n, got[0], got[1], dirty);
        return got[0] == (unsigned int)n && got[1] == (unsigned int)n && !dirty ? 0 : 1;
    }
    if (!strcmp(mode, "storm")) {
        int n = atoi(argv[2]);
        CUfunction bump = bump_in(bump_ptx);
        CUdeviceptr counter = counter_of(0);
        cuuint64_t m0, e0, k0, m1, e1, k1;
        CHECK(vgpuGetConnectionStats(&m0, &e0, &k0));
        void *args[] = {&counter};
        for (int i = 0; i < n; i++) CHECK(cuLaunchKernel(bump, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL));
        CHECK(cuCtxSynchronize());
        CHECK(vgpuGetConnectionStats(&m1, &e1, &k1));
        unsigned int got = 0;
        CHECK(cuMemcpyDtoH(&got, counter, 4));
        printf("launches=%d counter=%u messages=%llu ring_entries=%llu kicks=%llu\n", n, got, (unsigned long long)(m1 - m0), (unsigned long long)(e1 - e0), (unsigned long long)(k1 - k0));
        return got == (unsigned int)n ? 0 : 1;
    }
    if (!strcmp(mode, "graph") && argc > 3) {
        int k = atoi(argv[2]), n = atoi(argv[3]);
        CUfunction bump = bump_in(bump_ptx);
        CUdeviceptr counter = counter_of(0), seven, copied;
        CHECK(cuMemAlloc(&seven, 4));
        CHECK(cuMemAlloc(&copied, 4));
        unsigned int *host;
        CHECK(cuMemAllocHost((void **)&host, 4));
        *host = 0;
        CUstream s;
        CHECK(cuStreamCreate(&s, CU_STREAM_NON_BLOCKING));
        void *args[] = {&counter};
        CHECK(cuStreamBeginCapture(s, CU_STREAM_CAPTURE_MODE_GLOBAL));
        CHECK(cuMemsetD32Async(seven, 7, 1, s));
        for (int i = 0; i < k; i++) CHECK(cuLaunchKernel(bump, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
        CHECK(cuMemcpyDtoDAsync(copied, seven, 4, s));
        CHECK(cuMemcpyDtoHAsync(host, copied, 4, s));
        for (int i = 0; i < k; i++) CHECK(cuLaunchKernel(bump, 1, 1, 1, 1, 1, 1, 0, s, args, NULL));
        CUgraph graph;
        CUgraphExec exec;
        CHECK(cuStreamEndCapture(s, &graph));
        CHECK(cuGraphInstantiate(&exec, graph, 0));
        cuuint64_t m0, e0, k0, m1, e1, k1;
        CHECK(vgpuGetConnectionStats(&m0, &e0, &k0));
        for (int i = 0; i < n; i++) CHECK(cuGraphLaunch(exec, s));
        CHECK(cuStreamSynchronize(s));
        CHECK(vgpuGetConnectionStats(&m1, &e1, &k1));
        unsigned int got = 0, cp = 0;
        CHECK(cuMemcpyDtoH(&got, counter, 4));
        CHECK(cuMemcpyDtoH(&cp, copied, 4));
        printf("graph kernels=%d counter=%u copied=%u host=%u messages=%llu ring_entries=%llu\n", 2 * k * n, got, cp, *host, (unsigned long long)(m1 - m0), (unsigned long long)(e1 - e0));
        /* A graph launched into a capturing stream is recorded there: the
           outer graph's one launch adds 2*K. */
        CUstream s2;
        CUgraph outer;
        CUgraphExec outer_exec;
        CHECK(cuStreamCreate(&s2, CU_STREAM_NON_BLOCKING));
        CHECK(cuStreamBeginCapture(s2, CU_STREAM_CAPTURE_MODE_GLOBAL));
        CHECK(cuGraphLaunch(exec, s2));
        CHECK(cuStreamEndCapture(s2, &outer));
        unsigned int before = 0, after = 0;
        CHECK(cuMemcpyDtoH(&before, counter, 4));
        CHECK(cuGraphInstantiate(&outer_exec, outer, 0));
        CHECK(cuGraphLaunch(outer_exec, s2));
        CHECK(cuStreamSynchronize(s2));
        CHECK(cuMemcpyDtoH(&after, counter, 4));
        printf("captured_launch=%u\n", after - before);
        CHECK(cuGraphExecDestroy(outer_exec));
        CHECK(cuGraphDestroy(outer));
        CHECK(cuGraphExecDestroy(exec));
        CHECK(cuGraphDestroy(graph));
        /* A destroyed graph is gone. */
        printf("after_destroy=%s\n", name_of(cuGraphLaunch(exec, s)));
        return got == (unsigned int)(2 * k * n) && cp == 7 && *host == 7 && after - before == (unsigned int)(2 * k) ? 0 : 1;
    }
    size_t bytes = strtoull(argv[2], NULL, 0);
    if (!strcmp(mode, "fill") || !strcmp(mode, "check") || !strcmp(mode, "hold")) {
        CUdeviceptr p;
        CHECK(cuMemAlloc(&p, bytes));
        unsigned char *h = malloc(bytes);
        if (!strcmp(mode, "check")) {
            printf("ptr=0x%llx\n", (unsigned long long)p);
            fflush(stdout);
            CHECK(cuMemcpyDtoH(h, p, bytes));
            for (size_t i = 0; i < bytes; i++) {
                if (h[i] != 0) {
                    printf("dirty at %zu: 0x%02x\n", i, h[i]);
                    return 1;
                }
            }
            printf("clean=%zu\n", bytes);
            return 0;
        }
        unsigned char pat = !strcmp(mode, "fill") ? 0xA5 : 0x5A;
        CHECK(cuMemsetD8(p, pat, bytes));
        /* Said once the pattern is in: whoever reads the line next may end
         * the device under it. */
        printf("ptr=0x%llx\n", (unsigned long long)p);
        fflush(stdout);
        if (!strcmp(mode, "fill")) {
            CHECK(cuMemFree(p));
            return 0;
        }
        char line[64];
        if (!fgets(line, sizeof line, stdin)) return 1;
        CHECK(cuMemcpyDtoH(h, p, bytes));
        for (size_t i = 0; i < bytes; i++) {
            if (h[i] != pat) {
                printf("changed at %zu\n", i);
                return 1;
            }
        }
        printf("intact=%zu\n", bytes);
        return 0;
    }
    if (!strcmp(mode, "steal")) {
        CUdeviceptr victim = strtoull(argv[2], NULL, 0), mine;
        CHECK(cuMemAlloc(&mine, 4096));
        /* Tenants in executors of their own have address spaces of their
         * own: the same number may be one of this tenant's allocations,
         * which proves nothing. Move off it first. */
        if (victim >= mine && victim < mine + 4096) {
            CUdeviceptr other;
            CHECK(cuMemAlloc(&other, 4096));
            CHECK(cuMemFree(mine));
            mine = other;
            printf("aliased=1\n");
        }
        unsigned char buf[4096];
        memset(buf, 0x77, sizeof buf);
        CUresult r1 = cuMemcpyDtoH(buf, victim, 64);
        CUresult r2 = cuMemcpyHtoD(victim, buf, 64);
        CUresult r3 = cuMemcpyDtoD(mine, victim, 64);
        CUresult r4 = cuMemsetD8(victim, 0, 64);
        CUmodule mod;
        CUfunction peek;
        CHECK(cuModuleLoadData(&mod, load_ptx("faults.ptx")));
        CHECK(cuModuleGetFunction(&peek, mod, "peek"));
        void *args[] = {&victim, &mine};
        CUresult r5 = cuLaunchKernel(peek, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL);
        /* Launches are asynchronous: the kernel's fault surfaces at the sync. */
        if (r5 == CUDA_SUCCESS) r5 = cuCtxSynchronize();
        printf("dtoh=%s htod=%s dtod=%s memset=%s kernel=%s\n", name_of(r1), name_of(r2), name_of(r3), name_of(r4), name_of(r5));
        int leaked = 0;
        for (int i = 0; i < 64; i++) leaked |= buf[i] != 0x77;
        printf("leaked=%d\n", leaked);
        return r1 && r2 && r3 && r4 && r5 == CUDA_ERROR_ILLEGAL_ADDRESS && !leaked ? 0 : 1;
    }
    if (!strcmp(mode, "ptx") && argc > 3) {
        CUmodule mod;
        CUfunction f;
        char log[1024] = "";
        CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
        void *vals[] = {log, (void *)(size_t)sizeof log};
        CUresult r = cuModuleLoadDataEx(&mod, load_ptx(argv[2]), 2, opts, vals);
        if (r != CUDA_SUCCESS) {
            printf("load=%s log=%s\n", name_of(r), log);
            return 0;
        }
        CHECK(cuModuleGetFunction(&f, mod, argv[3]));
        r = cuLaunchKernel(f, 1, 1, 1, 32, 1, 1, 0, NULL, NULL, NULL);
        CUresult sync = cuCtxSynchronize();
        printf("launch=%s sync=%s\n", name_of(r), name_of(sync));
        return 0;
    }
    if (!strcmp(mode, "relive")) {
        CUdeviceptr p, q;
        CHECK(cuMemAlloc(&p, strtoull(argv[2], NULL, 0)));
        printf("ready\n");
        fflush(stdout);
        char line[16];
        if (!fgets(line, sizeof line, stdin)) return 1;
        CUresult old = cuMemAlloc(&q, 256);
        cuCtxDestroy(ctx);
        CUdevice dev;
        CHECK(cuDeviceGet(&dev, 0));
        CUresult made = cuCtxCreate(&ctx, NULL, 0, dev);
        unsigned char h[256] = {0};
        CUresult fresh = made;
        if (fresh == CUDA_SUCCESS) fresh = cuMemAlloc(&q, 256);
        if (fresh == CUDA_SUCCESS) fresh = cuMemsetD8(q, 0x3C, 256);
        if (fresh == CUDA_SUCCESS) fresh = cuMemcpyDtoH(h, q, 256);
        printf("old=%s made=%s fresh=%s value=0x%02x\n", name_of(old), name_of(made), name_of(fresh), h[255]);
        return 0;
    }
    if (!strcmp(mode, "fault")) {
        long long off = strtoll(argv[2], NULL, 0);
        CUdeviceptr p, q;
        CUmodule mod;
        CUfunction poke;
        CHECK(cuMemAlloc(&p, 256));
        CHECK(cuModuleLoadData(&mod, load_ptx("faults.ptx")));
        CHECK(cuModuleGetFunction(&poke, mod, "pokeOffset"));
        void *args[] = {&p, &off};
        CUresult launch = cuLaunchKernel(poke, 1, 1, 1, 1, 1, 1, 0, NULL, args, NULL);
        CUresult sync = cuCtxSynchronize();
        CUresult after = cuMemAlloc(&q, 256);
        printf("launch=%s sync=%s after=%s\n", name_of(launch), name_of(sync), name_of(after));
        cuCtxDestroy(ctx);
        CUdevice dev;
        CHECK(cuDeviceGet(&dev, 0));
        CHECK(cuCtxCreate(&ctx, NULL, 0, dev));
        unsigned char h[256];
        CUresult fresh = cuMemAlloc(&q, 256);
        if (fresh == CUDA_SUCCESS) fresh = cuMemsetD8(q, 0x3C, 256);
        if (fresh == CUDA_SUCCESS) fresh = cuMemcpyDtoH(h, q, 256);
        printf("fresh=%s value=0x%02x\n", name_of(fresh), h[255]);
        return 0;
    }
    fprintf(stderr, "unknown mode %s\n", mode);
    return 2;
}
