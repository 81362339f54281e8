/* tkv_l4.h - the shared tier (L4): blocks on a Redis Cluster, for reuse across hosts.
 *
 * A block is stored under "tkv4:{<key hex>}:<chunk>" as one or more values of at most
 * TKV_L4_CHUNK_BYTES data each (the hash tag keeps a block's chunks on one node). The record
 * is the block's tokens (u32 LE) followed by its payload; each chunk value starts with a
 * 128-byte header carrying the block key, its parent key, the chunk's place, the chunk's
 * checksum, a checksum over all chunks' checksums, and a checksum of the header itself
 * (tkv_csum64 throughout). A value that fails any check -- wrong key, torn across two writers,
 * bytes flipped in Redis -- is a miss and is deleted; it is never returned.
 *
 * Keys already carry the tenant: a block key is a chain rooted in the namespace's salt and
 * the model fingerprint (tkv_keys.h), so tenants and models never share an L4 entry.
 *
 * Writes are asynchronous: tkv_l4_put_async copies the block into a queue that one writer
 * thread drains in pipelined batches; beyond the write budget, or while the cluster is
 * unreachable, blocks are dropped (and counted), never waited for. Reads are synchronous,
 * one pipelined round per node for a whole chain. While the cluster is unreachable, reads
 * answer "miss" at once except one probe a second, so the local tiers keep serving.
 *
 * Thread safety: every function may be called from any number of threads on one tkv_l4.
 */
#ifndef TKV_L4_H
#define TKV_L4_H

#include <stddef.h>
#include <stdint.h>

#include "tkv_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

#define TKV_L4_CHUNK_BYTES (1u << 20)  /* data bytes per Redis value at most */
#define TKV_L4_HEADER_BYTES 128u
#define TKV_L4_LAT_BUCKETS 16
/* Upper bounds (microseconds) of the read-latency histogram's buckets; the last is +Inf. */
extern const double tkv_l4_latency_bounds_us[TKV_L4_LAT_BUCKETS];

typedef struct tkv_l4 tkv_l4;
typedef struct tkv_l4_opts tkv_l4_opts;

tkv_l4_opts *tkv_l4_opts_new(void);
void tkv_l4_opts_free(tkv_l4_opts *o);
/* Required: seed nodes "host:port,..." (any nodes of the cluster). TKV_EINVAL when malformed. */
int tkv_l4_opts_set_nodes(tkv_l4_opts *o, const char *nodes);
/* Required: the store's block size and tokens per block (records of another size are misses). */
int tkv_l4_opts_set_block(tkv_l4_opts *o, size_t block_bytes, uint32_t block_tokens);
/* AUTH: password alone (the default user), or an ACL user and its password. */
int tkv_l4_opts_set_auth(tkv_l4_opts *o, const char *user, const char *password);
/* connect_ms (default 500), op_ms: one pipelined round's deadline (default 2000). */
int tkv_l4_opts_set_timeouts(tkv_l4_opts *o, uint32_t connect_ms, uint32_t op_ms);
/* Bytes of write-down the queue may hold (default 256 MiB); 0 = never write (read-only L4). */
int tkv_l4_opts_set_write_budget(tkv_l4_opts *o, uint64_t bytes);
/* Expiry given to every value written (0 = none; Redis's maxmemory policy evicts). */
int tkv_l4_opts_set_ttl_s(tkv_l4_opts *o, uint32_t ttl_s);
/* Connections kept for readers (default 4; the writer has its own). */
int tkv_l4_opts_set_connections(tkv_l4_opts *o, unsigned n);

/* Starts the writer and connects. An unreachable cluster is not an error (it is retried);
 * TKV_EINVAL for missing options. */
int tkv_l4_open(const tkv_l4_opts *o, tkv_l4 **out);
/* Gives queued writes up to 2 s (none while the cluster is down), then drops the rest, stops
 * the writer and closes. NULL is ignored. */
void tkv_l4_close(tkv_l4 *l4);

/* Queues one block for writing (copies key, tokens and payload). TKV_OK queued; TKV_EEXIST
 * written or read here lately (not written again); TKV_EFULL over budget or L4 down (dropped,
 * counted); TKV_EINVAL for a length or token count other than the configured block's. */
int tkv_l4_put_async(tkv_l4 *l4, const tkv_key *key, const tkv_key *parent,
                     const uint32_t *tokens, uint32_t num_tokens, const void *payload,
                     size_t len);

/* Waits until every write queued before the call is done (written or failed), up to
 * timeout_ms (< 0: forever). TKV_OK or TKV_ETIMEDOUT. */
int tkv_l4_flush(tkv_l4 *l4, int timeout_ms);

typedef struct tkv_l4_block {
    tkv_key parent;
    uint32_t *tokens;        /* block_tokens entries */
    const void *payload;     /* block_bytes; valid until tkv_l4_blocks_free */
    void *owner_;            /* internal: what holds payload (a one-chunk block is not copied
                                out of the reply it came in) */
} tkv_l4_block;

/* Reads the longest prefix of keys[0..n) that L4 holds intact: out[0..*num_found) receive
 * the blocks (free them with tkv_l4_blocks_free). Never an error for a miss or for L4 being
 * down (*num_found = 0). */
int tkv_l4_fetch_prefix(tkv_l4 *l4, const tkv_key *keys, size_t n, tkv_l4_block *out,
                        size_t *num_found);
void tkv_l4_blocks_free(tkv_l4_block *b, size_t n);

/* 1 when the cluster answered lately with every slot served; 0 while it is unreachable. */
int tkv_l4_healthy(tkv_l4 *l4);

typedef struct tkv_l4_stats {
    uint64_t lookups, lookup_keys, hit_blocks, hit_bytes, skipped_lookups;
    uint64_t put_blocks, put_bytes, put_dropped, put_errors, put_known;
    uint64_t checksum_failures, errors, timeouts, moved, ask;
    uint64_t connects, connect_failures, map_loads;
    uint64_t queue_bytes;                      /* gauge */
    uint64_t lat_bucket[TKV_L4_LAT_BUCKETS];   /* read rounds (fetch_prefix) by latency */
    uint64_t lat_sum_ns;
    int healthy;
} tkv_l4_stats;

void tkv_l4_get_stats(tkv_l4 *l4, tkv_l4_stats *out);

/* ---- for tests and tools ---- */
/* The Redis key of chunk `chunk` of block `key` into buf (>= 80 bytes); its length. */
size_t tkv_l4_redis_key(const tkv_key *key, uint32_t chunk, char *buf);

#ifdef __cplusplus
}
#endif
#endif
