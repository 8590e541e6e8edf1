// Full-precision libdevice f32 functions: sinf/cosf (whose argument
// reduction uses a .local array and a .global table), expf, logf, tanhf, powf.
#include "common.cuh"

extern "C" __global__ void f32_libm(const float* a, float* out, int n) {
    int i = gid();
    if (i >= n) return;
    float x = a[i];
    float* o = out + i * 7;
    o[0] = sinf(x);
    o[1] = cosf(x);
    float s, c;
    sincosf(x * 0.5f, &s, &c);
    o[2] = s + c;
    float m = fminf(fabsf(x), 80.0f);
    o[3] = expf(m * 0.5f);
    o[4] = logf(fabsf(x) + 1.0f);
    o[5] = tanhf(x * 1e-3f);
    o[6] = powf(fminf(fabsf(x), 100.0f) + 1.0f, 1.5f);
}
