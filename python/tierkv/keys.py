"""keys.py - the block key chain of docs/design.md ("Key test vectors"), computed in Python:
what the daemon derives from the tokens. Engines use it to name blocks by their tokens
(stable across processes and hosts), never by an engine's per-process hash seed.
"""
import hashlib
import struct

_DTYPES = {"fp8_e4m3": 0, "bf16": 1}
_SCALES = {"per_tensor": 0, "per_token_head": 1}


def fingerprint(g):
    """SHA256("tierkv/geometry/1" || u32le(L, Hkv, D, P, dtype, scale_mode) || model_id)."""
    m = hashlib.sha256(b"tierkv/geometry/1")
    m.update(struct.pack("<6I", g.num_layers, g.num_kv_heads, g.head_dim, g.block_tokens,
                         _DTYPES[g.kv_dtype], _SCALES[g.scale_mode]))
    m.update(g.model_id.encode())
    return m.digest()


def chain_keys(fp, namespace, tokens, block_tokens):
    """Keys of the full blocks of tokens: key[i] = SHA256(key[i-1] || block i as u32 LE),
    key[-1] = SHA256("tierkv/1" || fingerprint || namespace)."""
    prev = hashlib.sha256(b"tierkv/1" + fp + namespace.encode()).digest()
    out = []
    for i in range(len(tokens) // block_tokens):
        blk = tokens[i * block_tokens:(i + 1) * block_tokens]
        prev = hashlib.sha256(prev + struct.pack(f"<{block_tokens}I", *blk)).digest()
        out.append(prev)
    return out
