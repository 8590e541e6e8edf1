// Warp reductions through shared memory separated by __syncwarp() (no
// shuffles), with the full mask and with a partial one.
#include "common.cuh"

// 128 threads per block: one sum per warp.
extern "C" __global__ void syncwarp_reduce(const int* in, int* out) {
    __shared__ int s[128];
    int t = threadIdx.x, lane = t & 31;
    s[t] = in[blockIdx.x * 128 + t];
    __syncwarp();
    for (int off = 16; off > 0; off >>= 1) {
        int x = 0;
        if (lane < off) x = s[t + off];
        __syncwarp();
        if (lane < off) s[t] += x;
        __syncwarp();
    }
    if (lane == 0) out[blockIdx.x * 4 + t / 32] = s[t];
}

// Lanes 0..15 reduce their values; the rest only write theirs.
extern "C" __global__ void syncwarp_partial(const int* in, int* out) {
    __shared__ int s[64];
    int t = threadIdx.x, lane = t & 31;
    s[t] = in[t];
    if (lane < 16) {
        const u32 m = 0x0000ffffu;
        __syncwarp(m);
        for (int off = 8; off > 0; off >>= 1) {
            int x = lane < off ? s[t + off] : 0;
            __syncwarp(m);
            if (lane < off) s[t] += x;
            __syncwarp(m);
        }
        out[t] = s[t - lane];
    } else {
        out[t] = -s[t];
    }
}
