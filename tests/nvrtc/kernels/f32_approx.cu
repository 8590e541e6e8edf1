// Approximate f32 functions: rsqrt.approx, div.full/approx (__fdividef),
// ex2.approx (__expf, exp2f), lg2.approx (__log2f), sin/cos.approx.
#include "common.cuh"

extern "C" __global__ void f32_approx(const float* a, const float* b, float* out, int n) {
    int i = gid();
    if (i >= n) return;
    float x = a[i], y = b[i];
    float* o = out + i * 8;
    o[0] = rsqrtf(fabsf(x) + 0.5f);
    o[1] = __fdividef(x, y);
    o[2] = __expf(x * 0.125f);
    o[3] = exp2f(x * 0.25f);
    o[4] = __log2f(fabsf(x) + 1.0f);
    o[5] = __sinf(x * 0.1f);
    o[6] = __cosf(x * 0.1f);
    o[7] = __frsqrt_rn(fabsf(x) + 0.5f);
}
