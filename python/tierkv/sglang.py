"""sglang.py - TierKVStore, an SGLang HiCache storage backend (HiCacheStorage) on tierkvd.

    --hicache-storage-backend dynamic --hicache-storage-backend-extra-config '{
        "backend_name": "tierkv", "module_path": "tierkv.sglang", "class_name": "TierKVStore",
        "socket": "/run/tierkv/tierkv.sock"}'

SGLang names a page by a sha256 hex chain over its tokens (4-byte LE), per model and TP rank;
tierkvd keys blocks by tokens. A page key becomes one block of "tokens" (the key's 32 bytes as
8 u32 words, repeated to fill block_tokens), and a batch of keys, with the prefix_keys SGLang
passes, one token sequence: tierkv's chain over it is a function of the SGLang chain, so one
lookup answers batch_exists (consecutive hits from the start) and one put / one get moves a
whole batch. The namespace is "<model>/tp<rank>/<host pool layout>": ranks, models and the
host pool's page layouts (SGLang's flat data page differs per layout) never mix.

Payloads are SGLang's host pages as SGLang lays them out (its flat data page: K and V of every
layer), stored opaque: a block's bytes must equal one page (the daemon's block_bytes, its
geometry set to the model's layers, kv heads per rank, head_dim and page size). A daemon
failure is a miss (batch_exists 0, get None, batch_get_v1 False for the pages not read: SGLang
recomputes them); batch_get_v1/batch_set_v1 never return None, and raise on misuse (no host
pool registered, a page size or layout that does not match).
"""
import hashlib
import logging
import struct

import torch

from sglang.srt.mem_cache.hicache_storage import HiCacheStorage

from .client import Client, TierKVError

log = logging.getLogger("tierkv.sglang")


def _key_words(key):
    """8 u32 words of a page key (sha256 hex, or any string: hashed)."""
    try:
        raw = bytes.fromhex(key)
        if len(raw) != 32:
            raise ValueError
    except ValueError:
        raw = hashlib.sha256(key.encode()).digest()
    return list(struct.unpack("<8I", raw))


class TierKVStore(HiCacheStorage):
    def __init__(self, storage_config, kwargs=None):
        ex = dict(getattr(storage_config, "extra_config", None) or {})
        model = storage_config.model_name or ex.get("model_id", "model")
        self._ns_base = f"{model}/tp{storage_config.tp_rank}"
        self._ex = ex
        self.mem_pool_host = None
        self._connect("page_first" if storage_config.is_page_first_layout else "layer_first")
        self.stats = {"exists": 0, "hit_pages": 0, "get_pages": 0, "set_pages": 0, "errors": 0}

    def _connect(self, layout):
        self.layout = layout
        self.namespace = f"{self._ns_base}/{layout}"
        old = getattr(self, "client", None)
        self.client = Client(self._ex.get("socket"), attach_socket=self._ex.get("attach_socket"),
                             namespace=self.namespace,
                             timeout_ms=int(self._ex.get("timeout_ms", 5000)))
        if old is not None:
            old.close()
        self.P = self.client.block_tokens
        self.block_bytes = self.client.block_bytes

    def _tokens(self, keys):
        out = []
        reps = self.P // 8
        for k in keys:
            out.extend(_key_words(k) * reps)
        return out

    def _chain(self, keys, extra_info):
        prefix = list(getattr(extra_info, "prefix_keys", None) or []) if extra_info else []
        return prefix + list(keys), len(prefix)

    # ---- existence ----
    def batch_exists(self, keys, extra_info=None):
        chain, first = self._chain(keys, extra_info)
        self.stats["exists"] += 1
        try:
            with self.client.lookup(self._tokens(chain)) as lease:
                hit = max(0, lease.num_blocks - first)
        except TierKVError as e:  # a miss: SGLang recomputes
            self.stats["errors"] += 1
            log.warning("tierkv: lookup failed, a miss: %s", e)
            return 0
        self.stats["hit_pages"] += hit
        return hit

    def exists(self, key):
        return self.batch_exists([key]) == 1

    # ---- values as tensors ----
    def _get_pages(self, keys, extra_info, out):
        """Fills out [n, block_bytes] uint8 with the leading pages found; returns how many."""
        chain, first = self._chain(keys, extra_info)
        with self.client.lookup(self._tokens(chain)) as lease:
            n = max(0, min(lease.num_blocks - first, len(keys)))
            if n:
                self.client.get(lease, first, n, out=out[:n])
        self.stats["get_pages"] += n
        return n

    def _check_page(self, t):
        nbytes = t.numel() * t.element_size()
        if nbytes != self.block_bytes:
            raise ValueError(f"tierkv: page of {nbytes} bytes, the daemon's blocks are "
                             f"{self.block_bytes}: its geometry does not match this model")

    def get(self, key, target_location=None, target_sizes=None):
        buf = torch.empty(1, self.block_bytes, dtype=torch.uint8)
        try:
            if self._get_pages([key], None, buf) != 1:
                return None
        except TierKVError as e:
            self.stats["errors"] += 1
            log.warning("tierkv: get failed, a miss: %s", e)
            return None
        if target_location is not None:
            self._check_page(target_location)
            target_location.view(-1).view(torch.uint8).copy_(buf[0])
            return target_location
        return buf[0]

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k, t) for k, t in zip(keys, target_locations or [None] * len(keys))]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        if not keys:
            return True
        for v in values:
            self._check_page(v)
        payload = torch.stack([v.contiguous().view(-1).view(torch.uint8) for v in values])
        return self._put(keys, None, payload) == len(keys)

    def _put(self, keys, extra_info, payload):
        chain, first = self._chain(keys, extra_info)
        r = self.client.put(self._tokens(chain), first, payload.contiguous(), len(keys))
        self.stats["set_pages"] += r.num_stored
        return r.num_stored + r.num_duplicate

    # ---- host pool pages (SGLang's HiCache path) ----
    LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

    def register_mem_pool_host(self, mem_pool_host):
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in self.LAYOUTS:
            raise ValueError(f"tierkv: host pool layout {layout!r}: tierkv stores the flat data "
                             f"pages of {', '.join(self.LAYOUTS)} only")
        if mem_pool_host.page_size != self.P:
            raise ValueError(f"tierkv: page size {mem_pool_host.page_size}, the daemon's blocks "
                             f"are {self.P} tokens")
        super().register_mem_pool_host(mem_pool_host)
        if layout != self.layout:
            self._connect(layout)
        page = mem_pool_host.get_dummy_flat_data_page()
        self._check_page(page)
        self.page_dtype = page.dtype

    def _page_indices(self, host_indices):
        ps = self.mem_pool_host.page_size
        return [int(host_indices[i]) for i in range(0, len(host_indices), ps)]

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        if self.mem_pool_host is None:
            raise RuntimeError("tierkv: batch_get_v1 before register_mem_pool_host")
        buf = torch.empty(len(keys), self.block_bytes, dtype=torch.uint8)
        try:
            n = self._get_pages(keys, extra_info, buf)
        except TierKVError as e:
            self.stats["errors"] += 1
            log.warning("tierkv: get failed, pages recomputed: %s", e)
            n = 0
        for i, idx in enumerate(self._page_indices(host_indices)[:n]):
            self.mem_pool_host.set_from_flat_data_page(idx, buf[i].view(self.page_dtype))
        return [i < n for i in range(len(keys))]

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        if self.mem_pool_host is None:
            raise RuntimeError("tierkv: batch_set_v1 before register_mem_pool_host")
        pages = [self.mem_pool_host.get_data_page(idx, flat=True).view(torch.uint8)
                 for idx in self._page_indices(host_indices)[:len(keys)]]
        try:
            ok = self._put(keys, extra_info, torch.stack(pages)) == len(keys)
        except TierKVError as e:
            self.stats["errors"] += 1
            log.warning("tierkv: put failed: %s", e)
            ok = False
        return [ok] * len(keys)

    def clear(self):
        self.client.evict(2)

    def get_stats(self):
        return dict(self.stats)
