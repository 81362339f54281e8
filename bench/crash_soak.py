#!/usr/bin/python3
"""crash_soak.py - kill -9 / restart cycles of a real tierkvd under put/get load (docs/perf.md).

Each cycle starts the daemon on the same data folder, runs a load of Puts of new prompts, Gets
of earlier ones (every byte checked) and Flushes, and kills the daemon with SIGKILL at a random
moment of it. A prompt is *reported durable* when a Flush that was sent after its Put was
answered returned OK. After each restart, every prompt of the last cycle and a sample of the
older ones are looked up and read back; at the end, all of them:

  lost  = blocks reported durable that a lookup no longer finds
  wrong = blocks served whose bytes differ from what was put (durable or not)

Both must be 0. Prints a table and writes JSON (--json FILE).

usage: crash_soak.py TIERKVD PROTO-DIR [--cycles N] [--seed S] [--json FILE]
"""
import argparse
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests", "daemon"))
from tkvd_harness import Harness, fingerprint, grpc, payload  # noqa: E402

GEO = ["--num-layers", "1", "--num-kv-heads", "1", "--head-dim", "64", "--block-tokens", "16",
       "--l2-blocks", "256", "--max-blocks-per-rpc", "8", "--no-http", "--store-workers", "2",
       "--cq-threads", "1", "--rpc-workers", "4", "--drain-timeout-ms", "0"]
P, BLOCKS_PER_PROMPT = 16, 4


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("tierkvd")
    ap.add_argument("proto")
    ap.add_argument("--cycles", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--json")
    a = ap.parse_args()
    rng = random.Random(a.seed)
    h = Harness(a.tierkvd, a.proto)
    pb = h.pb
    d = h.daemon("soak", GEO)
    fp = fingerprint(1, 1, 64, 16, "fp8_e4m3", "per_tensor", "tierkv-demo")
    bb = 1 * 2 * 16 * 1 * 64

    prompts = {}        # id -> {"tokens": [...], "durable": bool, "acked": bool}
    next_id = [0]
    stats = {"cycles": 0, "puts_acked": 0, "flushes_ok": 0, "gets_checked_blocks": 0,
             "durable_blocks": 0, "lost_blocks": 0, "wrong_blocks": 0, "restart_s": [],
             "checked_blocks": 0}

    def tokens_of(pid):
        r = random.Random(pid * 7919 + 13)
        return [r.randrange(50000) for _ in range(BLOCKS_PER_PROMPT * P)]

    def scope():
        return pb.BlockScope(fingerprint=fp)

    def check_prompt(stub, pid, must_hit):
        """Looks pid up and reads its hit blocks; counts lost and wrong blocks."""
        t = prompts[pid]["tokens"]
        r = stub.Lookup(pb.LookupRequest(scope=scope(), tokens=t, lease_ttl_ms=10000), timeout=10)
        hit = r.num_hit_blocks
        if must_hit and hit < BLOCKS_PER_PROMPT:
            stats["lost_blocks"] += BLOCKS_PER_PROMPT - hit
        if hit:
            g = stub.Get(pb.GetRequest(lease_id=r.lease_id, first=0, count=hit), timeout=10)
            for i, blk in enumerate(g.blocks):
                stats["checked_blocks"] += 1
                if blk != payload(pid, i, bb):
                    stats["wrong_blocks"] += 1
            stub.Release(pb.ReleaseRequest(lease_id=r.lease_id), timeout=10)

    def load(stub, stop):
        """Puts new prompts, Gets old ones, Flushes; until the daemon dies or stop is set."""
        pending = []
        try:
            while not stop.is_set():
                x = rng.random()
                if x < 0.6:
                    pid = next_id[0]
                    next_id[0] += 1
                    prompts[pid] = {"tokens": tokens_of(pid), "durable": False, "acked": False}
                    blocks = [payload(pid, i, bb) for i in range(BLOCKS_PER_PROMPT)]
                    stub.Put(pb.PutRequest(scope=scope(), tokens=prompts[pid]["tokens"],
                                           first_block=0, blocks=blocks), timeout=10)
                    prompts[pid]["acked"] = True
                    stats["puts_acked"] += 1
                    pending.append(pid)
                elif x < 0.85 and prompts:
                    before = stats["checked_blocks"]
                    pid = rng.choice(list(prompts))
                    check_prompt(stub, pid, prompts[pid]["durable"])
                    stats["gets_checked_blocks"] += stats["checked_blocks"] - before
                else:
                    sent = list(pending)
                    stub.Flush(pb.FlushRequest(), timeout=30)
                    for pid in sent:
                        prompts[pid]["durable"] = True
                    pending = [p for p in pending if p not in sent]
                    stats["flushes_ok"] += 1
        except grpc.RpcError:
            pass  # the daemon was killed under us

    last_cycle = []
    t_start = time.monotonic()
    for cycle in range(a.cycles):
        t0 = time.monotonic()
        d.start()
        stats["restart_s"].append(time.monotonic() - t0)
        # after a restart: the previous cycle's prompts, and a sample of older ones
        sample = set(last_cycle) | set(rng.sample(sorted(prompts), min(8, len(prompts))))
        for pid in sorted(sample):
            check_prompt(d.stub, pid, prompts[pid]["durable"])
        first = next_id[0]
        stop = threading.Event()
        th = threading.Thread(target=load, args=(d.stub, stop))
        th.start()
        time.sleep(rng.uniform(0.02, 0.4))
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait()
        stop.set()
        th.join()
        d.channel.close()
        d.channel = None
        last_cycle = list(range(first, next_id[0]))
        stats["cycles"] += 1
        if (cycle + 1) % 50 == 0:
            print(f"  cycle {cycle + 1}: {len(prompts)} prompts, lost {stats['lost_blocks']}, "
                  f"wrong {stats['wrong_blocks']}", flush=True)

    # the end: every prompt, from a clean start
    d.start()
    for pid in sorted(prompts):
        check_prompt(d.stub, pid, prompts[pid]["durable"])
    rc = d.stop()
    durable = sum(1 for p in prompts.values() if p["durable"])
    stats["durable_blocks"] = durable * BLOCKS_PER_PROMPT
    rs = sorted(stats.pop("restart_s"))
    stats["restart_median_s"] = rs[len(rs) // 2] if rs else 0
    stats["wall_s"] = time.monotonic() - t_start
    stats["final_stop_rc"] = rc
    print(f"{'cycles':>8} {'puts':>8} {'flushes':>8} {'durable blk':>12} {'checked blk':>12} "
          f"{'lost':>6} {'wrong':>6} {'restart p50':>12}")
    print(f"{stats['cycles']:>8} {stats['puts_acked']:>8} {stats['flushes_ok']:>8} "
          f"{stats['durable_blocks']:>12} {stats['checked_blocks']:>12} {stats['lost_blocks']:>6} "
          f"{stats['wrong_blocks']:>6} {stats['restart_median_s'] * 1000:>10.0f}ms")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(stats, f, indent=1)
    ok = stats["lost_blocks"] == 0 and stats["wrong_blocks"] == 0 and rc == 0
    print("PASS" if ok else "FAIL")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
