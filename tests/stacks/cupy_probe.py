"""CuPy on the vGPU: array creation, elementwise arithmetic, sum/max
reductions (with CuPy's default accelerators: CUB's prebuilt kernels), a
RawKernel, .get(), the quota as device memory, and matrix products
through cuBLAS.
Prints "ok <check>" per check; exits 1 if any fails.

Usage: cupy_probe.py QUOTA_BYTES [--matmul | --matmul-refused]

--matmul checks cuBLAS's products against NumPy's (on a CPU device that
reports an architecture no library ships machine code for, cuBLAS runs
its forward-compatible PTX); --matmul-refused checks that a product fails
with cuBLAS's error where cuBLAS has only machine code for the device's
architecture, and that the process goes on.
"""
import importlib.metadata
import sys

import numpy as np
import cupy as cp

quota = int(sys.argv[1])
matmul = "--matmul" in sys.argv[2:]
matmul_refused = "--matmul-refused" in sys.argv[2:]
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


def close(got, want, tol):
    err = float(np.abs(np.asarray(got, dtype=np.complex128) - want).max())
    return err <= tol, err


rng = np.random.default_rng(7)
ma = rng.random((127, 65), dtype=np.float32) - 0.5
mb = rng.random((65, 93), dtype=np.float32) - 0.5
if matmul:
    want = ma.astype(np.float64) @ mb
    for dt, tol in ((np.float32, 1e-5), (np.float16, 2e-2), (np.float64, 1e-12)):
        a16, b16 = ma.astype(dt), mb.astype(dt)
        ok, err = close((cp.asarray(a16) @ cp.asarray(b16)).get(), a16.astype(np.float64) @ b16.astype(np.float64), tol)
        check(ok, "matmul %s 127x65 @ 65x93 (max error %.3g)" % (np.dtype(dt).name, err))
    x, y = rng.random((3, 40, 30)), rng.random((3, 30, 20))
    ok, err = close(cp.matmul(cp.asarray(x), cp.asarray(y)).get(), x @ y, 1e-12)
    check(ok, "batched matmul 3 x (40x30 @ 30x20) (max error %.3g)" % err)
    v = mb[:, 0].copy()
    ok, err = close((cp.asarray(ma) @ cp.asarray(v)).get(), ma.astype(np.float64) @ v, 1e-5)
    check(ok, "matrix-vector product (max error %.3g)" % err)
    ok, err = close(float(cp.asarray(v) @ cp.asarray(v)), float(v.astype(np.float64) @ v), 1e-5)
    check(ok, "dot product (max error %.3g)" % err)
    ca = (ma + 0.5j * ma[::-1]).astype(np.complex64)
    ok, err = close((cp.asarray(ca) @ cp.asarray(mb.astype(np.complex64))).get(), ca.astype(np.complex128) @ mb, 1e-4)
    check(ok, "complex64 matmul (max error %.3g)" % err)
elif matmul_refused:
    try:
        (cp.asarray(ma) @ cp.asarray(mb)).get()
        check(False, "a matmul cuBLAS has no kernel for fails clearly")
    except Exception as e:
        check("CUBLAS_STATUS_" in str(e), "a matmul cuBLAS has no kernel for fails clearly (%s: %s)" % (type(e).__name__, str(e).splitlines()[0][:80]))
    check((cp.arange(10).get() == np.arange(10)).all(), "the process goes on after the refused matmul")

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
