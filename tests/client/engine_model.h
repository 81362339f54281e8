/* engine_model.h - the toy model the engine tests run through libkvclient's engine side:
 * deterministic BF16 QKV rows from token ids (equal tokens give equal K/V, so two engines
 * prefilling the same prefix write the same pages), a RoPE table, and the prologue/decode
 * argument set-up both the CPU test (tests/client/test_engine.c) and the GPU test
 * (tests/gpu/gpu_tier_e2e.c) use. Header-only (static functions).
 *
 * Each step is set up twice from the same values: through libkvclient's own structs
 * (kvc_store_params, kvc_attend_args: what an engine uses) and through the kernels' (the
 * tests' single-process reference). A field lost or an enum mistranslated between the two
 * makes the pages or the outputs differ, so the tests also check engine.c's translation.
 *
 * Geometry: 2 layers, 2 KV heads, head dim 64, 16 tokens per page, FP8 e4m3 per-tensor, 4 query
 * heads (GQA group 2): 8 KiB blocks, small enough for CI, large enough that layer and head
 * strides matter.
 */
#ifndef TKVT_ENGINE_MODEL_H
#define TKVT_ENGINE_MODEL_H

#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvclient.h"
#include "tkv_kernels.h"

#define EM_LAYERS 2
#define EM_KV_HEADS 2
#define EM_Q_HEADS 4
#define EM_HEAD_DIM 64
#define EM_PAGE 16
#define EM_MODEL "tierkv-engine-test"
#define EM_MAX_POS 512
#define EM_ROW ((EM_Q_HEADS + 2 * EM_KV_HEADS) * EM_HEAD_DIM) /* qkv elements per token */
#define EM_K_SCALE 0.01f /* per-tensor FP8 scales: |k|, |v| <= ~2 use a good part of +-448 */
#define EM_V_SCALE 0.01f

/* A value in [-1, 1) from (token, layer, element): splitmix64, so rows are reproducible in
 * every process without shared state. */
static inline float em_value(uint32_t token, int layer, int j)
{
    uint64_t x = ((uint64_t)token << 24) ^ ((uint64_t)layer << 16) ^ (uint64_t)j;
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    x ^= x >> 31;
    return (float)((double)(x >> 11) / (double)(1ull << 53) * 2.0 - 1.0);
}

/* qkv[n][EM_ROW] bf16 for tokens[0..n) of one layer. */
static inline void em_qkv(const uint32_t *tokens, int n, int layer, uint16_t *qkv)
{
    for (int t = 0; t < n; t++)
        for (int j = 0; j < EM_ROW; j++)
            qkv[(size_t)t * EM_ROW + j] = tkvk_bf16_from_float(em_value(tokens[t], layer, j));
}

/* cos/sin [EM_MAX_POS][D/2], NeoX frequencies with base 10000. */
static inline void em_rope(float *cos_t, float *sin_t)
{
    for (int p = 0; p < EM_MAX_POS; p++)
        for (int i = 0; i < EM_HEAD_DIM / 2; i++) {
            double inv = pow(10000.0, -2.0 * i / EM_HEAD_DIM);
            cos_t[p * (EM_HEAD_DIM / 2) + i] = (float)cos(p * inv);
            sin_t[p * (EM_HEAD_DIM / 2) + i] = (float)sin(p * inv);
        }
}

/* Prologue parameters of one layer: BF16 Q out, no norm, per-tensor FP8 K/V. pool, layout
 * and num_blocks are left for the caller (or kvc_store) to fill. */
static inline void em_prologue(tkvk_prologue_params *p, const uint16_t *qkv, int n,
                               const int32_t *positions, const float *cos_t, const float *sin_t,
                               int layer, const int64_t *slots, uint16_t *q_out)
{
    tkvk_prologue_params_init(p);
    p->qkv = qkv;
    p->num_tokens = n;
    p->num_q_heads = EM_Q_HEADS;
    p->positions = positions;
    p->rope_cos = cos_t;
    p->rope_sin = sin_t;
    p->max_pos = EM_MAX_POS;
    p->rope_style = TKVK_ROPE_NEOX;
    p->norm_mode = TKVK_NORM_OFF;
    p->q_dtype = TKVK_DTYPE_BF16;
    p->q_out = q_out;
    p->layer = layer;
    p->slot_mapping = slots;
    p->k_scale = EM_K_SCALE;
    p->v_scale = EM_V_SCALE;
}

/* The same layer's parameters for kvc_store (the pool and the layout are the library's). */
static inline void em_store(kvc_store_params *p, const uint16_t *qkv, int n,
                            const int32_t *positions, const float *cos_t, const float *sin_t,
                            int layer, const int64_t *slots, uint16_t *q_out)
{
    kvc_store_params_init(p, sizeof(*p));
    p->qkv = qkv;
    p->num_tokens = n;
    p->num_q_heads = EM_Q_HEADS;
    p->positions = positions;
    p->rope_cos = cos_t;
    p->rope_sin = sin_t;
    p->max_pos = EM_MAX_POS;
    p->rope_style = KVC_ROPE_NEOX;
    p->norm_mode = KVC_NORM_OFF;
    p->q_dtype = KVC_DTYPE_BF16;
    p->q_out = q_out;
    p->layer = layer;
    p->slot_mapping = slots;
    p->k_scale = EM_K_SCALE;
    p->v_scale = EM_V_SCALE;
}

/* Decode arguments of one request, one query token, over table[0..table_len). */
static inline void em_decode(tkvk_decode_args *a, const tkvk_layout *lay, int layer,
                             const uint16_t *q, const int32_t *kv_len, const int32_t *table,
                             int table_len, uint16_t *out, float *lse)
{
    memset(a, 0, sizeof(*a));
    a->layout = lay;
    a->layer = layer;
    a->num_requests = 1;
    a->num_q_heads = EM_Q_HEADS;
    a->q_len = 1;
    a->q_dtype = TKVK_DTYPE_BF16;
    a->q = q;
    a->kv_lens = kv_len;
    a->block_table = table;
    a->block_table_stride = table_len;
    a->k_scale = EM_K_SCALE;
    a->v_scale = EM_V_SCALE;
    a->sm_scale = 1.0f / sqrtf((float)EM_HEAD_DIM);
    a->out = out;
    a->lse = lse;
}

/* The same decode for kvc_attend; sm_scale is left at its default (1/sqrt(head_dim)). */
static inline void em_attend(kvc_attend_args *a, int layer, const uint16_t *q,
                             const int32_t *kv_len, const int32_t *table, int table_len,
                             uint16_t *out, float *lse)
{
    kvc_attend_args_init(a, sizeof(*a));
    a->layer = layer;
    a->num_requests = 1;
    a->num_q_heads = EM_Q_HEADS;
    a->q_len = 1;
    a->q_dtype = KVC_DTYPE_BF16;
    a->q = q;
    a->kv_lens = kv_len;
    a->block_table = table;
    a->block_table_stride = table_len;
    a->k_scale = EM_K_SCALE;
    a->v_scale = EM_V_SCALE;
    a->out = out;
    a->lse = lse;
}

/* Tolerance of a split-and-merged attention against the one-pass reference: both read the
 * same FP8 pages; they differ by the BF16 rounding of the two partial outputs before the merge
 * and the merge's own rounding (2^-8 relative each), so |o - ref| <= 2e-2 * max(1, |ref|)
 * bounds them; the LSE is float math on both sides: 1e-3. */
#define EM_O_TOL 2e-2
#define EM_LSE_TOL 1e-3

/* Max |a-b| (scaled by max(1, |b|)) over n bf16 values. */
static inline double em_max_err(const uint16_t *a, const uint16_t *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++) {
        double x = tkvk_bf16_to_float(a[i]), y = tkvk_bf16_to_float(b[i]);
        double d = fabs(x - y) / (fabs(y) > 1.0 ? fabs(y) : 1.0);
        if (!(d <= m)) /* also catches NaN */
            m = isnan(d) ? INFINITY : d;
    }
    return m;
}

#endif
