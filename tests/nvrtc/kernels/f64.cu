// f64 arithmetic (correctly rounded ops and explicit rounding modes) and
// the libdevice f64 functions sin, cos, exp, log.
#include "common.cuh"

extern "C" __global__ void f64_arith(const double* a, const double* b, const double* c, double* out, int n) {
    int i = gid();
    if (i >= n) return;
    double x = a[i], y = b[i], z = c[i];
    double* o = out + i * 18;
    o[0] = x + y;
    o[1] = x - y;
    o[2] = x * y;
    o[3] = x / y;
    o[4] = fma(x, y, z);
    o[5] = sqrt(fabs(x));
    o[6] = 1.0 / y;
    o[7] = fmin(x, y);
    o[8] = fmax(x, y);
    o[9] = __dadd_rz(x, y);
    o[10] = __dadd_ru(x, y);
    o[11] = __dmul_rd(x, y);
    o[12] = __fma_ru(x, y, z);
    o[13] = __ddiv_rz(x, y);
    o[14] = __dsqrt_rd(fabs(x));
    o[15] = __drcp_ru(y);
    o[16] = (double)(float)x;  // cvt.rn.f32.f64 then cvt.f64.f32
    o[17] = floor(x) + copysign(1.0, y);
}

extern "C" __global__ void f64_libm(const double* a, double* out, int n) {
    int i = gid();
    if (i >= n) return;
    double x = a[i];
    double* o = out + i * 4;
    o[0] = sin(x);
    o[1] = cos(x);
    o[2] = exp(fmin(fabs(x), 700.0) * 0.5);
    o[3] = log(fabs(x) + 1.0);
}
