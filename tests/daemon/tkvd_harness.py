"""tkvd_harness.py - shared by the daemon's Python tests: generates the client from
proto/tierkv.proto, starts the real tierkvd in a temporary folder, and computes fingerprints
and keys the way docs/design.md specifies them (so the tests check the daemon against the
written contract, not against itself).

Usage from a test:  h = Harness(sys.argv[1], sys.argv[2]);  d = h.daemon(); d.start() ...
Every daemon is killed at exit whatever happens (atexit), and the temporary folders removed.
"""
import atexit
import hashlib
import os
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

SKIP = 77

try:
    import grpc
    from grpc_tools import protoc
except ImportError as e:  # pragma: no cover - depends on the host
    print(f"skipped: {e} (install python3-grpcio and python3-grpc-tools)")
    sys.exit(SKIP)

TIER_NONE, TIER_L1, TIER_L2, TIER_L3 = 0, 1, 2, 3
DTYPES = {"fp8_e4m3": 0, "bf16": 1}
SCALES = {"per_tensor": 0, "per_token_head": 1}


def fail(msg):
    raise AssertionError(msg)


def check(cond, msg):
    if not cond:
        fail(msg)


class Harness:
    def __init__(self, binary, proto_dir):
        self.binary = binary
        self.top = tempfile.mkdtemp(prefix="tkvd", dir="/tmp")  # short: socket paths < 108
        atexit.register(self.cleanup)
        self.daemons = []
        gen = os.path.join(self.top, "gen")
        os.mkdir(gen)
        rc = protoc.main(["protoc", f"-I{proto_dir}", f"--python_out={gen}",
                          f"--grpc_python_out={gen}", os.path.join(proto_dir, "tierkv.proto")])
        check(rc == 0, f"grpc_tools.protoc failed ({rc})")
        sys.path.insert(0, gen)
        import tierkv_pb2
        import tierkv_pb2_grpc
        self.pb = tierkv_pb2
        self.pbg = tierkv_pb2_grpc

    def cleanup(self):
        for d in self.daemons:
            d.kill()
        shutil.rmtree(self.top, ignore_errors=True)

    def daemon(self, name="d", extra=()):
        d = Daemon(self, name, list(extra))
        self.daemons.append(d)
        return d


class Daemon:
    def __init__(self, h, name, extra):
        self.h = h
        self.data_dir = os.path.join(h.top, name + "-data")
        self.run_dir = os.path.join(h.top, name + "-run")
        self.log = os.path.join(h.top, name + ".log")
        self.sock = os.path.join(self.run_dir, "tierkv.sock")
        self.attach_sock = os.path.join(self.run_dir, "attach.sock")
        self.pid_file = os.path.join(self.run_dir, "tierkvd.pid")
        self.extra = extra
        self.proc = None
        self.channel = None
        self.stub = None

    def argv(self):
        return [self.h.binary, "--foreground", "--data-dir", self.data_dir, "--run-dir",
                self.run_dir, "--log-file", self.log, "--http-port", "0"] + self.extra

    def start(self, deadline_s=30.0):
        out = open(self.log + ".stderr", "ab")
        self.proc = subprocess.Popen(self.argv(), stdout=out, stderr=out)
        out.close()
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                fail(f"tierkvd exited with {self.proc.returncode} during start:\n{self.logs()}")
            if os.path.exists(self.sock):
                self.connect()
                try:
                    r = self.stub.Health(self.h.pb.HealthRequest(), timeout=2)
                    if r.status == "serving":
                        return self
                except grpc.RpcError:
                    pass
            time.sleep(0.05)
        fail(f"tierkvd did not serve within {deadline_s}s:\n{self.logs()}")

    def connect(self):
        if self.channel:
            self.channel.close()
        # The client's own limits are raised so that oversize requests reach the daemon,
        # whose limits are the ones under test.
        self.channel = grpc.insecure_channel(
            "unix:" + self.sock,
            options=[("grpc.max_send_message_length", 256 << 20),
                     ("grpc.max_receive_message_length", 256 << 20)])
        self.stub = self.h.pbg.CacheStub(self.channel)

    def logs(self):
        text = ""
        for p in (self.log, self.log + ".stderr"):
            if os.path.exists(p):
                with open(p, errors="replace") as f:
                    text += f.read()[-6000:]
        return text

    def send(self, sig):
        self.proc.send_signal(sig)

    def stop(self, sig=signal.SIGTERM, timeout=60):
        """Sends sig and returns the exit code (kills and fails after timeout)."""
        if self.channel:
            self.channel.close()
            self.channel = None
        self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            fail(f"tierkvd did not stop within {timeout}s after signal {sig}:\n{self.logs()}")

    def kill(self):
        if self.channel:
            self.channel.close()
            self.channel = None
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


# ---- the contract's hashes (docs/design.md) ------------------------------------------------

def fingerprint(layers, kv_heads, head_dim, block_tokens, dtype, scale_mode, model_id):
    m = hashlib.sha256(b"tierkv/geometry/1")
    m.update(struct.pack("<6I", layers, kv_heads, head_dim, block_tokens, DTYPES[dtype],
                         SCALES[scale_mode]))
    m.update(model_id.encode())
    return m.digest()


def key_chain(fp, namespace, tokens, block_tokens):
    prev = hashlib.sha256(b"tierkv/1" + fp + namespace.encode()).digest()
    keys = []
    for i in range(len(tokens) // block_tokens):
        blk = tokens[i * block_tokens:(i + 1) * block_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{block_tokens}I", *blk)).digest()
        keys.append(prev)
    return keys


def payload(seed, index, nbytes):
    """Deterministic block bytes for (prompt seed, block index): gets are checked bit-exact."""
    out = bytearray()
    ctr = 0
    while len(out) < nbytes:
        out += hashlib.sha256(struct.pack("<QQQ", seed, index, ctr)).digest()
        ctr += 1
    return bytes(out[:nbytes])


NUM_EXPECTED_ERRORS = [0]


def expect_status(fn, code, text, what):
    """Calls fn(); it must fail with gRPC status `code` and a message containing text."""
    NUM_EXPECTED_ERRORS[0] += 1
    try:
        fn()
    except grpc.RpcError as e:
        check(e.code() == code, f"{what}: expected {code}, got {e.code()}: {e.details()}")
        check(text in (e.details() or ""), f"{what}: expected '{text}' in '{e.details()}'")
        print(f"  ok  {what}: {e.code().name}: {e.details()}")
        return e
    fail(f"{what}: expected {code}, but the call succeeded")


def metrics(d):
    """The daemon's Prometheus text as {name: value} for unlabelled samples."""
    import urllib.request
    addr = open(os.path.join(d.run_dir, "tierkvd.http")).read().strip()
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and not line.startswith("#") and "{" not in parts[0]:
            out[parts[0]] = float(parts[1])
    return out


def uid_switching_harness(tierkvd, proto_dir):
    """A Harness whose folders every uid may enter, for tests whose clients run as other users
    (the tenant tests). Exits SKIP where switching uid is not possible (not root)."""
    if os.geteuid() != 0:
        print("skipped: switching uid needs root")
        sys.exit(SKIP)
    h = Harness(tierkvd, proto_dir)
    for root, _, _ in os.walk(h.top):
        os.chmod(root, 0o755)
    return h


def main_wrapper(fn):
    try:
        fn()
    except AssertionError as e:
        print(f"FAIL: {e}", file=sys.stderr)
        sys.exit(1)
    print("PASS")
    sys.exit(0)
