/* test_diskfull.c - a full disk and a refused io_uring degrade the L3 store without losing
 * anything durable.
 *
 *   storage_test_diskfull          injected ENOSPC (always runs), io_uring refused by a
 *                                  seccomp filter (a real refusal of io_uring_setup), forced
 *                                  pread/pwrite
 *   storage_test_diskfull --mount  a real full file system: a small loop-mounted ext4 (or a
 *                                  tmpfs with size=); exits 77 where mounting is not permitted
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/audit.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/prctl.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "l3_testutil.h"
#include "tkv_l3.h"
#include "tkv_l3_hooks.h"

#define BLK (64 * 1024)

static char *g_mount_dir; /* --mount: the mounted small file system */

static void make_block(uint8_t *b, uint64_t id) { tu_fill_random(b, BLK, id + 1000); }

/* Puts blocks [first, first+n) one batch; returns the batch status, statuses in st[]. */
static int put_blocks(tkv_l3 *l3, uint64_t first, size_t n, int *st)
{
    tkv_l3_put_req *r = calloc(n, sizeof(*r));
    uint8_t *bufs = malloc(n * BLK);
    for (size_t i = 0; i < n; i++) {
        make_block(bufs + i * BLK, first + i);
        tu_key(&r[i].key, 3, first + i);
        r[i].payload = bufs + i * BLK;
        r[i].len = BLK;
    }
    int rc = tkv_l3_put_batch(l3, r, n);
    for (size_t i = 0; i < n; i++)
        st[i] = r[i].status;
    free(bufs);
    free(r);
    return rc;
}

static int get_block(tkv_l3 *l3, uint64_t id)
{
    uint8_t *want = malloc(BLK), *got = malloc(BLK);
    make_block(want, id);
    tkv_l3_get_req g = {.dst = got, .cap = BLK};
    tu_key(&g.key, 3, id);
    int rc = tkv_l3_get_batch(l3, &g, 1);
    if (rc == TKV_OK)
        ck_assert_msg(g.len == BLK && memcmp(want, got, BLK) == 0, "block %llu differs",
                      (unsigned long long)id);
    free(want);
    free(got);
    return rc;
}

/* ---- injected ENOSPC ---------------------------------------------------------------------- */

static void injected_enospc(int io_mode)
{
    char *dir = tu_mkdtemp("diskfull");
    tkv_l3 *l3 = NULL;
    ck_assert_int_eq(tu_l3_open(dir, io_mode, 0, BLK, 0, 1, &l3), TKV_OK);
    int st[8];
    ck_assert_int_eq(put_blocks(l3, 0, 8, st), TKV_OK);

    /* the disk fills after two more blocks */
    tkv_l3_inject_write_error(l3, ENOSPC, 2 * BLK);
    int rc = put_blocks(l3, 8, 6, st);
    ck_assert_int_eq(rc, TKV_ENOSPC);
    ck_assert_int_eq(st[0], TKV_OK);
    ck_assert_int_eq(st[1], TKV_OK);
    ck_assert_int_eq(st[2], TKV_ENOSPC);
    for (int i = 3; i < 6; i++)
        ck_assert(st[i] == TKV_ENOSPC || st[i] == TKV_EREADONLY);
    tkv_l3_stats s;
    tkv_l3_get_stats(l3, &s);
    ck_assert_int_eq(s.readonly, 1);
    ck_assert_uint_ge(s.io_errors, 1);
    ck_assert_uint_eq(s.num_blocks, 10);

    /* read-only: writes refused at once, reads keep being served */
    ck_assert_int_eq(put_blocks(l3, 100, 1, st), TKV_EREADONLY);
    tkv_key k;
    tu_key(&k, 3, 0);
    ck_assert_int_eq(tkv_l3_delete(l3, &k, 1), TKV_EREADONLY);
    uint64_t reclaimed;
    ck_assert_int_eq(tkv_l3_compact(l3, &reclaimed), TKV_EREADONLY);
    for (uint64_t id = 0; id < 10; id++)
        ck_assert_int_eq(get_block(l3, id), TKV_OK);
    for (uint64_t id = 10; id < 14; id++)
        ck_assert_int_eq(get_block(l3, id), TKV_ENOTFOUND);
    tkv_l3_close(l3);

    /* after a restart (space freed) the store is writable again and lost nothing */
    ck_assert_int_eq(tu_l3_open(dir, io_mode, 0, BLK, 0, 1, &l3), TKV_OK);
    tkv_l3_get_stats(l3, &s);
    ck_assert_int_eq(s.readonly, 0);
    ck_assert_uint_eq(s.num_blocks, 10);
    for (uint64_t id = 0; id < 10; id++)
        ck_assert_int_eq(get_block(l3, id), TKV_OK);
    ck_assert_int_eq(put_blocks(l3, 10, 4, st), TKV_OK);
    for (uint64_t id = 0; id < 14; id++)
        ck_assert_int_eq(get_block(l3, id), TKV_OK);
    tkv_l3_close(l3);
    tu_rmdir(dir);
}

START_TEST(test_injected_enospc_psync) { injected_enospc(TKV_IO_PSYNC); }
END_TEST

START_TEST(test_injected_enospc_auto) { injected_enospc(TKV_IO_AUTO); }
END_TEST

/* ---- io_uring refused ------------------------------------------------------------------- */

/* Makes io_uring_setup fail with EPERM in this process, as a container's seccomp profile
 * does. Returns 0, or -1 where seccomp filters cannot be installed. */
static int refuse_io_uring(void)
{
#if defined(__x86_64__) && defined(__NR_io_uring_setup)
    struct sock_filter f[] = {
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, arch)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, AUDIT_ARCH_X86_64, 1, 0),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(struct seccomp_data, nr)),
        BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (EPERM & SECCOMP_RET_DATA)),
        BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
    };
    struct sock_fprog prog = {.len = sizeof(f) / sizeof(f[0]), .filter = f};
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0)
        return -1;
    return prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, &prog) == 0 ? 0 : -1;
#else
    return -1;
#endif
}

/* Runs in a child process so the filter does not outlive this test. */
static int uring_refused_child(void)
{
    if (refuse_io_uring() != 0)
        return 77;
    char *dir = tu_mkdtemp("norings");
    int fail = 1;
    tkv_l3 *l3 = NULL;
    if (tu_l3_open(dir, TKV_IO_URING, 0, BLK, 0, 1, &l3) != TKV_EUNSUPPORTED)
        goto out; /* io_uring demanded: refused with a clear error */
    if (tu_l3_open(dir, TKV_IO_AUTO, 0, BLK, 0, 1, &l3) != TKV_OK)
        goto out; /* automatic: falls back */
    tkv_l3_stats s;
    tkv_l3_get_stats(l3, &s);
    int st[4];
    if (s.io_mode != TKV_IO_PSYNC || put_blocks(l3, 0, 4, st) != TKV_OK)
        goto out;
    for (uint64_t id = 0; id < 4; id++)
        if (get_block(l3, id) != TKV_OK)
            goto out;
    fail = 0;
out:
    tkv_l3_close(l3);
    tu_rmdir(dir);
    return fail;
}

START_TEST(test_uring_refused)
{
    pid_t pid = fork();
    ck_assert_int_ge(pid, 0);
    if (pid == 0)
        _exit(uring_refused_child());
    int status;
    ck_assert_int_eq(waitpid(pid, &status, 0), pid);
    ck_assert(WIFEXITED(status));
    if (WEXITSTATUS(status) == 77) {
        fprintf(stderr, "seccomp not available: the io_uring refusal part did not run\n");
        return;
    }
    ck_assert_int_eq(WEXITSTATUS(status), 0);
}
END_TEST

START_TEST(test_forced_psync)
{
    char *dir = tu_mkdtemp("psync");
    tkv_l3 *l3 = NULL;
    ck_assert_int_eq(tu_l3_open(dir, TKV_IO_PSYNC, 0, BLK, 0, 1, &l3), TKV_OK);
    tkv_l3_stats s;
    tkv_l3_get_stats(l3, &s);
    ck_assert_int_eq(s.io_mode, TKV_IO_PSYNC);
    int st[4];
    ck_assert_int_eq(put_blocks(l3, 0, 4, st), TKV_OK);
    for (uint64_t id = 0; id < 4; id++)
        ck_assert_int_eq(get_block(l3, id), TKV_OK);
    tkv_l3_close(l3);
    tu_rmdir(dir);
}
END_TEST

/* ---- a real full file system -------------------------------------------------------------- */

START_TEST(test_real_full_disk)
{
    /* A ballast file takes space now and is removed later, like an operator freeing space. */
    char ballast[4200], dir[4200];
    snprintf(ballast, sizeof(ballast), "%s/ballast", g_mount_dir);
    snprintf(dir, sizeof(dir), "%s/l3", g_mount_dir);
    int fd = open(ballast, O_CREAT | O_WRONLY, 0644);
    ck_assert_int_ge(fd, 0);
    uint8_t *z = calloc(1, 1 << 20);
    for (int i = 0; i < 2; i++)
        ck_assert_int_eq(write(fd, z, 1 << 20), 1 << 20);
    fsync(fd);
    close(fd);
    free(z);

    tkv_l3 *l3 = NULL;
    ck_assert_int_eq(tu_l3_open(dir, TKV_IO_AUTO, 0, BLK, 1 << 20, 1, &l3), TKV_OK);
    uint64_t id = 0;
    int rc = TKV_OK, st[4];
    while (rc == TKV_OK && id < 100000) {
        rc = put_blocks(l3, id, 4, st);
        id += 4;
    }
    ck_assert_msg(rc == TKV_ENOSPC || rc == TKV_EIO, "a full disk gave %s", tkv_strerror(rc));
    uint64_t num_written = id - 4;
    for (int i = 0; i < 4; i++)
        if (st[i] == TKV_OK)
            num_written++;
    tkv_l3_stats s;
    tkv_l3_get_stats(l3, &s);
    ck_assert_int_eq(s.readonly, 1);
    ck_assert_uint_ge(num_written, 8);
    int st_ro[1];
    ck_assert_int_eq(put_blocks(l3, 1000000, 1, st_ro), TKV_EREADONLY);
    /* every block whose put succeeded is served */
    for (uint64_t i = 0; i < id; i++) {
        int g = get_block(l3, i);
        if (i < id - 4)
            ck_assert_int_eq(g, TKV_OK);
        else
        {
            int want = st[i - (id - 4)] == TKV_OK ? TKV_OK : TKV_ENOTFOUND;
            ck_assert_int_eq(g, want);
        }
    }
    tkv_l3_close(l3);

    ck_assert_int_eq(unlink(ballast), 0);
    ck_assert_int_eq(tu_l3_open(dir, TKV_IO_AUTO, 0, BLK, 1 << 20, 1, &l3), TKV_OK);
    tkv_l3_get_stats(l3, &s);
    ck_assert_int_eq(s.readonly, 0);
    for (uint64_t i = 0; i < id - 4; i++)
        ck_assert_int_eq(get_block(l3, i), TKV_OK);
    ck_assert_int_eq(put_blocks(l3, 2000000, 2, st), TKV_OK);
    ck_assert_int_eq(get_block(l3, 2000000), TKV_OK);
    tkv_l3_close(l3);
}
END_TEST

/* Mounts a 32 MiB ext4 loop file system at g_mount_dir, else a tmpfs of that size.
 * Returns 0, or -1 where this process may not mount. */
static char *g_image;
static int mount_small_fs(void)
{
    g_mount_dir = tu_mkdtemp("smallfs");
    g_image = tu_mkdtemp("smallfs-img");
    char cmd[8192];
    snprintf(cmd, sizeof(cmd),
             "truncate -s 32M %s/fs.img && mkfs.ext4 -q -F %s/fs.img >/dev/null 2>&1 && "
             "mount -o loop %s/fs.img %s >/dev/null 2>&1",
             g_image, g_image, g_image, g_mount_dir);
    if (system(cmd) == 0) {
        fprintf(stderr, "full-disk test on a loop-mounted ext4 of 32 MiB\n");
        return 0;
    }
    if (mount("tierkv-test", g_mount_dir, "tmpfs", 0, "size=32m") == 0) {
        fprintf(stderr, "full-disk test on a tmpfs of 32 MiB\n");
        return 0;
    }
    return -1;
}

static void unmount_small_fs(void)
{
    if (umount2(g_mount_dir, 0) != 0)
        umount2(g_mount_dir, MNT_DETACH);
    tu_rmdir(g_mount_dir);
    tu_rmdir(g_image);
}

int main(int argc, char **argv)
{
    if (!getenv("TKV_TEST_VERBOSE"))
        tkv_log_level = TKV_LOG_ERROR - 1; /* the failures are the point; keep output quiet */
    int mount_mode = argc > 1 && strcmp(argv[1], "--mount") == 0;
    if (mount_mode && (geteuid() != 0 || mount_small_fs() != 0)) {
        fprintf(stderr, "mounting a small file system is not permitted here: skipped\n");
        tu_rmdir(g_mount_dir);
        tu_rmdir(g_image);
        return 77;
    }
    Suite *s = suite_create("diskfull");
    TCase *tc = tcase_create(mount_mode ? "mounted" : "injected");
    tcase_set_timeout(tc, 120);
    if (mount_mode) {
        tcase_add_test(tc, test_real_full_disk);
    } else {
        tcase_add_test(tc, test_injected_enospc_psync);
        tcase_add_test(tc, test_injected_enospc_auto);
        tcase_add_test(tc, test_uring_refused);
        tcase_add_test(tc, test_forced_psync);
    }
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    if (mount_mode)
        unmount_small_fs();
    return failed ? 1 : 0;
}
