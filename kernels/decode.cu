/* decode.cu - decode attention over the paged pool on sm_90a: the plan kernel, the persistent
 * (dynamic-split) attention kernel, the static split-KV baseline, the combine kernel and merge
 * states. The CPU references are in decode.c; the contracts in tkv_kernels.h.
 *
 * How one step runs (all on the device, so plan + attention + combine replay in a CUDA graph
 * with new KV lengths):
 *   plan     one CTA reads kv_lens, cuts every (request, KV head) into 64-token tiles, lays
 *            all tiles end to end, cuts that sequence into bins of max(ceil(tiles/grid), floor)
 *            tiles, and writes one task per (pair, bin) intersection.
 *   attend   a persistent grid of workers (a worker is a warp in the warp-worker kernel, the
 *            fast path for FP8 Q over FP8 KV with up to 32 rows per pair; a CTA in the CTA
 *            kernel, every other shape): worker i drains bin i as one stream of tiles
 *            (cp.async, 2-4 stages deep, prefetching across task boundaries); at the end of a
 *            task it writes the partial O (normalised, f32) and its base-2 LSE.
 *   combine  merges each (request, KV head, row)'s partials with the global softmax and
 *            writes BF16 O and the LSE: K warps per row, and for few rows the head dim cut in
 *            S slices on separate CTAs, K x S chosen from the row count; a row whose partials
 *            fit one warp's batch is that warp's alone.
 * Kernels are chained with programmatic dependent launch: each triggers its dependents as it
 * starts and waits (griddepcontrol.wait, which returns when the previous kernel has finished
 * and its writes are visible) before its first memory access, so the next kernel's CTAs are
 * already resident when this one ends.
 *
 * Inside a CTA: the rows of a (request, KV head) are group * q_len queries (<= 128), in m-tiles
 * of 16 for mma.sync m16n8k16 (f32 accumulate). FP8 KV is converted to f16 in registers (exact:
 * every e4m3 value is an f16 value); BF16 KV runs the bf16 mma. Warps split the rows (one m-tile
 * each) and, when there are fewer m-tiles than warps, the tokens of the tile; their softmax
 * states are merged through shared memory at the end of each task.
 */
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <mutex>
#include <stdint.h>
#include <stdlib.h>
#include <type_traits>

#include "decode_internal.h"
#include "fp8.cuh"
#include "tkvk_cuda.cuh"

namespace {

constexpr int kTileTokens = TKVK_DECODE_TILE_TOKENS;
constexpr float kLog2e = 1.4426950408889634f;
constexpr int kPlanThreads = 512;
/* Per-pair values of the plan kernel: request, first bin, last whole bin, join base, length,
 * tile start, first task, first slot. */
constexpr int kPlanPairInts = 8;
/* Tasks of a bin kept in shared memory (a bin with more reads the rest from global memory). */
constexpr int kTaskWindow = 128;
/* Warp workers per CTA of the warp-worker kernel at most (its launch bounds). */
constexpr int kMaxCtaWarps = 8;
#ifndef TKVK_DEC_STAGES
/* cp.async stages for token rows under 256 bytes: tiles in flight per CTA = stages - 1. */
#define TKVK_DEC_STAGES 4
#endif

/* ============================================================================================
 * Parameters and per-shape constants
 * ========================================================================================== */

struct DecParams {
    const uint8_t *pool_layer; /* pool + layer * layer_stride */
    size_t block_stride, token_stride, v_offset, kscale_offset;
    int page_tokens, page_shift, num_kv_heads, num_blocks;
    const int32_t *block_table;
    int bt_stride;
    const int32_t *kv_lens;
    int num_requests;
    const void *q;
    const float *q_scales;
    int q_fp8, num_q_heads, group, q_len, rows;
    int per_token_head;
    float k_scale, v_scale;
    const float *v_head_scales;
    float score_scale; /* sm_scale * log2(e) */
    /* task map (dynamic) or the static split geometry */
    const int4 *tasks;
    const int32_t *task_len; /* kv_len of each task's request, written by the plan */
    const int32_t *task_slot; /* the slot of each task's partial (warp-worker kernel) */
    const int32_t *bin_first;
    /* warp-worker kernel: each warp's head (WarpHead, written by the plan kernel's pass 3) */
    const int2 *worker_span;
    const int4 *worker_task0;
    const int4 *worker_aux0;
    int static_splits, static_chunk_tiles;
    /* partial results: [slot][rows][D] and [slot][rows] (slot = task in the CTA kernel) */
    float *part_o;
    float *part_lse;
    /* direct: a task that is a whole (request, KV head) writes out/lse itself (the combine
     * skips pairs of one task); only the warp-worker kernel's dynamic path */
    int direct;
    uint16_t *out;
    float *lse;
};

template <int D, bool FP8KV> struct Shape {
    static constexpr int kElemBytes = FP8KV ? 1 : 2;
    static constexpr int kRowBytes = D * kElemBytes;     /* one token of one head */
    static constexpr int kChunks = kRowBytes / 16;       /* 16-byte chunks per token row */
    static constexpr int kChunkElems = 16 / kElemBytes;
    static constexpr int kStepsPerChunk = kChunkElems / 4; /* mma k-steps a lane takes per chunk */
    static constexpr int kKSteps = D / 16;
    static constexpr int kNBlocks = D / 8;               /* n-blocks of 8 output dims */
    static constexpr int kSliceBytes = kRowBytes / 8;    /* V bytes of one row a lane reads */
    static constexpr int kStages = kRowBytes >= 256 ? 2 : TKVK_DEC_STAGES;
    static constexpr int kTileBytes = kTileTokens * kRowBytes;
};

/* Swizzles of the 16-byte chunks of a token row in shared memory, chosen so the reads below
 * hit 8 distinct 16-byte bank groups per quarter warp (a lane reads K by token row, 4 lanes
 * per row; V by 4 rows 2 apart, 8 lanes side by side in a row). */
template <int kChunks> __device__ __forceinline__ int swz_k(int row)
{
    return kChunks >= 8 ? (row & 1) << 2 : 0;
}
template <int kChunks> __device__ __forceinline__ int swz_v(int row);

/* Byte address in a V stage of byte `off` of token row `row` (swizzled by 16-byte chunk). */
template <int kRowBytes> __device__ __forceinline__ int v_addr(int row, int off)
{
    constexpr int kChunks = kRowBytes / 16;
    return row * kRowBytes + (((off >> 4) ^ swz_v<kChunks>(row)) << 4) + (off & 15);
}

template <int kChunks> __device__ __forceinline__ int swz_v(int row)
{
    if (kChunks == 4)
        return ((row >> 1) & 1) << 1;
    if (kChunks == 8)
        return row & 6;
    if (kChunks == 16)
        return ((row >> 1) & 1) | (((row >> 2) & 1) << 2);
    return (row >> 1) & 3;
}

/* ============================================================================================
 * Small device helpers
 * ========================================================================================== */

__device__ __forceinline__ void pdl_wait()
{
    asm volatile("griddepcontrol.wait;" ::: "memory");
}
__device__ __forceinline__ void pdl_trigger()
{
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
}

__device__ __forceinline__ uint32_t smem_u32(const void *p)
{
    return (uint32_t)__cvta_generic_to_shared(p);
}

/* 4 bytes global -> shared; src_bytes 0 writes zeros. (The 16-byte K/V copies are written
 * inline in issue_tile, on shared addresses computed once.) */
__device__ __forceinline__ void cp_async4(void *dst, const void *src, int src_bytes)
{
    asm volatile("cp.async.ca.shared.global [%0], [%1], 4, %2;" ::"r"(smem_u32(dst)), "l"(src),
                 "r"(src_bytes)
                 : "memory");
}
__device__ __forceinline__ void cp_async_commit()
{
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N> __device__ __forceinline__ void cp_async_wait()
{
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

__device__ __forceinline__ uint4 lds128(const void *p)
{
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(smem_u32(p)));
    return v;
}
__device__ __forceinline__ uint2 lds64(const void *p)
{
    uint2 v;
    asm volatile("ld.shared.v2.u32 {%0,%1}, [%2];" : "=r"(v.x), "=r"(v.y) : "r"(smem_u32(p)));
    return v;
}

/* Four e4m3 codes -> f16x2 of bytes 0, 1 (lo) and of bytes 2, 3 (hi), exact. Each conversion
 * reads its half of the word in place, so no mask or shift comes before it. */
__device__ __forceinline__ void e4m3x4_to_f16x2(uint32_t four, uint32_t &lo, uint32_t &hi)
{
    asm("{ .reg .b16 l, h; mov.b32 {l, h}, %2; cvt.rn.f16x2.e4m3x2 %0, l; "
        "cvt.rn.f16x2.e4m3x2 %1, h; }"
        : "=r"(lo), "=r"(hi)
        : "r"(four));
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t sel)
{
    uint32_t r;
    asm("prmt.b32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(sel));
    return r;
}

/* One 32-bit word (4 e4m3 dims) of V from each of 4 token rows (x0, x1: tokens t, t + 1; x2,
 * x3: t + 8, t + 9) as f16x2 token pairs, exact: b[u][0] = (x0, x1) at dim u, b[u][1] = (x2, x3)
 * at dim u. They are P.V's B fragments where V is the mma's B operand, and its A fragments where
 * V^T is the A operand. */
__device__ __forceinline__ void e4m3_token_pairs(uint32_t x0, uint32_t x1, uint32_t x2,
                                                 uint32_t x3, uint32_t (&b)[4][2])
{
    const uint32_t lo01 = prmt(x0, x1, 0x5140), hi01 = prmt(x0, x1, 0x7362);
    const uint32_t lo23 = prmt(x2, x3, 0x5140), hi23 = prmt(x2, x3, 0x7362);
    e4m3x4_to_f16x2(lo01, b[0][0], b[1][0]);
    e4m3x4_to_f16x2(lo23, b[0][1], b[1][1]);
    e4m3x4_to_f16x2(hi01, b[2][0], b[3][0]);
    e4m3x4_to_f16x2(hi23, b[2][1], b[3][1]);
}

template <bool F16> __device__ __forceinline__ uint32_t pack2(float lo, float hi)
{
    if (F16) {
        __half2 h = __floats2half2_rn(lo, hi);
        return *reinterpret_cast<uint32_t *>(&h);
    }
    return tkvk_bf16x2_from_float2(lo, hi);
}

/* d += a * b, m16n8k16, row.col, f32 accumulate; F16: f16 operands, else bf16. */
template <bool F16>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                         uint32_t b1)
{
    if (F16)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
                     "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

/* 2^x on the SFU (2 ulp; 2^-inf = +0): the softmax weights need no more. */
__device__ __forceinline__ float fast_exp2(float x)
{
    float r;
    asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(x));
    return r;
}

/* d += a * b, m16n8k32, e4m3 operands, f32 accumulate. */
__device__ __forceinline__ void mma16832_e4m3(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                              uint32_t b1)
{
    asm volatile("mma.sync.aligned.m16n8k32.row.col.f32.e4m3.e4m3.f32 "
                 "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

__device__ __forceinline__ float quad_max(float x)
{
    x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 1));
    return fmaxf(x, __shfl_xor_sync(0xffffffffu, x, 2));
}
__device__ __forceinline__ float quad_sum(float x)
{
    x += __shfl_xor_sync(0xffffffffu, x, 1);
    return x + __shfl_xor_sync(0xffffffffu, x, 2);
}

/* ============================================================================================
 * Plan kernel
 * ========================================================================================== */

/* Exclusive scan of one value per thread over the whole block; returns the prefix, *total
 * gets the block's sum. Every thread of the block must call it. */
template <typename T> __device__ T block_exclusive_scan(T v, T *total)
{
    __shared__ T warp_sums[32];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = (blockDim.x + 31) >> 5;
    T x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        T y = __shfl_up_sync(0xffffffffu, x, o);
        if (lane >= o)
            x += y;
    }
    if (lane == 31)
        warp_sums[warp] = x;
    __syncthreads();
    if (warp == 0) {
        T w = lane < nwarps ? warp_sums[lane] : 0;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            T y = __shfl_up_sync(0xffffffffu, w, o);
            if (lane >= o)
                w += y;
        }
        warp_sums[lane] = w; /* inclusive */
    }
    __syncthreads();
    T warp_prefix = warp ? warp_sums[warp - 1] : 0;
    *total = warp_sums[nwarps - 1];
    __syncthreads(); /* warp_sums is reused by the next call */
    return warp_prefix + x - v;
}

__device__ __forceinline__ int tiles_of(int32_t len)
{
    return len <= 0 ? 0 : (len + kTileTokens - 1) / kTileTokens;
}

/* Row r of pair (req, kvh) as an index into q, q_scales, out and lse: a pair's rows are its
 * query tokens t times its group's heads gh, r = t * group + gh. P: DecParams or CombineParams. */
template <typename P>
__device__ __forceinline__ size_t row_index(const P &p, int req, int kvh, int r)
{
    int t = r / p.group, gh = r % p.group;
    return ((size_t)req * p.q_len + t) * p.num_q_heads + (size_t)kvh * p.group + gh;
}

/* info[0..5] = num_bins, num_tiles, num_tasks, tiles_per_cta, num_slots, bins_per_cta. Same
 * map as tkvk_decode_plan_cpu(), which reads the rules directly; this kernel runs on one SM,
 * where every instruction and every dependent step counts (timed by phase with Nsight
 * Compute, docs/perf.md), so it works out each pair's bins once (pass 2), each task's from
 * them with one division, and the values common to all threads in one thread. Its CTAs
 * (`ctas` of cta_warps warps) share the bins in order (tkvk__decode_bins); bin j of CTA c is
 * worked by warp c * cta_warps + j or, where may_pair (17..32 rows) and no CTA has more than
 * cta_warps / 2 bins, by warps c * cta_warps + 2j and 2j + 1 (rows 0..15 and 16..; the
 * map is the same either way). The worker_* arrays hold each warp's head (WarpHead: task
 * range [first, end), first task, and its request's length, slot, whether the CTA merges its
 * partial, and the warps of its bin), for one round trip at its start. kSmem: the per-pair
 * values of passes 1-3 (kPlanPairInts) live in dynamic shared memory (pass 3's binary search
 * reads them ~9 times in a row); else in the output arrays and pair_scratch (4 ints a pair). */
template <bool kSmem>
__global__ void __launch_bounds__(kPlanThreads, 1)
    dec_plan_kernel(const int32_t *kv_lens, int num_requests, int hkv, int grid, int min_tiles,
                    int cta_warps, int ctas, int may_pair, int4 *tasks, int32_t *task_len,
                    int32_t *task_slot, int32_t *bin_first, int2 *worker_span,
                    int4 *worker_task0, int4 *worker_aux0, int32_t *pair_first,
                    int32_t *pair_count, int32_t *slot_first, int32_t *slot_count,
                    int32_t *info, int32_t *pair_scratch)
{
    extern __shared__ int32_t plan_smem[];
    __shared__ tkvk__decode_bins s_bins;
    __shared__ int s_hv;
    pdl_wait(); /* the previous step's kernels may still read the map */
    pdl_trigger();
    const int num_pairs = num_requests * hkv;
    int32_t *const scratch = kSmem ? plan_smem : pair_scratch;
    /* until pass 4 pair_count holds the tile starts and slot_count the lengths */
    int32_t *const p_len = kSmem ? plan_smem + 4 * num_pairs : slot_count;
    int32_t *const p_start = kSmem ? plan_smem + 5 * num_pairs : pair_count;
    int32_t *const p_first = kSmem ? plan_smem + 6 * num_pairs : pair_first;
    int32_t *const p_slot = kSmem ? plan_smem + 7 * num_pairs : slot_first;
    /* a pair's request, first bin, the last bin it covers whole with the bin before, and the
     * bins before its first joinable one that are not the first of their CTA (joins) */
    int32_t *const p_req = scratch, *const p_bin0 = scratch + num_pairs;
    int32_t *const p_hi = scratch + 2 * num_pairs, *const p_base = scratch + 3 * num_pairs;
    /* pass 1: each pair's length and tile start */
    int carry = 0;
    for (int base = 0; base < num_pairs; base += blockDim.x) {
        int p = base + threadIdx.x, req = p / hkv;
        int32_t len = p < num_pairs ? max(kv_lens[req], 0) : 0;
        int total;
        int start = block_exclusive_scan(tiles_of(len), &total);
        if (p < num_pairs) {
            p_req[p] = req;
            p_len[p] = len;
            p_start[p] = carry + start;
        }
        carry += total;
    }
    const int num_tiles = carry;
    if (threadIdx.x == 0) {
        s_bins = tkvk__decode_bins_of(num_tiles, grid, min_tiles, ctas);
        /* workers of two warps, each with half the rows, where every CTA has at most
         * cta_warps / 2 bins: then the bins stay at the floor and twice the warps work */
        s_hv = may_pair && (s_bins.q + (s_bins.rem > 0)) * 2 <= cta_warps ? 2 : 1;
    }
    __syncthreads();
    const tkvk__decode_bins bins = s_bins;
    const int hv = s_hv;
    const int per_cta = bins.per_cta, num_bins = bins.num_bins;
    const bool joining = bins.q >= TKVK__DECODE_MIN_JOIN;

    /* pass 2: each pair's tasks and slots, and the index of its first task and slot (one
     * scan of both: tasks in the low 32 bits, slots in the high). The joins of
     * tkvk__decode_joins(): bins x in [lo, hi] not first of their CTA count
     * (x - cta(x)) - base with base = (lo - 1) - cta(lo - 1). */
    long long both_carry = 0;
    for (int base = 0; base < num_pairs; base += blockDim.x) {
        int p = base + threadIdx.x;
        long long count = 0, slots = 0;
        if (p < num_pairs) {
            int start = p_start[p], end = start + tiles_of(p_len[p]);
            int bin0 = start / per_cta, hi = end / per_cta - 1;
            int lo = bin0 + (start != bin0 * per_cta) + 1;
            int jbase = 0;
            if (end > start)
                count = (end - 1) / per_cta - bin0 + 1;
            slots = count;
            if (joining && hi >= lo) {
                jbase = (lo - 1) - tkvk__decode_cta_of_bin(&bins, lo - 1);
                slots -= (hi - tkvk__decode_cta_of_bin(&bins, hi)) - jbase;
            }
            p_bin0[p] = bin0;
            p_hi[p] = hi;
            p_base[p] = jbase;
        }
        long long total;
        long long first = both_carry + block_exclusive_scan(count | slots << 32, &total);
        if (p < num_pairs) {
            p_first[p] = (int)(first & 0xffffffff);
            p_slot[p] = (int)(first >> 32);
        }
        both_carry += total;
    }
    __syncthreads();
    const int task_carry = (int)(both_carry & 0xffffffff), slot_carry = (int)(both_carry >> 32);
    /* pass 3: every task in parallel (one long request can have hundreds): its pair is the
     * last one whose first task is <= d (pairs without tasks share the next one's first) */
    for (int d = threadIdx.x; d < task_carry; d += blockDim.x) {
        int lo = 0, hi = num_pairs - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (p_first[mid] <= d)
                lo = mid;
            else
                hi = mid - 1;
        }
        const int p = lo, k = d - p_first[p], req = p_req[p], bin0 = p_bin0[p];
        const int32_t len = p_len[p];
        const int start = p_start[p], end = start + tiles_of(len);
        const int bin = bin0 + k, bin_hi = p_hi[p];
        const int join_lo = bin0 + (start != bin0 * per_cta) + 1;
        const int t0 = max(start, bin * per_cta), t1 = min(end, (bin + 1) * per_cta);
        const int c = tkvk__decode_cta_of_bin(&bins, bin);
        const int c_first = tkvk__decode_cta_first_bin(&bins, c);
        int joins = 0; /* tkvk__decode_joins(&bins, start, end, bin) */
        if (joining && bin >= join_lo && bin_hi >= join_lo) {
            if (bin <= bin_hi) {
                joins = (bin - c) - p_base[p];
            } else { /* all the pair's joins: its tasks - its slots */
                int next = p + 1 < num_pairs;
                joins = ((next ? p_first[p + 1] : task_carry) - p_first[p]) -
                        ((next ? p_slot[p + 1] : slot_carry) - p_slot[p]);
            }
        }
        const int4 tk = make_int4(req, p - req * hkv, t0 - start, t1 - start);
        const int slot = p_slot[p] + k - joins;
        tasks[d] = tk;
        task_len[d] = len;
        task_slot[d] = slot;
        if (t0 == bin * per_cta) {
            /* the bin's head: the first task of its worker, and the end of the bin before */
            bin_first[bin] = d;
            const int w = c * cta_warps + (bin - c_first) * hv; /* its (first) warp */
            /* holds: the task shares its slot with the one before (its bin is joined) or the
             * one after (the next bin is): then it is its bin's only task, and its partial
             * waits in shared memory for the CTA's merge */
            const bool joined = joining && bin >= join_lo && bin <= bin_hi && bin != c_first;
            const bool next_joined = joining && bin + 1 >= join_lo && bin + 1 <= bin_hi &&
                                     bin + 1 != tkvk__decode_cta_first_bin(&bins, c + 1);
            /* the first warp of the bin before */
            const int wp =
                bin == 0         ? -1
                : bin != c_first ? w - hv
                                 : (c - 1) * cta_warps +
                                       (bin - 1 - tkvk__decode_cta_first_bin(&bins, c - 1)) * hv;
            for (int i = 0; i < hv; i++) {
                worker_span[w + i].x = d;
                worker_task0[w + i] = tk;
                worker_aux0[w + i] = make_int4(len, slot, joined || next_joined, hv);
                if (wp >= 0)
                    worker_span[wp + i].y = d;
            }
        }
    }
    __syncthreads();
    /* pass 4: each pair's first task and slot and their counts (the counts replace the tile
     * starts and lengths); the last bin's end; the workers without a bin */
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        int first = p_first[p], slot = p_slot[p];
        pair_count[p] = (p + 1 < num_pairs ? p_first[p + 1] : task_carry) - first;
        slot_count[p] = (p + 1 < num_pairs ? p_slot[p + 1] : slot_carry) - slot;
        pair_first[p] = first;
        slot_first[p] = slot;
    }
    for (int b = num_bins + threadIdx.x; b <= grid; b += blockDim.x)
        bin_first[b] = task_carry;
    if (threadIdx.x < hv && num_bins > 0) {
        int c = tkvk__decode_cta_of_bin(&bins, num_bins - 1);
        worker_span[c * cta_warps + (num_bins - 1 - tkvk__decode_cta_first_bin(&bins, c)) * hv +
                    threadIdx.x]
            .y = task_carry;
    }
    for (int c = threadIdx.x; c < ctas; c += blockDim.x)
        for (int j = (tkvk__decode_cta_first_bin(&bins, c + 1) -
                      tkvk__decode_cta_first_bin(&bins, c)) * hv;
             j < cta_warps; j++)
            worker_span[c * cta_warps + j] = make_int2(0, 0);
    if (threadIdx.x == 0) {
        info[0] = num_bins;
        info[1] = num_tiles;
        info[2] = task_carry;
        info[3] = per_cta;
        info[4] = slot_carry;
        info[5] = (num_bins + ctas - 1) / ctas;
    }
}

/* ============================================================================================
 * Attention kernel (persistent over a bin, or one static split)
 * ========================================================================================== */

/* Q8: FP8 Q over FP8 KV, whose Q.K products run as e4m3 mma (m16n8k32) straight from the
 * cached bytes; the other combinations convert K to f16/bf16 in registers. */
template <int D, bool FP8KV, int NW, bool Q8 = false> struct Attend {
    using S = Shape<D, FP8KV>;
    static_assert(!Q8 || FP8KV, "e4m3 products need FP8 KV");
    static constexpr int kThreads = NW * 32;
    static constexpr bool kF16 = FP8KV; /* mma element type: f16 for FP8 KV, bf16 for BF16 KV */

    static constexpr size_t smem_bytes()
    {
        return 2 * (size_t)S::kStages * S::kTileBytes    /* K, V stages */
               + (size_t)S::kStages * kTileTokens * 4    /* in-page K scales */
               + (NW == 4 ? (size_t)NW * 16 * D * 4 : 0) /* per-warp O for the task merge */
               + 2 * (size_t)NW * 16 * 4;                /* per-warp m, l */
    }

    /* Token rows of a tile a thread copies: rows tid / kChunks + k * kRowStep, always its
     * chunk tid % kChunks (kThreads is a multiple of kChunks). */
    static constexpr int kRowStep = kThreads / S::kChunks;
    static constexpr int kRowsPerThread = kTileTokens / kRowStep;

    /* Block ids of this thread's rows of tile `tile`: plain loads whose results are first used
     * by the next issue_tile(), a whole iteration later, so their latency stays hidden. With
     * pages of 64+ tokens a tile lies in one page: one id serves every row. */
    static __device__ __forceinline__ void fetch_blocks(const DecParams &p, int req, int tile,
                                                        int32_t len, int32_t (&blk)[kRowsPerThread])
    {
        const int32_t *bt = p.block_table + (size_t)req * p.bt_stride;
        if (p.page_tokens >= kTileTokens) {
            blk[0] = tile * kTileTokens < len ? __ldg(bt + ((tile * kTileTokens) >> p.page_shift)) : -1;
            return;
        }
        int row0 = threadIdx.x / S::kChunks;
#pragma unroll
        for (int k = 0; k < kRowsPerThread; k++) {
            int pos = tile * kTileTokens + row0 + k * kRowStep;
            blk[k] = pos < len ? __ldg(bt + (pos >> p.page_shift)) : -1;
        }
    }

    /* cp.async of tile `tile` of (req, kvh) into one stage; rows past the end or with a block
     * id outside the pool are zero-filled. dst_k/dst_v: this thread's (swizzled) byte offsets
     * of its rows in a stage, fixed for the whole kernel. */
    static __device__ __forceinline__ void issue_tile(const DecParams &p, uint32_t sK, uint32_t sV,
                                                      float *sKs, int req, int kvh, int tile,
                                                      int32_t len,
                                                      const int32_t (&blk)[kRowsPerThread],
                                                      const uint32_t (&dst_k)[kRowsPerThread],
                                                      const uint32_t (&dst_v)[kRowsPerThread])
    {
        const int j = threadIdx.x % S::kChunks, row0 = threadIdx.x / S::kChunks;
        const uint8_t *base = p.pool_layer + (size_t)kvh * S::kRowBytes + j * 16;
        if (p.page_tokens >= kTileTokens) {
            /* one page: rows are token_stride apart */
            int32_t b = blk[0];
            bool ok = b >= 0 && b < p.num_blocks;
            const uint8_t *src = base + (size_t)(ok ? b : 0) * p.block_stride +
                                 (size_t)(((tile * kTileTokens) & (p.page_tokens - 1)) + row0) *
                                     p.token_stride;
            int rows_left = len - tile * kTileTokens - row0;
#pragma unroll
            for (int k = 0; k < kRowsPerThread; k++) {
                int bytes = ok && k * kRowStep < rows_left ? 16 : 0;
                const uint8_t *sk = bytes ? src : p.pool_layer;
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sK + dst_k[k]),
                             "l"(sk), "r"(bytes)
                             : "memory");
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sV + dst_v[k]),
                             "l"(bytes ? src + p.v_offset : p.pool_layer), "r"(bytes)
                             : "memory");
                src += (size_t)kRowStep * p.token_stride;
            }
        } else {
#pragma unroll
            for (int k = 0; k < kRowsPerThread; k++) {
                int row = row0 + k * kRowStep;
                int pos = tile * kTileTokens + row;
                const uint8_t *src = p.pool_layer;
                int bytes = 0;
                if (blk[k] >= 0 && blk[k] < p.num_blocks) {
                    src = base + (size_t)blk[k] * p.block_stride +
                          (size_t)(pos & (p.page_tokens - 1)) * p.token_stride;
                    bytes = 16;
                }
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sK + dst_k[k]),
                             "l"(src), "r"(bytes)
                             : "memory");
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sV + dst_v[k]),
                             "l"(bytes ? src + p.v_offset : src), "r"(bytes)
                             : "memory");
            }
        }
        if (FP8KV && p.per_token_head) {
            for (int row = threadIdx.x; row < kTileTokens; row += kThreads) {
                int pos = tile * kTileTokens + row;
                const uint8_t *src = p.pool_layer;
                int bytes = 0;
                if (pos < len) {
                    int32_t b = p.block_table[(size_t)req * p.bt_stride + (pos >> p.page_shift)];
                    if (b >= 0 && b < p.num_blocks) {
                        src = p.pool_layer + (size_t)b * p.block_stride + p.kscale_offset +
                              ((size_t)(pos & (p.page_tokens - 1)) * p.num_kv_heads + kvh) * 4;
                        bytes = 4;
                    }
                }
                cp_async4(sKs + row, src, bytes);
            }
        }
    }

    static __device__ void run(const DecParams &p, uint8_t *smem)
    {
        __shared__ int4 s_tasks[kTaskWindow];
        __shared__ int32_t s_lens[kTaskWindow];
        uint8_t *sK = smem;
        uint8_t *sV = sK + S::kStages * S::kTileBytes;
        float *sKs = reinterpret_cast<float *>(sV + S::kStages * S::kTileBytes);
        float *sO = sKs + S::kStages * kTileTokens;
        /* 8 warps only run with one warp per row group (no token split, no merge) */
        float *sM = sO + (NW == 4 ? NW * 16 * D : 0);
        float *sL = sM + NW * 16;

        const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
        const int g = lane >> 2, c = lane & 3;
        const int R = p.rows;
        const int nmt = (R + 15) / 16;
        int rg_count = nmt <= 1 ? 1 : nmt <= 2 ? 2 : nmt <= 4 ? 4 : 8;
        if (rg_count > NW)
            rg_count = NW;
        const int ts_count = NW / rg_count;
        const int rg = warp / ts_count, ts = warp % ts_count;
        const int tokens_per_warp = kTileTokens / ts_count;
        const bool active = rg * 16 < R;

        /* The CTA's tasks, local index 0..num_tasks-1: a bin of the map, or the one static
         * split. The first kTaskWindow go to shared memory with their request's length. */
        int num_tasks, first_task = 0, static_index = 0;
        if (p.static_splits) {
            int kvh = blockIdx.x, req = blockIdx.y, split = blockIdx.z;
            int32_t len = max(p.kv_lens[req], 0);
            int tb = split * p.static_chunk_tiles;
            int te = min(tb + p.static_chunk_tiles, tiles_of(len));
            static_index = (req * p.num_kv_heads + kvh) * p.static_splits + split;
            if (tb >= te) {
                /* An empty split still says so: the combine gives it weight 0. */
                for (int r = threadIdx.x; r < R; r += kThreads)
                    p.part_lse[(size_t)static_index * R + r] = -INFINITY;
                return;
            }
            if (threadIdx.x == 0) {
                s_tasks[0] = make_int4(req, kvh, tb, te);
                s_lens[0] = len;
            }
            num_tasks = 1;
        } else {
            first_task = p.bin_first[blockIdx.x];
            num_tasks = p.bin_first[blockIdx.x + 1] - first_task;
            for (int k = threadIdx.x; k < num_tasks && k < kTaskWindow; k += kThreads) {
                s_tasks[k] = p.tasks[first_task + k];
                s_lens[k] = p.task_len[first_task + k];
            }
        }
        __syncthreads();
        auto task = [&](int k) -> int4 {
            return k < kTaskWindow ? s_tasks[k] : p.tasks[first_task + k];
        };
        auto task_len = [&](int k) -> int32_t {
            return k < kTaskWindow ? s_lens[k] : p.task_len[first_task + k];
        };
        int n_tiles = 0;
        for (int k = 0; k < num_tasks; k++) {
            int4 tk = task(k);
            n_tiles += tk.w - tk.z;
        }

        /* loader cursor, with the block ids of its tile already requested */
        int ld_task = 0, ld_tile = 0;
        int4 ld_tk = make_int4(0, 0, 0, 0);
        int32_t ld_len = 0;
        int32_t ld_blk[kRowsPerThread];
        uint32_t dst_k[kRowsPerThread], dst_v[kRowsPerThread];
#pragma unroll
        for (int k = 0; k < kRowsPerThread; k++) {
            int row = threadIdx.x / S::kChunks + k * kRowStep, j = threadIdx.x % S::kChunks;
            dst_k[k] = row * S::kRowBytes + ((j ^ swz_k<S::kChunks>(row)) * 16);
            dst_v[k] = row * S::kRowBytes + ((j ^ swz_v<S::kChunks>(row)) * 16);
        }
        const uint32_t sK_base = smem_u32(sK), sV_base = smem_u32(sV);
        if (n_tiles > 0) {
            ld_tk = task(0);
            ld_tile = ld_tk.z;
            ld_len = task_len(0);
            fetch_blocks(p, ld_tk.x, ld_tile, ld_len, ld_blk);
        }
        auto load_next = [&](int stage) {
            issue_tile(p, sK_base + stage * S::kTileBytes, sV_base + stage * S::kTileBytes,
                       sKs + stage * kTileTokens, ld_tk.x, ld_tk.y, ld_tile, ld_len, ld_blk, dst_k,
                       dst_v);
            if (++ld_tile == ld_tk.w) {
                if (++ld_task >= num_tasks)
                    return;
                ld_tk = task(ld_task);
                ld_tile = ld_tk.z;
                ld_len = task_len(ld_task);
            }
            fetch_blocks(p, ld_tk.x, ld_tile, ld_len, ld_blk);
        };
#pragma unroll
        for (int s = 0; s < S::kStages - 1; s++) {
            if (s < n_tiles)
                load_next(s);
            cp_async_commit();
        }

        /* per-warp state of the current task */
        uint32_t qa[S::kKSteps][4];
        float o[S::kNBlocks][4];
        float m_run[2], l_run[2], rowmul[2];
        int lim[2];
        float v_mul = 1.0f;

        int cc_task = 0;
        int4 tk = n_tiles > 0 ? task(0) : make_int4(0, 0, 0, 0);
        int cc_tile = tk.z;
        int32_t len = n_tiles > 0 ? task_len(0) : 0;

        for (int i = 0; i < n_tiles; i++) {
            cp_async_wait<S::kStages - 2>();
            __syncthreads();
            if (i + S::kStages - 1 < n_tiles)
                load_next((i + S::kStages - 1) % S::kStages);
            cp_async_commit();

            if (cc_tile == tk.z) {
                /* ---- start of a task: queries into registers, state reset ---- */
                const int req = tk.x, kvh = tk.y;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    m_run[h] = -INFINITY;
                    l_run[h] = 0.0f;
                }
#pragma unroll
                for (int nb = 0; nb < S::kNBlocks; nb++)
#pragma unroll
                    for (int e = 0; e < 4; e++)
                        o[nb][e] = 0.0f;
                if (FP8KV)
                    v_mul = p.per_token_head ? p.v_head_scales[kvh] : p.v_scale;
                if (active)
                    load_q(p, req, kvh, rg * 16 + g, g, c, qa, rowmul, lim, len);
            }

            if (active)
                compute_tile(p, sK + (i % S::kStages) * S::kTileBytes,
                             sV + (i % S::kStages) * S::kTileBytes,
                             sKs + (i % S::kStages) * kTileTokens, cc_tile, ts * tokens_per_warp,
                             tokens_per_warp, len, g, c, qa, rowmul, lim, m_run, l_run, o);

            if (cc_tile + 1 == tk.w) {
                /* ---- end of a task: merge the warps' states, write the partial ---- */
                int pidx = p.static_splits ? static_index : first_task + cc_task;
                finalize(p, pidx, R, rg, ts, ts_count, active, g, c, v_mul, m_run, l_run, o, sO,
                         sM, sL);
                if (++cc_task < num_tasks) {
                    tk = task(cc_task);
                    cc_tile = tk.z;
                    len = task_len(cc_task);
                }
            } else {
                cc_tile++;
            }
        }
        cp_async_wait<0>();
    }

    /* Queries of rows row0 and row0 + 8 (CTA rows) as A fragments in the permuted k order
     * that matches the K fragments (see compute_tile), their score multipliers and causal
     * limits. */
    static __device__ void load_q(const DecParams &p, int req, int kvh, int row0, int g, int c,
                                  uint32_t (&qa)[S::kKSteps][4], float (&rowmul)[2],
                                  int (&lim)[2], int32_t len)
    {
        const int R = p.rows;
        float kmul = (FP8KV && !p.per_token_head) ? p.k_scale : 1.0f;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = row0 + h * 8;
            bool valid = r < R;
            int t = valid ? r / p.group : 0;
            size_t qi = row_index(p, req, kvh, valid ? r : 0);
            /* rows past R are never written: no mask for them (INT_MAX) */
            lim[h] = valid ? len - p.q_len + t + 1 : 0x7fffffff;
            float qs = 1.0f;
            if (Q8) {
                /* k32 step s: chunk c + 4 * (s / 2), bytes 8 * (s % 2) .. +7: the first four
                 * are k-slots 4c..4c+3, the next four 16+4c..16+4c+3 (as K in compute_tile) */
                qs = valid ? p.q_scales[qi] : 0.0f;
                const uint8_t *q = static_cast<const uint8_t *>(p.q) + qi * D;
#pragma unroll
                for (int s = 0; s < D / 32; s++) {
                    int dim = 16 * (c + 4 * (s / 2)) + 8 * (s % 2);
                    uint2 w = valid ? *reinterpret_cast<const uint2 *>(q + dim) : make_uint2(0, 0);
                    qa[s][h] = w.x;
                    qa[s][h + 2] = w.y;
                }
            } else if (p.q_fp8) {
                qs = valid ? p.q_scales[qi] : 0.0f;
                const uint8_t *q = static_cast<const uint8_t *>(p.q) + qi * D;
#pragma unroll
                for (int s = 0; s < S::kKSteps; s++) {
                    int pp = s / S::kStepsPerChunk, u = s % S::kStepsPerChunk;
                    int dim = S::kChunkElems * (c + 4 * pp) + 4 * u;
                    uint32_t w = valid ? *reinterpret_cast<const uint32_t *>(q + dim) : 0u;
                    if (kF16) {
                        e4m3x4_to_f16x2(w, qa[s][h], qa[s][h + 2]);
                    } else {
                        float2 lo = tkvk_fp8x2_to_float2((uint16_t)(w & 0xffffu));
                        float2 hi = tkvk_fp8x2_to_float2((uint16_t)(w >> 16));
                        qa[s][h] = tkvk_bf16x2_from_float2(lo.x, lo.y);
                        qa[s][h + 2] = tkvk_bf16x2_from_float2(hi.x, hi.y);
                    }
                }
            } else {
                const uint16_t *q = static_cast<const uint16_t *>(p.q) + qi * D;
                uint2 raw[S::kKSteps];
                float amax = 0.0f;
#pragma unroll
                for (int s = 0; s < S::kKSteps; s++) {
                    int pp = s / S::kStepsPerChunk, u = s % S::kStepsPerChunk;
                    int dim = S::kChunkElems * (c + 4 * pp) + 4 * u;
                    raw[s] = valid ? *reinterpret_cast<const uint2 *>(q + dim) : make_uint2(0, 0);
                    if (kF16) {
                        amax = fmaxf(amax, fabsf(tkvk_bf16_to_float_dev(raw[s].x & 0xffffu)));
                        amax = fmaxf(amax, fabsf(tkvk_bf16_to_float_dev(raw[s].x >> 16)));
                        amax = fmaxf(amax, fabsf(tkvk_bf16_to_float_dev(raw[s].y & 0xffffu)));
                        amax = fmaxf(amax, fabsf(tkvk_bf16_to_float_dev(raw[s].y >> 16)));
                    }
                }
                if (kF16) {
                    /* bf16 -> f16 would lose range: scale the row by a power of two so its
                     * largest element sits below 2^14 (f16 then holds every bf16 mantissa),
                     * and undo it in the score multiplier. */
                    amax = quad_max(amax);
                    int e = 0;
                    if (amax > 0.0f && isfinite(amax))
                        frexpf(amax, &e);
                    float up = ldexpf(1.0f, 14 - e);
                    qs = ldexpf(1.0f, e - 14);
#pragma unroll
                    for (int s = 0; s < S::kKSteps; s++) {
                        qa[s][h] = pack2<true>(tkvk_bf16_to_float_dev(raw[s].x & 0xffffu) * up,
                                               tkvk_bf16_to_float_dev(raw[s].x >> 16) * up);
                        qa[s][h + 2] = pack2<true>(tkvk_bf16_to_float_dev(raw[s].y & 0xffffu) * up,
                                                   tkvk_bf16_to_float_dev(raw[s].y >> 16) * up);
                    }
                } else {
#pragma unroll
                    for (int s = 0; s < S::kKSteps; s++) {
                        qa[s][h] = raw[s].x;
                        qa[s][h + 2] = raw[s].y;
                    }
                }
            }
            rowmul[h] = p.score_scale * qs * kmul;
        }
    }

    /* One tile: this warp's tokens [tok0, tok0 + ntok) of it, in chunks of 16 tokens.
     *
     * k order: a lane (g, c) reads K row n = g of an n-block as 16-byte chunks c, c+4, ...;
     * byte 4u..4u+3 of chunk (c + 4pp) become the k-slots {2c, 2c+1, 2c+8, 2c+9} of k-step
     * pp * kStepsPerChunk + u. The dot product does not care about the order of k, so the
     * queries are loaded in the same order (load_q) and K needs no shuffling at all.
     * V (the B operand of P.V) needs two consecutive tokens per register: a lane reads its
     * 1/8 slice of 4 token rows and pairs the bytes with prmt; output column n = g of n-block
     * nb is head dim g * D/8 + nb. */
    static __device__ void compute_tile(const DecParams &p, const uint8_t *sK, const uint8_t *sV,
                                        const float *sKs, int tile, int tok0, int ntok,
                                        int32_t len, int g, int c,
                                        const uint32_t (&qa)[S::kKSteps][4],
                                        const float (&rowmul)[2], const int (&lim)[2],
                                        float (&m_run)[2], float (&l_run)[2],
                                        float (&o)[S::kNBlocks][4])
    {
        for (int t0 = tok0; t0 < tok0 + ntok; t0 += 16) {
            if (tile * kTileTokens + t0 >= len)
                break; /* the rest of the tile is past the end for every row */
            float sc[2][4];
#pragma unroll
            for (int nb = 0; nb < 2; nb++) {
#pragma unroll
                for (int e = 0; e < 4; e++)
                    sc[nb][e] = 0.0f;
                int row = t0 + nb * 8 + g;
                const uint8_t *krow = sK + row * S::kRowBytes;
#pragma unroll
                for (int pp = 0; pp < S::kChunks / 4; pp++) {
                    uint4 kv = lds128(krow + (((c + 4 * pp) ^ swz_k<S::kChunks>(row)) * 16));
                    uint32_t w[4] = {kv.x, kv.y, kv.z, kv.w};
                    if (Q8) {
                        mma16832_e4m3(sc[nb], qa[2 * pp], w[0], w[1]);
                        mma16832_e4m3(sc[nb], qa[2 * pp + 1], w[2], w[3]);
                    }
#pragma unroll
                    for (int u = 0; u < (Q8 ? 0 : S::kStepsPerChunk); u++) {
                        uint32_t b0, b1;
                        if (FP8KV) {
                            e4m3x4_to_f16x2(w[u], b0, b1);
                        } else {
                            b0 = w[2 * u];
                            b1 = w[2 * u + 1];
                        }
                        mma16816<kF16>(sc[nb], qa[pp * S::kStepsPerChunk + u], b0, b1);
                    }
                }
            }
            /* scale, mask, online softmax (base 2); only chunks reaching a row's limit mask */
            const bool need_mask = tile * kTileTokens + t0 + 16 > min(lim[0], lim[1]);
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nb = 0; nb < 2; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int h = e >> 1;
                    int col = t0 + nb * 8 + 2 * c + (e & 1);
                    int pos = tile * kTileTokens + col;
                    float v = sc[nb][e] * rowmul[h];
                    if (FP8KV && p.per_token_head)
                        v *= sKs[col];
                    if (need_mask)
                        v = pos < lim[h] ? v : -INFINITY;
                    sc[nb][e] = v;
                    mx[h] = fmaxf(mx[h], v);
                }
            float alpha[2], m_use[2];
#pragma unroll
            for (int h = 0; h < 2; h++) {
                float m_new = fmaxf(m_run[h], quad_max(mx[h]));
                m_use[h] = m_new == -INFINITY ? 0.0f : m_new;
                alpha[h] = fast_exp2(m_run[h] - m_use[h]);
                m_run[h] = m_new;
            }
            float rs[2] = {0.0f, 0.0f};
#pragma unroll
            for (int nb = 0; nb < 2; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    float pe = fast_exp2(sc[nb][e] - m_use[e >> 1]);
                    sc[nb][e] = pe;
                    rs[e >> 1] += pe;
                }
#pragma unroll
            for (int h = 0; h < 2; h++)
                l_run[h] = l_run[h] * alpha[h] + rs[h];
            if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
                for (int nb = 0; nb < S::kNBlocks; nb++) {
                    o[nb][0] *= alpha[0];
                    o[nb][1] *= alpha[0];
                    o[nb][2] *= alpha[1];
                    o[nb][3] *= alpha[1];
                }
            }
            uint32_t pa[4];
            pa[0] = pack2<kF16>(sc[0][0], sc[0][1]);
            pa[1] = pack2<kF16>(sc[0][2], sc[0][3]);
            pa[2] = pack2<kF16>(sc[1][0], sc[1][1]);
            pa[3] = pack2<kF16>(sc[1][2], sc[1][3]);

            /* P.V: rows t0+2c, +1 (k-slots 2c, 2c+1) and t0+8+2c, +1 (k-slots 2c+8, 2c+9) */
            int r0 = t0 + 2 * c, r1 = r0 + 1, r2 = r0 + 8, r3 = r0 + 9;
            const int slice = g * S::kSliceBytes;
            if (S::kSliceBytes == 8) {
                /* FP8, D = 64: 8 bytes = 8 dims per row */
                uint2 x0 = lds64(sV + v_addr<S::kRowBytes>(r0, slice));
                uint2 x1 = lds64(sV + v_addr<S::kRowBytes>(r1, slice));
                uint2 x2 = lds64(sV + v_addr<S::kRowBytes>(r2, slice));
                uint2 x3 = lds64(sV + v_addr<S::kRowBytes>(r3, slice));
                uint32_t a0[2] = {x0.x, x0.y}, a1[2] = {x1.x, x1.y};
                uint32_t a2[2] = {x2.x, x2.y}, a3[2] = {x3.x, x3.y};
#pragma unroll
                for (int wv = 0; wv < 2; wv++)
                    pv_word(a0[wv], a1[wv], a2[wv], a3[wv], wv, pa, o);
            } else {
#pragma unroll
                for (int piece = 0; piece < S::kSliceBytes / 16; piece++) {
                    int off = slice + piece * 16;
                    uint4 x0 = lds128(sV + v_addr<S::kRowBytes>(r0, off));
                    uint4 x1 = lds128(sV + v_addr<S::kRowBytes>(r1, off));
                    uint4 x2 = lds128(sV + v_addr<S::kRowBytes>(r2, off));
                    uint4 x3 = lds128(sV + v_addr<S::kRowBytes>(r3, off));
                    uint32_t a0[4] = {x0.x, x0.y, x0.z, x0.w}, a1[4] = {x1.x, x1.y, x1.z, x1.w};
                    uint32_t a2[4] = {x2.x, x2.y, x2.z, x2.w}, a3[4] = {x3.x, x3.y, x3.z, x3.w};
#pragma unroll
                    for (int wv = 0; wv < 4; wv++)
                        pv_word(a0[wv], a1[wv], a2[wv], a3[wv], piece * 4 + wv, pa, o);
                }
            }
        }
    }


    /* One 32-bit word of the lane's V slice from 4 token rows (t0, t1: k-slots 2c, 2c+1;
     * t2, t3: 2c+8, 2c+9) -> B fragments of its n-blocks -> mma. Word wv holds slice
     * elements [wv * 4 / elem_bytes, ...). */
    static __device__ __forceinline__ void pv_word(uint32_t x0, uint32_t x1, uint32_t x2,
                                                   uint32_t x3, int wv, const uint32_t (&pa)[4],
                                                   float (&o)[S::kNBlocks][4])
    {
        if (FP8KV) {
            /* bytes: x = d0 d1 d2 d3 of one token; pair tokens per dim */
            uint32_t b[4][2];
            e4m3_token_pairs(x0, x1, x2, x3, b);
            int nb = wv * 4;
#pragma unroll
            for (int u = 0; u < 4; u++)
                mma16816<true>(o[nb + u], pa, b[u][0], b[u][1]);
        } else {
            int nb = wv * 2;
            mma16816<false>(o[nb + 0], pa, prmt(x0, x1, 0x5410), prmt(x2, x3, 0x5410));
            mma16816<false>(o[nb + 1], pa, prmt(x0, x1, 0x7632), prmt(x2, x3, 0x7632));
        }
    }

    static __device__ void finalize(const DecParams &p, int pidx, int R, int rg, int ts,
                                    int ts_count, bool active, int g, int c, float v_mul,
                                    const float (&m_run)[2], const float (&l_run)[2],
                                    const float (&o)[S::kNBlocks][4], float *sO, float *sM,
                                    float *sL)
    {
        const int warp = threadIdx.x >> 5;
        float l_tot[2] = {quad_sum(l_run[0]), quad_sum(l_run[1])};
        if (ts_count == 1) {
            /* the warp saw every token of the task: write straight out, no merge */
            if (!active)
                return;
#pragma unroll
            for (int h = 0; h < 2; h++) {
                int r = rg * 16 + g + 8 * h;
                if (r >= R)
                    continue;
                float inv = l_tot[h] > 0.0f ? v_mul / l_tot[h] : 0.0f;
                float *dst = p.part_o + ((size_t)pidx * R + r) * D;
#pragma unroll
                for (int nb = 0; nb < S::kNBlocks; nb++) {
                    dst[(2 * c) * (D / 8) + nb] = o[nb][2 * h] * inv;
                    dst[(2 * c + 1) * (D / 8) + nb] = o[nb][2 * h + 1] * inv;
                }
                if (c == 0)
                    p.part_lse[(size_t)pidx * R + r] =
                        l_tot[h] > 0.0f ? m_run[h] + log2f(l_tot[h]) : -INFINITY;
            }
            return;
        }
        if (active) {
            float *ow = sO + (size_t)warp * 16 * D;
#pragma unroll
            for (int nb = 0; nb < S::kNBlocks; nb++) {
                int d0 = (2 * c) * (D / 8) + nb, d1 = (2 * c + 1) * (D / 8) + nb;
                ow[g * D + d0] = o[nb][0];
                ow[g * D + d1] = o[nb][1];
                ow[(g + 8) * D + d0] = o[nb][2];
                ow[(g + 8) * D + d1] = o[nb][3];
            }
            if (c == 0) {
                sM[warp * 16 + g] = m_run[0];
                sM[warp * 16 + g + 8] = m_run[1];
                sL[warp * 16 + g] = l_tot[0];
                sL[warp * 16 + g + 8] = l_tot[1];
            }
        }
        __syncthreads();
        /* every thread: 4 dims of one row; warp w of row group rg, split ts is rg*ts_count+ts */
        for (int idx = threadIdx.x; idx < R * (D / 4); idx += kThreads) {
            int r = idx / (D / 4), d = (idx % (D / 4)) * 4;
            int rgr = r >> 4, rr = r & 15;
            float mx = -INFINITY;
            for (int s = 0; s < ts_count; s++)
                mx = fmaxf(mx, sM[(rgr * ts_count + s) * 16 + rr]);
            float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
            float lsum = 0.0f;
            if (mx != -INFINITY) {
                for (int s = 0; s < ts_count; s++) {
                    int w = rgr * ts_count + s;
                    float ms = sM[w * 16 + rr];
                    if (ms == -INFINITY)
                        continue;
                    float wt = exp2f(ms - mx);
                    lsum += sL[w * 16 + rr] * wt;
                    const float *src = sO + ((size_t)w * 16 + rr) * D + d;
                    acc.x += src[0] * wt;
                    acc.y += src[1] * wt;
                    acc.z += src[2] * wt;
                    acc.w += src[3] * wt;
                }
            }
            float inv = lsum > 0.0f ? v_mul / lsum : 0.0f;
            acc.x *= inv;
            acc.y *= inv;
            acc.z *= inv;
            acc.w *= inv;
            *reinterpret_cast<float4 *>(p.part_o + ((size_t)pidx * R + r) * D + d) = acc;
            if (d == 0)
                p.part_lse[(size_t)pidx * R + r] = lsum > 0.0f ? mx + log2f(lsum) : -INFINITY;
        }
        (void)ts;
    }
};

template <int D, bool FP8KV, int NW, bool Q8>
__global__ void __launch_bounds__(NW * 32, NW == 4 ? 2 : 1) dec_attend_kernel(const DecParams p)
{
    extern __shared__ __align__(128) uint8_t dec_smem[];
    pdl_wait();
    pdl_trigger();
    Attend<D, FP8KV, NW, Q8>::run(p, dec_smem);
}

/* ============================================================================================
 * Warp-worker attention (FP8 Q over FP8 KV, up to 32 query rows): the fast path
 * ========================================================================================== */

/* A lane's V for one k16 step of P.V in the warp-worker kernel: bytes off..off + 15 (+ 7 for an
 * 8-byte slice) of token rows r0, r0 + 1, r0 + 8, r0 + 9 of a stage, as 4 words per row. */
template <int kRowBytes, int kSliceBytes>
__device__ __forceinline__ void load_v_slice(const uint8_t *sV, int r0, int off,
                                             uint32_t (&x)[4][4])
{
#pragma unroll
    for (int rr = 0; rr < 4; rr++) {
        const uint8_t *a = sV + v_addr<kRowBytes>(r0 + (rr & 1) + 8 * (rr >> 1), off);
        if (kSliceBytes == 8) {
            uint2 w = lds64(a);
            x[rr][0] = w.x;
            x[rr][1] = w.y;
            x[rr][2] = x[rr][3] = 0u;
        } else {
            uint4 w = lds128(a);
            x[rr][0] = w.x;
            x[rr][1] = w.y;
            x[rr][2] = w.z;
            x[rr][3] = w.w;
        }
    }
}

/* A warp's head in the plan (dec_plan_kernel, pass 3): its bin's task range [first, end),
 * first task, and that task's request length, slot, whether the CTA merges its partial, and
 * the warps of its worker (1, or 2 when two warps split the rows of the same bin). */
struct WarpHead {
    int2 span;
    int4 task0, aux0;
};

/* What a warp of a CTA of several leaves for the CTA's merge (merge_held): the slot of the
 * partial it wrote into its own shared memory (-1: none) and its task's place. */
struct Held {
    int slot, req, kvh;
    bool starts, ends;
};

/* Every warp works through a bin of the task map (alone, or with a second warp that takes
 * the other half of the rows) in its own ring of shared-memory stages, each one 32-token chunk
 * of K and V (and their in-page K scales): no barrier between warps while they work, and the
 * fixed work of a chunk (copies, softmax update) is paid once per 32 tokens by one warp
 * instead of once per 16 tokens by each of four. At the end, the warps of a CTA whose bins
 * share a slot merge their partials (merge_held).
 * The arithmetic of a chunk is a policy (M below): WarpMathM16 puts the query rows on the
 * mma's M side (m-tiles of 16 rows, any count up to 32); WarpMathT, for at most 8 rows, puts
 * the tokens and the head dims there and the rows on the N side (8), so no mma carries padding
 * rows. */
template <int D, class M> struct WarpAttend {
    using S = Shape<D, true>;
    static constexpr int kChunk = 32;                          /* tokens per stage */
    /* two stages: one chunk in flight while one is computed. Measured on an H200 against
     * three (docs/perf.md): two were as fast or faster on nearly every case */
    static constexpr int kStages = 2;
    static constexpr int kHalfBytes = kChunk * S::kRowBytes;    /* K (or V) of one chunk */
    static constexpr int kStageBytes = 2 * kHalfBytes + kChunk * 4;
    static constexpr int kRowStep = 32 / S::kChunks;           /* rows between a lane's copies */
    static constexpr int kRowsPerLane = kChunk / kRowStep;

    static constexpr size_t smem_bytes() { return (size_t)kStages * kStageBytes; }
    static_assert(32 * (D + 1) * 4 <= kStages * kStageBytes,
                  "a held partial (32 rows: O and LSE) fits the warp's stages");

    /* Where the chunks of a bin come from: task k's (request, head, tile range), length and
     * slot. */
    struct Cursor {
        int task, chunk, end; /* chunk index within the request; end exclusive */
        int req, kvh, slot;
        int32_t len;
        bool starts, whole; /* the task holds its pair's first tile / all its tiles */
    };

    static __device__ __forceinline__ bool open_task(const DecParams &p, int first, int num,
                                                     Cursor &cu)
    {
        while (cu.task < num) {
            int4 tk = __ldg(p.tasks + first + cu.task);
            int32_t len = __ldg(p.task_len + first + cu.task);
            int slot = __ldg(p.task_slot + first + cu.task);
            if (set_task(cu, tk, len, slot))
                return true;
            cu.task++; /* an empty task (cannot come from the plan, but never loop on it) */
        }
        return false;
    }

    static __device__ __forceinline__ bool set_task(Cursor &cu, int4 tk, int32_t len, int slot)
    {
        cu.req = tk.x;
        cu.kvh = tk.y;
        cu.slot = slot;
        cu.len = len;
        cu.chunk = tk.z * 2;
        cu.end = min(tk.w * 2, (len + kChunk - 1) / kChunk);
        cu.starts = tk.z == 0;
        cu.whole = cu.starts && tk.w >= tiles_of(len);
        return cu.chunk < cu.end;
    }

    /* Block ids of a chunk: the page holding its first token and, with 16-token pages, the
     * page of its second half. Past the end: -1 (nothing is read). */
    static __device__ __forceinline__ int2 chunk_blocks(const DecParams &p, const Cursor &cu)
    {
        const int32_t *bt = p.block_table + (size_t)cu.req * p.bt_stride;
        int pos = cu.chunk * kChunk;
        int2 b;
        b.x = pos < cu.len ? __ldg(bt + (pos >> p.page_shift)) : -1;
        b.y = (p.page_tokens < kChunk && pos + 16 < cu.len)
                  ? __ldg(bt + ((pos + 16) >> p.page_shift))
                  : b.x;
        return b;
    }

    /* cp.async of one chunk into a stage; rows past the end or with a block id outside the
     * pool become zeros. */
    static __device__ __forceinline__ void issue(const DecParams &p, uint32_t stage, float *sKs,
                                                 const Cursor &cu, int2 blk, int lane)
    {
        const int j = lane % S::kChunks, row0 = lane / S::kChunks;
        const uint8_t *base = p.pool_layer + (size_t)cu.kvh * S::kRowBytes + j * 16;
        const int pos0 = cu.chunk * kChunk;
        if (p.page_tokens >= kChunk && pos0 + kChunk <= cu.len && blk.x >= 0 &&
            blk.x < p.num_blocks) {
            /* the common case: a whole chunk inside one valid page, rows token_stride apart,
             * so one 64-bit address and an add per row */
            const uint8_t *src = base + (size_t)blk.x * p.block_stride +
                                 (size_t)((pos0 & (p.page_tokens - 1)) + row0) * p.token_stride;
            const size_t step = (size_t)kRowStep * p.token_stride;
#pragma unroll
            for (int k = 0; k < kRowsPerLane; k++) {
                int row = row0 + k * kRowStep;
                uint32_t dk = stage + row * S::kRowBytes + ((j ^ swz_k<S::kChunks>(row)) * 16);
                uint32_t dv =
                    stage + kHalfBytes + row * S::kRowBytes + ((j ^ swz_v<S::kChunks>(row)) * 16);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dk), "l"(src)
                             : "memory");
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dv),
                             "l"(src + p.v_offset)
                             : "memory");
                src += step;
            }
        } else {
            /* the last chunk of a request, 16-token pages, or a block id outside the pool:
             * row by row, zeros where nothing may be read */
#pragma unroll
            for (int k = 0; k < kRowsPerLane; k++) {
                int row = row0 + k * kRowStep, pos = pos0 + row;
                int32_t b = (p.page_tokens < kChunk && row >= 16) ? blk.y : blk.x;
                bool ok = pos < cu.len && b >= 0 && b < p.num_blocks;
                const uint8_t *src = ok ? base + (size_t)b * p.block_stride +
                                              (size_t)(pos & (p.page_tokens - 1)) * p.token_stride
                                        : p.pool_layer;
                int bytes = ok ? 16 : 0;
                uint32_t dk = stage + row * S::kRowBytes + ((j ^ swz_k<S::kChunks>(row)) * 16);
                uint32_t dv =
                    stage + kHalfBytes + row * S::kRowBytes + ((j ^ swz_v<S::kChunks>(row)) * 16);
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dk), "l"(src),
                             "r"(bytes)
                             : "memory");
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(dv),
                             "l"(ok ? src + p.v_offset : src), "r"(bytes)
                             : "memory");
            }
        }
        if (p.per_token_head) {
            int pos = pos0 + lane;
            int32_t b = (p.page_tokens < kChunk && lane >= 16) ? blk.y : blk.x;
            bool ok = pos < cu.len && b >= 0 && b < p.num_blocks;
            const uint8_t *src = ok ? p.pool_layer + (size_t)b * p.block_stride + p.kscale_offset +
                                          ((size_t)(pos & (p.page_tokens - 1)) * p.num_kv_heads +
                                           cu.kvh) * 4
                                    : p.pool_layer;
            cp_async4(sKs + lane, src, ok ? 4 : 0);
        }
    }

    /* Works through the bin of head `hd` (dynamic) or the CTA's static split, in the warp's
     * `smem` (smem_bytes()). A task whose slot the plan shares with a neighbouring worker's
     * (its bin's only one) leaves its partial in `smem` for merge_held() (returned in Held);
     * every other task writes its partial, or its outputs, itself. The warp takes the rows
     * rbase.. of its pairs (16: the second warp of a worker of two). */
    static __device__ Held run(const DecParams &p, uint8_t *smem, const WarpHead &hd, int rbase)
    {
        const int lane = threadIdx.x & 31, g = lane >> 2, c = lane & 3;
        const int R = p.rows;
        int first = 0, num = 1;
        Held held{-1, 0, 0, false, false};
        if (rbase >= R)
            return held; /* the second warp of a worker whose pairs have 16 rows or fewer */
        bool merged = false; /* the CTA merges the bin's only task's partial, left in smem */
        Cursor ld{}, cc{};
        if (p.static_splits) {
            /* one (KV head, request, split) per CTA, as the fixed grid of the baseline */
            int kvh = blockIdx.x, req = blockIdx.y, split = blockIdx.z;
            int32_t len = max(p.kv_lens[req], 0);
            int tb = split * p.static_chunk_tiles;
            int te = min(tb + p.static_chunk_tiles, tiles_of(len));
            int idx = (req * p.num_kv_heads + kvh) * p.static_splits + split;
            if (tb >= te) {
                for (int r = lane; r < R; r += 32)
                    p.part_lse[(size_t)idx * R + r] = -INFINITY;
                return held;
            }
            ld.req = cc.req = req;
            ld.kvh = cc.kvh = kvh;
            ld.slot = cc.slot = idx;
            ld.len = cc.len = len;
            ld.chunk = cc.chunk = tb * 2;
            ld.end = cc.end = min(te * 2, (len + kChunk - 1) / kChunk);
        } else {
            first = hd.span.x;
            num = hd.span.y - hd.span.x;
            if (num <= 0)
                return held;
            merged = hd.aux0.z != 0;
            if (!set_task(ld, hd.task0, hd.aux0.x, hd.aux0.y) && !open_task(p, first, num, ld))
                return held;
            cc = ld;
        }
        const uint32_t s_base = smem_u32(smem);

        /* loader: block ids of the next chunk to issue are fetched one issue ahead */
        bool ld_more = true;
        int2 ld_blk = chunk_blocks(p, ld);
        auto advance = [&](Cursor &cu) -> bool {
            if (++cu.chunk < cu.end)
                return true;
            if (p.static_splits)
                return false;
            cu.task++;
            return open_task(p, first, num, cu);
        };
        auto load_next = [&](int stage) {
            float *sKs = reinterpret_cast<float *>(smem + stage * kStageBytes + 2 * kHalfBytes);
            issue(p, s_base + stage * kStageBytes, sKs, ld, ld_blk, lane);
            ld_more = advance(ld);
            if (ld_more)
                ld_blk = chunk_blocks(p, ld);
        };
#pragma unroll
        for (int s = 0; s < kStages - 1; s++) {
            if (ld_more)
                load_next(s);
            cp_async_commit();
        }

        typename M::State ms;
        float v_mul = 1.0f;
        bool fresh = true;
        for (int i = 0;; i++) {
            if (fresh) {
                /* start of a task: queries into registers, state reset */
                v_mul = p.per_token_head ? p.v_head_scales[cc.kvh] : p.v_scale;
                M::start(p, cc.req, cc.kvh, cc.len, rbase, g, c, ms);
                fresh = false;
            }
            /* the queries above are in flight while the chunk is awaited */
            cp_async_wait<kStages - 2>();
            __syncwarp();
            if (ld_more)
                load_next((i + kStages - 1) % kStages);
            cp_async_commit();

            const int st = i % kStages;
            const uint8_t *stage = smem + st * kStageBytes;
            M::compute(p, stage, stage + kHalfBytes,
                       reinterpret_cast<const float *>(stage + 2 * kHalfBytes), cc.chunk * kChunk,
                       g, c, ms);

            if (cc.chunk + 1 == cc.end) {
                /* end of a task: its outputs, or its partial O (normalised, f32) and LSE in
                 * its slot or, held for the CTA's merge, in the warp's shared memory (the
                 * bin's only task: its last chunk, nothing more in flight) */
                if (p.direct && cc.whole) {
                    M::template finish<true>(p, nullptr, nullptr, cc.req, cc.kvh, rbase, g, c,
                                             v_mul, ms);
                } else {
                    /* the warp's rows rbase.. of the slot, or from row 0 of its shared memory */
                    float *po = merged ? reinterpret_cast<float *>(smem)
                                      : p.part_o + ((size_t)cc.slot * R + rbase) * D;
                    float *pl = merged ? po + R * D : p.part_lse + (size_t)cc.slot * R + rbase;
                    __syncwarp(); /* every lane is done reading the stages */
                    M::template finish<false>(p, po, pl, cc.req, cc.kvh, rbase, g, c, v_mul,
                                              ms);
                }
                fresh = true;
            }
            if (!advance(cc))
                break;
        }
        cp_async_wait<0>();
        if (merged) /* cc is still the task's cursor: the loop ended at its last chunk */
            held = Held{cc.slot, cc.req, cc.kvh, cc.starts,
                        cc.end == (cc.len + kChunk - 1) / kChunk};
        return held;
    }
};

/* The partials a CTA's warps held (WarpAttend::run): runs of consecutive workers holding the
 * same slot (the plan gives consecutive whole bins of one pair one slot) are merged, each
 * run's warps taking its rows in turn, into the slot or, where a run covers its whole pair,
 * into the outputs (the combine skips pairs of one slot). With workers of hv = 2 warps, the
 * warps of one half (rows from rbase) merge that half. warp_bytes: each warp's share of the
 * shared memory, its partial at the start ([rows][D] then [rows] LSEs, from the warp's
 * first row). */
template <int D>
__device__ void merge_held(const DecParams &p, const uint8_t *smem, size_t warp_bytes,
                           const Held &held, int rbase, int hv)
{
    const int slot = held.slot, req = held.req, kvh = held.kvh;
    const bool starts = held.starts, ends = held.ends;
    constexpr int V = D / 32; /* dims per lane: 2, 4 or 8, read and written as float2 */
    __shared__ int s_slot[kMaxCtaWarps];
    __shared__ unsigned char s_starts[kMaxCtaWarps], s_ends[kMaxCtaWarps];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, W = blockDim.x >> 5;
    if (lane == 0) {
        s_slot[warp] = slot;
        s_starts[warp] = starts;
        s_ends[warp] = ends;
    }
    __syncthreads();
    if (slot < 0)
        return;
    int h = warp, e = warp; /* the run: the warps of this half are hv apart */
    while (h >= hv && s_slot[h - hv] == slot)
        h -= hv;
    while (e + hv < W && s_slot[e + hv] == slot)
        e += hv;
    const int R = p.rows, n = (e - h) / hv + 1, nr = hv > 1 ? min(16, R - rbase) : R;
    const bool to_out = p.direct && s_starts[h] && s_ends[e];
    auto part = [&](int j) { return reinterpret_cast<const float *>(smem + j * warp_bytes); };
    for (int r = (warp - h) / hv; r < nr; r += n) {
        float m = -INFINITY;
        for (int j = h; j <= e; j += hv)
            m = fmaxf(m, part(j)[R * D + r]);
        float acc[V], ws = 0.0f;
#pragma unroll
        for (int v = 0; v < V; v++)
            acc[v] = 0.0f;
        for (int j = h; j <= e; j += hv) {
            const float lj = part(j)[R * D + r];
            const float w = lj == -INFINITY ? 0.0f : exp2f(lj - m);
            if (w > 0.0f) {
                const float *src = part(j) + r * D + lane * V;
                float x[V];
#pragma unroll
                for (int v = 0; v < V; v += 2) {
                    const float2 t = *reinterpret_cast<const float2 *>(src + v);
                    x[v] = t.x;
                    x[v + 1] = t.y;
                }
#pragma unroll
                for (int v = 0; v < V; v++)
                    acc[v] = fmaf(w, x[v], acc[v]);
                ws += w;
            }
        }
        const float inv = ws > 0.0f ? 1.0f / ws : 0.0f;
        const float lse = ws > 0.0f ? m + log2f(ws) : -INFINITY;
        if (to_out) {
            const size_t oi = row_index(p, req, kvh, rbase + r);
            uint16_t *dst = p.out + oi * D + lane * V;
#pragma unroll
            for (int v = 0; v < V; v += 2)
                *reinterpret_cast<uint32_t *>(dst + v) =
                    tkvk_bf16x2_from_float2(acc[v] * inv, acc[v + 1] * inv);
            if (p.lse && lane == 0)
                p.lse[oi] = lse;
        } else {
            float *dst = p.part_o + ((size_t)slot * R + rbase + r) * D + lane * V;
#pragma unroll
            for (int v = 0; v < V; v += 2)
                *reinterpret_cast<float2 *>(dst + v) = make_float2(acc[v] * inv, acc[v + 1] * inv);
            if (lane == 0)
                p.part_lse[(size_t)slot * R + rbase + r] = lse;
        }
    }
}

/* The query rows on the mma's M side: MT m-tiles of 16 rows share every K and V fragment; Q.K
 * as e4m3 mma straight from the cached bytes (on sm_90 carried out as f16 HMMA with the B
 * operand converted), P.V as f16 mma with V converted in registers (exact), as in Attend. */
template <int D, int MT, bool kLo8 = false> struct WarpMathM16 {
    static_assert(!kLo8 || MT == 1, "rows <= 8 is one m-tile");
    /* kLo8: at most 8 rows, so the m-tile's rows 8..15 are padding: their softmax is skipped */
    static constexpr int kHalves = kLo8 ? 1 : 2;
    using S = Shape<D, true>;
    static constexpr int kChunk = 32;
    static constexpr int kNB = S::kNBlocks;

    struct State {
        uint32_t qa[MT][D / 32][4];
        float o[MT][kNB][4];
        float m_run[MT][2], l_run[MT][2], rowmul[MT][2];
        int lim[MT][2];
    };

    /* start of a task: queries of rows rbase.. into registers, state reset */
    static __device__ __forceinline__ void start(const DecParams &p, int req, int kvh,
                                                 int32_t len, int rbase, int g, int c, State &st)
    {
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            load_q(p, req, kvh, rbase + mt * 16 + g, c, len, st.qa[mt], st.rowmul[mt],
                   st.lim[mt]);
#pragma unroll
            for (int h = 0; h < 2; h++) {
                st.m_run[mt][h] = -INFINITY;
                st.l_run[mt][h] = 0.0f;
            }
#pragma unroll
            for (int nb = 0; nb < kNB; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    st.o[mt][nb][e] = 0.0f;
        }
    }

    /* Rows row0 and row0 + 8 of one m-tile: A fragments in the k order of compute() (as
     * Attend::load_q, Q8 case), score multipliers and causal limits. */
    static __device__ __forceinline__ void load_q(const DecParams &p, int req, int kvh, int row0,
                                                  int c, int32_t len, uint32_t (&qa)[D / 32][4],
                                                  float (&rowmul)[2], int (&lim)[2])
    {
        const int R = p.rows;
        const float kmul = p.per_token_head ? 1.0f : p.k_scale;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = row0 + h * 8;
            bool valid = r < R;
            int t = valid ? r / p.group : 0;
            size_t qi = row_index(p, req, kvh, valid ? r : 0);
            lim[h] = valid ? len - p.q_len + t + 1 : 0x7fffffff;
            float qs = valid ? p.q_scales[qi] : 0.0f;
            const uint8_t *q = static_cast<const uint8_t *>(p.q) + qi * D;
#pragma unroll
            for (int s = 0; s < D / 32; s++) {
                int dim = 16 * (c + 4 * (s / 2)) + 8 * (s % 2);
                uint2 w = valid ? *reinterpret_cast<const uint2 *>(q + dim) : make_uint2(0, 0);
                qa[s][h] = w.x;
                qa[s][h + 2] = w.y;
            }
            rowmul[h] = p.score_scale * qs * kmul;
        }
    }

    /* One 32-token chunk for every m-tile: scores (e4m3 mma), online softmax (base 2), P.V. */
    static __device__ __forceinline__ void compute(const DecParams &p, const uint8_t *sK,
                                                   const uint8_t *sV, const float *sKs, int pos0,
                                                   int g, int c, State &st)
    {
        const auto &qa = st.qa;
        const auto &rowmul = st.rowmul;
        const auto &lim = st.lim;
        auto &m_run = st.m_run;
        auto &l_run = st.l_run;
        auto &o = st.o;
        float sc[MT][4][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int nb = 0; nb < 4; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    sc[mt][nb][e] = 0.0f;
        /* f16 mma, Q and K converted here: sm_90 has no e4m3 mma.sync, and its emulation
         * would convert each Q fragment once per n-block and add each k16 half separately.
         * k16 step (pp, u) takes dims 16 (c + 4 pp) + 4 u .. + 3: word u of K's 16 bytes and
         * word u % 2 of Q's k32 step 2 pp + u / 2. */
#pragma unroll
        for (int s2 = 0; s2 < S::kChunks / 2; s2++) {
            /* k32 step s2 = 2 pp + half: the 8 bytes at 8 half of every n-block's K row, 8
             * bytes at a time (16 would hold 8 more registers: it spills with two m-tiles) */
            const int pp = s2 / 2, half = s2 % 2;
            uint32_t kw[4][2];
#pragma unroll
            for (int nb = 0; nb < 4; nb++) {
                const int row = nb * 8 + g;
                uint2 kv = lds64(sK + row * S::kRowBytes +
                                 (((c + 4 * pp) ^ swz_k<S::kChunks>(row)) * 16) + 8 * half);
                kw[nb][0] = kv.x;
                kw[nb][1] = kv.y;
            }
#pragma unroll
            for (int u2 = 0; u2 < 2; u2++) {
                const int u = 2 * half + u2;
                uint32_t a[MT][4];
#pragma unroll
                for (int mt = 0; mt < MT; mt++) {
                    const uint32_t *q = qa[mt][2 * pp + u / 2];
                    e4m3x4_to_f16x2(q[2 * (u % 2)], a[mt][0], a[mt][2]);
                    e4m3x4_to_f16x2(q[2 * (u % 2) + 1], a[mt][1], a[mt][3]);
                }
#pragma unroll
                for (int nb = 0; nb < 4; nb++) {
                    uint32_t b0, b1;
                    e4m3x4_to_f16x2(kw[nb][u2], b0, b1);
#pragma unroll
                    for (int mt = 0; mt < MT; mt++)
                        mma16816<true>(sc[mt][nb], a[mt], b0, b1);
                }
            }
        }
        uint32_t pa[MT][2][4];
#pragma unroll
        for (int mt = 0; mt < MT; mt++) {
            const bool need_mask = pos0 + kChunk > min(lim[mt][0], lim[mt][1]);
            float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
            for (int nb = 0; nb < 4; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    int h = e >> 1, col = nb * 8 + 2 * c + (e & 1);
                    if (h >= kHalves)
                        continue;
                    float v = sc[mt][nb][e] * rowmul[mt][h];
                    if (p.per_token_head)
                        v *= sKs[col];
                    if (need_mask)
                        v = pos0 + col < lim[mt][h] ? v : -INFINITY;
                    sc[mt][nb][e] = v;
                    mx[h] = fmaxf(mx[h], v);
                }
            float alpha[2] = {1.0f, 1.0f}, m_use[2] = {0.0f, 0.0f};
#pragma unroll
            for (int h = 0; h < kHalves; h++) {
                float m_new = fmaxf(m_run[mt][h], quad_max(mx[h]));
                m_use[h] = m_new == -INFINITY ? 0.0f : m_new;
                alpha[h] = fast_exp2(m_run[mt][h] - m_use[h]);
                m_run[mt][h] = m_new;
            }
            float rs[2] = {0.0f, 0.0f};
#pragma unroll
            for (int nb = 0; nb < 4; nb++)
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    if ((e >> 1) >= kHalves) {
                        sc[mt][nb][e] = 0.0f; /* padding rows: P = 0 */
                        continue;
                    }
                    float pe = fast_exp2(sc[mt][nb][e] - m_use[e >> 1]);
                    sc[mt][nb][e] = pe;
                    rs[e >> 1] += pe;
                }
#pragma unroll
            for (int h = 0; h < kHalves; h++)
                l_run[mt][h] = l_run[mt][h] * alpha[h] + rs[h];
            if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
                for (int nb = 0; nb < kNB; nb++) {
                    o[mt][nb][0] *= alpha[0];
                    o[mt][nb][1] *= alpha[0];
                    if (!kLo8) {
                        o[mt][nb][2] *= alpha[1];
                        o[mt][nb][3] *= alpha[1];
                    }
                }
            }
#pragma unroll
            for (int ks = 0; ks < 2; ks++) {
                pa[mt][ks][0] = pack2<true>(sc[mt][2 * ks][0], sc[mt][2 * ks][1]);
                pa[mt][ks][1] = pack2<true>(sc[mt][2 * ks][2], sc[mt][2 * ks][3]);
                pa[mt][ks][2] = pack2<true>(sc[mt][2 * ks + 1][0], sc[mt][2 * ks + 1][1]);
                pa[mt][ks][3] = pack2<true>(sc[mt][2 * ks + 1][2], sc[mt][2 * ks + 1][3]);
            }
        }
        /* P.V: k16 step ks covers tokens 16ks..16ks+15; a lane's rows 2c, 2c+1 (k-slots 2c,
         * 2c+1) and 2c+8, 2c+9, its 1/8 slice of each row: output column g of n-block nb is
         * head dim g * D/8 + nb (as Attend). */
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            int r0 = 16 * ks + 2 * c;
            const int slice = g * S::kSliceBytes;
#pragma unroll
            for (int piece = 0; piece < (S::kSliceBytes + 15) / 16; piece++) {
                uint32_t x[4][4];
                load_v_slice<S::kRowBytes, S::kSliceBytes>(sV, r0, slice + piece * 16, x);
#pragma unroll
                for (int wv = 0; wv < (S::kSliceBytes == 8 ? 2 : 4); wv++) {
                    uint32_t b[4][2];
                    e4m3_token_pairs(x[0][wv], x[1][wv], x[2][wv], x[3][wv], b);
                    int nb = (piece * 4 + wv) * 4;
#pragma unroll
                    for (int mt = 0; mt < MT; mt++)
#pragma unroll
                        for (int u = 0; u < 4; u++)
                            mma16816<true>(o[mt][nb + u], pa[mt][ks], b[u][0], b[u][1]);
                }
            }
        }
    }


    /* end of a task: the partial O (normalised, f32) of rows rbase.. into po ([rows][D], from
     * row rbase) and its LSE into plse ([rows], the same) or, kOut (the pair's only task),
     * BF16 O and the LSE straight to the outputs */
    template <bool kOut>
    static __device__ __forceinline__ void finish(const DecParams &p, float *po, float *plse,
                                                  int req, int kvh, int rbase, int g, int c,
                                                  float v_mul, const State &st)
    {
        const int R = p.rows;
        const auto &m_run = st.m_run;
        const auto &o = st.o;
#pragma unroll
        for (int mt = 0; mt < MT; mt++)
#pragma unroll
            for (int h = 0; h < kHalves; h++) {
                float l = quad_sum(st.l_run[mt][h]);
                int r = mt * 16 + g + 8 * h;
                if (rbase + r >= R)
                    continue;
                float inv = l > 0.0f ? v_mul / l : 0.0f;
                if (kOut) {
                    size_t oi = row_index(p, req, kvh, rbase + r);
                    uint16_t *dst = p.out + oi * D;
                    /* dims 2c * D/8 + nb and (2c + 1) * D/8 + nb: two runs of D/8 values, 16
                     * bytes a store */
#pragma unroll
                    for (int half = 0; half < 2; half++)
#pragma unroll
                        for (int nb = 0; nb < kNB; nb += 8) {
                            uint32_t w[4];
#pragma unroll
                            for (int k = 0; k < 4; k++)
                                w[k] = tkvk_bf16x2_from_float2(
                                    o[mt][nb + 2 * k][2 * h + half] * inv,
                                    o[mt][nb + 2 * k + 1][2 * h + half] * inv);
                            *reinterpret_cast<uint4 *>(dst + (2 * c + half) * (D / 8) + nb) =
                                make_uint4(w[0], w[1], w[2], w[3]);
                        }
                    if (p.lse && c == 0)
                        p.lse[oi] = l > 0.0f ? m_run[mt][h] + log2f(l) : -INFINITY;
                } else {
                    float *dst = po + (size_t)r * D;
                    /* dims 2c * D/8 + nb and (2c + 1) * D/8 + nb: two runs of D/8 floats */
#pragma unroll
                    for (int nb = 0; nb < kNB; nb += 4) {
                        *reinterpret_cast<float4 *>(dst + (2 * c) * (D / 8) + nb) =
                            make_float4(o[mt][nb][2 * h] * inv, o[mt][nb + 1][2 * h] * inv,
                                        o[mt][nb + 2][2 * h] * inv, o[mt][nb + 3][2 * h] * inv);
                        *reinterpret_cast<float4 *>(dst + (2 * c + 1) * (D / 8) + nb) =
                            make_float4(o[mt][nb][2 * h + 1] * inv, o[mt][nb + 1][2 * h + 1] * inv,
                                        o[mt][nb + 2][2 * h + 1] * inv,
                                        o[mt][nb + 3][2 * h + 1] * inv);
                    }
                    if (c == 0)
                        plse[r] = l > 0.0f ? m_run[mt][h] + log2f(l) : -INFINITY;
                }
            }
    }
};

/* At most 8 query rows (a GQA group of 8 at one query token, the common decode shape): the
 * rows on the mma's N side (n = 8), tokens and head dims on M, so no mma carries padding rows
 * and the accumulators hold only real values (half of WarpMathM16's mma and accumulators).
 *   scores  S^T = K Q^T: m16n8k32 e4m3, A = 16 tokens x 32 dims of K straight from the cached
 *           bytes (the k order permuted as in WarpMathM16, so a lane's K fragment is 16
 *           consecutive bytes of its token row), B = the lane's query row g (loaded once).
 *   softmax a lane holds rows 2c, 2c + 1 of tokens g, g + 8 of each m-tile; a row's max is
 *           reduced across the 8 lanes of its c (xor 4, 8, 16).
 *   P.V     O^T = V^T P^T: m16n8k16 f16, A = V converted in registers (pairs of tokens per
 *           register, as the B operand of WarpMathM16), B = P^T, moved into the B layout by
 *           movmatrix (the score accumulator of 8 tokens x 8 rows, transposed).
 * M-row g of m-tile mt of O^T is head dim g * D/8 + 2 mt, m-row g + 8 is the next dim, so a
 * lane ends with D/8 consecutive dims of its two rows. */
template <int D> struct WarpMathT {
    using S = Shape<D, true>;
    static constexpr int kChunk = 32;
    static constexpr int kMT = D / 16;       /* m-tiles of O^T */
    static constexpr int kSlice = S::kSliceBytes; /* = D / 8 dims a lane ends with */

    struct State {
        uint32_t qh[D / 16][2]; /* B fragments of Q^T, f16, one per k16 step */
        float o[kMT][4];
        float m_run[2], l_run[2], rowmul[2];
        int lim[2];
    };

    static __device__ __forceinline__ uint32_t trans8x8(uint32_t x)
    {
        uint32_t r;
        asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(r) : "r"(x));
        return r;
    }

    /* as WarpMathM16::start; rbase is always 0 (at most 8 rows: a worker's second warp has
     * none, WarpAttend::run) */
    static __device__ __forceinline__ void start(const DecParams &p, int req, int kvh,
                                                 int32_t len, int /* rbase */, int g, int c,
                                                 State &st)
    {
        const int R = p.rows;
        const float kmul = p.per_token_head ? 1.0f : p.k_scale;
        /* B fragments: query row g; k16 step 4 pp + u takes dims 16 (c + 4 pp) + 4 u .. + 3,
         * as compute() takes K. Converted to f16 once per task, not once per chunk. */
        {
            const bool valid = g < R;
            const size_t qi = row_index(p, req, kvh, valid ? g : 0);
            const uint8_t *q = static_cast<const uint8_t *>(p.q) + qi * D;
#pragma unroll
            for (int s = 0; s < D / 32; s++) {
                int dim = 16 * (c + 4 * (s / 2)) + 8 * (s % 2);
                uint2 w = valid ? *reinterpret_cast<const uint2 *>(q + dim) : make_uint2(0, 0);
                e4m3x4_to_f16x2(w.x, st.qh[2 * s][0], st.qh[2 * s][1]);
                e4m3x4_to_f16x2(w.y, st.qh[2 * s + 1][0], st.qh[2 * s + 1][1]);
            }
        }
        /* this lane's score columns: rows 2c and 2c + 1 */
#pragma unroll
        for (int j = 0; j < 2; j++) {
            int r = 2 * c + j;
            bool valid = r < R;
            size_t qi = row_index(p, req, kvh, valid ? r : 0);
            st.lim[j] = valid ? len - p.q_len + r / p.group + 1 : 0x7fffffff;
            st.rowmul[j] = valid ? p.score_scale * p.q_scales[qi] * kmul : 0.0f;
            st.m_run[j] = -INFINITY;
            st.l_run[j] = 0.0f;
        }
#pragma unroll
        for (int mt = 0; mt < kMT; mt++)
#pragma unroll
            for (int e = 0; e < 4; e++)
                st.o[mt][e] = 0.0f;
    }

    static __device__ __forceinline__ void compute(const DecParams &p, const uint8_t *sK,
                                                   const uint8_t *sV, const float *sKs, int pos0,
                                                   int g, int c, State &st)
    {
        /* scores: sc[qt][e] = S^T[token 16 qt + g + 8 (e >> 1)][row 2c + (e & 1)] */
        float sc[2][4];
#pragma unroll
        for (int qt = 0; qt < 2; qt++) {
#pragma unroll
            for (int e = 0; e < 4; e++)
                sc[qt][e] = 0.0f;
            const int ra = 16 * qt + g, rb = ra + 8;
            const uint8_t *ka_row = sK + ra * S::kRowBytes, *kb_row = sK + rb * S::kRowBytes;
#pragma unroll
            for (int pp = 0; pp < S::kChunks / 4; pp++) {
                uint4 ka = lds128(ka_row + (((c + 4 * pp) ^ swz_k<S::kChunks>(ra)) * 16));
                uint4 kb = lds128(kb_row + (((c + 4 * pp) ^ swz_k<S::kChunks>(rb)) * 16));
                const uint32_t wa[4] = {ka.x, ka.y, ka.z, ka.w}, wb[4] = {kb.x, kb.y, kb.z, kb.w};
                /* f16 mma on K converted here: sm_90 has no e4m3 mma.sync, and its emulation
                 * would convert Q again every chunk and add each k16 half separately */
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    uint32_t a[4];
                    e4m3x4_to_f16x2(wa[u], a[0], a[2]);
                    e4m3x4_to_f16x2(wb[u], a[1], a[3]);
                    mma16816<true>(sc[qt], a, st.qh[4 * pp + u][0], st.qh[4 * pp + u][1]);
                }
            }
        }
        /* online softmax (base 2) per row */
        const bool need_mask = pos0 + kChunk > min(st.lim[0], st.lim[1]);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int qt = 0; qt < 2; qt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int j = e & 1, tok = 16 * qt + g + 8 * (e >> 1);
                float v = sc[qt][e] * st.rowmul[j];
                if (p.per_token_head)
                    v *= sKs[tok];
                if (need_mask)
                    v = pos0 + tok < st.lim[j] ? v : -INFINITY;
                sc[qt][e] = v;
                mx[j] = fmaxf(mx[j], v);
            }
        float alpha[2], m_use[2];
#pragma unroll
        for (int j = 0; j < 2; j++) {
            float m = mx[j];
#pragma unroll
            for (int o = 4; o < 32; o <<= 1)
                m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
            const float m_new = fmaxf(st.m_run[j], m);
            m_use[j] = m_new == -INFINITY ? 0.0f : m_new;
            alpha[j] = fast_exp2(st.m_run[j] - m_use[j]);
            st.m_run[j] = m_new;
        }
        float rs[2] = {0.0f, 0.0f};
#pragma unroll
        for (int qt = 0; qt < 2; qt++)
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const float pe = fast_exp2(sc[qt][e] - m_use[e & 1]);
                sc[qt][e] = pe;
                rs[e & 1] += pe;
            }
#pragma unroll
        for (int j = 0; j < 2; j++)
            st.l_run[j] = st.l_run[j] * alpha[j] + rs[j];
        if (__any_sync(0xffffffffu, alpha[0] != 1.0f || alpha[1] != 1.0f)) {
#pragma unroll
            for (int mt = 0; mt < kMT; mt++)
#pragma unroll
                for (int e = 0; e < 4; e++)
                    st.o[mt][e] *= alpha[e & 1];
        }
        /* P^T as B fragments: pb[ks] = P[row g][tokens 16 ks + 2c, +1 | 16 ks + 8 + 2c, +1] */
        uint32_t pb[2][2];
#pragma unroll
        for (int qt = 0; qt < 2; qt++) {
            pb[qt][0] = trans8x8(pack2<true>(sc[qt][0], sc[qt][1]));
            pb[qt][1] = trans8x8(pack2<true>(sc[qt][2], sc[qt][3]));
        }
        /* P.V: k16 step ks covers tokens 16 ks..16 ks + 15; a lane reads its 1/8 slice of
         * token rows 2c, 2c + 1, 2c + 8, 2c + 9 and pairs their bytes per dim */
#pragma unroll
        for (int ks = 0; ks < 2; ks++) {
            const int r0 = 16 * ks + 2 * c, slice = g * kSlice;
#pragma unroll
            for (int piece = 0; piece < (kSlice + 15) / 16; piece++) {
                uint32_t x[4][4];
                load_v_slice<S::kRowBytes, kSlice>(sV, r0, slice + piece * 16, x);
#pragma unroll
                for (int wv = 0; wv < (kSlice == 8 ? 2 : 4); wv++) {
                    /* dims 4 wv .. 4 wv + 3 of the piece: m-rows g, g + 8 of m-tiles mt, mt + 1 */
                    uint32_t b[4][2];
                    e4m3_token_pairs(x[0][wv], x[1][wv], x[2][wv], x[3][wv], b);
                    const uint32_t aa[4] = {b[0][0], b[1][0], b[0][1], b[1][1]};
                    const uint32_t ab[4] = {b[2][0], b[3][0], b[2][1], b[3][1]};
                    const int mt = piece * 8 + 2 * wv;
                    mma16816<true>(st.o[mt], aa, pb[ks][0], pb[ks][1]);
                    mma16816<true>(st.o[mt + 1], ab, pb[ks][0], pb[ks][1]);
                }
            }
        }
    }

    /* row 2c + j's sum over the 8 lanes of its c */
    static __device__ __forceinline__ float row_sum(float l)
    {
#pragma unroll
        for (int o = 4; o < 32; o <<= 1)
            l += __shfl_xor_sync(0xffffffffu, l, o);
        return l;
    }

    /* as WarpMathM16::finish; dims of m-tile mt: o[mt][j] is dim g * D/8 + 2 mt of row 2c + j,
     * o[mt][2 + j] the next */
    template <bool kOut>
    static __device__ __forceinline__ void finish(const DecParams &p, float *po, float *plse,
                                                  int req, int kvh, int /* rbase: 0 */, int g,
                                                  int c, float v_mul, const State &st)
    {
        const int R = p.rows;
#pragma unroll
        for (int j = 0; j < 2; j++) {
            const float l = row_sum(st.l_run[j]);
            const int r = 2 * c + j;
            if (r >= R)
                continue;
            const float inv = l > 0.0f ? v_mul / l : 0.0f;
            if (kOut) {
                const size_t oi = row_index(p, req, kvh, r);
                uint16_t *dst = p.out + oi * D + g * kSlice;
#pragma unroll
                for (int q = 0; q < kMT / 4; q++) {
                    uint32_t w[4];
#pragma unroll
                    for (int k = 0; k < 4; k++) {
                        const int mt = 4 * q + k;
                        w[k] = tkvk_bf16x2_from_float2(st.o[mt][j] * inv, st.o[mt][2 + j] * inv);
                    }
                    *reinterpret_cast<uint4 *>(dst + 8 * q) = make_uint4(w[0], w[1], w[2], w[3]);
                }
                if (p.lse && g == 0)
                    p.lse[oi] = l > 0.0f ? st.m_run[j] + log2f(l) : -INFINITY;
            } else {
                float *dst = po + (size_t)r * D + g * kSlice;
#pragma unroll
                for (int q = 0; q < kMT / 2; q++)
                    *reinterpret_cast<float4 *>(dst + 4 * q) =
                        make_float4(st.o[2 * q][j] * inv, st.o[2 * q][2 + j] * inv,
                                    st.o[2 * q + 1][j] * inv, st.o[2 * q + 1][2 + j] * inv);
                if (g == 0)
                    plse[r] = l > 0.0f ? st.m_run[j] + log2f(l) : -INFINITY;
            }
        }
    }
};

/* A CTA is W = blockDim.x / 32 warps (the static baseline: one), each with its own share of
 * the shared memory; warp w reads its head at blockIdx.x * W + w. Where the plan made workers
 * of two warps (every bin at the floor with half the workers: more warps at work, each with
 * half the rows), warps 2j and 2j + 1 take rows 0..15 and 16.. of the same bin with MH (one
 * m-tile); else each warp takes its bin's rows with M. */
template <int D, class M, class MH = M>
__global__ void __launch_bounds__(32 * kMaxCtaWarps) dec_warp_kernel(const DecParams p)
{
    extern __shared__ __align__(128) uint8_t dec_smem[];
    using WA = WarpAttend<D, M>;
    static_assert(WA::smem_bytes() == WarpAttend<D, MH>::smem_bytes(), "one share per warp");
    pdl_wait();
    pdl_trigger();
    const int W = blockDim.x >> 5, warp = threadIdx.x >> 5;
    uint8_t *smem = dec_smem + warp * WA::smem_bytes();
    WarpHead hd{};
    if (!p.static_splits) {
        /* span, first task and the rest together: one round trip before the block table */
        const int w = blockIdx.x * W + warp;
        hd.span = p.worker_span[w];
        hd.task0 = p.worker_task0[w];
        hd.aux0 = p.worker_aux0[w];
    }
    /* (a warp without a bin may see a stale aux0: it returns before using it) */
    const int hv = hd.aux0.w == 2 ? 2 : 1, rbase = (warp % hv) * 16;
    Held h;
    if (std::is_same<M, MH>::value || hv == 1)
        h = WA::run(p, smem, hd, rbase);
    else
        h = WarpAttend<D, MH>::run(p, smem, hd, rbase);
    if (W > 1)
        merge_held<D>(p, dec_smem, WA::smem_bytes(), h, rbase, hv);
}

/* ============================================================================================
 * Combine and merge states
 * ========================================================================================== */

struct CombineParams {
    const float *part_o, *part_lse;
    const int32_t *pair_first, *pair_count; /* NULL: static, splits per pair */
    int static_splits;
    int num_kv_heads, num_q_heads, group, q_len, rows, head_dim, num_pairs;
    int direct; /* pairs of one task were written by the attention kernel */
    uint16_t *out;
    float *lse;
};

/* The partials of a pair: first slot and count, read through the read-only cache
 * (ld.global.nc) before the grid-dependency wait. The plan's arrays are not written during
 * this grid's lifetime: the plan finished before the attention kernel passed its wait and
 * triggered this launch, and the next step's plan waits for this grid to end. Every warp of a
 * row and every row of a pair load the same two words, so the warps of an SM share one L2
 * request; with ld.global.cg each warp sent its own, thousands to a few lines (4,096 warps,
 * 64 pairs on 64x512 8/1), and the step was 0.4-0.8 us slower (docs/perf.md, the ninth stop). */
__device__ __forceinline__ void combine_pair(const CombineParams &p, int pair, int &first,
                                             int &count)
{
    if (p.pair_first) {
        first = __ldg(p.pair_first + pair);
        count = __ldg(p.pair_count + pair);
    } else {
        first = pair * p.static_splits;
        count = p.static_splits;
    }
}

/* Merges `mine` partials of one row, every STEP-th from the one at lse / src, into this lane's
 * (mx, ws, acc) in batches of kBatch: every load of a batch (one LSE per lane, and each lane's
 * V dims of every partial) is issued before any is used, so a batch costs one round trip to L2,
 * and the batches merge online (running max, rescaled sums), so no pass over the LSEs comes
 * first. */
template <int D, int V, int kBatch, int STEP>
__device__ __forceinline__ void combine_batches(const float *lse, const float *src, int R,
                                                int mine, float &mx, float &ws, float (&acc)[V])
{
    const int lane = threadIdx.x & 31;
    for (int j0 = 0; j0 < mine; j0 += kBatch) {
        const int n = min(kBatch, mine - j0);
        const float li = lane < n ? lse[(size_t)STEP * (j0 + lane) * R] : -INFINITY;
        float x[kBatch][V];
#pragma unroll
        for (int j = 0; j < kBatch; j++) {
            const float *at = src + (size_t)(j0 + j) * STEP * R * D;
            if (V == 1) {
                x[j][0] = j < n ? *at : 0.0f;
            } else {
#pragma unroll
                for (int v = 0; v < V; v += 2) {
                    float2 t = j < n ? *reinterpret_cast<const float2 *>(at + v)
                                     : make_float2(0.0f, 0.0f);
                    x[j][v] = t.x;
                    x[j][v + 1] = t.y;
                }
            }
        }
        float bm = li;
#pragma unroll
        for (int o = 16; o; o >>= 1)
            bm = fmaxf(bm, __shfl_xor_sync(0xffffffffu, bm, o));
        const float m_new = fmaxf(mx, bm);
        if (m_new == -INFINITY)
            continue; /* nothing but empty splits so far (warp-uniform) */
        const float alpha = exp2f(mx - m_new); /* 0 while mx is -inf */
        ws *= alpha;
#pragma unroll
        for (int v = 0; v < V; v++)
            acc[v] *= alpha;
        mx = m_new;
        /* an empty split's LSE is -inf and its O was never written: weight 0, not used */
        const float w = li == -INFINITY ? 0.0f : exp2f(li - mx);
        ws += w;
#pragma unroll
        for (int j = 0; j < kBatch; j++) {
            const float wj = __shfl_sync(0xffffffffu, w, j);
            if (j < n && wj > 0.0f) {
#pragma unroll
                for (int v = 0; v < V; v++)
                    acc[v] = fmaf(wj, x[j][v], acc[v]);
            }
        }
    }
}

/* K warps per (pair, row, slice of D / S dims), max(8, K) warps per CTA, grid.y = S slices;
 * K and S chosen by the launcher from the row count (a long request's rows, with hundreds of
 * partials, are spread over K x S warps on S CTAs, with no merge across CTAs: each slice is a
 * separate output). Warp k of a row merges partials k, k + K, ... (combine_batches), then the
 * row's K results are merged through shared memory. A row whose partials fit one batch (every
 * row of a uniform batch, the short rows beside a long request) is merged by its warp 0 alone,
 * straight from its loads: with K >= 8 a CTA is one row, and its other warps leave before the
 * grid-dependency wait, so the CTA has no barrier and frees its warp slots early. Measured on
 * an H200 (docs/perf.md, the eighth stop): on 64x512 8/1 the combine's time after the
 * attention kernel's end fell from 3.1 to 1.6 us, and the step took 1.3-1.6 us less. No
 * block-wide reductions per row, and a CTA's launch serves 8 / K rows. Registers are held to
 * 64 (32 of them the batch's loads), so that four 256-thread or two 512-thread CTAs fit an SM. */
template <int D, int K, int S>
__global__ void __launch_bounds__(K > 8 ? 32 * K : 256, K > 8 ? 2 : 4)
    dec_combine_warp_kernel(const CombineParams p)
{
    static_assert(D / 32 / S >= 1, "a lane takes at least one dim");
    constexpr int V = D / 32 / S, kWarps = K > 8 ? K : 8, kRows = kWarps / K;
    constexpr int kBatch = 32 / V; /* partials per batch: 32 registers of loads */
    __shared__ float s_acc[K > 1 ? kWarps : 1][D / S];
    __shared__ float s_m[kWarps], s_w[kWarps];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, sub = warp % K;
    const int64_t item = (int64_t)blockIdx.x * kRows + warp / K;
    const int R = p.rows, dim0 = blockIdx.y * (D / S) + lane * V;
    int pair = 0, r = 0, first = 0, count = 0;
    /* The pair's slots come from the plan, which finished before the attention kernel got
     * past its own wait, and so before this grid could start: read while the attention
     * kernel still runs, one round trip off the step's critical path. */
    if (item < (int64_t)p.num_pairs * R) {
        pair = (int)(item / R);
        r = (int)(item % R);
        combine_pair(p, pair, first, count);
    }
    /* one warp's row; alone: also the CTA's only work (K >= 8: one row per CTA) */
    const bool solo = K > 1 && count <= kBatch, alone = K >= 8 && solo;
    if (alone && sub != 0)
        return;
    pdl_wait();
    pdl_trigger();
    /* skipped rows still reach the barrier below (K > 1, unless alone) */
    const bool skip = item >= (int64_t)p.num_pairs * R || (p.direct && count == 1);
    const float *lse = p.part_lse + (size_t)first * R + r;
    float mx = -INFINITY, ws = 0.0f; /* ws: this lane's partials' weights, at scale mx */
    float acc[V];
#pragma unroll
    for (int v = 0; v < V; v++)
        acc[v] = 0.0f;
    if (solo) {
        if (!skip && sub == 0)
            combine_batches<D, V, kBatch, 1>(lse, p.part_o + ((size_t)first * R + r) * D + dim0,
                                             R, count, mx, ws, acc);
    } else if (!skip) {
        combine_batches<D, V, kBatch, K>(lse + (size_t)sub * R,
                                         p.part_o + ((size_t)(first + sub) * R + r) * D + dim0,
                                         R, (count - sub + K - 1) / K, mx, ws, acc);
    }
#pragma unroll
    for (int o = 16; o; o >>= 1)
        ws += __shfl_xor_sync(0xffffffffu, ws, o);
    if (K > 1 && !alone) {
        /* the row's K warps: their (max, sum, sums) through shared memory to warp sub 0 */
        if (lane == 0) {
            s_m[warp] = mx;
            s_w[warp] = ws;
        }
#pragma unroll
        for (int v = 0; v < V; v++)
            s_acc[warp][lane * V + v] = acc[v];
        __syncthreads();
        if (sub != 0)
            return;
        float m_all = -INFINITY;
#pragma unroll
        for (int k = 0; k < K; k++)
            m_all = fmaxf(m_all, s_m[warp + k]);
        ws = 0.0f;
#pragma unroll
        for (int v = 0; v < V; v++)
            acc[v] = 0.0f;
#pragma unroll
        for (int k = 0; k < K; k++) {
            float mk = s_m[warp + k];
            float sc = mk == -INFINITY ? 0.0f : exp2f(mk - m_all);
            ws += sc * s_w[warp + k];
#pragma unroll
            for (int v = 0; v < V; v++)
                acc[v] = fmaf(sc, s_acc[warp + k][lane * V + v], acc[v]);
        }
        mx = m_all;
    }
    if (skip)
        return;
    const float inv = ws > 0.0f ? 1.0f / ws : 0.0f;
    const int req = pair / p.num_kv_heads, kvh = pair % p.num_kv_heads;
    const size_t oi = row_index(p, req, kvh, r);
    uint16_t *dst = p.out + oi * D + dim0;
    if (V == 1) {
        dst[0] = tkvk_bf16_from_float_dev(acc[0] * inv);
    } else {
#pragma unroll
        for (int v = 0; v < V; v += 2)
            *reinterpret_cast<uint32_t *>(dst + v) =
                tkvk_bf16x2_from_float2(acc[v] * inv, acc[v + 1] * inv);
    }
    if (p.lse && lane == 0 && blockIdx.y == 0)
        p.lse[oi] = ws > 0.0f ? mx + log2f(ws) : -INFINITY;
}

__global__ void dec_merge_kernel(const uint16_t *o_a, const float *lse_a, const uint16_t *o_b,
                                 const float *lse_b, int num_rows, int head_dim, uint16_t *out,
                                 float *out_lse)
{
    int row = blockIdx.x * (blockDim.x / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (row >= num_rows)
        return;
    float la = lse_a[row], lb = lse_b[row];
    float mx = fmaxf(la, lb);
    float wa = 0.0f, wb = 0.0f, lse = -INFINITY;
    if (mx != -INFINITY) {
        wa = la == -INFINITY ? 0.0f : exp2f(la - mx);
        wb = lb == -INFINITY ? 0.0f : exp2f(lb - mx);
        lse = mx + log2f(wa + wb);
        float inv = 1.0f / (wa + wb);
        wa *= inv;
        wb *= inv;
    }
    __syncwarp();
    for (int d = lane; d < head_dim; d += 32) {
        size_t i = (size_t)row * head_dim + d;
        float x = 0.0f;
        if (wa > 0.0f)
            x += wa * tkvk_bf16_to_float_dev(o_a[i]);
        if (wb > 0.0f)
            x += wb * tkvk_bf16_to_float_dev(o_b[i]);
        out[i] = tkvk_bf16_from_float_dev(x);
    }
    __syncwarp();
    if (lane == 0)
        out_lse[row] = lse;
}

/* ============================================================================================
 * Launch helpers
 * ========================================================================================== */

typedef void (*attend_fn)(const DecParams);

template <int D, bool FP8KV, int NW, bool Q8> attend_fn attend_ptr()
{
    return dec_attend_kernel<D, FP8KV, NW, Q8>;
}
template <int D, bool FP8KV, int NW, bool Q8> size_t attend_smem()
{
    return Attend<D, FP8KV, NW, Q8>::smem_bytes();
}

struct AttendVariant {
    attend_fn fn;
    size_t smem;
    int threads;
};

template <int D, class M, class MH = M> AttendVariant warp_variant()
{
    return AttendVariant{dec_warp_kernel<D, M, MH>, WarpAttend<D, M>::smem_bytes(), 32};
}
template <int D> AttendVariant warp_variant_rows(int rows, int which)
{
    if (rows <= 8)
        return which == TKVK__DEC_WARP_M16 ? warp_variant<D, WarpMathM16<D, 1, true>>()
                                           : warp_variant<D, WarpMathT<D>>();
    if (rows <= 16 || D > 128)
        return warp_variant<D, WarpMathM16<D, 1>>();
    /* 17..32 rows: one warp with two m-tiles, or two warps of one (the plan's choice) */
    return warp_variant<D, WarpMathM16<D, (D > 128 ? 1 : 2)>, WarpMathM16<D, 1>>();
}

/* Set by tkvk__decode_kernel() (benchmarks): TKVK__DEC_* for plans made and steps launched
 * while it is set. */
int g_kernel = TKVK__DEC_AUTO;
/* Set by tkvk__decode_tune() (benchmarks, tests): the combine's shape; 0 the launcher's
 * choice. */
int g_combine = 0;
/* Set by tkvk__decode_cta_warps() (benchmarks): warps per CTA of the warp-worker kernel in
 * plans made from now on (an SM still holds kWarpWorkersPerSm of them); 0 the launcher's
 * choice. */
int g_cta_warps = 0;
/* Eight: measured on an H200 against 9 to 13 (as many as fit for WarpMathT at D = 128, which
 * leaves L1 28 KB), eight was as fast or faster on nearly every benchmark case (docs/perf.md). */
constexpr int kWarpWorkersPerSm = 8;

/* Warp workers of `smem` bytes each that a CTA of `optin` bytes holds, at most `want` and
 * kMaxCtaWarps (at least 1). */
int dec_fit_warps(size_t smem, int optin, int want)
{
    int fit = smem > 0 ? (int)(optin / smem) : 1;
    int w = want < kMaxCtaWarps ? want : kMaxCtaWarps;
    w = w < fit ? w : fit;
    return w < 1 ? 1 : w;
}

/* FP8 Q over FP8 KV with up to 16 rows (32 at D <= 128) runs the warp-worker kernel; every
 * other combination the CTA kernel with 4 warps (8 past 64 rows). */
AttendVariant pick_variant(int head_dim, bool fp8, int rows, bool q8, int which)
{
    if (fp8 && q8 && which != TKVK__DEC_CTA && (rows <= 16 || (rows <= 32 && head_dim <= 128))) {
        if (head_dim == 64)
            return warp_variant_rows<64>(rows, which);
        if (head_dim == 128)
            return warp_variant_rows<128>(rows, which);
        if (head_dim == 256)
            return warp_variant_rows<256>(rows, which);
    }
    bool wide = rows > 64;
#define TKVK_DEC_V(D_, F_, Q_)                                                                   \
    if (head_dim == D_ && fp8 == F_ && q8 == Q_)                                                 \
        return wide ? AttendVariant{attend_ptr<D_, F_, 8, Q_>(), attend_smem<D_, F_, 8, Q_>(), 256} \
                    : AttendVariant{attend_ptr<D_, F_, 4, Q_>(), attend_smem<D_, F_, 4, Q_>(), 128};
    TKVK_DEC_V(64, true, true)
    TKVK_DEC_V(128, true, true)
    TKVK_DEC_V(256, true, true)
    TKVK_DEC_V(64, true, false)
    TKVK_DEC_V(128, true, false)
    TKVK_DEC_V(256, true, false)
    TKVK_DEC_V(64, false, false)
    TKVK_DEC_V(128, false, false)
    TKVK_DEC_V(256, false, false)
#undef TKVK_DEC_V
    return AttendVariant{nullptr, 0, 0};
}

/* Launch with programmatic stream serialisation: the kernel may start while the previous one
 * in the stream drains; it waits with griddepcontrol.wait before reading its inputs. */
template <typename... Args>
cudaError_t launch_pdl(void (*fn)(Args...), dim3 grid, dim3 block, size_t smem,
                       cudaStream_t stream, Args... args)
{
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = grid;
    cfg.blockDim = block;
    cfg.dynamicSmemBytes = smem;
    cfg.stream = stream;
    cudaLaunchAttribute attr[1];
    attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    attr[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = attr;
    cfg.numAttrs = 1;
    return cudaLaunchKernelEx(&cfg, fn, args...);
}

} /* namespace */

/* ============================================================================================
 * The plan handle
 * ========================================================================================== */

struct tkvk_decode_plan {
    int device, num_sms, grid, min_tiles;
    int cta_warps; /* warps per CTA of the warp-worker kernel (1 for the CTA kernel) */
    int may_pair;  /* the plan kernel may give a bin two warps (17..32 rows, dec_warp_kernel) */
    int max_requests, num_kv_heads, max_rows, head_dim;
    int task_cap;
    int4 *tasks;
    int32_t *task_len, *task_slot, *bin_first, *pair_first, *pair_count;
    int32_t *slot_first, *slot_count, *info;
    int32_t *pair_scratch; /* the plan kernel's per-pair values that shared memory cannot hold */
    int2 *worker_span;
    int4 *worker_task0, *worker_aux0;
    float *part_o, *part_lse;
    int planned_requests; /* num_requests of the last plan launch, -1 before the first */
};

/* The shared-memory limits are attributes of this copy of the kernels: a program may hold two
 * copies of the library (e.g. its own and libkvclient's), and a plan made by one may be used
 * by the other, so every launcher makes sure of them once per process for its own copy. */
static int dec_set_smem_limits_now(void);
/* The plan kernel's dynamic shared memory at most (set with the limits) */
static size_t g_plan_smem_max = 0;
static int dec_set_smem_limits(void)
{
    static std::once_flag once;
    static int rc;
    std::call_once(once, [] { rc = dec_set_smem_limits_now(); });
    return rc;
}

/* The most shared memory a CTA may opt in to on the current device. */
static int dec_smem_optin(int *optin)
{
    int dev = 0;
    TKVK_CUDA_TRY(cudaGetDevice(&dev));
    TKVK_CUDA_TRY(cudaDeviceGetAttribute(optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return TKVK_OK;
}

static int dec_set_smem_limits_now(void)
{
    static const int dims[3] = {64, 128, 256};
    static const int row_counts[5] = {8, 16, 32, 64, 128};
    int optin = 0, rc = dec_smem_optin(&optin);
    if (rc)
        return rc;
    cudaFuncAttributes plan_attr;
    TKVK_CUDA_TRY(cudaFuncGetAttributes(&plan_attr, (const void *)dec_plan_kernel<true>));
    g_plan_smem_max = (size_t)optin - plan_attr.sharedSizeBytes;
    TKVK_CUDA_TRY(cudaFuncSetAttribute((const void *)dec_plan_kernel<true>,
                                       cudaFuncAttributeMaxDynamicSharedMemorySize,
                                       (int)g_plan_smem_max));
    for (int which = TKVK__DEC_AUTO; which <= TKVK__DEC_WARP_M16; which++)
        for (int i = 0; i < 3; i++)
            for (int f = 0; f < 2; f++)
                for (int ri = 0; ri < 5; ri++)
                    for (int q8 = 0; q8 <= f; q8++) {
                        AttendVariant v = pick_variant(dims[i], f != 0, row_counts[ri], q8 != 0,
                                                       which);
                        size_t most = v.threads == 32
                                          ? v.smem * dec_fit_warps(v.smem, optin, kMaxCtaWarps)
                                          : v.smem;
                        TKVK_CUDA_TRY(cudaFuncSetAttribute(
                            (const void *)v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)most));
                    }
    return TKVK_OK;
}

extern "C" int tkvk_decode_plan_create(tkvk_decode_plan **out, int max_requests, int num_kv_heads,
                                       int max_rows, int head_dim)
{
    if (!out)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_create: out is NULL");
    *out = NULL;
    if (max_requests < 1 || num_kv_heads < 1 || max_rows < 1)
        return tkvk__fail(TKVK_EINVAL,
                          "decode_plan_create: max_requests %d, num_kv_heads %d, max_rows %d",
                          max_requests, num_kv_heads, max_rows);
    if (max_rows > TKVK_DECODE_MAX_ROWS)
        return tkvk__fail(TKVK_EUNSUPPORTED, "decode_plan_create: max_rows %d > %d", max_rows,
                          TKVK_DECODE_MAX_ROWS);
    if (!tkvk__head_dim_ok(head_dim))
        return tkvk__fail(TKVK_EUNSUPPORTED, "decode_plan_create: head_dim %d", head_dim);
    if ((int64_t)max_requests * num_kv_heads > (1 << 24))
        return tkvk__fail(TKVK_EINVAL, "decode_plan_create: %d x %d pairs is too many",
                          max_requests, num_kv_heads);
    if (!tkvk_cuda_available())
        return tkvk__fail(TKVK_ENODEV, "decode_plan_create: no usable GPU");

    tkvk_decode_plan *pl = (tkvk_decode_plan *)calloc(1, sizeof *pl);
    if (!pl)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_create: out of memory");
    int rc = TKVK_OK, occ = 0;
    size_t pairs = (size_t)max_requests * num_kv_heads;
    AttendVariant v = pick_variant(head_dim, true, max_rows, true, g_kernel);
    cudaError_t e;
#define DEC_TRY(call)                                                                            \
    do {                                                                                         \
        e = (call);                                                                              \
        if (e != cudaSuccess) {                                                                  \
            rc = tkvk__fail(TKVK_ECUDA, "decode_plan_create: %s: %s", #call,                     \
                            cudaGetErrorString(e));                                              \
            goto fail;                                                                           \
        }                                                                                        \
    } while (0)
    DEC_TRY(cudaGetDevice(&pl->device));
    DEC_TRY(cudaDeviceGetAttribute(&pl->num_sms, cudaDevAttrMultiProcessorCount, pl->device));
    rc = dec_set_smem_limits();
    if (rc)
        goto fail;
    pl->cta_warps = 1;
    pl->may_pair = 0;
    if (v.threads == 32) {
        /* the warp-worker kernel: kWarpWorkersPerSm workers an SM in CTAs of cta_warps, held
         * there by a shared-memory carve-out that leaves the rest of the SM's memory to L1 */
        int carve = cudaSharedmemCarveoutDefault, smem_sm = 0, optin = 0;
        if ((rc = dec_smem_optin(&optin)) != TKVK_OK)
            goto fail;
        int per_sm = dec_fit_warps(v.smem, optin, kWarpWorkersPerSm);
        pl->cta_warps = g_cta_warps > 0 && g_cta_warps < per_sm ? g_cta_warps : per_sm;
        occ = per_sm / pl->cta_warps;
        pl->may_pair = max_rows > 16 && g_kernel != TKVK__DEC_WARP_ONE;
        DEC_TRY(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                       pl->device));
        /* each CTA also takes 1 KB of the SM's shared memory for the system */
        size_t smem_need = (size_t)occ * (pl->cta_warps * v.smem + 1024);
        if (smem_sm > 0)
            carve = (int)((smem_need * 100 + smem_sm - 1) / smem_sm);
        DEC_TRY(cudaFuncSetAttribute((const void *)v.fn,
                                     cudaFuncAttributePreferredSharedMemoryCarveout,
                                     carve > 100 ? 100 : carve));
    } else {
        DEC_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v.fn, v.threads, v.smem));
    }
    if (occ < 1)
        occ = 1;
    pl->grid = pl->num_sms * occ * pl->cta_warps;
    pl->min_tiles =
        v.threads == 32 ? tkvk__decode_warp_min_tiles(max_rows) : TKVK_DECODE_CTA_MIN_TILES;
    pl->max_requests = max_requests;
    pl->num_kv_heads = num_kv_heads;
    pl->max_rows = max_rows;
    pl->head_dim = head_dim;
    pl->task_cap = (int)pairs + pl->grid;
    pl->planned_requests = -1;
    DEC_TRY(cudaMalloc((void **)&pl->tasks, (size_t)pl->task_cap * sizeof(int4)));
    DEC_TRY(cudaMalloc((void **)&pl->task_len, (size_t)pl->task_cap * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->task_slot, (size_t)pl->task_cap * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->bin_first, ((size_t)pl->grid + 1) * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->worker_span, (size_t)pl->grid * sizeof(int2)));
    DEC_TRY(cudaMalloc((void **)&pl->worker_task0, (size_t)pl->grid * sizeof(int4)));
    DEC_TRY(cudaMalloc((void **)&pl->worker_aux0, (size_t)pl->grid * sizeof(int4)));
    DEC_TRY(cudaMalloc((void **)&pl->pair_first, pairs * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->pair_count, pairs * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->slot_first, pairs * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->slot_count, pairs * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->pair_scratch, pairs * 4 * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->info, 6 * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->part_o,
                       (size_t)pl->task_cap * max_rows * head_dim * sizeof(float)));
    DEC_TRY(cudaMalloc((void **)&pl->part_lse, (size_t)pl->task_cap * max_rows * sizeof(float)));
#undef DEC_TRY
    *out = pl;
    return TKVK_OK;
fail:
    tkvk_decode_plan_destroy(pl);
    return rc;
}

extern "C" void tkvk_decode_plan_destroy(tkvk_decode_plan *pl)
{
    if (!pl)
        return;
    cudaFree(pl->tasks);
    cudaFree(pl->task_len);
    cudaFree(pl->task_slot);
    cudaFree(pl->bin_first);
    cudaFree(pl->worker_span);
    cudaFree(pl->worker_task0);
    cudaFree(pl->worker_aux0);
    cudaFree(pl->pair_first);
    cudaFree(pl->pair_count);
    cudaFree(pl->slot_first);
    cudaFree(pl->slot_count);
    cudaFree(pl->pair_scratch);
    cudaFree(pl->info);
    cudaFree(pl->part_o);
    cudaFree(pl->part_lse);
    free(pl);
}

extern "C" int tkvk_decode_plan_grid(const tkvk_decode_plan *pl)
{
    return pl ? pl->grid : 0;
}

extern "C" int tkvk_decode_plan_cta_warps(const tkvk_decode_plan *pl)
{
    return pl ? pl->cta_warps : 0;
}

extern "C" int tkvk_decode_plan_min_tiles(const tkvk_decode_plan *pl)
{
    return pl ? pl->min_tiles : 0;
}

extern "C" int tkvk_decode_plan_set_min_tiles(tkvk_decode_plan *pl, int min_tiles_per_cta)
{
    if (!pl || min_tiles_per_cta < 1)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_set_min_tiles: plan NULL or floor %d < 1",
                          min_tiles_per_cta);
    pl->min_tiles = min_tiles_per_cta;
    return TKVK_OK;
}

extern "C" int tkvk_decode_plan_cuda(tkvk_decode_plan *pl, const int32_t *kv_lens,
                                     int num_requests, void *stream)
{
    if (!pl)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_cuda: plan is NULL");
    if (num_requests < 0 || num_requests > pl->max_requests)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_cuda: num_requests %d outside 0..%d",
                          num_requests, pl->max_requests);
    if (num_requests > 0 && !kv_lens)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_cuda: kv_lens is NULL");
    int rc = dec_set_smem_limits();
    if (rc)
        return rc;
    /* the per-pair values in shared memory where they fit (up to ~7K pairs on an H200) */
    size_t smem = (size_t)num_requests * pl->num_kv_heads * kPlanPairInts * sizeof(int32_t);
    bool in_smem = smem <= g_plan_smem_max;
    TKVK_CUDA_TRY(launch_pdl(in_smem ? dec_plan_kernel<true> : dec_plan_kernel<false>, dim3(1),
                             dim3(kPlanThreads), in_smem ? smem : 0, (cudaStream_t)stream,
                             kv_lens, num_requests, pl->num_kv_heads, pl->grid, pl->min_tiles,
                             pl->cta_warps, pl->grid / pl->cta_warps, pl->may_pair, pl->tasks,
                             pl->task_len, pl->task_slot, pl->bin_first, pl->worker_span,
                             pl->worker_task0, pl->worker_aux0, pl->pair_first, pl->pair_count,
                             pl->slot_first, pl->slot_count, pl->info, pl->pair_scratch));
    TKVK_CUDA_TRY(cudaGetLastError());
    pl->planned_requests = num_requests;
    return TKVK_OK;
}

extern "C" int tkvk_decode_plan_download(tkvk_decode_plan *pl, tkvk_decode_map *map, void *stream)
{
    if (!pl || !map || !map->tasks)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_download: plan or map NULL / not initialised");
    int pairs = pl->planned_requests * pl->num_kv_heads;
    if (pl->planned_requests < 0)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_download: nothing planned yet");
    if (map->num_pairs < pairs || map->grid < pl->grid)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_download: map too small (%d pairs, grid %d)",
                          map->num_pairs, map->grid);
    cudaStream_t s = (cudaStream_t)stream;
    int32_t info[6];
    TKVK_CUDA_TRY(cudaMemcpyAsync(info, pl->info, sizeof info, cudaMemcpyDeviceToHost, s));
    TKVK_CUDA_TRY(cudaStreamSynchronize(s));
    if (info[2] > pl->task_cap || info[2] < 0)
        return tkvk__fail(TKVK_ECUDA, "decode_plan_download: device map has %d tasks", info[2]);
    static_assert(sizeof(tkvk_decode_task) == sizeof(int4), "task layout");
    TKVK_CUDA_TRY(cudaMemcpyAsync(map->tasks, pl->tasks, (size_t)info[2] * sizeof(int4),
                                  cudaMemcpyDeviceToHost, s));
    TKVK_CUDA_TRY(cudaMemcpyAsync(map->task_slot, pl->task_slot, (size_t)info[2] * 4,
                                  cudaMemcpyDeviceToHost, s));
    TKVK_CUDA_TRY(cudaMemcpyAsync(map->bin_first, pl->bin_first,
                                  ((size_t)pl->grid + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    if (pairs > 0) {
        TKVK_CUDA_TRY(cudaMemcpyAsync(map->pair_first, pl->pair_first, (size_t)pairs * 4,
                                      cudaMemcpyDeviceToHost, s));
        TKVK_CUDA_TRY(cudaMemcpyAsync(map->pair_count, pl->pair_count, (size_t)pairs * 4,
                                      cudaMemcpyDeviceToHost, s));
        TKVK_CUDA_TRY(cudaMemcpyAsync(map->slot_first, pl->slot_first, (size_t)pairs * 4,
                                      cudaMemcpyDeviceToHost, s));
        TKVK_CUDA_TRY(cudaMemcpyAsync(map->slot_count, pl->slot_count, (size_t)pairs * 4,
                                      cudaMemcpyDeviceToHost, s));
    }
    TKVK_CUDA_TRY(cudaStreamSynchronize(s));
    map->grid = pl->grid;
    map->num_bins = info[0];
    map->num_tiles = info[1];
    map->num_tasks = info[2];
    map->tiles_per_cta = info[3];
    map->num_slots = info[4];
    map->bins_per_cta = info[5];
    return TKVK_OK;
}

/* ============================================================================================
 * Attention entry points
 * ========================================================================================== */

static int dec_fill_params(const tkvk_decode_plan *pl, const tkvk_decode_args *a,
                           const char *who, DecParams *p)
{
    int rc = tkvk__decode_check(a, who);
    if (rc)
        return rc;
    const tkvk_layout *lay = a->layout;
    int group = a->num_q_heads / lay->num_kv_heads;
    int rows = group * a->q_len;
    if (!pl)
        return tkvk__fail(TKVK_EINVAL, "%s: plan is NULL", who);
    if (lay->num_kv_heads != pl->num_kv_heads || lay->head_dim != pl->head_dim ||
        rows > pl->max_rows || a->num_requests > pl->max_requests)
        return tkvk__fail(TKVK_EINVAL,
                          "%s: the plan was made for %d KV heads, head dim %d, %d rows, %d "
                          "requests; got %d, %d, %d, %d",
                          who, pl->num_kv_heads, pl->head_dim, pl->max_rows, pl->max_requests,
                          lay->num_kv_heads, lay->head_dim, rows, a->num_requests);
    memset(p, 0, sizeof *p);
    p->pool_layer = (const uint8_t *)a->pool + (size_t)a->layer * lay->layer_stride;
    p->block_stride = lay->block_stride;
    p->token_stride = lay->token_stride;
    p->v_offset = lay->v_offset;
    p->kscale_offset = lay->kscale_offset;
    p->page_tokens = lay->page_tokens;
    p->page_shift = __builtin_ctz((unsigned)lay->page_tokens);
    p->num_kv_heads = lay->num_kv_heads;
    p->num_blocks = a->num_blocks;
    p->block_table = a->block_table;
    p->bt_stride = a->block_table_stride;
    p->kv_lens = a->kv_lens;
    p->num_requests = a->num_requests;
    p->q = a->q;
    p->q_scales = a->q_scales;
    p->q_fp8 = a->q_dtype == TKVK_DTYPE_FP8_E4M3;
    p->num_q_heads = a->num_q_heads;
    p->group = group;
    p->q_len = a->q_len;
    p->rows = rows;
    p->per_token_head = lay->scale_mode == TKVK_SCALE_PER_TOKEN_HEAD;
    p->k_scale = a->k_scale;
    p->v_scale = a->v_scale;
    p->v_head_scales = a->v_head_scales;
    p->score_scale = a->sm_scale * kLog2e;
    p->part_o = pl->part_o;
    p->part_lse = pl->part_lse;
    p->out = (uint16_t *)a->out;
    p->lse = a->lse;
    return TKVK_OK;
}

template <int D, int S>
static cudaError_t launch_combine_k(const CombineParams &cp, int64_t rows, int k, cudaStream_t s)
{
    const int per_cta = k > 8 ? 1 : 8 / k;
    const dim3 grid((unsigned)((rows + per_cta - 1) / per_cta), S);
    switch (k) {
    case 1: return launch_pdl(dec_combine_warp_kernel<D, 1, S>, grid, dim3(256), 0, s, cp);
    case 2: return launch_pdl(dec_combine_warp_kernel<D, 2, S>, grid, dim3(256), 0, s, cp);
    case 4: return launch_pdl(dec_combine_warp_kernel<D, 4, S>, grid, dim3(256), 0, s, cp);
    case 8: return launch_pdl(dec_combine_warp_kernel<D, 8, S>, grid, dim3(256), 0, s, cp);
    default: return launch_pdl(dec_combine_warp_kernel<D, 16, S>, grid, dim3(512), 0, s, cp);
    }
}

template <int D>
static cudaError_t launch_combine_ks(const CombineParams &cp, int64_t rows, int k, int sl,
                                    cudaStream_t s)
{
    if (sl >= 4 && D >= 128) /* (a lane takes D / 32 / S >= 1 dims) */
        return launch_combine_k<D, D >= 128 ? 4 : 1>(cp, rows, k, s);
    if (sl >= 2)
        return launch_combine_k<D, 2>(cp, rows, k, s);
    return launch_combine_k<D, 1>(cp, rows, k, s);
}

template <int D>
static cudaError_t dec_launch_combine(const CombineParams &cp, int pairs, int num_sms,
                                      cudaStream_t s)
{
    /* K warps per row over S head-dim slices: K x S the largest power of two up to
     * 16 x min(D / 32, 4) whose warps fill half a wave (32 per SM), K up to 16. Measured best
     * or within 0.7 us of the best shape from 64 to 4,096 rows (docs/perf.md): more warps pay
     * for long requests' rows (hundreds of partials), fewer for uniform batches' few. A CTA per
     * row (an earlier choice) spent 9-12 us on launches and block-wide reductions. */
    int64_t rows = (int64_t)pairs * cp.rows;
    int k = g_combine % 100, sl = g_combine / 100;
    if (g_combine == 0) {
        int ks = 16 * (D / 32 < 4 ? D / 32 : 4);
        while (ks > 1 && (int64_t)ks * rows > 32LL * num_sms)
            ks >>= 1;
        k = ks < 16 ? ks : 16;
        sl = ks / k;
    }
    return launch_combine_ks<D>(cp, rows, k, sl ? sl : 1, s);
}

/* kind: how the attention kernel left its partials: by static split, by slot (the
 * warp-worker kernel) or by task (the CTA kernel). */
enum DecParts { kPartsStatic, kPartsBySlot, kPartsByTask };

static int dec_combine(const tkvk_decode_plan *pl, const tkvk_decode_args *a, const DecParams &p,
                       DecParts kind, cudaStream_t s)
{
    const bool is_static = kind == kPartsStatic;
    CombineParams cp;
    cp.part_o = pl->part_o;
    cp.part_lse = pl->part_lse;
    cp.pair_first = is_static ? nullptr : kind == kPartsBySlot ? pl->slot_first : pl->pair_first;
    cp.pair_count = is_static ? nullptr : kind == kPartsBySlot ? pl->slot_count : pl->pair_count;
    cp.static_splits = p.static_splits;
    cp.direct = !is_static && p.direct;
    cp.num_pairs = a->num_requests * p.num_kv_heads;
    cp.num_kv_heads = p.num_kv_heads;
    cp.num_q_heads = p.num_q_heads;
    cp.group = p.group;
    cp.q_len = p.q_len;
    cp.rows = p.rows;
    cp.head_dim = a->layout->head_dim;
    cp.out = (uint16_t *)a->out;
    cp.lse = a->lse;
    int pairs = a->num_requests * p.num_kv_heads;
    switch (cp.head_dim) {
    case 64: TKVK_CUDA_TRY(dec_launch_combine<64>(cp, pairs, pl->num_sms, s)); break;
    case 128: TKVK_CUDA_TRY(dec_launch_combine<128>(cp, pairs, pl->num_sms, s)); break;
    default: TKVK_CUDA_TRY(dec_launch_combine<256>(cp, pairs, pl->num_sms, s)); break;
    }
    TKVK_CUDA_TRY(cudaGetLastError());
    return TKVK_OK;
}

extern "C" int tkvk_decode_attend_cuda(tkvk_decode_plan *pl, const tkvk_decode_args *a,
                                       void *stream)
{
    DecParams p;
    int rc = dec_fill_params(pl, a, "decode_attend_cuda", &p);
    if (rc)
        return rc;
    if (a->num_requests != pl->planned_requests)
        return tkvk__fail(TKVK_EINVAL,
                          "decode_attend_cuda: %d requests, but the last plan was for %d",
                          a->num_requests, pl->planned_requests);
    if (a->num_requests == 0)
        return TKVK_OK;
    p.tasks = pl->tasks;
    p.task_len = pl->task_len;
    p.task_slot = pl->task_slot;
    p.bin_first = pl->bin_first;
    p.worker_span = pl->worker_span;
    p.worker_task0 = pl->worker_task0;
    p.worker_aux0 = pl->worker_aux0;
    cudaStream_t s = (cudaStream_t)stream;
    bool fp8kv = a->layout->kv_dtype == TKVK_DTYPE_FP8_E4M3;
    AttendVariant v = pick_variant(a->layout->head_dim, fp8kv, p.rows, fp8kv && p.q_fp8,
                                   g_kernel);
    if ((rc = dec_set_smem_limits()) != TKVK_OK)
        return rc;
    p.direct = v.threads == 32; /* the warp-worker kernel */
    /* the warp-worker kernel runs the plan's CTAs of cta_warps warps (a bin at most each) */
    const int w = p.direct ? pl->cta_warps : 1;
    TKVK_CUDA_TRY(launch_pdl(v.fn, dim3(pl->grid / w), dim3(v.threads * w), v.smem * w, s, p));
    TKVK_CUDA_TRY(cudaGetLastError());
    return dec_combine(pl, a, p, p.direct ? kPartsBySlot : kPartsByTask, s);
}

extern "C" int tkvk_decode_static_cuda(tkvk_decode_plan *pl, const tkvk_decode_args *a,
                                       int max_kv_len, int num_splits, void *stream)
{
    DecParams p;
    int rc = dec_fill_params(pl, a, "decode_static_cuda", &p);
    if (rc)
        return rc;
    if (max_kv_len < 0 || num_splits < 0)
        return tkvk__fail(TKVK_EINVAL, "decode_static_cuda: max_kv_len %d / num_splits %d < 0",
                          max_kv_len, num_splits);
    if (a->num_requests == 0)
        return TKVK_OK;
    int pairs = a->num_requests * p.num_kv_heads;
    int splits = num_splits ? num_splits
                            : tkvk__decode_static_splits(pairs, max_kv_len, pl->grid);
    if ((int64_t)pairs * splits > pl->task_cap)
        return tkvk__fail(TKVK_EINVAL, "decode_static_cuda: %d pairs x %d splits > workspace %d",
                          pairs, splits, pl->task_cap);
    int max_tiles = tkvk__decode_tiles(max_kv_len);
    p.static_splits = splits;
    p.static_chunk_tiles = max_tiles > 0 ? (max_tiles + splits - 1) / splits : 1;
    cudaStream_t s = (cudaStream_t)stream;
    bool fp8kv = a->layout->kv_dtype == TKVK_DTYPE_FP8_E4M3;
    AttendVariant v = pick_variant(a->layout->head_dim, fp8kv, p.rows, fp8kv && p.q_fp8,
                                   g_kernel);
    if ((rc = dec_set_smem_limits()) != TKVK_OK)
        return rc;
    TKVK_CUDA_TRY(launch_pdl(v.fn, dim3(p.num_kv_heads, a->num_requests, splits),
                             dim3(v.threads), v.smem, s, p));
    TKVK_CUDA_TRY(cudaGetLastError());
    return dec_combine(pl, a, p, kPartsStatic, s);
}

extern "C" void tkvk__decode_kernel(int which)
{
    g_kernel = which;
}

extern "C" void tkvk__decode_tune(int combine)
{
    g_combine = combine;
}

extern "C" void tkvk__decode_cta_warps(int warps)
{
    g_cta_warps = warps;
}

extern "C" int tkvk_merge_states_cuda(const uint16_t *o_a, const float *lse_a,
                                      const uint16_t *o_b, const float *lse_b, int num_rows,
                                      int head_dim, uint16_t *out, float *out_lse, void *stream)
{
    if (num_rows < 0 || head_dim < 1)
        return tkvk__fail(TKVK_EINVAL, "merge_states_cuda: num_rows %d / head_dim %d", num_rows,
                          head_dim);
    if (num_rows == 0)
        return TKVK_OK;
    if (!o_a || !lse_a || !o_b || !lse_b || !out || !out_lse)
        return tkvk__fail(TKVK_EINVAL, "merge_states_cuda: NULL input or output");
    int rows_per_block = 8;
    dec_merge_kernel<<<(num_rows + rows_per_block - 1) / rows_per_block, rows_per_block * 32, 0,
                       (cudaStream_t)stream>>>(o_a, lse_a, o_b, lse_b, num_rows, head_dim, out,
                                               out_lse);
    TKVK_CUDA_TRY(cudaGetLastError());
    return TKVK_OK;
}
