/* test_cli.c - the `tierkv` CLI against a real tierkvd: every command runs, --json output
 * parses (checked with python3's json module), and the documented exit codes hold.
 */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

static tkvt_daemon g_d;
static char g_tokens_hit[160], g_tokens_miss[160], g_tokens_bad[160];

/* Runs `tierkv --socket S ARGS` through sh; stdout goes to *out (malloc'ed, may be NULL).
 * Returns the exit status. */
static int run_cli(const char *args, char **out)
{
    char cmd[1024], outfile[160];
    snprintf(outfile, sizeof(outfile), "%s/cli.out", g_d.dir);
    snprintf(cmd, sizeof(cmd), "%s/client/tierkv --socket %s %s > %s", tkvt_build_dir(),
             g_d.sock, args, outfile);
    int st = system(cmd);
    ck_assert_msg(st != -1 && WIFEXITED(st), "cannot run: %s", cmd);
    if (out) {
        FILE *f = fopen(outfile, "r");
        ck_assert_ptr_nonnull(f);
        *out = calloc(1, 1 << 20);
        size_t n = fread(*out, 1, (1 << 20) - 1, f);
        (*out)[n] = '\0';
        fclose(f);
    }
    return WEXITSTATUS(st);
}

/* The output parses as JSON (every line, for line-per-object output) and has `key`. */
static void assert_json(const char *args, const char *key)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd),
             "%s/client/tierkv --socket %s %s | python3 -c 'import json,sys\n"
             "lines=[l for l in sys.stdin.read().splitlines() if l.strip()]\n"
             "assert lines, \"no output\"\n"
             "for l in lines:\n"
             "    o=json.loads(l)\n"
             "    assert \"%s\" in o, o\n'",
             tkvt_build_dir(), g_d.sock, args, key);
    int st = system(cmd);
    ck_assert_msg(st != -1 && WIFEXITED(st) && WEXITSTATUS(st) == 0,
                  "`tierkv %s` did not print JSON with \"%s\"", args, key);
}

static void write_tokens(const char *path, uint64_t seed, size_t n, const char *sep)
{
    uint32_t *t = malloc(n * sizeof(*t));
    tkvt_tokens(seed, t, n);
    FILE *f = fopen(path, "w");
    if (!f) {
        perror(path); /* called from main(), outside any test: no ck_assert here */
        exit(1);
    }
    for (size_t i = 0; i < n; i++)
        fprintf(f, "%u%s", t[i], (i % 10 == 9) ? "\n" : sep);
    fclose(f);
    free(t);
}

START_TEST(test_help_and_usage)
{
    char *out;
    ck_assert_int_eq(run_cli("--help", &out), 0);
    ck_assert(strstr(out, "Exit codes") != NULL);
    ck_assert(strstr(out, "verify") != NULL);
    free(out);
    const char *cmds[] = {"status", "top", "lookup", "blocks", "evict", "flush", "verify",
                          "health"};
    for (size_t i = 0; i < sizeof(cmds) / sizeof(cmds[0]); i++) {
        char a[64];
        snprintf(a, sizeof(a), "%s --help", cmds[i]);
        ck_assert_int_eq(run_cli(a, &out), 0);
        ck_assert_msg(strstr(out, "usage: tierkv") != NULL, "%s --help: %s", cmds[i], out);
        free(out);
    }
    ck_assert_int_eq(run_cli("", NULL), 1);
    ck_assert_int_eq(run_cli("frobnicate 2>/dev/null", NULL), 1);
    ck_assert_int_eq(run_cli("status --bogus 2>/dev/null", NULL), 1);
    ck_assert_int_eq(run_cli("evict 2>/dev/null", NULL), 1); /* --tier is required */
    ck_assert_int_eq(run_cli("top --interval x 2>/dev/null", NULL), 1);
}
END_TEST

START_TEST(test_unreachable_exit_3)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "%s/client/tierkv --socket %s/none.sock --timeout 2000 status "
                               "2>/dev/null",
             tkvt_build_dir(), g_d.dir);
    int st = system(cmd);
    ck_assert(WIFEXITED(st));
    ck_assert_int_eq(WEXITSTATUS(st), 3);
}
END_TEST

START_TEST(test_lookup_hit_miss_and_json)
{
    char *out;
    /* a miss exits 2 */
    char a[256];
    snprintf(a, sizeof(a), "lookup %s", g_tokens_miss);
    ck_assert_int_eq(run_cli(a, &out), 2);
    ck_assert(strstr(out, "0 of 10 blocks hit") != NULL);
    free(out);
    /* the prompt put by main() hits all 10 blocks, read from stdin this time */
    snprintf(a, sizeof(a), "lookup < %s", g_tokens_hit);
    ck_assert_int_eq(run_cli(a, &out), 0);
    ck_assert_msg(strstr(out, "10 of 10 blocks hit") != NULL, "%s", out);
    free(out);
    snprintf(a, sizeof(a), "lookup --json %s", g_tokens_hit);
    assert_json(a, "hit_blocks");
    ck_assert_int_eq(run_cli(a, &out), 0);
    ck_assert(strstr(out, "\"hit_blocks\":10") != NULL);
    free(out);
    /* malformed token input is a usage error */
    snprintf(a, sizeof(a), "lookup %s 2>/dev/null", g_tokens_bad);
    ck_assert_int_eq(run_cli(a, NULL), 1);
    ck_assert_int_eq(run_cli("lookup /nonexistent/tokens 2>/dev/null", NULL), 1);
}
END_TEST

START_TEST(test_read_commands_json)
{
    char *out;
    ck_assert_int_eq(run_cli("status", &out), 0);
    ck_assert(strstr(out, TKVT_MODEL) != NULL);
    free(out);
    assert_json("status --json", "hit_rate");
    assert_json("status --json", "tiers");
    assert_json("health --json", "status");
    assert_json("blocks --json --limit 5", "blocks");
    assert_json("blocks --tier l2 --json", "total");
    assert_json("top --json --count 2 --interval 0.1", "tokens_saved_per_s");
    ck_assert_int_eq(run_cli("top --count 1 --interval 0.1", &out), 0);
    ck_assert(strstr(out, "hit rate") != NULL);
    free(out);
    ck_assert_int_eq(run_cli("blocks --limit 3", &out), 0);
    ck_assert(strstr(out, "blocks in the cache") != NULL);
    free(out);
}
END_TEST

START_TEST(test_flush_evict_verify)
{
    char *out, a[256];
    ck_assert_int_eq(run_cli("flush", NULL), 0);
    assert_json("verify --json --no-progress", "bad");
    ck_assert_int_eq(run_cli("verify --no-progress", &out), 0);
    ck_assert(strstr(out, "0 bad blocks") != NULL);
    free(out);
    /* evicting a prompt from L2 leaves it in L3: lookup still hits, now in L3 */
    snprintf(a, sizeof(a), "evict --tier l2 --tokens %s --json", g_tokens_hit);
    ck_assert_int_eq(run_cli(a, &out), 0);
    ck_assert_msg(strstr(out, "\"evicted\":10") != NULL, "%s", out);
    free(out);
    snprintf(a, sizeof(a), "lookup --json %s", g_tokens_hit);
    ck_assert_int_eq(run_cli(a, &out), 0);
    ck_assert_msg(strstr(out, "\"l3\":10") != NULL, "%s", out);
    free(out);
    /* evicting a prompt that is not cached exits 2 */
    snprintf(a, sizeof(a), "evict --tier l2 --tokens %s", g_tokens_miss);
    ck_assert_int_eq(run_cli(a, NULL), 2);
}
END_TEST

static Suite *suite(void)
{
    Suite *s = suite_create("cli");
    TCase *t = tcase_create("cli");
    tcase_set_timeout(t, 120);
    tcase_add_test(t, test_help_and_usage);
    tcase_add_test(t, test_unreachable_exit_3);
    tcase_add_test(t, test_lookup_hit_miss_and_json);
    tcase_add_test(t, test_read_commands_json);
    tcase_add_test(t, test_flush_evict_verify);
    suite_add_tcase(s, t);
    return s;
}

/* Puts the 10 blocks of the "hit" prompt through libkvclient, in a child process so that
 * this process never initialises gRPC. */
static int seed_daemon(void)
{
    pid_t p = fork();
    if (p == 0) {
        kvc_client *c;
        if (tkvt_connect(&g_d, 0, &c) != KVC_OK)
            _exit(1);
        uint32_t t[10 * TKVT_BLOCK_TOKENS];
        tkvt_tokens(1, t, 10 * TKVT_BLOCK_TOKENS);
        size_t bb = kvc_block_bytes(c);
        uint8_t *pay = malloc(10 * bb);
        for (uint32_t i = 0; i < 10; i++)
            tkvt_payload(1, i, pay + i * bb, bb);
        int rc = kvc_put(c, t, 10 * TKVT_BLOCK_TOKENS, 0, pay, 10, NULL);
        free(pay);
        kvc_close(c);
        _exit(rc == KVC_OK ? 0 : 2);
    }
    int st = 0;
    waitpid(p, &st, 0);
    return WIFEXITED(st) && WEXITSTATUS(st) == 0 ? 0 : -1;
}

int main(void)
{
    if (tkvt_daemon_start(&g_d, NULL) != 0)
        return 1;
    int failed = 1;
    snprintf(g_tokens_hit, sizeof(g_tokens_hit), "%s/hit.tok", g_d.dir);
    snprintf(g_tokens_miss, sizeof(g_tokens_miss), "%s/miss.tok", g_d.dir);
    snprintf(g_tokens_bad, sizeof(g_tokens_bad), "%s/bad.tok", g_d.dir);
    /* the same tokens the seeding put, written comma separated; 4 tokens of tail */
    {
        uint32_t t[10 * TKVT_BLOCK_TOKENS + 4];
        tkvt_tokens(1, t, 10 * TKVT_BLOCK_TOKENS + 4);
        FILE *f = fopen(g_tokens_hit, "w");
        for (size_t i = 0; i < sizeof(t) / sizeof(t[0]); i++)
            fprintf(f, "%u%s", t[i], i % 16 == 15 ? "\n" : ", ");
        fclose(f);
    }
    write_tokens(g_tokens_miss, 2, 10 * TKVT_BLOCK_TOKENS, " ");
    FILE *f = fopen(g_tokens_bad, "w");
    fprintf(f, "1 2 3 banana 5\n");
    fclose(f);
    if (seed_daemon() != 0) {
        fprintf(stderr, "test_cli: could not put the seed prompt\n");
    } else {
        SRunner *sr = srunner_create(suite());
        srunner_run_all(sr, CK_ENV); /* CK_VERBOSITY=verbose lists every test */
        failed = srunner_ntests_failed(sr);
        srunner_free(sr);
    }
    int st = tkvt_daemon_stop(&g_d);
    return (failed == 0 && st == 0) ? 0 : 1;
}
