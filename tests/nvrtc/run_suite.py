#!/usr/bin/env python3
"""Runs the NVRTC suite: every kernel of tests/nvrtc/kernels/*.cu, compiled
to PTX by scripts/nvrtc-compile.py, through a CUDA Driver API library
(our libcuda.so.1, or NVIDIA's) with ctypes, each checked against a host
reference computed here.

    python3 tests/nvrtc/run_suite.py [--lib PATH] [--ptx-dir DIR] [--arch compute_XX] [--only REGEX] [--list]

--lib      the driver library (default $VGPU_LIBCUDA, else target/release/libcuda.so.1);
           our shim reaches its device through $VGPU_SOCKET as usual.
--ptx-dir  where nvrtc-compile.py wrote compute_XX/*.ptx (default $NVRTC_PTX_DIR, else target/nvrtc).
--arch     use this arch's PTX whatever the device's compute capability says
           (default: the newest arch <= the device's capability).
--only     run only cases whose name (file.case) matches the regex (repeatable).

Prints `PASS name`, `FAIL name: why` or `SKIP name: why` for each case, then
a summary ending in `N passed, N failed, N skipped`; exits 1 if any case failed.
A case whose PTX needs a newer arch than the chosen one is skipped. A module
that fails to load fails each of its cases with the CUresult and the JIT log.
The whole run stops after $NVRTC_SUITE_TIMEOUT seconds (default 900).
"""

import argparse
import ctypes
import faulthandler
import os
import re
import struct
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree

import cases as suite  # noqa: E402

ARCHS = {"compute_70": 70, "compute_80": 80, "compute_90": 90}

ERRORS = {
    1: "CUDA_ERROR_INVALID_VALUE", 2: "CUDA_ERROR_OUT_OF_MEMORY", 3: "CUDA_ERROR_NOT_INITIALIZED",
    100: "CUDA_ERROR_NO_DEVICE", 200: "CUDA_ERROR_INVALID_IMAGE", 201: "CUDA_ERROR_INVALID_CONTEXT",
    209: "CUDA_ERROR_NO_BINARY_FOR_GPU", 218: "CUDA_ERROR_INVALID_PTX", 222: "CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
    300: "CUDA_ERROR_INVALID_SOURCE", 400: "CUDA_ERROR_INVALID_HANDLE", 500: "CUDA_ERROR_NOT_FOUND",
    700: "CUDA_ERROR_ILLEGAL_ADDRESS", 701: "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES", 702: "CUDA_ERROR_LAUNCH_TIMEOUT",
    710: "CUDA_ERROR_ASSERT", 715: "CUDA_ERROR_ILLEGAL_INSTRUCTION", 716: "CUDA_ERROR_MISALIGNED_ADDRESS",
    719: "CUDA_ERROR_LAUNCH_FAILED", 720: "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE", 801: "CUDA_ERROR_NOT_SUPPORTED",
    999: "CUDA_ERROR_UNKNOWN",
}

CUdeviceptr = ctypes.c_uint64
P, I, U, S = ctypes.c_void_p, ctypes.c_int, ctypes.c_uint, ctypes.c_size_t
SIGNATURES = {
    "cuInit": [U],
    "cuDeviceGet": [ctypes.POINTER(I), I],
    "cuDeviceGetAttribute": [ctypes.POINTER(I), I, I],
    "cuDeviceGetName": [ctypes.c_char_p, I, I],
    "cuCtxCreate_v2": [ctypes.POINTER(P), U, I],
    "cuCtxDestroy_v2": [P],
    "cuCtxSynchronize": [],
    "cuModuleLoadData": [ctypes.POINTER(P), ctypes.c_char_p],
    "cuModuleLoadDataEx": [ctypes.POINTER(P), ctypes.c_char_p, U, ctypes.POINTER(I), ctypes.POINTER(P)],
    "cuModuleUnload": [P],
    "cuModuleGetFunction": [ctypes.POINTER(P), P, ctypes.c_char_p],
    "cuModuleGetGlobal_v2": [ctypes.POINTER(CUdeviceptr), ctypes.POINTER(S), P, ctypes.c_char_p],
    "cuMemAlloc_v2": [ctypes.POINTER(CUdeviceptr), S],
    "cuMemFree_v2": [CUdeviceptr],
    "cuMemcpyHtoD_v2": [CUdeviceptr, P, S],
    "cuMemcpyDtoH_v2": [P, CUdeviceptr, S],
    "cuMemsetD8_v2": [CUdeviceptr, ctypes.c_ubyte, S],
    "cuLaunchKernel": [P, U, U, U, U, U, U, U, P, ctypes.POINTER(P), ctypes.POINTER(P)],
    "cuGetErrorName": [I, ctypes.POINTER(ctypes.c_char_p)],
}
CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 5, 6


class CudaError(Exception):
    def __init__(self, call, code, detail=""):
        self.call, self.code, self.detail = call, code, detail
        super().__init__(f"{call}: {ERRORS.get(code, 'CUresult')} ({code}){': ' + detail if detail else ''}")


class CheckFailed(Exception):
    def __init__(self, detail, what=None):
        super().__init__(f"{what}: {detail}" if what else detail)
        self.what, self.detail = what, detail


class Driver:
    def __init__(self, path):
        self.lib = ctypes.CDLL(path)
        self.fns = {}
        for name, args in SIGNATURES.items():
            f = getattr(self.lib, name, None)
            if f is not None:
                f.argtypes, f.restype = args, ctypes.c_int
                self.fns[name] = f

    def has(self, name):
        return name in self.fns

    def __call__(self, name, *args, detail=""):
        f = self.fns.get(name)
        if f is None:
            raise CudaError(name, 999, f"{name} is not exported by the driver library")
        r = f(*args)
        if r != 0:
            raise CudaError(name, r, detail)

    def error_name(self, code):
        s = ctypes.c_char_p()
        if self.has("cuGetErrorName") and self.fns["cuGetErrorName"](code, ctypes.byref(s)) == 0 and s.value:
            return s.value.decode()
        return ERRORS.get(code, "?")


class Module:
    """A loaded PTX module; load() returns None or the load error text."""

    def __init__(self, drv, ptx):
        self.drv, self.ptx, self.handle, self.funcs = drv, ptx, None, {}

    def load(self):
        h = P()
        if self.drv.has("cuModuleLoadDataEx"):
            log = ctypes.create_string_buffer(16384)
            opts = (I * 2)(CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES)
            vals = (P * 2)(ctypes.cast(log, P), P(len(log)))
            r = self.drv.fns["cuModuleLoadDataEx"](ctypes.byref(h), self.ptx, 2, opts, vals)
            text = log.value.decode(errors="replace").strip()
        else:
            r = self.drv.fns["cuModuleLoadData"](ctypes.byref(h), self.ptx)
            text = ""
        if r != 0:
            return f"module load: {self.drv.error_name(r)} ({r}){': ' + text if text else ''}"
        self.handle = h
        return None

    def unload(self):
        if self.handle:
            try:
                self.drv("cuModuleUnload", self.handle)
            except CudaError:
                pass
            self.handle = None

    def function(self, name):
        if name not in self.funcs:
            f = P()
            self.drv("cuModuleGetFunction", ctypes.byref(f), self.handle, name.encode(), detail=name)
            self.funcs[name] = f
        return self.funcs[name]

    def global_(self, name):
        ptr, size = CUdeviceptr(), S()
        self.drv("cuModuleGetGlobal_v2", ctypes.byref(ptr), ctypes.byref(size), self.handle, name.encode(), detail=name)
        return ptr.value, size.value


# Kernel parameter helpers for the cases.
def ptr(v):
    return ctypes.c_uint64(v)


def i32(v):
    return ctypes.c_int32(v)


def u32(v):
    return ctypes.c_uint32(v)


def u64(v):
    return ctypes.c_uint64(v)


def f32(v):
    return ctypes.c_float(v)


class T:
    """What a case sees: its module, allocations, launches and checks."""

    ptr, i32, u32, u64, f32 = staticmethod(ptr), staticmethod(i32), staticmethod(u32), staticmethod(u64), staticmethod(f32)

    def __init__(self, drv, module, arch, load_module):
        self.drv, self.mod, self.arch = drv, module, arch
        self._load_module = load_module
        self.allocs, self.extra_modules = [], []
        self.checks, self.failures = 0, []

    # memory
    def alloc(self, nbytes, fill=0):
        p = CUdeviceptr()
        self.drv("cuMemAlloc_v2", ctypes.byref(p), max(nbytes, 1))
        self.allocs.append(p.value)
        self.drv("cuMemsetD8_v2", p.value, fill, max(nbytes, 1))
        return p.value

    def upload(self, fmt, values):
        data = struct.pack("<%d%s" % (len(values), fmt), *values)
        p = self.alloc(len(data))
        self.htod(p, data)
        return p

    def zeros(self, fmt, count, fill=0):
        return self.alloc(struct.calcsize("<" + fmt) * count, fill)

    def htod(self, p, data):
        buf = ctypes.create_string_buffer(data, len(data))
        self.drv("cuMemcpyHtoD_v2", p, ctypes.cast(buf, P), len(data))

    def read(self, p, fmt, count):
        n = struct.calcsize("<" + fmt) * count
        buf = ctypes.create_string_buffer(n)
        self.drv("cuMemcpyDtoH_v2", ctypes.cast(buf, P), p, n)
        return list(struct.unpack("<%d%s" % (count, fmt), buf.raw))

    def global_(self, name, mod=None):
        return (mod or self.mod).global_(name)

    def write_global(self, name, fmt, values, mod=None):
        p, size = self.global_(name, mod)
        data = struct.pack("<%d%s" % (len(values), fmt), *values)
        if len(data) > size:
            raise CheckFailed(f"{name} is {size} bytes, wanted room for {len(data)}")
        self.htod(p, data)
        return p, size

    def read_global(self, name, fmt, count, mod=None):
        p, _ = self.global_(name, mod)
        return self.read(p, fmt, count)

    def another_module(self):
        """A second instance of this case's module (its own globals)."""
        m = self._load_module()
        self.extra_modules.append(m)
        return m

    # launches
    def launch(self, kernel, grid, block, params, shared=0, mod=None, sync=True):
        grid = tuple(grid) + (1,) * (3 - len(grid))
        block = tuple(block) + (1,) * (3 - len(block))
        f = (mod or self.mod).function(kernel)
        arr = (P * max(len(params), 1))(*[ctypes.cast(ctypes.pointer(p), P) for p in params])
        self.drv("cuLaunchKernel", f, *grid, *block, shared, None, arr, None, detail=kernel)
        if sync:
            self.drv("cuCtxSynchronize", detail=f"after {kernel}")

    def try_launch(self, *args, **kw):
        """launch(), returning the CudaError of the launch or the
        synchronize (None when both succeed) instead of raising it."""
        try:
            self.launch(*args, **kw)
            return None
        except CudaError as e:
            return e

    def sync(self):
        self.drv("cuCtxSynchronize")

    # checks
    def expect(self, what, got, want, same=None, show=None, limit=4):
        """got and want are equal-length lists; same(g, w) defaults to ==.
        show(i) describes element i's inputs in the message."""
        if len(got) != len(want):
            raise CheckFailed(f"{what}: {len(got)} results, wanted {len(want)}")
        bad = [i for i, (g, w) in enumerate(zip(got, want)) if not (same(g, w) if same else g == w)]
        self.checks += 1
        if bad:
            parts = []
            for i in bad[:limit]:
                s = f"[{i}] got {fmt_val(got[i])} want {fmt_val(want[i])}"
                if show:
                    s += f" ({show(i)})"
                parts.append(s)
            more = f" and {len(bad) - limit} more" if len(bad) > limit else ""
            self.failures.append(CheckFailed(f"{len(bad)}/{len(got)} wrong: " + "; ".join(parts) + more, what))

    def check(self, cond, msg):
        """A soft check: the case goes on and fails at its end."""
        self.checks += 1
        if not cond:
            self.failures.append(CheckFailed(msg))

    def cleanup(self):
        for p in self.allocs:
            try:
                self.drv("cuMemFree_v2", p)
            except CudaError:
                pass
        for m in self.extra_modules:
            m.unload()
        self.allocs, self.extra_modules = [], []


def fmt_val(v):
    if isinstance(v, int) and (v > 9 or v < -9):
        return f"{v:#x}" if v >= 0 else f"{v} ({v & 0xFFFFFFFFFFFFFFFF:#x})"
    if isinstance(v, float):
        return repr(v) + f" [{struct.unpack('<Q', struct.pack('<d', v))[0]:#018x}]"
    return repr(v)


def one_line(s, n=400):
    s = " | ".join(x.strip() for x in str(s).splitlines() if x.strip())
    return s if len(s) <= n else s[: n - 3] + "..."


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lib", default=os.environ.get("VGPU_LIBCUDA", os.path.join(ROOT, "target", "release", "libcuda.so.1")))
    ap.add_argument("--ptx-dir", default=os.environ.get("NVRTC_PTX_DIR", os.path.join(ROOT, "target", "nvrtc")))
    ap.add_argument("--arch", choices=sorted(ARCHS))
    ap.add_argument("--only", action="append", default=[])
    ap.add_argument("--list", action="store_true", help="list the cases and exit")
    ap.add_argument("--verbose", "-v", action="store_true", help="print whole JIT logs and tracebacks")
    args = ap.parse_args()

    if args.list:
        for c in suite.CASES:
            print(f"{c.name}  (kernels/{c.file}.cu, sm_{c.min_arch}+)")
        return 0
    faulthandler.dump_traceback_later(float(os.environ.get("NVRTC_SUITE_TIMEOUT", "900")), exit=True)

    if not os.path.isdir(args.ptx_dir):
        print(f"FAIL setup: {args.ptx_dir} is missing: run scripts/setup.sh (it compiles the kernels)")
        return 1
    drv = Driver(args.lib)
    dev = I()
    drv("cuInit", 0)
    drv("cuDeviceGet", ctypes.byref(dev), 0)
    major, minor = I(), I()
    drv("cuDeviceGetAttribute", ctypes.byref(major), 75, dev)
    drv("cuDeviceGetAttribute", ctypes.byref(minor), 76, dev)
    cc = major.value * 10 + minor.value
    name = ctypes.create_string_buffer(256)
    if drv.has("cuDeviceGetName"):
        drv("cuDeviceGetName", name, 256, dev)
    if args.arch:
        arch = args.arch
    else:
        fit = [a for a, v in ARCHS.items() if v <= cc]
        if not fit:
            print(f"FAIL setup: the device's compute capability {major.value}.{minor.value} is below compute_70")
            return 1
        arch = max(fit, key=ARCHS.get)
    av = ARCHS[arch]
    drv_name = name.value.decode(errors="replace")
    if av > cc:
        print(f"note: {arch} PTX forced on a device of compute capability {major.value}.{minor.value}")
    print(f"nvrtc suite: {arch} PTX from {args.ptx_dir} on {name.value.decode() or 'device 0'} "
          f"(compute capability {major.value}.{minor.value}) through {args.lib}", flush=True)

    selected = [c for c in suite.CASES if not args.only or any(re.search(p, c.name) for p in args.only)]
    # Cases that leave their context broken on purpose (a device assert) and
    # their files go last, so that a driver that cannot recover from them
    # costs no other case.
    selected = [c for c in selected if not c.sticky] + [c for c in selected if c.sticky]
    results = {"PASS": [], "FAIL": [], "SKIP": []}

    def report(kind, case, why=""):
        results[kind].append((case.name, why))
        print(f"{kind} {case.name}" + (f": {why}" if why else ""), flush=True)

    files = []
    for c in selected:
        if c.file not in files:
            files.append(c.file)
    sticky_files = {c.file for c in selected if c.sticky}
    files = [f for f in files if f not in sticky_files] + [f for f in files if f in sticky_files]
    for file in files:
        fcases = [c for c in selected if c.file == file]
        runnable = []
        for c in fcases:
            if c.min_arch > av:
                report("SKIP", c, f"needs compute_{c.min_arch}, running {arch} PTX")
            else:
                runnable.append(c)
        if not runnable:
            continue
        path = os.path.join(args.ptx_dir, arch, file + ".ptx")
        if not os.path.exists(path):
            for c in runnable:
                report("FAIL", c, f"{path} is missing: run scripts/setup.sh")
            continue
        ptx = open(path, "rb").read()
        state = {}

        def fresh():
            """A new context and module for this file; returns the load error or None."""
            if state.get("mod"):
                state["mod"].unload()
            if state.get("ctx"):
                try:
                    drv("cuCtxDestroy_v2", state["ctx"])
                except CudaError:
                    pass
            ctx = P()
            drv("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev)
            state["ctx"] = ctx
            mod = Module(drv, ptx)
            state["err"] = mod.load()
            state["mod"] = mod if state["err"] is None else None
            return state["err"]

        def load_another():
            m = Module(drv, ptx)
            err = m.load()
            if err:
                raise CheckFailed(f"second load: {err}")
            return m

        try:
            fresh()
        except CudaError as e:
            for c in runnable:
                report("FAIL", c, f"context: {e}")
            continue
        for c in runnable:
            if state["err"]:
                if c.refused and re.search(c.refused, state["err"], re.S) and "CPU reference device" in drv_name:
                    report("PASS", c, "refused as documented: " + one_line(state["err"]))
                    continue
                why = state["err"] if args.verbose else one_line(state["err"])
                report("FAIL", c, why)
                continue
            t = T(drv, state["mod"], av, load_another)
            t0 = time.time()
            dirty = False
            try:
                c.fn(t)
                if not t.failures:
                    report("PASS", c)
                else:
                    why = str(t.failures[0])
                    if len(t.failures) > 1:
                        why = (f"{len(t.failures)} of {t.checks} checks wrong: {why}; also wrong: "
                               + ", ".join(f.what or f.detail[:60] for f in t.failures[1:]))
                    report("FAIL", c, why)
                    if args.verbose:
                        for f in t.failures[1:]:
                            print(f"    {f}")
            except CheckFailed as e:
                report("FAIL", c, str(e))
            except CudaError as e:
                dirty = True
                report("FAIL", c, one_line(e, 600))
            except Exception as e:  # a bug in the case itself
                dirty = True
                import traceback
                report("FAIL", c, f"{type(e).__name__}: {e}" + ("\n" + traceback.format_exc() if args.verbose else ""))
            if args.verbose:
                print(f"    ({time.time() - t0:.2f} s)")
            t.cleanup()
            if c.sticky or dirty or drv.fns["cuCtxSynchronize"]() != 0:
                try:
                    fresh()
                except CudaError as e:
                    state["err"] = f"recreating the context: {e}"
        if state.get("mod"):
            state["mod"].unload()
        try:
            drv("cuCtxDestroy_v2", state["ctx"])
        except CudaError:
            pass

    npass, nfail, nskip = (len(results[k]) for k in ("PASS", "FAIL", "SKIP"))
    print()
    if results["SKIP"]:
        print(f"skipped ({arch} PTX): " + ", ".join(n for n, _ in results["SKIP"]))
    if results["FAIL"]:
        print("failed: " + ", ".join(n for n, _ in results["FAIL"]))
    print(f"nvrtc suite {arch}: {npass} passed, {nfail} failed, {nskip} skipped")
    return 1 if nfail else 0


if __name__ == "__main__":
    sys.exit(main())
