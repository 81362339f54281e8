/* decode_combine.cu - the combine of decode attention (each row's partials merged with the
 * global softmax into BF16 O and the LSE: K warps a row, the head dim cut in S slices for few
 * rows, one warp alone where the partials fit its batch) and merge states. docs/design.md,
 * decode, "CTA kernel" (the combine). */
#include "decode_dev.cuh"

namespace tkvk_dec {
namespace {



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
static cudaError_t dec_launch_combine_d(const CombineParams &cp, int pairs, int num_sms,
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


} /* namespace */

cudaError_t dec_launch_combine(const CombineParams &cp, int pairs, int num_sms, cudaStream_t s)
{
    switch (cp.head_dim) {
    case 64: return dec_launch_combine_d<64>(cp, pairs, num_sms, s);
    case 128: return dec_launch_combine_d<128>(cp, pairs, num_sms, s);
    default: return dec_launch_combine_d<256>(cp, pairs, num_sms, s);
    }
}

cudaError_t dec_launch_merge(const uint16_t *o_a, const float *lse_a, const uint16_t *o_b,
                             const float *lse_b, int num_rows, int head_dim, uint16_t *out,
                             float *out_lse, cudaStream_t s)
{
    int rows_per_block = 8;
    dec_merge_kernel<<<(num_rows + rows_per_block - 1) / rows_per_block, rows_per_block * 32, 0,
                       s>>>(o_a, lse_a, o_b, lse_b, num_rows, head_dim, out, out_lse);
    return cudaGetLastError();
}

} /* namespace tkvk_dec */
