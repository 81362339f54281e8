/* decode.c - decode attention on the CPU: argument checks shared with the CUDA path, the
 * planner (the same algorithm as the device plan kernel), the reference attention, the split
 * and static-split paths built from partial (O, LSE) results, and merge states.
 *
 * These are the references the GPU kernels are tested against and the daemon's path without
 * a GPU, so they favour plain, obviously right float code over speed.
 */
#include <limits.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "decode_internal.h"

#define LOG2E 1.4426950408889634f

/* The project's out-of-memory policy (as tkv_x* in storage): a failed allocation of working
 * memory is not a recoverable condition for a kernel call, so abort with a message. */
static void *dec_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p) {
        fprintf(stderr, "tkv_kernels: out of memory (%zu x %zu bytes)\n", n, size);
        abort();
    }
    return p;
}

/* ============================================================================================
 * Argument checks
 * ========================================================================================== */

int tkvk__decode_check(const tkvk_decode_args *a, const char *who)
{
    if (!a)
        return tkvk__fail(TKVK_EINVAL, "%s: args is NULL", who);
    const tkvk_layout *lay = a->layout;
    if (!lay)
        return tkvk__fail(TKVK_EINVAL, "%s: layout is NULL", who);
    if (!tkvk__head_dim_ok(lay->head_dim) || !tkvk__page_tokens_ok(lay->page_tokens) ||
        lay->num_kv_heads < 1 || lay->num_layers < 1 || lay->token_stride == 0)
        return tkvk__fail(TKVK_EINVAL, "%s: layout was not filled by tkvk_layout_init()", who);
    if (a->layer < 0 || a->layer >= lay->num_layers)
        return tkvk__fail(TKVK_EINVAL, "%s: layer %d outside 0..%d", who, a->layer,
                          lay->num_layers - 1);
    if (a->num_requests < 0)
        return tkvk__fail(TKVK_EINVAL, "%s: num_requests %d < 0", who, a->num_requests);
    if (a->num_q_heads < 1 || a->num_q_heads % lay->num_kv_heads != 0)
        return tkvk__fail(TKVK_EINVAL, "%s: num_q_heads %d is not a multiple of num_kv_heads %d",
                          who, a->num_q_heads, lay->num_kv_heads);
    int group = a->num_q_heads / lay->num_kv_heads;
    if (group > TKVK_DECODE_MAX_GROUP)
        return tkvk__fail(TKVK_EUNSUPPORTED, "%s: GQA group %d (supported: 1..%d)", who, group,
                          TKVK_DECODE_MAX_GROUP);
    if (a->q_len < 1 || a->q_len > TKVK_DECODE_MAX_Q_LEN)
        return tkvk__fail(TKVK_EUNSUPPORTED, "%s: q_len %d (supported: 1..%d)", who, a->q_len,
                          TKVK_DECODE_MAX_Q_LEN);
    if (a->q_dtype != TKVK_DTYPE_BF16 && a->q_dtype != TKVK_DTYPE_FP8_E4M3)
        return tkvk__fail(TKVK_EINVAL, "%s: q_dtype %d is not a TKVK_DTYPE_*", who, a->q_dtype);
    if (a->block_table_stride < 1)
        return tkvk__fail(TKVK_EINVAL, "%s: block_table_stride %d < 1", who,
                          a->block_table_stride);
    if (a->num_blocks < 1)
        return tkvk__fail(TKVK_EINVAL, "%s: num_blocks %d < 1", who, a->num_blocks);
    if (!isfinite(a->sm_scale))
        return tkvk__fail(TKVK_EINVAL, "%s: sm_scale is not finite", who);
    if (lay->kv_dtype == TKVK_DTYPE_FP8_E4M3 && lay->scale_mode == TKVK_SCALE_PER_TENSOR &&
        (!isfinite(a->k_scale) || !isfinite(a->v_scale)))
        return tkvk__fail(TKVK_EINVAL, "%s: k_scale/v_scale not finite", who);
    if (a->num_requests == 0)
        return TKVK_OK;
    if (!a->q || !a->kv_lens || !a->block_table || !a->pool || !a->out)
        return tkvk__fail(TKVK_EINVAL, "%s: q, kv_lens, block_table, pool and out are required",
                          who);
    if (a->q_dtype == TKVK_DTYPE_FP8_E4M3 && !a->q_scales)
        return tkvk__fail(TKVK_EINVAL, "%s: FP8 Q needs q_scales", who);
    if (lay->scale_mode == TKVK_SCALE_PER_TOKEN_HEAD && !a->v_head_scales)
        return tkvk__fail(TKVK_EINVAL, "%s: per-token-head scales need v_head_scales", who);
    return TKVK_OK;
}

/* Host-side content checks the GPU cannot make: lengths within the table, block ids within
 * the pool, scales finite. */
int tkvk__decode_check_host(const tkvk_decode_args *a, const char *who)
{
    int rc = tkvk__decode_check(a, who);
    if (rc)
        return rc;
    const tkvk_layout *lay = a->layout;
    int64_t max_len = (int64_t)a->block_table_stride * lay->page_tokens;
    for (int r = 0; r < a->num_requests; r++) {
        int32_t len = a->kv_lens[r];
        if (len < 0 || len > max_len)
            return tkvk__fail(TKVK_EINVAL, "%s: kv_lens[%d] = %d outside 0..%lld", who, r, len,
                              (long long)max_len);
        int nblk = (len + lay->page_tokens - 1) / lay->page_tokens;
        for (int b = 0; b < nblk; b++) {
            int32_t id = a->block_table[(size_t)r * a->block_table_stride + b];
            if (id < 0 || id >= a->num_blocks)
                return tkvk__fail(TKVK_EINVAL, "%s: block_table[%d][%d] = %d outside 0..%d", who,
                                  r, b, id, a->num_blocks - 1);
        }
    }
    if (a->q_dtype == TKVK_DTYPE_FP8_E4M3) {
        size_t n = (size_t)a->num_requests * a->q_len * a->num_q_heads;
        for (size_t i = 0; i < n; i++)
            if (!isfinite(a->q_scales[i]))
                return tkvk__fail(TKVK_EINVAL, "%s: q_scales[%zu] not finite", who, i);
    }
    if (lay->scale_mode == TKVK_SCALE_PER_TOKEN_HEAD)
        for (int h = 0; h < lay->num_kv_heads; h++)
            if (!isfinite(a->v_head_scales[h]))
                return tkvk__fail(TKVK_EINVAL, "%s: v_head_scales[%d] not finite", who, h);
    return TKVK_OK;
}

/* ============================================================================================
 * Planner
 * ========================================================================================== */

int tkvk_decode_map_init(tkvk_decode_map *map, int num_pairs, int grid)
{
    if (!map)
        return tkvk__fail(TKVK_EINVAL, "decode_map_init: map is NULL");
    memset(map, 0, sizeof *map);
    if (num_pairs < 1 || grid < 1)
        return tkvk__fail(TKVK_EINVAL, "decode_map_init: num_pairs %d / grid %d < 1", num_pairs,
                          grid);
    map->tasks = dec_xcalloc((size_t)num_pairs + grid, sizeof *map->tasks);
    map->task_slot = dec_xcalloc((size_t)num_pairs + grid, sizeof *map->task_slot);
    map->bin_first = dec_xcalloc((size_t)grid + 1, sizeof *map->bin_first);
    map->pair_first = dec_xcalloc((size_t)num_pairs, sizeof *map->pair_first);
    map->pair_count = dec_xcalloc((size_t)num_pairs, sizeof *map->pair_count);
    map->slot_first = dec_xcalloc((size_t)num_pairs, sizeof *map->slot_first);
    map->slot_count = dec_xcalloc((size_t)num_pairs, sizeof *map->slot_count);
    map->num_pairs = num_pairs;
    map->grid = grid;
    return TKVK_OK;
}

void tkvk_decode_map_free(tkvk_decode_map *map)
{
    if (!map)
        return;
    free(map->tasks);
    free(map->task_slot);
    free(map->bin_first);
    free(map->pair_first);
    free(map->pair_count);
    free(map->slot_first);
    free(map->slot_count);
    memset(map, 0, sizeof *map);
}

int tkvk_decode_plan_cpu(const int32_t *kv_lens, int num_requests, int num_kv_heads, int grid,
                         int min_tiles_per_cta, int cta_warps, tkvk_decode_map *map)
{
    if (!map || (!kv_lens && num_requests > 0))
        return tkvk__fail(TKVK_EINVAL, "decode_plan_cpu: kv_lens/map is NULL");
    if (num_requests < 0 || num_kv_heads < 1 || grid < 1 || min_tiles_per_cta < 1 ||
        cta_warps < 1)
        return tkvk__fail(TKVK_EINVAL,
                          "decode_plan_cpu: num_requests %d, num_kv_heads %d, grid %d, "
                          "min_tiles_per_cta %d, cta_warps %d",
                          num_requests, num_kv_heads, grid, min_tiles_per_cta, cta_warps);
    int num_pairs = num_requests * num_kv_heads;
    if (num_pairs > map->num_pairs || grid > map->grid)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_cpu: map holds %d pairs / grid %d, need %d / %d",
                          map->num_pairs, map->grid, num_pairs, grid);
    int64_t total = 0;
    for (int p = 0; p < num_pairs; p++)
        total += tkvk__decode_tiles(kv_lens[p / num_kv_heads]);
    if (total > INT32_MAX / 2)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_cpu: %lld tiles is too many", (long long)total);
    int num_tiles = (int)total;
    int ctas = (grid + cta_warps - 1) / cta_warps;
    const tkvk__decode_bins bins = tkvk__decode_bins_of(num_tiles, grid, min_tiles_per_cta, ctas);
    const int per_cta = bins.per_cta, num_bins = bins.num_bins;

    int start = 0, ntask = 0, nslot = 0;
    for (int p = 0; p < num_pairs; p++) {
        int tiles = tkvk__decode_tiles(kv_lens[p / num_kv_heads]);
        map->pair_first[p] = ntask;
        map->pair_count[p] = 0;
        map->slot_first[p] = nslot;
        int t = start;
        while (t < start + tiles) {
            int bin = t / per_cta, bin_end = (bin + 1) * per_cta;
            int end = bin_end < start + tiles ? bin_end : start + tiles;
            if (t % per_cta == 0)
                map->bin_first[bin] = ntask;
            map->tasks[ntask].request = p / num_kv_heads;
            map->tasks[ntask].kv_head = p % num_kv_heads;
            map->tasks[ntask].tile_begin = t - start;
            map->tasks[ntask].tile_end = end - start;
            map->task_slot[ntask] =
                nslot + map->pair_count[p] -
                tkvk__decode_joins(&bins, start, start + tiles, bin);
            ntask++;
            map->pair_count[p]++;
            t = end;
        }
        map->slot_count[p] =
            map->pair_count[p] -
            tkvk__decode_joins(&bins, start, start + tiles, INT_MAX);
        nslot += map->slot_count[p];
        start += tiles;
    }
    for (int b = num_bins; b <= grid; b++)
        map->bin_first[b] = ntask;
    map->grid = grid;
    map->bins_per_cta = (num_bins + ctas - 1) / ctas;
    map->num_slots = nslot;
    map->num_bins = num_bins;
    map->num_tiles = num_tiles;
    map->num_tasks = ntask;
    map->tiles_per_cta = per_cta;
    return TKVK_OK;
}

/* ============================================================================================
 * Attention over one range of positions (the building block of all three CPU paths)
 * ========================================================================================== */

typedef struct dec_work {
    int rows, dim, group;
    float *q;   /* [rows][dim] dequantised queries of the current (request, head) */
    float *k;   /* [dim] */
    float *v;   /* [dim] */
    float *acc; /* [rows][dim] */
    float *m;   /* [rows] running max (base-2 scores) */
    float *l;   /* [rows] running sum */
} dec_work;

static void dec_work_init(dec_work *w, const tkvk_decode_args *a)
{
    w->dim = a->layout->head_dim;
    w->group = a->num_q_heads / a->layout->num_kv_heads;
    w->rows = w->group * a->q_len;
    w->q = dec_xcalloc((size_t)w->rows * w->dim, sizeof(float));
    w->k = dec_xcalloc((size_t)w->dim, sizeof(float));
    w->v = dec_xcalloc((size_t)w->dim, sizeof(float));
    w->acc = dec_xcalloc((size_t)w->rows * w->dim, sizeof(float));
    w->m = dec_xcalloc((size_t)w->rows, sizeof(float));
    w->l = dec_xcalloc((size_t)w->rows, sizeof(float));
}

static void dec_work_free(dec_work *w)
{
    free(w->q);
    free(w->k);
    free(w->v);
    free(w->acc);
    free(w->m);
    free(w->l);
}

/* Dequantised queries of (request, KV head) into w->q; row = t * group + head in group. */
static void dec_load_q(const tkvk_decode_args *a, dec_work *w, int req, int kvh)
{
    int D = w->dim;
    for (int r = 0; r < w->rows; r++) {
        int t = r / w->group, hq = kvh * w->group + r % w->group;
        size_t idx = ((size_t)req * a->q_len + t) * a->num_q_heads + hq;
        for (int d = 0; d < D; d++) {
            float x;
            if (a->q_dtype == TKVK_DTYPE_FP8_E4M3)
                x = tkvk_fp8_to_float(((const uint8_t *)a->q)[idx * D + d]) * a->q_scales[idx];
            else
                x = tkvk_bf16_to_float(((const uint16_t *)a->q)[idx * D + d]);
            w->q[(size_t)r * D + d] = x;
        }
    }
}

/* Dequantised K and V of position pos of (request, KV head) into w->k / w->v. */
static void dec_load_kv(const tkvk_decode_args *a, dec_work *w, int req, int kvh, int pos)
{
    const tkvk_layout *lay = a->layout;
    int P = lay->page_tokens, D = w->dim;
    int32_t blk = a->block_table[(size_t)req * a->block_table_stride + pos / P];
    const uint8_t *page = (const uint8_t *)a->pool + (size_t)blk * lay->block_stride +
                          (size_t)a->layer * lay->layer_stride;
    size_t off = (size_t)(pos % P) * lay->token_stride + (size_t)kvh * D * lay->elem_bytes;
    const uint8_t *k = page + off, *v = page + lay->v_offset + off;
    if (lay->kv_dtype == TKVK_DTYPE_BF16) {
        for (int d = 0; d < D; d++) {
            uint16_t kb, vb;
            memcpy(&kb, k + 2 * d, 2);
            memcpy(&vb, v + 2 * d, 2);
            w->k[d] = tkvk_bf16_to_float(kb);
            w->v[d] = tkvk_bf16_to_float(vb);
        }
        return;
    }
    float ks = a->k_scale, vs = a->v_scale;
    if (lay->scale_mode == TKVK_SCALE_PER_TOKEN_HEAD) {
        memcpy(&ks, page + lay->kscale_offset + ((size_t)(pos % P) * lay->num_kv_heads + kvh) * 4,
               4);
        vs = a->v_head_scales[kvh];
    }
    for (int d = 0; d < D; d++) {
        w->k[d] = tkvk_fp8_to_float(k[d]) * ks;
        w->v[d] = tkvk_fp8_to_float(v[d]) * vs;
    }
}

/* Attention of the queries in w->q over positions [pos_begin, pos_end) of (request, KV
 * head): o [rows][dim] normalised, lse [rows] base 2 (-inf and O = 0 for a row that sees no
 * position in the range). */
static void dec_attend_range(const tkvk_decode_args *a, dec_work *w, int req, int kvh,
                             int pos_begin, int pos_end, float *o, float *lse)
{
    int D = w->dim, R = w->rows;
    int32_t L = a->kv_lens[req];
    float scale2 = a->sm_scale * LOG2E;
    for (int r = 0; r < R; r++) {
        w->m[r] = -INFINITY;
        w->l[r] = 0.0f;
    }
    memset(w->acc, 0, (size_t)R * D * sizeof(float));
    for (int pos = pos_begin; pos < pos_end; pos++) {
        dec_load_kv(a, w, req, kvh, pos);
        for (int r = 0; r < R; r++) {
            int t = r / w->group;
            if (pos >= L - a->q_len + t + 1)
                continue; /* causal within the new tokens */
            const float *q = w->q + (size_t)r * D;
            float s = 0.0f;
            for (int d = 0; d < D; d++)
                s += q[d] * w->k[d];
            s *= scale2;
            float m_new = s > w->m[r] ? s : w->m[r];
            float alpha = exp2f(w->m[r] - m_new); /* 0 when the old max was -inf */
            float p = exp2f(s - m_new);
            float *acc = w->acc + (size_t)r * D;
            for (int d = 0; d < D; d++)
                acc[d] = acc[d] * alpha + p * w->v[d];
            w->l[r] = w->l[r] * alpha + p;
            w->m[r] = m_new;
        }
    }
    for (int r = 0; r < R; r++) {
        float *dst = o + (size_t)r * D;
        if (w->l[r] > 0.0f) {
            float inv = 1.0f / w->l[r];
            for (int d = 0; d < D; d++)
                dst[d] = w->acc[(size_t)r * D + d] * inv;
            lse[r] = w->m[r] + log2f(w->l[r]);
        } else {
            memset(dst, 0, (size_t)D * sizeof(float));
            lse[r] = -INFINITY;
        }
    }
}

/* Rows of (request, KV head) from o/lse [rows][dim] into the outputs. */
static void dec_store(const tkvk_decode_args *a, const dec_work *w, int req, int kvh,
                      const float *o, const float *lse)
{
    int D = w->dim;
    for (int r = 0; r < w->rows; r++) {
        int t = r / w->group, hq = kvh * w->group + r % w->group;
        size_t idx = ((size_t)req * a->q_len + t) * a->num_q_heads + hq;
        uint16_t *dst = (uint16_t *)a->out + idx * D;
        for (int d = 0; d < D; d++)
            dst[d] = tkvk_bf16_from_float(o[(size_t)r * D + d]);
        if (a->lse)
            a->lse[idx] = lse[r];
    }
}

/* Merges n partial results (o_parts [n][rows][dim], lse_parts [n][rows]) into o/lse with the
 * global softmax: weights 2^(lse_i - max); parts with lse = -inf weigh nothing. */
static void dec_combine(int n, int rows, int dim, const float *o_parts, const float *lse_parts,
                        float *o, float *lse)
{
    for (int r = 0; r < rows; r++) {
        float mx = -INFINITY;
        for (int i = 0; i < n; i++)
            if (lse_parts[(size_t)i * rows + r] > mx)
                mx = lse_parts[(size_t)i * rows + r];
        float *dst = o + (size_t)r * dim;
        memset(dst, 0, (size_t)dim * sizeof(float));
        if (mx == -INFINITY) {
            lse[r] = -INFINITY;
            continue;
        }
        float wsum = 0.0f;
        for (int i = 0; i < n; i++) {
            float li = lse_parts[(size_t)i * rows + r];
            if (li == -INFINITY)
                continue;
            float wi = exp2f(li - mx);
            wsum += wi;
            const float *src = o_parts + ((size_t)i * rows + r) * dim;
            for (int d = 0; d < dim; d++)
                dst[d] += wi * src[d];
        }
        for (int d = 0; d < dim; d++)
            dst[d] /= wsum;
        lse[r] = mx + log2f(wsum);
    }
}

/* ============================================================================================
 * The three CPU paths
 * ========================================================================================== */

int tkvk_decode_cpu(const tkvk_decode_args *a)
{
    int rc = tkvk__decode_check_host(a, "decode_cpu");
    if (rc)
        return rc;
    if (a->num_requests == 0)
        return TKVK_OK;
    dec_work w;
    dec_work_init(&w, a);
    float *o = dec_xcalloc((size_t)w.rows * w.dim, sizeof(float));
    float *lse = dec_xcalloc((size_t)w.rows, sizeof(float));
    for (int req = 0; req < a->num_requests; req++)
        for (int h = 0; h < a->layout->num_kv_heads; h++) {
            dec_load_q(a, &w, req, h);
            dec_attend_range(a, &w, req, h, 0, a->kv_lens[req], o, lse);
            dec_store(a, &w, req, h, o, lse);
        }
    free(o);
    free(lse);
    dec_work_free(&w);
    return TKVK_OK;
}

/* Shared tail of the split paths: for every pair, attend each of its `count` position ranges
 * (from ranges(), which fills [begin, end) pairs) and combine. */
int tkvk__decode_split_run(const tkvk_decode_args *a, int max_parts, tkvk__decode_ranges_fn ranges,
                           const void *ctx)
{
    dec_work w;
    dec_work_init(&w, a);
    size_t rd = (size_t)w.rows * w.dim;
    float *o_parts = dec_xcalloc((size_t)max_parts * rd, sizeof(float));
    float *lse_parts = dec_xcalloc((size_t)max_parts * w.rows, sizeof(float));
    int *begin = dec_xcalloc((size_t)max_parts, sizeof(int));
    int *end = dec_xcalloc((size_t)max_parts, sizeof(int));
    float *o = dec_xcalloc(rd, sizeof(float));
    float *lse = dec_xcalloc((size_t)w.rows, sizeof(float));
    int hkv = a->layout->num_kv_heads;
    for (int p = 0; p < a->num_requests * hkv; p++) {
        int req = p / hkv, h = p % hkv;
        int n = ranges(ctx, p, begin, end, max_parts);
        dec_load_q(a, &w, req, h);
        for (int i = 0; i < n; i++)
            dec_attend_range(a, &w, req, h, begin[i], end[i], o_parts + (size_t)i * rd,
                             lse_parts + (size_t)i * w.rows);
        dec_combine(n, w.rows, w.dim, o_parts, lse_parts, o, lse);
        dec_store(a, &w, req, h, o, lse);
    }
    free(o_parts);
    free(lse_parts);
    free(begin);
    free(end);
    free(o);
    free(lse);
    dec_work_free(&w);
    return TKVK_OK;
}

typedef struct dec_split_ctx {
    const tkvk_decode_map *map;
    const int32_t *kv_lens;
    int hkv;
} dec_split_ctx;

static int dec_split_ranges(const void *ctx_, int pair, int *begin, int *end, int cap)
{
    const dec_split_ctx *ctx = ctx_;
    int n = ctx->map->pair_count[pair];
    int32_t L = ctx->kv_lens[pair / ctx->hkv];
    for (int i = 0; i < n && i < cap; i++) {
        const tkvk_decode_task *t = &ctx->map->tasks[ctx->map->pair_first[pair] + i];
        begin[i] = t->tile_begin * TKVK_DECODE_TILE_TOKENS;
        end[i] = t->tile_end * TKVK_DECODE_TILE_TOKENS;
        if (end[i] > L)
            end[i] = L;
    }
    return n < cap ? n : cap;
}

int tkvk_decode_split_cpu(const tkvk_decode_args *a, int grid, int min_tiles_per_cta)
{
    int rc = tkvk__decode_check_host(a, "decode_split_cpu");
    if (rc)
        return rc;
    if (grid < 1 || min_tiles_per_cta < 1)
        return tkvk__fail(TKVK_EINVAL, "decode_split_cpu: grid %d / min_tiles_per_cta %d < 1",
                          grid, min_tiles_per_cta);
    if (a->num_requests == 0)
        return TKVK_OK;
    int hkv = a->layout->num_kv_heads;
    tkvk_decode_map map;
    rc = tkvk_decode_map_init(&map, a->num_requests * hkv, grid);
    if (rc)
        return rc;
    rc = tkvk_decode_plan_cpu(a->kv_lens, a->num_requests, hkv, grid, min_tiles_per_cta, 1,
                              &map);
    if (rc == TKVK_OK) {
        int max_parts = 1;
        for (int p = 0; p < map.num_pairs; p++)
            if (map.pair_count[p] > max_parts)
                max_parts = map.pair_count[p];
        dec_split_ctx ctx = {&map, a->kv_lens, hkv};
        rc = tkvk__decode_split_run(a, max_parts, dec_split_ranges, &ctx);
    }
    tkvk_decode_map_free(&map);
    return rc;
}

/* ============================================================================================
 * Merge states
 * ========================================================================================== */

int tkvk_merge_states_cpu(const uint16_t *o_a, const float *lse_a, const uint16_t *o_b,
                          const float *lse_b, int num_rows, int head_dim, uint16_t *out,
                          float *out_lse)
{
    if (num_rows < 0 || head_dim < 1)
        return tkvk__fail(TKVK_EINVAL, "merge_states_cpu: num_rows %d / head_dim %d", num_rows,
                          head_dim);
    if (num_rows > 0 && (!o_a || !lse_a || !o_b || !lse_b || !out || !out_lse))
        return tkvk__fail(TKVK_EINVAL, "merge_states_cpu: NULL input or output");
    for (int r = 0; r < num_rows; r++) {
        float la = lse_a[r], lb = lse_b[r];
        float mx = la > lb ? la : lb;
        float wa = 0.0f, wb = 0.0f, lse = -INFINITY;
        if (mx != -INFINITY) {
            wa = la == -INFINITY ? 0.0f : exp2f(la - mx);
            wb = lb == -INFINITY ? 0.0f : exp2f(lb - mx);
            lse = mx + log2f(wa + wb);
            float inv = 1.0f / (wa + wb);
            wa *= inv;
            wb *= inv;
        }
        for (int d = 0; d < head_dim; d++) {
            size_t i = (size_t)r * head_dim + d;
            /* A set with weight 0 is not read: its O may be anything (even NaN). */
            float x = 0.0f;
            if (wa > 0.0f)
                x += wa * tkvk_bf16_to_float(o_a[i]);
            if (wb > 0.0f)
                x += wb * tkvk_bf16_to_float(o_b[i]);
            out[i] = tkvk_bf16_from_float(x);
        }
        out_lse[r] = lse;
    }
    return TKVK_OK;
}
