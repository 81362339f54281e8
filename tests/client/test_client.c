/* test_client.c - libkvclient against a real tierkvd: put/lookup/get bit-exact by value and
 * through the mapped pool, alloc/write/commit, prefetch from L3 after an eviction, leases of
 * a SIGKILLed client released, and the errors a caller sees.
 *
 * One daemon serves the whole suite (started in main, before Check forks the tests); every
 * test uses its own prompts (distinct seeds), so tests do not see each other's blocks.
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static tkvt_daemon g_d;

#define BT TKVT_BLOCK_TOKENS

/* Puts blocks [0, nblocks) of prompt `seed` (tokens of nblocks full blocks + tail extra). */
static void put_prompt(kvc_client *c, uint64_t seed, uint32_t nblocks, uint32_t *tokens)
{
    size_t bb = kvc_block_bytes(c);
    uint8_t *pay = malloc((size_t)nblocks * bb);
    ck_assert_ptr_nonnull(pay);
    for (uint32_t i = 0; i < nblocks; i++)
        tkvt_payload(seed, i, pay + (size_t)i * bb, bb);
    kvc_put_result r;
    int rc = kvc_put(c, tokens, (size_t)nblocks * BT, 0, pay, nblocks, &r);
    ck_assert_msg(rc == KVC_OK, "put: %s", kvc_last_error());
    ck_assert_uint_eq(r.num_stored + r.num_duplicate, nblocks);
    free(pay);
}

/* Gets every block of the lease and checks it against the prompt's payloads. */
static void check_get(kvc_client *c, const kvc_lease *l, uint64_t seed)
{
    uint32_t n = kvc_lease_num_blocks(l);
    size_t bb = kvc_block_bytes(c);
    uint8_t *got = malloc((size_t)n * bb + 1), *want = malloc(bb);
    ck_assert_ptr_nonnull(got);
    int rc = kvc_get(c, l, 0, 0, got, (size_t)n * bb);
    ck_assert_msg(rc == KVC_OK, "get: %s", kvc_last_error());
    for (uint32_t i = 0; i < n; i++) {
        tkvt_payload(seed, i, want, bb);
        ck_assert_msg(memcmp(want, got + (size_t)i * bb, bb) == 0, "block %u differs", i);
    }
    free(got);
    free(want);
}

/* ---- put / lookup / get ------------------------------------------------------------------ */

START_TEST(test_put_lookup_get_by_value)
{
    kvc_client *c;
    ck_assert_msg(tkvt_connect(&g_d, 0, &c) == KVC_OK, "%s", kvc_last_error());
    ck_assert_int_eq(kvc_is_attached(c), 0);
    ck_assert_uint_eq(kvc_block_tokens(c), BT);
    ck_assert_uint_eq(kvc_block_bytes(c), 2 * BT * TKVT_HEAD_DIM); /* fp8, 1 layer, 1 head */
    const uint32_t nb = 100; /* > 64 blocks: the put and the get each span two messages */
    uint32_t tokens[100 * BT + 7];
    tkvt_tokens(101, tokens, sizeof(tokens) / sizeof(tokens[0]));

    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, nb * BT + 7, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 0);
    ck_assert_uint_eq(kvc_lease_num_query_blocks(l), nb); /* the 7-token tail is not keyed */
    ck_assert_uint_eq(kvc_lease_id(l), 0);
    ck_assert_int_eq(kvc_release(c, l), KVC_OK);

    put_prompt(c, 101, nb, tokens);
    ck_assert_int_eq(kvc_lookup(c, tokens, nb * BT + 7, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), nb);
    ck_assert_uint_ne(kvc_lease_id(l), 0);
    for (uint32_t i = 0; i < nb; i++)
        ck_assert_int_ne(kvc_lease_tier(l, i), KVC_TIER_NONE);
    check_get(c, l, 101);
    ck_assert_int_eq(kvc_release(c, l), KVC_OK);

    /* a prompt that shares the first 10 blocks and then diverges hits exactly 10 */
    tokens[10 * BT + 3] ^= 1;
    ck_assert_int_eq(kvc_lookup(c, tokens, nb * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 10);
    check_get(c, l, 101);
    ck_assert_int_eq(kvc_release(c, l), KVC_OK);

    /* putting the same blocks again stores nothing new */
    tokens[10 * BT + 3] ^= 1;
    size_t bb = kvc_block_bytes(c);
    uint8_t *pay = malloc(4 * bb);
    for (uint32_t i = 0; i < 4; i++)
        tkvt_payload(101, i, pay + i * bb, bb);
    kvc_put_result r;
    ck_assert_int_eq(kvc_put(c, tokens, 4 * BT, 0, pay, 4, &r), KVC_OK);
    ck_assert_uint_eq(r.num_stored, 0);
    ck_assert_uint_eq(r.num_duplicate, 4);
    free(pay);
    kvc_close(c);
}
END_TEST

START_TEST(test_namespaces_are_separate)
{
    kvc_client *a, *b;
    ck_assert_int_eq(tkvt_connect(&g_d, 0, &a), KVC_OK);
    kvc_opts *o = tkvt_opts(&g_d, 0);
    ck_assert_int_eq(kvc_opts_set_namespace(o, "tenant-b"), KVC_OK);
    ck_assert_int_eq(kvc_connect(o, &b), KVC_OK);
    kvc_opts_free(o);
    uint32_t tokens[8 * BT];
    tkvt_tokens(202, tokens, 8 * BT);
    put_prompt(a, 202, 8, tokens);
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(b, tokens, 8 * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 0); /* tenant b cannot see tenant a's prefix */
    kvc_release(b, l);
    ck_assert_int_eq(kvc_lookup(a, tokens, 8 * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 8);
    kvc_release(a, l);
    kvc_close(a);
    kvc_close(b);
}
END_TEST

START_TEST(test_get_through_mapped_pool)
{
    kvc_client *c, *v;
    ck_assert_msg(tkvt_connect(&g_d, 1, &c) == KVC_OK, "%s", kvc_last_error());
    ck_assert_int_eq(kvc_is_attached(c), 1);
    ck_assert_uint_ne(kvc_client_id(c), 0);
    ck_assert_int_eq(tkvt_connect(&g_d, 0, &v), KVC_OK);
    const uint32_t nb = 20;
    uint32_t tokens[20 * BT];
    tkvt_tokens(303, tokens, nb * BT);
    put_prompt(c, 303, nb, tokens);

    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, nb * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), nb);
    /* make sure every block is in L2, then every one must be readable in place */
    ck_assert_msg(kvc_wait(c, l, KVC_TIER_L2, 10000) == KVC_OK, "%s", kvc_last_error());
    size_t bb = kvc_block_bytes(c);
    uint8_t *want = malloc(bb);
    for (uint32_t i = 0; i < nb; i++) {
        const uint8_t *p = kvc_lease_block_ptr(c, l, i);
        ck_assert_msg(p != NULL, "block %u is not mapped (tier %s)", i,
                      kvc_tier_name(kvc_lease_tier(l, i)));
        tkvt_payload(303, i, want, bb);
        ck_assert_msg(memcmp(p, want, bb) == 0, "mapped block %u differs", i);
    }
    free(want);
    check_get(c, l, 303);
    /* the same blocks by value, through a client that did not attach */
    kvc_lease *lv;
    ck_assert_int_eq(kvc_lookup(v, tokens, nb * BT, 0, &lv), KVC_OK);
    ck_assert_ptr_null(kvc_lease_block_ptr(v, lv, 0));
    check_get(v, lv, 303);
    kvc_release(v, lv);
    kvc_release(c, l);
    kvc_close(c);
    kvc_close(v);
}
END_TEST

START_TEST(test_alloc_write_commit)
{
    kvc_client *c;
    ck_assert_int_eq(tkvt_connect(&g_d, 1, &c), KVC_OK);
    size_t bb = kvc_block_bytes(c);
    const uint32_t nb = 5;
    uint32_t tokens[5 * BT];
    tkvt_tokens(404, tokens, nb * BT);
    uint64_t id = 0, offs[5];
    ck_assert_msg(kvc_alloc(c, nb, &id, offs) == KVC_OK, "%s", kvc_last_error());
    ck_assert_uint_ne(id, 0);
    uint8_t *pay = malloc(bb);
    for (uint32_t i = 0; i < nb; i++) {
        ck_assert_msg(offs[i] % bb == 0, "slot offset %llu not block aligned",
                      (unsigned long long)offs[i]);
        tkvt_payload(404, i, pay, bb);
        ck_assert_msg(kvc_write(c, id, i, pay, bb) == KVC_OK, "%s", kvc_last_error());
    }
    /* not visible before the commit */
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, nb * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 0);
    kvc_release(c, l);
    kvc_put_result r;
    ck_assert_msg(kvc_commit(c, id, tokens, nb * BT, 0, nb, &r) == KVC_OK, "%s",
                  kvc_last_error());
    ck_assert_uint_eq(r.num_stored, nb);
    ck_assert_int_eq(kvc_lookup(c, tokens, nb * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), nb);
    check_get(c, l, 404);
    kvc_release(c, l);

    /* an aborted allocation never becomes visible, and its id is gone */
    uint32_t t2[2 * BT];
    tkvt_tokens(405, t2, 2 * BT);
    ck_assert_int_eq(kvc_alloc(c, 2, &id, NULL), KVC_OK);
    tkvt_payload(405, 0, pay, bb);
    ck_assert_int_eq(kvc_write(c, id, 0, pay, bb), KVC_OK);
    ck_assert_int_eq(kvc_abort(c, id), KVC_OK);
    ck_assert_int_eq(kvc_commit(c, id, t2, 2 * BT, 0, 1, NULL), KVC_ENOTFOUND);
    ck_assert_int_eq(kvc_lookup(c, t2, 2 * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 0);
    kvc_release(c, l);
    /* a write of the wrong size is refused by the client itself */
    ck_assert_int_eq(kvc_write(c, id, 0, pay, bb - 1), KVC_EINVAL);
    free(pay);
    kvc_close(c);
}
END_TEST

START_TEST(test_prefetch_from_l3_after_evict)
{
    kvc_client *c;
    ck_assert_int_eq(tkvt_connect(&g_d, 1, &c), KVC_OK);
    const uint32_t nb = 12;
    uint32_t tokens[12 * BT];
    tkvt_tokens(505, tokens, nb * BT);
    put_prompt(c, 505, nb, tokens);
    ck_assert_msg(kvc_flush(c) == KVC_OK, "flush: %s", kvc_last_error());
    uint32_t evicted = 0, pinned = 0;
    ck_assert_msg(kvc_evict(c, KVC_TIER_L2, tokens, nb * BT, &evicted, &pinned) == KVC_OK,
                  "evict: %s", kvc_last_error());
    ck_assert_uint_eq(evicted, nb);
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, nb * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), nb);
    for (uint32_t i = 0; i < nb; i++) {
        ck_assert_int_eq(kvc_lease_tier(l, i), KVC_TIER_L3);
        ck_assert_ptr_null(kvc_lease_block_ptr(c, l, i));
    }
    uint64_t ticket = 0;
    ck_assert_msg(kvc_prefetch(c, l, KVC_TIER_L2, &ticket) == KVC_OK, "%s", kvc_last_error());
    ck_assert_msg(kvc_wait(c, l, KVC_TIER_L2, 10000) == KVC_OK, "%s", kvc_last_error());
    ck_assert_uint_eq(kvc_lease_num_blocks(l), nb);
    for (uint32_t i = 0; i < nb; i++) {
        ck_assert_int_eq(kvc_lease_tier(l, i), KVC_TIER_L2);
        ck_assert_ptr_nonnull(kvc_lease_block_ptr(c, l, i));
    }
    check_get(c, l, 505);
    kvc_release(c, l);
    kvc_close(c);
}
END_TEST

START_TEST(test_get_from_l3_by_value)
{
    kvc_client *c;
    ck_assert_int_eq(tkvt_connect(&g_d, 0, &c), KVC_OK);
    const uint32_t nb = 6;
    uint32_t tokens[6 * BT];
    tkvt_tokens(506, tokens, nb * BT);
    put_prompt(c, 506, nb, tokens);
    ck_assert_int_eq(kvc_flush(c), KVC_OK);
    uint32_t evicted = 0;
    ck_assert_int_eq(kvc_evict(c, KVC_TIER_L2, tokens, nb * BT, &evicted, NULL), KVC_OK);
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, nb * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), nb);
    check_get(c, l, 506); /* straight from L3, checksum verified by the daemon */
    kvc_release(c, l);
    kvc_close(c);
}
END_TEST

START_TEST(test_cost_check)
{
    kvc_client *c;
    ck_assert_int_eq(tkvt_connect(&g_d, 0, &c), KVC_OK);
    const uint32_t nb = 6;
    uint32_t tokens[6 * BT];
    tkvt_tokens(507, tokens, nb * BT);
    put_prompt(c, 507, nb, tokens);
    ck_assert_int_eq(kvc_flush(c), KVC_OK);
    ck_assert_int_eq(kvc_evict(c, KVC_TIER_L2, tokens, nb * BT, NULL, NULL), KVC_OK);
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, nb * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), nb);
    kvc_cost k;
    /* all six blocks are in L3: restoring them to L2 costs time, far less than an hour */
    ck_assert_msg(kvc_cost_check(c, l, 3600e3, KVC_TIER_L2, &k) == KVC_OK, "%s",
                  kvc_last_error());
    ck_assert_uint_eq(k.blocks_from_l3, nb);
    ck_assert_uint_eq(k.blocks_in_tier + k.blocks_from_l2, 0);
    ck_assert(k.restore_ms > 0 && k.restore_ms < 3600e3);
    ck_assert_int_eq(k.use_cache, 1);
    /* ... and more than a nanosecond of prefill */
    ck_assert_int_eq(kvc_cost_check(c, l, 1e-6, KVC_TIER_L2, &k), KVC_OK);
    ck_assert_int_eq(k.use_cache, 0);
    ck_assert_int_eq(kvc_cost_check(c, l, 0, KVC_TIER_L2, &k), KVC_EINVAL);
    ck_assert_int_eq(kvc_cost_check(c, l, 1, KVC_TIER_L3, &k), KVC_EINVAL);
    kvc_release(c, l);
    kvc_close(c);
}
END_TEST

/* ---- a client that dies holding leases --------------------------------------------------- */

static uint64_t leases_now(kvc_client *c)
{
    kvc_stats s;
    ck_assert_int_eq(kvc_stats_get(c, &s), KVC_OK);
    return s.leases_active;
}

START_TEST(test_sigkill_releases_leases)
{
    int pfd[2];
    ck_assert_int_eq(pipe(pfd), 0);
    /* fork before this process touches gRPC: the child is a fresh client process */
    pid_t child = fork();
    ck_assert_int_ge(child, 0);
    if (child == 0) {
        close(pfd[0]);
        kvc_client *c;
        if (tkvt_connect(&g_d, 1, &c) != KVC_OK) {
            fprintf(stderr, "child: connect: %s\n", kvc_last_error());
            _exit(1);
        }
        uint32_t tokens[4 * BT];
        tkvt_tokens(606, tokens, 4 * BT);
        size_t bb = kvc_block_bytes(c);
        uint8_t *pay = malloc(4 * bb);
        for (uint32_t i = 0; i < 4; i++)
            tkvt_payload(606, i, pay + i * bb, bb);
        if (kvc_put(c, tokens, 4 * BT, 0, pay, 4, NULL) != KVC_OK) {
            fprintf(stderr, "child: put: %s\n", kvc_last_error());
            _exit(2);
        }
        /* 5 leases with a long TTL: only the disconnect can end them in time */
        for (int i = 0; i < 5; i++) {
            kvc_lease *l;
            if (kvc_lookup(c, tokens, 4 * BT, 600000, &l) != KVC_OK) {
                fprintf(stderr, "child: lookup: %s\n", kvc_last_error());
                _exit(3);
            }
            if (kvc_lease_num_blocks(l) != 4)
                _exit(5);
        }
        char ok = 'k';
        if (write(pfd[1], &ok, 1) != 1)
            _exit(4);
        for (;;)
            pause();
    }
    close(pfd[1]);
    char got = 0;
    if (read(pfd[0], &got, 1) != 1) {
        int cst = 0;
        waitpid(child, &cst, 0);
        ck_abort_msg("the lease-holding child failed before it was ready (exit %d)",
                     WIFEXITED(cst) ? WEXITSTATUS(cst) : -1);
    }
    close(pfd[0]);
    ck_assert_int_eq(got, 'k');

    kvc_client *c;
    ck_assert_int_eq(tkvt_connect(&g_d, 0, &c), KVC_OK);
    uint64_t before = leases_now(c);
    ck_assert_uint_ge(before, 5);
    kill(child, SIGKILL);
    int st;
    waitpid(child, &st, 0);
    ck_assert(WIFSIGNALED(st));
    double deadline = tkvt_now() + 10;
    uint64_t after = before;
    while (tkvt_now() < deadline && (after = leases_now(c)) > before - 5)
        tkvt_sleep_ms(20);
    ck_assert_msg(after <= before - 5, "leases %llu -> %llu after the holder died",
                  (unsigned long long)before, (unsigned long long)after);
    /* the daemon still serves others, and the dead client's blocks are still there */
    uint32_t tokens[4 * BT];
    tkvt_tokens(606, tokens, 4 * BT);
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, 4 * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 4);
    check_get(c, l, 606);
    kvc_release(c, l);
    kvc_close(c);
}
END_TEST

/* ---- errors -------------------------------------------------------------------------------- */

START_TEST(test_errors)
{
    kvc_client *c = NULL;
    /* nobody listening */
    kvc_opts *o = kvc_opts_new();
    char path[160];
    snprintf(path, sizeof(path), "%s/nobody.sock", g_d.dir);
    ck_assert_int_eq(kvc_opts_set_socket(o, path), KVC_OK);
    ck_assert_int_eq(kvc_opts_set_timeout_ms(o, 2000), KVC_OK);
    ck_assert_int_eq(kvc_connect(o, &c), KVC_EUNAVAILABLE);
    ck_assert_ptr_null(c);
    ck_assert(strstr(kvc_last_error(), "nobody.sock") != NULL);
    kvc_opts_free(o);

    /* bad options are refused by the setters, with a reason */
    o = kvc_opts_new();
    ck_assert_int_eq(kvc_opts_set_geometry(o, 1, 1, 65, 16, "fp8_e4m3", "per_tensor", "m"),
                     KVC_EINVAL);
    ck_assert(strstr(kvc_last_error(), "head_dim") != NULL ||
              strstr(kvc_last_error(), "head dim") != NULL);
    ck_assert_int_eq(kvc_opts_set_geometry(o, 1, 1, 64, 16, "fp16", "per_tensor", "m"),
                     KVC_EINVAL);
    ck_assert_int_eq(kvc_opts_set_timeout_ms(o, 0), KVC_EINVAL);
    char longpath[200];
    memset(longpath, 'a', sizeof(longpath) - 1);
    longpath[sizeof(longpath) - 1] = '\0';
    ck_assert_int_eq(kvc_opts_set_socket(o, longpath), KVC_EINVAL);
    kvc_opts_free(o);

    /* another model's geometry: refused at connect, and by the attach handshake */
    o = tkvt_opts(&g_d, 0);
    ck_assert_int_eq(kvc_opts_set_geometry(o, 2, 1, 64, 16, "fp8_e4m3", "per_tensor",
                                           TKVT_MODEL), KVC_OK);
    ck_assert_int_eq(kvc_connect(o, &c), KVC_EGEOMETRY);
    ck_assert_str_eq(kvc_strerror(KVC_EGEOMETRY), "geometry fingerprint mismatch");
    kvc_opts_free(o);

    ck_assert_int_eq(tkvt_connect(&g_d, 0, &c), KVC_OK);
    uint32_t tokens[3 * BT];
    tkvt_tokens(707, tokens, 3 * BT);
    put_prompt(c, 707, 3, tokens);
    /* a lease that expired: its blocks can no longer be read through it */
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, 3 * BT, 50, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 3);
    tkvt_sleep_ms(400);
    size_t bb = kvc_block_bytes(c);
    uint8_t *buf = malloc(3 * bb);
    int rc = kvc_get(c, l, 0, 3, buf, 3 * bb);
    ck_assert_msg(rc == KVC_ENOTFOUND, "get on an expired lease: %d %s", rc, kvc_last_error());
    ck_assert(kvc_last_error()[0] != '\0');
    kvc_release(c, l); /* frees it even though the daemon no longer knows it */

    /* client-side argument checks */
    ck_assert_int_eq(kvc_lookup(c, tokens, 3 * BT, 0, &l), KVC_OK);
    ck_assert_int_eq(kvc_get(c, l, 2, 5, buf, 3 * bb), KVC_EINVAL);  /* past the lease */
    ck_assert_int_eq(kvc_get(c, l, 0, 3, buf, 3 * bb - 1), KVC_EINVAL); /* buffer too small */
    ck_assert_int_eq(kvc_prefetch(c, l, KVC_TIER_L3, NULL), KVC_EINVAL);
    kvc_release(c, l);
    ck_assert_int_eq(kvc_put(c, tokens, 2 * BT, 0, buf, 3, NULL), KVC_EINVAL); /* too few tokens */
    ck_assert_int_eq(kvc_evict(c, KVC_TIER_NONE, NULL, 0, NULL, NULL), KVC_EINVAL);
    ck_assert_int_eq(kvc_evict(c, 9, NULL, 0, NULL, NULL), KVC_EINVAL);
    free(buf);

    kvc_health h;
    ck_assert_int_eq(kvc_health_get(c, &h), KVC_OK);
    ck_assert(strcmp(h.status, "serving") == 0 || strcmp(h.status, "degraded") == 0);
    kvc_close(c);
}
END_TEST

/* counts listed blocks and checks each one's fields are well-formed */
typedef struct block_count {
    int n, bad;
} block_count;

static int count_block(void *arg, const kvc_block_info *b)
{
    block_count *k = arg;
    k->n++;
    if (strlen(b->key_hex) != 64 || (b->parent_hex[0] && strlen(b->parent_hex) != 64) ||
        !b->state[0])
        k->bad++;
    return 0;
}

START_TEST(test_stats_blocks_verify)
{
    kvc_client *c;
    ck_assert_int_eq(tkvt_connect(&g_d, 0, &c), KVC_OK);
    uint32_t tokens[4 * BT];
    tkvt_tokens(808, tokens, 4 * BT);
    kvc_stats s0, s1;
    ck_assert_int_eq(kvc_stats_get(c, &s0), KVC_OK);
    put_prompt(c, 808, 4, tokens);
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, 4 * BT, 0, &l), KVC_OK);
    kvc_release(c, l);
    ck_assert_int_eq(kvc_stats_get(c, &s1), KVC_OK);
    ck_assert_uint_ge(s1.lookups, s0.lookups + 1);
    ck_assert_uint_ge(s1.hit_blocks, s0.hit_blocks + 4);
    ck_assert_uint_ge(s1.puts, s0.puts + 1);
    ck_assert_uint_eq(s1.block_tokens, BT);
    ck_assert_str_eq(s1.model_id, TKVT_MODEL);
    ck_assert_uint_ge(s1.tiers[KVC_TIER_L2].blocks, 4);

    uint64_t total = 0;
    ck_assert_int_eq(kvc_list_blocks(c, KVC_TIER_NONE, 0, NULL, NULL, &total), KVC_EINVAL);
    block_count k = {0, 0};
    ck_assert_int_eq(kvc_list_blocks(c, KVC_TIER_NONE, 1000, count_block, &k, &total), KVC_OK);
    ck_assert_int_gt(k.n, 0);
    ck_assert_int_eq(k.bad, 0);
    ck_assert_uint_ge(total, 4);

    uint64_t bad = 99;
    ck_assert_int_eq(kvc_flush(c), KVC_OK);
    ck_assert_msg(kvc_verify(c, 60000, NULL, NULL, &bad) == KVC_OK, "%s", kvc_last_error());
    ck_assert_uint_eq(bad, 0);
    kvc_close(c);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("client");
    TCase *t = tcase_create("daemon");
    tcase_set_timeout(t, 120);
    tcase_add_test(t, test_put_lookup_get_by_value);
    tcase_add_test(t, test_namespaces_are_separate);
    tcase_add_test(t, test_get_through_mapped_pool);
    tcase_add_test(t, test_alloc_write_commit);
    tcase_add_test(t, test_prefetch_from_l3_after_evict);
    tcase_add_test(t, test_get_from_l3_by_value);
    tcase_add_test(t, test_cost_check);
    tcase_add_test(t, test_sigkill_releases_leases);
    tcase_add_test(t, test_errors);
    tcase_add_test(t, test_stats_blocks_verify);
    suite_add_tcase(s, t);
    return s;
}

int main(void)
{
    if (tkvt_daemon_start(&g_d, NULL) != 0)
        return 1;
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_ENV); /* CK_VERBOSITY=verbose lists every test */
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    int st = tkvt_daemon_stop(&g_d);
    if (st != 0)
        fprintf(stderr, "tierkvd did not exit cleanly on SIGTERM (status %d)\n", st);
    return (failed == 0 && st == 0) ? 0 : 1;
}
