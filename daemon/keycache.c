/* keycache.c - the memo of derived block keys (see tkvd_keycache.h). */
#include "tkvd_keycache.h"

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/types.h>
#include <time.h>

#include "tkv_base.h"

enum { kWays = 4 };           /* entries per set */
enum { kStripes = 64 };       /* locks; set s takes lock s % kStripes */
enum { kMinSets = 64 };       /* below this a cache is not worth its probes */
enum { kRoots = 8 };          /* namespaces whose root is remembered */
enum { kRootNsMax = 255 };    /* longest namespace the service accepts */

/* One remembered block: key = SHA-256(prev || tokens). The tokens live in kc->tokens at the
 * same index; tag 0 = empty. */
typedef struct kc_slot {
    uint64_t tag;             /* the block's hash | 1 */
    uint32_t used;            /* its set's clock at its last use */
    uint32_t pad;
    tkv_key prev, key;
} kc_slot;

typedef struct kc_root {
    size_t ns_len;            /* SIZE_MAX = empty */
    uint64_t used;
    uint8_t fp[TKV_KEY_BYTES];
    char ns[kRootNsMax];
    tkv_key root;
} kc_root;

struct tkvd_keycache {
    uint32_t block_tokens;
    uint64_t num_sets;
    uint64_t seed[4];         /* random per daemon: clients cannot aim blocks at one set */
    kc_slot *slots;           /* num_sets * kWays */
    uint32_t *tokens;         /* num_sets * kWays * block_tokens */
    uint32_t *clock;          /* per set */
    pthread_mutex_t locks[kStripes];
    pthread_mutex_t root_mu;
    kc_root roots[kRoots];
    uint64_t root_clock;
    atomic_uint_fast64_t hits, misses;
};

/* ---- creation --------------------------------------------------------------------------------- */

tkvd_keycache *tkvd_keycache_new(uint64_t max_bytes, uint32_t block_tokens)
{
    if (block_tokens < 16 || block_tokens > 128 || block_tokens % 8)
        return NULL;
    uint64_t per_set = kWays * (sizeof(kc_slot) + (uint64_t)block_tokens * sizeof(uint32_t)) +
                       sizeof(uint32_t);
    uint64_t sets = max_bytes / per_set;
    if (sets < kMinSets)
        return NULL;
    if (sets > UINT32_MAX)
        sets = UINT32_MAX;
    tkvd_keycache *kc = tkv_xcalloc(1, sizeof(*kc));
    kc->block_tokens = block_tokens;
    kc->num_sets = sets;
    kc->slots = tkv_xcalloc(sets * kWays, sizeof(kc_slot));
    kc->tokens = tkv_xmalloc(sets * kWays * block_tokens * sizeof(uint32_t));
    kc->clock = tkv_xcalloc(sets, sizeof(uint32_t));
    if (getrandom(kc->seed, sizeof(kc->seed), 0) != (ssize_t)sizeof(kc->seed)) {
        /* no entropy yet (early boot): the set choice is then guessable, still exact */
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts);
        for (int i = 0; i < 4; i++)
            kc->seed[i] = ((uint64_t)ts.tv_nsec << 20 ^ (uint64_t)ts.tv_sec) * (2 * i + 1) +
                          0x9e3779b97f4a7c15ull * (uint64_t)(i + 1);
    }
    for (int i = 0; i < kStripes; i++)
        pthread_mutex_init(&kc->locks[i], NULL);
    pthread_mutex_init(&kc->root_mu, NULL);
    for (int i = 0; i < kRoots; i++)
        kc->roots[i].ns_len = SIZE_MAX;
    atomic_init(&kc->hits, 0);
    atomic_init(&kc->misses, 0);
    return kc;
}

void tkvd_keycache_free(tkvd_keycache *kc)
{
    if (!kc)
        return;
    for (int i = 0; i < kStripes; i++)
        pthread_mutex_destroy(&kc->locks[i]);
    pthread_mutex_destroy(&kc->root_mu);
    free(kc->slots);
    free(kc->tokens);
    free(kc->clock);
    free(kc);
}

void tkvd_keycache_counts(const tkvd_keycache *kc, uint64_t *hits, uint64_t *misses)
{
    *hits = kc ? atomic_load_explicit(&kc->hits, memory_order_relaxed) : 0;
    *misses = kc ? atomic_load_explicit(&kc->misses, memory_order_relaxed) : 0;
}

/* ---- the block hash (picks a set; never trusted for equality) --------------------------------- */

static inline uint64_t rotl(uint64_t x, int r) { return x << r | x >> (64 - r); }

static inline uint64_t load64(const void *p)
{
    uint64_t v;
    memcpy(&v, p, sizeof(v));
    return v;
}

/* Four independent multiply-rotate lanes over the previous key and the tokens (block_tokens
 * is a multiple of 8, so the words split evenly): ~25 ns for 64 tokens where SHA-256 takes
 * ~270 ns with the CPU's SHA instructions. */
static uint64_t block_hash(const tkvd_keycache *kc, const tkv_key *prev, const uint32_t *tok)
{
    const uint64_t m = 0x9fb21c651e98df25ull;
    uint64_t a = kc->seed[0] ^ load64(prev->b), b = kc->seed[1] ^ load64(prev->b + 8),
             c = kc->seed[2] ^ load64(prev->b + 16), d = kc->seed[3] ^ load64(prev->b + 24);
    const uint8_t *p = (const uint8_t *)tok;
    size_t words = kc->block_tokens / 2;
    for (size_t j = 0; j < words; j += 4, p += 32) {
        a = rotl(a ^ load64(p), 29) * m;
        b = rotl(b ^ load64(p + 8), 29) * m;
        c = rotl(c ^ load64(p + 16), 29) * m;
        d = rotl(d ^ load64(p + 24), 29) * m;
    }
    uint64_t h = a ^ rotl(b, 17) ^ rotl(c, 31) ^ rotl(d, 47);
    h ^= h >> 32;
    h *= 0xd6e8feb86659fd93ull;
    h ^= h >> 32;
    return h | 1;
}

/* ---- lookups ---------------------------------------------------------------------------------- */

static bool slot_matches(const tkvd_keycache *kc, size_t i, uint64_t tag, const tkv_key *prev,
                         const uint32_t *tok)
{
    return kc->slots[i].tag == tag && memcmp(kc->slots[i].prev.b, prev->b, TKV_KEY_BYTES) == 0 &&
           memcmp(kc->tokens + i * kc->block_tokens, tok, kc->block_tokens * sizeof(*tok)) == 0;
}

/* The key of one block from the cache (true), or false. */
static bool find(tkvd_keycache *kc, uint64_t set, uint64_t tag, const tkv_key *prev,
                 const uint32_t *tok, tkv_key *out)
{
    bool hit = false;
    pthread_mutex_t *mu = &kc->locks[set % kStripes];
    pthread_mutex_lock(mu);
    for (size_t i = set * kWays; i < (set + 1) * kWays; i++)
        if (slot_matches(kc, i, tag, prev, tok)) {
            *out = kc->slots[i].key;
            kc->slots[i].used = ++kc->clock[set];
            hit = true;
            break;
        }
    pthread_mutex_unlock(mu);
    return hit;
}

/* Remembers a derived block in its set: an empty way, else the least recently used one
 * (unless another thread remembered the same block meanwhile). */
static void remember(tkvd_keycache *kc, uint64_t set, uint64_t tag, const tkv_key *prev,
                     const uint32_t *tok, const tkv_key *key)
{
    pthread_mutex_t *mu = &kc->locks[set % kStripes];
    pthread_mutex_lock(mu);
    uint32_t now = ++kc->clock[set];
    size_t victim = set * kWays;
    uint32_t oldest = 0;
    for (size_t i = set * kWays; i < (set + 1) * kWays; i++) {
        if (slot_matches(kc, i, tag, prev, tok)) {
            victim = SIZE_MAX;
            break;
        }
        uint32_t age = kc->slots[i].tag ? now - kc->slots[i].used : UINT32_MAX;
        if (age > oldest) {
            oldest = age;
            victim = i;
        }
    }
    if (victim != SIZE_MAX) {
        kc_slot *s = &kc->slots[victim];
        s->tag = tag;
        s->used = now;
        s->prev = *prev;
        s->key = *key;
        memcpy(kc->tokens + victim * kc->block_tokens, tok, kc->block_tokens * sizeof(*tok));
    }
    pthread_mutex_unlock(mu);
}

/* The namespace's root, remembered for the last kRoots namespaces (one SHA-256 per call). */
static void root_of(tkvd_keycache *kc, const uint8_t fp[TKV_KEY_BYTES], const char *ns,
                    size_t ns_len, tkv_key *root)
{
    if (ns_len > kRootNsMax) {
        tkv_key_root(fp, ns, ns_len, root);
        return;
    }
    pthread_mutex_lock(&kc->root_mu);
    kc_root *oldest = &kc->roots[0];
    for (int i = 0; i < kRoots; i++) {
        kc_root *r = &kc->roots[i];
        if (r->ns_len == ns_len && memcmp(r->ns, ns, ns_len) == 0 &&
            memcmp(r->fp, fp, TKV_KEY_BYTES) == 0) {
            r->used = ++kc->root_clock;
            *root = r->root;
            pthread_mutex_unlock(&kc->root_mu);
            return;
        }
        if (r->used < oldest->used)
            oldest = r;
    }
    pthread_mutex_unlock(&kc->root_mu);
    tkv_key_root(fp, ns, ns_len, root);
    pthread_mutex_lock(&kc->root_mu);
    oldest->ns_len = ns_len;
    memcpy(oldest->ns, ns, ns_len);
    memcpy(oldest->fp, fp, TKV_KEY_BYTES);
    oldest->root = *root;
    oldest->used = ++kc->root_clock;
    pthread_mutex_unlock(&kc->root_mu);
}

void tkvd_keycache_derive(tkvd_keycache *kc, const uint8_t fingerprint[TKV_KEY_BYTES],
                          const char *ns, size_t ns_len, const uint32_t *tokens,
                          size_t num_blocks, uint32_t block_tokens, tkv_key *out)
{
    tkv_key root;
    if (!kc) {
        tkv_key_root(fingerprint, ns, ns_len, &root);
        size_t n = tkv_key_chain(&root, tokens, num_blocks * block_tokens, block_tokens, out,
                                 num_blocks);
        TKV_ASSERT(n == num_blocks);
        return;
    }
    TKV_ASSERT(block_tokens == kc->block_tokens);
    root_of(kc, fingerprint, ns, ns_len, &root);
    const tkv_key *prev = &root;
    uint64_t hits = 0;
    for (size_t i = 0; i < num_blocks; i++) {
        const uint32_t *tok = tokens + i * (size_t)block_tokens;
        uint64_t tag = block_hash(kc, prev, tok), set = ((tag >> 32) * kc->num_sets) >> 32;
        if (find(kc, set, tag, prev, tok, &out[i])) {
            hits++;
        } else {
            TKV_ASSERT(tkv_key_chain(prev, tok, block_tokens, block_tokens, &out[i], 1) == 1);
            remember(kc, set, tag, prev, tok, &out[i]);
        }
        prev = &out[i];
    }
    atomic_fetch_add_explicit(&kc->hits, hits, memory_order_relaxed);
    atomic_fetch_add_explicit(&kc->misses, num_blocks - hits, memory_order_relaxed);
}
