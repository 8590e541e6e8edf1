// __nv_bfloat16 and __nv_bfloat162 arithmetic and conversions (cuda_bf16.h).
#include <cuda_bf16.h>
#include "common.cuh"

extern "C" __global__ void bf16_scalar(const __nv_bfloat16* a, const __nv_bfloat16* b, const __nv_bfloat16* c, __nv_bfloat16* out, int n) {
    int i = gid();
    if (i >= n) return;
    __nv_bfloat16 x = a[i], y = b[i], z = c[i];
    __nv_bfloat16* o = out + i * 6;
    o[0] = __hadd(x, y);
    o[1] = __hsub(x, y);
    o[2] = __hmul(x, y);
#if __CUDA_ARCH__ >= 800
    o[3] = __hfma(x, y, z);
#else  // no bf16 __hfma before sm_80: the inputs keep the f32 fma exact
    o[3] = __float2bfloat16_rn(fmaf(__bfloat162float(x), __bfloat162float(y), __bfloat162float(z)));
#endif
    o[4] = __hneg(x);
    o[5] = __hmax(x, y);
}

extern "C" __global__ void bf16_vec(const __nv_bfloat162* a, const __nv_bfloat162* b, const __nv_bfloat162* c, __nv_bfloat162* out, int n) {
    int i = gid();
    if (i >= n) return;
    __nv_bfloat162 x = a[i], y = b[i], z = c[i];
    __nv_bfloat162* o = out + i * 3;
    o[0] = __hadd2(x, y);
    o[1] = __hmul2(x, y);
#if __CUDA_ARCH__ >= 800
    o[2] = __hfma2(x, y, z);
#else
    float2 fx = __bfloat1622float2(x), fy = __bfloat1622float2(y), fz = __bfloat1622float2(z);
    o[2] = __floats2bfloat162_rn(fmaf(fx.x, fy.x, fz.x), fmaf(fx.y, fy.y, fz.y));
#endif
}

extern "C" __global__ void bf16_convert(const float* f, u32* out, int n) {
    int i = gid();
    if (i >= n) return;
    float x = f[i];
    u32* o = out + i * 4;
    o[0] = __bfloat16_as_ushort(__float2bfloat16(x));
    o[1] = __bfloat16_as_ushort(__float2bfloat16_rz(x));
    o[2] = __float_as_uint(__bfloat162float(__float2bfloat16_rn(x)));
    __nv_bfloat162 p = __floats2bfloat162_rn(x, x * 3.0f);
    o[3] = *reinterpret_cast<u32*>(&p);
}
