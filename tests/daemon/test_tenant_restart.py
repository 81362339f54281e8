#!/usr/bin/python3
"""test_tenant_restart.py - blocks recovered from L3 at start belong to their tenant, on the
real tierkvd with clients in separate processes running as separate users (the test switches
uid, so it needs root: exit 77 elsewhere).

Tenants a (uid 61011) and b (uid 61012), and ops (uid 0, admin). a stores one 8-block prompt;
once it is durable in L3 the daemon stops (SIGTERM) and, the second time, is killed (SIGKILL).
Each time it starts again on the same data folder with the tenants listed in another order
(so a's table index changes: a block's L3 record names its tenant by name, not by index) and
a's quota_l3_blocks = 8. Right after each start, before anyone looked anything up:
  - /metrics counts a's 8 blocks in L3 as a's and none as b's (quotas count them from the start);
  - b, looking up a's prompt, hits nothing; b naming a's namespace is PERMISSION_DENIED; b's Get
    of the lease id a's lookup got is NOT_FOUND;
  - a hits all 8 and reads them back bit-exact;
  - a, at its L3 quota with the recovered blocks alone, stores a fresh 4-block prompt: its L3
    blocks stay at 8 (its own recovered blocks make the room: own evictions are counted) and
    b's stay untouched.

usage: test_tenant_restart.py PATH-TO-TIERKVD PROTO-DIR
       test_tenant_restart.py --child GEN-DIR SOCK FP-HEX ACTION < ARGS-JSON   (internal)
"""
import json
import os
import signal
import subprocess
import sys
import time

UID_A, UID_B = 61011, 61012
NBLK, QUOTA_A_L3 = 8, 8


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
    scope = pb.BlockScope(namespace=args.get("namespace", ""), fingerprint=fp)
    out = {"uid": os.getuid()}
    if action == "store":
        blocks = [bytes.fromhex(b) for b in args["blocks"]]
        out["put"] = s.Put(pb.PutRequest(scope=scope, tokens=args["tokens"], first_block=0,
                                         blocks=blocks), timeout=30).num_stored
    elif action == "read":
        try:
            r = s.Lookup(pb.LookupRequest(scope=scope, tokens=args["tokens"], lease_ttl_ms=60000),
                         timeout=10)
            out["hit"] = r.num_hit_blocks
            out["lease"] = r.lease_id
            out["blocks"] = [b.hex() for b in s.Get(pb.GetRequest(
                lease_id=r.lease_id, first=0, count=r.num_hit_blocks), timeout=30).blocks] \
                if r.num_hit_blocks else []
            if args.get("keep"):
                out["kept"] = True   # the lease stays for the other tenant's guess
            elif r.lease_id:
                s.Release(pb.ReleaseRequest(lease_id=r.lease_id), timeout=10)
        except grpc.RpcError as e:
            out["code"] = e.code().name
            out["details"] = e.details()
    elif action == "release":
        s.Release(pb.ReleaseRequest(lease_id=args["lease"]), timeout=10)
    elif action == "get":
        try:
            s.Get(pb.GetRequest(lease_id=args["lease"], first=0, count=1), timeout=10)
            out["code"] = "OK"
        except grpc.RpcError as e:
            out["code"] = e.code().name
            out["details"] = e.details()
    print(json.dumps(out))
    ch.close()


def run():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tkvd_harness import check, payload, fingerprint, uid_switching_harness
    import urllib.request
    h = uid_switching_harness(sys.argv[1], sys.argv[2])

    def conf(order):
        lines = {"a": f"tenant.a.uid = {UID_A}\ntenant.a.quota_l3_blocks = {QUOTA_A_L3}\n",
                 "b": f"tenant.b.uid = {UID_B}\n",
                 "ops": "tenant.ops.uid = 0\ntenant.ops.admin = on\n"}
        path = os.path.join(h.top, "tenants-" + "".join(order) + ".conf")
        with open(path, "w") as f:
            f.write("".join(lines[t] for t in order))
        return path

    fp = fingerprint(4, 2, 64, 64, "fp8_e4m3", "per_tensor", "tierkv-demo")
    P, bb = 64, 4 * 2 * 64 * 64 * 2   # the demo geometry
    # the first start: a is no quota-holder yet (it is about to fill it)
    d = h.daemon("r", ["--config", conf(("a", "b", "ops")), "--l2-blocks", "64"]).start()

    def open_up():
        for p in (d.run_dir, d.sock):
            os.chmod(p, 0o777)

    open_up()

    def metrics():
        addr = open(os.path.join(d.run_dir, "tierkvd.http")).read().strip()
        text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
        m = {}
        for line in text.splitlines():
            if line.startswith("tierkv_tenant_"):
                key, val = line.rsplit(" ", 1)
                m[key] = float(val)
        return m

    def as_uid(uid, action, args):
        p = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--child",
                              os.path.join(h.top, "gen"), d.sock, fp.hex(), action],
                             user=uid, group=uid, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, cwd="/")
        o, e = p.communicate(json.dumps(args), timeout=120)
        check(p.returncode == 0, f"child {action} as {uid}: rc {p.returncode}\n{e}")
        out = json.loads(o.strip().splitlines()[-1])
        check(out["uid"] == uid, f"child did not run as {uid}")
        return out

    def l3_of(t):
        return metrics().get(f'tierkv_tenant_blocks{{tenant="{t}",tier="l3"}}')

    tokens_a = [(13 * i + 7) % 50000 for i in range(NBLK * P)]
    blocks_a = [payload(61, i, bb) for i in range(NBLK)]
    r = as_uid(UID_A, "store", dict(tokens=tokens_a, blocks=[b.hex() for b in blocks_a]))
    check(r["put"] == NBLK, f"a's put: {r}")
    end = time.monotonic() + 30   # written through to L3 (asynchronously)
    while l3_of("a") != NBLK:
        check(time.monotonic() < end, "a's blocks did not reach L3")
        time.sleep(0.05)
    print(f"  ok  a stored {NBLK} blocks, durable in L3")

    for n, (how, order) in enumerate(((signal.SIGTERM, ("b", "ops", "a")),
                                      (signal.SIGKILL, ("ops", "a", "b")))):
        if how == signal.SIGKILL:
            d.kill()
        else:
            check(d.stop() == 0, f"stop:\n{d.logs()}")
        d.extra = ["--config", conf(order), "--l2-blocks", "64"]
        d.start()
        open_up()
        m = metrics()
        a3, b3 = m['tierkv_tenant_blocks{tenant="a",tier="l3"}'], m['tierkv_tenant_blocks{tenant="b",tier="l3"}']
        check(a3 == NBLK and b3 == 0,
              f"after restart {n + 1} ({how.name}, order {order}): a holds {a3} L3 blocks, b {b3}")
        print(f"  ok  restart {n + 1} ({how.name}, tenants as {', '.join(order)}): a's {a3:.0f} "
              f"recovered blocks are a's from the start, b holds none")
        r = as_uid(UID_B, "read", dict(tokens=tokens_a))
        check(r.get("hit") == 0, f"b hit a's recovered prompt: {r}")
        r = as_uid(UID_B, "read", dict(tokens=tokens_a, namespace="a"))
        check(r.get("code") == "PERMISSION_DENIED", f"b naming a's namespace: {r}")
        ra = as_uid(UID_A, "read", dict(tokens=tokens_a, keep=True))
        # the second time, a's quota made room for its second prompt from this one's blocks
        want = NBLK if n == 0 else ra["hit"]
        check(ra["hit"] == want and ra["hit"] > 0 and
              ra["blocks"] == [b.hex() for b in blocks_a[:want]],
              f"a's recovered blocks: {ra['hit']} hit, bytes equal: "
              f"{ra['blocks'] == [b.hex() for b in blocks_a[:want]]}")
        r = as_uid(UID_B, "get", dict(lease=ra["lease"]))
        check(r["code"] == "NOT_FOUND", f"b's Get of a's lease {ra['lease']}: {r}")
        as_uid(UID_A, "release", dict(lease=ra["lease"])) # pinned blocks could not make room
        print(f"  ok  b misses a's recovered prompt, is refused a's namespace and a's lease "
              f"id; a hits {ra['hit']} bit-exact")
        if n == 0:
            # at its L3 quota with the recovered blocks alone: a fresh prompt evicts its own
            own0 = m['tierkv_tenant_own_evictions_total{tenant="a"}']
            tok = [(17 * i + 3) % 50000 for i in range(4 * P)]
            r = as_uid(UID_A, "store", dict(tokens=tok, blocks=[payload(62, i, bb).hex()
                                                                for i in range(4)]))
            check(r["put"] == 4, f"a's second put: {r}")
            # room is made when the put is admitted; the 4 new blocks reach L3 later
            # (written through asynchronously), so wait for both before reading the count
            end = time.monotonic() + 30
            while True:
                m = metrics()
                if (m['tierkv_tenant_own_evictions_total{tenant="a"}'] >= own0 + 4 and
                        m['tierkv_tenant_blocks{tenant="a",tier="l3"}'] >= QUOTA_A_L3):
                    break
                check(time.monotonic() < end, f"a's quota made no own evictions, or its new "
                      f"blocks did not reach L3: {m}")
                time.sleep(0.05)
            a3 = m['tierkv_tenant_blocks{tenant="a",tier="l3"}']
            own = m['tierkv_tenant_own_evictions_total{tenant="a"}'] - own0
            check(a3 == QUOTA_A_L3, f"a holds {a3} L3 blocks, quota {QUOTA_A_L3}")
            check(m['tierkv_tenant_quota_blocks{tenant="a",tier="l3"}'] == QUOTA_A_L3, "quota")
            print(f"  ok  a at its L3 quota with recovered blocks: a new prompt evicted "
                  f"{own:.0f} of its own, a holds {a3:.0f} L3 blocks")
    rc = d.stop()
    check(rc == 0, f"exit {rc}:\n{d.logs()}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tkvd_harness import main_wrapper
        main_wrapper(run)
