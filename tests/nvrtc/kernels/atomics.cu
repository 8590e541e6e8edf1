// Atomics on global and shared memory: add (s32, u64, f32, f64), min/max,
// and/or/xor, inc/dec, exch, CAS loops (32 and 64 bit), scoped variants.
#include "common.cuh"

// The results are independent of the order in which threads run.
extern "C" __global__ void atomics_global(i32* s32, u32* u, u64* w, float* f, double* d, u32* olds, int n) {
    int t = gid();
    if (t >= n) return;
    atomicAdd(&s32[0], t);                     // result unused: red
    olds[t] = (u32)atomicAdd(&s32[1], 1);     // a permutation of 0..n-1
    atomicMin(&s32[2], 1000 - t * 37);
    atomicMax(&s32[3], t * 13 - 500);
    atomicMin(&u[0], (u32)(t * 2654435761u));
    atomicMax(&u[1], (u32)(t * 2654435761u));
    atomicAnd(&u[2], ~(1u << (t % 29)));
    atomicOr(&u[3], 1u << ((t * 5) % 27));
    atomicXor(&u[4], 1u << (t & 31));
    atomicInc(&u[5], 9u);
    atomicDec(&u[6], 9u);
    olds[n + t] = atomicExch(&u[7], (u32)t);
    atomicAdd(&w[0], (u64)t << 33);
    atomicMin(&w[1], (u64)t * 0x100000001ull + 5);
    atomicMax(&w[2], (u64)t * 0x100000001ull);
    atomicMin((i64*)&w[3], (i64)(t - 40) * 0x10000000ll);
    atomicOr(&w[4], 1ull << (t & 63));
    atomicXor(&w[5], (u64)t * 0x9E3779B97F4A7C15ull);
    atomicAnd(&w[6], ~(1ull << ((t * 3) & 63)));
    atomicAdd(&f[0], (float)(t & 7) * 0.25f);
    atomicExch(&f[1], 2.5f);
    atomicAdd(&d[0], t * 0.5);
}

// atomicCAS loops: a float max (32-bit CAS) and a double sum (64-bit CAS).
extern "C" __global__ void atomics_cas(const float* in, u32* fmax_bits, u64* dsum_bits, int n) {
    int t = gid();
    if (t >= n) return;
    float v = in[t];
    u32 old = *((volatile u32*)fmax_bits), assumed;
    do {
        assumed = old;
        if (__uint_as_float(assumed) >= v) break;
        old = atomicCAS(fmax_bits, assumed, __float_as_uint(v));
    } while (old != assumed);
    u64 o2 = *((volatile u64*)dsum_bits), a2;
    do {
        a2 = o2;
        o2 = atomicCAS(dsum_bits, a2, (u64)__double_as_longlong(__longlong_as_double((i64)a2) + (double)(t + 1)));
    } while (o2 != a2);
}

// Shared-memory atomics, one block of 256 threads; results per block.
extern "C" __global__ void atomics_shared(const int* in, int* out) {
    __shared__ int acc[6];
    __shared__ u32 ctr[2];
    int t = threadIdx.x, v = in[blockIdx.x * blockDim.x + t];
    if (t < 6) acc[t] = (t == 2) ? 0x7fffffff : (t == 3 ? (int)0x80000000 : (t == 4 ? -1 : 0));
    if (t < 2) ctr[t] = 0;
    __syncthreads();
    atomicAdd(&acc[0], v);
    atomicSub(&acc[1], v);
    atomicMin(&acc[2], v);
    atomicMax(&acc[3], v);
    atomicAnd(&acc[4], ~(1 << (t & 31)) | (v & 1));
    int old = acc[5], assumed;
    do {
        assumed = old;
        old = atomicCAS(&acc[5], assumed, assumed + (v & 15));
    } while (old != assumed);
    atomicInc(&ctr[0], 99u);
    atomicExch(&ctr[1], 77u);
    __syncthreads();
    if (t < 6) out[blockIdx.x * 8 + t] = acc[t];
    if (t < 2) out[blockIdx.x * 8 + 6 + t] = (int)ctr[t];
}

// Scoped atomics: block, system.
extern "C" __global__ void atomics_scoped(u32* ctr, u64* ctr64, int n) {
    int t = gid();
    if (t >= n) return;
    atomicAdd_block(&ctr[0], 1u);
    atomicAdd_system(&ctr[1], 2u);
    atomicMax_block(&ctr[2], (u32)t);
    atomicOr_system(&ctr[3], 1u << (t & 31));
    atomicCAS_block(&ctr[4], 0u, 7u);
    atomicAdd_system(&ctr64[0], 3ull);
}
