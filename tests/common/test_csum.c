/* test_csum.c - the block checksum: the copying variant agrees with the plain one at every
 * length and alignment, and a single flipped bit anywhere changes the sum. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_csum.h"

static void fill(uint8_t *p, size_t n, uint32_t seed)
{
    for (size_t i = 0; i < n; i++) {
        seed = seed * 1664525u + 1013904223u;
        p[i] = (uint8_t)(seed >> 24);
    }
}

START_TEST(copy_variant_matches_at_every_length_and_alignment)
{
    uint8_t src[600], dst[600];
    fill(src, sizeof(src), 7);
    for (size_t off = 0; off < 8; off++) {
        for (size_t len = 0; len + off <= 520; len++) {
            memset(dst, 0xcc, sizeof(dst));
            uint64_t a = tkv_csum64(src + off, len);
            uint64_t b = tkv_csum64_copy(dst + (7 - off), src + off, len);
            ck_assert_uint_eq(a, b);
            ck_assert_mem_eq(dst + (7 - off), src + off, len);
            ck_assert_uint_eq(dst[7 - off + len], 0xcc); /* nothing written past the end */
        }
    }
}
END_TEST

START_TEST(every_single_bit_flip_is_detected)
{
    enum { N = 1000 };
    uint8_t *buf = malloc(N);
    fill(buf, N, 99);
    uint64_t ref = tkv_csum64(buf, N);
    for (size_t i = 0; i < N; i++) {
        for (int b = 0; b < 8; b++) {
            buf[i] ^= (uint8_t)(1u << b);
            ck_assert_uint_ne(tkv_csum64(buf, N), ref);
            buf[i] ^= (uint8_t)(1u << b);
        }
    }
    ck_assert_uint_eq(tkv_csum64(buf, N), ref);
    /* Length is part of the sum: trailing zeros are not invisible. */
    uint8_t z[64] = {0};
    ck_assert_uint_ne(tkv_csum64(z, 32), tkv_csum64(z, 33));
    ck_assert_uint_ne(tkv_csum64(z, 0), tkv_csum64(z, 8));
    /* Swapping two words (a torn or misplaced write) changes it too. */
    uint64_t w0, w1;
    memcpy(&w0, buf, 8);
    memcpy(&w1, buf + 8, 8);
    memcpy(buf, &w1, 8);
    memcpy(buf + 8, &w0, 8);
    ck_assert_uint_ne(tkv_csum64(buf, N), ref);
    free(buf);
}
END_TEST

START_TEST(lengths_are_told_apart)
{
    /* the one checksum guards L2 slots and L3 records alike: prefixes of one buffer, at every
     * length class (under a stripe, whole stripes, stripes plus a tail), sum differently */
    uint8_t buf[300];
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (uint8_t)(i * 131u + 7u);
    for (size_t n = 1; n < sizeof(buf); n += 7) {
        uint64_t h = tkv_csum64(buf, n);
        ck_assert_uint_eq(h, tkv_csum64(buf, n));
        ck_assert_uint_ne(h, tkv_csum64(buf, n - 1));
        buf[n / 2] ^= 1;
        ck_assert_uint_ne(h, tkv_csum64(buf, n));
        buf[n / 2] ^= 1;
    }
}
END_TEST

START_TEST(piecewise_sum_matches_the_whole_at_any_split)
{
    /* the values are pinned: L3 records on disk carry this sum, so it must never change */
    uint8_t buf[1000];
    for (size_t i = 0; i < sizeof(buf); i++)
        buf[i] = (uint8_t)(i * 131u + 7u);
    ck_assert_uint_eq(tkv_csum64(buf, 0), 0x21fbe99a0d13ad7bull);
    ck_assert_uint_eq(tkv_csum64(buf, 33), 0xce430a82ae19d334ull);
    ck_assert_uint_eq(tkv_csum64(buf, 1000), 0xf8ddc86de4260e3bull);
    uint32_t seed = 5;
    for (size_t len = 0; len <= sizeof(buf); len += len < 80 ? 1 : 37) {
        for (int trial = 0; trial < 20; trial++) {
            /* feed pieces of random sizes, handing back what update did not take */
            tkv_csum64_state st;
            tkv_csum64_begin(&st);
            size_t pos = 0, pending = 0;
            while (pos + pending < len) {
                seed = seed * 1664525u + 1013904223u;
                size_t more = (seed >> 20) % 97;
                if (more > len - pos - pending)
                    more = len - pos - pending;
                pending += more;
                size_t took = tkv_csum64_update(&st, buf + pos, pending);
                ck_assert_uint_eq(took % 32, 0);
                ck_assert_uint_le(took, pending);
                ck_assert_uint_lt(pending - took, 32);
                pos += took;
                pending -= took;
            }
            ck_assert_uint_eq(tkv_csum64_end(&st, buf + pos, pending), tkv_csum64(buf, len));
        }
    }
}
END_TEST

int main(void)
{
    Suite *s = suite_create("csum");
    TCase *tc = tcase_create("csum");
    tcase_add_test(tc, copy_variant_matches_at_every_length_and_alignment);
    tcase_add_test(tc, every_single_bit_flip_is_detected);
    tcase_add_test(tc, lengths_are_told_apart);
    tcase_add_test(tc, piecewise_sum_matches_the_whole_at_any_split);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
