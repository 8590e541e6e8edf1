// Atomic adds of __half2 and __half (sm_70) and __nv_bfloat162 (native on
// sm_90, a CAS loop before).
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include "common.cuh"

extern "C" __global__ void atomics_half(__half2* h2, __half* h, __nv_bfloat162* b2, int n) {
    int t = gid();
    if (t >= n) return;
    atomicAdd(h2, __halves2half2(__float2half(0.5f), __float2half((t & 3) * 0.25f)));
    atomicAdd(h, __float2half(1.0f));
    atomicAdd(b2, __floats2bfloat162_rn(1.0f, 0.5f));
}
