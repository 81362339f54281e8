/* policy.c - the policy registry and the LRU policy (see tkv_policy.h).
 *
 * To register a policy, add its ops to `registry` below (one line) and declare it in
 * tkv_policy.h. tkv_policy_find() and the contract tests (tests/storage/test_policy.c) pick it
 * up from there.
 */
#include "tkv_policy.h"

#include "tkv_base.h"

#include <stdlib.h>
#include <string.h>

static const tkv_policy_ops *const registry[] = {
    &tkv_policy_lru,
    &tkv_policy_hazard,
    NULL,
};

const tkv_policy_ops *tkv_policy_find(const char *name)
{
    if (!name)
        return NULL;
    for (size_t i = 0; registry[i]; i++)
        if (strcmp(registry[i]->name, name) == 0)
            return registry[i];
    return NULL;
}

const tkv_policy_ops *const *tkv_policy_all(void) { return registry; }

/* ============================================================================================
 * LRU, tails first
 *
 * Three lists, each in recency order (head = hottest, tail = coldest):
 *   TAILS    unpinned entries without cached children: the victims, coldest first;
 *   INTERIOR unpinned entries with cached children: victims only when TAILS is empty;
 *   PINNED   never victims.
 * victim() is O(1): the cold end of TAILS, else of INTERIOR. A single recency list would be
 * O(chain) per victim: a lookup touches a chain root-first, which leaves the root coldest and
 * the tail hottest, so a scan for the coldest tail would walk the whole chain.
 *
 * Position when an entry changes list: one that becomes a tail because its last child left is
 * placed at the cold end (a lookup that hits a child also hits its parent, so the parent is
 * about as cold as the child that was just evicted); one that becomes unpinned was in use a
 * moment ago and goes to the hot end. p_u64[0] = last access ns, p_u64[1] = current list.
 * ========================================================================================== */

enum { LRU_TAILS = 0, LRU_INTERIOR = 1, LRU_PINNED = 2, LRU_NUM_LISTS = 3 };

typedef struct lru_state {
    uint64_t capacity;
    tkv_policy_entry lists[LRU_NUM_LISTS]; /* sentinels: next = hottest, prev = coldest */
} lru_state;


static void list_push_cold(tkv_policy_entry *head, tkv_policy_entry *e)
{
    e->prev = head->prev;
    e->next = head;
    head->prev->next = e;
    head->prev = e;
}

static int lru_class(const tkv_policy_entry *e)
{
    if (e->pinned)
        return LRU_PINNED;
    return e->num_children ? LRU_INTERIOR : LRU_TAILS;
}

static void *lru_create(uint64_t capacity)
{
    if (capacity == 0)
        return NULL;
    lru_state *st = tkv_xcalloc(1, sizeof(*st));
    st->capacity = capacity;
    for (int i = 0; i < LRU_NUM_LISTS; i++)
        tkv_plist_init(&st->lists[i]);
    return st;
}

static void lru_destroy(void *state) { free(state); }

static bool lru_admit(void *state, const tkv_policy_entry *e, uint64_t now_ns)
{
    return true; /* LRU caches everything; the manager evicts to make room */
}

static void lru_inserted(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    lru_state *st = state;
    int c = lru_class(e);
    e->p_u64[0] = now_ns;
    e->p_u64[1] = (uint64_t)c;
    tkv_plist_push_hot(&st->lists[c], e);
}

static void lru_accessed(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    lru_state *st = state;
    e->p_u64[0] = now_ns;
    /* Order inside PINNED is irrelevant (never victims; they re-enter at the hot end when
     * unpinned), and a lookup pins before it touches: skip the relink there. */
    if (e->p_u64[1] == LRU_PINNED)
        return;
    tkv_plist_unlink(e);
    tkv_plist_push_hot(&st->lists[e->p_u64[1]], e);
}

static void lru_removed(void *state, tkv_policy_entry *e) { tkv_plist_unlink(e); }

static void lru_changed(void *state, tkv_policy_entry *e)
{
    lru_state *st = state;
    int old = (int)e->p_u64[1], c = lru_class(e);
    if (old == c)
        return;
    tkv_plist_unlink(e);
    e->p_u64[1] = (uint64_t)c;
    if (c == LRU_TAILS && old == LRU_INTERIOR)
        list_push_cold(&st->lists[c], e);
    else
        tkv_plist_push_hot(&st->lists[c], e);
}

static tkv_policy_entry *lru_victim(void *state)
{
    lru_state *st = state;
    for (int c = LRU_TAILS; c <= LRU_INTERIOR; c++) {
        tkv_policy_entry *head = &st->lists[c];
        if (head->prev != head)
            return head->prev;
    }
    return NULL;
}

const tkv_policy_ops tkv_policy_lru = {
    .name = "lru",
    .create = lru_create,
    .destroy = lru_destroy,
    .admit = lru_admit,
    .inserted = lru_inserted,
    .accessed = lru_accessed,
    .removed = lru_removed,
    .changed = lru_changed,
    .victim = lru_victim,
};
