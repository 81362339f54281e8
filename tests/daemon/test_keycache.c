/* test_keycache.c - the memo of derived block keys (daemon/keycache.c): every answer equals
 * SHA-256's chain (common/keys.c), for repeats, branches, one changed token, other namespaces,
 * a cache too small for its prompts, and threads sharing it. */
#include <check.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_keys.h"
#include "tkvd_keycache.h"

static const uint8_t kFp[TKV_KEY_BYTES] = {0x42, 0x17, 0x99};

static void tokens(uint64_t seed, uint32_t *t, size_t n)
{
    uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
    for (size_t i = 0; i < n; i++) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        t[i] = (uint32_t)(x % 151936);
    }
}

/* The plain derivation the cache must reproduce. */
static void expected(const char *ns, const uint32_t *t, size_t blocks, uint32_t bt, tkv_key *out)
{
    tkv_key root;
    tkv_key_root(kFp, ns, strlen(ns), &root);
    ck_assert_uint_eq(tkv_key_chain(&root, t, blocks * bt, bt, out, blocks), blocks);
}

static void check_derive(tkvd_keycache *kc, const char *ns, const uint32_t *t, size_t blocks,
                         uint32_t bt)
{
    tkv_key want[64], got[64];
    ck_assert_uint_le(blocks, 64);
    expected(ns, t, blocks, bt, want);
    memset(got, 0, sizeof(got));
    tkvd_keycache_derive(kc, kFp, ns, strlen(ns), t, blocks, bt, got);
    ck_assert_mem_eq(got, want, blocks * sizeof(tkv_key));
}

START_TEST(repeats_are_answered_and_equal)
{
    const uint32_t sizes[] = {16, 64, 128};
    for (size_t s = 0; s < 3; s++) {
        uint32_t bt = sizes[s];
        /* roomy: 800 blocks in >= 28,000 sets of 4, so no set overflows and all repeat */
        tkvd_keycache *kc = tkvd_keycache_new(64u << 20, bt);
        ck_assert_ptr_nonnull(kc);
        uint32_t *t = malloc(64 * bt * sizeof(uint32_t));
        uint64_t hits, misses, total = 0;
        for (uint64_t p = 0; p < 20; p++) {
            size_t blocks = 1 + p * 3 % 40;
            tokens(p, t, blocks * bt);
            check_derive(kc, "ns", t, blocks, bt); /* first time: derived */
            total += blocks;
        }
        tkvd_keycache_counts(kc, &hits, &misses);
        ck_assert_uint_eq(hits, 0);
        ck_assert_uint_eq(misses, total);
        for (uint64_t p = 0; p < 20; p++) {
            size_t blocks = 1 + p * 3 % 40;
            tokens(p, t, blocks * bt);
            check_derive(kc, "ns", t, blocks, bt); /* again: from the cache */
        }
        tkvd_keycache_counts(kc, &hits, &misses);
        ck_assert_uint_eq(hits, total);
        ck_assert_uint_eq(misses, total);
        free(t);
        tkvd_keycache_free(kc);
    }
}
END_TEST

START_TEST(one_token_or_namespace_apart)
{
    const uint32_t bt = 64;
    tkvd_keycache *kc = tkvd_keycache_new(8u << 20, bt);
    ck_assert_ptr_nonnull(kc);
    uint32_t a[16 * 64], b[16 * 64];
    tokens(7, a, 16 * bt);
    check_derive(kc, "tenant-a", a, 16, bt);
    /* the last token of block 5 differs: blocks 0-4 shared, 5.. their own keys */
    memcpy(b, a, sizeof(a));
    b[6 * bt - 1] ^= 1;
    uint64_t h0, m0, h1, m1;
    tkvd_keycache_counts(kc, &h0, &m0);
    check_derive(kc, "tenant-a", b, 16, bt);
    tkvd_keycache_counts(kc, &h1, &m1);
    ck_assert_uint_eq(h1 - h0, 5);
    ck_assert_uint_eq(m1 - m0, 11);
    /* the first token of block 0 differs */
    memcpy(b, a, sizeof(a));
    b[0] ^= 0x80000000u;
    check_derive(kc, "tenant-a", b, 16, bt);
    /* the same tokens in another namespace (another salt): nothing found, other keys */
    tkvd_keycache_counts(kc, &h0, &m0);
    check_derive(kc, "tenant-b", a, 16, bt);
    check_derive(kc, "tenant-a ", a, 16, bt);
    check_derive(kc, "", a, 16, bt);
    tkvd_keycache_counts(kc, &h1, &m1);
    ck_assert_uint_eq(h1 - h0, 0);
    ck_assert_uint_eq(m1 - m0, 48);
    tkv_key ka[16], kb[16];
    tkvd_keycache_derive(kc, kFp, "tenant-a", 8, a, 16, bt, ka);
    tkvd_keycache_derive(kc, kFp, "tenant-b", 8, a, 16, bt, kb);
    for (int i = 0; i < 16; i++)
        ck_assert(memcmp(&ka[i], &kb[i], sizeof(tkv_key)) != 0);
    /* another fingerprint (another model's geometry): other roots, so other keys */
    uint8_t fp2[TKV_KEY_BYTES];
    memcpy(fp2, kFp, sizeof(fp2));
    fp2[31] ^= 1;
    tkv_key root, want[16];
    tkv_key_root(fp2, "tenant-a", 8, &root);
    tkv_key_chain(&root, a, 16 * bt, bt, want, 16);
    tkvd_keycache_derive(kc, fp2, "tenant-a", 8, a, 16, bt, kb);
    ck_assert_mem_eq(kb, want, sizeof(want));
    tkvd_keycache_free(kc);
}
END_TEST

START_TEST(too_small_evicts_but_stays_exact)
{
    const uint32_t bt = 16;
    /* the smallest cache: 64 sets of 4 ways, far fewer than the blocks asked */
    tkvd_keycache *kc = tkvd_keycache_new(64 * 4 * (80 + 4 * bt) + 64 * 4, bt);
    ck_assert_ptr_nonnull(kc);
    uint32_t t[64 * 16];
    for (int round = 0; round < 3; round++)
        for (uint64_t p = 0; p < 50; p++) {
            tokens(p, t, 64 * bt);
            check_derive(kc, "ns", t, 64, bt);
        }
    uint64_t hits, misses;
    tkvd_keycache_counts(kc, &hits, &misses);
    ck_assert_uint_eq(hits + misses, 3 * 50 * 64);
    ck_assert_uint_gt(misses, 50 * 64); /* it could not hold them all */
    tkvd_keycache_free(kc);
    /* too small to be worth it, or a block size it does not take: no cache, still exact */
    ck_assert_ptr_null(tkvd_keycache_new(0, 64));
    ck_assert_ptr_null(tkvd_keycache_new(4096, 64));
    ck_assert_ptr_null(tkvd_keycache_new(8u << 20, 12));
    ck_assert_ptr_null(tkvd_keycache_new(8u << 20, 256));
    tokens(3, t, 8 * bt);
    check_derive(NULL, "ns", t, 8, bt);
}
END_TEST

/* ---- threads ---------------------------------------------------------------------------- */

enum { kPrompts = 24, kBlocks = 12, kBT = 32, kThreads = 4 };
static uint32_t g_tok[kPrompts][kBlocks * kBT];
static tkv_key g_want[kPrompts][kBlocks];
static tkvd_keycache *g_kc;

static void *worker(void *arg)
{
    uint64_t x = (uint64_t)(uintptr_t)arg * 7919 + 1;
    long bad = 0;
    for (int i = 0; i < 3000; i++) {
        x = x * 6364136223846793005ull + 1442695040888963407ull;
        int p = (int)((x >> 33) % kPrompts);
        size_t blocks = 1 + (x >> 13) % kBlocks;
        tkv_key got[kBlocks];
        tkvd_keycache_derive(g_kc, kFp, "shared", 6, g_tok[p], blocks, kBT, got);
        bad += memcmp(got, g_want[p], blocks * sizeof(tkv_key)) != 0;
    }
    return (void *)bad;
}

START_TEST(threads_share_it_exactly)
{
    /* prompts share prefixes (every fourth one starts like the one before it), so threads
     * race on the same sets; small enough that they also evict each other's entries */
    for (int p = 0; p < kPrompts; p++) {
        tokens((uint64_t)p + 100, g_tok[p], kBlocks * kBT);
        if (p % 4)
            memcpy(g_tok[p], g_tok[p - 1], (size_t)(p % 4) * 3 * kBT * sizeof(uint32_t));
        expected("shared", g_tok[p], kBlocks, kBT, g_want[p]);
    }
    g_kc = tkvd_keycache_new(64 * 4 * (80 + 4 * kBT) + 64 * 4, kBT);
    ck_assert_ptr_nonnull(g_kc);
    pthread_t th[kThreads];
    for (uintptr_t i = 0; i < kThreads; i++)
        ck_assert_int_eq(pthread_create(&th[i], NULL, worker, (void *)i), 0);
    long bad = 0;
    for (int i = 0; i < kThreads; i++) {
        void *r;
        pthread_join(th[i], &r);
        bad += (long)r;
    }
    ck_assert_int_eq(bad, 0);
    uint64_t hits, misses;
    tkvd_keycache_counts(g_kc, &hits, &misses);
    ck_assert_uint_gt(hits, 0);
    tkvd_keycache_free(g_kc);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("keycache");
    TCase *tc = tcase_create("core");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, repeats_are_answered_and_equal);
    tcase_add_test(tc, one_token_or_namespace_apart);
    tcase_add_test(tc, too_small_evicts_but_stays_exact);
    tcase_add_test(tc, threads_share_it_exactly);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
