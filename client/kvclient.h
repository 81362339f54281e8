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


#ifdef __cplusplus
extern "C" {
#endif

/* 0.2: the engine side takes libkvclient's own versioned structs (kvc_store_params, ...) */
#define KVC_VERSION_MAJOR 0
#define KVC_VERSION_MINOR 2

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

/* ---- scatter / gather: blocks kept in pieces --------------------------------------------
 * An engine's host pool often keeps one block in several pieces: one per layer and K/V
 * (SGLang's layer_first host pool, vLLM's per-layer caches), or K apart from V (SGLang's
 * page_first). These two calls move a batch of such blocks in one call with no staging copy:
 * a get copies each block from the mapped L2 pool (or from the daemon's reply) straight into
 * its pieces, a put copies the pieces straight into the request message.
 *
 * A block's bytes are the concatenation of its pieces, in order: block b of the call (0-based)
 * is iov[b * iov_per_block .. (b + 1) * iov_per_block), every block the same number of
 * pieces. Validation happens before anything is copied or sent (all or nothing): iov_per_block
 * 1..KVC_IOV_MAX, a piece with len > 0 has a non-NULL base and does not wrap the address
 * space, a block's piece lengths add up to exactly kvc_block_bytes() (KVC_EINVAL naming the
 * block and piece otherwise). Pieces are host memory; the caller keeps them valid (and, for a
 * get, unshared with other writers) for the duration of the call; the library keeps no
 * pointer after it returns. Pieces may be in any order in memory; overlapping pieces of a get
 * leave the later piece's bytes. Thread safety as kvc_get / kvc_put. */
typedef struct kvc_iov {
    void *base;              /* first byte of the piece (const for a put) */
    size_t len;              /* bytes of the piece */
} kvc_iov;

#define KVC_IOV_MAX 65536    /* pieces per block */

/* kvc_get into pieces: hit blocks first..first+count-1 of the lease, block first+b into the
 * pieces of block b. count 0 copies nothing (iov is sized by count, so there is no "to the
 * end" here). Besides the checks above, a piece of a get must not lie in this client's mapped
 * pools (L2 mapping, L1 device range): KVC_EINVAL. Errors otherwise as kvc_get; on a failure
 * after validation, the pieces of blocks not yet delivered are left unspecified. */
int kvc_get_scatter(kvc_client *c, const kvc_lease *l, uint32_t first, uint32_t count,
                    const kvc_iov *iov, uint32_t iov_per_block);

/* kvc_put from pieces: as kvc_put, block first_block+b of the prompt being the concatenation
 * of the pieces of block b (b < num_blocks). Large puts are split into several messages;
 * each piece is copied once, into the message. res may be NULL. */
int kvc_put_gather(kvc_client *c, const uint32_t *tokens, size_t num_tokens,
                   uint32_t first_block, const kvc_iov *iov, uint32_t iov_per_block,
                   uint32_t num_blocks, kvc_put_result *res);

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
 * An attached engine runs tierkv's kernels directly on the daemon's pools: L2 is the mapped
 * host pool (CPU kernels), L1 the GPU pool mapped by CUDA IPC (CUDA kernels on the engine's
 * stream). There is no daemon round trip per layer: the daemon is asked only for slots
 * (kvc_alloc_tier), to publish them (kvc_commit) and to pin/move hits (lookup, prefetch,
 * wait). Block ids are slot numbers in a tier's pool: byte offset / pool stride (L2: the
 * page-rounded slot stride; L1: kvc_block_bytes()). The kernels' arithmetic (the prologue's
 * float operations, the attention's split and merge) is described in docs/design.md.
 *
 * ABI: the parameter structs below are libkvclient's own (the kernels' structs never cross
 * this header), and each starts with struct_size. Fill one with its kvc_*_init(p, sizeof *p)
 * before setting fields: the library reads only the first struct_size bytes and treats the
 * fields it has and the caller's struct lacks as their defaults, so a program built against
 * this header keeps working with a later libkvclient whose structs have grown. A struct_size
 * below the struct's first version (the one in this header), or one larger than the library
 * knows with a non-zero byte past what it knows (a field it cannot honour), is refused with
 * KVC_EINVAL.
 *
 * Device memory: L1 is one cudaMalloc chunk of the daemon, opened at connect (on the device
 * whose PCI bus id the daemon announced; the caller's current device is left as it was).
 * Kernels on it must run on a stream of that device. The mapping lives until kvc_close; a
 * block's bytes are meaningful only while a lease or an allocation holds it.
 *
 * Thread safety: as the kernels (no shared state); one plan per stream at a time. */

/* KV and query element types, RoPE pairings and RMSNorm placements of the fields below. */
enum { KVC_DTYPE_FP8_E4M3 = 0, KVC_DTYPE_BF16 = 1 };
enum { KVC_SCALE_PER_TENSOR = 0, KVC_SCALE_PER_TOKEN_HEAD = 1 };
enum { KVC_ROPE_NEOX = 0, KVC_ROPE_GPTJ = 1 };
enum { KVC_NORM_OFF = 0, KVC_NORM_BEFORE_ROPE = 1, KVC_NORM_AFTER_ROPE = 2 };

/* 1 when the daemon's L1 pool is mapped in this process (CUDA build, device visible, single
 * chunk pool), else 0. */
int kvc_has_l1(const kvc_client *c);
/* 1 when this process may write the tier's pool (L1 mapped, or L2 mapped writable). */
int kvc_pool_writable(const kvc_client *c, int tier);

/* Where a tier's pages keep their bytes. Block b, layer l lies at
 *   base + b * block_stride + l * layer_stride:
 *     K [token][kv_head][dim] at +0, V the same at +v_offset, and in per-token-head mode the K
 *     scales [token][kv_head] as float32 at +kscale_offset (0 when there are none). */
typedef struct kvc_layout {
    size_t struct_size;       /* set by the caller to sizeof(kvc_layout) */
    uint32_t num_layers, num_kv_heads, head_dim, page_tokens;
    int kv_dtype;             /* KVC_DTYPE_* */
    int scale_mode;           /* KVC_SCALE_* */
    size_t elem_bytes, token_stride, v_offset, kscale_offset, layer_stride, block_stride;
} kvc_layout;

/* The layout of the client's geometry with block_stride = that tier's pool stride; fills the
 * first out->struct_size bytes (which the caller sets to sizeof *out). KVC_EINVAL for a tier
 * other than L1/L2 or a struct_size below the first version's; KVC_EUNSUPPORTED when the
 * geometry is outside the kernels' shapes. Works without attaching (it is arithmetic). */
int kvc_pool_layout(const kvc_client *c, int tier, kvc_layout *out);
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

/* One layer of one forward step through the fused prologue: per token the packed BF16 QKV
 * row goes through [RMSNorm] -> RoPE -> [RMSNorm] -> [Hadamard rotation] of the Q and K heads;
 * Q comes out as FP8 with a per-(token, head) scale or as BF16, and K, V are quantised into
 * the tier's pages at slot_mapping. Hkv, head_dim and page_tokens come from the geometry.
 * Pointers are device memory for L1, host memory for L2; none is kept after the call (L1:
 * after the work on the stream completes). */
typedef struct kvc_store_params {
    size_t struct_size;           /* kvc_store_params_init sets it */
    const uint16_t *qkv;          /* bf16 [num_tokens][qkv_stride]: Hq Q, Hkv K, Hkv V heads */
    size_t qkv_stride;            /* elements between token rows; 0 = packed (Hq + 2 Hkv) * D */
    int num_tokens;               /* >= 0 */
    int num_q_heads;              /* Hq: a multiple of Hkv, group Hq / Hkv <= 16 */
    const int32_t *positions;     /* [num_tokens], each in [0, max_pos) */
    const float *rope_cos;        /* [max_pos][D/2] */
    const float *rope_sin;        /* [max_pos][D/2] */
    int max_pos;                  /* >= 1 */
    int rope_style;               /* KVC_ROPE_*; default NeoX */
    int norm_mode;                /* KVC_NORM_*; default off */
    float norm_eps;               /* > 0 when norm_mode is not off; default 1e-6 */
    const float *q_norm_weight;   /* [D], when norm_mode is not off */
    const float *k_norm_weight;   /* [D], when norm_mode is not off */
    int hadamard;                 /* 0 or 1 */
    int q_dtype;                  /* KVC_DTYPE_*; default FP8 */
    void *q_out;                  /* [num_tokens][Hq][D] */
    float *q_scale_out;           /* [num_tokens][Hq], FP8 Q only */
    int layer;                    /* 0 .. num_layers-1 */
    const int64_t *slot_mapping;  /* [num_tokens]: pool block id * page_tokens + offset, or -1
                                   * (the token's K/V are not stored) */
    float k_scale, v_scale;       /* FP8 per-tensor mode; > 0; default 1 */
    const float *v_head_scales;   /* [Hkv], FP8 per-token-head mode */
    int num_reqs;                 /* >= 0: requests whose last page gets its tail zeroed */
    const int64_t *req_last_slot; /* [num_reqs]: slot of each request's last token, or -1 */
} kvc_store_params;

/* Zeroes the first struct_size bytes of *p (pass sizeof *p), then sets struct_size and the
 * defaults above. KVC_EINVAL when p is NULL or struct_size is below the first version's. */
int kvc_store_params_init(kvc_store_params *p, size_t struct_size);

/* Runs the prologue of *p into the tier's pool, on stream (L1: a cudaStream_t of the pool's
 * device; unused for L2). L2 needs the writable mapping of a trusted client (KVC_EINVAL
 * otherwise). The slots must be ones the caller allocated and has not committed yet. Bad
 * shapes are KVC_EUNSUPPORTED, bad values KVC_EINVAL (the CPU path checks positions and
 * slots; the GPU cannot refuse after launch: a bad position is clamped, a bad slot skipped),
 * a CUDA failure KVC_EINTERNAL, no GPU KVC_EUNAVAILABLE; kvc_last_error() gives the reason. */
int kvc_store(kvc_client *c, int tier, const kvc_store_params *p, void *stream);

/* Decode attention of one step over blocks of a tier's pool. Every request has q_len new
 * query tokens (already counted in its kv_len); token t of a request with kv_len L sees KV
 * positions < L - q_len + t + 1. O is BF16, LSE base 2 (so two key sets merge with kvc_merge);
 * a row that sees no position gets O = 0, LSE = -inf. Pointers as for kvc_store_params. */
typedef struct kvc_attend_args {
    size_t struct_size;           /* kvc_attend_args_init sets it */
    int layer;                    /* 0 .. num_layers-1 */
    int num_requests;             /* >= 0 */
    int num_q_heads;              /* Hq; group Hq / Hkv in 1..16 */
    int q_len;                    /* 1..8; default 1 */
    int q_dtype;                  /* KVC_DTYPE_*; default BF16 */
    const void *q;                /* [num_requests][q_len][Hq][D] */
    const float *q_scales;        /* [num_requests][q_len][Hq], FP8 Q only */
    const int32_t *kv_lens;       /* [num_requests], 0 .. block_table_stride * page_tokens */
    const int32_t *block_table;   /* [num_requests][block_table_stride] pool block ids */
    int block_table_stride;       /* >= 1 */
    float k_scale, v_scale;       /* FP8 per-tensor mode; default 1 */
    const float *v_head_scales;   /* [Hkv], FP8 per-token-head mode */
    float sm_scale;               /* softmax scale; 0 (default) = 1/sqrt(head_dim) */
    void *out;                    /* bf16 [num_requests][q_len][Hq][D] */
    float *lse;                   /* [num_requests][q_len][Hq]; NULL: not written */
} kvc_attend_args;

/* As kvc_store_params_init. */
int kvc_attend_args_init(kvc_attend_args *a, size_t struct_size);

/* The GPU decode plan: the device task map and partial-result workspace of steps of up to
 * max_requests requests with num_q_heads query heads and up to max_q_len (1..8) new tokens
 * each, in the client's geometry. One plan serves one stream at a time; it lives until
 * kvc_plan_destroy (which needs no client, and may outlive kvc_close). KVC_EUNAVAILABLE
 * without a usable GPU (L2 attention needs no plan). */
typedef struct kvc_plan kvc_plan;
int kvc_plan_create(const kvc_client *c, int max_requests, int num_q_heads, int max_q_len,
                    kvc_plan **out);
void kvc_plan_destroy(kvc_plan *plan); /* NULL is ignored */

/* Runs *a over the tier's pool: L1 plans on the device (from a->kv_lens, no host round trip)
 * and attends on stream with plan (required); L2 runs the CPU attention (plan and stream
 * unused). The block table's blocks must stay leased until the work is done. Errors as
 * kvc_store. */
int kvc_attend(kvc_client *c, int tier, const kvc_attend_args *a, kvc_plan *plan,
               void *stream);

/* Merges two (O, LSE) sets of num_rows rows (O bf16 [num_rows][head_dim], LSE base 2): on
 * stream with device pointers for L1, on the CPU for L2. A set whose LSE is -inf contributes
 * nothing. out/out_lse may alias an input. */
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
