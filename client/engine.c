/* engine.c - libkvclient's engine side: the kernels run on the daemon's pools (kvclient.h,
 * section "engine side"). Everything here is local: the pools were mapped at connect, so a
 * layer's store, attention and merge never talk to the daemon.
 *
 * This file is the one place where the public kvc_* parameter structs meet the kernels'
 * tkvk_* ones: every field is copied and every enum translated by name, so a kernel struct
 * may change (or its constants be renumbered) without libkvclient's ABI moving. */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "kvc_internal.h"
#include "kvclient.h"
#include "tkv_base.h"
#include "tkv_kernels.h"

/* The sizes of the structs' first versions: what every caller must pass at least. When a
 * struct grows, these stay (offsetof the end of its last first-version field). */
#define KVC_LAYOUT_SIZE_V1 sizeof(kvc_layout)
#define KVC_STORE_PARAMS_SIZE_V1 sizeof(kvc_store_params)
#define KVC_ATTEND_ARGS_SIZE_V1 sizeof(kvc_attend_args)

/* One mapping of the kernels' codes, with their reason, onto the client's. */
static int kernel_fail(int krc, const char *what)
{
    int code = KVC_EINTERNAL;
    switch (krc) {
    case TKVK_EINVAL: code = KVC_EINVAL; break;
    case TKVK_EUNSUPPORTED: code = KVC_EUNSUPPORTED; break;
    case TKVK_ENODEV: code = KVC_EUNAVAILABLE; break;
    default: break;
    }
    return tkv_kvc_fail(code, "%s: %s (%s)", what, tkvk_strerror(krc), tkvk_last_error());
}

/* =========================================================================================
 * versioned structs: struct_size first, the rest read as far as both sides know it
 * ========================================================================================= */

/* Copies the caller's struct (struct_size bytes) over *dst (dst_size bytes, already holding
 * the defaults). A caller's struct larger than ours is accepted only when the fields we do not
 * know are zero, i.e. their defaults: a non-zero one asks for something this library cannot
 * do, and ignoring it would compute the wrong thing. */
static int versioned_in(void *dst, size_t dst_size, const void *src, size_t min_size,
                        const char *what)
{
    if (!src)
        return tkv_kvc_fail(KVC_EINVAL, "%s is NULL", what);
    size_t n;
    memcpy(&n, src, sizeof(n)); /* struct_size is the first member of every versioned struct */
    if (n < min_size)
        return tkv_kvc_fail(KVC_EINVAL, "%s: struct_size %zu is below its first version's %zu "
                            "(fill it with its _init function)", what, n, min_size);
    const unsigned char *s = src;
    for (size_t i = dst_size; i < n; i++)
        if (s[i] != 0)
            return tkv_kvc_fail(KVC_EINVAL, "%s: a field at byte %zu is set that this "
                                "libkvclient (struct of %zu bytes) does not know", what, i,
                                dst_size);
    memcpy(dst, src, n < dst_size ? n : dst_size);
    return KVC_OK;
}

/* Writes the full struct *src (src_size bytes, struct_size included) into the caller's
 * struct_size bytes at dst; a caller's tail we do not know is zeroed (its defaults). */
static void versioned_out(void *dst, size_t struct_size, const void *src, size_t src_size)
{
    memcpy(dst, src, struct_size < src_size ? struct_size : src_size);
    if (struct_size > src_size)
        memset((unsigned char *)dst + src_size, 0, struct_size - src_size);
    memcpy(dst, &struct_size, sizeof(struct_size));
}

/* =========================================================================================
 * enums, by name in both directions
 * ========================================================================================= */

static int dtype_in(int v, int *out, const char *what)
{
    switch (v) {
    case KVC_DTYPE_FP8_E4M3: *out = TKVK_DTYPE_FP8_E4M3; return KVC_OK;
    case KVC_DTYPE_BF16: *out = TKVK_DTYPE_BF16; return KVC_OK;
    default: return tkv_kvc_fail(KVC_EINVAL, "%s %d is not a KVC_DTYPE_*", what, v);
    }
}

static int rope_in(int v, int *out)
{
    switch (v) {
    case KVC_ROPE_NEOX: *out = TKVK_ROPE_NEOX; return KVC_OK;
    case KVC_ROPE_GPTJ: *out = TKVK_ROPE_GPTJ; return KVC_OK;
    default: return tkv_kvc_fail(KVC_EINVAL, "rope_style %d is not a KVC_ROPE_*", v);
    }
}

static int norm_in(int v, int *out)
{
    switch (v) {
    case KVC_NORM_OFF: *out = TKVK_NORM_OFF; return KVC_OK;
    case KVC_NORM_BEFORE_ROPE: *out = TKVK_NORM_BEFORE_ROPE; return KVC_OK;
    case KVC_NORM_AFTER_ROPE: *out = TKVK_NORM_AFTER_ROPE; return KVC_OK;
    default: return tkv_kvc_fail(KVC_EINVAL, "norm_mode %d is not a KVC_NORM_*", v);
    }
}

/* the kernels' layout only ever holds the values tkvk_layout_init accepted */
static int dtype_out(int kernel_dtype)
{
    return kernel_dtype == TKVK_DTYPE_BF16 ? KVC_DTYPE_BF16 : KVC_DTYPE_FP8_E4M3;
}

static int scale_out(int kernel_scale)
{
    return kernel_scale == TKVK_SCALE_PER_TOKEN_HEAD ? KVC_SCALE_PER_TOKEN_HEAD
                                                     : KVC_SCALE_PER_TENSOR;
}

/* =========================================================================================
 * layout and pools
 * ========================================================================================= */

int kvc_pool_layout(const kvc_client *c, int tier, kvc_layout *out)
{
    if (!c || !out)
        return tkv_kvc_fail(KVC_EINVAL, "client or layout is NULL");
    if (out->struct_size < KVC_LAYOUT_SIZE_V1)
        return tkv_kvc_fail(KVC_EINVAL, "kvc_layout: struct_size %zu is below its first "
                            "version's %zu (set it to sizeof(kvc_layout))", out->struct_size,
                            KVC_LAYOUT_SIZE_V1);
    tkvk_layout k;
    int rc = tkv_kvc_kernel_layout(c, tier, &k);
    if (rc != KVC_OK)
        return rc;
    kvc_layout l = {
        .struct_size = sizeof(kvc_layout),
        .num_layers = (uint32_t)k.num_layers,
        .num_kv_heads = (uint32_t)k.num_kv_heads,
        .head_dim = (uint32_t)k.head_dim,
        .page_tokens = (uint32_t)k.page_tokens,
        .kv_dtype = dtype_out(k.kv_dtype),
        .scale_mode = scale_out(k.scale_mode),
        .elem_bytes = k.elem_bytes,
        .token_stride = k.token_stride,
        .v_offset = k.v_offset,
        .kscale_offset = k.kscale_offset,
        .layer_stride = k.layer_stride,
        .block_stride = k.block_stride,
    };
    versioned_out(out, out->struct_size, &l, sizeof(l));
    return KVC_OK;
}

/* The tier's pool, kernel layout and size, or an error saying why they are not usable here. */
static int tier_pool(kvc_client *c, int tier, tkvk_layout *lay, void **base, int64_t *num_blocks)
{
    if (!c)
        return tkv_kvc_fail(KVC_EINVAL, "client is NULL");
    if (tier != KVC_TIER_L1 && tier != KVC_TIER_L2)
        return tkv_kvc_fail(KVC_EINVAL, "kernel tier must be L1 or L2, not %s",
                            kvc_tier_name(tier));
    int rc = tkv_kvc_kernel_layout(c, tier, lay);
    if (rc != KVC_OK)
        return rc;
    *base = kvc_pool_base(c, tier);
    if (!*base)
        return tier == KVC_TIER_L1 ? KVC_EUNAVAILABLE : KVC_EATTACH; /* message already set */
    *num_blocks = kvc_pool_num_blocks(c, tier);
    return KVC_OK;
}

/* =========================================================================================
 * store: the fused prologue into a pool
 * ========================================================================================= */

int kvc_store_params_init(kvc_store_params *p, size_t struct_size)
{
    if (!p || struct_size < KVC_STORE_PARAMS_SIZE_V1)
        return tkv_kvc_fail(KVC_EINVAL, "kvc_store_params_init: %s", p ? "struct_size below "
                            "sizeof(kvc_store_params)" : "params are NULL");
    kvc_store_params d = {
        .struct_size = sizeof(d),
        .rope_style = KVC_ROPE_NEOX,
        .norm_mode = KVC_NORM_OFF,
        .norm_eps = 1e-6f,
        .q_dtype = KVC_DTYPE_FP8_E4M3,
        .k_scale = 1.0f,
        .v_scale = 1.0f,
    };
    versioned_out(p, struct_size, &d, sizeof(d));
    return KVC_OK;
}

/* The kernels' parameters of *in; pool, layout and block count are the caller's to add. */
static int store_to_kernel(const kvc_store_params *in, tkvk_prologue_params *k)
{
    tkvk_prologue_params_init(k);
    int rc;
    if ((rc = rope_in(in->rope_style, &k->rope_style)) != KVC_OK ||
        (rc = norm_in(in->norm_mode, &k->norm_mode)) != KVC_OK ||
        (rc = dtype_in(in->q_dtype, &k->q_dtype, "q_dtype")) != KVC_OK)
        return rc;
    k->qkv = in->qkv;
    k->qkv_stride = in->qkv_stride;
    k->num_tokens = in->num_tokens;
    k->num_q_heads = in->num_q_heads;
    k->positions = in->positions;
    k->rope_cos = in->rope_cos;
    k->rope_sin = in->rope_sin;
    k->max_pos = in->max_pos;
    k->norm_eps = in->norm_eps;
    k->q_norm_weight = in->q_norm_weight;
    k->k_norm_weight = in->k_norm_weight;
    k->hadamard = in->hadamard;
    k->q_out = in->q_out;
    k->q_scale_out = in->q_scale_out;
    k->layer = in->layer;
    k->slot_mapping = in->slot_mapping;
    k->k_scale = in->k_scale;
    k->v_scale = in->v_scale;
    k->v_head_scales = in->v_head_scales;
    k->num_reqs = in->num_reqs;
    k->req_last_slot = in->req_last_slot;
    return KVC_OK;
}

int kvc_store(kvc_client *c, int tier, const kvc_store_params *p, void *stream)
{
    kvc_store_params in;
    kvc_store_params_init(&in, sizeof(in));
    int rc = versioned_in(&in, sizeof(in), p, KVC_STORE_PARAMS_SIZE_V1, "kvc_store_params");
    if (rc != KVC_OK)
        return rc;
    tkvk_layout lay;
    void *base = NULL;
    int64_t num_blocks = 0;
    if ((rc = tier_pool(c, tier, &lay, &base, &num_blocks)) != KVC_OK)
        return rc;
    /* a read-only mapping would fault on the first store: refuse before touching it */
    if (!kvc_pool_writable(c, tier))
        return tkv_kvc_fail(KVC_EINVAL, "the %s pool is mapped read-only (connect with "
                            "kvc_opts_set_trusted to write it)", kvc_tier_name(tier));
    tkvk_prologue_params k;
    if ((rc = store_to_kernel(&in, &k)) != KVC_OK)
        return rc;
    k.layout = &lay;
    k.pool = base;
    k.num_blocks = num_blocks;
    int krc;
    if (tier == KVC_TIER_L1) {
#ifdef TKVK_HAVE_CUDA
        krc = tkvk_prologue_cuda(&k, stream);
#else
        krc = TKVK_ENODEV; /* unreachable: without CUDA no L1 pool is mapped */
#endif
    } else {
        (void)stream;
        krc = tkvk_prologue_cpu(&k);
    }
    return krc == TKVK_OK ? KVC_OK : kernel_fail(krc, "prologue");
}

/* =========================================================================================
 * attend: decode attention over a pool, and its GPU plan
 * ========================================================================================= */

struct kvc_plan {
    tkvk_decode_plan *k;
    int max_requests, num_kv_heads, head_dim; /* what the kernel plan was sized for */
};

int kvc_plan_create(const kvc_client *c, int max_requests, int num_q_heads, int max_q_len,
                    kvc_plan **out)
{
    if (!c || !out)
        return tkv_kvc_fail(KVC_EINVAL, "client or plan pointer is NULL");
    *out = NULL;
    tkvk_layout lay;
    int rc = tkv_kvc_kernel_layout(c, KVC_TIER_L1, &lay);
    if (rc != KVC_OK)
        return rc;
    if (max_requests < 1 || max_q_len < 1 || max_q_len > 8 || num_q_heads < 1 ||
        num_q_heads % lay.num_kv_heads != 0 || num_q_heads / lay.num_kv_heads > 16)
        return tkv_kvc_fail(KVC_EINVAL, "plan of %d requests x %d query heads x %d tokens: "
                            "needs requests >= 1, tokens 1..8, query heads a multiple of the "
                            "%d KV heads with a group <= 16", max_requests, num_q_heads,
                            max_q_len, lay.num_kv_heads);
#ifdef TKVK_HAVE_CUDA
    kvc_plan *pl = tkv_xcalloc(1, sizeof(*pl)); /* the project's one out-of-memory policy */
    int rows = num_q_heads / lay.num_kv_heads * max_q_len;
    int krc = tkvk_decode_plan_create(&pl->k, max_requests, lay.num_kv_heads, rows,
                                      lay.head_dim);
    if (krc != TKVK_OK) {
        free(pl);
        return kernel_fail(krc, "decode plan");
    }
    pl->max_requests = max_requests;
    pl->num_kv_heads = lay.num_kv_heads;
    pl->head_dim = lay.head_dim;
    *out = pl;
    return KVC_OK;
#else
    return tkv_kvc_fail(KVC_EUNAVAILABLE, "libkvclient was built without CUDA: no GPU plan "
                        "(L2 attention needs none)");
#endif
}

void kvc_plan_destroy(kvc_plan *plan)
{
    if (!plan)
        return;
#ifdef TKVK_HAVE_CUDA
    tkvk_decode_plan_destroy(plan->k);
#endif
    free(plan);
}

int kvc_attend_args_init(kvc_attend_args *a, size_t struct_size)
{
    if (!a || struct_size < KVC_ATTEND_ARGS_SIZE_V1)
        return tkv_kvc_fail(KVC_EINVAL, "kvc_attend_args_init: %s", a ? "struct_size below "
                            "sizeof(kvc_attend_args)" : "arguments are NULL");
    kvc_attend_args d = {
        .struct_size = sizeof(d),
        .q_len = 1,
        .q_dtype = KVC_DTYPE_BF16,
        .k_scale = 1.0f,
        .v_scale = 1.0f,
    };
    versioned_out(a, struct_size, &d, sizeof(d));
    return KVC_OK;
}

static int attend_to_kernel(const kvc_attend_args *in, const tkvk_layout *lay,
                            tkvk_decode_args *k)
{
    memset(k, 0, sizeof(*k));
    int rc = dtype_in(in->q_dtype, &k->q_dtype, "q_dtype");
    if (rc != KVC_OK)
        return rc;
    k->layer = in->layer;
    k->num_requests = in->num_requests;
    k->num_q_heads = in->num_q_heads;
    k->q_len = in->q_len;
    k->q = in->q;
    k->q_scales = in->q_scales;
    k->kv_lens = in->kv_lens;
    k->block_table = in->block_table;
    k->block_table_stride = in->block_table_stride;
    k->k_scale = in->k_scale;
    k->v_scale = in->v_scale;
    k->v_head_scales = in->v_head_scales;
    k->sm_scale = in->sm_scale != 0.0f ? in->sm_scale : 1.0f / sqrtf((float)lay->head_dim);
    k->out = in->out;
    k->lse = in->lse;
    return KVC_OK;
}

int kvc_attend(kvc_client *c, int tier, const kvc_attend_args *a, kvc_plan *plan,
               void *stream)
{
    kvc_attend_args in;
    kvc_attend_args_init(&in, sizeof(in));
    int rc = versioned_in(&in, sizeof(in), a, KVC_ATTEND_ARGS_SIZE_V1, "kvc_attend_args");
    if (rc != KVC_OK)
        return rc;
    tkvk_layout lay;
    void *base = NULL;
    int64_t num_blocks = 0;
    if ((rc = tier_pool(c, tier, &lay, &base, &num_blocks)) != KVC_OK)
        return rc;
    if (num_blocks > INT32_MAX)
        return tkv_kvc_fail(KVC_EUNSUPPORTED, "%lld blocks in the %s pool exceed the kernels' "
                            "int block ids", (long long)num_blocks, kvc_tier_name(tier));
    if (tier == KVC_TIER_L1) {
        if (!plan)
            return tkv_kvc_fail(KVC_EINVAL, "L1 attention needs a plan (kvc_plan_create)");
        /* a plan sized for another geometry would under-size its workspace */
        if (plan->num_kv_heads != lay.num_kv_heads || plan->head_dim != lay.head_dim)
            return tkv_kvc_fail(KVC_EINVAL, "the plan is for %d KV heads of dim %d, the pool "
                                "has %d of dim %d", plan->num_kv_heads, plan->head_dim,
                                lay.num_kv_heads, lay.head_dim);
    }
    tkvk_decode_args k;
    if ((rc = attend_to_kernel(&in, &lay, &k)) != KVC_OK)
        return rc;
    k.layout = &lay;
    k.pool = base;
    k.num_blocks = (int)num_blocks;
    int krc;
    const char *what = "decode";
    if (tier == KVC_TIER_L1) {
#ifdef TKVK_HAVE_CUDA
        krc = tkvk_decode_plan_cuda(plan->k, k.kv_lens, k.num_requests, stream);
        what = "decode plan";
        if (krc == TKVK_OK) {
            krc = tkvk_decode_attend_cuda(plan->k, &k, stream);
            what = "decode attention";
        }
#else
        krc = TKVK_ENODEV;
#endif
    } else {
        (void)stream;
        krc = tkvk_decode_cpu(&k);
    }
    return krc == TKVK_OK ? KVC_OK : kernel_fail(krc, what);
}

/* =========================================================================================
 * merge
 * ========================================================================================= */

int kvc_merge(kvc_client *c, int tier, const uint16_t *o_a, const float *lse_a,
              const uint16_t *o_b, const float *lse_b, int num_rows, int head_dim,
              uint16_t *out, float *out_lse, void *stream)
{
    if (!c)
        return tkv_kvc_fail(KVC_EINVAL, "client is NULL");
    int krc;
    if (tier == KVC_TIER_L1) {
#ifdef TKVK_HAVE_CUDA
        krc = tkvk_merge_states_cuda(o_a, lse_a, o_b, lse_b, num_rows, head_dim, out, out_lse,
                                     stream);
#else
        krc = TKVK_ENODEV;
#endif
    } else if (tier == KVC_TIER_L2) {
        (void)stream;
        krc = tkvk_merge_states_cpu(o_a, lse_a, o_b, lse_b, num_rows, head_dim, out, out_lse);
    } else {
        return tkv_kvc_fail(KVC_EINVAL, "merge tier must be L1 or L2, not %s",
                            kvc_tier_name(tier));
    }
    return krc == TKVK_OK ? KVC_OK : kernel_fail(krc, "merge states");
}
