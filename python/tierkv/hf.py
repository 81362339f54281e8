"""hf.py - prefix caching for a transformers model through tierkv: store the KV of a prompt's
full blocks after a prefill, and in another process look the prompt up, load the cached
prefix into a DynamicCache and prefill only the rest.

The KV layout is read from the cache at run time: each layer's keys / values must be
[batch=1, kv_heads, tokens, head_dim] tensors matching the daemon's geometry; anything else
(another cache class, a quantised or offloaded cache, a shape that does not match) raises
LayoutError instead of guessing. Every failure of the daemon (down, geometry mismatch, a block
that fails its checksum) becomes a miss: load() returns 0 cached tokens and the caller
recomputes; nothing that did not round-trip intact is used.

On a GPU (load(device="cuda")), the prefix comes through the daemon's L1 tier when its GPU
pool is mapped in this process (Client.has_l1: promoted to L1, then gathered from the pool on
the device, decoded there); otherwise from L2 into pinned host memory and copied to the device.
"""
import logging

import torch

from .client import DataLoss, TierKVError, TIER_L1, TIER_L2
from .kv import BlockCodec

log = logging.getLogger("tierkv.hf")


class LayoutError(ValueError):
    pass


def _layers(cache):
    """[(keys, values)] of a transformers cache, refusing any layout not known here."""
    layers = getattr(cache, "layers", None)
    if type(cache).__name__ != "DynamicCache" or layers is None:
        raise LayoutError(f"unknown KV cache layout {type(cache).__name__}: tierkv reads "
                          "transformers' DynamicCache only")
    out = []
    for i, layer in enumerate(layers):
        if type(layer).__name__ != "DynamicLayer":
            raise LayoutError(f"layer {i}: unknown cache layer {type(layer).__name__}")
        out.append((layer.keys, layer.values))
    return out


class PrefixCache:
    """client: a tierkv.Client (or None: every load is a miss); codec: the BlockCodec of the
    daemon's geometry (default: built from the client's geometry)."""

    def __init__(self, client, codec=None, k_scale=1.0, v_scale=1.0):
        self.client = client
        self.codec = codec
        if client is not None and codec is None:
            self.codec = BlockCodec(client.geometry, k_scale, v_scale)
        if client is not None:
            self.codec.check(client)

    def _check_kv(self, k):
        c = self.codec
        if k.dim() != 4 or k.shape[0] != 1 or k.shape[1] != c.H or k.shape[3] != c.D:
            raise LayoutError(f"KV of shape {tuple(k.shape)}: want [1, {c.H}, tokens, {c.D}] "
                              f"(the daemon's geometry)")

    def store(self, tokens, cache):
        """Stores the KV of the full blocks of tokens from cache (which holds at least those
        positions). One put for all blocks. Returns the put's result (None when no block)."""
        layers = _layers(cache)
        c = self.codec
        if len(layers) != c.L:
            raise LayoutError(f"cache has {len(layers)} layers, geometry {c.L}")
        n = len(tokens) // c.P
        if n == 0:
            return None
        keys, values = [], []
        for k, v in layers:
            self._check_kv(k)
            keys.append(k[0, :, :n * c.P].transpose(0, 1))  # [T][H][D]
            values.append(v[0, :, :n * c.P].transpose(0, 1))
        payload = c.encode(keys, values)
        if payload.device.type != "cpu":  # encoded where the KV is; the put reads host memory
            payload = payload.cpu()
        return self.client.put(tokens[:n * c.P], 0, payload)

    def _promote(self, lease, tier, n):
        """Blocks of the lease in tier after a prefetch if some are elsewhere (fewer when one
        fails its checksum: the lease then covers only the blocks before it)."""
        if any(t != tier for t in lease.tiers()[:n]):
            self.client.prefetch(lease, tier)
            try:
                self.client.wait(lease, tier)
            except DataLoss as e:
                log.warning("tierkv: %s; %d blocks before it remain", e, lease.num_blocks)
            n = min(n, lease.num_blocks)
        return n

    def _load_l1(self, lease, n):
        """(uint8 [n', block_bytes] on the L1 pool's device, n'): the lease's first blocks
        promoted to L1 and gathered out of the mapped pool in one device gather."""
        n = self._promote(lease, TIER_L1, n)
        ids = lease.block_ids(TIER_L1)[:n]
        if n == 0 or min(ids) < 0:
            raise TierKVError(None, f"L1 promotion left blocks outside L1: {ids}")
        pool = self.client.l1_pool()
        buf = pool[torch.tensor(ids, dtype=torch.long, device=pool.device)]
        # the lease keeps the slots only until it is released: the gather must be done
        torch.cuda.current_stream(pool.device).synchronize()
        self.last_path = "l1"
        return buf, n

    def load(self, tokens, dtype=torch.bfloat16, max_tokens=None, device="cpu"):
        """(num_cached_tokens, DynamicCache or None), the cache's tensors on device. At most
        len(tokens) - 1 tokens come from the cache (the last prompt token is always computed:
        its logits start generation). self.last_path says how the blocks came: "l1" (gathered
        from the mapped GPU pool), "l2" (copied from L2 into host memory) or "l2+h2d" (then
        to the device), None on a miss."""
        self.last_path = None
        if self.client is None:
            return 0, None
        from transformers import DynamicCache
        c = self.codec
        device = torch.device(device)
        limit = (len(tokens) - 1) if max_tokens is None else min(max_tokens, len(tokens) - 1)
        try:
            with self.client.lookup(tokens[:max(limit, 0)]) as lease:
                n = lease.num_blocks
                if n == 0:
                    return 0, None
                buf = None
                if device.type == "cuda" and self.client.has_l1:
                    try:
                        buf, n = self._load_l1(lease, n)
                    except TierKVError as e:  # L1 full or off: the blocks are still in L2/L3
                        log.warning("tierkv: no L1 load, loading through L2: %s", e)
                if buf is None:
                    n = self._promote(lease, TIER_L2, min(n, lease.num_blocks))
                    if n == 0:
                        return 0, None
                    pin = device.type == "cuda"
                    buf = torch.empty(n, c.block_bytes, dtype=torch.uint8, pin_memory=pin)
                    self.client.get(lease, 0, n, out=buf)
                    self.last_path = "l2"
                    if pin:
                        buf = buf.to(device, non_blocking=True)
                        self.last_path = "l2+h2d"
        except TierKVError as e:
            log.warning("tierkv: lookup/load failed, recomputing: %s", e)
            self.last_path = None
            return 0, None
        keys, values = c.decode(buf, dtype)
        cache = DynamicCache()
        for li in range(c.L):
            cache.update(keys[li].transpose(0, 1).unsqueeze(0).contiguous(),
                         values[li].transpose(0, 1).unsqueeze(0).contiguous(), li)
        return n * c.P, cache


def tiny_llama(seed=0, max_positions=4096, layers=2, hidden=128, heads=2, kv_heads=2,
               vocab=512):
    """A small Llama built in code with fixed-seed random weights (nothing downloaded), bf16,
    eval mode; head_dim = hidden / heads (64 by default, a head_dim the daemon accepts)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=heads,
                      num_key_value_heads=kv_heads, max_position_embeddings=max_positions,
                      tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    return model


@torch.no_grad()
def prefill_and_generate(model, tokens, num_new, cache=None, cached=0):
    """Prefills tokens[cached:] on top of cache (None: from scratch), then generates num_new
    tokens greedily. Returns (new tokens, logits of each step [num_new, vocab] float32, cache
    after the prefill is not kept)."""
    from transformers import DynamicCache
    if cache is None:
        cache, cached = DynamicCache(), 0
    dev = next(model.parameters()).device
    ids = torch.tensor([tokens[cached:]], dtype=torch.long, device=dev)
    out = model(input_ids=ids, past_key_values=cache, use_cache=True)
    logits = [out.logits[0, -1].float()]
    new = [int(logits[-1].argmax())]
    for _ in range(num_new - 1):
        out = model(input_ids=torch.tensor([[new[-1]]], device=dev),
                    past_key_values=out.past_key_values, use_cache=True)
        logits.append(out.logits[0, -1].float())
        new.append(int(logits[-1].argmax()))
    return new, torch.stack(logits), out.past_key_values
