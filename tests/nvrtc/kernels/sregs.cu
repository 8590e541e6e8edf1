// Special registers: %laneid, %warpid, %nwarpid, %smid, %nsmid,
// %lanemask_*, %dynamic_smem_size, %total_smem_size, and the clocks
// (%clock, %clock64, %globaltimer) read twice around some work.
#include "common.cuh"

extern "C" __global__ void sregs(u32* out) {
    u32 r[12];
    asm("mov.u32 %0, %%laneid;" : "=r"(r[0]));
    asm("mov.u32 %0, %%warpid;" : "=r"(r[1]));
    asm("mov.u32 %0, %%nwarpid;" : "=r"(r[2]));
    asm("mov.u32 %0, %%smid;" : "=r"(r[3]));
    asm("mov.u32 %0, %%nsmid;" : "=r"(r[4]));
    asm("mov.u32 %0, %%lanemask_eq;" : "=r"(r[5]));
    asm("mov.u32 %0, %%lanemask_lt;" : "=r"(r[6]));
    asm("mov.u32 %0, %%lanemask_le;" : "=r"(r[7]));
    asm("mov.u32 %0, %%lanemask_gt;" : "=r"(r[8]));
    asm("mov.u32 %0, %%lanemask_ge;" : "=r"(r[9]));
    asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(r[10]));
    asm("mov.u32 %0, %%total_smem_size;" : "=r"(r[11]));
    u32* o = out + gid() * 12;
    for (int k = 0; k < 12; k++) o[k] = r[k];
}

extern "C" __global__ void timers(const int* in, u64* out, int iters) {
    u64 c0 = clock64(), g0, g1;
    u32 k0 = (u32)clock();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g0));
    int acc = 0;
    for (int k = 0; k < iters; k++) acc = acc * 31 + in[k & 15];
    u64 c1 = clock64();
    u32 k1 = (u32)clock();
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(g1));
    u64* o = out + gid() * 5;
    o[0] = c0;
    o[1] = c1;
    o[2] = g0;
    o[3] = g1;
    o[4] = ((u64)(k1 - k0) << 32) | (u32)acc;
}
