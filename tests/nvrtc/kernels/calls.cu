// Real calls: a __noinline__ function with parameters and a return value
// (scalars and a struct), bounded recursion, and calls through function
// pointers (a table in global memory and a selected local pointer).
#include "common.cuh"

struct Trio { float x; int y; double z; };

__device__ __noinline__ int mix(int a, int b, float c) { return a * 3 + b - (int)(c * 2.0f); }

__device__ __noinline__ Trio scale(int k, Trio p) {
    Trio r;
    r.x = p.x * k;
    r.y = p.y + k;
    r.z = p.z - k;
    return r;
}

__device__ int fib(int n) { return n < 2 ? n : fib(n - 1) + fib(n - 2); }

__device__ __noinline__ int op_add(int a, int b) { return a + b; }
__device__ __noinline__ int op_sub(int a, int b) { return a - b; }
__device__ __noinline__ int op_mul(int a, int b) { return a * b; }
__device__ __noinline__ int op_xor(int a, int b) { return a ^ b; }

typedef int (*binop)(int, int);
__device__ binop g_ops[4] = {op_add, op_sub, op_mul, op_xor};

extern "C" __global__ void call_noinline(const int* a, const int* b, int* out, double* dout, int n) {
    int i = gid();
    if (i >= n) return;
    out[i * 3] = mix(a[i], b[i], (float)i);
    Trio t = {1.5f * i, a[i], 0.25 * b[i]};
    Trio r = scale(b[i] & 7, t);
    out[i * 3 + 1] = __float_as_int(r.x);
    out[i * 3 + 2] = r.y;
    dout[i] = r.z;
}

extern "C" __global__ void call_recursive(const int* a, int* out, int n) {
    int i = gid();
    if (i >= n) return;
    out[i] = fib(a[i] & 15);
}

extern "C" __global__ void call_indirect(const int* a, const int* b, int* out, int n) {
    int i = gid();
    if (i >= n) return;
    binop f = g_ops[b[i] & 3];
    binop g = (a[i] & 1) ? op_sub : op_xor;
    out[i * 2] = f(a[i], b[i]);
    out[i * 2 + 1] = g(a[i], 7);
}
