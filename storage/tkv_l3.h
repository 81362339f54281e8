/* tkv_l3.h - the local store (L3): RocksDB index + append-only segment files.
 *
 * RocksDB maps key -> record {segment, offset, stored length, raw length, checksum,
 * codec (zstd or raw), geometry fingerprint, parent key, the block's tokens}. Payloads are
 * zstd frames (stored raw when they do not shrink) in append-only segment files, written and
 * read with io_uring (O_DIRECT, aligned registered buffers, many I/Os in flight), or with
 * pread/pwrite when io_uring is refused (chosen at run time).
 *
 * Durability order: payload written and fdatasync'ed -> index record committed (synced WAL).
 * On open the index is the truth: segment tails it does not reference are truncated.
 * A checksum mismatch on read drops the record and returns TKV_ECHECKSUM: wrong KV is never
 * returned. Errors such as ENOSPC turn the store read-only (TKV_EREADONLY for writes) while
 * reads keep being served.
 *
 * Thread safety: every function may be called from many threads at once on one tkv_l3.
 */
#ifndef TKV_L3_H
#define TKV_L3_H

#include <stddef.h>
#include <stdint.h>

#include "tkv_keys.h"

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tkv_l3 tkv_l3;
typedef struct tkv_l3_opts tkv_l3_opts;

enum { TKV_IO_AUTO = 0, TKV_IO_URING = 1, TKV_IO_PSYNC = 2 };

tkv_l3_opts *tkv_l3_opts_new(void);
void tkv_l3_opts_free(tkv_l3_opts *o);
int tkv_l3_opts_set_fingerprint(tkv_l3_opts *o, const uint8_t fp[TKV_KEY_BYTES]); /* required */
int tkv_l3_opts_set_zstd_level(tkv_l3_opts *o, int level);      /* 0 = raw, 1..19; default 1 */
int tkv_l3_opts_set_io_mode(tkv_l3_opts *o, int mode);          /* TKV_IO_*; default AUTO */
int tkv_l3_opts_set_queue_depth(tkv_l3_opts *o, unsigned qd);    /* default 32 */
int tkv_l3_opts_set_segment_bytes(tkv_l3_opts *o, uint64_t n);   /* default 1 GiB */
int tkv_l3_opts_set_capacity_bytes(tkv_l3_opts *o, uint64_t n);  /* 0 = unlimited */
int tkv_l3_opts_set_compact_dead_fraction(tkv_l3_opts *o, double f); /* default 0.5 */
int tkv_l3_opts_set_max_block_bytes(tkv_l3_opts *o, size_t n);   /* required */
/* Default on: a background thread runs tkv_l3_compact() whenever deletes push a segment over
 * the dead fraction. Off: only explicit tkv_l3_compact() calls reclaim space. */
int tkv_l3_opts_set_auto_compact(tkv_l3_opts *o, int on);

/* Opens or creates the store in dir. TKV_EGEOMETRY if dir holds another fingerprint;
 * TKV_ECORRUPT / TKV_EIO with a log line otherwise. */
int tkv_l3_open(const char *dir, const tkv_l3_opts *o, tkv_l3 **out);
/* Waits for in-flight I/O, closes RocksDB. NULL is ignored. */
void tkv_l3_close(tkv_l3 *l3);

typedef struct tkv_l3_put_req {
    tkv_key key;
    tkv_key parent;            /* previous key of the chain (the root for block 0) */
    const void *payload;
    size_t len;
    const uint32_t *tokens;    /* the block's tokens (stored in the index record) */
    uint32_t num_tokens;
    uint64_t tenant_tag;       /* the owner's tag, kept in the record (0 = none) */
    int status;                /* out: TKV_OK, TKV_EEXIST (already stored; not an error), ... */
} tkv_l3_put_req;

/* Writes n blocks with all their I/O in flight; returns when each is durable (payload
 * synced and its index record committed) or failed. Returns TKV_OK if every status is OK or
 * EEXIST, else the first failure. */
int tkv_l3_put_batch(tkv_l3 *l3, tkv_l3_put_req *reqs, size_t n);

typedef struct tkv_l3_get_req {
    tkv_key key;
    void *dst;                 /* at least cap bytes */
    size_t cap;
    size_t len;                /* out: payload bytes */
    int status;                /* out: TKV_OK, TKV_ENOTFOUND, TKV_ECHECKSUM (record dropped), ... */
} tkv_l3_get_req;

/* Reads n blocks with all their I/O in flight. Return as for put_batch (ENOTFOUND counts). */
int tkv_l3_get_batch(tkv_l3 *l3, tkv_l3_get_req *reqs, size_t n);

/* Removes index records (payload space is reclaimed by compaction). Missing keys are ignored. */
int tkv_l3_delete(tkv_l3 *l3, const tkv_key *keys, size_t n);

typedef struct tkv_l3_info {
    tkv_key key;
    tkv_key parent;
    uint32_t num_tokens;
    uint64_t raw_bytes;
    uint64_t stored_bytes;
    uint64_t tenant_tag;       /* as put; 0 for none and for records of format version 1 */
} tkv_l3_info;

/* Calls cb for every indexed block (in key order); stops early when cb returns nonzero. */
int tkv_l3_scan(tkv_l3 *l3, int (*cb)(void *arg, const tkv_l3_info *info), void *arg);

/* Reads every indexed block and checks its checksum; drops the bad ones. progress(done,total)
 * may be NULL. */
int tkv_l3_verify(tkv_l3 *l3, void (*progress)(void *arg, uint64_t done, uint64_t total),
                  void *arg, uint64_t *num_checked, uint64_t *num_bad);

/* Rewrites live blocks out of segments whose dead fraction is over the threshold and deletes
 * those segments. Safe while other calls run. */
int tkv_l3_compact(tkv_l3 *l3, uint64_t *bytes_reclaimed);

typedef struct tkv_l3_stats {
    uint64_t num_blocks, raw_bytes, stored_bytes, disk_bytes;
    uint64_t reads, writes, read_bytes, write_bytes;
    uint64_t checksum_failures, io_errors, compactions;
    int readonly;              /* 1 after a write error such as ENOSPC */
    int io_mode;               /* TKV_IO_URING or TKV_IO_PSYNC actually in use */
} tkv_l3_stats;

void tkv_l3_get_stats(tkv_l3 *l3, tkv_l3_stats *out);

#ifdef __cplusplus
}
#endif
#endif
