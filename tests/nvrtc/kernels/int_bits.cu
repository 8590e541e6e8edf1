// Integer bit manipulation: brev, clz, popc, ffs, bfind, bfe, bfi, prmt
// (__byte_perm), shf (__funnelshift_*), lop3.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(128, 2) int_unary32(const u32* a, u32* out, int n) {
    int i = gid();
    if (i >= n) return;
    u32 x = a[i];
    u32* o = out + i * 8;
    u32 r;
    o[0] = __brev(x);
    o[1] = __clz((int)x);
    o[2] = __popc(x);
    o[3] = __ffs((int)x);
    asm("bfind.u32 %0, %1;" : "=r"(r) : "r"(x));
    o[4] = r;
    asm("bfind.s32 %0, %1;" : "=r"(r) : "r"(x));
    o[5] = r;
    asm("bfind.shiftamt.u32 %0, %1;" : "=r"(r) : "r"(x));
    o[6] = r;
    o[7] = ~x ^ (x >> 7);
}

extern "C" __global__ void int_unary64(const u64* a, u64* out, int n) {
    int i = gid();
    if (i >= n) return;
    u64 x = a[i];
    u64* o = out + i * 5;
    u32 r;
    o[0] = __brevll(x);
    o[1] = (u64)__clzll((i64)x);
    o[2] = (u64)__popcll(x);
    o[3] = (u64)__ffsll((i64)x);
    asm("bfind.u64 %0, %1;" : "=r"(r) : "l"(x));
    o[4] = r;
}

// Operands a, b, c per element; out gets 12 words per element.
extern "C" __global__ void int_bitfield(const u32* a, const u32* b, const u32* c, u32* out, int n) {
    int i = gid();
    if (i >= n) return;
    u32 x = a[i], y = b[i], z = c[i];
    u32* o = out + i * 12;
    u32 pos = z & 31, len = (z >> 8) & 31, r;
    asm("bfe.u32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(pos), "r"(len));
    o[0] = r;
    asm("bfe.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(pos), "r"(len));
    o[1] = r;
    asm("bfi.b32 %0, %1, %2, %3, %4;" : "=r"(r) : "r"(x), "r"(y), "r"(pos), "r"(len));
    o[2] = r;
    o[3] = __byte_perm(x, y, z & 0x7777);
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(x), "r"(y), "r"(z));
    o[4] = r;
    o[5] = __funnelshift_l(x, y, z);
    o[6] = __funnelshift_r(x, y, z);
    o[7] = __funnelshift_lc(x, y, z & 63);
    o[8] = __funnelshift_rc(x, y, z & 63);
    asm("lop3.b32 %0, %1, %2, %3, 0x96;" : "=r"(r) : "r"(x), "r"(y), "r"(z));
    o[9] = r;
    asm("lop3.b32 %0, %1, %2, %3, 0xE8;" : "=r"(r) : "r"(x), "r"(y), "r"(z));
    o[10] = r;
    // What the compiler makes of a three-input logic expression itself.
    o[11] = (x & ~y) | (y & z) ^ (~x & z);
}
