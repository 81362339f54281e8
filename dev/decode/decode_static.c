/* decode_static.c - the static split-KV baseline on the CPU (dev/decode/decode_static.h). */
#include "decode_static.h"

#include "decode_internal.h"
#include "tkvk_internal.h"

int tkvk__decode_static_splits(int num_pairs, int max_kv_len, int grid)
{
    int max_tiles = tkvk__decode_tiles(max_kv_len);
    if (max_tiles < 1 || num_pairs < 1)
        return 1;
    int splits = (grid + num_pairs - 1) / num_pairs;
    if (splits > max_tiles)
        splits = max_tiles;
    if (splits < 1)
        splits = 1;
    /* Equal chunks: the split count that the chunk size actually produces. */
    int chunk = (max_tiles + splits - 1) / splits;
    return (max_tiles + chunk - 1) / chunk;
}


typedef struct dec_static_ctx {
    const int32_t *kv_lens;
    int hkv, splits, chunk_tiles;
} dec_static_ctx;

static int dec_static_ranges(const void *ctx_, int pair, int *begin, int *end, int cap)
{
    const dec_static_ctx *ctx = ctx_;
    int32_t L = ctx->kv_lens[pair / ctx->hkv];
    int n = ctx->splits < cap ? ctx->splits : cap;
    for (int i = 0; i < n; i++) {
        int64_t b = (int64_t)i * ctx->chunk_tiles * TKVK_DECODE_TILE_TOKENS;
        int64_t e = b + (int64_t)ctx->chunk_tiles * TKVK_DECODE_TILE_TOKENS;
        begin[i] = (int)(b < L ? b : L);
        end[i] = (int)(e < L ? e : L);
    }
    return n;
}

int tkvk_decode_static_cpu(const tkvk_decode_args *a, int num_splits)
{
    int rc = tkvk__decode_check_host(a, "decode_static_cpu");
    if (rc)
        return rc;
    if (num_splits < 1)
        return tkvk__fail(TKVK_EINVAL, "decode_static_cpu: num_splits %d < 1", num_splits);
    if (a->num_requests == 0)
        return TKVK_OK;
    int32_t max_len = 0;
    for (int r = 0; r < a->num_requests; r++)
        if (a->kv_lens[r] > max_len)
            max_len = a->kv_lens[r];
    int max_tiles = tkvk__decode_tiles(max_len);
    if (max_tiles < 1)
        max_tiles = 1;
    int chunk = (max_tiles + num_splits - 1) / num_splits;
    dec_static_ctx ctx = {a->kv_lens, a->layout->num_kv_heads, num_splits, chunk};
    return tkvk__decode_split_run(a, num_splits, dec_static_ranges, &ctx);
}

