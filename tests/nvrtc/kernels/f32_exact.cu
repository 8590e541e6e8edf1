// f32 operations the PTX ISA defines as correctly rounded (add, sub, mul,
// div.rn, fma.rn, sqrt.rn, rcp.rn) and exact ones (min, max, abs, neg,
// copysign, saturate, testp, rounding to integral values).
#include "common.cuh"

extern "C" __global__ void f32_arith(const float* a, const float* b, const float* c, float* out, int n) {
    int i = gid();
    if (i >= n) return;
    float x = a[i], y = b[i], z = c[i];
    float* o = out + i * 16;
    o[0] = x + y;
    o[1] = x - y;
    o[2] = x * y;
    o[3] = x / y;
    o[4] = fmaf(x, y, z);
    o[5] = sqrtf(fabsf(x));
    o[6] = 1.0f / y;
    o[7] = fminf(x, y);
    o[8] = fmaxf(x, y);
    o[9] = fabsf(x) + (-y);
    o[10] = copysignf(x, y);
    o[11] = __saturatef(x);
    o[12] = floorf(x);
    o[13] = ceilf(x);
    o[14] = truncf(x);
    o[15] = rintf(x);
}

// isnan/isinf/isfinite/signbit of each input and the testp classes, as bits of one word.
extern "C" __global__ void f32_classify(const float* a, u32* out, int n) {
    int i = gid();
    if (i >= n) return;
    float x = a[i];
    u32 r = (isnan(x) ? 1u : 0u) | (isinf(x) ? 2u : 0u) | (isfinite(x) ? 4u : 0u) | (signbit(x) ? 8u : 0u);
    u32 p;
    asm("{ .reg .pred q; testp.subnormal.f32 q, %1; selp.u32 %0, 16, 0, q; }" : "=r"(p) : "f"(x));
    r |= p;
    asm("{ .reg .pred q; testp.normal.f32 q, %1; selp.u32 %0, 32, 0, q; }" : "=r"(p) : "f"(x));
    r |= p;
    asm("{ .reg .pred q; testp.finite.f32 q, %1; selp.u32 %0, 64, 0, q; }" : "=r"(p) : "f"(x));
    r |= p;
    asm("{ .reg .pred q; testp.infinite.f32 q, %1; selp.u32 %0, 128, 0, q; }" : "=r"(p) : "f"(x));
    r |= p;
    asm("{ .reg .pred q; testp.number.f32 q, %1; selp.u32 %0, 256, 0, q; }" : "=r"(p) : "f"(x));
    r |= p;
    asm("{ .reg .pred q; testp.notanumber.f64 q, %1; selp.u32 %0, 512, 0, q; }" : "=r"(p) : "d"((double)x));
    out[i] = r | p;
}
