"""test_model_e2e.py - a real model end to end through a real tierkvd: a tiny Llama built in
code with transformers (2 layers, hidden 128, 2 KV heads of 64, vocab 512, fixed-seed random
weights, bf16; nothing downloaded). A first process prefills a prompt and stores the KV of its
full blocks; a second, fresh process looks the prompt up, loads the cached prefix, prefills
only the rest and generates greedily. Checked against a run without the cache in that second
process: greedy tokens identical; with bf16 storage (unquantised for a bf16 model) the loaded
KV and the logits are bit-exact to the same prefix computed in process; with fp8_e4m3 storage
the logits are within FP8_TOL of the run without cache. Then the bad inputs: daemon down,
geometry mismatch, an unknown cache layout, blocks failing their checksum on disk: a miss,
a full recompute, the same tokens.

usage: test_model_e2e.py            (TIERKVD and TIERKV_LIBKVCLIENT in the environment)
       test_model_e2e.py --store SOCK DTYPE   /  --load SOCK DTYPE   (the two processes)
"""
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tkvd import Daemon, check, main  # noqa: E402

P = 16              # tokens per block (vLLM's default block)
PROMPT = 7 * P + 5  # 7 full blocks and a tail of 5
NEW = 12            # greedy tokens generated
FP8_TOL = 0.05      # max |logit difference| allowed with fp8 storage (logits span about +-0.8)
BF16_TOL = 0.05     # suffix-only prefill vs full prefill, bf16 arithmetic (different GEMM shapes)


def geometry(dtype, model_id="tiny-llama-e2e"):
    import tierkv
    return tierkv.Geometry(2, 2, 64, P, dtype, "per_tensor", model_id)


def prompt():
    import random
    rng = random.Random(11)
    return [rng.randrange(512) for _ in range(PROMPT)]


def proc_store(sock, dtype):
    import tierkv
    from tierkv.hf import PrefixCache, prefill_and_generate, tiny_llama
    model = tiny_llama()
    toks = prompt()
    new, _, cache = prefill_and_generate(model, toks, 1)
    with tierkv.Client(sock, geometry=geometry(dtype)) as c:
        r = PrefixCache(c).store(toks, cache)
    print(json.dumps({"stored": r.num_stored, "duplicate": r.num_duplicate}))


def proc_load(sock, dtype, geo_model_id=None):
    import torch
    import tierkv
    from tierkv.hf import PrefixCache, prefill_and_generate, tiny_llama
    model = tiny_llama()
    toks = prompt()
    ref_new, ref_logits, ref_cache = prefill_and_generate(model, toks, NEW)
    try:
        c = tierkv.Client(sock, geometry=geometry(dtype, geo_model_id or "tiny-llama-e2e"),
                          timeout_ms=2000)
        pc = PrefixCache(c)
    except tierkv.TierKVError as e:
        print(f"connect failed, running without the cache: {e}", file=sys.stderr)
        c, pc = None, PrefixCache(None)
    cached, cache = pc.load(toks)
    out = {"cached": cached, "skipped_share": cached / len(toks)}
    if cached:
        # the same prefix computed here: the KV the first process stored
        from transformers import DynamicCache
        local = DynamicCache()
        for li, layer in enumerate(ref_cache.layers):
            local.update(layer.keys[:, :, :cached].clone(), layer.values[:, :, :cached].clone(), li)
        kv_diff = max(float((a.keys.float() - b.keys.float()).abs().max())
                      for a, b in zip(cache.layers, local.layers))
        loc_new, loc_logits, _ = prefill_and_generate(model, toks, NEW, local, cached)
        out["kv_max_diff"] = kv_diff
        new, logits, _ = prefill_and_generate(model, toks, NEW, cache, cached)
        out["vs_local_prefix_max_diff"] = float((logits - loc_logits).abs().max())
    else:
        new, logits, _ = prefill_and_generate(model, toks, NEW)
    out["tokens_equal"] = new == ref_new
    out["vs_full_prefill_max_diff"] = float((logits - ref_logits).abs().max())
    out["tokens"] = new
    print(json.dumps(out))
    print(f"prefill tokens skipped: {cached} of {len(toks)}", file=sys.stderr)
    if c is not None:
        c.close()


def child(mode, sock, dtype, *extra):
    env = dict(os.environ)
    r = subprocess.run([sys.executable, __file__, mode, sock, dtype, *extra], env=env,
                       capture_output=True, text=True, timeout=300)
    sys.stderr.write(r.stderr[-3000:] if r.returncode else r.stderr[-300:])
    check(r.returncode == 0, f"{mode} process failed ({r.returncode})")
    return json.loads(r.stdout.strip().splitlines()[-1])


def run():
    # ---- bf16 storage: bit-exact --------------------------------------------------------------
    d = Daemon(kv_dtype="bf16", num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=P,
               model_id="tiny-llama-e2e", zstd_level=0).start()
    s = child("--store", d.sock, "bf16")
    check(s["stored"] == 7, f"stored {s}")
    r = child("--load", d.sock, "bf16")
    print(f"bf16: prefill tokens skipped {r['cached']} of {PROMPT} ({r['skipped_share']:.0%}); "
          f"kv diff {r['kv_max_diff']}, logits vs same prefix {r['vs_local_prefix_max_diff']}, "
          f"vs full prefill {r['vs_full_prefill_max_diff']:.4f}")
    check(r["cached"] == 7 * P, f"cached {r['cached']}")
    check(r["kv_max_diff"] == 0.0 and r["vs_local_prefix_max_diff"] == 0.0,
          "bf16 storage is not bit-exact")
    check(r["tokens_equal"], "greedy tokens differ with the bf16 cache")
    check(r["vs_full_prefill_max_diff"] <= BF16_TOL, f"bf16 logits off by {r['vs_full_prefill_max_diff']}")

    # ---- bad input 1: geometry mismatch (another model id): a miss, same tokens ----------------
    r = child("--load", d.sock, "bf16", "other-model")
    check(r["cached"] == 0 and r["tokens_equal"] and r["vs_full_prefill_max_diff"] == 0.0,
          f"geometry mismatch served something: {r}")
    print("  ok  geometry mismatch: miss, recomputed, same tokens")

    # ---- bad input 2: unknown layout refused ----------------------------------------------------
    import tierkv
    from tierkv.hf import LayoutError, PrefixCache
    with d.client(geometry=geometry("bf16")) as c:
        try:
            PrefixCache(c).store(prompt(), object())
            check(False, "an unknown cache layout was stored")
        except LayoutError as e:
            print(f"  ok  unknown layout refused: {e}")
        import torch
        from transformers import DynamicCache
        bad = DynamicCache()
        for li in range(2):  # heads and tokens swapped: [1, T, H, D]
            bad.update(torch.zeros(1, PROMPT, 2, 64, dtype=torch.bfloat16),
                       torch.zeros(1, PROMPT, 2, 64, dtype=torch.bfloat16), li)
        try:
            PrefixCache(c).store(prompt(), bad)
            check(False, "a cache of the wrong shape was stored")
        except LayoutError as e:
            print(f"  ok  wrong KV shape refused: {e}")

    # ---- bad input 3: blocks that fail their checksum on disk ---------------------------------
    with d.client() as c:
        c.flush()
    d.stop()
    check(d.corrupt_l3() >= 1, "no L3 segment to corrupt")
    d.start()
    with d.client(geometry=geometry("bf16")) as c, c.lookup(prompt()) as l:
        check(l.num_blocks == 7 and l.tiers() == [tierkv.TIER_L3] * 7, f"L3 hit {l.tiers()}")
    r = child("--load", d.sock, "bf16")
    check(r["cached"] == 0 and r["tokens_equal"] and r["vs_full_prefill_max_diff"] == 0.0,
          f"corrupt blocks served: {r}")
    with d.client() as c:
        check(c.stats()["checksum_failures"] >= 1, "checksum failure not counted")
    print("  ok  corrupt blocks: checksum failure, miss, recomputed, same tokens")

    # ---- bad input 4: daemon down ---------------------------------------------------------------
    d.stop()
    r = child("--load", d.sock, "bf16")
    check(r["cached"] == 0 and r["tokens_equal"], f"daemon down: {r}")
    print("  ok  daemon down: miss, recomputed, same tokens")

    # ---- fp8 storage: within tolerance ----------------------------------------------------------
    d8 = Daemon(kv_dtype="fp8_e4m3", num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=P,
                model_id="tiny-llama-e2e").start()
    s = child("--store", d8.sock, "fp8_e4m3")
    check(s["stored"] == 7, f"fp8 stored {s}")
    r = child("--load", d8.sock, "fp8_e4m3")
    print(f"fp8_e4m3: prefill tokens skipped {r['cached']} of {PROMPT}; kv diff "
          f"{r['kv_max_diff']:.4f}, logits vs full prefill {r['vs_full_prefill_max_diff']:.4f} "
          f"(tolerance {FP8_TOL})")
    check(r["cached"] == 7 * P and r["kv_max_diff"] > 0.0, f"fp8 load: {r}")
    check(r["tokens_equal"], "greedy tokens differ with the fp8 cache")
    check(r["vs_full_prefill_max_diff"] <= FP8_TOL, f"fp8 logits off by {r['vs_full_prefill_max_diff']}")
    d8.stop()


if __name__ == "__main__":
    if len(sys.argv) >= 4 and sys.argv[1] == "--store":
        proc_store(sys.argv[2], sys.argv[3])
    elif len(sys.argv) >= 4 and sys.argv[1] == "--load":
        proc_load(sys.argv[2], sys.argv[3], *sys.argv[4:])
    else:
        main(run)
