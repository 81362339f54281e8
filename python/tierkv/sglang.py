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


KVC_IOV_MAX = 65536  # kvclient.h: pieces per block


def _view_pieces(t):
    """(byte offsets from t.data_ptr(), bytes each) of the contiguous runs of a strided tensor,
    in row-major order: the pieces whose concatenation is t.flatten()'s bytes."""
    dims = [(n, st) for n, st in zip(t.shape, t.stride()) if n != 1]
    if any(st <= 0 for _, st in dims):
        raise ValueError(f"tierkv: a view with strides {t.stride()}: not addressable")
    run, k = 1, len(dims)
    while k and dims[k - 1][1] == run:   # the innermost dimensions that are contiguous
        run *= dims[k - 1][0]
        k -= 1
    offs = [0]
    for n, st in dims[:k]:               # each outer index starts one run
        offs = [o + i * st for o in offs for i in range(n)]
    item = t.element_size()
    return [o * item for o in offs], run * item


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
    def _lease_range(self, lease, first, num_keys):
        return max(0, min(lease.num_blocks - first, num_keys))

    def _get_pages(self, keys, extra_info, out):
        """Fills out (contiguous [n, block_bytes] bytes) with the leading pages found; returns
        how many."""
        chain, first = self._chain(keys, extra_info)
        with self.client.lookup(self._tokens(chain)) as lease:
            n = self._lease_range(lease, first, len(keys))
            if n:
                self.client.get(lease, first, n, out=out[:n])
        self.stats["get_pages"] += n
        return n

    def _check_page(self, t):
        nbytes = t.numel() * t.element_size()
        if nbytes != self.block_bytes:
            raise ValueError(f"tierkv: page of {nbytes} bytes, the daemon's blocks are "
                             f"{self.block_bytes}: its geometry does not match this model")
        if t.device.type != "cpu":
            raise ValueError(f"tierkv: page on {t.device}: pages are host memory")

    def _tensor_iov(self, tensors):
        """The pieces of each tensor (a page, any strides) in its row-major byte order, padded
        with empty pieces to one count: an iov for get_scatter/put_gather."""
        per = []
        for t in tensors:
            self._check_page(t)
            offs, run = _view_pieces(t)
            per.append([(t.data_ptr() + o, run) for o in offs])
        k = max(len(p) for p in per)
        iov = torch.zeros(len(per), k, 2, dtype=torch.int64)
        for b, p in enumerate(per):
            iov[b, :len(p)] = torch.tensor(p, dtype=torch.int64)
        return iov

    def get(self, key, target_location=None, target_sizes=None):
        # the page goes straight into target_location (pieces, whatever its strides), or into
        # the tensor returned
        if target_location is None:
            out = torch.empty(1, self.block_bytes, dtype=torch.uint8)
            dst = None
        else:
            out = target_location
            dst = self._tensor_iov([target_location])
        try:
            chain, first = self._chain([key], None)
            with self.client.lookup(self._tokens(chain)) as lease:
                if self._lease_range(lease, first, 1) != 1:
                    return None
                if dst is None:
                    self.client.get(lease, first, 1, out=out)
                else:
                    self.client.get_scatter(lease, first, dst)
            self.stats["get_pages"] += 1
        except TierKVError as e:
            self.stats["errors"] += 1
            log.warning("tierkv: get failed, a miss: %s", e)
            return None
        return out[0] if target_location is None else target_location

    def batch_get(self, keys, target_locations=None, target_sizes=None):
        return [self.get(k, t) for k, t in zip(keys, target_locations or [None] * len(keys))]

    def set(self, key, value=None, target_location=None, target_sizes=None):
        return self.batch_set([key], [value])

    def batch_set(self, keys, values=None, target_locations=None, target_sizes=None):
        if not keys:
            return True
        # every value's own memory, gathered into the request: no stacked copy
        iov = self._tensor_iov(values)
        return self._put(keys, None, iov) == len(keys)

    def _put(self, keys, extra_info, iov):
        chain, first = self._chain(keys, extra_info)
        r = self.client.put_gather(self._tokens(chain), first, iov)
        self.stats["set_pages"] += r.num_stored
        return r.num_stored + r.num_duplicate

    # ---- host pool pages (SGLang's HiCache path) ----
    # A page's bytes are its flat data page (get_data_page(i, flat=True): K and V of every
    # layer, in the order the layout's view flattens them), and the host pool is read and
    # written in place: the page view SGLang itself takes (get_data_page(i, flat=False)) is cut
    # into its contiguous runs (2 per page for page_first, page_first_direct and page_head: K
    # and V; 2 x layers for layer_first), and one get_scatter / put_gather moves a batch
    # between those runs and tierkvd (attached: straight from the mapped L2 pool).
    LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")

    def register_mem_pool_host(self, mem_pool_host):
        layout = getattr(mem_pool_host, "layout", None)
        if layout not in self.LAYOUTS:
            raise ValueError(f"tierkv: host pool layout {layout!r}: tierkv stores the flat data "
                             f"pages of {', '.join(self.LAYOUTS)} only")
        ps = mem_pool_host.page_size
        if ps != self.P:
            raise ValueError(f"tierkv: page size {ps}, the daemon's blocks are {self.P} tokens")
        if layout != self.layout:
            self._connect(layout)
        self._check_page(mem_pool_host.get_dummy_flat_data_page())
        # The pieces of page 0's view, and the stride from one page to the next; every page
        # must be the same pieces at base0 + page * stride (checked on the first, second and
        # last pages), or this pool's pages are not what tierkv can address.
        num_pages = mem_pool_host.size // ps
        v0 = mem_pool_host.get_data_page(0, flat=False)
        self._check_page(v0)
        offs, run = _view_pieces(v0)
        if len(offs) > KVC_IOV_MAX:
            raise ValueError(f"tierkv: a {layout} page is {len(offs)} pieces, more than "
                             f"{KVC_IOV_MAX}")
        base0 = v0.data_ptr()
        stride = (mem_pool_host.get_data_page(ps, flat=False).data_ptr() - base0
                  if num_pages > 1 else 0)
        for p in sorted({1, num_pages - 1}):
            if p <= 0 or p >= num_pages:
                continue
            v = mem_pool_host.get_data_page(p * ps, flat=False)
            if v.data_ptr() != base0 + p * stride or _view_pieces(v) != (offs, run):
                raise ValueError(f"tierkv: host pool layout {layout}: page {p} is not at a "
                                 "fixed stride from page 0 with the same pieces")
        super().register_mem_pool_host(mem_pool_host)
        self._num_pages = num_pages
        self._page_base0, self._page_stride = base0, stride
        self._piece_offs = torch.tensor(offs, dtype=torch.int64)
        self._piece_bytes = run
        self._host_buf = v0  # keeps the pool's storage referenced with the pointers

    def _host_iov(self, host_indices, n):
        """The iov of the first n pages of host_indices (token indices; a page starts at every
        page_size-th), checked to be whole pages of the registered pool."""
        ps = self.mem_pool_host.page_size
        idx = torch.as_tensor(host_indices).reshape(-1)[::ps][:n].to(torch.int64)
        if idx.numel() < n:
            raise ValueError(f"tierkv: {n} pages but host_indices holds {idx.numel()}")
        if n and (bool((idx % ps != 0).any()) or int(idx.min()) < 0 or
                  int(idx.max()) // ps >= self._num_pages):
            raise ValueError(f"tierkv: host_indices {idx.tolist()} are not page starts of this "
                             f"host pool ({self._num_pages} pages of {ps} tokens)")
        iov = torch.empty(n, self._piece_offs.numel(), 2, dtype=torch.int64)
        iov[:, :, 0] = (self._page_base0 + (idx // ps) * self._page_stride)[:, None] + \
            self._piece_offs[None, :]
        iov[:, :, 1] = self._piece_bytes
        return iov

    def batch_get_v1(self, keys, host_indices, extra_info=None):
        if self.mem_pool_host is None:
            raise RuntimeError("tierkv: batch_get_v1 before register_mem_pool_host")
        iov = self._host_iov(host_indices, len(keys))
        n = 0
        try:
            chain, first = self._chain(keys, extra_info)
            with self.client.lookup(self._tokens(chain)) as lease:
                n = self._lease_range(lease, first, len(keys))
                if n:
                    self.client.get_scatter(lease, first, iov[:n])
            self.stats["get_pages"] += n
        except TierKVError as e:
            self.stats["errors"] += 1
            log.warning("tierkv: get failed, pages recomputed: %s", e)
            n = 0
        return [i < n for i in range(len(keys))]

    def batch_set_v1(self, keys, host_indices, extra_info=None):
        if self.mem_pool_host is None:
            raise RuntimeError("tierkv: batch_set_v1 before register_mem_pool_host")
        iov = self._host_iov(host_indices, len(keys))
        try:
            ok = self._put(keys, extra_info, iov) == len(keys)
        except TierKVError as e:
            self.stats["errors"] += 1
            log.warning("tierkv: put failed: %s", e)
            ok = False
        return [ok] * len(keys)

    def clear(self):
        self.client.evict(2)

    def get_stats(self):
        return dict(self.stats)
