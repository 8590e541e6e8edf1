#!/usr/bin/env python3
"""The system calls some processes made, from an `strace -f` log.

Usage: scripts/syscalls-of.py TRACE[.gz] PID...   (scripts/gpu-syscalls.sh
writes the log and the executors' pids). Each PID counts with every thread
and process it made (the clone family's return values); prints each call
with how often it was made, most frequent first, then the ioctl request
numbers and the files opened."""
import collections
import gzip
import re
import sys

LINE = re.compile(r"^(\d+)\s+[\d.]+\s+(?:<\.\.\. )?([a-z_0-9]+)[( ]")
CLONE = re.compile(r"^(\d+)\s+[\d.]+\s+(?:<\.\.\. )?(clone3?|fork|vfork)\b.*= (\d+)")
IOCTL = re.compile(r"ioctl\(\d+(?:<[^>]*>)?, (0x[0-9a-f]+|[A-Z_0-9]+)")
OPEN = re.compile(r'open(?:at)?\([^"]*"([^"]*)"')


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    path, roots = sys.argv[1], {int(p) for p in sys.argv[2:]}
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rt", errors="replace") as f:
        lines = f.readlines()
    mine = set(roots)
    for l in lines:
        m = CLONE.match(l)
        if m and int(m.group(1)) in mine:
            mine.add(int(m.group(3)))
    calls, ioctls, files = collections.Counter(), collections.Counter(), collections.Counter()
    for l in lines:
        m = LINE.match(l)
        if not m or int(m.group(1)) not in mine:
            continue
        calls[m.group(2)] += 1
        if m.group(2) == "ioctl":
            i = IOCTL.search(l)
            ioctls[i.group(1) if i else "?"] += 1
        o = OPEN.search(l)
        if o:
            files[re.sub(r"\d+", "N", o.group(1))] += 1
    print(f"{len(mine)} threads and processes, {sum(calls.values())} calls")
    for name, n in calls.most_common():
        print(f"{n:8} {name}")
    print("ioctl requests:")
    for name, n in ioctls.most_common():
        print(f"{n:8} {name}")
    print("files opened:")
    for name, n in files.most_common(40):
        print(f"{n:8} {name}")


if __name__ == "__main__":
    main()
