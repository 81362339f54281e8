/* policy_harness.h - a tier manager for policy unit tests, and the workloads they share
 * (tests/storage/test_policy_hazard.c, dev/test_policy_tierkv.c). Header-only: each test
 * includes it once.
 *
 * The manager keeps the structural fields in the order storage/store.c does: admit() before
 * room is made, one now_ns per request; a parent learns of a new child (num_children,
 * changed()) before the policy learns of the child (inserted()); on removal the policy hears
 * removed() first, then the parent and orphaned children are updated. */
#ifndef TKV_TEST_POLICY_HARNESS_H
#define TKV_TEST_POLICY_HARNESS_H

#include <check.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_base.h"
#include "tkv_policy.h"


/* ck_assert records every passing check with a write(2) to the runner; the hot loops below
 * make millions of checks, so they only call into Check when one fails. */
#define REQUIRE(cond, ...)                                                                    \
    do {                                                                                      \
        if (!(cond))                                                                          \
            ck_abort_msg(__VA_ARGS__);                                                        \
    } while (0)

typedef struct node {
    tkv_policy_entry pe; /* first member: victim() pointers map back to nodes */
    int parent;          /* index, -1 for a chain's first block */
    int first_child, next_sibling;
    bool present;
} node;

typedef struct mgr {
    const tkv_policy_ops *ops;
    void *st;
    node *nodes;
    int n;
    uint64_t capacity, count;
    uint64_t hits, lookups_blocks;
    uint64_t interior_victims;
    uint64_t now; /* one per request: the store passes admit() one now_ns per put */
    bool keys;    /* give the policy key fingerprints (tkv_policy_entry.key_fp, rule 5) */
} mgr;

static inline uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

/* a block's key fingerprint: the same every time it is offered, never 0 */
static inline uint64_t key_fp(int i)
{
    uint64_t x = (uint64_t)i + 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return (x ^ (x >> 31)) | 1;
}

static inline mgr *mgr_new(const tkv_policy_ops *ops, int n, uint64_t capacity)
{
    mgr *m = tkv_xcalloc(1, sizeof(*m));
    m->ops = ops;
    m->st = ops->create(capacity);
    REQUIRE(m->st != NULL, "create() failed");
    m->n = n;
    m->capacity = capacity;
    m->nodes = tkv_xcalloc((size_t)n, sizeof(node));
    for (int i = 0; i < n; i++)
        m->nodes[i].parent = m->nodes[i].first_child = m->nodes[i].next_sibling = -1;
    return m;
}

static inline void mgr_free(mgr *m)
{
    m->ops->destroy(m->st);
    free(m->nodes);
    free(m);
}

/* Declares i as a child of p (the tree of possible blocks; not residency). */
static inline void mgr_link(mgr *m, int i, int p)
{
    m->nodes[i].parent = p;
    if (p >= 0) {
        m->nodes[i].next_sibling = m->nodes[p].first_child;
        m->nodes[p].first_child = i;
    }
}

static inline bool unpinned_tail_exists(const mgr *m)
{
    for (int i = 0; i < m->n; i++)
        if (m->nodes[i].present && !m->nodes[i].pe.pinned && !m->nodes[i].pe.num_children)
            return true;
    return false;
}

static inline void mgr_remove(mgr *m, int i)
{
    node *x = &m->nodes[i];
    REQUIRE(x->present, "removing an absent block");
    m->ops->removed(m->st, &x->pe);
    x->present = false;
    m->count--;
    if (x->pe.parent) {
        node *p = (node *)x->pe.parent;
        if (--p->pe.num_children == 0)
            m->ops->changed(m->st, &p->pe);
    }
    for (int c = x->first_child; c >= 0; c = m->nodes[c].next_sibling) {
        if (m->nodes[c].present && m->nodes[c].pe.parent == &x->pe) {
            m->nodes[c].pe.parent = NULL;
            m->ops->changed(m->st, &m->nodes[c].pe);
        }
    }
}

/* One victim() call checked against the contract; -1 when it returns NULL. With `check_all`
 * the "tails first" rule is verified by a scan (O(n): small harnesses only). */
static inline int mgr_victim(mgr *m, bool check_all)
{
    tkv_policy_entry *v = m->ops->victim(m->st);
    if (!v)
        return -1;
    node *x = (node *)v;
    int i = (int)(x - m->nodes);
    REQUIRE(i >= 0 && i < m->n && x->present, "victim is not in the tier");
    REQUIRE(v->pinned == 0, "victim %d is pinned", i);
    if (v->num_children) {
        m->interior_victims++;
        if (check_all)
            REQUIRE(!unpinned_tail_exists(m), "interior victim %d while a tail was free", i);
    }
    return i;
}

/* Enters block i (its parent must be present or i a chain head); evicts to make room first.
 * false when nothing could be evicted. */
static inline bool mgr_insert(mgr *m, int i, bool check_all)
{
    node *x = &m->nodes[i];
    int p = x->parent;
    if (p >= 0 && !m->nodes[p].present)
        return false;
    /* the store's order: admission first, then room is made */
    memset(&x->pe, 0, sizeof(x->pe));
    x->pe.key_fp = m->keys ? key_fp(i) : 0;
    if (p >= 0) {
        x->pe.parent = &m->nodes[p].pe;
        x->pe.depth = m->nodes[p].pe.depth + 1;
    }
    if (!m->ops->admit(m->st, &x->pe, m->now))
        return false;
    while (m->count >= m->capacity) {
        int v = mgr_victim(m, check_all);
        if (v < 0)
            return false;
        mgr_remove(m, v);
        if (p >= 0 && !m->nodes[p].present)
            return false; /* its prefix was the victim: the block could never be hit */
    }
    x->present = true;
    m->count++;
    if (p >= 0 && m->nodes[p].pe.num_children++ == 0)
        m->ops->changed(m->st, &m->nodes[p].pe);
    m->ops->inserted(m->st, &x->pe, 0);
    REQUIRE(m->count <= m->capacity, "capacity exceeded");
    return true;
}

static inline void mgr_pin(mgr *m, int i, int delta)
{
    m->nodes[i].pe.pinned = (uint32_t)((int)m->nodes[i].pe.pinned + delta);
    m->ops->changed(m->st, &m->nodes[i].pe);
}

/* A request for the chain ending at `last` (a root-to-last path): lookup of the cached prefix
 * (accessed + pinned like a lease), then insertion of the missing blocks, then release. */
static inline void mgr_request(mgr *m, int last, bool check_all)
{
    enum { kMaxPath = 8192 };
    static int path[kMaxPath];
    int len = 0;
    for (int i = last; i >= 0; i = m->nodes[i].parent) {
        REQUIRE(len < kMaxPath, "chain deeper than the harness supports");
        path[len++] = i;
    }
    int hit = 0;
    m->now++;
    while (hit < len && m->nodes[path[len - 1 - hit]].present)
        hit++;
    m->hits += (uint64_t)hit;
    m->lookups_blocks += (uint64_t)len;
    for (int k = 0; k < hit; k++) {
        int i = path[len - 1 - k];
        m->ops->accessed(m->st, &m->nodes[i].pe, 0);
        mgr_pin(m, i, +1);
    }
    for (int k = hit; k < len; k++) {
        if (m->nodes[path[len - 1 - k]].present)
            continue; /* cached beyond the first miss: a duplicate, dropped */
        if (!mgr_insert(m, path[len - 1 - k], check_all))
            break;
    }
    for (int k = 0; k < hit; k++)
        mgr_pin(m, path[len - 1 - k], -1);
}


/* ============================================================================================
 * Invariants and scale, for any policy
 * ========================================================================================== */

/* A random forest of conversations (chains that get extended, branch, and are abandoned),
 * requests with leases, extra pins held across requests. Every victim is checked against the
 * full contract; capacity is checked after every insert; interior victims happen only when
 * every tail is pinned (the documented case: the manager then orphans the children). */
static inline void random_invariants_of(const tkv_policy_ops *ops)
{
    for (uint64_t seed = 1; seed <= 8; seed++) {
        const int n = 600;
        mgr *m = mgr_new(ops, n, 40 + (seed % 4) * 7);
        m->keys = seed > 4; /* the same workloads with rule 5 on */
        uint64_t r = seed * 0x9e3779b97f4a7c15ull;
        for (int i = 0; i < n; i++) {
            uint64_t x = rng_next(&r) % 10;
            mgr_link(m, i, i == 0 || x == 0 ? -1 : x < 3 ? (int)(rng_next(&r) % (uint64_t)i) : i - 1);
        }
        int held[8];
        for (int k = 0; k < 8; k++)
            held[k] = -1;
        for (int step = 0; step < 3000; step++) {
            int last = (int)(rng_next(&r) % (uint64_t)n);
            mgr_request(m, last, true);
            /* a long lease: pin one cached block across requests, release it later */
            int slot = (int)(rng_next(&r) % 8);
            if (held[slot] >= 0) {
                mgr_pin(m, held[slot], -1);
                held[slot] = -1;
            } else if (m->nodes[last].present) {
                mgr_pin(m, last, +1);
                held[slot] = last;
            }
            REQUIRE(m->count <= m->capacity, "capacity exceeded");
        }
        for (int k = 0; k < 8; k++)
            if (held[k] >= 0)
                mgr_pin(m, held[k], -1);
        int v;
        while ((v = mgr_victim(m, true)) >= 0)
            mgr_remove(m, v);
        ck_assert_uint_eq(m->count, 0);
        mgr_free(m);
    }
}

/* Everything pinned but one chain: victim() drains that chain tail first and then returns NULL,
 * never a pinned block. */
static inline void pinned_never_evicted_of(const tkv_policy_ops *ops)
{
    mgr *m = mgr_new(ops, 20, 100);
    for (int i = 0; i < 20; i++)
        mgr_link(m, i, i % 10 == 0 ? -1 : i - 1); /* two chains of 10 */
    for (int i = 0; i < 20; i++)
        ck_assert(mgr_insert(m, i, true));
    for (int i = 0; i < 10; i++)
        mgr_pin(m, i, +1);
    for (int k = 19; k >= 10; k--) {
        int v = mgr_victim(m, true);
        ck_assert_int_eq(v, k); /* the unpinned chain, from its tail */
        mgr_remove(m, v);
    }
    ck_assert_int_eq(mgr_victim(m, true), -1);
    for (int i = 0; i < 10; i++)
        mgr_pin(m, i, -1);
    ck_assert_int_eq(mgr_victim(m, true), 9);
    while (m->count)
        mgr_remove(m, mgr_victim(m, true));
    mgr_free(m);
}

/* 1,000,000 block operations (lookups, inserts, evictions, pins) on a tier of 50,000 blocks.
 * Not a timed assertion: an O(n) step anywhere would take minutes and hit the test timeout;
 * the bound checked is the work, through the number of operations that completed. Run
 * without and with key fingerprints (rule 5's ghost history). */
static inline void million_ops_of(const tkv_policy_ops *ops, bool keys)
{
    const int n = 400000;
    mgr *m = mgr_new(ops, n, 50000);
    m->keys = keys;
    uint64_t r = 42;
    /* chains of 1..64 blocks, each node's parent the previous one of its chain; 1 in 8 chains
     * branches off a random earlier block (shared prefixes) */
    int start = 0;
    while (start < n) {
        int len = 1 + (int)(rng_next(&r) % 64);
        int head_parent = start > 0 && rng_next(&r) % 8 == 0 ? (int)(rng_next(&r) % (uint64_t)start) : -1;
        for (int k = 0; k < len && start + k < n; k++)
            mgr_link(m, start + k, k == 0 ? head_parent : start + k - 1);
        start += len;
    }
    uint64_t ops_before = 0;
    while (m->lookups_blocks + ops_before < 1000000) {
        /* mostly recent chains, sometimes old ones: hits and misses */
        int last = (int)(rng_next(&r) % (uint64_t)n);
        uint64_t before = m->count;
        mgr_request(m, last, false);
        ops_before += before > m->count ? before - m->count : m->count - before;
        REQUIRE(m->count <= m->capacity, "capacity exceeded");
    }
    ck_assert_uint_gt(m->hits, 0);
    mgr_free(m);
}

/* ============================================================================================
 * Workloads
 * ========================================================================================== */

/* Conversations: a first turn of 2 blocks; half of them come back once, `gap_lo..gap_hi`
 * requests later, re-sending those 2 blocks and adding 2. Returns the fraction of looked-up
 * blocks hit. One request per step, a new conversation every step; deterministic. */
static inline double turns_hit_rate(const tkv_policy_ops *ops, int gap_lo, int gap_hi, bool keys)
{
    enum { kConvs = 12000, kCapacity = 400 };
    mgr *m = mgr_new(ops, 4 * kConvs, kCapacity);
    m->keys = keys;
    int *due_head = tkv_xcalloc(2 * kConvs + 1, sizeof(int));
    int *due_next = tkv_xcalloc(kConvs, sizeof(int));
    for (int q = 0; q <= 2 * kConvs; q++)
        due_head[q] = -1;
    uint64_t r = 11;
    for (int c = 0; c < kConvs; c++) {
        int b = 4 * c;
        mgr_link(m, b, -1);
        mgr_link(m, b + 1, b);
        mgr_link(m, b + 2, b + 1);
        mgr_link(m, b + 3, b + 2);
        if (rng_next(&r) % 2 == 0) {
            int when = c + gap_lo + (int)(rng_next(&r) % (uint64_t)(gap_hi - gap_lo + 1));
            due_next[c] = due_head[when];
            due_head[when] = c;
        }
    }
    for (int q = 0; q < kConvs; q++) {
        mgr_request(m, 4 * q + 1, false); /* first turn of conversation q */
        for (int c = due_head[q]; c >= 0; c = due_next[c])
            mgr_request(m, 4 * c + 3, false); /* second turn of conversation c */
    }
    double rate = (double)m->hits / (double)m->lookups_blocks;
    free(due_head);
    free(due_next);
    mgr_free(m);
    return rate;
}

/* Rule 4. Conversations of two turns: a first turn of 8 blocks, and 500..1,500 requests later
 * a second turn that re-sends the first 7 of them and adds 4, never continued. The last block
 * of every first turn and the blocks of every second turn are never hit again; the tier (12
 * blocks turned over per request) remembers ~1,000 requests. The policy learns that the last
 * block of a put earns nothing and strips it from first turns still waiting for their second
 * turn, before their live blocks go; LRU evicts each first turn whole, from its end. Returns
 * the share of cached waiting first turns that still hold their dead last block.
 * Measured: lru 1.00, tierkv 0.10 (1.00 without rule 4). With unit > 1 each of those blocks
 * is `unit` chained blocks of the tier (a client's block over smaller store blocks: the dead
 * end is then `unit` blocks), and the tier is `unit` times larger. */
static inline double ends_kept(const tkv_policy_ops *ops, int unit, uint64_t *hits)
{
    enum { kConvs = 20000, kGapMin = 500, kGapSpan = 1000 };
    const int kPer = 12 * unit;
    mgr *m = mgr_new(ops, kConvs * kPer, 12000 * (uint64_t)unit);
    m->keys = unit > 1; /* the store gives fingerprints; hazard learns the unit from them */
    int *due_head = tkv_xmalloc(sizeof(int) * (kConvs + kGapMin + kGapSpan));
    int *due_next = tkv_xmalloc(sizeof(int) * kConvs);
    int *turn2_at = tkv_xmalloc(sizeof(int) * kConvs);
    for (int i = 0; i < kConvs + kGapMin + kGapSpan; i++)
        due_head[i] = -1;
    uint64_t r = 11;
    for (int c = 0; c < kConvs; c++) {
        for (int k = 0; k < 8 * unit; k++)
            mgr_link(m, c * kPer + k, k == 0 ? -1 : c * kPer + k - 1);
        for (int k = 0; k < 4 * unit; k++)
            mgr_link(m, c * kPer + 8 * unit + k,
                     k == 0 ? c * kPer + 7 * unit - 1 : c * kPer + 8 * unit + k - 1);
        turn2_at[c] = c + kGapMin + (int)(rng_next(&r) % kGapSpan);
        due_next[c] = due_head[turn2_at[c]];
        due_head[turn2_at[c]] = c;
    }
    for (int q = 0; q < kConvs; q++) {
        mgr_request(m, q * kPer + 8 * unit - 1, false);
        for (int c = due_head[q]; c >= 0; c = due_next[c])
            mgr_request(m, c * kPer + 12 * unit - 1, false);
    }
    /* cached first turns whose second turn is still due */
    uint64_t waiting = 0, with_end = 0;
    for (int c = 0; c < kConvs; c++) {
        if (turn2_at[c] < kConvs || !m->nodes[c * kPer].present)
            continue;
        waiting++;
        if (m->nodes[c * kPer + 7 * unit].present)
            with_end++;
    }
    *hits = m->hits;
    free(due_head);
    free(due_next);
    free(turn2_at);
    mgr_free(m);
    REQUIRE(waiting > 100, "only %llu first turns cached", (unsigned long long)waiting);
    return (double)with_end / (double)waiting;
}


/* Conversations of up to kTurns turns: each turn re-sends the previous one and adds 2 blocks,
 * and is followed by another with probability 1/2, gap_lo..gap_hi requests later; a new
 * conversation every step, the tier (400 blocks) turning over ~100 requests. */
static inline double convs_hit_rate(const tkv_policy_ops *ops, bool keys, int gap_lo, int gap_hi)
{
    enum { kConvs = 12000, kTurns = 4, kCapacity = 400, kSteps = kConvs + kTurns * 1000 };
    mgr *m = mgr_new(ops, 2 * kTurns * kConvs, kCapacity);
    m->keys = keys;
    int *due_head = tkv_xcalloc(kSteps, sizeof(int));
    int *due_next = tkv_xcalloc(kConvs, sizeof(int));
    int *turn = tkv_xcalloc(kConvs, sizeof(int));
    for (int q = 0; q < kSteps; q++)
        due_head[q] = -1;
    for (int c = 0; c < kConvs; c++)
        for (int k = 0; k < 2 * kTurns; k++)
            mgr_link(m, 2 * kTurns * c + k, k == 0 ? -1 : 2 * kTurns * c + k - 1);
    uint64_t r = 5;
    for (int q = 0; q < kSteps; q++) {
        if (q < kConvs) { /* a new conversation */
            due_next[q] = due_head[q];
            due_head[q] = q;
        }
        int c = due_head[q];
        due_head[q] = -1;
        while (c >= 0) {
            int next = due_next[c];
            mgr_request(m, 2 * kTurns * c + 2 * turn[c] + 1, false);
            if (++turn[c] < kTurns && rng_next(&r) % 2 == 0) {
                int when = q + gap_lo + (int)(rng_next(&r) % (uint64_t)(gap_hi - gap_lo + 1));
                if (when < kSteps) {
                    due_next[c] = due_head[when];
                    due_head[when] = c;
                }
            }
            c = next;
        }
    }
    double rate = (double)m->hits / (double)m->lookups_blocks;
    free(due_head);
    free(due_next);
    free(turn);
    mgr_free(m);
    return rate;
}

/* 20 shared documents of 12 blocks each, each asked about again every ~160 requests on average
 * (about twice the cache's LRU horizon of ~85 requests), interleaved with one-off prompts of 20
 * private blocks; the 2-block question after a document is not re-sent by the next request.
 * The cache holds 1,500 blocks: LRU loses a document whenever its gap exceeds the horizon;
 * tierkv keeps documents that keep coming back longer and drops the dead question suffixes
 * first. Deterministic (fixed seed). */
static inline double synthetic_hit_rate(const tkv_policy_ops *ops)
{
    enum { kDocs = 20, kDocBlocks = 12, kOneOff = 20, kRequests = 6000 };
    const int n = kDocs * kDocBlocks + kRequests * (kOneOff + 2);
    mgr *m = mgr_new(ops, n, 1500);
    for (int d = 0; d < kDocs; d++)
        for (int k = 0; k < kDocBlocks; k++)
            mgr_link(m, d * kDocBlocks + k, k == 0 ? -1 : d * kDocBlocks + k - 1);
    int next = kDocs * kDocBlocks;
    uint64_t r = 7;
    for (int q = 0; q < kRequests; q++) {
        if (rng_next(&r) % 8 == 0) {
            /* a question about a document: the document, then 2 private blocks */
            int d = (int)(rng_next(&r) % kDocs);
            mgr_link(m, next, d * kDocBlocks + kDocBlocks - 1);
            mgr_link(m, next + 1, next);
            mgr_request(m, next + 1, true);
            next += 2;
        } else {
            for (int k = 0; k < kOneOff; k++)
                mgr_link(m, next + k, k == 0 ? -1 : next + k - 1);
            mgr_request(m, next + kOneOff - 1, false);
            next += kOneOff;
        }
    }
    double rate = (double)m->hits / (double)m->lookups_blocks;
    mgr_free(m);
    return rate;
}

#endif
