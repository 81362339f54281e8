/* test_fp8.c - FP8 e4m3 and bf16 conversions, and the paged layout (kernels/common.c, fp8.c).
 *
 * The encoder is checked against an independent definition: the nearest of the 253 finite
 * codes by value, ties to the code with an even mantissa, saturating at 448. */
#include <check.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_kernels.h"

static float bits_to_float(uint32_t u)
{
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static uint32_t float_to_bits(float f)
{
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return u;
}

/* The definition, by search over the finite non-negative values 0x00..0x7e (ascending), which
 * are built here from the format's definition (not with the decoder under test). */
static double code_value(int c)
{
    int e = c >> 3, m = c & 7;
    return e == 0 ? m * ldexp(1.0, -9) : (1.0 + m / 8.0) * ldexp(1.0, e - 7);
}

static uint8_t fp8_by_search(float x)
{
    if (isnan(x))
        return 0x7f;
    uint8_t sign = signbit(x) ? 0x80 : 0x00;
    double a = fabs((double)x);
    if (a >= 448.0)
        return sign | 0x7e;
    int lo = 0, hi = 0x7e; /* invariant: value(lo) <= a < value(hi) */
    while (hi - lo > 1) {
        int mid = (lo + hi) / 2;
        if (code_value(mid) <= a)
            lo = mid;
        else
            hi = mid;
    }
    double vlo = code_value(lo), vhi = code_value(hi);
    int pick;
    if (a - vlo < vhi - a)
        pick = lo;
    else if (a - vlo > vhi - a)
        pick = hi;
    else
        pick = (lo & 1) ? hi : lo; /* tie: even mantissa */
    return (uint8_t)(sign | pick);
}

START_TEST(fp8_all_codes_round_trip)
{
    for (int c = 0; c < 256; c++) {
        float f = tkvk_fp8_to_float((uint8_t)c);
        if ((c & 0x7f) == 0x7f) {
            ck_assert_msg(isnan(f), "code 0x%02x should decode to NaN", c);
            ck_assert_uint_eq(tkvk_fp8_from_float(f), 0x7f);
        } else {
            ck_assert_msg(tkvk_fp8_from_float(f) == c, "code 0x%02x -> %g -> 0x%02x", c, f,
                          tkvk_fp8_from_float(f));
        }
    }
    /* Known values of the format. */
    ck_assert_float_eq(tkvk_fp8_to_float(0x7e), 448.0f);
    ck_assert_float_eq(tkvk_fp8_to_float(0x08), 0.015625f);       /* 2^-6 */
    ck_assert_float_eq(tkvk_fp8_to_float(0x01), 0.001953125f);    /* 2^-9 */
    ck_assert_float_eq(tkvk_fp8_to_float(0x38), 1.0f);
    ck_assert_float_eq(tkvk_fp8_to_float(0xb8), -1.0f);
    for (int c = 0; c < 0x7f; c++)
        ck_assert(tkvk_fp8_to_float((uint8_t)c) == (float)code_value(c));
}
END_TEST

START_TEST(fp8_specials_and_saturation)
{
    ck_assert_uint_eq(tkvk_fp8_from_float(INFINITY), 0x7e);
    ck_assert_uint_eq(tkvk_fp8_from_float(-INFINITY), 0xfe);
    ck_assert_uint_eq(tkvk_fp8_from_float(NAN), 0x7f);
    ck_assert_uint_eq(tkvk_fp8_from_float(-NAN), 0x7f);
    ck_assert_uint_eq(tkvk_fp8_from_float(1e30f), 0x7e);
    ck_assert_uint_eq(tkvk_fp8_from_float(464.0f), 0x7e); /* would round to 480: saturates */
    ck_assert_uint_eq(tkvk_fp8_from_float(-0.0f), 0x80);
    ck_assert_uint_eq(tkvk_fp8_from_float(0.0f), 0x00);
    ck_assert_uint_eq(tkvk_fp8_from_float(1e-30f), 0x00);
    ck_assert_uint_eq(tkvk_fp8_from_float(-1e-30f), 0x80);
    /* Ties to even: halfway between 2^-9 and 2*2^-9 -> 2*2^-9 (even), 0.5*2^-9 -> 0. */
    ck_assert_uint_eq(tkvk_fp8_from_float(1.5f / 512.0f), 0x02);
    ck_assert_uint_eq(tkvk_fp8_from_float(0.5f / 512.0f), 0x00);
    ck_assert_uint_eq(tkvk_fp8_from_float(2.5f / 512.0f), 0x02);
    /* 1.0625 is halfway between 1.0 (0x38) and 1.125 (0x39): even wins. */
    ck_assert_uint_eq(tkvk_fp8_from_float(1.0625f), 0x38);
    ck_assert_uint_eq(tkvk_fp8_from_float(1.1875f), 0x3a);
}
END_TEST

/* Every midpoint between neighbouring codes, and the floats a few ulps either side of it and
 * of each code, against the search definition. */
START_TEST(fp8_dense_around_codes_and_ties)
{
    long checked = 0;
    for (int c = 0; c < 0x7e; c++) {
        float lo = tkvk_fp8_to_float((uint8_t)c), hi = tkvk_fp8_to_float((uint8_t)(c + 1));
        float mids[2] = {lo, (float)(((double)lo + (double)hi) / 2.0)};
        for (int m = 0; m < 2; m++) {
            uint32_t center = float_to_bits(mids[m]);
            for (int d = -64; d <= 64; d++) {
                if (center == 0 && d < 0)
                    continue;
                for (int s = 0; s < 2; s++) {
                    float x = bits_to_float((center + (uint32_t)d) | (s ? 0x80000000u : 0));
                    uint8_t want = fp8_by_search(x);
                    ck_assert_msg(tkvk_fp8_from_float(x) == want, "x=%a: got 0x%02x want 0x%02x",
                                  (double)x, tkvk_fp8_from_float(x), want);
                    checked++;
                }
            }
        }
    }
    ck_assert_int_gt(checked, 60000);
}
END_TEST

START_TEST(fp8_random_floats)
{
    srand(12345);
    for (int i = 0; i < 200000; i++) {
        uint32_t u = ((uint32_t)rand() << 16) ^ (uint32_t)rand();
        /* Bias toward the interesting exponents (2^-12 .. 2^10) half of the time. */
        if (i & 1)
            u = (u & 0x807fffffu) | ((uint32_t)(115 + (u >> 7) % 22) << 23);
        float x = bits_to_float(u);
        ck_assert_msg(tkvk_fp8_from_float(x) == fp8_by_search(x), "x=%a", (double)x);
    }
}
END_TEST

START_TEST(bf16_round_to_nearest_even)
{
    ck_assert_uint_eq(tkvk_bf16_from_float(1.0f), 0x3f80);
    ck_assert_float_eq(tkvk_bf16_to_float(0x3f80), 1.0f);
    /* 1 + 2^-8 is halfway between 1.0 and 1 + 2^-7: even (1.0) wins; a bit more rounds up. */
    ck_assert_uint_eq(tkvk_bf16_from_float(1.0f + 0x1p-8f), 0x3f80);
    ck_assert_uint_eq(tkvk_bf16_from_float(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81);
    ck_assert_uint_eq(tkvk_bf16_from_float(1.0f + 0x1p-7f + 0x1p-8f), 0x3f82);
    ck_assert(isnan(tkvk_bf16_to_float(tkvk_bf16_from_float(NAN))));
    ck_assert(isnan(tkvk_bf16_to_float(tkvk_bf16_from_float(bits_to_float(0x7f800001u)))));
    ck_assert_uint_eq(tkvk_bf16_from_float(INFINITY), 0x7f80);
    ck_assert_uint_eq(tkvk_bf16_from_float(3.4e38f), 0x7f80); /* rounds past max to inf */
    for (uint32_t v = 0; v < 0x10000; v++) {
        if ((v & 0x7f80) == 0x7f80 && (v & 0x7f))
            continue; /* NaN payloads */
        ck_assert_uint_eq(tkvk_bf16_from_float(tkvk_bf16_to_float((uint16_t)v)), v);
    }
}
END_TEST

START_TEST(layout_strides)
{
    tkvk_layout lay;
    ck_assert_int_eq(tkvk_layout_init(&lay, 32, 8, 128, 64, TKVK_DTYPE_FP8_E4M3,
                                      TKVK_SCALE_PER_TENSOR), TKVK_OK);
    ck_assert_uint_eq(lay.elem_bytes, 1);
    ck_assert_uint_eq(lay.token_stride, 8 * 128);
    ck_assert_uint_eq(lay.v_offset, 64 * 8 * 128);
    ck_assert_uint_eq(lay.kscale_offset, 0);
    ck_assert_uint_eq(lay.layer_stride, 2 * 64 * 8 * 128);
    ck_assert_uint_eq(lay.block_stride, 32 * lay.layer_stride);

    ck_assert_int_eq(tkvk_layout_init(&lay, 2, 3, 64, 16, TKVK_DTYPE_FP8_E4M3,
                                      TKVK_SCALE_PER_TOKEN_HEAD), TKVK_OK);
    ck_assert_uint_eq(lay.token_stride, 3 * 64);
    ck_assert_uint_eq(lay.kscale_offset, 2 * 16 * 3 * 64);
    ck_assert_uint_eq(lay.layer_stride, 2 * 16 * 3 * 64 + 16 * 3 * 4); /* already 16-aligned */
    ck_assert_uint_eq(lay.layer_stride % 16, 0);

    ck_assert_int_eq(tkvk_layout_init(&lay, 1, 1, 256, 128, TKVK_DTYPE_BF16,
                                      TKVK_SCALE_PER_TENSOR), TKVK_OK);
    ck_assert_uint_eq(lay.elem_bytes, 2);
    ck_assert_uint_eq(lay.token_stride, 512);
    ck_assert_uint_eq(lay.block_stride, 2 * 128 * 512);
}
END_TEST

START_TEST(layout_refusals)
{
    tkvk_layout lay;
    ck_assert_int_eq(tkvk_layout_init(NULL, 1, 1, 128, 64, 0, 0), TKVK_EINVAL);
    ck_assert_int_eq(tkvk_layout_init(&lay, 0, 1, 128, 64, 0, 0), TKVK_EINVAL);
    ck_assert_int_eq(tkvk_layout_init(&lay, 1, -2, 128, 64, 0, 0), TKVK_EINVAL);
    ck_assert_int_eq(tkvk_layout_init(&lay, 1, 1, 96, 64, 0, 0), TKVK_EUNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(tkvk_last_error(), "head_dim 96"));
    ck_assert_int_eq(tkvk_layout_init(&lay, 1, 1, 128, 48, 0, 0), TKVK_EUNSUPPORTED);
    ck_assert_ptr_nonnull(strstr(tkvk_last_error(), "page_tokens 48"));
    ck_assert_int_eq(tkvk_layout_init(&lay, 1, 1, 128, 64, 7, 0), TKVK_EINVAL);
    ck_assert_int_eq(tkvk_layout_init(&lay, 1, 1, 128, 64, 0, 9), TKVK_EINVAL);
    ck_assert_int_eq(tkvk_layout_init(&lay, 1, 1, 128, 64, TKVK_DTYPE_BF16,
                                      TKVK_SCALE_PER_TOKEN_HEAD), TKVK_EUNSUPPORTED);
    ck_assert_str_eq(tkvk_strerror(TKVK_EUNSUPPORTED), "unsupported shape or mode");
}
END_TEST

START_TEST(cuda_probe_is_boolean)
{
    int a = tkvk_cuda_available();
    ck_assert(a == 0 || a == 1);
#ifndef TKVK_HAVE_CUDA
    ck_assert_int_eq(a, 0);
#endif
}
END_TEST

int main(void)
{
    Suite *s = suite_create("kernels_fp8");
    TCase *tc = tcase_create("core");
    tcase_add_test(tc, fp8_all_codes_round_trip);
    tcase_add_test(tc, fp8_specials_and_saturation);
    tcase_add_test(tc, fp8_dense_around_codes_and_ties);
    tcase_add_test(tc, fp8_random_floats);
    tcase_add_test(tc, bf16_round_to_nearest_even);
    tcase_add_test(tc, layout_strides);
    tcase_add_test(tc, layout_refusals);
    tcase_add_test(tc, cuda_probe_is_boolean);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
