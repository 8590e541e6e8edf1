// Warp shuffles: idx/up/down/xor with the full mask and with widths, on
// 32- and 64-bit values, and a partial-mask scan by the lower 16 lanes.
#include "common.cuh"

extern "C" __global__ void shfl_full(const int* in, int* out) {
    int i = gid(), lane = threadIdx.x & 31, v = in[i];
    const u32 full = 0xffffffffu;
    int* o = out + i * 8;
    o[0] = __shfl_sync(full, v, (lane * 7 + 3) & 31);
    o[1] = __shfl_up_sync(full, v, 3);
    o[2] = __shfl_down_sync(full, v, 5);
    o[3] = __shfl_xor_sync(full, v, 0x13);
    o[4] = __shfl_sync(full, v, lane + 2, 8);
    o[5] = __shfl_up_sync(full, v, 1, 16);
    o[6] = __shfl_down_sync(full, v, 2, 4);
    o[7] = __shfl_xor_sync(full, v, 5, 8);
}

extern "C" __global__ void shfl_types(const double* d, const u64* w, const float* f, double* od, u64* ow, float* of) {
    int i = gid(), lane = threadIdx.x & 31;
    const u32 full = 0xffffffffu;
    od[i] = __shfl_xor_sync(full, d[i], 1);
    ow[i] = __shfl_sync(full, w[i], 31 - lane);
    of[i] = __shfl_down_sync(full, f[i], 16);
}

// Inclusive prefix sums over lanes 0..15 of each warp; the other lanes write -1.
extern "C" __global__ void shfl_partial_scan(const int* in, int* out) {
    int i = gid(), lane = threadIdx.x & 31, v = in[i], r = -1;
    if (lane < 16) {
        for (int d = 1; d < 16; d <<= 1) {
            int u = __shfl_up_sync(0x0000ffffu, v, d);
            if (lane >= d) v += u;
        }
        r = v;
    }
    out[i] = r;
}
