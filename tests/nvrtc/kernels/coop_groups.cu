// Cooperative groups: grid ranks (no grid.sync), thread_block, tiles of 32
// and 8 with shfl_down reductions, cg::reduce; tiles of 64 and 128.
#include <cooperative_groups.h>
#include <cooperative_groups/reduce.h>
#include <cooperative_groups/scan.h>
#include "common.cuh"
namespace cg = cooperative_groups;

extern "C" __global__ void cg_grid_stride(const float* in, float* out, u64 n, u64* info) {
    cg::grid_group g = cg::this_grid();
    for (u64 k = g.thread_rank(); k < n; k += g.size()) out[k] = in[k] * 2.0f + 1.0f;
    if (g.thread_rank() == 0) {
        info[0] = g.size();
        info[1] = g.num_blocks();
        info[2] = g.dim_blocks().x;
    }
}

// Block (8, 4): each thread writes what its block group says of it.
extern "C" __global__ void cg_block(u32* out) {
    cg::thread_block b = cg::this_thread_block();
    u32 r = b.thread_rank();
    u32* o = out + (blockIdx.x * b.size() + r) * 5;
    o[0] = r;
    o[1] = b.size();
    o[2] = b.group_index().x;
    o[3] = b.thread_index().x + 100 * b.thread_index().y;
    o[4] = b.dim_threads().x * 1000 + b.dim_threads().y;
    b.sync();
}

extern "C" __global__ void cg_tiles(const int* in, int* out) {
    cg::thread_block block = cg::this_thread_block();
    cg::thread_block_tile<32> t32 = cg::tiled_partition<32>(block);
    cg::thread_block_tile<8> t8 = cg::tiled_partition<8>(block);
    int i = gid(), v = in[i];
    int s32 = v, s8 = v;
    for (int o = 16; o > 0; o >>= 1) s32 += t32.shfl_down(s32, o);
    for (int o = 4; o > 0; o >>= 1) s8 += t8.shfl_down(s8, o);
    int* o = out + i * 7;
    o[0] = t32.thread_rank() == 0 ? s32 : 0;
    o[1] = t8.thread_rank() == 0 ? s8 : 0;
    o[2] = cg::reduce(t32, v, cg::plus<int>());
    o[3] = cg::reduce(t8, v, cg::greater<int>());
    o[4] = t8.meta_group_rank() * 100 + t8.thread_rank();
    o[5] = (int)t32.ballot(v > 0);
    o[6] = t8.any(v == 3) + 2 * t8.all(v > -50);
}

// Tiles wider than a warp (64 and 128 threads, in blocks of 256): their
// collectives go through shared memory and named barriers, not shuffles.
extern "C" __global__ void cg_wide_tiles(const int* in, int* out) {
    __shared__ cg::block_tile_memory<256> scratch;
    cg::thread_block block = cg::this_thread_block(scratch);
    cg::thread_block_tile<64> t64 = cg::tiled_partition<64>(block);
    cg::thread_block_tile<128> t128 = cg::tiled_partition<128>(block);
    int i = gid(), v = in[i];
    int* o = out + i * 6;
    o[0] = cg::reduce(t64, v, cg::plus<int>());
    o[1] = cg::reduce(t128, v, cg::greater<int>());
    o[2] = t64.meta_group_rank() * 1000 + t64.thread_rank();
    o[3] = t64.shfl(v, 37);  // wider than a warp, shfl is a broadcast
    t128.sync();
    o[4] = t128.any(v == 7) + 2 * t128.all(v > -100);
    o[5] = cg::exclusive_scan(t64, v, cg::plus<int>());
}
