/* l4.c - the shared tier on Redis Cluster behind tkv_l4.h.
 *
 * ---- Threads and locks ---------------------------------------------------------------------
 *   mu        the write queue, its byte count, the stats, the known-key table.
 *   conn[i]   one router (tkv_rc) each, for readers: a reader takes a free one (or waits on
 *             one); no router is used by two threads at once.
 *   writer    one thread with its own router drains the queue in batches of up to
 *             WRITE_BATCH_BYTES, one pipelined round per batch, and probes the cluster once a
 *             second while it is marked down.
 * No network I/O runs under mu.
 */
#include "tkv_l4.h"

#include "tkv_base.h"
#include "tkv_csum.h"
#include "tkv_rcluster.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define MAGIC 0x34564b54u /* "TKV4" little-endian */
#define VERSION 1u
#define WRITE_BATCH_BYTES (32ull << 20)
#define WRITE_BATCH_BLOCKS 64
#define KNOWN_BITS 16
#define PROBE_INTERVAL_NS 1000000000ull
#define KEY_PREFIX "tkv4:{"

const double tkv_l4_latency_bounds_us[TKV_L4_LAT_BUCKETS] = {
    50, 100, 200, 400, 800, 1600, 3200, 6400, 12800, 25600, 51200, 102400, 204800, 409600,
    819200, INFINITY};

/* ============================================================================================
 * Options
 * ========================================================================================== */

struct tkv_l4_opts {
    char *nodes, *user, *password;
    size_t block_bytes;
    uint32_t block_tokens;
    uint32_t connect_ms, op_ms, ttl_s;
    uint64_t write_budget;
    unsigned connections;
};

tkv_l4_opts *tkv_l4_opts_new(void)
{
    tkv_l4_opts *o = tkv_xcalloc(1, sizeof(*o));
    o->connect_ms = 500;
    o->op_ms = 2000;
    o->write_budget = 256ull << 20;
    o->connections = 4;
    return o;
}

void tkv_l4_opts_free(tkv_l4_opts *o)
{
    if (!o)
        return;
    free(o->nodes);
    free(o->user);
    free(o->password);
    free(o);
}

int tkv_l4_opts_set_nodes(tkv_l4_opts *o, const char *nodes)
{
    char hosts[TKV_RC_MAX_NODES][64];
    int ports[TKV_RC_MAX_NODES];
    char err[160];
    if (!o || !nodes || tkv_rc_parse_nodes(nodes, hosts, ports, TKV_RC_MAX_NODES, err,
                                           sizeof(err)) < 0)
        return TKV_EINVAL;
    free(o->nodes);
    o->nodes = tkv_xstrdup(nodes);
    return TKV_OK;
}

int tkv_l4_opts_set_block(tkv_l4_opts *o, size_t block_bytes, uint32_t block_tokens)
{
    if (!o || !block_bytes || block_bytes > (1ull << 30) || !block_tokens || block_tokens > 4096)
        return TKV_EINVAL;
    o->block_bytes = block_bytes;
    o->block_tokens = block_tokens;
    return TKV_OK;
}

int tkv_l4_opts_set_auth(tkv_l4_opts *o, const char *user, const char *password)
{
    if (!o || (user && *user && !(password && *password)))
        return TKV_EINVAL;
    free(o->user);
    free(o->password);
    o->user = user && *user ? tkv_xstrdup(user) : NULL;
    o->password = password && *password ? tkv_xstrdup(password) : NULL;
    return TKV_OK;
}

int tkv_l4_opts_set_timeouts(tkv_l4_opts *o, uint32_t connect_ms, uint32_t op_ms)
{
    if (!o || !connect_ms || !op_ms || connect_ms > 60000 || op_ms > 600000)
        return TKV_EINVAL;
    o->connect_ms = connect_ms;
    o->op_ms = op_ms;
    return TKV_OK;
}

int tkv_l4_opts_set_write_budget(tkv_l4_opts *o, uint64_t bytes)
{
    if (!o)
        return TKV_EINVAL;
    o->write_budget = bytes;
    return TKV_OK;
}

int tkv_l4_opts_set_ttl_s(tkv_l4_opts *o, uint32_t ttl_s)
{
    if (!o)
        return TKV_EINVAL;
    o->ttl_s = ttl_s;
    return TKV_OK;
}

int tkv_l4_opts_set_connections(tkv_l4_opts *o, unsigned n)
{
    if (!o || n == 0 || n > 64)
        return TKV_EINVAL;
    o->connections = n;
    return TKV_OK;
}

/* ============================================================================================
 * Records
 * ========================================================================================== */

/* Header of each chunk value (little-endian):
 *   0 magic u32 | 4 version u16 | 6 header bytes u16 | 8 key[32] | 40 parent[32]
 *  72 chunk index u32 | 76 chunks u32 | 80 record bytes u64 | 88 chunk offset u64
 *  96 chunk bytes u32 | 100 tokens u32 | 104 chunk csum u64 | 112 record csum u64
 * 120 header csum u64 (of bytes 0..120)
 * record csum = tkv_csum64 of the chunks' csums in order, so chunks of two different writes
 * never pass as one record. */
typedef struct hdr {
    tkv_key key, parent;
    uint32_t chunk, num_chunks;
    uint64_t record_bytes, offset;
    uint32_t chunk_bytes, num_tokens;
    uint64_t chunk_csum, record_csum;
} hdr;

static void put32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static void put64(uint8_t *p, uint64_t v)
{
    for (int i = 0; i < 8; i++)
        p[i] = (uint8_t)(v >> (8 * i));
}
static uint32_t get32(const uint8_t *p)
{
    uint32_t v = 0;
    for (int i = 0; i < 4; i++)
        v |= (uint32_t)p[i] << (8 * i);
    return v;
}
static uint64_t get64(const uint8_t *p)
{
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v |= (uint64_t)p[i] << (8 * i);
    return v;
}

static void hdr_write(uint8_t *p, const hdr *h)
{
    memset(p, 0, TKV_L4_HEADER_BYTES);
    put32(p, MAGIC);
    p[4] = VERSION;
    p[6] = (uint8_t)TKV_L4_HEADER_BYTES;
    memcpy(p + 8, h->key.b, TKV_KEY_BYTES);
    memcpy(p + 40, h->parent.b, TKV_KEY_BYTES);
    put32(p + 72, h->chunk);
    put32(p + 76, h->num_chunks);
    put64(p + 80, h->record_bytes);
    put64(p + 88, h->offset);
    put32(p + 96, h->chunk_bytes);
    put32(p + 100, h->num_tokens);
    put64(p + 104, h->chunk_csum);
    put64(p + 112, h->record_csum);
    put64(p + 120, tkv_csum64(p, 120));
}

static bool hdr_read(const uint8_t *p, size_t len, hdr *h)
{
    if (len < TKV_L4_HEADER_BYTES || get32(p) != MAGIC || p[4] != VERSION || p[5] != 0 ||
        p[6] != TKV_L4_HEADER_BYTES || p[7] != 0 || get64(p + 120) != tkv_csum64(p, 120))
        return false;
    memcpy(h->key.b, p + 8, TKV_KEY_BYTES);
    memcpy(h->parent.b, p + 40, TKV_KEY_BYTES);
    h->chunk = get32(p + 72);
    h->num_chunks = get32(p + 76);
    h->record_bytes = get64(p + 80);
    h->offset = get64(p + 88);
    h->chunk_bytes = get32(p + 96);
    h->num_tokens = get32(p + 100);
    h->chunk_csum = get64(p + 104);
    h->record_csum = get64(p + 112);
    return true;
}

size_t tkv_l4_redis_key(const tkv_key *key, uint32_t chunk, char *buf)
{
    char hex[2 * TKV_KEY_BYTES + 1];
    tkv_key_hex(key, hex);
    return (size_t)sprintf(buf, KEY_PREFIX "%s}:%u", hex, chunk);
}

/* ============================================================================================
 * The tier
 * ========================================================================================== */

typedef struct wrec {
    tkv_key key;
    uint32_t num_chunks;
    size_t bytes;           /* of buf */
    uint8_t *buf;           /* the chunk values back to back */
    size_t *val_off, *val_len;
    uint64_t gen;
    struct wrec *next;
} wrec;

typedef struct conn {
    pthread_mutex_t mu;
    tkv_rc *rc;
} conn;

struct tkv_l4 {
    tkv_l4_opts o;
    size_t record_bytes;
    uint32_t num_chunks;

    pthread_mutex_t mu;
    pthread_cond_t cv_work, cv_done;
    wrec *q_head, *q_tail;
    uint64_t q_bytes, inflight_bytes;
    uint64_t gen_queued, gen_done;   /* write generations: flush waits for gen_done */
    bool closing;
    pthread_t writer;
    bool writer_started;
    tkv_rc *wrc;                     /* the writer's router */
    tkv_rc_stats wrc_stats;          /* a snapshot of it, under mu */

    unsigned num_conns;
    conn *conns;
    atomic_uint next_conn;

    _Atomic int healthy;
    _Atomic uint64_t next_probe_ns;

    uint64_t *known;                 /* fingerprints of keys written or read lately */
    tkv_l4_stats st;
};

static void lock(tkv_l4 *l) { pthread_mutex_lock(&l->mu); }
static void unlock(tkv_l4 *l) { pthread_mutex_unlock(&l->mu); }

static bool known_has(tkv_l4 *l, const tkv_key *k)
{
    uint64_t fp = tkv_key_fp(k) | 1;
    return l->known[fp & ((1u << KNOWN_BITS) - 1)] == fp;
}
static void known_add(tkv_l4 *l, const tkv_key *k)
{
    uint64_t fp = tkv_key_fp(k) | 1;
    l->known[fp & ((1u << KNOWN_BITS) - 1)] = fp;
}
static void known_del(tkv_l4 *l, const tkv_key *k)
{
    uint64_t fp = tkv_key_fp(k) | 1;
    if (l->known[fp & ((1u << KNOWN_BITS) - 1)] == fp)
        l->known[fp & ((1u << KNOWN_BITS) - 1)] = 0;
}

static void set_health(tkv_l4 *l, tkv_rc *rc)
{
    int h = tkv_rc_healthy(rc);
    int was = atomic_exchange(&l->healthy, h);
    if (was != h)
        TKV_LOG(h ? TKV_LOG_INFO : TKV_LOG_WARN, "L4: Redis Cluster %s",
                h ? "reachable, every slot served" : "unreachable or not serving every slot; "
                "serving from the local tiers");
    if (!h)
        atomic_store(&l->next_probe_ns, tkv_now_ns() + PROBE_INTERVAL_NS);
}

static void wrec_free(wrec *w)
{
    if (!w)
        return;
    tkv_rc_buf_release(w->buf);
    free(w->val_off);
    free(w->val_len);
    free(w);
}

static void *writer_main(void *arg);

int tkv_l4_open(const tkv_l4_opts *o, tkv_l4 **out)
{
    if (!o || !out || !o->nodes || !o->block_bytes)
        return TKV_EINVAL;
    *out = NULL;
    tkv_l4 *l = tkv_xcalloc(1, sizeof(*l));
    l->o = *o;
    l->o.nodes = tkv_xstrdup(o->nodes);
    l->o.user = o->user ? tkv_xstrdup(o->user) : NULL;
    l->o.password = o->password ? tkv_xstrdup(o->password) : NULL;
    l->record_bytes = (size_t)o->block_tokens * 4 + o->block_bytes;
    l->num_chunks = (uint32_t)((l->record_bytes + TKV_L4_CHUNK_BYTES - 1) / TKV_L4_CHUNK_BYTES);
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv_work, NULL);
    pthread_cond_init(&l->cv_done, NULL);
    l->known = tkv_xcalloc((size_t)1 << KNOWN_BITS, sizeof(uint64_t));
    tkv_rc_opts ro = {.nodes = l->o.nodes, .user = l->o.user, .password = l->o.password,
                      .connect_timeout_ms = o->connect_ms, .timeout_ms = o->op_ms};
    int rc = tkv_rc_open(&ro, &l->wrc);
    if (rc != TKV_OK)
        goto fail;
    set_health(l, l->wrc);
    l->num_conns = o->connections;
    l->conns = tkv_xcalloc(l->num_conns, sizeof(conn));
    for (unsigned i = 0; i < l->num_conns; i++) {
        pthread_mutex_init(&l->conns[i].mu, NULL);
        /* Readers connect lazily: the writer's router already said whether the cluster is
         * there, and a down cluster should cost one connect attempt at start, not five. */
        tkv_rc_opts r2 = ro;
        if ((rc = tkv_rc_open(&r2, &l->conns[i].rc)) != TKV_OK)
            goto fail;
    }
    if (pthread_create(&l->writer, NULL, writer_main, l) != 0) {
        rc = TKV_ENOMEM;
        goto fail;
    }
    l->writer_started = true;
    TKV_LOG(TKV_LOG_INFO, "L4 on Redis Cluster %s: %s; %u chunk(s) per block, write budget "
            "%llu bytes", l->o.nodes, atomic_load(&l->healthy) ? "reachable" : "unreachable",
            l->num_chunks, (unsigned long long)o->write_budget);
    *out = l;
    return TKV_OK;
fail:
    tkv_l4_close(l);
    return rc;
}

void tkv_l4_close(tkv_l4 *l)
{
    if (!l)
        return;
    /* What the store handed over last (its close finishes write-back first) gets a short
     * while to go out; a cluster that is down gets none. */
    if (l->writer_started && atomic_load(&l->healthy))
        tkv_l4_flush(l, 2000);
    lock(l);
    l->closing = true;
    pthread_cond_broadcast(&l->cv_work);
    unlock(l);
    if (l->writer_started)
        pthread_join(l->writer, NULL);
    while (l->q_head) {
        wrec *w = l->q_head;
        l->q_head = w->next;
        wrec_free(w);
    }
    for (unsigned i = 0; l->conns && i < l->num_conns; i++) {
        tkv_rc_close(l->conns[i].rc);
        pthread_mutex_destroy(&l->conns[i].mu);
    }
    free(l->conns);
    tkv_rc_close(l->wrc);
    free(l->known);
    free(l->o.nodes);
    free(l->o.user);
    free(l->o.password);
    pthread_cond_destroy(&l->cv_work);
    pthread_cond_destroy(&l->cv_done);
    pthread_mutex_destroy(&l->mu);
    free(l);
}

int tkv_l4_healthy(tkv_l4 *l) { return l ? atomic_load(&l->healthy) : 0; }

/* ============================================================================================
 * Writes
 * ========================================================================================== */

int tkv_l4_put_async(tkv_l4 *l, const tkv_key *key, const tkv_key *parent,
                     const uint32_t *tokens, uint32_t num_tokens, const void *payload,
                     size_t len)
{
    if (!l || !key || !parent || !tokens || !payload)
        return TKV_EINVAL;
    if (len != l->o.block_bytes || num_tokens != l->o.block_tokens)
        return TKV_EINVAL;
    size_t total = l->record_bytes + (size_t)l->num_chunks * TKV_L4_HEADER_BYTES;
    lock(l);
    int rc = TKV_OK;
    if (known_has(l, key)) {
        l->st.put_known++;
        rc = TKV_EEXIST;
    } else if (!atomic_load(&l->healthy) ||
               l->q_bytes + l->inflight_bytes + total > l->o.write_budget) {
        l->st.put_dropped++;
        rc = TKV_EFULL;
    } else {
        l->q_bytes += total; /* claimed now: the copy below runs unlocked */
    }
    unlock(l);
    if (rc != TKV_OK)
        return rc;

    /* Build the chunk values: header + the record's bytes for that chunk. */
    wrec *w = tkv_xcalloc(1, sizeof(*w));
    w->key = *key;
    w->num_chunks = l->num_chunks;
    w->bytes = total;
    /* from the router's list of large buffers, where the writer gives it back: a fresh 1 MiB
     * block per put faulted in ~250 pages (zeroed by the kernel) only to be freed again */
    w->buf = tkv_rc_buf_get(total);
    w->val_off = tkv_xmalloc(w->num_chunks * sizeof(size_t));
    w->val_len = tkv_xmalloc(w->num_chunks * sizeof(size_t));
    size_t tok_bytes = (size_t)num_tokens * 4;
    uint64_t *csums = tkv_xmalloc(w->num_chunks * sizeof(uint64_t));
    size_t pos = 0;
    for (uint32_t c = 0; c < w->num_chunks; c++) {
        uint64_t off = (uint64_t)c * TKV_L4_CHUNK_BYTES;
        size_t n = l->record_bytes - off < TKV_L4_CHUNK_BYTES ? l->record_bytes - off
                                                              : TKV_L4_CHUNK_BYTES;
        uint8_t *d = w->buf + pos + TKV_L4_HEADER_BYTES;
        /* the record is tokens then payload; copy the part of each that falls here */
        size_t done = 0;
        if (off < tok_bytes) {
            size_t t = tok_bytes - off < n ? tok_bytes - off : n;
            for (size_t i = 0; i < t; i++) {
                size_t bi = off + i;
                d[i] = (uint8_t)(tokens[bi / 4] >> (8 * (bi % 4)));
            }
            done = t;
        }
        if (done < n)
            memcpy(d + done, (const uint8_t *)payload + (off + done - tok_bytes), n - done);
        csums[c] = tkv_csum64(d, n);
        w->val_off[c] = pos;
        w->val_len[c] = TKV_L4_HEADER_BYTES + n;
        pos += TKV_L4_HEADER_BYTES + n;
    }
    uint64_t rcsum = tkv_csum64(csums, w->num_chunks * sizeof(uint64_t));
    for (uint32_t c = 0; c < w->num_chunks; c++) {
        hdr h = {.key = *key, .parent = *parent, .chunk = c, .num_chunks = w->num_chunks,
                 .record_bytes = l->record_bytes, .offset = (uint64_t)c * TKV_L4_CHUNK_BYTES,
                 .chunk_bytes = (uint32_t)(w->val_len[c] - TKV_L4_HEADER_BYTES),
                 .num_tokens = num_tokens, .chunk_csum = csums[c], .record_csum = rcsum};
        hdr_write(w->buf + w->val_off[c], &h);
    }
    free(csums);

    lock(l);
    w->gen = ++l->gen_queued;
    if (l->q_tail)
        l->q_tail->next = w;
    else
        l->q_head = w;
    l->q_tail = w;
    known_add(l, key); /* a second put of it while queued is not queued again */
    pthread_cond_signal(&l->cv_work);
    unlock(l);
    return TKV_OK;
}

/* Writes one batch of records with the writer's router; returns the newest generation. */
static void write_batch(tkv_l4 *l, wrec **batch, size_t nb)
{
    size_t ncmd = 0;
    for (size_t i = 0; i < nb; i++)
        ncmd += batch[i]->num_chunks;
    tkv_rc_cmd *cmds = tkv_xcalloc(ncmd, sizeof(*cmds));
    const char **argv = tkv_xmalloc(ncmd * 5 * sizeof(char *));
    size_t *argvlen = tkv_xmalloc(ncmd * 5 * sizeof(size_t));
    char (*keys)[96] = tkv_xmalloc(ncmd * sizeof(*keys));
    char ttl[16];
    int ttl_len = snprintf(ttl, sizeof(ttl), "%u", l->o.ttl_s);
    size_t k = 0;
    for (size_t i = 0; i < nb; i++) {
        wrec *w = batch[i];
        for (uint32_t c = 0; c < w->num_chunks; c++, k++) {
            const char **a = argv + k * 5;
            size_t *al = argvlen + k * 5;
            a[0] = "SET";
            al[0] = 3;
            al[1] = tkv_l4_redis_key(&w->key, c, keys[k]);
            a[1] = keys[k];
            a[2] = (const char *)w->buf + w->val_off[c];
            al[2] = w->val_len[c];
            cmds[k].argc = 3;
            if (l->o.ttl_s) {
                a[3] = "EX";
                al[3] = 2;
                a[4] = ttl;
                al[4] = (size_t)ttl_len;
                cmds[k].argc = 5;
            }
            cmds[k].argv = a;
            cmds[k].argvlen = al;
            cmds[k].key_arg = 1;
        }
    }
    tkv_rc_exec(l->wrc, cmds, ncmd);
    set_health(l, l->wrc);
    lock(l);
    k = 0;
    for (size_t i = 0; i < nb; i++) {
        wrec *w = batch[i];
        bool ok = true;
        for (uint32_t c = 0; c < w->num_chunks; c++, k++) {
            redisReply *r = cmds[k].reply;
            if (cmds[k].status != TKV_OK || !r || r->type != REDIS_REPLY_STATUS)
                ok = false;
            if (r)
                freeReplyObject(r);
        }
        if (ok) {
            l->st.put_blocks++;
            l->st.put_bytes += l->o.block_bytes;
        } else {
            l->st.put_errors++;
            known_del(l, &w->key);
        }
    }
    memset(&l->wrc_stats, 0, sizeof(l->wrc_stats));
    tkv_rc_add_stats(l->wrc, &l->wrc_stats);
    unlock(l);
    free(cmds);
    free(argv);
    free(argvlen);
    free(keys);
}

static void *writer_main(void *arg)
{
    tkv_l4 *l = arg;
    wrec *batch[WRITE_BATCH_BLOCKS];
    lock(l);
    for (;;) {
        if (!l->q_head) {
            if (l->closing)
                break;
            /* Idle and down: probe once a second so health comes back without traffic. */
            if (!atomic_load(&l->healthy)) {
                unlock(l);
                tkv_rc_refresh(l->wrc);
                set_health(l, l->wrc);
                lock(l);
                memset(&l->wrc_stats, 0, sizeof(l->wrc_stats));
                tkv_rc_add_stats(l->wrc, &l->wrc_stats);
            }
            struct timespec ts;
            clock_gettime(CLOCK_REALTIME, &ts);
            ts.tv_sec += 1;
            pthread_cond_timedwait(&l->cv_work, &l->mu, &ts);
            continue;
        }
        size_t nb = 0;
        uint64_t bytes = 0, gen = 0;
        while (l->q_head && nb < WRITE_BATCH_BLOCKS &&
               (nb == 0 || bytes + l->q_head->bytes <= WRITE_BATCH_BYTES)) {
            wrec *w = l->q_head;
            l->q_head = w->next;
            if (!l->q_head)
                l->q_tail = NULL;
            bytes += w->bytes;
            gen = w->gen;
            batch[nb++] = w;
        }
        l->q_bytes -= bytes;
        l->inflight_bytes += bytes;
        bool drop = l->closing; /* at close, queued writes are dropped, not waited for */
        unlock(l);
        if (!drop)
            write_batch(l, batch, nb);
        for (size_t i = 0; i < nb; i++)
            wrec_free(batch[i]);
        lock(l);
        if (drop)
            l->st.put_dropped += nb;
        l->inflight_bytes -= bytes;
        l->gen_done = gen;
        pthread_cond_broadcast(&l->cv_done);
    }
    pthread_cond_broadcast(&l->cv_done);
    unlock(l);
    return NULL;
}

int tkv_l4_flush(tkv_l4 *l, int timeout_ms)
{
    if (!l)
        return TKV_EINVAL;
    uint64_t deadline = timeout_ms < 0 ? 0 : tkv_now_ns() + (uint64_t)timeout_ms * 1000000ull;
    int rc = TKV_OK;
    lock(l);
    uint64_t want = l->gen_queued;
    while (l->gen_done < want && !l->closing) {
        if (timeout_ms >= 0 && tkv_now_ns() >= deadline) {
            rc = TKV_ETIMEDOUT;
            break;
        }
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        ts.tv_nsec += 20000000;
        if (ts.tv_nsec >= 1000000000) {
            ts.tv_sec++;
            ts.tv_nsec -= 1000000000;
        }
        pthread_cond_timedwait(&l->cv_done, &l->mu, &ts);
    }
    unlock(l);
    return rc;
}

/* ============================================================================================
 * Reads
 * ========================================================================================== */

static conn *conn_take(tkv_l4 *l)
{
    unsigned start = atomic_fetch_add(&l->next_conn, 1);
    for (unsigned i = 0; i < l->num_conns; i++) {
        conn *c = &l->conns[(start + i) % l->num_conns];
        if (pthread_mutex_trylock(&c->mu) == 0)
            return c;
    }
    conn *c = &l->conns[start % l->num_conns];
    pthread_mutex_lock(&c->mu);
    return c;
}

/* Checks chunk value v (n bytes) against what block `key` chunk `c` must be; data_sum is
 * tkv_csum64 of v's bytes after the header (taken by the router as they arrived). */
static bool chunk_ok(const tkv_l4 *l, const tkv_key *key, uint32_t c, const uint8_t *v,
                     size_t n, uint64_t data_sum, hdr *h)
{
    if (!hdr_read(v, n, h))
        return false;
    uint64_t off = (uint64_t)c * TKV_L4_CHUNK_BYTES;
    size_t want = l->record_bytes - off < TKV_L4_CHUNK_BYTES ? l->record_bytes - off
                                                             : TKV_L4_CHUNK_BYTES;
    return memcmp(h->key.b, key->b, TKV_KEY_BYTES) == 0 && h->chunk == c &&
           h->num_chunks == l->num_chunks && h->record_bytes == l->record_bytes &&
           h->offset == off && h->chunk_bytes == want && n == TKV_L4_HEADER_BYTES + want &&
           h->num_tokens == l->o.block_tokens &&
           data_sum == h->chunk_csum;
}

/* Copies chunk data (the record's bytes [off, off+n)) into the block's tokens / payload
 * (payload may be NULL: a one-chunk block keeps its payload in the reply). */
static void chunk_place(const tkv_l4 *l, tkv_l4_block *b, uint8_t *payload, uint64_t off,
                        const uint8_t *d, size_t n)
{
    size_t tok_bytes = (size_t)l->o.block_tokens * 4, done = 0;
    if (off < tok_bytes) {
        size_t t = tok_bytes - off < n ? tok_bytes - off : n;
        for (size_t i = 0; i < t; i++) {
            size_t bi = off + i;
            if (bi % 4 == 0)
                b->tokens[bi / 4] = 0;
            b->tokens[bi / 4] |= (uint32_t)d[i] << (8 * (bi % 4));
        }
        done = t;
    }
    if (done < n && payload)
        memcpy(payload + (off + done - tok_bytes), d + done, n - done);
}

static void observe(tkv_l4 *l, uint64_t ns)
{
    double us = (double)ns / 1000.0;
    int i = 0;
    while (i < TKV_L4_LAT_BUCKETS - 1 && us > tkv_l4_latency_bounds_us[i])
        i++;
    l->st.lat_bucket[i]++;
    l->st.lat_sum_ns += ns;
}

/* Deletes the values of blocks found damaged (best effort; a miss either way). */
static void delete_bad(tkv_rc *rc, const tkv_key *bad, size_t nbad, uint32_t num_chunks)
{
    size_t n = nbad * num_chunks;
    tkv_rc_cmd *cmds = tkv_xcalloc(n, sizeof(*cmds));
    const char **argv = tkv_xmalloc(n * 2 * sizeof(char *));
    size_t *argvlen = tkv_xmalloc(n * 2 * sizeof(size_t));
    char (*keys)[96] = tkv_xmalloc(n * sizeof(*keys));
    for (size_t i = 0, k = 0; i < nbad; i++) {
        for (uint32_t c = 0; c < num_chunks; c++, k++) {
            argv[2 * k] = "DEL";
            argvlen[2 * k] = 3;
            argvlen[2 * k + 1] = tkv_l4_redis_key(&bad[i], c, keys[k]);
            argv[2 * k + 1] = keys[k];
            cmds[k] = (tkv_rc_cmd){.argc = 2, .argv = argv + 2 * k, .argvlen = argvlen + 2 * k,
                                   .key_arg = 1};
        }
    }
    tkv_rc_exec(rc, cmds, n);
    for (size_t k = 0; k < n; k++)
        if (cmds[k].reply)
            freeReplyObject(cmds[k].reply);
    free(cmds);
    free(argv);
    free(argvlen);
    free(keys);
}

int tkv_l4_fetch_prefix(tkv_l4 *l, const tkv_key *keys, size_t n, tkv_l4_block *out,
                        size_t *num_found)
{
    if (!l || (!keys && n) || (!out && n) || !num_found)
        return TKV_EINVAL;
    *num_found = 0;
    if (n == 0)
        return TKV_OK;
    /* Down: answer at once, but let one lookup a second probe (the writer probes too). */
    if (!atomic_load(&l->healthy)) {
        uint64_t now = tkv_now_ns(), at = atomic_load(&l->next_probe_ns);
        if (now < at || !atomic_compare_exchange_strong(&l->next_probe_ns, &at,
                                                        now + PROBE_INTERVAL_NS)) {
            lock(l);
            l->st.skipped_lookups++;
            unlock(l);
            return TKV_OK;
        }
    }
    uint64_t t0 = tkv_now_ns();
    uint32_t nc = l->num_chunks;
    size_t ncmd = n * nc;
    tkv_rc_cmd *cmds = tkv_xcalloc(ncmd, sizeof(*cmds));
    const char **argv = tkv_xmalloc(ncmd * 2 * sizeof(char *));
    size_t *argvlen = tkv_xmalloc(ncmd * 2 * sizeof(size_t));
    char (*rkeys)[96] = tkv_xmalloc(ncmd * sizeof(*rkeys));
    tkv_key *bad = tkv_xmalloc(n * sizeof(*bad));
    size_t nbad = 0, found = 0, bytes = 0;
    /* Round one asks for every block's first chunk; round two for the other chunks of the
     * prefix round one found (none when a block fits one chunk, the usual case). */
    conn *cn = conn_take(l);
    for (size_t i = 0; i < n; i++) {
        argv[2 * i] = "GET";
        argvlen[2 * i] = 3;
        argvlen[2 * i + 1] = tkv_l4_redis_key(&keys[i], 0, rkeys[i]);
        argv[2 * i + 1] = rkeys[i];
        cmds[i] = (tkv_rc_cmd){.argc = 2, .argv = argv + 2 * i, .argvlen = argvlen + 2 * i,
                               .key_arg = 1, .sum_reply = 1, .sum_from = TKV_L4_HEADER_BYTES};
    }
    tkv_rc_exec(cn->rc, cmds, n);
    size_t prefix = 0;
    while (prefix < n && cmds[prefix].status == TKV_OK &&
           cmds[prefix].reply->type == REDIS_REPLY_STRING)
        prefix++;
    size_t more = 0;
    if (nc > 1 && prefix > 0) {
        for (size_t i = 0; i < prefix; i++) {
            for (uint32_t c = 1; c < nc; c++) {
                size_t k = n + more++;
                argv[2 * k] = "GET";
                argvlen[2 * k] = 3;
                argvlen[2 * k + 1] = tkv_l4_redis_key(&keys[i], c, rkeys[k]);
                argv[2 * k + 1] = rkeys[k];
                cmds[k] = (tkv_rc_cmd){.argc = 2, .argv = argv + 2 * k,
                                       .argvlen = argvlen + 2 * k, .key_arg = 1,
                                       .sum_reply = 1, .sum_from = TKV_L4_HEADER_BYTES};
            }
        }
        tkv_rc_exec(cn->rc, cmds + n, more);
    }
    /* Check and place, block by block, stopping at the first that is not whole and right. */
    for (size_t i = 0; i < prefix; i++) {
        tkv_l4_block *b = &out[found];
        b->tokens = tkv_xmalloc((size_t)l->o.block_tokens * 4);
        uint8_t *copy = nc > 1 ? tkv_rc_buf_get(l->o.block_bytes) : NULL;
        uint64_t *cs = tkv_xmalloc(nc * sizeof(uint64_t));
        bool ok = true, missing = false;
        hdr h0 = {0};
        for (uint32_t c = 0; c < nc && ok; c++) {
            tkv_rc_cmd *cmd = c == 0 ? &cmds[i] : &cmds[n + i * (nc - 1) + (c - 1)];
            if (cmd->status != TKV_OK || cmd->reply->type != REDIS_REPLY_STRING) {
                ok = false;
                missing = true; /* a chunk gone (evicted, lost in a failover): a miss */
                break;
            }
            hdr h;
            const uint8_t *v = (const uint8_t *)cmd->reply->str;
            size_t vlen = cmd->reply->len;
            /* not summed: shorter than a header, so damaged */
            if (!cmd->summed || !chunk_ok(l, &keys[i], c, v, vlen, cmd->sum, &h) ||
                (c > 0 && (h.record_csum != h0.record_csum ||
                           memcmp(h.parent.b, h0.parent.b, TKV_KEY_BYTES) != 0))) {
                ok = false;
                break;
            }
            if (c == 0)
                h0 = h;
            cs[c] = h.chunk_csum;
            chunk_place(l, b, copy, h.offset, v + TKV_L4_HEADER_BYTES, h.chunk_bytes);
        }
        if (ok && tkv_csum64(cs, nc * sizeof(uint64_t)) != h0.record_csum)
            ok = false;
        free(cs);
        if (!ok) {
            free(b->tokens);
            tkv_rc_buf_release(copy);
            b->tokens = NULL;
            if (!missing)
                bad[nbad++] = keys[i];
            break;
        }
        b->parent = h0.parent;
        if (copy) {
            b->payload = copy;
            b->owner_ = copy;
        } else { /* the reply itself holds it: hand it over instead of copying 1 MiB */
            redisReply *r = cmds[i].reply;
            b->payload = r->str + TKV_L4_HEADER_BYTES + (size_t)l->o.block_tokens * 4;
            b->owner_ = r;
            cmds[i].reply = NULL;
        }
        found++;
        bytes += l->o.block_bytes;
    }
    if (nbad)
        delete_bad(cn->rc, bad, nbad, nc);
    set_health(l, cn->rc);
    pthread_mutex_unlock(&cn->mu);
    for (size_t k = 0; k < n + more; k++)
        tkv_rc_reply_free(cmds[k].reply);

    lock(l);
    l->st.lookups++;
    l->st.lookup_keys += n;
    l->st.hit_blocks += found;
    l->st.hit_bytes += bytes;
    l->st.checksum_failures += nbad;
    for (size_t i = 0; i < found; i++)
        known_add(l, &keys[i]);
    observe(l, tkv_now_ns() - t0);
    unlock(l);
    free(cmds);
    free(argv);
    free(argvlen);
    free(rkeys);
    free(bad);
    *num_found = found;
    return TKV_OK;
}

void tkv_l4_blocks_free(tkv_l4_block *b, size_t n)
{
    for (size_t i = 0; b && i < n; i++) {
        free(b[i].tokens);
        if (b[i].owner_ && b[i].owner_ != b[i].payload)
            tkv_rc_reply_free(b[i].owner_);
        else
            tkv_rc_buf_release(b[i].owner_);
        b[i].tokens = NULL;
        b[i].payload = NULL;
        b[i].owner_ = NULL;
    }
}

void tkv_l4_get_stats(tkv_l4 *l, tkv_l4_stats *out)
{
    if (!l || !out)
        return;
    tkv_rc_stats rs = {0};
    /* Readers' routers are summed under their own locks (never two at once). */
    for (unsigned i = 0; i < l->num_conns; i++) {
        pthread_mutex_lock(&l->conns[i].mu);
        tkv_rc_add_stats(l->conns[i].rc, &rs);
        pthread_mutex_unlock(&l->conns[i].mu);
    }
    lock(l);
    *out = l->st;
    rs.commands += l->wrc_stats.commands;
    rs.errors += l->wrc_stats.errors;
    rs.timeouts += l->wrc_stats.timeouts;
    rs.moved += l->wrc_stats.moved;
    rs.ask += l->wrc_stats.ask;
    rs.connects += l->wrc_stats.connects;
    rs.connect_failures += l->wrc_stats.connect_failures;
    rs.map_loads += l->wrc_stats.map_loads;
    out->queue_bytes = l->q_bytes + l->inflight_bytes;
    unlock(l);
    out->errors = rs.errors;
    out->timeouts = rs.timeouts;
    out->moved = rs.moved;
    out->ask = rs.ask;
    out->connects = rs.connects;
    out->connect_failures = rs.connect_failures;
    out->map_loads = rs.map_loads;
    out->healthy = atomic_load(&l->healthy);
}
