/* store.c - the tier manager behind tkv_store.h: index + L2 pool + L3 store + policies.
 *
 * ---- Locking -------------------------------------------------------------------------------
 *   idx_lock (rwlock)  membership of the key index. Read mode: lookup's prefix probe, list,
 *                      flush's scan. Write mode: anything that inserts or unlinks entries
 *                      (put/commit phase A, eviction, promotion/write-back completion).
 *   mu (mutex)         every mutable field of every entry (state, residency, pins, the per-tier
 *                      policy entries), the tiers, the lease/alloc/ticket tables, queues, stats.
 *                      Index structure (table, parent/child links) is modified only with BOTH
 *                      idx_lock in write mode and mu held, so either one suffices to read it.
 *   pool mutex         inside tkv_pool, innermost.
 * Order: idx_lock -> mu -> pool. No I/O, memcpy of payloads or checksum runs under idx_lock
 * or mu. The exception is deleting L3 index records (L3 full, operator evict of L3, a block
 * found bad): one RocksDB write batch under the locks, no payload I/O, and rare.
 *
 * A lookup of a chain probes the table under the read lock (lookups run in parallel), then
 * takes mu once to check states, pin the hits, update the policies and create the lease.
 *
 * ---- Pins ----------------------------------------------------------------------------------
 * entry->pins counts lease pins plus in-flight work (a queued write-back, a promotion, a get
 * or verify reading the payload). A pinned entry is never evicted from any tier and its L2 slot
 * is never reused. An entry that has left every tier is unlinked from the index at once; its
 * memory is freed when its last pin goes.
 *
 * ---- Work ----------------------------------------------------------------------------------
 * Worker threads drain two queues: prefetch jobs (first, they have a waiter) and write-back
 * batches (L2 -> L3, many blocks per tkv_l3_put_batch). All but one worker may run write-back
 * at once (L3 compresses on the calling thread), so a prefetch always finds a worker. A caller
 * that needs L2 room while every victim is waiting for its demotion runs a write-back batch
 * itself instead of sleeping, so no caller or worker waits on a queue that nobody drains.
 */
#include "tkv_store.h"

#include "tkv_base.h"
#include "tkv_csum.h"
#include "tkv_index.h"
#include "tkv_l3.h"
#include "tkv_l4.h"
#include "tkv_policy.h"
#include "tkv_pool.h"
#include "tkv_store_internal.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

/* ============================================================================================
 * Options
 * ========================================================================================== */

struct tkv_store_opts {
    size_t block_bytes;
    uint32_t block_tokens;
    uint8_t fp[TKV_KEY_BYTES];
    bool have_block, have_fp;
    uint64_t l2_blocks;
    char *l3_dir;
    uint64_t l3_capacity_bytes;
    int zstd_level, io_mode;
    bool write_through;
    char *policy;
    unsigned workers;
    uint32_t ttl_default_ms, ttl_max_ms;
    uint64_t l1_blocks;
    const tkv_l1_ops *l1_ops;
    void *l1_ctx;
    tkv_l4 *l4;
    uint64_t tq_max[TKV_NUM_TIERS][TKV_STORE_TENANTS_MAX];  /* L1, L2 and L3 */
    uint64_t tq_guar[TKV_NUM_TIERS][TKV_STORE_TENANTS_MAX];
    uint64_t l4_max[TKV_STORE_TENANTS_MAX];      /* blocks it may put into L4 (0 = no limit) */
    uint64_t l2_region[TKV_STORE_TENANTS_MAX];   /* own L2 region of the tenant (0 = none) */
    uint64_t l1_region[TKV_STORE_TENANTS_MAX];   /* own L1 region of the tenant (0 = none) */
    char *tenant_name[TKV_STORE_TENANTS_MAX];    /* for the refusal log line */
};

#define MAX_BLOCK_BYTES (1ull << 30)
#define MAX_BLOCK_TOKENS 4096u
#define MAX_KEYS_PER_CALL (1u << 20)
#define WB_BATCH_BLOCKS 32
#define WB_BATCH_BYTES (32ull << 20)
#define TICKETS_KEPT 4096
#define EXPIRED_KEEP_NS (60ull * 1000000000ull)
#define RESERVE_DEADLINE_NS (30ull * 1000000000ull)

tkv_store_opts *tkv_store_opts_new(void)
{
    tkv_store_opts *o = tkv_xcalloc(1, sizeof(*o));
    o->l2_blocks = 1024;
    o->zstd_level = 1;
    o->io_mode = TKV_IO_AUTO;
    o->write_through = true;
    o->workers = 4;
    o->ttl_default_ms = 30000;
    o->ttl_max_ms = 600000;
    return o;
}

void tkv_store_opts_free(tkv_store_opts *o)
{
    for (unsigned i = 0; o && i < TKV_STORE_TENANTS_MAX; i++)
        free(o->tenant_name[i]);
    if (!o)
        return;
    free(o->l3_dir);
    free(o->policy);
    free(o);
}

int tkv_store_opts_set_block(tkv_store_opts *o, size_t block_bytes, uint32_t block_tokens)
{
    if (!o || block_bytes == 0 || block_bytes > MAX_BLOCK_BYTES || block_tokens == 0 ||
        block_tokens > MAX_BLOCK_TOKENS)
        return TKV_EINVAL;
    o->block_bytes = block_bytes;
    o->block_tokens = block_tokens;
    o->have_block = true;
    return TKV_OK;
}

int tkv_store_opts_set_fingerprint(tkv_store_opts *o, const uint8_t fp[TKV_KEY_BYTES])
{
    if (!o || !fp)
        return TKV_EINVAL;
    memcpy(o->fp, fp, TKV_KEY_BYTES);
    o->have_fp = true;
    return TKV_OK;
}

int tkv_store_opts_set_l2_blocks(tkv_store_opts *o, uint64_t num_blocks)
{
    if (!o || num_blocks == 0 || num_blocks > TKV_POOL_MAX_SLOTS)
        return TKV_EINVAL;
    o->l2_blocks = num_blocks;
    return TKV_OK;
}

int tkv_store_opts_set_l3(tkv_store_opts *o, const char *dir, uint64_t capacity_bytes)
{
    if (!o || (dir && !dir[0]))
        return TKV_EINVAL;
    free(o->l3_dir);
    o->l3_dir = dir ? tkv_xstrdup(dir) : NULL;
    o->l3_capacity_bytes = capacity_bytes;
    return TKV_OK;
}

int tkv_store_opts_set_l3_zstd_level(tkv_store_opts *o, int level)
{
    if (!o || level < 0 || level > 19)
        return TKV_EINVAL;
    o->zstd_level = level;
    return TKV_OK;
}

int tkv_store_opts_set_l3_io_mode(tkv_store_opts *o, int mode)
{
    if (!o || (mode != TKV_IO_AUTO && mode != TKV_IO_URING && mode != TKV_IO_PSYNC))
        return TKV_EINVAL;
    o->io_mode = mode;
    return TKV_OK;
}

int tkv_store_opts_set_write_through(tkv_store_opts *o, bool on)
{
    if (!o)
        return TKV_EINVAL;
    o->write_through = on;
    return TKV_OK;
}

int tkv_store_opts_set_policy(tkv_store_opts *o, const char *name)
{
    if (!o || !name || !tkv_policy_find(name))
        return TKV_EINVAL;
    free(o->policy);
    o->policy = tkv_xstrdup(name);
    return TKV_OK;
}

int tkv_store_opts_set_workers(tkv_store_opts *o, unsigned n)
{
    if (!o || n == 0 || n > 64)
        return TKV_EINVAL;
    o->workers = n;
    return TKV_OK;
}

int tkv_store_opts_set_l1(tkv_store_opts *o, uint64_t num_blocks, const tkv_l1_ops *ops,
                          void *ctx)
{
    if (!o || num_blocks == 0 || num_blocks > TKV_POOL_MAX_SLOTS || !ops || !ops->offset ||
        !ops->promote || !ops->demote)
        return TKV_EINVAL;
    o->l1_blocks = num_blocks;
    o->l1_ops = ops;
    o->l1_ctx = ctx;
    return TKV_OK;
}

int tkv_store_opts_set_l4(tkv_store_opts *o, tkv_l4 *l4)
{
    if (!o)
        return TKV_EINVAL;
    o->l4 = l4;
    return TKV_OK;
}

int tkv_store_opts_set_tenant_quota(tkv_store_opts *o, unsigned tenant, int tier,
                                    uint64_t max_blocks, uint64_t guaranteed_blocks)
{
    if (!o || tenant >= TKV_STORE_TENANTS_MAX || tier < TKV_TIER_L1 || tier >= TKV_NUM_TIERS)
        return TKV_EINVAL;
    if (max_blocks && guaranteed_blocks > max_blocks)
        return TKV_EINVAL;
    o->tq_max[tier][tenant] = max_blocks;
    o->tq_guar[tier][tenant] = guaranteed_blocks;
    return TKV_OK;
}

int tkv_store_opts_set_l2_region(tkv_store_opts *o, unsigned tenant, uint64_t num_blocks)
{
    if (!o || tenant == 0 || tenant >= TKV_STORE_TENANTS_MAX || num_blocks > TKV_POOL_MAX_SLOTS)
        return TKV_EINVAL;
    o->l2_region[tenant] = num_blocks;
    return TKV_OK;
}

int tkv_store_opts_set_l1_region(tkv_store_opts *o, unsigned tenant, uint64_t num_blocks)
{
    if (!o || tenant == 0 || tenant >= TKV_STORE_TENANTS_MAX || num_blocks > TKV_POOL_MAX_SLOTS)
        return TKV_EINVAL;
    o->l1_region[tenant] = num_blocks;
    return TKV_OK;
}

int tkv_store_opts_set_tenant_l4_quota(tkv_store_opts *o, unsigned tenant, uint64_t max_blocks)
{
    if (!o || tenant >= TKV_STORE_TENANTS_MAX)
        return TKV_EINVAL;
    o->l4_max[tenant] = max_blocks;
    return TKV_OK;
}

int tkv_store_opts_set_tenant_name(tkv_store_opts *o, unsigned tenant, const char *name)
{
    if (!o || tenant >= TKV_STORE_TENANTS_MAX || !name)
        return TKV_EINVAL;
    free(o->tenant_name[tenant]);
    o->tenant_name[tenant] = tkv_xstrdup(name);
    return TKV_OK;
}

int tkv_store_opts_set_lease_ttl_ms(tkv_store_opts *o, uint32_t dflt, uint32_t max)
{
    if (!o || dflt == 0 || max == 0 || dflt > max)
        return TKV_EINVAL;
    o->ttl_default_ms = dflt;
    o->ttl_max_ms = max;
    return TKV_OK;
}

/* ============================================================================================
 * The store
 * ========================================================================================== */

enum {
    F_CSUM = 1,      /* csum is known (set at put/commit; after the first read of an L3 block) */
    F_WB = 2,        /* queued for / in write-back to L3 (holds one pin) */
    F_DROP_L2 = 4,   /* evict from L2 once durable in L3 (demotion) */
    F_PROMOTING = 8, /* a prefetch job is reading it into L2 (holds one pin) */
};

#define RES(t) ((uint8_t)(1u << (t)))

typedef struct tier {
    bool enabled;
    const tkv_policy_ops *ops;
    void *pstate;
    uint64_t capacity_blocks;
    uint64_t num_blocks;
    uint64_t reserved;      /* L3: blocks being written that already counted against capacity */
} tier;

typedef struct alloc_rec {
    uint64_t id, owner;
    unsigned tenant;
    int tier;               /* TKV_TIER_L2 or TKV_TIER_L1 */
    size_t n;
    uint64_t *slots;
    unsigned writers;       /* alloc_write calls copying right now */
    bool dead;              /* aborted while a writer was copying: the last writer frees */
    struct alloc_rec *next;
} alloc_rec;

typedef struct ticket {
    uint64_t id;
    bool done;
    int status;
    struct ticket *next;
} ticket;

typedef struct prefetch_job {
    uint64_t ticket;
    int tier;               /* target: TKV_TIER_L2 or TKV_TIER_L1 */
    size_t n1;
    tkv_entry **l1ents;     /* target L1: every lease block not yet in L1 (pinned) */
    tkv_done_fn done;
    void *arg;
    size_t n, num_waits;
    tkv_entry **ents;       /* promote these (pinned, F_PROMOTING set by this job) */
    tkv_entry **waits;      /* promoted by an earlier job: wait for them (pinned) */
    struct prefetch_job *next;
} prefetch_job;

struct tkv_store {
    size_t block_bytes;
    uint32_t block_tokens;
    uint8_t fp[TKV_KEY_BYTES];
    bool write_through;
    uint32_t ttl_default_ms, ttl_max_ms;

    tkv_pool *pool;
    /* L2 regions (tkv_pool.h): tenant -> region, and one policy instance per region sized to
     * it, so a region's victims are its own blocks. Region 0 is tenant 0's and every tenant's
     * without a region of its own. tiers[L2].pstate is region 0's. */
    unsigned num_regions;
    uint8_t region_of[TKV_STORE_TENANTS_MAX];
    void *l2_ps[TKV_POOL_MAX_REGIONS];
    uint64_t wb_in_region[TKV_POOL_MAX_REGIONS]; /* its blocks queued for or in write-back:
                                                  * what a full region may wait for */
    /* L1: slot accounting here, bytes behind the backend. Regions as in L2: region r is the
     * slots [l1_first[r], l1_first[r] + l1_size[r]) (region 0 first, then the tenants' in
     * tenant order), the backend keeps each in an allocation of its own, and each has a
     * policy instance and a free stack (its slots of l1_free, from l1_first[r] up). */
    const tkv_l1_ops *l1_ops;
    void *l1_ctx;
    uint64_t *l1_free;
    unsigned l1_num_regions;
    uint8_t l1_region_of[TKV_STORE_TENANTS_MAX];
    uint64_t l1_first[TKV_POOL_MAX_REGIONS], l1_size[TKV_POOL_MAX_REGIONS];
    uint64_t l1_nfree[TKV_POOL_MAX_REGIONS];
    void *l1_ps[TKV_POOL_MAX_REGIONS];
    tkv_l3 *l3;
    bool l3_readonly;
    tier tiers[TKV_NUM_TIERS];
    tkv_l4 *l4;               /* the shared tier, or NULL (not owned) */

    pthread_rwlock_t idx_lock;
    tkv_index *ix;

    pthread_mutex_t mu;
    pthread_cond_t cv_work;   /* workers: a job or write-back arrived, or closing */
    pthread_cond_t cv_done;   /* write-back/promotion progress, tickets, alloc writers */
    pthread_cond_t cv_reap;   /* the reaper's sleep (signalled at close) */
    bool closing;

    tkv_lease_table *leases;
    alloc_rec *allocs;
    uint64_t next_alloc_id, num_allocs;
    ticket *tickets;          /* newest first */
    uint64_t next_ticket, num_tickets_done;

    prefetch_job *jobs_head, *jobs_tail;
    tkv_entry *wb_head, *wb_tail;
    uint64_t wb_len, wb_inflight;
    unsigned wb_running, wb_max_running;
    uint64_t wb_generation;   /* bumped at each write-back completion */

    unsigned num_workers;
    pthread_t *workers;
    pthread_t reaper;
    bool reaper_started;

    tkv_store_stats st;       /* counters only; the gauges are filled by get_stats */

    /* Per-tenant accounting (mu). tenant_limits: some tenant has a quota or guarantee, so
     * victims are checked against them (otherwise the policy's victim is taken as is). */
    struct tenant_acct {
        uint64_t blocks[TKV_NUM_TIERS];
        uint64_t max[TKV_NUM_TIERS], guar[TKV_NUM_TIERS];
        uint64_t reserved_l2;   /* L2 slots taken for the tenant's blocks, not yet entered:
                                 * they count against its quota (puts copying, allocations,
                                 * promotions reading) */
        uint64_t reserved_l3;   /* its blocks in write-back that counted against L3 room */
        uint64_t reserved_l1;   /* L1 slots taken for it, not yet entered (allocations,
                                 * promotions copying) */
        uint64_t l4_blocks;     /* blocks it put into L4 from this store (queued writes) */
        uint64_t l4_max;        /* the most it may (0 = no limit) */
        uint64_t tag;           /* kept in its L3 records: who owns a block after a restart */
        uint64_t refused, own_evictions, guarded_skips;
        uint64_t refused_tier[TKV_NUM_TIERS + 1]; /* of refused, per tier (index 4 = L4) */
        uint64_t log_ns, log_held;  /* the refusal log line: last time, refusals held back */
        char *name;
    } tn[TKV_STORE_TENANTS_MAX];
    bool tenant_limits[TKV_NUM_TIERS];
};

/* mu held: the policy instance of tier t that holds (or would hold) blocks of tenant tn. */
static void *pstate_of(const tkv_store *s, int t, unsigned tn)
{
    return t == TKV_TIER_L2   ? s->l2_ps[s->region_of[tn]]
           : t == TKV_TIER_L1 ? s->l1_ps[s->l1_region_of[tn]]
                              : s->tiers[t].pstate;
}

/* mu held: returns L1 slot `slot` to the free stack of the region it lies in (found by its
 * number, not by a block's tenant: a slot always goes back where it came from). */
static void l1_slot_free(tkv_store *s, uint64_t slot)
{
    unsigned r = 0;
    while (r + 1 < s->l1_num_regions &&
           (slot < s->l1_first[r] || slot - s->l1_first[r] >= s->l1_size[r]))
        r++;
    TKV_ASSERT(slot >= s->l1_first[r] && slot - s->l1_first[r] < s->l1_size[r]);
    TKV_ASSERT(s->l1_nfree[r] < s->l1_size[r]);
    s->l1_free[s->l1_first[r] + s->l1_nfree[r]++] = slot;
}

/* mu held: counts n refused blocks of tenant tn (tier t) and decides the refusal log line: at
 * most one a second per tenant, saying how many were held back. Tenant 0 (no tenants) is not
 * logged. Returns true when the caller is to log (after dropping the locks); *held gets the
 * refusals since the previous line. */
typedef struct refusal_line {
    uint64_t held, holds;  /* refusals held back since the last line; blocks held in the tier */
    uint64_t limit;        /* its quota there, or its own region's size (0: none) */
} refusal_line;

static bool refusal_note(tkv_store *s, unsigned tn, int t, uint64_t n, refusal_line *out)
{
    struct tenant_acct *a = &s->tn[tn];
    a->refused += n;
    a->refused_tier[t] += n;
    if (tn == 0 || n == 0)
        return false;
    uint64_t now = tkv_now_ns();
    if (a->log_ns && now - a->log_ns < 1000000000ull) {
        a->log_held += n;
        return false;
    }
    a->log_ns = now;
    out->held = a->log_held;
    out->holds = t < TKV_NUM_TIERS ? a->blocks[t] : a->l4_blocks;
    out->limit = t < TKV_NUM_TIERS ? a->max[t] : a->l4_max;
    uint64_t region = t == TKV_TIER_L2 && s->region_of[tn]
                          ? tkv_pool_region_slots(s->pool, s->region_of[tn])
                      : t == TKV_TIER_L1 && s->l1_region_of[tn] ? s->l1_size[s->l1_region_of[tn]]
                                                                : 0;
    if (region && (!out->limit || out->limit > region))
        out->limit = region;
    a->log_held = 0;
    return true;
}

/* No locks held: the line refusal_note allowed (name and limits do not change after open). */
static void refusal_log(const tkv_store *s, unsigned tn, int t, uint64_t n,
                        const refusal_line *l, const char *why)
{
    const struct tenant_acct *a = &s->tn[tn];
    char id[16];
    snprintf(id, sizeof(id), "#%u", tn);
    TKV_LOG(TKV_LOG_WARN, "tenant %s: %llu L%d blocks refused (%s; holds %llu, quota %llu) "
            "(%llu more refused since the last line)", a->name ? a->name : id,
            (unsigned long long)n, t, why, (unsigned long long)l->holds,
            (unsigned long long)l->limit, (unsigned long long)l->held);
}

static void lock(tkv_store *s);
static void unlock(tkv_store *s);

/* No locks held: hands a block of tenant tn to L4, within the tenant's L4 quota. L4 is a
 * cache the daemon does not see evict, so what is counted is the blocks this store queued for
 * it (a block written or read here lately is not queued again, nor counted): past the quota
 * the block is refused, counted and logged like a refusal in the other tiers. */
static void l4_put_as(tkv_store *s, unsigned tn, const tkv_key *key, const tkv_key *parent,
                      const uint32_t *tokens, uint32_t num_tokens, const void *payload,
                      size_t len)
{
    struct tenant_acct *a = &s->tn[tn];
    refusal_line line;
    bool log_it = false, ok = true;
    lock(s);
    if (a->l4_max && a->l4_blocks >= a->l4_max) {
        ok = false;
        log_it = refusal_note(s, tn, TKV_NUM_TIERS, 1, &line);
    } else {
        a->l4_blocks++;
    }
    unlock(s);
    if (!ok) {
        if (log_it)
            refusal_log(s, tn, TKV_NUM_TIERS, 1, &line, "at its L4 quota");
        return;
    }
    if (tkv_l4_put_async(s->l4, key, parent, tokens, num_tokens, payload, len) != TKV_OK) {
        lock(s);
        a->l4_blocks--; /* not queued: already there, over budget, or L4 down */
        unlock(s);
    }
}

static void rd_lock(tkv_store *s) { pthread_rwlock_rdlock(&s->idx_lock); }
static void wr_lock(tkv_store *s) { pthread_rwlock_wrlock(&s->idx_lock); }
static void idx_unlock(tkv_store *s) { pthread_rwlock_unlock(&s->idx_lock); }
static void lock(tkv_store *s) { pthread_mutex_lock(&s->mu); }
static void unlock(tkv_store *s) { pthread_mutex_unlock(&s->mu); }

static bool l3_writable(const tkv_store *s) { return s->l3 && !s->l3_readonly; }

static void *slot_ptr(const tkv_store *s, uint64_t slot)
{
    return tkv_pool_slot_ptr(s->pool, slot);
}

static uint64_t slot_offset(const tkv_store *s, uint64_t slot)
{
    return slot * tkv_pool_slot_stride(s->pool);
}

static tkv_entry *entry_of_pe(tkv_policy_entry *pe, int t)
{
    return (tkv_entry *)((char *)(pe - t) - offsetof(tkv_entry, pe));
}

static void cond_init_mono(pthread_cond_t *cv)
{
    pthread_condattr_t a;
    pthread_condattr_init(&a);
    pthread_condattr_setclock(&a, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &a);
    pthread_condattr_destroy(&a);
}

/* Waits on cv until the absolute CLOCK_MONOTONIC time deadline_ns; false when it passed. */
static bool cond_wait_until(pthread_cond_t *cv, pthread_mutex_t *mu, uint64_t deadline_ns)
{
    struct timespec ts = {.tv_sec = (time_t)(deadline_ns / 1000000000ull),
                          .tv_nsec = (long)(deadline_ns % 1000000000ull)};
    return pthread_cond_timedwait(cv, mu, &ts) != ETIMEDOUT;
}

/* ============================================================================================
 * Entries in tiers (mu held)
 * ========================================================================================== */

static void pe_changed(tkv_store *s, tkv_entry *e, int t)
{
    s->tiers[t].ops->changed(pstate_of(s, t, e->tenant), &e->pe[t]);
}

/* The pins that hold e's copy in tier t: all of them, except that write-back (F_WB, set
 * before its pin is taken and cleared before it is dropped) needs only the L2 copy, so an L1
 * copy may leave meanwhile (an engine committing at its L1 quota would otherwise find its own
 * blocks unevictable until they are durable). */
static uint32_t pins_in(const tkv_entry *e, int t)
{
    return e->pins - (t == TKV_TIER_L1 && (e->flags & F_WB) ? 1u : 0u);
}

/* Each tier's view of e's pins; a policy's candidate set changes only when one crosses zero. */
static void pins_changed(tkv_store *s, tkv_entry *e)
{
    for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++) {
        if (!(e->resident & RES(t)))
            continue;
        bool was = e->pe[t].pinned != 0;
        e->pe[t].pinned = pins_in(e, t);
        if (was != (e->pe[t].pinned != 0))
            pe_changed(s, e, t);
    }
}

static void entry_pin(tkv_store *s, tkv_entry *e)
{
    e->pins++;
    pins_changed(s, e);
}

static void entry_unpin(tkv_store *s, tkv_entry *e)
{
    TKV_ASSERT(e->pins > 0);
    e->pins--;
    pins_changed(s, e);
    if (e->pins == 0 && !e->linked) {
        TKV_ASSERT(e->resident == 0);
        tkv_entry_free(e);
    }
}

static void tier_enter(tkv_store *s, tkv_entry *e, int t, uint64_t now_ns)
{
    tier *T = &s->tiers[t];
    tkv_policy_entry *pe = &e->pe[t];
    TKV_ASSERT(!(e->resident & RES(t)));
    memset(pe, 0, sizeof(*pe));
    pe->key_fp = tkv_key_fp(&e->key);
    pe->depth = e->depth;
    pe->pinned = pins_in(e, t);
    tkv_entry *p = e->parent;
    if (p && (p->resident & RES(t))) {
        pe->parent = &p->pe[t];
        if (p->pe[t].num_children++ == 0)
            pe_changed(s, p, t);
    }
    for (tkv_entry *c = e->first_child; c; c = c->next_sibling)
        if (c->resident & RES(t))
            pe->num_children++;
    e->resident |= RES(t);
    T->num_blocks++;
    s->tn[e->tenant].blocks[t]++;
    T->ops->inserted(pstate_of(s, t, e->tenant), pe, now_ns);
    for (tkv_entry *c = e->first_child; c; c = c->next_sibling) {
        if (c->resident & RES(t)) {
            c->pe[t].parent = pe;
            c->pe[t].depth = c->depth;
            pe_changed(s, c, t);
        }
    }
}

static void tier_leave(tkv_store *s, tkv_entry *e, int t)
{
    tier *T = &s->tiers[t];
    tkv_policy_entry *pe = &e->pe[t];
    TKV_ASSERT(e->resident & RES(t));
    T->ops->removed(pstate_of(s, t, e->tenant), pe);
    if (pe->parent) {
        tkv_entry *p = entry_of_pe(pe->parent, t);
        TKV_ASSERT(p->pe[t].num_children > 0);
        if (--p->pe[t].num_children == 0)
            pe_changed(s, p, t);
    }
    for (tkv_entry *c = e->first_child; c; c = c->next_sibling) {
        if ((c->resident & RES(t)) && c->pe[t].parent == pe) {
            c->pe[t].parent = NULL;
            pe_changed(s, c, t);
        }
    }
    e->resident &= (uint8_t)~RES(t);
    T->num_blocks--;
    s->tn[e->tenant].blocks[t]--;
    if (t == TKV_TIER_L2) {
        tkv_pool_free(s->pool, e->l2_slot);
        e->l2_slot = UINT64_MAX;
    } else if (t == TKV_TIER_L1) {
        l1_slot_free(s, e->l1_slot);
        e->l1_slot = UINT64_MAX;
    }
}

/* idx_lock (write) + mu held: unlinks an entry that no tier holds any more. */
static void entry_drop_if_gone(tkv_store *s, tkv_entry *e)
{
    if (!e->linked || e->resident || e->state == TKV_BLOCK_WRITING)
        return;
    tkv_index_remove(s->ix, e);
    e->state = 0;
    if (e->pins == 0)
        tkv_entry_free(e);
}

/* Moves the tokens into the entry (kept until the block is durable in L3). */
static void entry_set_tokens(tkv_store *s, tkv_entry *e, const uint32_t *tokens)
{
    if (!tokens || !l3_writable(s))
        return;
    e->tokens = tkv_xmalloc((size_t)s->block_tokens * sizeof(uint32_t));
    memcpy(e->tokens, tokens, (size_t)s->block_tokens * sizeof(uint32_t));
    e->num_tokens = s->block_tokens;
}

/* mu held: queue a write-back of an L2 block to L3 (no-op when L3 cannot take it). */
static void wb_queue(tkv_store *s, tkv_entry *e)
{
    if (!l3_writable(s) || (e->flags & F_WB) || (e->resident & RES(TKV_TIER_L3)) ||
        !(e->resident & RES(TKV_TIER_L2)) || !e->tokens)
        return;
    e->flags |= F_WB;
    s->wb_in_region[s->region_of[e->tenant]]++;
    entry_pin(s, e);
    e->q_next = NULL;
    if (s->wb_tail)
        s->wb_tail->q_next = e;
    else
        s->wb_head = e;
    s->wb_tail = e;
    s->wb_len++;
    pthread_cond_signal(&s->cv_work);
}

static tkv_block_loc entry_loc(const tkv_store *s, const tkv_entry *e)
{
    tkv_block_loc loc = {0};
    loc.in_l1 = (e->resident & RES(TKV_TIER_L1)) != 0;
    loc.in_l2 = (e->resident & RES(TKV_TIER_L2)) != 0;
    loc.in_l3 = (e->resident & RES(TKV_TIER_L3)) != 0;
    loc.tier = loc.in_l1   ? TKV_TIER_L1
               : loc.in_l2 ? TKV_TIER_L2
               : loc.in_l3 ? TKV_TIER_L3
                           : TKV_TIER_NONE;
    loc.l2_offset = loc.in_l2 ? slot_offset(s, e->l2_slot) : TKV_NO_OFFSET;
    loc.l1_offset = loc.in_l1 ? s->l1_ops->offset(s->l1_ctx, e->l1_slot) : TKV_NO_OFFSET;
    return loc;
}

/* ============================================================================================
 * L1 and L2 room (idx_lock write + mu held)
 * ========================================================================================== */

enum { RESERVE_WAIT = 1 };

static tkv_entry *tier_victim(tkv_store *s, int t, unsigned tn, bool own_only, bool tails_only);

/* Takes up to `want` free L1 slots of tenant tn's region, evicting unpinned victims there
 * (the policy's order; with limits as in l2_reserve: at its quota only its own blocks, never
 * another's below its guaranteed share). held: slots this call already took for tn. An L1
 * block leaves at once: it has a copy below (commit and promotion put one there), or, where
 * L2 had no room for it, it is simply dropped like any cache line. *got = slots taken; TKV_OK
 * when all were taken, else TKV_EFULL. */
static int l1_reserve(tkv_store *s, unsigned tn, size_t held, size_t want, uint64_t *slots,
                      size_t *got)
{
    struct tenant_acct *ta = &s->tn[tn];
    unsigned r = s->l1_region_of[tn];
    *got = 0;
    while (*got < want) {
        bool at_quota = false;
        if (ta->max[TKV_TIER_L1]) {
            uint64_t mine = ta->blocks[TKV_TIER_L1] + ta->reserved_l1 + held + *got;
            at_quota = mine >= ta->max[TKV_TIER_L1];
        }
        if (!at_quota && s->l1_nfree[r]) {
            slots[(*got)++] = s->l1_free[s->l1_first[r] + --s->l1_nfree[r]];
            continue;
        }
        tkv_entry *e = tier_victim(s, TKV_TIER_L1, tn, at_quota, false);
        if (!e)
            return TKV_EFULL;
        TKV_ASSERT(pins_in(e, TKV_TIER_L1) == 0 && (e->resident & RES(TKV_TIER_L1)));
        if (e->tenant == tn && (ta->max[TKV_TIER_L1] || r))
            ta->own_evictions++;
        tier_leave(s, e, TKV_TIER_L1);
        s->st.evictions++;
        entry_drop_if_gone(s, e);
    }
    return TKV_OK;
}

/* mu held: may room in tier t for tenant tn be made by evicting e? Not when e belongs to
 * another tenant that holds no more than its guaranteed share there. */
static bool may_evict_for(tkv_store *s, const tkv_entry *e, unsigned tn, int t)
{
    const struct tenant_acct *a = &s->tn[e->tenant];
    return e->tenant == tn || !a->guar[t] || a->blocks[t] > a->guar[t];
}

/* mu held: the next victim in tier t (L2: tn's region) for tenant tn: the policy's, or with
 * tenant limits the first in its order that is tn's own (own_only) or that may_evict_for
 * allows. Blocks passed over are pinned for the walk, so the policy offers the next one, and
 * unpinned after it (at most TKV_TENANT_SKIP_MAX of them: O(1) per slot). tails_only as in
 * l2_reserve. NULL if none. */
static tkv_entry *tier_victim(tkv_store *s, int t, unsigned tn, bool own_only, bool tails_only)
{
    tier *T = &s->tiers[t];
    void *ps = pstate_of(s, t, tn);
    tkv_entry *skipped[TKV_TENANT_SKIP_MAX], *found = NULL;
    size_t ns = 0;
    for (;;) {
        tkv_policy_entry *v = T->ops->victim(ps);
        if (!v || (tails_only && v->num_children))
            break;
        tkv_entry *e = entry_of_pe(v, t);
        if (!s->tenant_limits[t])
            return e;
        if (own_only ? e->tenant == tn : may_evict_for(s, e, tn, t)) {
            found = e;
            break;
        }
        if (!own_only)
            s->tn[e->tenant].guarded_skips++;
        if (ns == TKV_TENANT_SKIP_MAX)
            break;
        entry_pin(s, e);
        skipped[ns++] = e;
    }
    for (size_t i = 0; i < ns; i++)
        entry_unpin(s, skipped[i]);
    return found;
}

/* Takes up to `want` free L2 slots into slots[] for tenant tn, evicting unpinned victims:
 * durable ones (or any when L3 cannot take them) leave L2 now; the others are queued for
 * demotion and leave once durable. tails_only: stop at a victim with cached children instead
 * of evicting it (the policy offers one only when no unpinned tail is left). held: slots this
 * call already took for tn (they count against its quota). With a quota, a tenant at it takes
 * a slot only after evicting one of its own blocks. *got = slots taken. Returns TKV_OK when
 * all were taken, RESERVE_WAIT when demotions are pending (the caller drops the locks, helps
 * write back, retries), else TKV_EFULL. */
static int l2_reserve(tkv_store *s, unsigned tn, size_t held, size_t want, bool tails_only,
                      uint64_t *slots, size_t *got)
{
    struct tenant_acct *ta = &s->tn[tn];
    unsigned region = s->region_of[tn];
    uint64_t draining = 0; /* own blocks this call queued to leave once durable */
    *got = 0;
    for (;;) {
        size_t take = want - *got;
        bool at_quota = false;
        if (ta->max[TKV_TIER_L2]) {
            uint64_t mine = ta->blocks[TKV_TIER_L2] + ta->reserved_l2 + held + *got;
            uint64_t room = mine < ta->max[TKV_TIER_L2] ? ta->max[TKV_TIER_L2] - mine : 0;
            if (room < take) {
                take = (size_t)room;
                at_quota = true;
            }
        }
        uint64_t nfree = tkv_pool_num_free_in(s->pool, region);
        if (take > nfree)
            take = (size_t)nfree;
        if (take) {
            int rc = tkv_pool_alloc_in(s->pool, region, take, slots + *got);
            TKV_ASSERT(rc == TKV_OK);
            *got += take;
        }
        if (*got == want)
            return TKV_OK;
        /* Enough own blocks are on their way out: wait for them rather than evict more (the
         * quota is not exceeded meanwhile, even for a moment). */
        if (at_quota && draining >= want - *got)
            return RESERVE_WAIT;
        tkv_entry *e = tier_victim(s, TKV_TIER_L2, tn, at_quota, tails_only);
        if (!e)
            break;
        TKV_ASSERT(e->pins == 0 && (e->resident & RES(TKV_TIER_L2)));
        if (e->tenant == tn && (ta->max[TKV_TIER_L2] || region))
            ta->own_evictions++;
        if ((e->resident & RES(TKV_TIER_L3)) || !l3_writable(s) || !e->tokens) {
            tier_leave(s, e, TKV_TIER_L2);
            s->st.evictions++;
            entry_drop_if_gone(s, e);
        } else {
            if (e->tenant == tn)
                draining++;
            e->flags |= F_DROP_L2;
            wb_queue(s, e); /* pins it: victim() will not offer it again */
        }
    }
    /* Only write-backs of this region's blocks can free (or make evictable) its slots; with
     * one region that is every write-back. */
    return s->wb_in_region[region] > 0 ? RESERVE_WAIT : TKV_EFULL;
}

static bool wb_run_batch(tkv_store *s, bool worker);

/* No locks held: make progress on write-back so a reservation can retry. */
static void help_writeback(tkv_store *s)
{
    if (wb_run_batch(s, false))
        return;
    lock(s);
    uint64_t gen = s->wb_generation;
    uint64_t deadline = tkv_now_ns() + 100000000ull;
    while (s->wb_generation == gen && s->wb_inflight > 0 && !s->closing)
        if (!cond_wait_until(&s->cv_done, &s->mu, deadline))
            break;
    unlock(s);
}

/* idx_lock (write) + mu held, and held again on return: takes `want` slots of tier t (L1 or
 * L2) into slots[] (L2: tails_only as in l2_reserve). When only pending demotions stand in
 * the way, drops the locks, helps the write-back along and retries, until
 * RESERVE_DEADLINE_NS. *got = slots taken (the first of slots[]). TKV_OK when all were taken,
 * TKV_ECLOSED when the store is closing, else TKV_EFULL. */
static int reserve_slots(tkv_store *s, int t, unsigned tn, size_t want, bool tails_only,
                         uint64_t *slots, size_t *got)
{
    uint64_t deadline = tkv_now_ns() + RESERVE_DEADLINE_NS;
    *got = 0;
    for (;;) {
        if (s->closing)
            return TKV_ECLOSED;
        size_t more = 0;
        int rc = t == TKV_TIER_L1 ? l1_reserve(s, tn, *got, want - *got, slots + *got, &more)
                                  : l2_reserve(s, tn, *got, want - *got, tails_only,
                                               slots + *got, &more);
        *got += more;
        if (rc == TKV_OK)
            return TKV_OK;
        if (rc != RESERVE_WAIT || tkv_now_ns() > deadline)
            return TKV_EFULL;
        /* The slots taken so far count against tn's quota while the locks are down. */
        if (t == TKV_TIER_L2)
            s->tn[tn].reserved_l2 += *got;
        unlock(s);
        idx_unlock(s);
        help_writeback(s);
        wr_lock(s);
        lock(s);
        if (t == TKV_TIER_L2)
            s->tn[tn].reserved_l2 -= *got;
    }
}

/* ============================================================================================
 * Open / close
 * ========================================================================================== */

static void *worker_main(void *arg);
static void *reaper_main(void *arg);
static void alloc_free(tkv_store *s, alloc_rec *a, size_t from);

typedef struct load_ctx {
    tkv_store *s;
    uint64_t loaded, skipped, unowned;
} load_ctx;

/* The tag a tenant's blocks carry in their L3 records. From its name where it has one, so a
 * block stays its own when the tenants are reordered or others are added; else from its id.
 * Never 0 (no tenant) for tenants 1..; tenant 0 is 0. */
static uint64_t tenant_tag_of(unsigned tn, const char *name)
{
    if (tn == 0)
        return 0;
    if (!name)
        return tn;
    uint64_t h = tkv_csum64(name, strlen(name)) ^ 0x74656e616e74ull; /* "tenant" */
    return h < TKV_STORE_TENANTS_MAX ? h + TKV_STORE_TENANTS_MAX : h; /* never an id's tag */
}

/* The tenant whose tag an L3 record carries; 0 for none or a tenant this store no longer
 * knows (then only the chain of that name's salt can reach the block, as before tags). */
static unsigned tenant_of_tag(const tkv_store *s, uint64_t tag)
{
    for (unsigned i = 1; tag && i < TKV_STORE_TENANTS_MAX; i++)
        if (s->tn[i].tag == tag)
            return i;
    return 0;
}

static int load_one(void *arg, const tkv_l3_info *info)
{
    load_ctx *lc = arg;
    tkv_store *s = lc->s;
    if (info->raw_bytes != s->block_bytes) {
        lc->skipped++;
        return 0;
    }
    tkv_entry *e = tkv_entry_new(&info->key, &info->parent, 0);
    e->state = TKV_BLOCK_READY;
    e->tenant = (uint8_t)tenant_of_tag(s, info->tenant_tag);
    if (info->tenant_tag && !e->tenant)
        lc->unowned++;
    if (tkv_index_insert(s->ix, e) != TKV_OK) {
        tkv_entry_free(e);
        lc->skipped++;
        return 0;
    }
    lc->loaded++;
    return 0;
}

/* Depth is only known once every block is linked: walk down from each chain head. */
static int fix_depth(void *arg, tkv_entry *e)
{
    if (e->parent)
        return 0;
    tkv_entry *c = e->first_child;
    while (c) {
        c->depth = c->parent->depth + 1;
        if (c->first_child) {
            c = c->first_child;
            continue;
        }
        while (c && !c->next_sibling && c != e) {
            c = c->parent;
            if (c == e)
                c = NULL;
        }
        if (c)
            c = c->next_sibling;
    }
    return 0;
}

static int enter_l3(void *arg, tkv_entry *e)
{
    tier_enter(arg, e, TKV_TIER_L3, tkv_now_ns());
    return 0;
}

static int open_l3(tkv_store *s, const tkv_store_opts *o)
{
    int rc = TKV_OK;
    tkv_l3_opts *lo = tkv_l3_opts_new();
    if (mkdir(o->l3_dir, 0755) != 0 && errno != EEXIST) {
        TKV_LOG(TKV_LOG_ERROR, "L3 directory %s: %s", o->l3_dir, strerror(errno));
        rc = TKV_EIO;
        goto out;
    }
    if ((rc = tkv_l3_opts_set_fingerprint(lo, s->fp)) != TKV_OK ||
        (rc = tkv_l3_opts_set_zstd_level(lo, o->zstd_level)) != TKV_OK ||
        (rc = tkv_l3_opts_set_io_mode(lo, o->io_mode)) != TKV_OK ||
        (rc = tkv_l3_opts_set_max_block_bytes(lo, s->block_bytes)) != TKV_OK)
        goto out;
    rc = tkv_l3_open(o->l3_dir, lo, &s->l3);
    if (rc != TKV_OK) {
        TKV_LOG(TKV_LOG_ERROR, "opening L3 in %s: %s", o->l3_dir, tkv_strerror(rc));
        goto out;
    }
    tkv_l3_stats l3st;
    tkv_l3_get_stats(s->l3, &l3st);
    s->l3_readonly = l3st.readonly != 0;

    /* Load the L3 index: every block there is READY in L3; parent keys rebuild chains. */
    load_ctx lc = {.s = s};
    wr_lock(s);
    lock(s);
    rc = tkv_l3_scan(s->l3, load_one, &lc);
    if (rc == TKV_OK) {
        tkv_index_foreach(s->ix, fix_depth, NULL);
        tkv_index_foreach(s->ix, enter_l3, s);
    }
    unlock(s);
    idx_unlock(s);
    if (rc != TKV_OK) {
        TKV_LOG(TKV_LOG_ERROR, "loading the L3 index: %s", tkv_strerror(rc));
        goto out;
    }
    if (lc.skipped)
        TKV_LOG(TKV_LOG_WARN, "L3: %llu records of another block size ignored",
                (unsigned long long)lc.skipped);
    if (lc.unowned)
        TKV_LOG(TKV_LOG_WARN, "L3: %llu blocks of a tenant this store does not know; they "
                "belong to no tenant", (unsigned long long)lc.unowned);
    TKV_LOG(TKV_LOG_INFO, "L3 %s: %llu blocks loaded%s", o->l3_dir,
            (unsigned long long)lc.loaded, s->l3_readonly ? " (read-only)" : "");
out:
    tkv_l3_opts_free(lo);
    return rc;
}

int tkv_store_open(const tkv_store_opts *o, tkv_store **out)
{
    tkv_store *s = NULL;
    int rc = TKV_EINVAL;
    if (!o || !out)
        goto fail;
    *out = NULL;
    if (!o->have_block || !o->have_fp) {
        TKV_LOG(TKV_LOG_ERROR, "store options need the block size and the fingerprint");
        goto fail;
    }
    const tkv_policy_ops *ops = o->policy ? tkv_policy_find(o->policy) : NULL;
    if (!ops)
        ops = tkv_policy_find("hazard");
    if (!ops)
        ops = &tkv_policy_lru;

    s = tkv_xcalloc(1, sizeof(*s));
    s->block_bytes = o->block_bytes;
    s->block_tokens = o->block_tokens;
    memcpy(s->fp, o->fp, TKV_KEY_BYTES);
    s->write_through = o->write_through;
    s->ttl_default_ms = o->ttl_default_ms;
    s->ttl_max_ms = o->ttl_max_ms;
    s->l4 = o->l4;
    /* Writer preference: glibc's default lets a steady stream of lookups starve a put. */
    pthread_rwlockattr_t rwa;
    pthread_rwlockattr_init(&rwa);
    pthread_rwlockattr_setkind_np(&rwa, PTHREAD_RWLOCK_PREFER_WRITER_NONRECURSIVE_NP);
    pthread_rwlock_init(&s->idx_lock, &rwa);
    pthread_rwlockattr_destroy(&rwa);
    pthread_mutex_init(&s->mu, NULL);
    cond_init_mono(&s->cv_work);
    cond_init_mono(&s->cv_done);
    cond_init_mono(&s->cv_reap);
    s->leases = tkv_lease_table_new();
    s->next_alloc_id = 1;
    s->next_ticket = 1;
    s->ix = tkv_index_new(o->l2_blocks);

    /* Region 0 (tenant 0 and every tenant without a region of its own) gets what the
     * tenants' own regions leave of l2_blocks; then one region per such tenant. */
    uint64_t region_slots[TKV_POOL_MAX_REGIONS], own = 0;
    s->num_regions = 1;
    for (unsigned i = 1; i < TKV_STORE_TENANTS_MAX; i++) {
        if (!o->l2_region[i])
            continue;
        if (s->num_regions == TKV_POOL_MAX_REGIONS) {
            TKV_LOG(TKV_LOG_ERROR, "more than %d L2 regions", TKV_POOL_MAX_REGIONS);
            goto fail;
        }
        own += o->l2_region[i];
        s->region_of[i] = (uint8_t)s->num_regions;
        region_slots[s->num_regions++] = o->l2_region[i];
    }
    if (own > o->l2_blocks) {
        TKV_LOG(TKV_LOG_ERROR, "the tenants' L2 regions (%llu blocks) exceed L2 (%llu blocks)",
                (unsigned long long)own, (unsigned long long)o->l2_blocks);
        goto fail;
    }
    region_slots[0] = o->l2_blocks - own;
    rc = tkv_pool_create_regions("tierkv-l2", o->block_bytes, region_slots, s->num_regions,
                                 &s->pool);
    if (rc != TKV_OK)
        goto fail;

    /* Tiers are indexed by TKV_TIER_*; L1 is there when a backend was given. */
    uint64_t l1_own = 0;
    s->l1_num_regions = 1;
    if (o->l1_ops) {
        for (unsigned i = 1; i < TKV_STORE_TENANTS_MAX; i++) {
            if (!o->l1_region[i])
                continue;
            s->l1_region_of[i] = (uint8_t)s->l1_num_regions;
            s->l1_size[s->l1_num_regions++] = o->l1_region[i];
            l1_own += o->l1_region[i];
        }
        if (l1_own > o->l1_blocks) {
            TKV_LOG(TKV_LOG_ERROR, "the tenants' L1 regions (%llu blocks) exceed L1 (%llu blocks)",
                    (unsigned long long)l1_own, (unsigned long long)o->l1_blocks);
            rc = TKV_EINVAL;
            goto fail;
        }
        s->l1_size[0] = o->l1_blocks - l1_own;
        s->l1_ops = o->l1_ops;
        s->l1_ctx = o->l1_ctx;
        s->l1_free = tkv_xmalloc(o->l1_blocks * sizeof(uint64_t));
        uint64_t first = 0;
        for (unsigned r = 0; r < s->l1_num_regions; r++) {
            s->l1_first[r] = first;
            for (uint64_t i = 0; i < s->l1_size[r]; i++) /* lowest slot on top: low offsets first */
                s->l1_free[first + i] = first + s->l1_size[r] - 1 - i;
            s->l1_nfree[r] = s->l1_size[r];
            first += s->l1_size[r];
        }
        s->tiers[TKV_TIER_L1].enabled = true;
        s->tiers[TKV_TIER_L1].capacity_blocks = o->l1_blocks;
    }
    s->tiers[TKV_TIER_L2].enabled = true;
    s->tiers[TKV_TIER_L2].capacity_blocks = o->l2_blocks;
    for (unsigned i = 0; i < TKV_STORE_TENANTS_MAX; i++) {
        s->tn[i].l4_max = o->l4_max[i];
        s->tn[i].tag = tenant_tag_of(i, o->tenant_name[i]);
        for (int t = TKV_TIER_L1; t <= TKV_TIER_L3; t++) {
            s->tn[i].max[t] = o->tq_max[t][i];
            s->tn[i].guar[t] = o->tq_guar[t][i];
            if (o->tq_max[t][i] || o->tq_guar[t][i])
                s->tenant_limits[t] = true;
        }
        if (o->tenant_name[i])
            s->tn[i].name = tkv_xstrdup(o->tenant_name[i]);
    }
    s->tiers[TKV_TIER_L3].enabled = o->l3_dir != NULL;
    /* L3 capacity in blocks of raw size (what the manager counts); 0 bytes = unlimited. */
    uint64_t l3_blocks = o->l3_capacity_bytes / o->block_bytes;
    s->tiers[TKV_TIER_L3].capacity_blocks = !o->l3_dir                ? 0
                                            : !o->l3_capacity_bytes ? UINT64_MAX
                                            : l3_blocks ? l3_blocks : 1;
    for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++) {
        tier *T = &s->tiers[t];
        T->ops = ops;
        unsigned nr = t == TKV_TIER_L2 ? s->num_regions : t == TKV_TIER_L1 ? s->l1_num_regions : 1;
        for (unsigned r = 0; r < nr; r++) {
            uint64_t cap = t == TKV_TIER_L2 && s->num_regions > 1      ? region_slots[r]
                           : t == TKV_TIER_L1 && s->l1_num_regions > 1 ? s->l1_size[r]
                                                                       : T->capacity_blocks;
            void *ps = ops->create(cap ? cap : 1);
            if (!ps) {
                TKV_LOG(TKV_LOG_ERROR, "policy %s refused tier %d", ops->name, t);
                rc = TKV_EINVAL;
                goto fail;
            }
            if (t == TKV_TIER_L2)
                s->l2_ps[r] = ps;
            if (t == TKV_TIER_L1)
                s->l1_ps[r] = ps;
            if (r == 0)
                T->pstate = ps;
        }
    }

    if (o->l3_dir && (rc = open_l3(s, o)) != TKV_OK)
        goto fail;

    s->num_workers = o->workers;
    /* L3 compresses on the calling thread, so write-back scales with concurrent batches;
     * one worker is always left for prefetches. */
    s->wb_max_running = o->workers > 1 ? o->workers - 1 : 1;
    s->workers = tkv_xcalloc(o->workers, sizeof(pthread_t));
    for (unsigned i = 0; i < o->workers; i++) {
        if (pthread_create(&s->workers[i], NULL, worker_main, s) != 0) {
            s->num_workers = i;
            rc = TKV_ENOMEM;
            goto fail;
        }
    }
    if (pthread_create(&s->reaper, NULL, reaper_main, s) != 0) {
        rc = TKV_ENOMEM;
        goto fail;
    }
    s->reaper_started = true;
    TKV_LOG(TKV_LOG_INFO, "store open: L2 %llu x %zu bytes, L3 %s, policy %s, %u workers",
            (unsigned long long)o->l2_blocks, o->block_bytes, o->l3_dir ? o->l3_dir : "off",
            ops->name, o->workers);
    *out = s;
    return TKV_OK;

fail:
    tkv_store_close(s);
    return rc;
}

static void release_lease_pins(void *arg, tkv_lease *l)
{
    tkv_store *s = arg;
    for (size_t i = 0; i < l->num_entries; i++)
        entry_unpin(s, l->entries[i]);
    tkv_lease_del(s->leases, l);
}

void tkv_store_close(tkv_store *s)
{
    if (!s)
        return;
    lock(s);
    s->closing = true;
    pthread_cond_broadcast(&s->cv_work);
    pthread_cond_broadcast(&s->cv_reap);
    pthread_cond_broadcast(&s->cv_done);
    unlock(s);
    for (unsigned i = 0; i < s->num_workers; i++)
        pthread_join(s->workers[i], NULL);
    if (s->reaper_started)
        pthread_join(s->reaper, NULL);
    free(s->workers);

    /* Workers drained both queues; drop leases (freeing entries only they kept alive). */
    lock(s);
    tkv_lease_foreach(s->leases, release_lease_pins, s);
    while (s->allocs) {
        alloc_rec *a = s->allocs;
        s->allocs = a->next;
        alloc_free(s, a, 0);
    }
    while (s->tickets) {
        ticket *t = s->tickets;
        s->tickets = t->next;
        free(t);
    }
    unlock(s);

    tkv_lease_table_free(s->leases);
    tkv_index_free(s->ix);
    for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++)
        if (s->tiers[t].pstate && t != TKV_TIER_L2 && t != TKV_TIER_L1)
            s->tiers[t].ops->destroy(s->tiers[t].pstate);
    for (unsigned r = 0; r < TKV_POOL_MAX_REGIONS; r++)
        if (s->l1_ps[r])
            s->tiers[TKV_TIER_L1].ops->destroy(s->l1_ps[r]);
    for (unsigned r = 0; r < TKV_POOL_MAX_REGIONS; r++)
        if (s->l2_ps[r])
            s->tiers[TKV_TIER_L2].ops->destroy(s->l2_ps[r]);
    for (unsigned i = 0; i < TKV_STORE_TENANTS_MAX; i++)
        free(s->tn[i].name);
    tkv_pool_destroy(s->pool);
    free(s->l1_free);
    tkv_l3_close(s->l3);
    pthread_cond_destroy(&s->cv_work);
    pthread_cond_destroy(&s->cv_done);
    pthread_cond_destroy(&s->cv_reap);
    pthread_mutex_destroy(&s->mu);
    pthread_rwlock_destroy(&s->idx_lock);
    free(s);
}

/* ============================================================================================
 * L2 pool accessors
 * ========================================================================================== */

int tkv_store_l2_fd(const tkv_store *s) { return s ? tkv_pool_fd(s->pool) : -1; }

int tkv_store_l2_region(const tkv_store *s, unsigned tenant, uint64_t *offset, uint64_t *bytes,
                        int *fd, int *fd_readonly)
{
    if (!s || tenant >= TKV_STORE_TENANTS_MAX)
        return TKV_EINVAL;
    unsigned r = s->region_of[tenant];
    size_t stride = tkv_pool_slot_stride(s->pool);
    if (offset)
        *offset = tkv_pool_region_first(s->pool, r) * stride;
    if (bytes)
        *bytes = tkv_pool_region_slots(s->pool, r) * stride;
    if (fd)
        *fd = tkv_pool_region_fd(s->pool, r);
    if (fd_readonly)
        *fd_readonly = tkv_pool_region_fd_readonly(s->pool, r);
    return TKV_OK;
}

unsigned tkv_store_l2_num_regions(const tkv_store *s) { return s ? s->num_regions : 0; }

int tkv_store_l2_region_at(const tkv_store *s, unsigned r, uint64_t *offset, uint64_t *bytes)
{
    if (!s || r >= s->num_regions)
        return TKV_EINVAL;
    size_t stride = tkv_pool_slot_stride(s->pool);
    *offset = tkv_pool_region_first(s->pool, r) * stride;
    *bytes = tkv_pool_region_slots(s->pool, r) * stride;
    return TKV_OK;
}
int tkv_store_l2_fd_readonly(const tkv_store *s) { return s ? tkv_pool_fd_readonly(s->pool) : -1; }
uint64_t tkv_store_l2_bytes(const tkv_store *s) { return s ? tkv_pool_bytes(s->pool) : 0; }
size_t tkv_store_block_bytes(const tkv_store *s) { return s ? s->block_bytes : 0; }
size_t tkv_store_l2_slot_stride(const tkv_store *s) { return s ? tkv_pool_slot_stride(s->pool) : 0; }
uint32_t tkv_store_block_tokens(const tkv_store *s) { return s ? s->block_tokens : 0; }

void *tkv_store_l2_ptr(tkv_store *s, uint64_t offset)
{
    if (!s)
        return NULL;
    uint64_t slot = tkv_pool_slot_of_offset(s->pool, offset);
    return slot == UINT64_MAX ? NULL : slot_ptr(s, slot);
}

tkv_l3 *tkv_store_l3_handle(tkv_store *s) { return s ? s->l3 : NULL; }

/* ============================================================================================
 * Lookup and leases
 * ========================================================================================== */

static uint64_t ttl_deadline(const tkv_store *s, uint32_t ttl_ms, uint64_t now_ns)
{
    if (ttl_ms == 0)
        ttl_ms = s->ttl_default_ms;
    if (ttl_ms > s->ttl_max_ms)
        ttl_ms = s->ttl_max_ms;
    return now_ns + (uint64_t)ttl_ms * 1000000ull;
}

static void lease_expire(tkv_store *s, tkv_lease *l, uint64_t now_ns)
{
    for (size_t i = 0; i < l->num_entries; i++)
        entry_unpin(s, l->entries[i]);
    tkv_lease_mark_expired(s->leases, l, now_ns);
    s->st.leases_expired++;
}

/* mu held: the live lease `id`, or NULL with *rc = TKV_ENOTFOUND / TKV_EXPIRED. */
static tkv_lease *lease_live(tkv_store *s, uint64_t id, int *rc)
{
    tkv_lease *l = tkv_lease_get(s->leases, id);
    if (!l) {
        *rc = TKV_ENOTFOUND;
        return NULL;
    }
    if (!l->expired_at_ns) {
        uint64_t now = tkv_now_ns();
        if (l->deadline_ns > now)
            return l;
        lease_expire(s, l, now);
    }
    *rc = TKV_EXPIRED;
    return NULL;
}

static void l4_fill(tkv_store *s, unsigned tn, const tkv_key *keys, size_t num_keys);

/* mu held: may tenant tn's lookup see e? Tenant 0 sees everything (the store without tenants);
 * a tenant sees its own blocks and those of no tenant (loaded from L3 at open), never
 * another's, so even a key shared by mistake reveals nothing. */
static bool visible_to(const tkv_entry *e, unsigned tn)
{
    return tn == 0 || e->tenant == tn || e->tenant == 0;
}

/* mu held: a block of no tenant (loaded from L3 at open: the L3 record keeps no tenant) that
 * tenant tn looked up becomes tn's: only tn's chain reaches its key. Not while it sits in
 * another region's L2 or is in flight (its counts there are the old tenant's). */
static void entry_adopt(tkv_store *s, tkv_entry *e, unsigned tn)
{
    if (tn == 0 || e->tenant != 0 || (e->flags & (F_WB | F_PROMOTING)) ||
        ((e->resident & RES(TKV_TIER_L2)) && s->region_of[0] != s->region_of[tn]) ||
        ((e->resident & RES(TKV_TIER_L1)) && s->l1_region_of[0] != s->l1_region_of[tn]))
        return;
    for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++)
        if (e->resident & RES(t)) {
            s->tn[0].blocks[t]--;
            s->tn[tn].blocks[t]++;
        }
    e->tenant = (uint8_t)tn;
}

static int lookup_local(tkv_store *s, unsigned tn, const tkv_key *keys, size_t num_keys,
                        uint64_t owner,
                        uint32_t ttl_ms, uint64_t *lease_id, size_t *num_hit,
                        tkv_block_loc *locs)
{
    if (!s || (!keys && num_keys) || !lease_id || !num_hit || num_keys > MAX_KEYS_PER_CALL)
        return TKV_EINVAL;
    *lease_id = 0;
    *num_hit = 0;
    tkv_entry *stack_ents[256];
    tkv_entry **ents = num_keys <= 256 ? stack_ents : tkv_xmalloc(num_keys * sizeof(*ents));
    int rc = TKV_OK;

    rd_lock(s);
    size_t m = tkv_index_prefix(s->ix, keys, num_keys, ents);
    uint64_t now = tkv_now_ns(), wall = tkv_wall_ms();
    lock(s);
    if (s->closing) {
        rc = TKV_ECLOSED;
        goto out;
    }
    size_t hit = 0;
    while (hit < m && ents[hit]->state == TKV_BLOCK_READY && ents[hit]->resident &&
           visible_to(ents[hit], tn))
        hit++;
    s->st.lookups++;
    s->st.lookup_keys += num_keys;
    s->st.hit_blocks += hit;
    s->st.miss_blocks += num_keys - hit;
    for (size_t i = 0; i < hit; i++) {
        tkv_entry *e = ents[i];
        entry_adopt(s, e, tn);
        entry_pin(s, e);
        e->hits++;
        e->last_access_ms = wall;
        for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++)
            if (e->resident & RES(t))
                s->tiers[t].ops->accessed(pstate_of(s, t, e->tenant), &e->pe[t], now);
        if (locs) {
            locs[i] = entry_loc(s, e);
            s->st.hit_blocks_tier[locs[i].tier]++;
        } else {
            s->st.hit_blocks_tier[(e->resident & RES(TKV_TIER_L2)) ? TKV_TIER_L2 : TKV_TIER_L3]++;
        }
    }
    if (hit) {
        tkv_lease *l = tkv_lease_add(s->leases, owner, ttl_deadline(s, ttl_ms, now), ents, hit);
        *lease_id = l->id;
    }
    *num_hit = hit;
out:
    unlock(s);
    idx_unlock(s);
    if (ents != stack_ents)
        free(ents);
    return rc;
}

/* No locks held: where the local tiers end short of the chain, reads what follows from the
 * shared tier and stores it through the put path (admission, write-through to L3): the
 * promotion L4 -> L2 happens here, not at prefetch, because a lease can pin only what a
 * local tier holds; Redis may drop a value at any time. At most a quarter of L2 per lookup. */
static void l4_fill(tkv_store *s, unsigned tn, const tkv_key *keys, size_t num_keys)
{
    tkv_entry *stack_ents[256];
    tkv_entry **ents = num_keys <= 256 ? stack_ents : tkv_xmalloc(num_keys * sizeof(*ents));
    rd_lock(s);
    size_t m = tkv_index_prefix(s->ix, keys, num_keys, ents);
    lock(s);
    size_t hit = 0;
    while (hit < m && ents[hit]->state == TKV_BLOCK_READY && ents[hit]->resident &&
           visible_to(ents[hit], tn))
        hit++;
    bool closing = s->closing;
    unlock(s);
    idx_unlock(s);
    if (ents != stack_ents)
        free(ents);
    if (closing || hit == num_keys)
        return;
    size_t want = num_keys - hit;
    uint64_t cap = tkv_pool_region_slots(s->pool, s->region_of[tn]) / 4;
    if (want > cap)
        want = cap ? (size_t)cap : 1;
    tkv_l4_block *b = tkv_xcalloc(want, sizeof(*b));
    size_t found = 0;
    tkv_l4_fetch_prefix(s->l4, keys + hit, want, b, &found);
    if (found) {
        const void **pays = tkv_xmalloc(found * sizeof(*pays));
        uint32_t *toks = tkv_xmalloc(found * s->block_tokens * sizeof(uint32_t));
        for (size_t i = 0; i < found; i++) {
            pays[i] = b[i].payload;
            memcpy(toks + i * s->block_tokens, b[i].tokens, s->block_tokens * sizeof(uint32_t));
        }
        /* Through the tenant's put: its region, its quota, its blocks. */
        tkv_store_put_as(s, tn, hit ? &keys[hit - 1] : NULL, keys + hit, toks,
                         (const void *const *)pays, found, NULL);
        free(pays);
        free(toks);
    }
    tkv_l4_blocks_free(b, found);
    free(b);
}

int tkv_store_lookup(tkv_store *s, const tkv_key *keys, size_t num_keys, uint64_t owner,
                     uint32_t ttl_ms, uint64_t *lease_id, size_t *num_hit, tkv_block_loc *locs)
{
    return tkv_store_lookup_as(s, 0, keys, num_keys, owner, ttl_ms, lease_id, num_hit, locs);
}

int tkv_store_lookup_as(tkv_store *s, unsigned tenant, const tkv_key *keys, size_t num_keys,
                        uint64_t owner, uint32_t ttl_ms, uint64_t *lease_id, size_t *num_hit,
                        tkv_block_loc *locs)
{
    if (tenant >= TKV_STORE_TENANTS_MAX)
        return TKV_EINVAL;
    if (s && s->l4 && keys && num_keys && num_keys <= MAX_KEYS_PER_CALL)
        l4_fill(s, tenant, keys, num_keys);
    return lookup_local(s, tenant, keys, num_keys, owner, ttl_ms, lease_id, num_hit, locs);
}

int tkv_store_lease_locs(tkv_store *s, uint64_t lease_id, tkv_block_loc *locs, size_t cap,
                         size_t *num_blocks)
{
    if (!s || (!locs && cap))
        return TKV_EINVAL;
    int rc = TKV_OK;
    lock(s);
    tkv_lease *l = lease_live(s, lease_id, &rc);
    if (l) {
        for (size_t i = 0; i < l->num_entries && i < cap; i++)
            locs[i] = entry_loc(s, l->entries[i]);
        if (num_blocks)
            *num_blocks = l->num_entries;
    }
    unlock(s);
    return rc;
}

int tkv_store_lease_touch(tkv_store *s, uint64_t lease_id, uint32_t ttl_ms)
{
    if (!s)
        return TKV_EINVAL;
    int rc = TKV_OK;
    lock(s);
    tkv_lease *l = lease_live(s, lease_id, &rc);
    if (l)
        l->deadline_ns = ttl_deadline(s, ttl_ms, tkv_now_ns());
    unlock(s);
    return rc;
}

int tkv_store_lease_owner(tkv_store *s, uint64_t lease_id, uint64_t *owner)
{
    if (!s || !owner)
        return TKV_EINVAL;
    int rc = TKV_OK;
    lock(s);
    tkv_lease *l = lease_live(s, lease_id, &rc);
    if (l)
        *owner = l->owner;
    unlock(s);
    return rc;
}

int tkv_store_lease_release(tkv_store *s, uint64_t lease_id)
{
    if (!s)
        return TKV_EINVAL;
    int rc = TKV_OK;
    lock(s);
    tkv_lease *l = lease_live(s, lease_id, &rc);
    if (l)
        release_lease_pins(s, l);
    else if (rc == TKV_EXPIRED) /* answered once; the record has done its job */
        tkv_lease_del(s->leases, tkv_lease_get(s->leases, lease_id));
    unlock(s);
    return rc;
}

typedef struct owner_ctx {
    tkv_store *s;
    uint64_t owner;
    size_t count;
} owner_ctx;

static void release_if_owner(void *arg, tkv_lease *l)
{
    owner_ctx *oc = arg;
    if (l->owner != oc->owner)
        return;
    if (!l->expired_at_ns)
        oc->count++;
    release_lease_pins(oc->s, l);
}

/* mu held: returns an unused slot of tier t (L1 or L2) to its free set. */
static void slot_free(tkv_store *s, int t, uint64_t slot)
{
    if (t == TKV_TIER_L1)
        l1_slot_free(s, slot);
    else
        tkv_pool_free(s->pool, slot);
}

static void alloc_free(tkv_store *s, alloc_rec *a, size_t from)
{
    if (a->tier == TKV_TIER_L2)
        s->tn[a->tenant].reserved_l2 -= a->n;
    else
        s->tn[a->tenant].reserved_l1 -= a->n;
    for (size_t i = from; i < a->n; i++)
        slot_free(s, a->tier, a->slots[i]);
    free(a->slots);
    free(a);
}

/* mu held: removes an allocation from the table; frees it unless a writer is copying. */
static void alloc_end(tkv_store *s, alloc_rec *a)
{
    alloc_rec **pp = &s->allocs;
    while (*pp != a)
        pp = &(*pp)->next;
    *pp = a->next;
    s->num_allocs--;
    if (a->writers)
        a->dead = true;
    else
        alloc_free(s, a, 0);
}

size_t tkv_store_release_owner(tkv_store *s, uint64_t owner)
{
    if (!s)
        return 0;
    owner_ctx oc = {.s = s, .owner = owner};
    lock(s);
    tkv_lease_foreach(s->leases, release_if_owner, &oc);
    for (alloc_rec *a = s->allocs, *next; a; a = next) {
        next = a->next;
        if (a->owner == owner) {
            alloc_end(s, a);
            oc.count++;
        }
    }
    unlock(s);
    return oc.count;
}

typedef struct reap_ctx {
    tkv_store *s;
    uint64_t now;
} reap_ctx;

static void reap_one(void *arg, tkv_lease *l)
{
    reap_ctx *r = arg;
    if (!l->expired_at_ns && l->deadline_ns <= r->now)
        lease_expire(r->s, l, r->now);
    else if (l->expired_at_ns && l->expired_at_ns + EXPIRED_KEEP_NS <= r->now)
        tkv_lease_del(r->s->leases, l);
}

/* Expires leases a few times per TTL granule: pins of a dead client never outlive their TTL
 * by more than ~50 ms. Lease calls also check the deadline themselves (lease_live). */
static void *reaper_main(void *arg)
{
    tkv_store *s = arg;
    lock(s);
    while (!s->closing) {
        cond_wait_until(&s->cv_reap, &s->mu, tkv_now_ns() + 50000000ull);
        reap_ctx r = {s, tkv_now_ns()};
        tkv_lease_foreach(s->leases, reap_one, &r);
    }
    unlock(s);
    return NULL;
}

/* ============================================================================================
 * put: insert WRITING entries and take slots (locked), copy + checksum (unlocked), publish
 * ========================================================================================== */

static const tkv_key zero_key;

/* Stores one chunk (at most a quarter of L2, so a large put streams through L2 while
 * write-back drains it). new_ents/slots are scratch arrays of n entries. */
/* mu held: the L2 policy's verdict on new entry e under parent pe (may be NULL). Refused
 * blocks are kept when a writable L3 can take them (and l2_copy: they have an L2 slot to go
 * down from): marked F_DROP_L2, they pass through L2 and leave it once durable. Returns false
 * when e is not to be stored at all. */
static bool l2_admit(tkv_store *s, tkv_entry *e, tkv_entry *pe, uint64_t now, bool l2_copy)
{
    tier *T2 = &s->tiers[TKV_TIER_L2];
    tkv_policy_entry probe = {0};
    probe.depth = e->depth;
    probe.key_fp = tkv_key_fp(&e->key);
    probe.parent = pe && (pe->resident & RES(TKV_TIER_L2)) ? &pe->pe[TKV_TIER_L2] : NULL;
    if (T2->ops->admit(pstate_of(s, TKV_TIER_L2, e->tenant), &probe, now))
        return true;
    if (!l3_writable(s) || !l2_copy)
        return false;
    e->flags |= F_DROP_L2;
    return true;
}

static int put_chunk(tkv_store *s, unsigned tn, const tkv_key *parent, bool parent_in_put,
                     const tkv_key *keys, const uint32_t *tokens, const void *const *payloads,
                     size_t n, tkv_entry **ents, size_t *idx, uint64_t *slots,
                     size_t *num_stored)
{
    int rc = TKV_OK;
    size_t m = 0, got = 0, dup = 0, rejected = 0, no_room = 0;

    wr_lock(s);
    lock(s);
    if (s->closing) {
        rc = TKV_ECLOSED;
        goto unlock_out;
    }
    uint64_t now = tkv_now_ns();
    const tkv_key *first_pk = parent ? parent : &zero_key; /* the key the chunk hangs under */
    for (size_t i = 0; i < n; i++) {
        const tkv_key *pk = i ? &keys[i - 1] : first_pk;
        if (tkv_index_find(s->ix, &keys[i])) {
            dup++;
            continue;
        }
        tkv_entry *pe = tkv_index_find(s->ix, pk);
        tkv_entry *e = tkv_entry_new(&keys[i], pk, pe ? pe->depth + 1 : 0);
        e->state = TKV_BLOCK_WRITING;
        e->tenant = (uint8_t)tn;
        /* Still asked when the block before it in this put was not stored (the policy sees
         * the whole put), but then not stored either: no lookup could reach it. */
        bool reachable = pe || (i == 0 && !parent_in_put);
        if (!l2_admit(s, e, pe, now, true) || !reachable) {
            tkv_entry_free(e);
            rejected++;
            continue;
        }
        rc = tkv_index_insert(s->ix, e);
        TKV_ASSERT(rc == TKV_OK);
        ents[m] = e;
        idx[m] = i;
        m++;
    }
    /* While demotions make room, our WRITING entries keep claiming their keys. The room is
     * not taken from the chain the chunk hangs under, nor (where evicted blocks are dropped,
     * not demoted) from the middle of any chain: either would leave cached blocks under a
     * gap, where no lookup reaches them. So the block the chunk hangs under is pinned, and
     * without a writable L3 only tails are evicted; the chunk stores the prefix that fits. */
    tkv_entry *under = m ? tkv_index_find(s->ix, first_pk) : NULL;
    if (under && !(under->resident & RES(TKV_TIER_L2)))
        under = NULL;
    if (under)
        entry_pin(s, under);
    reserve_slots(s, TKV_TIER_L2, tn, m, !l3_writable(s), slots, &got);
    if (under)
        entry_unpin(s, under);
    rc = TKV_OK;
    /* Blocks that found no slot are not stored (the prefix of the chunk is kept). */
    for (size_t j = got; j < m; j++) {
        ents[j]->state = 0;
        tkv_index_remove(s->ix, ents[j]);
        tkv_entry_free(ents[j]);
        no_room++;
    }
    m = got;
    for (size_t j = 0; j < m; j++)
        ents[j]->l2_slot = slots[j];
    s->tn[tn].reserved_l2 += m; /* until they enter L2 below */
    unlock(s);
    idx_unlock(s);

    /* Copy and checksum with no lock held: the entries are WRITING, invisible and unevictable. */
    for (size_t j = 0; j < m; j++) {
        ents[j]->csum = tkv_csum64_copy(slot_ptr(s, slots[j]), payloads[idx[j]], s->block_bytes);
        ents[j]->flags |= F_CSUM;
    }

    lock(s);
    now = tkv_now_ns();
    uint64_t wall = tkv_wall_ms();
    bool l4_now[256]; /* blocks that reach L4 from here, not through write-back */
    TKV_ASSERT(m <= 256);
    s->tn[tn].reserved_l2 -= m;
    for (size_t j = 0; j < m; j++) {
        tkv_entry *e = ents[j];
        entry_set_tokens(s, e, tokens + idx[j] * (size_t)s->block_tokens);
        e->state = TKV_BLOCK_READY;
        e->last_access_ms = wall;
        tier_enter(s, e, TKV_TIER_L2, now);
        if (s->write_through || (e->flags & F_DROP_L2))
            wb_queue(s, e);
        l4_now[j] = s->l4 && !(e->flags & F_WB);
    }
    s->st.put_blocks += n;
    s->st.put_dup_blocks += dup;
    s->st.put_rejected_blocks += rejected + no_room;
    refusal_line line;
    bool log_it = refusal_note(s, tn, TKV_TIER_L2, no_room, &line);
    *num_stored += m;
    /* A put the policy did not admit is an answer, not an error: the caller learns it from
     * num_stored. Only admitted blocks that found no room at all are a failure. */
    if (m == 0 && no_room > 0)
        rc = TKV_EFULL;
    unlock(s);
    if (log_it)
        refusal_log(s, tn, TKV_TIER_L2, no_room, &line, "put found no room");
    for (size_t j = 0; j < m; j++)
        if (l4_now[j])
            l4_put_as(s, tn, &keys[idx[j]], idx[j] ? &keys[idx[j] - 1] : first_pk,
                      tokens + idx[j] * (size_t)s->block_tokens, s->block_tokens,
                      payloads[idx[j]], s->block_bytes);
    return rc;
unlock_out:
    unlock(s);
    idx_unlock(s);
    return rc;
}

int tkv_store_put(tkv_store *s, const tkv_key *parent, const tkv_key *keys,
                  const uint32_t *tokens, const void *const *payloads, size_t num_blocks,
                  size_t *num_stored)
{
    return tkv_store_put_as(s, 0, parent, keys, tokens, payloads, num_blocks, num_stored);
}

int tkv_store_put_as(tkv_store *s, unsigned tenant, const tkv_key *parent, const tkv_key *keys,
                     const uint32_t *tokens, const void *const *payloads, size_t num_blocks,
                     size_t *num_stored)
{
    size_t stored = 0;
    if (num_stored)
        *num_stored = 0;
    if (!s || tenant >= TKV_STORE_TENANTS_MAX || (num_blocks && (!keys || !tokens || !payloads)) || num_blocks > MAX_KEYS_PER_CALL)
        return TKV_EINVAL;
    for (size_t i = 0; i < num_blocks; i++)
        if (!payloads[i])
            return TKV_EINVAL;
    uint64_t l2_cap = tkv_pool_region_slots(s->pool, s->region_of[tenant]);
    size_t chunk = l2_cap / 4 ? (size_t)(l2_cap / 4) : 1;
    if (chunk > 256)
        chunk = 256;
    if (chunk > num_blocks)
        chunk = num_blocks ? num_blocks : 1;
    tkv_entry **ents = tkv_xmalloc(chunk * sizeof(*ents));
    size_t *idx = tkv_xmalloc(chunk * sizeof(*idx));
    uint64_t *slots = tkv_xmalloc(chunk * sizeof(*slots));
    int rc = TKV_OK;
    for (size_t off = 0; off < num_blocks; off += chunk) {
        size_t n = num_blocks - off < chunk ? num_blocks - off : chunk;
        rc = put_chunk(s, tenant, off ? &keys[off - 1] : parent, off > 0, keys + off,
                       tokens + off * (size_t)s->block_tokens, payloads + off, n, ents, idx,
                       slots, &stored);
        if (rc != TKV_OK)
            break;
    }
    /* A chunk that found no room ends the put (the rest would hang under it); the put failed
     * only if nothing at all was stored. */
    if (rc == TKV_EFULL && stored > 0)
        rc = TKV_OK;
    lock(s);
    s->st.puts++;
    unlock(s);
    free(ents);
    free(idx);
    free(slots);
    if (num_stored)
        *num_stored = stored;
    return rc;
}

/* ============================================================================================
 * alloc -> write -> commit
 * ========================================================================================== */

int tkv_store_alloc(tkv_store *s, size_t n, uint64_t owner, uint64_t *alloc_id,
                    uint64_t *offsets)
{
    return tkv_store_alloc_tier(s, TKV_TIER_L2, n, owner, alloc_id, offsets);
}

int tkv_store_alloc_tier(tkv_store *s, int tier_id, size_t n, uint64_t owner,
                         uint64_t *alloc_id, uint64_t *offsets)
{
    return tkv_store_alloc_as(s, 0, tier_id, n, owner, alloc_id, offsets);
}

int tkv_store_alloc_as(tkv_store *s, unsigned tenant, int tier_id, size_t n, uint64_t owner,
                       uint64_t *alloc_id, uint64_t *offsets)
{
    if (!s || n == 0 || !alloc_id || !offsets || tenant >= TKV_STORE_TENANTS_MAX)
        return TKV_EINVAL;
    if (tier_id == TKV_TIER_L1 && !s->l1_ops)
        return TKV_EUNSUPPORTED;
    if (tier_id != TKV_TIER_L1 && tier_id != TKV_TIER_L2)
        return TKV_EINVAL;
    if (n > (tier_id == TKV_TIER_L2 ? tkv_pool_region_slots(s->pool, s->region_of[tenant])
                                    : s->l1_size[s->l1_region_of[tenant]]))
        return TKV_EFULL;
    uint64_t *slots = tkv_xmalloc(n * sizeof(*slots));
    size_t got = 0;
    refusal_line line;
    bool log_it = false;
    wr_lock(s);
    lock(s);
    int rc = reserve_slots(s, tier_id, tenant, n, false, slots, &got);
    if (rc == TKV_OK) {
        alloc_rec *a = tkv_xcalloc(1, sizeof(*a));
        a->id = s->next_alloc_id++;
        a->owner = owner;
        a->tenant = tenant;
        if (tier_id == TKV_TIER_L2) /* until commit or abort */
            s->tn[tenant].reserved_l2 += n;
        else
            s->tn[tenant].reserved_l1 += n;
        a->tier = tier_id;
        a->n = n;
        a->slots = slots;
        a->next = s->allocs;
        s->allocs = a;
        s->num_allocs++;
        for (size_t i = 0; i < n; i++)
            offsets[i] = tier_id == TKV_TIER_L1 ? s->l1_ops->offset(s->l1_ctx, slots[i])
                                                : slot_offset(s, slots[i]);
        *alloc_id = a->id;
        slots = NULL;
    } else {
        for (size_t i = 0; i < got; i++)
            slot_free(s, tier_id, slots[i]);
        log_it = refusal_note(s, tenant, tier_id, n, &line);
    }
    unlock(s);
    idx_unlock(s);
    if (log_it)
        refusal_log(s, tenant, tier_id, n, &line, "allocation found no room");
    free(slots);
    return rc;
}

static alloc_rec *alloc_find(tkv_store *s, uint64_t id)
{
    for (alloc_rec *a = s->allocs; a; a = a->next)
        if (a->id == id)
            return a;
    return NULL;
}

int tkv_store_alloc_owner(tkv_store *s, uint64_t alloc_id, uint64_t *owner)
{
    if (!s || !owner)
        return TKV_EINVAL;
    lock(s);
    alloc_rec *a = alloc_find(s, alloc_id);
    int rc = a && !a->dead ? TKV_OK : TKV_ENOTFOUND;
    if (rc == TKV_OK)
        *owner = a->owner;
    unlock(s);
    return rc;
}

int tkv_store_alloc_write(tkv_store *s, uint64_t alloc_id, uint32_t index, const void *src)
{
    if (!s || !src)
        return TKV_EINVAL;
    lock(s);
    alloc_rec *a = alloc_find(s, alloc_id);
    if (!a || index >= a->n || a->tier != TKV_TIER_L2) {
        unlock(s);
        return a ? TKV_EINVAL : TKV_ENOTFOUND;
    }
    a->writers++;
    void *dst = slot_ptr(s, a->slots[index]);
    unlock(s);
    memcpy(dst, src, s->block_bytes);
    lock(s);
    a->writers--;
    if (a->dead && a->writers == 0)
        alloc_free(s, a, 0);
    pthread_cond_broadcast(&s->cv_done);
    unlock(s);
    return TKV_OK;
}

/* No locks held: copies the first blocks of L1 slots down into newly reserved L2 slots.
 * Returns how many got a copy (a prefix: L2 may be short of room); *out gets a malloc'ed
 * array of their L2 slots. */
static size_t l1_copy_down(tkv_store *s, unsigned tn, const uint64_t *l1slots, size_t n,
                           uint64_t **out)
{
    uint64_t *slots = tkv_xmalloc((n ? n : 1) * sizeof(*slots));
    size_t got = 0;
    wr_lock(s);
    lock(s);
    reserve_slots(s, TKV_TIER_L2, tn, n, false, slots, &got); /* a prefix is enough */
    s->tn[tn].reserved_l2 += got; /* until the commit enters or frees them */
    unlock(s);
    idx_unlock(s);
    if (got) {
        uint64_t *offs = tkv_xmalloc(got * sizeof(*offs));
        for (size_t i = 0; i < got; i++)
            offs[i] = slot_offset(s, slots[i]);
        int rc = s->l1_ops->demote(s->l1_ctx, offs, l1slots, got);
        free(offs);
        lock(s);
        if (rc != TKV_OK) {
            for (size_t i = 0; i < got; i++)
                tkv_pool_free(s->pool, slots[i]);
            s->st.io_errors++;
            s->tn[tn].reserved_l2 -= got;
            got = 0;
        } else {
            s->st.demotions += got;
            s->st.demotion_bytes += got * s->block_bytes;
        }
        unlock(s);
    }
    *out = slots;
    return got;
}

int tkv_store_commit(tkv_store *s, uint64_t alloc_id, const tkv_key *parent,
                     const tkv_key *keys, const uint32_t *tokens, size_t n, size_t *num_stored)
{
    if (num_stored)
        *num_stored = 0;
    if (!s || (n && (!keys || !tokens)))
        return TKV_EINVAL;
    lock(s);
    alloc_rec *a = alloc_find(s, alloc_id);
    int rc = !a ? TKV_ENOTFOUND : n > a->n ? TKV_EINVAL : a->writers ? TKV_EBUSY : TKV_OK;
    if (rc == TKV_OK) { /* take it out: nobody else can write, abort or commit it now */
        alloc_rec **pp = &s->allocs;
        while (*pp != a)
            pp = &(*pp)->next;
        *pp = a->next;
        s->num_allocs--;
    }
    unlock(s);
    if (rc != TKV_OK)
        return rc;

    /* L2 copies: the allocation's own slots, or, for L1 slots, copies made now (so the block
     * is checksummed and can be written through; where L2 has no room, L1 alone holds it). */
    uint64_t *l2slots = a->slots;
    size_t num_l2 = n;
    if (a->tier == TKV_TIER_L1)
        num_l2 = l1_copy_down(s, a->tenant, a->slots, n, &l2slots);
    uint64_t *csums = tkv_xmalloc((n ? n : 1) * sizeof(*csums));
    for (size_t i = 0; i < num_l2; i++)
        csums[i] = tkv_csum64(slot_ptr(s, l2slots[i]), s->block_bytes);

    size_t stored = 0, dup = 0, rejected = 0;
    wr_lock(s);
    lock(s);
    uint64_t now = tkv_now_ns(), wall = tkv_wall_ms();
    for (size_t i = 0; i < n; i++) {
        const tkv_key *pk = i ? &keys[i - 1] : parent ? parent : &zero_key;
        if (tkv_index_find(s->ix, &keys[i])) {
            slot_free(s, a->tier, a->slots[i]);
            if (a->tier == TKV_TIER_L1 && i < num_l2)
                tkv_pool_free(s->pool, l2slots[i]);
            dup++;
            continue;
        }
        tkv_entry *p = tkv_index_find(s->ix, pk);
        tkv_entry *e = tkv_entry_new(&keys[i], pk, p ? p->depth + 1 : 0);
        e->tenant = (uint8_t)a->tenant;
        if (!l2_admit(s, e, p, now, i < num_l2)) {
            tkv_entry_free(e);
            slot_free(s, a->tier, a->slots[i]);
            if (a->tier == TKV_TIER_L1 && i < num_l2)
                tkv_pool_free(s->pool, l2slots[i]);
            rejected++;
            continue;
        }
        e->state = TKV_BLOCK_READY;
        e->last_access_ms = wall;
        entry_set_tokens(s, e, tokens + i * (size_t)s->block_tokens);
        rc = tkv_index_insert(s->ix, e);
        TKV_ASSERT(rc == TKV_OK);
        if (i < num_l2) {
            e->l2_slot = l2slots[i];
            e->csum = csums[i];
            e->flags |= F_CSUM;
            tier_enter(s, e, TKV_TIER_L2, now);
        }
        if (a->tier == TKV_TIER_L1) {
            e->l1_slot = a->slots[i];
            tier_enter(s, e, TKV_TIER_L1, now);
        }
        if (s->write_through || (e->flags & F_DROP_L2))
            wb_queue(s, e);
        stored++;
    }
    bool own_l2 = a->tier == TKV_TIER_L1;
    if (own_l2)
        s->tn[a->tenant].reserved_l2 -= num_l2; /* entered or freed above */
    alloc_free(s, a, n); /* the slots beyond n go back to the pool */
    if (own_l2)
        free(l2slots);
    s->st.puts++;
    s->st.put_blocks += n;
    s->st.put_dup_blocks += dup;
    s->st.put_rejected_blocks += rejected;
    unlock(s);
    idx_unlock(s);
    free(csums);
    if (num_stored)
        *num_stored = stored;
    return TKV_OK;
}

int tkv_store_abort(tkv_store *s, uint64_t alloc_id)
{
    if (!s)
        return TKV_EINVAL;
    lock(s);
    alloc_rec *a = alloc_find(s, alloc_id);
    if (a)
        alloc_end(s, a);
    unlock(s);
    return a ? TKV_OK : TKV_ENOTFOUND;
}

/* ============================================================================================
 * Reading L3 blocks (no locks held)
 * ========================================================================================== */

/* Checks a block read from L3 against the checksum taken at put time (the first read of a
 * block loaded at open adopts the checksum L3 vouched for). */
static int check_l3_read(tkv_store *s, tkv_entry *e, const tkv_l3_get_req *r, uint64_t *csum_out)
{
    if (r->status != TKV_OK)
        return r->status;
    if (r->len != s->block_bytes)
        return TKV_ECHECKSUM;
    *csum_out = tkv_csum64(r->dst, r->len);
    return TKV_OK;
}

/* idx_lock (write) + mu held: a block failed its checksum (or vanished) in L3: drop the L3
 * copy and count it. */
static void l3_copy_bad(tkv_store *s, tkv_entry *e, int status, bool delete_record)
{
    if (status == TKV_ECHECKSUM)
        s->st.checksum_failures++;
    else if (status != TKV_ENOTFOUND)
        s->st.io_errors++;
    if (status != TKV_ECHECKSUM && status != TKV_ENOTFOUND)
        return; /* an I/O error says nothing about the data: keep the block */
    if (delete_record)
        tkv_l3_delete(s->l3, &e->key, 1);
    if (e->resident & RES(TKV_TIER_L3))
        tier_leave(s, e, TKV_TIER_L3);
    entry_drop_if_gone(s, e);
}

/* ============================================================================================
 * get
 * ========================================================================================== */

int tkv_store_get(tkv_store *s, uint64_t lease_id, uint32_t index, void *dst, size_t cap)
{
    if (!s || !dst)
        return TKV_EINVAL;
    if (cap < s->block_bytes)
        return TKV_EINVAL;
    int rc = TKV_OK;
    lock(s);
    tkv_lease *l = lease_live(s, lease_id, &rc);
    if (!l) {
        unlock(s);
        return rc;
    }
    if (index >= l->num_entries) {
        unlock(s);
        return TKV_EINVAL;
    }
    tkv_entry *e = l->entries[index];
    if (!e->resident) {
        unlock(s);
        return TKV_ENOTFOUND;
    }
    entry_pin(s, e); /* our own pin: the lease may be released by another thread meanwhile */
    if (e->resident & RES(TKV_TIER_L2)) {
        const void *src = slot_ptr(s, e->l2_slot);
        unlock(s);
        memcpy(dst, src, s->block_bytes);
        lock(s);
        s->st.gets++;
        s->st.get_bytes += s->block_bytes;
        entry_unpin(s, e);
        unlock(s);
        return TKV_OK;
    }
    unlock(s);

    tkv_l3_get_req r = {.key = e->key, .dst = dst, .cap = cap};
    tkv_l3_get_batch(s->l3, &r, 1);
    uint64_t csum = 0;
    rc = check_l3_read(s, e, &r, &csum);
    bool mismatch = false;
    wr_lock(s);
    lock(s);
    if (rc == TKV_OK) {
        if (!(e->flags & F_CSUM)) {
            e->csum = csum;
            e->flags |= F_CSUM;
        } else if (e->csum != csum) {
            rc = TKV_ECHECKSUM;
            mismatch = true;
        }
    }
    if (rc == TKV_OK) {
        s->st.gets++;
        s->st.get_bytes += s->block_bytes;
    } else {
        l3_copy_bad(s, e, rc, mismatch);
        memset(dst, 0, s->block_bytes); /* wrong KV is never handed out */
    }
    entry_unpin(s, e);
    unlock(s);
    idx_unlock(s);
    return rc;
}

/* ============================================================================================
 * Prefetch (promotion L3 -> L2) and tickets
 * ========================================================================================== */

static ticket *ticket_find(tkv_store *s, uint64_t id)
{
    for (ticket *t = s->tickets; t; t = t->next)
        if (t->id == id)
            return t;
    return NULL;
}

static void ticket_unlink(tkv_store *s, ticket *t)
{
    ticket **pp = &s->tickets;
    while (*pp != t)
        pp = &(*pp)->next;
    *pp = t->next;
    if (t->done)
        s->num_tickets_done--;
    free(t);
}

/* mu held: marks a ticket done; keeps at most TICKETS_KEPT finished tickets nobody waited for
 * (the oldest are forgotten; waiting on one then answers TKV_ENOTFOUND). */
static void ticket_complete(tkv_store *s, uint64_t id, int status)
{
    ticket *t = ticket_find(s, id);
    TKV_ASSERT(t != NULL);
    t->done = true;
    t->status = status;
    s->num_tickets_done++;
    if (s->num_tickets_done > TICKETS_KEPT) {
        ticket *oldest = NULL;
        for (ticket *x = s->tickets; x; x = x->next)
            if (x->done)
                oldest = x;
        ticket_unlink(s, oldest);
    }
    pthread_cond_broadcast(&s->cv_done);
}

int tkv_store_prefetch(tkv_store *s, uint64_t lease_id, int tier_id, tkv_done_fn done,
                       void *arg, uint64_t *ticket_out)
{
    if (!s || !ticket_out)
        return TKV_EINVAL;
    if (tier_id == TKV_TIER_L1 && !s->l1_ops)
        return TKV_EUNSUPPORTED; /* no GPU tier attached */
    if (tier_id != TKV_TIER_L2 && tier_id != TKV_TIER_L1)
        return TKV_EINVAL;
    int rc = TKV_OK;
    lock(s);
    if (s->closing) {
        unlock(s);
        return TKV_ECLOSED;
    }
    tkv_lease *l = lease_live(s, lease_id, &rc);
    if (!l) {
        unlock(s);
        return rc;
    }
    prefetch_job *j = tkv_xcalloc(1, sizeof(*j));
    j->ents = tkv_xmalloc((l->num_entries + 1) * sizeof(tkv_entry *));
    j->waits = tkv_xmalloc((l->num_entries + 1) * sizeof(tkv_entry *));
    j->tier = tier_id;
    if (tier_id == TKV_TIER_L1) {
        j->l1ents = tkv_xmalloc((l->num_entries + 1) * sizeof(tkv_entry *));
        for (size_t i = 0; i < l->num_entries; i++) {
            tkv_entry *e = l->entries[i];
            if (e->resident & RES(TKV_TIER_L1))
                continue;
            entry_pin(s, e);
            j->l1ents[j->n1++] = e;
        }
    }
    for (size_t i = 0; i < l->num_entries; i++) {
        tkv_entry *e = l->entries[i];
        if ((e->resident & (RES(TKV_TIER_L2) | RES(TKV_TIER_L1))) ||
            !(e->resident & RES(TKV_TIER_L3)))
            continue;
        entry_pin(s, e);
        if (e->flags & F_PROMOTING) {
            j->waits[j->num_waits++] = e;
        } else {
            e->flags |= F_PROMOTING;
            j->ents[j->n++] = e;
        }
    }
    ticket *t = tkv_xcalloc(1, sizeof(*t));
    t->id = s->next_ticket++;
    t->next = s->tickets;
    s->tickets = t;
    j->ticket = t->id;
    j->done = done;
    j->arg = arg;
    if (s->jobs_tail)
        s->jobs_tail->next = j;
    else
        s->jobs_head = j;
    s->jobs_tail = j;
    pthread_cond_signal(&s->cv_work);
    *ticket_out = t->id;
    unlock(s);
    return TKV_OK;
}

int tkv_store_wait(tkv_store *s, uint64_t ticket_id, int timeout_ms, int *status)
{
    if (!s)
        return TKV_EINVAL;
    uint64_t deadline = timeout_ms < 0 ? 0 : tkv_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    int rc = TKV_OK;
    lock(s);
    ticket *t = ticket_find(s, ticket_id);
    while (t && !t->done) {
        if (timeout_ms < 0) {
            pthread_cond_wait(&s->cv_done, &s->mu);
        } else if (!cond_wait_until(&s->cv_done, &s->mu, deadline) && tkv_now_ns() >= deadline) {
            t = ticket_find(s, ticket_id);
            if (t && !t->done) {
                unlock(s);
                return TKV_ETIMEDOUT;
            }
            break;
        }
        t = ticket_find(s, ticket_id);
    }
    if (!t) {
        rc = TKV_ENOTFOUND;
    } else {
        if (status)
            *status = t->status;
        ticket_unlink(s, t);
    }
    unlock(s);
    return rc;
}

typedef struct csum_job {
    tkv_store *s;
    size_t n;
    void **ptrs;
    const uint64_t *want;
    uint8_t *bad;
} csum_job;

static void *csum_main(void *arg)
{
    csum_job *c = arg;
    for (size_t i = 0; i < c->n; i++)
        c->bad[i] = tkv_csum64(c->ptrs[i], c->s->block_bytes) != c->want[i];
    return NULL;
}

/* mu held (no idx_lock), after the L3 -> L2 phase of a prefetch to L1: copies every lease
 * block that is in L2 but not in L1 up in one batch. Each block's L2 copy is checksummed on
 * a second thread while the DMA runs; a mismatch drops the block from L1 and L2 and is
 * reported, so wrong KV never shows as present. Returns the job's status. */
static int run_l1_promotion(tkv_store *s, prefetch_job *j, int status)
{
    size_t n = j->n1, k = 0, got = 0;
    uint64_t *l1slots = tkv_xmalloc((n ? n : 1) * sizeof(uint64_t));
    uint64_t *l2offs = tkv_xmalloc((n ? n : 1) * sizeof(uint64_t));
    uint64_t *want = tkv_xmalloc((n ? n : 1) * sizeof(uint64_t));
    void **ptrs = tkv_xmalloc((n ? n : 1) * sizeof(void *));
    uint8_t *bad = tkv_xcalloc(n ? n : 1, 1);
    tkv_entry **ents = tkv_xmalloc((n ? n : 1) * sizeof(tkv_entry *));
    uint8_t *tns = tkv_xmalloc(n ? n : 1); /* whose quota each slot counts against */

    unlock(s);
    wr_lock(s);
    lock(s);
    for (size_t i = 0; i < n; i++) {
        tkv_entry *e = j->l1ents[i];
        if (e->resident & RES(TKV_TIER_L1))
            continue; /* another prefetch brought it meanwhile */
        if (!(e->resident & RES(TKV_TIER_L2))) {
            if (status == TKV_OK)
                status = e->promote_err ? e->promote_err : TKV_ENOTFOUND;
            continue;
        }
        ents[k++] = e;
    }
    /* Each block into its tenant's region and under its quota (a lease holds one tenant's
     * blocks, and those of none); the slots count against the quota while the copy runs. */
    refusal_line line;
    bool log_it = false;
    unsigned log_tn = 0;
    size_t log_n = 0;
    for (size_t i = 0; i < k; i++) {
        unsigned tn = ents[i]->tenant;
        size_t one = 0;
        if (l1_reserve(s, tn, 0, 1, l1slots + got, &one) != TKV_OK) {
            if (status == TKV_OK)
                status = TKV_EFULL;
            if (refusal_note(s, tn, TKV_TIER_L1, 1, &line) && !log_it) {
                log_it = true;
                log_tn = tn;
                log_n = 1;
            }
            continue;
        }
        s->tn[tn].reserved_l1++;
        tns[got] = (uint8_t)tn;
        ents[got++] = ents[i];
    }
    for (size_t i = 0; i < got; i++) {
        l2offs[i] = slot_offset(s, ents[i]->l2_slot);
        ptrs[i] = slot_ptr(s, ents[i]->l2_slot);
        want[i] = ents[i]->csum;
        bad[i] = 0;
    }
    unlock(s);
    idx_unlock(s);
    if (log_it)
        refusal_log(s, log_tn, TKV_TIER_L1, log_n, &line, "promotion found no room");

    int rc = TKV_OK;
    if (got) {
        csum_job cj = {s, got, ptrs, want, bad};
        pthread_t th;
        bool threaded = pthread_create(&th, NULL, csum_main, &cj) == 0;
        rc = s->l1_ops->promote(s->l1_ctx, l1slots, l2offs, got);
        if (threaded)
            pthread_join(th, NULL);
        else
            csum_main(&cj);
    }

    wr_lock(s);
    lock(s);
    uint64_t now = tkv_now_ns();
    for (size_t i = 0; i < got; i++) {
        tkv_entry *e = ents[i];
        s->tn[tns[i]].reserved_l1--;
        int st = rc != TKV_OK ? TKV_EIO : (e->flags & F_CSUM) && bad[i] ? TKV_ECHECKSUM : TKV_OK;
        if (st == TKV_OK && !(e->resident & RES(TKV_TIER_L1))) {
            e->l1_slot = l1slots[i];
            tier_enter(s, e, TKV_TIER_L1, now);
            s->st.promotions++;
            s->st.promotion_bytes += s->block_bytes;
            continue;
        }
        slot_free(s, TKV_TIER_L1, l1slots[i]);
        if (st == TKV_ECHECKSUM) {
            s->st.checksum_failures++;
            if (e->resident & RES(TKV_TIER_L2))
                tier_leave(s, e, TKV_TIER_L2);
            entry_drop_if_gone(s, e);
        } else if (st == TKV_EIO) {
            s->st.io_errors++;
        }
        if (st != TKV_OK && (status == TKV_OK || st == TKV_ECHECKSUM))
            status = st;
    }
    for (size_t i = 0; i < n; i++)
        entry_unpin(s, j->l1ents[i]);
    pthread_cond_broadcast(&s->cv_done);
    idx_unlock(s);
    free(l1slots);
    free(l2offs);
    free(want);
    free(ptrs);
    free(bad);
    free(ents);
    free(tns);
    return status;
}

/* Worker: runs one prefetch job. */
static void run_prefetch(tkv_store *s, prefetch_job *j)
{
    int status = TKV_OK;
    size_t n = j->n, got = 0;
    uint64_t *slots = tkv_xmalloc((n ? n : 1) * sizeof(*slots));
    tkv_l3_get_req *reqs = tkv_xcalloc(n ? n : 1, sizeof(*reqs));
    uint64_t *csums = tkv_xcalloc(n ? n : 1, sizeof(*csums));

    if (n) {
        /* Each block into its tenant's region and under its quota: a run of one tenant's
         * blocks at a time (a lease is one tenant's); those without a slot fail EFULL. The
         * slots count against the quota while the reads run. */
        wr_lock(s);
        lock(s);
        while (got < n) {
            unsigned tn = j->ents[got]->tenant;
            size_t run = 1, more = 0;
            while (got + run < n && j->ents[got + run]->tenant == tn)
                run++;
            reserve_slots(s, TKV_TIER_L2, tn, run, false, slots + got, &more);
            for (size_t i = 0; i < more; i++)
                s->tn[tn].reserved_l2++;
            got += more;
            if (more < run)
                break;
        }
        unlock(s);
        idx_unlock(s);
    }

    for (size_t i = 0; i < got; i++) {
        reqs[i].key = j->ents[i]->key;
        reqs[i].dst = slot_ptr(s, slots[i]);
        reqs[i].cap = tkv_pool_slot_stride(s->pool);
    }
    if (got)
        tkv_l3_get_batch(s->l3, reqs, got);
    for (size_t i = 0; i < got; i++)
        reqs[i].status = check_l3_read(s, j->ents[i], &reqs[i], &csums[i]);

    wr_lock(s);
    lock(s);
    uint64_t now = tkv_now_ns();
    for (size_t i = 0; i < got; i++)
        s->tn[j->ents[i]->tenant].reserved_l2--; /* entered or freed below */
    for (size_t i = 0; i < n; i++) {
        tkv_entry *e = j->ents[i];
        int st = i < got ? reqs[i].status : TKV_EFULL;
        bool mismatch = false;
        if (st == TKV_OK && (e->flags & F_CSUM) && e->csum != csums[i]) {
            st = TKV_ECHECKSUM;
            mismatch = true;
        }
        if (st == TKV_OK && !(e->resident & RES(TKV_TIER_L3)))
            st = TKV_ENOTFOUND; /* evicted from L3 meanwhile is impossible (pinned); be safe */
        if (st == TKV_OK) {
            e->csum = csums[i];
            e->flags |= F_CSUM;
            e->l2_slot = slots[i];
            tier_enter(s, e, TKV_TIER_L2, now);
            s->st.promotions++;
            s->st.promotion_bytes += s->block_bytes;
        } else {
            if (i < got)
                tkv_pool_free(s->pool, slots[i]);
            if (st != TKV_EFULL)
                l3_copy_bad(s, e, st, mismatch);
            if (status == TKV_OK || st == TKV_ECHECKSUM)
                status = st;
        }
        e->promote_err = (int16_t)st;
        e->flags &= (uint8_t)~F_PROMOTING;
        entry_unpin(s, e);
    }
    pthread_cond_broadcast(&s->cv_done);
    idx_unlock(s);
    /* Blocks an earlier job was promoting: wait for that job (FIFO order: it is running). */
    for (size_t i = 0; i < j->num_waits; i++) {
        tkv_entry *e = j->waits[i];
        while (e->flags & F_PROMOTING)
            pthread_cond_wait(&s->cv_done, &s->mu);
        if (!(e->resident & RES(TKV_TIER_L2)) &&
            (status == TKV_OK || e->promote_err == TKV_ECHECKSUM))
            status = e->promote_err ? e->promote_err : TKV_ENOTFOUND;
        entry_unpin(s, e);
    }
    /* The callback runs before the ticket completes, so a caller that waits on the ticket
     * knows the callback is finished with its argument. */
    if (j->tier == TKV_TIER_L1)
        status = run_l1_promotion(s, j, status);
    if (j->done) {
        unlock(s);
        j->done(j->arg, j->ticket, status);
        lock(s);
    }
    ticket_complete(s, j->ticket, status);
    unlock(s);
    free(slots);
    free(reqs);
    free(csums);
    free(j->ents);
    free(j->waits);
    free(j->l1ents);
    free(j);
}

/* ============================================================================================
 * Write-back L2 -> L3 (write-through and demotion)
 * ========================================================================================== */

/* idx_lock (write) + mu held: e leaves L3 as a victim (its record joins the delete batch). */
static void l3_take_victim(tkv_store *s, tkv_entry *e, tkv_key *keys, tkv_entry **ents,
                           size_t *nv)
{
    tier_leave(s, e, TKV_TIER_L3);
    keys[*nv] = e->key;
    ents[(*nv)++] = e;
}

/* idx_lock (write) + mu held: makes room in L3 for the k blocks of a write-back batch by
 * deleting unpinned victims (tails first). The deletion is one RocksDB batch: index records
 * only, no payload I/O. With tenant limits, a tenant over its L3 quota makes room from its own
 * blocks first, and a full L3 passes over blocks of tenants at or below their guaranteed
 * share; a block that finds no room so is refused (refused[i] set; it is not written). The
 * blocks kept count in T->reserved and their tenant's reserved_l3 until written. */
static void l3_make_room(tkv_store *s, tkv_entry *const *batch, size_t k, bool *refused)
{
    tier *T = &s->tiers[TKV_TIER_L3];
    bool limits = s->tenant_limits[TKV_TIER_L3];
    size_t cap_v = k + 8;
    tkv_key *keys = tkv_xmalloc(cap_v * sizeof(*keys));
    tkv_entry **ents = tkv_xmalloc(cap_v * sizeof(*ents));
    size_t nv = 0;
    for (size_t i = 0; i < k; i++)
        refused[i] = false;
    /* Tenants at their quota: each of their blocks here takes the room of one of their own. */
    for (size_t i = 0; limits && i < k; i++) {
        tkv_entry *e = batch[i];
        struct tenant_acct *a = &s->tn[e->tenant];
        if (!a->max[TKV_TIER_L3] || a->blocks[TKV_TIER_L3] + a->reserved_l3 < a->max[TKV_TIER_L3]) {
            a->reserved_l3++;
            continue;
        }
        tkv_entry *v = tier_victim(s, TKV_TIER_L3, e->tenant, true, false);
        if (v) {
            a->own_evictions++;
            l3_take_victim(s, v, keys, ents, &nv);
            a->reserved_l3++;
        } else {
            refused[i] = true;
        }
    }
    size_t kept = 0;
    for (size_t i = 0; i < k; i++)
        if (!refused[i]) {
            kept++;
            if (!limits)
                s->tn[batch[i]->tenant].reserved_l3++;
        }
    /* Then the tier's capacity, a victim for each block that needs one, last blocks first. */
    for (size_t i = k; T->capacity_blocks != UINT64_MAX && i-- > 0;) {
        if (T->num_blocks + T->reserved + kept <= T->capacity_blocks)
            break;
        if (refused[i])
            continue;
        tkv_entry *e = batch[i];
        tkv_entry *v = tier_victim(s, TKV_TIER_L3, e->tenant, false, false);
        if (v) {
            if (nv == cap_v) {
                cap_v *= 2;
                keys = tkv_xrealloc(keys, cap_v * sizeof(*keys));
                ents = tkv_xrealloc(ents, cap_v * sizeof(*ents));
            }
            if (v->tenant == e->tenant && s->tn[e->tenant].max[TKV_TIER_L3])
                s->tn[e->tenant].own_evictions++;
            l3_take_victim(s, v, keys, ents, &nv);
            i++; /* the same block again, until the tier has room for it */
        } else if (limits) {
            refused[i] = true;  /* every evictable block is guarded or pinned */
            s->tn[e->tenant].reserved_l3--;
            kept--;
        } else {
            break;              /* no limits: as before, a tier of pinned blocks overflows */
        }
    }
    if (nv) {
        int rc = tkv_l3_delete(s->l3, keys, nv);
        if (rc != TKV_OK) {
            s->st.io_errors++;
            TKV_LOG(TKV_LOG_WARN, "L3 eviction: delete of %zu records: %s", nv,
                    tkv_strerror(rc));
        }
        s->st.evictions += nv;
        for (size_t i = 0; i < nv; i++)
            entry_drop_if_gone(s, ents[i]);
    }
    free(keys);
    free(ents);
    T->reserved += kept;
}

static void l3_went_readonly(tkv_store *s, int rc)
{
    if (!s->l3_readonly)
        TKV_LOG(TKV_LOG_ERROR, "L3 write failed (%s): L3 is read-only from now on; L2 keeps "
                "serving and L3 reads go on", tkv_strerror(rc));
    s->l3_readonly = true;
}

/* Runs one write-back batch. With worker set, only if fewer than wb_max_running batches run.
 * Returns false when there was nothing to take. No locks held on entry. */
static bool wb_run_batch(tkv_store *s, bool worker)
{
    lock(s);
    if (!s->wb_head || (worker && s->wb_running >= s->wb_max_running)) {
        unlock(s);
        return false;
    }
    tkv_entry *batch[WB_BATCH_BLOCKS];
    bool have_csum[WB_BATCH_BLOCKS];   /* snapshots: flags may change once mu is dropped */
    size_t k = 0;
    uint64_t bytes = 0;
    while (s->wb_head && k < WB_BATCH_BLOCKS &&
           (k == 0 || bytes + s->block_bytes <= WB_BATCH_BYTES)) {
        tkv_entry *e = s->wb_head;
        s->wb_head = e->q_next;
        if (!s->wb_head)
            s->wb_tail = NULL;
        e->q_next = NULL;
        have_csum[k] = (e->flags & F_CSUM) != 0;
        batch[k++] = e;
        bytes += s->block_bytes;
    }
    s->wb_len -= k;
    s->wb_inflight += k;
    s->wb_running++;
    bool readonly = s->l3_readonly;
    unlock(s);

    bool refused[WB_BATCH_BLOCKS] = {false};
    if (!readonly) {
        wr_lock(s);
        lock(s);
        l3_make_room(s, batch, k, refused);
        unlock(s);
        idx_unlock(s);
    }

    /* The slots cannot change under us: every entry holds a pin (F_WB). Check each payload
     * against its checksum before it goes down a tier. */
    tkv_l3_put_req reqs[WB_BATCH_BLOCKS];
    int status[WB_BATCH_BLOCKS];
    size_t map[WB_BATCH_BLOCKS], nreq = 0;
    for (size_t i = 0; i < k; i++) {
        tkv_entry *e = batch[i];
        const void *src = slot_ptr(s, e->l2_slot);
        status[i] = TKV_OK;
        if (readonly) {
            status[i] = TKV_EREADONLY;
            continue;
        }
        if (refused[i]) {
            status[i] = TKV_EFULL; /* no room in L3 within the tenant's quota or others' shares */
            continue;
        }
        if (have_csum[i] && tkv_csum64(src, s->block_bytes) != e->csum) {
            status[i] = TKV_ECHECKSUM;
            continue;
        }
        tkv_l3_put_req *r = &reqs[nreq];
        memset(r, 0, sizeof(*r));
        r->key = e->key;
        r->parent = e->parent_key;
        r->payload = src;
        r->len = s->block_bytes;
        r->tokens = e->tokens;
        r->num_tokens = e->num_tokens;
        r->tenant_tag = s->tn[e->tenant].tag; /* F_WB: no adoption changes it meanwhile */
        map[nreq++] = i;
    }
    if (nreq) {
        tkv_l3_put_batch(s->l3, reqs, nreq);
        for (size_t r = 0; r < nreq; r++)
            status[map[r]] = reqs[r].status == TKV_EEXIST ? TKV_OK : reqs[r].status;
    }
    /* Down to the shared tier as well, from the same pinned, checked L2 copies. */
    for (size_t r = 0; s->l4 && r < nreq; r++)
        if (status[map[r]] == TKV_OK)
            l4_put_as(s, batch[map[r]]->tenant, &reqs[r].key, &reqs[r].parent, reqs[r].tokens,
                      reqs[r].num_tokens, reqs[r].payload, reqs[r].len);

    wr_lock(s);
    lock(s);
    uint64_t now = tkv_now_ns();
    size_t kept = 0;
    uint64_t num_refused[WB_BATCH_BLOCKS];
    unsigned refused_tn[WB_BATCH_BLOCKS];
    size_t num_rt = 0;
    for (size_t i = 0; i < k; i++) {
        tkv_entry *e = batch[i];
        int st = status[i];
        if (!readonly && !refused[i]) {
            kept++;
            s->tn[e->tenant].reserved_l3--;
        }
        if (st == TKV_EFULL) {
            /* Not written: it stays an L2-only block (no tokens: never queued again, and an
             * L2 eviction drops it), and a demotion drops it now. */
            size_t r = 0;
            while (r < num_rt && refused_tn[r] != e->tenant)
                r++;
            if (r == num_rt) {
                refused_tn[num_rt++] = e->tenant;
                num_refused[r] = 0;
            }
            num_refused[r]++;
            free(e->tokens);
            e->tokens = NULL;
            e->num_tokens = 0;
        } else if (st == TKV_OK) {
            if (!(e->resident & RES(TKV_TIER_L3)))
                tier_enter(s, e, TKV_TIER_L3, now);
            free(e->tokens);
            e->tokens = NULL;
            e->num_tokens = 0;
            s->st.demotions++;
            s->st.demotion_bytes += s->block_bytes;
        } else if (st == TKV_ECHECKSUM) {
            /* The L2 copy was damaged after it was written: never pass it on. */
            s->st.checksum_failures++;
            if (e->resident & RES(TKV_TIER_L2))
                tier_leave(s, e, TKV_TIER_L2);
        } else if (st != TKV_EREADONLY || !readonly) {
            s->st.io_errors++;
            l3_went_readonly(s, st);
        }
        e->flags &= (uint8_t)~F_WB;
        s->wb_in_region[s->region_of[e->tenant]]--;
        if ((e->flags & F_DROP_L2) && e->pins == 1 && (e->resident & RES(TKV_TIER_L2)) &&
            ((e->resident & RES(TKV_TIER_L3)) || !l3_writable(s) || st == TKV_EFULL)) {
            tier_leave(s, e, TKV_TIER_L2);
            s->st.evictions++;
        }
        e->flags &= (uint8_t)~F_DROP_L2;
        entry_drop_if_gone(s, e);
        entry_unpin(s, e);
    }
    if (!readonly) {
        TKV_ASSERT(s->tiers[TKV_TIER_L3].reserved >= kept);
        s->tiers[TKV_TIER_L3].reserved -= kept;
    }
    refusal_line line[WB_BATCH_BLOCKS];
    bool log_it[WB_BATCH_BLOCKS];
    for (size_t r = 0; r < num_rt; r++)
        log_it[r] = refusal_note(s, refused_tn[r], TKV_TIER_L3, num_refused[r], &line[r]);
    s->wb_inflight -= k;
    s->wb_running--;
    s->wb_generation++;
    if (s->wb_head || s->closing) /* at close, idle workers re-check whether to exit */
        pthread_cond_broadcast(&s->cv_work);
    pthread_cond_broadcast(&s->cv_done);
    unlock(s);
    idx_unlock(s);
    for (size_t r = 0; r < num_rt; r++)
        if (log_it[r])
            refusal_log(s, refused_tn[r], TKV_TIER_L3, num_refused[r], &line[r],
                        "no L3 room within its quota or beside others' shares");
    return true;
}

/* No locks held; the caller pinned ents[0..n). Returns when none of them is queued for or in
 * write-back. Waits for these blocks only, not for the queue to drain: under a steady stream of
 * puts the queue may never be empty, but FIFO order brings these blocks to the front. Runs
 * batches itself while it waits. */
static void wb_wait_entries(tkv_store *s, tkv_entry *const *ents, size_t n)
{
    size_t i = 0;
    for (;;) {
        lock(s);
        while (i < n && !(ents[i]->flags & F_WB))
            i++;
        if (i == n) {
            unlock(s);
            return;
        }
        unlock(s);
        if (wb_run_batch(s, false))
            continue;
        lock(s);
        if (ents[i]->flags & F_WB)
            cond_wait_until(&s->cv_done, &s->mu, tkv_now_ns() + 100000000ull);
        unlock(s);
    }
}

static void *worker_main(void *arg)
{
    tkv_store *s = arg;
    lock(s);
    for (;;) {
        if (s->jobs_head) {
            prefetch_job *j = s->jobs_head;
            s->jobs_head = j->next;
            if (!s->jobs_head)
                s->jobs_tail = NULL;
            unlock(s);
            run_prefetch(s, j);
            lock(s);
            continue;
        }
        if (s->wb_head && s->wb_running < s->wb_max_running) {
            unlock(s);
            wb_run_batch(s, true);
            lock(s);
            continue;
        }
        if (s->closing && !s->wb_head)
            break;
        pthread_cond_wait(&s->cv_work, &s->mu);
    }
    unlock(s);
    return NULL;
}

/* ============================================================================================
 * Operations: evict, flush, verify, list, stats
 * ========================================================================================== */

typedef struct collect_ctx {
    int tier;
    tkv_entry **ents;
    size_t n, cap;
} collect_ctx;

static int collect_resident(void *arg, tkv_entry *e)
{
    collect_ctx *c = arg;
    if (!(e->resident & RES(c->tier)) || e->state != TKV_BLOCK_READY)
        return 0;
    if (c->n == c->cap) {
        c->cap = c->cap ? c->cap * 2 : 256;
        c->ents = tkv_xrealloc(c->ents, c->cap * sizeof(*c->ents));
    }
    c->ents[c->n++] = e;
    return 0;
}

/* idx_lock + mu held: the entries of `keys` (or all) resident in tier. */
static void collect_targets(tkv_store *s, int t, const tkv_key *keys, size_t nk, collect_ctx *c)
{
    c->tier = t;
    if (!keys) {
        tkv_index_foreach(s->ix, collect_resident, c);
        return;
    }
    for (size_t i = 0; i < nk; i++) {
        tkv_entry *e = tkv_index_find(s->ix, &keys[i]);
        if (e)
            collect_resident(c, e);
    }
}

static uint32_t internal_pins(const tkv_entry *e)
{
    return ((e->flags & F_WB) ? 1u : 0u) + ((e->flags & F_PROMOTING) ? 1u : 0u);
}

/* L1 blocks leave at once (see l1_reserve): their copy below stays. */
static int evict_l1(tkv_store *s, const tkv_key *keys, size_t nk, size_t *evicted,
                    size_t *pinned)
{
    collect_ctx c = {0};
    wr_lock(s);
    lock(s);
    collect_targets(s, TKV_TIER_L1, keys, nk, &c);
    for (size_t i = 0; i < c.n; i++) {
        tkv_entry *e = c.ents[i];
        if (e->pins) {
            (*pinned)++;
            continue;
        }
        tier_leave(s, e, TKV_TIER_L1);
        s->st.evictions++;
        (*evicted)++;
        entry_drop_if_gone(s, e);
    }
    unlock(s);
    idx_unlock(s);
    free(c.ents);
    return TKV_OK;
}

static int evict_l2(tkv_store *s, const tkv_key *keys, size_t nk, size_t *evicted,
                    size_t *pinned)
{
    collect_ctx c = {0};
    tkv_entry **pending = NULL;
    size_t npending = 0;
    wr_lock(s);
    lock(s);
    collect_targets(s, TKV_TIER_L2, keys, nk, &c);
    for (size_t i = 0; i < c.n; i++) {
        tkv_entry *e = c.ents[i];
        if (e->pins > internal_pins(e) || (e->flags & F_PROMOTING)) {
            (*pinned)++;
        } else if ((e->resident & RES(TKV_TIER_L3)) || !l3_writable(s) || !e->tokens) {
            if (e->pins) {
                (*pinned)++;
                continue;
            }
            tier_leave(s, e, TKV_TIER_L2);
            s->st.evictions++;
            (*evicted)++;
            entry_drop_if_gone(s, e);
        } else {
            /* Demote first. Our pin keeps the entry (and the write-back leaves the L2 copy to
             * us: it drops F_DROP_L2 blocks only when its own pin is the last). */
            e->flags |= F_DROP_L2;
            wb_queue(s, e);
            entry_pin(s, e);
            if (!pending)
                pending = tkv_xmalloc(c.n * sizeof(*pending));
            pending[npending++] = e;
        }
    }
    unlock(s);
    idx_unlock(s);
    free(c.ents);
    if (npending) {
        wb_wait_entries(s, pending, npending);
        wr_lock(s);
        lock(s);
        for (size_t i = 0; i < npending; i++) {
            tkv_entry *e = pending[i];
            e->flags &= (uint8_t)~F_DROP_L2;
            if (!(e->resident & RES(TKV_TIER_L2))) {
                (*evicted)++; /* dropped meanwhile (checksum failure) */
            } else if (e->pins == 1 &&
                       ((e->resident & RES(TKV_TIER_L3)) || !l3_writable(s))) {
                tier_leave(s, e, TKV_TIER_L2);
                s->st.evictions++;
                (*evicted)++;
            } else {
                (*pinned)++; /* a lookup pinned it before its demotion finished */
            }
            entry_drop_if_gone(s, e);
            entry_unpin(s, e);
        }
        unlock(s);
        idx_unlock(s);
        free(pending);
    }
    return TKV_OK;
}

static int evict_l3(tkv_store *s, const tkv_key *keys, size_t nk, size_t *evicted,
                    size_t *pinned)
{
    collect_ctx c = {0};
    int rc = TKV_OK;
    wr_lock(s);
    lock(s);
    collect_targets(s, TKV_TIER_L3, keys, nk, &c);
    size_t nd = 0;
    tkv_key *del = tkv_xmalloc((c.n ? c.n : 1) * sizeof(*del));
    for (size_t i = 0; i < c.n; i++) {
        if (c.ents[i]->pins) {
            (*pinned)++;
            continue;
        }
        del[nd] = c.ents[i]->key;
        c.ents[nd++] = c.ents[i];
    }
    if (nd) {
        rc = tkv_l3_delete(s->l3, del, nd);
        if (rc == TKV_OK) {
            for (size_t i = 0; i < nd; i++) {
                tier_leave(s, c.ents[i], TKV_TIER_L3);
                entry_drop_if_gone(s, c.ents[i]);
            }
            *evicted += nd;
            s->st.evictions += nd;
        } else {
            s->st.io_errors++;
        }
    }
    unlock(s);
    idx_unlock(s);
    free(del);
    free(c.ents);
    return rc;
}

int tkv_store_evict(tkv_store *s, int tier_id, const tkv_key *keys, size_t num_keys,
                    size_t *num_evicted, size_t *num_pinned)
{
    size_t ev = 0, pin = 0;
    if (num_evicted)
        *num_evicted = 0;
    if (num_pinned)
        *num_pinned = 0;
    if (!s || num_keys > MAX_KEYS_PER_CALL)
        return TKV_EINVAL;
    if (tier_id != TKV_TIER_L1 && tier_id != TKV_TIER_L2 && tier_id != TKV_TIER_L3)
        return TKV_EINVAL;
    if ((tier_id == TKV_TIER_L3 && !s->l3) || (tier_id == TKV_TIER_L1 && !s->l1_ops))
        return TKV_EUNSUPPORTED;
    int rc = tier_id == TKV_TIER_L1   ? evict_l1(s, keys, num_keys, &ev, &pin)
             : tier_id == TKV_TIER_L2 ? evict_l2(s, keys, num_keys, &ev, &pin)
                                      : evict_l3(s, keys, num_keys, &ev, &pin);
    if (num_evicted)
        *num_evicted = ev;
    if (num_pinned)
        *num_pinned = pin;
    return rc;
}

typedef struct flush_ctx {
    tkv_store *s;
    tkv_entry **ents;
    size_t n, cap;
} flush_ctx;

/* Queues a READY block that is not durable yet and remembers (pins) those that are queued. */
static int queue_unwritten(void *arg, tkv_entry *e)
{
    flush_ctx *fc = arg;
    if (e->state != TKV_BLOCK_READY)
        return 0;
    wb_queue(fc->s, e); /* skips what is durable, already queued, or has no tokens to record */
    if (!(e->flags & F_WB))
        return 0;
    if (fc->n == fc->cap) {
        fc->cap = fc->cap ? fc->cap * 2 : 256;
        fc->ents = tkv_xrealloc(fc->ents, fc->cap * sizeof(*fc->ents));
    }
    entry_pin(fc->s, e);
    fc->ents[fc->n++] = e;
    return 0;
}

static int flush_l3(tkv_store *s)
{
    if (!s->l3)
        return TKV_OK;
    flush_ctx fc = {.s = s};
    rd_lock(s);
    lock(s);
    tkv_index_foreach(s->ix, queue_unwritten, &fc);
    unlock(s);
    idx_unlock(s);
    wb_wait_entries(s, fc.ents, fc.n);
    wr_lock(s);
    lock(s);
    for (size_t i = 0; i < fc.n; i++) {
        entry_drop_if_gone(s, fc.ents[i]);
        entry_unpin(s, fc.ents[i]);
    }
    int rc = s->l3_readonly ? TKV_EREADONLY : TKV_OK;
    unlock(s);
    idx_unlock(s);
    free(fc.ents);
    return rc;
}

int tkv_store_flush(tkv_store *s)
{
    if (!s)
        return TKV_EINVAL;
    int rc = flush_l3(s);
    /* Then what write-back handed to L4 (bounded: L4 down must not hang a flush). */
    if (s->l4)
        tkv_l4_flush(s->l4, 30000);
    return rc;
}

int tkv_store_verify(tkv_store *s, void (*progress)(void *arg, uint64_t done, uint64_t total),
                     void *arg, uint64_t *num_checked, uint64_t *num_bad)
{
    if (!s)
        return TKV_EINVAL;
    uint64_t checked = 0, bad = 0;
    collect_ctx c2 = {0}, c3 = {0};
    rd_lock(s);
    lock(s);
    c2.tier = TKV_TIER_L2;
    tkv_index_foreach(s->ix, collect_resident, &c2);
    if (s->l3) {
        c3.tier = TKV_TIER_L3;
        tkv_index_foreach(s->ix, collect_resident, &c3);
    }
    uint8_t *bad2 = tkv_xcalloc(c2.n ? c2.n : 1, 1);
    uint64_t *slot2 = tkv_xcalloc(c2.n ? c2.n : 1, sizeof(uint64_t));
    for (size_t i = 0; i < c2.n; i++) {
        entry_pin(s, c2.ents[i]);
        /* bad2[i] = 2: no checksum known (cannot happen for L2 today; kept general) */
        bad2[i] = (c2.ents[i]->flags & F_CSUM) ? 0 : 2;
        slot2[i] = c2.ents[i]->l2_slot;
    }
    for (size_t i = 0; i < c3.n; i++)
        entry_pin(s, c3.ents[i]);
    unlock(s);
    idx_unlock(s);
    uint64_t total = c2.n + c3.n;

    /* L2: every slot against the checksum taken when it was written. */
    for (size_t i = 0; i < c2.n; i++) {
        tkv_entry *e = c2.ents[i];
        bad2[i] = bad2[i] == 2 ? 0 : tkv_csum64(slot_ptr(s, slot2[i]), s->block_bytes) != e->csum;
        checked++;
        if (progress)
            progress(arg, checked, total);
    }

    /* L3: read every block (L3 checks its own checksum, we check ours). */
    int *st3 = tkv_xcalloc(c3.n ? c3.n : 1, sizeof(int));
    uint8_t *mm3 = tkv_xcalloc(c3.n ? c3.n : 1, 1);
    size_t per = (size_t)(WB_BATCH_BYTES / s->block_bytes);
    per = per < 1 ? 1 : per > 32 ? 32 : per;
    uint8_t *buf = tkv_xmalloc(per * s->block_bytes);
    tkv_l3_get_req reqs[32];
    for (size_t off = 0; off < c3.n; off += per) {
        size_t n = c3.n - off < per ? c3.n - off : per;
        for (size_t i = 0; i < n; i++) {
            memset(&reqs[i], 0, sizeof(reqs[i]));
            reqs[i].key = c3.ents[off + i]->key;
            reqs[i].dst = buf + i * s->block_bytes;
            reqs[i].cap = s->block_bytes;
        }
        tkv_l3_get_batch(s->l3, reqs, n);
        lock(s);
        for (size_t i = 0; i < n; i++) {
            tkv_entry *e = c3.ents[off + i];
            uint64_t csum = 0;
            int st = check_l3_read(s, e, &reqs[i], &csum);
            if (st == TKV_OK && !(e->flags & F_CSUM)) {
                e->csum = csum;
                e->flags |= F_CSUM;
            } else if (st == TKV_OK && e->csum != csum) {
                st = TKV_ECHECKSUM;
                mm3[off + i] = 1;
            }
            st3[off + i] = st;
        }
        unlock(s);
        checked += n;
        if (progress)
            progress(arg, checked, total);
    }
    free(buf);

    wr_lock(s);
    lock(s);
    for (size_t i = 0; i < c2.n; i++) {
        tkv_entry *e = c2.ents[i];
        if (bad2[i]) {
            bad++;
            s->st.checksum_failures++;
            /* A write-back in flight checks the slot itself and drops it; otherwise drop now. */
            if (!(e->flags & (F_WB | F_PROMOTING)) && (e->resident & RES(TKV_TIER_L2))) {
                tier_leave(s, e, TKV_TIER_L2);
                entry_drop_if_gone(s, e);
            }
        }
        entry_unpin(s, e);
    }
    for (size_t i = 0; i < c3.n; i++) {
        tkv_entry *e = c3.ents[i];
        if (st3[i] == TKV_ECHECKSUM || st3[i] == TKV_ENOTFOUND) {
            bad++;
            l3_copy_bad(s, e, st3[i], mm3[i]);
        } else if (st3[i] != TKV_OK) {
            s->st.io_errors++;
        }
        entry_unpin(s, e);
    }
    unlock(s);
    idx_unlock(s);
    free(bad2);
    free(slot2);
    free(st3);
    free(mm3);
    free(c2.ents);
    free(c3.ents);
    if (num_checked)
        *num_checked = checked;
    if (num_bad)
        *num_bad = bad;
    return TKV_OK;
}

typedef struct list_ctx {
    tkv_block_info *infos;
    size_t n;
} list_ctx;

static int list_one(void *arg, tkv_entry *e)
{
    list_ctx *lc = arg;
    tkv_block_info *b = &lc->infos[lc->n++];
    memset(b, 0, sizeof(*b));
    b->key = e->key;
    b->parent = e->parent_key;
    b->depth = e->depth;
    b->state = e->state;
    b->in_l1 = (e->resident & RES(TKV_TIER_L1)) != 0;
    b->in_l2 = (e->resident & RES(TKV_TIER_L2)) != 0;
    b->in_l3 = (e->resident & RES(TKV_TIER_L3)) != 0;
    b->pins = e->pins;
    b->hits = e->hits;
    b->last_access_ms = e->last_access_ms;
    return 0;
}

int tkv_store_list(tkv_store *s, int (*cb)(void *arg, const tkv_block_info *b), void *arg)
{
    if (!s || !cb)
        return TKV_EINVAL;
    rd_lock(s);
    lock(s);
    list_ctx lc = {.infos = tkv_xmalloc((tkv_index_count(s->ix) + 1) * sizeof(tkv_block_info))};
    tkv_index_foreach(s->ix, list_one, &lc);
    unlock(s);
    idx_unlock(s);
    for (size_t i = 0; i < lc.n; i++)
        if (cb(arg, &lc.infos[i]))
            break;
    free(lc.infos);
    return TKV_OK;
}

int tkv_store_get_tenant_stats(tkv_store *s, unsigned tenant, tkv_store_tenant_stats *out)
{
    if (!s || !out || tenant >= TKV_STORE_TENANTS_MAX)
        return TKV_EINVAL;
    memset(out, 0, sizeof(*out));
    lock(s);
    const struct tenant_acct *a = &s->tn[tenant];
    for (int t = 0; t < TKV_NUM_TIERS; t++)
        out->blocks_tier[t] = a->blocks[t];
    for (int t = TKV_TIER_L1; t <= TKV_TIER_L3; t++) {
        out->max_blocks_tier[t] = a->max[t];
        out->guaranteed_blocks_tier[t] = a->guar[t];
        out->refused_blocks_tier[t] = a->refused_tier[t];
    }
    out->l4_blocks = a->l4_blocks;
    out->max_l4_blocks = a->l4_max;
    out->refused_l4_blocks = a->refused_tier[TKV_NUM_TIERS];
    if (s->l1_region_of[tenant]) { /* the same for its own L1 region */
        uint64_t n = s->l1_size[s->l1_region_of[tenant]];
        out->guaranteed_blocks_tier[TKV_TIER_L1] = n;
        if (!a->max[TKV_TIER_L1] || a->max[TKV_TIER_L1] > n)
            out->max_blocks_tier[TKV_TIER_L1] = n;
    }
    if (s->region_of[tenant]) { /* its own region: all of it is its, nobody else's */
        uint64_t n = tkv_pool_region_slots(s->pool, s->region_of[tenant]);
        out->guaranteed_blocks_tier[TKV_TIER_L2] = n;
        if (!a->max[TKV_TIER_L2] || a->max[TKV_TIER_L2] > n)
            out->max_blocks_tier[TKV_TIER_L2] = n;
    }
    out->refused_blocks = a->refused;
    out->own_evictions = a->own_evictions;
    out->guarded_skips = a->guarded_skips;
    unlock(s);
    return TKV_OK;
}

unsigned tkv_store_l1_num_regions(const tkv_store *s)
{
    return s && s->l1_ops ? s->l1_num_regions : 0;
}

int tkv_store_l1_region_at(const tkv_store *s, unsigned r, uint64_t *first_slot,
                           uint64_t *num_slots)
{
    if (!s || !s->l1_ops || r >= s->l1_num_regions)
        return TKV_EINVAL;
    if (first_slot)
        *first_slot = s->l1_first[r];
    if (num_slots)
        *num_slots = s->l1_size[r];
    return TKV_OK;
}

int tkv_store_l1_region(const tkv_store *s, unsigned tenant, unsigned *region)
{
    if (!s || !s->l1_ops || tenant >= TKV_STORE_TENANTS_MAX || !region)
        return TKV_EINVAL;
    *region = s->l1_region_of[tenant];
    return TKV_OK;
}

void tkv_store_get_stats(tkv_store *s, tkv_store_stats *out)
{
    if (!s || !out)
        return;
    tkv_l3_stats l3st = {0};
    if (s->l3)
        tkv_l3_get_stats(s->l3, &l3st);
    lock(s);
    *out = s->st;
    for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++) {
        out->blocks_tier[t] = s->tiers[t].num_blocks;
        out->bytes_tier[t] = s->tiers[t].num_blocks * s->block_bytes;
        /* 0 = tier off or unlimited */
        out->capacity_blocks_tier[t] =
            s->tiers[t].enabled && s->tiers[t].capacity_blocks != UINT64_MAX
                ? s->tiers[t].capacity_blocks
                : 0;
    }
    out->leases_active = tkv_lease_count(s->leases);
    out->allocs_active = s->num_allocs;
    out->writeback_queue = s->wb_len + s->wb_inflight;
    out->l3_readonly = s->l3 ? (s->l3_readonly || l3st.readonly) : 0;
    out->l3_io_mode = s->l3 ? l3st.io_mode : 0;
    unlock(s);
    if (s->l3)
        out->bytes_tier[TKV_TIER_L3] = l3st.stored_bytes;
}
