/* prologue.c - the fused prologue on the CPU: the reference the CUDA kernel is tested against
 * and the daemon's path without a GPU. The arithmetic is spelled out in tkv_kernels.h; every
 * step below does exactly those float operations in that order (built with
 * -ffp-contract=off), which is what lets the GPU results be compared code for code. */
#include <math.h>
#include <string.h>

#include "tkvk_internal.h"

/* ============================================================================================
 * Parameters
 * ========================================================================================== */

void tkvk_prologue_params_init(tkvk_prologue_params *p)
{
    memset(p, 0, sizeof *p);
    p->norm_eps = 1e-6f;
    p->k_scale = 1.0f;
    p->v_scale = 1.0f;
    p->rope_style = TKVK_ROPE_NEOX;
    p->norm_mode = TKVK_NORM_OFF;
    p->q_dtype = TKVK_DTYPE_FP8_E4M3;
}

float tkvk_hadamard_scale(int head_dim)
{
    /* Literals, not sqrtf at run time: both implementations must use the very same float. */
    switch (head_dim) {
    case 64: return 0.125f;
    case 128: return 0.0883883476483184405f;
    case 256: return 0.0625f;
    default: return 0.0f;
    }
}

int tkvk__prologue_check(const tkvk_prologue_params *p, const char *fn)
{
    if (!p)
        return tkvk__fail(TKVK_EINVAL, "%s: params is NULL", fn);
    const tkvk_layout *lay = p->layout;
    if (!lay)
        return tkvk__fail(TKVK_EINVAL, "%s: layout is NULL", fn);
    if (!tkvk__head_dim_ok(lay->head_dim))
        return tkvk__fail(TKVK_EUNSUPPORTED, "%s: head_dim %d (supported: 64, 128, 256)", fn,
                          lay->head_dim);
    if (!tkvk__page_tokens_ok(lay->page_tokens))
        return tkvk__fail(TKVK_EUNSUPPORTED, "%s: page_tokens %d (supported: 16, 32, 64, 128)",
                          fn, lay->page_tokens);
    if (lay->num_kv_heads < 1 || lay->num_layers < 1 || lay->token_stride == 0 ||
        lay->token_stride != (size_t)lay->num_kv_heads * (size_t)lay->head_dim * lay->elem_bytes)
        return tkvk__fail(TKVK_EINVAL, "%s: layout not filled by tkvk_layout_init()", fn);
    int hkv = lay->num_kv_heads, hq = p->num_q_heads;
    if (hq < 1)
        return tkvk__fail(TKVK_EINVAL, "%s: num_q_heads %d < 1", fn, hq);
    if (hq % hkv != 0)
        return tkvk__fail(TKVK_EUNSUPPORTED, "%s: num_q_heads %d is not a multiple of "
                          "num_kv_heads %d", fn, hq, hkv);
    if (hq / hkv > 16)
        return tkvk__fail(TKVK_EUNSUPPORTED, "%s: GQA group %d > 16", fn, hq / hkv);
    if (p->num_tokens < 0)
        return tkvk__fail(TKVK_EINVAL, "%s: num_tokens %d < 0", fn, p->num_tokens);
    if (p->num_reqs < 0)
        return tkvk__fail(TKVK_EINVAL, "%s: num_reqs %d < 0", fn, p->num_reqs);
    if (p->layer < 0 || p->layer >= lay->num_layers)
        return tkvk__fail(TKVK_EINVAL, "%s: layer %d outside 0..%d", fn, p->layer,
                          lay->num_layers - 1);
    if (p->rope_style != TKVK_ROPE_NEOX && p->rope_style != TKVK_ROPE_GPTJ)
        return tkvk__fail(TKVK_EINVAL, "%s: rope_style %d is not a TKVK_ROPE_*", fn,
                          p->rope_style);
    if (p->norm_mode != TKVK_NORM_OFF && p->norm_mode != TKVK_NORM_BEFORE_ROPE &&
        p->norm_mode != TKVK_NORM_AFTER_ROPE)
        return tkvk__fail(TKVK_EINVAL, "%s: norm_mode %d is not a TKVK_NORM_*", fn,
                          p->norm_mode);
    if (p->norm_mode != TKVK_NORM_OFF) {
        if (!p->q_norm_weight || !p->k_norm_weight)
            return tkvk__fail(TKVK_EINVAL, "%s: QK-norm needs q_norm_weight and k_norm_weight",
                              fn);
        if (!(p->norm_eps > 0.0f) || isinf(p->norm_eps))
            return tkvk__fail(TKVK_EINVAL, "%s: norm_eps %g must be a positive number", fn,
                              (double)p->norm_eps);
    }
    if (p->hadamard != 0 && p->hadamard != 1)
        return tkvk__fail(TKVK_EINVAL, "%s: hadamard %d must be 0 or 1", fn, p->hadamard);
    if (p->q_dtype != TKVK_DTYPE_FP8_E4M3 && p->q_dtype != TKVK_DTYPE_BF16)
        return tkvk__fail(TKVK_EINVAL, "%s: q_dtype %d is not a TKVK_DTYPE_*", fn, p->q_dtype);
    size_t row = (size_t)(hq + 2 * hkv) * (size_t)lay->head_dim;
    if (p->qkv_stride != 0 && p->qkv_stride < row)
        return tkvk__fail(TKVK_EINVAL, "%s: qkv_stride %zu < row of %zu elements", fn,
                          p->qkv_stride, row);
    if (p->num_blocks < 0 || (p->num_blocks > 0 && !p->pool))
        return tkvk__fail(TKVK_EINVAL, "%s: pool is NULL or num_blocks %lld < 0", fn,
                          (long long)p->num_blocks);
    if (p->num_reqs > 0 && !p->req_last_slot)
        return tkvk__fail(TKVK_EINVAL, "%s: req_last_slot is NULL with %d requests", fn,
                          p->num_reqs);
    if (lay->kv_dtype == TKVK_DTYPE_FP8_E4M3) {
        if (lay->scale_mode == TKVK_SCALE_PER_TENSOR) {
            if (!(p->k_scale > 0.0f) || !(p->v_scale > 0.0f) || isinf(p->k_scale) ||
                isinf(p->v_scale))
                return tkvk__fail(TKVK_EINVAL, "%s: k_scale %g / v_scale %g must be positive "
                                  "finite numbers", fn, (double)p->k_scale, (double)p->v_scale);
        } else if (!p->v_head_scales) {
            return tkvk__fail(TKVK_EINVAL, "%s: per-token-head mode needs v_head_scales", fn);
        }
    }
    if (p->num_tokens == 0)
        return TKVK_OK;
    if (!p->qkv || !p->positions || !p->rope_cos || !p->rope_sin || !p->q_out ||
        !p->slot_mapping)
        return tkvk__fail(TKVK_EINVAL, "%s: qkv, positions, rope_cos, rope_sin, q_out and "
                          "slot_mapping are required", fn);
    if (p->q_dtype == TKVK_DTYPE_FP8_E4M3 && !p->q_scale_out)
        return tkvk__fail(TKVK_EINVAL, "%s: FP8 Q needs q_scale_out", fn);
    if (p->max_pos < 1)
        return tkvk__fail(TKVK_EINVAL, "%s: max_pos %d < 1", fn, p->max_pos);
    return TKVK_OK;
}

/* ============================================================================================
 * The per-head steps (float, in place, head_dim elements)
 * ========================================================================================== */

static void rms_norm(float *x, int d, const float *w, float eps)
{
    /* d/16 partial sums combined by a butterfly: the order of the CUDA kernel, where each of
     * a head's d/16 lanes holds elements 8j..8j+7 and d/2+8j..d/2+8j+7. */
    float part[16], next[16];
    int nparts = d / 16;
    for (int j = 0; j < nparts; j++) {
        float s = 0.0f;
        for (int half = 0; half < 2; half++)
            for (int e = 0; e < 8; e++) {
                float v = x[half * (d / 2) + 8 * j + e];
                s = s + v * v;
            }
        part[j] = s;
    }
    for (int m = nparts / 2; m >= 1; m /= 2) {
        for (int j = 0; j < nparts; j++)
            next[j] = part[j] + part[j ^ m];
        memcpy(part, next, sizeof(float) * (size_t)nparts);
    }
    float inv = 1.0f / sqrtf(part[0] / (float)d + eps);
    for (int i = 0; i < d; i++)
        x[i] = (x[i] * inv) * w[i];
}

static void rope(float *x, int d, int style, const float *cos_row, const float *sin_row)
{
    int half = d / 2;
    for (int i = 0; i < half; i++) {
        int ia = style == TKVK_ROPE_NEOX ? i : 2 * i;
        int ib = style == TKVK_ROPE_NEOX ? i + half : 2 * i + 1;
        float a = x[ia], b = x[ib], c = cos_row[i], s = sin_row[i];
        x[ia] = a * c - b * s;
        x[ib] = b * c + a * s;
    }
}

static void hadamard(float *x, int d)
{
    for (int h = 1; h < d; h *= 2) {
        for (int i = 0; i < d; i++) {
            if (i & h)
                continue;
            float a = x[i], b = x[i + h];
            x[i] = a + b;
            x[i + h] = a - b;
        }
    }
    float scale = tkvk_hadamard_scale(d);
    for (int i = 0; i < d; i++)
        x[i] = x[i] * scale;
}

static float dynamic_scale(const float *x, int d)
{
    float amax = 0.0f;
    for (int i = 0; i < d; i++)
        amax = fmaxf(amax, fabsf(x[i]));
    return fmaxf(amax / TKVK_FP8_MAX, TKVK_MIN_SCALE);
}

static void quantize(const float *x, int d, float scale, uint8_t *out)
{
    float inv = 1.0f / scale;
    for (int i = 0; i < d; i++)
        out[i] = tkvk_fp8_from_float(x[i] * inv);
}

static void to_bf16(const float *x, int d, uint16_t *out)
{
    for (int i = 0; i < d; i++)
        out[i] = tkvk_bf16_from_float(x[i]);
}

/* ============================================================================================
 * The whole prologue
 * ========================================================================================== */

int tkvk_prologue_cpu(const tkvk_prologue_params *p)
{
    int rc = tkvk__prologue_check(p, "tkvk_prologue_cpu");
    if (rc != TKVK_OK)
        return rc;
    const tkvk_layout *lay = p->layout;
    const int d = lay->head_dim, hkv = lay->num_kv_heads, hq = p->num_q_heads;
    const int P = lay->page_tokens;
    const int heads = hq + 2 * hkv;
    const size_t stride = p->qkv_stride ? p->qkv_stride : (size_t)heads * (size_t)d;
    const int64_t num_slots = p->num_blocks * P;
    const int fp8_kv = lay->kv_dtype == TKVK_DTYPE_FP8_E4M3;
    const int per_token_head = lay->scale_mode == TKVK_SCALE_PER_TOKEN_HEAD;

    /* Validate everything data-dependent before writing anything: a refused call leaves the
     * outputs untouched. */
    for (int t = 0; t < p->num_tokens; t++) {
        if (p->positions[t] < 0 || p->positions[t] >= p->max_pos)
            return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cpu: positions[%d] = %d outside "
                              "[0, %d)", t, p->positions[t], p->max_pos);
        if (p->slot_mapping[t] < -1 || p->slot_mapping[t] >= num_slots)
            return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cpu: slot_mapping[%d] = %lld outside "
                              "[-1, %lld)", t, (long long)p->slot_mapping[t],
                              (long long)num_slots);
    }
    for (int r = 0; r < p->num_reqs; r++) {
        if (p->req_last_slot[r] < -1 || p->req_last_slot[r] >= num_slots)
            return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cpu: req_last_slot[%d] = %lld outside "
                              "[-1, %lld)", r, (long long)p->req_last_slot[r],
                              (long long)num_slots);
    }
    if (per_token_head && p->num_tokens > 0) {
        for (int h = 0; h < hkv; h++)
            if (!(p->v_head_scales[h] > 0.0f) || isinf(p->v_head_scales[h]))
                return tkvk__fail(TKVK_EINVAL, "tkvk_prologue_cpu: v_head_scales[%d] = %g must "
                                  "be a positive finite number", h, (double)p->v_head_scales[h]);
    }

    uint8_t *layer_base = (uint8_t *)p->pool + (size_t)p->layer * lay->layer_stride;
    float x[256];
    for (int t = 0; t < p->num_tokens; t++) {
        const uint16_t *row = p->qkv + (size_t)t * stride;
        const float *cos_row = p->rope_cos + (size_t)p->positions[t] * (size_t)(d / 2);
        const float *sin_row = p->rope_sin + (size_t)p->positions[t] * (size_t)(d / 2);
        int64_t slot = p->slot_mapping[t];
        uint8_t *page = NULL;
        int offset = 0;
        if (slot >= 0) {
            page = layer_base + (size_t)(slot / P) * lay->block_stride;
            offset = (int)(slot % P);
        }
        for (int h = 0; h < heads; h++) {
            for (int i = 0; i < d; i++)
                x[i] = tkvk_bf16_to_float(row[(size_t)h * d + i]);
            if (h < hq + hkv) { /* Q or K */
                const float *w = h < hq ? p->q_norm_weight : p->k_norm_weight;
                if (p->norm_mode == TKVK_NORM_BEFORE_ROPE)
                    rms_norm(x, d, w, p->norm_eps);
                rope(x, d, p->rope_style, cos_row, sin_row);
                if (p->norm_mode == TKVK_NORM_AFTER_ROPE)
                    rms_norm(x, d, w, p->norm_eps);
                if (p->hadamard)
                    hadamard(x, d);
            }
            if (h < hq) {
                size_t at = ((size_t)t * hq + h) * d;
                if (p->q_dtype == TKVK_DTYPE_BF16) {
                    to_bf16(x, d, (uint16_t *)p->q_out + at);
                } else {
                    float scale = dynamic_scale(x, d);
                    quantize(x, d, scale, (uint8_t *)p->q_out + at);
                    p->q_scale_out[(size_t)t * hq + h] = scale;
                }
                continue;
            }
            if (!page)
                continue;
            int is_v = h >= hq + hkv;
            int kvh = is_v ? h - hq - hkv : h - hq;
            uint8_t *dst = page + (is_v ? lay->v_offset : 0) + (size_t)offset * lay->token_stride +
                           (size_t)kvh * d * lay->elem_bytes;
            if (!fp8_kv) {
                uint16_t tmp[256];
                to_bf16(x, d, tmp);
                memcpy(dst, tmp, (size_t)d * 2);
            } else if (!per_token_head) {
                quantize(x, d, is_v ? p->v_scale : p->k_scale, dst);
            } else if (is_v) {
                quantize(x, d, p->v_head_scales[kvh], dst);
            } else {
                float scale = dynamic_scale(x, d);
                quantize(x, d, scale, dst);
                memcpy(page + lay->kscale_offset + ((size_t)offset * hkv + kvh) * sizeof(float),
                       &scale, sizeof scale);
            }
        }
    }

    /* Tail zero-fill of every request's last page (this layer only). */
    for (int r = 0; r < p->num_reqs; r++) {
        int64_t last = p->req_last_slot[r];
        if (last < 0)
            continue;
        uint8_t *page = layer_base + (size_t)(last / P) * lay->block_stride;
        size_t first = (size_t)(last % P) + 1, rows = (size_t)P - first;
        if (rows == 0)
            continue;
        memset(page + first * lay->token_stride, 0, rows * lay->token_stride);
        memset(page + lay->v_offset + first * lay->token_stride, 0, rows * lay->token_stride);
        if (per_token_head)
            memset(page + lay->kscale_offset + first * hkv * sizeof(float), 0,
                   rows * hkv * sizeof(float));
    }
    return TKVK_OK;
}
