/* trace_sim - replays a Mooncake-format trace through a minimal tier manager in this file that
 * drives tkv_policy_ops directly: no store, no payloads, a few times faster than
 * bench/trace_replay, and any policy can be tried, registered or not (dev/policy_tierkv.c's
 * "tierkv" included). For trying policies; the figures that count are trace_replay's.
 *
 *   trace_sim --trace FILE --capacity N[,N...] [--policy lru,hazard,tierkv] [--json]
 *             [--block-tokens P] [--requests M]
 *
 * It must model the store faithfully (same granularity, chunks and call order) so a policy
 * tuned with it is tuned for the store: dev_trace_sim_agrees checks that both give the same
 * hit counts. It gives the policies the key fingerprints the store gives (tkv_policy_entry
 * .key_fp: the first 8 bytes of the block's SHA-256 chain key, | 1). Output as trace_replay's.
 */
#include "trace_load.h"

#include "tkv_policy.h"
#include "tkv_policy_dev.h"

#include <errno.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>

/* ============================================================================================
 * A minimal tier manager over tkv_policy_ops, P/512 entries per trace block
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

/* node_keys: every cache entry's key (trace_keys_build), for the store's key fingerprints. */
static int run_sim(const trace *t, const tkv_policy_ops *ops, uint64_t trace_capacity,
                   uint32_t block_tokens, double speedup, const tkv_key *node_keys,
                   trace_result *res)
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
    double t0 = trace_now_s();
    for (size_t ir = 0; ir < t->num_reqs; ir++) {
        trace_pace(t, ir, speedup);
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
        trace_account(res, r, hit / per);
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
    res->seconds = trace_now_s() - t0;
    ops->destroy(st);
    free(nodes);
    free(nd);
    return TKV_OK;
}

static const tkv_policy_ops *find_policy(const char *name)
{
    if (strcmp(name, tkv_policy_tierkv.name) == 0)
        return &tkv_policy_tierkv;
    return tkv_policy_find(name);
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
    const char *trace_path = NULL, *caps_arg = NULL, *policies = "lru,hazard,tierkv";
    uint64_t block_tokens = 128, max_reqs = 0;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (strcmp(a, "--json") == 0) {
            json = true;
            continue;
        }
        if (!v) {
            fprintf(stderr, "trace_sim: %s needs a value\n", a);
            return 2;
        }
        i++;
        if (strcmp(a, "--trace") == 0) {
            trace_path = v;
        } else if (strcmp(a, "--capacity") == 0) {
            caps_arg = v;
        } else if (strcmp(a, "--policy") == 0) {
            policies = v;
        } else if (strcmp(a, "--block-tokens") == 0) {
            if (parse_u64_arg(v, &block_tokens) != TKV_OK || block_tokens == 0 ||
                block_tokens > kTraceBlockTokens || kTraceBlockTokens % block_tokens) {
                fprintf(stderr, "trace_sim: --block-tokens must divide 512\n");
                return 2;
            }
        } else if (strcmp(a, "--requests") == 0) {
            if (parse_u64_arg(v, &max_reqs) != TKV_OK) {
                fprintf(stderr, "trace_sim: --requests: not a count: %s\n", v);
                return 2;
            }
        } else {
            fprintf(stderr, "trace_sim: unknown argument %s\n", a);
            return 2;
        }
    }
    if (!trace_path || !caps_arg) {
        fprintf(stderr, "usage: trace_sim --trace FILE --capacity N[,N...] [--policy P[,P...]] "
                        "[--json] [--block-tokens P] [--requests M]\n");
        return 2;
    }
    uint64_t caps[64];
    const tkv_policy_ops *pols[16];
    size_t num_caps = 0, num_pols = 0;
    char *copy = tkv_xstrdup(caps_arg), *save = NULL;
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (num_caps == 64 || parse_u64_arg(tok, &caps[num_caps]) != TKV_OK ||
            caps[num_caps] == 0 || caps[num_caps] > UINT32_MAX / 8) {
            fprintf(stderr, "trace_sim: bad capacity '%s'\n", tok);
            free(copy);
            return 2;
        }
        num_caps++;
    }
    free(copy);
    copy = tkv_xstrdup(policies);
    for (char *tok = strtok_r(copy, ",", &save); tok; tok = strtok_r(NULL, ",", &save)) {
        if (num_pols == 16 || !(pols[num_pols] = find_policy(tok))) {
            fprintf(stderr, "trace_sim: unknown policy '%s'\n", tok);
            free(copy);
            return 2;
        }
        num_pols++;
    }
    free(copy);
    if (!num_caps || !num_pols)
        return 2;
    trace t = {0};
    if (trace_load(trace_path, max_reqs, &t) != TKV_OK)
        return 1;
    trace_keys rk = {0};
    trace_keys_build(&t, (uint32_t)block_tokens, &rk);
    trace_result *results = tkv_xcalloc(num_caps * num_pols, sizeof(*results));
    size_t n = 0;
    int rc = 0;
    for (size_t ic = 0; ic < num_caps && !rc; ic++)
        for (size_t ip = 0; ip < num_pols && !rc; ip++) {
            trace_result *res = &results[n++];
            res->policy = pols[ip]->name;
            res->mode = "policy-sim";
            res->capacity_blocks = caps[ic];
            rc = run_sim(&t, pols[ip], caps[ic], (uint32_t)block_tokens, 0, rk.node_keys, res)
                     ? 1 : 0;
        }
    if (!rc)
        trace_print_results(trace_path, results, n, block_tokens, json);
    free(results);
    free(rk.node_keys);
    trace_free(&t);
    return rc;
}
