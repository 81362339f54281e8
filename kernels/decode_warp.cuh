/* decode_warp.cuh - the warp-worker kernel of decode attention, the fast path (FP8 Q over FP8
 * KV, up to 32 rows a pair): every warp drains its own bin through a two-stage ring of 32-token
 * chunks; a CTA's warps whose bins share a slot merge their partials at the end. Its arithmetic
 * is a policy: WarpMathT (at most 8 rows, on the mma's N side) or WarpMathM16 (one or two
 * m-tiles). docs/design.md, decode, "Warp-worker kernel". */
#ifndef TKVK_DECODE_WARP_CUH
#define TKVK_DECODE_WARP_CUH

#include "decode_dev.cuh"

namespace tkvk_dec {
namespace {


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
template <int D, class M, bool kStatic = false> struct WarpAttend {
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
        if (kStatic) {
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
            if (kStatic)
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
template <int D, class M, class MH = M, bool kStatic = false>
__global__ void __launch_bounds__(32 * kMaxCtaWarps) dec_warp_kernel(const DecParams p)
{
    extern __shared__ __align__(128) uint8_t dec_smem[];
    using WA = WarpAttend<D, M, kStatic>;
    static_assert(WA::smem_bytes() == WarpAttend<D, MH>::smem_bytes(), "one share per warp");
    pdl_wait();
    pdl_trigger();
    const int W = blockDim.x >> 5, warp = threadIdx.x >> 5;
    uint8_t *smem = dec_smem + warp * WA::smem_bytes();
    WarpHead hd{};
    if (!kStatic) {
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
        h = WarpAttend<D, MH, kStatic>::run(p, smem, hd, rbase);
    if (W > 1)
        merge_held<D>(p, dec_smem, WA::smem_bytes(), h, rbase, hv);
}


template <int D, bool kStatic, class M, class MH = M> AttendVariant warp_variant()
{
    return AttendVariant{dec_warp_kernel<D, M, MH, kStatic>, WarpAttend<D, M>::smem_bytes(), 32};
}
template <int D, bool kStatic> AttendVariant warp_variant_rows(int rows, int which)
{
    if (rows <= 8)
        return which == TKVK__DEC_WARP_M16
                   ? warp_variant<D, kStatic, WarpMathM16<D, 1, true>>()
                   : warp_variant<D, kStatic, WarpMathT<D>>();
    if (rows <= 16 || D > 128)
        return warp_variant<D, kStatic, WarpMathM16<D, 1>>();
    /* 17..32 rows: one warp with two m-tiles, or two warps of one (the plan's choice) */
    return warp_variant<D, kStatic, WarpMathM16<D, (D > 128 ? 1 : 2)>, WarpMathM16<D, 1>>();
}


} /* namespace */

/* The warp-worker kernel for a shape, with or without kStatic; fn NULL outside the set. */
template <bool kStatic> AttendVariant warp_variant_of(int head_dim, int rows, int which)
{
    if (head_dim == 64)
        return warp_variant_rows<64, kStatic>(rows, which);
    if (head_dim == 128)
        return warp_variant_rows<128, kStatic>(rows, which);
    if (head_dim == 256)
        return warp_variant_rows<256, kStatic>(rows, which);
    return AttendVariant{nullptr, 0, 0};
}

} /* namespace tkvk_dec */

#endif
