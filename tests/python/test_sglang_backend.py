"""test_sglang_backend.py - tierkv.sglang.TierKVStore loaded by SGLang's own
StorageBackendFactory ("dynamic" backend, module_path/class_name) from SGLang's
HiCacheStorageConfig, against a real tierkvd: keys are SGLang-style sha256 hex chains;
batch_exists counts consecutive hits from the start (with prefix_keys), set/get round-trip
pages bit-exact, ranks are isolated, a wrong page size is refused, a daemon that goes down
gives misses (never None from a batch call, nothing written). Then SGLang's HiCache path: its own
MHATokenToKVPool (on the CPU) and MHATokenToKVPoolHost (page_first and layer_first layouts),
pages written by batch_set_v1 from the host pool and read back by batch_get_v1 into other
host pages of another pool: bit-exact; a miss reports False for the pages not found.
Every host-pool layout tierkv knows (page_first, layer_first, page_first_direct, page_head),
by value and attached: a stored block is SGLang's own flat data page byte for byte; the
batch is one libkvclient call whose pieces all lie in the host pool's own buffer (no staging
buffer: the backend never calls the pool's flat-page copy methods); bad host indices are
refused before anything is read or written.
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


def backend(sock, rank=0, page_first=True, attach=None):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
    cfg = HiCacheStorageConfig(tp_rank=rank, tp_size=2, pp_rank=0, pp_size=1, attn_cp_rank=0,
                               attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
                               is_page_first_layout=page_first, model_name="tiny",
                               extra_config={"backend_name": "tierkv",
                                             "module_path": "tierkv.sglang",
                                             "class_name": "TierKVStore", "socket": sock,
                                             "attach_socket": attach})
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
    # a target and values that are views with strides (not contiguous): read and written in
    # place, piece by piece
    big = torch.zeros(b.block_bytes // 128, 128, dtype=torch.bfloat16)
    view = big[:, :64]
    check(b.get(keys[0], target_location=view) is view, "get into a view")
    check(torch.equal(view.flatten(), pages[0]) and not big[:, 64:].any(),
          "get into a strided view: wrong bytes, or bytes outside the view")
    big2 = torch.randn(b.block_bytes // 128, 128, generator=g).to(torch.bfloat16)
    check(b.batch_set(keys[4:5], [big2[:, 64:]]), "batch_set of a strided view")
    got = b.get(keys[4])
    check(torch.equal(got.view(torch.bfloat16), big2[:, 64:].flatten()), "strided set differs")
    check(backend(d.sock, rank=1).batch_exists(keys) == 0, "TP rank 1 sees rank 0's pages")
    try:
        b.batch_set(keys[4:5], [torch.zeros(10, dtype=torch.bfloat16)])
        check(False, "a page of the wrong size was stored")
    except ValueError as e:
        print(f"  ok  wrong page size refused: {e}")
    print(f"  ok  stats {b.get_stats()}")
    host_pool_path(d, keys)
    unknown_layout(d)
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


class Spy:
    """Counts a client's scatter/gather calls and checks that every piece they are given lies
    in the host pool's buffer (so the bytes move between tierkvd and the pool itself), and
    makes the pool's flat-page copies (the old staging path) fail if anything calls them."""

    def __init__(self, b, pool):
        self.calls, self.bytes = 0, 0
        lo = pool.kv_buffer.data_ptr()
        hi = lo + pool.kv_buffer.numel() * pool.kv_buffer.element_size()
        c = b.client

        def wrap(fn, iov_arg):
            def spy(*args):
                iov = args[iov_arg]
                self.calls += 1
                a, n = iov[:, :, 0], iov[:, :, 1]
                check(bool(((a >= lo) & (a + n <= hi)).all()), "a piece outside the host pool")
                self.bytes += int(n.sum())
                return fn(*args)
            return spy
        c.get_scatter = wrap(c.get_scatter, 2)
        c.put_gather = wrap(c.put_gather, 2)

        def staged(*a, **k):
            raise AssertionError("the backend copied a page through a flat staging page")
        pool.get_data_page = staged
        pool.set_from_flat_data_page = staged


LAYOUTS = ("page_first", "layer_first", "page_first_direct", "page_head")


def host_pool_path(d, keys0):
    import torch
    for layout in LAYOUTS:
        for attach in (False, True):
            host_pool_round_trip(d, layout, attach)


def host_pool_round_trip(d, layout, attach):
    import torch
    how = f"{layout}{', attached' if attach else ''}"
    base = 7000 + 100 * LAYOUTS.index(layout) + 50 * attach
    keys = sglang_keys(list(range(base, base + 6 * P)), P)
    src, dst = host_pools(layout), host_pools(layout)
    pf = layout != "layer_first"  # SGLang's flag names page_first vs layer_first only
    b = backend(d.sock, page_first=pf, attach=d.attach_sock if attach else None)
    b.register_mem_pool_host(src)
    check(b.layout == layout and b.client.attached == attach, f"{how}: {b.layout}")
    idx = src.alloc(5 * P)
    g = torch.Generator().manual_seed(3)
    src.kv_buffer.copy_(torch.randn(src.kv_buffer.shape, generator=g).to(torch.bfloat16))
    flat = [src.get_data_page(int(idx[i * P])).view(torch.uint8).clone() for i in range(5)]
    pieces = b._piece_offs.numel()
    spy = Spy(b, src)
    ok = b.batch_set_v1(keys[:5], idx)
    check(ok == [True] * 5, f"{how}: batch_set_v1 {ok}")
    check(spy.calls == 1 and spy.bytes == 5 * b.block_bytes,
          f"{how}: batch_set_v1 made {spy.calls} calls over {spy.bytes} bytes")
    # what tierkvd holds is SGLang's flat data page, byte for byte
    with d.client(namespace=b.namespace) as c, c.lookup(b._tokens(keys[:5])) as lease:
        check(lease.num_blocks == 5, f"{how}: {lease.num_blocks} blocks stored")
        got = torch.empty(5, b.block_bytes, dtype=torch.uint8)
        c.get(lease, 0, 5, out=got)
    for i in range(5):
        check(torch.equal(got[i], flat[i]), f"{how}: block {i} is not SGLang's flat page")

    b2 = backend(d.sock, page_first=pf, attach=d.attach_sock if attach else None)
    b2.register_mem_pool_host(dst)
    dst.alloc(3 * P)                      # other host pages than the source's
    idx2 = dst.alloc(6 * P)
    spy2 = Spy(b2, dst)
    ok = b2.batch_get_v1(keys[:6], idx2)
    check(ok == [True] * 5 + [False], f"{how}: batch_get_v1 {ok}")
    check(spy2.calls == 1 and spy2.bytes == 5 * b2.block_bytes,
          f"{how}: batch_get_v1 made {spy2.calls} calls over {spy2.bytes} bytes")
    del dst.get_data_page, src.get_data_page  # the spies' guards: read the pages back
    for i in range(5):
        c_ = dst.get_data_page(int(idx2[i * P])).view(torch.uint8)
        check(torch.equal(c_, flat[i]), f"{how}: page {i} differs after the round trip")
    check(not dst.get_data_page(int(idx2[5 * P])).any(), f"{how}: a missing page was written")
    # host indices that are not page starts of this pool: refused, nothing read or written
    before = dst.kv_buffer.clone()
    for bad in (idx2 + 1, torch.full_like(idx2, dst.size), idx2[:P]):
        try:
            b2.batch_get_v1(keys[:2], bad)
            check(False, f"{how}: bad host indices accepted")
        except ValueError:
            pass
    check(torch.equal(before, dst.kv_buffer), f"{how}: a refused get wrote the pool")
    print(f"  ok  {how}: 5 host pages ({pieces} pieces each) stored by one put_gather from "
          "the pool, equal to SGLang's flat pages, loaded by one get_scatter into another "
          "pool bit-exact; the 6th a miss; bad host indices refused")


def unknown_layout(d):
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
