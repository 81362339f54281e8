/* decode_static.cu - the static split-KV baseline on the GPU (decode_static.h): the library's
 * attention kernels instantiated with kStatic (one split a CTA or warp, the grid over KV heads,
 * requests and splits), then the library's combine. */
#include "decode_static.h"

#include "decode_cta.cuh"
#include "decode_warp.cuh"

using namespace tkvk_dec;

namespace {

/* pick_variant() (kernels/decode.cu) with kStatic */
AttendVariant static_variant(int head_dim, bool fp8, int rows, bool q8, int which)
{
    if (fp8 && q8 && which != TKVK__DEC_CTA && (rows <= 16 || (rows <= 32 && head_dim <= 128))) {
        AttendVariant v = warp_variant_of<true>(head_dim, rows, which);
        if (v.fn)
            return v;
    }
    return cta_variant<true>(head_dim, fp8, q8, rows > 64);
}

/* One warp a CTA here, so each variant needs its own shared memory only (once per process). */
int static_smem_limits_now(void)
{
    static const int dims[3] = {64, 128, 256};
    static const int row_counts[5] = {8, 16, 32, 64, 128};
    for (int which = TKVK__DEC_AUTO; which <= TKVK__DEC_WARP_M16; which++)
        for (int i = 0; i < 3; i++)
            for (int f = 0; f < 2; f++)
                for (int ri = 0; ri < 5; ri++)
                    for (int q8 = 0; q8 <= f; q8++) {
                        AttendVariant v = static_variant(dims[i], f != 0, row_counts[ri],
                                                         q8 != 0, which);
                        TKVK_CUDA_TRY(cudaFuncSetAttribute(
                            (const void *)v.fn, cudaFuncAttributeMaxDynamicSharedMemorySize,
                            (int)v.smem));
                    }
    return TKVK_OK;
}

int static_smem_limits(void)
{
    static std::once_flag once;
    static int rc;
    std::call_once(once, [] { rc = static_smem_limits_now(); });
    return rc;
}

} /* namespace */

extern "C" int tkvk_decode_static_cuda(tkvk_decode_plan *pl, const tkvk_decode_args *a,
                                       int max_kv_len, int num_splits, void *stream)
{
    DecParams p;
    int rc = dec_fill_params(pl, a, "decode_static_cuda", &p);
    if (rc)
        return rc;
    if (max_kv_len < 0 || num_splits < 0)
        return tkvk__fail(TKVK_EINVAL, "decode_static_cuda: max_kv_len %d / num_splits %d < 0",
                          max_kv_len, num_splits);
    if (a->num_requests == 0)
        return TKVK_OK;
    int pairs = a->num_requests * p.num_kv_heads;
    int splits = num_splits ? num_splits
                            : tkvk__decode_static_splits(pairs, max_kv_len, pl->grid);
    if ((int64_t)pairs * splits > pl->task_cap)
        return tkvk__fail(TKVK_EINVAL, "decode_static_cuda: %d pairs x %d splits > workspace %d",
                          pairs, splits, pl->task_cap);
    int max_tiles = tkvk__decode_tiles(max_kv_len);
    p.static_splits = splits;
    p.static_chunk_tiles = max_tiles > 0 ? (max_tiles + splits - 1) / splits : 1;
    cudaStream_t s = (cudaStream_t)stream;
    bool fp8kv = a->layout->kv_dtype == TKVK_DTYPE_FP8_E4M3;
    AttendVariant v = static_variant(a->layout->head_dim, fp8kv, p.rows, fp8kv && p.q_fp8,
                                     g_kernel);
    if (!v.fn)
        return tkvk__fail(TKVK_EUNSUPPORTED, "decode_static_cuda: head dim %d",
                          a->layout->head_dim);
    if ((rc = static_smem_limits()) != TKVK_OK)
        return rc;
    TKVK_CUDA_TRY(launch_pdl(v.fn, dim3(p.num_kv_heads, a->num_requests, splits),
                             dim3(v.threads), v.smem, s, p));
    TKVK_CUDA_TRY(cudaGetLastError());
    return dec_combine(pl, a, p, kPartsStatic, s);
}

