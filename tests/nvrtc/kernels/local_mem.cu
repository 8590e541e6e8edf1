// A per-thread array indexed by runtime values lives in .local memory.
#include "common.cuh"

extern "C" __global__ void local_array(const int* sel, int* out, int n) {
    int i = gid();
    if (i >= n) return;
    int arr[32];
    for (int k = 0; k < 32; k++) arr[k] = k * k + i;
    int s = sel[i];
    arr[(s >> 10) & 31] += 1000;
    out[i] = arr[s & 31] + arr[(s >> 5) & 31];
}

struct Big { double d[6]; int k[5]; };

// A struct copied and indexed dynamically.
extern "C" __global__ void local_struct(const int* sel, double* out, int n) {
    int i = gid();
    if (i >= n) return;
    Big b;
    for (int k = 0; k < 6; k++) b.d[k] = 0.5 * k + i;
    for (int k = 0; k < 5; k++) b.k[k] = k - i;
    int s = sel[i];
    out[i] = b.d[s % 6] + b.k[s % 5];
}
