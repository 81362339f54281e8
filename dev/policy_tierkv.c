/* policy_tierkv.c - "tierkv": a prefix-aware eviction policy, kept in dev/ as the baseline that
 * hazard replaced (tkv_policy_dev.h; not registered in the store).
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
 *   4. Learned choice among never-hit blocks. Never-hit blocks are classed by whether their
 *      chain was continued and by their distance from the end of the put that inserted them
 *      (log2 buckets), and each class learns the same age profile as rule 3. When rule 1
 *      picks a never-hit block, the oldest block of the class that earns least at its age
 *      goes instead, if that is clearly less (confidence intervals apart). What it learns on
 *      conversations: the last blocks of a put are never hit (the next turn re-sends the
 *      prompt with its last, partial block completed), so they are stripped from first turns
 *      that are still waiting for their next turn, before those lose live blocks.
 *   5. Ghost history (where the manager gives key fingerprints, tkv_policy_entry.key_fp): the
 *      fingerprints of blocks that left the tier (not dead ones) or were refused by rule 3 are
 *      remembered, with their hit count, in a set-associative table of kGhostPerCapacity
 *      entries per cached block, oldest replaced first in each set. A block that enters and
 *      is found there was looked up again: a miss that the tier's history makes a hit in all
 *      but name, so it enters with its remembered hits + 1 (rule 1's earned life). Rule 3
 *      judges a put whose first block is found there ("returning") by what returning blocks
 *      have earned per tick since their return (learned like rule 3's newcomer density)
 *      instead of by what new probation blocks earn. On conversations: a turn whose previous
 *      turn left the tier (the turn gap is longer than a small tier's horizon) is a returning
 *      conversation, not a new first turn: its prefix is kept for the next turn, and it is
 *      admitted where returning conversations are learned to be worth more than the first
 *      turns rule 3 holds. Where returning blocks earn nothing (a workload whose second turns
 *      are its last) they are refused like first turns. Without fingerprints (key_fp == 0)
 *      the rule is off and the table is never allocated.
 *
 * Time is the policy's own logical clock, one tick per inserted() or accessed() call (per block
 * that entered or was hit in this tier), so parameters are fractions of the tier's turnover and
 * do not depend on the request rate: bonus_ticks = capacity * kBonusPerCapacity, age buckets of
 * capacity * kAgeBucket ticks. Rules 3 and 4 have no threshold: they compare learned rates
 * (rule 4 with a confidence level).
 *
 * Prefix structure: only tails (num_children == 0) are victims while an unpinned tail exists,
 * so a chain is eaten from its end and never loses a block its cached children need; interior
 * entries are victims only when no tail is left. A block that becomes a tail because its last
 * child left is placed by its own tick (it was touched by the same lookups as that child, just
 * before it), so a dead suffix is evicted as a whole.
 *
 * O(1): one list per never-hit class and per level, each kept sorted by tick (inserts at the
 * hot end; the rare re-placement walks at most kMaxWalk entries from the nearer end); victim()
 * compares the cold ends of the NUM_NH + kMaxLevel tail lists, twice at most; marking a dead
 * branch is paid once per block, and so is classing a put's blocks when it ends; the learned
 * profiles are (1 + NUM_NH) * NB_AGE counters refreshed every half bucket of ticks; a ghost
 * look-up or insertion scans and shifts one set of GHOST_WAYS words.
 *
 * Entry fields owned here:
 *   p_u64[0]  last access tick (for a never-hit block: its insertion tick, so its age)
 *   p_u64[1]  list index (bits 0-7) | F_DEAD | F_CONT | F_RET | rule 4's end bucket (bits
 *             11-14) | hits << 16
 *   p_u64[2]  the newest child inserted under this entry (a tkv_policy_entry *), or 0
 */
#include "tkv_policy_dev.h"

#include "tkv_base.h"

#include <math.h>
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

/* Rule 4: never-hit blocks are classed by whether their chain was continued (F_CONT) and by
 * their distance d from the end of the put that inserted them, as floor(log2(d + 1)): NB_END
 * buckets, the last one for blocks of a put still being inserted (d not known yet; a class
 * with no data is never chosen). Each class learns the same age profile as rule 3; one class's
 * oldest block replaces rule 1's choice only when the upper bound of its rate is below the
 * lower bound of the rate of the block rule 1 chose, bounds at kConfidence standard deviations
 * of the hit count (Poisson). The log2 buckets keep "the last block" apart from the rest at
 * any block size; the confidence level is what keeps the rule off where the profiles are thin
 * (2 instead of 3: -0.05 point at 5,000 blocks, docs/design.md). */
enum { NB_END = 16, END_PENDING = NB_END - 1, NUM_NH = 2 * NB_END };
static const double kConfidence = 3.0;
_Static_assert(NUM_NH <= 32, "never-hit classes are a 32-bit mask");

/* Rule 5: ghost entries per cached block. The turn gap of a conversation is several fills of a
 * small tier (docs/design.md); the table remembers about the last kGhostPerCapacity fills of
 * blocks that left (each set forgets its oldest). One word per entry: the fingerprint's high
 * 56 bits | GM_VALID | the remembered hits (capped at GM_HITS). */
static const double kGhostPerCapacity = 4.0;
enum { GHOST_WAYS = 8 };
#define GM_HITS 0x7full
#define GM_VALID 0x80ull
#define GM_META 0xffull

/* Levels: 0 = never hit, chain never continued (probation); 1 = never hit, in a continued
 * chain; 1 + h = hit h times (h = 1..kMaxLevel). */
enum { LEVEL_PROBATION = 0, LEVEL_CONTINUED = 1 };
#define NUM_LEVELS (kMaxLevel + 2)
/* Lists: never-hit tails by class, hit tails by level, interior entries by level, dead,
 * pinned. */
#define LIST_TAIL_HIT (NUM_NH)                      /* + hits - 1 */
#define LIST_INTERIOR (LIST_TAIL_HIT + kMaxLevel)   /* + level */
#define LIST_DEAD (LIST_INTERIOR + NUM_LEVELS)
#define LIST_PINNED (LIST_DEAD + 1)
#define NUM_LISTS (LIST_PINNED + 1)

#define F_LIST_MASK 0xffull
#define F_DEAD 0x100ull
#define F_CONT 0x200ull /* in a chain that a later request continued from a hit block */
#define F_RET 0x400ull  /* rule 5: came back from the ghost history, not hit or removed since */
#define F_END_SHIFT 11   /* bits 11..14: rule 4's distance-from-end bucket */
#define F_END_MASK (0xfull << F_END_SHIFT)
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
    double inv_bucket; /* 1 / bucket_ticks */
    double hit_at[NB_AGE], exit_at[NB_AGE], hit_sum, life_sum;
    double future[NB_AGE], density;
    /* rule 5: the same density for blocks that came back from the ghost history (from their
     * return to their next hit or removal) */
    double ret_hit_sum, ret_life_sum, ret_density;
    /* rule 4: the same counts per class of never-hit blocks, refreshed by learn() into a
     * confidence interval [nh_lo, nh_hi] of the rest-of-stay rate */
    double nh_hit[NUM_NH][NB_AGE], nh_exit[NUM_NH][NB_AGE];
    double nh_lo[NUM_NH][NB_AGE], nh_hi[NUM_NH][NB_AGE];
    /* bit c set: never-hit class list c may be non-empty (set on every entry into it, cleared
     * by the scans that find it empty), so victim() skips the empty classes */
    uint32_t nh_mask;
    uint32_t nh_seen; /* bit c set: class c has recorded an exit (learn() skips the others) */
    /* the put being inserted (rule 4): its newest block and how many blocks it inserted */
    tkv_policy_entry *run_last;
    uint64_t run_len;
    uint64_t count;             /* entries in the tier (inserted, not yet removed) */
    /* rule 5: ghost_sets sets of GHOST_WAYS words (0 = empty; way 0 the newest), allocated at
     * the first block that has a fingerprint */
    uint64_t *ghost;
    uint64_t ghost_sets;
    uint64_t admit_now;         /* now_ns of the put being judged, and its verdict */
    bool admit_valid, admit_verdict;
    /* sentinels: next = hottest, prev = coldest; the layout is at LIST_TAIL_HIT above */
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

static unsigned nh_class(const tkv_policy_entry *e)
{
    return (is_continued(e) ? NB_END : 0) + (unsigned)((e->p_u64[1] & F_END_MASK) >> F_END_SHIFT);
}

static void set_end_bucket(tkv_policy_entry *e, unsigned b)
{
    e->p_u64[1] = (e->p_u64[1] & ~F_END_MASK) | ((uint64_t)b << F_END_SHIFT);
}

/* floor(log2(d + 1)) for a block d blocks before the end of its put, below END_PENDING */
static unsigned end_bucket(uint64_t d)
{
    unsigned b = 0;
    for (d += 1; d > 1 && b < END_PENDING - 1; d >>= 1)
        b++;
    return b;
}

static unsigned list_of(const tkv_policy_entry *e)
{
    if (e->pinned)
        return LIST_PINNED;
    if (e->num_children)
        return LIST_INTERIOR + level_of(e);
    if (is_dead(e))
        return LIST_DEAD;
    uint64_t h = hits_of(e);
    if (h == 0)
        return nh_class(e);
    return LIST_TAIL_HIT + (unsigned)(h < kMaxLevel ? h : kMaxLevel) - 1;
}

static uint64_t priority(const tierkv_state *st, const tkv_policy_entry *e)
{
    unsigned lv = level_of(e);
    uint64_t hits = lv > LEVEL_CONTINUED ? lv - LEVEL_CONTINUED : 0;
    return tick_of(e) + st->bonus_ticks * hits;
}

/* age / bucket_ticks, capped at NB_AGE - 1. victim() asks this for every never-hit class, so
 * the quotient comes from a multiply by the reciprocal, corrected to the exact one. */
static unsigned age_bucket(const tierkv_state *st, uint64_t age)
{
    if (age >= NB_AGE * st->bucket_ticks)
        return NB_AGE - 1;
    uint64_t b = (uint64_t)((double)age * st->inv_bucket);
    if (b * st->bucket_ticks > age)
        b--;
    else if ((b + 1) * st->bucket_ticks <= age)
        b++;
    return (unsigned)b;
}

/* Rule 4: a never-hit block stops being one (hit, removed or marked dead): its class
 * learns the ticks it spent and whether it ended in a hit. */
static void record_class_exit(tierkv_state *st, const tkv_policy_entry *e, bool hit)
{
    if (hits_of(e) != 0 || is_dead(e))
        return;
    unsigned c = nh_class(e);
    unsigned b = age_bucket(st, st->tick > tick_of(e) ? st->tick - tick_of(e) : 0);
    st->nh_seen |= 1u << c;
    st->nh_exit[c][b] += 1;
    if (hit)
        st->nh_hit[c][b] += 1;
}

/* ---- lists -------------------------------------------------------------------------------- */

static void push_hot(tierkv_state *st, tkv_policy_entry *e)
{
    unsigned l = list_idx(e);
    if (l < NUM_NH)
        st->nh_mask |= 1u << l;
    tkv_plist_push_hot(&st->lists[l], e);
}

/* Cold end of never-hit class c, or NULL (then c's bit is cleared). */
static tkv_policy_entry *class_cold(tierkv_state *st, unsigned c)
{
    tkv_policy_entry *head = &st->lists[c];
    if (head->prev != head)
        return head->prev;
    st->nh_mask &= ~(1u << c);
    return NULL;
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
    if (now < NUM_NH)
        st->nh_mask |= 1u << now;
    insert_sorted(head, e, from_cold);
}

/* Marks the never-hit branch that starts at c dead, following each block's newest child.
 * Each block is marked at most once, so the walk is paid for by the inserts that made it. */
static void mark_dead_branch(tierkv_state *st, tkv_policy_entry *c)
{
    while (c && !is_dead(c) && hits_of(c) == 0 && c->num_children <= 1) {
        record_class_exit(st, c, false);
        c->p_u64[1] |= F_DEAD;
        refile(st, c);
        c = newest_child(c);
    }
}

/* ---- learned profile of probation blocks (rule 3) ------------------------------------------ */

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

/* Rule 5: a block that came back from the ghost history is hit or leaves: its stay since
 * it came back counts toward what returning blocks earn per tick. */
static void record_return_exit(tierkv_state *st, tkv_policy_entry *e, bool hit)
{
    if (!(e->p_u64[1] & F_RET))
        return;
    e->p_u64[1] &= ~F_RET;
    st->ret_life_sum += (double)(st->tick > tick_of(e) ? st->tick - tick_of(e) : 0);
    if (hit)
        st->ret_hit_sum += 1;
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
    st->ret_density = st->ret_life_sum > 0 ? st->ret_hit_sum / st->ret_life_sum : st->density;
    /* rule 4: the same per class, kept as a confidence interval: with h hits in t ticks,
     * (h -+ kConfidence * sqrt(h + 1)) / t; a class with no ticks yet is unknown: [0, inf],
     * as create() left it */
    for (uint32_t m = st->nh_seen; m; m &= m - 1) {
        unsigned c = (unsigned)__builtin_ctz(m);
        double past = 0, hits_from = 0, ticks_from = 0;
        for (int b = NB_AGE - 1; b >= 0; b--) {
            hits_from += st->nh_hit[c][b];
            ticks_from += (past + 0.5 * st->nh_exit[c][b]) * (double)st->bucket_ticks;
            double sd = kConfidence * sqrt(hits_from + 1);
            st->nh_lo[c][b] = ticks_from > 0 && hits_from > sd ? (hits_from - sd) / ticks_from : 0;
            st->nh_hi[c][b] = ticks_from > 0 ? (hits_from + sd) / ticks_from : HUGE_VAL;
            past += st->nh_exit[c][b];
            st->nh_hit[c][b] *= 1 - kDecay;
            st->nh_exit[c][b] *= 1 - kDecay;
        }
    }
    for (int b = 0; b < NB_AGE; b++) {
        st->hit_at[b] *= 1 - kDecay;
        st->exit_at[b] *= 1 - kDecay;
    }
    st->hit_sum *= 1 - kDecay;
    st->life_sum *= 1 - kDecay;
    st->ret_hit_sum *= 1 - kDecay;
    st->ret_life_sum *= 1 - kDecay;
}

/* Rule 4: the put being inserted is complete (a lookup came, a block entered that does not
 * continue it, or its newest block left); its never-hit blocks learn their distance from its
 * end and move to that class. The walk follows parent links from its newest block, once per
 * put: O(1) per block. A put whose blocks the store entered in several chunks is one run: each
 * chunk's first block hangs under the previous chunk's last. */
static void finish_run(tierkv_state *st)
{
    tkv_policy_entry *e = st->run_last;
    for (uint64_t i = 0; e && i < st->run_len; i++, e = e->parent) {
        if (hits_of(e) != 0 || is_dead(e))
            continue;
        set_end_bucket(e, end_bucket(i));
        refile(st, e);
    }
    st->run_last = NULL;
    st->run_len = 0;
}

/* ---- ghost history (rule 5) ---------------------------------------------------------------- */

static uint64_t *ghost_set(const tierkv_state *st, uint64_t fp)
{
    /* the set from the low 32 bits, the tag from the high 56: both from a uniform hash */
    return st->ghost + (((fp & 0xffffffffull) * st->ghost_sets) >> 32) * GHOST_WAYS;
}

/* 1 + the remembered hits of the block with fingerprint fp, or 0 if it is not remembered;
 * take: forget it (it is back in the tier). */
static uint64_t ghost_find(tierkv_state *st, uint64_t fp, bool take)
{
    if (!st->ghost || !fp)
        return 0;
    uint64_t *w = ghost_set(st, fp), tag = (fp & ~GM_META) | GM_VALID;
    for (int i = 0; i < GHOST_WAYS; i++) {
        if ((w[i] & ~GM_HITS) == tag) {
            uint64_t hits = w[i] & GM_HITS;
            if (take) {
                for (int j = i; j < GHOST_WAYS - 1; j++)
                    w[j] = w[j + 1];
                w[GHOST_WAYS - 1] = 0;
            }
            return hits + 1;
        }
    }
    return 0;
}

/* Remembers a block that left the tier or was refused, as the newest of its set (the oldest
 * of the set is forgotten); a block remembered already keeps the higher hit count. */
static void ghost_remember(tierkv_state *st, uint64_t fp, uint64_t hits)
{
    if (!fp)
        return;
    if (!st->ghost) {
        st->ghost_sets = tkv_policy_ghost_sets(st->capacity, kGhostPerCapacity, GHOST_WAYS);
        st->ghost = tkv_xcalloc(st->ghost_sets * GHOST_WAYS, sizeof(uint64_t));
    }
    uint64_t old = ghost_find(st, fp, true);
    if (old > hits + 1)
        hits = old - 1;
    uint64_t *w = ghost_set(st, fp);
    for (int j = GHOST_WAYS - 1; j > 0; j--)
        w[j] = w[j - 1];
    w[0] = (fp & ~GM_META) | GM_VALID | (hits < GM_HITS ? hits : GM_HITS);
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
    st->inv_bucket = 1.0 / (double)st->bucket_ticks;
    for (int c = 0; c < NUM_NH; c++) /* nothing known yet: a rate in [0, inf] */
        for (int b = 0; b < NB_AGE; b++)
            st->nh_hi[c][b] = HUGE_VAL;
    for (int i = 0; i < NUM_LISTS; i++)
        tkv_plist_init(&st->lists[i]);
    return st;
}

static void tierkv_destroy(void *state)
{
    tierkv_state *st = state;
    free(st->ghost);
    free(st);
}

/* Rule 3's test: would the oldest probation tail, held for the rest of its stay, earn more
 * per tick than a newcomer that earns `density` (a new probation block's, or with rule 5 a
 * returning block's)? */
static bool hold_old(const tierkv_state *st, double density)
{
    const tkv_policy_entry *oldest = NULL;
    /* the probation classes: not continued */
    for (uint32_t m = st->nh_mask & ((1u << NB_END) - 1); m; m &= m - 1) {
        const tkv_policy_entry *head = &st->lists[__builtin_ctz(m)];
        if (head->prev != head && (!oldest || tick_of(head->prev) < tick_of(oldest)))
            oldest = head->prev;
    }
    if (!oldest)
        return false;
    uint64_t age = st->tick > tick_of(oldest) ? st->tick - tick_of(oldest) : 0;
    return st->future[age_bucket(st, age)] > density;
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
        /* rule 5: a block seen before comes back (a conversation whose turn left the tier):
         * judged by what returning blocks earn */
        bool back = ghost_find(st, e->key_fp, false) != 0;
        verdict = continues || !hold_old(st, back ? st->ret_density : st->density);
    }
    st->admit_valid = true;
    st->admit_now = now_ns;
    st->admit_verdict = verdict;
done:
    /* A refused block still counts as one tick of the tier's turnover: the clock must run
     * while newcomers are refused, or the held blocks would never age out of it (with no hits
     * and no inserts the verdict could never change). */
    if (!verdict) {
        ghost_remember(st, e->key_fp, 0); /* rule 5: a returning block if it comes back */
        st->tick++;
        learn(st);
    }
    return verdict;
}

static void tierkv_inserted(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    tierkv_state *st = state;
    tkv_policy_entry *p = e->parent;
    if (!p || p != st->run_last)
        finish_run(st);
    st->run_last = e;
    st->run_len++;
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
    /* rule 5: a block that was here (or was refused) comes back: looked up again, so hit once
     * more than it was when it left; F_RET until its next hit or removal (ret_density) */
    uint64_t back = ghost_find(st, e->key_fp, true);
    if (back) {
        set_hits(e, back);
        e->p_u64[1] |= F_RET;
    }
    set_end_bucket(e, END_PENDING); /* until finish_run() knows its distance from the end */
    set_list(e, list_of(e));
    push_hot(st, e);
    learn(st);
}

static void tierkv_accessed(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    tierkv_state *st = state;
    if (st->run_last)
        finish_run(st); /* a lookup: the put before it is complete */
    if (is_probation(e))
        record_exit(st, e, true);
    record_class_exit(st, e, true);
    record_return_exit(st, e, true);
    e->p_u64[0] = ++st->tick;
    e->p_u64[1] &= ~F_DEAD; /* hit after all: alive */
    set_hits(e, hits_of(e) + 1);
    tkv_plist_unlink(e);
    set_list(e, list_of(e));
    push_hot(st, e);
    learn(st);
}

static void tierkv_removed(void *state, tkv_policy_entry *e)
{
    tierkv_state *st = state;
    if (e == st->run_last)
        finish_run(st);
    if (is_probation(e))
        record_exit(st, e, false);
    record_class_exit(st, e, false);
    record_return_exit(st, e, false);
    if (!is_dead(e)) /* rule 5 (a dead block's contents do not come back) */
        ghost_remember(st, e->key_fp, hits_of(e));
    st->count--;
    tkv_plist_unlink(e);
    if (e->parent && newest_child(e->parent) == e)
        e->parent->p_u64[2] = 0;
}

static void tierkv_changed(void *state, tkv_policy_entry *e) { refile(state, e); }

/* Lowest priority among the cold ends of lists [from, to); NULL if all are empty. */
static tkv_policy_entry *coldest_of(tierkv_state *st, unsigned from, unsigned to)
{
    tkv_policy_entry *best = NULL;
    uint64_t best_prio = UINT64_MAX;
    for (unsigned l = from; l < to; l++) {
        tkv_policy_entry *head = &st->lists[l];
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

/* Rule 1's choice among tails: lowest priority among the cold ends of the non-empty never-hit
 * classes and of the hit levels; NULL if no unpinned tail is left. */
static tkv_policy_entry *coldest_tail(tierkv_state *st)
{
    tkv_policy_entry *best = NULL;
    uint64_t best_prio = UINT64_MAX;
    for (uint32_t m = st->nh_mask; m; m &= m - 1) {
        tkv_policy_entry *e = class_cold(st, (unsigned)__builtin_ctz(m));
        if (!e)
            continue;
        uint64_t p = priority(st, e);
        if (!best || p < best_prio) {
            best = e;
            best_prio = p;
        }
    }
    tkv_policy_entry *hit = coldest_of(st, LIST_TAIL_HIT, LIST_INTERIOR);
    if (hit && (!best || priority(st, hit) < best_prio))
        best = hit;
    return best;
}

static tkv_policy_entry *tierkv_victim(void *state)
{
    tierkv_state *st = state;
    tkv_policy_entry *dead = &st->lists[LIST_DEAD];
    if (dead->prev != dead)
        return dead->prev;
    tkv_policy_entry *e = coldest_tail(st);
    double e_lo = 0;
    if (e && list_idx(e) < NUM_NH) {
        uint64_t age = st->tick > tick_of(e) ? st->tick - tick_of(e) : 0;
        e_lo = st->nh_lo[list_idx(e)][age_bucket(st, age)];
    }
    if (e_lo > 0) { /* else no class can be clearly below e's */
        /* rule 4: a never-hit block goes; which one: the class whose oldest block would
         * earn the least per tick of the rest of its stay, if clearly less than e */
        tkv_policy_entry *pick = NULL;
        double best = 0;
        for (uint32_t m = st->nh_mask; m; m &= m - 1) {
            unsigned c = (unsigned)__builtin_ctz(m);
            tkv_policy_entry *old = class_cold(st, c);
            if (!old)
                continue;
            uint64_t age = st->tick > tick_of(old) ? st->tick - tick_of(old) : 0;
            double f = st->nh_hi[c][age_bucket(st, age)];
            if (!pick || f < best || (f == best && tick_of(old) < tick_of(pick))) {
                best = f;
                pick = old;
            }
        }
        if (pick && best < e_lo)
            e = pick;
    }
    return e ? e : coldest_of(st, LIST_INTERIOR, LIST_DEAD);
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
