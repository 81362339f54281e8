/* decode.cu - decode attention over the paged pool on sm_90a: the entry points (kernel choice,
 * shared-memory limits, launches of attention and combine, the static split-KV baseline, merge
 * states). The kernels are in decode_plan.cu, decode_cta.cu, decode_warp.cu and
 * decode_combine.cu (decode_dev.cuh lists them); the CPU references are in decode.c; the
 * contracts in tkv_kernels.h.
 *
 * How one step runs (all on the device, so plan + attention + combine replay in a CUDA graph
 * with new KV lengths):
 *   plan     one CTA reads kv_lens, cuts every (request, KV head) into 64-token tiles, lays
 *            all tiles end to end, cuts that sequence into bins of max(ceil(tiles/grid), floor)
 *            tiles, and writes one task per (pair, bin) intersection.
 *   attend   a persistent grid of workers (a worker is a warp in the warp-worker kernel, FP8
 *            Q over FP8 KV with up to 16 rows per pair; a one-warpgroup CTA in the warpgroup
 *            kernel, the same at D 128 with 17..64 rows; a CTA in the CTA kernel, every other
 *            shape): worker i drains bin i as one stream of tiles
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
#include "decode_dev.cuh"

namespace tkvk_dec {

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
/* Warp workers of `smem` bytes each that a CTA of `optin` bytes holds, at most `want` and
 * kMaxCtaWarps (at least 1). */
int dec_fit_warps(size_t smem, int optin, int want)
{
    int fit = smem > 0 ? (int)(optin / smem) : 1;
    int w = want < kMaxCtaWarps ? want : kMaxCtaWarps;
    w = w < fit ? w : fit;
    return w < 1 ? 1 : w;
}

/* The warpgroup kernel in the launcher's choice: past 16 rows (q_len 3..8 of a GQA group of
 * 8). On an H200 (docs/perf.md, decode) its form 32 took 0.83-0.91x form 12's time at q_len
 * 5 and 8 (geometric means) and, at 17..32 rows, 0.86-1.00x the warp-worker kernel's (0.71x
 * on one long request among short ones, up to 1.33x on many short ones at 64/8 heads); at
 * 9..16 rows it was ahead at 8/1 heads but behind at 64/8, and the launcher cannot see the
 * lengths, so the warp-worker kernel keeps those. Also wherever asked for (TKVK__DEC_WG:
 * tests, benchmarks); never under the other forced choices. */
bool dec_wg_wanted(int rows, int which)
{
    return which == TKVK__DEC_WG || (which == TKVK__DEC_AUTO && rows > 16);
}

/* The warpgroup kernel's form (tkvk__decode_wg_form): 32, two stages, each tile's P.V
 * awaited at once, the running maximum kept while a tile's scores stay within 8 of it (no
 * exchange of the maximum, no barrier for it and no rescaling of O on such tiles). */
int dec_wg_default_form(int rows)
{
    (void)rows;
    return 32;
}

/* FP8 Q over FP8 KV at D 128 with 1..64 rows runs the warpgroup kernel where dec_wg_wanted();
 * else with up to 16 rows (32 at D <= 128) the warp-worker kernel; every other combination
 * the CTA kernel with 4 warps (8 past 64 rows). */
AttendVariant pick_variant(int head_dim, bool fp8, int rows, bool q8, int which)
{
    if (fp8 && q8 && head_dim == 128 && dec_wg_wanted(rows, which)) {
        AttendVariant v = dec_wg_variant(head_dim, rows);
        if (v.fn)
            return v;
    }
    if (fp8 && q8 && which != TKVK__DEC_CTA && (rows <= 16 || (rows <= 32 && head_dim <= 128))) {
        AttendVariant v = dec_warp_variant(head_dim, rows, which);
        if (v.fn)
            return v;
    }
    return dec_cta_variant(head_dim, fp8, q8, rows > 64);
}


/* The shared-memory limits are attributes of this copy of the kernels: a program may hold two
 * copies of the library (e.g. its own and libkvclient's), and a plan made by one may be used
 * by the other, so every launcher makes sure of them once per process for its own copy. */
static int dec_set_smem_limits_now(void);
int dec_set_smem_limits(void)
{
    static std::once_flag once;
    static int rc;
    std::call_once(once, [] { rc = dec_set_smem_limits_now(); });
    return rc;
}

/* The most shared memory a CTA may opt in to on the current device. */
int dec_smem_optin(int *optin)
{
    int dev = 0;
    TKVK_CUDA_TRY(cudaGetDevice(&dev));
    TKVK_CUDA_TRY(cudaDeviceGetAttribute(optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, dev));
    return TKVK_OK;
}

static int dec_set_smem_limits_now(void)
{
    static const int dims[3] = {64, 128, 256};
    static const int row_counts[6] = {8, 16, 32, 48, 64, 128};
    int optin = 0, rc = dec_smem_optin(&optin);
    if (rc)
        return rc;
    TKVK_CUDA_TRY(dec_plan_set_smem(optin));
    TKVK_CUDA_TRY(dec_wg_set_smem());
    for (int which = TKVK__DEC_AUTO; which <= TKVK__DEC_LAST; which++)
        for (int i = 0; i < 3; i++)
            for (int f = 0; f < 2; f++)
                for (int ri = 0; ri < 6; ri++)
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

} /* namespace tkvk_dec */

using namespace tkvk_dec;

/* ============================================================================================
 * Attention entry points
 * ========================================================================================== */

int tkvk_dec::dec_fill_params(const tkvk_decode_plan *pl, const tkvk_decode_args *a,
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

int tkvk_dec::dec_combine(const tkvk_decode_plan *pl, const tkvk_decode_args *a,
                          const DecParams &p, DecParts kind, cudaStream_t s)
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
    TKVK_CUDA_TRY(dec_launch_combine(cp, pairs, pl->num_sms, s));
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
    TKVK_CUDA_TRY(dec_launch_merge(o_a, lse_a, o_b, lse_b, num_rows, head_dim, out, out_lse,
                                   (cudaStream_t)stream));
    return TKVK_OK;
}

