#!/usr/bin/env python3
"""Lists every distinct PTX construct in the suite's generated PTX: each
instruction spelling (opcode with all its modifiers), directive and special
register, with how often it occurs and one example line (file:line).

    python3 tests/nvrtc/ptx_constructs.py [--ptx-dir DIR] [--check [--lib PATH]]

--check also loads every module through the driver library (as
run_suite.py does; our shim needs $VGPU_SOCKET) and marks what the loader
refuses: on CUDA_ERROR_INVALID_PTX naming a line, that line is commented out
and the module loaded again, so one run finds every refused line. The
module's .target is lowered to the device's arch first, so that PTX for a
newer arch is parsed rather than refused whole.
"""

import argparse
import collections
import ctypes
import glob
import os
import re
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
sys.dont_write_bytecode = True  # no __pycache__ in the source tree

LABEL = re.compile(r"^\s*[$A-Za-z_][$\w]*:")
GUARD = re.compile(r"^@!?%\w+\s+")


def statements(text):
    """(line number, statement) for every statement of a PTX file."""
    for no, line in enumerate(text.splitlines(), 1):
        line = line.split("//", 1)[0]
        for part in line.split(";"):
            s = part.strip().lstrip("{}").strip()  # block braces, not {a,b} operands
            while True:
                m = LABEL.match(s)
                if not m:
                    break
                s = s[m.end():].strip()
            s = GUARD.sub("", s)
            if s:
                yield no, s


def scan(files):
    instrs, directives, sregs = (collections.OrderedDict() for _ in range(3))
    for path in files:
        text = open(path).read()
        rel = os.path.relpath(path, ROOT)
        declared = set()
        for no, s in statements(text):
            if s.startswith(".reg") or s.startswith(".param") or s.startswith(".local") or s.startswith(".shared"):
                for name in re.findall(r"%(\w+)", s):
                    declared.add(re.sub(r"\d+$", "", name))
            head = s.split()[0]
            if head.startswith("."):
                for d in re.findall(r"(?<![\w%])(\.[a-z_][a-z0-9_]*)\b", s.split("(")[0].split("=")[0]):
                    if d in (".b8", ".b16", ".b32", ".b64", ".u8", ".u16", ".u32", ".u64", ".s8", ".s16", ".s32", ".s64",
                             ".f16", ".f16x2", ".bf16", ".bf16x2", ".f32", ".f64", ".pred", ".v2", ".v4", ".align", ".ptr"):
                        continue
                    directives.setdefault(d, [0, f"{rel}:{no}: {s[:100]}"])[0] += 1
                continue
            if not re.fullmatch(r"[a-z][a-z0-9_.:]*", head) or head.startswith(("param", "prototype", "retval")):
                continue
            instrs.setdefault(head, [0, f"{rel}:{no}: {s[:110]}"])[0] += 1
            for m in re.finditer(r"%([a-z_]+[a-z0-9_]*)(\.[xyz])?", s):
                base = re.sub(r"\d+$", "", m.group(1))
                if base in declared or m.group(1) in declared:
                    continue
                name = "%" + m.group(1) + (m.group(2) or "")
                sregs.setdefault(name, [0, f"{rel}:{no}: {s[:110]}"])[0] += 1
    return instrs, directives, sregs


def check(files, lib, max_tries=60):
    """{(path, line): error} for every line the loader refuses."""
    import run_suite as rs

    drv = rs.Driver(lib)
    dev = rs.I()
    drv("cuInit", 0)
    drv("cuDeviceGet", ctypes.byref(dev), 0)
    ma, mi = rs.I(), rs.I()
    drv("cuDeviceGetAttribute", ctypes.byref(ma), 75, dev)
    drv("cuDeviceGetAttribute", ctypes.byref(mi), 76, dev)
    target = f".target sm_{ma.value}{mi.value}"
    ctx = rs.P()
    drv("cuCtxCreate_v2", ctypes.byref(ctx), 0, dev)
    refused, other = {}, {}
    for path in files:
        lines = open(path).read().splitlines()
        lines = [re.sub(r"^\.target sm_\d+a?", target, l) for l in lines]
        for _ in range(max_tries):
            m = rs.Module(drv, ("\n".join(lines) + "\n").encode())
            err = m.load()
            if err is None:
                m.unload()
                break
            hit = re.search(r"line (\d+)", err)
            if not hit or lines[int(hit.group(1)) - 1].lstrip().startswith("//"):
                other[path] = err
                break
            n = int(hit.group(1))
            refused[(path, n)] = err
            lines[n - 1] = "// " + lines[n - 1]
    drv("cuCtxDestroy_v2", ctx)
    return refused, other


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ptx-dir", default=os.environ.get("NVRTC_PTX_DIR", os.path.join(ROOT, "target", "nvrtc")))
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--lib", default=os.environ.get("VGPU_LIBCUDA", os.path.join(ROOT, "target", "release", "libcuda.so.1")))
    args = ap.parse_args()
    files = sorted(glob.glob(os.path.join(args.ptx_dir, "compute_*", "*.ptx")))
    if not files:
        sys.exit(f"no PTX under {args.ptx_dir}: run scripts/setup.sh")
    instrs, directives, sregs = scan(files)
    bad_spellings = {}
    if args.check:
        refused, other = check(files, args.lib)
        for (path, n), err in refused.items():
            stmts = [s for no, s in statements(open(path).read()) if no == n]
            key = stmts[0].split()[0] if stmts else f"line {n}"
            bad_spellings.setdefault(key, (f"{os.path.relpath(path, ROOT)}:{n}", err))
        for path, err in other.items():
            print(f"LOAD FAILED (no line to drop) {os.path.relpath(path, ROOT)}: {err}")
    print(f"# {len(files)} PTX files: {len(instrs)} instruction spellings, {len(directives)} directives, {len(sregs)} special registers")
    for title, table in (("instructions", instrs), ("directives", directives), ("special registers", sregs)):
        print(f"\n## {title}")
        for k in sorted(table):
            n, ex = table[k]
            mark = ""
            if k in bad_spellings:
                mark = f"  REFUSED: {bad_spellings[k][1]}"
            print(f"{k:34} {n:6}  {ex}{mark}")
    if args.check:
        print(f"\n## refused by the loader: {len(bad_spellings)}")
        for k, (where, err) in sorted(bad_spellings.items()):
            print(f"{k:34} {where}: {err}")


if __name__ == "__main__":
    main()
