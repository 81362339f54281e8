#!/usr/bin/env python3
"""sglang_hicache.py - tierkv.sglang's batch_set_v1 / batch_get_v1, moving pages between
SGLang's own host pool (MHATokenToKVPoolHost, CPU) and a real tierkvd in place (one
put_gather / get_scatter per batch over the pages' runs), against the same batch through a
staging buffer (the pool's flat-page copies + one contiguous put / get: what the backend did
before), in the same run, per host-pool layout, attached (gets copy from the mapped L2 pool).

Prints per layout and direction the median time of --reps batches (range in brackets, the two
ways alternating) and GB/s of page bytes. Pages are checked bit-exact once per layout.

usage: tests/python/run BUILD/daemon/tierkvd BUILD/client/libkvclient.so bench/sglang_hicache.py
       [--layers 8] [--kv-heads 8] [--head-dim 128] [--pages 32] [--reps 20]
"""
import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
from tkvd import Daemon  # noqa: E402
from test_sglang_backend import P, backend, sglang_keys  # noqa: E402

import torch  # noqa: E402


def pools(layout, layers, heads, dim, pages):
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    kv = MHATokenToKVPool(pages * P, P, torch.bfloat16, heads, dim, layers, "cpu", False,
                          start_layer=0, end_layer=layers - 1)
    cap = kv.size if kv.host_capacity_tokens is None else kv.host_capacity_tokens
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, P, layout,
                                pin_memory=False, device_capacity_tokens=cap,
                                start_layer=kv.start_layer, end_layer=kv.end_layer,
                                write_back_staging=kv.hicache_write_back_staging)


def staged_set(b, keys, idx):
    pages = [b.mem_pool_host.get_data_page(int(idx[i * P])).view(torch.uint8)
             for i in range(len(keys))]
    chain, first = b._chain(keys, None)
    b.client.put(b._tokens(chain), first, torch.stack(pages))


def staged_get(b, keys, idx):
    chain, first = b._chain(keys, None)
    buf = torch.empty(len(keys), b.block_bytes, dtype=torch.uint8)
    with b.client.lookup(b._tokens(chain)) as lease:
        b.client.get(lease, first, len(keys), out=buf)
    for i in range(len(keys)):
        b.mem_pool_host.set_from_flat_data_page(int(idx[i * P]), buf[i].view(torch.bfloat16))


def timed(fns, reps):
    """(median, min, max) seconds of each of fns, run in turn rep after rep (so that the
    machine's load falls on both alike)."""
    ts = [[] for _ in fns]
    for _ in range(reps):
        for t, fn in zip(ts, fns):
            t0 = time.perf_counter()
            fn()
            t.append(time.perf_counter() - t0)
    return [(statistics.median(t), min(t), max(t)) for t in ts]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pages", type=int, default=32, help="pages per batch")
    ap.add_argument("--reps", type=int, default=20)
    a = ap.parse_args()
    d = Daemon(kv_dtype="bf16", num_layers=a.layers, num_kv_heads=a.kv_heads,
               head_dim=a.head_dim, block_tokens=P, l2_bytes="2G", l3="off").start()
    print(f"# {a.layers} layers x {a.kv_heads} KV heads x {a.head_dim}, pages of {P} tokens, "
          f"bf16; {a.pages} pages a batch; median of {a.reps} [min-max] ms, GB/s of pages")
    print(f"{'layout':>18} {'op':>4} {'in place':>22} {'staged':>22} {'staged/in place':>16}")
    for li, layout in enumerate(("page_first", "layer_first", "page_first_direct",
                                 "page_head")):
        pf = layout != "layer_first"
        src = pools(layout, a.layers, a.kv_heads, a.head_dim, 2 * a.pages)
        b = backend(d.sock, page_first=pf, attach=d.attach_sock)
        b.register_mem_pool_host(src)
        idx = src.alloc(a.pages * P)
        g = torch.Generator().manual_seed(li)
        src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape, generator=g).to(torch.bfloat16))
        keys = sglang_keys(list(range(li << 20, (li << 20) + a.pages * P)), P)
        ok = b.batch_set_v1(keys, idx)
        assert all(ok), ok
        want = [src.get_data_page(int(idx[i * P])).clone() for i in range(a.pages)]
        # another pool as the destination of the gets
        dst = pools(layout, a.layers, a.kv_heads, a.head_dim, 2 * a.pages)
        b2 = backend(d.sock, page_first=pf, attach=d.attach_sock)
        b2.register_mem_pool_host(dst)
        idx2 = dst.alloc(a.pages * P)
        assert all(b2.batch_get_v1(keys, idx2))
        for i in range(a.pages):
            assert torch.equal(dst.get_data_page(int(idx2[i * P])), want[i]), (layout, i)
        nbytes = a.pages * b.block_bytes
        rows = {
            "set": (lambda: b.batch_set_v1(keys, idx), lambda: staged_set(b, keys, idx)),
            "get": (lambda: b2.batch_get_v1(keys, idx2), lambda: staged_get(b2, keys, idx2)),
        }
        for op, (direct, staged) in rows.items():
            staged()  # warm both
            direct()
            (m1, lo1, hi1), (m2, lo2, hi2) = timed((direct, staged), a.reps)
            print(f"{layout:>18} {op:>4} {m1 * 1e3:>7.2f} [{lo1 * 1e3:.2f}-{hi1 * 1e3:.2f}] "
                  f"{nbytes / m1 / 1e9:>4.1f} {m2 * 1e3:>7.2f} [{lo2 * 1e3:.2f}-{hi2 * 1e3:.2f}] "
                  f"{nbytes / m2 / 1e9:>4.1f} {m2 / m1:>15.2f}x", flush=True)
        b.client.close()
        b2.client.close()
    d.stop()


if __name__ == "__main__":
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e}")
        sys.exit(77)
    main()
