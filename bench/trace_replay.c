/* trace_replay - replays a Mooncake-format trace through the cache and reports prefix hit rates.
 *
 *   trace_replay --trace FILE --capacity N[,N...] [--policy lru,tierkv,hazard,oracle] [--json]
 *                [--block-tokens P] [--fast] [--speedup X] [--requests M]
 *
 * Trace format (JSONL, one request a line): {"timestamp": ms, "input_length": tokens,
 * "output_length": tokens, "hash_ids": [id, ...]}, one id per 512-token trace block; equal ids
 * mean the same prefix up to and including that block.
 *
 * Hit accounting (the same for every policy): a request's prefix hit is the leading run of its
 * blocks that are cached (one lookup); after it is served, its missing blocks are inserted (one
 * put). Capacities are given in 512-token trace blocks; the cache holds N * (512 / P) blocks of
 * P tokens. A trace block counts as hit when all of its P-token blocks hit.
 *
 * Partial blocks: the last id of a request usually covers fewer than 512 tokens. It is counted
 * as one block (so block hit rates are comparable with published figures, which count one block
 * per id) and stored as 512 tokens derived from the id; the token hit rate counts only its real
 * tokens (input_length), so a hit on it is worth its real length there.
 *
 * Modes:
 *   default  the real engine in-process: tkv_store (L2 only, small block_bytes), keys are real
 *            SHA-256 chains (tkv_key_chain) of token contents derived from the ids;
 *   --fast   a minimal tier manager in this file driving the registered tkv_policy_ops directly,
 *            512 / P entries per trace block, as the store (faithful to the policy contract
 *            and to the store's granularity; no payloads). It gives the policies the key
 *            fingerprints the store gives (tkv_policy_entry.key_fp: the first 8 bytes of the
 *            block's SHA-256 chain key, | 1), so it hashes the trace's tokens once as the
 *            default mode does;
 *   oracle   always simulated (it needs the future): Belady, evicting the cached block whose
 *            next use is farthest away (never = farthest; ties: deepest first, so a chain is
 *            evicted from its tail, the prefix rule the store applies).
 *   --daemon SOCKET  through a running tierkvd with libkvclient (lookup, put of the missing
 *            blocks by value, release): the daemon's own policy and L2 capacity are measured
 *            (reported as its policy name and its capacity in trace blocks; --capacity and
 *            --policy do not apply). Start the daemon with a small geometry (e.g. 1 layer,
 *            1 KV head, head dim 64) and L3 off so the replay is about the policy, not copies.
 * --speedup X sleeps the trace's inter-arrival gaps divided by X (default: no sleeping).
 */
#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_policy.h"
#include "tkv_store.h"
#ifdef TKV_HAVE_KVCLIENT
#include "kvclient.h"
#endif

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

enum { kTraceBlockTokens = 512 };

/* ============================================================================================
 * Trace
 * ========================================================================================== */

typedef struct trace_req {
    uint64_t timestamp_ms;
    uint32_t input_tokens;
    uint32_t num_blocks;
    size_t first; /* index into trace.ids / trace.nodes */
} trace_req;

typedef struct trace {
    trace_req *reqs;
    size_t num_reqs, cap_reqs;
    uint64_t *ids;     /* all hash ids, request after request */
    uint32_t *nodes;   /* dense node index of each id */
    size_t num_ids, cap_ids;
    uint64_t total_tokens;
    /* dense nodes: one per distinct id */
    uint64_t *node_id;
    int64_t *node_parent; /* node of the previous block, -1 for a chain's first block */
    uint32_t *node_depth;
    size_t num_nodes;
    size_t num_bad_lines;
} trace;

/* ---- open-addressing map id -> dense node ---- */
typedef struct idmap {
    uint64_t *keys;
    uint32_t *vals;
    size_t mask;
    size_t used;
} idmap;

static uint64_t mix64(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

static void idmap_init(idmap *m, size_t cap_pow2)
{
    m->mask = cap_pow2 - 1;
    m->keys = tkv_xmalloc(cap_pow2 * sizeof(*m->keys));
    m->vals = tkv_xmalloc(cap_pow2 * sizeof(*m->vals));
    for (size_t i = 0; i < cap_pow2; i++)
        m->vals[i] = UINT32_MAX;
    m->used = 0;
}

static void idmap_free(idmap *m)
{
    free(m->keys);
    free(m->vals);
}

static uint32_t *idmap_slot(idmap *m, uint64_t key, bool *found);

static void idmap_grow(idmap *m)
{
    idmap old = *m;
    idmap_init(m, (old.mask + 1) * 2);
    for (size_t i = 0; i <= old.mask; i++) {
        if (old.vals[i] == UINT32_MAX)
            continue;
        bool found;
        *idmap_slot(m, old.keys[i], &found) = old.vals[i];
        m->used++;
    }
    idmap_free(&old);
}

/* Slot for key (inserting an empty one if absent; the caller fills it and bumps used). */
static uint32_t *idmap_slot(idmap *m, uint64_t key, bool *found)
{
    size_t i = mix64(key) & m->mask;
    while (m->vals[i] != UINT32_MAX) {
        if (m->keys[i] == key) {
            *found = true;
            return &m->vals[i];
        }
        i = (i + 1) & m->mask;
    }
    *found = false;
    m->keys[i] = key;
    return &m->vals[i];
}

/* ---- a small parser for the one JSON shape of the trace ---- */
typedef struct cursor {
    const char *p;
} cursor;

static void skip_ws(cursor *c)
{
    while (*c->p == ' ' || *c->p == '\t' || *c->p == '\r' || *c->p == '\n')
        c->p++;
}

static bool expect(cursor *c, char ch)
{
    skip_ws(c);
    if (*c->p != ch)
        return false;
    c->p++;
    return true;
}

static bool parse_u64(cursor *c, uint64_t *out)
{
    skip_ws(c);
    if (*c->p < '0' || *c->p > '9')
        return false;
    uint64_t v = 0;
    while (*c->p >= '0' && *c->p <= '9') {
        unsigned d = (unsigned)(*c->p - '0');
        if (v > (UINT64_MAX - d) / 10)
            return false;
        v = v * 10 + d;
        c->p++;
    }
    /* the published traces write integers; a fraction or exponent is not a count */
    if (*c->p == '.' || *c->p == 'e' || *c->p == 'E')
        return false;
    *out = v;
    return true;
}

static bool parse_key(cursor *c, char *key, size_t cap)
{
    if (!expect(c, '"'))
        return false;
    size_t n = 0;
    while (*c->p && *c->p != '"') {
        if (*c->p == '\\' || n + 1 >= cap)
            return false;
        key[n++] = *c->p++;
    }
    if (*c->p != '"')
        return false;
    c->p++;
    key[n] = 0;
    return true;
}

/* Skips a value of a field we do not use: a number, string, true/false/null, or a flat array. */
static bool skip_value(cursor *c)
{
    skip_ws(c);
    if (*c->p == '"') {
        c->p++;
        while (*c->p && *c->p != '"') {
            if (*c->p == '\\' && c->p[1])
                c->p++;
            c->p++;
        }
        if (*c->p != '"')
            return false;
        c->p++;
        return true;
    }
    if (*c->p == '[') {
        int depth = 0;
        do {
            if (*c->p == '[')
                depth++;
            else if (*c->p == ']')
                depth--;
            else if (!*c->p || *c->p == '{')
                return false;
            c->p++;
        } while (depth > 0);
        return true;
    }
    const char *start = c->p;
    while (*c->p && strchr("0123456789+-.eEtruefalsn", *c->p))
        c->p++;
    return c->p != start;
}

static void trace_free(trace *t)
{
    free(t->reqs);
    free(t->ids);
    free(t->nodes);
    free(t->node_id);
    free(t->node_parent);
    free(t->node_depth);
    memset(t, 0, sizeof(*t));
}

/* Parses one line into a request (ids appended to t->ids). false + reason on malformed input;
 * then t->num_ids is left where it was. */
static bool parse_line(trace *t, const char *line, const char **why)
{
    cursor c = {line};
    trace_req r = {0};
    bool have_ts = false, have_in = false, have_ids = false;
    size_t first = t->num_ids;
    char key[32];
    uint64_t v;

    *why = "expected '{'";
    if (!expect(&c, '{'))
        goto fail;
    skip_ws(&c);
    if (*c.p == '}') {
        *why = "empty object";
        goto fail;
    }
    for (;;) {
        *why = "expected a \"key\"";
        if (!parse_key(&c, key, sizeof(key)))
            goto fail;
        *why = "expected ':'";
        if (!expect(&c, ':'))
            goto fail;
        if (strcmp(key, "timestamp") == 0) {
            *why = "timestamp is not a non-negative integer";
            if (!parse_u64(&c, &v))
                goto fail;
            r.timestamp_ms = v;
            have_ts = true;
        } else if (strcmp(key, "input_length") == 0) {
            *why = "input_length is not an integer in 1..2^31";
            if (!parse_u64(&c, &v) || v == 0 || v > INT32_MAX)
                goto fail;
            r.input_tokens = (uint32_t)v;
            have_in = true;
        } else if (strcmp(key, "hash_ids") == 0) {
            *why = "hash_ids is not an array of non-negative integers";
            if (!expect(&c, '['))
                goto fail;
            skip_ws(&c);
            if (*c.p != ']') {
                for (;;) {
                    if (!parse_u64(&c, &v))
                        goto fail;
                    if (t->num_ids == t->cap_ids) {
                        t->cap_ids = t->cap_ids ? t->cap_ids * 2 : 1 << 16;
                        t->ids = tkv_xrealloc(t->ids, t->cap_ids * sizeof(*t->ids));
                    }
                    t->ids[t->num_ids++] = v;
                    skip_ws(&c);
                    if (*c.p == ',') {
                        c.p++;
                        continue;
                    }
                    break;
                }
            }
            if (!expect(&c, ']'))
                goto fail;
            have_ids = true;
        } else {
            *why = "bad value";
            if (!skip_value(&c))
                goto fail;
        }
        skip_ws(&c);
        if (*c.p == ',') {
            c.p++;
            continue;
        }
        *why = "expected ',' or '}'";
        if (!expect(&c, '}'))
            goto fail;
        break;
    }
    skip_ws(&c);
    *why = "trailing characters after the object";
    if (*c.p)
        goto fail;
    *why = "missing timestamp, input_length or hash_ids";
    if (!have_ts || !have_in || !have_ids)
        goto fail;
    r.first = first;
    r.num_blocks = (uint32_t)(t->num_ids - first);
    *why = "hash_ids is empty";
    if (r.num_blocks == 0)
        goto fail;
    *why = "len(hash_ids) != ceil(input_length / 512)";
    if (r.num_blocks != (r.input_tokens + kTraceBlockTokens - 1) / kTraceBlockTokens)
        goto fail;
    if (t->num_reqs == t->cap_reqs) {
        t->cap_reqs = t->cap_reqs ? t->cap_reqs * 2 : 1024;
        t->reqs = tkv_xrealloc(t->reqs, t->cap_reqs * sizeof(*t->reqs));
    }
    t->reqs[t->num_reqs++] = r;
    t->total_tokens += r.input_tokens;
    return true;
fail:
    t->num_ids = first;
    return false;
}

/* Loads a trace; prints each bad line (the first 10) with its number and why. Bad lines are
 * skipped and counted; TKV_EINVAL if no request is left, TKV_EIO if the file cannot be read. */
static int trace_load(const char *path, size_t max_reqs, trace *t)
{
    memset(t, 0, sizeof(*t));
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "trace_replay: %s: %s\n", path, strerror(errno));
        return TKV_EIO;
    }
    char *line = NULL;
    size_t cap = 0;
    ssize_t len;
    size_t lineno = 0;
    while ((len = getline(&line, &cap, f)) >= 0) {
        lineno++;
        if (max_reqs && t->num_reqs >= max_reqs)
            break;
        const char *p = line;
        while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
            p++;
        if (!*p)
            continue; /* blank lines are allowed */
        const char *why;
        if ((size_t)len != strlen(line))
            why = "NUL byte in line";
        else if (parse_line(t, line, &why))
            continue;
        if (t->num_bad_lines++ < 10)
            fprintf(stderr, "trace_replay: %s:%zu: bad line skipped: %s\n", path, lineno, why);
    }
    free(line);
    fclose(f);
    if (t->num_bad_lines)
        fprintf(stderr, "trace_replay: %s: %zu bad line(s) skipped\n", path, t->num_bad_lines);
    if (t->num_reqs == 0) {
        fprintf(stderr, "trace_replay: %s: no valid request\n", path);
        trace_free(t);
        return TKV_EINVAL;
    }

    /* Dense nodes; an id's parent is the id before it where it first appeared. An id that
     * later appears after another parent contradicts the format ("equal ids mean the same
     * prefix"): it is counted and its first parent kept. */
    idmap m;
    idmap_init(&m, 1 << 16);
    t->nodes = tkv_xmalloc(t->num_ids * sizeof(*t->nodes));
    size_t cap_nodes = 1 << 16, num_inconsistent = 0;
    t->node_id = tkv_xmalloc(cap_nodes * sizeof(*t->node_id));
    t->node_parent = tkv_xmalloc(cap_nodes * sizeof(*t->node_parent));
    t->node_depth = tkv_xmalloc(cap_nodes * sizeof(*t->node_depth));
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        const trace_req *r = &t->reqs[ir];
        int64_t parent = -1;
        for (uint32_t j = 0; j < r->num_blocks; j++) {
            if (m.used * 2 >= m.mask + 1)
                idmap_grow(&m);
            bool found;
            uint32_t *slot = idmap_slot(&m, t->ids[r->first + j], &found);
            if (!found) {
                TKV_ASSERT(t->num_nodes < UINT32_MAX);
                if (t->num_nodes == cap_nodes) {
                    cap_nodes *= 2;
                    t->node_id = tkv_xrealloc(t->node_id, cap_nodes * sizeof(*t->node_id));
                    t->node_parent =
                        tkv_xrealloc(t->node_parent, cap_nodes * sizeof(*t->node_parent));
                    t->node_depth =
                        tkv_xrealloc(t->node_depth, cap_nodes * sizeof(*t->node_depth));
                }
                *slot = (uint32_t)t->num_nodes;
                m.used++;
                t->node_id[t->num_nodes] = t->ids[r->first + j];
                t->node_parent[t->num_nodes] = parent;
                t->node_depth[t->num_nodes] = j;
                t->num_nodes++;
            } else if (t->node_parent[*slot] != parent) {
                num_inconsistent++;
            }
            t->nodes[r->first + j] = *slot;
            parent = *slot;
        }
    }
    idmap_free(&m);
    if (num_inconsistent)
        fprintf(stderr,
                "trace_replay: %s: %zu block(s) appear after different prefixes; the first "
                "prefix seen is kept\n",
                path, num_inconsistent);
    return TKV_OK;
}

/* ============================================================================================
 * Results
 * ========================================================================================== */

typedef struct result {
    const char *policy;
    const char *mode;
    uint64_t capacity_blocks;
    uint64_t requests, blocks, hit_blocks;
    uint64_t tokens, hit_tokens;
    uint64_t hit_blocks_tier[TKV_NUM_TIERS]; /* in trace blocks */
    uint64_t evictions;
    double seconds;
} result;

static double now_s(void) { return (double)tkv_now_ns() / 1e9; }

static void account(result *res, const trace_req *r, uint32_t hit_trace_blocks)
{
    res->requests++;
    res->blocks += r->num_blocks;
    res->hit_blocks += hit_trace_blocks;
    res->tokens += r->input_tokens;
    uint64_t ht = (uint64_t)hit_trace_blocks * kTraceBlockTokens;
    res->hit_tokens += ht < r->input_tokens ? ht : r->input_tokens;
}

static void pace(const trace *t, size_t ir, double speedup)
{
    if (speedup <= 0 || ir == 0)
        return;
    uint64_t a = t->reqs[ir - 1].timestamp_ms, b = t->reqs[ir].timestamp_ms;
    if (b <= a)
        return;
    double s = (double)(b - a) / 1e3 / speedup;
    struct timespec ts = {(time_t)s, (long)((s - (double)(time_t)s) * 1e9)};
    nanosleep(&ts, NULL);
}

/* ============================================================================================
 * --fast: a minimal tier manager over tkv_policy_ops, P/512 entries per trace block
 *
 * It keeps the structural fields the way the store's tier manager does: parent/depth set at
 * insertion, num_children counted, hit blocks pinned while the request inserts its missing
 * blocks (the lease a real lookup takes), changed() on every structural or pin change; and it
 * calls the policy in the order of the store's put: admit() for every missing block (one
 * now_ns per request, the parent shown only for the first), then victims until all of them
 * fit, then inserted() in chain order. Like the store it works in cache blocks of P tokens:
 * a trace block is 512 / P entries chained one after the other (capacity N trace blocks =
 * N * 512 / P entries), so a policy sees the same number of calls and ticks as in the store,
 * and a trace block counts as hit when all of its entries hit.
 * ========================================================================================== */

typedef struct sim_node {
    tkv_policy_entry pe;
    uint8_t present;
} sim_node;

/* Cache entry k (0 .. per-1) of trace node n is n * per + k; its parent is the entry before
 * it in the chain: k - 1 of the same node, or the last entry of the node's parent. */
static int64_t sim_parent(const trace *t, uint64_t e, uint32_t per)
{
    if (e % per)
        return (int64_t)e - 1;
    int64_t ip = t->node_parent[e / per];
    return ip >= 0 ? ip * (int64_t)per + per - 1 : -1;
}

/* node_keys: every cache entry's key (replay_keys_build), for the store's key fingerprints. */
static int run_sim(const trace *t, const tkv_policy_ops *ops, uint64_t trace_capacity,
                   uint32_t block_tokens, double speedup, const tkv_key *node_keys,
                   result *res)
{
    const uint32_t per = kTraceBlockTokens / block_tokens;
    const uint64_t capacity = trace_capacity * per;
    sim_node *nodes = tkv_xcalloc((size_t)t->num_nodes * per, sizeof(*nodes));
    uint32_t max_blocks = 0;
    for (size_t ir = 0; ir < t->num_reqs; ir++)
        if (t->reqs[ir].num_blocks > max_blocks)
            max_blocks = t->reqs[ir].num_blocks;
    uint64_t *nd = tkv_xmalloc((size_t)max_blocks * per * sizeof(*nd));
    uint8_t admitted[256];
    uint64_t now = 0;
    void *st = ops->create(capacity);
    if (!st) {
        free(nodes);
        free(nd);
        fprintf(stderr, "trace_replay: policy %s refused capacity %" PRIu64 "\n", ops->name,
                capacity);
        return TKV_EINVAL;
    }
    uint64_t used = 0;
    double t0 = now_s();
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        pace(t, ir, speedup);
        const trace_req *r = &t->reqs[ir];
        const uint32_t nb = r->num_blocks * per;
        for (uint32_t j = 0; j < r->num_blocks; j++)
            for (uint32_t k = 0; k < per; k++)
                nd[(size_t)j * per + k] = (uint64_t)t->nodes[r->first + j] * per + k;
        uint64_t tnow = tkv_now_ns();
        now = tnow > now ? tnow : now + 1;
        uint32_t hit = 0;
        while (hit < nb && nodes[nd[hit]].present)
            hit++;
        for (uint32_t j = 0; j < hit; j++) {
            sim_node *n = &nodes[nd[j]];
            n->pe.pinned++; /* the store's order: the lease pins it, then the policy sees the hit */
            ops->changed(st, &n->pe);
            ops->accessed(st, &n->pe, now);
        }
        account(res, r, hit / per);
        res->hit_blocks_tier[TKV_TIER_L2] += hit / per;

        /* The store's put, in its chunks (at most 256 blocks and a quarter of the tier, one
         * now_ns each): every missing block of the chunk is asked admit() (a refused one is
         * dropped and the next is still asked), then room is made for all admitted blocks at
         * once (the victims are chosen before any of them exists in the policy), then they
         * enter in chain order. */
        uint32_t chunk = capacity / 4 ? (uint32_t)(capacity / 4 < 256 ? capacity / 4 : 256) : 1;
        for (uint32_t off = hit; off < nb; off += chunk) {
            uint32_t end = nb - off < chunk ? nb : off + chunk, want = 0;
            uint64_t tnow = tkv_now_ns();
            now = tnow > now ? tnow : now + 1; /* a new put: a new now_ns */
            for (uint32_t j = off; j < end; j++) {
                sim_node *n = &nodes[nd[j]];
                admitted[j - off] = 0;
                if (n->present)
                    continue; /* cached already: a duplicate, dropped */
                /* the store's probe shows the parent only where it is cached already: the
                 * chunk's first missing block (its parent is the request's last hit block,
                 * or the previous chunk's last block), or a block after a duplicate; the
                 * depth is known where the parent is indexed (cached, or admitted just
                 * before in this chunk), else 0 */
                int64_t ip = sim_parent(t, nd[j], per);
                bool indexed = ip >= 0 && (nodes[ip].present || (j > off && admitted[j - 1 - off]));
                n->pe = (tkv_policy_entry){0};
                n->pe.key_fp = tkv_key_fp(&node_keys[nd[j]]); /* as the store's probe */
                if (ip >= 0 && nodes[ip].present)
                    n->pe.parent = &nodes[ip].pe;
                if (indexed)
                    n->pe.depth =
                        t->node_depth[nd[j] / per] * per + (uint32_t)(nd[j] % per);
                /* asked even where the block before it was not admitted, but then, as in
                 * the store, not stored: no lookup could reach it */
                bool reachable = ip < 0 || indexed;
                if (!ops->admit(st, &n->pe, now) || !reachable)
                    continue;
                admitted[j - off] = 1;
                want++;
            }
            /* as in the store, the block the chunk hangs under is pinned while room is made
             * (the first chunk's, the request's last hit, is pinned already) */
            sim_node *cp = off > hit && want ? &nodes[nd[off - 1]] : NULL;
            if (cp && cp->present) {
                cp->pe.pinned++;
                ops->changed(st, &cp->pe);
            } else {
                cp = NULL;
            }
            while (used + want > capacity) {
                tkv_policy_entry *v = ops->victim(st);
                /* NULL: all pinned. An interior victim is not taken, as the store without L3
                 * does not take one for a put: the chunk inserts fewer blocks instead. */
                if (!v || v->num_children) {
                    want = (uint32_t)(capacity - used);
                    break;
                }
                TKV_ASSERT(!v->pinned);
                sim_node *vn = (sim_node *)v;
                ops->removed(st, v);
                vn->present = 0;
                used--;
                res->evictions++;
                if (v->parent && --v->parent->num_children == 0)
                    ops->changed(st, v->parent);
            }
            if (cp) {
                cp->pe.pinned--;
                ops->changed(st, &cp->pe);
            }
            for (uint32_t j = off; j < end && want > 0; j++) {
                sim_node *n = &nodes[nd[j]];
                int64_t ip = sim_parent(t, nd[j], per);
                sim_node *p = ip >= 0 ? &nodes[ip] : NULL;
                if (!admitted[j - off])
                    continue;
                /* admitted only under a cached block, one admitted before it in this chunk,
                 * or the chunk's pinned parent */
                TKV_ASSERT(!p || p->present);
                n->pe.parent = p ? &p->pe : NULL;
                n->pe.depth = t->node_depth[nd[j] / per] * per + (uint32_t)(nd[j] % per);
                /* the store's order: the parent learns of its child first, then the policy
                 * learns of the child */
                n->present = 1;
                used++;
                want--;
                if (p && p->pe.num_children++ == 0)
                    ops->changed(st, &p->pe);
                ops->inserted(st, &n->pe, now);
            }
        }
        for (uint32_t j = 0; j < hit; j++) {
            sim_node *n = &nodes[nd[j]];
            n->pe.pinned--;
            ops->changed(st, &n->pe);
        }
        TKV_ASSERT(used <= capacity);
    }
    res->seconds = now_s() - t0;
    ops->destroy(st);
    free(nodes);
    free(nd);
    return TKV_OK;
}

/* ============================================================================================
 * Oracle (Belady with the prefix rule), simulated: it needs the future
 * ========================================================================================== */

typedef struct oracle {
    uint32_t *heap;     /* node indices, max-heap on (next_use, depth) */
    uint32_t *pos;      /* node -> heap position, UINT32_MAX when not cached */
    uint64_t *next_use; /* node -> request index of its next use (UINT64_MAX = never) */
    const uint32_t *depth;
    size_t size;
} oracle;

static bool oracle_above(const oracle *o, uint32_t a, uint32_t b)
{
    if (o->next_use[a] != o->next_use[b])
        return o->next_use[a] > o->next_use[b];
    return o->depth[a] > o->depth[b];
}

static void oracle_swap(oracle *o, size_t i, size_t j)
{
    uint32_t a = o->heap[i], b = o->heap[j];
    o->heap[i] = b;
    o->heap[j] = a;
    o->pos[b] = (uint32_t)i;
    o->pos[a] = (uint32_t)j;
}

static void oracle_fix(oracle *o, size_t i)
{
    while (i > 0 && oracle_above(o, o->heap[i], o->heap[(i - 1) / 2])) {
        oracle_swap(o, i, (i - 1) / 2);
        i = (i - 1) / 2;
    }
    for (;;) {
        size_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < o->size && oracle_above(o, o->heap[l], o->heap[m]))
            m = l;
        if (r < o->size && oracle_above(o, o->heap[r], o->heap[m]))
            m = r;
        if (m == i)
            return;
        oracle_swap(o, i, m);
        i = m;
    }
}

static int run_oracle(const trace *t, uint64_t capacity, result *res)
{
    /* next[k]: the request after this one that uses the same node, for every id position k */
    uint64_t *next = tkv_xmalloc(t->num_ids * sizeof(*next));
    uint64_t *last_seen = tkv_xmalloc(t->num_nodes * sizeof(*last_seen));
    for (size_t i = 0; i < t->num_nodes; i++)
        last_seen[i] = UINT64_MAX;
    for (size_t ir = t->num_reqs; ir-- > 0;) {
        const trace_req *r = &t->reqs[ir];
        for (uint32_t j = 0; j < r->num_blocks; j++) {
            uint32_t n = t->nodes[r->first + j];
            next[r->first + j] = last_seen[n];
        }
        for (uint32_t j = 0; j < r->num_blocks; j++)
            last_seen[t->nodes[r->first + j]] = ir;
    }
    free(last_seen);

    oracle o = {
        .heap = tkv_xmalloc((capacity + 1) * sizeof(uint32_t)),
        .pos = tkv_xmalloc(t->num_nodes * sizeof(uint32_t)),
        .next_use = tkv_xmalloc(t->num_nodes * sizeof(uint64_t)),
        .depth = t->node_depth,
    };
    for (size_t i = 0; i < t->num_nodes; i++)
        o.pos[i] = UINT32_MAX;
    double t0 = now_s();
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        const trace_req *r = &t->reqs[ir];
        const uint32_t *nd = &t->nodes[r->first];
        uint32_t hit = 0;
        while (hit < r->num_blocks && o.pos[nd[hit]] != UINT32_MAX)
            hit++;
        account(res, r, hit);
        res->hit_blocks_tier[TKV_TIER_L2] += hit;
        for (uint32_t j = 0; j < r->num_blocks; j++) {
            uint32_t n = nd[j];
            o.next_use[n] = next[r->first + j];
            if (o.pos[n] != UINT32_MAX) {
                oracle_fix(&o, o.pos[n]);
                continue;
            }
            int64_t ip = t->node_parent[n];
            if (ip >= 0 && o.pos[ip] == UINT32_MAX)
                break; /* its prefix was evicted: it could never be hit */
            o.heap[o.size] = n;
            o.pos[n] = (uint32_t)o.size;
            o.size++;
            oracle_fix(&o, o.size - 1);
            if (o.size > capacity) {
                /* The farthest next use is always a tail: a parent is used whenever any of
                 * its children is, and ties go to the deeper block. It may be n itself. */
                uint32_t v = o.heap[0];
                oracle_swap(&o, 0, o.size - 1);
                o.size--;
                o.pos[v] = UINT32_MAX;
                if (o.size)
                    oracle_fix(&o, 0);
                res->evictions++;
                if (v == n)
                    break;
            }
        }
    }
    res->seconds = now_s() - t0;
    free(o.heap);
    free(o.pos);
    free(o.next_use);
    free(next);
    return TKV_OK;
}

/* ============================================================================================
 * The real engine, in-process
 * ========================================================================================== */

/* Deterministic token contents of a trace block: 512 tokens derived from its id. */
static void id_tokens(uint64_t id, uint32_t *out)
{
    for (uint32_t k = 0; k < kTraceBlockTokens; k++)
        out[k] = (uint32_t)(mix64(id * kTraceBlockTokens + k) % 200000u);
}

/* The geometry the replay's blocks are keyed under, and every node's keys: the chain of its
 * P-token blocks, continuing its parent's chain. Nodes are numbered in first-seen order, so a
 * parent's keys are always computed first. Computed once per process (it hashes every token
 * of the trace once). */
typedef struct replay_keys {
    uint8_t fp[TKV_KEY_BYTES];
    tkv_key *node_keys; /* num_nodes * (512 / block_tokens) */
} replay_keys;

static void replay_keys_build(const trace *t, uint32_t block_tokens, replay_keys *rk)
{
    const uint32_t per = kTraceBlockTokens / block_tokens;
    tkv_geometry g = {.num_layers = 1, .num_kv_heads = 1, .head_dim = 64,
                      .block_tokens = block_tokens, .dtype = TKV_DTYPE_FP8_E4M3,
                      .scale_mode = TKV_SCALE_PER_TENSOR};
    snprintf(g.model_id, sizeof(g.model_id), "trace-replay");
    tkv_geometry_fingerprint(&g, rk->fp);
    tkv_key root;
    tkv_key_root(rk->fp, "", 0, &root);
    tkv_key *node_keys = tkv_xmalloc(t->num_nodes * per * sizeof(*node_keys));
    uint32_t tok[kTraceBlockTokens];
    for (size_t n = 0; n < t->num_nodes; n++) {
        id_tokens(t->node_id[n], tok);
        const tkv_key *prev = t->node_parent[n] >= 0
                                  ? &node_keys[(size_t)t->node_parent[n] * per + per - 1]
                                  : &root;
        for (uint32_t b = 0; b < per; b++) {
            tkv_key_chain(prev, tok + b * block_tokens, block_tokens, block_tokens,
                          &node_keys[n * per + b], 1);
            prev = &node_keys[n * per + b];
        }
    }
    rk->node_keys = node_keys;
}

static int run_store(const trace *t, const replay_keys *rk, const char *policy,
                     uint64_t capacity, uint32_t block_tokens, double speedup, result *res)
{
    const uint32_t per = kTraceBlockTokens / block_tokens;
    const size_t block_bytes = 64;
    int rc = TKV_OK;
    tkv_store *s = NULL;
    tkv_store_opts *o = tkv_store_opts_new();
    const tkv_key *node_keys = rk->node_keys;
    tkv_key *keys = NULL;
    uint32_t *tokens = NULL;
    const void **payloads = NULL;
    uint8_t *payload = NULL;
    uint32_t max_blocks = 0;

    for (size_t ir = 0; ir < t->num_reqs; ir++)
        if (t->reqs[ir].num_blocks > max_blocks)
            max_blocks = t->reqs[ir].num_blocks;
    size_t max_cache_blocks = (size_t)max_blocks * per;
    keys = tkv_xmalloc(max_cache_blocks * sizeof(*keys));
    tokens = tkv_xmalloc(max_cache_blocks * block_tokens * sizeof(*tokens));
    payloads = tkv_xmalloc(max_cache_blocks * sizeof(*payloads));
    payload = tkv_xcalloc(1, block_bytes);
    for (size_t i = 0; i < max_cache_blocks; i++)
        payloads[i] = payload;

    if ((rc = tkv_store_opts_set_block(o, block_bytes, block_tokens)) != TKV_OK ||
        (rc = tkv_store_opts_set_fingerprint(o, rk->fp)) != TKV_OK ||
        (rc = tkv_store_opts_set_l2_blocks(o, capacity * per)) != TKV_OK ||
        (rc = tkv_store_opts_set_l3(o, NULL, 0)) != TKV_OK ||
        (rc = tkv_store_opts_set_write_through(o, false)) != TKV_OK ||
        (rc = tkv_store_opts_set_policy(o, policy)) != TKV_OK ||
        (rc = tkv_store_open(o, &s)) != TKV_OK) {
        fprintf(stderr, "trace_replay: store (policy %s, %" PRIu64 " blocks): %s\n", policy,
                capacity * per, tkv_strerror(rc));
        goto fail;
    }

    double t0 = now_s();
    tkv_block_loc *locs = tkv_xmalloc(max_cache_blocks * sizeof(*locs));
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        pace(t, ir, speedup);
        const trace_req *r = &t->reqs[ir];
        size_t nk = (size_t)r->num_blocks * per;
        for (uint32_t j = 0; j < r->num_blocks; j++) {
            uint32_t n = t->nodes[r->first + j];
            memcpy(&keys[(size_t)j * per], &node_keys[(size_t)n * per], per * sizeof(*keys));
            id_tokens(t->node_id[n], tokens + (size_t)j * kTraceBlockTokens);
        }
        uint64_t lease = 0;
        size_t num_hit = 0;
        rc = tkv_store_lookup(s, keys, nk, 1, 0, &lease, &num_hit, locs);
        if (rc != TKV_OK) {
            fprintf(stderr, "trace_replay: lookup: %s\n", tkv_strerror(rc));
            free(locs);
            goto fail;
        }
        uint32_t hit_trace = (uint32_t)(num_hit / per);
        account(res, r, hit_trace);
        for (uint32_t j = 0; j < hit_trace; j++)
            res->hit_blocks_tier[locs[(size_t)j * per + per - 1].tier]++;
        if (num_hit < nk) {
            rc = tkv_store_put(s, num_hit ? &keys[num_hit - 1] : NULL, keys + num_hit,
                               tokens + num_hit * block_tokens, payloads, nk - num_hit, NULL);
            if (rc != TKV_OK && rc != TKV_EFULL) {
                fprintf(stderr, "trace_replay: put: %s\n", tkv_strerror(rc));
                free(locs);
                goto fail;
            }
        }
        if (lease)
            tkv_store_lease_release(s, lease);
    }
    free(locs);
    res->seconds = now_s() - t0;
    tkv_store_stats stats;
    tkv_store_get_stats(s, &stats);
    res->evictions = stats.evictions;
    rc = TKV_OK;
fail:
    tkv_store_close(s);
    tkv_store_opts_free(o);
    free(keys);
    free(tokens);
    free(payloads);
    free(payload);
    return rc;
}

#ifdef TKV_HAVE_KVCLIENT
/* ============================================================================================
 * Through a running daemon (libkvclient)
 * ========================================================================================== */

static int run_daemon(const trace *t, const char *socket_path, double speedup, result *res,
                      char *policy_out, size_t policy_cap)
{
    int rc = TKV_EIO;
    kvc_client *c = NULL;
    uint32_t *tokens = NULL;
    uint8_t *payloads = NULL;
    kvc_opts *o = kvc_opts_new();
    if (kvc_opts_set_socket(o, socket_path) != KVC_OK || kvc_connect(o, &c) != KVC_OK) {
        fprintf(stderr, "trace_replay: daemon at %s: %s\n", socket_path, kvc_last_error());
        goto fail;
    }
    uint32_t block_tokens = kvc_block_tokens(c);
    size_t block_bytes = kvc_block_bytes(c);
    if (block_tokens == 0 || kTraceBlockTokens % block_tokens != 0) {
        fprintf(stderr, "trace_replay: daemon block_tokens %u does not divide 512\n", block_tokens);
        goto fail;
    }
    const uint32_t per = kTraceBlockTokens / block_tokens;
    kvc_stats stats;
    if (kvc_stats_get(c, &stats) != KVC_OK) {
        fprintf(stderr, "trace_replay: daemon stats: %s\n", kvc_last_error());
        goto fail;
    }
    snprintf(policy_out, policy_cap, "%s", stats.policy[0] ? stats.policy : "daemon");
    res->capacity_blocks = stats.tiers[KVC_TIER_L2].capacity_blocks / per;
    uint32_t max_blocks = 0;
    for (size_t ir = 0; ir < t->num_reqs; ir++)
        if (t->reqs[ir].num_blocks > max_blocks)
            max_blocks = t->reqs[ir].num_blocks;
    tokens = tkv_xmalloc((size_t)max_blocks * kTraceBlockTokens * sizeof(*tokens));
    payloads = tkv_xcalloc((size_t)max_blocks * per, block_bytes);
    uint64_t evictions_before = stats.evictions;

    double t0 = now_s();
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        pace(t, ir, speedup);
        const trace_req *r = &t->reqs[ir];
        size_t num_tokens = (size_t)r->num_blocks * kTraceBlockTokens;
        for (uint32_t j = 0; j < r->num_blocks; j++)
            id_tokens(t->node_id[t->nodes[r->first + j]], tokens + (size_t)j * kTraceBlockTokens);
        kvc_lease *l = NULL;
        if (kvc_lookup(c, tokens, num_tokens, 0, &l) != KVC_OK) {
            fprintf(stderr, "trace_replay: lookup: %s\n", kvc_last_error());
            goto fail;
        }
        uint32_t hit = kvc_lease_num_blocks(l), total = r->num_blocks * per;
        uint32_t hit_trace = hit / per;
        account(res, r, hit_trace);
        for (uint32_t j = 0; j < hit_trace; j++) {
            int tier = kvc_lease_tier(l, j * per + per - 1);
            res->hit_blocks_tier[tier >= 0 && tier < TKV_NUM_TIERS ? tier : 0]++;
        }
        int prc = KVC_OK;
        if (hit < total)
            prc = kvc_put(c, tokens, num_tokens, hit, payloads, total - hit, NULL);
        kvc_release(c, l);
        if (prc != KVC_OK && prc != KVC_EFULL) {
            fprintf(stderr, "trace_replay: put: %s\n", kvc_last_error());
            goto fail;
        }
    }
    res->seconds = now_s() - t0;
    if (kvc_stats_get(c, &stats) == KVC_OK)
        res->evictions = stats.evictions - evictions_before;
    rc = TKV_OK;
fail:
    kvc_close(c);
    kvc_opts_free(o);
    free(tokens);
    free(payloads);
    return rc;
}
#endif

/* ============================================================================================
 * Command line
 * ========================================================================================== */

/* Writes s as a JSON string (quotes, backslashes and control characters escaped). */
static void json_string(FILE *f, const char *s)
{
    fputc('"', f);
    for (; *s; s++) {
        unsigned char c = (unsigned char)*s;
        if (c == '"' || c == '\\')
            fprintf(f, "\\%c", c);
        else if (c < 0x20)
            fprintf(f, "\\u%04x", c);
        else
            fputc(c, f);
    }
    fputc('"', f);
}

static void usage(FILE *f)
{
    fprintf(f,
            "usage: trace_replay --trace FILE --capacity N[,N...] [--policy P[,P...]] [--json]\n"
            "                    [--block-tokens 16|32|64|128] [--fast] [--speedup X]\n"
            "                    [--requests M]\n"
            "       trace_replay --trace FILE --daemon SOCKET [--json] [--speedup X]\n"
            "  --capacity   cache sizes in 512-token trace blocks\n"
            "  --policy     any of: oracle");
    for (const tkv_policy_ops *const *p = tkv_policy_all(); *p; p++)
        fprintf(f, ", %s", (*p)->name);
    fprintf(f, " (default: lru,tierkv,hazard,oracle;\n"
               "               hazard is the store's default)\n"
               "  --fast       drive the policies directly (512/P entries per trace block) instead\n"
               "               of through the storage engine (the store's calls and key\n"
               "               fingerprints, no payloads)\n"
               "  --speedup X  sleep the trace's inter-arrival gaps divided by X\n"
               "  --requests M replay only the first M requests\n"
               "  --daemon S   replay through the tierkvd listening on UNIX socket S (its own\n"
               "               policy and capacity)%s\n",
#ifdef TKV_HAVE_KVCLIENT
               ""
#else
               " [not built: libkvclient was not part of this build]"
#endif
    );
}

static int parse_u64_arg(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    unsigned long long v = strtoull(s, &end, 10);
    if (errno || end == s || *end || s[0] == '-')
        return TKV_EINVAL;
    *out = v;
    return TKV_OK;
}

int main(int argc, char **argv)
{
    const char *trace_path = NULL, *policies = "lru,tierkv,hazard,oracle", *daemon_socket = NULL;
    const char *caps_arg = NULL;
    bool json = false, fast = false;
    uint64_t block_tokens = 128, max_reqs = 0;
    double speedup = 0;
    int rc = 1;
    trace t = {0};
    result *results = NULL;
    size_t num_results = 0;
    replay_keys rk = {0};

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--json") == 0) {
            json = true;
        } else if (strcmp(a, "--fast") == 0) {
            fast = true;
        } else if (strcmp(a, "--help") == 0 || strcmp(a, "-h") == 0) {
            usage(stdout);
            return 0;
        } else if (!v) {
            fprintf(stderr, "trace_replay: %s needs a value\n", a);
            usage(stderr);
            return 2;
        } else if (strcmp(a, "--trace") == 0) {
            trace_path = v, i++;
        } else if (strcmp(a, "--daemon") == 0) {
            daemon_socket = v, i++;
        } else if (strcmp(a, "--capacity") == 0) {
            caps_arg = v, i++;
        } else if (strcmp(a, "--policy") == 0) {
            policies = v, i++;
        } else if (strcmp(a, "--block-tokens") == 0) {
            if (parse_u64_arg(v, &block_tokens) != TKV_OK ||
                (block_tokens != 16 && block_tokens != 32 && block_tokens != 64 &&
                 block_tokens != 128)) {
                fprintf(stderr, "trace_replay: --block-tokens must be 16, 32, 64 or 128\n");
                return 2;
            }
            i++;
        } else if (strcmp(a, "--requests") == 0) {
            if (parse_u64_arg(v, &max_reqs) != TKV_OK) {
                fprintf(stderr, "trace_replay: --requests: not a count: %s\n", v);
                return 2;
            }
            i++;
        } else if (strcmp(a, "--speedup") == 0) {
            char *end;
            speedup = strtod(v, &end);
            if (end == v || *end || !(speedup > 0) || speedup > 1e9) {
                fprintf(stderr, "trace_replay: --speedup must be a positive number\n");
                return 2;
            }
            i++;
        } else {
            fprintf(stderr, "trace_replay: unknown argument %s\n", a);
            usage(stderr);
            return 2;
        }
    }
    if (!trace_path || (!caps_arg && !daemon_socket)) {
        fprintf(stderr, "trace_replay: --trace and --capacity (or --daemon) are required\n");
        usage(stderr);
        return 2;
    }
    if (daemon_socket) {
#ifdef TKV_HAVE_KVCLIENT
        if (caps_arg || fast) {
            fprintf(stderr, "trace_replay: --daemon measures the daemon's own policy and "
                            "capacity; --capacity and --fast do not apply\n");
            return 2;
        }
        caps_arg = "1"; /* placeholder: the daemon reports its capacity */
        policies = "lru";
#else
        fprintf(stderr, "trace_replay: --daemon: this build has no libkvclient\n");
        return 2;
#endif
    }

    /* Validate every capacity and policy before the (long) replay starts. */
    uint64_t caps[64];
    size_t num_caps = 0;
    {
        char *copy = tkv_xstrdup(caps_arg), *save = NULL;
        for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
            uint64_t c;
            if (num_caps == 64 || parse_u64_arg(tok, &c) != TKV_OK || c == 0 ||
                c > (UINT32_MAX / 8)) {
                fprintf(stderr, "trace_replay: bad capacity '%s' (1..%u, at most 64 values)\n",
                        tok, UINT32_MAX / 8);
                free(copy);
                return 2;
            }
            caps[num_caps++] = c;
        }
        free(copy);
    }
    const char *pols[16];
    size_t num_pols = 0;
    char *pol_copy = tkv_xstrdup(policies), *save = NULL;
    for (char *tok = strtok_r(pol_copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (num_pols == 16 || (strcmp(tok, "oracle") != 0 && !tkv_policy_find(tok))) {
            fprintf(stderr, "trace_replay: unknown policy '%s'\n", tok);
            usage(stderr);
            goto fail;
        }
        pols[num_pols++] = tok;
    }
    if (num_caps == 0 || num_pols == 0) {
        fprintf(stderr, "trace_replay: empty --capacity or --policy\n");
        goto fail;
    }

    if (trace_load(trace_path, max_reqs, &t) != TKV_OK)
        goto fail;

    results = tkv_xcalloc(num_caps * num_pols, sizeof(*results));
#ifdef TKV_HAVE_KVCLIENT
    char daemon_policy[40];
    if (daemon_socket) {
        result *res = &results[num_results++];
        res->mode = "daemon";
        if (run_daemon(&t, daemon_socket, speedup, res, daemon_policy,
                       sizeof(daemon_policy)) != TKV_OK)
            goto fail;
        res->policy = daemon_policy;
        num_caps = 0; /* nothing else to run */
    }
#endif
    for (size_t ic = 0; ic < num_caps; ic++) {
        for (size_t ip = 0; ip < num_pols; ip++) {
            result *res = &results[num_results++];
            res->policy = pols[ip];
            res->capacity_blocks = caps[ic];
            int st;
            if (strcmp(pols[ip], "oracle") == 0) {
                res->mode = "oracle-sim";
                st = run_oracle(&t, caps[ic], res);
            } else if (fast) {
                res->mode = "policy-sim";
                if (!rk.node_keys)
                    replay_keys_build(&t, (uint32_t)block_tokens, &rk);
                st = run_sim(&t, tkv_policy_find(pols[ip]), caps[ic], (uint32_t)block_tokens,
                             speedup, rk.node_keys, res);
            } else {
                res->mode = "store";
                if (!rk.node_keys)
                    replay_keys_build(&t, (uint32_t)block_tokens, &rk);
                st = run_store(&t, &rk, pols[ip], caps[ic], (uint32_t)block_tokens, speedup, res);
            }
            if (st != TKV_OK)
                goto fail;
            if (!json)
                fprintf(stderr, "trace_replay: capacity %" PRIu64 " %-7s %6.2f%% (%.1f s)\n",
                        res->capacity_blocks, res->policy,
                        100.0 * (double)res->hit_blocks / (double)res->blocks, res->seconds);
        }
    }

    if (json) {
        printf("[\n");
        for (size_t i = 0; i < num_results; i++) {
            const result *r = &results[i];
            printf("  {\"trace\": ");
            json_string(stdout, trace_path);
            printf(", \"capacity_blocks\": %" PRIu64 ", \"policy\": \"%s\", "
                   "\"mode\": \"%s\", \"block_tokens\": %" PRIu64 ", \"requests\": %" PRIu64
                   ", \"blocks\": %" PRIu64 ", \"hit_blocks\": %" PRIu64
                   ", \"hit_rate\": %.6f, \"tokens\": %" PRIu64 ", \"hit_tokens\": %" PRIu64
                   ", \"token_hit_rate\": %.6f, \"hit_rate_tier\": {\"l1\": %.6f, \"l2\": %.6f, "
                   "\"l3\": %.6f}, \"evictions\": %" PRIu64 ", \"seconds\": %.3f}%s\n",
                   r->capacity_blocks, r->policy, r->mode,
                   strcmp(r->mode, "oracle-sim") != 0 ? block_tokens : (uint64_t)kTraceBlockTokens,
                   r->requests, r->blocks, r->hit_blocks,
                   (double)r->hit_blocks / (double)r->blocks, r->tokens, r->hit_tokens,
                   (double)r->hit_tokens / (double)r->tokens,
                   (double)r->hit_blocks_tier[TKV_TIER_L1] / (double)r->blocks,
                   (double)r->hit_blocks_tier[TKV_TIER_L2] / (double)r->blocks,
                   (double)r->hit_blocks_tier[TKV_TIER_L3] / (double)r->blocks, r->evictions,
                   r->seconds, i + 1 < num_results ? "," : "");
        }
        printf("]\n");
    } else {
        printf("%-10s %-8s %-10s %9s %9s %9s %9s\n", "capacity", "policy", "mode", "requests",
               "blocks", "hit%", "tok-hit%");
        for (size_t i = 0; i < num_results; i++) {
            const result *r = &results[i];
            printf("%-10" PRIu64 " %-8s %-10s %9" PRIu64 " %9" PRIu64 " %8.2f%% %8.2f%%\n",
                   r->capacity_blocks, r->policy, r->mode, r->requests, r->blocks,
                   100.0 * (double)r->hit_blocks / (double)r->blocks,
                   100.0 * (double)r->hit_tokens / (double)r->tokens);
        }
    }
    rc = 0;
fail:
    free(pol_copy);
    free(results);
    free(rk.node_keys);
    trace_free(&t);
    return rc;
}
