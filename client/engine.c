/* engine.c - libkvclient's engine side: the kernels run on the daemon's pools (kvclient.h,
 * section "engine side"). Everything here is local: the pools were mapped at connect, so a
 * layer's store, attention and merge never talk to the daemon. */
#include <stdint.h>

#include "kvc_internal.h"
#include "kvclient.h"
#include "tkv_kernels.h"

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

/* The tier's pool, layout and size, or an error saying why they are not usable here. */
static int tier_pool(kvc_client *c, int tier, tkvk_layout *lay, void **base, int64_t *num_blocks)
{
    if (!c)
        return tkv_kvc_fail(KVC_EINVAL, "client is NULL");
    if (tier != KVC_TIER_L1 && tier != KVC_TIER_L2)
        return tkv_kvc_fail(KVC_EINVAL, "kernel tier must be L1 or L2, not %s",
                            kvc_tier_name(tier));
    int rc = kvc_pool_layout(c, tier, lay);
    if (rc != KVC_OK)
        return rc;
    *base = kvc_pool_base(c, tier);
    if (!*base)
        return tier == KVC_TIER_L1 ? KVC_EUNAVAILABLE : KVC_EATTACH; /* message already set */
    *num_blocks = kvc_pool_num_blocks(c, tier);
    return KVC_OK;
}

int kvc_store(kvc_client *c, int tier, tkvk_prologue_params *p, void *stream)
{
    if (!p)
        return tkv_kvc_fail(KVC_EINVAL, "prologue parameters are NULL");
    tkvk_layout lay;
    void *base = NULL;
    int64_t num_blocks = 0;
    int rc = tier_pool(c, tier, &lay, &base, &num_blocks);
    if (rc != KVC_OK)
        return rc;
    /* a read-only mapping would fault on the first store: refuse before touching it */
    if (!kvc_pool_writable(c, tier))
        return tkv_kvc_fail(KVC_EINVAL, "the %s pool is mapped read-only (connect with "
                            "kvc_opts_set_trusted to write it)", kvc_tier_name(tier));
    const tkvk_layout *caller_layout = p->layout;
    p->layout = &lay;
    p->pool = base;
    p->num_blocks = num_blocks;
    int krc;
    if (tier == KVC_TIER_L1) {
#ifdef TKVK_HAVE_CUDA
        krc = tkvk_prologue_cuda(p, stream);
#else
        krc = TKVK_ENODEV; /* unreachable: without CUDA no L1 pool is mapped */
#endif
    } else {
        (void)stream;
        krc = tkvk_prologue_cpu(p);
    }
    p->layout = caller_layout;
    return krc == TKVK_OK ? KVC_OK : kernel_fail(krc, "prologue");
}

int kvc_attend(kvc_client *c, int tier, tkvk_decode_args *a, tkvk_decode_plan *plan,
               void *stream)
{
    if (!a)
        return tkv_kvc_fail(KVC_EINVAL, "decode arguments are NULL");
    tkvk_layout lay;
    void *base = NULL;
    int64_t num_blocks = 0;
    int rc = tier_pool(c, tier, &lay, &base, &num_blocks);
    if (rc != KVC_OK)
        return rc;
    if (num_blocks > INT32_MAX)
        return tkv_kvc_fail(KVC_EUNSUPPORTED, "%lld blocks in the %s pool exceed the kernels' "
                            "int block ids", (long long)num_blocks, kvc_tier_name(tier));
    if (tier == KVC_TIER_L1 && !plan)
        return tkv_kvc_fail(KVC_EINVAL, "L1 attention needs a plan (tkvk_decode_plan_create)");
    const tkvk_layout *caller_layout = a->layout;
    a->layout = &lay;
    a->pool = base;
    a->num_blocks = (int)num_blocks;
    int krc;
    const char *what = "decode";
    if (tier == KVC_TIER_L1) {
#ifdef TKVK_HAVE_CUDA
        krc = tkvk_decode_plan_cuda(plan, a->kv_lens, a->num_requests, stream);
        what = "decode plan";
        if (krc == TKVK_OK) {
            krc = tkvk_decode_attend_cuda(plan, a, stream);
            what = "decode attention";
        }
#else
        krc = TKVK_ENODEV;
#endif
    } else {
        (void)stream;
        krc = tkvk_decode_cpu(a);
    }
    a->layout = caller_layout;
    return krc == TKVK_OK ? KVC_OK : kernel_fail(krc, what);
}

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
