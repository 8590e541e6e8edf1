// The CUDA C++ WMMA API (mma.h): fragments loaded from row- and
// column-major matrices with leading dimensions wider than the tile,
// multiplied, and stored back, on f16 (f32 and f16 accumulators), bf16,
// tf32, s8 and f64. One warp each; A is MxK, B is KxN, C and D are MxN.
#include <mma.h>
#include <cuda_fp16.h>
#if __CUDA_ARCH__ >= 800
#include <cuda_bf16.h>
#endif
#include "common.cuh"
using namespace nvcuda;

// 16x16x16 f16 tiles out of larger matrices: A row-major with 24 columns,
// B column-major with 20 rows, C and D row-major with 16 columns.
extern "C" __global__ void wmma_f16(const __half* A, const __half* B, const float* C, float* D) {
#if __CUDA_ARCH__ >= 700
    wmma::fragment<wmma::matrix_a, 16, 16, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, __half, wmma::col_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::load_matrix_sync(a, A, 24);
    wmma::load_matrix_sync(b, B, 20);
    wmma::load_matrix_sync(acc, C, 16, wmma::mem_row_major);
    wmma::mma_sync(acc, a, b, acc);
    wmma::store_matrix_sync(D, acc, 16, wmma::mem_row_major);
#endif
}

// 32x8x16 with f16 accumulators, D stored column-major.
extern "C" __global__ void wmma_f16_acc(const __half* A, const __half* B, const __half* C, __half* D) {
#if __CUDA_ARCH__ >= 700
    wmma::fragment<wmma::matrix_a, 32, 8, 16, __half, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 32, 8, 16, __half, wmma::row_major> b;
    wmma::fragment<wmma::accumulator, 32, 8, 16, __half> acc;
    wmma::load_matrix_sync(a, A, 16);
    wmma::load_matrix_sync(b, B, 8);
    wmma::load_matrix_sync(acc, C, 8, wmma::mem_row_major);
    wmma::mma_sync(acc, a, b, acc);
    wmma::store_matrix_sync(D, acc, 32, wmma::mem_col_major);
#endif
}

// 16x16x16 on signed 8-bit integers, s32 accumulators.
extern "C" __global__ void wmma_s8(const signed char* A, const signed char* B, const int* C, int* D) {
#if __CUDA_ARCH__ >= 720
    wmma::fragment<wmma::matrix_a, 16, 16, 16, signed char, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 16, 16, 16, signed char, wmma::row_major> b;
    wmma::fragment<wmma::accumulator, 16, 16, 16, int> acc;
    wmma::load_matrix_sync(a, A, 16);
    wmma::load_matrix_sync(b, B, 16);
    wmma::load_matrix_sync(acc, C, 16, wmma::mem_row_major);
    wmma::mma_sync(acc, a, b, acc);
    wmma::store_matrix_sync(D, acc, 16, wmma::mem_row_major);
#endif
}

// bf16 (16x16x16) and tf32 (16x16x8) with f32 accumulators from zero.
extern "C" __global__ void wmma_bf16_tf32(const unsigned short* A, const unsigned short* B, const float* At, const float* Bt, float* D, float* Dt) {
#if __CUDA_ARCH__ >= 800
    {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::row_major> b;
        wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
        wmma::fill_fragment(acc, 0.0f);
        wmma::load_matrix_sync(a, (const __nv_bfloat16*)A, 16);
        wmma::load_matrix_sync(b, (const __nv_bfloat16*)B, 16);
        wmma::mma_sync(acc, a, b, acc);
        wmma::store_matrix_sync(D, acc, 16, wmma::mem_row_major);
    }
    {
        wmma::fragment<wmma::matrix_a, 16, 16, 8, wmma::precision::tf32, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 8, wmma::precision::tf32, wmma::col_major> b;
        wmma::fragment<wmma::accumulator, 16, 16, 8, float> acc;
        wmma::fill_fragment(acc, 0.0f);
        wmma::load_matrix_sync(a, At, 8);
        wmma::load_matrix_sync(b, Bt, 8);
        for (int i = 0; i < a.num_elements; i++) a.x[i] = wmma::__float_to_tf32(a.x[i]);
        for (int i = 0; i < b.num_elements; i++) b.x[i] = wmma::__float_to_tf32(b.x[i]);
        wmma::mma_sync(acc, a, b, acc);
        wmma::store_matrix_sync(Dt, acc, 16, wmma::mem_row_major);
    }
#endif
}

// 8x8x4 on doubles.
extern "C" __global__ void wmma_f64(const double* A, const double* B, const double* C, double* D) {
#if __CUDA_ARCH__ >= 800
    wmma::fragment<wmma::matrix_a, 8, 8, 4, double, wmma::row_major> a;
    wmma::fragment<wmma::matrix_b, 8, 8, 4, double, wmma::row_major> b;
    wmma::fragment<wmma::accumulator, 8, 8, 4, double> acc;
    wmma::load_matrix_sync(a, A, 4);
    wmma::load_matrix_sync(b, B, 8);
    wmma::load_matrix_sync(acc, C, 8, wmma::mem_row_major);
    wmma::mma_sync(acc, a, b, acc);
    wmma::store_matrix_sync(D, acc, 8, wmma::mem_row_major);
#endif
}
