// Module-scope variables: __device__ scalars and initialised arrays,
// __constant__ arrays with initialisers and ones the host writes through
// cuModuleGetGlobal, and addresses of __device__ symbols held in memory.
#include "common.cuh"

__device__ int g_scalar = 42;
__device__ int g_table[8] = {3, 1, 4, 1, 5, 9, 2, 6};
__device__ u64 g_big = 0x123456789abcdef0ULL;
__device__ float g_f = 1.5f;
__device__ u32 g_counter;            // zero-initialised, bumped by launches
__device__ int g_host;               // written by the host before use
__constant__ int c_table[4] = {10, 20, 30, 40};
__constant__ float c_coef[3] = {0.5f, 0.25f, 2.0f};
__constant__ int c_host[16];         // written by the host before use
__device__ int* g_ptr = &g_table[2]; // the address of a __device__ symbol
__device__ const int* g_ptrs[2] = {&g_table[5], &g_scalar};

extern "C" __global__ void read_vars(const int* sel, int* out) {
    int k = sel[0];
    out[0] = g_scalar;
    for (int j = 0; j < 8; j++) out[1 + j] = g_table[(j + k) & 7];
    out[9] = (int)(g_big >> 32);
    out[10] = (int)g_big;
    out[11] = __float_as_int(g_f);
    for (int j = 0; j < 4; j++) out[12 + j] = c_table[(j + k) & 3];
    out[16] = *g_ptr;
    out[17] = *g_ptrs[0];
    out[18] = *g_ptrs[1];
    out[19] = __float_as_int(c_coef[(k + 1) % 3]);
}

extern "C" __global__ void use_host_vars(const int* idx, int* out, int n) {
    int i = gid();
    if (i >= n) return;
    out[i] = c_host[idx[i] & 15] * g_host + c_table[i & 3];
}

extern "C" __global__ void store_addrs(u64* out) {
    out[0] = (u64)(&g_table[3]);
    out[1] = (u64)(&g_scalar);
    out[2] = (u64)g_ptr;
    out[3] = (u64)(&c_table[1]);
}

// Loads through addresses that the host passes in memory.
extern "C" __global__ void deref(const int* const* ptrs, int* out, int n) {
    int i = gid();
    if (i >= n) return;
    out[i] = *ptrs[i];
}

extern "C" __global__ void bump(int n) {
    if (gid() < n) atomicAdd(&g_counter, 1u);
}
