/* policy_hazard.c - "hazard", the store's default policy: evict the block least worth its space,
 * by a reuse hazard learned online, under a guard that keeps it from losing to LRU.
 *
 * Why: in LLM serving most blocks are never used again, and the ones that are come back after
 * gaps (a conversation's next turn) that are often longer than LRU remembers. Which block is
 * worth keeping depends on what kind of block it is, so the policy learns that from the
 * tier's own history instead of assuming "recent = valuable".
 *
 * What it learns: every use of a block (insertion, hit, refused put) starts an event that ends
 * at its next use (a reuse, at some age) or when the block can no longer be seen (censored).
 * Events are classed by the put that brought the block: prior uses (1..NU), distance from the
 * put's end (ND log2 buckets: a prompt's dead partial block is a class), the put's turn
 * (1..NT) and its new blocks (NN buckets 4x apart), distances and counts in the clients' block
 * (learn_unit). Per class and age bucket it estimates the hazard (reuses over the time open
 * events spent at that age), and from it the class's index at each age: the most hits per tick
 * of holding that any holding time gives (build_index).
 *
 * How it decides: victim() takes the lowest index among kSamples random unpinned tails (or the
 * last victim's parent, so that a dead suffix goes in one piece); admit() refuses a put whose
 * first block is worth less at age 0 than what it would evict. A ghost table remembers blocks
 * that left or were refused, so a block that comes back is a reuse at its true age.
 *
 * The guard (guard_count): a shadow LRU directory of the tier's capacity (tkv_lru_shadow) sees
 * every block of every request, so the policy knows how many hits LRU has had and how many it
 * could still gain; the learned order may take a step only while that leaves the tier within
 * a fill of hits of LRU (a bound that holds by construction), and when it falls behind by a
 * margin the tier follows LRU's set until a later trial shows the learned order ahead again.
 * docs/design.md, "Cache policy".
 *
 * Cost: O(1) per call (kSamples reads per victim; learning in amortised steps of NB_AGE per
 * class every capacity / kLearnPerFill ticks); memory bounded (ghost and shadow capped at
 * 2^24 entries).
 *
 * Entry fields owned here:
 *   p_u64[0]  tick of the block's last use (its event's start)
 *   p_u64[1]  class | uses << USES_SHIFT | turn << TURN_SHIFT | new-blocks bucket << NEWB_SHIFT
 *             | flags (F_*) | where it is placed << WHERE_SHIFT
 *   p_u64[2]  1 + its index in the tail array, or 0
 * prev/next link it into the list of where it is placed (tails in LRU's order, interior or
 * pinned).
 */
#include "tkv_policy.h"

#include "tkv_base.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

enum { NB_AGE = 64 };                        /* age buckets; the last takes every older age */
static const double kBucketPerFill = 0.125;  /* age bucket width, in fills of the tier */
enum { kLearnPerFill = 16 };                 /* index rebuilds per fill of the tier */
enum { kMinBucket = 32, kMinLearn = 256 };   /* floors, in ticks, for tiny tiers */
static const double kDecay = 1.0 / 64;       /* per rebuild: a memory of about 4 fills */
static const double kPrior = 20;             /* pseudo-events pulling a class to its base */
enum { kSamples = 64 };
enum { NUNIT = 7 };                          /* clients' blocks of 1 .. 64 of ours */
static const double kUnitDecay = 1.0 / 256;  /* per put starting new content */
static const double kUnitShare = 0.95;       /* of those starting on a multiple of the unit */
static const double kUnitMinStarts = 32;     /* before that, a unit of 1 */
static const double kGhostPerCapacity = 4.0;
enum { GHOST_WAYS = 8 };
/* The LRU guard (guard_count): the most hits the learned order may ever cost against LRU, in
 * fills of the tier (kGuardBudgetFills); checked every fill / kGuardChecksPerFill blocks
 * requested; the surplus of real hits over LRU's decays with a half-life of
 * kGuardHalfLifeFills fills; the tier follows LRU once it is below -kGuardMargin * capacity,
 * judged after a quarter fill (1 / kGuardGraceDiv) of the learned order's own; a trial of the
 * learned order after kGuardFirstWaitFills fills, the wait doubled after each trial that fails
 * within kGuardShortTrials waits, up to kGuardMaxWaitFills. */
enum { kGuardBudgetFills = 1, kGuardChecksPerFill = 8, kGuardMinCheck = 64 };
enum { kGuardShortTrials = 4, kGuardMaxWaitFills = 256, kGuardFirstWaitFills = 2 };
enum { kGuardGraceDiv = 4, kGuardWalk = 256 }; /* guard_outside_tail */
static const double kGuardHalfLifeFills = 8.0;
static const double kGuardMargin = 1.0 / 64;

/* class = (((uses - 1) * ND + end bucket) * NT + turn - 1) * NN + new bucket */
enum { NU = 4, ND = 4, NT = 5, NN = 5, NCLASS = NU * ND * NT * NN };

#define F_CLASS 0x1ffull
#define USES_SHIFT 9
#define TURN_SHIFT 12
#define NEWB_SHIFT 15
#define FIELD3 0x7ull
#define F_HAS_HISTORY (1ull << 18)    /* entered with ghost history: keeps its own turn */
#define F_IN_OPEN_PUT (1ull << 19) /* in the put being inserted: classed when it ends */
#define F_IN_LAST_LOOKUP (1ull << 20) /* hit by the latest lookup: classed by the put after it */
#define WHERE_SHIFT 21          /* 2 bits: IN_TAILS, IN_INTERIOR or IN_PINNED */
#define F_KEEP (F_HAS_HISTORY | F_IN_OPEN_PUT | F_IN_LAST_LOOKUP | (3ull << WHERE_SHIFT))
_Static_assert(NCLASS <= 512, "a class is 9 bits");

enum { IN_TAILS, IN_INTERIOR, IN_PINNED };

typedef struct hazard_state {
    uint64_t capacity, count, tick;
    uint64_t bucket_ticks, learn_ticks, bucket_now; /* bucket_now = tick / bucket_ticks */
    uint64_t rng;
    /* learned: reuses and exposure by class and age (decayed), open events by the bucket they
     * started in (a ring; NB_AGE - 1 buckets old or more in old_open), the index tables */
    double reuse[NCLASS][NB_AGE], exposure[NCLASS][NB_AGE];
    double open[NCLASS][NB_AGE], old_open[NCLASS];
    float index_by_age[NCLASS][NB_AGE];
    bool has_index[NCLASS], active[NCLASS];
    /* unpinned tails, for sampling (an array) and in LRU's order (lists[IN_TAILS]) */
    tkv_policy_entry **tails;
    uint64_t num_tails, tails_cap;
    tkv_policy_entry lists[3]; /* sentinels: next = hottest, prev = coldest */
    /* the put being inserted: its newest block, the parent of its first, its length and new
     * blocks, and the turn of its deepest block with ghost history (-1: none) */
    tkv_policy_entry *put_last, *put_parent;
    uint64_t put_len, put_new;
    int put_history_turn;
    tkv_policy_entry *hit_last; /* the latest lookup's deepest hit (F_IN_LAST_LOOKUP) block */
    /* the clients' block, in blocks: puts seen starting new content (decayed), and of them
     * those starting at a multiple of 2^k blocks */
    double unit_starts, unit_aligned[NUNIT];
    uint64_t unit;
    /* the last victim's parent, tick, class and index */
    tkv_policy_entry *victim_parent;
    uint64_t victim_tick;
    unsigned victim_class;
    double victim_index;
    /* ghost: sets of GHOST_WAYS (fingerprint word, meta word) pairs, way 0 newest */
    uint64_t *ghost, ghost_sets;
    /* admit(): the put being judged, its verdict and turn; the fingerprints and prior uses of
     * the blocks it refused, classed when the put ends (its length is known then) */
    uint64_t admit_now;
    bool admit_valid, admit_verdict;
    unsigned admit_turn;
    uint64_t *refused_fp;
    uint64_t num_refused, refused_cap;
    /* the LRU guard: LRU's tier on the same requests, the tier's hits minus LRU's (all and
     * decayed), the blocks admitted and not inserted yet, the longest put seen; whether the
     * tier follows LRU, since which check, for how long; where the requests begin (the last
     * call was admit(), with that now_ns) */
    tkv_lru_shadow *lru_shadow;
    int64_t guard_lead;
    double guard_surplus, guard_keep, guard_margin;
    uint64_t guard_pending, guard_longest_put, guard_seen, guard_check, guard_since, guard_wait;
    bool guard_follow, last_call_admit;
    uint64_t last_admit_now;
} hazard_state;

/* ---- entry fields ------------------------------------------------------------------------- */
static unsigned class_of(const tkv_policy_entry *e) { return (unsigned)(e->p_u64[1] & F_CLASS); }
static unsigned field(const tkv_policy_entry *e, int shift)
{
    return (unsigned)((e->p_u64[1] >> shift) & FIELD3);
}

/* n new blocks, in units of the clients' block (unit blocks, see learn_unit) */
static unsigned new_bucket(uint64_t n, uint64_t unit)
{
    n = (n + unit - 1) / unit;
    return n <= 1 ? 0 : n <= 4 ? 1 : n <= 16 ? 2 : n <= 64 ? 3 : 4;
}

/* distance d (in blocks) from the end of its put, in units of the clients' block (unit
 * blocks): floor(log2(d / unit + 1)), capped (the last bucket is also a put still being
 * inserted) */
static unsigned end_bucket(uint64_t d, uint64_t unit)
{
    unsigned b = 0;
    for (d = d / unit + 1; d > 1 && b < ND - 1; d >>= 1)
        b++;
    return b;
}

static unsigned make_class(unsigned uses, unsigned endb, unsigned turn, unsigned newb)
{
    uses = uses < 1 ? 1 : uses > NU ? NU : uses;
    turn = turn < 1 ? 1 : turn > NT ? NT : turn;
    return (((uses - 1) * ND + endb) * NT + turn - 1) * NN + newb;
}

static void set_fields(tkv_policy_entry *e, unsigned cls, unsigned uses, unsigned turn,
                       unsigned newb)
{
    uses = uses > NU ? NU : uses;
    turn = turn > NT ? NT : turn;
    e->p_u64[1] = (e->p_u64[1] & F_KEEP) | cls |
                  (uint64_t)uses << USES_SHIFT | (uint64_t)turn << TURN_SHIFT |
                  (uint64_t)newb << NEWB_SHIFT;
}

/* ---- learning ----------------------------------------------------------------------------- */
/* The counter of class c's open events that holds one started at tick `start`; *age: its age
 * bucket now. */
static double *open_count(hazard_state *st, unsigned c, uint64_t start, uint64_t *age)
{
    uint64_t a = st->bucket_now - start / st->bucket_ticks;
    *age = a < NB_AGE - 1 ? a : NB_AGE - 1;
    return a < NB_AGE - 1 ? &st->open[c][(start / st->bucket_ticks) % NB_AGE] : &st->old_open[c];
}

/* An event of class c starts (or, moved from another class, started) at tick `start`. */
static void event_start(hazard_state *st, unsigned c, uint64_t start)
{
    uint64_t a;
    *open_count(st, c, start, &a) += 1;
    st->active[c] = true;
}

/* An event of class c that started at tick `start` ends: reused, or no longer observable. */
static void event_end(hazard_state *st, unsigned c, uint64_t start, bool reused)
{
    uint64_t a;
    *open_count(st, c, start, &a) -= 1;
    if (reused)
        st->reuse[c][a] += 1;
}

/* Index by age from per-bucket hazards h: with S the survival, points (G_i, F_i) = (sum of
 * S below i, 1 - S_i); the index at a is the largest slope from point a to a later point, the
 * tangent to the upper hull of the later points, which the backward pass keeps on a stack. */
static void build_index(float *out, const double *h)
{
    double G[NB_AGE + 1], F[NB_AGE + 1], s = 1;
    G[0] = 0;
    for (int a = 0; a < NB_AGE; a++) {
        G[a + 1] = G[a] + s;
        s *= 1 - h[a];
        F[a + 1] = 1 - s;
    }
    F[0] = 0;
    int stack[NB_AGE + 1], n = 0;
    stack[n++] = NB_AGE;
#define SLOPE(i, j) ((F[j] - F[i]) / (G[j] - G[i]))
    for (int a = NB_AGE - 1; a >= 0; a--) {
        while (n >= 2 && SLOPE(a, stack[n - 1]) <= SLOPE(a, stack[n - 2]))
            n--;
        out[a] = (float)SLOPE(a, stack[n - 1]);
        stack[n++] = a;
    }
#undef SLOPE
}

static void learn(hazard_state *st)
{
    for (unsigned u = 0; u < NU; u++) {
        unsigned per_u = NCLASS / NU, c0 = u * per_u;
        double base[NB_AGE];
        for (int a = 0; a < NB_AGE; a++) {
            double r = 0, e = 0;
            for (unsigned c = c0; c < c0 + per_u; c++)
                if (st->active[c]) {
                    r += st->reuse[c][a];
                    e += st->exposure[c][a];
                }
            base[a] = e > 0 ? r / e : 0;
        }
        for (unsigned c = c0; c < c0 + per_u; c++) {
            if (!st->active[c])
                continue;
            double r = 0, expected = 0, h[NB_AGE];
            for (int a = 0; a < NB_AGE; a++) {
                r += st->reuse[c][a];
                expected += st->exposure[c][a] * base[a];
            }
            double m = (r + kPrior) / (expected + kPrior);
            for (int a = 0; a < NB_AGE; a++)
                h[a] = fmin(0.999, base[a] * m);
            build_index(st->index_by_age[c], h);
            st->has_index[c] = true;
            for (int a = 0; a < NB_AGE; a++) {
                st->reuse[c][a] *= 1 - kDecay;
                st->exposure[c][a] *= 1 - kDecay;
            }
        }
    }
}

/* One tick of the clock: bucket edges add a bucket of exposure per open event at its age. */
static void advance(hazard_state *st)
{
    st->tick++;
    if (st->tick % st->bucket_ticks == 0) {
        /* the events that started in this slot reach the last age bucket as the next begins */
        uint64_t slot = (st->bucket_now + 2) % NB_AGE;
        for (unsigned c = 0; c < NCLASS; c++) {
            if (!st->active[c]) /* never had an open event */
                continue;
            for (unsigned a = 0; a < NB_AGE - 1; a++)
                st->exposure[c][a] += st->open[c][(st->bucket_now - a) % NB_AGE];
            st->exposure[c][NB_AGE - 1] += st->old_open[c];
            st->old_open[c] += st->open[c][slot];
            st->open[c][slot] = 0;
        }
        st->bucket_now++;
    }
    if (st->tick % st->learn_ticks == 0)
        learn(st);
}

static double index_at(const hazard_state *st, unsigned c, uint64_t start)
{
    if (!st->has_index[c])
        return HUGE_VAL; /* nothing learned yet: keep */
    uint64_t a = st->bucket_now - start / st->bucket_ticks;
    return st->index_by_age[c][a < NB_AGE - 1 ? a : NB_AGE - 1];
}

/* ---- ghost history ------------------------------------------------------------------------ */
#define GH_VALID 1ull
/* meta word: start tick (40 bits) | class << 40 | uses << 49 | turn << 52 */
static uint64_t gh_meta(uint64_t start, unsigned c, unsigned uses, unsigned turn)
{
    return (start & ((1ull << 40) - 1)) | (uint64_t)c << 40 | (uint64_t)uses << 49 |
           (uint64_t)turn << 52;
}

static uint64_t *ghost_set(const hazard_state *st, uint64_t fp)
{
    return st->ghost + (((fp & 0xffffffffull) * st->ghost_sets) >> 32) * GHOST_WAYS * 2;
}

/* The way (fingerprint word, meta word) remembering fp, or NULL. */
static uint64_t *ghost_find(const hazard_state *st, uint64_t fp)
{
    if (!st->ghost || !fp)
        return NULL;
    uint64_t *w = ghost_set(st, fp);
    for (int i = 0; i < GHOST_WAYS; i++)
        if (w[2 * i] == (fp | GH_VALID))
            return &w[2 * i];
    return NULL;
}

static uint64_t ghost_peek(const hazard_state *st, uint64_t fp)
{
    const uint64_t *way = ghost_find(st, fp);
    return way ? way[1] : 0;
}

/* The remembered meta word of fp, removed from the table; 0 if not remembered. */
static uint64_t ghost_take(hazard_state *st, uint64_t fp)
{
    uint64_t *way = ghost_find(st, fp);
    if (!way)
        return 0;
    uint64_t meta = way[1], *end = ghost_set(st, fp) + 2 * GHOST_WAYS;
    memmove(way, way + 2, (size_t)(end - way - 2) * sizeof(*way));
    end[-2] = end[-1] = 0;
    return meta;
}

/* The start tick of a remembered event: the low 40 bits of a tick within 2^40 of now. */
static uint64_t meta_start(const hazard_state *st, uint64_t meta)
{
    uint64_t lo = meta & ((1ull << 40) - 1), t = (st->tick & ~((1ull << 40) - 1)) | lo;
    return t > st->tick ? t - (1ull << 40) : t;
}
static unsigned meta_class(uint64_t m) { return (unsigned)((m >> 40) & F_CLASS); }
static unsigned meta_uses(uint64_t m) { return (unsigned)((m >> 49) & FIELD3); }
static unsigned meta_turn(uint64_t m) { return (unsigned)((m >> 52) & FIELD3); }

/* Remembers an open event of a block that leaves or is refused; without a fingerprint it is
 * censored now. The set's oldest entry is forgotten, and its event censored. */
static void ghost_put(hazard_state *st, uint64_t fp, uint64_t start, unsigned c, unsigned uses,
                      unsigned turn)
{
    if (!fp) {
        event_end(st, c, start, false);
        return;
    }
    if (!st->ghost) {
        st->ghost_sets = tkv_policy_ghost_sets(st->capacity, kGhostPerCapacity, GHOST_WAYS);
        st->ghost = tkv_xcalloc(st->ghost_sets * GHOST_WAYS * 2, sizeof(uint64_t));
    }
    uint64_t old = ghost_take(st, fp);
    if (old)
        event_end(st, meta_class(old), meta_start(st, old), false);
    uint64_t *w = ghost_set(st, fp);
    if (w[2 * GHOST_WAYS - 2]) {
        uint64_t m = w[2 * GHOST_WAYS - 1];
        event_end(st, meta_class(m), meta_start(st, m), false);
    }
    memmove(&w[2], &w[0], (size_t)(GHOST_WAYS - 1) * 2 * sizeof(*w));
    w[0] = fp | GH_VALID;
    w[1] = gh_meta(start, c, uses, turn);
}

/* ---- where an entry lives ----------------------------------------------------------------- */
static unsigned where_of(const tkv_policy_entry *e)
{
    return e->pinned ? IN_PINNED : e->num_children ? IN_INTERIOR : IN_TAILS;
}

static unsigned placed_in(const tkv_policy_entry *e)
{
    return (unsigned)((e->p_u64[1] >> WHERE_SHIFT) & 3);
}

static void push_cold(tkv_policy_entry *head, tkv_policy_entry *e)
{
    e->prev = head->prev;
    e->next = head;
    head->prev->next = e;
    head->prev = e;
}

/* Into the list of where it belongs now, at LRU's place: the hot end, except a block that
 * became a tail because its last child left (as cold as that child: tkv_policy_lru's rule). */
static void place(hazard_state *st, tkv_policy_entry *e, unsigned was)
{
    unsigned w = where_of(e);
    e->p_u64[1] = (e->p_u64[1] & ~(3ull << WHERE_SHIFT)) | (uint64_t)w << WHERE_SHIFT;
    e->p_u64[2] = 0;
    if (w == IN_TAILS) {
        if (st->num_tails == st->tails_cap) {
            st->tails_cap = st->tails_cap ? 2 * st->tails_cap : 64;
            st->tails = tkv_xrealloc(st->tails, st->tails_cap * sizeof(*st->tails));
        }
        st->tails[st->num_tails] = e;
        e->p_u64[2] = ++st->num_tails;
    }
    if (w == IN_TAILS && was == IN_INTERIOR)
        push_cold(&st->lists[w], e);
    else
        tkv_plist_push_hot(&st->lists[w], e);
}

static void unplace(hazard_state *st, tkv_policy_entry *e)
{
    if (e->p_u64[2]) {
        uint64_t i = e->p_u64[2] - 1;
        tkv_policy_entry *last = st->tails[--st->num_tails];
        st->tails[i] = last;
        last->p_u64[2] = i + 1;
        e->p_u64[2] = 0;
    }
    if (e->prev)
        tkv_plist_unlink(e);
}

/* ---- the put being inserted --------------------------------------------------------------- */
static bool is_hub(const tkv_policy_entry *p) { return p->num_children > 2; }

/* The turn of a put hanging under p: after its deepest block with ghost history, else after
 * p; 1 under a hub (a shared prefix: a new conversation) or from nothing. */
static unsigned put_turn(const hazard_state *st, const tkv_policy_entry *p)
{
    if (st->put_history_turn >= 0)
        return (unsigned)st->put_history_turn + 1;
    return p && !is_hub(p) ? field(p, TURN_SHIFT) + 1 : 1;
}

/* e's open event moves to class c (its features are known now). */
static void reclass(hazard_state *st, tkv_policy_entry *e, unsigned c)
{
    event_end(st, class_of(e), e->p_u64[0], false);
    event_start(st, c, e->p_u64[0]);
}

/* The latest lookup is done with: its hit blocks, from the deepest up, get the turn and new
 * blocks of the put that continued it (turn > 0), or keep their class (turn == 0). Each hit
 * is walked once. */
static void finish_hits(hazard_state *st, unsigned turn, unsigned newb)
{
    for (tkv_policy_entry *e = st->hit_last; e && (e->p_u64[1] & F_IN_LAST_LOOKUP); e = e->parent) {
        e->p_u64[1] &= ~F_IN_LAST_LOOKUP;
        if (!turn)
            continue;
        unsigned uses = field(e, USES_SHIFT), c = make_class(uses, ND - 1, turn, newb);
        reclass(st, e, c);
        set_fields(e, c, uses, field(e, TURN_SHIFT), field(e, NEWB_SHIFT));
    }
    st->hit_last = NULL;
}

/* A put's new content starts at depth `depth`: where this request departs from what the
 * tier has seen. A client whose block is a multiple of the store's (a 512-token hash block
 * over 128-token blocks, say) departs only at its own block boundaries, and a prompt's dead
 * partial block is then that many blocks: the unit of the distance from a put's end and of
 * its new blocks. The largest power of two that nearly all recent departures fall on.
 * (Where puts end says less: a workload of first turns only, all of one length, ends them
 * all on a multiple of that length.) */
static void learn_unit(hazard_state *st, uint64_t depth)
{
    st->unit_starts = st->unit_starts * (1 - kUnitDecay) + 1;
    for (unsigned k = 1; k < NUNIT; k++)
        st->unit_aligned[k] = st->unit_aligned[k] * (1 - kUnitDecay) + (depth % (1ull << k) == 0);
    st->unit = 1;
    for (unsigned k = 1; k < NUNIT && st->unit_starts >= kUnitMinStarts &&
                         st->unit_aligned[k] >= kUnitShare * st->unit_starts;
         k++)
        st->unit <<= 1;
}

/* The put is complete (a lookup, a block that does not continue it, or its newest block
 * leaving): its blocks get their class, now that its end, turn and new blocks are known, and
 * so do the hits of the lookup it continues. */
static void finish_put(hazard_state *st)
{
    tkv_policy_entry *e = st->put_last;
    unsigned turn = put_turn(st, st->put_parent), newb = new_bucket(st->put_new, st->unit);
    for (uint64_t i = 0; e && i < st->put_len; i++, e = e->parent) {
        if (!(e->p_u64[1] & F_IN_OPEN_PUT))
            continue;
        e->p_u64[1] &= ~F_IN_OPEN_PUT;
        unsigned uses = field(e, USES_SHIFT),
                 c = make_class(uses, end_bucket(i, st->unit), turn, newb);
        reclass(st, e, c);
        set_fields(e, c, uses, (e->p_u64[1] & F_HAS_HISTORY) ? field(e, TURN_SHIFT) : turn, newb);
    }
    if (st->put_last && st->hit_last)
        finish_hits(st, st->put_parent == st->hit_last ? turn : 0, newb);
    if (st->put_len > st->guard_longest_put)
        st->guard_longest_put = st->put_len;
    st->put_last = st->put_parent = NULL;
    st->put_len = st->put_new = 0;
    st->put_history_turn = -1;
}

/* The refused put is complete: its blocks' events start, classed by its length, and are
 * remembered (a refused block that comes back is a reuse). */
static void finish_refused(hazard_state *st)
{
    unsigned newb = new_bucket(st->num_refused, st->unit);
    if (st->num_refused > st->guard_longest_put)
        st->guard_longest_put = st->num_refused;
    for (uint64_t i = 0; i < st->num_refused; i++) {
        uint64_t fp = st->refused_fp[i], meta = ghost_take(st, fp);
        unsigned uses = 1;
        if (meta) {
            event_end(st, meta_class(meta), meta_start(st, meta), true);
            uses = meta_uses(meta) + 1;
        }
        unsigned c =
            make_class(uses, end_bucket(st->num_refused - 1 - i, st->unit), st->admit_turn, newb);
        event_start(st, c, st->tick);
        ghost_put(st, fp, st->tick, c, uses > NU ? NU : uses, st->admit_turn);
    }
    st->num_refused = 0;
}

/* ---- the LRU guard ------------------------------------------------------------------------ */
/* The bound, by construction: let lead = the tier's hits - LRU's (on the same requests, block
 * by block) and missing = the blocks LRU holds that the tier does not (the shadow counts
 * both). If from now on the tier follows LRU's set (admits every block, evicts only blocks LRU
 * does not hold: while missing > 0 there is such a tail, as both sets are closed under
 * prefixes, so what the tier holds outside LRU's set hangs below it), no request lowers
 * lead - missing: an LRU-only hit costs a hit but makes the block shared; a tier-only hit, or
 * LRU evicting a block the tier lacks, raises it. So the slack lead - missing + budget stays
 * >= 0 if every step of the learned order that lowers it (a victim LRU holds: 1; a refused
 * put: 1 a block) is taken only when the slack covers it; then the tier's hits are never more
 * than the budget (a fill) below LRU's, on any trace. Pinned blocks and outside blocks deeper
 * than kGuardWalk from the cold end (the rule may find no outside tail) and a put longer than
 * any before it can overdraw it. The budget is what the
 * learned order needs to start: its first bets pay only fills later.
 * Within the bound, the trials: the decayed surplus of real hits over LRU's picks, at every
 * check, whether the tier follows LRU's set (once the learned order has fallen guard_margin
 * hits behind) or the learned order again for a trial after guard_wait (longer after each
 * trial that fails soon). Where the learned order wins it is never overruled; where it loses
 * slowly, it loses about a margin per trial, and the trials grow rarer. Without fingerprints
 * (key_fp 0) there is no guard. */
static void guard_count(hazard_state *st, uint64_t key_fp, bool first_of_request, bool real_hit)
{
    if (!key_fp || !st->lru_shadow)
        return;
    bool lru_hit = tkv_lru_shadow_touch(st->lru_shadow, key_fp, first_of_request, real_hit);
    st->guard_lead += (int64_t)real_hit - (int64_t)lru_hit;
    st->guard_surplus += (double)real_hit - (double)lru_hit;
    if (++st->guard_seen % st->guard_check)
        return;
    st->guard_surplus *= st->guard_keep;
    uint64_t since = st->guard_seen - st->guard_since;
    if (!st->guard_follow) {
        /* judged after a while of its own: a policy that holds blocks for later pays first */
        if (since < st->capacity / kGuardGraceDiv || st->guard_surplus >= -st->guard_margin)
            return;
        st->guard_wait = since < kGuardShortTrials * st->guard_wait
                             ? 2 * st->guard_wait
                             : kGuardFirstWaitFills * st->capacity;
        if (st->guard_wait > kGuardMaxWaitFills * st->capacity)
            st->guard_wait = kGuardMaxWaitFills * st->capacity;
        st->guard_follow = true;
    } else if (since >= st->guard_wait) {
        st->guard_follow = false;
        st->guard_surplus = 0; /* the trial is judged on its own */
    } else {
        return;
    }
    st->guard_since = st->guard_seen;
}

/* The slack now, counting the blocks of the put being admitted as inserted. */
static int64_t guard_slack(const hazard_state *st)
{
    return st->guard_lead + (int64_t)(kGuardBudgetFills * st->capacity + st->guard_pending) -
           (int64_t)tkv_lru_shadow_missing(st->lru_shadow);
}

/* May the learned order take a step that lowers the slack by `cost`? */
static bool guard_allows(const hazard_state *st, int64_t cost)
{
    return !st->lru_shadow || (!st->guard_follow && guard_slack(st) - cost >= 0);
}

/* Does evicting e lower the slack (LRU holds it)? */
static bool guard_costs(const hazard_state *st, const tkv_policy_entry *e)
{
    return tkv_lru_shadow_holds(st->lru_shadow, e->key_fp);
}

/* The coldest tail LRU does not hold among the kGuardWalk coldest, or NULL. Such blocks are
 * the least recently used ones, so they are found at the cold end; the walk is bounded so
 * that a tier holding none costs O(1) (the bound may then be overdrawn by the victim). */
static tkv_policy_entry *guard_outside_tail(const hazard_state *st)
{
    const tkv_policy_entry *head = &st->lists[IN_TAILS];
    tkv_policy_entry *e = head->prev;
    for (int i = 0; i < kGuardWalk && e != head; i++, e = e->prev)
        if (!guard_costs(st, e))
            return e;
    return NULL;
}

/* ---- ops ---------------------------------------------------------------------------------- */
static void *hazard_create(uint64_t capacity)
{
    if (capacity == 0)
        return NULL;
    hazard_state *st = tkv_xcalloc(1, sizeof(*st));
    st->capacity = capacity;
    st->bucket_ticks = (uint64_t)((double)capacity * kBucketPerFill);
    if (st->bucket_ticks < kMinBucket)
        st->bucket_ticks = kMinBucket;
    st->learn_ticks = capacity / kLearnPerFill;
    if (st->learn_ticks < kMinLearn)
        st->learn_ticks = kMinLearn;
    st->rng = 0x9e3779b97f4a7c15ull;
    st->put_history_turn = -1;
    st->unit = 1;
    st->lru_shadow = tkv_lru_shadow_new(capacity);
    st->guard_check = capacity / kGuardChecksPerFill;
    if (st->guard_check < kGuardMinCheck)
        st->guard_check = kGuardMinCheck;
    st->guard_keep = exp2(-1.0 / (kGuardHalfLifeFills * kGuardChecksPerFill));
    st->guard_margin = kGuardMargin * (double)capacity;
    st->guard_wait = kGuardFirstWaitFills * capacity;
    st->guard_longest_put = 1;
    for (int i = 0; i < 3; i++)
        tkv_plist_init(&st->lists[i]);
    return st;
}

static void hazard_destroy(void *state)
{
    hazard_state *st = state;
    free(st->ghost);
    free(st->tails);
    free(st->refused_fp);
    tkv_lru_shadow_free(st->lru_shadow);
    free(st);
}

static uint64_t next_rand(hazard_state *st)
{
    st->rng ^= st->rng << 13;
    st->rng ^= st->rng >> 7;
    st->rng ^= st->rng << 17;
    return st->rng;
}

/* Among equal indices (nothing learned yet, or ages past what was seen), recency plus half
 * a fill of life per prior use. */
static uint64_t tie_prio(const hazard_state *st, const tkv_policy_entry *e)
{
    return e->p_u64[0] + (uint64_t)(field(e, USES_SHIFT) - 1) * (st->capacity / 2);
}

/* The last victim's parent, if the same request used it just before (consecutive ticks: one
 * put, or one lookup), it is an unpinned tail now, of the victim's class, and worth no more
 * than the victim was: the next block of the same suffix. NULL otherwise. */
static tkv_policy_entry *continuation(const hazard_state *st, double *index)
{
    tkv_policy_entry *p = st->victim_parent;
    if (!p || !p->p_u64[2] || p->p_u64[0] + 1 != st->victim_tick ||
        class_of(p) != st->victim_class)
        return NULL;
    *index = index_at(st, class_of(p), p->p_u64[0]);
    return *index <= st->victim_index ? p : NULL;
}

/* The lowest-index tail among the continuation and kSamples random ones (ties: the
 * continuation, then tie_prio); NULL if none. Evicting a suffix in one piece concentrates the
 * loss on one request, where spreading it would leave many requests with a part of a block
 * they reuse as a unit (a client's block larger than the store's) and no use for the rest. */
static tkv_policy_entry *sample_victim(hazard_state *st, double *index)
{
    double bv = HUGE_VAL;
    tkv_policy_entry *chain = continuation(st, &bv), *best = chain;
    for (int i = 0; i < kSamples && st->num_tails; i++) {
        tkv_policy_entry *e = st->tails[next_rand(st) % st->num_tails];
        double v = index_at(st, class_of(e), e->p_u64[0]);
        if (!best || v < bv || (v == bv && best != chain && tie_prio(st, e) < tie_prio(st, best))) {
            best = e;
            bv = v;
        }
    }
    *index = bv;
    return best;
}

/* A put is judged as a whole by its first missing block (the store asks admit() for every
 * block of one put with the same now_ns, and only the first one shows a cached parent): is
 * its class at age 0 worth at least the block it would evict, per tick? Its length is not
 * known yet, so the best of the new-blocks classes stands for it. */
static bool hazard_admit(void *state, const tkv_policy_entry *e, uint64_t now_ns)
{
    hazard_state *st = state;
    /* a new request's first block: a root, not right after a refused block of the same put */
    bool first = !e->parent && !e->depth && !(st->last_call_admit && now_ns == st->last_admit_now);
    guard_count(st, e->key_fp, first, false);
    st->last_call_admit = true;
    st->last_admit_now = now_ns;
    if (!st->admit_valid || now_ns != st->admit_now) {
        finish_refused(st);
        st->guard_pending = 0;
        uint64_t meta = ghost_peek(st, e->key_fp);
        unsigned uses = meta ? meta_uses(meta) + 1 : 1;
        st->admit_turn = meta ? meta_turn(meta) + 1 : put_turn(st, e->parent);
        if (st->admit_turn > NT)
            st->admit_turn = NT;
        bool verdict = true;
        if (st->count >= st->capacity) {
            double mine = 0, theirs;
            for (unsigned b = 0; b < NN; b++) {
                unsigned c = make_class(uses, ND - 1, st->admit_turn, b);
                mine = fmax(mine, index_at(st, c, st->tick));
            }
            verdict = !sample_victim(st, &theirs) || mine >= theirs;
            /* a refused put lowers the slack by a block each (guard_count) */
            if (!verdict && !guard_allows(st, (int64_t)st->guard_longest_put - 1))
                verdict = true;
        }
        st->admit_valid = true;
        st->admit_now = now_ns;
        st->admit_verdict = verdict;
    }
    if (st->admit_verdict)
        st->guard_pending++;
    if (!st->admit_verdict) {
        /* a refused block is a tick of the tier's turnover (with no inserts and no hits the
         * clock would stop and the verdict could never change), and a use, remembered */
        advance(st);
        if (e->key_fp) {
            if (st->num_refused == st->refused_cap) {
                st->refused_cap = st->refused_cap ? 2 * st->refused_cap : 64;
                st->refused_fp = tkv_xrealloc(st->refused_fp, st->refused_cap * sizeof(uint64_t));
            }
            st->refused_fp[st->num_refused++] = e->key_fp;
        }
    }
    return st->admit_verdict;
}

static void hazard_inserted(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    hazard_state *st = state;
    (void)now_ns;
    tkv_policy_entry *p = e->parent;
    finish_refused(st);
    if (!p || p != st->put_last) {
        finish_put(st);
        st->put_parent = p;
    }
    advance(st);
    e->p_u64[0] = st->tick;
    e->p_u64[1] = F_IN_OPEN_PUT;
    e->prev = e->next = NULL;
    unsigned uses = 1;
    uint64_t meta = ghost_take(st, e->key_fp);
    if (st->put_len == 0 && !meta && e->key_fp && e->depth > 0)
        learn_unit(st, e->depth); /* a put starts new content under a known prefix */
    if (meta) { /* it was here, or was refused: looked up again */
        event_end(st, meta_class(meta), meta_start(st, meta), true);
        uses = meta_uses(meta) + 1;
        st->put_history_turn = (int)meta_turn(meta);
        e->p_u64[1] |= F_HAS_HISTORY;
    } else {
        st->put_new++;
    }
    st->put_last = e;
    st->put_len++;
    /* a provisional class until the put ends; a block with history keeps its own turn */
    unsigned turn = put_turn(st, st->put_parent), newb = new_bucket(st->put_new, st->unit);
    unsigned c = make_class(uses, ND - 1, turn, newb);
    set_fields(e, c, uses, meta ? meta_turn(meta) : turn, newb);
    event_start(st, c, st->tick);
    st->count++;
    st->last_call_admit = false;
    tkv_lru_shadow_mark(st->lru_shadow, e->key_fp, true);
    if (st->guard_pending)
        st->guard_pending--;
    place(st, e, IN_TAILS);
}

static void hazard_accessed(void *state, tkv_policy_entry *e, uint64_t now_ns)
{
    hazard_state *st = state;
    (void)now_ns;
    guard_count(st, e->key_fp, !e->parent, true);
    st->guard_pending = 0;
    st->last_call_admit = false;
    if (placed_in(e) == IN_TAILS) { /* LRU's order: a hit goes to the hot end */
        tkv_plist_unlink(e);
        tkv_plist_push_hot(&st->lists[IN_TAILS], e);
    }
    finish_refused(st);
    finish_put(st); /* a lookup: the put before it is complete */
    if (st->hit_last && e->parent != st->hit_last)
        finish_hits(st, 0, 0); /* a new lookup: no put continued the last one */
    event_end(st, class_of(e), e->p_u64[0], true);
    advance(st);
    /* provisionally classed by the put that inserted it, until the put after this lookup */
    unsigned uses = field(e, USES_SHIFT) + 1, turn = field(e, TURN_SHIFT);
    unsigned newb = field(e, NEWB_SHIFT), c = make_class(uses, ND - 1, turn, newb);
    set_fields(e, c, uses, turn, newb);
    e->p_u64[0] = st->tick;
    e->p_u64[1] |= F_IN_LAST_LOOKUP;
    st->hit_last = e;
    event_start(st, c, st->tick);
}

static void hazard_removed(void *state, tkv_policy_entry *e)
{
    hazard_state *st = state;
    if (e == st->put_last)
        finish_put(st);
    if (e == st->put_parent)
        st->put_parent = NULL;
    if (e->p_u64[1] & F_IN_LAST_LOOKUP)
        finish_hits(st, 0, 0);
    if (e == st->victim_parent)
        st->victim_parent = NULL;
    unplace(st, e);
    st->count--;
    tkv_lru_shadow_mark(st->lru_shadow, e->key_fp, false);
    /* its event stays open in the ghost history */
    ghost_put(st, e->key_fp, e->p_u64[0], class_of(e), field(e, USES_SHIFT), field(e, TURN_SHIFT));
}

static void hazard_changed(void *state, tkv_policy_entry *e)
{
    unsigned was = placed_in(e);
    if (was == where_of(e))
        return;
    unplace(state, e);
    place(state, e, was);
}

/* The learned order's victim, or where the slack cannot pay for it (guard_slack) the coldest
 * tail LRU does not hold. */
static tkv_policy_entry *hazard_victim(void *state)
{
    hazard_state *st = state;
    double v;
    tkv_policy_entry *e = sample_victim(st, &v);
    if (e && guard_costs(st, e) && !guard_allows(st, 1)) {
        tkv_policy_entry *o = guard_outside_tail(st);
        if (o) {
            e = o;
            v = index_at(st, class_of(e), e->p_u64[0]);
        }
    }
    if (e) {
        st->victim_parent = e->parent;
        st->victim_tick = e->p_u64[0];
        st->victim_class = class_of(e);
        st->victim_index = v;
        return e;
    }
    tkv_policy_entry *head = &st->lists[IN_INTERIOR];
    return head->prev != head ? head->prev : NULL;
}

const tkv_policy_ops tkv_policy_hazard = {
    .name = "hazard",
    .create = hazard_create,
    .destroy = hazard_destroy,
    .admit = hazard_admit,
    .inserted = hazard_inserted,
    .accessed = hazard_accessed,
    .removed = hazard_removed,
    .changed = hazard_changed,
    .victim = hazard_victim,
};
