/* tkv_kernels.h - the one header for tierkv's kernels.
 *
 * Every entry point exists twice: `tkvk_<op>_cpu()` (plain C, the reference for tests and
 * the daemon's path without a GPU) and `tkvk_<op>_cuda()` (sm_90a; takes a cudaStream_t as
 * `void *stream`; checks its preconditions, launches, checks cudaGetLastError()). The CUDA
 * ones exist only when the library was built with CUDA (TKVK_HAVE_CUDA is then defined by
 * the build, and tkvk_cuda_available() reports whether a device is usable at run time).
 *
 * All functions return TKVK_OK or a negative TKVK_E* code; unsupported shapes are refused
 * with TKVK_EUNSUPPORTED (and tkvk_last_error() says why), never computed wrong.
 *
 * Sections: common (status, dtypes, FP8, paged layout) / fused prologue / decode attention /
 * merge states / block copy.
 */
#ifndef TKV_KERNELS_H
#define TKV_KERNELS_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* ============================================================================================
 * Common
 * ========================================================================================== */

enum {
    TKVK_OK = 0,
    TKVK_EINVAL = -1,       /* NULL pointer, negative count, inconsistent sizes */
    TKVK_EUNSUPPORTED = -2, /* a shape outside the supported set (head dim, page size, group) */
    TKVK_ECUDA = -3,        /* a CUDA call failed (message in tkvk_last_error()) */
    TKVK_ENODEV = -4,       /* no usable GPU, or built without CUDA */
};

const char *tkvk_strerror(int err);
/* Thread-local description of the last failure in this thread ("" if none). */
const char *tkvk_last_error(void);

enum { TKVK_DTYPE_FP8_E4M3 = 0, TKVK_DTYPE_BF16 = 1 };
enum { TKVK_SCALE_PER_TENSOR = 0, TKVK_SCALE_PER_TOKEN_HEAD = 1 };

/* ---- FP8 e4m3 (OCP "e4m3fn": no infinities, 0x7f/0xff NaN, max 448) ----
 * float -> e4m3: round to nearest even, saturating to +-448; NaN -> 0x7f.
 * Bit-identical between these CPU functions and the device ones in kernels/fp8.cuh. */
uint8_t tkvk_fp8_from_float(float x);
float tkvk_fp8_to_float(uint8_t v);
#define TKVK_FP8_MAX 448.0f

/* bf16 stored as uint16_t (the upper half of an IEEE float). float -> bf16 rounds to nearest
 * even; NaN stays NaN. */
uint16_t tkvk_bf16_from_float(float x);
float tkvk_bf16_to_float(uint16_t v);

/* ---- the paged KV layout (design brief section 3), described once -----------------------
 * One block (page) = P tokens of every layer, K and V:
 *     block b, layer l at  pool + b * block_stride + l * layer_stride
 *       K  [token][kv_head][dim]   at +0
 *       V  [token][kv_head][dim]   at +v_offset            (v_offset = P * token_stride)
 *       K scales [token][kv_head] float32 at +kscale_offset (per-token-head mode only)
 *     layer_stride = 2 * P * token_stride (+ P * Hkv * 4 for in-page K scales), rounded up
 *     to 16 bytes; block_stride = L * layer_stride.
 * Per-head V scales (per-token-head mode) and per-tensor K/V scales are parameters of the
 * kernels, not stored in pages. Kernels take a tkvk_layout, never assume a fixed shape. */
typedef struct tkvk_layout {
    int num_layers;
    int num_kv_heads;
    int head_dim;       /* 64, 128, 256 */
    int page_tokens;    /* 16, 32, 64, 128 */
    int kv_dtype;       /* TKVK_DTYPE_* */
    int scale_mode;     /* TKVK_SCALE_*; per-token-head requires FP8 */
    size_t elem_bytes;
    size_t token_stride;
    size_t v_offset;
    size_t kscale_offset; /* 0 when there are no in-page scales */
    size_t layer_stride;
    size_t block_stride;
} tkvk_layout;

/* Fills *lay; TKVK_EUNSUPPORTED (with the reason) for shapes outside the supported set. */
int tkvk_layout_init(tkvk_layout *lay, int num_layers, int num_kv_heads, int head_dim,
                     int page_tokens, int kv_dtype, int scale_mode);

/* 1 when built with CUDA and a device is usable, else 0. */
int tkvk_cuda_available(void);

/* ============================================================================================
 * Fused prologue (kernels/prologue.c, kernels/prologue.cu)
 * ========================================================================================== */
/* (declared by the prologue module) */

/* ============================================================================================
 * Decode attention: plan / dynamic split / static split / combine / merge states
 * (kernels/decode.c, kernels/decode.cu)
 * ========================================================================================== */
/* (declared by the decode module) */

/* ============================================================================================
 * Block copy for tier moves (kernels/blockcopy.c, kernels/blockcopy.cu)
 * ========================================================================================== */
/* (declared by the block-copy module) */

#ifdef __cplusplus
}
#endif
#endif
