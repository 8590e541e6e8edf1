// Integer arithmetic: mul24, mulhi, sad, dp4a/dp2a, min/max incl. relu, div/rem.
#include "common.cuh"

extern "C" __global__ void int_mul(const i32* a, const i32* b, const u32* c, u32* out, int n) {
    int i = gid();
    if (i >= n) return;
    i32 x = a[i], y = b[i];
    u32 z = c[i];
    u32* o = out + i * 10;
    o[0] = (u32)__mul24(x, y);
    o[1] = __umul24((u32)x, (u32)y);
    o[2] = (u32)__mulhi(x, y);
    o[3] = __umulhi((u32)x, (u32)y);
    i64 wx = ((i64)x << 20) ^ (i64)y, wy = ((i64)y << 25) + (i64)z;
    u64 hs = (u64)__mul64hi(wx, wy), hu = __umul64hi((u64)wx, (u64)wy);
    o[4] = (u32)hs;
    o[5] = (u32)(hs >> 32);
    o[6] = (u32)hu;
    o[7] = (u32)(hu >> 32);
    o[8] = __sad(x, y, z);
    o[9] = __usad((u32)x, (u32)y, z);
}

extern "C" __global__ void int_dot(const i32* a, const i32* b, const i32* c, i32* out, int n) {
    int i = gid();
    if (i >= n) return;
    i32 x = a[i], y = b[i], z = c[i];
    i32* o = out + i * 6;
    o[0] = __dp4a(x, y, z);
    o[1] = (i32)__dp4a((u32)x, (u32)y, (u32)z);
    o[2] = __dp2a_lo(x, y, z);
    o[3] = __dp2a_hi(x, y, z);
    o[4] = (i32)__dp2a_lo((u32)x, (u32)y, (u32)z);
    o[5] = (i32)__dp2a_hi((u32)x, (u32)y, (u32)z);
}

extern "C" __global__ void int_minmax(const i32* a, const i32* b, const i32* c, i32* out, int n) {
    int i = gid();
    if (i >= n) return;
    i32 x = a[i], y = b[i], z = c[i];
    i32* o = out + i * 10;
    o[0] = min(x, y);
    o[1] = max(x, y);
    o[2] = (i32)min((u32)x, (u32)y);
    o[3] = (i32)max((u32)x, (u32)y);
    o[4] = __vimax_s32_relu(x, y);
    o[5] = __vimin_s32_relu(x, y);
    o[6] = __vimax3_s32(x, y, z);
    o[7] = (i32)__vimin3_u32((u32)x, (u32)y, (u32)z);
    bool p;
    o[8] = __vibmax_s32(x, y, &p);
    o[9] = p;
}

// max.relu/min.relu on s32 via inline asm: sm_90 and newer.
extern "C" __global__ void int_relu_asm(const i32* a, const i32* b, i32* out, int n) {
#if __CUDA_ARCH__ >= 900
    int i = gid();
    if (i >= n) return;
    i32 r;
    asm("max.relu.s32 %0, %1, %2;" : "=r"(r) : "r"(a[i]), "r"(b[i]));
    out[i * 2] = r;
    asm("min.relu.s32 %0, %1, %2;" : "=r"(r) : "r"(a[i]), "r"(b[i]));
    out[i * 2 + 1] = r;
#endif
}

extern "C" __global__ void int_divrem(const i32* a, const i32* b, i64* out, int n) {
    int i = gid();
    if (i >= n) return;
    i32 x = a[i], y = b[i];
    i64* o = out + i * 8;
    o[0] = x / y;
    o[1] = x % y;
    o[2] = (u32)x / (u32)y;
    o[3] = (u32)x % (u32)y;
    i64 wx = (i64)x * 1000003 + y, wy = (i64)y * 7 - 3;
    o[4] = wx / wy;
    o[5] = wx % wy;
    o[6] = (i64)((u64)wx / (u64)wy);
    o[7] = (i64)(((u64)wx >> (y & 63)) ^ ((u64)wy << (x & 63)) ^ (u64)(wx >> (x & 63)));
}
