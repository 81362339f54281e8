/* decode_static.h - the static split-KV baseline of decode attention: a fixed grid over (KV
 * heads, requests, splits), every pair cut into the same number of equal ranges of tiles. It is
 * what a fixed grid gives, the reference decode_bench and the decode tests compare the dynamic
 * split against; it is not part of tierkv's decode path (libtkv_kernels holds none of it).
 *
 * Built as tkv_decode_static (kernels/CMakeLists.txt) from this folder: the CPU path here, and
 * the GPU path from the same kernel templates as the library's (kernels/decode_warp.cuh,
 * kernels/decode_cta.cuh) instantiated with kStatic, the one place their static branches
 * exist. */
#ifndef TKV_DECODE_STATIC_H
#define TKV_DECODE_STATIC_H

#include "tkv_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Splits for the static baseline: enough CTAs over (pairs x splits) to fill `grid` CTA
 * slots, never more splits than the longest request has tiles. */
int tkvk__decode_static_splits(int num_pairs, int max_kv_len, int grid);

/* Static split-KV on the CPU: every pair cut into num_splits equal ranges of tiles. */
int tkvk_decode_static_cpu(const tkvk_decode_args *a, int num_splits);

/* Static split-KV on the GPU. num_splits 0 = chosen from max_kv_len (an upper bound of the
 * step's kv_lens) and the SM count. Uses the plan's workspace (not its task map). */
int tkvk_decode_static_cuda(tkvk_decode_plan *plan, const tkvk_decode_args *a, int max_kv_len,
                            int num_splits, void *stream);

#ifdef __cplusplus
}
#endif

#endif
