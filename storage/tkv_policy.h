/* tkv_policy.h - the admission + eviction policy interface, one instance per tier.
 *
 * The tier manager embeds one tkv_policy_entry per (block, tier) in its index entries and
 * keeps the structural fields up to date; the policy owns the rest. All calls for one tier
 * are made under that tier's lock, so a policy needs no locking of its own.
 *
 * Contract a policy must keep (tests/storage/test_policy.c checks every registered one):
 *   - victim() never returns an entry with pinned != 0;
 *   - victim() prefers entries with num_children == 0 (chain tails): an entry whose children
 *     are cached in this tier is returned only if no unpinned tail exists;
 *   - it never asks for more than `capacity` entries: the manager evicts until it fits.
 */
#ifndef TKV_POLICY_H
#define TKV_POLICY_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

typedef struct tkv_policy_entry {
    /* ---- maintained by the tier manager (read-only for the policy) ---- */
    struct tkv_policy_entry *parent; /* previous block of the chain in this tier, or NULL */
    uint32_t depth;                  /* index of the block in its chain (0 = first block) */
    uint32_t num_children;           /* cached children of this block in this tier */
    uint32_t pinned;                 /* leases holding it; never evict while nonzero */
    uint32_t flags;                  /* reserved for the manager */
    uint64_t key_fp;                 /* a 64-bit fingerprint of the block's key (the same for
                                      * the same block every time it is offered; uniform
                                      * bits), or 0 where the manager does not give one; set
                                      * in admit()'s probe too. The store gives the first 8
                                      * bytes of the SHA-256 chain key, | 1 */
    /* ---- owned by the policy ---- */
    struct tkv_policy_entry *prev, *next;
    uint64_t p_u64[3];
    double p_score;
} tkv_policy_entry;

typedef struct tkv_policy_ops {
    const char *name;
    /* capacity in entries (blocks) of this tier. Returns state or NULL on bad config. */
    void *(*create)(uint64_t capacity);
    void (*destroy)(void *state);
    /* May this new block enter the tier? (false = it is not cached at this tier). */
    bool (*admit)(void *state, const tkv_policy_entry *e, uint64_t now_ns);
    void (*inserted)(void *state, tkv_policy_entry *e, uint64_t now_ns);
    void (*accessed)(void *state, tkv_policy_entry *e, uint64_t now_ns); /* hit by a lookup */
    void (*removed)(void *state, tkv_policy_entry *e);                  /* left the tier */
    /* Pinned / structural changes, so a policy can keep its candidate set exact. */
    void (*changed)(void *state, tkv_policy_entry *e);
    /* Next block to evict (see the contract above); NULL if every entry is pinned. */
    tkv_policy_entry *(*victim)(void *state);
} tkv_policy_ops;

/* Intrusive circular lists over the policy-owned prev/next links, with a sentinel head
 * (head->next = hottest, head->prev = coldest), for policies that keep recency lists. */
static inline void tkv_plist_init(tkv_policy_entry *head) { head->next = head->prev = head; }

static inline void tkv_plist_unlink(tkv_policy_entry *e)
{
    e->prev->next = e->next;
    e->next->prev = e->prev;
    e->prev = e->next = NULL;
}

static inline void tkv_plist_push_hot(tkv_policy_entry *head, tkv_policy_entry *e)
{
    e->next = head->next;
    e->prev = head;
    head->next->prev = e;
    head->next = e;
}

/* Sets of `ways` entries for a ghost history of per_block entries per block of a tier of
 * `capacity` blocks: at least 1, and at most 2^24 entries in all, so that an unlimited tier
 * (an L3 without a byte limit has capacity UINT64_MAX) gets a bounded table instead of an
 * allocation of its capacity's size (and no out-of-range float conversion). */
static inline uint64_t tkv_policy_ghost_sets(uint64_t capacity, double per_block, unsigned ways)
{
    const double max_entries = (double)(1u << 24);
    double entries = (double)capacity * per_block;
    uint64_t sets = (uint64_t)(entries < max_entries ? entries : max_entries) / ways;
    return sets ? sets : 1;
}

/* A shadow LRU directory: the key fingerprints LRU would hold in a tier of `capacity` blocks
 * given the same requests (metadata only, 24 bytes per block, allocated on the first touch),
 * and which of them the real tier holds too, so a policy can count the hits LRU would have had
 * and the hits it could still lose to LRU (hazard's guard). Each block of a request is touched
 * once, in the request's order, root first: hits (the policy's accessed(), tier_holds true)
 * and misses (admit(), false) alike; the policy marks blocks as they enter and leave the real
 * tier (inserted(), removed()). touch() returns whether LRU would have hit the block (held,
 * and so was every block of the request before it). new() returns NULL for capacity 0 or
 * above TKV_LRU_SHADOW_MAX (an unlimited tier: there is nothing to shadow); on NULL, or with
 * key_fp 0, touch() and holds() return false, mark() does nothing and missing() is 0. O(1). */
#define TKV_LRU_SHADOW_MAX (1ull << 24)
typedef struct tkv_lru_shadow tkv_lru_shadow;
tkv_lru_shadow *tkv_lru_shadow_new(uint64_t capacity);
void tkv_lru_shadow_free(tkv_lru_shadow *sh);
bool tkv_lru_shadow_touch(tkv_lru_shadow *sh, uint64_t key_fp, bool first_of_request,
                          bool tier_holds);
/* Does LRU hold key_fp now? */
bool tkv_lru_shadow_holds(const tkv_lru_shadow *sh, uint64_t key_fp);
/* The real tier now holds key_fp (true) or not (false); nothing if LRU does not hold it. */
void tkv_lru_shadow_mark(tkv_lru_shadow *sh, uint64_t key_fp, bool tier_holds);
/* How many blocks LRU holds that the real tier does not: the most hits LRU could still gain
 * on the real tier, if those were requested next and the tier then followed LRU. */
uint64_t tkv_lru_shadow_missing(const tkv_lru_shadow *sh);

/* Registered policies by name ("lru", "hazard"); NULL if unknown. */
const tkv_policy_ops *tkv_policy_find(const char *name);
/* NULL-terminated list of registered policies (for --help and tests). */
const tkv_policy_ops *const *tkv_policy_all(void);

extern const tkv_policy_ops tkv_policy_lru;
extern const tkv_policy_ops tkv_policy_hazard; /* learned reuse hazard; storage/policy_hazard.c */

#ifdef __cplusplus
}
#endif
#endif
