/* tkv_store.h - the cache engine: index + host pool (L2) + local store (L3) + policy,
 * driven by the tier manager. No network; the daemon and the benchmarks link it.
 *
 * Blocks are opaque byte strings of block_bytes each, named by chained keys (tkv_keys.h)
 * that the caller derived from tokens. Block states: WRITING -> READY -> (EVICTING) -> gone;
 * only READY blocks are visible to lookups. Every block carries a checksum that is checked
 * whenever it crosses a tier: a mismatch drops the block and counts it.
 *
 * Leases pin the blocks a lookup returned (no tier may evict them) until released, until
 * their time-to-live passes, or until their owner is released (client disconnect).
 *
 * Thread safety: every function may be called concurrently from any number of threads on one
 * tkv_store (the locking is documented in storage/store.c and docs/design.md). Callbacks run
 * on the store's worker threads and must not block for long.
 */
#ifndef TKV_STORE_H
#define TKV_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "tkv_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tkv_store tkv_store;
typedef struct tkv_store_opts tkv_store_opts;

enum { TKV_TIER_NONE = 0, TKV_TIER_L1 = 1, TKV_TIER_L2 = 2, TKV_TIER_L3 = 3 };
#define TKV_NUM_TIERS 4
#define TKV_NO_OFFSET UINT64_MAX

/* ---- options ---------------------------------------------------------------------------- */
tkv_store_opts *tkv_store_opts_new(void);
void tkv_store_opts_free(tkv_store_opts *o);
/* Required: the size of one block and the tokens it holds. */
int tkv_store_opts_set_block(tkv_store_opts *o, size_t block_bytes, uint32_t block_tokens);
/* Required: model+geometry fingerprint (stored in and checked against L3). */
int tkv_store_opts_set_fingerprint(tkv_store_opts *o, const uint8_t fp[TKV_KEY_BYTES]);
int tkv_store_opts_set_l2_blocks(tkv_store_opts *o, uint64_t num_blocks);   /* default 1024 */
/* L3 in dir (created if missing); dir NULL disables L3. capacity 0 = unlimited. */
int tkv_store_opts_set_l3(tkv_store_opts *o, const char *dir, uint64_t capacity_bytes);
int tkv_store_opts_set_l3_zstd_level(tkv_store_opts *o, int level);        /* default 1 */
int tkv_store_opts_set_l3_io_mode(tkv_store_opts *o, int mode);            /* TKV_IO_* */
int tkv_store_opts_set_write_through(tkv_store_opts *o, bool on);          /* default true */
int tkv_store_opts_set_policy(tkv_store_opts *o, const char *name);        /* default "hazard" */
int tkv_store_opts_set_workers(tkv_store_opts *o, unsigned n);             /* default 4 */
int tkv_store_opts_set_lease_ttl_ms(tkv_store_opts *o, uint32_t dflt, uint32_t max);

/* ---- tenants ------------------------------------------------------------------------------
 * Every block belongs to a tenant: a small id the caller gives at put/alloc (0 = none, the
 * default; the daemon gives tenant index + 1), kept on the block for its life. Per tenant and
 * tier the store counts the blocks held and may enforce:
 *   max_blocks        the most blocks of the tenant in the tier (0 = no limit). A put or
 *                     allocation at the limit makes room by evicting the tenant's own blocks
 *                     (unpinned, in the policy's victim order); where none can go, the blocks
 *                     that do not fit are refused (rejected, as for a full tier);
 *   guaranteed_blocks a share no other tenant's load evicts (0 = none): while the tenant holds
 *                     no more than this, room for others is made from other blocks.
 * Every tier takes limits. In L1 they act on alloc and promotion to L1; in L2 on put, alloc,
 * promotion and L4 fills (all reserve slots for the block's tenant); in L3 on write-back,
 * where a block that finds no room is not written (it stays an L2 block and a demotion drops
 * it) and counts as refused. The victim search skips at most
 * TKV_TENANT_SKIP_MAX blocks of other tenants per slot (O(1) per block), then gives up for
 * that slot as if every block were pinned. A block's L3 record keeps its tenant's tag (from
 * its name, tkv_store_opts_set_tenant_name, else its id), so blocks loaded from L3 at open
 * are their tenant's again and count against its quotas from the start; blocks of records
 * without a tag (an older format) or of a tenant the store no longer knows have tenant 0
 * until a tenant's lookup reaches them (tkv_store_lookup_as): only that tenant's chain can,
 * so they become its. Refusals of a tenant other than 0 are logged, at most one line a
 * second per tenant with the number held back. */
#define TKV_STORE_TENANTS_MAX 128
#define TKV_TENANT_SKIP_MAX 256
int tkv_store_opts_set_tenant_quota(tkv_store_opts *o, unsigned tenant, int tier,
                                    uint64_t max_blocks, uint64_t guaranteed_blocks);
/* Gives tenant (1 .. TKV_STORE_TENANTS_MAX - 1) an L2 region of its own: num_blocks slots in
 * a memfd of their own (tkv_store_l2_region), its own policy instance, which only its blocks
 * enter, so its load evicts only its own blocks and nobody else's evicts them. Region 0 gets
 * what the regions leave of the L2 size (tkv_store_open fails with TKV_EINVAL when they
 * exceed it) and holds tenant 0's blocks and those of tenants without a region. */
int tkv_store_opts_set_l2_region(tkv_store_opts *o, unsigned tenant, uint64_t num_blocks);
/* The same for L1 (where an L1 tier is set): tenant gets num_blocks L1 slots of its own, a
 * contiguous run of slot numbers (tkv_store_l1_region_at) that a backend keeps in an
 * allocation of its own, with its own policy instance; region 0 gets what the regions leave.
 * tkv_store_open fails with TKV_EINVAL when they exceed the L1 size. */
int tkv_store_opts_set_l1_region(tkv_store_opts *o, unsigned tenant, uint64_t num_blocks);
/* The most blocks tenant may hand to L4 from this store (0 = no limit, the default). L4 does
 * not tell the store what the cluster evicts, so the count is of blocks this store queued for
 * L4 since it opened (not again a block written or read here lately); past it a block is not
 * written to L4 and counts as refused (tkv_store_tenant_stats.refused_l4_blocks). */
int tkv_store_opts_set_tenant_l4_quota(tkv_store_opts *o, unsigned tenant, uint64_t max_blocks);
/* The name the refusal log line gives the tenant (default "#<id>"). Copied. */
int tkv_store_opts_set_tenant_name(tkv_store_opts *o, unsigned tenant, const char *name);

/* ---- the GPU tier (L1) ------------------------------------------------------------------
 * The store keeps L1's slot accounting, leases, states and policy like any tier; the bytes
 * live in device memory that only a backend can touch. The daemon's backend is tkvd_gpu
 * (CUDA); tests use a host-memory one. Ops are called on store worker threads, never under
 * the store's locks, possibly concurrently. */
typedef struct tkv_l1_ops {
    /* Byte offset of L1 slot `slot` as clients address it (after mapping the pool). */
    uint64_t (*offset)(void *ctx, uint64_t slot);
    /* L2 -> L1: copies n blocks from L2 pool byte offsets into L1 slots; returns when done.
     * TKV_OK or TKV_EIO. */
    int (*promote)(void *ctx, const uint64_t *l1_slots, const uint64_t *l2_offsets, size_t n);
    /* L1 -> L2: the reverse. */
    int (*demote)(void *ctx, const uint64_t *l2_offsets, const uint64_t *l1_slots, size_t n);
} tkv_l1_ops;

/* Attaches an L1 tier of num_blocks slots served by ops/ctx (both must outlive the store). */
int tkv_store_opts_set_l1(tkv_store_opts *o, uint64_t num_blocks, const tkv_l1_ops *ops,
                          void *ctx);
/* L1 regions (tkv_store_opts_set_l1_region), for the backend that keeps each in an
 * allocation of its own: their number (0 without L1), region r's slots [*first_slot,
 * *first_slot + *num_slots) (region 0 first, then the tenants' in tenant order; a region may
 * be empty), and the region a tenant's blocks live in. TKV_EINVAL without L1 or for a bad
 * index. */
unsigned tkv_store_l1_num_regions(const tkv_store *s);
int tkv_store_l1_region_at(const tkv_store *s, unsigned r, uint64_t *first_slot,
                           uint64_t *num_slots);
int tkv_store_l1_region(const tkv_store *s, unsigned tenant, unsigned *region);

/* ---- the shared tier (L4) ----------------------------------------------------------------
 * Attaches a Redis Cluster tier (tkv_l4.h; the caller owns it and it must outlive the store).
 * Blocks go down to it asynchronously with their write-back to L3 (or at put, where there is
 * no write-back); a lookup whose local prefix ends short reads the rest of the chain from L4
 * and stores it in L2 (and on to L3) before it answers, so the lease pins local copies. A
 * miss or an unreachable L4 only costs that read. NULL (the default) leaves L4 off. */
typedef struct tkv_l4 tkv_l4;
int tkv_store_opts_set_l4(tkv_store_opts *o, tkv_l4 *l4);

/* Opens the engine: creates the L2 memfd pool, opens L3 and loads its index (blocks found
 * there are READY in L3). TKV_EGEOMETRY when L3 holds another fingerprint. */
int tkv_store_open(const tkv_store_opts *o, tkv_store **out);
/* Stops accepting work, finishes queued write-backs and promotions, closes L3, frees all.
 * Outstanding leases are dropped. NULL is ignored. */
void tkv_store_close(tkv_store *s);

/* ---- the L2 pool, for the attach socket --------------------------------------------------- */
int tkv_store_l2_fd(const tkv_store *s);            /* the memfd; owned by the store */
int tkv_store_l2_fd_readonly(const tkv_store *s);   /* read-only reopen of it, for clients */
uint64_t tkv_store_l2_bytes(const tkv_store *s);    /* its mapped length */
size_t tkv_store_block_bytes(const tkv_store *s);
size_t tkv_store_l2_slot_stride(const tkv_store *s); /* bytes between L2 slots (page-rounded) */
uint32_t tkv_store_block_tokens(const tkv_store *s);
/* Direct pointer to L2 slot memory at pool offset (valid while the block is pinned). */
void *tkv_store_l2_ptr(tkv_store *s, uint64_t offset);
/* The L2 region of a tenant (tkv_store_opts_set_l2_region; region 0 for tenants without
 * one): its start as a pool offset, its length, its memfd and the read-only reopen of it
 * (-1 for an empty region; owned by the store). Any out-pointer may be NULL. A client that
 * maps the region addresses a block at (pool offset - *offset). TKV_EINVAL for a bad tenant. */
int tkv_store_l2_region(const tkv_store *s, unsigned tenant, uint64_t *offset, uint64_t *bytes,
                        int *fd, int *fd_readonly);
/* Regions by index (0 .. num - 1), e.g. to pin each for DMA: start (pool offset) and length. */
unsigned tkv_store_l2_num_regions(const tkv_store *s);
int tkv_store_l2_region_at(const tkv_store *s, unsigned r, uint64_t *offset, uint64_t *bytes);

/* ---- lookup and leases ---------------------------------------------------------------------- */
typedef struct tkv_block_loc {
    uint8_t tier;           /* fastest tier holding the block (TKV_TIER_*) */
    uint8_t in_l2, in_l3;   /* residency flags */
    uint8_t in_l1;
    uint64_t l2_offset;     /* byte offset of the slot in the L2 pool (not its region: see
                             * tkv_store_l2_region), or TKV_NO_OFFSET */
    uint64_t l1_offset;     /* byte offset in the L1 pool (tkv_l1_ops.offset), or TKV_NO_OFFSET */
} tkv_block_loc;

/* Longest prefix of READY blocks among keys[0..num_keys). When num_hit > 0 the hit blocks are
 * pinned by a new lease owned by `owner` (an id the caller chose, e.g. per client connection)
 * for ttl_ms (0 = default; clamped to max); its id goes to *lease_id (0 when nothing hit).
 * locs (num_keys entries, may be NULL) receives the hit blocks' locations. */
int tkv_store_lookup(tkv_store *s, const tkv_key *keys, size_t num_keys, uint64_t owner,
                     uint32_t ttl_ms, uint64_t *lease_id, size_t *num_hit, tkv_block_loc *locs);
/* The same for tenant `tenant`: blocks of another tenant (other than 0) end the prefix as a
 * miss would, blocks of tenant 0 it reaches become its, and an L4 fill is put as its. */
int tkv_store_lookup_as(tkv_store *s, unsigned tenant, const tkv_key *keys, size_t num_keys,
                        uint64_t owner, uint32_t ttl_ms, uint64_t *lease_id, size_t *num_hit,
                        tkv_block_loc *locs);

/* Current locations of a lease's blocks (they change as prefetches complete). */
int tkv_store_lease_locs(tkv_store *s, uint64_t lease_id, tkv_block_loc *locs, size_t cap,
                         size_t *num_blocks);
/* Extends a lease's time-to-live. TKV_ENOTFOUND / TKV_EXPIRED. */
int tkv_store_lease_touch(tkv_store *s, uint64_t lease_id, uint32_t ttl_ms);
int tkv_store_lease_release(tkv_store *s, uint64_t lease_id);
/* The owner a live lease or allocation was made for (the daemon checks it against the
 * caller's tenant before acting on an id a client sent). TKV_ENOTFOUND / TKV_EXPIRED. */
int tkv_store_lease_owner(tkv_store *s, uint64_t lease_id, uint64_t *owner);
int tkv_store_alloc_owner(tkv_store *s, uint64_t alloc_id, uint64_t *owner);
/* Releases every lease and allocation of an owner (client gone). Returns how many. */
size_t tkv_store_release_owner(tkv_store *s, uint64_t owner);

/* ---- prefetch: asynchronous promotion to a faster tier -------------------------------------- */
typedef void (*tkv_done_fn)(void *arg, uint64_t ticket, int status);
/* Promotes the lease's blocks to `tier` (TKV_TIER_L2; L1 where a GPU tier is attached:
 * L3 -> L2 first where needed, then L2 -> L1 in one batch; each L2 copy's checksum is checked
 * while its DMA runs and a mismatch drops the block from both tiers).
 * Returns at once with a ticket; done (may be NULL) runs on a worker thread when every block
 * has arrived or failed. A block that fails its checksum is dropped and reported (status
 * TKV_ECHECKSUM) and is not shown as present. done returns before the ticket completes, so
 * once tkv_store_wait() has answered, done is finished with arg. */
int tkv_store_prefetch(tkv_store *s, uint64_t lease_id, int tier, tkv_done_fn done, void *arg,
                       uint64_t *ticket);
/* Waits for a ticket; *status gets its result. timeout_ms < 0 waits forever. TKV_ETIMEDOUT. */
int tkv_store_wait(tkv_store *s, uint64_t ticket, int timeout_ms, int *status);

/* ---- by-value data path -------------------------------------------------------------------- */
/* Copies block `index` of a lease (0-based within the lease) into dst (cap >= block_bytes),
 * from L2 or, if only in L3, by reading it (checksum verified). */
int tkv_store_get(tkv_store *s, uint64_t lease_id, uint32_t index, void *dst, size_t cap);

/* Stores num_blocks blocks: keys[i] with parent keys[i-1] (parent for i = 0: *parent, or the
 * chain root when parent is NULL), tokens block_tokens per block, payloads[i] block_bytes
 * each. Blocks already present are skipped (duplicates dropped). Admission to L2 is the
 * policy's call: with a writable L3, a block it does not admit still goes to L3 (through an L2
 * slot it leaves as soon as it is durable); without one, it is not stored and counts as
 * rejected, which is not an error, and neither are the blocks after it in this put (the
 * policy is still asked for them; no lookup could reach them). Room is not made by evicting
 * the block a chunk of the put hangs under, nor, without a writable L3, a block with cached
 * children. *num_stored (may be NULL) counts the blocks newly made READY. Blocks that find no
 * L2 room (every victim pinned) end the put and count as rejected; TKV_EFULL only when some
 * block found no room and none was stored. */
int tkv_store_put(tkv_store *s, const tkv_key *parent, const tkv_key *keys,
                  const uint32_t *tokens, const void *const *payloads, size_t num_blocks,
                  size_t *num_stored);
/* The same, for tenant `tenant` (< TKV_STORE_TENANTS_MAX; tkv_store_put is tenant 0). */
int tkv_store_put_as(tkv_store *s, unsigned tenant, const tkv_key *parent, const tkv_key *keys,
                     const uint32_t *tokens, const void *const *payloads, size_t num_blocks,
                     size_t *num_stored);

/* ---- zero-copy write path: alloc -> write slots -> commit ---------------------------------- */
/* Reserves n L2 slots in state WRITING for owner; *alloc_id names them; offsets[n] gets their
 * byte offsets in the L2 pool. TKV_EFULL if n slots cannot be freed. */
int tkv_store_alloc(tkv_store *s, size_t n, uint64_t owner, uint64_t *alloc_id,
                    uint64_t *offsets);
/* The same in a given tier: TKV_TIER_L2 as above, or TKV_TIER_L1 (offsets in the L1 pool;
 * the engine writes the slots itself through its mapping, so tkv_store_alloc_write refuses
 * them). Committing L1 slots also copies them down to L2 (checksummed there), so an L1
 * block always has a copy a tier below while there is room; write-through continues from
 * L2. TKV_EUNSUPPORTED when the store has no such tier. */
int tkv_store_alloc_tier(tkv_store *s, int tier, size_t n, uint64_t owner, uint64_t *alloc_id,
                         uint64_t *offsets);
/* The same for tenant `tenant`: the slots are reserved in its region of the tier and under
 * its quota there, and the committed blocks are its. */
int tkv_store_alloc_as(tkv_store *s, unsigned tenant, int tier, size_t n, uint64_t owner,
                       uint64_t *alloc_id, uint64_t *offsets);
/* Writes src (block_bytes) into slot `index` of an allocation (for clients that cannot write
 * the pool themselves). */
int tkv_store_alloc_write(tkv_store *s, uint64_t alloc_id, uint32_t index, const void *src);
/* Publishes the first n slots of an allocation under keys (chain as in tkv_store_put); the
 * rest of the allocation and slots whose key already exists are freed. The allocation ends.
 * Admission as in tkv_store_put: a block the L2 policy refuses goes down to a writable L3 from
 * its L2 copy (and stays in L1 if committed there), else its slots are freed. */
int tkv_store_commit(tkv_store *s, uint64_t alloc_id, const tkv_key *parent,
                     const tkv_key *keys, const uint32_t *tokens, size_t n, size_t *num_stored);
int tkv_store_abort(tkv_store *s, uint64_t alloc_id);

/* ---- operations ----------------------------------------------------------------------------- */
/* Moves the named blocks (or all when keys == NULL) out of `tier` (down to the next tier
 * when write-back allows, else dropped). Pinned blocks are skipped and counted. */
int tkv_store_evict(tkv_store *s, int tier, const tkv_key *keys, size_t num_keys,
                    size_t *num_evicted, size_t *num_pinned);
/* Waits until every READY block is durable in L3 (no-op without L3). */
int tkv_store_flush(tkv_store *s);
/* Checks every L3 block's checksum (dropping bad ones) and every L2 block's. */
int tkv_store_verify(tkv_store *s, void (*progress)(void *arg, uint64_t done, uint64_t total),
                     void *arg, uint64_t *num_checked, uint64_t *num_bad);

typedef struct tkv_block_info {
    tkv_key key;
    tkv_key parent;
    uint32_t depth;       /* position in its chain (0 = first block); best known */
    uint8_t state;        /* TKV_BLOCK_* */
    uint8_t in_l2, in_l3, in_l1;
    uint32_t pins;
    uint64_t hits;
    uint64_t last_access_ms;
} tkv_block_info;
enum { TKV_BLOCK_WRITING = 1, TKV_BLOCK_READY = 2, TKV_BLOCK_EVICTING = 3 };

/* Calls cb for each block (snapshot under the lock, callback outside it); stops when cb
 * returns nonzero. */
int tkv_store_list(tkv_store *s, int (*cb)(void *arg, const tkv_block_info *b), void *arg);

typedef struct tkv_store_stats {
    uint64_t lookups, lookup_keys, hit_blocks, miss_blocks;
    uint64_t hit_blocks_tier[TKV_NUM_TIERS];
    uint64_t puts, put_blocks, put_dup_blocks, put_rejected_blocks;
    uint64_t gets, get_bytes;
    uint64_t blocks_tier[TKV_NUM_TIERS], bytes_tier[TKV_NUM_TIERS];
    uint64_t capacity_blocks_tier[TKV_NUM_TIERS];
    uint64_t promotions, promotion_bytes, demotions, demotion_bytes;
    uint64_t evictions, checksum_failures, io_errors;
    uint64_t leases_active, leases_expired, allocs_active;
    uint64_t writeback_queue;
    int l3_readonly, l3_io_mode;
} tkv_store_stats;

void tkv_store_get_stats(tkv_store *s, tkv_store_stats *out);

typedef struct tkv_store_tenant_stats {
    uint64_t blocks_tier[TKV_NUM_TIERS];       /* held now */
    uint64_t max_blocks_tier[TKV_NUM_TIERS];   /* configured limits (0 = none) */
    uint64_t guaranteed_blocks_tier[TKV_NUM_TIERS];
    uint64_t refused_blocks;    /* put/alloc/write-back blocks that found no room within the
                                 * quota (or beside others' guaranteed shares) */
    uint64_t own_evictions;     /* own blocks evicted to stay within the quota or region */
    uint64_t guarded_skips;     /* times a block of this tenant was spared by its guarantee */
    uint64_t refused_blocks_tier[TKV_NUM_TIERS]; /* refused_blocks by tier (L1..L3) */
    uint64_t l4_blocks;         /* blocks it handed to L4 from this store (see the L4 quota) */
    uint64_t max_l4_blocks;     /* its L4 quota (0 = none) */
    uint64_t refused_l4_blocks; /* blocks not handed to L4 for the quota (also in
                                 * refused_blocks) */
} tkv_store_tenant_stats;
/* TKV_EINVAL for a tenant >= TKV_STORE_TENANTS_MAX. */
int tkv_store_get_tenant_stats(tkv_store *s, unsigned tenant, tkv_store_tenant_stats *out);

#ifdef __cplusplus
}
#endif
#endif
