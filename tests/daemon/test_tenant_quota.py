#!/usr/bin/python3
"""test_tenant_quota.py - per-tenant L2 regions, L3 quotas and guaranteed shares on the real
tierkvd, with clients in separate processes running as separate users (the test switches uid,
so it needs root: exit 77 elsewhere).

L2 holds 64 blocks, L3 160. Tenant a (uid 61001) has quota_l2_blocks = 24 (its own L2 region)
and quota_l3_blocks = 60; tenant c (uid 61003) a 4-block region; tenants b (uid 61002,
guaranteed_l3_blocks = 8) and ops (uid 0, no quota) share the rest, 18 blocks each. b stores
one 8-block prompt. Then a and ops put new 4-block prompts as fast as they can, together far
more than L2 and L3 hold. While they run, the test samples tierkv_tenant_blocks from /metrics:
a never holds more than 24 L2 or 60 L3 blocks, b never fewer than its 8 in L3. Afterwards b's
8 blocks are all still in L2 and L3 and read back bit-exact, a's own evictions and b's guarded
L3 skips were counted. a then puts 12 fresh prompts (twice its region) and promotes those
gone down to L3 back to L2 (Prefetch, wait): the promotions happen and a still never holds
more than its 24 L2 blocks. c pins its 4 blocks and
bursts puts: all refused, and the refusal log lines (at most one a second for c, each telling
how many it held back) add up to c's refused blocks. The config refuses a guarantee larger
than the quota (L2 and L3) and L2 quotas larger than L2.

usage: test_tenant_quota.py PATH-TO-TIERKVD PROTO-DIR
       test_tenant_quota.py --child GEN-DIR SOCK FP-HEX ACTION < ARGS-JSON   (internal)
"""
import json
import os
import subprocess
import sys
import time

UID_A, UID_B, UID_C = 61001, 61002, 61003
L2, QUOTA_A, GUAR_B = 64, 24, 8
L3, QUOTA_A_L3, QUOTA_C = 160, 60, 4


def child(argv):
    gen, sock, fp_hex, action = argv
    args = json.loads(sys.stdin.read())
    sys.path.insert(0, gen)
    import grpc
    import tierkv_pb2 as pb
    import tierkv_pb2_grpc as pbg
    fp = bytes.fromhex(fp_hex)
    ch = grpc.insecure_channel("unix:" + sock, options=[("grpc.max_receive_message_length", 64 << 20)])
    s = pbg.CacheStub(ch)
    scope = pb.BlockScope(namespace="", fingerprint=fp)
    out = {"uid": os.getuid()}
    P, bb = args["P"], args["block_bytes"]
    if action == "store":
        blocks = [bytes.fromhex(b) for b in args["blocks"]]
        out["put"] = s.Put(pb.PutRequest(scope=scope, tokens=args["tokens"], first_block=0,
                                         blocks=blocks), timeout=30).num_stored
    elif action == "read":
        r = s.Lookup(pb.LookupRequest(scope=scope, tokens=args["tokens"], lease_ttl_ms=60000),
                     timeout=10)
        out["hit"] = r.num_hit_blocks
        out["blocks"] = [b.hex() for b in s.Get(pb.GetRequest(
            lease_id=r.lease_id, first=0, count=r.num_hit_blocks), timeout=30).blocks] \
            if r.num_hit_blocks else []
        s.Release(pb.ReleaseRequest(lease_id=r.lease_id), timeout=10)
    elif action == "promote":
        # fresh prompts, more than the tenant's L2 region holds (so the first ones have gone
        # down to L3 only), then, oldest first, those with hit blocks only in L3 are promoted
        # back to L2, one prompt at a time
        blocks = [bytes([args["seed"] & 0xFF, i]) * (bb // 2) for i in range(4)]
        prompts = [[(args["seed"] * 1000003 + i * 4099 + k) % 50000 for k in range(4 * P)]
                   for i in range(args["n"])]
        for tokens in prompts:
            s.Put(pb.PutRequest(scope=scope, tokens=tokens, first_block=0, blocks=blocks),
                  timeout=60)
        promoted, tried = 0, 0
        for tokens in prompts:
            r = s.Lookup(pb.LookupRequest(scope=scope, tokens=tokens, lease_ttl_ms=60000),
                         timeout=10)
            missing = sum(1 for b in r.blocks if not b.in_l2)
            if r.num_hit_blocks and missing:
                tried += 1
                try:
                    w = s.Prefetch(pb.PrefetchRequest(lease_id=r.lease_id, tier=2, wait=True),
                                   timeout=30)
                    promoted += sum(1 for b in w.blocks if b.in_l2) - (len(r.blocks) - missing)
                except grpc.RpcError:
                    pass
            if r.lease_id:
                s.Release(pb.ReleaseRequest(lease_id=r.lease_id), timeout=10)
            if tried >= args["max"]:
                break
        out["tried"], out["promoted"] = tried, promoted
    elif action == "pin_and_burst":
        # fills the tenant's region, pins it with a lease, then puts that cannot find room
        tokens = [(77 * k + 9) % 50000 for k in range(4 * P)]
        blocks = [bytes([9, i]) * (bb // 2) for i in range(4)]
        out["put"] = s.Put(pb.PutRequest(scope=scope, tokens=tokens, first_block=0,
                                         blocks=blocks), timeout=30).num_stored
        r = s.Lookup(pb.LookupRequest(scope=scope, tokens=tokens, lease_ttl_ms=60000), timeout=10)
        out["pinned"] = sum(1 for b in r.blocks if b.in_l2)
        import time as _t
        refused = 0
        for n in (args["n"], 1):
            for i in range(n):
                t2 = [(args["seed"] * 7919 + i * 131 + k) % 50000 for k in range(4 * P)]
                try:
                    refused += 4 - s.Put(pb.PutRequest(scope=scope, tokens=t2, first_block=0,
                                                       blocks=blocks), timeout=60).num_stored
                except grpc.RpcError as e:
                    refused += 4 if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED else 0
            _t.sleep(1.1)  # the last put's line tells what the burst held back
            args["seed"] += 1
        out["refused"] = refused
        s.Release(pb.ReleaseRequest(lease_id=r.lease_id), timeout=10)
    elif action == "load":
        stored = 0
        blocks = [bytes([args["seed"] & 0xFF, i]) * (bb // 2) for i in range(4)]
        for i in range(args["n"]):
            tokens = [(args["seed"] * 1000003 + i * 4099 + k) % 50000 for k in range(4 * P)]
            stored += s.Put(pb.PutRequest(scope=scope, tokens=tokens, first_block=0,
                                          blocks=blocks), timeout=60).num_stored
        out["stored"] = stored
    print(json.dumps(out))
    ch.close()


def run():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tkvd_harness import check, payload, fingerprint, uid_switching_harness
    import urllib.request
    h = uid_switching_harness(sys.argv[1], sys.argv[2])
    pb = h.pb

    # a guarantee beyond the quota is a config error, said clearly
    bad = os.path.join(h.top, "bad.conf")
    with open(bad, "w") as f:
        f.write(f"tenant.a.uid = {UID_A}\ntenant.a.quota_l2_blocks = 4\n"
                "tenant.a.guaranteed_l2_blocks = 5\n")
    r = subprocess.run([sys.argv[1], "--config", bad, "--check-config"], capture_output=True,
                       text=True, timeout=30)
    check(r.returncode != 0 and "exceeds its quota_l2_blocks" in r.stdout + r.stderr,
          f"bad quota accepted: rc {r.returncode} {r.stdout} {r.stderr}")
    print("  ok  guaranteed_l2_blocks > quota_l2_blocks refused")
    for text, why in ((f"tenant.a.uid = {UID_A}\ntenant.a.quota_l3_blocks = 4\n"
                       "tenant.a.guaranteed_l3_blocks = 5\n", "exceeds its quota_l3_blocks"),
                      (f"tenant.a.uid = {UID_A}\ntenant.a.quota_l2_blocks = 40\n"
                       f"tenant.b.uid = {UID_B}\ntenant.b.quota_l2_blocks = 40\n",
                       "more than L2 holds")):
        with open(bad, "w") as f:
            f.write(text)
        r = subprocess.run([sys.argv[1], "--config", bad, "--l2-blocks", str(L2),
                            "--check-config"], capture_output=True, text=True, timeout=30)
        check(r.returncode != 0 and why in r.stdout + r.stderr,
              f"bad config accepted: rc {r.returncode} {r.stdout} {r.stderr}")
        print(f"  ok  refused: {why}")

    conf = os.path.join(h.top, "tenants.conf")
    with open(conf, "w") as f:
        f.write(f"tenant.a.uid = {UID_A}\ntenant.a.quota_l2_blocks = {QUOTA_A}\n"
                f"tenant.a.quota_l3_blocks = {QUOTA_A_L3}\n"
                f"tenant.b.uid = {UID_B}\ntenant.b.guaranteed_l2_blocks = {GUAR_B}\n"
                f"tenant.b.guaranteed_l3_blocks = {GUAR_B}\n"
                f"tenant.c.uid = {UID_C}\ntenant.c.quota_l2_blocks = {QUOTA_C}\n"
                "tenant.ops.uid = 0\ntenant.ops.admin = on\n")
    fp = fingerprint(4, 2, 64, 64, "fp8_e4m3", "per_tensor", "tierkv-demo")
    P, bb = 64, 4 * 2 * 64 * 64 * 2   # the demo geometry: fp8 K and V, 4 layers
    d = h.daemon("q", ["--config", conf, "--l2-blocks", str(L2),
                       "--l3-capacity-bytes", str(L3 * bb)]).start()
    for p in (d.run_dir, d.sock):
        os.chmod(p, 0o777)
    check(d.stub.Stats(pb.StatsRequest(), timeout=5).geometry.block_bytes == bb, "block size")
    addr = open(os.path.join(d.run_dir, "tierkvd.http")).read().strip()

    def metrics():
        text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
        m = {}
        for line in text.splitlines():
            if line.startswith("tierkv_tenant_"):
                key, val = line.rsplit(" ", 1)
                m[key] = float(val)
        return m

    def child_cmd(uid, action):
        return dict(args=[sys.executable, os.path.abspath(__file__), "--child",
                          os.path.join(h.top, "gen"), d.sock, fp.hex(), action],
                    user=uid, group=uid, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE, text=True, cwd="/")

    def as_uid(uid, action, args):
        p = subprocess.Popen(**child_cmd(uid, action))
        o, e = p.communicate(json.dumps(args), timeout=120)
        check(p.returncode == 0, f"child {action} as {uid}: rc {p.returncode}\n{e}")
        out = json.loads(o.strip().splitlines()[-1])
        check(out["uid"] == uid, f"child did not run as {uid}")
        return out

    tokens_b = [(11 * i + 5) % 50000 for i in range(GUAR_B * P)]
    blocks_b = [payload(44, i, bb) for i in range(GUAR_B)]
    geo = {"P": P, "block_bytes": bb}
    r = as_uid(UID_B, "store", dict(geo, tokens=tokens_b, blocks=[b.hex() for b in blocks_b]))
    check(r["put"] == GUAR_B, f"b's put: {r}")
    check(metrics().get('tierkv_tenant_blocks{tenant="b",tier="l2"}') == GUAR_B, "b's blocks")
    end = time.monotonic() + 30   # written through to L3 (asynchronously)
    while metrics().get('tierkv_tenant_blocks{tenant="b",tier="l3"}') != GUAR_B:
        check(time.monotonic() < end, "b's blocks did not reach L3")
        time.sleep(0.05)

    # a and ops load at full speed, together 10x L2
    loads = []
    for uid, seed in ((UID_A, 1), (0, 2)):
        p = subprocess.Popen(**child_cmd(uid, "load"))
        p.stdin.write(json.dumps(dict(geo, seed=seed, n=L2 * 10 // 4 // 2)))
        p.stdin.close()
        p.stdin = None  # sent: communicate() below only reads
        loads.append(p)
    max_a, max_a3, min_b3, samples = 0.0, 0.0, float(GUAR_B), 0
    while any(p.poll() is None for p in loads):
        m = metrics()
        max_a = max(max_a, m['tierkv_tenant_blocks{tenant="a",tier="l2"}'])
        max_a3 = max(max_a3, m['tierkv_tenant_blocks{tenant="a",tier="l3"}'])
        min_b3 = min(min_b3, m['tierkv_tenant_blocks{tenant="b",tier="l3"}'])
        samples += 1
        check(max_a <= QUOTA_A, f"tenant a holds {max_a} L2 blocks, quota {QUOTA_A}")
        check(max_a3 <= QUOTA_A_L3, f"tenant a holds {max_a3} L3 blocks, quota {QUOTA_A_L3}")
        check(min_b3 == GUAR_B, f"b's guaranteed L3 blocks were evicted: {min_b3} left")
        time.sleep(0.01)
    stored = []
    for p in loads:
        o, e = p.communicate(timeout=60)
        check(p.returncode == 0, f"load child: rc {p.returncode}\n{e}")
        stored.append(json.loads(o.strip().splitlines()[-1])["stored"])
    m = metrics()
    a_l2 = m['tierkv_tenant_blocks{tenant="a",tier="l2"}']
    b_l2 = m['tierkv_tenant_blocks{tenant="b",tier="l2"}']
    check(a_l2 <= QUOTA_A, f"tenant a holds {a_l2} L2 blocks after the load")
    check(stored[0] > QUOTA_A, f"a stored only {stored[0]} blocks: the quota should evict, not stop it")
    print(f"  ok  a stored {stored[0]} blocks, ops {stored[1]}; a held at most {max_a:.0f} L2 "
          f"blocks over {samples} samples (quota {QUOTA_A}), {a_l2:.0f} at the end")
    a_l3 = m['tierkv_tenant_blocks{tenant="a",tier="l3"}']
    b_l3 = m['tierkv_tenant_blocks{tenant="b",tier="l3"}']
    ops_l3 = m['tierkv_tenant_blocks{tenant="ops",tier="l3"}']
    # (ops, without a quota or share, may evict a's L3 blocks once a stops: only the bound holds)
    check(a_l3 <= QUOTA_A_L3 and max_a3 > 0, f"tenant a holds {a_l3} L3 blocks after the load")
    check(a_l3 + b_l3 + ops_l3 <= L3, f"L3 holds {a_l3 + b_l3 + ops_l3} blocks, capacity {L3}")
    print(f"  ok  a held at most {max_a3:.0f} L3 blocks (quota {QUOTA_A_L3}), {a_l3:.0f} at the "
          f"end; ops {ops_l3:.0f}; L3 {a_l3 + b_l3 + ops_l3:.0f} of {L3}")
    check(b_l2 == GUAR_B, f"b's guaranteed blocks were evicted from L2: {b_l2} left")
    check(b_l3 == GUAR_B, f"b's guaranteed blocks were evicted from L3: {b_l3} left")
    check(m['tierkv_tenant_own_evictions_total{tenant="a"}'] > 0, f"a's own evictions: {m}")
    check(m['tierkv_tenant_guarded_skips_total{tenant="b"}'] > 0, f"b's guarded skips: {m}")
    check(m['tierkv_tenant_quota_blocks{tenant="a",tier="l2"}'] == QUOTA_A, "a's quota metric")
    check(m['tierkv_tenant_quota_blocks{tenant="a",tier="l3"}'] == QUOTA_A_L3, "a's L3 quota")
    check(m['tierkv_tenant_guaranteed_blocks{tenant="b",tier="l3"}'] == GUAR_B, "b's L3 share")
    check(m['tierkv_tenant_guaranteed_blocks{tenant="b",tier="l2"}'] == (L2 - QUOTA_A - QUOTA_C) // 2,
          "b's L2 region is all its own")
    r = as_uid(UID_B, "read", dict(geo, tokens=tokens_b))
    check(r["hit"] == GUAR_B and r["blocks"] == [b.hex() for b in blocks_b],
          f"b's blocks after the load: {r['hit']} hit")
    skips = m['tierkv_tenant_guarded_skips_total{tenant="b"}']
    own = m['tierkv_tenant_own_evictions_total{tenant="a"}']
    print(f"  ok  b's {GUAR_B} guaranteed blocks all still in L2 and bit-exact "
          f"({skips:.0f} guarded skips, {own:.0f} own evictions of a)")

    # promotions L3 -> L2 are held to the region/quota too
    before = d.stub.Stats(pb.StatsRequest(), timeout=5).promotions
    p = subprocess.Popen(**child_cmd(UID_A, "promote"))
    p.stdin.write(json.dumps(dict(geo, seed=3, n=QUOTA_A // 4 * 2, max=QUOTA_A // 4 * 2)))
    p.stdin.close()
    p.stdin = None
    max_a = 0.0
    while p.poll() is None:
        max_a = max(max_a, metrics()['tierkv_tenant_blocks{tenant="a",tier="l2"}'])
        check(max_a <= QUOTA_A, f"tenant a holds {max_a} L2 blocks while promoting")
        time.sleep(0.005)
    o, e = p.communicate(timeout=60)
    check(p.returncode == 0, f"promote child: rc {p.returncode}\n{e}")
    pr = json.loads(o.strip().splitlines()[-1])
    after = d.stub.Stats(pb.StatsRequest(), timeout=5).promotions
    max_a = max(max_a, metrics()['tierkv_tenant_blocks{tenant="a",tier="l2"}'])
    check(pr["promoted"] > 0 and after > before, f"no promotion happened: {pr}")
    check(max_a <= QUOTA_A, f"tenant a holds {max_a} L2 blocks after promoting")
    print(f"  ok  a promoted {pr['promoted']} blocks of {pr['tried']} prompts from L3 back to L2 "
          f"and held at most {max_a:.0f} L2 blocks (quota {QUOTA_A})")

    # refusals: c's region pinned full; a burst of puts, all refused, logged at most 1/s
    import re
    t0 = time.monotonic()
    r = as_uid(UID_C, "pin_and_burst", dict(geo, seed=5, n=30))
    elapsed = time.monotonic() - t0
    check(r["put"] == QUOTA_C and r["pinned"] == QUOTA_C, f"c's pinned region: {r}")
    m = metrics()
    refused_c = m['tierkv_tenant_refused_blocks_total{tenant="c"}']
    # every block of the 31 puts was refused; the store counts the blocks that found no slot
    # (a put's blocks after the first that finds none are not tried: they would hang under it)
    check(r["refused"] == 31 * 4 and 31 <= refused_c <= 31 * 4, f"c's refusals: {r}, {refused_c}")
    lines = [l for l in d.logs().splitlines() if "tenant c: " in l and "refused" in l]
    counted = 0
    for l in lines:
        mm = re.search(r": (\d+) L2 blocks refused .*\((\d+) more refused since the last line\)", l)
        check(mm is not None, f"refusal line without counts: {l}")
        counted += int(mm.group(1)) + int(mm.group(2))
    check(1 <= len(lines) <= elapsed + 2, f"{len(lines)} refusal lines of c in {elapsed:.1f} s")
    check(counted == refused_c, f"c's refusal lines count {counted}, not {refused_c}")
    print(f"  ok  c: {refused_c:.0f} blocks refused with its region pinned, in {len(lines)} log "
          f"lines over {elapsed:.1f} s that count them all")
    rc = d.stop()
    check(rc == 0, f"exit {rc}:\n{d.logs()}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tkvd_harness import main_wrapper
        main_wrapper(run)
