"""test_client.py - the tierkv package over libkvclient against a real tierkvd: lookup, put,
get (bytes, numpy, torch, and the mapped pool's view), put_gather / get_scatter of blocks in
pieces (and bad pieces refused), alloc/write/commit, prefetch/wait,
stats; the Python key chain equals the daemon's; errors carry the daemon's message.
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tkvd import Daemon, check, main  # noqa: E402

import tierkv  # noqa: E402


def run():
    d = Daemon(kv_dtype="bf16", num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16,
               model_id="py-test").start()
    with d.client(attach=True) as c:
        g = c.geometry
        check((g.num_layers, g.block_tokens, g.kv_dtype) == (2, 16, "bf16"), f"geometry {g}")
        BB, P = c.block_bytes, c.block_tokens
        check(BB == 2 * 2 * 16 * 2 * 64 * 2, f"block bytes {BB}")
        check(c.fingerprint == tierkv.fingerprint(g).hex(), "fingerprint differs from keys.py")
        check(c.attached, "attach failed")
        rng = random.Random(3)
        toks = [rng.randrange(0, 1 << 31) for _ in range(5 * P + 7)]
        with c.lookup(toks) as l:
            check(l.num_blocks == 0 and l.num_query_blocks == 5, "cold lookup hit")
        payload = bytes(rng.randrange(256) for _ in range(4 * BB))
        r = c.put(toks, 0, payload)
        check((r.num_stored, r.num_duplicate) == (4, 0), f"put {r.num_stored}/{r.num_duplicate}")
        r = c.put(toks, 2, payload[2 * BB:])
        check((r.num_stored, r.num_duplicate) == (0, 2), "duplicate put")
        with c.lookup(toks) as l:
            check(l.num_blocks == 4 and l.tiers() == [tierkv.TIER_L2] * 4, f"hit {l.num_blocks}")
            check(bytes(c.get(l)) == payload, "get bytes differ")
            import numpy as np
            arr = np.zeros(2 * BB, dtype=np.uint8)
            c.get(l, 1, 2, out=arr)
            check(arr.tobytes() == payload[BB:3 * BB], "get into numpy differs")
            import torch
            t = torch.zeros(4, BB, dtype=torch.uint8)
            c.get(l, out=t)
            check(t.numpy().tobytes() == payload, "get into torch differs")
            v = l.block_view(3)
            check(v is not None and bytes(v) == payload[3 * BB:], "mapped view differs")
            try:
                c.get(l, 0, 4, out=bytearray(BB))
                check(False, "short destination accepted")
            except tierkv.InvalidArgument as e:
                print(f"  ok  short destination: {e}")
        # blocks in pieces: a numpy "pool" of [K/V][block][half] runs, 4 pieces a block
        import numpy as np
        half = BB // 4
        pool = np.frombuffer(payload, dtype=np.uint8).reshape(4, 4, half).transpose(1, 0, 2)
        pool = np.ascontiguousarray(pool)            # piece j of block b at pool[j, b]
        base = pool.ctypes.data
        iov = np.array([[[base + (j * 4 + b) * half, half] for j in range(4)] for b in range(4)],
                       dtype=np.int64)
        toks2 = [x ^ 1 for x in toks]
        r = c.put_gather(toks2, 0, iov)
        check((r.num_stored, r.num_duplicate) == (4, 0), "put_gather")
        dst = np.zeros_like(pool)
        iov2 = iov.copy()
        iov2[:, :, 0] += dst.ctypes.data - base
        with c.lookup(toks2) as l:
            check(l.num_blocks == 4 and bytes(c.get(l)) == payload, "put_gather stored other bytes")
            c.get_scatter(l, 1, iov2[1:])
            check(not dst[:, 0].any() and dst[:, 1:].tobytes() == pool[:, 1:].tobytes(),
                  "get_scatter differs")
            bad = iov2[1:].copy()
            bad[0, 3, 1] -= 1
            try:
                c.get_scatter(l, 1, bad)
                check(False, "a short piece accepted")
            except tierkv.InvalidArgument as e:
                check("block 0" in str(e), f"unclear: {e}")
                print(f"  ok  bad piece: {e}")
            for wrong in (iov2[1:, :, :1], iov2[1:].astype(np.int32), list(iov2[1:])):
                try:
                    c.get_scatter(l, 1, wrong)
                    check(False, "a malformed iov accepted")
                except tierkv.InvalidArgument:
                    pass
        # several prompts in one lookup call: this one, a prefix of it, and a cold one
        ls = c.lookup_batch([toks, toks[:2 * P + 3], [7] * (3 * P)])
        check([l.num_blocks for l in ls] == [4, 2, 0], f"lookup_batch {[l.num_blocks for l in ls]}")
        check(bytes(c.get(ls[1])) == payload[:2 * BB], "get through a batch lease differs")
        for l in ls:
            l.release()
        # alloc / write / commit: block 4 appended
        aid, offs = c.alloc(1)
        check(aid and len(offs) == 1, "alloc")
        last = bytes(rng.randrange(256) for _ in range(BB))
        c.write(aid, 0, last)
        r = c.commit(aid, toks, 4, 1)
        check(r.num_stored == 1, "commit")
        with c.lookup(toks) as l:
            check(l.num_blocks == 5, f"after commit {l.num_blocks}")
            c.prefetch(l, tierkv.TIER_L2)
            c.wait(l, tierkv.TIER_L2)
            check(bytes(c.get(l, 4, 1)) == last, "committed block differs")
        # keys: the daemon's chain is the documented one (evict by prompt, then lookups by the
        # same tokens give nothing; another namespace never sees them)
        with d.client(namespace="other") as o, o.lookup(toks) as l:
            check(l.num_blocks == 0, "namespace isolation")
        st = c.stats()
        check(st["put_blocks"] >= 5 and st["lookups"] >= 4 and st["kv_dtype"] == "bf16",
              f"stats {st['put_blocks']} {st['lookups']}")
        # bad input: tokens out of range, a payload that is not whole blocks
        for what, fn in (("negative token", lambda: c.lookup([-1] * 16)),
                         ("partial payload", lambda: c.put(toks, 0, b"x" * (BB + 1)))):
            try:
                fn()
                check(False, f"{what} accepted")
            except tierkv.InvalidArgument as e:
                print(f"  ok  {what}: {e}")
        try:
            c.commit(aid, toks, 4, 1)
            check(False, "second commit accepted")
        except tierkv.NotFound as e:
            check("alloc" in str(e).lower() or "not found" in str(e).lower(), f"message {e}")
            print(f"  ok  commit of an ended allocation: {e}")
    # geometry mismatch: a clear GeometryMismatch at connect
    try:
        d.client(geometry=tierkv.Geometry(2, 2, 64, 16, "fp8_e4m3", "per_tensor", "py-test"))
        check(False, "mismatched geometry connected")
    except tierkv.GeometryMismatch as e:
        print(f"  ok  geometry mismatch: {e}")
    d.stop()
    try:
        d.client(timeout_ms=1000)
        check(False, "connected to a stopped daemon")
    except (tierkv.Unavailable, tierkv.TimedOut) as e:
        print(f"  ok  daemon down: {e}")


if __name__ == "__main__":
    main(run)
