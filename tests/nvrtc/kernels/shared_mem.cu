// Static __shared__ arrays, extern __shared__ dynamic shared memory (and
// both at once), and a 2-D tiled transpose.
#include "common.cuh"

extern "C" __global__ void smem_reverse(const int* in, int* out) {
    __shared__ int s[256];
    int t = threadIdx.x, base = blockIdx.x * blockDim.x;
    s[t] = in[base + t];
    __syncthreads();
    out[base + t] = s[blockDim.x - 1 - t];
}

extern "C" __global__ void smem_dynamic(const float* in, float* out, u32* info) {
    extern __shared__ float dyn[];
    __shared__ int hist[4];
    int t = threadIdx.x, nt = blockDim.x, base = blockIdx.x * nt;
    if (t < 4) hist[t] = 0;
    dyn[t] = in[base + t];
    dyn[nt + t] = 2.0f * in[base + t];
    __syncthreads();
    atomicAdd(&hist[t & 3], 1);
    out[base + t] = dyn[(t + 1) % nt] + dyn[nt + t];
    __syncthreads();
    if (t == 0) {
        u32 d;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(d));
        info[blockIdx.x * 2] = d;
        info[blockIdx.x * 2 + 1] = hist[0] + 10 * hist[1] + 100 * hist[2] + 1000 * hist[3];
    }
}

// Block (16, 16), grid (w/16, h/16): out[x][y] = in[y][x].
extern "C" __global__ void smem_transpose(const float* in, float* out, int w, int h) {
    __shared__ float tile[16][17];
    int x = blockIdx.x * 16 + threadIdx.x, y = blockIdx.y * 16 + threadIdx.y;
    if (x < w && y < h) tile[threadIdx.y][threadIdx.x] = in[y * w + x];
    __syncthreads();
    int tx = blockIdx.y * 16 + threadIdx.x, ty = blockIdx.x * 16 + threadIdx.y;
    if (tx < h && ty < w) out[ty * h + tx] = tile[threadIdx.x][threadIdx.y];
}
