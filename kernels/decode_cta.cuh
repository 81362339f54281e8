/* decode_cta.cuh - the CTA kernel of decode attention: a CTA streams its bin of 64-token tiles
 * (or one static split) through a cp.async pipeline, its warps taking m-tiles of the rows or
 * splitting a tile's tokens. Every shape the warp-worker kernel does not take: BF16 Q or KV,
 * more than 32 rows. docs/design.md, decode, "CTA kernel". */
#ifndef TKVK_DECODE_CTA_CUH
#define TKVK_DECODE_CTA_CUH

#include "decode_dev.cuh"

namespace tkvk_dec {
namespace {


/* A CTA's bin as one stream of tiles, shared by the CTA kernel and the warpgroup kernel: its
 * tasks (the first kTaskWindow of them in shared memory, with their request's length), and
 * two cursors over them, the loader's (`ld`, with the block ids of its tile already requested)
 * and the consumer's (`cc`). L: the loader (Attend's fetch_blocks and issue_tile). */
template <class L> struct BinTiles {
    struct Cursor {
        int task, tile; /* task index in the bin; tile index in the request */
        int4 tk;        /* the task: request, KV head, tiles [z, w) */
        int32_t len;    /* the request's length */
    };
    const DecParams &p;
    const int4 *s_tasks;
    const int32_t *s_lens;
    int first, num, n_tiles;
    Cursor ld, cc;
    int32_t ld_blk[L::kRowsPerThread];

    /* s_tasks/s_lens: shared memory holding the first kTaskWindow tasks (filled by the
     * caller, a barrier before) of the num tasks from index `first` of the map */
    __device__ BinTiles(const DecParams &p_, const int4 *st, const int32_t *sl, int first_, int num_)
        : p(p_), s_tasks(st), s_lens(sl), first(first_), num(num_), n_tiles(0)
    {
        for (int k = 0; k < num; k++) {
            const int4 t = task(k);
            n_tiles += t.w - t.z;
        }
        ld.task = cc.task = 0;
        ld.tk = cc.tk = n_tiles > 0 ? task(0) : make_int4(0, 0, 0, 0);
        ld.tile = cc.tile = ld.tk.z;
        ld.len = cc.len = n_tiles > 0 ? task_len(0) : 0;
        if (n_tiles > 0)
            L::fetch_blocks(p, ld.tk.x, ld.tile, ld.len, ld_blk);
    }
    __device__ int4 task(int k) const { return k < kTaskWindow ? s_tasks[k] : p.tasks[first + k]; }
    __device__ int32_t task_len(int k) const
    {
        return k < kTaskWindow ? s_lens[k] : p.task_len[first + k];
    }
    /* the loader's tile into one stage (dst_k/dst_v: this thread's offsets in a stage), then
     * the loader moves on and requests the next tile's block ids */
    __device__ void issue(uint32_t sK, uint32_t sV, float *sKs,
                          const uint32_t (&dst_k)[L::kRowsPerThread],
                          const uint32_t (&dst_v)[L::kRowsPerThread])
    {
        L::issue_tile(p, sK, sV, sKs, ld.tk.x, ld.tk.y, ld.tile, ld.len, ld_blk, dst_k, dst_v);
        if (!step(ld))
            return;
        L::fetch_blocks(p, ld.tk.x, ld.tile, ld.len, ld_blk);
    }
    /* the cursor's next tile; false past the bin's last */
    __device__ bool step(Cursor &c) const
    {
        if (++c.tile < c.tk.w)
            return true;
        if (++c.task >= num)
            return false;
        c.tk = task(c.task);
        c.tile = c.tk.z;
        c.len = task_len(c.task);
        return true;
    }
};

/* Q8: FP8 Q over FP8 KV, whose Q.K products run as e4m3 mma (m16n8k32) straight from the
 * cached bytes; the other combinations convert K to f16/bf16 in registers. */
template <int D, bool FP8KV, int NW, bool Q8 = false, bool kStatic = false> struct Attend {
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
        if (kStatic) {
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
        BinTiles<Attend> bt(p, s_tasks, s_lens, first_task, num_tasks);
        const int n_tiles = bt.n_tiles;

        uint32_t dst_k[kRowsPerThread], dst_v[kRowsPerThread];
#pragma unroll
        for (int k = 0; k < kRowsPerThread; k++) {
            int row = threadIdx.x / S::kChunks + k * kRowStep, j = threadIdx.x % S::kChunks;
            dst_k[k] = row * S::kRowBytes + ((j ^ swz_k<S::kChunks>(row)) * 16);
            dst_v[k] = row * S::kRowBytes + ((j ^ swz_v<S::kChunks>(row)) * 16);
        }
        const uint32_t sK_base = smem_u32(sK), sV_base = smem_u32(sV);
        auto load_next = [&](int stage) {
            bt.issue(sK_base + stage * S::kTileBytes, sV_base + stage * S::kTileBytes,
                     sKs + stage * kTileTokens, dst_k, dst_v);
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

        for (int i = 0; i < n_tiles; i++) {
            cp_async_wait<S::kStages - 2>();
            __syncthreads();
            if (i + S::kStages - 1 < n_tiles)
                load_next((i + S::kStages - 1) % S::kStages);
            cp_async_commit();

            const int cc_tile = bt.cc.tile;
            const int32_t len = bt.cc.len;
            if (cc_tile == bt.cc.tk.z) {
                /* ---- start of a task: queries into registers, state reset ---- */
                const int req = bt.cc.tk.x, kvh = bt.cc.tk.y;
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

            if (cc_tile + 1 == bt.cc.tk.w) {
                /* ---- end of a task: merge the warps' states, write the partial ---- */
                int pidx = kStatic ? static_index : first_task + bt.cc.task;
                finalize(p, pidx, R, rg, ts, ts_count, active, g, c, v_mul, m_run, l_run, o, sO,
                         sM, sL);
            }
            bt.step(bt.cc);
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

/* kStatic: the fixed-grid baseline's instantiation (dev/decode/decode_static.cu), one static
 * split a CTA; the library's kernels are instantiated without it. */
template <int D, bool FP8KV, int NW, bool Q8, bool kStatic = false>
__global__ void __launch_bounds__(NW * 32, NW == 4 ? 2 : 1) dec_attend_kernel(const DecParams p)
{
    extern __shared__ __align__(128) uint8_t dec_smem[];
    pdl_wait();
    pdl_trigger();
    Attend<D, FP8KV, NW, Q8, kStatic>::run(p, dec_smem);
}


template <int D, bool FP8KV, int NW, bool Q8, bool kStatic = false> attend_fn attend_ptr()
{
    return dec_attend_kernel<D, FP8KV, NW, Q8, kStatic>;
}
template <int D, bool FP8KV, int NW, bool Q8> size_t attend_smem()
{
    return Attend<D, FP8KV, NW, Q8>::smem_bytes();
}


} /* namespace */

/* The CTA kernel for a shape, with or without kStatic (NW 8 past 64 rows, else 4). */
template <bool kStatic> AttendVariant cta_variant(int head_dim, bool fp8, bool q8, bool wide)
{
#define TKVK_DEC_V(D_, F_, Q_)                                                                   \
    if (head_dim == D_ && fp8 == F_ && q8 == Q_)                                                 \
        return wide ? AttendVariant{attend_ptr<D_, F_, 8, Q_, kStatic>(),                         \
                                    attend_smem<D_, F_, 8, Q_>(), 256}                           \
                    : AttendVariant{attend_ptr<D_, F_, 4, Q_, kStatic>(),                         \
                                    attend_smem<D_, F_, 4, Q_>(), 128};
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

} /* namespace tkvk_dec */

#endif
