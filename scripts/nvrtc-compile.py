#!/usr/bin/env python3
"""Compiles the NVRTC suite's CUDA C++ kernels (tests/nvrtc/kernels/*.cu) to
PTX with NVRTC from PyPI, for compute_70, compute_80 and compute_90.

Run it with the suite's virtual environment (scripts/setup.sh makes it):

    target/pyenv/bin/python scripts/nvrtc-compile.py [--out DIR] [--arch compute_XX ...] [FILE.cu ...]

Writes DIR/compute_XX/<file>.ptx (DIR defaults to target/nvrtc). A file is
compiled again only when its source, the suite's headers, the options or
NVRTC's version changed (a .hash file beside each .ptx records them).
Prints NVRTC's log and exits non-zero when any compilation fails.
"""

import argparse
import ctypes
import glob
import hashlib
import os
import sys
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KERNELS = os.path.join(ROOT, "tests", "nvrtc", "kernels")
ARCHS = ["compute_70", "compute_80", "compute_90"]


def site_dirs():
    return [p for p in sys.path if p and os.path.isdir(os.path.join(p, "nvidia"))]


def find_in_wheels(rel):
    for d in site_dirs():
        p = os.path.join(d, "nvidia", rel)
        if os.path.exists(p):
            return p
    return None


def load_nvrtc():
    lib = find_in_wheels("cuda_nvrtc/lib/libnvrtc.so.12")
    if lib is None:
        sys.exit("nvrtc-compile: libnvrtc.so.12 not found: run this with target/pyenv/bin/python "
                 "(scripts/setup.sh installs nvidia-cuda-nvrtc-cu12 there)")
    nv = ctypes.CDLL(lib)
    nv.nvrtcGetErrorString.restype = ctypes.c_char_p
    nv.nvrtcCreateProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p, ctypes.c_char_p, ctypes.c_int,
                                      ctypes.c_void_p, ctypes.c_void_p]
    nv.nvrtcCompileProgram.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
    for f in ("nvrtcGetProgramLogSize", "nvrtcGetPTXSize"):
        getattr(nv, f).argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t)]
    for f in ("nvrtcGetProgramLog", "nvrtcGetPTX"):
        getattr(nv, f).argtypes = [ctypes.c_void_p, ctypes.c_char_p]
    nv.nvrtcDestroyProgram.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
    return nv


def nvrtc_version(nv):
    major, minor = ctypes.c_int(), ctypes.c_int()
    nv.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
    return f"{major.value}.{minor.value}"


def include_dirs():
    dirs = []
    # cuda_nvcc/include holds crt/mma.h, which mma.h (the WMMA API) includes.
    for rel in ("cuda_runtime/include", "cuda_cccl/include", "cuda_nvcc/include"):
        d = find_in_wheels(rel)
        if d is None:
            sys.exit(f"nvrtc-compile: nvidia/{rel} not found: scripts/setup.sh installs the suite's wheels "
                     "(tests/nvrtc/requirements.txt)")
        dirs.append(d)
    return dirs + [KERNELS]


def compile_one(nv, src_path, arch, opts):
    """Returns (ptx or None, log)."""
    src = open(src_path, "rb").read()
    prog = ctypes.c_void_p()
    name = os.path.basename(src_path).encode()
    r = nv.nvrtcCreateProgram(ctypes.byref(prog), src, name, 0, None, None)
    if r != 0:
        return None, f"nvrtcCreateProgram: {nv.nvrtcGetErrorString(r).decode()}"
    try:
        allopts = [f"--gpu-architecture={arch}".encode()] + [o.encode() for o in opts]
        arr = (ctypes.c_char_p * len(allopts))(*allopts)
        r = nv.nvrtcCompileProgram(prog, len(allopts), arr)
        n = ctypes.c_size_t()
        nv.nvrtcGetProgramLogSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        nv.nvrtcGetProgramLog(prog, buf)
        # compute_70 is deprecated in CUDA 12.9 (still supported); NVRTC has
        # no option to silence that warning.
        log = "\n".join(l for l in buf.value.decode(errors="replace").splitlines()
                        if "Architectures prior to" not in l).strip()
        if r != 0:
            return None, f"{nv.nvrtcGetErrorString(r).decode()}\n{log}"
        nv.nvrtcGetPTXSize(prog, ctypes.byref(n))
        buf = ctypes.create_string_buffer(n.value)
        nv.nvrtcGetPTX(prog, buf)
        return buf.value.decode(), log
    finally:
        nv.nvrtcDestroyProgram(ctypes.byref(prog))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.path.join(ROOT, "target", "nvrtc"))
    ap.add_argument("--arch", action="append", choices=ARCHS, help="only this arch (repeatable)")
    ap.add_argument("--force", action="store_true", help="compile even what is up to date")
    ap.add_argument("files", nargs="*", help="only these .cu files")
    args = ap.parse_args()

    nv = load_nvrtc()
    version = nvrtc_version(nv)
    incs = include_dirs()
    opts = ["-std=c++17"] + [f"-I{d}" for d in incs]
    sources = sorted(args.files) if args.files else sorted(glob.glob(os.path.join(KERNELS, "*.cu")))
    headers = sorted(glob.glob(os.path.join(KERNELS, "*.cuh")))
    hdr_digest = hashlib.sha256(b"".join(open(h, "rb").read() for h in headers)).hexdigest()
    archs = args.arch or ARCHS

    jobs = []
    for arch in archs:
        outdir = os.path.join(args.out, arch)
        os.makedirs(outdir, exist_ok=True)
        wanted = set()
        for src in sources:
            base = os.path.splitext(os.path.basename(src))[0]
            wanted.add(base)
            key = hashlib.sha256("\0".join([version, arch, opts[0], hdr_digest,
                                            hashlib.sha256(open(src, "rb").read()).hexdigest()]).encode()).hexdigest()
            ptx, stamp = os.path.join(outdir, base + ".ptx"), os.path.join(outdir, base + ".hash")
            if not args.force and os.path.exists(ptx) and os.path.exists(stamp) and open(stamp).read() == key:
                continue
            jobs.append((src, arch, ptx, stamp, key))
        if not args.files:  # drop the PTX of kernels that no longer exist
            for old in glob.glob(os.path.join(outdir, "*.ptx")):
                if os.path.splitext(os.path.basename(old))[0] not in wanted:
                    os.remove(old)
                    stale = old[:-4] + ".hash"
                    if os.path.exists(stale):
                        os.remove(stale)

    def run(job):
        src, arch, ptx_path, stamp, key = job
        ptx, log = compile_one(nv, src, arch, opts)
        if ptx is not None:
            with open(ptx_path, "w") as f:
                f.write(ptx)
            with open(stamp, "w") as f:
                f.write(key)
        return job, ptx is not None, log

    failed = 0
    # NVRTC may be called from several threads at once for distinct programs.
    with ThreadPoolExecutor(max_workers=max(1, os.cpu_count() or 1)) as pool:
        for (src, arch, _, _, _), ok, log in pool.map(run, jobs):
            rel = os.path.relpath(src, ROOT)
            if not ok:
                failed += 1
                print(f"nvrtc-compile: {rel} for {arch} FAILED:\n{log}", file=sys.stderr)
            elif log:
                print(f"nvrtc-compile: {rel} for {arch}:\n{log}", file=sys.stderr)
    total = len(sources) * len(archs)
    print(f"nvrtc-compile: NVRTC {version}: {len(jobs)} compiled, {total - len(jobs)} up to date, {failed} failed "
          f"-> {os.path.relpath(args.out, ROOT)}/", file=sys.stderr)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
