"""pynvml (nvidia-ml-py) against the vGPU's libnvidia-ml.so.1: the queries
monitoring tools make, answered for the tenant's one GPU. Prints one JSON
object; the test checks it against the tenant and the metrics."""
import json
import sys

import pynvml

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
    processes=len(pynvml.nvmlDeviceGetComputeRunningProcesses(h)),
)
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
