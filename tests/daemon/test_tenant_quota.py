#!/usr/bin/python3
"""test_tenant_quota.py - per-tenant L2 quotas and guaranteed shares on the real tierkvd, with
clients in separate processes running as separate users (the test switches uid, so it needs
root: exit 77 elsewhere).

L2 holds 64 blocks. Tenant b (uid 61002, guaranteed_l2_blocks = 8) stores one 8-block prompt.
Then tenant a (uid 61001, quota_l2_blocks = 24) and tenant ops (uid 0, no quota) both put new
4-block prompts as fast as they can, together far more than L2 holds. While they run, the test
samples tierkv_tenant_blocks from /metrics: a never holds more than 24 L2 blocks. Afterwards
b's 8 blocks are all still in L2 (tierkv_tenant_blocks{tenant="b",tier="l2"} == 8) and read
back bit-exact, a's own evictions and b's guarded skips were counted, and the config refuses
a guarantee larger than the quota.

usage: test_tenant_quota.py PATH-TO-TIERKVD PROTO-DIR
       test_tenant_quota.py --child GEN-DIR SOCK FP-HEX ACTION < ARGS-JSON   (internal)
"""
import json
import os
import subprocess
import sys
import time

UID_A, UID_B = 61001, 61002
L2, QUOTA_A, GUAR_B = 64, 24, 8


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

    conf = os.path.join(h.top, "tenants.conf")
    with open(conf, "w") as f:
        f.write(f"tenant.a.uid = {UID_A}\ntenant.a.quota_l2_blocks = {QUOTA_A}\n"
                f"tenant.b.uid = {UID_B}\ntenant.b.guaranteed_l2_blocks = {GUAR_B}\n"
                "tenant.ops.uid = 0\ntenant.ops.admin = on\n")
    d = h.daemon("q", ["--config", conf, "--l2-blocks", str(L2)]).start()
    for p in (d.run_dir, d.sock):
        os.chmod(p, 0o777)
    fp = fingerprint(4, 2, 64, 64, "fp8_e4m3", "per_tensor", "tierkv-demo")
    P, bb = 64, d.stub.Stats(pb.StatsRequest(), timeout=5).geometry.block_bytes
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

    # a and ops load at full speed, together 10x L2
    loads = []
    for uid, seed in ((UID_A, 1), (0, 2)):
        p = subprocess.Popen(**child_cmd(uid, "load"))
        p.stdin.write(json.dumps(dict(geo, seed=seed, n=L2 * 10 // 4 // 2)))
        p.stdin.close()
        p.stdin = None  # sent: communicate() below only reads
        loads.append(p)
    max_a, samples = 0.0, 0
    while any(p.poll() is None for p in loads):
        m = metrics()
        max_a = max(max_a, m['tierkv_tenant_blocks{tenant="a",tier="l2"}'])
        samples += 1
        check(max_a <= QUOTA_A, f"tenant a holds {max_a} L2 blocks, quota {QUOTA_A}")
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
    check(b_l2 == GUAR_B, f"b's guaranteed blocks were evicted from L2: {b_l2} left")
    check(m['tierkv_tenant_own_evictions_total{tenant="a"}'] > 0, f"a's own evictions: {m}")
    check(m['tierkv_tenant_guarded_skips_total{tenant="b"}'] > 0, f"b's guarded skips: {m}")
    check(m['tierkv_tenant_quota_blocks{tenant="a",tier="l2"}'] == QUOTA_A, "a's quota metric")
    check(m['tierkv_tenant_guaranteed_blocks{tenant="b",tier="l2"}'] == GUAR_B, "b's share metric")
    r = as_uid(UID_B, "read", dict(geo, tokens=tokens_b))
    check(r["hit"] == GUAR_B and r["blocks"] == [b.hex() for b in blocks_b],
          f"b's blocks after the load: {r['hit']} hit")
    skips = m['tierkv_tenant_guarded_skips_total{tenant="b"}']
    own = m['tierkv_tenant_own_evictions_total{tenant="a"}']
    print(f"  ok  b's {GUAR_B} guaranteed blocks all still in L2 and bit-exact "
          f"({skips:.0f} guarded skips, {own:.0f} own evictions of a)")
    rc = d.stop()
    check(rc == 0, f"exit {rc}:\n{d.logs()}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tkvd_harness import main_wrapper
        main_wrapper(run)
