/* policy_tierkv.c - "tierkv": the project's prefix-aware eviction policy (see tkv_policy.h).
 *
 * The idea (measurements, and the alternatives that lost: docs/design-policy.md):
 *
 *   1. Rank by recency plus earned life:
 *        priority(e) = last_access_tick(e) + bonus_ticks * level(e),  level = min(hits, kMaxLevel)
 *      and evict the unpinned chain tail of lowest priority. Every hit buys a block bonus_ticks
 *      more life, up to kMaxLevel hits: a prefix that keeps being hit survives gaps between its
 *      uses that are longer than the tier's LRU horizon. The cap is the aging: a block hit
 *      kMaxLevel times and then abandoned goes kMaxLevel * bonus_ticks after its last use.
 *   2. Dead suffixes go first: when a chain is extended in a new direction from a block P, the
 *      previous newest branch under P that was never hit is the abandoned end of an earlier
 *      request (typically a prompt's last, partial block, re-sent differently by the next
 *      turn). Its never-hit blocks are marked dead and are victims before anything else.
 *
 * Time is the policy's own logical clock, one tick per inserted() or accessed() call (per block
 * that entered or was hit in this tier), so parameters are fractions of the tier's turnover and
 * do not depend on the request rate: bonus_ticks = capacity * kBonusPerCapacity.
 *
 * Prefix structure: only tails (num_children == 0) are victims while an unpinned tail exists,
 * so a chain is eaten from its end and never loses a block its cached children need; interior
 * entries are victims only when no tail is left. A block that becomes a tail because its last
 * child left is placed by its own tick near the cold end (it was touched by the same lookups
 * as that child, just before it), so a dead suffix is evicted as a whole.
 *
 * O(1): one list per (class, level), each kept sorted by tick (inserts at the hot end; the
 * rare re-placement walks at most kMaxWalk entries); victim() compares the cold ends of the
 * kMaxLevel + 1 tail lists; marking a dead branch is paid once per block.
 *
 * Entry fields owned here:
 *   p_u64[0]  last access tick
 *   p_u64[1]  list index (bits 0-7) | F_DEAD | hits << 16
 *   p_u64[2]  the newest child inserted under this entry (a tkv_policy_entry *), or 0
 */
#include "tkv_policy.h"

#include "tkv_base.h"

#include <stdlib.h>

enum { kMaxLevel = 4 };                       /* hits beyond this earn nothing */
static const double kBonusPerCapacity = 0.5;  /* life per hit, in fills of the tier */
enum { kMaxWalk = 32 };                                   /* bound of a sorted re-placement */

enum { CLASS_TAIL = 0, CLASS_INTERIOR = 1, NUM_CLASSES = 2 };
#define NUM_LEVELS (kMaxLevel + 1)
#define LIST_DEAD (NUM_CLASSES * NUM_LEVELS)
#define LIST_PINNED (LIST_DEAD + 1)
#define NUM_LISTS (LIST_PINNED + 1)

#define F_LIST_MASK 0xffull
#define F_DEAD 0x100ull
#define HITS_SHIFT 16
#define HITS_MAX 0xffffffffull

typedef struct tierkv_state {
    uint64_t capacity;
    uint64_t bonus_ticks;
    uint64_t tick;
    /* sentinels: next = hottest, prev = coldest. [class * NUM_LEVELS + level], DEAD, PINNED */
    tkv_policy_entry lists[NUM_LISTS];
} tierkv_state;

/* ---- entry fields ------------------------------------------------------------------------- */
static uint64_t tick_of(const tkv_policy_entry *e) { return e->p_u64[0]; }
static unsigned list_idx(const tkv_policy_entry *e) { return (unsigned)(e->p_u64[1] & F_LIST_MASK); }
static bool is_dead(const tkv_policy_entry *e) { return (e->p_u64[1] & F_DEAD) != 0; }
static uint64_t hits_of(const tkv_policy_entry *e) { return e->p_u64[1] >> HITS_SHIFT; }

static void set_list(tkv_policy_entry *e, unsigned l)
{
    e->p_u64[1] = (e->p_u64[1] & ~F_LIST_MASK) | l;
}

static void set_hits(tkv_policy_entry *e, uint64_t h)
{
    if (h > HITS_MAX)
        h = HITS_MAX;
    e->p_u64[1] = (e->p_u64[1] & ((1ull << HITS_SHIFT) - 1)) | (h << HITS_SHIFT);
}

static tkv_policy_entry *newest_child(const tkv_policy_entry *e)
{
    return (tkv_policy_entry *)(uintptr_t)e->p_u64[2];
}

static unsigned level_of(const tkv_policy_entry *e)
{
    uint64_t h = hits_of(e);
    return h < kMaxLevel ? (unsigned)h : kMaxLevel;
}

static unsigned list_of(const tkv_policy_entry *e)
{
    if (e->pinned)
        return LIST_PINNED;
    if (e->num_children == 0 && is_dead(e))
        return LIST_DEAD;
    unsigned c = e->num_children ? CLASS_INTERIOR : CLASS_TAIL;
    return c * NUM_LEVELS + level_of(e);
}

static uint64_t priority(const tierkv_state *st, const tkv_policy_entry *e)
{
    return tick_of(e) + st->bonus_ticks * level_of(e);
}

/* ---- lists -------------------------------------------------------------------------------- */
static void list_init(tkv_policy_entry *head) { head->next = head->prev = head; }

static void list_unlink(tkv_policy_entry *e)
{
    e->prev->next = e->next;
    e->next->prev = e->prev;
    e->prev = e->next = NULL;
}

static void list_push_hot(tkv_policy_entry *head, tkv_policy_entry *e)
{
    e->next = head->next;
    e->prev = head;
    head->next->prev = e;
    head->next = e;
}

/* Puts e into `head` where its tick belongs, so every list stays sorted by tick (victim()
 * compares only cold ends). The walk starts at the end e is expected near and is bounded by
 * kMaxWalk; past that e takes the tick of the neighbour it stopped at (it loses or gains a
 * little recency, and the work stays O(1)). */
static void insert_sorted(tkv_policy_entry *head, tkv_policy_entry *e, bool from_cold)
{
    tkv_policy_entry *cur;
    unsigned steps = 0;
    if (from_cold) {
        for (cur = head->prev; cur != head && tick_of(cur) < tick_of(e); cur = cur->prev)
            if (++steps == kMaxWalk) {
                e->p_u64[0] = tick_of(cur);
                break;
            }
        e->next = cur->next; /* on the cold side of cur */
        e->prev = cur;
        cur->next->prev = e;
        cur->next = e;
    } else {
        for (cur = head->next; cur != head && tick_of(cur) > tick_of(e); cur = cur->next)
            if (++steps == kMaxWalk) {
                e->p_u64[0] = tick_of(cur);
                break;
            }
        e->next = cur; /* on the hot side of cur */
        e->prev = cur->prev;
        cur->prev->next = e;
        cur->prev = e;
    }
}

/* Re-files e after a change of class, level, pin or dead mark. */
static void refile(tierkv_state *st, tkv_policy_entry *e, bool from_cold)
{
    unsigned now = list_of(e);
    if (now == list_idx(e))
        return;
    list_unlink(e);
    set_list(e, now);
    if (now == LIST_DEAD || now == LIST_PINNED)
        list_push_hot(&st->lists[now], e); /* order does not matter there */
    else
        insert_sorted(&st->lists[now], e, from_cold);
}

/* Marks the never-hit branch that starts at c dead, following each block's newest child.
 * Each block is marked at most once, so the walk is paid for by the inserts that made it. */
static void mark_dead_branch(tierkv_state *st, tkv_policy_entry *c)
{
    while (c && !is_dead(c) && hits_of(c) == 0 && c->num_children <= 1) {
        c->p_u64[1] |= F_DEAD;
        refile(st, c, false);
        c = newest_child(c);
    }
}

/* ---- ops ---------------------------------------------------------------------------------- */
static void *tierkv_create(uint64_t capacity)
{
    if (capacity == 0)
        return NULL;
    tierkv_state *st = tkv_xcalloc(1, sizeof(*st));
    st->capacity = capacity;
    st->bonus_ticks = (uint64_t)((double)capacity * kBonusPerCapacity);
    if (st->bonus_ticks == 0)
        st->bonus_ticks = 1;
    for (int i = 0; i < NUM_LISTS; i++)
        list_init(&st->lists[i]);
    return st;
}

static void tierkv_destroy(void *state) { free(state); }

static bool tierkv_admit(void *state, const tkv_policy_entry *e, uint64_t now_ns)
{
    /* Everything enters: a block refused here would also cut off every block after it in its
     * chain, and a block that is never hit is among the first to go anyway. */
    return true;
}

static void tierkv_inserted(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    tierkv_state *st = state;
    tkv_policy_entry *p = e->parent;
    e->p_u64[0] = ++st->tick;
    e->p_u64[1] = 0;
    e->p_u64[2] = 0;
    if (p) {
        /* p->num_children already counts e (the manager links the child first). */
        tkv_policy_entry *older = newest_child(p);
        /* Only where the chain was a line until now: under a hub (a shared system prompt
         * with many branches) a new branch says nothing about its siblings. */
        if (older && older != e && p->num_children <= 2)
            mark_dead_branch(st, older);
        p->p_u64[2] = (uint64_t)(uintptr_t)e;
    }
    set_list(e, list_of(e));
    list_push_hot(&st->lists[list_idx(e)], e);
}

static void tierkv_accessed(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    tierkv_state *st = state;
    e->p_u64[0] = ++st->tick;
    e->p_u64[1] &= ~F_DEAD; /* hit after all: alive */
    set_hits(e, hits_of(e) + 1);
    list_unlink(e);
    set_list(e, list_of(e));
    list_push_hot(&st->lists[list_idx(e)], e);
}

static void tierkv_removed(void *state, tkv_policy_entry *e)
{
    list_unlink(e);
    if (e->parent && newest_child(e->parent) == e)
        e->parent->p_u64[2] = 0;
}

static void tierkv_changed(void *state, tkv_policy_entry *e)
{
    tierkv_state *st = state;
    unsigned old = list_idx(e);
    /* One whose last child just left was touched by the same lookups as that child, just
     * before it: it belongs near the cold end. One that was unpinned or got a child was in
     * use a moment ago: near the hot end. */
    bool was_interior = old < LIST_DEAD && old / NUM_LEVELS == CLASS_INTERIOR;
    refile(st, e, was_interior && e->num_children == 0);
}

/* Lowest priority among the cold ends of one class's levels; NULL if the class is empty. */
static tkv_policy_entry *coldest_of_class(tierkv_state *st, unsigned cls)
{
    tkv_policy_entry *best = NULL;
    uint64_t best_prio = UINT64_MAX;
    for (unsigned lv = 0; lv < NUM_LEVELS; lv++) {
        tkv_policy_entry *head = &st->lists[cls * NUM_LEVELS + lv];
        if (head->prev == head)
            continue;
        uint64_t p = priority(st, head->prev);
        if (!best || p < best_prio) {
            best = head->prev;
            best_prio = p;
        }
    }
    return best;
}

static tkv_policy_entry *tierkv_victim(void *state)
{
    tierkv_state *st = state;
    tkv_policy_entry *dead = &st->lists[LIST_DEAD];
    if (dead->prev != dead)
        return dead->prev;
    tkv_policy_entry *e = coldest_of_class(st, CLASS_TAIL);
    return e ? e : coldest_of_class(st, CLASS_INTERIOR);
}

const tkv_policy_ops tkv_policy_tierkv = {
    .name = "tierkv",
    .create = tierkv_create,
    .destroy = tierkv_destroy,
    .admit = tierkv_admit,
    .inserted = tierkv_inserted,
    .accessed = tierkv_accessed,
    .removed = tierkv_removed,
    .changed = tierkv_changed,
    .victim = tierkv_victim,
};
