"""pynvml (nvidia-ml-py) against the vGPU's libnvidia-ml.so.1: the queries
monitoring tools make, answered for the tenant's one GPU. Prints one JSON
object; the test checks it against the tenant and the metrics.

With `hold MiB`, it only makes a CUDA context holding that much device
memory, prints "ready" and keeps it until its stdin closes."""
import ctypes
import json
import os
import sys

import pynvml


def hold(mib):
    """A context with `mib` MiB allocated in it, through the Driver API."""
    cuda = ctypes.CDLL("libcuda.so.1")
    dev, ctx, ptr = ctypes.c_int(), ctypes.c_void_p(), ctypes.c_uint64()
    for call in (lambda: cuda.cuInit(0), lambda: cuda.cuDeviceGet(ctypes.byref(dev), 0),
                 lambda: cuda.cuCtxCreate_v2(ctypes.byref(ctx), 0, dev),
                 lambda: cuda.cuMemAlloc_v2(ctypes.byref(ptr), ctypes.c_size_t(mib << 20))):
        rc = call()
        if rc != 0:
            sys.exit(f"CUDA call failed: {rc}")
    return cuda


if len(sys.argv) == 3 and sys.argv[1] == "hold":
    keep = hold(int(sys.argv[2]))
    print("ready", flush=True)
    sys.stdin.read()
    sys.exit(0)

pynvml.nvmlInit()
out = {
    "count": pynvml.nvmlDeviceGetCount(),
    "driver": pynvml.nvmlSystemGetDriverVersion(),
    "cuda": pynvml.nvmlSystemGetCudaDriverVersion(),
}
h = pynvml.nvmlDeviceGetHandleByIndex(0)
mem = pynvml.nvmlDeviceGetMemoryInfo(h)
util = pynvml.nvmlDeviceGetUtilizationRates(h)
out.update(
    name=pynvml.nvmlDeviceGetName(h),
    uuid=pynvml.nvmlDeviceGetUUID(h),
    total=mem.total,
    used=mem.used,
    free=mem.free,
    util=util.gpu,
    cc=list(pynvml.nvmlDeviceGetCudaComputeCapability(h)),
    processes_before=len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
)
# Once this process holds a context with 4 MiB in it, the list has it.
keep = hold(4)
out["self"] = os.getpid()
out["processes"] = [
    {"pid": p.pid, "used": p.usedGpuMemory, "name": pynvml.nvmlSystemGetProcessName(p.pid)}
    for p in pynvml.nvmlDeviceGetComputeRunningProcesses(h)
]
out["graphics"] = len(pynvml.nvmlDeviceGetGraphicsRunningProcesses(h))
same = pynvml.nvmlDeviceGetHandleByUUID(out["uuid"])
out["by_uuid"] = pynvml.nvmlDeviceGetName(same) == out["name"]
try:
    pynvml.nvmlDeviceGetTemperature(h, pynvml.NVML_TEMPERATURE_GPU)
    out["temperature"] = "answered"
except pynvml.NVMLError_NotSupported:
    out["temperature"] = "not supported"
try:
    pynvml.nvmlDeviceGetHandleByIndex(1)
    out["second"] = "exists"
except pynvml.NVMLError_InvalidArgument:
    out["second"] = "invalid argument"
pynvml.nvmlShutdown()
json.dump(out, sys.stdout)
print()
