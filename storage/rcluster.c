/* rcluster.c - the Redis Cluster router behind tkv_rcluster.h.
 *
 * ---- How a batch runs ----------------------------------------------------------------------
 * Each round routes every unfinished command to a node (an ASK target, else the slot map's
 * master), appends it to that node's hiredis output buffer, and then drives all nodes' sockets
 * at once from one poll() loop until each node has answered everything sent to it or the
 * round's deadline passes. Answers come back in order per connection, so the i-th reply of a
 * node belongs to the i-th command sent there. MOVED and ASK send the command round again;
 * a node that fails mid-round is dropped (its unanswered commands fail: we cannot know what it
 * did with them) and reconnected with back-off on a later call.
 *
 * The sockets are non-blocking while a round runs; the few setup commands (AUTH, CLUSTER
 * SLOTS) run in blocking mode with SO_RCVTIMEO, between rounds, when nothing is in flight.
 *
 * Replies are read by us, not by hiredis: small ones into hiredis's reader buffer and parsed
 * there; a bulk string of 64 KiB or more is taken over once its length is known and read
 * straight into a reused buffer (one copy, from the socket), so a 1 MiB value costs neither
 * hiredis's second copy nor fresh heap pages. When the command asks for it (sum_reply), such a
 * value is checksummed after each read, on bytes the kernel has just written and the cache
 * still holds; summed after the batch, 16 values of 1 MiB were read back from memory and took
 * ~15% of a lookup.
 */
#include "tkv_rcluster.h"

#include "tkv_base.h"
#include "tkv_csum.h"

#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <poll.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/time.h>
#include <sys/uio.h>
#include <unistd.h>

#include <hiredis/sds.h>

#define MAX_REDIRECTS 5
#define MAP_MIN_INTERVAL_NS 100000000ull /* reload the slot map at most every 100 ms */
#define BACKOFF_MIN_MS 25u

/* ============================================================================================
 * Key slots
 * ========================================================================================== */

uint16_t tkv_rc_crc16(const void *buf, size_t len)
{
    const uint8_t *p = buf;
    uint16_t crc = 0;
    for (size_t i = 0; i < len; i++) {
        crc ^= (uint16_t)(p[i] << 8);
        for (int b = 0; b < 8; b++)
            crc = (uint16_t)(crc & 0x8000 ? (crc << 1) ^ 0x1021 : crc << 1);
    }
    return crc;
}

uint16_t tkv_rc_key_slot(const void *key, size_t len)
{
    const char *k = key;
    const char *open = memchr(k, '{', len);
    if (open) {
        size_t from = (size_t)(open - k) + 1;
        const char *close = memchr(k + from, '}', len - from);
        if (close && close > k + from) /* "{}" is no tag: the whole key is hashed */
            return tkv_rc_crc16(k + from, (size_t)(close - (k + from))) & (TKV_RC_SLOTS - 1);
    }
    return tkv_rc_crc16(k, len) & (TKV_RC_SLOTS - 1);
}

int tkv_rc_parse_nodes(const char *list, char hosts[][64], int *ports, int max, char *err,
                       size_t err_len)
{
    int n = 0;
    const char *p = list ? list : "";
    while (*p) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        const char *colon = memrchr(p, ':', len);
        if (len == 0 || !colon || colon == p || (size_t)(colon - p) >= 64) {
            snprintf(err, err_len, "node \"%.*s\": expected host:port", (int)len, p);
            return TKV_EINVAL;
        }
        char portbuf[8];
        size_t plen = len - (size_t)(colon + 1 - p);
        if (plen == 0 || plen >= sizeof(portbuf)) {
            snprintf(err, err_len, "node \"%.*s\": bad port", (int)len, p);
            return TKV_EINVAL;
        }
        memcpy(portbuf, colon + 1, plen);
        portbuf[plen] = '\0';
        char *e = NULL;
        long port = strtol(portbuf, &e, 10);
        if (*e || port < 1 || port > 65535) {
            snprintf(err, err_len, "node \"%.*s\": port must be 1..65535", (int)len, p);
            return TKV_EINVAL;
        }
        for (const char *c = p; c < colon; c++) {
            if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') ||
                  (*c >= '0' && *c <= '9') || *c == '.' || *c == '-' || *c == '_')) {
                snprintf(err, err_len, "node \"%.*s\": bad host name", (int)len, p);
                return TKV_EINVAL;
            }
        }
        if (n == max) {
            snprintf(err, err_len, "more than %d nodes", max);
            return TKV_EINVAL;
        }
        memcpy(hosts[n], p, (size_t)(colon - p));
        hosts[n][colon - p] = '\0';
        ports[n] = (int)port;
        n++;
        p += len;
        if (*p == ',' && !*++p) {
            snprintf(err, err_len, "empty entry after the last ','");
            return TKV_EINVAL;
        }
    }
    if (n == 0) {
        snprintf(err, err_len, "no nodes given");
        return TKV_EINVAL;
    }
    return n;
}

/* ============================================================================================
 * Large string buffers, kept for reuse
 *
 * A lookup of 16 blocks of 1 MiB hands 16 replies to its caller, who frees them together; from
 * glibc's heap that is 16 MiB grown (page faults on fresh pages) and trimmed (brk) every round.
 * Strings of POOL_MIN_BYTES or more are therefore taken from, and given back to, a small
 * process-wide free list. Its buffers are plain malloc blocks, so a reply freed the ordinary
 * way (freeReplyObject) is still correct, it just does not come back to the list.
 * ========================================================================================== */

#define POOL_MIN_BYTES (64u << 10)
#define POOL_ROUND (64u << 10)     /* sizes rounded up, so near sizes share buffers */
#define TAKE_MAX_BYTES (512u << 20) /* Redis's largest string (proto-max-bulk-len) */
#define POOL_MAX_BUFS 64           /* idle at most 64 buffers (64 MiB of 1 MiB values) */

static pthread_mutex_t g_pool_mu = PTHREAD_MUTEX_INITIALIZER;
static void *g_pool[POOL_MAX_BUFS];
static int g_pool_n;

void *tkv_rc_buf_get(size_t bytes)
{
    if (bytes < POOL_MIN_BYTES)
        return tkv_xmalloc(bytes);
    pthread_mutex_lock(&g_pool_mu);
    for (int i = g_pool_n - 1; i >= 0; i--) {
        size_t have = malloc_usable_size(g_pool[i]);
        if (have >= bytes && have <= 2 * bytes + POOL_ROUND) {
            void *p = g_pool[i];
            g_pool[i] = g_pool[--g_pool_n];
            pthread_mutex_unlock(&g_pool_mu);
            return p;
        }
    }
    pthread_mutex_unlock(&g_pool_mu);
    return tkv_xmalloc((bytes + POOL_ROUND - 1) / POOL_ROUND * POOL_ROUND);
}

void tkv_rc_buf_release(void *p)
{
    if (!p)
        return;
    if (malloc_usable_size(p) >= POOL_MIN_BYTES) {
        pthread_mutex_lock(&g_pool_mu);
        if (g_pool_n < POOL_MAX_BUFS) {
            g_pool[g_pool_n++] = p;
            p = NULL;
        }
        pthread_mutex_unlock(&g_pool_mu);
    }
    free(p);
}

void tkv_rc_reply_free(redisReply *r)
{
    if (!r)
        return;
    if (r->type == REDIS_REPLY_STRING) {
        tkv_rc_buf_release(r->str);
        r->str = NULL;
    }
    freeReplyObject(r);
}

/* hiredis's reply builders with one change: a large string's copy goes into a pool buffer.
 * The default builder makes the reply (and links it into its parent) with an empty string,
 * whose 1-byte buffer is then swapped for ours. */
static redisReplyObjectFunctions g_fn;
static void *(*g_fn_default_string)(const redisReadTask *, char *, size_t);
static pthread_once_t g_fn_once = PTHREAD_ONCE_INIT;

static void *create_string(const redisReadTask *t, char *str, size_t len)
{
    if (len < POOL_MIN_BYTES)
        return g_fn_default_string(t, str, len);
    redisReply *r = g_fn_default_string(t, str, 0);
    if (!r)
        return NULL;
    char *buf = tkv_rc_buf_get(len + 1);
    memcpy(buf, str, len);
    buf[len] = '\0';
    free(r->str);
    r->str = buf;
    r->len = len;
    return r;
}

static void fn_init(void)
{
    redisReader *rd = redisReaderCreate();
    TKV_ASSERT(rd != NULL); /* out of memory at the first connect */
    g_fn = *rd->fn;
    g_fn_default_string = rd->fn->createString;
    g_fn.createString = create_string;
    redisReaderFree(rd);
}

/* ============================================================================================
 * Nodes and connections
 * ========================================================================================== */

typedef struct node {
    char host[64];
    int port;
    redisContext *c;
    uint64_t retry_at_ns;     /* no connect attempt before this */
    uint32_t backoff_ms;
    /* the current round */
    size_t nsent, nread;      /* replies expected / received (ASKING included) */
    bool failed;
    /* The round's output, written with writev: protocol text in `arena`, large arguments
     * straight from the caller's buffers (hiredis's own output buffer would copy each value
     * and move its unwritten tail after every partial write). */
    char *arena;
    size_t arena_len, arena_cap;
    struct iovec *iov;
    size_t niov, iov_cap, iov_pos;
    /* A large bulk reply taken over from hiredis's reader (see take_bulk): read straight
     * into big (want = its length + the closing CRLF), handed out as `ready` when whole. */
    char *big;
    size_t big_len, big_have;
    redisReply *ready;
    /* The sum the next reply's command asks for (set before each parse), the running sum of
     * a taken-over bulk (bytes [sum_from, big_sum_pos) taken so far), and the finished sum
     * that goes with `ready`. */
    int next_sum;
    size_t next_sum_from;
    int big_sum;
    size_t big_sum_pos;
    tkv_csum64_state big_st;
    int ready_summed;
    uint64_t ready_sum;
} node;

#define INLINE_ARG_BYTES 512
#define READ_BYTES (128u << 10) /* arguments up to this size are copied into the arena */
#define BIG_READ_BYTES (256u << 10) /* a taken-over bulk is read and summed in such steps */

struct tkv_rc {
    tkv_rc_opts o;
    char *user, *password;
    node nodes[TKV_RC_MAX_NODES];
    int num_nodes;
    int16_t slots[TKV_RC_SLOTS];   /* node index serving each slot, or -1 */
    uint64_t map_at_ns;            /* last reload attempt */
    bool map_stale;                /* a MOVED or a failure says the map is out of date */
    bool healthy;
    tkv_rc_stats st;
    /* per-exec scratch */
    size_t cap;
    int16_t *route;                /* node of each command this round, -1 when finished */
    int16_t *ask;                  /* ASK target, or -1 */
    uint8_t *redirects;
    size_t *order;                 /* commands grouped by node, in send order */
};

static int node_find_add(tkv_rc *rc, const char *host, int port)
{
    for (int i = 0; i < rc->num_nodes; i++)
        if (rc->nodes[i].port == port && strcmp(rc->nodes[i].host, host) == 0)
            return i;
    if (rc->num_nodes == TKV_RC_MAX_NODES || strlen(host) >= sizeof(rc->nodes[0].host))
        return -1;
    node *nd = &rc->nodes[rc->num_nodes];
    memset(nd, 0, sizeof(*nd));
    strcpy(nd->host, host);
    nd->port = port;
    return rc->num_nodes++;
}

/* ---- output of a round ---- */

static void out_reset(node *nd)
{
    nd->arena_len = 0;
    nd->niov = nd->iov_pos = 0;
}

/* Reserves room for what the commands cmds[order[from..to)] (and an ASKING before each with
 * ask[i] >= 0) need in the arena, so that it never moves while iovecs point into it. */
static void out_reserve(node *nd, size_t bytes, size_t iovs)
{
    if (nd->arena_cap < bytes) {
        free(nd->arena);
        nd->arena_cap = bytes < 4096 ? 4096 : bytes;
        nd->arena = tkv_xmalloc(nd->arena_cap);
    }
    if (nd->iov_cap < iovs) {
        free(nd->iov);
        nd->iov_cap = iovs < 64 ? 64 : iovs;
        nd->iov = tkv_xmalloc(nd->iov_cap * sizeof(*nd->iov));
    }
}

static void out_arena(node *nd, const void *p, size_t n)
{
    char *dst = nd->arena + nd->arena_len;
    TKV_ASSERT(nd->arena_len + n <= nd->arena_cap);
    memcpy(dst, p, n);
    nd->arena_len += n;
    struct iovec *last = nd->niov ? &nd->iov[nd->niov - 1] : NULL;
    if (last && (char *)last->iov_base + last->iov_len == dst) {
        last->iov_len += n;
        return;
    }
    TKV_ASSERT(nd->niov < nd->iov_cap);
    nd->iov[nd->niov++] = (struct iovec){.iov_base = dst, .iov_len = n};
}

static void out_fmt(node *nd, char c, size_t v)
{
    char b[32];
    int n = snprintf(b, sizeof(b), "%c%zu\r\n", c, v);
    out_arena(nd, b, (size_t)n);
}

/* Arena bytes and iovecs one command needs at most. */
static void out_need(int argc, const char **argv, const size_t *argvlen, size_t *bytes,
                     size_t *iovs)
{
    *bytes += 24;
    *iovs += 1;
    for (int a = 0; a < argc; a++) {
        size_t len = argvlen ? argvlen[a] : strlen(argv[a]);
        *bytes += 24 + 2 + (len <= INLINE_ARG_BYTES ? len : 0);
        *iovs += 3;
    }
}

static void out_command(node *nd, int argc, const char **argv, const size_t *argvlen)
{
    out_fmt(nd, '*', (size_t)argc);
    for (int a = 0; a < argc; a++) {
        size_t len = argvlen ? argvlen[a] : strlen(argv[a]);
        out_fmt(nd, '$', len);
        if (len <= INLINE_ARG_BYTES) {
            out_arena(nd, argv[a], len);
        } else {
            TKV_ASSERT(nd->niov < nd->iov_cap);
            nd->iov[nd->niov++] = (struct iovec){.iov_base = (void *)argv[a], .iov_len = len};
        }
        out_arena(nd, "\r\n", 2);
    }
}

/* Writes what the socket takes; false on an error. */
static bool out_write(node *nd)
{
    while (nd->iov_pos < nd->niov) {
        size_t cnt = nd->niov - nd->iov_pos;
        ssize_t w = writev(nd->c->fd, nd->iov + nd->iov_pos, (int)(cnt > 1024 ? 1024 : cnt));
        if (w < 0)
            return errno == EAGAIN || errno == EINTR;
        size_t left = (size_t)w;
        while (left && nd->iov_pos < nd->niov) {
            struct iovec *v = &nd->iov[nd->iov_pos];
            size_t take = left < v->iov_len ? left : v->iov_len;
            v->iov_base = (char *)v->iov_base + take;
            v->iov_len -= take;
            left -= take;
            if (v->iov_len == 0)
                nd->iov_pos++;
        }
    }
    return true;
}

static struct timeval tv_ms(uint32_t ms)
{
    struct timeval tv = {.tv_sec = ms / 1000, .tv_usec = (suseconds_t)(ms % 1000) * 1000};
    return tv;
}

static void set_blocking(redisContext *c, bool on)
{
    int fl = fcntl(c->fd, F_GETFL);
    if (fl >= 0)
        fcntl(c->fd, F_SETFL, on ? fl & ~O_NONBLOCK : fl | O_NONBLOCK);
    if (on)
        c->flags |= REDIS_BLOCK;
    else
        c->flags &= ~REDIS_BLOCK;
}

static void node_drop(tkv_rc *rc, node *nd)
{
    tkv_rc_buf_release(nd->big);
    nd->big = NULL;
    tkv_rc_reply_free(nd->ready);
    nd->ready = NULL;
    nd->big_sum = nd->ready_summed = 0;
    if (nd->c) {
        redisFree(nd->c);
        nd->c = NULL;
    }
    nd->backoff_ms = nd->backoff_ms ? nd->backoff_ms * 2 : BACKOFF_MIN_MS;
    if (nd->backoff_ms > rc->o.backoff_max_ms)
        nd->backoff_ms = rc->o.backoff_max_ms;
    nd->retry_at_ns = tkv_now_ns() + (uint64_t)nd->backoff_ms * 1000000ull;
    rc->map_stale = true;
}

/* Blocking command on a connected node (between rounds). NULL on failure (node dropped). */
static redisReply *node_command(tkv_rc *rc, node *nd, int argc, const char **argv)
{
    redisReply *r = redisCommandArgv(nd->c, argc, argv, NULL);
    if (!r) {
        TKV_LOG(TKV_LOG_DEBUG, "redis %s:%d: %s", nd->host, nd->port, nd->c->errstr);
        node_drop(rc, nd);
    }
    return r;
}

/* The node's connection, connecting (and authenticating) when its back-off allows. */
static redisContext *node_conn(tkv_rc *rc, node *nd)
{
    if (nd->c)
        return nd->c;
    if (tkv_now_ns() < nd->retry_at_ns)
        return NULL;
    rc->st.connects++;
    nd->c = redisConnectWithTimeout(nd->host, nd->port, tv_ms(rc->o.connect_timeout_ms));
    if (!nd->c || nd->c->err) {
        TKV_LOG(TKV_LOG_DEBUG, "redis %s:%d: connect: %s", nd->host, nd->port,
                nd->c ? nd->c->errstr : "out of memory");
        rc->st.connect_failures++;
        node_drop(rc, nd);
        return NULL;
    }
    redisSetTimeout(nd->c, tv_ms(rc->o.connect_timeout_ms));
    redisEnableKeepAlive(nd->c);
    /* Keep the reader's buffer between replies: hiredis frees any idle buffer over 16 KiB,
     * so each 1 MiB value would grow a new one from nothing, copying it ~7 times. */
    nd->c->reader->maxbuf = 0;
    pthread_once(&g_fn_once, fn_init);
    nd->c->reader->fn = &g_fn;
    if (rc->password) {
        const char *argv[3] = {"AUTH", rc->user ? rc->user : rc->password, rc->password};
        redisReply *r = node_command(rc, nd, rc->user ? 3 : 2, argv);
        if (!r) {
            rc->st.connect_failures++;
            return NULL;
        }
        bool ok = r->type == REDIS_REPLY_STATUS;
        if (!ok)
            TKV_LOG(TKV_LOG_WARN, "redis %s:%d: AUTH refused: %s", nd->host, nd->port,
                    r->type == REDIS_REPLY_ERROR ? r->str : "unexpected reply");
        freeReplyObject(r);
        if (!ok) {
            rc->st.connect_failures++;
            node_drop(rc, nd);
            return NULL;
        }
    }
    nd->backoff_ms = 0;
    return nd->c;
}

/* ============================================================================================
 * The slot map
 * ========================================================================================== */

/* Parses a CLUSTER SLOTS reply into slots[]; the number of slots covered, or -1. */
static int parse_slots(tkv_rc *rc, const node *asked, const redisReply *r, int16_t *slots)
{
    if (r->type != REDIS_REPLY_ARRAY)
        return -1;
    int covered = 0;
    for (size_t i = 0; i < r->elements; i++) {
        const redisReply *e = r->element[i];
        if (e->type != REDIS_REPLY_ARRAY || e->elements < 3 ||
            e->element[0]->type != REDIS_REPLY_INTEGER ||
            e->element[1]->type != REDIS_REPLY_INTEGER || e->element[2]->type != REDIS_REPLY_ARRAY ||
            e->element[2]->elements < 2 || e->element[2]->element[0]->type != REDIS_REPLY_STRING ||
            e->element[2]->element[1]->type != REDIS_REPLY_INTEGER)
            return -1;
        long long lo = e->element[0]->integer, hi = e->element[1]->integer;
        const redisReply *m = e->element[2];
        /* An empty address means "the node you asked" (it does not know its own). */
        const char *host = m->element[0]->len ? m->element[0]->str : asked->host;
        long long port = m->element[1]->integer;
        if (lo < 0 || hi >= TKV_RC_SLOTS || lo > hi || port < 1 || port > 65535)
            return -1;
        int idx = node_find_add(rc, host, (int)port);
        if (idx < 0)
            return -1;
        for (long long s = lo; s <= hi; s++) {
            if (slots[s] < 0)
                covered++;
            slots[s] = (int16_t)idx;
        }
    }
    return covered;
}

static int load_map(tkv_rc *rc, bool force)
{
    uint64_t now = tkv_now_ns();
    if (!force && rc->map_at_ns && now - rc->map_at_ns < MAP_MIN_INTERVAL_NS)
        return rc->healthy ? TKV_OK : TKV_EIO;
    rc->map_at_ns = now;
    int16_t *slots = tkv_xmalloc(sizeof(rc->slots));
    int rcode = TKV_EIO;
    /* Ask the nodes in turn, starting after the last one that answered is not worth the
     * bookkeeping: the first reachable node's map is as good as any. */
    for (int i = 0; i < rc->num_nodes; i++) {
        node *nd = &rc->nodes[i];
        if (!node_conn(rc, nd))
            continue;
        const char *argv[2] = {"CLUSTER", "SLOTS"};
        redisReply *r = node_command(rc, nd, 2, argv);
        if (!r)
            continue;
        for (int s = 0; s < TKV_RC_SLOTS; s++)
            slots[s] = -1;
        int covered = parse_slots(rc, nd, r, slots);
        freeReplyObject(r);
        if (covered < 0) {
            TKV_LOG(TKV_LOG_WARN, "redis %s:%d: malformed CLUSTER SLOTS reply", nd->host,
                    nd->port);
            continue;
        }
        rc->st.map_loads++;
        memcpy(rc->slots, slots, sizeof(rc->slots));
        rc->map_stale = false;
        rcode = covered == TKV_RC_SLOTS ? TKV_OK : TKV_EIO;
        break;
    }
    free(slots);
    rc->healthy = rcode == TKV_OK;
    return rcode;
}

int tkv_rc_refresh(tkv_rc *rc) { return rc ? load_map(rc, false) : TKV_EINVAL; }
int tkv_rc_healthy(const tkv_rc *rc) { return rc && rc->healthy; }

/* ============================================================================================
 * Open / close
 * ========================================================================================== */

int tkv_rc_open(const tkv_rc_opts *o, tkv_rc **out)
{
    if (!o || !out)
        return TKV_EINVAL;
    *out = NULL;
    char hosts[TKV_RC_MAX_NODES][64];
    int ports[TKV_RC_MAX_NODES];
    char err[160];
    int n = tkv_rc_parse_nodes(o->nodes, hosts, ports, TKV_RC_MAX_NODES, err, sizeof(err));
    if (n < 0) {
        TKV_LOG(TKV_LOG_ERROR, "redis nodes: %s", err);
        return TKV_EINVAL;
    }
    tkv_rc *rc = tkv_xcalloc(1, sizeof(*rc));
    rc->o = *o;
    rc->o.nodes = NULL;
    if (!rc->o.connect_timeout_ms)
        rc->o.connect_timeout_ms = 500;
    if (!rc->o.timeout_ms)
        rc->o.timeout_ms = 2000;
    if (!rc->o.backoff_max_ms)
        rc->o.backoff_max_ms = 2000;
    rc->user = o->user && *o->user ? tkv_xstrdup(o->user) : NULL;
    rc->password = o->password && *o->password ? tkv_xstrdup(o->password) : NULL;
    rc->o.user = rc->o.password = NULL;
    for (int i = 0; i < n; i++)
        node_find_add(rc, hosts[i], ports[i]);
    for (int s = 0; s < TKV_RC_SLOTS; s++)
        rc->slots[s] = -1;
    load_map(rc, true);
    *out = rc;
    return TKV_OK;
}

void tkv_rc_close(tkv_rc *rc)
{
    if (!rc)
        return;
    for (int i = 0; i < rc->num_nodes; i++) {
        if (rc->nodes[i].c)
            redisFree(rc->nodes[i].c);
        free(rc->nodes[i].arena);
        free(rc->nodes[i].iov);
    }
    free(rc->user);
    free(rc->password);
    free(rc->route);
    free(rc->ask);
    free(rc->redirects);
    free(rc->order);
    free(rc);
}

void tkv_rc_add_stats(const tkv_rc *rc, tkv_rc_stats *out)
{
    if (!rc || !out)
        return;
    out->commands += rc->st.commands;
    out->errors += rc->st.errors;
    out->timeouts += rc->st.timeouts;
    out->moved += rc->st.moved;
    out->ask += rc->st.ask;
    out->connects += rc->st.connects;
    out->connect_failures += rc->st.connect_failures;
    out->map_loads += rc->st.map_loads;
}

/* ============================================================================================
 * exec
 * ========================================================================================== */

/* "MOVED <slot> <host>:<port>" / "ASK ...": the target node's index, or -1. */
static int redirect_target(tkv_rc *rc, const char *msg, size_t skip)
{
    const char *p = strchr(msg + skip, ' ');
    if (!p)
        return -1;
    p++;
    const char *colon = strrchr(p, ':');
    if (!colon || colon == p || (size_t)(colon - p) >= 64)
        return -1;
    char host[64];
    memcpy(host, p, (size_t)(colon - p));
    host[colon - p] = '\0';
    long port = strtol(colon + 1, NULL, 10);
    if (port < 1 || port > 65535)
        return -1;
    return node_find_add(rc, host, (int)port);
}

static void ensure_scratch(tkv_rc *rc, size_t n)
{
    if (n <= rc->cap)
        return;
    free(rc->route);
    free(rc->ask);
    free(rc->redirects);
    free(rc->order);
    rc->cap = n;
    rc->route = tkv_xmalloc(n * sizeof(*rc->route));
    rc->ask = tkv_xmalloc(n * sizeof(*rc->ask));
    rc->redirects = tkv_xmalloc(n);
    rc->order = tkv_xmalloc(n * sizeof(*rc->order));
}

/* Sums what has arrived of a taken-over bulk (its closing CRLF excluded). */
static void big_sum_more(node *nd)
{
    size_t upto = nd->big_have < nd->big_len ? nd->big_have : nd->big_len;
    if (nd->big_sum && upto > nd->big_sum_pos)
        nd->big_sum_pos += tkv_csum64_update(&nd->big_st, nd->big + nd->big_sum_pos,
                                             upto - nd->big_sum_pos);
}

/* When hiredis's reader stopped inside a top-level bulk string of POOL_MIN_BYTES or more (it
 * has read the '$' and waits for the rest), the rest is read by us straight into a pool
 * buffer: hiredis would gather the whole value in its own buffer and then copy it out. The
 * reader is left as between replies. */
static void take_bulk(node *nd)
{
    redisReader *rd = nd->c->reader;
    if (rd->err || rd->ridx != 0 || rd->rstack[0].type != REDIS_REPLY_STRING ||
        rd->rstack[0].parent != NULL)
        return;
    const char *p = rd->buf + rd->pos, *end = rd->buf + rd->len;
    const char *nl = memchr(p, '\r', (size_t)(end - p));
    if (!nl || nl + 1 >= end || nl[1] != '\n' || nl == p)
        return;
    size_t len = 0;
    for (const char *q = p; q < nl; q++) {
        if (*q < '0' || *q > '9' || len > TAKE_MAX_BYTES)
            return; /* "-1" (nil) or something odd: left to hiredis */
        len = len * 10 + (size_t)(*q - '0');
    }
    if (len < POOL_MIN_BYTES || len > TAKE_MAX_BYTES)
        return; /* over Redis's own limit: not allocated up front on the header's word */
    const char *data = nl + 2;
    size_t have = (size_t)(end - data);
    if (have >= len + 2)
        return; /* whole already (cannot be: hiredis would have parsed it) */
    nd->big = tkv_rc_buf_get(len + 2);
    memcpy(nd->big, data, have);
    nd->big_len = len;
    nd->big_have = have;
    nd->big_sum = nd->next_sum && len >= nd->next_sum_from;
    if (nd->big_sum) {
        tkv_csum64_begin(&nd->big_st);
        nd->big_sum_pos = nd->next_sum_from;
        big_sum_more(nd);
    }
    sdsclear(rd->buf);
    rd->pos = rd->len = 0;
    rd->ridx = -1;
}

/* The next reply of a node: a taken-over bulk once whole (with its sum when one was taken:
 * *summed), else hiredis's next. */
static int node_reply(node *nd, void **out, int *summed, uint64_t *sum)
{
    *out = NULL;
    *summed = 0;
    if (nd->ready) {
        *out = nd->ready;
        nd->ready = NULL;
        *summed = nd->ready_summed;
        *sum = nd->ready_sum;
        nd->ready_summed = 0;
        return REDIS_OK;
    }
    if (nd->big)
        return REDIS_OK;
    if (redisGetReplyFromReader(nd->c, out) != REDIS_OK)
        return REDIS_ERR;
    if (!*out)
        take_bulk(nd);
    return REDIS_OK;
}

/* One poll() over every node still owed replies: writes what it can of their output, reads
 * what arrived (parsed later by the caller). Returns when something happened or at the
 * deadline. */
static void pump(tkv_rc *rc, uint64_t deadline_ns)
{
    struct pollfd pfd[TKV_RC_MAX_NODES];
    int map[TKV_RC_MAX_NODES];
    int np = 0;
    for (int i = 0; i < rc->num_nodes; i++) {
        node *nd = &rc->nodes[i];
        if (nd->failed || !nd->c || nd->nread == nd->nsent)
            continue;
        pfd[np].fd = nd->c->fd;
        pfd[np].events = (short)(POLLIN | (nd->iov_pos < nd->niov ? POLLOUT : 0));
        pfd[np].revents = 0;
        map[np++] = i;
    }
    uint64_t now = tkv_now_ns();
    if (np == 0 || now >= deadline_ns)
        return;
    int ms = (int)((deadline_ns - now + 999999) / 1000000);
    if (poll(pfd, (nfds_t)np, ms) <= 0)
        return;
    for (int j = 0; j < np; j++) {
        node *nd = &rc->nodes[map[j]];
        if (pfd[j].revents & POLLOUT) {
            if (!out_write(nd)) {
                nd->failed = true;
                continue;
            }
        }
        /* One read of up to 128 KiB per wake-up (hiredis reads 16 KiB: 64 polls per 1 MiB
         * value), straight into the end of the reader's buffer (redisReaderFeed would copy
         * every value once more), then the caller parses; reading further ahead would pile
         * replies up in that buffer, which hiredis shifts down after every reply. */
        if ((pfd[j].revents & (POLLIN | POLLERR | POLLHUP)) && nd->big) {
            /* Read in steps that stay in cache, summing each step while it is there, until
             * the socket is empty or the value is whole. */
            for (;;) {
                size_t want = nd->big_len + 2 - nd->big_have;
                ssize_t got = read(nd->c->fd, nd->big + nd->big_have,
                                   want < BIG_READ_BYTES ? want : BIG_READ_BYTES);
                if (got <= 0) {
                    if (got == 0 || (errno != EAGAIN && errno != EINTR))
                        nd->failed = true;
                    break;
                }
                nd->big_have += (size_t)got;
                big_sum_more(nd);
                if (nd->big_have < nd->big_len + 2) {
                    if ((size_t)got < BIG_READ_BYTES)
                        break; /* the socket had no more: back to poll */
                    continue;
                }
                if (nd->big[nd->big_len] != '\r' || nd->big[nd->big_len + 1] != '\n') {
                    nd->failed = true; /* out of step with the protocol */
                    break;
                }
                if (nd->big_sum) {
                    nd->ready_sum = tkv_csum64_end(&nd->big_st, nd->big + nd->big_sum_pos,
                                                   nd->big_len - nd->big_sum_pos);
                    nd->ready_summed = 1;
                    nd->big_sum = 0;
                }
                nd->big[nd->big_len] = '\0';
                redisReply *r = tkv_xcalloc(1, sizeof(*r));
                r->type = REDIS_REPLY_STRING;
                r->str = nd->big;
                r->len = nd->big_len;
                nd->ready = r;
                nd->big = NULL;
                break;
            }
        } else if (pfd[j].revents & (POLLIN | POLLERR | POLLHUP)) {
            redisReader *rd = nd->c->reader;
            if (rd->err || !(rd->buf = sdsMakeRoomFor(rd->buf, READ_BYTES))) {
                nd->failed = true;
                continue;
            }
            ssize_t got = read(nd->c->fd, rd->buf + sdslen(rd->buf), READ_BYTES);
            if (got > 0) {
                sdsIncrLen(rd->buf, (int)got);
                rd->len = sdslen(rd->buf);
            } else if (got == 0 || (errno != EAGAIN && errno != EINTR)) {
                nd->failed = true; /* closed by the server, or an error */
            }
        }
    }
}

int tkv_rc_exec(tkv_rc *rc, tkv_rc_cmd *cmds, size_t n)
{
    if (!rc || (!cmds && n))
        return TKV_EINVAL;
    ensure_scratch(rc, n);
    for (size_t i = 0; i < n; i++) {
        cmds[i].reply = NULL;
        cmds[i].status = TKV_EIO;
        cmds[i].summed = 0;
        cmds[i].sum = 0;
        rc->route[i] = 0;
        rc->ask[i] = -1;
        rc->redirects[i] = 0;
    }
    rc->st.commands += n;
    if (rc->map_stale)
        load_map(rc, false);
    size_t left = n;
    bool reached = false;
    for (int round = 0; round <= MAX_REDIRECTS && left; round++) {
        /* Route. */
        size_t per_node[TKV_RC_MAX_NODES] = {0};
        for (size_t i = 0; i < n; i++) {
            if (rc->route[i] < 0)
                continue;
            tkv_rc_cmd *c = &cmds[i];
            int nd = rc->ask[i];
            if (nd < 0) {
                uint16_t slot = tkv_rc_key_slot(c->argv[c->key_arg], c->argvlen
                                                ? c->argvlen[c->key_arg] : strlen(c->argv[c->key_arg]));
                nd = rc->slots[slot];
            }
            if (nd < 0 || !node_conn(rc, &rc->nodes[nd])) {
                rc->route[i] = -1; /* no node: a miss */
                c->status = TKV_EIO;
                rc->map_stale = true;
                left--;
                continue;
            }
            rc->route[i] = (int16_t)nd;
            per_node[nd]++;
        }
        /* Group by node (counting sort keeps the order within a node) and append. */
        size_t start[TKV_RC_MAX_NODES + 1], fill[TKV_RC_MAX_NODES];
        start[0] = 0;
        for (int k = 0; k < rc->num_nodes; k++)
            start[k + 1] = start[k] + per_node[k];
        memcpy(fill, start, sizeof(fill));
        size_t need_bytes[TKV_RC_MAX_NODES] = {0}, need_iovs[TKV_RC_MAX_NODES] = {0};
        for (size_t i = 0; i < n; i++) {
            if (rc->route[i] < 0)
                continue;
            int k = rc->route[i];
            out_need(cmds[i].argc, cmds[i].argv, cmds[i].argvlen, &need_bytes[k], &need_iovs[k]);
            if (rc->ask[i] >= 0) {
                need_bytes[k] += 24;
                need_iovs[k] += 1;
            }
        }
        for (int k = 0; k < rc->num_nodes; k++) {
            rc->nodes[k].nsent = rc->nodes[k].nread = 0;
            rc->nodes[k].failed = false;
            out_reset(&rc->nodes[k]);
            if (per_node[k])
                out_reserve(&rc->nodes[k], need_bytes[k], need_iovs[k]);
        }
        for (size_t i = 0; i < n; i++) {
            if (rc->route[i] < 0)
                continue;
            node *nd = &rc->nodes[rc->route[i]];
            rc->order[fill[rc->route[i]]++] = i;
            if (rc->ask[i] >= 0) {
                out_arena(nd, "*1\r\n$6\r\nASKING\r\n", 16);
                nd->nsent++;
            }
            out_command(nd, cmds[i].argc, cmds[i].argv, cmds[i].argvlen);
            nd->nsent++;
        }
        for (int k = 0; k < rc->num_nodes; k++)
            if (rc->nodes[k].nsent)
                set_blocking(rc->nodes[k].c, false);

        /* Collect: replies of node k belong to order[start[k]..], ASKING replies skipped. */
        uint64_t deadline = tkv_now_ns() + (uint64_t)rc->o.timeout_ms * 1000000ull;
        size_t pos[TKV_RC_MAX_NODES];
        bool skip_ask[TKV_RC_MAX_NODES] = {0};
        memcpy(pos, start, sizeof(pos));
        for (;;) {
            bool progress = false;
            for (int k = 0; k < rc->num_nodes; k++) {
                node *nd = &rc->nodes[k];
                while (!nd->failed && nd->nread < nd->nsent) {
                    void *rv = NULL;
                    int summed = 0;
                    uint64_t sum = 0;
                    /* while replies are owed, order[pos[k]] is the command the next one
                     * (or the ASKING answer before it) belongs to */
                    const tkv_rc_cmd *next = &cmds[rc->order[pos[k]]];
                    nd->next_sum = next->sum_reply;
                    nd->next_sum_from = next->sum_from;
                    if (node_reply(nd, &rv, &summed, &sum) != REDIS_OK) {
                        nd->failed = true;
                        break;
                    }
                    if (!rv)
                        break;
                    nd->nread++;
                    progress = true;
                    size_t i = rc->order[pos[k]];
                    redisReply *r = rv;
                    if (rc->ask[i] >= 0 && !skip_ask[k]) {
                        skip_ask[k] = true; /* the ASKING answer */
                        freeReplyObject(r);
                        continue;
                    }
                    skip_ask[k] = false;
                    pos[k]++;
                    reached = true;
                    rc->ask[i] = -1;
                    if (r->type == REDIS_REPLY_ERROR && strncmp(r->str, "MOVED ", 6) == 0) {
                        int to = redirect_target(rc, r->str, 6);
                        uint16_t slot = tkv_rc_key_slot(cmds[i].argv[cmds[i].key_arg],
                                                        cmds[i].argvlen[cmds[i].key_arg]);
                        rc->st.moved++;
                        rc->map_stale = true;
                        if (to >= 0)
                            rc->slots[slot] = (int16_t)to;
                        freeReplyObject(r);
                        if (to < 0 || ++rc->redirects[i] > MAX_REDIRECTS) {
                            rc->route[i] = -1;
                            left--;
                        }
                        continue;
                    }
                    if (r->type == REDIS_REPLY_ERROR && strncmp(r->str, "ASK ", 4) == 0) {
                        int to = redirect_target(rc, r->str, 4);
                        rc->st.ask++;
                        freeReplyObject(r);
                        if (to < 0 || ++rc->redirects[i] > MAX_REDIRECTS) {
                            rc->route[i] = -1;
                            left--;
                        } else {
                            rc->ask[i] = (int16_t)to;
                        }
                        continue;
                    }
                    rc->route[i] = -1;
                    left--;
                    if (r->type == REDIS_REPLY_ERROR) {
                        /* CLUSTERDOWN, TRYAGAIN, LOADING, OOM...: this command fails. */
                        TKV_LOG(TKV_LOG_DEBUG, "redis %s:%d: %s", nd->host, nd->port, r->str);
                        rc->st.errors++;
                        if (strncmp(r->str, "CLUSTERDOWN", 11) == 0)
                            rc->map_stale = true;
                        freeReplyObject(r);
                        continue;
                    }
                    cmds[i].reply = r;
                    cmds[i].status = TKV_OK;
                    if (cmds[i].sum_reply && r->type == REDIS_REPLY_STRING &&
                        r->len >= cmds[i].sum_from) {
                        /* a reply hiredis parsed whole was just copied out: still in cache */
                        cmds[i].sum = summed ? sum
                                             : tkv_csum64(r->str + cmds[i].sum_from,
                                                          r->len - cmds[i].sum_from);
                        cmds[i].summed = 1;
                    }
                }
            }
            bool busy = false;
            for (int k = 0; k < rc->num_nodes; k++)
                if (!rc->nodes[k].failed && rc->nodes[k].nread < rc->nodes[k].nsent)
                    busy = true;
            if (!busy)
                break;
            if (!progress && tkv_now_ns() >= deadline)
                break;
            if (tkv_now_ns() >= deadline)
                break;
            pump(rc, deadline);
        }
        /* Nodes that failed or did not answer in time: their unanswered commands fail, and
         * the connection (whose reply stream we no longer follow) is dropped. */
        for (int k = 0; k < rc->num_nodes; k++) {
            node *nd = &rc->nodes[k];
            if (!nd->nsent)
                continue;
            if (nd->failed || nd->nread < nd->nsent) {
                bool timed_out = !nd->failed;
                TKV_LOG(TKV_LOG_DEBUG, "redis %s:%d: %s", nd->host, nd->port,
                        timed_out ? "timed out" : nd->c ? nd->c->errstr : "failed");
                for (size_t p = pos[k]; p < start[k + 1]; p++) {
                    size_t i = rc->order[p];
                    if (rc->route[i] < 0)
                        continue;
                    rc->route[i] = -1;
                    cmds[i].status = timed_out ? TKV_ETIMEDOUT : TKV_EIO;
                    if (timed_out)
                        rc->st.timeouts++;
                    else
                        rc->st.errors++;
                    left--;
                }
                node_drop(rc, nd);
            } else {
                set_blocking(nd->c, true);
            }
            nd->nsent = nd->nread = 0;
        }
    }
    /* Commands still routed after the last round ran out of redirects. */
    for (size_t i = 0; i < n; i++)
        if (rc->route[i] >= 0 && cmds[i].status != TKV_OK)
            rc->route[i] = -1;
    if (rc->map_stale)
        load_map(rc, false);
    else if (reached)
        rc->healthy = true;
    int first = TKV_OK;
    for (size_t i = 0; i < n && first == TKV_OK; i++)
        first = cmds[i].status;
    return first;
}
