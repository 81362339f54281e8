/* tkv_keys.h - model geometry, its fingerprint, and the SHA-256 block-key chain.
 *
 *   fingerprint = SHA256("tierkv/geometry/1" || layers, kv_heads, head_dim, block_tokens,
 *                        dtype, scale_mode as u32 LE || model_id bytes)
 *   root        = SHA256("tierkv/1" || fingerprint || namespace salt)
 *   key[i]      = SHA256(key[i-1] || tokens of block i as u32 little-endian),  key[-1] = root
 *
 * Only full blocks are keyed. Namespaces get different salts, so one tenant can neither hit
 * nor probe another's prefixes. Test vectors: docs/design.md and tests/storage/test_keys.c.
 * All functions are pure and thread-safe.
 */
#ifndef TKV_KEYS_H
#define TKV_KEYS_H

#include <stddef.h>
#include <stdint.h>
#include <string.h>

#ifdef __cplusplus
extern "C" {
#endif

#define TKV_KEY_BYTES 32
#define TKV_MODEL_ID_MAX 128

typedef struct tkv_key {
    uint8_t b[TKV_KEY_BYTES];
} tkv_key;

enum { TKV_DTYPE_FP8_E4M3 = 0, TKV_DTYPE_BF16 = 1 };
enum { TKV_SCALE_PER_TENSOR = 0, TKV_SCALE_PER_TOKEN_HEAD = 1 };

typedef struct tkv_geometry {
    uint32_t num_layers;    /* 1..1024 */
    uint32_t num_kv_heads;  /* 1..256 */
    uint32_t head_dim;      /* 64, 128, 256 */
    uint32_t block_tokens;  /* 16, 32, 64, 128 */
    uint32_t dtype;         /* TKV_DTYPE_* */
    uint32_t scale_mode;    /* TKV_SCALE_*; per-token-head needs fp8 */
    char model_id[TKV_MODEL_ID_MAX]; /* NUL-terminated, non-empty */
} tkv_geometry;

/* TKV_OK or TKV_EINVAL with a one-line reason in err (if err != NULL). */
int tkv_geometry_validate(const tkv_geometry *g, char *err, size_t err_len);

/* Bytes of one block in the paged layout (all layers, K and V, plus in-page scales);
 * the same number the kernels' layout computes. 0 if g is invalid. */
size_t tkv_geometry_block_bytes(const tkv_geometry *g);

void tkv_geometry_fingerprint(const tkv_geometry *g, uint8_t fp[TKV_KEY_BYTES]);

void tkv_key_root(const uint8_t fingerprint[TKV_KEY_BYTES], const void *salt, size_t salt_len,
                  tkv_key *root);

/* Keys of the full blocks of tokens[0..num_tokens): writes min(num_tokens / block_tokens,
 * max_keys) keys to out and returns that count. */
size_t tkv_key_chain(const tkv_key *root, const uint32_t *tokens, size_t num_tokens,
                     uint32_t block_tokens, tkv_key *out, size_t max_keys);

/* A key's 64-bit fingerprint for the policies (tkv_policy_entry.key_fp): its first 8 bytes,
 * already uniform (SHA-256 output), | 1 because 0 means "none". */
static inline uint64_t tkv_key_fp(const tkv_key *k)
{
    uint64_t fp;
    memcpy(&fp, k->b, sizeof(fp));
    return fp | 1;
}

/* Lower-case hex, 64 chars + NUL. */
void tkv_key_hex(const tkv_key *k, char out[2 * TKV_KEY_BYTES + 1]);
int tkv_key_from_hex(const char *hex, tkv_key *k); /* TKV_OK / TKV_EINVAL */

#ifdef __cplusplus
}
#endif
#endif
