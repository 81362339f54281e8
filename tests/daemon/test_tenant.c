/* test_tenant.c - the tenant table (daemon/tenant.c) and its config keys (daemon/config.c):
 * parsing and its messages, the whole-table checks, and which tenant a peer proves to be. */
#include <check.h>
#include <string.h>

#include "tkv_base.h"
#include "tkvd_config.h"
#include "tkvd_tenant.h"

#define SHA_TEST "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08" /* "test" */

static int set(tkvd_config *c, const char *k, const char *v, char *err)
{
    return tkvd_config_set(c, k, v, "t.conf:1", err, TKVD_ERR_LEN);
}

START_TEST(parses_and_maps_peers)
{
    tkvd_config c;
    tkvd_config_init(&c);
    char err[TKVD_ERR_LEN];
    ck_assert_int_eq(set(&c, "tenant.a.uid", "1000, 1001", err), TKV_OK);
    ck_assert_int_eq(set(&c, "tenant.a.uid", "1002", err), TKV_OK); /* appends */
    ck_assert_int_eq(set(&c, "tenant.a.gid", "50", err), TKV_OK);
    ck_assert_int_eq(set(&c, "tenant.team.b.tls_subject", "O=x,CN=b", err), TKV_OK);
    ck_assert_int_eq(set(&c, "tenant.team.b.token_sha256", SHA_TEST, err), TKV_OK);
    ck_assert_int_eq(set(&c, "tenant.ops.gid", "50", err), TKV_OK);
    ck_assert_int_eq(set(&c, "tenant.ops.admin", "on", err), TKV_OK);
    ck_assert_int_eq(tkvd_tenants_finish(&c.tenants, err, sizeof(err)), TKV_OK);
    const tkvd_tenants *t = &c.tenants;
    ck_assert_uint_eq(t->n, 3);
    const tkvd_tenant *a = tkvd_tenant_by_name(t, "a"), *b = tkvd_tenant_by_name(t, "team.b"),
                      *ops = tkvd_tenant_by_name(t, "ops");
    ck_assert_ptr_nonnull(a);
    ck_assert_ptr_nonnull(b);
    ck_assert(ops && ops->admin && !a->admin && !a->map_pool);
    ck_assert_uint_eq(a->num_uids, 3);
    ck_assert_int_eq(set(&c, "tenant.a.quota_l2_blocks", "40", err), TKV_OK);
    ck_assert_int_eq(set(&c, "tenant.a.guaranteed_l2_blocks", "8", err), TKV_OK);
    ck_assert(a->quota[2] == 40 && a->guaranteed[2] == 8);
    ck_assert_int_eq(set(&c, "tenant.a.quota_l3_blocks", "400", err), TKV_OK);
    ck_assert_int_eq(set(&c, "tenant.a.guaranteed_l3_blocks", "80", err), TKV_OK);
    ck_assert(a->quota[3] == 400 && a->guaranteed[3] == 80);
    ck_assert_int_eq(set(&c, "tenant.a.quota_l1_blocks", "16", err), TKV_OK);
    ck_assert_int_eq(set(&c, "tenant.a.guaranteed_l1_blocks", "4", err), TKV_OK);
    ck_assert_int_eq(set(&c, "tenant.a.quota_l4_blocks", "5000", err), TKV_OK);
    ck_assert(a->quota[1] == 16 && a->guaranteed[1] == 4 && a->quota[4] == 5000);
    ck_assert_uint_eq(tkvd_tenant_store_id(a), a->index + 1);
    /* L2 regions: a's quota, the others an equal share of the rest */
    uint64_t regions[3];
    ck_assert_int_eq(tkvd_tenants_l2_regions(t, 101, regions, err, sizeof(err)), TKV_OK);
    ck_assert_uint_eq(regions[a->index], 40);
    ck_assert_uint_eq(regions[b->index], 30);
    ck_assert_uint_eq(regions[ops->index], 30);
    ck_assert_int_eq(tkvd_tenants_l2_regions(t, 41, regions, err, sizeof(err)), TKV_EINVAL);
    ck_assert(strstr(err, "no L2 left for its region"));
    /* L1 regions the same way, from quota_l1_blocks */
    ck_assert_int_eq(tkvd_tenants_l1_regions(t, 36, regions, err, sizeof(err)), TKV_OK);
    ck_assert_uint_eq(regions[a->index], 16);
    ck_assert_uint_eq(regions[b->index], 10);
    ck_assert_uint_eq(regions[ops->index], 10);
    ck_assert_int_eq(tkvd_tenants_l1_regions(t, 15, regions, err, sizeof(err)), TKV_EINVAL);
    ck_assert_msg(strstr(err, "quota_l1_blocks add up to 16 blocks, more than L1"), "%s", err);

    tkvd_identity p = {.has_ucred = true, .uid = 1001, .gid = 7};
    ck_assert_ptr_eq(tkvd_tenant_of_peer(t, &p), a);
    p.uid = 4242;
    p.gid = 50; /* gid 50 is both a's and ops': the first tenant by gid */
    ck_assert_ptr_eq(tkvd_tenant_of_peer(t, &p), a);
    p.uid = 1000; /* a uid match wins over gid */
    ck_assert_ptr_eq(tkvd_tenant_of_peer(t, &p), a);
    p = (tkvd_identity){.has_ucred = true, .uid = 4242, .gid = 4242};
    ck_assert_ptr_null(tkvd_tenant_of_peer(t, &p));
    p = (tkvd_identity){.tls_subject = "O=x,CN=b"};
    ck_assert_ptr_eq(tkvd_tenant_of_peer(t, &p), b);
    p = (tkvd_identity){.tls_subject = "O=x,CN=b2"};
    ck_assert_ptr_null(tkvd_tenant_of_peer(t, &p));
    p = (tkvd_identity){.token = "test", .token_len = 4};
    ck_assert_ptr_eq(tkvd_tenant_of_peer(t, &p), b);
    /* A wrong token is never ignored in favour of another identity. */
    p = (tkvd_identity){.token = "tesT", .token_len = 4, .has_ucred = true, .uid = 1000};
    ck_assert_ptr_null(tkvd_tenant_of_peer(t, &p));

    /* owner tags: tenant index + 1 in the top byte */
    ck_assert(tkvd_tenant_owns(a, tkvd_tenant_tag(a) | 12345));
    ck_assert(!tkvd_tenant_owns(b, tkvd_tenant_tag(a) | 12345));
    ck_assert(!tkvd_tenant_owns(a, 12345));
    ck_assert(tkvd_tenant_owns(NULL, 12345));
    tkvd_config_free(&c);
}
END_TEST

START_TEST(refuses_bad_lines)
{
    static const char *const bad[][3] = {
        {"tenant.a.uid", "", "empty list"},
        {"tenant.a.uid", "12,,3", "not a list"},
        {"tenant.a.uid", "-1", "not a list"},
        {"tenant.a.uid", "4294967295", "out of range"},
        {"tenant.a.gid", "abc", "not a list"},
        {"tenant.a.token_sha256", "abcd", "64 hex digits"},
        {"tenant.a.token_sha256", "zz86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08", "not hex"},
        {"tenant.a.tls_subject", "", "must not be empty"},
        {"tenant.a.admin", "maybe", "not a boolean"},
        {"tenant.a.quota", "1", "unknown tenant field"},
        {"tenant.a.quota_l2_blocks", "-1", "not a block count"},
        {"tenant.a.quota_l2_blocks", "12x", "not a block count"},
        {"tenant.a.guaranteed_l2_blocks", "", "not a block count"},
        {"tenant.a.guaranteed_l2_blocks", "1099511627777", "not a block count"},
        {"tenant.a.quota_l1_blocks", "x", "not a block count"},
        {"tenant.a.guaranteed_l1_blocks", "-3", "not a block count"},
        {"tenant.a.quota_l4_blocks", "1099511627777", "not a block count"},
        {"tenant.a.guaranteed_l4_blocks", "1", "unknown tenant field"},
        {"tenant.a.quota_l5_blocks", "1", "unknown tenant field"},
        {"tenant.a b.uid", "1", "tenant name"},
        {"tenant..uid", "1", "tenant.<name>.<field>"},
        {"tenant.uid", "1", "tenant.<name>.<field>"},
        {"tenant.a.", "1", "tenant.<name>.<field>"},
        {"tenant.0123456789012345678901234567890123456789012345678901234567890123.uid", "1", "tenant name"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        tkvd_config c;
        tkvd_config_init(&c);
        char err[TKVD_ERR_LEN] = "";
        ck_assert_msg(set(&c, bad[i][0], bad[i][1], err) == TKV_EINVAL, "%s = %s accepted",
                      bad[i][0], bad[i][1]);
        ck_assert_msg(strstr(err, bad[i][2]) && strstr(err, "t.conf:1"), "%s = %s: '%s'",
                      bad[i][0], bad[i][1], err);
        ck_assert_uint_eq(c.tenants.n, 0); /* a refused first line creates no tenant */
        tkvd_config_free(&c);
    }
}
END_TEST

START_TEST(table_checks)
{
    static const char *const cases[][5] = {
        /* key1 value1 key2 value2 expected message */
        {"tenant.a.uid", "5", "tenant.b.uid", "5", "uid 5 belongs to tenants a and b"},
        {"tenant.a.tls_subject", "CN=x", "tenant.b.tls_subject", "CN=x", "belongs to tenants a and b"},
        {"tenant.a.token_sha256", SHA_TEST, "tenant.b.token_sha256", SHA_TEST, "belongs to tenants a and b"},
        {"tenant.a.uid", "5", "tenant.b.admin", "on", "tenant.b: names no identity"},
        {"tenant.a.quota_l2_blocks", "4", "tenant.a.guaranteed_l2_blocks", "5",
         "exceeds its quota_l2_blocks"},
        {"tenant.a.uid", "5", "tenant.a.guaranteed_l2_blocks", "1099511627776",
         "exceeds its L2 region"},
        {"tenant.a.uid", "5", "tenant.a.quota_l2_blocks", "1099511627776", "more than L2 holds"},
        {"tenant.a.quota_l3_blocks", "4", "tenant.a.guaranteed_l3_blocks", "5",
         "exceeds its quota_l3_blocks"},
        {"tenant.a.quota_l1_blocks", "4", "tenant.a.guaranteed_l1_blocks", "5",
         "exceeds its quota_l1_blocks"},
        {"tenant.a.uid", "5", "tenant.a.guaranteed_l1_blocks", "1099511627776",
         "exceeds its L1 region"},
        {"tenant.a.uid", "5", "tenant.a.quota_l1_blocks", "1099511627776", "more than L1 holds"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        tkvd_config c;
        tkvd_config_init(&c);
        char err[TKVD_ERR_LEN] = "";
        ck_assert_int_eq(set(&c, cases[i][0], cases[i][1], err), TKV_OK);
        ck_assert_int_eq(set(&c, cases[i][2], cases[i][3], err), TKV_OK);
        ck_assert_int_eq(tkvd_config_finish(&c, err, sizeof(err)), TKV_EINVAL);
        ck_assert_msg(strstr(err, cases[i][4]), "case %zu: '%s'", i, err);
        tkvd_config_free(&c);
    }
    /* tls_client_ca needs the server's own certificate */
    tkvd_config c;
    tkvd_config_init(&c);
    char err[TKVD_ERR_LEN] = "";
    ck_assert_int_eq(set(&c, "tls_client_ca", "/etc/hostname", err), TKV_OK);
    ck_assert_int_eq(tkvd_config_finish(&c, err, sizeof(err)), TKV_EINVAL);
    ck_assert_ptr_nonnull(strstr(err, "tls_client_ca needs tls_cert"));
    tkvd_config_free(&c);
}
END_TEST

START_TEST(no_tenants_is_the_default)
{
    tkvd_config c;
    tkvd_config_init(&c);
    char err[TKVD_ERR_LEN];
    ck_assert_int_eq(tkvd_config_finish(&c, err, sizeof(err)), TKV_OK);
    ck_assert(!tkvd_tenants_enabled(&c.tenants));
    tkvd_identity p = {.has_ucred = true, .uid = 0};
    ck_assert_ptr_null(tkvd_tenant_of_peer(&c.tenants, &p));
    tkvd_config_free(&c);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("tenant");
    TCase *tc = tcase_create("tenant");
    tcase_add_test(tc, parses_and_maps_peers);
    tcase_add_test(tc, refuses_bad_lines);
    tcase_add_test(tc, table_checks);
    tcase_add_test(tc, no_tenants_is_the_default);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
