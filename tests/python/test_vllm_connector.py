"""test_vllm_connector.py - tierkv.vllm.TierKVConnector inside the real, pinned vLLM: the
connector is loaded by vLLM's own KVConnectorFactory from a KVTransferConfig, and driven with
vLLM's own Request, KVCacheBlocks, NewRequestData / SchedulerOutput and attention-backend
lookup (vLLM's PyPI wheel is a CUDA build: on a machine without a GPU it has no platform to
run a model on, so the engine loop itself is not run here; docs/engines.md says so).

Run 1 (engine A): a prompt misses, its KV (random bf16 standing in for the model's) is saved
after the step. Run 2 (engine B, fresh connectors, other block ids): the scheduler counts the
prefix, the worker loads it into B's paged cache: bit-equal to A's blocks. Bad input: daemon
down (a miss, and a load planned before it went down reports its blocks as load errors), a
geometry mismatch (a miss), an unknown KV layout (refused at register_kv_caches).
"""
import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tkvd import Daemon, check, main  # noqa: E402

P, H, D, L = 16, 2, 64, 2
PROMPT = 7 * P + 5


def make(sock, role, model_id="tiny", backend="CPU_ATTN"):
    from vllm.config import (AttentionConfig, CacheConfig, DeviceConfig, KVTransferConfig,
                             VllmConfig)
    from vllm.v1.attention.backends.registry import AttentionBackendEnum
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    kt = KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.vllm",
                          kv_role="kv_both", kv_connector_extra_config={
                              "socket": sock, "model_id": model_id, "num_layers": L,
                              "num_kv_heads": H, "head_dim": D, "timeout_ms": 2000})
    vc = VllmConfig(kv_transfer_config=kt, cache_config=CacheConfig(block_size=P),
                    device_config=DeviceConfig(device="cpu"),
                    attention_config=AttentionConfig(backend=AttentionBackendEnum[backend]))
    return vc, KVConnectorFactory.create_connector(vc, role, None)


def request(rid, toks):
    from vllm import SamplingParams
    from vllm.v1.request import Request
    return Request(rid, toks, SamplingParams(max_tokens=4), None)


def blocks(ids):
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    return KVCacheBlocks(([KVCacheBlock(i) for i in ids],))


def sched_output(req, ids, num_computed, num_scheduled):
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput
    nr = NewRequestData.from_request(req, (ids,))
    nr.num_computed_tokens = num_computed
    return SchedulerOutput(scheduled_new_reqs=[nr], scheduled_cached_reqs=CachedRequestData.make_empty(),
                           num_scheduled_tokens={req.request_id: num_scheduled},
                           total_num_scheduled_tokens=num_scheduled,
                           scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
                           num_common_prefix_blocks=[0], finished_req_ids=set(),
                           free_encoder_mm_hashes=[])


def kv_caches(num_blocks, fill):
    import torch
    g = torch.Generator().manual_seed(5)
    out = {}
    for li in range(L):
        t = torch.zeros(num_blocks, H, P, 2 * D, dtype=torch.bfloat16)
        if fill:
            t.copy_(torch.randn(t.shape, generator=g).to(torch.bfloat16))
        out[f"model.layers.{li}.self_attn.attn"] = t
    return out


def step(sched, worker, so):
    meta = sched.build_connector_meta(so)
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_save()
    worker.clear_connector_metadata()
    return meta, worker.get_block_ids_with_load_errors()


def round_trip(d, backend, toks):
    """Engine A saves the prompt's blocks, engine B (fresh connectors) loads them."""
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole as R
    with d.client() as c:
        c.evict(2, toks)
        c.evict(3, toks)
    # ---- engine A: miss, compute, save -----------------------------------------------------
    _, sa = make(d.sock, R.SCHEDULER, backend=backend)
    _, wa = make(d.sock, R.WORKER, backend=backend)
    check(type(sa).__name__ == "TierKVConnector", f"factory made {type(sa)}")
    kva = kv_caches(32, fill=True)
    wa.register_kv_caches(kva)
    print(f"vLLM attention backend: {wa._backend}")
    ra = request("a", toks)
    n, async_ = sa.get_num_new_matched_tokens(ra, 0)
    check((n, async_) == (0, False), f"cold match {n}")
    ids_a = [3, 9, 4, 20, 11, 7, 30, 2]
    sa.update_state_after_alloc(ra, blocks(ids_a), 0)
    meta, errs = step(sa, wa, sched_output(ra, ids_a, 0, PROMPT))
    check(len(meta.saves) == 1 and len(meta.saves[0].block_ids) == 7 and not errs, "save plan")
    sa.request_finished(ra, ids_a)
    with d.client() as c, c.lookup(toks) as l:
        check(l.num_blocks == 7, f"daemon holds {l.num_blocks} blocks")

    # ---- engine B: fresh connectors, hit, load into other blocks ---------------------------
    _, sb = make(d.sock, R.SCHEDULER, backend=backend)
    _, wb = make(d.sock, R.WORKER, backend=backend)
    kvb = kv_caches(32, fill=False)
    wb.register_kv_caches(kvb)
    rb = request("b", toks)
    n2, _ = sb.get_num_new_matched_tokens(rb, 2 * P)  # as if 2 blocks were computed locally
    check(n2 == 5 * P, f"matched beyond local {n2}")
    n, _ = sb.get_num_new_matched_tokens(rb, 0)        # the call vLLM acts on: the last one
    check(n == 7 * P, f"matched {n}")
    check(sb.get_num_new_matched_tokens(rb, 0)[0] == n, "second call differs (side effect)")
    ids_b = [12, 0, 5, 17, 25, 6, 1, 8]
    sb.update_state_after_alloc(rb, blocks(ids_b), n)
    meta, errs = step(sb, wb, sched_output(rb, ids_b, n, PROMPT - n))
    check(len(meta.loads) == 1 and not errs, f"load errors {errs}")
    check(not meta.saves, "blocks loaded from tierkv are saved again")
    for name in kva:
        check(torch.equal(kva[name][ids_a[:7]], kvb[name][ids_b[:7]]),
              f"{name}: loaded blocks differ from the saved ones")
        check(not kvb[name][ids_b[7]].any(), "the tail block was written")
    print(f"  ok  {backend}: prefix of {n} tokens saved by A, loaded by B bit-exact")

    return kva, ids_a, ids_b


def run():
    import torch
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole as R
    d = Daemon(kv_dtype="bf16", num_layers=L, num_kv_heads=H, head_dim=D, block_tokens=P,
               model_id="tiny/tp0", zstd_level=0).start()
    rng = random.Random(2)
    toks = [rng.randrange(512) for _ in range(PROMPT)]

    for backend in ("CPU_ATTN", "FLASH_ATTN"):
        kva, ids_a, ids_b = round_trip(d, backend, toks)  # (FLASH_ATTN's blocks stay)

    # ---- bad input: geometry mismatch, unknown layout, daemon down -----------------------------
    _, sx = make(d.sock, R.SCHEDULER, model_id="other")
    check(sx.get_num_new_matched_tokens(request("x", toks), 0)[0] == 0, "mismatch matched")
    print("  ok  geometry mismatch: no match")
    _, wx = make(d.sock, R.WORKER)
    bad = {k: v.transpose(1, 2).contiguous() for k, v in kv_caches(4, False).items()}  # [B,N,H,C]
    try:
        wx.register_kv_caches(bad)
        check(False, "unknown layout accepted")
    except ValueError as e:
        print(f"  ok  unknown layout refused: {e}")
    _, wt = make(d.sock, R.WORKER, backend="TRITON_ATTN")  # a backend whose layout is not known
    try:
        wt.register_kv_caches(kv_caches(4, False))
        check(False, "an unknown attention backend was accepted")
    except ValueError as e:
        print(f"  ok  unknown backend refused: {e}")
    # blocks failing their checksum on disk: matched from the index, then refused at load
    with d.client() as c:
        c.flush()
    d.stop()
    check(d.corrupt_l3() >= 1, "no L3 segment to corrupt")
    d.start()
    _, sk = make(d.sock, R.SCHEDULER, backend="FLASH_ATTN")
    _, wk = make(d.sock, R.WORKER, backend="FLASH_ATTN")
    kvk = kv_caches(32, fill=False)
    wk.register_kv_caches(kvk)
    rk = request("k", toks)
    n, _ = sk.get_num_new_matched_tokens(rk, 0)
    check(n == 7 * P, f"corrupt blocks not in the index: {n}")
    sk.update_state_after_alloc(rk, blocks(ids_b), n)
    meta, errs = step(sk, wk, sched_output(rk, ids_b, n, PROMPT - n))
    check(errs == set(ids_b[:7]), f"corrupt: load errors {errs}")
    check(not any(t.any() for t in kvk.values()), "corrupt blocks were written")
    print(f"  ok  blocks failing their checksum: {sorted(errs)} reported for recompute, "
          "nothing written")
    _, sc = make(d.sock, R.SCHEDULER)
    _, wc = make(d.sock, R.WORKER)
    kvc = kv_caches(32, fill=False)
    wc.register_kv_caches(kvc)
    rc_ = request("c", toks)
    with d.client() as c:  # the corrupt blocks are gone: store the prefix again
        c.put(toks[:7 * P], 0, torch.zeros(7, c.block_bytes, dtype=torch.uint8))
    n, _ = sc.get_num_new_matched_tokens(rc_, 0)
    check(n == 7 * P, f"matched {n} before the daemon went down")
    sc.update_state_after_alloc(rc_, blocks(ids_b), n)
    d.stop()  # goes down between the match and the load
    meta, errs = step(sc, wc, sched_output(rc_, ids_b, n, PROMPT - n))
    check(errs == set(ids_b[:7]), f"load errors {errs}")
    check(not any(t.any() for t in kvc.values()), "something was written from a dead daemon")
    print(f"  ok  daemon down at load: blocks {sorted(errs)} reported for recompute")
    n, _ = sc.get_num_new_matched_tokens(request("d", toks), 0)
    check(n == 0, "matched with the daemon down")
    print("  ok  daemon down: no match")


if __name__ == "__main__":
    try:
        import vllm  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e}")
        sys.exit(77)
    main(run)
