/* keys.c - geometry validation, block size, fingerprint and the SHA-256 key chain
 * (see tkv_keys.h for the formulas; test vectors in docs/design.md). */
#include "tkv_keys.h"

#include "tkv_base.h"

/* The chain uses OpenSSL's direct SHA-256 (deprecated in 3.0 in favour of EVP, not removed):
 * the same compression code (SHA instructions where the CPU has them) without EVP's
 * per-digest dispatch, 15-20% of a 16-block chain. */
#define OPENSSL_SUPPRESS_DEPRECATED
#include <openssl/evp.h>
#include <openssl/sha.h>
#include <pthread.h>
#include <stdio.h>
#include <string.h>

/* ============================================================================================
 * Geometry
 * ========================================================================================== */

static int geo_fail(char *err, size_t err_len, const char *msg)
{
    if (err && err_len)
        snprintf(err, err_len, "%s", msg);
    return TKV_EINVAL;
}

int tkv_geometry_validate(const tkv_geometry *g, char *err, size_t err_len)
{
    if (!g)
        return geo_fail(err, err_len, "geometry is NULL");
    if (g->num_layers < 1 || g->num_layers > 1024)
        return geo_fail(err, err_len, "num_layers must be 1..1024");
    if (g->num_kv_heads < 1 || g->num_kv_heads > 256)
        return geo_fail(err, err_len, "num_kv_heads must be 1..256");
    if (g->head_dim != 64 && g->head_dim != 128 && g->head_dim != 256)
        return geo_fail(err, err_len, "head_dim must be 64, 128 or 256");
    if (g->block_tokens != 16 && g->block_tokens != 32 && g->block_tokens != 64 &&
        g->block_tokens != 128)
        return geo_fail(err, err_len, "block_tokens must be 16, 32, 64 or 128");
    if (g->dtype != TKV_DTYPE_FP8_E4M3 && g->dtype != TKV_DTYPE_BF16)
        return geo_fail(err, err_len, "dtype must be fp8_e4m3 or bf16");
    if (g->scale_mode != TKV_SCALE_PER_TENSOR && g->scale_mode != TKV_SCALE_PER_TOKEN_HEAD)
        return geo_fail(err, err_len, "scale_mode must be per_tensor or per_token_head");
    if (g->scale_mode == TKV_SCALE_PER_TOKEN_HEAD && g->dtype != TKV_DTYPE_FP8_E4M3)
        return geo_fail(err, err_len, "per_token_head scales need the fp8_e4m3 dtype");
    size_t id_len = strnlen(g->model_id, TKV_MODEL_ID_MAX);
    if (id_len == 0)
        return geo_fail(err, err_len, "model_id is empty");
    if (id_len == TKV_MODEL_ID_MAX)
        return geo_fail(err, err_len, "model_id is not NUL-terminated within 128 bytes");
    if (err && err_len)
        err[0] = '\0';
    return TKV_OK;
}

/* The layout of kernels/tkv_kernels.h (tkvk_layout_init), restated here so the storage library
 * does not link the kernels: layer_stride = 2 * P * token_stride (+ P * Hkv * 4 bytes of K
 * scales in per-token-head mode) rounded up to 16; block = L * layer_stride. */
size_t tkv_geometry_block_bytes(const tkv_geometry *g)
{
    if (tkv_geometry_validate(g, NULL, 0) != TKV_OK)
        return 0;
    size_t elem = g->dtype == TKV_DTYPE_FP8_E4M3 ? 1 : 2;
    size_t token_stride = (size_t)g->num_kv_heads * g->head_dim * elem;
    size_t layer = 2 * (size_t)g->block_tokens * token_stride;
    if (g->scale_mode == TKV_SCALE_PER_TOKEN_HEAD)
        layer += (size_t)g->block_tokens * g->num_kv_heads * sizeof(float);
    layer = (layer + 15) & ~(size_t)15;
    return layer * g->num_layers;
}

/* ============================================================================================
 * SHA-256 (EVP for the one-off digests, the direct API for the chain)
 * ========================================================================================== */

/* OpenSSL 3 resolves EVP_sha256() through its provider machinery on every Init; fetching the
 * implementation once keeps the fingerprint and root digests cheap. */
static EVP_MD *sha256_md;
static pthread_once_t sha256_once = PTHREAD_ONCE_INIT;

static void sha256_fetch(void)
{
    sha256_md = EVP_MD_fetch(NULL, "SHA256", NULL);
    TKV_ASSERT(sha256_md != NULL);
}

static const EVP_MD *sha256(void)
{
    pthread_once(&sha256_once, sha256_fetch);
    return sha256_md;
}

static void put_u32le(uint8_t *p, uint32_t v)
{
    p[0] = (uint8_t)v;
    p[1] = (uint8_t)(v >> 8);
    p[2] = (uint8_t)(v >> 16);
    p[3] = (uint8_t)(v >> 24);
}

void tkv_geometry_fingerprint(const tkv_geometry *g, uint8_t fp[TKV_KEY_BYTES])
{
    static const char tag[] = "tierkv/geometry/1";
    uint8_t fields[6 * 4];
    put_u32le(fields + 0, g->num_layers);
    put_u32le(fields + 4, g->num_kv_heads);
    put_u32le(fields + 8, g->head_dim);
    put_u32le(fields + 12, g->block_tokens);
    put_u32le(fields + 16, g->dtype);
    put_u32le(fields + 20, g->scale_mode);
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    TKV_ASSERT(ctx != NULL);
    unsigned int len = 0;
    int ok = EVP_DigestInit_ex(ctx, sha256(), NULL) &&
             EVP_DigestUpdate(ctx, tag, sizeof(tag) - 1) &&
             EVP_DigestUpdate(ctx, fields, sizeof(fields)) &&
             EVP_DigestUpdate(ctx, g->model_id, strnlen(g->model_id, TKV_MODEL_ID_MAX)) &&
             EVP_DigestFinal_ex(ctx, fp, &len);
    TKV_ASSERT(ok && len == TKV_KEY_BYTES);
    EVP_MD_CTX_free(ctx);
}

void tkv_key_root(const uint8_t fingerprint[TKV_KEY_BYTES], const void *salt, size_t salt_len,
                  tkv_key *root)
{
    static const char tag[] = "tierkv/1";
    EVP_MD_CTX *ctx = EVP_MD_CTX_new();
    TKV_ASSERT(ctx != NULL);
    unsigned int len = 0;
    int ok = EVP_DigestInit_ex(ctx, sha256(), NULL) &&
             EVP_DigestUpdate(ctx, tag, sizeof(tag) - 1) &&
             EVP_DigestUpdate(ctx, fingerprint, TKV_KEY_BYTES) &&
             (salt_len == 0 || EVP_DigestUpdate(ctx, salt, salt_len)) &&
             EVP_DigestFinal_ex(ctx, root->b, &len);
    TKV_ASSERT(ok && len == TKV_KEY_BYTES);
    EVP_MD_CTX_free(ctx);
}

size_t tkv_key_chain(const tkv_key *root, const uint32_t *tokens, size_t num_tokens,
                     uint32_t block_tokens, tkv_key *out, size_t max_keys)
{
    if (!root || !out || block_tokens == 0 || (!tokens && num_tokens))
        return 0;
    size_t n = num_tokens / block_tokens;
    if (n > max_keys)
        n = max_keys;
    if (n == 0)
        return 0;
    const tkv_key *prev = root;
    /* Tokens are hashed as u32 little-endian; on a little-endian host that is their memory
     * image, so the block is fed straight from the caller's array. */
#if __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
    uint8_t buf[128 * 4];
#endif
    for (size_t i = 0; i < n; i++) {
        const uint32_t *blk = tokens + i * (size_t)block_tokens;
        SHA256_CTX ctx;
        int ok = SHA256_Init(&ctx) && SHA256_Update(&ctx, prev->b, TKV_KEY_BYTES);
#if __BYTE_ORDER__ == __ORDER_LITTLE_ENDIAN__
        ok = ok && SHA256_Update(&ctx, blk, (size_t)block_tokens * 4);
#else
        for (uint32_t done = 0; ok && done < block_tokens;) {
            uint32_t m = block_tokens - done < 128 ? block_tokens - done : 128;
            for (uint32_t j = 0; j < m; j++)
                put_u32le(buf + 4 * j, blk[done + j]);
            ok = SHA256_Update(&ctx, buf, (size_t)m * 4);
            done += m;
        }
#endif
        ok = ok && SHA256_Final(out[i].b, &ctx);
        TKV_ASSERT(ok);
        prev = &out[i];
    }
    return n;
}

/* ============================================================================================
 * Hex
 * ========================================================================================== */

void tkv_key_hex(const tkv_key *k, char out[2 * TKV_KEY_BYTES + 1])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < TKV_KEY_BYTES; i++) {
        out[2 * i] = digits[k->b[i] >> 4];
        out[2 * i + 1] = digits[k->b[i] & 15];
    }
    out[2 * TKV_KEY_BYTES] = '\0';
}

static int hex_nibble(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    if (c >= 'A' && c <= 'F')
        return c - 'A' + 10;
    return -1;
}

int tkv_key_from_hex(const char *hex, tkv_key *k)
{
    if (!hex || !k)
        return TKV_EINVAL;
    tkv_key tmp;
    for (int i = 0; i < TKV_KEY_BYTES; i++) {
        int hi = hex_nibble(hex[2 * i]);
        int lo = hi < 0 ? -1 : hex_nibble(hex[2 * i + 1]);
        if (hi < 0 || lo < 0)
            return TKV_EINVAL;
        tmp.b[i] = (uint8_t)(hi << 4 | lo);
    }
    if (hex[2 * TKV_KEY_BYTES] != '\0')
        return TKV_EINVAL;
    *k = tmp;
    return TKV_OK;
}
