"""PyTorch on the CPU reference device, as far as its binaries allow.

PyTorch's own kernels ship as cubins (machine code for real GPUs) with no
PTX, so this device cannot run them. Everything that needs no kernel works:
initialisation and device queries, the caching allocator within the
tenant's quota (mem_get_info reports it; past it, OutOfMemoryError), copies
both ways, cuBLAS's initialisation. A kernel launch and a cuBLAS matmul
fail with a clear error, and the process goes on. Prints "ok <check>" per check; exits 1 if any fails.

Usage: torch_probe.py QUOTA_BYTES [--cublas-refused]
"""
import sys

import torch

quota = int(sys.argv[1])
# Where none of cuBLAS's start-up kernels can load (the test double of
# NVIDIA's driver refuses cubins, and cuBLAS's PTX is for compute 12.0),
# cuBLAS cannot start: then its refusal is what is checked.
cublas_refused = "--cublas-refused" in sys.argv[2:]
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
# kernels are cubins too, so a matmul is refused with cuBLAS's error.
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
