/* test_scatter.c - kvc_put_gather / kvc_get_scatter against a real tierkvd: blocks kept in
 * pieces in an engine-like host pool (SGLang's layer_first and page_first layouts) are
 * stored and read back bit-exact, by value (gRPC) and attached (fast path, and gets from the
 * mapped L2 pool), across several messages; a gathered put sends the very bytes kvc_put
 * would; and bad pieces are refused with a clear error before anything is sent or written.
 *
 * One daemon serves the suite (started in main, before Check forks the tests).
 */
#include <check.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static tkvt_daemon g_d;

#define BT TKVT_BLOCK_TOKENS
/* A host pool in the shape of SGLang's: a block (page) is K and V of kLayers layers, one
 * piece each; the test geometry's 2 KiB block (K 1 KiB, V 1 KiB) is read as 2 K/V x 4
 * "layers" of 256 bytes. */
enum { kLayers = 4, kPieces = 2 * kLayers, kPages = 160 };

typedef enum { LAYER_FIRST, PAGE_FIRST } pool_layout;

/* Byte offset in the pool of piece (kv, layer) of page p:
 *   layer_first: [kv][layer][page][piece]  -> 2 * kLayers pieces per page, strided;
 *   page_first:  [kv][page][layer][piece]  -> contiguous per kv (2 runs of kLayers pieces). */
static size_t piece_off(pool_layout lay, size_t piece, int kv, int layer, uint32_t p)
{
    if (lay == LAYER_FIRST)
        return (((size_t)kv * kLayers + layer) * kPages + p) * piece;
    return (((size_t)kv * kPages + p) * kLayers + layer) * piece;
}

/* Pieces of pages pages[0..n) of the pool, in the block's byte order (K layers, V layers). */
static kvc_iov *pool_iov(pool_layout lay, uint8_t *pool, size_t bb, const uint32_t *pages,
                         uint32_t n)
{
    size_t piece = bb / kPieces;
    kvc_iov *v = calloc((size_t)n * kPieces, sizeof(*v));
    ck_assert_ptr_nonnull(v);
    for (uint32_t b = 0; b < n; b++)
        for (int kv = 0; kv < 2; kv++)
            for (int layer = 0; layer < kLayers; layer++) {
                kvc_iov *e = &v[(size_t)b * kPieces + kv * kLayers + layer];
                e->base = pool + piece_off(lay, piece, kv, layer, pages[b]);
                e->len = piece;
            }
    return v;
}

/* Writes block `index` of prompt `seed` into page p of the pool, piece by piece. */
static void pool_fill(pool_layout lay, uint8_t *pool, size_t bb, uint32_t p, uint64_t seed,
                      uint32_t index)
{
    uint8_t *blk = malloc(bb);
    tkvt_payload(seed, index, blk, bb);
    uint32_t pages[1] = {p};
    kvc_iov *v = pool_iov(lay, pool, bb, pages, 1);
    const uint8_t *src = blk;
    for (int i = 0; i < kPieces; i++) {
        memcpy(v[i].base, src, v[i].len);
        src += v[i].len;
    }
    free(v);
    free(blk);
}

/* Is page p of the pool block `index` of prompt `seed`? */
static int pool_has(pool_layout lay, uint8_t *pool, size_t bb, uint32_t p, uint64_t seed,
                    uint32_t index)
{
    uint8_t *blk = malloc(bb);
    tkvt_payload(seed, index, blk, bb);
    uint32_t pages[1] = {p};
    kvc_iov *v = pool_iov(lay, pool, bb, pages, 1);
    const uint8_t *want = blk;
    int same = 1;
    for (int i = 0; i < kPieces; i++) {
        same &= memcmp(v[i].base, want, v[i].len) == 0;
        want += v[i].len;
    }
    free(v);
    free(blk);
    return same;
}

/* Round trip of nb blocks (several messages) through one layout: put from pieces of the
 * source pool, get into pieces of other pages of a destination pool, by the writer and by a
 * second client (attached or not). */
static void round_trip(pool_layout lay, int attach_put, int attach_get, uint64_t seed)
{
    kvc_client *w, *r;
    ck_assert_msg(tkvt_connect(&g_d, attach_put, &w) == KVC_OK, "%s", kvc_last_error());
    ck_assert_msg(tkvt_connect(&g_d, attach_get, &r) == KVC_OK, "%s", kvc_last_error());
    size_t bb = kvc_block_bytes(w), pool_bytes = (size_t)kPages * bb;
    const uint32_t nb = 100; /* > 64 per message: two Puts and two Gets */
    uint8_t *src = malloc(pool_bytes), *dst = calloc(1, pool_bytes);
    uint32_t spages[100], dpages[100];
    for (uint32_t i = 0; i < nb; i++) {
        spages[i] = (i * 37 + 5) % kPages; /* scattered, out of order: an engine's free list */
        dpages[i] = (i * 53 + 11) % kPages;
        pool_fill(lay, src, bb, spages[i], seed, i);
    }
    uint32_t tokens[100 * BT];
    tkvt_tokens(seed, tokens, nb * BT);
    kvc_iov *sv = pool_iov(lay, src, bb, spages, nb), *dv = pool_iov(lay, dst, bb, dpages, nb);
    kvc_put_result res;
    int rc = kvc_put_gather(w, tokens, nb * BT, 0, sv, kPieces, nb, &res);
    ck_assert_msg(rc == KVC_OK, "put_gather: %s", kvc_last_error());
    ck_assert_uint_eq(res.num_stored, nb);

    /* the gathered bytes are the block's bytes: a plain kvc_put of them is all duplicates */
    uint8_t *flat = malloc((size_t)nb * bb);
    for (uint32_t i = 0; i < nb; i++)
        tkvt_payload(seed, i, flat + (size_t)i * bb, bb);
    ck_assert_int_eq(kvc_put(w, tokens, nb * BT, 0, flat, nb, &res), KVC_OK);
    ck_assert_uint_eq(res.num_duplicate, nb);

    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(r, tokens, nb * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), nb);
    if (attach_get) { /* every block in L2: the gets below copy from the mapping */
        ck_assert_msg(kvc_wait(r, l, KVC_TIER_L2, 10000) == KVC_OK, "%s", kvc_last_error());
        for (uint32_t i = 0; i < nb; i++)
            ck_assert_ptr_nonnull(kvc_lease_block_ptr(r, l, i));
    } else {
        ck_assert_ptr_null(kvc_lease_block_ptr(r, l, 0));
    }
    /* blocks 30.. only: the pieces of the call's block b are dv[b] */
    rc = kvc_get_scatter(r, l, 30, nb - 30, dv + 30 * kPieces, kPieces);
    ck_assert_msg(rc == KVC_OK, "get_scatter: %s", kvc_last_error());
    rc = kvc_get_scatter(r, l, 0, 30, dv, kPieces);
    ck_assert_msg(rc == KVC_OK, "get_scatter: %s", kvc_last_error());
    for (uint32_t i = 0; i < nb; i++)
        ck_assert_msg(pool_has(lay, dst, bb, dpages[i], seed, i), "%s: block %u differs",
                      lay == LAYER_FIRST ? "layer_first" : "page_first", i);
    /* a flat get agrees */
    memset(flat, 0, (size_t)nb * bb);
    ck_assert_int_eq(kvc_get(r, l, 0, nb, flat, (size_t)nb * bb), KVC_OK);
    uint8_t *want = malloc(bb);
    for (uint32_t i = 0; i < nb; i++) {
        tkvt_payload(seed, i, want, bb);
        ck_assert_msg(memcmp(want, flat + (size_t)i * bb, bb) == 0, "flat block %u", i);
    }
    /* count 0 copies nothing */
    memset(dst, 0x5a, pool_bytes);
    ck_assert_int_eq(kvc_get_scatter(r, l, 0, 0, dv, kPieces), KVC_OK);
    ck_assert_int_eq(kvc_get_scatter(r, l, nb, 0, NULL, kPieces), KVC_OK);
    for (size_t i = 0; i < pool_bytes; i++)
        ck_assert_uint_eq(dst[i], 0x5a);
    kvc_release(r, l);
    free(want);
    free(flat);
    free(sv);
    free(dv);
    free(src);
    free(dst);
    kvc_close(w);
    kvc_close(r);
}

START_TEST(test_layer_first_by_value) { round_trip(LAYER_FIRST, 0, 0, 9101); }
END_TEST

START_TEST(test_page_first_by_value) { round_trip(PAGE_FIRST, 0, 0, 9102); }
END_TEST

/* an attached writer puts over the attach connection; an attached reader copies from L2 */
START_TEST(test_layer_first_attached) { round_trip(LAYER_FIRST, 1, 1, 9103); }
END_TEST

START_TEST(test_page_first_attached) { round_trip(PAGE_FIRST, 1, 1, 9104); }
END_TEST

/* One piece per block is a plain block: gather from a flat buffer, scatter into another. */
START_TEST(test_one_piece_per_block)
{
    kvc_client *c;
    ck_assert_int_eq(tkvt_connect(&g_d, 0, &c), KVC_OK);
    size_t bb = kvc_block_bytes(c);
    uint32_t tokens[5 * BT];
    tkvt_tokens(9105, tokens, 5 * BT);
    uint8_t *a = malloc(5 * bb), *b = calloc(5, bb);
    kvc_iov va[5], vb[5];
    for (uint32_t i = 0; i < 5; i++) {
        tkvt_payload(9105, i, a + i * bb, bb);
        va[i] = (kvc_iov){a + i * bb, bb};
        vb[4 - i] = (kvc_iov){b + i * bb, bb}; /* reversed: block i lands at b[4 - i] */
    }
    ck_assert_int_eq(kvc_put_gather(c, tokens, 5 * BT, 0, va, 1, 5, NULL), KVC_OK);
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, 5 * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 5);
    ck_assert_int_eq(kvc_get_scatter(c, l, 0, 5, vb, 1), KVC_OK);
    for (uint32_t i = 0; i < 5; i++)
        ck_assert(memcmp(a + i * bb, b + (4 - i) * bb, bb) == 0);
    kvc_release(c, l);
    free(a);
    free(b);
    kvc_close(c);
}
END_TEST

/* ---- bad pieces -------------------------------------------------------------------------- */

/* rc must be KVC_EINVAL and the message must name what was wrong */
#define REFUSED(call, words)                                                                    \
    do {                                                                                        \
        int rc_ = (call);                                                                       \
        ck_assert_msg(rc_ == KVC_EINVAL, "%s: rc %d (%s)", #call, rc_, kvc_last_error());       \
        ck_assert_msg(strstr(kvc_last_error(), words) != NULL, "%s: '%s' lacks '%s'", #call,   \
                      kvc_last_error(), words);                                                 \
    } while (0)

START_TEST(test_bad_pieces_refused)
{
    kvc_client *c;
    ck_assert_int_eq(tkvt_connect(&g_d, 1, &c), KVC_OK);
    size_t bb = kvc_block_bytes(c), pool_bytes = (size_t)kPages * bb;
    uint8_t *pool = malloc(pool_bytes);
    uint32_t pages[3] = {7, 8, 9};
    for (uint32_t i = 0; i < 3; i++)
        pool_fill(LAYER_FIRST, pool, bb, pages[i], 9106, i);
    uint32_t tokens[3 * BT];
    tkvt_tokens(9106, tokens, 3 * BT);
    kvc_iov *v = pool_iov(LAYER_FIRST, pool, bb, pages, 3);
    kvc_iov *bad = malloc(3 * kPieces * sizeof(*bad));

    /* puts: each refused, and nothing was stored */
    memcpy(bad, v, 3 * kPieces * sizeof(*bad));
    bad[kPieces + 2].len -= 1; /* block 1 one byte short */
    REFUSED(kvc_put_gather(c, tokens, 3 * BT, 0, bad, kPieces, 3, NULL), "block 1");
    ck_assert(strstr(kvc_last_error(), "2047 bytes") != NULL);
    memcpy(bad, v, 3 * kPieces * sizeof(*bad));
    bad[2 * kPieces + 5].len += 1; /* block 2 one byte long */
    REFUSED(kvc_put_gather(c, tokens, 3 * BT, 0, bad, kPieces, 3, NULL), "more than");
    memcpy(bad, v, 3 * kPieces * sizeof(*bad));
    bad[3].base = NULL;
    REFUSED(kvc_put_gather(c, tokens, 3 * BT, 0, bad, kPieces, 3, NULL), "base is NULL");
    memcpy(bad, v, 3 * kPieces * sizeof(*bad));
    bad[1].base = (void *)(UINTPTR_MAX - 16); /* would run off the end of the address space */
    REFUSED(kvc_put_gather(c, tokens, 3 * BT, 0, bad, kPieces, 3, NULL), "wrap");
    REFUSED(kvc_put_gather(c, tokens, 3 * BT, 0, v, 0, 3, NULL), "pieces per block");
    REFUSED(kvc_put_gather(c, tokens, 3 * BT, 0, v, KVC_IOV_MAX + 1, 3, NULL),
            "pieces per block");
    REFUSED(kvc_put_gather(c, tokens, 3 * BT, 0, NULL, kPieces, 3, NULL), "NULL");
    REFUSED(kvc_put_gather(c, tokens, 2 * BT, 0, v, kPieces, 3, NULL), "tokens");
    /* a piece layout whose per-block sum is right but whose pieces per block differ from
     * what the caller meant (4 pieces of a block of 8): refused, the sum is half */
    REFUSED(kvc_put_gather(c, tokens, 3 * BT, 0, v, kPieces / 2, 3, NULL), "block 0");
    kvc_lease *l;
    ck_assert_int_eq(kvc_lookup(c, tokens, 3 * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 0); /* nothing of the refused puts stored */
    kvc_release(c, l);

    /* gets: each refused, and nothing was written into the destination */
    ck_assert_int_eq(kvc_put_gather(c, tokens, 3 * BT, 0, v, kPieces, 3, NULL), KVC_OK);
    ck_assert_int_eq(kvc_lookup(c, tokens, 3 * BT, 0, &l), KVC_OK);
    ck_assert_uint_eq(kvc_lease_num_blocks(l), 3);
    ck_assert_int_eq(kvc_wait(c, l, KVC_TIER_L2, 10000), KVC_OK);
    memset(pool, 0xa5, pool_bytes);
    memcpy(bad, v, 3 * kPieces * sizeof(*bad));
    bad[2 * kPieces].len = 0; /* block 2 short by a whole piece */
    REFUSED(kvc_get_scatter(c, l, 0, 3, bad, kPieces), "block 2");
    memcpy(bad, v, 3 * kPieces * sizeof(*bad));
    bad[kPieces + 7].base = (void *)kvc_lease_block_ptr(c, l, 0); /* into the read-only pool */
    ck_assert_ptr_nonnull(bad[kPieces + 7].base);
    REFUSED(kvc_get_scatter(c, l, 0, 3, bad, kPieces), "mapped pool");
    REFUSED(kvc_get_scatter(c, l, 1, 3, v, kPieces), "beyond the lease");
    REFUSED(kvc_get_scatter(c, l, 0, 3, NULL, kPieces), "NULL");
    REFUSED(kvc_get_scatter(c, l, 0, 3, v, 0), "pieces per block");
    REFUSED(kvc_get_scatter(NULL, l, 0, 3, v, kPieces), "NULL");
    for (size_t i = 0; i < pool_bytes; i++)
        ck_assert_msg(pool[i] == 0xa5, "a refused get wrote byte %zu", i);
    /* and the good pieces still work after the refusals */
    ck_assert_int_eq(kvc_get_scatter(c, l, 0, 3, v, kPieces), KVC_OK);
    for (uint32_t i = 0; i < 3; i++)
        ck_assert(pool_has(LAYER_FIRST, pool, bb, pages[i], 9106, i));
    kvc_release(c, l);
    free(bad);
    free(v);
    free(pool);
    kvc_close(c);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("scatter");
    TCase *t = tcase_create("daemon");
    tcase_set_timeout(t, 120);
    tcase_add_test(t, test_layer_first_by_value);
    tcase_add_test(t, test_page_first_by_value);
    tcase_add_test(t, test_layer_first_attached);
    tcase_add_test(t, test_page_first_attached);
    tcase_add_test(t, test_one_piece_per_block);
    tcase_add_test(t, test_bad_pieces_refused);
    suite_add_tcase(s, t);
    return s;
}

int main(void)
{
    if (tkvt_daemon_start(&g_d, NULL) != 0)
        return 1;
    SRunner *sr = srunner_create(suite());
    srunner_run_all(sr, CK_ENV);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    int st = tkvt_daemon_stop(&g_d);
    if (st != 0)
        fprintf(stderr, "tierkvd did not exit cleanly on SIGTERM (status %d)\n", st);
    return (failed == 0 && st == 0) ? 0 : 1;
}
