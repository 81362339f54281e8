/* index.c - key -> entry table, chain structure, prefix probe, lease table (see tkv_index.h).
 *
 * The key table is open addressing with linear probing over {tag, entry} pairs, where tag is
 * the key's first 8 bytes (the keys are SHA-256 outputs, so those bytes are already uniform).
 * A probe compares tags before touching an entry, so a miss costs one cache line; deletion
 * shifts the run back (no tombstones), so lookups never slow down with churn.
 */
#include "tkv_index.h"

#include "tkv_base.h"

#include <stdlib.h>
#include <string.h>

typedef struct slot {
    uint64_t tag;
    tkv_entry *e;   /* NULL = empty */
} slot;

struct tkv_index {
    slot *slots;
    uint64_t mask;         /* capacity - 1 (capacity a power of two) */
    uint64_t count;
    tkv_entry **orphans;   /* chained by orphan_next, bucketed by parent key */
    uint64_t omask;
    uint64_t num_orphans;
};

static uint64_t key_tag(const tkv_key *k)
{
    uint64_t t;
    memcpy(&t, k->b, sizeof(t));
    return t;
}

static bool key_eq(const tkv_key *a, const tkv_key *b) { return memcmp(a, b, sizeof(*a)) == 0; }

static bool key_zero(const tkv_key *k)
{
    static const tkv_key zero;
    return key_eq(k, &zero);
}

static uint64_t pow2_at_least(uint64_t n)
{
    uint64_t c = 16;
    while (c < n)
        c <<= 1;
    return c;
}

tkv_index *tkv_index_new(uint64_t expected_entries)
{
    tkv_index *ix = tkv_xcalloc(1, sizeof(*ix));
    uint64_t cap = pow2_at_least(expected_entries * 2);
    ix->slots = tkv_xcalloc(cap, sizeof(slot));
    ix->mask = cap - 1;
    ix->orphans = tkv_xcalloc(16, sizeof(tkv_entry *));
    ix->omask = 15;
    return ix;
}

void tkv_index_free(tkv_index *ix)
{
    if (!ix)
        return;
    for (uint64_t i = 0; i <= ix->mask; i++)
        if (ix->slots[i].e)
            tkv_entry_free(ix->slots[i].e);
    free(ix->slots);
    free(ix->orphans);
    free(ix);
}

tkv_entry *tkv_entry_new(const tkv_key *key, const tkv_key *parent_key, uint32_t depth)
{
    tkv_entry *e = tkv_xcalloc(1, sizeof(*e));
    e->key = *key;
    if (parent_key)
        e->parent_key = *parent_key;
    e->depth = depth;
    e->l2_slot = UINT64_MAX;
    e->l1_slot = UINT64_MAX;
    return e;
}

void tkv_entry_free(tkv_entry *e)
{
    if (!e)
        return;
    free(e->tokens);
    free(e);
}

/* ---- key table ------------------------------------------------------------------------------ */

tkv_entry *tkv_index_find(const tkv_index *ix, const tkv_key *key)
{
    uint64_t tag = key_tag(key);
    for (uint64_t i = tag & ix->mask;; i = (i + 1) & ix->mask) {
        const slot *s = &ix->slots[i];
        if (!s->e)
            return NULL;
        if (s->tag == tag && key_eq(&s->e->key, key))
            return s->e;
    }
}

static void table_put(slot *slots, uint64_t mask, tkv_entry *e)
{
    uint64_t tag = key_tag(&e->key);
    uint64_t i = tag & mask;
    while (slots[i].e)
        i = (i + 1) & mask;
    slots[i].tag = tag;
    slots[i].e = e;
}

static void table_grow(tkv_index *ix)
{
    uint64_t cap = (ix->mask + 1) * 2;
    slot *ns = tkv_xcalloc(cap, sizeof(slot));
    for (uint64_t i = 0; i <= ix->mask; i++)
        if (ix->slots[i].e)
            table_put(ns, cap - 1, ix->slots[i].e);
    free(ix->slots);
    ix->slots = ns;
    ix->mask = cap - 1;
}

static void table_del(tkv_index *ix, tkv_entry *e)
{
    uint64_t tag = key_tag(&e->key);
    uint64_t i = tag & ix->mask;
    while (ix->slots[i].e != e) {
        TKV_ASSERT(ix->slots[i].e != NULL);
        i = (i + 1) & ix->mask;
    }
    /* Backward-shift deletion: move later members of the run into the hole when their home
     * slot is not between the hole and them. */
    uint64_t hole = i;
    for (uint64_t j = (i + 1) & ix->mask; ix->slots[j].e; j = (j + 1) & ix->mask) {
        uint64_t home = ix->slots[j].tag & ix->mask;
        bool home_in_gap = hole <= j ? (home > hole && home <= j) : (home > hole || home <= j);
        if (!home_in_gap) {
            ix->slots[hole] = ix->slots[j];
            hole = j;
        }
    }
    ix->slots[hole].e = NULL;
    ix->slots[hole].tag = 0;
}

/* ---- chain structure ------------------------------------------------------------------------- */

static void orphan_grow(tkv_index *ix)
{
    uint64_t cap = (ix->omask + 1) * 2;
    tkv_entry **nb = tkv_xcalloc(cap, sizeof(tkv_entry *));
    for (uint64_t i = 0; i <= ix->omask; i++) {
        tkv_entry *e = ix->orphans[i];
        while (e) {
            tkv_entry *next = e->orphan_next;
            uint64_t b = key_tag(&e->parent_key) & (cap - 1);
            e->orphan_next = nb[b];
            nb[b] = e;
            e = next;
        }
    }
    free(ix->orphans);
    ix->orphans = nb;
    ix->omask = cap - 1;
}

static void orphan_add(tkv_index *ix, tkv_entry *e)
{
    if (key_zero(&e->parent_key))
        return; /* block 0 of a chain: its parent is the root, never indexed */
    if (ix->num_orphans + 1 > ix->omask + 1)
        orphan_grow(ix);
    uint64_t b = key_tag(&e->parent_key) & ix->omask;
    e->orphan_next = ix->orphans[b];
    ix->orphans[b] = e;
    ix->num_orphans++;
}

static void orphan_del(tkv_index *ix, tkv_entry *e)
{
    if (key_zero(&e->parent_key))
        return;
    tkv_entry **pp = &ix->orphans[key_tag(&e->parent_key) & ix->omask];
    while (*pp != e) {
        TKV_ASSERT(*pp != NULL);
        pp = &(*pp)->orphan_next;
    }
    *pp = e->orphan_next;
    e->orphan_next = NULL;
    ix->num_orphans--;
}

static void child_link(tkv_entry *parent, tkv_entry *c)
{
    c->parent = parent;
    c->depth = parent->depth + 1;
    c->prev_sibling = NULL;
    c->next_sibling = parent->first_child;
    if (parent->first_child)
        parent->first_child->prev_sibling = c;
    parent->first_child = c;
}

static void child_unlink(tkv_entry *c)
{
    if (c->prev_sibling)
        c->prev_sibling->next_sibling = c->next_sibling;
    else
        c->parent->first_child = c->next_sibling;
    if (c->next_sibling)
        c->next_sibling->prev_sibling = c->prev_sibling;
    c->parent = c->prev_sibling = c->next_sibling = NULL;
}

int tkv_index_insert(tkv_index *ix, tkv_entry *e)
{
    if (tkv_index_find(ix, &e->key))
        return TKV_EEXIST;
    if ((ix->count + 1) * 2 > ix->mask + 1)
        table_grow(ix);
    table_put(ix->slots, ix->mask, e);
    ix->count++;
    e->linked = 1;

    tkv_entry *p = key_zero(&e->parent_key) ? NULL : tkv_index_find(ix, &e->parent_key);
    if (p && p != e)
        child_link(p, e);
    else
        orphan_add(ix, e);

    /* Adopt entries that were waiting for this key. */
    tkv_entry **pp = &ix->orphans[key_tag(&e->key) & ix->omask];
    while (*pp) {
        tkv_entry *c = *pp;
        if (c != e && key_eq(&c->parent_key, &e->key)) {
            *pp = c->orphan_next;
            c->orphan_next = NULL;
            ix->num_orphans--;
            child_link(e, c);
        } else {
            pp = &c->orphan_next;
        }
    }
    return TKV_OK;
}

void tkv_index_remove(tkv_index *ix, tkv_entry *e)
{
    TKV_ASSERT(e->linked);
    table_del(ix, e);
    ix->count--;
    e->linked = 0;
    if (e->parent)
        child_unlink(e);
    else
        orphan_del(ix, e);
    while (e->first_child) {
        tkv_entry *c = e->first_child;
        child_unlink(c);
        orphan_add(ix, c);
    }
}

uint64_t tkv_index_count(const tkv_index *ix) { return ix->count; }

size_t tkv_index_prefix(const tkv_index *ix, const tkv_key *keys, size_t n, tkv_entry **out)
{
    size_t i = 0;
    for (; i < n; i++) {
        tkv_entry *e = tkv_index_find(ix, &keys[i]);
        if (!e)
            break;
        out[i] = e;
    }
    return i;
}

int tkv_index_foreach(const tkv_index *ix, int (*cb)(void *arg, tkv_entry *e), void *arg)
{
    for (uint64_t i = 0; i <= ix->mask; i++) {
        if (!ix->slots[i].e)
            continue;
        int r = cb(arg, ix->slots[i].e);
        if (r)
            return r;
    }
    return 0;
}

/* ============================================================================================
 * Lease table: chained hash on the id
 * ========================================================================================== */

struct tkv_lease_table {
    tkv_lease **buckets;
    uint64_t mask;
    uint64_t num_records, num_live;
    uint64_t next_id;
};

tkv_lease_table *tkv_lease_table_new(void)
{
    tkv_lease_table *t = tkv_xcalloc(1, sizeof(*t));
    t->buckets = tkv_xcalloc(64, sizeof(tkv_lease *));
    t->mask = 63;
    t->next_id = 1;
    return t;
}

static void lease_free(tkv_lease *l)
{
    free(l->entries);
    free(l);
}

void tkv_lease_table_free(tkv_lease_table *t)
{
    if (!t)
        return;
    for (uint64_t i = 0; i <= t->mask; i++) {
        tkv_lease *l = t->buckets[i];
        while (l) {
            tkv_lease *next = l->next;
            lease_free(l);
            l = next;
        }
    }
    free(t->buckets);
    free(t);
}

/* ids are sequential, so a multiplicative hash spreads them over the buckets */
static uint64_t id_bucket(const tkv_lease_table *t, uint64_t id)
{
    return (id * 0x9E3779B97F4A7C15ull >> 20) & t->mask;
}

static void lease_grow(tkv_lease_table *t)
{
    uint64_t old_cap = t->mask + 1;
    tkv_lease **old = t->buckets;
    t->mask = old_cap * 2 - 1;
    t->buckets = tkv_xcalloc(old_cap * 2, sizeof(tkv_lease *));
    for (uint64_t i = 0; i < old_cap; i++) {
        tkv_lease *l = old[i];
        while (l) {
            tkv_lease *next = l->next;
            uint64_t b = id_bucket(t, l->id);
            l->next = t->buckets[b];
            t->buckets[b] = l;
            l = next;
        }
    }
    free(old);
}

tkv_lease *tkv_lease_add(tkv_lease_table *t, uint64_t owner, uint64_t deadline_ns,
                         tkv_entry *const *entries, size_t n)
{
    if (t->num_records + 1 > (t->mask + 1) * 2)
        lease_grow(t);
    tkv_lease *l = tkv_xcalloc(1, sizeof(*l));
    l->id = t->next_id++;
    l->owner = owner;
    l->deadline_ns = deadline_ns;
    l->num_entries = n;
    l->entries = tkv_xmalloc((n ? n : 1) * sizeof(tkv_entry *));
    if (n)
        memcpy(l->entries, entries, n * sizeof(tkv_entry *));
    uint64_t b = id_bucket(t, l->id);
    l->next = t->buckets[b];
    t->buckets[b] = l;
    t->num_records++;
    t->num_live++;
    return l;
}

tkv_lease *tkv_lease_get(tkv_lease_table *t, uint64_t id)
{
    for (tkv_lease *l = t->buckets[id_bucket(t, id)]; l; l = l->next)
        if (l->id == id)
            return l;
    return NULL;
}

void tkv_lease_del(tkv_lease_table *t, tkv_lease *l)
{
    tkv_lease **pp = &t->buckets[id_bucket(t, l->id)];
    while (*pp != l) {
        TKV_ASSERT(*pp != NULL);
        pp = &(*pp)->next;
    }
    *pp = l->next;
    t->num_records--;
    if (!l->expired_at_ns)
        t->num_live--;
    lease_free(l);
}

uint64_t tkv_lease_count(const tkv_lease_table *t) { return t->num_live; }

void tkv_lease_foreach(tkv_lease_table *t, void (*cb)(void *arg, tkv_lease *l), void *arg)
{
    for (uint64_t i = 0; i <= t->mask; i++) {
        tkv_lease *l = t->buckets[i];
        while (l) {
            tkv_lease *next = l->next; /* cb may delete l */
            cb(arg, l);
            l = next;
        }
    }
}

void tkv_lease_mark_expired(tkv_lease_table *t, tkv_lease *l, uint64_t now_ns)
{
    if (l->expired_at_ns)
        return;
    l->expired_at_ns = now_ns ? now_ns : 1;
    free(l->entries);
    l->entries = NULL;
    l->num_entries = 0;
    t->num_live--;
}
