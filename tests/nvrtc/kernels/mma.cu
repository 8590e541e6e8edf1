// Warp-level matrix instructions the way GEMM libraries emit them (inline
// PTX on register fragments): mma.sync on f16, bf16, tf32, s8, e4m3 and f64
// operands, ldmatrix (plain and .trans) feeding it from shared memory, and
// stmatrix. Every fragment is built from, or written to, the matrices by the
// coordinates the PTX ISA gives ("Matrix Fragments for mma.m16n8k*"), so a
// device whose layout differs fails the host comparison. One warp each.
// Matrices are row-major: A is MxK, B is KxN, C and D are MxN.
#include "common.cuh"

typedef unsigned short u16;

__device__ __forceinline__ int grp() { return (threadIdx.x & 31) >> 2; }
__device__ __forceinline__ int tig() { return threadIdx.x & 3; }
__device__ __forceinline__ u32 pack16(u16 lo, u16 hi) { return (u32)lo | ((u32)hi << 16); }
__device__ __forceinline__ u32 pack8(const signed char* p, int stride) {
    return (u32)(unsigned char)p[0] | ((u32)(unsigned char)p[stride] << 8) | ((u32)(unsigned char)p[2 * stride] << 16) |
           ((u32)(unsigned char)p[3 * stride] << 24);
}

// C/D element i of this lane in a 16x8 accumulator.
__device__ __forceinline__ int cd16(int i) { return (grp() + 8 * (i >> 1)) * 8 + 2 * tig() + (i & 1); }

// A 16x16 and B 16x8 of 16-bit elements (f16 or bf16 bits) into fragments.
__device__ void frag16(const u16* A, const u16* B, u32 a[4], u32 b[2]) {
    int g = grp(), t = tig();
    for (int r = 0; r < 4; r++) {
        int row = g + 8 * (r & 1), col = (r >> 1) * 8 + 2 * t;
        a[r] = pack16(A[row * 16 + col], A[row * 16 + col + 1]);
    }
    for (int r = 0; r < 2; r++) {
        int row = r * 8 + 2 * t;
        b[r] = pack16(B[row * 8 + g], B[(row + 1) * 8 + g]);
    }
}

#define MMA_16816(TYPES, d, a, b, c)                                                                                       \
    asm volatile("mma.sync.aligned.m16n8k16.row.col." TYPES " {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};" \
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])                                                        \
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]),     \
                   "f"(c[3]))

// D = A x B + C, f16 operands, f32 accumulators, fragments from global memory.
extern "C" __global__ void mma_f16(const u16* A, const u16* B, const float* C, float* D) {
#if __CUDA_ARCH__ >= 800
    u32 a[4], b[2];
    float c[4], d[4];
    frag16(A, B, a, b);
    for (int i = 0; i < 4; i++) c[i] = C[cd16(i)];
    MMA_16816("f32.f16.f16.f32", d, a, b, c);
    for (int i = 0; i < 4; i++) D[cd16(i)] = d[i];
#endif
}

// The same with bf16 operands.
extern "C" __global__ void mma_bf16(const u16* A, const u16* B, const float* C, float* D) {
#if __CUDA_ARCH__ >= 800
    u32 a[4], b[2];
    float c[4], d[4];
    frag16(A, B, a, b);
    for (int i = 0; i < 4; i++) c[i] = C[cd16(i)];
    MMA_16816("f32.bf16.bf16.f32", d, a, b, c);
    for (int i = 0; i < 4; i++) D[cd16(i)] = d[i];
#endif
}

// f16 operands staged in shared memory and loaded with ldmatrix, the way
// CUTLASS does: A with .x4 (four 8x8 tiles), B (row-major KxN) with
// .x2.trans; then f16 accumulators (m16n8k16 .f16), written back with
// stmatrix where the device has it (sm_90), else by their fragment layout.
extern "C" __global__ void mma_ldmatrix(const u16* A, const u16* B, const u16* C, u16* D, float* Df32) {
#if __CUDA_ARCH__ >= 800
    __shared__ __align__(16) u16 sA[16 * 16], sB[16 * 8], sD[16 * 8];
    int lane = threadIdx.x & 31, g = grp(), t = tig();
    for (int i = lane; i < 256; i += 32) sA[i] = A[i];
    for (int i = lane; i < 128; i += 32) sB[i] = B[i];
    __syncwarp();
    u32 a[4], b[2], c[2], d[2];
    {
        int q = lane >> 3, r = lane & 7;
        u32 p = (u32)__cvta_generic_to_shared(&sA[(r + 8 * (q & 1)) * 16 + 8 * (q >> 1)]);
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                     : "=r"(a[0]), "=r"(a[1]), "=r"(a[2]), "=r"(a[3])
                     : "r"(p));
        u32 pb = (u32)__cvta_generic_to_shared(&sB[(lane & 15) * 8]);
        asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0,%1}, [%2];" : "=r"(b[0]), "=r"(b[1]) : "r"(pb));
    }
    for (int r = 0; r < 2; r++) c[r] = pack16(C[(g + 8 * r) * 8 + 2 * t], C[(g + 8 * r) * 8 + 2 * t + 1]);
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f16.f16.f16.f16 {%0,%1}, {%2,%3,%4,%5}, {%6,%7}, {%8,%9};"
                 : "=r"(d[0]), "=r"(d[1])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]));
#if __CUDA_ARCH__ >= 900
    u32 pd = (u32)__cvta_generic_to_shared(&sD[(lane & 15) * 8]);
    asm volatile("stmatrix.sync.aligned.m8n8.x2.shared.b16 [%0], {%1,%2};" ::"r"(pd), "r"(d[0]), "r"(d[1]));
#else
    for (int r = 0; r < 2; r++) {
        sD[(g + 8 * r) * 8 + 2 * t] = (u16)d[r];
        sD[(g + 8 * r) * 8 + 2 * t + 1] = (u16)(d[r] >> 16);
    }
#endif
    __syncwarp();
    for (int i = lane; i < 128; i += 32) D[i] = sD[i];
    // And the same tiles once more through f32 accumulators, B loaded
    // without .trans from its transpose (NxK, the "col" operand as stored).
    __shared__ __align__(16) u16 sBt[8 * 16];
    for (int i = lane; i < 128; i += 32) sBt[(i % 8) * 16 + i / 8] = sB[i];
    __syncwarp();
    u32 pbt = (u32)__cvta_generic_to_shared(&sBt[(lane & 7) * 16 + 8 * ((lane >> 3) & 1)]);
    asm volatile("ldmatrix.sync.aligned.m8n8.x2.shared.b16 {%0,%1}, [%2];" : "=r"(b[0]), "=r"(b[1]) : "r"(pbt));
    float cf[4] = {0, 0, 0, 0}, df[4];
    MMA_16816("f32.f16.f16.f32", df, a, b, cf);
    for (int i = 0; i < 4; i++) Df32[cd16(i)] = df[i];
#endif
}

// tf32: A 16x8 and B 8x8 f32, rounded with cvt.rna.tf32.f32 first (as
// cuBLAS does), m16n8k8; and the rounding itself for every element of X.
extern "C" __global__ void mma_tf32(const float* A, const float* B, const float* C, float* D, const float* X, u32* Xr) {
#if __CUDA_ARCH__ >= 800
    int g = grp(), t = tig(), lane = threadIdx.x & 31;
    u32 a[4], b[2];
    float c[4], d[4];
    for (int r = 0; r < 4; r++) asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(a[r]) : "f"(A[(g + 8 * (r & 1)) * 8 + (r >> 1) * 4 + t]));
    for (int r = 0; r < 2; r++) asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(b[r]) : "f"(B[(r * 4 + t) * 8 + g]));
    for (int i = 0; i < 4; i++) c[i] = C[cd16(i)];
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.tf32.tf32.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    for (int i = 0; i < 4; i++) D[cd16(i)] = d[i];
    for (int i = lane; i < 64; i += 32) asm("cvt.rna.tf32.f32 %0, %1;" : "=r"(Xr[i]) : "f"(X[i]));
#endif
}

// s8: A 16x32, B 32x8, s32 accumulators, m16n8k32, wrapping and .satfinite.
extern "C" __global__ void mma_s8(const signed char* A, const signed char* B, const int* C, int* D, int* Dsat) {
#if __CUDA_ARCH__ >= 800
    int g = grp(), t = tig();
    u32 a[4], b[2];
    int c[4], d[4], s[4];
    for (int r = 0; r < 4; r++) a[r] = pack8(&A[(g + 8 * (r & 1)) * 32 + (r >> 1) * 16 + 4 * t], 1);
    for (int r = 0; r < 2; r++) b[r] = pack8(&B[(r * 16 + 4 * t) * 8 + g], 8);
    for (int i = 0; i < 4; i++) c[i] = C[cd16(i)];
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                 : "=r"(d[0]), "=r"(d[1]), "=r"(d[2]), "=r"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
    asm volatile("mma.sync.aligned.m16n8k32.row.col.satfinite.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                 : "=r"(s[0]), "=r"(s[1]), "=r"(s[2]), "=r"(s[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(c[0]), "r"(c[1]), "r"(c[2]), "r"(c[3]));
    for (int i = 0; i < 4; i++) {
        D[cd16(i)] = d[i];
        Dsat[cd16(i)] = s[i];
    }
#endif
}

// e4m3 (FP8): A 16x32, B 32x8, f32 accumulators, m16n8k32 (sm_89 and later).
extern "C" __global__ void mma_e4m3(const signed char* A, const signed char* B, const float* C, float* D) {
#if __CUDA_ARCH__ >= 900
    int g = grp(), t = tig();
    u32 a[4], b[2];
    float c[4], d[4];
    for (int r = 0; r < 4; r++) a[r] = pack8(&A[(g + 8 * (r & 1)) * 32 + (r >> 1) * 16 + 4 * t], 1);
    for (int r = 0; r < 2; r++) b[r] = pack8(&B[(r * 16 + 4 * t) * 8 + g], 8);
    for (int i = 0; i < 4; i++) c[i] = C[cd16(i)];
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    for (int i = 0; i < 4; i++) D[cd16(i)] = d[i];
#endif
}

// f64: A 8x4, B 4x8, C and D 8x8, m8n8k4 (the DMMA of sm_80).
extern "C" __global__ void mma_f64(const double* A, const double* B, const double* C, double* D) {
#if __CUDA_ARCH__ >= 800
    int g = grp(), t = tig();
    double a = A[g * 4 + t], b = B[t * 8 + g], c0 = C[g * 8 + 2 * t], c1 = C[g * 8 + 2 * t + 1], d0, d1;
    asm volatile("mma.sync.aligned.m8n8k4.row.col.f64.f64.f64.f64 {%0,%1}, {%2}, {%3}, {%4,%5};"
                 : "=d"(d0), "=d"(d1)
                 : "d"(a), "d"(b), "d"(c0), "d"(c1));
    D[g * 8 + 2 * t] = d0;
    D[g * 8 + 2 * t + 1] = d1;
#endif
}

// m16n8k8 with f16 operands: A 16x8, B 8x8.
extern "C" __global__ void mma_f16_k8(const u16* A, const u16* B, const float* C, float* D) {
#if __CUDA_ARCH__ >= 800
    int g = grp(), t = tig();
    u32 a[2], b;
    float c[4], d[4];
    for (int r = 0; r < 2; r++) a[r] = pack16(A[(g + 8 * r) * 8 + 2 * t], A[(g + 8 * r) * 8 + 2 * t + 1]);
    b = pack16(B[(2 * t) * 8 + g], B[(2 * t + 1) * 8 + g]);
    for (int i = 0; i < 4; i++) c[i] = C[cd16(i)];
    asm volatile("mma.sync.aligned.m16n8k8.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};"
                 : "=f"(d[0]), "=f"(d[1]), "=f"(d[2]), "=f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(b), "f"(c[0]), "f"(c[1]), "f"(c[2]), "f"(c[3]));
    for (int i = 0; i < 4; i++) D[cd16(i)] = d[i];
#endif
}
