/* common.c - status strings, the thread's last error, the paged layout, bf16 helpers and the
 * run-time CUDA probe. Everything here is plain C so the daemon without a GPU uses it too. */
#include <stdarg.h>
#include <stdio.h>
#include <string.h>

#include "tkvk_internal.h"

#ifdef TKVK_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* ============================================================================================
 * Status
 * ========================================================================================== */

const char *tkvk_strerror(int err)
{
    switch (err) {
    case TKVK_OK: return "success";
    case TKVK_EINVAL: return "invalid argument";
    case TKVK_EUNSUPPORTED: return "unsupported shape or mode";
    case TKVK_ECUDA: return "CUDA error";
    case TKVK_ENODEV: return "no usable GPU";
    default: return "unknown tkvk error";
    }
}

/* Thread-local so that concurrent callers (daemon workers, one per stream) never read each
 * other's reasons; fixed size so recording a failure can never itself fail. */
static _Thread_local char tkvk_last_error_buf[256];

const char *tkvk_last_error(void)
{
    return tkvk_last_error_buf;
}

int tkvk__fail(int err, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tkvk_last_error_buf, sizeof tkvk_last_error_buf, fmt, ap);
    va_end(ap);
    return err;
}

int tkvk__head_dim_ok(int head_dim)
{
    return head_dim == 64 || head_dim == 128 || head_dim == 256;
}

int tkvk__page_tokens_ok(int page_tokens)
{
    return page_tokens == 16 || page_tokens == 32 || page_tokens == 64 || page_tokens == 128;
}

/* ============================================================================================
 * Paged layout
 * ========================================================================================== */

int tkvk_layout_init(tkvk_layout *lay, int num_layers, int num_kv_heads, int head_dim,
                     int page_tokens, int kv_dtype, int scale_mode)
{
    if (!lay)
        return tkvk__fail(TKVK_EINVAL, "layout_init: lay is NULL");
    memset(lay, 0, sizeof *lay);
    if (num_layers < 1)
        return tkvk__fail(TKVK_EINVAL, "layout_init: num_layers %d < 1", num_layers);
    if (num_kv_heads < 1)
        return tkvk__fail(TKVK_EINVAL, "layout_init: num_kv_heads %d < 1", num_kv_heads);
    if (!tkvk__head_dim_ok(head_dim))
        return tkvk__fail(TKVK_EUNSUPPORTED, "layout_init: head_dim %d (supported: 64, 128, 256)",
                          head_dim);
    if (!tkvk__page_tokens_ok(page_tokens))
        return tkvk__fail(TKVK_EUNSUPPORTED,
                          "layout_init: page_tokens %d (supported: 16, 32, 64, 128)", page_tokens);
    if (kv_dtype != TKVK_DTYPE_FP8_E4M3 && kv_dtype != TKVK_DTYPE_BF16)
        return tkvk__fail(TKVK_EINVAL, "layout_init: kv_dtype %d is not a TKVK_DTYPE_*", kv_dtype);
    if (scale_mode != TKVK_SCALE_PER_TENSOR && scale_mode != TKVK_SCALE_PER_TOKEN_HEAD)
        return tkvk__fail(TKVK_EINVAL, "layout_init: scale_mode %d is not a TKVK_SCALE_*",
                          scale_mode);
    if (scale_mode == TKVK_SCALE_PER_TOKEN_HEAD && kv_dtype != TKVK_DTYPE_FP8_E4M3)
        return tkvk__fail(TKVK_EUNSUPPORTED,
                          "layout_init: per-token-head scales need the fp8_e4m3 KV dtype");

    /* Sizes are computed in size_t; with the bounds above only num_layers and num_kv_heads
     * can make them large, so guard the products against wrap-around. */
    size_t elem = kv_dtype == TKVK_DTYPE_FP8_E4M3 ? 1 : 2;
    if ((size_t)num_kv_heads > ((size_t)1 << 24))
        return tkvk__fail(TKVK_EINVAL, "layout_init: num_kv_heads %d is absurdly large",
                          num_kv_heads);
    size_t token_stride = (size_t)num_kv_heads * (size_t)head_dim * elem;
    size_t kv_bytes = 2 * (size_t)page_tokens * token_stride;
    size_t scale_bytes = scale_mode == TKVK_SCALE_PER_TOKEN_HEAD
                             ? (size_t)page_tokens * (size_t)num_kv_heads * sizeof(float)
                             : 0;
    size_t layer_stride = (kv_bytes + scale_bytes + 15) & ~(size_t)15;
    if ((size_t)num_layers > SIZE_MAX / layer_stride)
        return tkvk__fail(TKVK_EINVAL, "layout_init: %d layers overflow the block size",
                          num_layers);

    lay->num_layers = num_layers;
    lay->num_kv_heads = num_kv_heads;
    lay->head_dim = head_dim;
    lay->page_tokens = page_tokens;
    lay->kv_dtype = kv_dtype;
    lay->scale_mode = scale_mode;
    lay->elem_bytes = elem;
    lay->token_stride = token_stride;
    lay->v_offset = (size_t)page_tokens * token_stride;
    lay->kscale_offset = scale_bytes ? kv_bytes : 0;
    lay->layer_stride = layer_stride;
    lay->block_stride = (size_t)num_layers * layer_stride;
    return TKVK_OK;
}

/* ============================================================================================
 * bf16
 * ========================================================================================== */

static uint32_t f32_bits(float x)
{
    uint32_t u;
    memcpy(&u, &x, sizeof u);
    return u;
}

static float f32_from_bits(uint32_t u)
{
    float x;
    memcpy(&x, &u, sizeof x);
    return x;
}

uint16_t tkvk_bf16_from_float(float x)
{
    uint32_t u = f32_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u)
        return (uint16_t)((u >> 16) | 0x0040u); /* keep it a (quiet) NaN after truncation */
    /* Round to nearest even: add 0x7fff plus the lowest kept bit, then truncate. */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (uint16_t)(u >> 16);
}

float tkvk_bf16_to_float(uint16_t v)
{
    return f32_from_bits((uint32_t)v << 16);
}

/* ============================================================================================
 * Run-time CUDA probe
 * ========================================================================================== */

int tkvk_cuda_available(void)
{
#ifdef TKVK_HAVE_CUDA
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
        (void)cudaGetLastError(); /* clear the sticky-free error so later calls start clean */
        return 0;
    }
    return n > 0;
#else
    return 0;
#endif
}
