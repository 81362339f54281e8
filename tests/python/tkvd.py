"""tkvd.py - for tierkv's Python tests: starts the real tierkvd in a temporary folder (127.0.0.1
only: gRPC and attach on UNIX sockets, HTTP on an ephemeral loopback port), waits until it
serves, and kills every daemon it started at exit. The binary and libkvclient come from the
build tree: TIERKVD=path/to/tierkvd, TIERKV_LIBKVCLIENT=path/to/libkvclient.so (ctest sets
both); python/ of this clone is put first on sys.path.
"""
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "python"))

import tierkv  # noqa: E402

SKIP = 77
_daemons = []


def _cleanup():
    for d in _daemons:
        d.kill()
        shutil.rmtree(d.top, ignore_errors=True)


atexit.register(_cleanup)


def check(cond, msg):
    if not cond:
        raise AssertionError(msg)


class Daemon:
    """tierkvd with the given flags (e.g. {"kv_dtype": "bf16", "num_layers": 2})."""

    def __init__(self, **flags):
        self.top = tempfile.mkdtemp(prefix="tkvpy", dir="/tmp")  # short: socket paths < 108
        self.run_dir = os.path.join(self.top, "run")
        self.data_dir = os.path.join(self.top, "data")
        self.sock = os.path.join(self.run_dir, "tierkv.sock")
        self.attach_sock = os.path.join(self.run_dir, "attach.sock")
        self.log = os.path.join(self.top, "tierkvd.log")
        self.flags = {"l2_bytes": "64M", "http_port": "0", "http_address": "127.0.0.1"}
        self.flags.update({k: str(v) for k, v in flags.items()})
        self.proc = None
        _daemons.append(self)

    def start(self, deadline_s=30.0):
        argv = [os.environ["TIERKVD"], "--foreground", "--data-dir", self.data_dir,
                "--run-dir", self.run_dir, "--log-file", self.log]
        for k, v in self.flags.items():
            argv += ["--" + k, v]
        with open(self.log + ".stderr", "ab") as out:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=out)
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                raise AssertionError(f"tierkvd exited {self.proc.returncode}:\n{self.logs()}")
            if os.path.exists(self.sock):
                try:
                    with self.client(timeout_ms=2000) as c:
                        if c.health()["status"] == "serving":
                            return self
                except tierkv.TierKVError:
                    pass
            time.sleep(0.05)
        raise AssertionError(f"tierkvd did not serve within {deadline_s}s:\n{self.logs()}")

    def client(self, attach=False, **kw):
        return tierkv.Client(self.sock, attach_socket=self.attach_sock if attach else None, **kw)

    def stop(self):
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=60)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def logs(self):
        text = ""
        for p in (self.log, self.log + ".stderr"):
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    text += f.read()[-4000:]
        return text

    def corrupt_l3(self):
        """Flips bytes inside every stored L3 payload segment of a stopped daemon (the real
        files the daemon reads back, checksum verified). Returns how many segments."""
        check(self.proc.poll() is not None, "stop the daemon before corrupting its store")
        l3 = os.path.join(self.data_dir, "l3")
        n = 0
        for name in sorted(os.listdir(l3)):
            if name.startswith("seg-") and name.endswith(".dat"):
                path = os.path.join(l3, name)
                size = os.path.getsize(path)
                with open(path, "r+b") as f:
                    for off in range(64, size, 4096):  # one byte of every 4 KiB: every payload
                        f.seek(off)
                        b = f.read(1)
                        f.seek(off)
                        f.write(bytes([b[0] ^ 0x5A]))
                n += 1
        return n


def main(fn):
    try:
        fn()
    except AssertionError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        sys.exit(1)
    print("PASS")
    sys.exit(0)
