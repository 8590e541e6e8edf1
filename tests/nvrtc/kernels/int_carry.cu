// Extended precision through the carry flag: add.cc/addc, sub.cc/subc,
// mad.lo.cc/madc.hi.
#include "common.cuh"

extern "C" __global__ void carry128(const uint4* a, const uint4* b, uint4* sum, uint4* diff, int n) {
    int i = gid();
    if (i >= n) return;
    uint4 x = a[i], y = b[i], s, d;
    asm("add.cc.u32 %0, %4, %8;\n\t"
        "addc.cc.u32 %1, %5, %9;\n\t"
        "addc.cc.u32 %2, %6, %10;\n\t"
        "addc.u32 %3, %7, %11;"
        : "=r"(s.x), "=r"(s.y), "=r"(s.z), "=r"(s.w)
        : "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w), "r"(y.x), "r"(y.y), "r"(y.z), "r"(y.w));
    asm("sub.cc.u32 %0, %4, %8;\n\t"
        "subc.cc.u32 %1, %5, %9;\n\t"
        "subc.cc.u32 %2, %6, %10;\n\t"
        "subc.u32 %3, %7, %11;"
        : "=r"(d.x), "=r"(d.y), "=r"(d.z), "=r"(d.w)
        : "r"(x.x), "r"(x.y), "r"(x.z), "r"(x.w), "r"(y.x), "r"(y.y), "r"(y.z), "r"(y.w));
    sum[i] = s;
    diff[i] = d;
}

// 128-bit sums of 64-bit limbs, and the full 64x64->128 product from
// 32-bit limbs.
extern "C" __global__ void carry64_mul(const u64* a, const u64* b, u64* out, int n) {
    int i = gid();
    if (i >= n) return;
    u64 x = a[i], y = b[i], lo, hi;
    asm("add.cc.u64 %0, %2, %3;\n\t"
        "addc.u64 %1, 0, 0;"
        : "=l"(lo), "=l"(hi) : "l"(x), "l"(y));
    out[i * 6 + 0] = lo;
    out[i * 6 + 1] = hi;
    u32 a0 = (u32)x, a1 = (u32)(x >> 32), b0 = (u32)y, b1 = (u32)(y >> 32);
    u32 r0, r1, r2, r3;
    asm("mul.lo.u32 %0, %4, %6;\n\t"
        "mul.hi.u32 %1, %4, %6;\n\t"
        "mad.lo.cc.u32 %1, %4, %7, %1;\n\t"
        "madc.hi.u32 %2, %4, %7, 0;\n\t"
        "mad.lo.cc.u32 %1, %5, %6, %1;\n\t"
        "madc.hi.cc.u32 %2, %5, %6, %2;\n\t"
        "madc.hi.u32 %3, %5, %7, 0;\n\t"
        "mad.lo.cc.u32 %2, %5, %7, %2;\n\t"
        "addc.u32 %3, %3, 0;"
        : "=&r"(r0), "=&r"(r1), "=&r"(r2), "=&r"(r3)
        : "r"(a0), "r"(a1), "r"(b0), "r"(b1));
    out[i * 6 + 2] = ((u64)r1 << 32) | r0;
    out[i * 6 + 3] = ((u64)r3 << 32) | r2;
    out[i * 6 + 4] = x * y;
    out[i * 6 + 5] = __umul64hi(x, y);
}
