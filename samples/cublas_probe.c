/*
 * A cuBLAS program, as application code calls it: NVIDIA's libcublas,
 * libcublasLt and libcudart (from PyPI) over our libcuda.so.1. Each GEMM's result is
 * compared with a reference computed here on the host in double
 * precision, within a bound set by the operand and accumulation types
 * (k products, each operand rounded to its type). Each check prints
 * "ok <name> (max error E, bound B)"; a failure prints "FAIL <name>: <why>"
 * and the program exits 1 at the end.
 *
 *     cublas_probe [--expect-refused]
 *
 * On a device whose GEMM kernels cuBLAS can not run (a device that runs
 * PTX only, reporting an architecture cuBLAS ships machine code for),
 * `--expect-refused` checks instead that the first GEMM fails with a
 * cuBLAS error and that the process can still copy memory afterwards.
 */
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime_api.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "runtime_check.h"

static int failures;

/* A cuBLAS call that must succeed: the check fails (and the program stops)
 * with cuBLAS's status name otherwise. */
#define CB(name, call)                                                                   \
    do {                                                                                 \
        cublasStatus_t s_ = (call);                                                      \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                               \
            printf("FAIL %s: %s returned %s\n", name, #call, cublasGetStatusName(s_));   \
            exit(1);                                                                     \
        }                                                                                \
    } while (0)

/* Deterministic operands in [-1, 1). */
static uint32_t rng = 12345;
static float next_value(void) {
    rng = rng * 1664525u + 1013904223u;
    return (float)((rng >> 8) & 0xffff) / 32768.0f - 1.0f;
}

/* Host conversions for the 16-bit operand types. */
static uint16_t to_half(float f) {
    _Float16 h = (_Float16)f;
    uint16_t bits;
    memcpy(&bits, &h, 2);
    return bits;
}
static float from_half(uint16_t bits) {
    _Float16 h;
    memcpy(&h, &bits, 2);
    return (float)h;
}
static uint16_t to_bf16(float f) {
    uint32_t u;
    memcpy(&u, &f, 4);
    u += 0x7fff + ((u >> 16) & 1); /* round to nearest even */
    return (uint16_t)(u >> 16);
}
static float from_bf16(uint16_t bits) {
    uint32_t u = (uint32_t)bits << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

/* Element (i, j) of op(X), X column-major with leading dimension ld. */
static double at(const double *x, int ld, int trans, int i, int j) {
    return trans ? x[j + (size_t)i * ld] : x[i + (size_t)j * ld];
}

/* C = alpha op(A) op(B) + beta C in double, A m x k after op, B k x n. */
static void reference(int ta, int tb, int m, int n, int k, double alpha, const double *a, int lda, const double *b, int ldb,
                      double beta, double *c, int ldc) {
    for (int j = 0; j < n; j++)
        for (int i = 0; i < m; i++) {
            double s = 0;
            for (int p = 0; p < k; p++) s += at(a, lda, ta, i, p) * at(b, ldb, tb, p, j);
            c[i + (size_t)j * ldc] = alpha * s + beta * c[i + (size_t)j * ldc];
        }
}

static void compare(const char *name, const double *want, const double *got, size_t n, double bound) {
    double worst = 0;
    size_t bad = n;
    for (size_t i = 0; i < n; i++) {
        double e = fabs(want[i] - got[i]);
        if (!(e <= worst)) {
            worst = e;
            if (!(e <= bound) && bad == n) bad = i;
        }
    }
    if (bad == n) {
        printf("ok %s (max error %.3g, bound %.3g)\n", name, worst, bound);
    } else {
        printf("FAIL %s: element %zu is %.9g, want %.9g (max error %.3g, bound %.3g)\n", name, bad, got[bad], want[bad], worst,
               bound);
        failures++;
    }
}

/* The shapes every GEMM check runs: not multiples of any tile. */
enum { M = 67, N = 45, K = 33 };

/* Operands of one check, as doubles (what the reference multiplies: the
 * values after rounding to the operand type). */
struct operands {
    double a[K * M], b[K * N], c[M * N];
};

/* Rounding a value to an operand type and storing it in that type. */
static float round_to(cudaDataType_t t, float f) {
    return t == CUDA_R_16F ? from_half(to_half(f)) : t == CUDA_R_16BF ? from_bf16(to_bf16(f)) : f;
}
static size_t size_of(cudaDataType_t t) { return t == CUDA_R_64F ? 8 : t == CUDA_R_32F ? 4 : 2; }
static void store(cudaDataType_t t, void *out, size_t i, double v) {
    if (t == CUDA_R_64F) ((double *)out)[i] = v;
    else if (t == CUDA_R_32F) ((float *)out)[i] = (float)v;
    else ((uint16_t *)out)[i] = t == CUDA_R_16F ? to_half((float)v) : to_bf16((float)v);
}
static double load(cudaDataType_t t, const void *in, size_t i) {
    if (t == CUDA_R_64F) return ((const double *)in)[i];
    if (t == CUDA_R_32F) return ((const float *)in)[i];
    uint16_t bits = ((const uint16_t *)in)[i];
    return t == CUDA_R_16F ? from_half(bits) : from_bf16(bits);
}

/* A (m x k, or k x m when transposed), B and C, rounded to their types. */
static void fill(struct operands *o, cudaDataType_t ab, cudaDataType_t c) {
    for (int i = 0; i < K * M; i++) o->a[i] = round_to(ab, next_value());
    for (int i = 0; i < K * N; i++) o->b[i] = round_to(ab, next_value());
    for (int i = 0; i < M * N; i++) o->c[i] = round_to(c, next_value());
}

static void *device_copy(const void *host, size_t bytes) {
    void *d;
    CK(cudaMalloc(&d, bytes));
    CK(cudaMemcpy(d, host, bytes, cudaMemcpyHostToDevice));
    return d;
}

/* The entry point a check calls. */
enum api { SGEMM, DGEMM, GEMM_EX };

/* One GEMM check: C = alpha op(A) op(B) + beta C with A and B of type
 * `ab`, C of type `ct`, computed as `compute` (GEMM_EX), through `api`;
 * the result is compared with the host's within `bound`. */
static void gemm(cublasHandle_t h, const char *name, enum api api, int ta, int tb, cudaDataType_t ab, cudaDataType_t ct,
                 cublasComputeType_t compute, double alpha, double beta, double bound) {
    static struct operands o;
    static double a_dev[K * M], b_dev[K * N], c_dev[M * N], want[M * N], got[M * N];
    int lda = ta ? K : M, ldb = tb ? N : K;
    fill(&o, ab, ct);
    for (int i = 0; i < K * M; i++) store(ab, a_dev, i, o.a[i]);
    for (int i = 0; i < K * N; i++) store(ab, b_dev, i, o.b[i]);
    for (int i = 0; i < M * N; i++) store(ct, c_dev, i, o.c[i]);
    void *da = device_copy(a_dev, size_of(ab) * K * M), *db = device_copy(b_dev, size_of(ab) * K * N);
    void *dc = device_copy(c_dev, size_of(ct) * M * N);
    cublasOperation_t opa = ta ? CUBLAS_OP_T : CUBLAS_OP_N, opb = tb ? CUBLAS_OP_T : CUBLAS_OP_N;
    /* alpha and beta in the scale type: C's, or FP32 for 16-bit C
     * computed in FP32. */
    double a64 = alpha, b64 = beta;
    float a32 = (float)alpha, b32 = (float)beta;
    uint16_t a16 = to_half((float)alpha), b16 = to_half((float)beta);
    const void *pa = &a32, *pb = &b32;
    if (compute == CUBLAS_COMPUTE_64F) pa = &a64, pb = &b64;
    if (compute == CUBLAS_COMPUTE_16F) pa = &a16, pb = &b16;
    switch (api) {
    case SGEMM:
        CB(name, cublasSgemm(h, opa, opb, M, N, K, &a32, da, lda, db, ldb, &b32, dc, M));
        break;
    case DGEMM:
        CB(name, cublasDgemm(h, opa, opb, M, N, K, &a64, da, lda, db, ldb, &b64, dc, M));
        break;
    case GEMM_EX:
        CB(name, cublasGemmEx(h, opa, opb, M, N, K, pa, da, ab, lda, db, ab, ldb, pb, dc, ct, M, compute, CUBLAS_GEMM_DEFAULT));
        break;
    }
    CK(cudaMemcpy(c_dev, dc, size_of(ct) * M * N, cudaMemcpyDeviceToHost));
    memcpy(want, o.c, sizeof want);
    reference(ta, tb, M, N, K, alpha, o.a, lda, o.b, ldb, beta, want, M);
    for (int i = 0; i < M * N; i++) got[i] = load(ct, c_dev, i);
    compare(name, want, got, M * N, bound);
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(dc));
}

/* The error bound of K products of operands below 1 summed in FP32 (the
 * products of 16-bit operands are exact in FP32). */
#define FP32_SUMS (4.0 * K * 0x1p-23)

static void gemms(cublasHandle_t h) {
    for (int t = 0; t < 4; t++) {
        char name[32];
        snprintf(name, sizeof name, "sgemm %c%c", t & 1 ? 't' : 'n', t & 2 ? 't' : 'n');
        gemm(h, name, SGEMM, t & 1, t >> 1, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F, 1.5, -0.5, FP32_SUMS);
    }
    gemm(h, "dgemm nt", DGEMM, 0, 1, CUDA_R_64F, CUDA_R_64F, CUBLAS_COMPUTE_64F, -0.75, 2.0, 8.0 * K * 0x1p-52);
    gemm(h, "gemmex f16 in, f32 out", GEMM_EX, 1, 0, CUDA_R_16F, CUDA_R_32F, CUBLAS_COMPUTE_32F, 1.0, 1.0, FP32_SUMS);
    gemm(h, "gemmex bf16 in, f32 out", GEMM_EX, 1, 0, CUDA_R_16BF, CUDA_R_32F, CUBLAS_COMPUTE_32F, 1.0, 1.0, FP32_SUMS);
    /* FP16 in, out and accumulation (what cublasHgemm does; C has no
     * __half type for its prototype). FP16 has an 11-bit significand;
     * sums of K products below 1 stay below K, and each partial sum may
     * round (or be held in FP32). */
    gemm(h, "hgemm nn", GEMM_EX, 0, 0, CUDA_R_16F, CUDA_R_16F, CUBLAS_COMPUTE_16F, 1.0, 0.5, 8.0 * K * 0x1p-11);
    /* FP32 operands with TF32 tensor operations allowed (10-bit mantissa
     * products), as PyTorch's allow_tf32 asks: each operand rounded to
     * TF32 (2^-11 relative each), K products. */
    gemm(h, "gemmex tf32", GEMM_EX, 0, 0, CUDA_R_32F, CUDA_R_32F, CUBLAS_COMPUTE_32F_FAST_TF32, 1.0, 0.0, 2.0 * K * 0x1p-10);
}

/* Three SGEMMs in one call, with strides between the matrices. */
static void batched(cublasHandle_t h) {
    enum { B = 3 };
    static struct operands o[B];
    static float af[B][K * M], bf[B][K * N], cf[B][M * N];
    static double want[B * M * N], got[B * M * N];
    for (int s = 0; s < B; s++) {
        fill(&o[s], CUDA_R_32F, CUDA_R_32F);
        for (int i = 0; i < K * M; i++) af[s][i] = (float)o[s].a[i];
        for (int i = 0; i < K * N; i++) bf[s][i] = (float)o[s].b[i];
        for (int i = 0; i < M * N; i++) cf[s][i] = (float)o[s].c[i];
    }
    float *da = device_copy(af, sizeof af), *db = device_copy(bf, sizeof bf), *dc = device_copy(cf, sizeof cf);
    float alpha = 1.0f, beta = 1.0f;
    CB("sgemm strided batched", cublasSgemmStridedBatched(h, CUBLAS_OP_N, CUBLAS_OP_N, M, N, K, &alpha, da, M, K * M, db, K,
                                                          K * N, &beta, dc, M, M * N, B));
    CK(cudaMemcpy(cf, dc, sizeof cf, cudaMemcpyDeviceToHost));
    for (int s = 0; s < B; s++) {
        memcpy(want + s * M * N, o[s].c, sizeof o[s].c);
        reference(0, 0, M, N, K, 1.0, o[s].a, M, o[s].b, K, 1.0, want + s * M * N, M);
        for (int i = 0; i < M * N; i++) got[s * M * N + i] = cf[s][i];
    }
    compare("sgemm strided batched x3", want, got, (size_t)B * M * N, FP32_SUMS);
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(dc));
}

/* An FP8 (E4M3) byte for a value E4M3 holds exactly (normal numbers and
 * zero; the operands below are chosen so). */
static uint8_t to_e4m3(float f) {
    if (f == 0) return 0;
    int e;
    float m = frexpf(fabsf(f), &e); /* |f| = m 2^e, m in [0.5, 1) */
    int mant = (int)((2 * m - 1) * 8);
    return (uint8_t)((f < 0 ? 0x80 : 0) | ((e - 1 + 7) << 3) | mant);
}

/* Values E4M3 holds exactly, for the FP8 operands. */
static float fp8_value(void) {
    static const float v[] = {-2, -1.5f, -1, -0.75f, -0.5f, -0.25f, 0, 0.25f, 0.5f, 0.75f, 1, 1.5f, 2};
    rng = rng * 1664525u + 1013904223u;
    return v[(rng >> 8) % (sizeof v / sizeof v[0])];
}

#define LT(name, call)                                                                   \
    do {                                                                                 \
        cublasStatus_t s_ = (call);                                                      \
        if (s_ != CUBLAS_STATUS_SUCCESS) {                                               \
            printf("FAIL %s: %s returned %s\n", name, #call, cublasGetStatusName(s_));   \
            failures++;                                                                  \
            return;                                                                      \
        }                                                                                \
    } while (0)

/* The shape of a cuBLASLt check. */
struct shape {
    int m, n, k;
};

/* D (m x n, FP32) = epilogue(op(A) op(B) + bias) through cublasLtMatmul,
 * A given as k x m (transposed) and B as k x n, both of type `ty` with
 * elements of `size` bytes; the heuristic picks the algorithm, as
 * PyTorch's addmm and _scaled_mm do. */
static void lt_matmul(cublasLtHandle_t lt, const char *name, struct shape sh, cudaDataType_t ty, size_t size, const void *a_bytes,
                      const void *b_bytes, const double *a, const double *b, const float *bias, int relu, double bound) {
    int m = sh.m, n = sh.n, k = sh.k;
    static float d[M * N];
    static double want[M * N], got[M * N];
    void *da = device_copy(a_bytes, size * k * m), *db = device_copy(b_bytes, size * k * n);
    float *dd, *dbias = bias ? device_copy(bias, sizeof(float) * m) : NULL;
    void *work;
    size_t work_size = 4 << 20;
    CK(cudaMalloc((void **)&dd, sizeof(float) * m * n));
    CK(cudaMalloc(&work, work_size));
    cublasLtMatmulDesc_t op;
    cublasLtMatrixLayout_t la, lb, ld;
    cublasLtMatmulPreference_t pref;
    cublasOperation_t t = CUBLAS_OP_T;
    cublasLtEpilogue_t epi = bias ? (relu ? CUBLASLT_EPILOGUE_RELU_BIAS : CUBLASLT_EPILOGUE_BIAS) : CUBLASLT_EPILOGUE_DEFAULT;
    LT(name, cublasLtMatmulDescCreate(&op, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    LT(name, cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_TRANSA, &t, sizeof t));
    LT(name, cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_EPILOGUE, &epi, sizeof epi));
    if (bias) LT(name, cublasLtMatmulDescSetAttribute(op, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &dbias, sizeof dbias));
    LT(name, cublasLtMatrixLayoutCreate(&la, ty, k, m, k));
    LT(name, cublasLtMatrixLayoutCreate(&lb, ty, k, n, k));
    LT(name, cublasLtMatrixLayoutCreate(&ld, CUDA_R_32F, m, n, m));
    LT(name, cublasLtMatmulPreferenceCreate(&pref));
    LT(name, cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &work_size, sizeof work_size));
    /* Every algorithm the heuristic offers (up to 8), not only its first
     * choice: each is a different kernel (SIMT, tensor-core tilings). */
    cublasLtMatmulHeuristicResult_t h[8];
    int found = 0;
    LT(name, cublasLtMatmulAlgoGetHeuristic(lt, op, la, lb, ld, ld, pref, 8, h, &found));
    if (found < 1) {
        printf("FAIL %s: cublasLtMatmulAlgoGetHeuristic found no algorithm\n", name);
        failures++;
        return;
    }
    memset(want, 0, sizeof want);
    reference(1, 0, m, n, k, 1.0, a, k, b, k, 0.0, want, m);
    for (int i = 0; i < m * n; i++) {
        if (bias) want[i] += bias[i % m];
        if (relu && want[i] < 0) want[i] = 0;
    }
    for (int r = 0; r < found; r++) {
        char each[96];
        int id = 0;
        size_t written = 0;
        cublasLtMatmulAlgoConfigGetAttribute(&h[r].algo, CUBLASLT_ALGO_CONFIG_ID, &id, sizeof id, &written);
        snprintf(each, sizeof each, "%s, algorithm %d of %d (id %d)", name, r + 1, found, id);
        float alpha = 1.0f, beta = 0.0f;
        CK(cudaMemset(dd, 0xff, sizeof(float) * m * n));
        LT(each, cublasLtMatmul(lt, op, &alpha, da, la, db, lb, &beta, dd, ld, dd, ld, &h[r].algo, work, work_size, 0));
        CK(cudaMemcpy(d, dd, sizeof(float) * m * n, cudaMemcpyDeviceToHost));
        for (int i = 0; i < m * n; i++) got[i] = d[i];
        compare(each, want, got, (size_t)m * n, bound);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(ld);
    cublasLtMatmulDescDestroy(op);
    CK(cudaFree(da));
    CK(cudaFree(db));
    CK(cudaFree(dd));
    CK(cudaFree(work));
    if (dbias) CK(cudaFree(dbias));
}

/* cuBLASLt: FP8 E4M3 operands (as PyTorch's _scaled_mm), and BF16 ones
 * with a bias and ReLU fused in the epilogue (as a Linear layer). */
static void lt(void) {
    static double a[K * M], b[K * N];
    static uint8_t a8[K * M], b8[K * N];
    static uint16_t a16[K * M], b16[K * N];
    static float bias[M];
    cublasLtHandle_t h;
    LT("cublasLtCreate", cublasLtCreate(&h));
    /* FP8 GEMMs need dimensions that are multiples of 16. */
    struct shape fp8 = {48, 16, 32}, all = {M, N, K};
    for (int i = 0; i < fp8.k * fp8.m; i++) a8[i] = to_e4m3((float)(a[i] = fp8_value()));
    for (int i = 0; i < fp8.k * fp8.n; i++) b8[i] = to_e4m3((float)(b[i] = fp8_value()));
    /* Products of E4M3 values are exact in FP32, and so are their sums
     * here (multiples of 1/16 below 2^7). */
    lt_matmul(h, "cublasLt fp8 e4m3", fp8, CUDA_R_8F_E4M3, 1, a8, b8, a, b, NULL, 0, 0.0);
    /* 16-bit operands at a shape whose rows are aligned to 16 bytes, where
     * cuBLASLt offers its tensor-core kernels as well; then BF16 at the
     * common shape with a bias and ReLU. */
    cudaDataType_t types[] = {CUDA_R_16F, CUDA_R_16BF, CUDA_R_16BF};
    struct shape shapes[] = {fp8, fp8, all};
    for (int c = 0; c < 3; c++) {
        struct shape sh = shapes[c];
        for (int i = 0; i < sh.k * sh.m; i++) store(types[c], a16, i, a[i] = round_to(types[c], next_value()));
        for (int i = 0; i < sh.k * sh.n; i++) store(types[c], b16, i, b[i] = round_to(types[c], next_value()));
        if (c < 2) lt_matmul(h, c == 0 ? "cublasLt f16, aligned" : "cublasLt bf16, aligned", sh, types[c], 2, a16, b16, a, b, NULL, 0, 4.0 * sh.k * 0x1p-23);
    }
    for (int i = 0; i < M; i++) bias[i] = next_value();
    lt_matmul(h, "cublasLt bf16 with bias and relu", all, CUDA_R_16BF, 2, a16, b16, a, b, bias, 1, FP32_SUMS + 0x1p-22);
    cublasLtDestroy(h);
}

/* Where cuBLAS has no kernel this device runs: the GEMM fails with a
 * cuBLAS status (never a crash or a hang) and the process goes on. */
static void refused(cublasHandle_t h) {
    static float af[K * M], bf[K * N], cf[M * N];
    float *da = device_copy(af, sizeof af), *db = device_copy(bf, sizeof bf), *dc = device_copy(cf, sizeof cf);
    float alpha = 1.0f, beta = 0.0f;
    cublasStatus_t s = cublasSgemm(h, CUBLAS_OP_N, CUBLAS_OP_N, M, N, K, &alpha, da, M, db, K, &beta, dc, M);
    if (s == CUBLAS_STATUS_SUCCESS) s = cudaDeviceSynchronize() == cudaSuccess ? s : CUBLAS_STATUS_EXECUTION_FAILED;
    if (s != CUBLAS_STATUS_SUCCESS) {
        printf("ok sgemm refused (%s)\n", cublasGetStatusName(s));
    } else {
        printf("FAIL sgemm refused: it succeeded\n");
        failures++;
    }
    cudaGetLastError();
    CK(cudaMemcpy(cf, dc, sizeof cf, cudaMemcpyDeviceToHost));
    printf("ok the process goes on\n");
}

int main(int argc, char **argv) {
    int expect_refused = argc > 1 && strcmp(argv[1], "--expect-refused") == 0;
    struct cudaDeviceProp p;
    CK(cudaGetDeviceProperties(&p, 0));
    int version = 0;
    cublasHandle_t h;
    CB("cublasCreate", cublasCreate(&h));
    CB("cublasGetVersion", cublasGetVersion(h, &version));
    printf("device: %s, compute %d.%d; cuBLAS %d\n", p.name, p.major, p.minor, version);
    printf("ok cublasCreate\n");
    if (expect_refused) {
        refused(h);
    } else {
        gemms(h);
        batched(h);
        lt();
    }
    CB("cublasDestroy", cublasDestroy(h));
    if (failures) {
        printf("cublas probe: %d failed\n", failures);
        return 1;
    }
    printf("cublas probe: all passed\n");
    return 0;
}
