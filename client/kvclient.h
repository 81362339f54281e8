/* kvclient.h - libkvclient, the C client of tierkvd (the tierkv KV-cache daemon).
 *
 * An engine links libkvclient (shared or static; pkg-config `kvclient`) and talks to the
 * daemon of its host:
 *
 *   kvc_opts *o = kvc_opts_new();
 *   kvc_opts_set_socket(o, "/run/tierkv/tierkv.sock");
 *   kvc_opts_set_attach_socket(o, "/run/tierkv/attach.sock");     // optional: mapped gets
 *   kvc_opts_set_geometry(o, 32, 8, 128, 64, "fp8_e4m3", "per_tensor", "llama-3-8b");
 *   kvc_client *c;
 *   if (kvc_connect(o, &c) != KVC_OK) fprintf(stderr, "%s\n", kvc_last_error());
 *   kvc_opts_free(o);                        // the client keeps its own copy
 *
 *   kvc_lease *l;
 *   kvc_lookup(c, tokens, n, 0, &l);         // longest cached prefix, pinned by a lease
 *   kvc_get(c, l, 0, kvc_lease_num_blocks(l), buf, cap);
 *   kvc_put(c, tokens, n, kvc_lease_num_blocks(l), missing_kv, num_missing, NULL);
 *   kvc_release(c, l);
 *
 * Errors: every call returns KVC_OK (0) or a negative KVC_E* code; kvc_strerror() names the
 * code and kvc_last_error() returns the full message of the calling thread's last failure
 * (the daemon's gRPC status message where there was one).
 *
 * Thread safety: a kvc_client may be shared by any number of threads. It holds one gRPC
 * channel (HTTP/2 multiplexes concurrent calls on one connection); every call creates its
 * own grpc_call and completion queue, so calls never wait on each other inside the client.
 * When attached, the critical-path calls (lookup, prefetch/wait, release, alloc/write/commit,
 * put) go over the attach connection instead, one at a time; a call that finds it busy with
 * another thread's call takes the gRPC channel, so calls still never wait on each other.
 * A kvc_lease is not locked: use one lease from one thread at a time (several threads may
 * read a lease concurrently through the kvc_lease_* accessors and kvc_get).
 *
 * Namespaces: blocks are keyed per namespace (tenant); one namespace can neither hit nor
 * probe another's prefixes. The client's namespace is fixed at connect time.
 *
 * Keys: the daemon derives block keys from tokens; the client only computes its geometry
 * fingerprint (SHA-256 of the geometry and model id), sent with every request so blocks of
 * different models never mix.
 */
#ifndef KVCLIENT_H
#define KVCLIENT_H

#include <stddef.h>
#include <stdint.h>

#include "tkv_kernels.h" /* the engine-side section takes the kernels' parameter structs */

#ifdef __cplusplus
extern "C" {
#endif

#define KVC_VERSION_MAJOR 0
#define KVC_VERSION_MINOR 1

/* ---- status codes ----------------------------------------------------------------------- */
enum {
    KVC_OK = 0,
    KVC_EINVAL = -1,       /* bad argument, or the daemon said INVALID_ARGUMENT */
    KVC_EUNAVAILABLE = -2, /* daemon unreachable, shutting down, or a tier is off */
    KVC_ENOTFOUND = -3,    /* unknown or expired lease / allocation */
    KVC_EGEOMETRY = -4,    /* geometry fingerprint differs from the daemon's */
    KVC_EFULL = -5,        /* a tier is full or a message too large (RESOURCE_EXHAUSTED) */
    KVC_EDATALOSS = -6,    /* a block failed its checksum and was dropped */
    KVC_ETIMEDOUT = -7,    /* the call's deadline passed */
    KVC_EBUSY = -8,        /* FAILED_PRECONDITION other than geometry: e.g. block pinned */
    KVC_EPROTO = -9,       /* a reply the client could not parse or that breaks the contract */
    KVC_EATTACH = -10,     /* the attach handshake or the pool mapping failed */
    KVC_EUNSUPPORTED = -11,/* the daemon does not implement the method */
    KVC_EINTERNAL = -12,   /* any other gRPC status (INTERNAL, UNKNOWN, ...) */
    KVC_ECANCELLED = -13,  /* stopped by the caller (e.g. a verify callback returned non-0) */
};

/* Static, never NULL: a short name of a KVC_* code ("ok", "daemon unavailable", ...). */
const char *kvc_strerror(int status);

/* The calling thread's last error message (the code's name plus detail: the daemon's gRPC
 * status message, the errno of a failed system call, ...). Thread-local: a failure in one
 * thread never overwrites another's. Valid until the next failing kvc_* call in this thread;
 * "" when no call has failed in this thread. Never NULL. */
const char *kvc_last_error(void);

/* Tiers, as in proto/tierkv.proto. */
typedef enum kvc_tier {
    KVC_TIER_NONE = 0,
    KVC_TIER_L1 = 1,       /* GPU HBM */
    KVC_TIER_L2 = 2,       /* host memory */
    KVC_TIER_L3 = 3,       /* local store */
} kvc_tier;

/* "none", "L1", "L2", "L3"; "?" for other values. */
const char *kvc_tier_name(int tier);

/* ---- options ------------------------------------------------------------------------------
 * An options object is owned by the caller; kvc_connect copies what it needs, so it may be
 * freed right after. Setters copy their string arguments. Not thread-safe (build it in one
 * thread). Setters return KVC_OK or KVC_EINVAL (with kvc_last_error() saying why). */
typedef struct kvc_opts kvc_opts;

kvc_opts *kvc_opts_new(void);              /* aborts on out-of-memory, never NULL */
void kvc_opts_free(kvc_opts *o);           /* NULL is ignored */

/* The daemon's gRPC UNIX socket path. Default: $TIERKV_SOCKET, else /run/tierkv/tierkv.sock. */
int kvc_opts_set_socket(kvc_opts *o, const char *path);
/* Any gRPC target instead of a UNIX socket path, e.g. "127.0.0.1:7700" or "unix:/p".
 * Overrides kvc_opts_set_socket. */
int kvc_opts_set_target(kvc_opts *o, const char *target);
/* Attach socket path (proto/tkv_attach.h). When set, kvc_connect attaches: it receives the
 * L2 pool's memfd, maps it read-only, and keeps the attach connection open so the daemon
 * releases this client's leases and allocations when the process exits or dies. NULL (the
 * default) = do not attach; gets then always go by value and leases end by release or TTL. */
int kvc_opts_set_attach_socket(kvc_opts *o, const char *path);
/* Tenant namespace; "" (default) is the default namespace. At most 255 bytes. */
int kvc_opts_set_namespace(kvc_opts *o, const char *ns);
/* The model geometry (docs/design.md): layers 1..1024, kv_heads 1..256, head_dim 64/128/256,
 * block_tokens 16/32/64/128, dtype "fp8_e4m3"|"bf16", scale_mode "per_tensor"|
 * "per_token_head" (fp8 only), model_id non-empty (< 128 bytes). The fingerprint is computed
 * from it. When no geometry is set, kvc_connect adopts the daemon's (what the CLI does). */
int kvc_opts_set_geometry(kvc_opts *o, uint32_t num_layers, uint32_t num_kv_heads,
                          uint32_t head_dim, uint32_t block_tokens, const char *kv_dtype,
                          const char *scale_mode, const char *model_id);
/* Deadline of every call in milliseconds (default 10000). kvc_wait and kvc_verify take
 * their own limits. 0 is invalid. */
int kvc_opts_set_timeout_ms(kvc_opts *o, uint32_t timeout_ms);
/* Most blocks one Put or Get message carries (default 64, tierkvd's default
 * max_blocks_per_rpc; set it to at most the daemon's value). Larger requests are split. */
int kvc_opts_set_max_blocks_per_call(kvc_opts *o, uint32_t n);
/* Trusted engine (0/1, default 0): attach asks for a writable mapping of the L2 pool
 * (TKV_ATTACH_HELLO_WRITABLE), so kvc_store can write KV into allocated L2 slots with the CPU
 * kernels. The daemon grants it only to a process of its own user (or root) when its
 * attach_writable is on; otherwise kvc_connect fails with KVC_EATTACH (no silent read-only
 * fallback: an engine that needs to write must know at connect). Needs an attach socket. */
int kvc_opts_set_trusted(kvc_opts *o, int trusted);
/* Lease time-to-live asked for by kvc_lookup when its ttl_ms argument is 0 (0 = daemon default). */
int kvc_opts_set_lease_ttl_ms(kvc_opts *o, uint32_t ttl_ms);

/* ---- connection -------------------------------------------------------------------------- */
typedef struct kvc_client kvc_client;

/* Connects: opens the channel, asks the daemon for its geometry (Stats) within the timeout,
 * checks it against the options' geometry (KVC_EGEOMETRY on mismatch) or adopts it, and
 * attaches when an attach socket is set. On success *out owns the connection until
 * kvc_close. Errors: KVC_EINVAL (bad options), KVC_EUNAVAILABLE / KVC_ETIMEDOUT (daemon not
 * there), KVC_EGEOMETRY, KVC_EATTACH. */
int kvc_connect(const kvc_opts *o, kvc_client **out);

/* Closes the attach connection (the daemon then releases this client's leases), unmaps the
 * pool and frees the client. Every call on c must have returned; leases still open are
 * freed (their daemon side ends with the attach connection or their TTL). NULL is ignored. */
void kvc_close(kvc_client *c);

size_t kvc_block_bytes(const kvc_client *c);   /* bytes of one block (from the daemon) */
uint32_t kvc_block_tokens(const kvc_client *c);
int kvc_is_attached(const kvc_client *c);      /* 1 when the L2 pool is mapped */
uint64_t kvc_client_id(const kvc_client *c);   /* from the attach handshake; 0 if not attached */
/* The 32-byte geometry fingerprint in use, as 64 lower-case hex chars + NUL. */
void kvc_fingerprint_hex(const kvc_client *c, char out[65]);

/* ---- lookup and leases ------------------------------------------------------------------- */
/* A lease pins the blocks a lookup hit, until kvc_release, its TTL, or (when attached) the
 * client's exit. Owned by the caller; freed only by kvc_release. */
typedef struct kvc_lease kvc_lease;

/* Finds the longest cached prefix of tokens[0..num_tokens) (only full blocks count) and pins
 * it. *out is always set on KVC_OK, also when nothing hit (then kvc_lease_id() is 0 and
 * kvc_release only frees it). ttl_ms 0 = the options' default. */
int kvc_lookup(kvc_client *c, const uint32_t *tokens, size_t num_tokens, uint32_t ttl_ms,
               kvc_lease **out);

/* Looks up num_prompts prompts in one call (an engine's scheduler step): prompt i is
 * tokens[i][0..num_tokens[i]) and gets its own lease in out[i], exactly as kvc_lookup would
 * give it. At most 256 prompts and 4 x the daemon's max_prompt_tokens tokens in all
 * (KVC_EINVAL beyond). All or nothing: on failure no out[i] is set and no lease of the call
 * remains. Each out[i] is the caller's, freed by kvc_release. ttl_ms as kvc_lookup. */
int kvc_lookup_batch(kvc_client *c, const uint32_t *const *tokens, const size_t *num_tokens,
                     size_t num_prompts, uint32_t ttl_ms, kvc_lease **out);

uint64_t kvc_lease_id(const kvc_lease *l);
uint32_t kvc_lease_num_blocks(const kvc_lease *l);        /* hit blocks */
uint32_t kvc_lease_num_query_blocks(const kvc_lease *l);  /* full blocks in the query */
/* Fastest tier holding hit block i (KVC_TIER_*), as of the lookup or the last kvc_wait;
 * KVC_TIER_NONE when i is out of range. */
int kvc_lease_tier(const kvc_lease *l, uint32_t i);

/* Starts promoting the lease's blocks to tier (KVC_TIER_L2, or KVC_TIER_L1 where the daemon
 * has a GPU tier) and returns at once; *ticket (may be NULL) names the promotion. */
int kvc_prefetch(kvc_client *c, kvc_lease *l, int tier, uint64_t *ticket);
/* Waits until the lease's blocks are in tier (timeout_ms 0 = no limit) and refreshes the
 * lease's locations. KVC_ETIMEDOUT, KVC_EDATALOSS when a block failed its checksum (the
 * lease then covers only the blocks before it), KVC_ENOTFOUND when the lease expired. */
int kvc_wait(kvc_client *c, kvc_lease *l, int tier, uint32_t timeout_ms);

/* Copies hit blocks first..first+count-1 of the lease into dst (count * kvc_block_bytes()
 * bytes; dst_len must be at least that). A block in L2 of an attached client is copied from
 * the mapped pool (a memcpy, no message); others come by value from the daemon, which reads
 * them from L3 if needed (checksum verified). count 0 = to the end of the lease. */
int kvc_get(kvc_client *c, const kvc_lease *l, uint32_t first, uint32_t count, void *dst,
            size_t dst_len);

/* Location in the mapped L2 pool of hit block i, or NULL when the client is not attached or
 * the block is not in L2. The pointer is read-only and stays valid while the lease is held. */
const void *kvc_lease_block_ptr(const kvc_client *c, const kvc_lease *l, uint32_t i);

/* Is restoring the lease's blocks into tier (KVC_TIER_L1, or KVC_TIER_L2) faster than
 * recomputing them? The daemon estimates restore_ms from where the blocks are and the copy
 * rates it measured; prefill_ms (> 0) is the engine's own estimate for recomputing the
 * lease's tokens. KVC_EUNSUPPORTED from a daemon that does not offer the estimate. */
typedef struct kvc_cost {
    double restore_ms;       /* estimated time until every block is in the tier */
    int use_cache;           /* 1 when restore_ms < prefill_ms */
    uint32_t blocks_in_tier, blocks_from_l2, blocks_from_l3;
    double pcie_gbps, l3_read_gbps; /* the rates the estimate used */
} kvc_cost;

int kvc_cost_check(kvc_client *c, const kvc_lease *l, double prefill_ms, int tier,
                   kvc_cost *out);

/* Ends the lease on the daemon (when it has an id) and frees l. NULL is ignored. The lease
 * is freed even when the daemon call fails (its daemon side then ends by TTL). */
int kvc_release(kvc_client *c, kvc_lease *l);

/* ---- put by value ------------------------------------------------------------------------ */
typedef struct kvc_put_result {
    uint32_t num_stored;     /* newly stored */
    uint32_t num_duplicate;  /* already present, dropped */
    uint32_t num_rejected;   /* not admitted by the daemon's policy */
} kvc_put_result;

/* Stores num_blocks blocks, chain indices first_block..first_block+num_blocks-1 of the prompt
 * tokens[0..num_tokens) (num_tokens must cover them: >= (first_block+num_blocks) *
 * block_tokens). payloads: num_blocks * kvc_block_bytes() bytes, block after block. Large puts
 * are split into several messages. res may be NULL. */
int kvc_put(kvc_client *c, const uint32_t *tokens, size_t num_tokens, uint32_t first_block,
            const void *payloads, uint32_t num_blocks, kvc_put_result *res);

/* ---- zero-copy write path: alloc -> write -> commit -------------------------------------- */
/* Reserves num_blocks L2 slots. *alloc_id names them; offsets (num_blocks entries, may be
 * NULL) get their byte offsets in the L2 pool. Until kvc_commit or kvc_abort the slots are
 * invisible to lookups. */
int kvc_alloc(kvc_client *c, uint32_t num_blocks, uint64_t *alloc_id, uint64_t *offsets);
/* Writes one block (len == kvc_block_bytes()) into slot index of an allocation, by value. */
int kvc_write(kvc_client *c, uint64_t alloc_id, uint32_t index, const void *payload, size_t len);
/* Publishes the first num_blocks slots as chain blocks first_block.. of tokens (the rest are
 * freed); duplicates of existing keys are dropped. The allocation ends. res may be NULL. */
int kvc_commit(kvc_client *c, uint64_t alloc_id, const uint32_t *tokens, size_t num_tokens,
               uint32_t first_block, uint32_t num_blocks, kvc_put_result *res);
/* Abandons an allocation; its slots are never visible. */
int kvc_abort(kvc_client *c, uint64_t alloc_id);

/* ---- engine side: kernels over the daemon's pools -----------------------------------------
 * An attached engine runs the kernels (kernels/tkv_kernels.h) directly on the daemon's pools:
 * L2 is the mapped host pool (CPU kernels), L1 the GPU pool mapped by CUDA IPC (CUDA kernels
 * on the engine's stream). There is no daemon round trip per layer: the daemon is asked only
 * for slots (kvc_alloc_tier), to publish them (kvc_commit) and to pin/move hits (lookup,
 * prefetch, wait). Block ids are slot numbers in a tier's pool: byte offset / pool stride
 * (L2: the page-rounded slot stride; L1: kvc_block_bytes()).
 *
 * Device memory: L1 is one cudaMalloc chunk of the daemon, opened at connect (on the device
 * whose PCI bus id the daemon announced; the caller's current device is left as it was).
 * Kernels on it must run on a stream of that device. The mapping lives until kvc_close; a
 * block's bytes are meaningful only while a lease or an allocation holds it.
 *
 * Thread safety: as the kernels (no shared state); one plan per stream at a time. */

/* 1 when the daemon's L1 pool is mapped in this process (CUDA build, device visible, single
 * chunk pool), else 0. */
int kvc_has_l1(const kvc_client *c);
/* 1 when this process may write the tier's pool (L1 mapped, or L2 mapped writable). */
int kvc_pool_writable(const kvc_client *c, int tier);
/* The kernels' layout of the client's geometry with block_stride = that tier's pool stride.
 * KVC_EINVAL for a tier other than L1/L2; KVC_EUNSUPPORTED when the geometry is outside the
 * kernels' shapes. Works without attaching (it is arithmetic). */
int kvc_pool_layout(const kvc_client *c, int tier, tkvk_layout *out);
/* Block 0 of the tier's pool: L2 the host mapping (read-only unless trusted), L1 a device
 * pointer. NULL with kvc_last_error() set when that pool is not mapped here. */
void *kvc_pool_base(const kvc_client *c, int tier);
/* Blocks in the mapped pool of tier (the bound of every block id); 0 when not mapped. */
int64_t kvc_pool_num_blocks(const kvc_client *c, int tier);
/* Block id of a pool byte offset (as kvc_alloc_tier returns); -1 when it is not a slot of
 * the mapped pool (misaligned or past its end). */
int64_t kvc_offset_block_id(const kvc_client *c, int tier, uint64_t offset);
/* Block id of hit block i of the lease in tier's pool, or -1 when the block is not there (as
 * of the lookup or the last kvc_wait: refresh with kvc_wait after a prefetch). */
int64_t kvc_lease_block_id(const kvc_client *c, const kvc_lease *l, uint32_t i, int tier);

/* kvc_alloc in tier (KVC_TIER_L2 or KVC_TIER_L1): offsets get byte offsets in that tier's
 * pool (turn them into block ids with kvc_offset_block_id). Committing L1 slots also copies
 * them down to L2 on the daemon. KVC_EUNAVAILABLE when the daemon has no such tier. */
int kvc_alloc_tier(kvc_client *c, int tier, uint32_t num_blocks, uint64_t *alloc_id,
                   uint64_t *offsets);

/* One layer of the fused prologue into the tier's pool: sets p->pool and p->num_blocks,
 * points p->layout at the tier's layout for the call (the caller's p->layout is ignored and
 * restored on return), then runs tkvk_prologue_cuda on stream
 * (L1: every pointer in p device memory) or tkvk_prologue_cpu (L2: host memory, stream
 * unused; needs the writable mapping of a trusted client, KVC_EINVAL otherwise). The
 * slot_mapping holds pool block ids * page_tokens + offset, for slots the caller allocated
 * and has not committed yet. Kernel failures map to KVC_EINVAL / KVC_EUNSUPPORTED /
 * KVC_EINTERNAL (CUDA) / KVC_EUNAVAILABLE (no GPU), with the kernel's reason. */
int kvc_store(kvc_client *c, int tier, tkvk_prologue_params *p, void *stream);

/* Decode attention over blocks of the tier's pool: fills a->pool, a->layout and
 * a->num_blocks (a->layout restored on return, as kvc_store), then L1:
 * tkvk_decode_plan_cuda(plan, a->kv_lens, a->num_requests) + tkvk_decode_attend_cuda on stream (plan from tkvk_decode_plan_create, sized by the
 * caller; all pointers of a device memory); L2: tkvk_decode_cpu (plan and stream unused).
 * The block table holds pool block ids (kvc_lease_block_id), which must stay leased until the
 * work is done. O and LSE (base 2) merge with kvc_merge. */
int kvc_attend(kvc_client *c, int tier, tkvk_decode_args *a, tkvk_decode_plan *plan,
               void *stream);

/* Merges two (O, LSE) sets of num_rows rows (tkvk_merge_states_*): on stream with device
 * pointers for L1, on the CPU for L2. out/out_lse may alias an input. */
int kvc_merge(kvc_client *c, int tier, const uint16_t *o_a, const float *lse_a,
              const uint16_t *o_b, const float *lse_b, int num_rows, int head_dim,
              uint16_t *out, float *out_lse, void *stream);

/* ---- operations (the CLI's needs) -------------------------------------------------------- */
typedef struct kvc_tier_stats {
    int tier;                /* KVC_TIER_* */
    uint64_t blocks, bytes, capacity_blocks, hit_blocks;
} kvc_tier_stats;

typedef struct kvc_stats {
    uint64_t lookups, hit_blocks, miss_blocks, hit_tokens;
    uint64_t promotions, promotion_bytes, demotions, demotion_bytes, evictions;
    uint64_t checksum_failures, io_errors, leases_active, clients_connected;
    double lookup_p50_us, lookup_p99_us;
    uint64_t uptime_s, puts, put_blocks, gets, get_bytes;
    int l3_readonly;
    char policy[32];
    kvc_tier_stats tiers[4]; /* indexed by KVC_TIER_*; tiers[t].tier == t, 0s when absent */
    /* the daemon's geometry */
    uint32_t num_layers, num_kv_heads, head_dim, block_tokens;
    uint64_t block_bytes;
    char kv_dtype[16], scale_mode[16], model_id[128];
} kvc_stats;

int kvc_stats_get(kvc_client *c, kvc_stats *out);

typedef struct kvc_health {
    char status[16];         /* "serving" | "degraded" | "stopping" */
    char version[32];
    char notes[512];         /* the daemon's notes joined by "; " ("" when none) */
} kvc_health;

int kvc_health_get(kvc_client *c, kvc_health *out);

typedef struct kvc_block_info {
    char key_hex[65];
    char parent_hex[65];     /* "" for a root block */
    uint32_t depth;
    char state[12];          /* "writing" | "ready" | "evicting" */
    int in_l2, in_l3;
    uint32_t pins;
    uint64_t hits, last_access_ms;
} kvc_block_info;

/* Calls fn once per block the daemon lists (at most limit; 0 = daemon maximum) of tier
 * (KVC_TIER_NONE = all); *total gets how many blocks the daemon holds (may be NULL).
 * fn returning non-zero stops the listing (KVC_OK is still returned). */
typedef int (*kvc_block_fn)(void *arg, const kvc_block_info *b);
int kvc_list_blocks(kvc_client *c, int tier, uint32_t limit, kvc_block_fn fn, void *arg,
                    uint64_t *total);

/* Evicts every unpinned block from tier (KVC_TIER_L2 or KVC_TIER_L3), or, with tokens, only
 * that prompt's blocks in this client's namespace. Counts may be NULL. */
int kvc_evict(kvc_client *c, int tier, const uint32_t *tokens, size_t num_tokens,
              uint32_t *num_evicted, uint32_t *num_pinned);

/* Waits until every pending write-back reached L3. */
int kvc_flush(kvc_client *c);

/* Re-reads every block and checks its checksum; fn (may be NULL) is called with each
 * progress message (done, total, bad so far); returning non-zero cancels (KVC_ECANCELLED).
 * *bad (may be NULL) gets the final number of bad blocks. timeout_ms 0 = no limit. */
typedef int (*kvc_progress_fn)(void *arg, uint64_t done, uint64_t total, uint64_t bad);
int kvc_verify(kvc_client *c, uint32_t timeout_ms, kvc_progress_fn fn, void *arg,
               uint64_t *bad);

#ifdef __cplusplus
}
#endif
#endif
