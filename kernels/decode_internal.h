/* decode_internal.h - what decode.c and decode.cu share (not public).
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
/* Default floors of tiles per worker: a warp worker (warp-worker kernel) and a CTA (CTA
 * kernel). Measured on an H200 (docs/perf.md): below these, the extra partials cost more in
 * the combine than the finer split saves. */
#define TKVK_DECODE_DEFAULT_MIN_TILES 2
#define TKVK_DECODE_CTA_MIN_TILES 4

/* Shape checks common to every decode entry point (pointers are only checked for NULL;
 * their contents are the CPU path's to validate). `who` prefixes the error sentence. */
int tkvk__decode_check(const tkvk_decode_args *a, const char *who);

/* Tiles of a request of kv_len tokens (negative lengths count as 0). */
static inline int tkvk__decode_tiles(int32_t kv_len)
{
    return kv_len <= 0 ? 0 : (int)((kv_len + TKVK_DECODE_TILE_TOKENS - 1) / TKVK_DECODE_TILE_TOKENS);
}

/* Splits for the static baseline: enough CTAs over (pairs x splits) to fill `grid` CTA
 * slots, never more splits than the longest request has tiles. */
int tkvk__decode_static_splits(int num_pairs, int max_kv_len, int grid);

/* Benchmarks and tests only (not thread-safe): which attention kernel plans made and decode
 * steps launched from now on use, so that they can be timed side by side in one run. A plan
 * must be used with the setting it was made with.
 *   AUTO   the launcher's choice (the warp-worker kernel where it applies)
 *   CTA    the CTA kernel for every shape */
enum { TKVK__DEC_AUTO = 0, TKVK__DEC_CTA = 1 };
void tkvk__decode_kernel(int which);
/* Benchmarks and tests: warps per row (1, 2, 4, 8, 16) of the combine for more rows than SMs
 * in steps launched from now on; 0 the launcher's choice. */
void tkvk__decode_tune(int combine);

#ifdef __cplusplus
}
#endif
#endif
