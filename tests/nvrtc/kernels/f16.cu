// __half and __half2 arithmetic and conversions (cuda_fp16.h).
#include <cuda_fp16.h>
#include "common.cuh"

extern "C" __global__ void half_scalar(const __half* a, const __half* b, const __half* c, __half* out, int n) {
    int i = gid();
    if (i >= n) return;
    __half x = a[i], y = b[i], z = c[i];
    __half* o = out + i * 8;
    o[0] = __hadd(x, y);
    o[1] = __hsub(x, y);
    o[2] = __hmul(x, y);
    o[3] = __hfma(x, y, z);
    o[4] = __hneg(x);
    o[5] = __habs(y);
    o[6] = x * y + z;  // operators: two roundings
    o[7] = __hlt(x, y) ? x : z;
}

extern "C" __global__ void half_vec(const __half2* a, const __half2* b, const __half2* c, __half2* out, int n) {
    int i = gid();
    if (i >= n) return;
    __half2 x = a[i], y = b[i], z = c[i];
    __half2* o = out + i * 5;
    o[0] = __hadd2(x, y);
    o[1] = __hmul2(x, y);
    o[2] = __hfma2(x, y, z);
    o[3] = __hsub2(x, y);
    o[4] = __lowhigh2highlow(__halves2half2(__low2half(x), __high2half(y)));
}

extern "C" __global__ void half_convert(const float* f, const i32* k, u32* out, int n) {
    int i = gid();
    if (i >= n) return;
    float x = f[i];
    u32* o = out + i * 8;
    o[0] = __half_as_ushort(__float2half_rn(x));
    o[1] = __half_as_ushort(__float2half_rz(x));
    o[2] = __half_as_ushort(__float2half_ru(x));
    o[3] = __half_as_ushort(__float2half_rd(x));
    o[4] = __float_as_uint(__half2float(__float2half_rn(x)));
    o[5] = (u32)__half2int_rz(__float2half_rn(x));
    o[6] = __half_as_ushort(__int2half_rn(k[i]));
    __half2 h2 = __floats2half2_rn(x, -x * 0.5f);
    o[7] = *reinterpret_cast<u32*>(&h2);
}
