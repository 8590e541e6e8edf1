// One warp waits in a loop for another warp's flag: in shared memory through
// cuda::atomic_ref (release/acquire), and a ping-pong in global memory through
// ld.acquire/st.release asm and volatile loads. Correct only if the device
// lets the spinning warp yield to the one that sets the flag.
#include <cuda/atomic>
#include "common.cuh"

// 64 threads: warp 0 fills data and raises the flag; warp 1 waits, then reads.
extern "C" __global__ void spin_shared_flag(int* out) {
    __shared__ int flag;
    __shared__ int data[32];
    int t = threadIdx.x, lane = t & 31;
    if (t == 0) flag = 0;
    __syncthreads();
    cuda::atomic_ref<int, cuda::thread_scope_block> f(flag);
    if (t < 32) {
        data[lane] = lane * lane + 7;
        __syncwarp();
        if (lane == 0) f.store(1, cuda::memory_order_release);
    } else {
        while (f.load(cuda::memory_order_acquire) == 0) {
        }
        out[lane] = data[31 - lane];
    }
}

// 64 threads, flags zeroed by the host: warp 1 publishes first, warp 0
// answers, then warp 1 reads the answer; whichever warp runs first waits.
extern "C" __global__ void spin_pingpong(u32* flags, int* data, int* out) {
    int t = threadIdx.x, lane = t & 31;
    if (t >= 32) {
        if (lane == 0) {
            data[0] = 99;
            asm volatile("st.release.gpu.global.u32 [%0], %1;" ::"l"(flags), "r"(1u) : "memory");
        }
        __syncwarp();
        while (((volatile u32*)flags)[1] == 0) {
        }
        __threadfence();
        out[32 + lane] = data[1] + lane;
    } else {
        u32 seen = 0;
        while (seen == 0) asm volatile("ld.acquire.gpu.global.u32 %0, [%1];" : "=r"(seen) : "l"(flags) : "memory");
        if (lane == 0) {
            data[1] = data[0] + 1;
            __threadfence();
            ((volatile u32*)flags)[1] = 1;
        }
        out[lane] = data[0] - lane;
    }
}
