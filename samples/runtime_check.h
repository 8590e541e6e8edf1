/* The error check of the sample programs on NVIDIA's CUDA runtime
 * (libcudart): a failed call prints "FAIL file:line call: error" and ends
 * the program with status 1. */
#ifndef SAMPLES_RUNTIME_CHECK_H
#define SAMPLES_RUNTIME_CHECK_H

#include <cuda_runtime_api.h>
#include <stdio.h>
#include <stdlib.h>

#define CK(call)                                                                           \
    do {                                                                                   \
        cudaError_t e_ = (call);                                                           \
        if (e_ != cudaSuccess) {                                                           \
            printf("FAIL %s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorName(e_)); \
            exit(1);                                                                       \
        }                                                                                  \
    } while (0)

#endif
