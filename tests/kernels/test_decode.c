/* test_decode.c - the CPU decode attention (kernels/decode.c): the reference, the split and
 * static-split paths and merge states against a float64 naive attention written here; the
 * planner's invariants; zero-length requests; causal masking for q_len > 1; refusals.
 *
 * Tolerances: the CPU paths compute in float32 and round O to bf16, so O is compared with
 * a relative L2 error of 5e-3 and the base-2 LSE with 1e-3 absolute. */
#include <check.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "decode_internal.h"
#include "tkv_kernels.h"
#include "decode_static.h"

static uint64_t rng_state = 88172645463325252ull;
static double rnd_unit(void)
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) * (1.0 / 9007199254740992.0);
}
static float rnd_normal(void)
{
    double u1 = rnd_unit() + 1e-12, u2 = rnd_unit();
    return (float)(sqrt(-2.0 * log(u1)) * cos(6.283185307179586 * u2));
}

/* ---- a test problem ------------------------------------------------------------------------ */

typedef struct prob {
    tkvk_layout lay;
    int nreq, hq, q_len, q_dtype, bt_stride, num_blocks;
    int32_t lens[8];
    int32_t *table;
    uint8_t *pool;
    uint8_t *q;
    float *q_scales, *v_head_scales;
    uint16_t *out;
    float *lse;
    tkvk_decode_args a;
} prob;

static void prob_make(prob *p, int D, int P, int kv_dtype, int scale_mode, int q_dtype, int hkv,
                      int group, int q_len, const int32_t *lens, int nreq)
{
    memset(p, 0, sizeof *p);
    ck_assert_int_eq(tkvk_layout_init(&p->lay, 2, hkv, D, P, kv_dtype, scale_mode), TKVK_OK);
    p->nreq = nreq;
    p->hq = hkv * group;
    p->q_len = q_len;
    p->q_dtype = q_dtype;
    int maxb = 1, total = 0;
    for (int r = 0; r < nreq; r++) {
        p->lens[r] = lens[r];
        int b = (lens[r] + P - 1) / P;
        maxb = b > maxb ? b : maxb;
        total += b;
    }
    p->bt_stride = maxb;
    p->num_blocks = total + 1;
    p->pool = calloc((size_t)p->num_blocks, p->lay.block_stride);
    size_t elems = p->lay.block_stride / p->lay.elem_bytes;
    for (size_t i = 0; i < elems; i++) {
        float x = rnd_normal() * 2.0f;
        for (int b = 0; b < p->num_blocks; b++) {
            uint8_t *dst = p->pool + (size_t)b * p->lay.block_stride + i * p->lay.elem_bytes;
            float y = x * (1.0f + 0.1f * b) - 0.05f * b;
            if (kv_dtype == TKVK_DTYPE_FP8_E4M3) {
                *dst = tkvk_fp8_from_float(y);
            } else {
                uint16_t h = tkvk_bf16_from_float(y);
                memcpy(dst, &h, 2);
            }
        }
    }
    if (scale_mode == TKVK_SCALE_PER_TOKEN_HEAD)
        for (int b = 0; b < p->num_blocks; b++)
            for (int l = 0; l < 2; l++)
                for (int t = 0; t < P * hkv; t++) {
                    float s = (float)(0.5 + rnd_unit());
                    memcpy(p->pool + (size_t)b * p->lay.block_stride + (size_t)l * p->lay.layer_stride +
                               p->lay.kscale_offset + 4 * (size_t)t,
                           &s, 4);
                }
    p->table = calloc((size_t)nreq * maxb, sizeof(int32_t));
    int next = total; /* ids in reverse so the table is not the identity */
    for (int r = 0; r < nreq; r++)
        for (int b = 0; b < (lens[r] + P - 1) / P; b++)
            p->table[(size_t)r * maxb + b] = --next;
    size_t qn = (size_t)nreq * q_len * p->hq;
    p->q = calloc(qn * D, 2);
    p->q_scales = calloc(qn, sizeof(float));
    for (size_t i = 0; i < qn; i++)
        p->q_scales[i] = (float)(0.01 + 0.01 * rnd_unit());
    for (size_t i = 0; i < qn * D; i++) {
        if (q_dtype == TKVK_DTYPE_BF16) {
            uint16_t h = tkvk_bf16_from_float(rnd_normal());
            memcpy(p->q + 2 * i, &h, 2);
        } else {
            p->q[i] = tkvk_fp8_from_float(rnd_normal() * 100.0f);
        }
    }
    p->v_head_scales = calloc((size_t)hkv, sizeof(float));
    for (int h = 0; h < hkv; h++)
        p->v_head_scales[h] = (float)(0.3 + rnd_unit());
    p->out = calloc(qn * D, 2);
    p->lse = calloc(qn, sizeof(float));
    tkvk_decode_args *a = &p->a;
    a->layout = &p->lay;
    a->layer = 1;
    a->num_requests = nreq;
    a->num_q_heads = p->hq;
    a->q_len = q_len;
    a->q_dtype = q_dtype;
    a->q = p->q;
    a->q_scales = p->q_scales;
    a->kv_lens = p->lens;
    a->block_table = p->table;
    a->block_table_stride = maxb;
    a->num_blocks = p->num_blocks;
    a->pool = p->pool;
    a->k_scale = 0.7f;
    a->v_scale = 0.4f;
    a->v_head_scales = p->v_head_scales;
    a->sm_scale = 1.0f / sqrtf((float)D);
    a->out = p->out;
    a->lse = p->lse;
}

static void prob_free(prob *p)
{
    free(p->pool);
    free(p->table);
    free(p->q);
    free(p->q_scales);
    free(p->v_head_scales);
    free(p->out);
    free(p->lse);
}

/* float64 attention; ref [rows][D] and ref_lse [rows] in the output order */
static void naive(const prob *p, double *ref, double *ref_lse)
{
    const tkvk_layout *L = &p->lay;
    int D = L->head_dim, P = L->page_tokens, hkv = L->num_kv_heads, group = p->hq / hkv;
    for (int r = 0; r < p->nreq; r++)
        for (int t = 0; t < p->q_len; t++)
            for (int hq = 0; hq < p->hq; hq++) {
                size_t qi = ((size_t)r * p->q_len + t) * p->hq + hq;
                int h = hq / group;
                double q[256], acc[256] = {0};
                for (int d = 0; d < D; d++) {
                    if (p->q_dtype == TKVK_DTYPE_BF16) {
                        uint16_t b;
                        memcpy(&b, p->q + 2 * (qi * D + d), 2);
                        q[d] = tkvk_bf16_to_float(b);
                    } else {
                        q[d] = (double)tkvk_fp8_to_float(p->q[qi * D + d]) * p->q_scales[qi];
                    }
                }
                int vis = p->lens[r] - p->q_len + t + 1;
                double mx = -INFINITY, sum = 0.0;
                double *s = malloc(sizeof(double) * (vis > 0 ? vis : 1));
                for (int pass = 0; pass < 2; pass++)
                    for (int pos = 0; pos < vis; pos++) {
                        int32_t blk = p->table[(size_t)r * p->bt_stride + pos / P];
                        const uint8_t *page = p->pool + (size_t)blk * L->block_stride + L->layer_stride;
                        size_t off = (size_t)(pos % P) * L->token_stride + (size_t)h * D * L->elem_bytes;
                        double ks = p->a.k_scale, vs = p->a.v_scale;
                        if (L->scale_mode == TKVK_SCALE_PER_TOKEN_HEAD) {
                            float f;
                            memcpy(&f, page + L->kscale_offset + ((size_t)(pos % P) * hkv + h) * 4, 4);
                            ks = f;
                            vs = p->v_head_scales[h];
                        }
                        if (L->kv_dtype == TKVK_DTYPE_BF16)
                            ks = vs = 1.0;
                        double dot = 0.0;
                        for (int d = 0; d < D; d++) {
                            double k, v;
                            if (L->kv_dtype == TKVK_DTYPE_FP8_E4M3) {
                                k = tkvk_fp8_to_float(page[off + d]) * ks;
                                v = tkvk_fp8_to_float(page[L->v_offset + off + d]) * vs;
                            } else {
                                uint16_t a, b;
                                memcpy(&a, page + off + 2 * d, 2);
                                memcpy(&b, page + L->v_offset + off + 2 * d, 2);
                                k = tkvk_bf16_to_float(a);
                                v = tkvk_bf16_to_float(b);
                            }
                            if (pass == 0)
                                dot += q[d] * k;
                            else
                                acc[d] += exp2(s[pos] - mx) * v;
                        }
                        if (pass == 0) {
                            s[pos] = dot * p->a.sm_scale * 1.4426950408889634;
                            mx = s[pos] > mx ? s[pos] : mx;
                        } else {
                            sum += exp2(s[pos] - mx);
                        }
                    }
                free(s);
                for (int d = 0; d < D; d++)
                    ref[qi * D + d] = vis > 0 ? acc[d] / sum : 0.0;
                ref_lse[qi] = vis > 0 ? mx + log2(sum) : -INFINITY;
            }
}

/* relative L2 error of out vs ref; lse error; empty rows must be exactly 0 / -inf */
static void compare(const prob *p, const double *ref, const double *ref_lse, const char *what)
{
    int D = p->lay.head_dim;
    size_t rows = (size_t)p->nreq * p->q_len * p->hq;
    double num = 0, den = 0, lerr = 0;
    for (size_t r = 0; r < rows; r++) {
        if (ref_lse[r] == -INFINITY) {
            ck_assert_msg(p->lse[r] == -INFINITY, "%s: row %zu lse %f, want -inf", what, r,
                          p->lse[r]);
            for (int d = 0; d < D; d++)
                ck_assert_msg(tkvk_bf16_to_float(p->out[r * D + d]) == 0.0f, "%s: empty row %zu", what, r);
            continue;
        }
        ck_assert_msg(isfinite(p->lse[r]), "%s: lse[%zu] not finite", what, r);
        double e = fabs(p->lse[r] - ref_lse[r]);
        lerr = e > lerr ? e : lerr;
        for (int d = 0; d < D; d++) {
            double x = tkvk_bf16_to_float(p->out[r * D + d]);
            ck_assert_msg(!isnan(x), "%s: NaN at row %zu", what, r);
            num += (x - ref[r * D + d]) * (x - ref[r * D + d]);
            den += ref[r * D + d] * ref[r * D + d];
        }
    }
    double rel = den > 0 ? sqrt(num / den) : sqrt(num);
    ck_assert_msg(rel < 5e-3, "%s: relative L2 error %.3g", what, rel);
    ck_assert_msg(lerr < 1e-3, "%s: LSE error %.3g", what, lerr);
}

static void check_all_paths(prob *p, const char *what)
{
    size_t rows = (size_t)p->nreq * p->q_len * p->hq;
    double *ref = malloc(sizeof(double) * rows * p->lay.head_dim);
    double *ref_lse = malloc(sizeof(double) * rows);
    naive(p, ref, ref_lse);
    ck_assert_int_eq(tkvk_decode_cpu(&p->a), TKVK_OK);
    compare(p, ref, ref_lse, what);
    memset(p->out, 0xff, rows * p->lay.head_dim * 2);
    ck_assert_int_eq(tkvk_decode_split_cpu(&p->a, 7, 1), TKVK_OK);
    compare(p, ref, ref_lse, what);
    memset(p->out, 0xff, rows * p->lay.head_dim * 2);
    ck_assert_int_eq(tkvk_decode_static_cpu(&p->a, 3), TKVK_OK);
    compare(p, ref, ref_lse, what);
    free(ref);
    free(ref_lse);
}

/* ---- tests ---------------------------------------------------------------------------------- */

START_TEST(test_fp8_per_tensor)
{
    int32_t lens[4] = {200, 1, 0, 64};
    prob p;
    prob_make(&p, 64, 16, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3, 2, 4, 1,
              lens, 4);
    check_all_paths(&p, "fp8 per-tensor, fp8 Q");
    prob_free(&p);
}
END_TEST

START_TEST(test_fp8_per_token_head_causal)
{
    /* q_len 3: query t sees L - 3 + t + 1 keys; a length of 2 leaves the first query empty */
    int32_t lens[3] = {150, 2, 33};
    prob p;
    prob_make(&p, 64, 32, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TOKEN_HEAD, TKVK_DTYPE_BF16, 1, 3, 3,
              lens, 3);
    check_all_paths(&p, "fp8 per-token-head, causal q_len 3");
    prob_free(&p);
}
END_TEST

START_TEST(test_bf16_kv)
{
    int32_t lens[2] = {130, 17};
    prob p;
    prob_make(&p, 128, 64, TKVK_DTYPE_BF16, TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_BF16, 2, 1, 2, lens,
              2);
    check_all_paths(&p, "bf16 KV, group 1");
    prob_free(&p);
}
END_TEST

START_TEST(test_zero_length)
{
    int32_t lens[2] = {0, 0};
    prob p;
    prob_make(&p, 64, 16, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3, 1, 2, 2,
              lens, 2);
    memset(p.out, 0xff, (size_t)2 * 2 * 2 * 64 * 2);
    ck_assert_int_eq(tkvk_decode_cpu(&p.a), TKVK_OK);
    for (int i = 0; i < 2 * 2 * 2; i++) {
        ck_assert(p.lse[i] == -INFINITY);
        for (int d = 0; d < 64; d++)
            ck_assert_uint_eq(p.out[i * 64 + d], 0);
    }
    prob_free(&p);
}
END_TEST

START_TEST(test_planner_invariants)
{
    int32_t lens[6] = {0, 1, 64, 65, 5000, 700};
    int hkv = 3, grid = 11;
    tkvk_decode_map m;
    ck_assert_int_eq(tkvk_decode_map_init(&m, 6 * hkv, grid), TKVK_OK);
    for (int floor_tiles = 1; floor_tiles <= 64; floor_tiles *= 4) {
        ck_assert_int_eq(tkvk_decode_plan_cpu(lens, 6, hkv, grid, floor_tiles, 1, &m), TKVK_OK);
        int total = 0;
        for (int r = 0; r < 6; r++)
            total += hkv * ((lens[r] + 63) / 64);
        ck_assert_int_eq(m.num_tiles, total);
        ck_assert_int_ge(m.tiles_per_cta, floor_tiles);
        ck_assert_int_ge(m.tiles_per_cta * grid, total);
        ck_assert_int_le(m.num_bins, grid);
        ck_assert_int_le(m.num_tasks, m.num_pairs + grid);
        /* every pair's tiles covered once, in order, by its own tasks */
        for (int pr = 0; pr < 6 * hkv; pr++) {
            int tiles = (lens[pr / hkv] + 63) / 64, next = 0;
            for (int i = 0; i < m.pair_count[pr]; i++) {
                const tkvk_decode_task *t = &m.tasks[m.pair_first[pr] + i];
                ck_assert_int_eq(t->request, pr / hkv);
                ck_assert_int_eq(t->kv_head, pr % hkv);
                ck_assert_int_eq(t->tile_begin, next);
                ck_assert_int_gt(t->tile_end, t->tile_begin);
                next = t->tile_end;
            }
            ck_assert_int_eq(next, tiles);
        }
        /* bins: contiguous, at most tiles_per_cta tiles each, the last ones empty */
        for (int b = 0; b < grid; b++) {
            ck_assert_int_le(m.bin_first[b], m.bin_first[b + 1]);
            int n = 0;
            for (int d = m.bin_first[b]; d < m.bin_first[b + 1]; d++)
                n += m.tasks[d].tile_end - m.tasks[d].tile_begin;
            ck_assert_int_le(n, m.tiles_per_cta);
            if (b >= m.num_bins)
                ck_assert_int_eq(n, 0);
        }
        ck_assert_int_eq(m.bin_first[grid], m.num_tasks);
    }
    /* slots, against a direct reading of their definition: the CTAs (ceil(grid / warps)) take
     * the bins in order, the first bins % CTAs of them one more than the others; a task
     * shares its predecessor's slot exactly when the CTAs take TKVK__DECODE_MIN_JOIN bins or
     * more, both tasks are the whole of their (full) bins, of the same pair, and its bin is
     * not the first of its CTA; with one warp per CTA, slot = task */
    int total_joins = 0;
    for (int per = 1; per <= 4; per *= 3)
        for (int warps = 1; warps <= 8; warps++) {
            ck_assert_int_eq(tkvk_decode_plan_cpu(lens, 6, hkv, grid, per, warps, &m), TKVK_OK);
            const int ctas = (grid + warps - 1) / warps;
            ck_assert_int_eq(m.bins_per_cta, (m.num_bins + ctas - 1) / ctas);
            ck_assert_int_le(m.bins_per_cta, warps);
            bool cta_start[64] = {false};
            for (int c = 0, b = 0; c < ctas; c++) {
                cta_start[b] = true;
                b += m.num_bins / ctas + (c < m.num_bins % ctas);
            }
            const bool joining = m.num_bins / ctas >= TKVK__DECODE_MIN_JOIN;
            int bin_of[64], expect = -1;
            ck_assert_int_le(m.num_tasks, 64);
            for (int b = 0; b < grid; b++)
                for (int d = m.bin_first[b]; d < m.bin_first[b + 1]; d++)
                    bin_of[d] = b;
            for (int d = 0; d < m.num_tasks; d++) {
                int b = bin_of[d];
                bool alone = m.bin_first[b + 1] - m.bin_first[b] == 1 &&
                             m.tasks[d].tile_end - m.tasks[d].tile_begin == m.tiles_per_cta;
                bool joins = d > 0 && alone && joining && !cta_start[b] && bin_of[d - 1] == b - 1 &&
                             m.bin_first[b] - m.bin_first[b - 1] == 1 &&
                             m.tasks[d - 1].request == m.tasks[d].request &&
                             m.tasks[d - 1].kv_head == m.tasks[d].kv_head;
                expect += joins ? 0 : 1;
                total_joins += joins;
                ck_assert_int_eq(m.task_slot[d], expect);
                if (warps == 1)
                    ck_assert_int_eq(m.task_slot[d], d);
            }
            ck_assert_int_eq(m.num_slots, expect + 1);
            for (int pr = 0; pr < 6 * hkv; pr++) {
                int n = m.pair_count[pr];
                if (n == 0) {
                    ck_assert_int_eq(m.slot_count[pr], 0);
                    continue;
                }
                ck_assert_int_eq(m.slot_first[pr], m.task_slot[m.pair_first[pr]]);
                ck_assert_int_eq(m.slot_first[pr] + m.slot_count[pr] - 1,
                                 m.task_slot[m.pair_first[pr] + n - 1]);
            }
        }
    ck_assert_int_gt(total_joins, 0); /* the cases above do merge some slots */
    /* too small a map is refused, and a CTA of no warps */
    ck_assert_int_eq(tkvk_decode_plan_cpu(lens, 6, hkv, grid + 1, 1, 1, &m), TKVK_EINVAL);
    ck_assert_int_eq(tkvk_decode_plan_cpu(lens, 6, hkv, grid, 1, 0, &m), TKVK_EINVAL);
    tkvk_decode_map_free(&m);
    tkvk_decode_map_free(&m); /* idempotent */
}
END_TEST

START_TEST(test_merge_states)
{
    /* prefix [0, 128) and suffix [128, L) computed separately, merged = the whole */
    int32_t lens[1] = {300};
    prob whole;
    prob_make(&whole, 64, 64, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3, 1, 4,
              1, lens, 1);
    ck_assert_int_eq(tkvk_decode_cpu(&whole.a), TKVK_OK);
    int rows = 4, D = 64;
    uint16_t oa[4 * 64], ob[4 * 64], om[4 * 64];
    float la[4], lb[4], lm[4];
    tkvk_decode_args a = whole.a;
    int32_t len_a = 128, len_b = 300 - 128;
    a.kv_lens = &len_a;
    a.out = oa;
    a.lse = la;
    ck_assert_int_eq(tkvk_decode_cpu(&a), TKVK_OK);
    a.kv_lens = &len_b;
    a.block_table = whole.table + 2; /* pages 2.. of the request: positions 128.. */
    a.out = ob;
    a.lse = lb;
    ck_assert_int_eq(tkvk_decode_cpu(&a), TKVK_OK);
    ck_assert_int_eq(tkvk_merge_states_cpu(oa, la, ob, lb, rows, D, om, lm), TKVK_OK);
    for (int i = 0; i < rows; i++) {
        ck_assert_msg(fabsf(lm[i] - whole.lse[i]) < 1e-4, "lse %f vs %f", lm[i], whole.lse[i]);
        for (int d = 0; d < D; d++) {
            float x = tkvk_bf16_to_float(om[i * D + d]), y = tkvk_bf16_to_float(whole.out[i * D + d]);
            ck_assert_msg(fabsf(x - y) <= 0.01f * fabsf(y) + 1e-3f, "O %f vs %f", x, y);
        }
    }
    /* merging with an empty set (-inf; its O is never read, even NaN) is the identity */
    float linf[4] = {-INFINITY, -INFINITY, -INFINITY, -INFINITY};
    uint16_t onan[4 * 64];
    for (int i = 0; i < rows * D; i++)
        onan[i] = 0x7fc0;
    ck_assert_int_eq(tkvk_merge_states_cpu(oa, la, onan, linf, rows, D, om, lm), TKVK_OK);
    ck_assert_int_eq(memcmp(om, oa, sizeof om), 0);
    for (int i = 0; i < rows; i++)
        ck_assert(lm[i] == la[i]);
    /* a set merged with itself: the same O, LSE + 1 */
    ck_assert_int_eq(tkvk_merge_states_cpu(oa, la, oa, la, rows, D, om, lm), TKVK_OK);
    ck_assert_int_eq(memcmp(om, oa, sizeof om), 0);
    for (int i = 0; i < rows; i++)
        ck_assert(fabsf(lm[i] - (la[i] + 1.0f)) < 1e-5f);
    /* two empty sets: O = 0, LSE = -inf */
    ck_assert_int_eq(tkvk_merge_states_cpu(onan, linf, onan, linf, rows, D, om, lm), TKVK_OK);
    for (int i = 0; i < rows; i++) {
        ck_assert(lm[i] == -INFINITY);
        ck_assert_uint_eq(om[i * D], 0);
    }
    prob_free(&whole);
}
END_TEST

START_TEST(test_refusals)
{
    int32_t lens[2] = {40, 20};
    prob p;
    prob_make(&p, 64, 16, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, TKVK_DTYPE_FP8_E4M3, 1, 2, 1,
              lens, 2);
    tkvk_decode_args a = p.a;
    a.num_q_heads = 17; /* group 17 */
    ck_assert_int_eq(tkvk_decode_cpu(&a), TKVK_EUNSUPPORTED);
    ck_assert(strlen(tkvk_last_error()) > 0);
    a = p.a;
    a.num_q_heads = 3;
    p.lay.num_kv_heads = 2;
    ck_assert_int_eq(tkvk_decode_cpu(&a), TKVK_EINVAL); /* not a multiple */
    p.lay.num_kv_heads = 1;
    a = p.a;
    a.q_len = 9;
    ck_assert_int_eq(tkvk_decode_cpu(&a), TKVK_EUNSUPPORTED);
    a = p.a;
    a.q_dtype = 7;
    ck_assert_int_eq(tkvk_decode_cpu(&a), TKVK_EINVAL);
    a = p.a;
    a.q = NULL;
    ck_assert_int_eq(tkvk_decode_cpu(&a), TKVK_EINVAL);
    a = p.a;
    a.layer = 2;
    ck_assert_int_eq(tkvk_decode_cpu(&a), TKVK_EINVAL);
    a = p.a;
    int32_t too_long[2] = {40, 10000};
    a.kv_lens = too_long;
    ck_assert_int_eq(tkvk_decode_cpu(&a), TKVK_EINVAL);
    ck_assert(strstr(tkvk_last_error(), "kv_lens") != NULL);
    p.table[0] = p.num_blocks + 5; /* a block id outside the pool */
    ck_assert_int_eq(tkvk_decode_cpu(&p.a), TKVK_EINVAL);
    ck_assert(strstr(tkvk_last_error(), "block_table") != NULL);
    p.table[0] = 0;
    a = p.a;
    a.q_scales = NULL;
    ck_assert_int_eq(tkvk_decode_split_cpu(&a, 4, 1), TKVK_EINVAL);
    ck_assert_int_eq(tkvk_decode_static_cpu(&p.a, 0), TKVK_EINVAL);
    ck_assert_int_eq(tkvk_merge_states_cpu(NULL, NULL, NULL, NULL, 1, 64, NULL, NULL), TKVK_EINVAL);
    ck_assert_int_eq(tkvk_decode_cpu(NULL), TKVK_EINVAL);
    prob_free(&p);
}
END_TEST

static Suite *decode_suite(void)
{
    Suite *s = suite_create("decode");
    TCase *tc = tcase_create("cpu");
    tcase_add_test(tc, test_fp8_per_tensor);
    tcase_add_test(tc, test_fp8_per_token_head_causal);
    tcase_add_test(tc, test_bf16_kv);
    tcase_add_test(tc, test_zero_length);
    tcase_add_test(tc, test_planner_invariants);
    tcase_add_test(tc, test_merge_states);
    tcase_add_test(tc, test_refusals);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    SRunner *sr = srunner_create(decode_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
