/* tkvd_keycache.h - the daemon's memo of derived block keys.
 *
 * A block's key is SHA-256(previous key || its tokens) (common/tkv_keys.h); a 16-block
 * prompt is 80 SHA-256 compressions, most of a fast-path lookup's time. The prompts an
 * engine asks about were mostly derived before (its Put or Commit, the lookups of the same
 * request, the next turn of a conversation), so the daemon remembers, per block, (previous
 * key, tokens) -> key and answers a repeat with a fast hash, a probe and an exact compare.
 *
 * Exact by construction: an entry is used only when the previous key and every token are
 * equal to the ones it was made from, so a memo answer is the key SHA-256 gives; the 64-bit
 * hash only picks the set. Previous keys are namespace-salted, so a caller can only find
 * entries of chains under its own root (its tenant's), and a miss simply computes the key.
 *
 * Memory is bounded at creation (max_bytes, set-associative, least recently used way
 * replaced); every call is thread-safe (striped locks). A NULL cache derives every key.
 */
#ifndef TKVD_KEYCACHE_H
#define TKVD_KEYCACHE_H

#include <stddef.h>
#include <stdint.h>

#include "tkv_keys.h"

typedef struct tkvd_keycache tkvd_keycache;

/* A cache of at most about max_bytes (entries and their tables) for blocks of block_tokens
 * tokens (16..128). NULL when max_bytes holds too few entries to be worth it (0 = off). */
tkvd_keycache *tkvd_keycache_new(uint64_t max_bytes, uint32_t block_tokens);
void tkvd_keycache_free(tkvd_keycache *kc);

/* The keys of the first num_blocks full blocks of tokens in namespace ns (ns_len bytes):
 * exactly tkv_key_root(fingerprint, ns) then tkv_key_chain(...). kc may be NULL; otherwise
 * block_tokens must be the one it was made for. */
void tkvd_keycache_derive(tkvd_keycache *kc, const uint8_t fingerprint[TKV_KEY_BYTES],
                          const char *ns, size_t ns_len, const uint32_t *tokens,
                          size_t num_blocks, uint32_t block_tokens, tkv_key *out);

/* Blocks answered from the cache and blocks derived, since creation (relaxed counters). */
void tkvd_keycache_counts(const tkvd_keycache *kc, uint64_t *hits, uint64_t *misses);

#endif
