"""vllm.py - TierKVConnector, a vLLM v1 KV connector (KVConnectorBase_V1) backed by tierkvd.

    KVTransferConfig(kv_connector="TierKVConnector", kv_connector_module_path="tierkv.vllm",
                     kv_role="kv_both", kv_connector_extra_config={
                         "socket": "/run/tierkv/tierkv.sock", "model_id": "my-model"})

Keys are tierkv's own chain over the prompt tokens (the daemon derives them), never vLLM's
per-process block hashes, so a prefix stored by one vLLM process is found by any other.

Scheduler side: get_num_new_matched_tokens makes one lookup per request (the lease is
released at once: the call has no lasting effect) and counts whole blocks beyond what vLLM
computed locally, at most the prompt less its last token. update_state_after_alloc notes
the blocks to load; build_connector_meta hands loads and saves to the workers; a save is
planned once a request's whole prompt has been scheduled, for the prompt's full blocks only.

Worker side: register_kv_caches reads the layout of the KV cache tensors from vLLM (the
attention backend of the layers and the tensor shapes) and refuses any it does not know:
a silent misreading of a layout corrupts every prefix. start_load_kv loads synchronously
(one batched lookup for the step, one get per request, one scatter per layer); blocks that could not be loaded
(daemon down, evicted, a checksum failure) are returned by get_block_ids_with_load_errors
so vLLM recomputes them. wait_for_save stores with one put per request.

Supported: attention layers of one KV cache group, the CPU_ATTN and FLASH_ATTN layouts,
bf16 KV caches; storage bf16 (bit-exact) or fp8_e4m3 (extra config "kv_dtype").
"""
import logging
import time
from dataclasses import dataclass, field

import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

from .client import Client, Geometry, TierKVError, Unsupported
from .kv import BlockCodec

log = logging.getLogger("tierkv.vllm")

KNOWN_BACKENDS = ("CPU_ATTN", "FLASH_ATTN")


class LayoutError(ValueError):
    pass


@dataclass
class _Load:
    req_id: str
    tokens: list
    block_ids: list      # vLLM block ids of the blocks to fill, in order
    first_block: int     # chain index of block_ids[0]


@dataclass
class _Save:
    req_id: str
    tokens: list         # the prompt's full blocks
    block_ids: list      # vLLM block ids of chain blocks first_block..
    first_block: int = 0


@dataclass
class TierKVMetadata(KVConnectorMetadata):
    loads: list = field(default_factory=list)
    saves: list = field(default_factory=list)


def _geometry(vllm_config, extra, block_size):
    """From the extra config where given (num_layers, num_kv_heads, head_dim), else from
    vLLM's model config."""
    mc = vllm_config.model_config
    layers = extra.get("num_layers") or mc.get_num_layers(vllm_config.parallel_config)
    heads = extra.get("num_kv_heads") or mc.get_num_kv_heads(vllm_config.parallel_config)
    head_dim = extra.get("head_dim") or mc.get_head_size()
    model_id = extra.get("model_id") or (mc.model if mc is not None else "")
    tp = 0
    try:  # a worker's TP rank; the scheduler (one process for all ranks) counts rank 0's blocks
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        tp = get_tensor_model_parallel_rank()
    except Exception:  # noqa: BLE001 - not initialised: the scheduler process, or tests
        tp = 0
    return Geometry(int(layers), int(heads), int(head_dim), int(block_size),
                    extra.get("kv_dtype", "bf16"), extra.get("scale_mode", "per_tensor"),
                    f"{model_id}/tp{tp}")


class TierKVConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ex = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self._block = vllm_config.cache_config.block_size
        if self._block not in (16, 32, 64, 128):
            raise ValueError(f"tierkv: block_size {self._block}: tierkvd takes 16, 32, 64, 128")
        self._geo = _geometry(vllm_config, ex, self._block)
        self._codec = BlockCodec(self._geo, float(ex.get("k_scale", 1.0)),
                                 float(ex.get("v_scale", 1.0)))
        self._sock = ex.get("socket")
        self._attach = ex.get("attach_socket")
        self._ns = ex.get("namespace", "")
        self._timeout = int(ex.get("timeout_ms", 2000))
        self._client = None
        self._next_try = 0.0
        # scheduler state
        self._computed = {}   # req_id -> num locally computed tokens at the match
        self._loads = {}      # req_id -> _Load
        self._reqs = {}       # req_id -> [Request, block ids] for planning saves
        self._saved = set()
        self._hit = {}        # req_id -> blocks already in tierkv (matched), not saved again
        # worker state
        self._kv = None       # [(name, tensor)]
        self._backend = None
        self._errors = set()

    # ---- the daemon ----
    def _conn(self):
        """The client, or None while the daemon cannot be reached (retried every 5 s)."""
        if self._client is None and time.monotonic() >= self._next_try:
            try:
                self._client = Client(self._sock, attach_socket=self._attach,
                                      namespace=self._ns, geometry=self._geo,
                                      timeout_ms=self._timeout)
                self._codec.check(self._client)
            except (TierKVError, ValueError) as e:
                log.warning("tierkv: not connected, every lookup misses: %s", e)
                self._client = None
                self._next_try = time.monotonic() + 5.0
        return self._client

    def _drop(self, e):
        log.warning("tierkv: %s", e)
        if self._client is not None:
            self._client.close()
        self._client = None
        self._next_try = time.monotonic() + 5.0

    # ==== scheduler side ====
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        toks = list(request.prompt_token_ids or [])
        limit = (len(toks) - 1) // self._block * self._block
        c = self._conn()
        if c is None or limit <= num_computed_tokens:
            return 0, False
        try:
            with c.lookup(toks[:limit]) as lease:
                hit = lease.num_blocks * self._block
        except TierKVError as e:
            self._drop(e)
            return 0, False
        self._computed[request.request_id] = num_computed_tokens
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        rid = request.request_id
        ids = list(blocks.get_block_ids()[0]) if blocks is not None else []
        self._reqs.setdefault(rid, [request, []])
        if num_external_tokens <= 0:
            return
        local = self._computed.get(rid, 0)
        first = local // self._block
        n = num_external_tokens // self._block
        # blocks holds all the request's blocks (vLLM's get_blocks): local prefix hits first
        toks = list(request.prompt_token_ids)[:(first + n) * self._block]
        self._loads[rid] = _Load(rid, toks, ids[first:first + n], first)
        self._hit[rid] = first + n

    def build_connector_meta(self, scheduler_output):
        meta = TierKVMetadata(loads=list(self._loads.values()))
        self._loads.clear()
        for nr in scheduler_output.scheduled_new_reqs:
            ent = self._reqs.setdefault(nr.req_id, [None, []])
            ent[1] = list(nr.block_ids[0])
            self._plan_save(meta, nr.req_id, nr.prompt_token_ids or [],
                            nr.num_computed_tokens
                            + scheduler_output.num_scheduled_tokens.get(nr.req_id, 0))
        cr = scheduler_output.scheduled_cached_reqs
        for i, rid in enumerate(cr.req_ids):
            ent = self._reqs.get(rid)
            if ent is None or ent[0] is None:
                continue
            new = cr.new_block_ids[i]
            if new is not None:
                ent[1] = (list(new[0]) if rid in cr.resumed_req_ids else ent[1] + list(new[0]))
            self._plan_save(meta, rid, list(ent[0].prompt_token_ids or []),
                            cr.num_computed_tokens[i]
                            + scheduler_output.num_scheduled_tokens.get(rid, 0))
        return meta

    def _plan_save(self, meta, rid, prompt, scheduled_through):
        if rid in self._saved or scheduled_through < len(prompt):
            return
        n = len(prompt) // self._block
        ids = self._reqs[rid][1]
        first = self._hit.get(rid, 0)
        if n > first and len(ids) >= n:
            meta.saves.append(_Save(rid, list(prompt[:n * self._block]), ids[first:n], first))
        self._saved.add(rid)

    def request_finished(self, request, block_ids):
        rid = request.request_id
        for d in (self._computed, self._loads, self._reqs, self._hit):
            d.pop(rid, None)
        self._saved.discard(rid)
        return False, None

    # ==== worker side ====
    def register_kv_caches(self, kv_caches):
        names = self._backends()
        if len(set(names)) != 1 or names[0] not in KNOWN_BACKENDS:
            raise LayoutError(f"tierkv: attention backend {names}: tierkv knows the KV layout "
                              f"of {', '.join(KNOWN_BACKENDS)} only")
        self._backend = names[0]
        g = self._geo
        want = (g.num_kv_heads, g.block_tokens, 2 * g.head_dim)
        items = list(kv_caches.items())
        if len(items) != g.num_layers:
            raise LayoutError(f"tierkv: {len(items)} KV cache layers, geometry {g.num_layers}")
        for name, t in items:
            if t.dim() != 4 or tuple(t.shape[1:]) != want or t.dtype != torch.bfloat16:
                raise LayoutError(f"tierkv: layer {name}: KV cache {tuple(t.shape)} {t.dtype}: "
                                  f"want [blocks, {want[0]}, {want[1]}, {want[2]}] bfloat16 "
                                  f"({self._backend})")
            if self._backend == "CPU_ATTN" and not t.is_contiguous():
                raise LayoutError(f"tierkv: layer {name}: CPU_ATTN cache is not contiguous")
        self._kv = items

    def _backends(self):
        """Names of the attention backends of the model's layers, as vLLM resolves them;
        where vLLM cannot resolve one (no platform: e.g. its CUDA build on a host without a
        GPU), the backend the user chose (--attention-backend); else LayoutError."""
        from vllm.distributed.kv_transfer.kv_connector.utils import get_current_attn_backends
        try:
            return [b.get_name() for b in get_current_attn_backends(self._vllm_config)]
        except (ValueError, AttributeError, RuntimeError) as e:
            chosen = getattr(getattr(self._vllm_config, "attention_config", None), "backend", None)
            if chosen is None:
                raise LayoutError(f"tierkv: vLLM cannot tell the attention backend ({e}): "
                                  "the KV layout is unknown") from None
            return [chosen.name]

    def _read(self, t, ids):
        """K, V of vLLM blocks ids of one layer as [n * P, H, D]."""
        x = t[ids]                                          # [n, H, P, 2D]
        n, H, P, C = x.shape
        D = C // 2
        if self._backend == "CPU_ATTN":                     # per head: K [P][D] then V [P][D]
            x = x.reshape(n, H, 2 * P, D)
            k, v = x[:, :, :P], x[:, :, P:]
        else:                                               # per token: [K | V]
            k, v = x[..., :D], x[..., D:]
        return (k.permute(0, 2, 1, 3).reshape(n * P, H, D),
                v.permute(0, 2, 1, 3).reshape(n * P, H, D))

    def _write(self, t, ids, k, v):
        n = len(ids)
        H, P, C = t.shape[1:]
        D = C // 2
        k = k.reshape(n, P, H, D).permute(0, 2, 1, 3)
        v = v.reshape(n, P, H, D).permute(0, 2, 1, 3)
        if self._backend == "CPU_ATTN":
            x = torch.cat([k, v], dim=2).reshape(n, H, P, C)
        else:
            x = torch.cat([k, v], dim=3)
        t[torch.tensor(ids, dtype=torch.long)] = x.to(t.dtype)

    def start_load_kv(self, forward_context, **kwargs):
        loads = self._get_connector_metadata().loads
        if not loads:
            return
        c = self._conn() if self._kv is not None else None
        leases = [None] * len(loads)
        if c is not None:
            try:  # the step's loads: one lookup for all of them
                leases = c.lookup_batch([ld.tokens for ld in loads])
            except Unsupported:
                leases = [None] * len(loads)
            except TierKVError as e:
                self._drop(e)
                c = None
        for ld, lease in zip(loads, leases):
            loaded = 0
            if c is not None:
                try:
                    if lease is None:
                        lease = c.lookup(ld.tokens)
                    with lease:
                        loaded = self._load(c, ld, lease)
                except TierKVError as e:
                    self._drop(e)
                    c, loaded = None, 0
            elif lease is not None:
                lease.release()
            self._errors.update(ld.block_ids[loaded:])

    def _load(self, c, ld, lease):
        """Gets the lease's blocks of ld (one get) into the paged cache; how many it loaded."""
        n = max(0, min(lease.num_blocks - ld.first_block, len(ld.block_ids)))
        if n:
            buf = torch.empty(n, self._codec.block_bytes, dtype=torch.uint8)
            c.get(lease, ld.first_block, n, out=buf)
            keys, values = self._codec.decode(buf, torch.bfloat16)
            for li, (_, t) in enumerate(self._kv):
                self._write(t, ld.block_ids[:n], keys[li], values[li])
        return n

    def wait_for_layer_load(self, layer_name):
        return  # loads are synchronous in start_load_kv

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return  # saved whole, after the forward, in wait_for_save

    def wait_for_save(self):
        meta = self._get_connector_metadata()
        c = self._conn() if meta.saves else None
        if c is None or self._kv is None:
            return
        for sv in meta.saves:
            keys, values = zip(*(self._read(t, sv.block_ids) for _, t in self._kv))
            payload = self._codec.encode(list(keys), list(values))
            try:
                c.put(sv.tokens, sv.first_block, payload)
            except TierKVError as e:
                self._drop(e)
                return

    def get_finished(self, finished_req_ids):
        return None, None

    def get_block_ids_with_load_errors(self):
        out, self._errors = self._errors, set()
        return out

    def shutdown(self):
        if self._client is not None:
            self._client.close()
            self._client = None
