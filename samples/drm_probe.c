/*
 * drm_probe CAPSET [NODE]: asks the virtio-gpu render node which capsets it
 * offers, then tries CONTEXT_INIT with CAPSET as the first context ioctl.
 * Prints "capsets=0x..." and "context_init capset=N: ok" or ": <errno name>".
 * Used by the nested tests to show our capset works and a foreign one is
 * refused cleanly. Structures follow the Linux virtgpu_drm.h UAPI.
 */
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <unistd.h>

struct getparam { uint64_t param, value; };
struct set_param { uint64_t param, value; };
struct context_init { uint32_t num_params, pad; uint64_t ctx_set_params; };

#define IOWR_D(nr, type) _IOWR('d', 0x40 + (nr), type)
#define IOCTL_GETPARAM IOWR_D(0x03, struct getparam)
#define IOCTL_CONTEXT_INIT IOWR_D(0x0b, struct context_init)

int main(int argc, char **argv) {
    if (argc < 2) {
        fprintf(stderr, "usage: drm_probe CAPSET [NODE]\n");
        return 2;
    }
    const char *node = argc > 2 ? argv[2] : "/dev/dri/renderD128";
    int fd = open(node, O_RDWR | O_CLOEXEC);
    if (fd < 0) {
        fprintf(stderr, "drm_probe: %s: %s\n", node, strerror(errno));
        return 1;
    }
    uint64_t mask = 0;
    struct getparam gp = { 7 /* SUPPORTED_CAPSET_IDs */, (uint64_t)(uintptr_t)&mask };
    if (ioctl(fd, IOCTL_GETPARAM, &gp) == 0)
        printf("capsets=0x%llx\n", (unsigned long long)mask);
    unsigned capset = (unsigned)strtoul(argv[1], NULL, 0);
    struct set_param p[2] = { { 1 /* CAPSET_ID */, capset }, { 2 /* NUM_RINGS */, 1 } };
    struct context_init ci = { 2, 0, (uint64_t)(uintptr_t)p };
    if (ioctl(fd, IOCTL_CONTEXT_INIT, &ci) == 0)
        printf("context_init capset=%u: ok\n", capset);
    else
        printf("context_init capset=%u: %s\n", capset, errno == EINVAL ? "EINVAL" : strerror(errno));
    close(fd);
    return 0;
}
