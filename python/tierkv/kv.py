"""kv.py - the block payload layout of docs/design.md ("The paged layout, described once"),
in torch: per block, per layer, K [P][Hkv][D], then V [P][Hkv][D], then (per_token_head
mode) the K scales [P][Hkv] as float32, the layer rounded up to 16 bytes.

bf16 storage is unquantised for a bf16 model: encode then decode gives the same bits.
fp8_e4m3 storage codes x / scale, saturated to +-448, round-half-even (torch's cast, the
kernels' rule); per_tensor mode takes fixed K and V scales (the engine's calibrated
k_scale / v_scale, 1.0 by default as in vLLM), per_token_head mode computes one K scale per
token and head, max(amax / 448, 1e-12), and keeps it in the block (V keeps the fixed scale).
"""
import torch

FP8_MAX = 448.0


def _round16(n):
    return (n + 15) // 16 * 16


class BlockCodec:
    def __init__(self, geometry, k_scale=1.0, v_scale=1.0):
        g = geometry
        if g.kv_dtype not in ("bf16", "fp8_e4m3"):
            raise ValueError(f"unknown kv_dtype {g.kv_dtype!r}")
        if g.scale_mode not in ("per_tensor", "per_token_head"):
            raise ValueError(f"unknown scale_mode {g.scale_mode!r}")
        if g.scale_mode == "per_token_head" and g.kv_dtype != "fp8_e4m3":
            raise ValueError("per_token_head scales need fp8_e4m3")
        self.g = g
        self.L, self.H, self.D, self.P = g.num_layers, g.num_kv_heads, g.head_dim, g.block_tokens
        self.elem = 2 if g.kv_dtype == "bf16" else 1
        self.per_token_head = g.scale_mode == "per_token_head"
        self.plane = self.P * self.H * self.D * self.elem          # bytes of K (or V) of a layer
        self.scales = self.P * self.H * 4 if self.per_token_head else 0
        self.layer_bytes = _round16(2 * self.plane + self.scales)
        self.block_bytes = self.L * self.layer_bytes
        self.k_scale, self.v_scale = float(k_scale), float(v_scale)

    def check(self, client):
        if client.block_bytes != self.block_bytes:
            raise ValueError(f"daemon blocks are {client.block_bytes} bytes, this layout "
                             f"{self.block_bytes}: geometry differs")

    # ---- one plane (K or V of one layer) to bytes and back ----
    def _codes(self, x, scale):
        if self.elem == 2:
            return x.to(torch.bfloat16).contiguous().view(torch.uint8)
        y = (x.float() / scale).clamp_(-FP8_MAX, FP8_MAX)
        return y.to(torch.float8_e4m3fn).view(torch.uint8)

    def _values(self, codes, scale, dtype):
        if self.elem == 2:
            return codes.contiguous().view(torch.bfloat16).to(dtype)
        return (codes.contiguous().view(torch.float8_e4m3fn).float() * scale).to(dtype)

    def encode(self, keys, values, out=None):
        """keys, values: per layer, [n * P, Hkv, D] tensors (n whole blocks). Returns (or fills)
        a uint8 tensor [n, block_bytes]."""
        if len(keys) != self.L or len(values) != self.L:
            raise ValueError(f"{len(keys)} layers given, geometry has {self.L}")
        T = keys[0].shape[0]
        if T % self.P or tuple(keys[0].shape[1:]) != (self.H, self.D):
            raise ValueError(f"K of shape {tuple(keys[0].shape)}: want [n*{self.P}, {self.H}, "
                             f"{self.D}]")
        n = T // self.P
        if out is None:
            out = torch.zeros(n, self.block_bytes, dtype=torch.uint8, device=keys[0].device)
        blk = out.view(n, self.L, self.layer_bytes)
        for li in range(self.L):
            k = keys[li].reshape(n, self.P, self.H, self.D)
            v = values[li].reshape(n, self.P, self.H, self.D)
            if self.per_token_head:
                ks = (k.float().abs().amax(dim=-1) / FP8_MAX).clamp_(min=1e-12)  # [n][P][H]
                kc = (k.float() / ks.unsqueeze(-1)).clamp_(-FP8_MAX, FP8_MAX) \
                    .to(torch.float8_e4m3fn).view(torch.uint8)
                off = 2 * self.plane
                blk[:, li, off:off + self.scales] = ks.contiguous().view(n, -1) \
                    .view(torch.uint8).view(n, self.scales)
            else:
                kc = self._codes(k, self.k_scale)
            blk[:, li, :self.plane] = kc.reshape(n, self.plane)
            blk[:, li, self.plane:2 * self.plane] = self._codes(v, self.v_scale).reshape(n, self.plane)
        return out

    def decode(self, payload, dtype=torch.bfloat16):
        """payload: uint8 tensor [n, block_bytes] (or its flat bytes). Returns (keys, values):
        per layer, [n * P, Hkv, D] tensors of dtype."""
        payload = payload.reshape(-1, self.block_bytes)
        n = payload.shape[0]
        blk = payload.view(n, self.L, self.layer_bytes)
        keys, values = [], []
        for li in range(self.L):
            kc = blk[:, li, :self.plane]
            vc = blk[:, li, self.plane:2 * self.plane]
            if self.per_token_head:
                off = 2 * self.plane
                ks = blk[:, li, off:off + self.scales].contiguous().view(torch.float32) \
                    .view(n, self.P, self.H, 1)
                k = (kc.contiguous().view(torch.float8_e4m3fn).float()
                     .view(n, self.P, self.H, self.D) * ks).to(dtype)
            else:
                k = self._values(kc, self.k_scale, dtype)
            v = self._values(vc, self.v_scale, dtype)
            keys.append(k.reshape(n * self.P, self.H, self.D))
            values.append(v.reshape(n * self.P, self.H, self.D))
        return keys, values
