/* decode_plan.cu - the plan of decode attention: one CTA cuts every (request, KV head) pair
 * into 64-token tiles, lays them end to end and cuts that sequence into one bin per worker,
 * on the device (no host round trip), so plan + attention + combine replay in a CUDA graph
 * with new lengths. Also the plan handle (tkvk_decode_plan_*). docs/design.md, decode, "Plan on the device". */
#include "decode_dev.cuh"

namespace tkvk_dec {
namespace {

/* info[0..5] = num_bins, num_tiles, num_tasks, tiles_per_cta, num_slots, bins_per_cta. Same
 * map as tkvk_decode_plan_cpu(), which reads the rules directly; this kernel runs on one SM,
 * where every instruction and every dependent step counts (timed by phase with Nsight
 * Compute, docs/perf.md), so it works out each pair's bins once (pass 2), each task's from
 * them with one division, and the values common to all threads in one thread. Its CTAs
 * (`ctas` of cta_warps warps) share the bins in order (tkvk__decode_bins); bin j of CTA c is
 * worked by warp c * cta_warps + j or, where may_pair (17..32 rows) and no CTA has more than
 * cta_warps / 2 bins, by warps c * cta_warps + 2j and 2j + 1 (rows 0..15 and 16..; the
 * map is the same either way). The worker_* arrays hold each warp's head (WarpHead: task
 * range [first, end), first task, and its request's length, slot, whether the CTA merges its
 * partial, and the warps of its bin), for one round trip at its start. kSmem: the per-pair
 * values of passes 1-3 (kPlanPairInts) live in dynamic shared memory (pass 3's binary search
 * reads them ~9 times in a row); else in the output arrays and pair_scratch (4 ints a pair). */
template <bool kSmem>
__global__ void __launch_bounds__(kPlanThreads, 1)
    dec_plan_kernel(const int32_t *kv_lens, int num_requests, int hkv, int grid, int min_tiles,
                    int cta_warps, int ctas, int may_pair, int4 *tasks, int32_t *task_len,
                    int32_t *task_slot, int32_t *bin_first, int2 *worker_span,
                    int4 *worker_task0, int4 *worker_aux0, int32_t *pair_first,
                    int32_t *pair_count, int32_t *slot_first, int32_t *slot_count,
                    int32_t *info, int32_t *pair_scratch)
{
    extern __shared__ int32_t plan_smem[];
    __shared__ tkvk__decode_bins s_bins;
    __shared__ int s_hv;
    pdl_wait(); /* the previous step's kernels may still read the map */
    pdl_trigger();
    const int num_pairs = num_requests * hkv;
    int32_t *const scratch = kSmem ? plan_smem : pair_scratch;
    /* until pass 4 pair_count holds the tile starts and slot_count the lengths */
    int32_t *const p_len = kSmem ? plan_smem + 4 * num_pairs : slot_count;
    int32_t *const p_start = kSmem ? plan_smem + 5 * num_pairs : pair_count;
    int32_t *const p_first = kSmem ? plan_smem + 6 * num_pairs : pair_first;
    int32_t *const p_slot = kSmem ? plan_smem + 7 * num_pairs : slot_first;
    /* a pair's request, first bin, the last bin it covers whole with the bin before, and the
     * bins before its first joinable one that are not the first of their CTA (joins) */
    int32_t *const p_req = scratch, *const p_bin0 = scratch + num_pairs;
    int32_t *const p_hi = scratch + 2 * num_pairs, *const p_base = scratch + 3 * num_pairs;
    /* pass 1: each pair's length and tile start */
    int carry = 0;
    for (int base = 0; base < num_pairs; base += blockDim.x) {
        int p = base + threadIdx.x, req = p / hkv;
        int32_t len = p < num_pairs ? max(kv_lens[req], 0) : 0;
        int total;
        int start = block_exclusive_scan(tiles_of(len), &total);
        if (p < num_pairs) {
            p_req[p] = req;
            p_len[p] = len;
            p_start[p] = carry + start;
        }
        carry += total;
    }
    const int num_tiles = carry;
    if (threadIdx.x == 0) {
        s_bins = tkvk__decode_bins_of(num_tiles, grid, min_tiles, ctas);
        /* workers of two warps, each with half the rows, where every CTA has at most
         * cta_warps / 2 bins: then the bins stay at the floor and twice the warps work */
        s_hv = may_pair && (s_bins.q + (s_bins.rem > 0)) * 2 <= cta_warps ? 2 : 1;
    }
    __syncthreads();
    const tkvk__decode_bins bins = s_bins;
    const int hv = s_hv;
    const int per_cta = bins.per_cta, num_bins = bins.num_bins;
    const bool joining = bins.q >= TKVK__DECODE_MIN_JOIN;

    /* pass 2: each pair's tasks and slots, and the index of its first task and slot (one
     * scan of both: tasks in the low 32 bits, slots in the high). The joins of
     * tkvk__decode_joins(): bins x in [lo, hi] not first of their CTA count
     * (x - cta(x)) - base with base = (lo - 1) - cta(lo - 1). */
    long long both_carry = 0;
    for (int base = 0; base < num_pairs; base += blockDim.x) {
        int p = base + threadIdx.x;
        long long count = 0, slots = 0;
        if (p < num_pairs) {
            int start = p_start[p], end = start + tiles_of(p_len[p]);
            int bin0 = start / per_cta, hi = end / per_cta - 1;
            int lo = bin0 + (start != bin0 * per_cta) + 1;
            int jbase = 0;
            if (end > start)
                count = (end - 1) / per_cta - bin0 + 1;
            slots = count;
            if (joining && hi >= lo) {
                jbase = (lo - 1) - tkvk__decode_cta_of_bin(&bins, lo - 1);
                slots -= (hi - tkvk__decode_cta_of_bin(&bins, hi)) - jbase;
            }
            p_bin0[p] = bin0;
            p_hi[p] = hi;
            p_base[p] = jbase;
        }
        long long total;
        long long first = both_carry + block_exclusive_scan(count | slots << 32, &total);
        if (p < num_pairs) {
            p_first[p] = (int)(first & 0xffffffff);
            p_slot[p] = (int)(first >> 32);
        }
        both_carry += total;
    }
    __syncthreads();
    const int task_carry = (int)(both_carry & 0xffffffff), slot_carry = (int)(both_carry >> 32);
    /* pass 3: every task in parallel (one long request can have hundreds): its pair is the
     * last one whose first task is <= d (pairs without tasks share the next one's first) */
    for (int d = threadIdx.x; d < task_carry; d += blockDim.x) {
        int lo = 0, hi = num_pairs - 1;
        while (lo < hi) {
            int mid = (lo + hi + 1) >> 1;
            if (p_first[mid] <= d)
                lo = mid;
            else
                hi = mid - 1;
        }
        const int p = lo, k = d - p_first[p], req = p_req[p], bin0 = p_bin0[p];
        const int32_t len = p_len[p];
        const int start = p_start[p], end = start + tiles_of(len);
        const int bin = bin0 + k, bin_hi = p_hi[p];
        const int join_lo = bin0 + (start != bin0 * per_cta) + 1;
        const int t0 = max(start, bin * per_cta), t1 = min(end, (bin + 1) * per_cta);
        const int c = tkvk__decode_cta_of_bin(&bins, bin);
        const int c_first = tkvk__decode_cta_first_bin(&bins, c);
        int joins = 0; /* tkvk__decode_joins(&bins, start, end, bin) */
        if (joining && bin >= join_lo && bin_hi >= join_lo) {
            if (bin <= bin_hi) {
                joins = (bin - c) - p_base[p];
            } else { /* all the pair's joins: its tasks - its slots */
                int next = p + 1 < num_pairs;
                joins = ((next ? p_first[p + 1] : task_carry) - p_first[p]) -
                        ((next ? p_slot[p + 1] : slot_carry) - p_slot[p]);
            }
        }
        const int4 tk = make_int4(req, p - req * hkv, t0 - start, t1 - start);
        const int slot = p_slot[p] + k - joins;
        tasks[d] = tk;
        task_len[d] = len;
        task_slot[d] = slot;
        if (t0 == bin * per_cta) {
            /* the bin's head: the first task of its worker, and the end of the bin before */
            bin_first[bin] = d;
            const int w = c * cta_warps + (bin - c_first) * hv; /* its (first) warp */
            /* holds: the task shares its slot with the one before (its bin is joined) or the
             * one after (the next bin is): then it is its bin's only task, and its partial
             * waits in shared memory for the CTA's merge */
            const bool joined = joining && bin >= join_lo && bin <= bin_hi && bin != c_first;
            const bool next_joined = joining && bin + 1 >= join_lo && bin + 1 <= bin_hi &&
                                     bin + 1 != tkvk__decode_cta_first_bin(&bins, c + 1);
            /* the first warp of the bin before */
            const int wp =
                bin == 0         ? -1
                : bin != c_first ? w - hv
                                 : (c - 1) * cta_warps +
                                       (bin - 1 - tkvk__decode_cta_first_bin(&bins, c - 1)) * hv;
            for (int i = 0; i < hv; i++) {
                worker_span[w + i].x = d;
                worker_task0[w + i] = tk;
                worker_aux0[w + i] = make_int4(len, slot, joined || next_joined, hv);
                if (wp >= 0)
                    worker_span[wp + i].y = d;
            }
        }
    }
    __syncthreads();
    /* pass 4: each pair's first task and slot and their counts (the counts replace the tile
     * starts and lengths); the last bin's end; the workers without a bin */
    for (int p = threadIdx.x; p < num_pairs; p += blockDim.x) {
        int first = p_first[p], slot = p_slot[p];
        pair_count[p] = (p + 1 < num_pairs ? p_first[p + 1] : task_carry) - first;
        slot_count[p] = (p + 1 < num_pairs ? p_slot[p + 1] : slot_carry) - slot;
        pair_first[p] = first;
        slot_first[p] = slot;
    }
    for (int b = num_bins + threadIdx.x; b <= grid; b += blockDim.x)
        bin_first[b] = task_carry;
    if (threadIdx.x < hv && num_bins > 0) {
        int c = tkvk__decode_cta_of_bin(&bins, num_bins - 1);
        worker_span[c * cta_warps + (num_bins - 1 - tkvk__decode_cta_first_bin(&bins, c)) * hv +
                    threadIdx.x]
            .y = task_carry;
    }
    for (int c = threadIdx.x; c < ctas; c += blockDim.x)
        for (int j = (tkvk__decode_cta_first_bin(&bins, c + 1) -
                      tkvk__decode_cta_first_bin(&bins, c)) * hv;
             j < cta_warps; j++)
            worker_span[c * cta_warps + j] = make_int2(0, 0);
    if (threadIdx.x == 0) {
        info[0] = num_bins;
        info[1] = num_tiles;
        info[2] = task_carry;
        info[3] = per_cta;
        info[4] = slot_carry;
        info[5] = (num_bins + ctas - 1) / ctas;
    }
}


} /* namespace */

/* The plan kernel's dynamic shared memory at most (set with the limits) */
static size_t g_plan_smem_max = 0;

cudaError_t dec_plan_set_smem(int optin)
{
    cudaFuncAttributes plan_attr;
    cudaError_t e = cudaFuncGetAttributes(&plan_attr, (const void *)dec_plan_kernel<true>);
    if (e != cudaSuccess)
        return e;
    g_plan_smem_max = (size_t)optin - plan_attr.sharedSizeBytes;
    return cudaFuncSetAttribute((const void *)dec_plan_kernel<true>,
                                cudaFuncAttributeMaxDynamicSharedMemorySize,
                                (int)g_plan_smem_max);
}

} /* namespace tkvk_dec */

using namespace tkvk_dec;

extern "C" int tkvk_decode_plan_create(tkvk_decode_plan **out, int max_requests, int num_kv_heads,
                                       int max_rows, int head_dim)
{
    if (!out)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_create: out is NULL");
    *out = NULL;
    if (max_requests < 1 || num_kv_heads < 1 || max_rows < 1)
        return tkvk__fail(TKVK_EINVAL,
                          "decode_plan_create: max_requests %d, num_kv_heads %d, max_rows %d",
                          max_requests, num_kv_heads, max_rows);
    if (max_rows > TKVK_DECODE_MAX_ROWS)
        return tkvk__fail(TKVK_EUNSUPPORTED, "decode_plan_create: max_rows %d > %d", max_rows,
                          TKVK_DECODE_MAX_ROWS);
    if (!tkvk__head_dim_ok(head_dim))
        return tkvk__fail(TKVK_EUNSUPPORTED, "decode_plan_create: head_dim %d", head_dim);
    if ((int64_t)max_requests * num_kv_heads > (1 << 24))
        return tkvk__fail(TKVK_EINVAL, "decode_plan_create: %d x %d pairs is too many",
                          max_requests, num_kv_heads);
    if (!tkvk_cuda_available())
        return tkvk__fail(TKVK_ENODEV, "decode_plan_create: no usable GPU");

    tkvk_decode_plan *pl = (tkvk_decode_plan *)calloc(1, sizeof *pl);
    if (!pl)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_create: out of memory");
    int rc = TKVK_OK, occ = 0;
    size_t pairs = (size_t)max_requests * num_kv_heads;
    AttendVariant v = pick_variant(head_dim, true, max_rows, true, g_kernel);
    cudaError_t e;
#define DEC_TRY(call)                                                                            \
    do {                                                                                         \
        e = (call);                                                                              \
        if (e != cudaSuccess) {                                                                  \
            rc = tkvk__fail(TKVK_ECUDA, "decode_plan_create: %s: %s", #call,                     \
                            cudaGetErrorString(e));                                              \
            goto fail;                                                                           \
        }                                                                                        \
    } while (0)
    DEC_TRY(cudaGetDevice(&pl->device));
    DEC_TRY(cudaDeviceGetAttribute(&pl->num_sms, cudaDevAttrMultiProcessorCount, pl->device));
    rc = dec_set_smem_limits();
    if (rc)
        goto fail;
    pl->cta_warps = 1;
    pl->may_pair = 0;
    if (v.threads == 32) {
        /* the warp-worker kernel: kWarpWorkersPerSm workers an SM in CTAs of cta_warps, held
         * there by a shared-memory carve-out that leaves the rest of the SM's memory to L1 */
        int carve = cudaSharedmemCarveoutDefault, smem_sm = 0, optin = 0;
        if ((rc = dec_smem_optin(&optin)) != TKVK_OK)
            goto fail;
        int per_sm = dec_fit_warps(v.smem, optin, kWarpWorkersPerSm);
        pl->cta_warps = g_cta_warps > 0 && g_cta_warps < per_sm ? g_cta_warps : per_sm;
        occ = per_sm / pl->cta_warps;
        pl->may_pair = max_rows > 16 && g_kernel != TKVK__DEC_WARP_ONE;
        DEC_TRY(cudaDeviceGetAttribute(&smem_sm, cudaDevAttrMaxSharedMemoryPerMultiprocessor,
                                       pl->device));
        /* each CTA also takes 1 KB of the SM's shared memory for the system */
        size_t smem_need = (size_t)occ * (pl->cta_warps * v.smem + 1024);
        if (smem_sm > 0)
            carve = (int)((smem_need * 100 + smem_sm - 1) / smem_sm);
        DEC_TRY(cudaFuncSetAttribute((const void *)v.fn,
                                     cudaFuncAttributePreferredSharedMemoryCarveout,
                                     carve > 100 ? 100 : carve));
    } else {
        DEC_TRY(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&occ, v.fn, v.threads, v.smem));
    }
    if (occ < 1)
        occ = 1;
    pl->grid = pl->num_sms * occ * pl->cta_warps;
    /* the warpgroup kernel takes the warp workers' floor: its partials cost the same */
    pl->min_tiles = v.threads == 32 || v.fn == dec_wg_variant(head_dim, max_rows).fn
                        ? tkvk__decode_warp_min_tiles(max_rows)
                        : TKVK_DECODE_CTA_MIN_TILES;
    pl->max_requests = max_requests;
    pl->num_kv_heads = num_kv_heads;
    pl->max_rows = max_rows;
    pl->head_dim = head_dim;
    pl->task_cap = (int)pairs + pl->grid;
    pl->planned_requests = -1;
    DEC_TRY(cudaMalloc((void **)&pl->tasks, (size_t)pl->task_cap * sizeof(int4)));
    DEC_TRY(cudaMalloc((void **)&pl->task_len, (size_t)pl->task_cap * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->task_slot, (size_t)pl->task_cap * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->bin_first, ((size_t)pl->grid + 1) * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->worker_span, (size_t)pl->grid * sizeof(int2)));
    DEC_TRY(cudaMalloc((void **)&pl->worker_task0, (size_t)pl->grid * sizeof(int4)));
    DEC_TRY(cudaMalloc((void **)&pl->worker_aux0, (size_t)pl->grid * sizeof(int4)));
    DEC_TRY(cudaMalloc((void **)&pl->pair_first, pairs * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->pair_count, pairs * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->slot_first, pairs * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->slot_count, pairs * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->pair_scratch, pairs * 4 * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->info, 6 * sizeof(int32_t)));
    DEC_TRY(cudaMalloc((void **)&pl->part_o,
                       (size_t)pl->task_cap * max_rows * head_dim * sizeof(float)));
    DEC_TRY(cudaMalloc((void **)&pl->part_lse, (size_t)pl->task_cap * max_rows * sizeof(float)));
#undef DEC_TRY
    *out = pl;
    return TKVK_OK;
fail:
    tkvk_decode_plan_destroy(pl);
    return rc;
}

extern "C" void tkvk_decode_plan_destroy(tkvk_decode_plan *pl)
{
    if (!pl)
        return;
    cudaFree(pl->tasks);
    cudaFree(pl->task_len);
    cudaFree(pl->task_slot);
    cudaFree(pl->bin_first);
    cudaFree(pl->worker_span);
    cudaFree(pl->worker_task0);
    cudaFree(pl->worker_aux0);
    cudaFree(pl->pair_first);
    cudaFree(pl->pair_count);
    cudaFree(pl->slot_first);
    cudaFree(pl->slot_count);
    cudaFree(pl->pair_scratch);
    cudaFree(pl->info);
    cudaFree(pl->part_o);
    cudaFree(pl->part_lse);
    free(pl);
}

extern "C" int tkvk_decode_plan_grid(const tkvk_decode_plan *pl)
{
    return pl ? pl->grid : 0;
}

extern "C" int tkvk_decode_plan_cta_warps(const tkvk_decode_plan *pl)
{
    return pl ? pl->cta_warps : 0;
}

extern "C" int tkvk_decode_plan_min_tiles(const tkvk_decode_plan *pl)
{
    return pl ? pl->min_tiles : 0;
}

extern "C" int tkvk_decode_plan_set_min_tiles(tkvk_decode_plan *pl, int min_tiles_per_cta)
{
    if (!pl || min_tiles_per_cta < 1)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_set_min_tiles: plan NULL or floor %d < 1",
                          min_tiles_per_cta);
    pl->min_tiles = min_tiles_per_cta;
    return TKVK_OK;
}

extern "C" int tkvk_decode_plan_cuda(tkvk_decode_plan *pl, const int32_t *kv_lens,
                                     int num_requests, void *stream)
{
    if (!pl)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_cuda: plan is NULL");
    if (num_requests < 0 || num_requests > pl->max_requests)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_cuda: num_requests %d outside 0..%d",
                          num_requests, pl->max_requests);
    if (num_requests > 0 && !kv_lens)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_cuda: kv_lens is NULL");
    int rc = dec_set_smem_limits();
    if (rc)
        return rc;
    /* the per-pair values in shared memory where they fit (up to ~7K pairs on an H200) */
    size_t smem = (size_t)num_requests * pl->num_kv_heads * kPlanPairInts * sizeof(int32_t);
    bool in_smem = smem <= g_plan_smem_max;
    TKVK_CUDA_TRY(launch_pdl(in_smem ? dec_plan_kernel<true> : dec_plan_kernel<false>, dim3(1),
                             dim3(kPlanThreads), in_smem ? smem : 0, (cudaStream_t)stream,
                             kv_lens, num_requests, pl->num_kv_heads, pl->grid, pl->min_tiles,
                             pl->cta_warps, pl->grid / pl->cta_warps, pl->may_pair, pl->tasks,
                             pl->task_len, pl->task_slot, pl->bin_first, pl->worker_span,
                             pl->worker_task0, pl->worker_aux0, pl->pair_first, pl->pair_count,
                             pl->slot_first, pl->slot_count, pl->info, pl->pair_scratch));
    TKVK_CUDA_TRY(cudaGetLastError());
    pl->planned_requests = num_requests;
    return TKVK_OK;
}

extern "C" int tkvk_decode_plan_download(tkvk_decode_plan *pl, tkvk_decode_map *map, void *stream)
{
    if (!pl || !map || !map->tasks)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_download: plan or map NULL / not initialised");
    int pairs = pl->planned_requests * pl->num_kv_heads;
    if (pl->planned_requests < 0)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_download: nothing planned yet");
    if (map->num_pairs < pairs || map->grid < pl->grid)
        return tkvk__fail(TKVK_EINVAL, "decode_plan_download: map too small (%d pairs, grid %d)",
                          map->num_pairs, map->grid);
    cudaStream_t s = (cudaStream_t)stream;
    int32_t info[6];
    TKVK_CUDA_TRY(cudaMemcpyAsync(info, pl->info, sizeof info, cudaMemcpyDeviceToHost, s));
    TKVK_CUDA_TRY(cudaStreamSynchronize(s));
    if (info[2] > pl->task_cap || info[2] < 0)
        return tkvk__fail(TKVK_ECUDA, "decode_plan_download: device map has %d tasks", info[2]);
    static_assert(sizeof(tkvk_decode_task) == sizeof(int4), "task layout");
    TKVK_CUDA_TRY(cudaMemcpyAsync(map->tasks, pl->tasks, (size_t)info[2] * sizeof(int4),
                                  cudaMemcpyDeviceToHost, s));
    TKVK_CUDA_TRY(cudaMemcpyAsync(map->task_slot, pl->task_slot, (size_t)info[2] * 4,
                                  cudaMemcpyDeviceToHost, s));
    TKVK_CUDA_TRY(cudaMemcpyAsync(map->bin_first, pl->bin_first,
                                  ((size_t)pl->grid + 1) * sizeof(int32_t), cudaMemcpyDeviceToHost, s));
    if (pairs > 0) {
        TKVK_CUDA_TRY(cudaMemcpyAsync(map->pair_first, pl->pair_first, (size_t)pairs * 4,
                                      cudaMemcpyDeviceToHost, s));
        TKVK_CUDA_TRY(cudaMemcpyAsync(map->pair_count, pl->pair_count, (size_t)pairs * 4,
                                      cudaMemcpyDeviceToHost, s));
        TKVK_CUDA_TRY(cudaMemcpyAsync(map->slot_first, pl->slot_first, (size_t)pairs * 4,
                                      cudaMemcpyDeviceToHost, s));
        TKVK_CUDA_TRY(cudaMemcpyAsync(map->slot_count, pl->slot_count, (size_t)pairs * 4,
                                      cudaMemcpyDeviceToHost, s));
    }
    TKVK_CUDA_TRY(cudaStreamSynchronize(s));
    map->grid = pl->grid;
    map->num_bins = info[0];
    map->num_tiles = info[1];
    map->num_tasks = info[2];
    map->tiles_per_cta = info[3];
    map->num_slots = info[4];
    map->bins_per_cta = info[5];
    return TKVK_OK;
}


namespace tkvk_dec {

} /* namespace tkvk_dec */
