"""PyTorch on the CPU reference device, as far as its binaries allow.

PyTorch's own kernels ship as cubins (machine code for real GPUs) with no
PTX, so this device cannot run them. Everything that needs no kernel works:
initialisation and device queries, the caching allocator within the
tenant's quota (mem_get_info reports it; past it, OutOfMemoryError), copies
both ways, cuBLAS's initialisation. A kernel launch and a cuBLAS matmul
fail with a clear error, and the process goes on; with --matmul (a device
reporting an architecture no library ships machine code for), cuBLAS's
products run instead and are checked against the host's. Prints
"ok <check>" per check; exits 1 if any fails.

Usage: torch_probe.py QUOTA_BYTES [--cublas-refused | --matmul]
"""
import sys

import torch

quota = int(sys.argv[1])
# Where none of cuBLAS's start-up kernels can load (the test double of
# NVIDIA's driver refuses cubins, and cuBLAS's PTX is for compute 12.0),
# cuBLAS cannot start: then its refusal is what is checked.
cublas_refused = "--cublas-refused" in sys.argv[2:]
# On a CPU device that reports an architecture no library ships machine
# code for, cuBLAS takes its forward-compatible PTX kernels: then its
# products run and are checked (docs/cuda-stacks.md).
matmul = "--matmul" in sys.argv[2:]
failed = []


def check(ok, name):
    print(("ok " if ok else "FAIL ") + name, flush=True)
    if not ok:
        failed.append(name)


print("torch", torch.__version__, "built for CUDA", torch.version.cuda, flush=True)
check(torch.cuda.is_available(), "torch.cuda.is_available()")
check(torch.cuda.device_count() == 1, "one device")
name = torch.cuda.get_device_name(0)
props = torch.cuda.get_device_properties(0)
check(bool(name) and props.total_memory == quota, "device name and total memory (%s, %d bytes)" % (name, props.total_memory))
free, total = torch.cuda.mem_get_info()
check(total == quota and 0 < free <= quota, "mem_get_info is the quota (%d of %d)" % (free, total))

x = torch.arange(4096, dtype=torch.float32)
g = x.to("cuda")
check(g.is_cuda and bool((g.cpu() == x).all()), "host to device and back")
h = torch.empty(4096, dtype=torch.float32, device="cuda")
h.copy_(g)
check(bool((h.cpu() == x).all()), "device to device copy")
pinned = x.pin_memory()
check(bool((pinned.to("cuda", non_blocking=True).cpu() == x).all()), "copy from pinned memory")
check(torch.cuda.memory_allocated() >= 2 * 4096 * 4, "the caching allocator counts its blocks (%d bytes)" % torch.cuda.memory_allocated())

try:
    torch.empty(quota + (1 << 20), dtype=torch.uint8, device="cuda")
    check(False, "allocation past the quota raises OutOfMemoryError")
except torch.cuda.OutOfMemoryError as e:
    check(True, "allocation past the quota raises OutOfMemoryError (%s)" % str(e).splitlines()[0][:80])

try:
    (g * 2).cpu()
    check(False, "a kernel without PTX fails clearly")
except Exception as e:
    msg = str(e).splitlines()[0]
    check("no kernel image is available" in msg, "a kernel without PTX fails clearly (%s: %s)" % (type(e).__name__, msg))

# cuBLAS starts through this driver: cublasCreate loads its kernel
# libraries, reads its constants, resolves the driver entry points it
# looks up by name and its private tables (docs/cuda-stacks.md). Its GEMM
# kernels for the device's architecture are cubins too, so a matmul is
# refused with cuBLAS's error (unless --matmul, above).
if cublas_refused:
    try:
        torch.cuda.current_blas_handle()
        check(False, "cublasCreate is refused clearly")
    except Exception as e:
        msg = str(e).splitlines()[0]
        check("CUBLAS_STATUS_NOT_INITIALIZED" in msg, "cublasCreate is refused clearly (%s: %s)" % (type(e).__name__, msg[:100]))
else:
    try:
        check(torch.cuda.current_blas_handle() != 0, "cuBLAS initialises (cublasCreate)")
    except Exception as e:
        check(False, "cuBLAS initialises (cublasCreate) (%s: %s)" % (type(e).__name__, str(e).splitlines()[0]))
if matmul:
    # cuBLAS's forward-compatible PTX kernels, on a device reporting an
    # architecture no library ships machine code for: each product is
    # checked against the same product in float64 on the host.
    torch.manual_seed(0)
    a, b, bias = torch.randn(40, 24), torch.randn(24, 16), torch.randn(16)

    def product(name, run, want, tol):
        try:
            got = run().cpu().double()
            err = (got - want).abs().max().item()
            check(err <= tol, "%s (max error %.3g)" % (name, err))
        except Exception as e:
            check(False, "%s (%s: %s)" % (name, type(e).__name__, str(e).splitlines()[0][:100]))

    for dt, tol in ((torch.float32, 1e-5), (torch.float16, 2e-2), (torch.bfloat16, 0.1), (torch.float64, 1e-12)):
        ta, tb = a.to(dt), b.to(dt)
        product("matmul %s 40x24 @ 24x16" % str(dt).split(".")[1], lambda: ta.cuda() @ tb.cuda(), ta.double() @ tb.double(), tol)
    product("addmm with a bias (a Linear layer's forward)", lambda: torch.addmm(bias.cuda(), a.cuda(), b.cuda()), bias.double() + a.double() @ b.double(), 1e-5)
    p, q = torch.randn(3, 10, 8), torch.randn(3, 8, 6)
    product("bmm 3 x (10x8 @ 8x6)", lambda: torch.bmm(p.cuda(), q.cuda()), p.double() @ q.double(), 1e-5)
    f8a, f8b = torch.randn(32, 64).to(torch.float8_e4m3fn), torch.randn(32, 64).to(torch.float8_e4m3fn)
    one = torch.tensor(1.0)
    product("_scaled_mm float8_e4m3fn", lambda: torch._scaled_mm(f8a.cuda(), f8b.cuda().t(), scale_a=one.cuda(), scale_b=one.cuda(), out_dtype=torch.float32), f8a.double() @ f8b.double().t(), 1e-4)
else:
    a = torch.ones(32, 64).cuda()
    b = torch.ones(64, 16).cuda()
    try:
        (a @ b).cpu()
        check(False, "a cuBLAS matmul without PTX fails clearly")
    except Exception as e:
        msg = str(e).splitlines()[0]
        check("CUBLAS_STATUS_" in msg, "a cuBLAS matmul without PTX fails clearly (%s: %s)" % (type(e).__name__, msg[:100]))

# The process is still usable after the refused launch: no crash, no hang.
try:
    again = g.cpu()
    check(bool((again == x).all()), "copies still work after the refused launch")
except Exception as e:
    check(False, "copies still work after the refused launch (%s)" % str(e).splitlines()[0])

print("torch probe: %s" % ("%d FAILED" % len(failed) if failed else "all passed"))
sys.exit(1 if failed else 0)
