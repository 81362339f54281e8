/* l3.c - the local store (L3): RocksDB index + append-only segment files (see tkv_l3.h).
 *
 * On disk, in the store's directory:
 *   index/                RocksDB: "m" -> meta (magic, fingerprint); "k" + key -> record
 *   seg-XXXXXXXX.dat      append-only payload segments (hex id, never reused)
 *
 * Every payload occupies an aligned slot [off, off + round_up(stored_len, align)) of one
 * segment, so O_DIRECT reads and writes need no read-modify-write. A record is committed to
 * RocksDB (synced WAL) only after its payload was written and fdatasync'ed: a crash can leave
 * unreferenced bytes behind (discarded on open, or counted dead and compacted) but never an
 * index record that points at bytes that are not on disk.
 *
 * Locking (order: compact_mu -> idx_mu -> seg_mu; ctx_mu is a leaf):
 *   idx_mu   serialises read-check-write sequences on the index (commit of puts, deletes,
 *            compaction moves, dropping a block that failed its checksum). Plain lookups
 *            read RocksDB without it.
 *   seg_mu   the segment table: space reservation, live-byte accounting, reference counts.
 *   ctx_mu   the pool of I/O contexts (an io_uring ring + bounce buffers + zstd contexts);
 *            a batch call owns one context for its whole run, so rings are never shared.
 *   compact_mu  one compaction at a time.
 * A segment is deleted only when it is doomed (compacted away) and no reader or writer holds
 * a reference, so a reader that found a block's old location reads valid bytes.
 */
#include "tkv_l3.h"
#include "tkv_l3_hooks.h"
#include "tkv_base.h"
#include "tkv_csum.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <rocksdb/c.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>
#include <zstd.h>

/* ==== constants ============================================================================ */

#define L3_MAX_CTX 4                        /* I/O contexts: one per concurrent batch call */
#define L3_CTX_BUF_BUDGET (32u << 20)       /* bounce-buffer bytes per context */
#define L3_MAX_TOKENS 65536u
#define L3_MAX_STORED (1ull << 31)          /* io_uring lengths are 32-bit */
/* Record versions: 1 (108-byte header, no tenant) is still read; 2 adds the owner tag (u64 at
 * 108) so recovered blocks belong to their tenant from the start. Only 2 is written. */
#define L3_REC_VERSION 2
#define L3_REC_HDR_V1 108
#define L3_REC_HDR 116
#define L3_META_MAGIC "TKVL3v01"
#define L3_META_LEN (8 + TKV_KEY_BYTES)
#define L3_KEY_LEN (1 + TKV_KEY_BYTES)
#define L3_LOOKUP_RETRIES 8
#define L3_COMPACT_CHUNK_BYTES (64ull << 20)
#define L3_PREALLOC_BYTES (64ull << 20)     /* segment space allocated ahead of appends */

enum { L3_CODEC_RAW = 0, L3_CODEC_ZSTD = 1 };
enum { L3_PENDING = 1 }; /* item status before it is finished (TKV_* are <= 0) */
enum { L3_PREP_SUBMIT = 0, L3_PREP_SKIP = 1, L3_PREP_NEEDBUF = 2 };

/* ==== options ============================================================================== */

struct tkv_l3_opts {
    uint8_t fp[TKV_KEY_BYTES];
    int has_fp;
    int zstd_level;
    int io_mode;
    unsigned queue_depth;
    uint64_t segment_bytes;
    uint64_t capacity_bytes;
    double dead_fraction;
    size_t max_block_bytes;
    int auto_compact;
};

tkv_l3_opts *tkv_l3_opts_new(void)
{
    tkv_l3_opts *o = tkv_xcalloc(1, sizeof(*o));
    o->zstd_level = 1;
    o->io_mode = TKV_IO_AUTO;
    o->queue_depth = 32;
    o->segment_bytes = 1ull << 30;
    o->dead_fraction = 0.5;
    o->auto_compact = 1;
    return o;
}

void tkv_l3_opts_free(tkv_l3_opts *o) { free(o); }

int tkv_l3_opts_set_fingerprint(tkv_l3_opts *o, const uint8_t fp[TKV_KEY_BYTES])
{
    if (!o || !fp)
        return TKV_EINVAL;
    memcpy(o->fp, fp, TKV_KEY_BYTES);
    o->has_fp = 1;
    return TKV_OK;
}

int tkv_l3_opts_set_zstd_level(tkv_l3_opts *o, int level)
{
    if (!o || level < 0 || level > ZSTD_maxCLevel())
        return TKV_EINVAL;
    o->zstd_level = level;
    return TKV_OK;
}

int tkv_l3_opts_set_io_mode(tkv_l3_opts *o, int mode)
{
    if (!o || (mode != TKV_IO_AUTO && mode != TKV_IO_URING && mode != TKV_IO_PSYNC))
        return TKV_EINVAL;
    o->io_mode = mode;
    return TKV_OK;
}

int tkv_l3_opts_set_queue_depth(tkv_l3_opts *o, unsigned qd)
{
    if (!o || qd < 1 || qd > 4096)
        return TKV_EINVAL;
    o->queue_depth = qd;
    return TKV_OK;
}

int tkv_l3_opts_set_segment_bytes(tkv_l3_opts *o, uint64_t n)
{
    if (!o || n < 4096)
        return TKV_EINVAL;
    o->segment_bytes = n;
    return TKV_OK;
}

int tkv_l3_opts_set_capacity_bytes(tkv_l3_opts *o, uint64_t n)
{
    if (!o)
        return TKV_EINVAL;
    o->capacity_bytes = n;
    return TKV_OK;
}

int tkv_l3_opts_set_compact_dead_fraction(tkv_l3_opts *o, double f)
{
    if (!o || !(f > 0.0 && f <= 1.0))
        return TKV_EINVAL;
    o->dead_fraction = f;
    return TKV_OK;
}

int tkv_l3_opts_set_auto_compact(tkv_l3_opts *o, int on)
{
    if (!o)
        return TKV_EINVAL;
    o->auto_compact = on != 0;
    return TKV_OK;
}

int tkv_l3_opts_set_max_block_bytes(tkv_l3_opts *o, size_t n)
{
    if (!o || n == 0 || n > (1ull << 30))
        return TKV_EINVAL;
    o->max_block_bytes = n;
    return TKV_OK;
}

/* ==== types ================================================================================ */

typedef struct l3_seg {
    uint32_t id;
    int fd;
    uint64_t end;       /* bytes reserved (the append cursor); file size after open */
    uint64_t live;      /* slot bytes referenced by the index */
    uint64_t prealloc;  /* file size set by fallocate ahead of the cursor; UINT64_MAX: off */
    uint32_t refs;      /* readers + writers holding the segment open */
    uint32_t pending;   /* writers whose records are not committed yet */
    int compacting;
    int doomed;         /* compacted away: delete when refs drops to 0 */
} l3_seg;

typedef struct l3_rec {
    uint8_t codec;
    uint32_t seg;
    uint64_t off;
    uint64_t stored_len;
    uint64_t raw_len;
    uint64_t csum;
    tkv_key parent;
    uint32_t num_tokens;
    uint64_t tenant_tag;   /* 0 in a version-1 record */
    size_t hdr_len;        /* L3_REC_HDR_V1 or L3_REC_HDR (parsed records) */
    const uint8_t *tokens; /* into the value buffer it was parsed from */
} l3_rec;

typedef struct l3_op {
    int fd;
    int write;
    int buf_index;      /* bounce buffer (registered when the ring has them), or -1 */
    void *buf;
    size_t len;         /* bytes to transfer */
    size_t min_len;     /* a read that hits end of file after this many bytes is complete */
    uint64_t off;
    size_t done;
    int res;            /* 0 or -errno */
} l3_op;

typedef struct l3_slot {
    l3_op op;
    size_t item;
} l3_slot;

typedef struct l3_ctx {
    struct l3_ctx *next_free;
    int has_ring, fixed;
    struct io_uring ring;
    unsigned qd;
    l3_slot *slots;
    unsigned *free_slots;
    void **bufs;
    unsigned nbuf;
    unsigned *free_bufs;
    unsigned num_free_bufs;
    ZSTD_CCtx *cctx;
    ZSTD_DCtx *dctx;
} l3_ctx;

/* A batch of independent I/Os. prep() fills the op of item i (L3_PREP_SUBMIT), finishes the
 * item without I/O (L3_PREP_SKIP), or asks to be called again once a bounce buffer is free
 * (L3_PREP_NEEDBUF); fin() consumes the result. Both run on the calling thread, prep of later
 * items overlapping the I/O of earlier ones. */
typedef struct l3_job {
    tkv_l3 *l3;
    l3_ctx *ctx;
    size_t n;
    int (*prep)(struct l3_job *j, size_t i, l3_op *op);
    void (*fin)(struct l3_job *j, size_t i, l3_op *op);
    void *items;
    /* Optional asynchronous fdatasyncs (io_uring only): a job may call job_sync() from prep
     * or fin; sync_done(tag, res) runs when that sync completes. */
    void (*sync_done)(struct l3_job *j, uint64_t tag, int res);
    unsigned num_syncs;       /* in flight */
    void *state;
} l3_job;

struct tkv_l3 {
    char *dir;
    int dirfd;
    tkv_l3_opts o;
    rocksdb_t *db;
    rocksdb_options_t *dbo;
    rocksdb_writeoptions_t *wo;
    rocksdb_readoptions_t *ro;
    int io_mode;
    int direct;              /* segment files opened with O_DIRECT */
    uint32_t align;          /* offset/length alignment of slots */
    uint32_t mem_align;      /* buffer alignment O_DIRECT needs */
    size_t buf_bytes;        /* one bounce buffer */

    pthread_mutex_t seg_mu;
    l3_seg **segs;           /* indexed by id */
    uint32_t segs_cap;
    uint32_t cur_id;         /* segment being appended to; 0 = none yet */
    uint32_t next_id;
    uint64_t disk_bytes;

    pthread_mutex_t idx_mu;
    pthread_mutex_t compact_mu;

    /* background compaction (auto_compact): kicked under seg_mu when a segment crosses the
     * dead fraction, stopped by close */
    pthread_t compactor;
    int has_compactor;
    pthread_cond_t compact_cv;   /* with seg_mu */
    int compact_kick, compact_stop;

    pthread_mutex_t ctx_mu;
    pthread_cond_t ctx_cv;
    l3_ctx *free_ctx;
    unsigned num_ctx;

    int readonly;            /* atomic */
    int inject_err;          /* atomic; 0 = off */
    uint64_t inject_left;    /* atomic */

    uint64_t num_blocks, raw_bytes, stored_bytes; /* atomic */
    uint64_t reads, writes, read_bytes, write_bytes;
    uint64_t checksum_failures, io_errors, compactions;
};

#define ATOMIC_ADD(p, v) __atomic_fetch_add((p), (v), __ATOMIC_RELAXED)
#define ATOMIC_SUB(p, v) __atomic_fetch_sub((p), (v), __ATOMIC_RELAXED)
#define ATOMIC_LOAD(p) __atomic_load_n((p), __ATOMIC_RELAXED)

static inline uint64_t round_up(uint64_t n, uint64_t a) { return (n + a - 1) / a * a; }

static void *xaligned(size_t align, size_t n)
{
    void *p = NULL;
    if (posix_memalign(&p, align, n ? n : align) != 0) {
        fprintf(stderr, "tierkv: out of memory allocating %zu aligned bytes\n", n);
        abort();
    }
    return p;
}

static void set_readonly(tkv_l3 *l3, const char *why, int err)
{
    if (__atomic_exchange_n(&l3->readonly, 1, __ATOMIC_SEQ_CST) == 0)
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: %s failed (%s); store is now read-only", l3->dir, why,
                strerror(err));
}

/* Key in hex for log lines (kept local: the L3 store depends on nothing but tkv_base). */
static void key_hex(const tkv_key *k, char out[2 * TKV_KEY_BYTES + 1])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < TKV_KEY_BYTES; i++) {
        out[2 * i] = digits[k->b[i] >> 4];
        out[2 * i + 1] = digits[k->b[i] & 15];
    }
    out[2 * TKV_KEY_BYTES] = 0;
}

static int errno_to_tkv(int err)
{
    return (err == ENOSPC || err == EDQUOT || err == EFBIG) ? TKV_ENOSPC : TKV_EIO;
}

/* ==== index records ======================================================================== */

static void put_u32(uint8_t *p, uint32_t v) { memcpy(p, &v, 4); }
static void put_u64(uint8_t *p, uint64_t v) { memcpy(p, &v, 8); }
static uint32_t get_u32(const uint8_t *p) { uint32_t v; memcpy(&v, p, 4); return v; }
static uint64_t get_u64(const uint8_t *p) { uint64_t v; memcpy(&v, p, 8); return v; }

static void idx_key(const tkv_key *k, char out[L3_KEY_LEN])
{
    out[0] = 'k';
    memcpy(out + 1, k->b, TKV_KEY_BYTES);
}

/* Serialises a record; returns a tkv_xmalloc'ed buffer of *len bytes. */
static uint8_t *rec_encode(const tkv_l3 *l3, const l3_rec *r, const uint32_t *tokens,
                           size_t *len)
{
    size_t n = L3_REC_HDR + 4ull * r->num_tokens;
    uint8_t *v = tkv_xcalloc(1, n);
    v[0] = L3_REC_VERSION;
    v[1] = r->codec;
    put_u32(v + 4, r->seg);
    put_u64(v + 8, r->off);
    put_u64(v + 16, r->stored_len);
    put_u64(v + 24, r->raw_len);
    put_u64(v + 32, r->csum);
    memcpy(v + 40, l3->o.fp, TKV_KEY_BYTES);
    memcpy(v + 72, r->parent.b, TKV_KEY_BYTES);
    put_u32(v + 104, r->num_tokens);
    put_u64(v + 108, r->tenant_tag);
    for (uint32_t i = 0; i < r->num_tokens; i++)
        put_u32(v + L3_REC_HDR + 4ull * i, tokens[i]);
    *len = n;
    return v;
}

/* Validates a record read from RocksDB: the index is outside input like any file. */
static int rec_parse(const tkv_l3 *l3, const uint8_t *v, size_t n, l3_rec *r)
{
    if (n < L3_REC_HDR_V1 || (v[0] != 1 && v[0] != L3_REC_VERSION) || v[1] > L3_CODEC_ZSTD)
        return TKV_ECORRUPT;
    r->hdr_len = v[0] == 1 ? L3_REC_HDR_V1 : L3_REC_HDR;
    if (n < r->hdr_len)
        return TKV_ECORRUPT;
    r->codec = v[1];
    r->seg = get_u32(v + 4);
    r->off = get_u64(v + 8);
    r->stored_len = get_u64(v + 16);
    r->raw_len = get_u64(v + 24);
    r->csum = get_u64(v + 32);
    memcpy(r->parent.b, v + 72, TKV_KEY_BYTES);
    r->num_tokens = get_u32(v + 104);
    r->tenant_tag = r->hdr_len == L3_REC_HDR ? get_u64(v + 108) : 0;
    r->tokens = v + r->hdr_len;
    if (r->num_tokens > L3_MAX_TOKENS || n != r->hdr_len + 4ull * r->num_tokens)
        return TKV_ECORRUPT;
    if (r->seg == 0 || r->stored_len == 0 || r->stored_len > L3_MAX_STORED ||
        r->raw_len > L3_MAX_STORED || r->off > (1ull << 62))
        return TKV_ECORRUPT;
    if (r->codec == L3_CODEC_RAW && r->stored_len != r->raw_len)
        return TKV_ECORRUPT;
    /* This store never writes a block over max_block_bytes nor stored bytes over one bounce
     * buffer (zstd's bound for that block): a longer record is damaged or forged, and
     * reading it would overrun the bounce buffer it is read into. */
    if (r->raw_len > l3->o.max_block_bytes || r->stored_len > l3->buf_bytes)
        return TKV_ECORRUPT;
    if (memcmp(v + 40, l3->o.fp, TKV_KEY_BYTES) != 0)
        return TKV_EGEOMETRY;
    return TKV_OK;
}

/* Looks a key up. TKV_OK with *val (rocksdb_free it) and *r parsed; TKV_ENOTFOUND;
 * TKV_ECORRUPT for an unreadable record; TKV_EIO when RocksDB fails. */
static int idx_get(tkv_l3 *l3, const tkv_key *key, char **val, l3_rec *r)
{
    char k[L3_KEY_LEN];
    char *err = NULL;
    size_t vlen = 0;
    idx_key(key, k);
    char *v = rocksdb_get(l3->db, l3->ro, k, sizeof(k), &vlen, &err);
    if (err) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: index read: %s", l3->dir, err);
        rocksdb_free(err);
        return TKV_EIO;
    }
    if (!v)
        return TKV_ENOTFOUND;
    int rc = rec_parse(l3, (const uint8_t *)v, vlen, r);
    if (rc != TKV_OK) {
        rocksdb_free(v);
        return rc == TKV_EGEOMETRY ? TKV_ECORRUPT : rc;
    }
    *val = v;
    return TKV_OK;
}

static int idx_exists(tkv_l3 *l3, const tkv_key *key)
{
    char *v = NULL;
    l3_rec r;
    int rc = idx_get(l3, key, &v, &r);
    if (rc == TKV_OK)
        rocksdb_free(v);
    return rc == TKV_OK;
}

/* Writes a batch with a synced WAL. */
static int idx_commit(tkv_l3 *l3, rocksdb_writebatch_t *wb)
{
    char *err = NULL;
    rocksdb_write(l3->db, l3->wo, wb, &err);
    if (err) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: index commit: %s", l3->dir, err);
        rocksdb_free(err);
        ATOMIC_ADD(&l3->io_errors, 1);
        set_readonly(l3, "index commit", EIO);
        return TKV_EIO;
    }
    return TKV_OK;
}

/* ==== segments ============================================================================= */

static void seg_path(const tkv_l3 *l3, uint32_t id, char *out, size_t n)
{
    snprintf(out, n, "%s/seg-%08x.dat", l3->dir, id);
}

static int seg_open_fd(tkv_l3 *l3, uint32_t id, int create)
{
    char path[4096];
    seg_path(l3, id, path, sizeof(path));
    int flags = O_RDWR | O_CLOEXEC | (create ? O_CREAT | O_EXCL : 0);
    return open(path, flags | (l3->direct ? O_DIRECT : 0), 0644);
}

/* Adds a segment to the table (seg_mu held or single-threaded open). */
static void seg_insert(tkv_l3 *l3, l3_seg *s)
{
    if (s->id >= l3->segs_cap) {
        uint32_t cap = l3->segs_cap ? l3->segs_cap : 16;
        while (cap <= s->id)
            cap *= 2;
        l3->segs = tkv_xrealloc(l3->segs, cap * sizeof(*l3->segs));
        memset(l3->segs + l3->segs_cap, 0, (cap - l3->segs_cap) * sizeof(*l3->segs));
        l3->segs_cap = cap;
    }
    l3->segs[s->id] = s;
}

/* Removes a segment for good (seg_mu held): closes and unlinks its file. */
static void seg_destroy(tkv_l3 *l3, l3_seg *s)
{
    char path[4096];
    seg_path(l3, s->id, path, sizeof(path));
    close(s->fd);
    if (unlink(path) != 0)
        TKV_LOG(TKV_LOG_WARN, "l3 %s: unlink %s: %s", l3->dir, path, strerror(errno));
    l3->segs[s->id] = NULL;
    free(s);
}

/* A new segment to append to (seg_mu held). The directory is synced so the file survives a
 * crash together with the records that will point into it. */
static int seg_create(tkv_l3 *l3, l3_seg **out)
{
    uint32_t id = l3->next_id;
    int fd = seg_open_fd(l3, id, 1);
    if (fd < 0) {
        int e = errno;
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: create segment %08x: %s", l3->dir, id, strerror(e));
        ATOMIC_ADD(&l3->io_errors, 1);
        set_readonly(l3, "segment create", e);
        return errno_to_tkv(e);
    }
    if (fsync(l3->dirfd) != 0) {
        int e = errno;
        close(fd);
        ATOMIC_ADD(&l3->io_errors, 1);
        set_readonly(l3, "directory sync", e);
        return errno_to_tkv(e);
    }
    l3->next_id++;
    l3_seg *s = tkv_xcalloc(1, sizeof(*s));
    s->id = id;
    s->fd = fd;
    seg_insert(l3, s);
    *out = s;
    return TKV_OK;
}

/* Allocates segment space ahead of the append cursor (seg_mu held). An O_DIRECT write that
 * extends a file is serialised by the file system (ext4 takes the inode lock exclusively and
 * updates the size on completion); writes inside an allocated range run in parallel, as
 * fio's do into the file it lays out first. The tail past the last record is cut again on
 * close and on open, so the preallocation is never mistaken for data. */
static void seg_prealloc(tkv_l3 *l3, l3_seg *s)
{
    if (s->prealloc == UINT64_MAX || s->end <= s->prealloc)
        return;
    uint64_t chunk = L3_PREALLOC_BYTES < l3->o.segment_bytes ? L3_PREALLOC_BYTES
                                                              : l3->o.segment_bytes;
    uint64_t target = round_up(s->end, chunk);
    if (fallocate(s->fd, 0, (off_t)s->prealloc, (off_t)(target - s->prealloc)) == 0) {
        s->prealloc = target;
    } else if (errno == EOPNOTSUPP || errno == ENOSYS) {
        s->prealloc = UINT64_MAX; /* the file system cannot: plain appends */
    }
    /* other errors (ENOSPC): the writes themselves report them */
}

/* Cuts a segment's file back to its cursor when it was preallocated past it. */
static int seg_trim(l3_seg *s)
{
    if (s->prealloc == UINT64_MAX || s->prealloc <= s->end)
        return 0;
    if (ftruncate(s->fd, (off_t)s->end) != 0)
        return -1;
    s->prealloc = s->end;
    return 0;
}

/* Reserves an aligned slot of alen bytes in the current segment for a writer; the writer
 * holds a reference and a pending count until its record is committed (seg_release_write). */
static int seg_reserve(tkv_l3 *l3, uint64_t alen, int over_capacity, l3_seg **out,
                       uint64_t *off)
{
    int rc = TKV_OK;
    pthread_mutex_lock(&l3->seg_mu);
    if (ATOMIC_LOAD(&l3->readonly)) {
        rc = TKV_EREADONLY;
        goto out;
    }
    if (!over_capacity && l3->o.capacity_bytes &&
        l3->disk_bytes + alen > l3->o.capacity_bytes) {
        rc = TKV_EFULL;
        goto out;
    }
    l3_seg *s = l3->cur_id ? l3->segs[l3->cur_id] : NULL;
    if (!s || (s->end > 0 && s->end + alen > l3->o.segment_bytes)) {
        rc = seg_create(l3, &s);
        if (rc != TKV_OK)
            goto out;
        l3->cur_id = s->id;
    }
    *off = s->end;
    s->end += alen;
    seg_prealloc(l3, s);
    l3->disk_bytes += alen;
    s->refs++;
    s->pending++;
    *out = s;
out:
    pthread_mutex_unlock(&l3->seg_mu);
    return rc;
}

static void seg_unref_locked(tkv_l3 *l3, l3_seg *s)
{
    TKV_ASSERT(s->refs > 0);
    if (--s->refs == 0 && s->doomed)
        seg_destroy(l3, s);
}

static void seg_release_write(tkv_l3 *l3, l3_seg *s)
{
    pthread_mutex_lock(&l3->seg_mu);
    TKV_ASSERT(s->pending > 0);
    s->pending--;
    seg_unref_locked(l3, s);
    pthread_mutex_unlock(&l3->seg_mu);
}

/* A reader's reference; NULL when the segment is gone or being deleted. */
static l3_seg *seg_ref(tkv_l3 *l3, uint32_t id)
{
    l3_seg *s = NULL;
    pthread_mutex_lock(&l3->seg_mu);
    if (id < l3->segs_cap && l3->segs[id] && !l3->segs[id]->doomed) {
        s = l3->segs[id];
        s->refs++;
    }
    pthread_mutex_unlock(&l3->seg_mu);
    return s;
}

static void seg_unref(tkv_l3 *l3, l3_seg *s)
{
    pthread_mutex_lock(&l3->seg_mu);
    seg_unref_locked(l3, s);
    pthread_mutex_unlock(&l3->seg_mu);
}

static void seg_account(tkv_l3 *l3, uint32_t id, int64_t delta)
{
    pthread_mutex_lock(&l3->seg_mu);
    l3_seg *s = id < l3->segs_cap ? l3->segs[id] : NULL;
    if (s) {
        s->live += (uint64_t)delta;
        /* a delete pushed the segment over the threshold: wake the compactor */
        if (delta < 0 && l3->has_compactor && !s->compacting && !s->doomed && s->end > 0 &&
            (double)(s->end - (s->live < s->end ? s->live : s->end)) >=
                l3->o.dead_fraction * (double)s->end) {
            l3->compact_kick = 1;
            pthread_cond_signal(&l3->compact_cv);
        }
    }
    pthread_mutex_unlock(&l3->seg_mu);
}

/* Finds a key's record and takes a reference on its segment, retrying when a compaction
 * moved the block between the lookup and the reference. */
static int lookup_ref(tkv_l3 *l3, const tkv_key *key, l3_rec *r, l3_seg **seg)
{
    for (int attempt = 0; attempt < L3_LOOKUP_RETRIES; attempt++) {
        char *v = NULL;
        int rc = idx_get(l3, key, &v, r);
        if (rc != TKV_OK)
            return rc;
        rocksdb_free(v);
        r->tokens = NULL;
        *seg = seg_ref(l3, r->seg);
        if (*seg)
            return TKV_OK;
    }
    TKV_LOG(TKV_LOG_ERROR, "l3 %s: record points at a missing segment", l3->dir);
    return TKV_ECORRUPT;
}

/* ==== I/O contexts ========================================================================= */

static void ctx_free(l3_ctx *c)
{
    if (!c)
        return;
    if (c->has_ring) {
        if (c->fixed)
            io_uring_unregister_buffers(&c->ring);
        io_uring_queue_exit(&c->ring);
    }
    for (unsigned i = 0; i < c->nbuf; i++)
        free(c->bufs[i]);
    free(c->bufs);
    free(c->free_bufs);
    free(c->slots);
    free(c->free_slots);
    ZSTD_freeCCtx(c->cctx);
    ZSTD_freeDCtx(c->dctx);
    free(c);
}

/* Returns NULL only when an io_uring ring was asked for and the kernel refused it. */
static l3_ctx *ctx_new(tkv_l3 *l3, int uring, int *err)
{
    l3_ctx *c = tkv_xcalloc(1, sizeof(*c));
    c->qd = l3->o.queue_depth;
    size_t nbuf = L3_CTX_BUF_BUDGET / l3->buf_bytes;
    if (nbuf < 2)
        nbuf = 2;
    if (nbuf > c->qd)
        nbuf = c->qd;
    c->nbuf = (unsigned)nbuf;
    c->bufs = tkv_xcalloc(nbuf, sizeof(*c->bufs));
    c->free_bufs = tkv_xcalloc(nbuf, sizeof(*c->free_bufs));
    for (unsigned i = 0; i < c->nbuf; i++) {
        c->bufs[i] = xaligned(4096, l3->buf_bytes);
        c->free_bufs[i] = i;
    }
    c->num_free_bufs = c->nbuf;
    c->slots = tkv_xcalloc(c->qd, sizeof(*c->slots));
    c->free_slots = tkv_xcalloc(c->qd, sizeof(*c->free_slots));
    c->cctx = ZSTD_createCCtx();
    c->dctx = ZSTD_createDCtx();
    if (!c->cctx || !c->dctx) {
        fprintf(stderr, "tierkv: out of memory creating zstd contexts\n");
        abort();
    }
    if (uring) {
        int rc = io_uring_queue_init(c->qd, &c->ring, 0);
        if (rc < 0) {
            *err = -rc;
            ctx_free(c);
            return NULL;
        }
        c->has_ring = 1;
        /* Registered buffers save the per-I/O page pinning; a kernel that refuses them
         * (RLIMIT_MEMLOCK) still gets plain reads and writes. */
        struct iovec *iov = tkv_xcalloc(c->nbuf, sizeof(*iov));
        for (unsigned i = 0; i < c->nbuf; i++) {
            iov[i].iov_base = c->bufs[i];
            iov[i].iov_len = l3->buf_bytes;
        }
        c->fixed = io_uring_register_buffers(&c->ring, iov, c->nbuf) == 0;
        free(iov);
    }
    return c;
}

static l3_ctx *ctx_get(tkv_l3 *l3)
{
    l3_ctx *c = NULL;
    int create = 0;
    pthread_mutex_lock(&l3->ctx_mu);
    for (;;) {
        if (l3->free_ctx) {
            c = l3->free_ctx;
            l3->free_ctx = c->next_free;
            break;
        }
        if (l3->num_ctx < L3_MAX_CTX) {
            l3->num_ctx++;
            create = 1;
            break;
        }
        pthread_cond_wait(&l3->ctx_cv, &l3->ctx_mu);
    }
    pthread_mutex_unlock(&l3->ctx_mu);
    if (create) {
        int err = 0;
        c = ctx_new(l3, l3->io_mode == TKV_IO_URING, &err);
        if (!c) {
            /* The kernel accepted a ring at open but refuses one now (e.g. ring memory
             * accounting): this context does synchronous I/O instead. */
            TKV_LOG(TKV_LOG_WARN, "l3 %s: io_uring ring refused (%s); using pread/pwrite",
                    l3->dir, strerror(err));
            c = ctx_new(l3, 0, &err);
        }
    }
    return c;
}

static void ctx_put(tkv_l3 *l3, l3_ctx *c)
{
    pthread_mutex_lock(&l3->ctx_mu);
    c->next_free = l3->free_ctx;
    l3->free_ctx = c;
    pthread_cond_signal(&l3->ctx_cv);
    pthread_mutex_unlock(&l3->ctx_mu);
}

static int ctx_buf_get(l3_ctx *c)
{
    if (c->num_free_bufs == 0)
        return -1;
    return (int)c->free_bufs[--c->num_free_bufs];
}

static void ctx_buf_put(l3_ctx *c, int i)
{
    if (i >= 0)
        c->free_bufs[c->num_free_bufs++] = (unsigned)i;
}

/* ==== the I/O engine ======================================================================= */

/* Test hook: a write that would cross the injected budget fails as the OS would fail it. */
static int inject_check(tkv_l3 *l3, size_t len)
{
    int err = ATOMIC_LOAD(&l3->inject_err);
    if (!err)
        return 0;
    uint64_t left = ATOMIC_LOAD(&l3->inject_left);
    for (;;) {
        if (left < len)
            return err;
        if (__atomic_compare_exchange_n(&l3->inject_left, &left, left - len, 0,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED))
            return 0;
    }
}

static void op_psync(l3_op *op)
{
    while (op->done < op->len) {
        char *p = (char *)op->buf + op->done;
        size_t n = op->len - op->done;
        off_t off = (off_t)(op->off + op->done);
        ssize_t r = op->write ? pwrite(op->fd, p, n, off) : pread(op->fd, p, n, off);
        if (r < 0) {
            if (errno == EINTR || errno == EAGAIN)
                continue;
            op->res = -errno;
            return;
        }
        if (r == 0) {
            op->res = (!op->write && op->done >= op->min_len) ? 0 : -EIO;
            return;
        }
        op->done += (size_t)r;
    }
    op->res = 0;
}

static void finish_op(l3_job *j, size_t item, l3_op *op)
{
    j->fin(j, item, op);
    ctx_buf_put(j->ctx, op->buf_index);
    op->buf_index = -1;
}

static void op_init(l3_op *op)
{
    memset(op, 0, sizeof(*op));
    op->buf_index = -1;
}

static void run_psync(l3_job *j)
{
    l3_op op;
    for (size_t i = 0; i < j->n; i++) {
        op_init(&op);
        int r = j->prep(j, i, &op);
        TKV_ASSERT(r != L3_PREP_NEEDBUF); /* one op at a time: a buffer is always free */
        if (r == L3_PREP_SKIP)
            continue;
        int err = op.write ? inject_check(j->l3, op.len) : 0;
        if (err)
            op.res = -err;
        else
            op_psync(&op);
        finish_op(j, i, &op);
    }
}

static void uring_submit_op(l3_ctx *c, unsigned s)
{
    l3_op *op = &c->slots[s].op;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&c->ring);
    if (!sqe) {
        io_uring_submit(&c->ring);
        sqe = io_uring_get_sqe(&c->ring);
        TKV_ASSERT(sqe != NULL);
    }
    char *p = (char *)op->buf + op->done;
    unsigned n = (unsigned)(op->len - op->done);
    uint64_t off = op->off + op->done;
    if (op->buf_index >= 0 && c->fixed) {
        if (op->write)
            io_uring_prep_write_fixed(sqe, op->fd, p, n, off, op->buf_index);
        else
            io_uring_prep_read_fixed(sqe, op->fd, p, n, off, op->buf_index);
    } else {
        if (op->write)
            io_uring_prep_write(sqe, op->fd, p, n, off);
        else
            io_uring_prep_read(sqe, op->fd, p, n, off);
    }
    io_uring_sqe_set_data(sqe, (void *)(uintptr_t)s);
}

#define L3_SYNC_TAG (1ull << 63) /* user_data of a sync: tag | L3_SYNC_TAG */

/* Queues an fdatasync of fd on the job's ring; it is submitted with the next batch of
 * SQEs. Only data whose writes completed before the call is covered, as with fdatasync(2). */
static void job_sync(l3_job *j, int fd, uint64_t tag)
{
    l3_ctx *c = j->ctx;
    struct io_uring_sqe *sqe = io_uring_get_sqe(&c->ring);
    if (!sqe) {
        io_uring_submit(&c->ring);
        sqe = io_uring_get_sqe(&c->ring);
        TKV_ASSERT(sqe != NULL);
    }
    io_uring_prep_fsync(sqe, fd, IORING_FSYNC_DATASYNC);
    io_uring_sqe_set_data(sqe, (void *)(uintptr_t)(tag | L3_SYNC_TAG));
    j->num_syncs++;
}

static void run_uring(l3_job *j)
{
    l3_ctx *c = j->ctx;
    unsigned num_free = c->qd, inflight = 0;
    for (unsigned i = 0; i < c->qd; i++)
        c->free_slots[i] = i;
    size_t next = 0;
    while (next < j->n || inflight > 0 || j->num_syncs > 0) {
        while (next < j->n && num_free > 0) {
            unsigned s = c->free_slots[num_free - 1];
            l3_op *op = &c->slots[s].op;
            op_init(op);
            int r = j->prep(j, next, op);
            if (r == L3_PREP_NEEDBUF) {
                TKV_ASSERT(inflight > 0);
                break;
            }
            if (r == L3_PREP_SKIP) {
                next++;
                continue;
            }
            num_free--;
            c->slots[s].item = next++;
            int err = op->write ? inject_check(j->l3, op->len) : 0;
            if (err) {
                op->res = -err;
                finish_op(j, c->slots[s].item, op);
                c->free_slots[num_free++] = s;
                continue;
            }
            uring_submit_op(c, s);
            inflight++;
        }
        if (inflight == 0 && j->num_syncs == 0)
            continue;
        int rc = io_uring_submit(&c->ring);
        if (rc < 0 && rc != -EINTR && rc != -EAGAIN && rc != -EBUSY)
            TKV_LOG(TKV_LOG_WARN, "l3: io_uring_submit: %s", strerror(-rc));
        struct io_uring_cqe *cqe = NULL;
        rc = io_uring_wait_cqe(&c->ring, &cqe);
        if (rc < 0) {
            if (rc == -EINTR || rc == -EAGAIN)
                continue;
            /* The ring itself failed: nothing can complete; fail everything in flight. */
            TKV_LOG(TKV_LOG_ERROR, "l3: io_uring_wait_cqe: %s", strerror(-rc));
            TKV_ASSERT(!"io_uring ring failed with I/O in flight");
        }
        while (cqe) {
            uint64_t data = (uint64_t)(uintptr_t)io_uring_cqe_get_data(cqe);
            int res = cqe->res;
            io_uring_cqe_seen(&c->ring, cqe);
            if (data & L3_SYNC_TAG) {
                j->num_syncs--;
                j->sync_done(j, data & ~L3_SYNC_TAG, res);
                cqe = NULL;
                if (io_uring_peek_cqe(&c->ring, &cqe) != 0)
                    cqe = NULL;
                continue;
            }
            unsigned s = (unsigned)data;
            TKV_ASSERT(s < c->qd);
            l3_op *op = &c->slots[s].op;
            int complete = 1;
            if (res == -EAGAIN || res == -EINTR) {
                uring_submit_op(c, s);
                complete = 0;
            } else if (res < 0) {
                op->res = res;
            } else if (res == 0) {
                op->res = (!op->write && op->done >= op->min_len) ? 0 : -EIO;
            } else {
                op->done += (size_t)res;
                if (op->done < op->len) {
                    uring_submit_op(c, s); /* short transfer: ask for the rest */
                    complete = 0;
                } else {
                    op->res = 0;
                }
            }
            if (complete) {
                finish_op(j, c->slots[s].item, op);
                c->free_slots[num_free++] = s;
                inflight--;
            }
            cqe = NULL;
            if (io_uring_peek_cqe(&c->ring, &cqe) != 0)
                cqe = NULL;
        }
    }
}

static void run_job(l3_job *j)
{
    if (j->ctx->has_ring)
        run_uring(j);
    else
        run_psync(j);
}

/* ==== writing ============================================================================== */

typedef struct w_item {
    /* input: either a raw payload to encode, or an already-encoded aligned buffer */
    const void *payload;
    size_t len;
    const void *stored;       /* pre-encoded (compaction): codec/csum/stored_len given; may
                               * exceed the capacity for a moment: it frees more than it uses */
    /* result */
    uint8_t codec;
    uint64_t stored_len, alen, csum;
    l3_seg *seg;
    uint64_t off;
    int status;
    int synced;               /* covered by a completed group fdatasync */
} w_item;

/* Group syncs: with io_uring, the items are cut into groups of queue-depth writes, and a
 * group's fdatasync is issued as soon as its last write completes, while the next group's
 * writes are in flight, the way fio's --fdatasync overlaps. Without it, every batch would
 * wait for its sync with the disk idle. */
typedef struct w_sync {
    l3_seg *seg;
    size_t group;
} w_sync;

typedef struct w_state {
    size_t group_size;
    uint32_t *outstanding;    /* per group: items not finished yet */
    w_sync *syncs;
    size_t num_syncs;
} w_state;

static void w_group_step(l3_job *j, size_t i)
{
    w_state *ws = j->state;
    if (!ws)
        return;
    size_t g = i / ws->group_size;
    TKV_ASSERT(ws->outstanding[g] > 0);
    if (--ws->outstanding[g] > 0)
        return;
    w_item *items = j->items;
    size_t end = (g + 1) * ws->group_size < j->n ? (g + 1) * ws->group_size : j->n;
    for (size_t k = g * ws->group_size; k < end; k++) {
        if (items[k].status != L3_PENDING || !items[k].seg)
            continue;
        int seen = 0;
        for (size_t m = g * ws->group_size; m < k && !seen; m++)
            seen = items[m].status == L3_PENDING && items[m].seg == items[k].seg;
        if (seen)
            continue;
        ws->syncs[ws->num_syncs] = (w_sync){items[k].seg, g};
        job_sync(j, items[k].seg->fd, ws->num_syncs++);
    }
}

static void w_sync_done(l3_job *j, uint64_t tag, int res)
{
    w_state *ws = j->state;
    w_sync *sy = &ws->syncs[tag];
    w_item *items = j->items;
    size_t end = (sy->group + 1) * ws->group_size < j->n ? (sy->group + 1) * ws->group_size
                                                         : j->n;
    if (res < 0) {
        ATOMIC_ADD(&j->l3->io_errors, 1);
        set_readonly(j->l3, "segment sync", -res);
    }
    for (size_t k = sy->group * ws->group_size; k < end; k++) {
        if (items[k].seg != sy->seg || items[k].status != L3_PENDING)
            continue;
        if (res < 0)
            items[k].status = errno_to_tkv(-res);
        else
            items[k].synced = 1;
    }
}

static int w_prep(l3_job *j, size_t i, l3_op *op)
{
    tkv_l3 *l3 = j->l3;
    l3_ctx *c = j->ctx;
    w_item *it = (w_item *)j->items + i;
    if (it->status != L3_PENDING) {
        w_group_step(j, i);
        return L3_PREP_SKIP;
    }
    void *buf = NULL;
    int bi = -1;
    if (it->stored) {
        buf = (void *)it->stored;
    } else if (l3->o.zstd_level == 0 && ((uintptr_t)it->payload % l3->mem_align) == 0 &&
               it->len % l3->align == 0) {
        /* raw and already aligned: write straight from the caller's buffer */
        buf = (void *)it->payload;
        it->codec = L3_CODEC_RAW;
        it->stored_len = it->len;
    } else {
        bi = ctx_buf_get(c);
        if (bi < 0)
            return L3_PREP_NEEDBUF;
        buf = c->bufs[bi];
        size_t z = 0;
        if (l3->o.zstd_level > 0) {
            z = ZSTD_compressCCtx(c->cctx, buf, l3->buf_bytes, it->payload, it->len,
                                  l3->o.zstd_level);
            if (ZSTD_isError(z))
                z = 0;
        }
        if (z > 0 && z < it->len) {
            it->codec = L3_CODEC_ZSTD;
            it->stored_len = z;
        } else { /* does not shrink: store raw */
            memcpy(buf, it->payload, it->len);
            it->codec = L3_CODEC_RAW;
            it->stored_len = it->len;
        }
    }
    it->alen = round_up(it->stored_len, l3->align);
    if (buf != it->payload && buf != it->stored && it->alen > it->stored_len)
        memset((char *)buf + it->stored_len, 0, it->alen - it->stored_len);
    if (!it->stored)
        it->csum = tkv_csum64(buf, it->stored_len);
    int rc = seg_reserve(l3, it->alen, it->stored != NULL, &it->seg, &it->off);
    if (rc != TKV_OK) {
        it->status = rc;
        ctx_buf_put(c, bi);
        w_group_step(j, i);
        return L3_PREP_SKIP;
    }
    op->fd = it->seg->fd;
    op->write = 1;
    op->buf = buf;
    op->buf_index = bi;
    op->len = it->alen;
    op->min_len = it->alen;
    op->off = it->off;
    return L3_PREP_SUBMIT;
}

static void w_fin(l3_job *j, size_t i, l3_op *op)
{
    w_item *it = (w_item *)j->items + i;
    if (op->res < 0) {
        int e = -op->res;
        it->status = errno_to_tkv(e);
        ATOMIC_ADD(&j->l3->io_errors, 1);
        set_readonly(j->l3, "segment write", e);
    }
    w_group_step(j, i);
}

/* Writes the pending items' payloads and makes them durable (fdatasync of every segment
 * written). Items that fail get their status; the caller commits the rest and then releases
 * every item's segment (w_release). */
static void w_write(tkv_l3 *l3, w_item *items, size_t n)
{
    l3_ctx *c = ctx_get(l3);
    l3_job j = {.l3 = l3, .ctx = c, .n = n, .prep = w_prep, .fin = w_fin, .items = items,
                .sync_done = w_sync_done};
    w_state ws = {0};
    if (c->has_ring) {
        ws.group_size = c->qd;
        size_t num_groups = (n + ws.group_size - 1) / ws.group_size;
        ws.outstanding = tkv_xcalloc(num_groups, sizeof(*ws.outstanding));
        for (size_t g = 0; g < num_groups; g++)
            ws.outstanding[g] = (uint32_t)((g + 1) * ws.group_size <= n ? ws.group_size
                                                                         : n - g * ws.group_size);
        ws.syncs = tkv_xcalloc(n, sizeof(*ws.syncs));
        j.state = &ws;
    }
    run_job(&j);
    ctx_put(l3, c);
    free(ws.outstanding);
    free(ws.syncs);

    /* pread/pwrite path: fdatasync each segment once (a batch spans one or two). */
    for (size_t i = 0; i < n; i++) {
        if (!items[i].seg || items[i].status != L3_PENDING || items[i].synced)
            continue;
        int seen = 0;
        for (size_t k = 0; k < i && !seen; k++)
            seen = items[k].seg == items[i].seg && items[k].status == L3_PENDING &&
                   !items[k].synced;
        if (seen)
            continue;
        if (fdatasync(items[i].seg->fd) != 0) {
            int e = errno;
            ATOMIC_ADD(&l3->io_errors, 1);
            set_readonly(l3, "segment sync", e);
            for (size_t k = i; k < n; k++)
                if (items[k].seg == items[i].seg && items[k].status == L3_PENDING)
                    items[k].status = errno_to_tkv(e);
        }
    }
}

static void w_release(tkv_l3 *l3, w_item *items, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (items[i].seg)
            seg_release_write(l3, items[i].seg);
}

int tkv_l3_put_batch(tkv_l3 *l3, tkv_l3_put_req *reqs, size_t n)
{
    if (!l3 || (n && !reqs))
        return TKV_EINVAL;
    if (n == 0)
        return TKV_OK;
    w_item *items = tkv_xcalloc(n, sizeof(*items));
    int ro = ATOMIC_LOAD(&l3->readonly);
    size_t num_pending = 0;
    for (size_t i = 0; i < n; i++) {
        tkv_l3_put_req *q = &reqs[i];
        w_item *it = &items[i];
        it->payload = q->payload;
        it->len = q->len;
        it->status = L3_PENDING;
        if (!q->payload || q->len == 0 || q->len > l3->o.max_block_bytes ||
            q->num_tokens > L3_MAX_TOKENS || (q->num_tokens && !q->tokens)) {
            it->status = TKV_EINVAL;
        } else if (ro) {
            it->status = TKV_EREADONLY;
        } else if (idx_exists(l3, &q->key)) {
            it->status = TKV_EEXIST;
        } else {
            for (size_t k = 0; k < i; k++)
                if (items[k].status == L3_PENDING &&
                    memcmp(reqs[k].key.b, q->key.b, TKV_KEY_BYTES) == 0) {
                    it->status = TKV_EEXIST; /* the same key twice in one batch */
                    break;
                }
        }
        num_pending += it->status == L3_PENDING;
    }
    if (num_pending)
        w_write(l3, items, n);

    /* Commit the durable payloads. Re-check existence under idx_mu: another batch may have
     * committed the same key meanwhile (its copy wins; ours becomes dead space). */
    pthread_mutex_lock(&l3->idx_mu);
    rocksdb_writebatch_t *wb = rocksdb_writebatch_create();
    size_t num_commit = 0;
    for (size_t i = 0; i < n; i++) {
        w_item *it = &items[i];
        if (it->status != L3_PENDING)
            continue;
        if (idx_exists(l3, &reqs[i].key)) {
            it->status = TKV_EEXIST;
            continue;
        }
        l3_rec r = {.codec = it->codec, .seg = it->seg->id, .off = it->off,
                    .stored_len = it->stored_len, .raw_len = it->len, .csum = it->csum,
                    .parent = reqs[i].parent, .num_tokens = reqs[i].num_tokens,
                    .tenant_tag = reqs[i].tenant_tag};
        size_t vlen;
        uint8_t *v = rec_encode(l3, &r, reqs[i].tokens, &vlen);
        char k[L3_KEY_LEN];
        idx_key(&reqs[i].key, k);
        rocksdb_writebatch_put(wb, k, sizeof(k), (const char *)v, vlen);
        free(v);
        num_commit++;
    }
    int crc = num_commit ? idx_commit(l3, wb) : TKV_OK;
    rocksdb_writebatch_destroy(wb);
    for (size_t i = 0; i < n; i++) {
        w_item *it = &items[i];
        if (it->status != L3_PENDING)
            continue;
        if (crc != TKV_OK) {
            it->status = crc;
            continue;
        }
        it->status = TKV_OK;
        seg_account(l3, it->seg->id, (int64_t)it->alen);
        ATOMIC_ADD(&l3->num_blocks, 1);
        ATOMIC_ADD(&l3->raw_bytes, it->len);
        ATOMIC_ADD(&l3->stored_bytes, it->stored_len);
        ATOMIC_ADD(&l3->writes, 1);
        ATOMIC_ADD(&l3->write_bytes, it->len);
    }
    pthread_mutex_unlock(&l3->idx_mu);
    w_release(l3, items, n);

    int first = TKV_OK;
    for (size_t i = 0; i < n; i++) {
        reqs[i].status = items[i].status;
        if (first == TKV_OK && items[i].status != TKV_OK && items[i].status != TKV_EEXIST)
            first = items[i].status;
    }
    free(items);
    return first;
}

/* ==== reading ============================================================================== */

typedef struct r_item {
    tkv_key key;
    l3_rec rec;
    l3_seg *seg;
    void *dst;
    size_t cap;
    int stored_only;          /* verify/compaction: keep the stored bytes, do not decode */
    size_t len;
    int status;
    int drop;                 /* checksum failed: remove the record */
} r_item;

static int r_prep(l3_job *j, size_t i, l3_op *op)
{
    tkv_l3 *l3 = j->l3;
    r_item *it = (r_item *)j->items + i;
    if (it->status != L3_PENDING)
        return L3_PREP_SKIP;
    uint64_t alen = round_up(it->rec.stored_len, l3->align);
    int bi = -1;
    void *buf;
    if ((it->stored_only || it->rec.codec == L3_CODEC_RAW) && it->cap >= alen &&
        ((uintptr_t)it->dst % l3->mem_align) == 0) {
        buf = it->dst; /* read straight into the caller's buffer */
    } else {
        bi = ctx_buf_get(j->ctx);
        if (bi < 0)
            return L3_PREP_NEEDBUF;
        buf = j->ctx->bufs[bi];
    }
    op->fd = it->seg->fd;
    op->buf = buf;
    op->buf_index = bi;
    op->len = alen;
    op->min_len = it->rec.stored_len;
    op->off = it->rec.off;
    return L3_PREP_SUBMIT;
}

static void r_fin(l3_job *j, size_t i, l3_op *op)
{
    tkv_l3 *l3 = j->l3;
    r_item *it = (r_item *)j->items + i;
    if (op->res < 0) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: read of segment %08x at %llu: %s", l3->dir,
                it->rec.seg, (unsigned long long)it->rec.off, strerror(-op->res));
        ATOMIC_ADD(&l3->io_errors, 1);
        it->status = TKV_EIO;
        return;
    }
    if (tkv_csum64(op->buf, it->rec.stored_len) != it->rec.csum) {
        char hex[2 * TKV_KEY_BYTES + 1];
        key_hex(&it->key, hex);
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: checksum mismatch for block %s; dropping it", l3->dir,
                hex);
        ATOMIC_ADD(&l3->checksum_failures, 1);
        it->status = TKV_ECHECKSUM;
        it->drop = 1;
        if (op->buf == it->dst)
            memset(it->dst, 0, op->len); /* never leave wrong KV in the caller's buffer */
        return;
    }
    if (it->stored_only) {
        it->len = it->rec.stored_len;
    } else if (it->rec.codec == L3_CODEC_RAW) {
        if (op->buf != it->dst)
            memcpy(it->dst, op->buf, it->rec.raw_len);
        it->len = it->rec.raw_len;
    } else {
        size_t z = ZSTD_decompressDCtx(j->ctx->dctx, it->dst, it->cap, op->buf,
                                       it->rec.stored_len);
        if (ZSTD_isError(z) || z != it->rec.raw_len) {
            TKV_LOG(TKV_LOG_ERROR, "l3 %s: zstd frame does not decode (%s)", l3->dir,
                    ZSTD_isError(z) ? ZSTD_getErrorName(z) : "length mismatch");
            memset(it->dst, 0, it->cap < it->rec.raw_len ? it->cap : it->rec.raw_len);
            it->status = TKV_ECORRUPT;
            it->drop = 1;
            return;
        }
        it->len = z;
    }
    it->status = TKV_OK;
    ATOMIC_ADD(&l3->reads, 1);
    ATOMIC_ADD(&l3->read_bytes, it->rec.raw_len);
}

/* Removes a record if it still points where the bad copy was read from. */
static void drop_record(tkv_l3 *l3, const tkv_key *key, const l3_rec *bad)
{
    pthread_mutex_lock(&l3->idx_mu);
    char *v = NULL;
    l3_rec cur;
    if (idx_get(l3, key, &v, &cur) == TKV_OK) {
        if (cur.seg == bad->seg && cur.off == bad->off) {
            char k[L3_KEY_LEN];
            idx_key(key, k);
            rocksdb_writebatch_t *wb = rocksdb_writebatch_create();
            rocksdb_writebatch_delete(wb, k, sizeof(k));
            if (idx_commit(l3, wb) == TKV_OK) {
                seg_account(l3, cur.seg, -(int64_t)round_up(cur.stored_len, l3->align));
                ATOMIC_SUB(&l3->num_blocks, 1);
                ATOMIC_SUB(&l3->raw_bytes, cur.raw_len);
                ATOMIC_SUB(&l3->stored_bytes, cur.stored_len);
            }
            rocksdb_writebatch_destroy(wb);
        }
        rocksdb_free(v);
    }
    pthread_mutex_unlock(&l3->idx_mu);
}

/* Runs the reads of items whose status is L3_PENDING and whose seg reference is held, then
 * drops the records that failed their checksum and releases the references. */
static void r_run(tkv_l3 *l3, r_item *items, size_t n)
{
    l3_ctx *c = ctx_get(l3);
    l3_job j = {.l3 = l3, .ctx = c, .n = n, .prep = r_prep, .fin = r_fin, .items = items};
    run_job(&j);
    ctx_put(l3, c);
    for (size_t i = 0; i < n; i++) {
        if (items[i].seg) {
            seg_unref(l3, items[i].seg);
            items[i].seg = NULL;
        }
        if (items[i].drop)
            drop_record(l3, &items[i].key, &items[i].rec);
    }
}

int tkv_l3_get_batch(tkv_l3 *l3, tkv_l3_get_req *reqs, size_t n)
{
    if (!l3 || (n && !reqs))
        return TKV_EINVAL;
    if (n == 0)
        return TKV_OK;
    r_item *items = tkv_xcalloc(n, sizeof(*items));
    for (size_t i = 0; i < n; i++) {
        r_item *it = &items[i];
        it->key = reqs[i].key;
        it->dst = reqs[i].dst;
        it->cap = reqs[i].cap;
        it->status = L3_PENDING;
        reqs[i].len = 0;
        if (!reqs[i].dst && reqs[i].cap) {
            it->status = TKV_EINVAL;
            continue;
        }
        int rc = lookup_ref(l3, &it->key, &it->rec, &it->seg);
        if (rc != TKV_OK) {
            it->status = rc;
        } else if (it->cap < it->rec.raw_len) {
            it->status = TKV_EINVAL; /* len tells the caller what it needs */
            it->len = it->rec.raw_len;
            seg_unref(l3, it->seg);
            it->seg = NULL;
        }
    }
    r_run(l3, items, n);
    int first = TKV_OK;
    for (size_t i = 0; i < n; i++) {
        reqs[i].status = items[i].status;
        reqs[i].len = items[i].len;
        if (first == TKV_OK && items[i].status != TKV_OK)
            first = items[i].status;
    }
    free(items);
    return first;
}

/* ==== delete, scan, locate ================================================================= */

int tkv_l3_delete(tkv_l3 *l3, const tkv_key *keys, size_t n)
{
    if (!l3 || (n && !keys))
        return TKV_EINVAL;
    if (n == 0)
        return TKV_OK;
    if (ATOMIC_LOAD(&l3->readonly))
        return TKV_EREADONLY;
    int rc = TKV_OK;
    pthread_mutex_lock(&l3->idx_mu);
    rocksdb_writebatch_t *wb = rocksdb_writebatch_create();
    l3_rec *recs = tkv_xcalloc(n, sizeof(*recs));
    uint8_t *found = tkv_xcalloc(n, 1);
    for (size_t i = 0; i < n; i++) {
        char *v = NULL;
        int g = idx_get(l3, &keys[i], &v, &recs[i]);
        if (g == TKV_ENOTFOUND)
            continue;
        if (g == TKV_EIO) {
            rc = g;
            goto out;
        }
        int dup = 0;
        for (size_t k = 0; k < i && !dup; k++)
            dup = found[k] && memcmp(keys[k].b, keys[i].b, TKV_KEY_BYTES) == 0;
        if (v)
            rocksdb_free(v);
        if (dup)
            continue;
        found[i] = g == TKV_OK; /* a corrupt record is deleted but not accounted */
        char k[L3_KEY_LEN];
        idx_key(&keys[i], k);
        rocksdb_writebatch_delete(wb, k, sizeof(k));
    }
    rc = idx_commit(l3, wb);
    if (rc != TKV_OK)
        goto out;
    for (size_t i = 0; i < n; i++) {
        if (!found[i])
            continue;
        seg_account(l3, recs[i].seg, -(int64_t)round_up(recs[i].stored_len, l3->align));
        ATOMIC_SUB(&l3->num_blocks, 1);
        ATOMIC_SUB(&l3->raw_bytes, recs[i].raw_len);
        ATOMIC_SUB(&l3->stored_bytes, recs[i].stored_len);
    }
out:
    rocksdb_writebatch_destroy(wb);
    free(recs);
    free(found);
    pthread_mutex_unlock(&l3->idx_mu);
    return rc;
}

typedef int (*idx_cb)(void *arg, const tkv_key *key, const uint8_t *v, size_t vlen,
                      int parse_rc, const l3_rec *r);

/* One index entry as a scan sees it: -1 when the key ends the block records, 0 when it is
 * skipped (not a block key), else cb's result (nonzero stops the scan). */
static int idx_entry(const tkv_l3 *l3, const char *k, size_t klen, const uint8_t *v,
                     size_t vlen, idx_cb cb, void *arg)
{
    if (klen < 1 || k[0] != 'k')
        return -1;
    if (klen != L3_KEY_LEN)
        return 0;
    tkv_key key;
    memcpy(key.b, k + 1, TKV_KEY_BYTES);
    l3_rec r;
    int prc = rec_parse(l3, v, vlen, &r);
    return cb(arg, &key, v, vlen, prc, &r) ? 1 : 0;
}

/* Iterates the block records in key order; cb gets the key, the raw value and its parse
 * status. Stops when cb returns nonzero (returns 1). */
static int idx_iterate(tkv_l3 *l3, idx_cb cb, void *arg)
{
    rocksdb_iterator_t *itr = rocksdb_create_iterator(l3->db, l3->ro);
    int stop = 0;
    rocksdb_iter_seek(itr, "k", 1);
    for (; rocksdb_iter_valid(itr); rocksdb_iter_next(itr)) {
        size_t klen, vlen;
        const char *k = rocksdb_iter_key(itr, &klen);
        const uint8_t *v = (const uint8_t *)rocksdb_iter_value(itr, &vlen);
        int e = idx_entry(l3, k, klen, v, vlen, cb, arg);
        if (e < 0)
            break;
        if (e > 0) {
            stop = 1;
            break;
        }
    }
    char *err = NULL;
    rocksdb_iter_get_error(itr, &err);
    rocksdb_iter_destroy(itr);
    if (err) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: index scan: %s", l3->dir, err);
        rocksdb_free(err);
        return TKV_EIO;
    }
    return stop;
}

struct scan_arg {
    int (*cb)(void *arg, const tkv_l3_info *info);
    void *arg;
};

static int scan_one(void *arg, const tkv_key *key, const uint8_t *v, size_t vlen, int prc,
                    const l3_rec *r)
{
    struct scan_arg *a = arg;
    if (prc != TKV_OK)
        return 0;
    tkv_l3_info info = {.key = *key, .parent = r->parent, .num_tokens = r->num_tokens,
                        .raw_bytes = r->raw_len, .stored_bytes = r->stored_len,
                        .tenant_tag = r->tenant_tag};
    return a->cb(a->arg, &info) ? 1 : 0;
}

int tkv_l3_scan(tkv_l3 *l3, int (*cb)(void *arg, const tkv_l3_info *info), void *arg)
{
    if (!l3 || !cb)
        return TKV_EINVAL;
    struct scan_arg a = {cb, arg};
    int rc = idx_iterate(l3, scan_one, &a);
    return rc < 0 ? rc : TKV_OK;
}

int tkv_l3_locate(tkv_l3 *l3, const tkv_key *key, char *path, size_t path_len,
                  uint64_t *offset, uint64_t *stored_len)
{
    if (!l3 || !key)
        return TKV_EINVAL;
    char *v = NULL;
    l3_rec r;
    int rc = idx_get(l3, key, &v, &r);
    if (rc != TKV_OK)
        return rc;
    rocksdb_free(v);
    if (path && path_len)
        seg_path(l3, r.seg, path, path_len);
    if (offset)
        *offset = r.off;
    if (stored_len)
        *stored_len = r.stored_len;
    return TKV_OK;
}

void tkv_l3_inject_write_error(tkv_l3 *l3, int err, uint64_t after_bytes)
{
    __atomic_store_n(&l3->inject_left, after_bytes, __ATOMIC_RELAXED);
    __atomic_store_n(&l3->inject_err, err, __ATOMIC_SEQ_CST);
}

/* ==== verify =============================================================================== */

typedef struct key_list {
    tkv_key *keys;
    size_t n, cap;
} key_list;

static int collect_key(void *arg, const tkv_key *key, const uint8_t *v, size_t vlen, int prc,
                       const l3_rec *r)
{
    key_list *kl = arg;
    if (kl->n == kl->cap) {
        kl->cap = kl->cap ? kl->cap * 2 : 256;
        kl->keys = tkv_xrealloc(kl->keys, kl->cap * sizeof(*kl->keys));
    }
    kl->keys[kl->n++] = *key;
    return 0;
}

/* Reads each listed key's stored bytes into scratch buffers and checks them; the checksum
 * failures are dropped by r_run. Used by verify. */
static void verify_chunk(tkv_l3 *l3, const tkv_key *keys, size_t n, uint64_t *checked,
                         uint64_t *bad)
{
    r_item *items = tkv_xcalloc(n, sizeof(*items));
    for (size_t i = 0; i < n; i++) {
        r_item *it = &items[i];
        it->key = keys[i];
        it->status = L3_PENDING;
        it->stored_only = 1;
        int rc = lookup_ref(l3, &it->key, &it->rec, &it->seg);
        if (rc == TKV_ENOTFOUND) {
            it->status = rc; /* deleted meanwhile */
            continue;
        }
        if (rc != TKV_OK) {
            it->status = rc;
            continue;
        }
        it->cap = round_up(it->rec.stored_len, l3->align);
        it->dst = xaligned(4096, it->cap);
    }
    r_run(l3, items, n);
    for (size_t i = 0; i < n; i++) {
        if (items[i].status == TKV_ENOTFOUND)
            continue;
        (*checked)++;
        if (items[i].status != TKV_OK) {
            (*bad)++;
            if (items[i].status == TKV_ECORRUPT) /* unreadable record: remove it */
                tkv_l3_delete(l3, &items[i].key, 1);
        }
        free(items[i].dst);
    }
    free(items);
}

int tkv_l3_verify(tkv_l3 *l3, void (*progress)(void *arg, uint64_t done, uint64_t total),
                  void *arg, uint64_t *num_checked, uint64_t *num_bad)
{
    if (!l3)
        return TKV_EINVAL;
    key_list kl = {0};
    int rc = idx_iterate(l3, collect_key, &kl);
    uint64_t checked = 0, bad = 0;
    if (rc < 0)
        goto out;
    rc = TKV_OK;
    size_t chunk = l3->o.queue_depth;
    for (size_t i = 0; i < kl.n; i += chunk) {
        size_t m = kl.n - i < chunk ? kl.n - i : chunk;
        verify_chunk(l3, kl.keys + i, m, &checked, &bad);
        if (progress)
            progress(arg, i + m, kl.n);
    }
out:
    free(kl.keys);
    if (num_checked)
        *num_checked = checked;
    if (num_bad)
        *num_bad = bad;
    return rc;
}

/* ==== compaction =========================================================================== */

typedef struct victim_rec {
    tkv_key key;
    uint32_t seg;
    uint64_t off, stored_len;
} victim_rec;

typedef struct victim_list {
    tkv_l3 *l3;
    const uint8_t *is_victim; /* by segment id */
    uint32_t cap;
    victim_rec *v;
    size_t n, vcap;
} victim_list;

static int collect_victim(void *arg, const tkv_key *key, const uint8_t *v, size_t vlen,
                          int prc, const l3_rec *r)
{
    victim_list *vl = arg;
    if (prc != TKV_OK || r->seg >= vl->cap || !vl->is_victim[r->seg])
        return 0;
    if (vl->n == vl->vcap) {
        vl->vcap = vl->vcap ? vl->vcap * 2 : 256;
        vl->v = tkv_xrealloc(vl->v, vl->vcap * sizeof(*vl->v));
    }
    vl->v[vl->n++] = (victim_rec){*key, r->seg, r->off, r->stored_len};
    return 0;
}

/* Moves one chunk of live blocks to the current segment. Returns TKV_OK, or the write
 * error that stops the compaction. */
static int compact_chunk(tkv_l3 *l3, const victim_rec *vr, size_t n)
{
    r_item *ri = tkv_xcalloc(n, sizeof(*ri));
    w_item *wi = tkv_xcalloc(n, sizeof(*wi));
    int rc = TKV_OK;
    for (size_t i = 0; i < n; i++) {
        r_item *it = &ri[i];
        it->key = vr[i].key;
        it->stored_only = 1;
        it->status = L3_PENDING;
        int g = lookup_ref(l3, &it->key, &it->rec, &it->seg);
        if (g != TKV_OK) {
            it->status = g;
            continue;
        }
        if (it->rec.seg != vr[i].seg || it->rec.off != vr[i].off) {
            it->status = TKV_ENOTFOUND; /* rewritten or deleted since the scan */
            seg_unref(l3, it->seg);
            it->seg = NULL;
            continue;
        }
        it->cap = round_up(it->rec.stored_len, l3->align);
        it->dst = xaligned(4096, it->cap);
    }
    r_run(l3, ri, n);
    for (size_t i = 0; i < n; i++) {
        w_item *w = &wi[i];
        if (ri[i].status != TKV_OK) {
            w->status = TKV_ENOTFOUND;
            continue;
        }
        w->status = L3_PENDING;
        w->stored = ri[i].dst;
        w->codec = ri[i].rec.codec;
        w->stored_len = ri[i].rec.stored_len;
        w->len = ri[i].rec.raw_len;
        w->csum = ri[i].rec.csum;
    }
    w_write(l3, wi, n);

    pthread_mutex_lock(&l3->idx_mu);
    rocksdb_writebatch_t *wb = rocksdb_writebatch_create();
    size_t num_moves = 0;
    for (size_t i = 0; i < n; i++) {
        w_item *w = &wi[i];
        if (w->status != L3_PENDING) {
            if (w->status != TKV_ENOTFOUND && rc == TKV_OK)
                rc = w->status;
            continue;
        }
        char *v = NULL;
        l3_rec cur;
        if (idx_get(l3, &ri[i].key, &v, &cur) != TKV_OK) {
            w->status = TKV_ENOTFOUND;
            continue;
        }
        if (cur.seg != ri[i].rec.seg || cur.off != ri[i].rec.off) {
            w->status = TKV_ENOTFOUND; /* moved or replaced meanwhile: our copy is dead */
            rocksdb_free(v);
            continue;
        }
        size_t vlen = cur.hdr_len + 4ull * cur.num_tokens; /* either version, kept as is */
        uint8_t *nv = tkv_xmalloc(vlen);
        memcpy(nv, v, vlen);
        rocksdb_free(v);
        put_u32(nv + 4, w->seg->id);
        put_u64(nv + 8, w->off);
        char k[L3_KEY_LEN];
        idx_key(&ri[i].key, k);
        rocksdb_writebatch_put(wb, k, sizeof(k), (const char *)nv, vlen);
        free(nv);
        num_moves++;
    }
    int crc = num_moves ? idx_commit(l3, wb) : TKV_OK;
    rocksdb_writebatch_destroy(wb);
    if (crc != TKV_OK && rc == TKV_OK)
        rc = crc;
    if (crc == TKV_OK) {
        for (size_t i = 0; i < n; i++) {
            if (wi[i].status != L3_PENDING)
                continue;
            seg_account(l3, wi[i].seg->id, (int64_t)wi[i].alen);
            seg_account(l3, ri[i].rec.seg, -(int64_t)round_up(ri[i].rec.stored_len, l3->align));
        }
    }
    pthread_mutex_unlock(&l3->idx_mu);
    w_release(l3, wi, n);
    for (size_t i = 0; i < n; i++)
        free(ri[i].dst);
    free(ri);
    free(wi);
    return rc;
}

int tkv_l3_compact(tkv_l3 *l3, uint64_t *bytes_reclaimed)
{
    if (!l3)
        return TKV_EINVAL;
    if (bytes_reclaimed)
        *bytes_reclaimed = 0;
    if (ATOMIC_LOAD(&l3->readonly))
        return TKV_EREADONLY;
    pthread_mutex_lock(&l3->compact_mu);
    int rc = TKV_OK;
    uint64_t reclaimed = 0;
    victim_list vl = {.l3 = l3};

    /* Victims: segments without an uncommitted writer whose dead share is over the
     * threshold. The segment being appended to qualifies too (else a store smaller than one
     * segment could never reclaim anything); it is sealed, and appends go to a new one. */
    pthread_mutex_lock(&l3->seg_mu);
    uint32_t cap = l3->segs_cap;
    uint8_t *is_victim = tkv_xcalloc(cap ? cap : 1, 1);
    size_t num_victims = 0;
    for (uint32_t id = 1; id < cap; id++) {
        l3_seg *s = l3->segs[id];
        if (!s || s->doomed || s->compacting || s->pending || s->end == 0)
            continue;
        uint64_t dead = s->end > s->live ? s->end - s->live : 0;
        if ((double)dead >= l3->o.dead_fraction * (double)s->end) {
            if (id == l3->cur_id)
                l3->cur_id = 0;
            is_victim[id] = 1;
            s->compacting = 1;
            num_victims++;
        }
    }
    pthread_mutex_unlock(&l3->seg_mu);
    if (num_victims == 0)
        goto out;

    vl.is_victim = is_victim;
    vl.cap = cap;
    int src = idx_iterate(l3, collect_victim, &vl);
    if (src < 0) {
        rc = src;
        goto unmark;
    }
    for (size_t i = 0; i < vl.n;) {
        size_t m = 0;
        uint64_t bytes = 0;
        while (i + m < vl.n && m < l3->o.queue_depth &&
               (m == 0 || bytes + vl.v[i + m].stored_len <= L3_COMPACT_CHUNK_BYTES)) {
            bytes += vl.v[i + m].stored_len;
            m++;
        }
        rc = compact_chunk(l3, vl.v + i, m);
        if (rc != TKV_OK)
            goto unmark;
        i += m;
    }

    /* Every live block has left the victims: delete them once no reader holds them. */
    pthread_mutex_lock(&l3->seg_mu);
    for (uint32_t id = 1; id < cap; id++) {
        if (!is_victim[id] || !l3->segs[id])
            continue;
        l3_seg *s = l3->segs[id];
        reclaimed += s->end;
        l3->disk_bytes -= s->end;
        s->doomed = 1;
        if (s->refs == 0)
            seg_destroy(l3, s);
    }
    pthread_mutex_unlock(&l3->seg_mu);
    ATOMIC_ADD(&l3->compactions, 1);
    TKV_LOG(TKV_LOG_INFO, "l3 %s: compaction moved %zu blocks, reclaimed %llu bytes from %zu "
            "segments", l3->dir, vl.n, (unsigned long long)reclaimed, num_victims);
    goto out;

unmark:
    pthread_mutex_lock(&l3->seg_mu);
    for (uint32_t id = 1; id < cap; id++)
        if (is_victim[id] && l3->segs[id])
            l3->segs[id]->compacting = 0;
    pthread_mutex_unlock(&l3->seg_mu);
out:
    free(is_victim);
    free(vl.v);
    pthread_mutex_unlock(&l3->compact_mu);
    if (bytes_reclaimed)
        *bytes_reclaimed = reclaimed;
    return rc;
}

/* The background compactor: sleeps until a delete kicks it, then compacts. Its errors are
 * the store's (read-only, counted) and are not reported anywhere else. */
static void *compactor_main(void *arg)
{
    tkv_l3 *l3 = arg;
    pthread_mutex_lock(&l3->seg_mu);
    for (;;) {
        while (!l3->compact_kick && !l3->compact_stop)
            pthread_cond_wait(&l3->compact_cv, &l3->seg_mu);
        if (l3->compact_stop)
            break;
        l3->compact_kick = 0;
        pthread_mutex_unlock(&l3->seg_mu);
        uint64_t reclaimed = 0;
        int rc = tkv_l3_compact(l3, &reclaimed);
        if (rc != TKV_OK && rc != TKV_EREADONLY)
            TKV_LOG(TKV_LOG_WARN, "l3 %s: background compaction: %s", l3->dir,
                    tkv_strerror(rc));
        pthread_mutex_lock(&l3->seg_mu);
    }
    pthread_mutex_unlock(&l3->seg_mu);
    return NULL;
}

/* ==== stats ================================================================================ */

void tkv_l3_get_stats(tkv_l3 *l3, tkv_l3_stats *out)
{
    if (!out)
        return;
    memset(out, 0, sizeof(*out));
    if (!l3)
        return;
    out->num_blocks = ATOMIC_LOAD(&l3->num_blocks);
    out->raw_bytes = ATOMIC_LOAD(&l3->raw_bytes);
    out->stored_bytes = ATOMIC_LOAD(&l3->stored_bytes);
    pthread_mutex_lock(&l3->seg_mu);
    out->disk_bytes = l3->disk_bytes;
    pthread_mutex_unlock(&l3->seg_mu);
    out->reads = ATOMIC_LOAD(&l3->reads);
    out->writes = ATOMIC_LOAD(&l3->writes);
    out->read_bytes = ATOMIC_LOAD(&l3->read_bytes);
    out->write_bytes = ATOMIC_LOAD(&l3->write_bytes);
    out->checksum_failures = ATOMIC_LOAD(&l3->checksum_failures);
    out->io_errors = ATOMIC_LOAD(&l3->io_errors);
    out->compactions = ATOMIC_LOAD(&l3->compactions);
    out->readonly = ATOMIC_LOAD(&l3->readonly);
    out->io_mode = l3->io_mode;
}

/* ==== open / close ========================================================================= */

/* O_DIRECT alignment of this file system (statx STATX_DIOALIGN, 4096 when not reported), and
 * whether it takes O_DIRECT at all (tmpfs before Linux 6.6 does not). */
static int probe_dio(tkv_l3 *l3)
{
    char path[4096];
    snprintf(path, sizeof(path), "%s/.dio-probe", l3->dir);
    unlink(path);
    l3->direct = 1;
    int fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC | O_DIRECT, 0644);
    if (fd < 0 && errno == EINVAL) {
        l3->direct = 0;
        TKV_LOG(TKV_LOG_WARN, "l3 %s: file system refuses O_DIRECT; using the page cache",
                l3->dir);
        fd = open(path, O_RDWR | O_CREAT | O_EXCL | O_CLOEXEC, 0644);
    }
    if (fd < 0) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: cannot create files: %s", l3->dir, strerror(errno));
        return TKV_EIO;
    }
    l3->align = 4096;
    l3->mem_align = 4096;
    struct statx st;
    if (statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &st) == 0 &&
        (st.stx_mask & STATX_DIOALIGN) && st.stx_dio_offset_align) {
        l3->align = st.stx_dio_offset_align;
        l3->mem_align = st.stx_dio_mem_align ? st.stx_dio_mem_align : 4096;
    }
    if (l3->align < 512 || (l3->align & (l3->align - 1)))
        l3->align = 4096;
    if (l3->mem_align > 4096 || (l3->mem_align & (l3->mem_align - 1)))
        l3->mem_align = 4096;
    close(fd);
    unlink(path);
    return TKV_OK;
}

static int open_index(tkv_l3 *l3)
{
    char path[4096];
    char *err = NULL;
    snprintf(path, sizeof(path), "%s/index", l3->dir);
    l3->dbo = rocksdb_options_create();
    rocksdb_options_set_create_if_missing(l3->dbo, 1);
    rocksdb_options_set_info_log_level(l3->dbo, 2 /* WARN */);
    rocksdb_options_set_keep_log_file_num(l3->dbo, 2);
    /* Records are ~100-400 bytes, so a 4 MiB memtable holds ~10^4 blocks. It also bounds
     * the WAL preallocation (1.1x the memtable): the 64 MiB default fallocates ~70 MiB,
     * which on ext4 stays allocated even when the fallocate fails for want of space. */
    rocksdb_options_set_write_buffer_size(l3->dbo, 4u << 20);
    l3->db = rocksdb_open(l3->dbo, path, &err);
    if (err) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: cannot open index: %s", l3->dir, err);
        rocksdb_free(err);
        l3->db = NULL;
        return TKV_EIO;
    }
    l3->wo = rocksdb_writeoptions_create();
    rocksdb_writeoptions_set_sync(l3->wo, 1);
    l3->ro = rocksdb_readoptions_create();
    return TKV_OK;
}

/* The meta record pins the store to one model geometry. */
static int meta_parse(const tkv_l3 *l3, const uint8_t *v, size_t vlen)
{
    if (vlen != L3_META_LEN || memcmp(v, L3_META_MAGIC, 8) != 0) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: meta record is not a tierkv L3 store", l3->dir);
        return TKV_ECORRUPT;
    }
    if (memcmp(v + 8, l3->o.fp, TKV_KEY_BYTES) != 0) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: store holds another model geometry", l3->dir);
        return TKV_EGEOMETRY;
    }
    return TKV_OK;
}

static int check_meta(tkv_l3 *l3)
{
    char *err = NULL;
    size_t vlen = 0;
    char *v = rocksdb_get(l3->db, l3->ro, "m", 1, &vlen, &err);
    if (err) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: index read: %s", l3->dir, err);
        rocksdb_free(err);
        return TKV_EIO;
    }
    if (v) {
        int rc = meta_parse(l3, (const uint8_t *)v, vlen);
        rocksdb_free(v);
        return rc;
    }
    /* A fresh store: refuse an index that has block records but lost its meta. */
    rocksdb_iterator_t *itr = rocksdb_create_iterator(l3->db, l3->ro);
    rocksdb_iter_seek(itr, "k", 1);
    int has_blocks = rocksdb_iter_valid(itr);
    rocksdb_iter_destroy(itr);
    if (has_blocks) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: index has blocks but no meta record", l3->dir);
        return TKV_ECORRUPT;
    }
    char meta[L3_META_LEN];
    memcpy(meta, L3_META_MAGIC, 8);
    memcpy(meta + 8, l3->o.fp, TKV_KEY_BYTES);
    rocksdb_put(l3->db, l3->wo, "m", 1, meta, sizeof(meta), &err);
    if (err) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: index write: %s", l3->dir, err);
        rocksdb_free(err);
        return TKV_EIO;
    }
    return TKV_OK;
}

/* The segment id a directory entry names, or 0: only the exact name seg_path writes
 * ("seg-%08x.dat") counts, so "seg-+0000001.dat" or "seg- 0000001.dat" (which sscanf's %x
 * would read as 1) never alias a real segment's id. */
static int seg_name_id(const char *name, uint32_t *id)
{
    unsigned v;
    char tail[8], canon[24];
    if (strlen(name) != 16 || sscanf(name, "seg-%8x%7s", &v, tail) != 2 || v == 0 ||
        v >= 0x7fffffffu)
        return 0;
    snprintf(canon, sizeof(canon), "seg-%08x.dat", v);
    if (strcmp(canon, name) != 0)
        return 0;
    *id = v;
    return 1;
}

static int load_segments(tkv_l3 *l3)
{
    DIR *d = opendir(l3->dir);
    if (!d) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: opendir: %s", l3->dir, strerror(errno));
        return TKV_EIO;
    }
    int rc = TKV_OK;
    struct dirent *e;
    l3->next_id = 1;
    while ((e = readdir(d)) != NULL) {
        uint32_t id;
        if (!seg_name_id(e->d_name, &id))
            continue;
        int fd = seg_open_fd(l3, id, 0);
        struct stat st;
        if (fd < 0 || fstat(fd, &st) != 0) {
            TKV_LOG(TKV_LOG_ERROR, "l3 %s: open %s: %s", l3->dir, e->d_name, strerror(errno));
            if (fd >= 0)
                close(fd);
            rc = TKV_EIO;
            break;
        }
        l3_seg *s = tkv_xcalloc(1, sizeof(*s));
        s->id = id;
        s->fd = fd;
        s->end = (uint64_t)st.st_size;
        seg_insert(l3, s);
        if (id >= l3->next_id)
            l3->next_id = id + 1;
    }
    closedir(d);
    return rc;
}

typedef struct load_arg {
    tkv_l3 *l3;
    uint64_t *ref_end;        /* by segment id: end of the last referenced slot */
    rocksdb_writebatch_t *drop;
    uint64_t num_dropped;
} load_arg;

static int load_one(void *arg, const tkv_key *key, const uint8_t *v, size_t vlen, int prc,
                    const l3_rec *r)
{
    load_arg *a = arg;
    tkv_l3 *l3 = a->l3;
    l3_seg *s = (prc == TKV_OK && r->seg < l3->segs_cap) ? l3->segs[r->seg] : NULL;
    if (!s || r->off + r->stored_len > s->end) {
        char hex[2 * TKV_KEY_BYTES + 1];
        key_hex(key, hex);
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: dropping block %s: %s", l3->dir, hex,
                prc != TKV_OK ? "unreadable index record" : "payload missing from its segment");
        char k[L3_KEY_LEN];
        idx_key(key, k);
        rocksdb_writebatch_delete(a->drop, k, sizeof(k));
        a->num_dropped++;
        return 0;
    }
    uint64_t alen = round_up(r->stored_len, l3->align);
    uint64_t end = r->off + alen;
    if (end > a->ref_end[r->seg])
        a->ref_end[r->seg] = end;
    s->live += alen;
    l3->num_blocks++;
    l3->raw_bytes += r->raw_len;
    l3->stored_bytes += r->stored_len;
    return 0;
}

/* Segment tails past the last referenced byte are cut, segments nothing references are
 * deleted (ref_end: by segment id, from load_one). */
static int recover_segments(tkv_l3 *l3, const uint64_t *ref_end)
{
    for (uint32_t id = 1; id < l3->segs_cap; id++) {
        l3_seg *s = l3->segs[id];
        if (!s)
            continue;
        uint64_t keep = round_up(ref_end[id], l3->align);
        if (keep == 0) {
            TKV_LOG(TKV_LOG_INFO, "l3 %s: deleting unreferenced segment %08x", l3->dir, id);
            seg_destroy(l3, s);
            continue;
        }
        if (s->end != keep) {
            if (s->end > keep)
                TKV_LOG(TKV_LOG_INFO, "l3 %s: segment %08x: discarding %llu tail bytes",
                        l3->dir, id, (unsigned long long)(s->end - keep));
            if (ftruncate(s->fd, (off_t)keep) != 0) {
                TKV_LOG(TKV_LOG_ERROR, "l3 %s: truncate segment %08x: %s", l3->dir, id,
                        strerror(errno));
                return TKV_EIO;
            }
            if (fdatasync(s->fd) != 0)
                return TKV_EIO;
            s->end = keep;
        }
        s->prealloc = s->end;
        l3->disk_bytes += s->end;
        if (s->end < l3->o.segment_bytes)
            l3->cur_id = id; /* the highest id with room keeps being appended to */
    }
    return fsync(l3->dirfd) != 0 ? TKV_EIO : TKV_OK;
}

/* The index is the truth: records without their payload are dropped (load_one), then the
 * segments are cut to what the index references (recover_segments). */
static int recover(tkv_l3 *l3)
{
    load_arg a = {.l3 = l3};
    a.ref_end = tkv_xcalloc(l3->segs_cap ? l3->segs_cap : 1, sizeof(*a.ref_end));
    a.drop = rocksdb_writebatch_create();
    int rc = idx_iterate(l3, load_one, &a);
    if (rc >= 0)
        rc = a.num_dropped ? idx_commit(l3, a.drop) : TKV_OK;
    if (rc == TKV_OK)
        rc = recover_segments(l3, a.ref_end);
    rocksdb_writebatch_destroy(a.drop);
    free(a.ref_end);
    return rc;
}

int tkv_l3_open(const char *dir, const tkv_l3_opts *o, tkv_l3 **out)
{
    if (!dir || !*dir || !o || !out)
        return TKV_EINVAL;
    *out = NULL;
    if (!o->has_fp || o->max_block_bytes == 0) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: options need a fingerprint and max_block_bytes", dir);
        return TKV_EINVAL;
    }
    if (strlen(dir) > 3000)
        return TKV_EINVAL;
    tkv_l3 *l3 = tkv_xcalloc(1, sizeof(*l3));
    int rc;
    l3->dir = tkv_xstrdup(dir);
    l3->o = *o;
    l3->dirfd = -1;
    pthread_mutex_init(&l3->seg_mu, NULL);
    pthread_mutex_init(&l3->idx_mu, NULL);
    pthread_mutex_init(&l3->compact_mu, NULL);
    pthread_mutex_init(&l3->ctx_mu, NULL);
    pthread_cond_init(&l3->ctx_cv, NULL);
    pthread_cond_init(&l3->compact_cv, NULL);

    if (mkdir(dir, 0755) != 0 && errno != EEXIST) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: mkdir: %s", dir, strerror(errno));
        rc = TKV_EIO;
        goto fail;
    }
    l3->dirfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (l3->dirfd < 0) {
        TKV_LOG(TKV_LOG_ERROR, "l3 %s: open: %s", dir, strerror(errno));
        rc = TKV_EIO;
        goto fail;
    }
    rc = probe_dio(l3);
    if (rc != TKV_OK)
        goto fail;
    size_t bound = ZSTD_compressBound(o->max_block_bytes);
    l3->buf_bytes = round_up(bound > o->max_block_bytes ? bound : o->max_block_bytes, 4096);
    if (l3->align > 4096)
        l3->buf_bytes = round_up(l3->buf_bytes, l3->align);

    rc = open_index(l3);
    if (rc != TKV_OK)
        goto fail;
    rc = check_meta(l3);
    if (rc != TKV_OK)
        goto fail;
    rc = load_segments(l3);
    if (rc != TKV_OK)
        goto fail;
    rc = recover(l3);
    if (rc != TKV_OK)
        goto fail;

    /* io_uring when the kernel grants a ring, else pread/pwrite (decided once, here). */
    l3->io_mode = TKV_IO_PSYNC;
    if (o->io_mode != TKV_IO_PSYNC) {
        int err = 0;
        l3_ctx *c = ctx_new(l3, 1, &err);
        if (c) {
            l3->io_mode = TKV_IO_URING;
            c->next_free = NULL;
            l3->free_ctx = c;
            l3->num_ctx = 1;
        } else if (o->io_mode == TKV_IO_URING) {
            TKV_LOG(TKV_LOG_ERROR, "l3 %s: io_uring refused by the kernel: %s", dir,
                    strerror(err));
            rc = TKV_EUNSUPPORTED;
            goto fail;
        } else {
            TKV_LOG(TKV_LOG_WARN, "l3 %s: io_uring refused by the kernel (%s); using "
                    "pread/pwrite", dir, strerror(err));
        }
    }
    if (o->auto_compact) {
        if (pthread_create(&l3->compactor, NULL, compactor_main, l3) != 0) {
            TKV_LOG(TKV_LOG_ERROR, "l3 %s: cannot start the compaction thread", dir);
            rc = TKV_ENOMEM;
            goto fail;
        }
        l3->has_compactor = 1;
    }
    TKV_LOG(TKV_LOG_INFO, "l3 %s: %llu blocks, %s, align %u%s", dir,
            (unsigned long long)l3->num_blocks, l3->io_mode == TKV_IO_URING ? "io_uring" :
            "pread/pwrite", l3->align, l3->direct ? ", O_DIRECT" : "");
    *out = l3;
    return TKV_OK;
fail:
    tkv_l3_close(l3);
    return rc;
}

void tkv_l3_close(tkv_l3 *l3)
{
    if (!l3)
        return;
    if (l3->has_compactor) {
        pthread_mutex_lock(&l3->seg_mu);
        l3->compact_stop = 1;
        pthread_cond_signal(&l3->compact_cv);
        pthread_mutex_unlock(&l3->seg_mu);
        pthread_join(l3->compactor, NULL);
        l3->has_compactor = 0;
    }
    while (l3->free_ctx) {
        l3_ctx *c = l3->free_ctx;
        l3->free_ctx = c->next_free;
        ctx_free(c);
    }
    for (uint32_t id = 0; id < l3->segs_cap; id++) {
        if (l3->segs[id]) {
            if (l3->segs[id]->end && seg_trim(l3->segs[id]) != 0)
                TKV_LOG(TKV_LOG_WARN, "l3 %s: trim segment %08x: %s", l3->dir, id,
                        strerror(errno));
            close(l3->segs[id]->fd);
            free(l3->segs[id]);
        }
    }
    free(l3->segs);
    if (l3->db)
        rocksdb_close(l3->db);
    if (l3->dbo)
        rocksdb_options_destroy(l3->dbo);
    if (l3->wo)
        rocksdb_writeoptions_destroy(l3->wo);
    if (l3->ro)
        rocksdb_readoptions_destroy(l3->ro);
    if (l3->dirfd >= 0)
        close(l3->dirfd);
    pthread_mutex_destroy(&l3->seg_mu);
    pthread_mutex_destroy(&l3->idx_mu);
    pthread_mutex_destroy(&l3->compact_mu);
    pthread_mutex_destroy(&l3->ctx_mu);
    pthread_cond_destroy(&l3->ctx_cv);
    pthread_cond_destroy(&l3->compact_cv);
    free(l3->dir);
    free(l3);
}
