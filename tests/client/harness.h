/* harness.h - starts and stops a real tierkvd for the client's black-box tests.
 *
 * tkvt_daemon_start() makes a temp dir (data + run folders), fork/execs the tierkvd binary
 * of this build with a small geometry and the sockets inside that dir, and waits (with a
 * deadline) until the daemon answers. tkvt_daemon_stop() sends SIGTERM, waits, checks the
 * exit status and removes the temp dir. Call both from the test runner's main() (gRPC is
 * never initialised there, so Check's fork mode stays safe) or from inside a test.
 *
 * Header-only (static functions) so every test program of tests/client/ shares it.
 */
#ifndef TKVT_HARNESS_H
#define TKVT_HARNESS_H

#include <errno.h>
#include <fcntl.h>
#include <ftw.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "kvclient.h"

/* Test geometry: 1 layer, 1 KV head, head dim 64, 16 tokens per block, fp8 -> 2 KiB blocks,
 * small enough that thousands of operations take seconds. */
#define TKVT_LAYERS 1
#define TKVT_KV_HEADS 1
#define TKVT_HEAD_DIM 64
#define TKVT_BLOCK_TOKENS 16
#define TKVT_MODEL "tierkv-client-test"

typedef struct tkvt_daemon {
    pid_t pid;
    char dir[64];
    char sock[128];
    char attach[128];
    char log[128];
} tkvt_daemon;

static inline const char *tkvt_build_dir(void)
{
    const char *b = getenv("TKV_BUILD_DIR");
    return b && *b ? b : TKV_BUILD_DIR;
}

static inline int tkvt_rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

static inline void tkvt_rmtree(const char *dir) { nftw(dir, tkvt_rm_one, 16, FTW_DEPTH | FTW_PHYS); }

static inline double tkvt_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static inline void tkvt_sleep_ms(int ms)
{
    struct timespec d = {ms / 1000, (long)(ms % 1000) * 1000000L};
    while (nanosleep(&d, &d) != 0 && errno == EINTR)
        ;
}

/* Options for a client of this daemon with the test geometry; attach when asked. */
static inline kvc_opts *tkvt_opts(const tkvt_daemon *d, int attach)
{
    kvc_opts *o = kvc_opts_new();
    kvc_opts_set_socket(o, d->sock);
    if (attach)
        kvc_opts_set_attach_socket(o, d->attach);
    kvc_opts_set_geometry(o, TKVT_LAYERS, TKVT_KV_HEADS, TKVT_HEAD_DIM, TKVT_BLOCK_TOKENS,
                          "fp8_e4m3", "per_tensor", TKVT_MODEL);
    kvc_opts_set_timeout_ms(o, 20000);
    return o;
}

static inline int tkvt_connect(const tkvt_daemon *d, int attach, kvc_client **c)
{
    kvc_opts *o = tkvt_opts(d, attach);
    int rc = kvc_connect(o, c);
    kvc_opts_free(o);
    return rc;
}

/* extra: NULL-terminated extra "--key value" arguments for tierkvd, or NULL.
 * Returns 0, or -1 with a message on stderr. */
static inline int tkvt_daemon_start_(tkvt_daemon *d, const char *const *extra)
{
    memset(d, 0, sizeof(*d));
    snprintf(d->dir, sizeof(d->dir), "/tmp/tkv-client-XXXXXX");
    if (!mkdtemp(d->dir)) {
        fprintf(stderr, "harness: mkdtemp: %s\n", strerror(errno));
        return -1;
    }
    char data[96], run[96], bin[512];
    snprintf(data, sizeof(data), "%s/data", d->dir);
    snprintf(run, sizeof(run), "%s/run", d->dir);
    snprintf(d->sock, sizeof(d->sock), "%s/tierkv.sock", run);
    snprintf(d->attach, sizeof(d->attach), "%s/attach.sock", run);
    snprintf(d->log, sizeof(d->log), "%s/tierkvd.log", d->dir);
    snprintf(bin, sizeof(bin), "%s/daemon/tierkvd", tkvt_build_dir());
    if (access(bin, X_OK) != 0) {
        fprintf(stderr, "harness: %s is not built: %s\n", bin, strerror(errno));
        return -1;
    }
    char layers[16], heads[16], dim[16], ptok[16];
    snprintf(layers, sizeof(layers), "%d", TKVT_LAYERS);
    snprintf(heads, sizeof(heads), "%d", TKVT_KV_HEADS);
    snprintf(dim, sizeof(dim), "%d", TKVT_HEAD_DIM);
    snprintf(ptok, sizeof(ptok), "%d", TKVT_BLOCK_TOKENS);
    const char *argv[64] = {bin, "--foreground", "--data-dir", data, "--run-dir", run,
                            "--grpc-socket", d->sock, "--attach-socket", d->attach,
                            "--http-port", "0", "--num-layers", layers, "--num-kv-heads",
                            heads, "--head-dim", dim, "--block-tokens", ptok, "--model-id",
                            TKVT_MODEL, "--l2-blocks", "8192", "--log-level", "warn"};
    int argc = 26;
    for (int i = 0; extra && extra[i] && argc < 62; i++)
        argv[argc++] = extra[i];
    argv[argc] = NULL;

    d->pid = fork();
    if (d->pid < 0) {
        fprintf(stderr, "harness: fork: %s\n", strerror(errno));
        return -1;
    }
    if (d->pid == 0) {
        int fd = open(d->log, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
        if (fd >= 0) {
            dup2(fd, STDOUT_FILENO);
            dup2(fd, STDERR_FILENO);
        }
        execv(bin, (char *const *)argv);
        _exit(127);
    }
    /* serving = the gRPC socket exists and the daemon answers a Stats (checked by a child
     * process: this process must not initialise gRPC before Check forks its tests) */
    double deadline = tkvt_now() + 30.0;
    while (tkvt_now() < deadline) {
        int st;
        if (waitpid(d->pid, &st, WNOHANG) == d->pid) {
            fprintf(stderr, "harness: tierkvd exited early (status 0x%x); log %s:\n", st, d->log);
            char cmd[256];
            snprintf(cmd, sizeof(cmd), "tail -20 %s >&2", d->log);
            if (system(cmd) != 0)
                fprintf(stderr, "harness: cannot show the log\n");
            d->pid = 0;
            return -1;
        }
        if (access(d->sock, F_OK) == 0 && access(d->attach, F_OK) == 0) {
            pid_t probe = fork();
            if (probe == 0) {
                /* no geometry: serving is all this asks (extra flags may change it) */
                kvc_opts *o = kvc_opts_new();
                kvc_opts_set_socket(o, d->sock);
                kvc_client *c = NULL;
                int rc = kvc_connect(o, &c);
                kvc_close(c);
                kvc_opts_free(o);
                _exit(rc == KVC_OK ? 0 : 1);
            }
            int pst = 0;
            waitpid(probe, &pst, 0);
            if (WIFEXITED(pst) && WEXITSTATUS(pst) == 0)
                return 0;
        }
        tkvt_sleep_ms(50);
    }
    fprintf(stderr, "harness: tierkvd did not serve within 30 s; its log:\n");
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "tail -20 %s >&2", d->log);
    if (system(cmd) != 0)
        fprintf(stderr, "harness: cannot show the log\n");
    kill(d->pid, SIGKILL);
    waitpid(d->pid, NULL, 0);
    d->pid = 0;
    return -1;
}

static inline int tkvt_daemon_start(tkvt_daemon *d, const char *const *extra)
{
    int rc = tkvt_daemon_start_(d, extra);
    if (rc != 0 && d->dir[0]) {
        tkvt_rmtree(d->dir); /* a failed start leaves nothing behind */
        d->dir[0] = '\0';
    }
    return rc;
}

/* SIGTERM, wait up to 30 s, remove the temp dir. Returns the daemon's exit status (0 is a
 * clean stop), or -1 when it had to be killed or died by a signal. */
static inline int tkvt_daemon_stop(tkvt_daemon *d)
{
    int rc = -1;
    if (d->pid > 0) {
        kill(d->pid, SIGTERM);
        double deadline = tkvt_now() + 30.0;
        int st = 0;
        pid_t w = 0;
        while ((w = waitpid(d->pid, &st, WNOHANG)) == 0 && tkvt_now() < deadline)
            tkvt_sleep_ms(20);
        if (w == d->pid) {
            rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
        } else {
            fprintf(stderr, "harness: tierkvd ignored SIGTERM for 30 s; killing it\n");
            kill(d->pid, SIGKILL);
            waitpid(d->pid, NULL, 0);
        }
        if (rc != 0) {
            char cmd[256];
            snprintf(cmd, sizeof(cmd), "tail -20 %s >&2", d->log);
            if (system(cmd) != 0)
                fprintf(stderr, "harness: cannot show the log\n");
        }
        d->pid = 0;
    }
    if (d->dir[0])
        tkvt_rmtree(d->dir);
    return rc;
}

/* ---- deterministic test data ---- */

static inline uint64_t tkvt_mix(uint64_t x)
{
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

/* num tokens of a prompt named by seed (distinct seeds give distinct prompts). */
static inline void tkvt_tokens(uint64_t seed, uint32_t *t, size_t num)
{
    for (size_t i = 0; i < num; i++)
        t[i] = (uint32_t)(tkvt_mix(seed * 1000003u + i) & 0x7fffffff);
}

/* Payload of block `index` of the prompt named by seed. */
static inline void tkvt_payload(uint64_t seed, uint32_t index, uint8_t *p, size_t n)
{
    uint64_t s = tkvt_mix(seed ^ ((uint64_t)index << 40)) | 1;
    for (size_t i = 0; i < n; i++) {
        if ((i & 7) == 0) {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
        }
        p[i] = (uint8_t)(s >> (8 * (i & 7)));
    }
}

#endif
