/* trace_replay - replays a Mooncake-format trace through the cache and reports prefix hit rates.
 *
 *   trace_replay --trace FILE --capacity N[,N...] [--policy lru,hazard,oracle] [--json]
 *                [--block-tokens P] [--speedup X] [--requests M]
 *   trace_replay --trace FILE --daemon SOCKET [--json] [--speedup X]
 *
 * The trace format is in trace_load.h. Hit accounting (the same for every policy): a request's
 * prefix hit is the leading run of its blocks that are cached (one lookup); after it is served,
 * its missing blocks are inserted (one put). Capacities are given in 512-token trace blocks;
 * the cache holds N * (512 / P) blocks of P tokens. A trace block counts as hit when all of its
 * P-token blocks hit.
 *
 * Partial blocks: the last id of a request usually covers fewer than 512 tokens. It is counted
 * as one block (so block hit rates are comparable with published figures, which count one block
 * per id) and stored as 512 tokens derived from the id; the token hit rate counts only its real
 * tokens (input_length), so a hit on it is worth its real length there.
 *
 * Modes:
 *   a policy  the real engine in-process: tkv_store (L2 only, small block_bytes) with that
 *             policy, keys are real SHA-256 chains (tkv_key_chain) of token contents derived
 *             from the ids;
 *   oracle    the ceiling, simulated (it needs the future): Belady, evicting the cached block
 *             whose next use is farthest away (never = farthest; ties: deepest first, so a
 *             chain is evicted from its tail, the prefix rule the store applies);
 *   --daemon SOCKET  through a running tierkvd with libkvclient (lookup, put of the missing
 *             blocks by value, release): the daemon's own policy and L2 capacity are measured
 *             (reported as its policy name and its capacity in trace blocks; --capacity and
 *             --policy do not apply). Start the daemon with a small geometry (e.g. 1 layer,
 *             1 KV head, head dim 64) and L3 off so the replay is about the policy, not copies.
 * --speedup X sleeps the trace's inter-arrival gaps divided by X (default: no sleeping).
 * A policy simulator without the store, for trying policies quickly, is dev/trace_sim.c.
 */
#include "trace_load.h"

#include "tkv_policy.h"
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

static int run_oracle(const trace *t, uint64_t capacity, trace_result *res)
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
    double t0 = trace_now_s();
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        const trace_req *r = &t->reqs[ir];
        const uint32_t *nd = &t->nodes[r->first];
        uint32_t hit = 0;
        while (hit < r->num_blocks && o.pos[nd[hit]] != UINT32_MAX)
            hit++;
        trace_account(res, r, hit);
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
    res->seconds = trace_now_s() - t0;
    free(o.heap);
    free(o.pos);
    free(o.next_use);
    free(next);
    return TKV_OK;
}

/* ============================================================================================
 * The real engine, in-process
 * ========================================================================================== */

static int run_store(const trace *t, const trace_keys *rk, const char *policy,
                     uint64_t capacity, uint32_t block_tokens, double speedup, trace_result *res)
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

    res->store_capacity = capacity * per;
    double t0 = trace_now_s();
    tkv_block_loc *locs = tkv_xmalloc(max_cache_blocks * sizeof(*locs));
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        trace_pace(t, ir, speedup);
        const trace_req *r = &t->reqs[ir];
        size_t nk = (size_t)r->num_blocks * per;
        for (uint32_t j = 0; j < r->num_blocks; j++) {
            uint32_t n = t->nodes[r->first + j];
            memcpy(&keys[(size_t)j * per], &node_keys[(size_t)n * per], per * sizeof(*keys));
            trace_id_tokens(t->node_id[n], tokens + (size_t)j * kTraceBlockTokens);
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
        trace_account(res, r, hit_trace);
        res->store_hit_blocks += num_hit;
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
    res->seconds = trace_now_s() - t0;
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

static int run_daemon(const trace *t, const char *socket_path, double speedup, trace_result *res,
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

    double t0 = trace_now_s();
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        trace_pace(t, ir, speedup);
        const trace_req *r = &t->reqs[ir];
        size_t num_tokens = (size_t)r->num_blocks * kTraceBlockTokens;
        for (uint32_t j = 0; j < r->num_blocks; j++)
            trace_id_tokens(t->node_id[t->nodes[r->first + j]], tokens + (size_t)j * kTraceBlockTokens);
        kvc_lease *l = NULL;
        if (kvc_lookup(c, tokens, num_tokens, 0, &l) != KVC_OK) {
            fprintf(stderr, "trace_replay: lookup: %s\n", kvc_last_error());
            goto fail;
        }
        uint32_t hit = kvc_lease_num_blocks(l), total = r->num_blocks * per;
        uint32_t hit_trace = hit / per;
        trace_account(res, r, hit_trace);
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
    res->seconds = trace_now_s() - t0;
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

static void usage(FILE *f)
{
    fprintf(f,
            "usage: trace_replay --trace FILE --capacity N[,N...] [--policy P[,P...]] [--json]\n"
            "                    [--block-tokens 16|32|64|128] [--speedup X]\n"
            "                    [--requests M]\n"
            "       trace_replay --trace FILE --daemon SOCKET [--json] [--speedup X]\n"
            "  --capacity   cache sizes in 512-token trace blocks\n"
            "  --policy     any of: oracle");
    for (const tkv_policy_ops *const *p = tkv_policy_all(); *p; p++)
        fprintf(f, ", %s", (*p)->name);
    fprintf(f, " (default: lru,hazard,oracle;\n"
               "               hazard is the store's default)\n"
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
    const char *trace_path = NULL, *policies = "lru,hazard,oracle", *daemon_socket = NULL;
    const char *caps_arg = NULL;
    bool json = false;
    uint64_t block_tokens = 128, max_reqs = 0;
    double speedup = 0;
    int rc = 1;
    trace t = {0};
    trace_result *results = NULL;
    size_t num_results = 0;
    trace_keys rk = {0};

    for (int i = 1; i < argc; i++) {
        const char *a = argv[i];
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--json") == 0) {
            json = true;
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
        if (caps_arg) {
            fprintf(stderr, "trace_replay: --daemon measures the daemon's own policy and "
                            "capacity; --capacity does not apply\n");
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
        trace_result *res = &results[num_results++];
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
            trace_result *res = &results[num_results++];
            res->policy = pols[ip];
            res->capacity_blocks = caps[ic];
            int st;
            if (strcmp(pols[ip], "oracle") == 0) {
                res->mode = "oracle-sim";
                st = run_oracle(&t, caps[ic], res);
            } else {
                res->mode = "store";
                if (!rk.node_keys)
                    trace_keys_build(&t, (uint32_t)block_tokens, &rk);
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

    trace_print_results(trace_path, results, num_results, block_tokens, json);
    rc = 0;
fail:
    free(pol_copy);
    free(results);
    free(rk.node_keys);
    trace_free(&t);
    return rc;
}
