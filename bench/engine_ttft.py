#!/usr/bin/env python3
"""engine_ttft.py - time to first token of the tiny transformers Llama (tierkv.hf.tiny_llama,
bf16) with and without tierkv, at prompt lengths 512 .. 32K tokens, through a real tierkvd
started here (bf16 blocks of 16 tokens).

  without: full prefill of the prompt + the first token.
  with:    lookup + load of the cached prefix (stored by an earlier run) + decode into a
           DynamicCache + prefill of the rest + the first token.
Prints, per length, both TTFTs (median of --reps), their ratio, the share of prefill tokens
skipped and how the prefix came; the first tokens must agree (asserted).

--device cpu (default): model and KV on the CPU, the prefix copied from the mapped L2 pool.
--device cuda: model and KV on the GPU; the daemon gets an L1 (GPU) pool of --l1-bytes, and
  where this process maps it (a CUDA build of tierkvd and libkvclient, e.g. scripts/gpu-bundle)
  the prefix is promoted to L1 and gathered from it on the device ("l1"); otherwise it comes
  from L2 through pinned memory ("l2+h2d"). Times include a device synchronisation.

usage: tests/python/run BUILD/daemon/tierkvd BUILD/client/libkvclient.so bench/engine_ttft.py
       [--lengths 512,2048,8192,32768] [--reps 3] [--device cpu|cuda] [--json FILE]
       [--layers 2 --hidden 128 --heads 2 --kv-heads 2] [--l1-bytes 2G]
"""
import argparse
import json
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
    ap.add_argument("--device", default="cpu", help="cpu (default) or cuda[:N]")
    ap.add_argument("--json", help="also write the rows as JSON to this file")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--heads", type=int, default=2)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--l1-bytes", default="2G", help="the daemon's L1 pool with --device cuda")
    a = ap.parse_args()
    lengths = [int(x) for x in a.lengths.split(",")]
    dev = torch.device(a.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        print("engine_ttft: --device cuda but torch sees no GPU", file=sys.stderr)
        sys.exit(77)
    if dev.type == "cuda":
        if dev.index is None:  # "cuda" alone: the first GPU (set_device needs an index)
            dev = torch.device("cuda", 0)
        torch.cuda.set_device(dev)

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    torch.set_num_threads(max(1, os.cpu_count() or 1))
    L, H, D = a.layers, a.kv_heads, a.hidden // a.heads
    model = tiny_llama(max_positions=max(lengths) + 64, layers=L, hidden=a.hidden,
                       heads=a.heads, kv_heads=H).to(dev)
    flags = dict(kv_dtype="bf16", num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=16,
                 model_id="ttft", l2_bytes="512M", l3="off")
    if dev.type == "cuda":
        flags.update(l1_bytes=a.l1_bytes, gpu_device=dev.index or 0)
    d = Daemon(**flags).start()
    c = tierkv.Client(d.sock, attach_socket=d.attach_sock,
                      geometry=tierkv.Geometry(L, H, D, 16, "bf16", "per_tensor", "ttft"))
    has_l1 = dev.type == "cuda" and c.has_l1
    pc = PrefixCache(c)
    rng = random.Random(1)
    w = [rng.randrange(512) for _ in range(256)]  # warm-up: the first calls pay one-off costs
    _, _, wc = prefill_and_generate(model, w, 1)
    pc.store(w, wc)
    k, kvc = pc.load(w, device=dev)
    prefill_and_generate(model, w, 1, kvc, k)
    sync()
    gpu = torch.cuda.get_device_name(dev) if dev.type == "cuda" else None
    print(f"# device {dev}{f' ({gpu})' if gpu else ''}, model {L} layers, hidden {a.hidden}, "
          f"{a.heads} heads / {H} kv heads; L1 mapped here: {has_l1}", flush=True)
    print(f"{'tokens':>7} {'ttft_no_cache_ms':>17} {'ttft_tierkv_ms':>15} {'ratio':>7} "
          f"{'skipped':>8} {'load_ms':>8} {'path':>7}")
    rows = []
    for n in lengths:
        toks = [rng.randrange(512) for _ in range(n)]
        base, cached_t, load_t = [], [], []
        for r in range(a.reps):
            sync()
            t0 = time.perf_counter()
            new0, _, cache = prefill_and_generate(model, toks, 1)
            sync()
            base.append(time.perf_counter() - t0)
        pc.store(toks, cache)
        del cache
        paths = set()
        for r in range(a.reps):
            sync()
            t0 = time.perf_counter()
            k, kvc = pc.load(toks, device=dev)
            sync()
            t1 = time.perf_counter()
            new1, _, _ = prefill_and_generate(model, toks, 1, kvc, k)
            sync()
            cached_t.append(time.perf_counter() - t0)
            load_t.append(t1 - t0)
            paths.add(pc.last_path)
            assert new1 == new0, f"{n}: first token differs with the cache"
        b, wt = statistics.median(base) * 1e3, statistics.median(cached_t) * 1e3
        lt = statistics.median(load_t) * 1e3
        path = "/".join(sorted(str(p) for p in paths))
        print(f"{n:>7} {b:>17.1f} {wt:>15.1f} {b / wt:>6.1f}x {k / n:>8.1%} {lt:>8.1f} "
              f"{path:>7}", flush=True)
        rows.append({"tokens": n, "ttft_no_cache_ms": b, "ttft_tierkv_ms": wt, "ratio": b / wt,
                     "skipped": k / n, "load_ms": lt, "path": path,
                     "ttft_no_cache_ms_all": [x * 1e3 for x in base],
                     "ttft_tierkv_ms_all": [x * 1e3 for x in cached_t]})
    c.close()
    d.stop()
    if a.json:
        info = {"device": str(dev), "l1_mapped": has_l1, "reps": a.reps,
                "model": {"layers": L, "hidden": a.hidden, "heads": a.heads, "kv_heads": H,
                          "head_dim": D, "dtype": "bf16"},
                "gpu": gpu,
                "torch": torch.__version__, "rows": rows}
        with open(a.json, "w") as f:
            json.dump(info, f, indent=1)


if __name__ == "__main__":
    main()
