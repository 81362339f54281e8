/* test_crash.c - kill -9 at random moments never loses a block reported durable, never makes
 * an incomplete block visible, and a block damaged on disk is detected and never returned.
 *
 * 50 rounds: a child process (storage_crash_child, see crash.cmake) writes blocks into one
 * store directory and reports every block it knows durable on a pipe; the parent kills it
 * with SIGKILL after a random delay, reopens the L3 store there (recovery runs), and checks
 * every block. Rounds cycle through three ways in (crash_payload.h): the whole store
 * (tkv_store_put + tkv_store_flush), and tkv_l3 directly over pread/pwrite and over io_uring
 * (where the kernel grants it) with deletes and compactions mixed in.
 * TKV_CRASH_SEED=<n> replays one run.
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "crash_payload.h"
#include "tkv_l3.h"
#include "tkv_l3_hooks.h"

#define ROUNDS 50

enum { ST_NONE = 0, ST_DURABLE = 1, ST_DELETING = 2, ST_FLIPPED = 3 };

static uint8_t *g_state; /* by id */
static uint64_t g_num_durable;

static void on_message(const uint8_t msg[9])
{
    uint64_t id;
    memcpy(&id, msg + 1, 8);
    ck_assert_uint_lt(id, (uint64_t)ROUNDS * CRASH_IDS_PER_ROUND);
    if (msg[0] == CRASH_MSG_DURABLE) {
        ck_assert_int_eq(g_state[id], ST_NONE);
        g_state[id] = ST_DURABLE;
        g_num_durable++;
    } else {
        ck_assert_int_eq(msg[0], CRASH_MSG_DELETING);
        if (g_state[id] == ST_DURABLE)
            g_state[id] = ST_DELETING;
    }
}

/* Reads whole messages until the deadline (ms; < 0 = until end of file). */
static void pump(int fd, int64_t deadline_ms, uint8_t *partial, size_t *have)
{
    uint64_t start = tkv_now_ns();
    for (;;) {
        int wait_ms = -1;
        if (deadline_ms >= 0) {
            int64_t left = deadline_ms - (int64_t)((tkv_now_ns() - start) / 1000000);
            if (left <= 0)
                return;
            wait_ms = (int)left;
        }
        struct pollfd pfd = {.fd = fd, .events = POLLIN};
        int r = poll(&pfd, 1, wait_ms);
        if (r < 0 && errno == EINTR)
            continue;
        if (r == 0)
            return;
        uint8_t buf[9 * 256];
        ssize_t n = read(fd, buf, sizeof(buf));
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        for (ssize_t i = 0; i < n; i++) {
            partial[(*have)++] = buf[i];
            if (*have == 9) {
                on_message(partial);
                *have = 0;
            }
        }
    }
}

typedef struct scan_keys {
    tkv_key *keys;
    size_t n, cap;
} scan_keys;

static int collect(void *arg, const tkv_l3_info *info)
{
    scan_keys *sk = arg;
    if (sk->n == sk->cap) {
        sk->cap = sk->cap ? 2 * sk->cap : 1024;
        sk->keys = realloc(sk->keys, sk->cap * sizeof(*sk->keys));
    }
    sk->keys[sk->n++] = info->key;
    return 0;
}

/* Every indexed block must read back exactly as its id says; returns how many were read. */
static size_t check_all_indexed(tkv_l3 *l3)
{
    scan_keys sk = {0};
    ck_assert_int_eq(tkv_l3_scan(l3, collect, &sk), TKV_OK);
    enum { CHUNK = 32 };
    uint8_t *bufs = malloc((size_t)CHUNK * CRASH_MAX_BLOCK);
    uint8_t *want = malloc(CRASH_MAX_BLOCK);
    for (size_t i = 0; i < sk.n; i += CHUNK) {
        size_t m = sk.n - i < CHUNK ? sk.n - i : CHUNK;
        tkv_l3_get_req g[CHUNK];
        for (size_t k = 0; k < m; k++)
            g[k] = (tkv_l3_get_req){.key = sk.keys[i + k],
                                    .dst = bufs + k * CRASH_MAX_BLOCK,
                                    .cap = CRASH_MAX_BLOCK};
        tkv_l3_get_batch(l3, g, m);
        for (size_t k = 0; k < m; k++) {
            ck_assert_msg(g[k].status == TKV_OK, "indexed block unreadable: %s",
                          tkv_strerror(g[k].status));
            uint64_t id;
            memcpy(&id, g[k].dst, 8);
            ck_assert_uint_lt(id, (uint64_t)ROUNDS * CRASH_IDS_PER_ROUND);
            tkv_key key;
            crash_key(&key, id);
            ck_assert_msg(memcmp(key.b, g[k].key.b, TKV_KEY_BYTES) == 0,
                          "block under another block's key");
            ck_assert_uint_eq(g[k].len, crash_len(id));
            crash_fill(want, id);
            ck_assert_msg(memcmp(want, g[k].dst, g[k].len) == 0, "block %llu differs",
                          (unsigned long long)id);
        }
    }
    free(bufs);
    free(want);
    free(sk.keys);
    return sk.n;
}

/* Every block reported durable (and not deleted since) reads back exactly. */
static void check_durable(tkv_l3 *l3, uint64_t max_id)
{
    uint8_t *got = malloc(CRASH_MAX_BLOCK), *want = malloc(CRASH_MAX_BLOCK);
    for (uint64_t id = 0; id < max_id; id++) {
        if (g_state[id] == ST_NONE)
            continue;
        tkv_l3_get_req g = {.dst = got, .cap = CRASH_MAX_BLOCK};
        crash_key(&g.key, id);
        int rc = tkv_l3_get_batch(l3, &g, 1);
        if (g_state[id] == ST_DURABLE) {
            ck_assert_msg(rc == TKV_OK, "durable block %llu lost: %s",
                          (unsigned long long)id, tkv_strerror(rc));
        } else if (g_state[id] == ST_DELETING) {
            ck_assert(rc == TKV_OK || rc == TKV_ENOTFOUND);
        } else {
            ck_assert_int_eq(rc, TKV_ENOTFOUND); /* flipped by us, dropped when detected */
        }
        if (rc == TKV_OK) {
            crash_fill(want, id);
            ck_assert_uint_eq(g.len, crash_len(id));
            ck_assert(memcmp(want, got, g.len) == 0);
        }
    }
    free(got);
    free(want);
}

/* Flips one byte of a random durable block on disk; a read must detect it. */
static void flip_one(tkv_l3 *l3, uint64_t max_id)
{
    uint64_t start = (uint64_t)rand() % (max_id ? max_id : 1);
    for (uint64_t k = 0; k < max_id; k++) {
        uint64_t id = (start + k) % max_id;
        if (g_state[id] != ST_DURABLE)
            continue;
        tkv_key key;
        crash_key(&key, id);
        char path[4096];
        uint64_t off, stored;
        ck_assert_int_eq(tkv_l3_locate(l3, &key, path, sizeof(path), &off, &stored), TKV_OK);
        int fd = open(path, O_RDWR);
        ck_assert_int_ge(fd, 0);
        uint64_t at = off + (uint64_t)rand() % stored;
        uint8_t b;
        ck_assert_int_eq(pread(fd, &b, 1, (off_t)at), 1);
        b ^= (uint8_t)(1u << (rand() % 8));
        ck_assert_int_eq(pwrite(fd, &b, 1, (off_t)at), 1);
        fsync(fd);
        posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
        close(fd);
        uint8_t *got = malloc(CRASH_MAX_BLOCK);
        tkv_l3_get_req g = {.key = key, .dst = got, .cap = CRASH_MAX_BLOCK};
        ck_assert_int_eq(tkv_l3_get_batch(l3, &g, 1), TKV_ECHECKSUM);
        ck_assert_int_eq(tkv_l3_get_batch(l3, &g, 1), TKV_ENOTFOUND);
        free(got);
        g_state[id] = ST_FLIPPED;
        return;
    }
}

static int uring_available(void)
{
    struct io_uring ring;
    if (io_uring_queue_init(4, &ring, 0) < 0)
        return 0;
    io_uring_queue_exit(&ring);
    return 1;
}

START_TEST(test_kill9)
{
    unsigned seed = (unsigned)time(NULL);
    if (getenv("TKV_CRASH_SEED"))
        seed = (unsigned)strtoul(getenv("TKV_CRASH_SEED"), NULL, 10);
    fprintf(stderr, "test_crash: seed %u (TKV_CRASH_SEED=%u replays it)\n", seed, seed);
    srand(seed);
    int have_uring = uring_available();
    char *dir = tu_mkdtemp("crash");
    g_state = calloc((size_t)ROUNDS * CRASH_IDS_PER_ROUND, 1);
    g_num_durable = 0;
    size_t max_indexed = 0, num_killed = 0;

    for (int round = 0; round < ROUNDS; round++) {
        int via = crash_round_via((uint64_t)round);
        int use_uring = have_uring && via != CRASH_VIA_L3_PSYNC;
        int p[2];
        ck_assert_int_eq(pipe(p), 0);
        char round_s[16];
        snprintf(round_s, sizeof(round_s), "%d", round);
        pid_t pid = fork();
        ck_assert_int_ge(pid, 0);
        if (pid == 0) {
            close(p[0]);
            if (dup2(p[1], 3) < 0)
                _exit(126);
            execl(TKV_CRASH_CHILD, TKV_CRASH_CHILD, dir, round_s,
                  via == CRASH_VIA_STORE ? "store" : use_uring ? "uring" : "psync",
                  (char *)NULL);
            _exit(127);
        }
        close(p[1]);
        uint8_t partial[9];
        size_t have = 0;
        pump(p[0], 20 + rand() % 300, partial, &have);
        kill(pid, SIGKILL);
        int status = 0;
        ck_assert_int_eq(waitpid(pid, &status, 0), pid);
        pump(p[0], -1, partial, &have); /* what it reported before dying */
        close(p[0]);
        ck_assert_uint_eq(have, 0);
        ck_assert_msg(WIFSIGNALED(status) || (WIFEXITED(status) && WEXITSTATUS(status) == 0),
                      "child failed on its own (exit %d)", WEXITSTATUS(status));
        num_killed += WIFSIGNALED(status);

        tkv_l3 *l3 = NULL;
        int rc = tu_l3_open(dir, use_uring ? TKV_IO_URING : TKV_IO_PSYNC, 1, CRASH_MAX_BLOCK,
                            256 * 1024, 1, &l3);
        ck_assert_msg(rc == TKV_OK, "reopen after kill: %s", tkv_strerror(rc));
        uint64_t max_id = (uint64_t)(round + 1) * CRASH_IDS_PER_ROUND;
        check_durable(l3, max_id);
        size_t n = check_all_indexed(l3);
        if (n > max_indexed)
            max_indexed = n;
        tkv_l3_stats st;
        tkv_l3_get_stats(l3, &st);
        ck_assert_uint_eq(st.checksum_failures, 0);
        flip_one(l3, max_id);
        tkv_l3_close(l3);
    }
    uint64_t by_via[3] = {0};
    for (uint64_t id = 0; id < (uint64_t)ROUNDS * CRASH_IDS_PER_ROUND; id++)
        if (g_state[id] != ST_NONE)
            by_via[crash_round_via(id / CRASH_IDS_PER_ROUND)]++;
    fprintf(stderr, "test_crash: %d rounds, %zu killed, %llu blocks reported durable (store "
            "%llu, l3 psync %llu, l3 %s %llu), up to %zu indexed\n", ROUNDS, num_killed,
            (unsigned long long)g_num_durable, (unsigned long long)by_via[0],
            (unsigned long long)by_via[1], have_uring ? "io_uring" : "psync",
            (unsigned long long)by_via[2], max_indexed);
    ck_assert_uint_gt(by_via[CRASH_VIA_STORE], 0);
    ck_assert_uint_ge(num_killed, ROUNDS / 2);
    ck_assert_uint_ge(g_num_durable, ROUNDS / 2); /* kills land in writes, not only opens */
    free(g_state);
    tu_rmdir(dir);
}
END_TEST

int main(void)
{
    if (!getenv("TKV_TEST_VERBOSE"))
        tkv_log_level = TKV_LOG_ERROR - 1; /* the flipped blocks log errors on purpose */
    Suite *s = suite_create("crash");
    TCase *tc = tcase_create("kill9");
    tcase_set_timeout(tc, 280);
    tcase_add_test(tc, test_kill9);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
