// Explicit rounding modes: __fadd_r*, __fmul_r*, __fmaf_r*, __fdiv_r*,
// __fsqrt_r*, __frcp_r*, and conversions with rounding.
#include "common.cuh"

extern "C" __global__ void f32_rounding(const float* a, const float* b, const float* c, float* out, int n) {
    int i = gid();
    if (i >= n) return;
    float x = a[i], y = b[i], z = c[i];
    float* o = out + i * 16;
    o[0] = __fadd_rn(x, y);
    o[1] = __fadd_rz(x, y);
    o[2] = __fadd_ru(x, y);
    o[3] = __fadd_rd(x, y);
    o[4] = __fmul_rz(x, y);
    o[5] = __fmul_ru(x, y);
    o[6] = __fmul_rd(x, y);
    o[7] = __fmaf_rz(x, y, z);
    o[8] = __fmaf_ru(x, y, z);
    o[9] = __fmaf_rd(x, y, z);
    o[10] = __fdiv_rz(x, y);
    o[11] = __fdiv_ru(x, y);
    o[12] = __fsqrt_rd(fabsf(x));
    o[13] = __fsqrt_ru(fabsf(x));
    o[14] = __frcp_rz(y);
    o[15] = __fsub_ru(x, y);
}

extern "C" __global__ void f32_convert(const float* a, const double* d, const i32* k, const i64* l, u32* out, int n) {
    int i = gid();
    if (i >= n) return;
    float x = a[i];
    double w = d[i];
    i32 v = k[i];
    i64 lv = l[i];
    u32* o = out + i * 20;
    o[0] = (u32)__float2int_rn(x);
    o[1] = (u32)__float2int_rz(x);
    o[2] = (u32)__float2int_ru(x);
    o[3] = (u32)__float2int_rd(x);
    o[4] = __float2uint_rn(x);
    o[5] = __float2uint_rz(x);
    o[6] = __float_as_uint(__int2float_rn(v));
    o[7] = __float_as_uint(__int2float_rz(v));
    o[8] = __float_as_uint(__int2float_ru(v));
    o[9] = __float_as_uint(__uint2float_rd((u32)v));
    o[10] = __float_as_uint(__double2float_rn(w));
    o[11] = __float_as_uint(__double2float_rz(w));
    o[12] = __float_as_uint(__double2float_ru(w));
    o[13] = __float_as_uint(__double2float_rd(w));
    o[14] = (u32)__double2int_rz(w);
    o[15] = (u32)__double2int_rn(w);
    i64 q = __float2ll_rd(x);
    o[16] = (u32)q;
    o[17] = (u32)(q >> 32);
    o[18] = __float_as_uint(__ll2float_rz(lv));
    o[19] = __float_as_uint((float)v);
}
