/* test_prologue.c - the fused prologue's CPU reference (kernels/prologue.c).
 *
 * Properties checked through the public entry point: RoPE is a rotation (norms kept, position 0
 * is the identity, NeoX and GPT-J pair the right elements), the Hadamard rotation is
 * orthonormal and its own inverse, RMSNorm gives unit RMS, the FP8 scales and codes follow the
 * header's formulas, K/V land exactly in the mapped slots, the tail of a last page is zeroed
 * and nothing else is touched, and unsupported shapes are refused without writing anything.
 * A sweep over the supported configurations compares the reference with an independent
 * double-precision computation (Hadamard as a matrix product) within FP8 rounding. */
#include <check.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_kernels.h"

/* ---- a small random source and a test fixture ---------------------------------------------- */

static uint64_t rng_state = 0x9e3779b97f4a7c15ull;
static double rnd(void) /* uniform [-1, 1) */
{
    rng_state ^= rng_state << 13;
    rng_state ^= rng_state >> 7;
    rng_state ^= rng_state << 17;
    return (double)(rng_state >> 11) / (double)(1ull << 52) - 1.0;
}

typedef struct fixture {
    tkvk_layout lay;
    tkvk_prologue_params p;
    int hq, tokens, max_pos, blocks;
    uint16_t *qkv;
    int32_t *pos;
    float *cos_t, *sin_t, *qw, *kw, *vhs, *qscale;
    void *qout;
    uint8_t *pool;
    int64_t *slots, last_slot[4];
} fixture;

static void fx_init(fixture *f, int hq, int hkv, int d, int P, int kv_dtype, int scale_mode,
                    int tokens)
{
    memset(f, 0, sizeof *f);
    ck_assert_int_eq(tkvk_layout_init(&f->lay, 2, hkv, d, P, kv_dtype, scale_mode), TKVK_OK);
    f->hq = hq;
    f->tokens = tokens;
    f->max_pos = 64;
    f->blocks = (tokens + P - 1) / P + 3;
    size_t row = (size_t)(hq + 2 * hkv) * d;
    f->qkv = calloc(row * (tokens ? tokens : 1), 2);
    for (size_t i = 0; i < row * tokens; i++)
        f->qkv[i] = tkvk_bf16_from_float((float)(rnd() * 3.0));
    f->pos = calloc(tokens + 1, sizeof *f->pos);
    for (int t = 0; t < tokens; t++)
        f->pos[t] = (t * 37 + 5) % f->max_pos;
    f->cos_t = calloc((size_t)f->max_pos * d / 2, sizeof(float));
    f->sin_t = calloc((size_t)f->max_pos * d / 2, sizeof(float));
    for (int ps = 0; ps < f->max_pos; ps++)
        for (int i = 0; i < d / 2; i++) {
            double ang = ps * pow(10000.0, -2.0 * i / d);
            f->cos_t[(size_t)ps * d / 2 + i] = (float)cos(ang);
            f->sin_t[(size_t)ps * d / 2 + i] = (float)sin(ang);
        }
    f->qw = calloc(d, sizeof(float));
    f->kw = calloc(d, sizeof(float));
    for (int i = 0; i < d; i++) {
        f->qw[i] = (float)(1.0 + 0.5 * rnd());
        f->kw[i] = (float)(1.0 + 0.5 * rnd());
    }
    f->vhs = calloc(hkv, sizeof(float));
    for (int h = 0; h < hkv; h++)
        f->vhs[h] = (float)(0.01 + 0.005 * (h + 1));
    f->qscale = calloc((size_t)(tokens + 1) * hq, sizeof(float));
    f->qout = calloc((size_t)(tokens + 1) * hq * d, 2);
    f->pool = malloc(f->blocks * f->lay.block_stride);
    memset(f->pool, 0xab, f->blocks * f->lay.block_stride); /* poison */
    /* Slots: request 0 takes blocks 1, 2, .. from offset 0; every 7th token is not stored. */
    f->slots = calloc(tokens + 1, sizeof *f->slots);
    for (int t = 0; t < tokens; t++)
        f->slots[t] = (t % 7 == 3) ? -1 : (int64_t)P + t;
    f->last_slot[0] = tokens ? (int64_t)P + tokens - 1 : -1;

    tkvk_prologue_params *p = &f->p;
    tkvk_prologue_params_init(p);
    p->qkv = f->qkv;
    p->num_tokens = tokens;
    p->num_q_heads = hq;
    p->positions = f->pos;
    p->rope_cos = f->cos_t;
    p->rope_sin = f->sin_t;
    p->max_pos = f->max_pos;
    p->q_norm_weight = f->qw;
    p->k_norm_weight = f->kw;
    p->q_out = f->qout;
    p->q_scale_out = f->qscale;
    p->layout = &f->lay;
    p->layer = 1;
    p->pool = f->pool;
    p->num_blocks = f->blocks;
    p->slot_mapping = f->slots;
    p->k_scale = 0.02f;
    p->v_scale = 0.015f;
    p->v_head_scales = f->vhs;
    p->num_reqs = 1;
    p->req_last_slot = f->last_slot;
}

static void fx_free(fixture *f)
{
    free(f->qkv);
    free(f->pos);
    free(f->cos_t);
    free(f->sin_t);
    free(f->qw);
    free(f->kw);
    free(f->vhs);
    free(f->qscale);
    free(f->qout);
    free(f->pool);
    free(f->slots);
}

static double l2(const double *x, int n)
{
    double s = 0;
    for (int i = 0; i < n; i++)
        s += x[i] * x[i];
    return sqrt(s);
}

/* Q head h of token t as floats (BF16 Q out). */
static void q_bf16(const fixture *f, int t, int h, double *out)
{
    int d = f->lay.head_dim;
    const uint16_t *q = (const uint16_t *)f->qout + ((size_t)t * f->hq + h) * d;
    for (int i = 0; i < d; i++)
        out[i] = tkvk_bf16_to_float(q[i]);
}

static void in_head(const fixture *f, int t, int h, double *out)
{
    int d = f->lay.head_dim;
    size_t row = (size_t)(f->hq + 2 * f->lay.num_kv_heads) * d;
    for (int i = 0; i < d; i++)
        out[i] = tkvk_bf16_to_float(f->qkv[t * row + (size_t)h * d + i]);
}

/* ---- RoPE ---------------------------------------------------------------------------------- */

START_TEST(rope_is_a_rotation)
{
    for (int style = 0; style < 2; style++) {
        fixture f;
        fx_init(&f, 4, 2, 128, 16, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, 9);
        f.p.q_dtype = TKVK_DTYPE_BF16;
        f.p.rope_style = style;
        f.pos[0] = 0; /* identity */
        ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
        double in[256], out[256];
        for (int t = 0; t < 9; t++)
            for (int h = 0; h < 4; h++) {
                in_head(&f, t, h, in);
                q_bf16(&f, t, h, out);
                double ni = l2(in, 128), no = l2(out, 128);
                ck_assert_msg(fabs(ni - no) <= 4e-3 * ni, "norm %g -> %g", ni, no);
                if (t == 0)
                    for (int i = 0; i < 128; i++)
                        ck_assert_msg(in[i] == out[i], "position 0 must be the identity");
            }
        /* Pairing: at position p the pair (a, b) rotates by angle(p, i), so the pair's norm
         * is kept pair by pair, NeoX pairs (i, i+64) and GPT-J (2i, 2i+1). */
        in_head(&f, 5, 1, in);
        q_bf16(&f, 5, 1, out);
        for (int i = 0; i < 64; i++) {
            int a = style == TKVK_ROPE_NEOX ? i : 2 * i, b = style == TKVK_ROPE_NEOX ? i + 64 : 2 * i + 1;
            double c = f.cos_t[(size_t)f.pos[5] * 64 + i], s = f.sin_t[(size_t)f.pos[5] * 64 + i];
            double ea = in[a] * c - in[b] * s, eb = in[b] * c + in[a] * s;
            ck_assert_msg(fabs(out[a] - ea) <= 1e-2 * (fabs(ea) + 1e-2), "style %d pair %d", style, i);
            ck_assert_msg(fabs(out[b] - eb) <= 1e-2 * (fabs(eb) + 1e-2), "style %d pair %d", style, i);
        }
        fx_free(&f);
    }
}
END_TEST

/* ---- Hadamard ------------------------------------------------------------------------------ */

/* Position 0 makes RoPE the identity, so the prologue is x -> H x (rounded to BF16). */
START_TEST(hadamard_is_orthonormal_and_involutive)
{
    const int dims[3] = {64, 128, 256};
    for (int di = 0; di < 3; di++) {
        int d = dims[di];
        fixture f;
        fx_init(&f, 1, 1, d, 16, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, 1);
        size_t row = (size_t)3 * d;
        f.p.q_dtype = TKVK_DTYPE_BF16;
        f.p.hadamard = 1;
        f.pos[0] = 0;
        /* Basis vectors: H e_j is column j, entries +-1/sqrt(d) with the Sylvester sign. */
        for (int j = 0; j < d; j += 7) {
            memset(f.qkv, 0, row * 2);
            f.qkv[j] = tkvk_bf16_from_float(1.0f);
            ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
            double col[256];
            q_bf16(&f, 0, 0, col);
            for (int i = 0; i < d; i++) {
                double want = (__builtin_popcount((unsigned)(i & j)) & 1 ? -1.0 : 1.0) / sqrt(d);
                ck_assert_msg(fabs(col[i] - want) <= 4e-3 * fabs(want), "d %d H[%d][%d]", d, i, j);
            }
        }
        /* Twice gives the input back (up to the BF16 rounding of the intermediate). */
        double x[256], hx[256], hhx[256];
        for (int i = 0; i < d; i++)
            f.qkv[i] = tkvk_bf16_from_float((float)rnd());
        in_head(&f, 0, 0, x);
        ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
        q_bf16(&f, 0, 0, hx);
        ck_assert_msg(fabs(l2(hx, d) - l2(x, d)) <= 4e-3 * l2(x, d), "norm kept");
        for (int i = 0; i < d; i++)
            f.qkv[i] = tkvk_bf16_from_float((float)hx[i]);
        ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
        q_bf16(&f, 0, 0, hhx);
        for (int i = 0; i < d; i++)
            ck_assert_msg(fabs(hhx[i] - x[i]) <= 0.02 * l2(x, d) / sqrt(d), "d %d i %d: %g vs %g",
                          d, i, hhx[i], x[i]);
        fx_free(&f);
    }
    ck_assert_float_eq(tkvk_hadamard_scale(64) * tkvk_hadamard_scale(64) * 64.0f, 1.0f);
    ck_assert(fabs(tkvk_hadamard_scale(128) * sqrt(128.0) - 1.0) < 1e-7);
}
END_TEST

/* ---- RMSNorm ------------------------------------------------------------------------------- */

START_TEST(rms_norm_gives_unit_rms)
{
    for (int mode = TKVK_NORM_BEFORE_ROPE; mode <= TKVK_NORM_AFTER_ROPE; mode++) {
        fixture f;
        fx_init(&f, 2, 1, 64, 16, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, 5);
        for (int i = 0; i < 64; i++)
            f.qw[i] = 1.0f;
        f.p.q_dtype = TKVK_DTYPE_BF16;
        f.p.norm_mode = mode;
        ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
        double q[256];
        for (int t = 0; t < 5; t++) {
            q_bf16(&f, t, 1, q);
            double rms = l2(q, 64) / 8.0;
            ck_assert_msg(fabs(rms - 1.0) < 5e-3, "mode %d rms %g", mode, rms);
        }
        fx_free(&f);
    }
}
END_TEST

/* ---- FP8 scales and codes ------------------------------------------------------------------ */

START_TEST(quant_scales_follow_the_formulas)
{
    fixture f;
    fx_init(&f, 4, 2, 128, 32, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TOKEN_HEAD, 6);
    ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
    /* Q: position 0 -> identity transform, so the scale is amax(input)/448 and codes are the
     * input divided by the scale. Use token with pos 0. */
    f.pos[0] = 0;
    ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
    double in[256];
    for (int h = 0; h < 4; h++) {
        in_head(&f, 0, h, in);
        double amax = 0;
        for (int i = 0; i < 128; i++)
            amax = fmax(amax, fabs(in[i]));
        float scale = f.qscale[h];
        ck_assert_float_eq(scale, fmaxf((float)amax / 448.0f, TKVK_MIN_SCALE));
        const uint8_t *codes = (const uint8_t *)f.qout + (size_t)h * 128;
        int saw_max = 0;
        for (int i = 0; i < 128; i++) {
            ck_assert_uint_eq(codes[i], tkvk_fp8_from_float((float)in[i] * (1.0f / scale)));
            if ((codes[i] & 0x7f) == 0x7e)
                saw_max = 1;
            double deq = tkvk_fp8_to_float(codes[i]) * scale;
            ck_assert_msg(fabs(deq - in[i]) <= fabs(in[i]) / 16.0 + scale / 512.0, "dequant");
        }
        ck_assert_msg(saw_max, "the largest element must use the top code");
    }
    /* K per-token-head: the scale is in the page; V: per-head scale parameter. */
    const tkvk_layout *L = &f.lay;
    uint8_t *layer = f.pool + L->layer_stride; /* layer 1 */
    for (int t = 0; t < 6; t++) {
        if (f.slots[t] < 0)
            continue;
        int64_t s = f.slots[t];
        uint8_t *page = layer + (size_t)(s / 32) * L->block_stride;
        int off = (int)(s % 32);
        for (int h = 0; h < 2; h++) {
            float ks;
            memcpy(&ks, page + L->kscale_offset + ((size_t)off * 2 + h) * 4, 4);
            ck_assert_msg(ks > 0.0f, "K scale stored");
            const uint8_t *k = page + (size_t)off * L->token_stride + (size_t)h * 128;
            int top = 0;
            for (int i = 0; i < 128; i++)
                top |= (k[i] & 0x7f) == 0x7e;
            ck_assert_msg(top, "dynamic K scale uses the top code");
            const uint8_t *v = page + L->v_offset + (size_t)off * L->token_stride + (size_t)h * 128;
            in_head(&f, t, 4 + 2 + h, in);
            for (int i = 0; i < 128; i++)
                ck_assert_uint_eq(v[i], tkvk_fp8_from_float((float)in[i] * (1.0f / f.vhs[h])));
        }
    }
    fx_free(&f);
}
END_TEST

START_TEST(per_tensor_and_bf16_pools)
{
    for (int dt = 0; dt < 2; dt++) {
        fixture f;
        fx_init(&f, 2, 2, 64, 16, dt, TKVK_SCALE_PER_TENSOR, 4);
        ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
        const tkvk_layout *L = &f.lay;
        double in[256];
        for (int t = 0; t < 4; t++) {
            if (f.slots[t] < 0)
                continue;
            uint8_t *page = f.pool + L->layer_stride + (size_t)(f.slots[t] / 16) * L->block_stride;
            int off = (int)(f.slots[t] % 16);
            in_head(&f, t, 2 + 2 + 1, in); /* V head 1: stored without transforms */
            const uint8_t *v = page + L->v_offset + (size_t)off * L->token_stride + 64 * L->elem_bytes;
            for (int i = 0; i < 64; i++) {
                if (dt == TKVK_DTYPE_FP8_E4M3) {
                    ck_assert_uint_eq(v[i], tkvk_fp8_from_float((float)in[i] * (1.0f / 0.015f)));
                } else {
                    uint16_t b;
                    memcpy(&b, v + 2 * i, 2);
                    ck_assert_float_eq(tkvk_bf16_to_float(b), (float)in[i]);
                }
            }
        }
        fx_free(&f);
    }
}
END_TEST

/* ---- slots, poison and the tail ------------------------------------------------------------ */

static int row_is(const uint8_t *p, size_t n, uint8_t v)
{
    for (size_t i = 0; i < n; i++)
        if (p[i] != v)
            return 0;
    return 1;
}

START_TEST(slots_and_tail_zero_fill)
{
    const int Ps[4] = {16, 32, 64, 128};
    for (int pi = 0; pi < 4; pi++) {
        for (int mode = 0; mode < 2; mode++) {
            int P = Ps[pi], tokens = P + P / 2 + 3; /* ends mid-page */
            fixture f;
            fx_init(&f, 2, 2, 64, P, TKVK_DTYPE_FP8_E4M3, mode, tokens);
            ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
            const tkvk_layout *L = &f.lay;
            int64_t last = f.last_slot[0];
            for (int b = 0; b < f.blocks; b++)
                for (int l = 0; l < 2; l++) {
                    uint8_t *base = f.pool + (size_t)b * L->block_stride + (size_t)l * L->layer_stride;
                    for (int off = 0; off < P; off++) {
                        int64_t slot = (int64_t)b * P + off;
                        int t = (int)(slot - P);
                        int mapped = l == 1 && t >= 0 && t < tokens && f.slots[t] == slot;
                        int tail = l == 1 && b == last / P && off > last % P;
                        uint8_t *k = base + (size_t)off * L->token_stride;
                        uint8_t *v = base + L->v_offset + (size_t)off * L->token_stride;
                        uint8_t *ks = base + L->kscale_offset + (size_t)off * 2 * 4;
                        if (tail) {
                            ck_assert_msg(row_is(k, L->token_stride, 0) && row_is(v, L->token_stride, 0),
                                          "P %d tail row %d zeroed", P, off);
                            if (mode)
                                ck_assert(row_is(ks, 8, 0));
                        } else if (!mapped) {
                            ck_assert_msg(row_is(k, L->token_stride, 0xab) &&
                                          row_is(v, L->token_stride, 0xab),
                                          "P %d block %d layer %d row %d untouched", P, b, l, off);
                            if (mode)
                                ck_assert(row_is(ks, 8, 0xab));
                        } else {
                            ck_assert_msg(!row_is(k, L->token_stride, 0xab), "mapped row written");
                            if (mode)
                                ck_assert(!row_is(ks, 8, 0xab));
                        }
                    }
                    /* The padding after the in-page scales (16-byte rounding) is untouched. */
                    size_t used = mode ? L->kscale_offset + (size_t)P * 2 * 4 : 2 * (size_t)P * L->token_stride;
                    ck_assert(row_is(base + used, L->layer_stride - used, 0xab));
                }
            fx_free(&f);
        }
    }
}
END_TEST

/* ---- refusals ------------------------------------------------------------------------------ */

START_TEST(unsupported_shapes_are_refused)
{
    fixture f;
    fx_init(&f, 4, 2, 64, 16, TKVK_DTYPE_FP8_E4M3, TKVK_SCALE_PER_TENSOR, 3);
    tkvk_layout bad = f.lay;
    tkvk_prologue_params p = f.p;

    p.num_q_heads = 5; /* not a multiple of 2 */
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EUNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(tkvk_last_error(), "multiple"));
    p.num_q_heads = 34; /* group 17 */
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EUNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(tkvk_last_error(), "group 17"));
    p.num_q_heads = 32; /* group 16: fine (shape-wise), but qkv would be too short: use check only */

    p = f.p;
    bad.head_dim = 96;
    p.layout = &bad;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EUNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(tkvk_last_error(), "head_dim 96"));
    bad = f.lay;
    bad.page_tokens = 8;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EUNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(tkvk_last_error(), "page_tokens 8"));

    p = f.p;
    p.layer = 2;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EINVAL);
    p = f.p;
    p.rope_style = 7;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EINVAL);
    p = f.p;
    p.norm_mode = TKVK_NORM_AFTER_ROPE;
    p.k_norm_weight = NULL;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EINVAL);
    p = f.p;
    p.k_scale = 0.0f;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EINVAL);
    p = f.p;
    p.qkv_stride = 10;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EINVAL);

    /* Data-dependent refusals write nothing. */
    memset(f.qout, 0x5a, (size_t)3 * 4 * 64);
    p = f.p;
    f.pos[2] = f.max_pos;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EINVAL);
    ck_assert_ptr_nonnull(strstr(tkvk_last_error(), "positions[2]"));
    f.pos[2] = 0;
    f.slots[1] = (int64_t)f.blocks * 16;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EINVAL);
    ck_assert_ptr_nonnull(strstr(tkvk_last_error(), "slot_mapping[1]"));
    f.slots[1] = -2;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EINVAL);
    f.slots[1] = 1;
    f.last_slot[0] = -5;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_EINVAL);
    ck_assert(row_is(f.qout, (size_t)3 * 4 * 64, 0x5a));
    ck_assert(row_is(f.pool, f.blocks * f.lay.block_stride, 0xab));
    f.last_slot[0] = -1;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_OK);

    ck_assert_int_eq(tkvk_prologue_cpu(NULL), TKVK_EINVAL);
    p = f.p;
    p.num_tokens = 0; /* no tokens: only the tail work, pointers to token data not needed */
    p.qkv = NULL;
    ck_assert_int_eq(tkvk_prologue_cpu(&p), TKVK_OK);
#ifdef TKVK_HAVE_CUDA
    if (!tkvk_cuda_available()) {
        ck_assert_int_eq(tkvk_prologue_cuda(&f.p, NULL), TKVK_ENODEV);
        ck_assert_str_ne(tkvk_last_error(), "");
    }
#endif
    fx_free(&f);
}
END_TEST

/* ---- the whole configuration space against an independent double computation --------------- */

static void ref_double(const fixture *f, int t, int h, double *x)
{
    int d = f->lay.head_dim, hq = f->hq, hkv = f->lay.num_kv_heads;
    in_head(f, t, h, x);
    if (h >= hq + hkv)
        return;
    const float *w = h < hq ? f->qw : f->kw;
    const tkvk_prologue_params *p = &f->p;
    for (int step = 0; step < 3; step++) {
        int norm_now = (step == 0 && p->norm_mode == TKVK_NORM_BEFORE_ROPE) ||
                       (step == 2 && p->norm_mode == TKVK_NORM_AFTER_ROPE);
        if (norm_now) {
            double ss = 0;
            for (int i = 0; i < d; i++)
                ss += x[i] * x[i];
            double inv = 1.0 / sqrt(ss / d + p->norm_eps);
            for (int i = 0; i < d; i++)
                x[i] = x[i] * inv * w[i];
        }
        if (step == 1) {
            double y[256];
            memcpy(y, x, sizeof(double) * d);
            for (int i = 0; i < d / 2; i++) {
                int a = p->rope_style == TKVK_ROPE_NEOX ? i : 2 * i;
                int b = p->rope_style == TKVK_ROPE_NEOX ? i + d / 2 : 2 * i + 1;
                double c = f->cos_t[(size_t)f->pos[t] * d / 2 + i];
                double s = f->sin_t[(size_t)f->pos[t] * d / 2 + i];
                x[a] = y[a] * c - y[b] * s;
                x[b] = y[b] * c + y[a] * s;
            }
        }
    }
    if (p->hadamard) {
        /* Walsh-Hadamard in double: the butterflies, then 1/sqrt(d) (H's entries are
         * +-1/sqrt(d); hadamard_is_orthonormal_and_involutive checks them one by one). */
        for (int h = 1; h < d; h *= 2)
            for (int i = 0; i < d; i++)
                if (!(i & h)) {
                    double a = x[i], b = x[i + h];
                    x[i] = a + b;
                    x[i + h] = a - b;
                }
        for (int i = 0; i < d; i++)
            x[i] /= sqrt(d);
    }
}

static void expect_close(const uint8_t *codes, const uint16_t *bf, float scale, const double *x,
                         int d, const char *what)
{
    double amax = 0;
    for (int i = 0; i < d; i++)
        amax = fmax(amax, fabs(x[i]));
    for (int i = 0; i < d; i++) {
        double got = codes ? tkvk_fp8_to_float(codes[i]) * (double)scale
                           : (double)tkvk_bf16_to_float(bf[i]);
        /* FP8: half a step (1/16 relative) + subnormal step; BF16: 2^-8 relative. Plus the
         * float-vs-double difference of the transforms, relative to the head's magnitude. */
        double tol = codes ? fabs(x[i]) / 15.0 + scale / 500.0 : fabs(x[i]) / 200.0;
        tol += 2e-5 * amax;
        ck_assert_msg(fabs(got - x[i]) <= tol, "%s[%d]: got %g want %g", what, i, got, x[i]);
    }
}

START_TEST(sweep_against_double_reference)
{
    const int dims[3] = {64, 128, 256}, groups[3] = {1, 3, 16};
    int configs = 0;
    /* Every combination of head dim, group, RoPE style, norm mode and Hadamard; the KV scale
     * mode and the Q dtype cycle through theirs along the way (each meets every head dim,
     * group and mode). Kept small: this suite also runs under ASan in CI. */
    for (int di = 0; di < 3; di++)
        for (int gi = 0; gi < 3; gi++)
            for (int rs = 0; rs < 2; rs++)
                for (int nm = 0; nm < 3; nm++)
                    for (int had = 0; had < 2; had++) {
                                int sm = configs % 3, qd = (configs / 3 + di) % 2;
                                int d = dims[di], hkv = gi == 2 ? 1 : 2, hq = hkv * groups[gi];
                                int kv_dtype = sm == 2 ? TKVK_DTYPE_BF16 : TKVK_DTYPE_FP8_E4M3;
                                int smode = sm == 1 ? TKVK_SCALE_PER_TOKEN_HEAD : TKVK_SCALE_PER_TENSOR;
                                int P = 16 << ((di + gi + rs) % 4);
                                fixture f;
                                fx_init(&f, hq, hkv, d, P, kv_dtype, smode, 3);
                                f.p.rope_style = rs;
                                f.p.norm_mode = nm;
                                f.p.hadamard = had;
                                f.p.q_dtype = qd ? TKVK_DTYPE_BF16 : TKVK_DTYPE_FP8_E4M3;
                                ck_assert_int_eq(tkvk_prologue_cpu(&f.p), TKVK_OK);
                                const tkvk_layout *L = &f.lay;
                                double x[256];
                                for (int t = 0; t < 3; t++)
                                    for (int h = 0; h < hq + 2 * hkv; h++) {
                                        ref_double(&f, t, h, x);
                                        if (h < hq) {
                                            size_t at = ((size_t)t * hq + h) * d;
                                            if (qd)
                                                expect_close(NULL, (uint16_t *)f.qout + at, 0, x, d, "q");
                                            else
                                                expect_close((uint8_t *)f.qout + at, NULL,
                                                             f.qscale[t * hq + h], x, d, "q");
                                            continue;
                                        }
                                        if (f.slots[t] < 0)
                                            continue;
                                        int is_v = h >= hq + hkv, kh = is_v ? h - hq - hkv : h - hq;
                                        uint8_t *page = f.pool + L->layer_stride +
                                                        (size_t)(f.slots[t] / P) * L->block_stride;
                                        int off = (int)(f.slots[t] % P);
                                        uint8_t *row = page + (is_v ? L->v_offset : 0) +
                                                       (size_t)off * L->token_stride +
                                                       (size_t)kh * d * L->elem_bytes;
                                        float scale = is_v ? f.p.v_scale : f.p.k_scale;
                                        if (smode == TKVK_SCALE_PER_TOKEN_HEAD) {
                                            if (is_v)
                                                scale = f.vhs[kh];
                                            else
                                                memcpy(&scale, page + L->kscale_offset +
                                                       ((size_t)off * hkv + kh) * 4, 4);
                                        }
                                        if (kv_dtype == TKVK_DTYPE_BF16)
                                            expect_close(NULL, (uint16_t *)row, 0, x, d, "kv");
                                        else
                                            expect_close(row, NULL, scale, x, d, is_v ? "v" : "k");
                                    }
                                fx_free(&f);
                                configs++;
                            }
    ck_assert_int_eq(configs, 3 * 3 * 2 * 3 * 2);
}
END_TEST

/* The CUDA kernel computes the dynamic scale max(amax / 448, TKVK_MIN_SCALE) with amax / 448
 * as q = amax * RN(1/448) plus one fma correction (div448() in kernels/prologue.cu), which must
 * give the scale of the IEEE division the reference does, or GPU and CPU scales would differ.
 * (Below TKVK_MIN_SCALE * 448 the two may differ in the last bit; the floor hides it.) The same
 * float operations here, over every float below 2^-109 and every third one above, up to
 * FLT_MAX, and +inf. */
static float div448_as_kernel(float m)
{
    const float r = 1.0f / TKVK_FP8_MAX;
    const float q = m * r;
    const float rem = fmaf(-q, TKVK_FP8_MAX, m);
    const float q2 = fmaf(rem, r, q);
    return m <= 3.40282347e38f ? q2 : q;
}

START_TEST(kernel_division_by_448_is_exact)
{
    volatile float d = TKVK_FP8_MAX; /* a real division, not folded into a product */
    uint64_t checked = 0, bad = 0;
    for (uint64_t u = 0; u <= 0x7f800000u; u += (u < 0x09000000u ? 1 : 3)) {
        uint32_t bits = (uint32_t)u;
        float m, got, want;
        memcpy(&m, &bits, 4);
        got = fmaxf(div448_as_kernel(m), TKVK_MIN_SCALE);
        want = fmaxf(m / d, TKVK_MIN_SCALE);
        if (memcmp(&got, &want, 4) != 0)
            bad++;
        checked++;
    }
    ck_assert_uint_gt(checked, 700000000u);
    ck_assert_uint_eq(bad, 0);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("kernels_prologue");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, rope_is_a_rotation);
    tcase_add_test(tc, hadamard_is_orthonormal_and_involutive);
    tcase_add_test(tc, rms_norm_gives_unit_rms);
    tcase_add_test(tc, quant_scales_follow_the_formulas);
    tcase_add_test(tc, per_tensor_and_bf16_pools);
    tcase_add_test(tc, slots_and_tail_zero_fill);
    tcase_add_test(tc, unsupported_shapes_are_refused);
    suite_add_tcase(s, tc);
    TCase *div = tcase_create("div448");
    tcase_set_timeout(div, 120);
    tcase_add_test(div, kernel_division_by_448_is_exact);
    suite_add_tcase(s, div);
    TCase *sweep = tcase_create("sweep");
    tcase_add_test(sweep, sweep_against_double_reference);
    suite_add_tcase(s, sweep);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
