/* trace_load.c - reading a Mooncake-format trace, its keys and the shared accounting (see
 * trace_load.h). */
#include "trace_load.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

/* ============================================================================================
 * Trace
 * ========================================================================================== */


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

void trace_free(trace *t)
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
                        t->cap_ids = t->cap_ids ? t->cap_ids * 2 : 256;
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
int trace_load(const char *path, size_t max_reqs, trace *t)
{
    memset(t, 0, sizeof(*t));
    FILE *f = fopen(path, "r");
    if (!f) {
        fprintf(stderr, "trace_replay: %s: %s\n", path, strerror(errno));
        return TKV_EIO;
    }
    int rc = trace_read(f, path, max_reqs, t);
    fclose(f);
    return rc;
}

int trace_read(FILE *f, const char *path, size_t max_reqs, trace *t)
{
    memset(t, 0, sizeof(*t));
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
    /* Sized from the id count (distinct ids are at most that many), so the map stays at
     * most half full and nothing grows: a small trace costs little, a large one no rehash. */
    idmap m;
    size_t cap_map = 16;
    while (cap_map < 2 * t->num_ids)
        cap_map *= 2;
    idmap_init(&m, cap_map);
    size_t cap_nodes = t->num_ids ? t->num_ids : 1, num_inconsistent = 0;
    t->nodes = tkv_xmalloc(cap_nodes * sizeof(*t->nodes));
    t->node_id = tkv_xmalloc(cap_nodes * sizeof(*t->node_id));
    t->node_parent = tkv_xmalloc(cap_nodes * sizeof(*t->node_parent));
    t->node_depth = tkv_xmalloc(cap_nodes * sizeof(*t->node_depth));
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        const trace_req *r = &t->reqs[ir];
        int64_t parent = -1;
        for (uint32_t j = 0; j < r->num_blocks; j++) {
            bool found;
            uint32_t *slot = idmap_slot(&m, t->ids[r->first + j], &found);
            if (!found) {
                TKV_ASSERT(t->num_nodes < UINT32_MAX && t->num_nodes < cap_nodes);
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
}/* ============================================================================================
 * Keys
 * ========================================================================================== */

/* Deterministic token contents of a trace block: 512 tokens derived from its id. */
void trace_id_tokens(uint64_t id, uint32_t *out)
{
    for (uint32_t k = 0; k < kTraceBlockTokens; k++)
        out[k] = (uint32_t)(mix64(id * kTraceBlockTokens + k) % 200000u);
}

/* The geometry the replay's blocks are keyed under, and every node's keys: the chain of its
 * P-token blocks, continuing its parent's chain. Nodes are numbered in first-seen order, so a
 * parent's keys are always computed first. Computed once per process (it hashes every token
 * of the trace once). */

void trace_keys_build(const trace *t, uint32_t block_tokens, trace_keys *rk)
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
        trace_id_tokens(t->node_id[n], tok);
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
/* ============================================================================================
 * Results
 * ========================================================================================== */


double trace_now_s(void) { return (double)tkv_now_ns() / 1e9; }

void trace_account(trace_result *res, const trace_req *r, uint32_t hit_trace_blocks)
{
    res->requests++;
    res->blocks += r->num_blocks;
    res->hit_blocks += hit_trace_blocks;
    res->tokens += r->input_tokens;
    uint64_t ht = (uint64_t)hit_trace_blocks * kTraceBlockTokens;
    res->hit_tokens += ht < r->input_tokens ? ht : r->input_tokens;
}

void trace_pace(const trace *t, size_t ir, double speedup)
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


void trace_print_results(const char *trace_path, const trace_result *results, size_t num_results,
                         uint64_t block_tokens, bool json)
{
    if (json) {
        printf("[\n");
        for (size_t i = 0; i < num_results; i++) {
            const trace_result *r = &results[i];
            printf("  {\"trace\": ");
            json_string(stdout, trace_path);
            printf(", \"capacity_blocks\": %" PRIu64 ", \"policy\": \"%s\", "
                   "\"mode\": \"%s\", \"block_tokens\": %" PRIu64 ", \"requests\": %" PRIu64
                   ", \"blocks\": %" PRIu64 ", \"hit_blocks\": %" PRIu64
                   ", \"hit_rate\": %.6f, \"tokens\": %" PRIu64 ", \"hit_tokens\": %" PRIu64
                   ", \"token_hit_rate\": %.6f, \"hit_rate_tier\": {\"l1\": %.6f, \"l2\": %.6f, "
                   "\"l3\": %.6f}, \"evictions\": %" PRIu64 ", \"store_capacity\": %" PRIu64
                   ", \"store_hit_blocks\": %" PRIu64 ", \"seconds\": %.3f}%s\n",
                   r->capacity_blocks, r->policy, r->mode,
                   strcmp(r->mode, "oracle-sim") != 0 ? block_tokens : (uint64_t)kTraceBlockTokens,
                   r->requests, r->blocks, r->hit_blocks,
                   (double)r->hit_blocks / (double)r->blocks, r->tokens, r->hit_tokens,
                   (double)r->hit_tokens / (double)r->tokens,
                   (double)r->hit_blocks_tier[TKV_TIER_L1] / (double)r->blocks,
                   (double)r->hit_blocks_tier[TKV_TIER_L2] / (double)r->blocks,
                   (double)r->hit_blocks_tier[TKV_TIER_L3] / (double)r->blocks, r->evictions,
                   r->store_capacity, r->store_hit_blocks, r->seconds, i + 1 < num_results ? "," : "");
        }
        printf("]\n");
    } else {
        printf("%-10s %-8s %-10s %9s %9s %9s %9s\n", "capacity", "policy", "mode", "requests",
               "blocks", "hit%", "tok-hit%");
        for (size_t i = 0; i < num_results; i++) {
            const trace_result *r = &results[i];
            printf("%-10" PRIu64 " %-8s %-10s %9" PRIu64 " %9" PRIu64 " %8.2f%% %8.2f%%\n",
                   r->capacity_blocks, r->policy, r->mode, r->requests, r->blocks,
                   100.0 * (double)r->hit_blocks / (double)r->blocks,
                   100.0 * (double)r->hit_tokens / (double)r->tokens);
        }
    }
}
