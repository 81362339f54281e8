#!/usr/bin/env python3
"""prologue_torch: the prologue's work as plain PyTorch ops, the "unfused in PyTorch" reference
point of the prologue benchmark, on the same configurations as bench/prologue_bench.

Same method as prologue_bench: one call captured in a CUDA graph, 5 warm-up replays, then 50
replays each between its own CUDA events, median. Work per call: RMSNorm (fp32 math, bf16 out) of
Q and K heads, NeoX RoPE from a cos/sin table, dynamic per-(token, head) FP8 Q with its scales,
per-tensor FP8 K/V, K/V written into a paged pool [block][K|V][64][Hkv][128] by slot.

Usage: prologue_torch.py [--json]   (table on stderr with --json, JSON list on stdout)
Exit 77 when PyTorch or a GPU is missing.
"""
import json
import sys

try:
    import torch
except ImportError:
    print("prologue_torch: PyTorch not installed, skipped", file=sys.stderr)
    sys.exit(77)

D, P, MAX_POS, EPS = 128, 64, 4096, 1e-6
TOKENS = [1, 8, 64, 256, 4096, 16384, 65536]
HEADS = [(64, 8), (8, 1)]


def measure(tokens, hq, hkv):
    dev = "cuda"
    heads = hq + 2 * hkv
    decode = tokens < 4096
    qkv = torch.randn(tokens, heads * D, device=dev, dtype=torch.bfloat16)
    if decode:  # one token per request at position 4095, the last row of its page
        pos = torch.full((tokens,), MAX_POS - 1, device=dev, dtype=torch.int64)
        slots = torch.arange(tokens, device=dev, dtype=torch.int64) * P + (MAX_POS - 1) % P
        nblocks = tokens
    else:  # requests of 4096 tokens
        pos = torch.arange(tokens, device=dev, dtype=torch.int64) % MAX_POS
        slots = torch.arange(tokens, device=dev, dtype=torch.int64)
        nblocks = tokens // P
    blk, off = slots // P, slots % P
    freqs = 1.0 / (10000.0 ** (torch.arange(0, D, 2, device=dev, dtype=torch.float32) / D))
    ang = torch.arange(MAX_POS, device=dev, dtype=torch.float32)[:, None] * freqs[None, :]
    cos_t, sin_t = ang.cos(), ang.sin()
    qw = torch.ones(D, device=dev, dtype=torch.float32)
    kw = torch.ones(D, device=dev, dtype=torch.float32)
    pool = torch.zeros(nblocks, 2, P, hkv, D, device=dev, dtype=torch.uint8)
    inv_k, inv_v = 1.0 / 0.05, 1.0 / 0.05
    out = {}

    def rms(x, w):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w).to(torch.bfloat16)

    def rope(x):
        c = cos_t[pos][:, None, :]
        s = sin_t[pos][:, None, :]
        x1, x2 = x[..., : D // 2].float(), x[..., D // 2:].float()
        return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], -1).to(torch.bfloat16)

    def step():
        q, k, v = qkv.view(tokens, heads, D).split([hq, hkv, hkv], dim=1)
        q = rope(rms(q, qw))
        k = rope(rms(k, kw))
        qf = q.float()
        qs = (qf.abs().amax(-1, keepdim=True) / 448.0).clamp(min=1e-12)
        out["q8"] = (qf / qs).to(torch.float8_e4m3fn)
        out["qs"] = qs
        k8 = (k.float() * inv_k).to(torch.float8_e4m3fn)
        v8 = (v.float() * inv_v).to(torch.float8_e4m3fn)
        pool[blk, 0, off] = k8.view(torch.uint8)
        pool[blk, 1, off] = v8.view(torch.uint8)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    for _ in range(5):
        graph.replay()
    events = []
    for _ in range(50):
        e0 = torch.cuda.Event(enable_timing=True)
        e1 = torch.cuda.Event(enable_timing=True)
        e0.record()
        graph.replay()
        e1.record()
        events.append((e0, e1))
    torch.cuda.synchronize()
    ms = sorted(a.elapsed_time(b) for a, b in events)
    del graph, pool, qkv, out
    torch.cuda.empty_cache()
    return 0.5 * (ms[24] + ms[25]) * 1000.0


def main():
    as_json = "--json" in sys.argv[1:]
    if not torch.cuda.is_available():
        print("prologue_torch: no CUDA device, skipped", file=sys.stderr)
        return 77
    table = sys.stderr if as_json else sys.stdout
    rows = []
    for hq, hkv in HEADS:
        for tokens in TOKENS:
            rows.append({"bench": "prologue_torch", "tokens": tokens, "hq": hq, "hkv": hkv,
                         "head_dim": D, "page_tokens": P,
                         "torch_unfused_us": round(measure(tokens, hq, hkv), 3)})
    print(f"prologue_torch on {torch.cuda.get_device_name()} (torch {torch.__version__})", file=table)
    print(f"{'tokens':>7} {'heads':>6} {'torch_unfused_us':>17}", file=table)
    for r in rows:
        print(f"{r['tokens']:>7} {r['hq']:>3}/{r['hkv']:<2} {r['torch_unfused_us']:>17.2f}", file=table)
    if as_json:
        json.dump(rows, sys.stdout, indent=1)
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
