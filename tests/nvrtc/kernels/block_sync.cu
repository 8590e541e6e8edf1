// Block barriers: __syncthreads, __syncthreads_count/_and/_or (bar.red),
// named barriers with thread counts (bar.sync / bar.arrive).
#include "common.cuh"

extern "C" __global__ void bar_red(const int* in, int* out) {
    int t = threadIdx.x, v = in[blockIdx.x * blockDim.x + t];
    int c = __syncthreads_count(v > 0);
    int a = __syncthreads_and(v > -5);
    int o = __syncthreads_or(v == 42);
    if (t == 0) {
        out[blockIdx.x * 3] = c;
        out[blockIdx.x * 3 + 1] = a;
        out[blockIdx.x * 3 + 2] = o;
    }
}

// 256 threads: a tree sum in shared memory, one barrier per level.
extern "C" __global__ void block_tree_sum(const int* in, int* out) {
    __shared__ int s[256];
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * 256 + t];
    __syncthreads();
    for (int k = 128; k > 0; k >>= 1) {
        if (t < k) s[t] += s[t + k];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = s[0];
}

// 128 threads: warps 0-1 meet at barrier 1, warps 2-3 at barrier 2.
extern "C" __global__ void __launch_bounds__(128) named_barriers(const int* in, int* out) {
    __shared__ int s[128];
    int t = threadIdx.x;
    s[t] = in[t] * 3;
    if (t < 64)
        asm volatile("bar.sync 1, 64;" ::: "memory");
    else
        asm volatile("bar.sync 2, 64;" ::: "memory");
    out[t] = s[t ^ 32];
}

// 128 threads: warps 0-1 produce and arrive, warps 2-3 wait and consume.
extern "C" __global__ void producer_consumer(const int* in, int* out) {
    __shared__ int buf[64];
    int t = threadIdx.x;
    if (t < 64) {
        buf[t] = in[t] * 5 + 1;
        asm volatile("bar.arrive 3, 128;" ::: "memory");
    } else {
        asm volatile("bar.sync 3, 128;" ::: "memory");
        out[t - 64] = buf[127 - t];
    }
}
