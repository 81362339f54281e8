/* test_keys.c - geometry validation, block size, and the key chain's published test vectors
 * (the same vectors are in docs/design.md, "Key test vectors"; they were cross-checked
 * against an independent SHA-256 of the documented byte strings). */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_base.h"
#include "tkv_keys.h"

/* Vector geometry A: 32 layers, 8 KV heads, head dim 128, 64-token blocks, fp8, per-tensor,
 * model id "tierkv-test-model". Tokens of the prompt: 0, 1, 2, ..., 255 (four full blocks). */
static const tkv_geometry geo_a = {32, 8, 128, 64, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TENSOR,
                                   "tierkv-test-model"};
static const char *fp_a = "6ca036bd814c80c4d843ffb748a6eeca0da97c3ee695d106f7ddc83df545e2a6";
static const char *root_a = "facb474cd5d49ca7183f9f0238df2f26c0a938330af1bb9844cd8bb12b85f3a8";
static const char *keys_a[4] = {
    "5bd9d3b1bc3424affce20896be6af29575339418a19acf495d0e086c8143fa84",
    "850616921c1f732e351f6e8af551bf093504c4b75e379813fa57b114e86186ef",
    "98a51a7cd710787c3fd7b2569cf26281064f9d63d755af95e2f77377d829ca82",
    "b7da94680e26e9dc5b4b5c88abbd329f1a211939d50e0a8000e2e9ee124c70a4",
};
/* Same geometry, namespace salt "tenant-a" (8 bytes), first block of the same tokens. */
static const char *root_a_tenant = "be22bfa7a565a1badfefec066dc7da24bc3a3cd8d5c200974d845d02b8349093";
static const char *key0_a_tenant = "5040146bcfef27dbeaf8761c45ff45293cc3515ab99a9ad112709ad48903d082";
/* Geometry B: 4 layers, 2 KV heads, head dim 64, 16-token blocks, fp8, per-token-head, "m". */
static const tkv_geometry geo_b = {4, 2, 64, 16, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TOKEN_HEAD,
                                   "m"};
static const char *fp_b = "0c17d52d71ee9892f7cd65d5d2746d0666cb7ff3ce81886425ab96fe15ceccb7";

static void hex_of(const uint8_t *b, char out[65])
{
    tkv_key k;
    memcpy(k.b, b, 32);
    tkv_key_hex(&k, out);
}

START_TEST(vectors_fingerprint_root_chain)
{
    char hex[65];
    uint8_t fp[32];
    tkv_geometry_fingerprint(&geo_a, fp);
    hex_of(fp, hex);
    ck_assert_str_eq(hex, fp_a);
    tkv_geometry_fingerprint(&geo_b, fp);
    hex_of(fp, hex);
    ck_assert_str_eq(hex, fp_b);

    tkv_geometry_fingerprint(&geo_a, fp);
    tkv_key root;
    tkv_key_root(fp, "", 0, &root);
    tkv_key_hex(&root, hex);
    ck_assert_str_eq(hex, root_a);

    uint32_t tokens[256 + 63];
    for (uint32_t i = 0; i < 256 + 63; i++)
        tokens[i] = i;
    tkv_key keys[8];
    /* 319 tokens: the trailing partial block is not keyed. */
    ck_assert_uint_eq(tkv_key_chain(&root, tokens, 256 + 63, 64, keys, 8), 4);
    for (int i = 0; i < 4; i++) {
        tkv_key_hex(&keys[i], hex);
        ck_assert_str_eq(hex, keys_a[i]);
    }
    /* max_keys caps the count; a prefix of a prompt gives a prefix of its keys. */
    tkv_key two[2];
    ck_assert_uint_eq(tkv_key_chain(&root, tokens, 256, 64, two, 2), 2);
    ck_assert_mem_eq(two, keys, sizeof(two));
    ck_assert_uint_eq(tkv_key_chain(&root, tokens, 63, 64, two, 2), 0);

    tkv_key troot;
    tkv_key_root(fp, "tenant-a", 8, &troot);
    tkv_key_hex(&troot, hex);
    ck_assert_str_eq(hex, root_a_tenant);
    ck_assert_uint_eq(tkv_key_chain(&troot, tokens, 64, 64, two, 2), 1);
    tkv_key_hex(&two[0], hex);
    ck_assert_str_eq(hex, key0_a_tenant);
    ck_assert(memcmp(&two[0], &keys[0], sizeof(tkv_key)) != 0); /* tenants never share keys */
}
END_TEST

START_TEST(chain_depends_on_every_token_and_the_past)
{
    uint8_t fp[32];
    tkv_geometry_fingerprint(&geo_a, fp);
    tkv_key root, a[4], b[4];
    tkv_key_root(fp, NULL, 0, &root);
    uint32_t t1[256], t2[256];
    for (int i = 0; i < 256; i++)
        t1[i] = t2[i] = (uint32_t)(i * 2654435761u);
    t2[70] ^= 1u << 31; /* one bit in block 1 */
    tkv_key_chain(&root, t1, 256, 64, a, 4);
    tkv_key_chain(&root, t2, 256, 64, b, 4);
    ck_assert_mem_eq(&a[0], &b[0], sizeof(tkv_key));
    for (int i = 1; i < 4; i++)
        ck_assert(memcmp(&a[i], &b[i], sizeof(tkv_key)) != 0);
    /* A different model or geometry gives a different chain for the same tokens. */
    tkv_geometry g = geo_a;
    g.head_dim = 64;
    uint8_t fp2[32];
    tkv_geometry_fingerprint(&g, fp2);
    ck_assert(memcmp(fp, fp2, 32) != 0);
    strcpy(g.model_id, "tierkv-test-modeL");
    g.head_dim = 128;
    tkv_geometry_fingerprint(&g, fp2);
    ck_assert(memcmp(fp, fp2, 32) != 0);
}
END_TEST

START_TEST(geometry_validation)
{
    char err[128];
    tkv_geometry g = geo_a;
    ck_assert_int_eq(tkv_geometry_validate(&g, err, sizeof(err)), TKV_OK);
    ck_assert_str_eq(err, "");
    ck_assert_int_eq(tkv_geometry_validate(&geo_b, NULL, 0), TKV_OK);
    tkv_geometry bad;
#define EXPECT_BAD(stmt, word)                                                                \
    do {                                                                                      \
        bad = geo_a;                                                                          \
        stmt;                                                                                 \
        ck_assert_int_eq(tkv_geometry_validate(&bad, err, sizeof(err)), TKV_EINVAL);          \
        ck_assert_msg(strstr(err, word) != NULL, "reason '%s' lacks '%s'", err, word);        \
        ck_assert_uint_eq(tkv_geometry_block_bytes(&bad), 0);                                 \
    } while (0)
    EXPECT_BAD(bad.num_layers = 0, "num_layers");
    EXPECT_BAD(bad.num_layers = 1025, "num_layers");
    EXPECT_BAD(bad.num_kv_heads = 0, "num_kv_heads");
    EXPECT_BAD(bad.num_kv_heads = 257, "num_kv_heads");
    EXPECT_BAD(bad.head_dim = 96, "head_dim");
    EXPECT_BAD(bad.block_tokens = 48, "block_tokens");
    EXPECT_BAD(bad.block_tokens = 256, "block_tokens");
    EXPECT_BAD(bad.dtype = 7, "dtype");
    EXPECT_BAD(bad.scale_mode = 2, "scale_mode");
    EXPECT_BAD((bad.dtype = TKV_DTYPE_BF16, bad.scale_mode = TKV_SCALE_PER_TOKEN_HEAD), "fp8");
    EXPECT_BAD(bad.model_id[0] = '\0', "model_id");
    EXPECT_BAD(memset(bad.model_id, 'x', sizeof(bad.model_id)), "NUL");
    ck_assert_int_eq(tkv_geometry_validate(NULL, err, sizeof(err)), TKV_EINVAL);
}
END_TEST

START_TEST(block_bytes_match_the_paged_layout)
{
    /* [layer][K|V][token][kv_head][dim] (+ K scales), layer stride rounded up to 16 bytes. */
    ck_assert_uint_eq(tkv_geometry_block_bytes(&geo_a), 32u * 2 * 64 * 8 * 128); /* 4 MiB */
    /* B: token stride 2*64 = 128; layer = 2*16*128 + 16*2*4 scales = 4224 (16-aligned) */
    ck_assert_uint_eq(tkv_geometry_block_bytes(&geo_b), 4u * 4224);
    tkv_geometry c = {2, 1, 256, 32, TKV_DTYPE_BF16, TKV_SCALE_PER_TENSOR, "bf16-model"};
    ck_assert_uint_eq(tkv_geometry_block_bytes(&c), 2u * 2 * 32 * 256 * 2);
    /* Rounding: 1 head, dim 64, 16 tokens, fp8, scales 16*1*4 = 64: 2048 + 64, already aligned;
     * 3 heads: 2*16*192 = 6144 + 16*3*4 = 192 -> 6336 (aligned); odd case below needs it. */
    tkv_geometry d = {1, 3, 64, 16, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TOKEN_HEAD, "d"};
    ck_assert_uint_eq(tkv_geometry_block_bytes(&d), 6336u);
    tkv_geometry e = {3, 1, 64, 16, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TOKEN_HEAD, "e"};
    ck_assert_uint_eq(tkv_geometry_block_bytes(&e) % 16, 0);
    ck_assert_uint_eq(tkv_geometry_block_bytes(&e), 3u * (2048 + 64));
}
END_TEST

START_TEST(hex_round_trip_and_rejects)
{
    tkv_key k, back;
    for (int i = 0; i < 32; i++)
        k.b[i] = (uint8_t)(i * 37 + 5);
    char hex[65];
    tkv_key_hex(&k, hex);
    ck_assert_uint_eq(strlen(hex), 64);
    ck_assert_int_eq(tkv_key_from_hex(hex, &back), TKV_OK);
    ck_assert_mem_eq(&k, &back, sizeof(k));
    /* Upper case accepted. */
    char up[65];
    for (int i = 0; i < 65; i++)
        up[i] = (char)(hex[i] >= 'a' && hex[i] <= 'f' ? hex[i] - 32 : hex[i]);
    ck_assert_int_eq(tkv_key_from_hex(up, &back), TKV_OK);
    ck_assert_mem_eq(&k, &back, sizeof(k));
    memset(&back, 0xee, sizeof(back));
    tkv_key before = back;
    ck_assert_int_eq(tkv_key_from_hex("abc", &back), TKV_EINVAL);       /* short */
    char longer[70];
    snprintf(longer, sizeof(longer), "%s00", hex);
    ck_assert_int_eq(tkv_key_from_hex(longer, &back), TKV_EINVAL);      /* long */
    char badc[65];
    memcpy(badc, hex, 65);
    badc[17] = 'g';
    ck_assert_int_eq(tkv_key_from_hex(badc, &back), TKV_EINVAL);        /* not hex */
    ck_assert_int_eq(tkv_key_from_hex(NULL, &back), TKV_EINVAL);
    ck_assert_mem_eq(&back, &before, sizeof(back)); /* untouched on error */
}
END_TEST

int main(void)
{
    Suite *s = suite_create("keys");
    TCase *tc = tcase_create("keys");
    tcase_add_test(tc, vectors_fingerprint_root_chain);
    tcase_add_test(tc, chain_depends_on_every_token_and_the_past);
    tcase_add_test(tc, geometry_validation);
    tcase_add_test(tc, block_bytes_match_the_paged_layout);
    tcase_add_test(tc, hex_round_trip_and_rejects);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
