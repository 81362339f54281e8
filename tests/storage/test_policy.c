/* test_policy.c - the contract of tkv_policy.h, checked over EVERY registered policy, with a
 * small tier manager that keeps the structural fields the way storage/store.c does:
 *   - victim() never returns a pinned entry, and returns NULL only when all are pinned;
 *   - victim() returns an entry with cached children only when no unpinned tail exists;
 *   - a manager evicting victim() until it fits never exceeds the capacity.
 * The manager gives every block a key fingerprint (tkv_policy_entry.key_fp), the same each
 * time the block enters, so policies that remember departed blocks are exercised too.
 * Plus LRU's own order. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_base.h"
#include "tkv_policy.h"

typedef struct node {
    tkv_policy_entry pe;  /* first member: victim() pointers map back to nodes */
    int parent;           /* index, -1 for a chain head */
    bool present;
} node;

typedef struct harness {
    const tkv_policy_ops *ops;
    void *st;
    node *nodes;
    int n;
    uint64_t clock;
    uint64_t count;
} harness;

static void h_changed(harness *h, int i) { h->ops->changed(h->st, &h->nodes[i].pe); }

/* Enters node i into the tier (its parent, if present, gains a child). */
static bool h_insert(harness *h, int i)
{
    node *x = &h->nodes[i];
    memset(&x->pe, 0, sizeof(x->pe));
    x->pe.key_fp = ((uint64_t)i + 1) * 0x9e3779b97f4a7c15ull | 1;
    int p = x->parent;
    x->pe.parent = p >= 0 && h->nodes[p].present ? &h->nodes[p].pe : NULL;
    x->pe.depth = p >= 0 ? h->nodes[p].pe.depth + 1 : 0;
    for (int c = 0; c < h->n; c++)
        if (h->nodes[c].present && h->nodes[c].parent == i)
            x->pe.num_children++;
    if (!h->ops->admit(h->st, &x->pe, ++h->clock))
        return false;
    x->present = true;
    h->ops->inserted(h->st, &x->pe, ++h->clock);
    if (x->pe.parent) {
        h->nodes[p].pe.num_children++;
        h_changed(h, p);
    }
    for (int c = 0; c < h->n; c++) {
        if (h->nodes[c].present && h->nodes[c].parent == i) {
            h->nodes[c].pe.parent = &x->pe;
            h_changed(h, c);
        }
    }
    h->count++;
    return true;
}

static void h_remove(harness *h, int i)
{
    node *x = &h->nodes[i];
    ck_assert(x->present);
    h->ops->removed(h->st, &x->pe);
    x->present = false;
    if (x->pe.parent) {
        node *p = (node *)x->pe.parent;
        p->pe.num_children--;
        h_changed(h, (int)(p - h->nodes));
    }
    for (int c = 0; c < h->n; c++) {
        if (h->nodes[c].present && h->nodes[c].parent == i) {
            h->nodes[c].pe.parent = NULL;
            h_changed(h, c);
        }
    }
    h->count--;
}

static void h_pin(harness *h, int i, int delta)
{
    h->nodes[i].pe.pinned = (uint32_t)((int)h->nodes[i].pe.pinned + delta);
    h_changed(h, i);
}

static bool unpinned_tail_exists(harness *h)
{
    for (int i = 0; i < h->n; i++)
        if (h->nodes[i].present && !h->nodes[i].pe.pinned && !h->nodes[i].pe.num_children)
            return true;
    return false;
}

static bool unpinned_exists(harness *h)
{
    for (int i = 0; i < h->n; i++)
        if (h->nodes[i].present && !h->nodes[i].pe.pinned)
            return true;
    return false;
}

/* Checks one victim() answer against the contract; returns its node index or -1. */
static int checked_victim(harness *h)
{
    tkv_policy_entry *v = h->ops->victim(h->st);
    if (!v) {
        ck_assert_msg(!unpinned_exists(h), "%s: victim() is NULL with unpinned entries",
                      h->ops->name);
        return -1;
    }
    node *x = (node *)v;
    int i = (int)(x - h->nodes);
    ck_assert_msg(i >= 0 && i < h->n && x->present, "%s: victim not in the tier", h->ops->name);
    ck_assert_msg(x->pe.pinned == 0, "%s: returned a pinned entry", h->ops->name);
    if (x->pe.num_children)
        ck_assert_msg(!unpinned_tail_exists(h), "%s: returned a parent while a tail was free",
                      h->ops->name);
    return i;
}

/* A forest: chains of random length, some branching off earlier blocks. */
static harness *h_new(const tkv_policy_ops *ops, int n, uint64_t capacity, unsigned seed)
{
    harness *h = calloc(1, sizeof(*h));
    h->ops = ops;
    h->st = ops->create(capacity);
    ck_assert_ptr_nonnull(h->st);
    h->n = n;
    h->nodes = calloc((size_t)n, sizeof(node));
    for (int i = 0; i < n; i++) {
        seed = seed * 1103515245u + 12345u;
        int r = (int)((seed >> 16) % 10);
        h->nodes[i].parent = i == 0 || r == 0 ? -1 : r == 1 ? (int)((seed >> 8) % (unsigned)i) : i - 1;
    }
    return h;
}

static void h_free(harness *h)
{
    h->ops->destroy(h->st);
    free(h->nodes);
    free(h);
}

START_TEST(registry)
{
    const tkv_policy_ops *const *all = tkv_policy_all();
    ck_assert_ptr_nonnull(all[0]);
    ck_assert_ptr_eq(tkv_policy_find("lru"), &tkv_policy_lru);
    ck_assert_ptr_null(tkv_policy_find("no-such-policy"));
    ck_assert_ptr_null(tkv_policy_find(NULL));
    for (int i = 0; all[i]; i++) {
        ck_assert_ptr_eq(tkv_policy_find(all[i]->name), all[i]);
        ck_assert(all[i]->create && all[i]->destroy && all[i]->admit && all[i]->inserted &&
                  all[i]->accessed && all[i]->removed && all[i]->changed && all[i]->victim);
        ck_assert_ptr_null(all[i]->create(0)); /* a zero-capacity tier is a bad config */
    }
}
END_TEST

/* _i: index into the registry. */
START_TEST(contract_drain_with_pins)
{
    const tkv_policy_ops *ops = tkv_policy_all()[_i];
    for (unsigned seed = 1; seed <= 5; seed++) {
        harness *h = h_new(ops, 300, 1000, seed);
        for (int i = 0; i < h->n; i++)
            h_insert(h, i);
        /* Pin like leases do (a node and all its ancestors), and a few lone pins. */
        unsigned r = seed * 7919u;
        for (int k = 0; k < 20; k++) {
            r = r * 1103515245u + 12345u;
            int i = (int)((r >> 16) % (unsigned)h->n);
            if (!h->nodes[i].present)
                continue;
            if (k % 4 == 0) {
                h_pin(h, i, +1);
                continue;
            }
            for (int j = i; j >= 0 && h->nodes[j].present; j = h->nodes[j].parent)
                h_pin(h, j, +1);
        }
        /* Touch some entries so recency differs. */
        for (int k = 0; k < 100; k++) {
            r = r * 1103515245u + 12345u;
            int i = (int)((r >> 16) % (unsigned)h->n);
            if (h->nodes[i].present)
                ops->accessed(h->st, &h->nodes[i].pe, ++h->clock);
        }
        /* Drain: every answer obeys the contract; what remains is exactly the pinned set. */
        int v;
        while ((v = checked_victim(h)) >= 0)
            h_remove(h, v);
        for (int i = 0; i < h->n; i++)
            if (h->nodes[i].present)
                ck_assert(h->nodes[i].pe.pinned);
        /* Unpin everything: the rest drains too, tails first. */
        for (int i = 0; i < h->n; i++)
            if (h->nodes[i].present)
                while (h->nodes[i].pe.pinned)
                    h_pin(h, i, -1);
        while ((v = checked_victim(h)) >= 0)
            h_remove(h, v);
        ck_assert_uint_eq(h->count, 0);
        h_free(h);
    }
}
END_TEST

START_TEST(contract_all_pinned_gives_null)
{
    const tkv_policy_ops *ops = tkv_policy_all()[_i];
    harness *h = h_new(ops, 50, 100, 3);
    for (int i = 0; i < h->n; i++)
        h_insert(h, i);
    for (int i = 0; i < h->n; i++)
        if (h->nodes[i].present)
            h_pin(h, i, +1);
    ck_assert_ptr_null(ops->victim(h->st));
    int last = -1;
    for (int i = 0; i < h->n; i++)
        if (h->nodes[i].present)
            last = i;
    ck_assert_int_ge(last, 0);
    h_pin(h, last, -1); /* exactly one unpinned: it must be the victim */
    ck_assert_ptr_eq(ops->victim(h->st), &h->nodes[last].pe);
    for (int i = 0; i < h->n; i++)
        if (h->nodes[i].present)
            h->nodes[i].pe.pinned = 0, h_changed(h, i);
    h_free(h);
}
END_TEST

START_TEST(contract_capacity)
{
    const tkv_policy_ops *ops = tkv_policy_all()[_i];
    const uint64_t cap = 16;
    harness *h = h_new(ops, 400, cap, 11);
    /* two passes: in the second, blocks evicted in the first come back */
    for (int k = 0; k < 2 * h->n; k++) {
        int i = k % h->n;
        if (h->nodes[i].present)
            continue;
        h_insert(h, i);
        while (h->count > cap) {
            int v = checked_victim(h);
            ck_assert_int_ge(v, 0); /* nothing is pinned: there is always a victim */
            h_remove(h, v);
        }
        ck_assert_uint_le(h->count, cap);
    }
    int v;
    while ((v = checked_victim(h)) >= 0)
        h_remove(h, v);
    h_free(h);
}
END_TEST

/* An unlimited tier (an L3 without a byte limit: capacity UINT64_MAX) takes blocks and lets
 * them go, fingerprints and all: no policy sizes a table by that capacity (the ghost
 * histories are bounded, tkv_policy_ghost_sets). */
START_TEST(contract_unlimited_tier)
{
    const tkv_policy_ops *ops = tkv_policy_all()[_i];
    harness *h = h_new(ops, 200, UINT64_MAX, 5);
    for (int i = 0; i < h->n; i++)
        h_insert(h, i);
    int v;
    while ((v = checked_victim(h)) >= 0)
        h_remove(h, v);
    ck_assert_uint_eq(h->count, 0);
    for (int i = 0; i < h->n; i += 2) /* back from the ghost history */
        h_insert(h, i);
    h_free(h);
}
END_TEST

START_TEST(lru_order)
{
    harness *h = h_new(&tkv_policy_lru, 6, 100, 1);
    for (int i = 0; i < 6; i++)
        h->nodes[i].parent = -1; /* six independent blocks */
    for (int i = 0; i < 6; i++)
        h_insert(h, i);
    tkv_policy_lru.accessed(h->st, &h->nodes[0].pe, ++h->clock);
    tkv_policy_lru.accessed(h->st, &h->nodes[2].pe, ++h->clock);
    int expect[6] = {1, 3, 4, 5, 0, 2};
    for (int k = 0; k < 6; k++) {
        int v = checked_victim(h);
        ck_assert_int_eq(v, expect[k]);
        h_remove(h, v);
    }
    /* A chain is evicted tail first even though a lookup touched its head last. */
    harness *c = h_new(&tkv_policy_lru, 5, 100, 1);
    for (int i = 0; i < 5; i++)
        c->nodes[i].parent = i - 1;
    for (int i = 0; i < 5; i++)
        h_insert(c, i);
    for (int i = 4; i >= 0; i--)
        tkv_policy_lru.accessed(c->st, &c->nodes[i].pe, ++c->clock);
    for (int k = 4; k >= 0; k--) {
        ck_assert_int_eq(checked_victim(c), k);
        h_remove(c, k);
    }
    h_free(h);
    h_free(c);
}
END_TEST

int main(void)
{
    int np = 0;
    while (tkv_policy_all()[np])
        np++;
    Suite *s = suite_create("policy");
    TCase *tc = tcase_create("policy");
    tcase_add_test(tc, registry);
    tcase_add_loop_test(tc, contract_drain_with_pins, 0, np);
    tcase_add_loop_test(tc, contract_all_pinned_gives_null, 0, np);
    tcase_add_loop_test(tc, contract_capacity, 0, np);
    tcase_add_loop_test(tc, contract_unlimited_tier, 0, np);
    tcase_add_test(tc, lru_order);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
