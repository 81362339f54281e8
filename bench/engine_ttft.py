#!/usr/bin/env python3
"""engine_ttft.py - time to first token of the tiny transformers Llama (tierkv.hf.tiny_llama,
bf16, CPU) with and without tierkv, at prompt lengths 512 .. 32K tokens, through a real
tierkvd started here (bf16 blocks of 16 tokens, L2 only).

  without: full prefill of the prompt + the first token.
  with:    lookup + get of the cached prefix (stored by an earlier run) + decode into a
           DynamicCache + prefill of the rest + the first token.
Prints, per length, both TTFTs (median of --reps), their ratio and the share of prefill
tokens skipped; the first tokens must agree (asserted).

usage: tests/python/run BUILD/daemon/tierkvd BUILD/client/libkvclient.so bench/engine_ttft.py
       [--lengths 512,2048,8192,32768] [--reps 3]
"""
import argparse
import os
import random
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "python"))
from tkvd import Daemon  # noqa: E402

import torch  # noqa: E402
import tierkv  # noqa: E402
from tierkv.hf import PrefixCache, prefill_and_generate, tiny_llama  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--lengths", default="512,2048,8192,32768")
    ap.add_argument("--reps", type=int, default=3)
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    model = tiny_llama(max_positions=max(lengths) + 64)
    d = Daemon(kv_dtype="bf16", num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=16,
               model_id="ttft", l2_bytes="512M", l3="off").start()
    c = tierkv.Client(d.sock, attach_socket=d.attach_sock,
                      geometry=tierkv.Geometry(2, 2, 64, 16, "bf16", "per_tensor", "ttft"))
    pc = PrefixCache(c)
    rng = random.Random(1)
    w = [rng.randrange(512) for _ in range(256)]  # warm-up: the first calls pay one-off costs
    _, _, wc = prefill_and_generate(model, w, 1)
    pc.store(w, wc)
    k, kvc = pc.load(w)
    prefill_and_generate(model, w, 1, kvc, k)
    print(f"{'tokens':>7} {'ttft_no_cache_ms':>17} {'ttft_tierkv_ms':>15} {'ratio':>7} "
          f"{'skipped':>8} {'load_ms':>8}")
    for n in lengths:
        toks = [rng.randrange(512) for _ in range(n)]
        base, cached_t, load_t = [], [], []
        for r in range(a.reps):
            t0 = time.perf_counter()
            new0, _, cache = prefill_and_generate(model, toks, 1)
            base.append(time.perf_counter() - t0)
        pc.store(toks, cache)
        del cache
        for r in range(a.reps):
            t0 = time.perf_counter()
            k, kvc = pc.load(toks)
            t1 = time.perf_counter()
            new1, _, _ = prefill_and_generate(model, toks, 1, kvc, k)
            cached_t.append(time.perf_counter() - t0)
            load_t.append(t1 - t0)
            assert new1 == new0, f"{n}: first token differs with the cache"
        b, w = statistics.median(base) * 1e3, statistics.median(cached_t) * 1e3
        print(f"{n:>7} {b:>17.1f} {w:>15.1f} {b / w:>6.1f}x {k / n:>8.1%} "
              f"{statistics.median(load_t) * 1e3:>8.1f}", flush=True)
    c.close()
    d.stop()


if __name__ == "__main__":
    main()
