/* test_rcluster.c - the Redis Cluster router's pure parts: the specification's CRC16 vector,
 * key slots with and without hash tags (values as `CLUSTER KEYSLOT` of redis-server 7.0
 * answers them), and the seed-list parser's acceptance and refusals. The router against a
 * live cluster (MOVED, ASK, failover) is tested in tests/l4/. */
#include <check.h>
#include <stdlib.h>
#include <string.h>

#include "tkv_base.h"
#include "tkv_rcluster.h"

START_TEST(crc16_matches_the_specification)
{
    ck_assert_uint_eq(tkv_rc_crc16("123456789", 9), 0x31C3);
    ck_assert_uint_eq(tkv_rc_crc16("", 0), 0);
    /* one flipped bit anywhere changes it */
    char k[] = "123456789";
    for (size_t i = 0; i < 9; i++) {
        k[i] ^= 1;
        ck_assert_uint_ne(tkv_rc_crc16(k, 9), 0x31C3);
        k[i] ^= 1;
    }
}
END_TEST

static uint16_t slot(const char *k) { return tkv_rc_key_slot(k, strlen(k)); }

START_TEST(slots_match_cluster_keyslot)
{
    ck_assert_uint_eq(slot("foo"), 12182);
    ck_assert_uint_eq(slot("bar"), 5061);
    ck_assert_uint_eq(slot("hello"), 866);
    ck_assert_uint_eq(slot("123456789"), 12739); /* 0x31C3 mod 16384 */
}
END_TEST

START_TEST(hash_tags_follow_the_specification)
{
    /* the tag alone is hashed: both keys in one slot */
    ck_assert_uint_eq(slot("{user1000}.following"), 3443);
    ck_assert_uint_eq(slot("{user1000}.followers"), 3443);
    ck_assert_uint_eq(slot("{user1000}.x"), tkv_rc_key_slot("user1000", 8));
    /* "{}" is no tag: the whole key is hashed */
    ck_assert_uint_eq(slot("foo{}{bar}"), 8363);
    ck_assert_uint_eq(slot("{}"), 15257);
    /* the tag ends at the first '}' after the first '{' */
    ck_assert_uint_eq(slot("foo{{bar}}zap"), 4015);
    ck_assert_uint_eq(slot("foo{bar}{zap}"), 5061);
    /* an unclosed '{' is no tag */
    ck_assert_uint_eq(slot("a{b"), 13340);
    /* binary keys work, a NUL included */
    const char bin[] = {'{', 0, 1, '}', 'x'};
    ck_assert_uint_eq(tkv_rc_key_slot(bin, sizeof(bin)), tkv_rc_crc16(bin + 1, 2) & 16383);
}
END_TEST

START_TEST(seed_lists_are_validated)
{
    char hosts[8][64], err[160];
    int ports[8];
    ck_assert_int_eq(tkv_rc_parse_nodes("127.0.0.1:7000", hosts, ports, 8, err, sizeof(err)), 1);
    ck_assert_str_eq(hosts[0], "127.0.0.1");
    ck_assert_int_eq(ports[0], 7000);
    ck_assert_int_eq(tkv_rc_parse_nodes("a:1,redis-2.local:65535", hosts, ports, 8, err,
                                        sizeof(err)), 2);
    ck_assert_str_eq(hosts[1], "redis-2.local");
    ck_assert_int_eq(ports[1], 65535);
    const char *bad[] = {"", "host", ":7000", "h:0", "h:65536", "h:70x", "h:", "h:1,,h:2",
                         "h o:1", "h:1,", NULL};
    for (int i = 0; bad[i]; i++) {
        err[0] = 0;
        ck_assert_msg(tkv_rc_parse_nodes(bad[i], hosts, ports, 8, err, sizeof(err)) == TKV_EINVAL,
                      "accepted \"%s\"", bad[i]);
        ck_assert_msg(err[0], "no message for \"%s\"", bad[i]);
    }
    ck_assert_int_eq(tkv_rc_parse_nodes("a:1,a:2,a:3", hosts, ports, 2, err, sizeof(err)),
                     TKV_EINVAL);
}
END_TEST

START_TEST(an_unreachable_cluster_is_not_an_error)
{
    /* port 1 on loopback: refused at once; the router opens and answers "no node" */
    tkv_rc_opts o = {.nodes = "127.0.0.1:1", .connect_timeout_ms = 200, .timeout_ms = 200};
    tkv_rc *rc = NULL;
    ck_assert_int_eq(tkv_rc_open(&o, &rc), TKV_OK);
    ck_assert_int_eq(tkv_rc_healthy(rc), 0);
    const char *argv[2] = {"GET", "k"};
    size_t len[2] = {3, 1};
    tkv_rc_cmd c = {.argc = 2, .argv = argv, .argvlen = len, .key_arg = 1};
    ck_assert_int_eq(tkv_rc_exec(rc, &c, 1), TKV_EIO);
    ck_assert_ptr_null(c.reply);
    ck_assert_int_eq(c.status, TKV_EIO);
    tkv_rc_close(rc);
    o.nodes = "nonsense";
    ck_assert_int_eq(tkv_rc_open(&o, &rc), TKV_EINVAL);
}
END_TEST

int main(void)
{
    Suite *s = suite_create("rcluster");
    TCase *tc = tcase_create("rcluster");
    tcase_add_test(tc, crc16_matches_the_specification);
    tcase_add_test(tc, slots_match_cluster_keyslot);
    tcase_add_test(tc, hash_tags_follow_the_specification);
    tcase_add_test(tc, seed_lists_are_validated);
    tcase_add_test(tc, an_unreachable_cluster_is_not_an_error);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
