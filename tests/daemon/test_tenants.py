#!/usr/bin/python3
"""test_tenants.py - tenants that cannot see each other, on the real tierkvd with clients in
separate processes running as separate users (the test switches uid, so it needs root: exit 77
elsewhere).

Tenant a (uid 61001) stores a prompt; tenant b (uid 61002) then tries every path to it: the
same prompt in its own namespace (a miss: keys are salted per tenant), a forged namespace on
Lookup/Put/Evict (PERMISSION_DENIED), a's lease id on Get/Prefetch/Release/CostCheck (NOT_FOUND,
as if it did not exist), an attached client's id (PERMISSION_DENIED), ListBlocks/Flush and an
evict of everything (admin only). Through the attach socket b gets its own L2 region only: the
test maps it and reads it at every page offset of the whole mapping and at the offsets a was
told, and finds none of a's bytes (while a, mapping its own region, finds its blocks at its
offsets, and b finds its own at its offsets: the scan could see them); the descriptor refuses
a writable mapping. A uid that is no tenant is refused everything but Health, attach included.
Every refusal is counted in tierkv_tenant_denied_total and logged at most once a second per
tenant with the number held back (a burst of 40 forged calls: the lines and the counts they
carry add up to the refusals). Afterwards a's blocks are all still there, bit-exact.

usage: test_tenants.py PATH-TO-TIERKVD PROTO-DIR
       test_tenants.py --child GEN-DIR SOCK ATTACH-SOCK FP-HEX ACTION < ARGS-JSON   (internal)
"""
import json
import os
import socket
import struct
import subprocess
import sys

UID_A, UID_B, UID_NONE = 61001, 61002, 61003
ATTACH_MAGIC, ATTACH_VERSION = 0x41564B54, 1


# ---- the child: one client process, run as some uid -------------------------------------------

def child(argv):
    gen, sock, attach_sock, fp_hex, action = argv
    args = sys.stdin.read()
    sys.path.insert(0, gen)
    import grpc
    import tierkv_pb2 as pb
    import tierkv_pb2_grpc as pbg
    args = json.loads(args)
    fp = bytes.fromhex(fp_hex)
    out = {"uid": os.getuid()}
    ch = grpc.insecure_channel("unix:" + sock, options=[("grpc.max_receive_message_length", 64 << 20)])
    s = pbg.CacheStub(ch)

    def scope(ns="", client_id=0):
        return pb.BlockScope(namespace=ns, fingerprint=fp, client_id=client_id)

    def call(name, fn):
        try:
            r = fn()
            out[name] = {"ok": True, "r": r}
        except grpc.RpcError as e:
            out[name] = {"ok": False, "code": e.code().name, "msg": e.details()}

    tokens = args.get("tokens", [])
    if action == "store":
        blocks = [bytes.fromhex(b) for b in args["blocks"]]
        call("put", lambda: s.Put(pb.PutRequest(scope=scope(), tokens=tokens, first_block=0,
                                                blocks=blocks), timeout=10).num_stored)
        call("lookup", lambda: s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens,
                                                         lease_ttl_ms=60000), timeout=5))
        r = out["lookup"]
        if r["ok"]:
            out["lookup"] = {"ok": True, "hit": r["r"].num_hit_blocks, "lease": r["r"].lease_id}
            lease = r["r"].lease_id
            call("get", lambda: [b.hex() for b in s.Get(pb.GetRequest(
                lease_id=lease, first=0, count=len(blocks)), timeout=10).blocks])
    elif action == "map":
        out["map"] = map_region(attach_sock, fp, s, scope, args)
    elif action == "burst":
        for _ in range(args["n"]):
            call("forged", lambda: s.Lookup(pb.LookupRequest(scope=scope("a"), tokens=tokens),
                                            timeout=5).num_hit_blocks)
        out.pop("forged", None)
    elif action == "probe":
        lease = args["lease"]
        call("lookup_own", lambda: s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens),
                                            timeout=5).num_hit_blocks)
        call("lookup_forged", lambda: s.Lookup(pb.LookupRequest(scope=scope("a"), tokens=tokens),
                                               timeout=5).num_hit_blocks)
        call("put_forged", lambda: s.Put(pb.PutRequest(
            scope=scope("a"), tokens=tokens[:len(tokens) // 2 // args["P"] * args["P"]],
            first_block=0, blocks=[b"\0" * args["block_bytes"]]), timeout=5).num_stored)
        call("evict_forged", lambda: s.Evict(pb.EvictRequest(scope=scope("a"), tokens=tokens,
                                                             tier=2), timeout=5).num_evicted)
        call("evict_own", lambda: s.Evict(pb.EvictRequest(scope=scope(), tokens=tokens, tier=2),
                                          timeout=5).num_evicted)
        call("evict_all", lambda: s.Evict(pb.EvictRequest(tier=2), timeout=5).num_evicted)
        call("get_lease", lambda: len(s.Get(pb.GetRequest(lease_id=lease, first=0, count=1),
                                            timeout=5).blocks))
        call("prefetch_lease", lambda: s.Prefetch(pb.PrefetchRequest(lease_id=lease, tier=2),
                                                  timeout=5).ticket)
        call("cost_lease", lambda: str(s.CostCheck(pb.CostCheckRequest(lease_id=lease,
                                                                       prefill_ms=1.0), timeout=5)))
        call("release_lease", lambda: str(s.Release(pb.ReleaseRequest(lease_id=lease), timeout=5)))
        call("client_id", lambda: s.Lookup(pb.LookupRequest(
            scope=scope(client_id=args["client_id"]), tokens=tokens), timeout=5).num_hit_blocks)
        call("list", lambda: len(list(s.ListBlocks(pb.ListBlocksRequest(), timeout=5).blocks)))
        call("flush", lambda: str(s.Flush(pb.FlushRequest(), timeout=5)))
        call("health", lambda: s.Health(pb.HealthRequest(), timeout=5).status)
        out["attach"] = attach(attach_sock, fp)
    for k, v in out.items():
        if isinstance(v, dict) and v.get("ok") and not isinstance(v.get("r"), (int, str, list, type(None))):
            v["r"] = str(v["r"])
    print(json.dumps(out))
    ch.close()


def hello(path, fp):
    """One attach hello; returns (the reply's bytes, the descriptors it carried, the socket)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    s.settimeout(5)
    s.connect(path)
    s.send(struct.pack("<II32sII", ATTACH_MAGIC, ATTACH_VERSION, fp, 0, os.getpid()))
    msg, anc, _, _ = s.recvmsg(4096, socket.CMSG_SPACE(4 * 4))
    fds = []
    for level, typ, data in anc:
        if level == socket.SOL_SOCKET and typ == socket.SCM_RIGHTS:
            fds += list(struct.unpack(f"{len(data) // 4}i", data[:len(data) // 4 * 4]))
    return msg, fds, s


def attach_fd(path, fp):
    """One attach hello; returns (reply fields, descriptor or None, socket kept open)."""
    msg, fds, s = hello(path, fp)
    magic, status, client_id, l2_bytes, block_bytes, block_tokens, flags = \
        struct.unpack_from("<IiQQQII", msg)
    rep = {"status": status, "client_id": client_id, "l2_bytes": l2_bytes, "flags": flags,
           "block_bytes": block_bytes}
    return rep, (fds[0] if fds else None), s


def map_region(path, fp, stub, scope, args):
    """Attaches, maps the descriptor read-only, checks the caller's own blocks at the offsets
    its lookup gives, then looks for the foreign blocks everywhere in the mapping: at every
    page offset, at the offsets their owner was given, by a search for each one's first 256
    bytes, and past the end. Returns what it found."""
    import mmap
    import tierkv_pb2 as pb
    rep, fd, sk = attach_fd(path, fp)
    out = {"reply": rep}
    if fd is None:
        return out
    size = rep["l2_bytes"]
    out["fstat_bytes"] = os.fstat(fd).st_size
    try:
        mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        out["writable"] = True
    except OSError:
        out["writable"] = False
    mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    os.close(fd)
    bb = rep["block_bytes"]
    own = [bytes.fromhex(b) for b in args["own_blocks"]]
    r = stub.Lookup(pb.LookupRequest(scope=scope(client_id=rep["client_id"]),
                                     tokens=args["own_tokens"], lease_ttl_ms=60000), timeout=5)
    offs = [b.l2_offset for b in r.blocks if b.in_l2]
    out["own_offsets"] = offs
    out["own_in_l2"] = len(offs)
    out["own_ok"] = len(offs) == len(own) and all(
        mm[o:o + bb] == own[i] for i, o in enumerate(offs))
    foreign = [bytes.fromhex(b) for b in args["foreign"]]
    fset = set(foreign)
    hits, tried = 0, 0
    for o in list(range(0, size, 4096)) + list(args.get("foreign_offsets", [])):
        tried += 1
        if mm[o:o + bb] in fset:
            hits += 1
    for f in foreign:
        tried += 1
        if mm.find(f[:256]) != -1:
            hits += 1
    for o in (size, size + 4096, 2 * size, (1 << 40)):
        tried += 1
        if len(mm[o:o + bb]) != 0:
            hits += 1
    out["foreign_hits"], out["offsets_tried"] = hits, tried
    mm.close()
    sk.close()
    return out


def attach(path, fp):
    """One attach hello; returns the reply's status/message and whether a descriptor came."""
    msg, fds, s = hello(path, fp)
    for fd in fds:
        os.close(fd)
    s.close()
    magic, status, client_id = struct.unpack_from("<IiQ", msg)
    text = msg[40:168].split(b"\0")[0].decode(errors="replace")
    return {"status": status, "client_id": client_id, "fds": len(fds), "msg": text}


# ---- the test ---------------------------------------------------------------------------------

def run():
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from tkvd_harness import check, payload, fingerprint, uid_switching_harness
    h = uid_switching_harness(sys.argv[1], sys.argv[2])
    pb = h.pb
    conf = os.path.join(h.top, "tenants.conf")
    with open(conf, "w") as f:
        f.write(f"tenant.a.uid = {UID_A}\ntenant.b.uid = {UID_B}\n"
                "tenant.ops.uid = 0\ntenant.ops.admin = on\ntenant.ops.map_pool = on\n")
    d = h.daemon("t", ["--config", conf, "--l2-blocks", "64"]).start()
    for p in (d.run_dir, d.sock, d.attach_sock):
        os.chmod(p, 0o777)
    fp = fingerprint(4, 2, 64, 64, "fp8_e4m3", "per_tensor", "tierkv-demo")
    P, bb = 64, d.stub.Stats(pb.StatsRequest(), timeout=5).geometry.block_bytes
    tokens = [(7 * i + 3) % 50000 for i in range(4 * P)]
    blocks = [payload(33, i, bb) for i in range(4)]

    def as_uid(uid, action, args):
        r = subprocess.run([sys.executable, os.path.abspath(__file__), "--child",
                            os.path.join(h.top, "gen"), d.sock, d.attach_sock, fp.hex(), action],
                           input=json.dumps(args), user=uid, group=uid, capture_output=True,
                           text=True, timeout=60, cwd="/")
        check(r.returncode == 0, f"child {action} as {uid}: rc {r.returncode}\n{r.stderr}")
        out = json.loads(r.stdout.strip().splitlines()[-1])
        check(out["uid"] == uid, f"child did not run as {uid}")
        return out

    # a stores and reads back its prompt
    a = as_uid(UID_A, "store", {"tokens": tokens, "blocks": [b.hex() for b in blocks]})
    check(a["put"] == {"ok": True, "r": 4}, f"a's put: {a['put']}")
    check(a["lookup"]["ok"] and a["lookup"]["hit"] == 4, f"a's lookup: {a['lookup']}")
    check(a["get"]["ok"] and a["get"]["r"] == [b.hex() for b in blocks], "a's get bytes")
    lease_a = a["lookup"]["lease"]
    print(f"tenant a stored 4 blocks, lease {lease_a}")

    # an attached client of the ops tenant (root): its client id must not serve b
    ops = attach(d.attach_sock, fp)
    check(ops["status"] == 0 and ops["fds"] == 1, f"ops attach: {ops}")

    b = as_uid(UID_B, "probe", {"tokens": tokens, "lease": lease_a, "client_id": ops["client_id"],
                                "P": P, "block_bytes": bb})

    def refused(name, code, text=""):
        r = b[name]
        check(not r["ok"] and r["code"] == code and text in r["msg"], f"b {name}: {r}")
        print(f"  ok  b {name}: {r['code']}: {r['msg']}")

    check(b["lookup_own"] == {"ok": True, "r": 0}, f"b sees a's prefix: {b['lookup_own']}")
    print("  ok  b's lookup of a's prompt in its own namespace: 0 blocks")
    refused("lookup_forged", "PERMISSION_DENIED", "tenant 'b'")
    refused("put_forged", "PERMISSION_DENIED", "tenant 'b'")
    refused("evict_forged", "PERMISSION_DENIED", "tenant 'b'")
    check(b["evict_own"] == {"ok": True, "r": 0}, f"b's evict reached a's blocks: {b['evict_own']}")
    refused("evict_all", "PERMISSION_DENIED", "admin")
    for n in ("get_lease", "prefetch_lease", "cost_lease", "release_lease"):
        refused(n, "NOT_FOUND", "not found")
    refused("client_id", "PERMISSION_DENIED", "another tenant")
    refused("list", "PERMISSION_DENIED", "admin")
    refused("flush", "PERMISSION_DENIED", "admin")
    check(b["health"] == {"ok": True, "r": "serving"}, f"b health: {b['health']}")
    check(b["attach"]["status"] == 0 and b["attach"]["fds"] == 1, f"b attach: {b['attach']}")
    print("  ok  b attaches (its own L2 region)")

    # the mappings: each tenant's region holds its own blocks and nothing of the other's
    stride = (bb + 4095) // 4096 * 4096
    region = 64 // 3 * stride                      # three tenants, no quotas: equal regions
    a_map = as_uid(UID_A, "map", {"own_tokens": tokens, "own_blocks": [x.hex() for x in blocks],
                                  "foreign": []})["map"]
    check(a_map["reply"]["status"] == 0 and a_map["own_ok"] and a_map["own_in_l2"] == 4,
          f"a does not find its own blocks in its mapping: {a_map}")
    tokens_b = [(13 * i + 1) % 50000 for i in range(2 * P)]
    blocks_b = [payload(55, i, bb) for i in range(2)]
    sb = as_uid(UID_B, "store", {"tokens": tokens_b, "blocks": [x.hex() for x in blocks_b]})
    check(sb["put"] == {"ok": True, "r": 2}, f"b's put: {sb['put']}")
    b_map = as_uid(UID_B, "map", {"own_tokens": tokens_b, "own_blocks": [x.hex() for x in blocks_b],
                                  "foreign": [x.hex() for x in blocks],
                                  "foreign_offsets": a_map["own_offsets"]})["map"]
    check(b_map["reply"]["status"] == 0 and b_map["own_ok"], f"b's own blocks: {b_map}")
    check(b_map["reply"]["l2_bytes"] == region and b_map["fstat_bytes"] == region,
          f"b's mapping is not its region of {region} bytes: {b_map}")
    check(b_map["foreign_hits"] == 0, f"b's mapping holds a's bytes: {b_map}")
    check(not b_map["writable"] and not a_map["writable"], "a tenant's descriptor maps writable")
    check(b_map["reply"]["flags"] & 1 == 0, "b was offered the L1 pool")
    print(f"  ok  b maps {region} bytes (its region of a {64 * stride}-byte pool): its own 2 blocks "
          f"at its offsets, none of a's bytes over {b_map['offsets_tried']} offsets and searches "
          f"(a's offsets {a_map['own_offsets']} included); a finds its 4 blocks in its own")

    n = as_uid(UID_NONE, "probe", {"tokens": tokens, "lease": lease_a, "client_id": 0, "P": P,
                                   "block_bytes": bb})
    for name in ("lookup_own", "get_lease", "list"):
        check(not n[name]["ok"] and n[name]["code"] == "PERMISSION_DENIED" and
              "no tenant" in n[name]["msg"], f"no-tenant {name}: {n[name]}")
    check(n["attach"]["status"] != 0 and n["attach"]["fds"] == 0, f"no-tenant attach: {n['attach']}")
    print("  ok  a uid that is no tenant is refused (gRPC and attach)")

    # a's blocks are untouched: its lease still pins them and reads them bit-exact
    a2 = as_uid(UID_A, "store", {"tokens": tokens, "blocks": [b.hex() for b in blocks]})
    check(a2["put"] == {"ok": True, "r": 0}, f"a's blocks were lost: {a2['put']}")
    check(a2["lookup"]["hit"] == 4 and a2["get"]["r"] == [x.hex() for x in blocks],
          "a's blocks after b's attempts")
    print("  ok  a's 4 blocks still cached and bit-exact")

    import urllib.request
    addr = open(os.path.join(d.run_dir, "tierkvd.http")).read().strip()
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    denied = {}
    for line in text.splitlines():
        if line.startswith("tierkv_tenant_denied_total{"):
            name = line.split('"')[1]
            denied[name] = float(line.split()[-1])
    # b: 3 forged namespaces, evict-all, 4 lease ids, a client id, list, flush = 11
    check(denied.get("b") == 11, f"b's refusals counted: {denied}")
    check(denied.get("") == 14 and denied.get("a") == 0, f"refusals counted: {denied}")
    print(f"  ok  tierkv_tenant_denied_total {denied}")

    # the refusal log line: per tenant, at most one a second, carrying the count held back
    import re
    import time
    time.sleep(1.1)
    t0 = time.monotonic()
    as_uid(UID_B, "burst", {"tokens": tokens, "n": 40})
    time.sleep(1.1)
    as_uid(UID_B, "burst", {"tokens": tokens, "n": 1})   # its line tells what was held back
    elapsed = time.monotonic() - t0
    text = urllib.request.urlopen(f"http://{addr}/metrics", timeout=5).read().decode()
    total_b = [float(x.split()[-1]) for x in text.splitlines()
               if x.startswith('tierkv_tenant_denied_total{tenant="b"}')][0]
    lines = [l for l in d.logs().splitlines() if "refused a call of tenant b " in l]
    held = [int(m.group(1)) for l in lines
            for m in [re.search(r"\((\d+) more refusals since the last line\)", l)] if m]
    check(len(held) == len(lines), f"refusal lines without a count: {lines}")
    check(len(lines) + sum(held) == total_b, f"b's refusal lines ({len(lines)}, holding back "
          f"{sum(held)}) do not add up to its {total_b:.0f} refusals")
    check(len(lines) <= 2 + elapsed + 2, f"{len(lines)} refusal lines of b in ~{elapsed:.1f} s")
    check(any("refused a call of tenant (none)" in l for l in d.logs().splitlines()),
          "no refusal line for the no-tenant uid (another tenant's refusals hid it)")
    print(f"  ok  {total_b:.0f} refusals of b in {len(lines)} log lines (the lines hold back "
          f"{sum(held)}); the no-tenant uid got its own line")
    rc = d.stop()
    check(rc == 0, f"exit {rc}:\n{d.logs()}")


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(sys.argv[2:])
    else:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from tkvd_harness import main_wrapper
        main_wrapper(run)
