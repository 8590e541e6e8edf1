// A device-side assert that fires for one specific input value.
#include <cuda/std/cassert>
#include "common.cuh"

extern "C" __global__ void check_not_13(const int* in, int* out, int n) {
    int i = gid();
    if (i >= n) return;
    int v = in[i];
    assert(v != 13);
    out[i] = v * 2;
}
