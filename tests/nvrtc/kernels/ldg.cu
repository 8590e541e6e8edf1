// Read-only and cache-hinted global loads and stores: __ldg (ld.global.nc),
// const __restrict__, __ldcg/__ldcs/__ldca/__ldlu/__ldcv and __stcg/__stcs/__stwt.
#include "common.cuh"

extern "C" __global__ void ldg_loads(const int* __restrict__ a, const float4* __restrict__ b, const u64* c, int* out, float4* out4, u64* out64, int n) {
    int i = gid();
    if (i >= n) return;
    int x = __ldg(&a[i]);
    float4 v = __ldg(&b[i]);
    u64 w = __ldg(&c[i]);
    int y = __ldcg(&a[(i + 1) % n]) + __ldcs(&a[(i + 2) % n]) + __ldca(&a[(i + 3) % n]) + __ldlu(&a[(i + 4) % n]) + __ldcv(&a[(i + 5) % n]);
    __stcg(&out[i * 2], x * 3);
    __stcs(&out[i * 2 + 1], y);
    __stwt(&out4[i], make_float4(v.w, v.z, v.y, v.x));
    out64[i] = w ^ ((u64)a[i] << 32);
}
