/* policy_shadow.c - the shadow LRU directory (see tkv_policy.h): the key fingerprints LRU
 * would hold in a tier of the same capacity, and nothing else (no payloads, no entries).
 *
 * Order: the recency list runs hot to cold; a request's first block goes to the hot end and
 * each later block of the same request just behind the one before it. A request's root then
 * stays hotter than its tail, so the cold end gives tails first, as the store's LRU evicts
 * them (tkv_policy_lru), and what the directory holds is closed under prefixes.
 *
 * Layout: slots hold a fingerprint, two 32-bit links and a bit saying whether the real tier
 * holds the block too; an open-addressing table (linear probing, at most half full,
 * backward-shift deletion) maps a fingerprint to its slot. 24 bytes and a bit per block of
 * capacity, allocated on the first touch. */
#include "tkv_policy.h"

#include "tkv_base.h"

#include <stdlib.h>

enum { kNone = UINT32_MAX };

struct tkv_lru_shadow {
    uint64_t capacity;
    uint64_t *slot_fp;            /* 0: a free slot */
    uint32_t *prev, *next;        /* num_slots + 1 links; the sentinel is index num_slots */
    uint32_t *table;              /* slot + 1, or 0 for empty */
    uint64_t *in_tier;            /* a bit per slot: the real tier holds its block too */
    uint64_t table_mask;
    uint32_t num_slots, num_used, num_in_tier;
    uint32_t last;                /* the previous block of the current request, or kNone */
    bool prefix_hit;              /* every block of the current request so far was held */
};

tkv_lru_shadow *tkv_lru_shadow_new(uint64_t capacity)
{
    if (capacity == 0 || capacity > TKV_LRU_SHADOW_MAX)
        return NULL;
    tkv_lru_shadow *sh = tkv_xcalloc(1, sizeof(*sh));
    sh->capacity = capacity;
    sh->last = kNone;
    return sh;
}

void tkv_lru_shadow_free(tkv_lru_shadow *sh)
{
    if (!sh)
        return;
    free(sh->slot_fp);
    free(sh->prev);
    free(sh->next);
    free(sh->table);
    free(sh->in_tier);
    free(sh);
}

static void shadow_alloc(tkv_lru_shadow *sh)
{
    uint32_t n = (uint32_t)sh->capacity;
    uint64_t tsize = 2;
    while (tsize < 2 * (uint64_t)n)
        tsize <<= 1;
    sh->num_slots = n;
    sh->slot_fp = tkv_xcalloc(n, sizeof(uint64_t));
    sh->prev = tkv_xmalloc(((size_t)n + 1) * sizeof(uint32_t));
    sh->next = tkv_xmalloc(((size_t)n + 1) * sizeof(uint32_t));
    sh->table = tkv_xcalloc(tsize, sizeof(uint32_t));
    sh->in_tier = tkv_xcalloc(((size_t)n + 63) / 64, sizeof(uint64_t));
    sh->table_mask = tsize - 1;
    sh->prev[n] = sh->next[n] = n;
}

static uint64_t home_of(const tkv_lru_shadow *sh, uint64_t fp)
{
    return ((fp * 0x9e3779b97f4a7c15ull) >> 20) & sh->table_mask;
}

/* The table position holding fp's slot, or the empty position where it would go. */
static uint64_t table_pos(const tkv_lru_shadow *sh, uint64_t fp)
{
    uint64_t i = home_of(sh, fp);
    while (sh->table[i] && sh->slot_fp[sh->table[i] - 1] != fp)
        i = (i + 1) & sh->table_mask;
    return i;
}

static void table_delete(tkv_lru_shadow *sh, uint64_t i)
{
    for (uint64_t j = (i + 1) & sh->table_mask; sh->table[j]; j = (j + 1) & sh->table_mask) {
        uint64_t h = home_of(sh, sh->slot_fp[sh->table[j] - 1]);
        /* j's entry may fill the hole at i when its home is not in (i, j] (cyclically) */
        if (((j - h) & sh->table_mask) >= ((j - i) & sh->table_mask)) {
            sh->table[i] = sh->table[j];
            i = j;
        }
    }
    sh->table[i] = 0;
}

static bool bit_of(const tkv_lru_shadow *sh, uint32_t s)
{
    return (sh->in_tier[s / 64] >> (s % 64)) & 1;
}

static void set_bit(tkv_lru_shadow *sh, uint32_t s, bool in_tier)
{
    if (bit_of(sh, s) == in_tier)
        return;
    sh->in_tier[s / 64] ^= 1ull << (s % 64);
    if (in_tier)
        sh->num_in_tier++;
    else
        sh->num_in_tier--;
}

static void unlink_slot(tkv_lru_shadow *sh, uint32_t s)
{
    sh->next[sh->prev[s]] = sh->next[s];
    sh->prev[sh->next[s]] = sh->prev[s];
}

static void link_after(tkv_lru_shadow *sh, uint32_t at, uint32_t s)
{
    sh->prev[s] = at;
    sh->next[s] = sh->next[at];
    sh->prev[sh->next[at]] = s;
    sh->next[at] = s;
}

bool tkv_lru_shadow_touch(tkv_lru_shadow *sh, uint64_t key_fp, bool first_of_request,
                          bool tier_holds)
{
    if (!sh || !key_fp)
        return false;
    if (!sh->slot_fp)
        shadow_alloc(sh);
    const uint32_t head = sh->num_slots;
    if (first_of_request) {
        sh->last = kNone;
        sh->prefix_hit = true;
    }
    uint32_t at = sh->last == kNone ? head : sh->last;
    uint64_t pos = table_pos(sh, key_fp);
    uint32_t s;
    bool held = sh->table[pos] != 0;
    if (held) {
        s = sh->table[pos] - 1;
        if (s == at) { /* the same block twice in a row: it stays where it is */
            if (tier_holds)
                set_bit(sh, s, true);
            return sh->prefix_hit;
        }
        unlink_slot(sh, s);
    } else {
        if (sh->num_used < sh->num_slots) {
            s = sh->num_used++;
        } else {
            s = sh->prev[head]; /* the coldest */
            if (s == at)
                at = sh->prev[s];
            unlink_slot(sh, s);
            table_delete(sh, table_pos(sh, sh->slot_fp[s]));
            pos = table_pos(sh, key_fp);
        }
        sh->slot_fp[s] = key_fp;
        sh->table[pos] = s + 1;
        set_bit(sh, s, false);
    }
    if (tier_holds)
        set_bit(sh, s, true);
    link_after(sh, at, s);
    sh->last = s;
    sh->prefix_hit = sh->prefix_hit && held;
    return sh->prefix_hit;
}

/* The slot holding key_fp, or kNone. */
static uint32_t slot_of(const tkv_lru_shadow *sh, uint64_t key_fp)
{
    if (!sh || !sh->slot_fp || !key_fp)
        return kNone;
    uint64_t pos = table_pos(sh, key_fp);
    return sh->table[pos] ? sh->table[pos] - 1 : kNone;
}

bool tkv_lru_shadow_holds(const tkv_lru_shadow *sh, uint64_t key_fp)
{
    return slot_of(sh, key_fp) != kNone;
}

void tkv_lru_shadow_mark(tkv_lru_shadow *sh, uint64_t key_fp, bool tier_holds)
{
    uint32_t s = slot_of(sh, key_fp);
    if (s != kNone)
        set_bit(sh, s, tier_holds);
}

uint64_t tkv_lru_shadow_missing(const tkv_lru_shadow *sh)
{
    return sh ? sh->num_used - sh->num_in_tier : 0;
}
