// Shared by the NVRTC suite's kernels (tests/nvrtc/run_suite.py runs them).
#pragma once
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;
typedef long long i64;

// Global index of this thread in a 1-D launch.
__device__ __forceinline__ int gid() { return blockIdx.x * blockDim.x + threadIdx.x; }
