#!/usr/bin/env python3
"""flashinfer_decode.py - the peer for bench/decode_bench: FlashInfer's paged decode
(BatchDecodeWithPagedKVCacheWrapper) with FP8 KV on the same shapes, timed by the same method.

Same cases, head dims, page size and KV bytes as decode_bench (head dim 128, 64 tokens per page,
FP8 e4m3 K/V with per-tensor scales, Hq/Hkv 8/1 and 64/8). FlashInfer's layout differs from
tierkv's (separate K and V caches, NHD), so the KV is built in its layout once, outside the
timing, with random finite e4m3 bytes. Q is BF16: FlashInfer's decode takes no FP8 Q with
per-token-head scales. Its decode wrapper serves one query token per request, so query lengths
2..8 (speculative verify) run its paged prefill wrapper (BatchPrefillWithPagedKVCacheWrapper,
causal, FA2 backend: the one that takes BF16 Q over FP8 KV), as an engine would.

Method (decode_bench's): plan() outside the timing; one run() captured in a CUDA graph; 5 warm-up
replays; 50 replays each between its own CUDA events; the median. Both of FlashInfer's decode
kernels are timed (use_tensor_cores False and True, the second its choice for large GQA groups)
and the faster is the peer's figure, its kernel named in "flashinfer_kernel" ("prefill" for
query lengths above 1).

FlashInfer compiles its kernels on first use (nvcc, a minute or more per kernel); those
compilations happen before any timing. Its wheels come from scripts/peer-wheels.

Usage: python3 bench/flashinfer_decode.py [--out FILE] [--qlens a,b,...]   (JSON list; feed it to
decode_bench --peer FILE). Exit 77 when flashinfer or a GPU is missing.
"""
import argparse
import json
import statistics
import sys

CASES = [
    ("64x512", [(64, 512)]),
    ("64x4096", [(64, 4096)]),
    ("32x128+32x4096", [(32, 128), (32, 4096)]),
    ("15x64+1x16384", [(15, 64), (1, 16384)]),
    ("1x65536+7x4096", [(1, 65536), (7, 4096)]),
    ("1x65536+15x4096", [(1, 65536), (15, 4096)]),
    ("1x65536+31x4096", [(1, 65536), (31, 4096)]),
    ("1x131072+31x4096", [(1, 131072), (31, 4096)]),
    ("2x32768+30x4096", [(2, 32768), (30, 4096)]),
    ("256x333", [(256, 333)]),
    ("1x200003+63x97", [(1, 200003), (63, 97)]),
    ("7x4097+9x1023+16x257", [(7, 4097), (9, 1023), (16, 257)]),
]
Q_LENS = (1, 2, 3, 4, 5, 8)
HEADS = [(8, 1), (64, 8)]
HEAD_DIM = 128
PAGE = 64


def time_graph(graph, torch, reps=50, warm=5):
    for _ in range(warm):
        graph.replay()
    times = []
    for _ in range(reps):
        a = torch.cuda.Event(enable_timing=True)
        b = torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000.0)
    return statistics.median(times)


def make_kv(torch, lens, hkv):
    """FlashInfer's paged inputs for these KV lengths: caches, indptr, page ids, last lengths."""
    pages = [(n + PAGE - 1) // PAGE for n in lens]
    total_pages = sum(pages)
    dev = "cuda"
    # random finite e4m3 codes (exponent field < 15, as decode_bench), in FlashInfer's NHD layout
    raw = torch.randint(0, 256, (2, total_pages, PAGE, hkv, HEAD_DIM), dtype=torch.uint8, device=dev)
    raw &= 0xF7
    k_cache = raw[0].view(torch.float8_e4m3fn)
    v_cache = raw[1].view(torch.float8_e4m3fn)
    perm = torch.randperm(total_pages, device=dev, dtype=torch.int32)
    indptr = torch.zeros(len(lens) + 1, dtype=torch.int32, device=dev)
    indptr[1:] = torch.cumsum(torch.tensor(pages, dtype=torch.int32, device=dev), 0)
    last = torch.tensor([(n - 1) % PAGE + 1 for n in lens], dtype=torch.int32, device=dev)
    return (k_cache, v_cache), indptr, perm, last


def capture(torch, run):
    """run() once outside (JIT and warm-up), then captured in a CUDA graph; the graph's time."""
    out = run(None)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        run(out)
        torch.cuda.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            run(out)
    torch.cuda.synchronize()
    return time_graph(graph, torch)


def run_case(flashinfer, torch, parts, hq, hkv, q_len, tensor_cores):
    lens = [n for count, n in parts for _ in range(count)]
    kv, indptr, perm, last = make_kv(torch, lens, hkv)
    q = (torch.randn(len(lens) * q_len, hq, HEAD_DIM, device="cuda") * 0.5).to(torch.bfloat16)
    workspace = torch.empty(512 << 20, dtype=torch.uint8, device="cuda")  # prefill q4: 331 MB
    if q_len == 1:
        wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, use_tensor_cores=tensor_cores,
            paged_kv_indptr_buffer=indptr, paged_kv_indices_buffer=perm,
            paged_kv_last_page_len_buffer=last)
        wrapper.plan(indptr, perm, last, hq, hkv, HEAD_DIM, PAGE, pos_encoding_mode="NONE",
                     q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    else:
        qo_indptr = torch.arange(0, (len(lens) + 1) * q_len, q_len, dtype=torch.int32,
                                 device="cuda")
        wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
            workspace, "NHD", use_cuda_graph=True, qo_indptr_buf=qo_indptr,
            paged_kv_indptr_buf=indptr, paged_kv_indices_buf=perm,
            paged_kv_last_page_len_buf=last, backend="fa2")
        wrapper.plan(qo_indptr, indptr, perm, last, hq, hkv, HEAD_DIM, PAGE, causal=True,
                     q_data_type=torch.bfloat16, kv_data_type=torch.float8_e4m3fn)
    return capture(torch, lambda out: wrapper.run(q, kv, k_scale=0.02, v_scale=0.03, out=out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="-")
    ap.add_argument("--qlens", default=",".join(map(str, Q_LENS)),
                    help="query lengths to run, a,b,... (default: decode_bench's)")
    args = ap.parse_args()
    q_lens = [int(x) for x in args.qlens.split(",")]
    try:
        import torch
        import flashinfer
    except ImportError as e:
        print(f"flashinfer_decode: {e}; skipped", file=sys.stderr)
        return 77
    if not torch.cuda.is_available():
        print("flashinfer_decode: no GPU; skipped", file=sys.stderr)
        return 77
    rows = []
    for q_len in q_lens:
        for hq, hkv in HEADS:
            for name, parts in CASES:
                us, kernel = None, None
                for tc in (False, True) if q_len == 1 else (True,):
                    try:
                        t = run_case(flashinfer, torch, parts, hq, hkv, q_len, tc)
                    except Exception as e:  # a shape FlashInfer refuses: not a figure
                        print(f"flashinfer_decode: {name} {hq}/{hkv} tensor cores {tc}: {e}",
                              file=sys.stderr)
                        continue
                    print(f"{name:18s} {hq}/{hkv} q{q_len} tensor cores {tc}: {t:.1f}",
                          file=sys.stderr)
                    if us is None or t < us:
                        us, kernel = t, ("prefill" if q_len > 1 else
                                         "tensor_cores" if tc else "cuda_cores")
                # "flashinfer_us" right after "q_len": decode_bench --peer reads them together
                rows.append({"case": name, "hq": hq, "hkv": hkv, "q_len": q_len,
                             "flashinfer_us": None if us is None else round(us, 2),
                             "flashinfer_kernel": kernel})
    text = "[\n" + ",\n".join("  " + json.dumps(r) for r in rows) + "\n]\n"
    if args.out == "-":
        sys.stdout.write(text)
    else:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
