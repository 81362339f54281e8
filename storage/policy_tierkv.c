/* policy_tierkv.c - "tierkv": the project's prefix-aware eviction policy (see tkv_policy.h).
 *
 * The idea (measurements, and the alternatives that lost: docs/design.md):
 *
 *   1. Rank by recency plus earned life:
 *        priority(e) = last_access_tick(e) + bonus_ticks * min(hits(e), kMaxLevel)
 *      and evict the unpinned chain tail of lowest priority. Every hit buys a block bonus_ticks
 *      more life, up to kMaxLevel hits: a prefix that keeps being hit survives gaps between its
 *      uses that are longer than the tier's LRU horizon. The cap is the aging: a block hit
 *      kMaxLevel times and then abandoned goes kMaxLevel * bonus_ticks after its last use.
 *   2. Dead suffixes go first: when a chain is extended in a new direction from a block P, the
 *      previous newest branch under P that was never hit is the abandoned end of an earlier
 *      request (typically a prompt's last, partial block, re-sent differently by the next
 *      turn). Its never-hit blocks are marked dead and are victims before anything else.
 *   3. Learned admission of first turns. A never-hit block of a chain that was never
 *      continued ("probation": a first turn, or any one-off prompt) is worth its chance of being
 *      hit later. The policy learns online, per age bucket, how many hits such a block still
 *      earns per tick of the rest of its stay once it has reached that age (LHD-style hit
 *      density), and what a newcomer earns per tick of its stay. When the tier is full and the
 *      oldest probation tail, held on, would earn more per tick than a newcomer, a new
 *      probation chain is refused (admit() == false) and the old one stays. The gaps between
 *      a conversation's turns are longer than a small tier's LRU horizon; keeping fewer first
 *      turns, but long enough for their next turn to arrive, then wins. Continuations are
 *      always admitted. Where old blocks earn less than newcomers (large tiers) the rule stays
 *      off and this is rules 1 and 2.
 *
 * Time is the policy's own logical clock, one tick per inserted() or accessed() call (per block
 * that entered or was hit in this tier), so parameters are fractions of the tier's turnover and
 * do not depend on the request rate: bonus_ticks = capacity * kBonusPerCapacity, age buckets of
 * capacity * kAgeBucket ticks. Rule 3 has no threshold: it compares two learned rates.
 *
 * Prefix structure: only tails (num_children == 0) are victims while an unpinned tail exists,
 * so a chain is eaten from its end and never loses a block its cached children need; interior
 * entries are victims only when no tail is left. A block that becomes a tail because its last
 * child left is placed by its own tick (it was touched by the same lookups as that child, just
 * before it), so a dead suffix is evicted as a whole.
 *
 * O(1): one list per (class, level), each kept sorted by tick (inserts at the hot end; the
 * rare re-placement walks at most kMaxWalk entries from the nearer end); victim() compares the
 * cold ends of the NUM_LEVELS tail lists; marking a dead branch is paid once per block; the
 * learned profile is NB_AGE counters refreshed every half bucket of ticks.
 *
 * Entry fields owned here:
 *   p_u64[0]  last access tick (for a never-hit block: its insertion tick, so its age)
 *   p_u64[1]  list index (bits 0-7) | F_DEAD | F_CONT | hits << 16
 *   p_u64[2]  the newest child inserted under this entry (a tkv_policy_entry *), or 0
 */
#include "tkv_policy.h"

#include "tkv_base.h"

#include <stdlib.h>

enum { kMaxLevel = 4 };                       /* hits beyond this earn nothing */
static const double kBonusPerCapacity = 0.5;  /* life per hit, in fills of the tier */
enum { kMaxWalk = 32 };                                   /* bound of a sorted re-placement */

/* Learned profile of probation blocks: NB_AGE age buckets of kAgeBucket fills of the tier
 * each (the last one takes every older age), counts decayed by kDecay every half bucket of
 * ticks, so the profile follows a workload that changes over a few fills of the tier. */
enum { NB_AGE = 64 };
static const double kAgeBucket = 0.125;
static const double kDecay = 1.0 / 64;

enum { CLASS_TAIL = 0, CLASS_INTERIOR = 1, NUM_CLASSES = 2 };
/* Levels: 0 = never hit, chain never continued (probation); 1 = never hit, in a continued
 * chain; 1 + h = hit h times (h = 1..kMaxLevel). */
enum { LEVEL_PROBATION = 0, LEVEL_CONTINUED = 1 };
#define NUM_LEVELS (kMaxLevel + 2)
#define LIST_DEAD (NUM_CLASSES * NUM_LEVELS)
#define LIST_PINNED (LIST_DEAD + 1)
#define NUM_LISTS (LIST_PINNED + 1)

#define F_LIST_MASK 0xffull
#define F_DEAD 0x100ull
#define F_CONT 0x200ull /* in a chain that a later request continued from a hit block */
#define HITS_SHIFT 16
#define HITS_MAX 0xffffffffull

typedef struct tierkv_state {
    uint64_t capacity;
    uint64_t bonus_ticks;
    uint64_t tick;
    /* learned profile of probation blocks (rule 3): exits (hit or removed) per age bucket,
     * hits per age bucket, their sums and the sum of ages at exit; refreshed by learn() into
     * future[] (hits per tick of the rest of the stay of a block of that age) and density
     * (hits per tick of a newcomer's stay) */
    uint64_t bucket_ticks, next_learn;
    double hit_at[NB_AGE], exit_at[NB_AGE], hit_sum, life_sum;
    double future[NB_AGE], density;
    uint64_t count;             /* entries in the tier (inserted, not yet removed) */
    uint64_t admit_now;         /* now_ns of the put being judged, and its verdict */
    bool admit_valid, admit_verdict;
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

static bool is_continued(const tkv_policy_entry *e) { return (e->p_u64[1] & F_CONT) != 0; }

static unsigned level_of(const tkv_policy_entry *e)
{
    uint64_t h = hits_of(e);
    if (h == 0)
        return is_continued(e) ? LEVEL_CONTINUED : LEVEL_PROBATION;
    return h < kMaxLevel ? (unsigned)h + 1 : kMaxLevel + 1;
}

/* Never hit, never continued, not dead: the blocks rule 3 learns about. */
static bool is_probation(const tkv_policy_entry *e)
{
    return hits_of(e) == 0 && !is_continued(e) && !is_dead(e);
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
    unsigned lv = level_of(e);
    uint64_t hits = lv > LEVEL_CONTINUED ? lv - LEVEL_CONTINUED : 0;
    return tick_of(e) + st->bonus_ticks * hits;
}

/* ---- lists -------------------------------------------------------------------------------- */

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
/* Re-files e after a change of class, level, pin or dead mark. The walk starts at the end of
 * the list e's tick is nearer to: a parent whose last child was just evicted belongs near the
 * cold end, one that was just unpinned or got a child near the hot end. */
static void refile(tierkv_state *st, tkv_policy_entry *e)
{
    unsigned now = list_of(e);
    if (now == list_idx(e))
        return;
    tkv_plist_unlink(e);
    set_list(e, now);
    tkv_policy_entry *head = &st->lists[now];
    if (now == LIST_DEAD || now == LIST_PINNED) {
        tkv_plist_push_hot(head, e); /* order does not matter there */
        return;
    }
    bool from_cold = false;
    if (head->next != head)
        from_cold = (int64_t)(tick_of(e) - tick_of(head->prev)) <
                    (int64_t)(tick_of(head->next) - tick_of(e));
    insert_sorted(head, e, from_cold);
}

/* Marks the never-hit branch that starts at c dead, following each block's newest child.
 * Each block is marked at most once, so the walk is paid for by the inserts that made it. */
static void mark_dead_branch(tierkv_state *st, tkv_policy_entry *c)
{
    while (c && !is_dead(c) && hits_of(c) == 0 && c->num_children <= 1) {
        c->p_u64[1] |= F_DEAD;
        refile(st, c);
        c = newest_child(c);
    }
}

/* ---- learned profile of probation blocks (rule 3) ------------------------------------------ */
static unsigned age_bucket(const tierkv_state *st, uint64_t age)
{
    uint64_t b = age / st->bucket_ticks;
    return b < NB_AGE ? (unsigned)b : NB_AGE - 1;
}

/* A probation block leaves probation: hit (its chain was continued) or removed. */
static void record_exit(tierkv_state *st, const tkv_policy_entry *e, bool hit)
{
    uint64_t age = st->tick > tick_of(e) ? st->tick - tick_of(e) : 0;
    unsigned b = age_bucket(st, age);
    st->exit_at[b] += 1;
    st->life_sum += (double)age;
    if (hit) {
        st->hit_at[b] += 1;
        st->hit_sum += 1;
    }
}

/* Every half bucket of ticks, LHD-style hit density by age: future[b] = hits at ages from
 * bucket b on, per tick that probation blocks spent at those ages (one that went past a bucket
 * spent all of it there, one that left in it half of it on average), i.e. what a block that has
 * reached age b earns per tick of the rest of its stay; density = the same from age 0, what a
 * newcomer earns. The whole remaining stay counts, not the next bucket only: the single-bucket
 * rate at the horizon rests on few samples and flipped the decision back and forth (measured
 * worse than LRU at one capacity, docs/design.md). Then the counts decay. NB_AGE steps
 * per bucket_ticks / 2 ticks: O(1) amortised. */
static void learn(tierkv_state *st)
{
    if (st->tick < st->next_learn)
        return;
    st->next_learn = st->tick + st->bucket_ticks / 2 + 1;
    double past = 0;                   /* exits at ages above bucket b */
    double hits_from = 0, ticks_from = 0; /* hits and exposure at ages from bucket b on */
    for (int b = NB_AGE - 1; b >= 0; b--) {
        hits_from += st->hit_at[b];
        ticks_from += (past + 0.5 * st->exit_at[b]) * (double)st->bucket_ticks;
        st->future[b] = ticks_from > 0 ? hits_from / ticks_from : 0;
        past += st->exit_at[b];
    }
    st->density = st->life_sum > 0 ? st->hit_sum / st->life_sum : 0;
    for (int b = 0; b < NB_AGE; b++) {
        st->hit_at[b] *= 1 - kDecay;
        st->exit_at[b] *= 1 - kDecay;
    }
    st->hit_sum *= 1 - kDecay;
    st->life_sum *= 1 - kDecay;
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
    st->bucket_ticks = (uint64_t)((double)capacity * kAgeBucket);
    if (st->bucket_ticks == 0)
        st->bucket_ticks = 1;
    st->next_learn = st->bucket_ticks;
    for (int i = 0; i < NUM_LISTS; i++)
        tkv_plist_init(&st->lists[i]);
    return st;
}

static void tierkv_destroy(void *state) { free(state); }

/* Rule 3's test: would the oldest probation tail, held for the rest of its stay, earn more
 * per tick than a newcomer? */
static bool hold_old(const tierkv_state *st)
{
    const tkv_policy_entry *probation = &st->lists[CLASS_TAIL * NUM_LEVELS + LEVEL_PROBATION];
    if (probation->prev == probation)
        return false;
    const tkv_policy_entry *oldest = probation->prev;
    uint64_t age = st->tick > tick_of(oldest) ? st->tick - tick_of(oldest) : 0;
    return st->future[age_bucket(st, age)] > st->density;
}

/* Rule 3. A put is judged as a whole, by its first missing block: the store asks admit() for
 * every block of one put with the same now_ns before any of them enters, and only that first
 * block's probe shows its parent (the last block the request hit, or none for a new chain);
 * the rest have no cached parent yet. Refusing one block of a chain and admitting the next
 * would cache a block nobody can reach, so the first verdict holds for the whole put. */
static bool tierkv_admit(void *state, const tkv_policy_entry *e, uint64_t now_ns)
{
    tierkv_state *st = state;
    bool verdict = true;
    if (st->admit_valid && now_ns == st->admit_now) {
        verdict = st->admit_verdict;
        goto done;
    }
    if (st->count >= st->capacity) { /* while there is room, everything enters */
        /* a chain this request continues from a hit block in a line (not a hub's new
         * branch: p has at most one other child, the previous turn's abandoned end), or one
         * continued before, is not probation */
        const tkv_policy_entry *p = e->parent;
        bool continues = p && (is_continued(p) || (hits_of(p) > 0 && p->num_children <= 1));
        verdict = continues || !hold_old(st);
    }
    st->admit_valid = true;
    st->admit_now = now_ns;
    st->admit_verdict = verdict;
done:
    /* A refused block still counts as one tick of the tier's turnover: the clock must run
     * while newcomers are refused, or the held blocks would never age out of it (with no hits
     * and no inserts the verdict could never change). */
    if (!verdict) {
        st->tick++;
        learn(st);
    }
    return verdict;
}

static void tierkv_inserted(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    tierkv_state *st = state;
    tkv_policy_entry *p = e->parent;
    e->p_u64[0] = ++st->tick;
    e->p_u64[1] = 0;
    e->p_u64[2] = 0;
    st->count++;
    if (p) {
        /* p->num_children already counts e (the manager links the child first). */
        tkv_policy_entry *older = newest_child(p);
        /* Only where the chain was a line until now: under a hub (a shared system prompt
         * with many branches) a new branch says nothing about its siblings. */
        if (older && older != e && p->num_children <= 2)
            mark_dead_branch(st, older);
        p->p_u64[2] = (uint64_t)(uintptr_t)e;
        /* A cached parent was either hit by this request or inserted by it. Hit, in a line
         * (not a hub's new branch): this request continues an earlier one. Inserted: e
         * belongs to the same request as p and inherits its mark. */
        if (is_continued(p) || (hits_of(p) > 0 && p->num_children <= 2))
            e->p_u64[1] |= F_CONT;
    }
    set_list(e, list_of(e));
    tkv_plist_push_hot(&st->lists[list_idx(e)], e);
    learn(st);
}

static void tierkv_accessed(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    tierkv_state *st = state;
    if (is_probation(e))
        record_exit(st, e, true);
    e->p_u64[0] = ++st->tick;
    e->p_u64[1] &= ~F_DEAD; /* hit after all: alive */
    set_hits(e, hits_of(e) + 1);
    tkv_plist_unlink(e);
    set_list(e, list_of(e));
    tkv_plist_push_hot(&st->lists[list_idx(e)], e);
    learn(st);
}

static void tierkv_removed(void *state, tkv_policy_entry *e)
{
    tierkv_state *st = state;
    if (is_probation(e))
        record_exit(st, e, false);
    st->count--;
    tkv_plist_unlink(e);
    if (e->parent && newest_child(e->parent) == e)
        e->parent->p_u64[2] = 0;
}

static void tierkv_changed(void *state, tkv_policy_entry *e) { refile(state, e); }

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
