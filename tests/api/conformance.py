#!/usr/bin/env python3
"""The API conformance check (DESIGN §9, "Gates"): each daemon's served API
against its OpenAPI document, with schemathesis (tests/api/requirements.txt).

1. vgpu-vmm running the bare-metal test guest (`test=count`), against
   docs/api/vmm.yaml. `PUT /vm/kill` and `PUT /vm/shutdown` end the VMM by
   design: a watcher starts a new one whenever one ends, and the bridge
   holds the next request until it is up. A VMM that ends without having
   been asked to fails the check.
2. vgpu-mediatord on a temporary run directory with two CPU devices,
   against docs/api/mediator.yaml. Before the run it is given the objects
   the document names as examples (tenant `web`, pool `pool-a`, VM `vm1`
   booting the test guest), so the operations on one object are also
   tried on one that exists. Every operation but DELETE runs first; the
   DELETEs run in a second pass, so they cannot take those objects away
   from the first one. Afterwards the daemon must still answer, and no
   device worker may have restarted.

The daemons listen on unix sockets only, and schemathesis speaks HTTP over
TCP: a bridge on 127.0.0.1 (an ephemeral port) forwards each connection to
the socket, and stops a run at once when a request goes unanswered (the
daemon hangs). Whatever the check starts is ended before it returns, and
it fails if anything of it is left running.

Run it alone, after scripts/setup.sh (which builds the binaries and the
test guest and installs schemathesis in target/apienv):

    target/apienv/bin/python tests/api/conformance.py [--only mediator|vmm]
        [--max-examples N] [--seed N] [--serve]

Schemathesis' logs go to target/api-conformance/; each failure comes with
a curl command that reproduces it (`--serve` sets up a mediator as the
check does and keeps it on a loopback port to replay against).
"""

import argparse
import asyncio
import http.client
import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(os.environ.get("VGPU_BIN_DIR", ROOT / "target" / "release"))
ENV_BIN = Path(sys.executable).parent
SCHEMATHESIS = ENV_BIN / "schemathesis"
CONFIG = ROOT / "tests" / "api" / "schemathesis.toml"
GUEST = ROOT / "images" / "test-guest" / "target" / "x86_64-unknown-linux-gnu" / "release" / "vgpu-test-guest"
LOGS = ROOT / "target" / "api-conformance"
SKIPS = BIN / "skipped-tests.txt"

# Every response is checked for: no 5xx but those the configuration allows
# (tests/api/schemathesis.toml), a status code the operation documents,
# the documented content type, a body that validates against the
# documented schema and the documented headers; and a request the
# document calls invalid must be refused (4xx). (Not the reverse: a valid
# request may still name a file or a device that does not exist.)
CHECKS = ",".join(
    [
        "not_a_server_error",
        "status_code_conformance",
        "content_type_conformance",
        "response_schema_conformance",
        "response_headers_conformance",
        "negative_data_rejection",
    ]
)

# The whole check must fit in about three minutes on a 2-core machine; a
# run that has not ended by then is stopped and fails.
BUDGET_S = 170.0


def log(msg):
    print(f"api-conformance: {msg}", flush=True)


class UnixHTTPConnection(http.client.HTTPConnection):
    def __init__(self, path, timeout=60):
        super().__init__("localhost", timeout=timeout)
        self.unix_path = str(path)

    def connect(self):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(self.timeout)
        s.connect(self.unix_path)
        self.sock = s


def call(sock, method, path, body=None, timeout=60):
    """One request on a unix socket; returns (status, parsed JSON or text)."""
    c = UnixHTTPConnection(sock, timeout)
    try:
        headers = {"Connection": "close"}
        data = None
        if body is not None:
            data = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        c.request(method, path, body=data, headers=headers)
        r = c.getresponse()
        raw = r.read()
        try:
            return r.status, json.loads(raw)
        except ValueError:
            return r.status, raw.decode(errors="replace")
    finally:
        c.close()


def wait_socket(path, proc, what, timeout=20.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.connect(str(path))
            return
        except OSError:
            pass
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited ({proc.returncode}) before its API came up")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what}'s API did not come up within {timeout:.0f}s")
        time.sleep(0.02)


def spawn(argv, log_path):
    """Starts a daemon in a process group of its own (its workers and
    VMMs join it), so that it and all it started can be ended together."""
    env = dict(os.environ, VGPU_LOG=os.environ.get("VGPU_LOG", "warn"))
    with open(log_path, "ab") as out:
        return subprocess.Popen([str(a) for a in argv], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)


def end_group(proc, grace=15.0):
    """SIGTERM (a clean shutdown), then SIGKILL to the whole process group;
    returns whether nothing of the group is left afterwards."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.killpg(proc.pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.05)
    return False


class Respawner:
    """Keeps one VMM up: starts a new one whenever the last one ends.
    `generation` counts the VMMs whose API came up; `wanted` is the
    generation the next request must reach (raised when a request asked
    the current one to end)."""

    def __init__(self, start, api):
        self.start, self.api = start, api
        self.cv = threading.Condition()
        self.proc = start()
        try:
            wait_socket(api, self.proc, "vgpu-vmm")
        except RuntimeError:
            end_group(self.proc)
            raise
        self.generation, self.wanted, self.asked = 1, 1, 0
        self.exits = []
        self.stopping = False
        self.error = None
        self.thread = threading.Thread(target=self._watch, name="vmm-watch", daemon=True)
        self.thread.start()

    def _watch(self):
        while True:
            code = self.proc.wait()
            end_group(self.proc, grace=0)
            with self.cv:
                if self.stopping:
                    return
                self.exits.append(code)
            try:
                self.proc = self.start()
                wait_socket(self.api, self.proc, "vgpu-vmm")
            except (OSError, RuntimeError) as e:
                with self.cv:
                    self.error = None if self.stopping else str(e)
                    self.cv.notify_all()
                return
            with self.cv:
                if self.stopping:
                    return
                self.generation += 1
                self.cv.notify_all()

    def asked_to_end(self, generation):
        with self.cv:
            self.asked += 1
            self.wanted = max(self.wanted, generation + 1)

    def ready(self, timeout=20.0):
        with self.cv:
            if not self.cv.wait_for(lambda: self.generation >= self.wanted or self.error, timeout) or self.error:
                raise TimeoutError(self.error or "no new VMM came up")
            return self.generation

    def stop(self):
        with self.cv:
            self.stopping = True
        ok = end_group(self.proc)
        self.thread.join(30)
        # The watcher may have started one more meanwhile.
        return end_group(self.proc) and ok


# Requests after whose 2xx answer the VMM ends by design.
ENDING = (b"PUT /vm/kill ", b"PUT /vm/shutdown ")


class Bridge:
    """127.0.0.1:port to a unix socket, one upstream connection per client
    connection (schemathesis is told to send `Connection: close`)."""

    def __init__(self, target, respawner=None):
        self.target, self.respawner = str(target), respawner
        self.tasks = set()
        # Requests sent on and not answered yet: connection -> (request line, when).
        self.pending, self.lock = {}, threading.Lock()
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="bridge", daemon=True)
        self.thread.start()
        self.server = asyncio.run_coroutine_threadsafe(asyncio.start_server(self._client, "127.0.0.1", 0), self.loop).result(10)
        self.port = self.server.sockets[0].getsockname()[1]

    async def _client(self, reader, writer):
        # Held here: asyncio keeps only a weak reference to the task of a
        # connection whose client went away while the daemon is silent.
        me = asyncio.current_task()
        self.tasks.add(me)
        try:
            await self._relay(reader, writer)
        except asyncio.CancelledError:
            pass  # the bridge is closing
        finally:
            self.tasks.discard(me)

    async def _relay(self, reader, writer):
        generation = 0
        try:
            if self.respawner:
                generation = await self.loop.run_in_executor(None, self.respawner.ready)
            ur, uw = await asyncio.open_unix_connection(self.target)
        except (OSError, TimeoutError) as e:
            log(f"bridge: cannot reach {self.target}: {e}")
            writer.close()
            return
        head = bytearray()
        key = id(writer)

        async def upstream():
            try:
                while data := await reader.read(65536):
                    if not head:
                        with self.lock:
                            self.pending[key] = (data.split(b"\r\n", 1)[0].decode(errors="replace"), time.monotonic())
                    if len(head) < 64:
                        head.extend(data[: 64 - len(head)])
                    uw.write(data)
                    await uw.drain()
                # The client's end of the connection is not passed on: the
                # daemon would drop the request's connection, and the
                # bridge could no longer tell a request that hangs.
            except (OSError, asyncio.IncompleteReadError):
                pass

        async def downstream():
            first = True
            try:
                while data := await ur.read(65536):
                    with self.lock:
                        self.pending.pop(key, None)
                    if first and self.respawner:
                        first = False
                        parts = data.split(b" ", 2)
                        ok = len(parts) > 1 and parts[1][:1] == b"2"
                        if ok and bytes(head).startswith(ENDING):
                            self.respawner.asked_to_end(generation)
                    writer.write(data)
                    await writer.drain()
            except OSError:
                pass
            finally:
                writer.close()

        try:
            await asyncio.gather(upstream(), downstream())
        finally:
            with self.lock:
                self.pending.pop(key, None)
            uw.close()

    def unanswered(self, older_than):
        """Requests the daemon has not answered for `older_than` seconds."""
        now = time.monotonic()
        with self.lock:
            return [(line, now - t) for line, t in self.pending.values() if now - t > older_than]

    def close(self):
        async def shutdown():
            self.server.close()
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            if tasks:
                await asyncio.wait(tasks, timeout=5)

        asyncio.run_coroutine_threadsafe(shutdown(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


# A request the daemon has not answered for this long means it hangs (the
# slowest legitimate answers, a VM start or a tenant's teardown, take 15s
# at most): the run is stopped there instead of spending the budget on
# timeouts.
HUNG_S = 30.0


def schemathesis(name, doc, bridge, extra, deadline, args):
    """One `schemathesis run` through `bridge`; returns whether it passed."""
    left = deadline - time.monotonic()
    if left < 5:
        log(f"{name}: no time left of the {BUDGET_S:.0f}s budget")
        return False
    out = LOGS / f"{name}.log"
    argv = [
        SCHEMATHESIS,
        "--config-file",
        CONFIG,
        "--no-color",
        "run",
        doc,
        "--url",
        f"http://127.0.0.1:{bridge.port}",
        "--checks",
        CHECKS,
        "--max-examples",
        str(args.max_examples),
        "--seed",
        str(args.seed),
        "--workers",
        "1",
        # Fresh examples every run: no database of earlier failures.
        "--generation-database",
        "none",
        "--header",
        "Connection: close",
        # A request the daemon never answers fails after this long.
        "--request-timeout",
        "10",
        *extra,
        # Extra schemathesis options, to narrow a run down while debugging
        # (e.g. API_SCHEMATHESIS_ARGS="--include-path-regex ^/pools").
        *shlex.split(os.environ.get("API_SCHEMATHESIS_ARGS", "")),
    ]
    t = time.monotonic()
    rc = hung = None
    with open(out, "w") as f:
        proc = subprocess.Popen([str(a) for a in argv], cwd=LOGS, stdin=subprocess.DEVNULL, stdout=f, stderr=subprocess.STDOUT)
        try:
            while rc is None and time.monotonic() < deadline and not hung:
                try:
                    rc = proc.wait(1)
                except subprocess.TimeoutExpired:
                    hung = bridge.unanswered(HUNG_S)
        finally:
            if rc is None:
                proc.kill()
                proc.wait()
    lines = out.read_text(errors="replace").splitlines()
    if rc == 0:
        cases = next((l.strip() for l in reversed(lines) if " generated" in l), "")
        log(f"{name}: passed in {time.monotonic() - t:.0f}s ({cases})")
        return True
    if rc is None:
        print("\n".join(l for l in lines if l.strip()[:1] in ("✅", "❌", "🚫", "⏭") or "passed" in l), flush=True)
        for line, age in hung or []:
            log(f"{name}: the daemon has not answered {line} for {age:.0f}s: it hangs")
        if not hung:
            log(f"{name}: still running when the {BUDGET_S:.0f}s budget ran out")
        log(f"{name}: FAILED; its log: {out}")
    else:
        start = next((i for i, l in enumerate(lines) if "FAILURES" in l or "ERRORS" in l), max(0, len(lines) - 60))
        print("\n".join(lines[start:]), flush=True)
        log(f"{name}: FAILED (schemathesis exit {rc}); its log: {out}")
    return False


def kvm_usable():
    try:
        os.close(os.open("/dev/kvm", os.O_RDWR))
        return True
    except OSError as e:
        return str(e)


def report_skip(what, why):
    line = f"SKIPPED {what}: {why}"
    log(f"*** {line}")
    with open(SKIPS, "a") as f:
        f.write(line + "\n")


def check_mediator(tmp, deadline, args):
    run_dir, api = tmp / "run", tmp / "run" / "api.sock"
    # The document's pool example overcommits its device's memory, which
    # needs the devices' tenants in one worker (isolation "shared"; the
    # default, "process", refuses such a pool with a 400).
    proc = spawn(
        [BIN / "vgpu-mediatord", "--cuda", "off", "--run-dir", run_dir, "--state-dir", tmp / "state", "--cpu-devices", "2", "--device-memory", "64MiB", "--usage-interval", "1", "--isolation", "shared"],
        LOGS / "mediatord.log",
    )
    bridge = None
    ok = True
    try:
        wait_socket(api, proc, "vgpu-mediatord")
        # The objects the document's examples name.
        fixtures = [
            ("POST", "/pools", {"name": "pool-a", "devices": ["cpu1"], "access": "private", "allow": ["web"], "placement": "pack", "overcommit": 2}),
            ("POST", "/tenants", {"name": "web", "memory": "16MiB", "weight": 2, "cap": 50, "priority": "latency", "owner": "1000:1000", "mode": "0660", "host_memory": "8MiB", "max_connections": 8}),
        ]
        kvm = kvm_usable()
        if kvm is True and GUEST.is_file():
            fixtures.append(("POST", "/vms", {"name": "vm1", "memory": "16MiB", "kernel": str(GUEST), "cmdline": "test=count", "vgpu": {"memory": "8MiB"}, "restart": "never"}))
        else:
            why = kvm if kvm is not True else f"the test guest {GUEST} is not built (scripts/setup.sh builds it)"
            report_skip("api conformance of /vms on a running VM", f"no VM can run here ({why}); /vms is still checked on VMs that do not exist")
        for method, path, body in fixtures:
            st, v = call(api, method, path, body)
            if st != 201:
                raise RuntimeError(f"setting up: {method} {path} answered {st}: {v}")
        bridge = Bridge(api)
        if args.serve:
            log(f"vgpu-mediatord (pid {proc.pid}, run dir {run_dir}) is on http://127.0.0.1:{bridge.port}; Ctrl-C ends it")
            while proc.poll() is None:
                time.sleep(1)
            return False
        log(f"vgpu-mediatord (pid {proc.pid}) on 127.0.0.1:{bridge.port}, against docs/api/mediator.yaml")
        doc = ROOT / "docs" / "api" / "mediator.yaml"
        ok &= schemathesis("mediator", doc, bridge, ["--exclude-method", "DELETE"], deadline, args)
        if bridge.unanswered(0):
            log("mediator-delete: not run: the daemon hangs")
        else:
            ok &= schemathesis("mediator-delete", doc, bridge, ["--include-method", "DELETE"], deadline, args)
        # A request that hangs (a deadlock in the daemon) shows as a run
        # that timed out: name what no longer answers.
        for path in ("/devices", "/tenants", "/pools", "/vms", "/usage?limit=1", "/metrics"):
            try:
                call(api, "GET", path, timeout=5)
            except (OSError, http.client.HTTPException) as e:
                log(f"GET {path} gets no answer any more ({e}): vgpu-mediatord is wedged; see {LOGS / 'mediatord.log'}")
                ok = False
        if proc.poll() is not None:
            log(f"vgpu-mediatord died during the run (exit {proc.returncode}); its log: {LOGS / 'mediatord.log'}")
            return False
        st, devices = call(api, "GET", "/devices", timeout=5)
        bad = [d for d in devices if d.get("worker_restarts") or d.get("state") != "running"] if st == 200 else devices
        if bad:
            log(f"a device worker crashed or restarted during the run: {bad}; see {LOGS / 'mediatord.log'}")
            ok = False
    finally:
        if bridge:
            bridge.close()
        if not end_group(proc):
            log("vgpu-mediatord's process group did not end")
            ok = False
    return ok


def check_vmm(tmp, deadline, args):
    kvm = kvm_usable()
    if kvm is not True or not GUEST.is_file():
        why = kvm if kvm is not True else f"the test guest {GUEST} is not built (scripts/setup.sh builds it)"
        report_skip("api conformance of vgpu-vmm", f"no VM can run here ({why})")
        return True
    api = tmp / "vmm.sock"

    def start():
        return spawn(
            [BIN / "vgpu-vmm", "--kernel", GUEST, "--memory", "16", "--vcpus", "2", "--cmdline", "test=count", "--serial", tmp / "serial.log", "--api-socket", api],
            LOGS / "vmm.log",
        )

    vmm = Respawner(start, api)
    bridge = Bridge(api, vmm)
    ok = True
    try:
        log(f"vgpu-vmm on 127.0.0.1:{bridge.port}, against docs/api/vmm.yaml")
        ok &= schemathesis("vmm", ROOT / "docs" / "api" / "vmm.yaml", bridge, [], deadline, args)
        with vmm.cv:
            exits, asked, error = list(vmm.exits), vmm.asked, vmm.error
        unasked = len(exits) - asked
        if error or unasked > 0 or any(c not in (0, 4) for c in exits):
            log(f"vgpu-vmm ended without being asked to, or badly: exits {exits} after {asked} kill/shutdown requests {error or ''}; its log: {LOGS / 'vmm.log'}")
            ok = False
        else:
            log(f"vgpu-vmm: {asked} kill/shutdown requests ended it as documented (exits {sorted(set(exits))})")
    finally:
        bridge.close()
        if not vmm.stop():
            log("vgpu-vmm's process group did not end")
            ok = False
    return ok


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--only", choices=["mediator", "vmm"])
    p.add_argument("--serve", action="store_true", help="set the mediator up as the check does and serve it on a loopback port until Ctrl-C, to replay failures with curl or `schemathesis run`")
    p.add_argument("--max-examples", type=int, default=int(os.environ.get("API_MAX_EXAMPLES", "200")), help="test cases per operation and phase (default 200)")
    p.add_argument("--seed", type=int, default=int(os.environ.get("API_SEED", "20240101")))
    args = p.parse_args()

    # A SIGTERM (a CI runner's, say) ends the check as Ctrl-C does: what it
    # started is ended first.
    def interrupted(*_):
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupted)
    for b in ("vgpu-mediatord", "vgpu-vmm"):
        if not (BIN / b).is_file():
            log(f"{BIN / b} is missing: build the workspace first (scripts/setup.sh)")
            return 1
    if not SCHEMATHESIS.is_file():
        log(f"{SCHEMATHESIS} is missing: run this with the Python of target/apienv (scripts/setup.sh installs it)")
        return 1
    LOGS.mkdir(parents=True, exist_ok=True)
    for old in LOGS.glob("*.log"):
        old.unlink()
    started = time.monotonic()
    deadline = started + BUDGET_S
    # Short: tenant socket paths must fit a sockaddr_un.
    tmp = Path(tempfile.mkdtemp(prefix="vgpu-api-", dir="/tmp"))
    # The device workers drop to the user vgpu and bind tenant sockets in
    # RUN_DIR/tenants: they must be able to pass through.
    tmp.chmod(0o711)
    results = {}
    try:
        # The VMM first: it takes seconds, the mediator most of the budget.
        if args.only in (None, "vmm") and not args.serve:
            results["vmm"] = check_vmm(tmp, deadline, args)
        if args.only in (None, "mediator"):
            results["mediator"] = check_mediator(tmp, deadline, args)
    except KeyboardInterrupt:
        results["interrupted"] = False
    except (OSError, RuntimeError) as e:
        log(f"error: {e}")
        results["setup"] = False
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    passed = sum(1 for v in results.values() if v)
    failed = len(results) - passed
    log(f"seed {args.seed}, {args.max_examples} examples per operation, {time.monotonic() - started:.0f}s")
    print(f"api-conformance: {passed} passed, {failed} failed", flush=True)
    return 0 if failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
