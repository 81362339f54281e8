/* test_config.c - tierkvd's configuration, black-box: the real binary is run with bad config
 * files and flags; each must exit 2 with one clear message naming the key (and file:line),
 * and flags must override the file. argv[1] is the tierkvd binary.
 *
 * Config errors stop tierkvd before it creates folders or sockets, so these runs are fast
 * and leave nothing behind; --check-config prints the effective configuration.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

static const char *g_bin;
static char g_dir[64];

typedef struct run_result {
    int code;          /* exit status, or 128 + signal */
    char out[16384];   /* stdout + stderr */
} run_result;

/* Runs tierkvd with args (NULL-terminated), kills it after 20 s. */
static void run(run_result *r, const char *const *args)
{
    char path[128];
    snprintf(path, sizeof(path), "%s/out.txt", g_dir);
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0) {
        int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0)
            _exit(120);
        dup2(fd, 1);
        dup2(fd, 2);
        const char *argv[64];
        int n = 0;
        argv[n++] = g_bin;
        for (int i = 0; args[i] && n < 63; i++)
            argv[n++] = args[i];
        argv[n] = NULL;
        execv(g_bin, (char *const *)argv);
        _exit(121);
    }
    int st = 0;
    for (int i = 0; i < 2000; i++) {
        pid_t w = waitpid(pid, &st, WNOHANG);
        if (w == pid)
            break;
        if (i == 1999) {
            kill(pid, SIGKILL);
            waitpid(pid, &st, 0);
        }
        struct timespec ts = {0, 10 * 1000 * 1000};
        nanosleep(&ts, NULL);
    }
    r->code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
    FILE *f = fopen(path, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(r->out, 1, sizeof(r->out) - 1, f);
    r->out[n] = 0;
    fclose(f);
}

static const char *write_conf(const char *name, const char *text)
{
    static char path[128];
    snprintf(path, sizeof(path), "%s/%s", g_dir, name);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    fputs(text, f);
    fclose(f);
    return path;
}

/* A config file with one bad line must exit 2 with `expect` in the output. */
static void expect_bad_file(const char *text, const char *expect)
{
    const char *conf = write_conf("bad.conf", text);
    run_result r;
    run(&r, (const char *const[]){"--config", conf, "--check-config", NULL});
    ck_assert_msg(r.code == 2, "exit %d for:\n%s\noutput: %s", r.code, text, r.out);
    ck_assert_msg(strstr(r.out, expect), "expected '%s' in: %s", expect, r.out);
    ck_assert_msg(strncmp(r.out, "tierkvd: ", 9) == 0, "message not prefixed: %s", r.out);
}

static void setup(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/tkvd-cfg-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(g_dir));
}

static void teardown(void)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "rm -rf '%s'", g_dir);
    ck_assert_int_eq(system(cmd), 0);
}

START_TEST(unknown_key_names_file_and_line)
{
    char expect[160];
    snprintf(expect, sizeof(expect), "%s/bad.conf:3: unknown key 'num_layer'", g_dir);
    expect_bad_file("# comment\nnum_layers = 4\nnum_layer = 8\n", expect);
}
END_TEST

START_TEST(bad_values)
{
    expect_bad_file("num_layers = four\n", "bad.conf:1: num_layers: 'four' is not an unsigned integer");
    expect_bad_file("num_layers = -3\n", "num_layers: '-3' is not an unsigned integer");
    expect_bad_file("\n\nnum_layers = 2000\n", "bad.conf:3: num_layers: 2000 is out of range [1, 1024]");
    expect_bad_file("kv_dtype = fp4\n", "kv_dtype: 'fp4' is not one of: fp8_e4m3, bf16");
    expect_bad_file("write_through = maybe\n", "write_through: 'maybe' is not a boolean");
    expect_bad_file("l2_bytes = 12X\n", "l2_bytes: '12X' is not a size");
    expect_bad_file("zstd_level = 25\n", "zstd_level: 25 is out of range [0, 19]");
    expect_bad_file("log_level = loud\n", "log_level: 'loud' is not one of: error, warn, info, debug");
    expect_bad_file("just some words\n", "bad.conf:1: expected 'key = value'");
    expect_bad_file("= 3\n", "missing key before '='");
    expect_bad_file("model_id = \"\"\n", "model_id: must not be empty");
    expect_bad_file("http_port = 70000\n", "http_port: 70000 is out of range [0, 65535]");
}
END_TEST

START_TEST(whole_config_rules)
{
    expect_bad_file("head_dim = 96\n", "geometry:");
    expect_bad_file("block_tokens = 48\n", "geometry:");
    expect_bad_file("kv_dtype = bf16\nscale_mode = per_token_head\n", "geometry:");
    expect_bad_file("policy = fifo\n", "policy: unknown policy 'fifo'");
    expect_bad_file("lease_ttl_ms = 5000\nlease_ttl_max_ms = 1000\n",
                    "lease_ttl_ms (5000) must not exceed lease_ttl_max_ms (1000)");
    expect_bad_file("l2_bytes = 1K\n", "l2_bytes: 1024 bytes hold no block");
    expect_bad_file("l2_blocks = 8\n", "less than max_blocks_per_rpc");
    expect_bad_file("grpc_tcp = 127.0.0.1:7700\ntls_cert = /etc/hostname\n",
                    "tls_cert and tls_key must be given together");
    expect_bad_file("tls_cert = /etc/hostname\ntls_key = /etc/hostname\n", "need grpc_tcp");
    expect_bad_file("grpc_tcp = 7700\n", "grpc_tcp: '7700' is not host:port");
    expect_bad_file("run_dir = /tmp/aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
                    "aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa\n",
                    "too long for a UNIX socket");
}
END_TEST

START_TEST(missing_file_and_bad_flags)
{
    run_result r;
    run(&r, (const char *const[]){"--config", "/nonexistent/tierkvd.conf", NULL});
    ck_assert_int_eq(r.code, 2);
    ck_assert_msg(strstr(r.out, "/nonexistent/tierkvd.conf: cannot open config file"), "%s", r.out);

    run(&r, (const char *const[]){"--bogus-flag", "1", NULL});
    ck_assert_int_eq(r.code, 2);
    ck_assert_msg(strstr(r.out, "--bogus-flag: unknown option"), "%s", r.out);

    run(&r, (const char *const[]){"--num-layers", "0", "--check-config", NULL});
    ck_assert_int_eq(r.code, 2);
    ck_assert_msg(strstr(r.out, "--num-layers: num_layers: 0 is out of range"), "%s", r.out);

    run(&r, (const char *const[]){"--data-dir", NULL});
    ck_assert_int_eq(r.code, 2);
    ck_assert_msg(strstr(r.out, "--data-dir needs a value"), "%s", r.out);

    run(&r, (const char *const[]){"stray", NULL});
    ck_assert_int_eq(r.code, 2);
    ck_assert_msg(strstr(r.out, "unexpected argument 'stray'"), "%s", r.out);
}
END_TEST

START_TEST(flags_override_the_file)
{
    const char *conf = write_conf("ok.conf", "num_layers = 8\n"
                                             "data_dir = /srv/from-file\n"
                                             "http_port = 9000\n"
                                             "write_through = on\n"
                                             "l2_bytes = 64M\n");
    run_result r;
    /* The flag comes before --config and still wins: flags are applied after the file. */
    run(&r, (const char *const[]){"--num-layers=2", "--config", conf, "--http_port", "0",
                                  "--no-write-through", "--check-config", NULL});
    ck_assert_msg(r.code == 0, "exit %d: %s", r.code, r.out);
    ck_assert_msg(strstr(r.out, "num_layers = 2\n"), "%s", r.out);
    ck_assert_msg(strstr(r.out, "http_port = 0\n"), "%s", r.out);
    ck_assert_msg(strstr(r.out, "write_through = off\n"), "%s", r.out);
    /* What no flag touched comes from the file; derived paths follow data_dir. */
    ck_assert_msg(strstr(r.out, "data_dir = \"/srv/from-file\"\n"), "%s", r.out);
    ck_assert_msg(strstr(r.out, "l3_dir = \"/srv/from-file/l3\"\n"), "%s", r.out);
    ck_assert_msg(strstr(r.out, "l2_bytes = 67108864\n"), "%s", r.out);
    ck_assert_msg(strstr(r.out, "policy = \"hazard\"\n"), "the default policy: %s", r.out);
    /* 2 layers x K,V x 64 tokens x 2 heads x 64 dims of fp8 = 32 KiB (+ no in-page scales
     * for per-tensor scaling): 64 MiB hold 2048 blocks. */
    ck_assert_msg(strstr(r.out, "l2 = 2048 blocks"), "%s", r.out);
}
END_TEST

START_TEST(help_lists_every_key)
{
    run_result r;
    run(&r, (const char *const[]){"--help", NULL});
    ck_assert_int_eq(r.code, 0);
    static const char *const keys[] = {"model_id", "num_layers", "num_kv_heads", "head_dim",
                                       "block_tokens", "kv_dtype", "scale_mode", "l2_bytes",
                                       "l3_dir", "data_dir", "run_dir", "pid_file", "log_file",
                                       "grpc_socket", "grpc_tcp", "tls_cert", "tls_key",
                                       "attach_socket", "http_port", "policy", "write_through",
                                       "zstd_level", "io_mode", "lease_ttl_ms", "log_level", NULL};
    for (int i = 0; keys[i]; i++)
        ck_assert_msg(strstr(r.out, keys[i]), "--help lacks %s", keys[i]);
    run(&r, (const char *const[]){"--version", NULL});
    ck_assert_int_eq(r.code, 0);
    ck_assert_msg(strncmp(r.out, "tierkvd ", 8) == 0, "%s", r.out);
}
END_TEST

START_TEST(example_config_is_valid)
{
    char conf[512];
    snprintf(conf, sizeof(conf), "%s/daemon/tierkvd.conf.example", TKV_SOURCE_DIR);
    run_result r;
    run(&r, (const char *const[]){"--config", conf, "--check-config", NULL});
    ck_assert_msg(r.code == 0, "exit %d: %s", r.code, r.out);
}
END_TEST

int main(int argc, char **argv)
{
    if (argc < 2) {
        fprintf(stderr, "usage: %s PATH-TO-TIERKVD\n", argv[0]);
        return 2;
    }
    g_bin = argv[1];
    Suite *s = suite_create("daemon_config");
    TCase *tc = tcase_create("config");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, unknown_key_names_file_and_line);
    tcase_add_test(tc, bad_values);
    tcase_add_test(tc, whole_config_rules);
    tcase_add_test(tc, missing_file_and_bad_flags);
    tcase_add_test(tc, flags_override_the_file);
    tcase_add_test(tc, help_lists_every_key);
    tcase_add_test(tc, example_config_is_valid);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
