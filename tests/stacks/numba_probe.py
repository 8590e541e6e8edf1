"""numba-cuda kernels on the vGPU, as a user writes them: elementwise,
shared memory, atomics, cuda.reduce, and the quota as device memory.
Prints "ok <check>" per check; exits 1 if any fails.

Usage: numba_probe.py QUOTA_BYTES
"""
import sys
import warnings

import numpy as np
from numba import cuda, float32

warnings.simplefilter("ignore")
quota = int(sys.argv[1])
failed = []


def check(ok, name):
    print(("ok " if ok else "FAIL ") + name, flush=True)
    if not ok:
        failed.append(name)


def _version(dist):
    import importlib.metadata
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "absent"


print("numba-cuda", _version("numba-cuda"), "on cuda-bindings", _version("cuda-bindings"), flush=True)


@cuda.jit
def scale_add(a, x, y, out):
    i = cuda.grid(1)
    if i < x.size:
        out[i] = a * x[i] + y[i]


@cuda.jit
def tile_sums(x, out):
    tile = cuda.shared.array(128, dtype=float32)
    t = cuda.threadIdx.x
    i = cuda.grid(1)
    tile[t] = x[i] if i < x.size else 0.0
    cuda.syncthreads()
    step = 64
    while step > 0:
        if t < step:
            tile[t] += tile[t + step]
        cuda.syncthreads()
        step //= 2
    if t == 0:
        out[cuda.blockIdx.x] = tile[0]


@cuda.jit
def count_residues(x, bins):
    i = cuda.grid(1)
    if i < x.size:
        cuda.atomic.add(bins, x[i] % bins.size, 1)


check(cuda.is_available() and len(cuda.gpus) == 1, "one device")
n = 5000
x = np.linspace(0, 1, n).astype(np.float32)
y = np.full(n, 3, dtype=np.float32)
out = cuda.device_array(n, dtype=np.float32)
scale_add[(n + 127) // 128, 128](np.float32(2.5), cuda.to_device(x), cuda.to_device(y), out)
check(np.allclose(out.copy_to_host(), 2.5 * x + y), "elementwise kernel")

m = 64 * 128
v = np.random.default_rng(7).random(m).astype(np.float32)
sums = cuda.device_array(64, dtype=np.float32)
tile_sums[64, 128](cuda.to_device(v), sums)
check(np.allclose(sums.copy_to_host(), v.reshape(64, 128).sum(axis=1), rtol=1e-5), "shared memory and syncthreads")

k = np.arange(m, dtype=np.int32)
bins = cuda.to_device(np.zeros(32, dtype=np.int32))
count_residues[64, 128](cuda.to_device(k), bins)
check((bins.copy_to_host() == m // 32).all(), "atomics")

total = cuda.reduce(lambda a, b: a + b)(np.arange(100000, dtype=np.float64))
check(total == 4999950000.0, "cuda.reduce")
biggest = cuda.reduce(lambda a, b: max(a, b))(np.array([3.0, -1.0, 42.5, 7.0]))
check(biggest == 42.5, "cuda.reduce with max")

free, total_mem = cuda.current_context().get_memory_info()
check(total_mem == quota and free <= quota, "memory info is the quota (%d of %d)" % (total_mem, quota))
try:
    cuda.device_array(quota + (1 << 20), dtype=np.uint8)
    check(False, "allocation past the quota fails")
except cuda.cudadrv.driver.CudaAPIError as e:
    check("OUT_OF_MEMORY" in str(e), "allocation past the quota fails (%s)" % e)

print("numba probe: %s" % ("%d FAILED" % len(failed) if failed else "all passed"))
sys.exit(1 if failed else 0)
