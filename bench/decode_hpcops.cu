/* decode_hpcops.cu - calls HPC-Ops' dynamic FP8 decode attention (decode_hpcops.h says what and
 * why). Its launchers are called directly, as its own Python entry point calls them for
 * `attention_decode_fp8(..., quant_type=QPERTOKEN_PERHEAD_KPERTENSOR_VPERTENSOR,
 * task_map=...)`: the task map sized and headed as its `get_attention_decode_task_workspace`
 * does, filled once by its device planner (new_kv_included: our kv_lens count the query tokens;
 * min_process_len 64, its benchmark's default); the partials sized for its CTA count. */
#include "decode_hpcops.h"

#include <stdlib.h>

#include <algorithm>

#include "src/attention/decode/decode.h"
#include "src/attention/decode/sched_task_info.h"
#include "src/attention/decode/smallm_dim128.h"
#include "src/utils/utils.h"

namespace dec = hpc::attention::decode;

struct hpcops_decode {
    hpcops_decode_args a;
    int ctas;
    int *task_map, *split_flag;
    float *lse, *split_out, *kv_scales;
};

int hpcops_decode_supported(int group, int q_len)
{
    return (group == 4 || group == 8) && q_len >= 1 && q_len <= 4;
}

/* Its partials are [request][CTA][q_len][Hq][128] floats addressed with 32-bit offsets: past
 * 2^31 elements (e.g. 256 requests of 64/8 heads at q_len 3: 396 CTAs) they wrap and it faults. */
static int hpcops_parts_fit(const hpcops_decode_args *a, int ctas)
{
    return (double)a->num_requests * ctas * a->q_len * a->num_q_heads * 128 < 2147483648.0;
}

static const int kMinProcessLen = 64, kTileN = 64, kTaskBytes = 48;

hpcops_decode *hpcops_decode_create(const hpcops_decode_args *a, cudaStream_t s)
{
    if (!hpcops_decode_supported(a->num_q_heads / a->num_kv_heads, a->q_len))
        return NULL;
    hpcops_decode *h = (hpcops_decode *)calloc(1, sizeof *h);
    if (!h)
        return NULL;
    h->a = *a;
    const int sms = hpc::get_sm_count();
    h->ctas = dec::dynamic::kCtaPerSmMap.at(9)[a->q_len - 1] * sms;
    if (!hpcops_parts_fit(a, h->ctas)) {
        free(h);
        return NULL;
    }
    /* the workspace: the same sizes and header words as its Python allocator */
    const long long max_ctas = (long long)sms * 4;
    const long long tiles =
        (long long)a->num_requests * a->num_kv_heads * ((a->max_kv_len + kTileN - 1) / kTileN);
    long long max_tasks = 0;
    for (int per_sm = 4; per_sm >= 1; per_sm--) {
        const long long n = (long long)sms * per_sm;
        const long long per = std::max((tiles + n - 1) / n, (long long)kMinProcessLen / kTileN);
        max_tasks = std::max(max_tasks, (per + 1) * n + 1);
    }
    const long long chunk_bytes = (long long)a->num_requests * a->num_kv_heads * 4;
    const long long batch_pad = (chunk_bytes + kTaskBytes - 1) / kTaskBytes * kTaskBytes;
    const int stride_ints = kTaskBytes / 4;
    const long long cta_pad = (max_ctas + stride_ints - 1) / stride_ints * stride_ints * 4;
    const long long sched = max_tasks * kTaskBytes + batch_pad;
    const long long ws = sched + 2 * cta_pad;
    int header[5] = {0, 0, a->num_kv_heads, a->num_requests, (int)sched};
    const size_t rows = (size_t)a->num_requests * a->q_len;
    const size_t lse_n = (size_t)a->num_requests * h->ctas * a->num_kv_heads * a->q_len * 8;
    const size_t part_n = (size_t)h->ctas * rows * a->num_q_heads * 128;
    const float scales[2] = {a->k_scale, a->v_scale};
    if (cudaMalloc((void **)&h->task_map, (size_t)ws) != cudaSuccess ||
        cudaMemsetAsync(h->task_map, 0, (size_t)ws, s) != cudaSuccess ||
        cudaMemcpyAsync(h->task_map, header, sizeof header, cudaMemcpyHostToDevice, s) !=
            cudaSuccess ||
        cudaMalloc((void **)&h->split_flag, (size_t)a->num_requests * a->num_kv_heads * 4) !=
            cudaSuccess ||
        cudaMemsetAsync(h->split_flag, 0, (size_t)a->num_requests * a->num_kv_heads * 4, s) !=
            cudaSuccess ||
        cudaMalloc((void **)&h->lse, lse_n * 4) != cudaSuccess ||
        cudaMalloc((void **)&h->split_out, part_n * 4) != cudaSuccess ||
        cudaMalloc((void **)&h->kv_scales, sizeof scales) != cudaSuccess ||
        cudaMemcpyAsync(h->kv_scales, scales, sizeof scales, cudaMemcpyHostToDevice, s) !=
            cudaSuccess)
        goto fail;
    if (!dec::assign_attention_decode_task_async(h->task_map, a->kv_lens, h->ctas, a->num_requests,
                                                 a->num_kv_heads, a->q_len, kTileN, true,
                                                 kMinProcessLen, s) ||
        cudaStreamSynchronize(s) != cudaSuccess)
        goto fail;
    return h;
fail:
    (void)cudaGetLastError();
    hpcops_decode_destroy(h);
    return NULL;
}

int hpcops_decode_run(hpcops_decode *h, cudaStream_t s)
{
    const hpcops_decode_args *a = &h->a;
    const int ld = a->num_q_heads * 128;
    bool ok = dec::smallm_fp8_qpertoken_perhead_kvpertensor_dim128_dynamic_async(
        a->out, h->lse, h->split_out, h->task_map, a->q, (void *)a->k, (void *)a->v,
        a->block_table, a->kv_lens, a->q_scales, h->kv_scales, h->kv_scales + 1, h->split_flag,
        true, h->ctas, 0, 1, a->num_requests, a->q_len, a->num_q_heads, a->num_kv_heads,
        a->num_kv_heads, 128, 128, a->num_blocks, 64, a->table_stride, a->num_q_heads, ld, ld,
        a->block_stride, a->token_stride, a->head_stride, a->block_stride, a->token_stride,
        a->head_stride, s);
    return ok && cudaGetLastError() == cudaSuccess ? 0 : -1;
}

void hpcops_decode_destroy(hpcops_decode *h)
{
    if (!h)
        return;
    cudaFree(h->task_map);
    cudaFree(h->split_flag);
    cudaFree(h->lse);
    cudaFree(h->split_out);
    cudaFree(h->kv_scales);
    free(h);
}
