/* decode_wg.cu - the warpgroup kernel of decode attention: FP8 Q over FP8 KV at head dim 128
 * with 1..64 rows a pair (q_len 2..8 of a GQA group of 8: MTP and speculative verify); the
 * launcher takes it at 17..64 rows, where it was timed faster than the warp-worker kernel
 * (17..32) and the CTA kernel (33..64) (dec_wg_wanted, decode.cu; docs/perf.md), and anywhere
 * it applies when asked for
 * (TKVK__DEC_WG). A CTA is one warpgroup (4 warps) that drains its bin of 64-token tiles
 * through the CTA kernel's cp.async ring (BinTiles: the same loader, the same partials by
 * task; a task's queries copied with its first tile, so its start waits on no load); the
 * products run on wgmma with the query rows on the N side (16, 32, 48 or 64: the rows padded
 * to 16), so no product carries more than 15 padding rows:
 *   scores  S^T = K Q^T: m64nNk16 f16, A = the K tile from registers (converted from e4m3,
 *           exact), B = Q as f16 in shared memory. (The e4m3 wgmma was tried: its accumulation
 *           truncates, which biased the LSE past the test's 2e-3; docs/perf.md.)
 *   P.V     O^T = V^T P^T: m64nNk16 f16, A = V^T from registers (V converted in pairs of
 *           tokens), B = P^T (f16) in shared memory; two m64 blocks for D = 128.
 * The softmax is per column (a query row) of S^T: a column's 64 tokens lie in the 8 lanes of a
 * quad position and the 4 warps, so its tile maximum goes through shared memory (one barrier;
 * the launcher's form skips that, and O's rescaling, on a tile whose scores all stay within 8
 * of the running maximum: P is then taken against the old maximum, at most 2^8, exact enough
 * in f16); the running sum stays per thread until the end of the task.
 * Layouts in shared memory:
 *   K tile  token t = 16a + 2b + h at row 16a + b + 8h, so that the accumulator rows g, g + 8
 *           of a lane are the consecutive tokens 2g, 2g + 1 (its P^T pair is one 32-bit
 *           store); 16-byte chunk j of row r at j ^ (r & 1). The k order of the products is
 *           permuted (a dot product does not care): k16 step s, k-slots 2c, 2c+1, 2c+8, 2c+9
 *           of lane quad position c are dims 32c + 4s .. + 3, so a lane's K is two 16-byte
 *           reads a row and Q is stored in the same order.
 *   Q, P^T  K-major operands of 128-byte rows, 128-byte swizzle, 8-row groups 1024 bytes
 *           apart: Q as two tiles (k 0..63, 64..127) of N rows, P^T one (the tile's 64 tokens).
 *   V       token rows in order, chunk j of row t at j ^ 2 ((t >> 1) & 3), so a lane's 32-bit
 *           reads (4 dims of tokens 2c, 2c+1, 2c+8, 2c+9) hit 32 distinct banks a warp.
 * O^T row 16w + g + 8hh of m64 block b is head dim 4 (8w + g) + 2b + hh: a lane ends with 4
 * consecutive dims of each of its columns (one float4 store). docs/design.md, decode,
 * "Warpgroup kernel". */
#include "decode_cta.cuh"

namespace tkvk_dec {
namespace {

/* d += a * b: m64nNk16, f16 operands (A in registers, B a shared-memory descriptor), f32
 * accumulate, for N = 16, 32, 48, 64. */
__device__ __forceinline__ void wg_f16_rs(float (&d)[8], const uint32_t (&a)[4],
                                          uint64_t db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %13, 0; "
                 "wgmma.mma_async.sync.aligned.m64n16k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7}, {%8,%9,%10,%11}, %12, p, 1, 1, 0; }"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wg_f16_rs(float (&d)[16], const uint32_t (&a)[4],
                                          uint64_t db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %21, 0; "
                 "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15},"
                 "{%16,%17,%18,%19}, %20, p, 1, 1, 0; }"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wg_f16_rs(float (&d)[24], const uint32_t (&a)[4],
                                          uint64_t db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %29, 0; "
                 "wgmma.mma_async.sync.aligned.m64n48k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20"
                 ",%21,%22,%23}, {%24,%25,%26,%27}, %28, p, 1, 1, 0; }"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wg_f16_rs(float (&d)[32], const uint32_t (&a)[4],
                                          uint64_t db)
{
    asm volatile("{ .reg .pred p; setp.ne.b32 p, %37, 0; "
                 "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
                 "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20"
                 ",%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, p,"
                 "1, 1, 0; }"
                 : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]),
                   "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]),
                   "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]),
                   "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
                   "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]),
                   "+f"(d[30]), "+f"(d[31])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}

__device__ __forceinline__ void wg_fence()
{
    asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_commit()
{
    asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
}
__device__ __forceinline__ void wg_wait0()
{
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
/* Keeps the compiler from moving reads or writes of accumulator registers across the
 * asynchronous products (which it cannot see). */
template <int K> __device__ __forceinline__ void reg_fence(float (&d)[K])
{
#pragma unroll
    for (int i = 0; i < K; i++)
        asm volatile("" : "+f"(d[i])::"memory");
}
/* Ordinary shared-memory stores made visible to the tensor cores (Q, P^T). */
__device__ __forceinline__ void fence_async_smem()
{
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
}
__device__ __forceinline__ uint32_t lds32(uint32_t a)
{
    uint32_t v;
    asm volatile("ld.shared.u32 %0, [%1];" : "=r"(v) : "r"(a));
    return v;
}
__device__ __forceinline__ uint4 lds128a(uint32_t a)
{
    uint4 v;
    asm volatile("ld.shared.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "r"(a));
    return v;
}
__device__ __forceinline__ void sts32(uint32_t a, uint32_t v)
{
    asm volatile("st.shared.u32 [%0], %1;" ::"r"(a), "r"(v) : "memory");
}

/* Byte offset of byte `byte` of row r in a 128-byte-swizzled tile (1024-aligned). */
__device__ __forceinline__ uint32_t sw128(int r, int byte)
{
    return (uint32_t)(r * 128 + ((((byte >> 4) ^ r) & 7) << 4) + (byte & 15));
}

/* Descriptor of a K-major operand at shared address addr (a 1024-aligned tile plus the
 * k-step's byte offset inside its 128-byte rows): 128-byte swizzle, 8-row groups 1024 bytes
 * apart (the leading offset is unused with this swizzle). */
__device__ __forceinline__ uint64_t wg_desc(uint32_t addr)
{
    uint64_t d = (uint64_t)((addr & 0x3FFFFu) >> 4);
    d |= (uint64_t)1 << 16;
    d |= (uint64_t)(1024 >> 4) << 32;
    d |= (uint64_t)1 << 62;
    return d;
}

/* N: the rows padded (16..64); kSt: K/V stages (kSt - 1 tiles in flight); kMinB: CTAs an SM
 * the registers are capped for (__launch_bounds__); kDefer: a tile's P.V is awaited only
 * after the next tile's Q.K (more registers live), else at once; kQStage: a task's queries
 * come with its first tile (per-stage staging in shared memory), else they are read at the
 * task's start; kLead >= 0: the running maximum is kept while no score of a tile passes it by
 * more than kLead (base 2: P then up to 2^kLead, exact in f16 and f32), decided by the vote of
 * the barrier that publishes P^T, so such a tile needs neither the maximum's exchange through
 * shared memory and its barrier nor O's rescaling; a tile that passes it, and a task's first,
 * redo the softmax with the exchange. */
template <int N, int kSt, int kMinB, bool kDefer, bool kQStage = true, int kLead = -1>
struct WgAttend {
    static constexpr int D = 128;
    using L = Attend<D, true, 4, true>; /* the CTA kernel: its loader (fetch_blocks, issue_tile) */
    using S = Shape<D, true>;
    static constexpr int kStages = kSt;
    static constexpr int kTile = S::kTileBytes; /* 64 tokens x 128 bytes */
    static constexpr int kNR = N / 2;           /* accumulator floats of one m64 block */
    static constexpr int kNC = N / 4;           /* columns (query rows) a thread holds */
    static constexpr int kQTile = N * 128;      /* one of Q's two f16 tiles */
    static constexpr int kOffK = 0, kOffV = kStages * kTile, kOffQ = 2 * kStages * kTile;
    static constexpr int kOffP = kOffQ + 2 * kQTile, kOffKs = kOffP + N * 128;
    /* per stage, the e4m3 Q rows and q scales of the task whose first tile the stage holds
     * (copied with the tile, so a task's start waits on no load of its own) */
    static constexpr int kOffQ8 = kOffKs + kStages * kTileTokens * 4;
    static constexpr int kOffQsc = kOffQ8 + (kQStage ? kStages * N * D : 0);
    static constexpr int kOffMax = kOffQsc + (kQStage ? kStages * N * 4 : 0);
    static constexpr int kOffL = kOffMax + 4 * N * 4, kOffMul = kOffL + 4 * N * 4;
    static constexpr int kOffLim = kOffMul + N * 4, kEnd = kOffLim + N * 4;
    static constexpr bool kLazy = kLead >= 0;
    static_assert(L::kThreads == 128 && L::kRowsPerThread == 4, "one warpgroup, 4 rows a thread");
    static_assert(kStages >= 2 && kStages <= 4, "2..4 stages");
    static_assert(kOffQ % 1024 == 0 && kQTile % 1024 == 0 && kOffP % 1024 == 0,
                  "operand tiles 1024-aligned");

    /* + 1024: the base is aligned up to 1024 bytes at run time */
    static constexpr size_t smem_bytes() { return (size_t)kEnd + 1024; }

    /* cp.async of task (req, kvh)'s e4m3 Q rows and q scales into a stage's staging (rows past
     * R: zeros) */
    static __device__ __forceinline__ void issue_q(const DecParams &p, uint32_t sQ8, float *sQsc,
                                                   int req, int kvh)
    {
        const int R = p.rows;
        const uint8_t *qb = static_cast<const uint8_t *>(p.q);
        for (int idx = threadIdx.x; idx < N * (D / 16); idx += 128) {
            const int n = idx / (D / 16), j = idx % (D / 16);
            const bool ok = n < R;
            const uint8_t *src = ok ? qb + row_index(p, req, kvh, n) * D + 16 * j : qb;
            asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(sQ8 + idx * 16),
                         "l"(src), "r"(ok ? 16 : 0)
                         : "memory");
        }
        for (int n = threadIdx.x; n < N; n += 128) {
            const bool ok = n < R;
            cp_async4(sQsc + n, ok ? p.q_scales + row_index(p, req, kvh, n) : p.q_scales,
                      ok ? 4 : 0);
        }
    }

    static __device__ void run(const DecParams &p, uint8_t *raw)
    {
        __shared__ int4 s_tasks[kTaskWindow];
        __shared__ int32_t s_lens[kTaskWindow];
        const uint32_t raw_u = smem_u32(raw), base = (raw_u + 1023u) & ~1023u;
        uint8_t *sm = raw + (base - raw_u);
        const uint32_t sK = base + kOffK, sV = base + kOffV, sQ = base + kOffQ, sP = base + kOffP;
        const uint32_t sQ8 = base + kOffQ8;
        float *sKs = reinterpret_cast<float *>(sm + kOffKs);
        float *sQsc = reinterpret_cast<float *>(sm + kOffQsc);
        float *sMax = reinterpret_cast<float *>(sm + kOffMax);
        float *sL = reinterpret_cast<float *>(sm + kOffL);
        float *sMul = reinterpret_cast<float *>(sm + kOffMul);
        int *sLim = reinterpret_cast<int *>(sm + kOffLim);

        const int tid = threadIdx.x, lane = tid & 31, w = tid >> 5, g = lane >> 2, c = lane & 3;
        const int R = p.rows;
        const int q4 = 8 * w + g; /* this thread's head dims of O are 4 q4 .. 4 q4 + 3 */

        const int first_task = p.bin_first[blockIdx.x];
        const int num_tasks = p.bin_first[blockIdx.x + 1] - first_task;
        for (int k = tid; k < num_tasks && k < kTaskWindow; k += 128) {
            s_tasks[k] = p.tasks[first_task + k];
            s_lens[k] = p.task_len[first_task + k];
        }
        __syncthreads();
        BinTiles<L> bt(p, s_tasks, s_lens, first_task, num_tasks);
        const int n_tiles = bt.n_tiles;

        /* loader: the CTA kernel's, with this kernel's destinations; a task's first tile
         * brings its queries along */
        uint32_t dst_k[4], dst_v[4];
#pragma unroll
        for (int k = 0; k < 4; k++) {
            const int t = tid / 8 + 16 * k, j = tid % 8;
            const int sr = (t & ~15) + ((t & 15) >> 1) + 8 * (t & 1);
            dst_k[k] = (uint32_t)(sr * 128 + ((j ^ (sr & 1)) << 4));
            dst_v[k] = (uint32_t)(t * 128 + ((j ^ (2 * ((t >> 1) & 3))) << 4));
        }
        auto load_next = [&](int stage) {
            if (kQStage && bt.ld.tile == bt.ld.tk.z)
                issue_q(p, sQ8 + stage * N * D, sQsc + stage * N, bt.ld.tk.x, bt.ld.tk.y);
            bt.issue(sK + stage * kTile, sV + stage * kTile, sKs + stage * kTileTokens, dst_k,
                     dst_v);
        };
#pragma unroll
        for (int s = 0; s < kStages - 1; s++) {
            if (s < n_tiles)
                load_next(s);
            cp_async_commit();
        }

        float o[2][kNR];
        float m_run[kNC], l_run[kNC];
        int lim_min = 0;
        float v_mul = 1.0f;

        for (int i = 0; i < n_tiles; i++) {
            cp_async_wait<kStages - 2>();
            __syncthreads();
            if (i + kStages - 1 < n_tiles)
                load_next((i + kStages - 1) % kStages);
            cp_async_commit();
            const int st = i % kStages;
            const int cc_tile = bt.cc.tile;

            if (cc_tile == bt.cc.tk.z) {
                /* ---- start of a task: Q (f16, k order permuted) and the columns' score
                 * multipliers and causal limits into shared memory, state reset ---- */
                const int kvh = bt.cc.tk.y;
                const int32_t len = bt.cc.len;
                const uint32_t q8 = sQ8 + st * N * D;
                const uint8_t *qb = static_cast<const uint8_t *>(p.q);
                for (int idx = tid; idx < N * 32; idx += 128) {
                    /* word m (dims 4m..4m+3) of row n: step s = m & 7 of quad position
                     * c' = m >> 3, k-slots 2c', 2c'+1 (lo) and 2c'+8, 2c'+9 (hi) */
                    const int n = idx >> 5, m = idx & 31, s = m & 7, cq = m >> 3;
                    uint32_t wv = 0u, lo, hi;
                    if (kQStage)
                        wv = lds32(q8 + idx * 4);
                    else if (n < R)
                        wv = *reinterpret_cast<const uint32_t *>(
                            qb + row_index(p, bt.cc.tk.x, kvh, n) * D + 4 * m);
                    e4m3x4_to_f16x2(wv, lo, hi);
                    const uint32_t t = sQ + (s >> 2) * kQTile;
                    sts32(t + sw128(n, 32 * (s & 3) + 4 * cq), lo);
                    sts32(t + sw128(n, 32 * (s & 3) + 4 * cq + 16), hi);
                }
                const float kmul = p.per_token_head ? 1.0f : p.k_scale;
                for (int n = tid; n < N; n += 128) {
                    const bool valid = n < R;
                    sLim[n] = valid ? len - p.q_len + n / p.group + 1 : 0x7fffffff;
                    const float qs = !valid  ? 0.0f
                                     : kQStage ? sQsc[st * N + n]
                                               : p.q_scales[row_index(p, bt.cc.tk.x, kvh, n)];
                    sMul[n] = p.score_scale * qs * kmul;
                }
                v_mul = p.per_token_head ? p.v_head_scales[kvh] : p.v_scale;
                /* the smallest limit of the pair's rows: its last row's is the largest */
                lim_min = len - p.q_len + 1;
#pragma unroll
                for (int k = 0; k < kNC; k++) {
                    m_run[k] = -INFINITY;
                    l_run[k] = 0.0f;
                }
                fence_async_smem();
                __syncthreads();
            }

            /* ---- K fragments: smem rows 16w + g (+ 8), dims 32c .. 32c + 31 ---- */
            uint4 kw[2][2];
            {
                const uint32_t kst = sK + st * kTile;
#pragma unroll
                for (int h = 0; h < 2; h++) {
                    const int sr = 16 * w + g + 8 * h;
#pragma unroll
                    for (int x = 0; x < 2; x++)
                        kw[h][x] = lds128a(kst + sr * 128 + (((2 * c + x) ^ (sr & 1)) << 4));
                }
            }
            /* ---- S^T = K Q^T on the tensor cores ---- */
            float sc[kNR];
#pragma unroll
            for (int e = 0; e < kNR; e++)
                sc[e] = 0.0f;
            /* all of the A fragments first: a register written between two products would
             * make the compiler fence every product */
            uint32_t ka[D / 16][4];
#pragma unroll
            for (int s = 0; s < D / 16; s++) {
                const int x = s >> 2, u = s & 3;
                const uint4 k0 = kw[0][x], k1 = kw[1][x];
                const uint32_t w0 = u == 0 ? k0.x : u == 1 ? k0.y : u == 2 ? k0.z : k0.w;
                const uint32_t w1 = u == 0 ? k1.x : u == 1 ? k1.y : u == 2 ? k1.z : k1.w;
                e4m3x4_to_f16x2(w0, ka[s][0], ka[s][2]);
                e4m3x4_to_f16x2(w1, ka[s][1], ka[s][3]);
            }
            wg_fence();
#pragma unroll
            for (int s = 0; s < D / 16; s++)
                wg_f16_rs(sc, ka[s], wg_desc(sQ + (s >> 2) * kQTile + 32 * (s & 3)));
            wg_commit();

            /* V^T fragments while the products run: tokens 16 ks + 2c, +1, +8, +9, dims 4 q4.. */
            uint32_t va[2][4][4];
            const uint32_t vst = sV + st * kTile + (uint32_t)((q4 & 3) << 2);
#pragma unroll
            for (int ks = 0; ks < 4; ks++) {
                uint32_t x[4];
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    const int t = 16 * ks + 2 * c + (u & 1) + 8 * (u >> 1);
                    x[u] = lds32(vst + t * 128 + ((((q4 >> 2) ^ (2 * ((t >> 1) & 3)))) << 4));
                }
                uint32_t bb[4][2];
                e4m3_token_pairs(x[0], x[1], x[2], x[3], bb);
#pragma unroll
                for (int b = 0; b < 2; b++) {
                    va[b][ks][0] = bb[2 * b][0];
                    va[b][ks][1] = bb[2 * b + 1][0];
                    va[b][ks][2] = bb[2 * b][1];
                    va[b][ks][3] = bb[2 * b + 1][1];
                }
            }
            wg_wait0(); /* Q.K, and the previous tile's P.V */
            reg_fence(sc);
            reg_fence(o[0]);
            reg_fence(o[1]);
            if (cc_tile == bt.cc.tk.z) {
                /* a task's O is reset only here, after the wait: written while products are
                 * in flight, the compiler would serialise every product */
#pragma unroll
                for (int b = 0; b < 2; b++)
#pragma unroll
                    for (int e = 0; e < kNR; e++)
                        o[b][e] = 0.0f;
            }

            /* ---- scale, mask, online softmax (base 2) per column ---- */
            const int tok0 = 16 * w + 2 * g; /* accumulator rows g, g + 8: tokens tok0, tok0 + 1 */
            const int pos0 = cc_tile * kTileTokens + tok0;
            float ks0 = 1.0f, ks1 = 1.0f;
            if (p.per_token_head) {
                ks0 = sKs[st * kTileTokens + tok0];
                ks1 = sKs[st * kTileTokens + tok0 + 1];
            }
            const bool need_mask = cc_tile * kTileTokens + kTileTokens > lim_min;
            float mx[kNC];
#pragma unroll
            for (int k = 0; k < kNC; k++) {
                const int n = 8 * (k >> 1) + 2 * c + (k & 1);
                const int i0 = 4 * (k >> 1) + (k & 1), i1 = i0 + 2;
                const float mul = sMul[n];
                float v0 = sc[i0] * mul * ks0, v1 = sc[i1] * mul * ks1;
                if (need_mask) {
                    const int lim = sLim[n];
                    v0 = pos0 < lim ? v0 : -INFINITY;
                    v1 = pos0 + 1 < lim ? v1 : -INFINITY;
                }
                sc[i0] = v0;
                sc[i1] = v1;
                mx[k] = fmaxf(v0, v1);
            }
            bool exact = true;
            if (kLazy) {
                /* P against the running maximum; kept unless a score passes it by more than
                 * kLead (or the task starts here), by the vote of P^T's barrier */
                bool over = cc_tile == bt.cc.tk.z;
                float pl[kNC][2];
#pragma unroll
                for (int k = 0; k < kNC; k++) {
                    const int n = 8 * (k >> 1) + 2 * c + (k & 1);
                    const int i0 = 4 * (k >> 1) + (k & 1), i1 = i0 + 2;
                    const float m_ref = m_run[k] == -INFINITY ? 0.0f : m_run[k];
                    over |= mx[k] > m_ref + (float)kLead;
                    pl[k][0] = fast_exp2(sc[i0] - m_ref);
                    pl[k][1] = fast_exp2(sc[i1] - m_ref);
                    sts32(sP + sw128(n, 2 * tok0), pack2<true>(pl[k][0], pl[k][1]));
                }
                fence_async_smem();
                exact = __syncthreads_or(over);
                if (!exact) {
#pragma unroll
                    for (int k = 0; k < kNC; k++)
                        l_run[k] += pl[k][0] + pl[k][1];
                }
            }
            if (exact) {
#pragma unroll
            for (int k = 0; k < kNC; k++) {
#pragma unroll
                for (int off = 4; off < 32; off <<= 1)
                    mx[k] = fmaxf(mx[k], __shfl_xor_sync(0xffffffffu, mx[k], off));
            }
            if (g == 0) {
#pragma unroll
                for (int k = 0; k < kNC; k++)
                    sMax[w * N + 8 * (k >> 1) + 2 * c + (k & 1)] = mx[k];
            }
            __syncthreads();
            float alpha[kNC];
#pragma unroll
            for (int k = 0; k < kNC; k++) {
                const int n = 8 * (k >> 1) + 2 * c + (k & 1);
                const float m = fmaxf(fmaxf(sMax[n], sMax[N + n]),
                                      fmaxf(sMax[2 * N + n], sMax[3 * N + n]));
                const float m_new = fmaxf(m_run[k], m);
                const float m_use = m_new == -INFINITY ? 0.0f : m_new;
                alpha[k] = fast_exp2(m_run[k] - m_use);
                m_run[k] = m_new;
                const int i0 = 4 * (k >> 1) + (k & 1), i1 = i0 + 2;
                const float p0 = fast_exp2(sc[i0] - m_use), p1 = fast_exp2(sc[i1] - m_use);
                l_run[k] = l_run[k] * alpha[k] + (p0 + p1);
                /* P^T row n, tokens tok0, tok0 + 1: bytes 2 tok0 .. + 3 */
                sts32(sP + sw128(n, 2 * tok0), pack2<true>(p0, p1));
            }
#pragma unroll
            for (int b = 0; b < 2; b++)
#pragma unroll
                for (int e = 0; e < kNR; e++)
                    o[b][e] *= alpha[2 * (e >> 2) + (e & 1)];
            fence_async_smem();
            __syncthreads();
            }

            /* ---- O^T += V^T P^T on the tensor cores ---- */
            wg_fence();
#pragma unroll
            for (int b = 0; b < 2; b++)
#pragma unroll
                for (int ks = 0; ks < 4; ks++)
                    wg_f16_rs(o[b], va[b][ks], wg_desc(sP + 32 * ks));
            wg_commit();
            /* kDefer: not awaited here: these products run on while the next tile is set up
             * (its barrier, copies, K and V fragments, Q.K), and the wait after Q.K covers
             * them, before the softmax scales O and overwrites P^T; a task's end awaits them */
            if (!kDefer) {
                wg_wait0();
                reg_fence(o[0]);
                reg_fence(o[1]);
            }

            if (cc_tile + 1 == bt.cc.tk.w) {
                /* ---- end of a task: the columns' sums over all threads, the partial ---- */
                wg_wait0();
                reg_fence(o[0]);
                reg_fence(o[1]);
                const int pidx = first_task + bt.cc.task;
#pragma unroll
                for (int k = 0; k < kNC; k++) {
                    float l = l_run[k];
#pragma unroll
                    for (int off = 4; off < 32; off <<= 1)
                        l += __shfl_xor_sync(0xffffffffu, l, off);
                    l_run[k] = l;
                }
                if (g == 0) {
#pragma unroll
                    for (int k = 0; k < kNC; k++)
                        sL[w * N + 8 * (k >> 1) + 2 * c + (k & 1)] = l_run[k];
                }
                __syncthreads();
#pragma unroll
                for (int k = 0; k < kNC; k++) {
                    const int n = 8 * (k >> 1) + 2 * c + (k & 1);
                    if (n >= R)
                        continue;
                    const float lt = (sL[n] + sL[N + n]) + (sL[2 * N + n] + sL[3 * N + n]);
                    const float inv = lt > 0.0f ? v_mul / lt : 0.0f;
                    const int i0 = 4 * (k >> 1) + (k & 1);
                    *reinterpret_cast<float4 *>(p.part_o + ((size_t)pidx * R + n) * D + 4 * q4) =
                        make_float4(o[0][i0] * inv, o[0][i0 + 2] * inv, o[1][i0] * inv,
                                    o[1][i0 + 2] * inv);
                    if (w == 0 && g == 0)
                        p.part_lse[(size_t)pidx * R + n] =
                            lt > 0.0f ? m_run[k] + log2f(lt) : -INFINITY;
                }
            }
            bt.step(bt.cc);
        }
        wg_wait0();
        cp_async_wait<0>();
    }
};

template <int N, int kSt, int kMinB, bool kDefer, bool kQStage, int kLead>
__global__ void __launch_bounds__(128, kMinB) dec_wg_kernel(const DecParams p)
{
    extern __shared__ __align__(128) uint8_t dec_smem[];
    pdl_wait();
    pdl_trigger();
    WgAttend<N, kSt, kMinB, kDefer, kQStage, kLead>::run(p, dec_smem);
}

template <int N, int kSt, int kMinB, bool kDefer, bool kQStage = true, int kLead = -1>
AttendVariant wg_variant()
{
    using W = WgAttend<N, kSt, kMinB, kDefer, kQStage, kLead>;
    return AttendVariant{dec_wg_kernel<N, kSt, kMinB, kDefer, kQStage, kLead>, W::smem_bytes(),
                         128};
}

/* The kernel's forms (dec_wg_form_valid): stages 2..4 with P.V deferred, + 10 with P.V
 * awaited at once (2 and 3 stages); 22: 2 stages, P.V at once, no query staging, 4 CTAs an SM
 * up to N 32; 32: form 12 with the running maximum kept within 8 (kLead), the launcher's; 34:
 * within 0 (every tile whose maximum rises redoes its softmax, so the tests run both paths).
 * The CTAs an SM the registers are capped for, where the shared memory holds them: 4 stages 2
 * CTAs; 3 stages 3 at N 16, else 2; 2 stages 4 at N 16, 3 at N 32, else 2. */
template <int N> AttendVariant wg_variant_form(int form)
{
    constexpr int kMin3 = N <= 16 ? 3 : 2, kMin2 = N <= 16 ? 4 : N <= 32 ? 3 : 2;
    switch (form) {
    case 2:
        return wg_variant<N, 2, kMin2, true>();
    case 3:
        return wg_variant<N, 3, kMin3, true>();
    case 12:
        return wg_variant<N, 2, kMin2, false>();
    case 13:
        return wg_variant<N, 3, kMin3, false>();
    case 22:
        return wg_variant<N, 2, (N <= 32 ? 4 : 2), false, false>();
    case 32:
        return wg_variant<N, 2, kMin2, false, true, 8>();
    case 34:
        return wg_variant<N, 2, kMin2, false, true, 0>();
    default:
        return wg_variant<N, 4, 1, true>();
    }
}

AttendVariant wg_variant_rows(int rows, int form)
{
    if (rows <= 16)
        return wg_variant_form<16>(form);
    if (rows <= 32)
        return wg_variant_form<32>(form);
    if (rows <= 48)
        return wg_variant_form<48>(form);
    if (rows <= 64)
        return wg_variant_form<64>(form);
    return AttendVariant{nullptr, 0, 0};
}

const int kForms[8] = {2, 3, 4, 12, 13, 22, 32, 34};

} /* namespace */

bool dec_wg_form_valid(int form)
{
    for (int f : kForms)
        if (f == form)
            return true;
    return false;
}

/* Set by tkvk__decode_wg_form() (benchmarks, tests): the warpgroup kernel's form in plans
 * made and steps launched from now on; 0 the launcher's choice (dec_wg_default_form). */
int g_wg_form = 0;

AttendVariant dec_wg_variant(int head_dim, int rows)
{
    if (head_dim != 128 || rows < 1)
        return AttendVariant{nullptr, 0, 0};
    return wg_variant_rows(rows, g_wg_form ? g_wg_form : dec_wg_default_form(rows));
}

cudaError_t dec_wg_set_smem(void)
{
    for (int form : kForms)
        for (int rows = 16; rows <= 64; rows += 16) {
            AttendVariant v = wg_variant_rows(rows, form);
            cudaError_t e = cudaFuncSetAttribute(
                (const void *)v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)v.smem);
            if (e != cudaSuccess)
                return e;
        }
    return cudaSuccess;
}

} /* namespace tkvk_dec */

extern "C" void tkvk__decode_wg_form(int form)
{
    tkvk_dec::g_wg_form = tkvk_dec::dec_wg_form_valid(form) ? form : 0;
}
