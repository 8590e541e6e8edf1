// Warp votes and matching: ballot, all, any, activemask, a ballot by the
// lanes of a divergent branch, match.any/all (sm_70), redux.sync (sm_80).
#include "common.cuh"

// Launched with 48 threads per block: the second warp has 16 lanes.
extern "C" __global__ void vote(const int* in, u32* out) {
    int t = threadIdx.x, v = in[blockIdx.x * blockDim.x + t];
    u32* o = out + (blockIdx.x * blockDim.x + t) * 6;
    u32 m = __activemask();
    o[0] = m;
    o[1] = __ballot_sync(m, v > 0);
    o[2] = __all_sync(m, v > -100);
    o[3] = __all_sync(m, v > 0);
    o[4] = __any_sync(m, v == 7);
    u32 odd = __ballot_sync(m, v & 1), r = 0xdeadbeefu;
    if (v & 1) r = __ballot_sync(odd, v > 5);
    o[5] = r;
}

extern "C" __global__ void match(const int* keys, const u64* wide, u32* out) {
    int i = gid();
    u32* o = out + i * 5;
    const u32 full = 0xffffffffu;
    int k = keys[i], pred;
    o[0] = __match_any_sync(full, k);
    o[1] = __match_all_sync(full, k & 0x100, &pred);
    o[2] = pred;
    o[3] = __match_all_sync(full, k, &pred) | (u32)pred;
    o[4] = __match_any_sync(full, wide[i]);
}

// __reduce_*_sync: sm_80 and newer.
extern "C" __global__ void redux(const int* in, u32* out) {
#if __CUDA_ARCH__ >= 800
    int i = gid(), lane = threadIdx.x & 31, v = in[i];
    u32* o = out + i * 7;
    const u32 full = 0xffffffffu;
    o[0] = __reduce_add_sync(full, (u32)v);
    o[1] = (u32)__reduce_min_sync(full, v);
    o[2] = (u32)__reduce_max_sync(full, v);
    o[3] = __reduce_min_sync(full, (u32)v);
    o[4] = __reduce_and_sync(full, (u32)v);
    o[5] = __reduce_or_sync(full, (u32)v) ^ __reduce_xor_sync(full, (u32)v);
    o[6] = 0xdeadbeefu;
    if (lane < 16) o[6] = __reduce_add_sync(0x0000ffffu, (u32)v);
#endif
}
