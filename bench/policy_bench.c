/* policy_bench - cost per block operation of each registered policy, against tier size.
 *
 *   policy_bench [--ops N] [--json]
 *
 * A synthetic prefix workload (chains of 1..64 blocks, 1 in 8 branching off an earlier chain,
 * requests for random chain ends, skewed towards recent chains) runs through a minimal tier
 * manager that keeps the policy fields the way storage/store.c does (parent learns of a child
 * before the policy does; hit blocks pinned while the request inserts; admit() asked before a
 * missing block enters, one now_ns per request; a refused block ends the request's put). It
 * reports nanoseconds (process CPU time) per block operation (lookup hit, admission, insert,
 * eviction, pin change) at tier sizes from 10^4 to 10^6 blocks: a policy that is O(1) per
 * operation shows a flat line (cache misses of larger working sets aside). Each policy runs
 * twice: without key fingerprints (key_fp = 0) and with them (a hash of the block's number,
 * as the store gives a hash of its key), which turns on what a policy keeps by fingerprint
 * (hazard's ghost history and its LRU guard's shadow directory).
 */
#include "tkv_base.h"
#include "tkv_policy.h"

#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef struct node {
    tkv_policy_entry pe; /* first member: victim() pointers map back to nodes */
    int32_t parent;
    bool present;
} node;

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* Process CPU time: the figure should not depend on what else the machine runs. */
static uint64_t cpu_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

typedef struct run_result {
    uint64_t ops, hits, lookups;
    double seconds;
} run_result;

/* splitmix64's finalizer: a block's key fingerprint from its number */
static uint64_t mix64(uint64_t x)
{
    x ^= x >> 30;
    x *= 0xbf58476d1ce4e5b9ull;
    x ^= x >> 27;
    x *= 0x94d049bb133111ebull;
    x ^= x >> 31;
    return x;
}

static int run(const tkv_policy_ops *ops, uint64_t capacity, uint64_t num_ops, bool key_fp,
               run_result *out)
{
    const int32_t n = (int32_t)(capacity * 4);
    node *nodes = tkv_xcalloc((size_t)n, sizeof(*nodes));
    void *st = ops->create(capacity);
    if (!st) {
        free(nodes);
        return TKV_EINVAL;
    }
    uint64_t r = 12345, used = 0;
    int32_t start = 0;
    while (start < n) {
        int32_t len = 1 + (int32_t)(rng_next(&r) % 64);
        int32_t head = start > 0 && rng_next(&r) % 8 == 0 ? (int32_t)(rng_next(&r) % (uint64_t)start) : -1;
        for (int32_t k = 0; k < len && start + k < n; k++)
            nodes[start + k].parent = k == 0 ? head : start + k - 1;
        start += len;
    }
    int32_t *path = tkv_xmalloc((size_t)n * sizeof(*path));
    memset(out, 0, sizeof(*out));
    uint64_t t0 = cpu_ns(), now = 0;
    while (out->ops < num_ops) {
        now++; /* the request's put: one now_ns */
        /* the newest quarter of the chains half of the time: a working set with reuse */
        uint64_t span = rng_next(&r) % 2 ? (uint64_t)n : (uint64_t)n / 4;
        int32_t last = (int32_t)(rng_next(&r) % span);
        int32_t len = 0;
        for (int32_t i = last; i >= 0; i = nodes[i].parent)
            path[len++] = i;
        int32_t hit = 0;
        while (hit < len && nodes[path[len - 1 - hit]].present)
            hit++;
        out->hits += (uint64_t)hit;
        out->lookups += (uint64_t)len;
        for (int32_t k = 0; k < hit; k++) {
            node *x = &nodes[path[len - 1 - k]];
            ops->accessed(st, &x->pe, 0);
            x->pe.pinned++;
            ops->changed(st, &x->pe);
            out->ops += 2;
        }
        for (int32_t k = hit; k < len; k++) {
            node *x = &nodes[path[len - 1 - k]];
            node *p = x->parent >= 0 ? &nodes[x->parent] : NULL;
            if (x->present)
                continue;
            if (p && !p->present)
                break;
            bool room = true;
            while (used >= capacity) {
                tkv_policy_entry *v = ops->victim(st);
                if (!v || v->num_children) {
                    room = false;
                    break;
                }
                node *vn = (node *)v;
                ops->removed(st, v);
                vn->present = false;
                used--;
                out->ops++;
                if (v->parent && --v->parent->num_children == 0)
                    ops->changed(st, v->parent);
            }
            if (!room || (p && !p->present))
                break;
            x->pe = (tkv_policy_entry){.parent = p ? &p->pe : NULL,
                                       .depth = p ? p->pe.depth + 1 : 0,
                                       .key_fp = key_fp ? mix64((uint64_t)(x - nodes) + 1) | 1
                                                        : 0};
            out->ops++;
            if (!ops->admit(st, &x->pe, now))
                break;
            x->present = true;
            used++;
            if (p && p->pe.num_children++ == 0)
                ops->changed(st, &p->pe);
            ops->inserted(st, &x->pe, now);
            out->ops++;
        }
        for (int32_t k = 0; k < hit; k++) {
            node *x = &nodes[path[len - 1 - k]];
            x->pe.pinned--;
            ops->changed(st, &x->pe);
            out->ops++;
        }
    }
    out->seconds = (double)(cpu_ns() - t0) / 1e9;
    ops->destroy(st);
    free(path);
    free(nodes);
    return TKV_OK;
}

int main(int argc, char **argv)
{
    uint64_t num_ops = 5000000;
    bool json = false;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0) {
            json = true;
        } else if (strcmp(argv[i], "--ops") == 0 && i + 1 < argc) {
            char *end;
            num_ops = strtoull(argv[++i], &end, 10);
            if (*end || num_ops == 0) {
                fprintf(stderr, "policy_bench: --ops needs a positive count\n");
                return 2;
            }
        } else {
            fprintf(stderr, "usage: policy_bench [--ops N] [--json]\n");
            return 2;
        }
    }
    const uint64_t caps[] = {10000, 100000, 1000000};
    const size_t num_caps = sizeof(caps) / sizeof(caps[0]);
    if (json)
        printf("[\n");
    else
        printf("%-8s %6s %10s %12s %10s %8s\n", "policy", "key_fp", "capacity", "ops", "ns/op",
               "hit%");
    bool first = true;
    for (const tkv_policy_ops *const *p = tkv_policy_all(); *p; p++) {
        for (size_t i = 0; i < 2 * num_caps; i++) { /* without, then with fingerprints */
            const bool fp = i >= num_caps;
            const size_t ic = i % num_caps;
            run_result res;
            if (run(*p, caps[ic], num_ops, fp, &res) != TKV_OK) {
                fprintf(stderr, "policy_bench: %s refused capacity %" PRIu64 "\n", (*p)->name,
                        caps[ic]);
                return 1;
            }
            double ns = res.seconds * 1e9 / (double)res.ops;
            double hit = 100.0 * (double)res.hits / (double)res.lookups;
            if (json)
                printf("%s  {\"policy\": \"%s\", \"key_fp\": %s, \"capacity_blocks\": %" PRIu64
                       ", \"ops\": %" PRIu64 ", \"ns_per_op\": %.1f, \"hit_rate\": %.4f}",
                       first ? "" : ",\n", (*p)->name, fp ? "true" : "false", caps[ic], res.ops,
                       ns, hit / 100);
            else
                printf("%-8s %6s %10" PRIu64 " %12" PRIu64 " %10.1f %7.2f%%\n", (*p)->name,
                       fp ? "yes" : "no", caps[ic], res.ops, ns, hit);
            first = false;
        }
    }
    if (json)
        printf("\n]\n");
    return 0;
}
