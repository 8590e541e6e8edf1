/* Shared helpers for the sample programs: error checks and PTX loading. */
#ifndef SAMPLES_COMMON_H
#define SAMPLES_COMMON_H

#include <cuda.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#ifndef KERNEL_DIR
#define KERNEL_DIR "samples/kernels"
#endif

#define CHECK(call)                                                                 \
    do {                                                                            \
        CUresult err_ = (call);                                                     \
        if (err_ != CUDA_SUCCESS) {                                                 \
            const char *name_ = NULL;                                               \
            cuGetErrorName(err_, &name_);                                           \
            fprintf(stderr, "%s:%d: %s failed: %s (%d)\n", __FILE__, __LINE__, #call, \
                    name_ ? name_ : "?", (int)err_);                                \
            exit(1);                                                                \
        }                                                                           \
    } while (0)

/* Reads kernels/<name> (or $VGPU_KERNEL_DIR/<name>) as a NUL-terminated string. */
static char *load_ptx(const char *name) {
    const char *dir = getenv("VGPU_KERNEL_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/%s", dir ? dir : KERNEL_DIR, name);
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "cannot open %s\n", path);
        exit(1);
    }
    fseek(f, 0, SEEK_END);
    long n = ftell(f);
    fseek(f, 0, SEEK_SET);
    char *buf = malloc((size_t)n + 1);
    if (!buf || fread(buf, 1, (size_t)n, f) != (size_t)n) {
        fprintf(stderr, "cannot read %s\n", path);
        exit(1);
    }
    buf[n] = 0;
    fclose(f);
    return buf;
}

#endif
