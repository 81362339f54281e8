"""test_sglang_backend.py - tierkv.sglang.TierKVStore loaded by SGLang's own
StorageBackendFactory ("dynamic" backend, module_path/class_name) from SGLang's
HiCacheStorageConfig, against a real tierkvd: keys are SGLang-style sha256 hex chains;
batch_exists counts consecutive hits from the start (with prefix_keys), set/get round-trip
pages bit-exact, ranks are isolated, a wrong page size is refused, a daemon that goes down
gives misses (never None from a batch call, nothing written). Then SGLang's HiCache path: its own
MHATokenToKVPool (on the CPU) and MHATokenToKVPoolHost (page_first and layer_first layouts),
pages written by batch_set_v1 from the host pool and read back by batch_get_v1 into other
host pages of another pool: bit-exact; a miss reports False for the pages not found.
"""
import hashlib
import os
import struct
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from tkvd import Daemon, check, main  # noqa: E402

P = 16


def sglang_keys(tokens, page):
    """SGLang's page hashes: sha256 over the previous hash and the page's tokens (4-byte LE)."""
    keys, prev = [], b""
    for i in range(0, len(tokens) - len(tokens) % page, page):
        h = hashlib.sha256(prev + struct.pack(f"<{page}I", *tokens[i:i + page]))
        keys.append(h.hexdigest())
        prev = h.digest()
    return keys


def backend(sock, rank=0, page_first=True):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    cfg = HiCacheStorageConfig(tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=page_first, model_name="tiny",
                               extra_config={"backend_name": "tierkv",
                                             "module_path": "tierkv.sglang",
                                             "class_name": "TierKVStore", "socket": sock})
    return StorageBackendFactory.create_backend("dynamic", cfg, None)


def run():
    import torch
    d = Daemon(kv_dtype="bf16", num_layers=2, num_kv_heads=2, head_dim=64, block_tokens=P).start()
    b = backend(d.sock)
    check(type(b).__name__ == "TierKVStore", f"factory made {type(b)}")
    keys = sglang_keys(list(range(1000, 1000 + 6 * P)), P)
    g = torch.Generator().manual_seed(1)
    pages = [torch.randn(b.block_bytes // 2, generator=g).to(torch.bfloat16) for _ in keys]
    check(b.batch_exists(keys) == 0, "cold exists")
    check(b.batch_set(keys[:4], pages[:4]), "batch_set")
    check(b.batch_exists(keys) == 4, f"exists {b.batch_exists(keys)}")
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo
    ei = HiCacheStorageExtraInfo(prefix_keys=keys[:2])
    check(b.batch_exists(keys[2:], ei) == 2, "exists after prefix_keys")
    check(b.exists(keys[0]) and not b.exists(keys[5]), "exists single")
    for i in (0, 3):
        got = b.get(keys[i]) if i == 0 else None
        if i == 0:
            check(torch.equal(got.view(torch.bfloat16), pages[0]), "page 0 differs")
    # pages 2.. through a chain given by prefix_keys read back bit-exact
    out = torch.empty(2, b.block_bytes, dtype=torch.uint8)
    check(b._get_pages(keys[2:4], ei, out) == 2, "get with prefix")
    check(torch.equal(out[1].view(torch.bfloat16), pages[3]), "page 3 differs")
    check(backend(d.sock, rank=1).batch_exists(keys) == 0, "TP rank 1 sees rank 0's pages")
    try:
        b.batch_set(keys[4:5], [torch.zeros(10, dtype=torch.bfloat16)])
        check(False, "a page of the wrong size was stored")
    except ValueError as e:
        print(f"  ok  wrong page size refused: {e}")
    print(f"  ok  stats {b.get_stats()}")
    host_pool_path(d, keys)
    pool = host_pools("page_first")
    b.register_mem_pool_host(pool)
    idx = pool.alloc(2 * P)
    d.stop()
    check(b.batch_exists(keys) == 0 and b.get(keys[0]) is None, "daemon down: not a miss")
    check(b.batch_get_v1(keys[:2], idx) == [False, False], "daemon down: batch_get_v1")
    check(not pool.kv_buffer.any(), "daemon down: something was written")
    check(b.batch_set_v1(keys[:2], idx) == [False, False], "daemon down: batch_set_v1")
    print(f"  ok  daemon down: misses, nothing written ({b.get_stats()['errors']} errors counted)")


def host_pools(layout):
    """SGLang's own device pool on the CPU and its host pool over it (as its unit tests do)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost
    kv = MHATokenToKVPool(1024, P, torch.bfloat16, 2, 64, 2, "cpu", False, start_layer=0,
                          end_layer=1)
    cap = kv.size if kv.host_capacity_tokens is None else kv.host_capacity_tokens
    return MHATokenToKVPoolHost(kv.get_device_pool_infos()[0].buffer_info, 2, 0, P, layout,
                                pin_memory=False, device_capacity_tokens=cap,
                                start_layer=kv.start_layer, end_layer=kv.end_layer,
                                write_back_staging=kv.hicache_write_back_staging)


def host_pool_path(d, keys0):
    import torch
    for layout in ("page_first", "layer_first"):
        keys = sglang_keys(list(range(7000, 7000 + 6 * P)), P)  # the same keys for both
        src, dst = host_pools(layout), host_pools(layout)
        b = backend(d.sock, page_first=layout == "page_first")
        b.register_mem_pool_host(src)
        idx = src.alloc(5 * P)
        g = torch.Generator().manual_seed(3)
        src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape, generator=g).to(torch.bfloat16))
        ok = b.batch_set_v1(keys[:5], idx)
        check(ok == [True] * 5, f"{layout}: batch_set_v1 {ok}")
        b2 = backend(d.sock, page_first=layout == "page_first")
        b2.register_mem_pool_host(dst)
        dst.alloc(3 * P)                      # other host pages than the source's
        idx2 = dst.alloc(6 * P)
        ok = b2.batch_get_v1(keys[:6], idx2)
        check(ok == [True] * 5 + [False], f"{layout}: batch_get_v1 {ok}")
        for i in range(5):
            a = src.get_data_page(int(idx[i * P]))
            c = dst.get_data_page(int(idx2[i * P]))
            check(torch.equal(a, c), f"{layout}: page {i} differs after the round trip")
        check(not dst.get_data_page(int(idx2[5 * P])).any(), f"{layout}: a missing page was written")
        print(f"  ok  {layout}: 5 host pages stored by batch_set_v1, loaded by batch_get_v1 "
              "into another host pool bit-exact; the 6th a miss")
    # the two layouts stored the same keys: each read back its own pages (checked above), and
    # a host pool of a layout tierkv does not know is refused
    b = backend(d.sock)
    pool = host_pools("page_first")
    pool.layout = "page_unified"
    try:
        b.register_mem_pool_host(pool)
        check(False, "an unknown host pool layout was accepted")
    except ValueError as e:
        print(f"  ok  unknown layout refused: {e}")


if __name__ == "__main__":
    try:
        import sglang  # noqa: F401
    except ImportError as e:
        print(f"skipped: {e}")
        sys.exit(77)
    main(run)
