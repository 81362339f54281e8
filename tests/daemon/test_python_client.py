#!/usr/bin/python3
"""test_python_client.py - drives every tierkv.v1.Cache method of the real tierkvd from a
Python client generated at test time from proto/tierkv.proto (a gRPC stack written
elsewhere), then the bad inputs; the daemon must answer each with a clear status and keep
serving. Also the attach socket: memfd by SCM_RIGHTS, mapped bytes equal to Get's, and
leases released when the attach connection closes.

usage: test_python_client.py PATH-TO-TIERKVD PROTO-DIR
"""
import mmap
import os
import random
import signal
import socket
import struct
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tkvd_harness import (NUM_EXPECTED_ERRORS, TIER_L1, TIER_L2, TIER_L3, Harness, check,  # noqa: E402
                          expect_status, fingerprint, grpc, key_chain, main_wrapper, metrics,
                          payload)

SC = grpc.StatusCode


def run():
    h = Harness(sys.argv[1], sys.argv[2])
    pb = h.pb
    # 16 MiB of L2 = 256 blocks of the default geometry: small, and enough for this test.
    d = h.daemon("py", ["--l2-bytes", "16M"]).start()
    s = d.stub

    # ---- Health, Stats, and the geometry contract -------------------------------------------
    hr = s.Health(pb.HealthRequest(), timeout=5)
    check(hr.status == "serving" and hr.version, f"health: {hr}")
    st = s.Stats(pb.StatsRequest(), timeout=5)
    g = st.geometry
    fp = fingerprint(g.num_layers, g.num_kv_heads, g.head_dim, g.block_tokens, g.kv_dtype,
                     g.scale_mode, g.model_id)
    check(g.fingerprint == fp, "Stats.geometry.fingerprint differs from the documented formula")
    check((g.num_layers, g.num_kv_heads, g.head_dim, g.block_tokens) == (4, 2, 64, 64),
          f"embedded default geometry changed: {g}")
    P, BB = g.block_tokens, g.block_bytes
    check(BB == 4 * 2 * 64 * 2 * 64, f"block_bytes {BB}")
    print(f"geometry ok: model {g.model_id}, block {BB} bytes, {P} tokens")

    def scope(ns="", fpr=fp, client_id=0):
        return pb.BlockScope(namespace=ns, fingerprint=fpr, client_id=client_id)

    rng = random.Random(7)
    tokens = [rng.randrange(1, 50000) for _ in range(5 * P + 10)]  # 5 full blocks + a tail
    SEED = 11

    # ---- Lookup (miss), Put, duplicate Put, Lookup (hit) ------------------------------------
    r = s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens), timeout=5)
    check(r.num_hit_blocks == 0 and r.lease_id == 0 and r.num_query_blocks == 5, f"cold lookup: {r}")
    blocks = [payload(SEED, i, BB) for i in range(5)]
    r = s.Put(pb.PutRequest(scope=scope(), tokens=tokens, first_block=0, blocks=blocks), timeout=10)
    check(r.num_stored == 5, f"put: {r}")
    r = s.Put(pb.PutRequest(scope=scope(), tokens=tokens[:5 * P], first_block=3, blocks=blocks[3:]),
              timeout=10)
    check(r.num_stored == 0 and r.num_duplicate == 2, f"duplicate put: {r}")
    r = s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens), timeout=5)
    check(r.num_hit_blocks == 5 and r.num_hit_tokens == 5 * P and r.lease_id, f"lookup: {r}")
    check(len(r.blocks) == 5 and all(b.in_l2 for b in r.blocks), f"lookup locs: {r.blocks}")
    lease = r.lease_id
    print(f"put + lookup ok: lease {lease}")

    # A prefix of the prompt hits its prefix; another namespace hits nothing.
    r = s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens[:2 * P + 5]), timeout=5)
    check(r.num_hit_blocks == 2, f"prefix lookup: {r}")
    s.Release(pb.ReleaseRequest(lease_id=r.lease_id), timeout=5)
    r = s.Lookup(pb.LookupRequest(scope=scope(ns="tenant-b"), tokens=tokens), timeout=5)
    check(r.num_hit_blocks == 0 and r.lease_id == 0, f"namespace isolation: {r}")

    # ---- Prefetch (wait) and Get bit-exact ---------------------------------------------------
    r = s.Prefetch(pb.PrefetchRequest(lease_id=lease, tier=TIER_L2, wait=True, timeout_ms=10000),
                   timeout=15)
    check(r.done and len(r.blocks) == 5 and all(b.in_l2 for b in r.blocks), f"prefetch: {r}")
    r = s.Get(pb.GetRequest(lease_id=lease), timeout=10)
    check(list(r.blocks) == blocks, "get: bytes differ from what was put")
    r = s.Get(pb.GetRequest(lease_id=lease, first=2, count=2), timeout=10)
    check(list(r.blocks) == blocks[2:4], "get 2..3: bytes differ")
    print("prefetch + get ok (bit-exact)")

    # ---- Alloc / WriteSlot / Commit ------------------------------------------------------------
    tokens7 = tokens[:5 * P] + [rng.randrange(1, 50000) for _ in range(2 * P)]
    r = s.Alloc(pb.AllocRequest(scope=scope(), num_blocks=3, tier=TIER_L2), timeout=5)
    check(r.alloc_id and len(r.offsets) == 3 and len(set(r.offsets)) == 3, f"alloc: {r}")
    check(all(o % BB == 0 for o in r.offsets), f"alloc offsets not block-aligned: {list(r.offsets)}")
    alloc = r.alloc_id
    new_blocks = [payload(SEED, 5, BB), payload(SEED, 6, BB)]
    for i, b in enumerate(new_blocks):
        s.WriteSlot(pb.WriteSlotRequest(alloc_id=alloc, index=i, payload=b), timeout=5)
    r = s.Commit(pb.CommitRequest(scope=scope(), alloc_id=alloc, tokens=tokens7, first_block=5,
                                  num_blocks=2), timeout=10)
    check(r.num_stored == 2 and r.num_duplicate == 0, f"commit: {r}")
    expect_status(lambda: s.WriteSlot(pb.WriteSlotRequest(alloc_id=alloc, index=0, payload=new_blocks[0]),
                                      timeout=5), SC.NOT_FOUND, "", "write_slot after commit")
    r = s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens7), timeout=5)
    check(r.num_hit_blocks == 7, f"lookup after commit: {r}")
    lease7 = r.lease_id
    r = s.Get(pb.GetRequest(lease_id=lease7, first=5), timeout=10)
    check(list(r.blocks) == new_blocks, "get of committed blocks differs")
    # An allocation that is released (aborted) publishes nothing.
    r = s.Alloc(pb.AllocRequest(scope=scope(), num_blocks=1), timeout=5)
    s.Release(pb.ReleaseRequest(alloc_id=r.alloc_id), timeout=5)
    expect_status(lambda: s.Release(pb.ReleaseRequest(alloc_id=r.alloc_id), timeout=5),
                  SC.NOT_FOUND, "", "second abort of an allocation")
    print("alloc / write_slot / commit ok")

    # ---- ListBlocks: the daemon's keys are the documented chain ------------------------------
    r = s.ListBlocks(pb.ListBlocksRequest(), timeout=10)
    want = set(key_chain(fp, "", tokens7, P))
    got = {b.key for b in r.blocks}
    check(r.total == 7 and got == want, f"list: total {r.total}; keys match: {got == want}")
    check(all(b.state == "ready" for b in r.blocks), "list: a block is not ready")
    r = s.ListBlocks(pb.ListBlocksRequest(limit=3), timeout=10)
    check(len(r.blocks) == 3 and r.total == 7, f"list limit: {len(r.blocks)} / {r.total}")

    # ---- Stats ------------------------------------------------------------------------------------
    st = s.Stats(pb.StatsRequest(), timeout=5)
    l2 = [t for t in st.tiers if t.tier == TIER_L2]
    check(st.lookups >= 5 and st.hit_blocks >= 14 and st.hit_tokens >= 14 * P, f"stats: {st}")
    check(l2 and l2[0].blocks == 7 and l2[0].capacity_blocks == 256, f"stats L2: {l2}")
    check(st.put_blocks >= 5 and st.leases_active >= 2 and st.policy, f"stats: {st}")
    print(f"stats ok: lookups {st.lookups}, hit blocks {st.hit_blocks}, p50 {st.lookup_p50_us:.1f} us")

    # ---- Flush, Evict (pinned, then free), L3 round trip --------------------------------------
    s.Flush(pb.FlushRequest(), timeout=30)
    r = s.ListBlocks(pb.ListBlocksRequest(tier=TIER_L3), timeout=10)
    check(r.total == 7, f"after flush, L3 holds {r.total} of 7 blocks")
    r = s.Evict(pb.EvictRequest(tier=TIER_L2), timeout=30)
    check(r.num_pinned >= 7 and r.num_evicted == 0, f"evict with leases held: {r}")
    s.Release(pb.ReleaseRequest(lease_id=lease), timeout=5)
    s.Release(pb.ReleaseRequest(lease_id=lease7), timeout=5)
    expect_status(lambda: s.Release(pb.ReleaseRequest(lease_id=lease), timeout=5), SC.NOT_FOUND,
                  "", "second release of a lease")
    r = s.Evict(pb.EvictRequest(tier=TIER_L2), timeout=30)
    check(r.num_evicted == 7 and r.num_pinned == 0, f"evict: {r}")
    r = s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens7), timeout=5)
    check(r.num_hit_blocks == 7 and all(b.tier == TIER_L3 and not b.in_l2 for b in r.blocks),
          f"lookup after evict: {r}")
    lease = r.lease_id
    # CostCheck: every block must come up from L3 (no GPU tier here: the target is L2).
    r = s.CostCheck(pb.CostCheckRequest(lease_id=lease, prefill_ms=1e6), timeout=5)
    check(r.blocks_from_l3 == 7 and r.blocks_in_tier == 0 and r.restore_ms > 0 and r.use_cache,
          f"cost check, blocks in L3: {r}")
    r = s.CostCheck(pb.CostCheckRequest(lease_id=lease, prefill_ms=r.restore_ms / 2), timeout=5)
    check(not r.use_cache, f"cost check, prefill cheaper than the restore: {r}")
    expect_status(lambda: s.CostCheck(pb.CostCheckRequest(lease_id=lease, prefill_ms=-1),
                                      timeout=5), SC.INVALID_ARGUMENT, "prefill_ms",
                  "cost check with a negative prefill estimate")
    r = s.Get(pb.GetRequest(lease_id=lease), timeout=10)  # read from L3
    check(list(r.blocks) == blocks + new_blocks, "get from L3 differs")
    r = s.Prefetch(pb.PrefetchRequest(lease_id=lease, tier=TIER_L2, wait=True), timeout=15)
    check(r.done and all(b.in_l2 for b in r.blocks), f"prefetch from L3: {r}")
    r = s.Get(pb.GetRequest(lease_id=lease, first=6, count=1), timeout=10)
    check(r.blocks[0] == new_blocks[1], "get after promotion differs")
    r = s.CostCheck(pb.CostCheckRequest(lease_id=lease, prefill_ms=1.0), timeout=5)
    check(r.blocks_in_tier == 7 and r.restore_ms == 0 and r.use_cache, f"cost check in L2: {r}")
    # Evicting one prompt's blocks by tokens.
    s.Release(pb.ReleaseRequest(lease_id=lease), timeout=5)
    r = s.Evict(pb.EvictRequest(tier=TIER_L2, scope=scope(), tokens=tokens7[:2 * P]), timeout=30)
    check(r.num_evicted == 2, f"evict by tokens: {r}")
    print("flush / evict / L3 round trip ok")

    # ---- Verify (server streaming) ---------------------------------------------------------------
    msgs = list(s.Verify(pb.VerifyRequest(), timeout=60))
    check(msgs and msgs[-1].done == msgs[-1].total and msgs[-1].total >= 7 and msgs[-1].bad == 0,
          f"verify: {msgs[-1] if msgs else 'no messages'}")
    print(f"verify ok: {msgs[-1].total} blocks, {len(msgs)} progress messages")

    # ---- the attach socket -------------------------------------------------------------------------
    check_attach(d, pb, fp, tokens7, blocks + new_blocks, P, BB, scope)

    # ---- bad inputs: each a clear status; the daemon keeps serving ------------------------------
    check_bad_inputs(d, pb, fp, tokens7, blocks, P, BB, scope)

    hr = s.Health(pb.HealthRequest(), timeout=5)
    check(hr.status == "serving", f"health after bad inputs: {hr}")

    # ---- the daemon's own counters, as the HTTP side exports them -------------------------------
    m = metrics(d)
    # Every refused call is counted, except the oversize one that the transport refuses before
    # any handler sees it.
    n_err = NUM_EXPECTED_ERRORS[0] - 1
    check(m.get("tierkv_rpc_errors_total", 0) >= n_err,
          f"rpc_errors_total {m.get('tierkv_rpc_errors_total')} < {n_err} refused calls")
    for _ in range(5):
        s.Health(pb.HealthRequest(), timeout=5)
    m2 = metrics(d)
    check(m2["tierkv_rpcs_total"] == m["tierkv_rpcs_total"] + 5,
          f"rpcs_total went {m['tierkv_rpcs_total']} -> {m2['tierkv_rpcs_total']} over 5 calls")
    check(m.get("tierkv_clients_connected", -1) == 0 and m.get("tierkv_clients_total", 0) >= 2,
          f"clients: {m.get('tierkv_clients_connected')} / {m.get('tierkv_clients_total')}")
    print(f"metrics ok: {m['tierkv_rpcs_total']:.0f} rpcs, {m['tierkv_rpc_errors_total']:.0f} errors")
    rc = d.stop()
    check(rc == 0, f"tierkvd exit {rc} after SIGTERM:\n{d.logs()}")
    check(not os.path.exists(d.sock) and not os.path.exists(d.pid_file),
          "socket or pid file left behind")


# Attaches, prints its client_id, then waits to be killed.
KILLED_CLIENT = '''
import os, socket, struct, sys, time
c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
c.connect(sys.argv[1])
c.sendall(struct.pack("=II32sII", 0x41564b54, 1, bytes.fromhex(sys.argv[2]), 0, os.getpid()))
msg, fds, _, _ = socket.recv_fds(c, 4096, 1)
print(struct.unpack("=IiQ", msg[:16])[2], flush=True)
time.sleep(60)
'''

HELLO = struct.Struct("=II32sII")
REPLY = struct.Struct("=IiQQQII128s")
MAGIC = 0x41564b54


def attach(d, fp, magic=MAGIC, version=1):
    c = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    c.connect(d.attach_sock)
    c.sendall(HELLO.pack(magic, version, fp, 0, os.getpid()))
    msg, fds, _, _ = socket.recv_fds(c, 4096, 1)
    check(len(msg) == REPLY.size, f"attach reply has {len(msg)} bytes")
    return c, REPLY.unpack(msg), fds


def check_attach(d, pb, fp, tokens, all_blocks, P, BB, scope):
    s = d.stub
    # A wrong fingerprint or magic is refused with a reason and no fd.
    c, rep, fds = attach(d, bytes(32))
    check(rep[1] == -6 and not fds and b"geometry mismatch" in rep[7], f"bad fp attach: {rep}")
    c.close()
    c, rep, fds = attach(d, fp, magic=0x1234)
    check(rep[1] == -1 and not fds and b"bad magic" in rep[7], f"bad magic attach: {rep}")
    c.close()

    c, rep, fds = attach(d, fp)
    _, status, client_id, l2_bytes, block_bytes, block_tokens, _, _ = rep
    check(status == 0 and client_id and len(fds) == 1, f"attach: {rep}")
    check(block_bytes == BB and block_tokens == P and l2_bytes >= 256 * BB, f"attach sizes: {rep}")
    pool = mmap.mmap(fds[0], l2_bytes, mmap.MAP_SHARED, mmap.PROT_READ)
    os.close(fds[0])
    check(s.Stats(pb.StatsRequest(), timeout=5).clients_connected == 1, "clients_connected != 1")

    # The lease of an attached client: its bytes are readable in the mapped pool.
    s.Evict(pb.EvictRequest(tier=TIER_L2), timeout=30)
    r = s.Lookup(pb.LookupRequest(scope=scope(client_id=client_id), tokens=tokens), timeout=5)
    check(r.num_hit_blocks == 7, f"attached lookup: {r}")
    lease = r.lease_id
    r = s.Prefetch(pb.PrefetchRequest(lease_id=lease, wait=True), timeout=15)
    for i, b in enumerate(r.blocks):
        check(b.in_l2, f"block {i} not in L2 after prefetch")
        check(pool[b.l2_offset:b.l2_offset + BB] == all_blocks[i], f"mapped block {i} differs")
    print(f"attach ok: client {client_id}, {l2_bytes} bytes mapped, 7 blocks read from the pool")

    # Closing the attach connection releases the client's leases (the daemon notices the
    # close on its attach thread: poll, with a deadline, without touching the lease).
    c.close()
    end = time.monotonic() + 10
    while True:
        try:
            s.Get(pb.GetRequest(lease_id=lease, count=1), timeout=5)
        except grpc.RpcError as e:
            check(e.code() == SC.NOT_FOUND, f"get after detach: {e.code()}: {e.details()}")
            break
        check(time.monotonic() < end, "the lease survived its client's detach for 10 s")
        time.sleep(0.02)
    while s.Stats(pb.StatsRequest(), timeout=5).clients_connected != 0:
        check(time.monotonic() < end, "clients_connected stayed nonzero after the detach")
        time.sleep(0.02)
    pool.close()
    # A client_id that is not attached (any more) is refused.
    expect_status(lambda: s.Lookup(pb.LookupRequest(scope=scope(client_id=client_id), tokens=tokens),
                                   timeout=5), SC.NOT_FOUND, "no attached client", "stale client_id")
    print("detach releases leases ok")

    # A client process killed (SIGKILL) while it holds a lease: the kernel closes its attach
    # socket and the daemon releases the lease.
    child = subprocess.Popen([sys.executable, "-c", KILLED_CLIENT, d.attach_sock, fp.hex()],
                             stdout=subprocess.PIPE, text=True)
    try:
        cid = int(child.stdout.readline())
        r = s.Lookup(pb.LookupRequest(scope=scope(client_id=cid), tokens=tokens), timeout=5)
        check(r.num_hit_blocks == 7, f"lookup for the doomed client: {r}")
        child.send_signal(signal.SIGKILL)
        child.wait(10)
        end = time.monotonic() + 10
        while True:
            try:
                s.Get(pb.GetRequest(lease_id=r.lease_id, count=1), timeout=5)
            except grpc.RpcError as e:
                check(e.code() == SC.NOT_FOUND, f"get after kill: {e.code()}")
                break
            check(time.monotonic() < end, "the killed client's lease survived for 10 s")
            time.sleep(0.02)
    finally:
        child.kill()
        child.wait()
    print("killed client's lease released ok")


def check_bad_inputs(d, pb, fp, tokens, blocks, P, BB, scope):
    s, ch = d.stub, d.channel
    raw = ch.unary_unary("/tierkv.v1.Cache/Lookup")  # bytes in, bytes out
    expect_status(lambda: raw(b"\xff\xff\xff\xff\x0f", timeout=5), SC.INVALID_ARGUMENT,
                  "malformed LookupRequest", "malformed protobuf (Lookup)")
    raw_put = ch.unary_unary("/tierkv.v1.Cache/Put")
    expect_status(lambda: raw_put(b"\x0a\x05\x01", timeout=5), SC.INVALID_ARGUMENT,
                  "malformed PutRequest", "truncated protobuf (Put)")
    expect_status(lambda: ch.unary_unary("/tierkv.v1.Cache/NoSuchMethod")(b"", timeout=5),
                  SC.UNIMPLEMENTED, "", "unknown method")

    other = fingerprint(4, 2, 64, 64, "fp8_e4m3", "per_tensor", "another-model")
    expect_status(lambda: s.Lookup(pb.LookupRequest(scope=scope(fpr=other), tokens=tokens), timeout=5),
                  SC.FAILED_PRECONDITION, "geometry mismatch", "wrong geometry (Lookup)")
    expect_status(lambda: s.Put(pb.PutRequest(scope=scope(fpr=other), tokens=tokens, blocks=blocks[:1]),
                                timeout=5), SC.FAILED_PRECONDITION, "geometry mismatch",
                  "wrong geometry (Put)")
    expect_status(lambda: s.Lookup(pb.LookupRequest(scope=scope(fpr=b"short"), tokens=tokens), timeout=5),
                  SC.INVALID_ARGUMENT, "expected 32", "short fingerprint")
    expect_status(lambda: s.Lookup(pb.LookupRequest(tokens=tokens), timeout=5),
                  SC.INVALID_ARGUMENT, "scope missing", "no scope")

    big = b"\0" * (8 << 20)
    expect_status(lambda: s.Put(pb.PutRequest(scope=scope(), tokens=tokens, blocks=[big]), timeout=10),
                  SC.RESOURCE_EXHAUSTED, "", "oversize message (8 MiB Put)")
    expect_status(lambda: s.Put(pb.PutRequest(scope=scope(), tokens=tokens, blocks=[b"x" * 100]),
                                timeout=5), SC.INVALID_ARGUMENT, "has 100 bytes", "short block")
    expect_status(lambda: s.Put(pb.PutRequest(scope=scope(), tokens=tokens[:2 * P], first_block=1,
                                              blocks=blocks[:2]), timeout=5),
                  SC.INVALID_ARGUMENT, "need", "blocks beyond the tokens")
    expect_status(lambda: s.Put(pb.PutRequest(scope=scope(), tokens=tokens, blocks=[]), timeout=5),
                  SC.INVALID_ARGUMENT, "no blocks", "empty put")
    many = [bytes(BB)] * 65
    expect_status(lambda: s.Put(pb.PutRequest(scope=scope(), tokens=list(range(65 * P)), blocks=many),
                                timeout=10), SC.INVALID_ARGUMENT, "max_blocks_per_rpc",
                  "too many blocks in one put")
    expect_status(lambda: s.Lookup(pb.LookupRequest(scope=scope(), tokens=[1] * 262145), timeout=10),
                  SC.INVALID_ARGUMENT, "max_prompt_tokens", "too many tokens")

    expect_status(lambda: s.Get(pb.GetRequest(lease_id=987654321), timeout=5), SC.NOT_FOUND, "",
                  "unknown lease (Get)")
    expect_status(lambda: s.Prefetch(pb.PrefetchRequest(lease_id=987654321, wait=True), timeout=5),
                  SC.NOT_FOUND, "", "unknown lease (Prefetch)")
    expect_status(lambda: s.Release(pb.ReleaseRequest(lease_id=987654321), timeout=5),
                  SC.NOT_FOUND, "", "unknown lease (Release)")
    expect_status(lambda: s.Get(pb.GetRequest(lease_id=0), timeout=5), SC.INVALID_ARGUMENT,
                  "lease_id missing", "lease 0")
    expect_status(lambda: s.Release(pb.ReleaseRequest(lease_id=1, alloc_id=1), timeout=5),
                  SC.INVALID_ARGUMENT, "exactly one", "release of both")
    expect_status(lambda: s.WriteSlot(pb.WriteSlotRequest(alloc_id=987654321, index=0,
                                                          payload=bytes(BB)), timeout=5),
                  SC.NOT_FOUND, "", "unknown allocation (WriteSlot)")
    expect_status(lambda: s.Commit(pb.CommitRequest(scope=scope(), alloc_id=987654321, tokens=tokens,
                                                    num_blocks=1), timeout=5),
                  SC.NOT_FOUND, "", "unknown allocation (Commit)")
    expect_status(lambda: s.Alloc(pb.AllocRequest(scope=scope(), num_blocks=1, tier=TIER_L1), timeout=5),
                  SC.UNIMPLEMENTED, "no GPU", "alloc in L1")
    expect_status(lambda: s.Alloc(pb.AllocRequest(scope=scope(), num_blocks=0), timeout=5),
                  SC.INVALID_ARGUMENT, "num_blocks 0", "alloc of 0 blocks")
    expect_status(lambda: s.Evict(pb.EvictRequest(tier=0), timeout=5), SC.INVALID_ARGUMENT,
                  "tier must be", "evict without a tier")

    # A lease's out-of-range block.
    s.Put(pb.PutRequest(scope=scope(), tokens=tokens[:P], blocks=blocks[:1]), timeout=10)
    r = s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens[:P]), timeout=5)
    expect_status(lambda: s.Get(pb.GetRequest(lease_id=r.lease_id, first=1), timeout=5),
                  SC.INVALID_ARGUMENT, "out of range", "get past the lease")
    # Lease time-to-live: a 200 ms lease is gone after it passes.
    r2 = s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens[:P], lease_ttl_ms=200), timeout=5)
    time.sleep(0.6)
    expect_status(lambda: s.Get(pb.GetRequest(lease_id=r2.lease_id), timeout=5), SC.NOT_FOUND, "",
                  "expired lease")
    s.Release(pb.ReleaseRequest(lease_id=r.lease_id), timeout=5)
    # And the daemon still serves normal calls.
    r = s.Lookup(pb.LookupRequest(scope=scope(), tokens=tokens), timeout=5)
    check(r.num_hit_blocks == 7, f"lookup after bad inputs: {r}")
    s.Release(pb.ReleaseRequest(lease_id=r.lease_id), timeout=5)


if __name__ == "__main__":
    main_wrapper(run)
