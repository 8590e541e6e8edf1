"""CuPy on the vGPU: array creation, elementwise arithmetic, sum/max
reductions (with CuPy's default accelerators: CUB's prebuilt kernels), a
RawKernel, .get(), and the quota as device memory.
Prints "ok <check>" per check; exits 1 if any fails.

Usage: cupy_probe.py QUOTA_BYTES
"""
import importlib.metadata
import sys

import numpy as np
import cupy as cp

quota = int(sys.argv[1])
failed = []


def _installed(dist):
    try:
        importlib.metadata.version(dist)
        return True
    except importlib.metadata.PackageNotFoundError:
        return False


def check(ok, name):
    print(("ok " if ok else "FAIL ") + name, flush=True)
    if not ok:
        failed.append(name)


print("cupy build:", next((d for d in ("cupy-cuda12x", "cupy-cuda13x") if _installed(d)), "unknown"), "runtime", cp.cuda.runtime.runtimeGetVersion(), flush=True)
check(cp.cuda.runtime.getDeviceCount() == 1, "one device")
a = cp.arange(1000, dtype=cp.float32)
check((a.get() == np.arange(1000, dtype=np.float32)).all(), "arange and .get()")
b = cp.sqrt(a * 4 + 1) - 1
check(np.allclose(b.get(), np.sqrt(np.arange(1000) * 4 + 1) - 1), "elementwise arithmetic")
check(float(a.sum()) == 499500.0, "sum")
check(float((a - 500).max()) == 499.0 and float(a.min()) == 0.0, "max and min")
big = cp.arange(200000, dtype=cp.float64)
check(float(big.sum()) == 19999900000.0 and float(big.max()) == 199999.0, "multi-block reductions of 200000 elements")
print("accelerators:", [a for a in cp._core.get_reduction_accelerators()] if hasattr(cp._core, "get_reduction_accelerators") else "default", flush=True)
m = cp.asarray(np.arange(12, dtype=np.int64).reshape(3, 4))
check((m.sum(axis=0).get() == np.arange(12).reshape(3, 4).sum(axis=0)).all(), "sum along an axis")

kernel = cp.RawKernel(r'''
extern "C" __global__ void affine(const float* x, float* y, float k, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] = k * x[i] + 1.0f;
}''', "affine")
y = cp.empty_like(a)
kernel((8,), (128,), (a, y, cp.float32(0.5), cp.int32(1000)))
check(np.allclose(y.get(), 0.5 * np.arange(1000) + 1), "RawKernel")

# A CUDA graph captured from a stream, replayed twice (kernels warmed up
# first: compiling is not stream work).
x = cp.arange(1000, dtype=cp.float32)
z = cp.zeros_like(x)
cp.multiply(x, 2, out=z)
z += 1
z.fill(0)
# The fill ran on the legacy default stream, which a non-blocking stream
# does not wait for: wait for it here.
cp.cuda.Device().synchronize()
s = cp.cuda.Stream(non_blocking=True)
with s:
    s.begin_capture()
    cp.multiply(x, 2, out=y)
    z += y
    graph = s.end_capture()
graph.launch(stream=s)
graph.launch(stream=s)
s.synchronize()
check(np.allclose(z.get(), 4 * np.arange(1000)), "CUDA graph capture and replay")

free, total = cp.cuda.runtime.memGetInfo()
check(total == quota and free <= quota, "memory info is the quota (%d of %d)" % (total, quota))
cp.get_default_memory_pool().free_all_blocks()
try:
    cp.empty(quota + (1 << 20), dtype=cp.uint8)
    check(False, "allocation past the quota fails")
except cp.cuda.memory.OutOfMemoryError as e:
    check(True, "allocation past the quota fails (%s)" % str(e).splitlines()[0])

print("cupy probe: %s" % ("%d FAILED" % len(failed) if failed else "all passed"))
sys.exit(1 if failed else 0)
