// Thread block clusters (sm_90): cluster ranks, cluster.sync() and reading
// another block's shared memory (distributed shared memory).
#include <cooperative_groups.h>
#include "common.cuh"
namespace cg = cooperative_groups;

#if __CUDA_ARCH__ >= 900
#define CLUSTER2 __cluster_dims__(2, 1, 1)
#else
#define CLUSTER2
#endif

extern "C" __global__ void CLUSTER2 cluster_pairs(const int* in, int* out) {
#if __CUDA_ARCH__ >= 900
    __shared__ int s[64];
    cg::cluster_group c = cg::this_cluster();
    int t = threadIdx.x;
    s[t] = in[blockIdx.x * 64 + t];
    c.sync();
    int* peer = c.map_shared_rank(s, c.block_rank() ^ 1);
    int v = peer[63 - t];
    c.sync();
    out[blockIdx.x * 64 + t] = v * 10 + (int)c.block_rank() + 100 * (int)c.num_blocks();
#endif
}
