/* decode_internal.h - what decode.c, the decode*.cu files and dev/decode/ share (not public).
 *
 * The argument checks are one function so the CPU and the CUDA entry points refuse exactly
 * the same shapes with the same sentences. */
#ifndef TKVK_DECODE_INTERNAL_H
#define TKVK_DECODE_INTERNAL_H

#include "tkvk_internal.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Largest GQA group and query length: group * q_len rows per (request, KV head). */
#define TKVK_DECODE_MAX_GROUP 16
#define TKVK_DECODE_MAX_Q_LEN 8
#define TKVK_DECODE_MAX_ROWS (TKVK_DECODE_MAX_GROUP * TKVK_DECODE_MAX_Q_LEN)
/* Default floor of tiles per CTA of the CTA kernel. Measured on an H200 (docs/perf.md): below
 * it, the extra partials cost more in the combine than the finer split saves. */
#define TKVK_DECODE_CTA_MIN_TILES 4

/* Default floor of tiles per warp worker (warp-worker kernel) for pairs of `rows` rows: a task's
 * partial (rows x D floats, written once, read once by the combine) may cost at most half the
 * FP8 K and V bytes the task reads (64 x 2 x D per tile), so the floor is ceil(rows / 16): one
 * tile up to 16 rows, two up to 32. Timed against floors 1, 2, 4 and 8 on an H200
 * (docs/perf.md). */
static inline int tkvk__decode_warp_min_tiles(int rows) /* rows >= 1 */
{
    return (rows + 15) / 16;
}

/* Shape checks common to every decode entry point (pointers are only checked for NULL;
 * their contents are the CPU path's to validate). `who` prefixes the error sentence. */
int tkvk__decode_check(const tkvk_decode_args *a, const char *who);

/* Tiles of a request of kv_len tokens (negative lengths count as 0). */
static inline int tkvk__decode_tiles(int32_t kv_len)
{
    return kv_len <= 0 ? 0 : (int)((kv_len + TKVK_DECODE_TILE_TOKENS - 1) / TKVK_DECODE_TILE_TOKENS);
}

#ifdef __CUDACC__
#define TKVK__HD __host__ __device__
#else
#define TKVK__HD
#endif

/* A plan's bins: num_bins of per_cta tiles, shared over the CTAs in order, the first rem =
 * num_bins % CTAs of them one more (q + 1) than the others (q = num_bins / CTAs), so that
 * every SM gets work. */
typedef struct {
    int per_cta, num_bins, q, rem;
} tkvk__decode_bins;

/* The bins of num_tiles tiles for a grid of `grid` workers in `ctas` CTAs: per_cta =
 * max(ceil(num_tiles / grid), min_tiles) (the floor, tkv_kernels.h). grid, min_tiles, ctas
 * >= 1. Both planners (CPU and the plan kernel) size their bins here. */
static inline TKVK__HD tkvk__decode_bins tkvk__decode_bins_of(int num_tiles, int grid,
                                                              int min_tiles, int ctas)
{
    tkvk__decode_bins b;
    b.per_cta = (num_tiles + grid - 1) / grid;
    if (b.per_cta < min_tiles)
        b.per_cta = min_tiles;
    b.num_bins = (num_tiles + b.per_cta - 1) / b.per_cta;
    b.q = b.num_bins / ctas;
    b.rem = b.num_bins % ctas;
    return b;
}

static inline TKVK__HD int tkvk__decode_cta_first_bin(const tkvk__decode_bins *b, int cta)
{
    return cta * b->q + (cta < b->rem ? cta : b->rem);
}
static inline TKVK__HD int tkvk__decode_cta_of_bin(const tkvk__decode_bins *b, int bin)
{
    int split = b->rem * (b->q + 1); /* the bins of the CTAs that take q + 1 */
    return bin < split ? bin / (b->q + 1) : b->rem + (bin - split) / b->q;
}

/* Fewest bins per CTA at which CTAs merge their runs of bins (tkv_kernels.h, slots): with
 * fewer, a pair has few partials anyway, and the merge at the end of the CTA (a pass over
 * the partials in shared memory) costs more than the combine saves (measured on an H200,
 * docs/perf.md). */
#define TKVK__DECODE_MIN_JOIN 4

/* Slot joins (tkv_kernels.h, slots) among the tasks of a pair of tiles [start, end) in bins
 * up to `upto`: the bins x in [lo, min(upto, hi)] that are not the first of their CTA, where
 * lo..hi are the bins that the pair covers whole together with the bin before (start <=
 * (x - 1) per_cta, (x + 1) per_cta <= end); none when the CTAs get fewer than
 * TKVK__DECODE_MIN_JOIN bins. A task's slot is its pair's first slot + its index in the pair
 * - the joins up to its bin; the pair's slot count is its task count - all its joins. */
static inline TKVK__HD int tkvk__decode_joins(const tkvk__decode_bins *b, int start, int end,
                                              int upto)
{
    if (b->q < TKVK__DECODE_MIN_JOIN)
        return 0;
    int lo = (start + b->per_cta - 1) / b->per_cta + 1, hi = end / b->per_cta - 1;
    if (hi > upto)
        hi = upto;
    if (hi < lo)
        return 0;
    /* the bins in [0, x] that are not the first of their CTA: x - (CTA of x) */
    return (hi - tkvk__decode_cta_of_bin(b, hi)) -
           ((lo - 1) - tkvk__decode_cta_of_bin(b, lo - 1));
}

/* The CPU split paths' shared tail (decode.c; also the static baseline's in dev/decode/): for
 * every pair, attend each of the position ranges ranges() gives ([begin, end) pairs, at most
 * cap) and combine. a must have passed tkvk__decode_check_host(). */
typedef int (*tkvk__decode_ranges_fn)(const void *ctx, int pair, int *begin, int *end, int cap);
int tkvk__decode_split_run(const tkvk_decode_args *a, int max_parts,
                           tkvk__decode_ranges_fn ranges, const void *ctx);
/* tkvk__decode_check() and the host-side checks of the CPU entry points (lengths within the
 * block table, block ids within the pool). */
int tkvk__decode_check_host(const tkvk_decode_args *a, const char *who);

/* Benchmarks and tests only (not thread-safe): which attention kernel plans made and decode
 * steps launched from now on use, so that they can be timed side by side in one run. A plan
 * must be used with the setting it was made with.
 *   AUTO   the launcher's choice (the warp-worker kernel where it applies)
 *   CTA    the CTA kernel for every shape
 *   WARP_M16  for at most 8 rows, the warp-worker kernel with the rows on the mma's M side
 *          (padded to 16) instead of its N side
 *   WARP_ONE  for 17..32 rows, one warp per worker of the warp-worker kernel, with both
 *          m-tiles of 16 rows, instead of two warps of one m-tile each
 *   LEGACY the launcher's choice without the warpgroup kernel (what it was before it)
 *   WG     the warpgroup kernel wherever it applies (FP8 Q over FP8 KV, D 128, 1..64 rows;
 *          the launcher's choice takes it past 16 rows only; its form: tkvk__decode_wg_form) */
enum {
    TKVK__DEC_AUTO = 0,
    TKVK__DEC_CTA = 1,
    TKVK__DEC_WARP_M16 = 2,
    TKVK__DEC_WARP_ONE = 3,
    TKVK__DEC_LEGACY = 4,
    TKVK__DEC_WG = 5,
    TKVK__DEC_LAST = TKVK__DEC_WG
};
void tkvk__decode_kernel(int which);
/* Benchmarks and tests: the combine's shape in steps launched from now on: K + 100 * S for K
 * warps per row (1, 2, 4, 8, 16) over S slices of the head dim (1, 2, 4; up to D / 32);
 * 0 the launcher's choice. */
void tkvk__decode_tune(int combine);
/* Benchmarks: warp workers per CTA of the warp-worker kernel in plans made from now on (the
 * SM holds 8 workers either way, in 8 / warps CTAs); 0 the launcher's choice. */
void tkvk__decode_cta_warps(int warps);
/* Benchmarks and tests: the warpgroup kernel's form in plans made and steps launched from now
 * on: 2, 3 or 4 K/V stages (fewer stages, more CTAs an SM), each tile's P.V awaited after the
 * next tile's Q.K; 12, 13: 2 or 3 stages, P.V awaited at once; 22: 2 stages, P.V at once,
 * queries read at each task's start (less shared memory, 4 CTAs an SM up to 32 rows); 32:
 * form 12 with the running maximum kept while a tile's scores stay within 8 of it (the
 * launcher's), 34: within 0; 0 (or any other value) the launcher's choice. */
void tkvk__decode_wg_form(int form);

#ifdef __cplusplus
}
#endif
#endif
