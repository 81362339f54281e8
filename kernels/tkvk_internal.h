/* tkvk_internal.h - internals shared by the kernel modules (not installed, not public).
 *
 * The one way a kernel module reports a failure: `return tkvk__fail(TKVK_E..., fmt, ...)`
 * records the reason in the thread's tkvk_last_error() buffer and returns the code, so every
 * refusal carries a sentence saying which argument and which value. Usable from C and CUDA.
 */
#ifndef TKVK_INTERNAL_H
#define TKVK_INTERNAL_H

#include "tkv_kernels.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Formats the reason into the thread-local last-error buffer (truncated at 255 bytes) and
 * returns `err` unchanged. */
int tkvk__fail(int err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));

/* 1 when v is one of the supported head dims / tokens-per-page values. */
int tkvk__head_dim_ok(int head_dim);
int tkvk__page_tokens_ok(int page_tokens);

/* The checks tkvk_prologue_cpu() and tkvk_prologue_cuda() share (shapes, modes, required
 * pointers); returns TKVK_OK or the refusal, with tkvk_last_error() set. `fn` names the
 * caller in the message. Data-dependent checks (positions, slots) are the CPU's own. */
int tkvk__prologue_check(const tkvk_prologue_params *p, const char *fn);

/* tkvk_prologue_cuda() with the kernel variant forced: 1, 2 or 4 items per lane group in one
 * pass, 8 = the persistent grid, 16 = the walk grid, 32 = the ring grid (the persistent grid
 * with two items of input in flight per group), 64 = the persistent grid prefetching its input
 * into L2 a few items ahead, 128 = the persistent grid with streaming stores, compiled for the
 * fixed mode where the call's modes are those, 0 = its own choice (what tkvk_prologue_cuda()
 * does), for the benchmark's comparison of the variants. Built with CUDA only. */
int tkvk__prologue_cuda_tuned(const tkvk_prologue_params *p, void *stream, int items_per_warp);

#ifdef __cplusplus
}
#endif
#endif
