#!/usr/bin/python3
"""test_lifecycle.py - tierkvd's process life: SIGTERM drains and exits 0 with the blocks
durable (a restart on the same data folder hits them in L3, bit-exact); SIGHUP reopens the
log; the pid file refuses a second daemon; SIGINT stops too; the detached (default) mode
returns once the daemon serves; HTTP's bound port is published in the run folder.

usage: test_lifecycle.py PATH-TO-TIERKVD PROTO-DIR
"""
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tkvd_harness import (TIER_L3, Harness, check, grpc, main_wrapper, payload)  # noqa: E402


def wait_for(cond, what, deadline_s=10.0):
    end = time.monotonic() + deadline_s
    while not cond():
        check(time.monotonic() < end, f"timed out waiting for {what}")
        time.sleep(0.02)


def gone(pid):
    """True once pid has exited (a zombie counts: it is not our child to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def run():
    h = Harness(sys.argv[1], sys.argv[2])
    pb = h.pb
    d = h.daemon("life").start()
    s = d.stub
    g = s.Stats(pb.StatsRequest(), timeout=5).geometry
    P, BB = g.block_tokens, g.block_bytes

    def scope():
        return pb.BlockScope(fingerprint=g.fingerprint)

    # ---- HTTP address file ------------------------------------------------------------------
    http_file = os.path.join(d.run_dir, "tierkvd.http")
    check(os.path.exists(http_file), "no tierkvd.http in the run folder")
    addr = open(http_file).read().strip()
    with urllib.request.urlopen(f"http://{addr}/metrics", timeout=5) as resp:
        check(resp.status == 200, f"/metrics answered {resp.status}")
    print(f"http ok at {addr}")

    # ---- a second daemon on the same run folder is refused ------------------------------------
    r = subprocess.run(d.argv(), capture_output=True, text=True, timeout=30)
    check(r.returncode == 3 and "another tierkvd" in r.stderr and str(d.proc.pid) in r.stderr,
          f"second daemon: exit {r.returncode}: {r.stderr}")
    print(f"pid file ok: {r.stderr.strip()}")

    # ---- SIGHUP reopens the log (logrotate's move + HUP) -----------------------------------------
    rotated = d.log + ".1"
    os.rename(d.log, rotated)
    d.send(signal.SIGHUP)
    wait_for(lambda: os.path.exists(d.log) and "log reopened" in open(d.log).read(),
             "a new log file after SIGHUP")
    check(s.Health(pb.HealthRequest(), timeout=5).status == "serving", "not serving after SIGHUP")
    print("SIGHUP ok")

    # ---- put, stop while a put stream runs, restart: blocks durable -----------------------------
    prompts = []
    for seed in range(1, 9):
        toks = [(seed * 1000003 + i * 7919) % 50000 for i in range(4 * P)]
        blocks = [payload(seed, i, BB) for i in range(4)]
        r = s.Put(pb.PutRequest(scope=scope(), tokens=toks, blocks=blocks), timeout=10)
        check(r.num_stored == 4, f"put {seed}: {r}")
        prompts.append((toks, blocks))

    # Calls during SIGTERM: a background client keeps calling until the daemon goes away.
    # Each call ends OK with a correct answer, or is refused (UNAVAILABLE once the transport
    # says GOAWAY; CANCELLED for a call that reached gRPC core in the instant between its
    # shutdown and the GOAWAY, before any handler saw it) -- never a hang or another error.
    # A call caught in that instant learns its fate when the daemon's connections close, after
    # the store has finished its write-backs: seconds under a sanitizer on a loaded machine,
    # so the per-call deadline is generous and a hang shows as the thread outliving the join.
    errors = []
    calls = [0]

    def hammer():
        ch = grpc.insecure_channel("unix:" + d.sock)
        stub = h.pbg.CacheStub(ch)
        toks, _ = prompts[0]
        for _ in range(100000):
            try:
                rr = stub.Lookup(pb.LookupRequest(scope=scope(), tokens=toks), timeout=45)
                if rr.num_hit_blocks != 4:
                    errors.append(f"lookup during stop hit {rr.num_hit_blocks} of 4 blocks")
                stub.Release(pb.ReleaseRequest(lease_id=rr.lease_id), timeout=45)
                calls[0] += 1
            except grpc.RpcError as e:
                if e.code() not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                    errors.append(f"{e.code()}: {e.details()}")
                break
        ch.close()

    t = threading.Thread(target=hammer)
    t.start()
    time.sleep(0.3)
    rc = d.stop(signal.SIGTERM)
    t.join(60)
    check(not t.is_alive(), "a client hung across the daemon's stop")
    check(rc == 0, f"exit {rc} after SIGTERM:\n{d.logs()}")
    check(not errors, f"calls during the stop failed with: {errors}")
    check(not os.path.exists(d.sock) and not os.path.exists(d.pid_file), "socket/pid file left")
    log = open(d.log).read()
    check("store closed" in log and "tierkvd stopped" in log, f"stop not logged:\n{log[-2000:]}")
    check(calls[0] > 0, "no call succeeded before the stop")
    print(f"SIGTERM ok: exit 0 with {calls[0]} lookups answered meanwhile, sockets removed")

    d.start()
    s = d.stub
    for seed, (toks, blocks) in enumerate(prompts, 1):
        r = s.Lookup(pb.LookupRequest(scope=scope(), tokens=toks), timeout=5)
        check(r.num_hit_blocks == 4 and all(b.tier == TIER_L3 for b in r.blocks),
              f"after restart, prompt {seed}: {r}")
        got = s.Get(pb.GetRequest(lease_id=r.lease_id), timeout=10)
        check(list(got.blocks) == blocks, f"after restart, prompt {seed}: bytes differ")
        s.Release(pb.ReleaseRequest(lease_id=r.lease_id), timeout=5)
    print("restart ok: 32 blocks hit in L3, bit-exact")

    rc = d.stop(signal.SIGINT)
    check(rc == 0, f"exit {rc} after SIGINT:\n{d.logs()}")
    print("SIGINT ok")

    # ---- the data folder keeps its geometry: another one is refused at start ------------------
    r = subprocess.run(d.argv() + ["--num-layers", "8"], capture_output=True, text=True, timeout=60)
    check(r.returncode == 2, f"start with another geometry: exit {r.returncode}")
    check("holds blocks of another geometry" in open(d.log).read(), "no geometry message in the log")
    print("geometry of the data folder enforced")

    # ---- detached mode: returns after start-up, pid file names the daemon ----------------------
    argv = [a for a in d.argv() if a != "--foreground"]
    r = subprocess.run(argv, capture_output=True, text=True, timeout=60)
    check(r.returncode == 0, f"detached start: exit {r.returncode}: {r.stderr}")
    pid = int(open(d.pid_file).read())
    try:
        d.connect()
        check(d.stub.Health(pb.HealthRequest(), timeout=5).status == "serving", "detached: not serving")
        os.kill(pid, signal.SIGTERM)
        wait_for(lambda: gone(pid), "the detached daemon to exit", 60)
        check(not os.path.exists(d.pid_file), "detached: pid file left behind")
    finally:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    d.channel.close()
    d.channel = None
    print(f"detached mode ok (pid {pid})")


if __name__ == "__main__":
    main_wrapper(run)
