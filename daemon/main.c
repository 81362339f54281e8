/* main.c - tierkvd: configuration, start-up order, signals, and the orderly stop.
 *
 * Start:  config (defaults < file < flags) -> folders -> [detach] -> pid file lock -> log ->
 *         store (L2 pool + L3 index) -> attach socket -> gRPC server -> HTTP -> "ready".
 * Stop (SIGTERM/SIGINT): Health says "stopping"; the gRPC server stops accepting and drains
 *         in-flight calls; HTTP and attach close (attached clients' leases are released); the
 *         store closes, finishing write-backs and closing RocksDB; sockets and pid file are
 *         removed; exit 0. SIGHUP reopens the log file.
 * Signals are blocked in every thread and taken synchronously by run() with sigwait, so no
 * handler runs in the middle of gRPC or the store.
 *
 * main() is the steps in order, each one job: load_config, become_daemon (folders, pid file,
 * detach, log, signal mask), open_store (GPU L1, store, L2 pinned), start_servers (attach,
 * gRPC, HTTP), run, shut_down (undoes whatever the steps made, also after a failed start).
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <unistd.h>

#include "tkv_base.h"
#include "tkv_l3.h"
#include "tkv_policy.h"
#include "tkv_l4.h"
#include "tkv_store.h"
#include "tkvd_attach.h"
#include "tkvd_gpu.h"
#include "tkvd_config.h"
#include "tkvd_http.h"
#include "tkvd_metrics.h"
#include "tkvd_server.h"
#include "tkvd_fastpath.h"
#include "tkvd_service.h"

#ifndef TKVD_VERSION
#define TKVD_VERSION "0.0.0"
#endif

/* Exit codes (docs/config.md): 0 clean stop, 1 runtime failure, 2 bad configuration or usage,
 * 3 another daemon holds the pid file. */
enum { EXIT_RUNTIME = 1, EXIT_CONFIG = 2, EXIT_RUNNING = 3 };

static void usage(FILE *f)
{
    fprintf(f,
            "usage: tierkvd [--config FILE] [--foreground] [--KEY VALUE | --KEY=VALUE]...\n"
            "\n"
            "tierkvd serves the tierkv KV cache (gRPC on a UNIX socket, shared-memory attach,\n"
            "HTTP /metrics). Without a config file it runs the embedded default: host memory +\n"
            "a local store in ./tierkv-data, demo geometry, sockets in the run folder.\n"
            "\n"
            "options:\n"
            "  --config FILE        read `key = value` lines from FILE (flags override it)\n"
            "  --foreground         stay in the foreground, log to stderr\n"
            "  --KEY VALUE          set any configuration key (dashes or underscores)\n"
            "  --no-KEY             turn a boolean key off (e.g. --no-http)\n"
            "  --check-config       validate, print the effective configuration, exit\n"
            "  --version            print the version\n"
            "  --help               this text\n"
            "\n"
            "keys (docs/config.md has the details):\n");
    tkvd_config_print_keys(f);
    fprintf(f,
            "\n"
            "common flags: --data-dir, --run-dir, --l2-bytes, --http-port, --log-level.\n"
            "exit codes: 0 stopped cleanly, 1 runtime failure, 2 bad configuration, 3 already\n"
            "running (pid file held).\n");
}

/* ---- command line --------------------------------------------------------------------------- */

typedef struct cli {
    const char *config_path;
    bool check_only;
} cli;

/* "--data-dir" -> "data_dir" in buf. */
static void flag_key(const char *flag, char *buf, size_t len)
{
    snprintf(buf, len, "%s", flag);
    for (char *p = buf; *p; p++)
        if (*p == '-')
            *p = '_';
}

/* Pass 1 finds --config/--help/--version/--check-config; pass 2 (apply = true) sets keys, so
 * flags override the file whatever their position. Returns -1 to exit 0, or an exit code. */
static int parse_args(int argc, char **argv, tkvd_config *cfg, cli *cl, bool apply)
{
    char err[TKVD_ERR_LEN];
    for (int i = 1; i < argc; i++) {
        const char *arg = argv[i];
        if (strncmp(arg, "--", 2) != 0) {
            fprintf(stderr, "tierkvd: unexpected argument '%s' (see --help)\n", arg);
            return EXIT_CONFIG;
        }
        const char *name = arg + 2;
        const char *value = NULL;
        char key[128];
        const char *eq = strchr(name, '=');
        if (eq) {
            snprintf(key, sizeof(key), "%.*s", (int)(eq - name), name);
            value = eq + 1;
        } else {
            snprintf(key, sizeof(key), "%s", name);
        }
        if (strcmp(key, "help") == 0) {
            if (!apply) {
                usage(stdout);
                return -1;
            }
            continue;
        }
        if (strcmp(key, "version") == 0) {
            if (!apply) {
                printf("tierkvd %s\n", TKVD_VERSION);
                return -1;
            }
            continue;
        }
        if (strcmp(key, "check-config") == 0) {
            cl->check_only = true;
            continue;
        }
        if (strcmp(key, "config") == 0) {
            if (!value) {
                if (i + 1 >= argc) {
                    fprintf(stderr, "tierkvd: --config needs a file\n");
                    return EXIT_CONFIG;
                }
                value = argv[++i];
            }
            cl->config_path = value;
            continue;
        }
        char ckey[128];
        flag_key(key, ckey, sizeof(ckey));
        if (strncmp(ckey, "no_", 3) == 0 && !value && tkvd_config_key_is_bool(ckey + 3)) {
            if (apply && tkvd_config_set(cfg, ckey + 3, "off", arg, err, sizeof(err)) != TKV_OK) {
                fprintf(stderr, "tierkvd: %s\n", err);
                return EXIT_CONFIG;
            }
            continue;
        }
        if (!tkvd_config_has_key(ckey)) {
            fprintf(stderr, "tierkvd: %s: unknown option (see --help)\n", arg);
            return EXIT_CONFIG;
        }
        if (!value) {
            if (tkvd_config_key_is_bool(ckey) &&
                (i + 1 >= argc || strncmp(argv[i + 1], "--", 2) == 0)) {
                value = "on";
            } else if (i + 1 >= argc) {
                fprintf(stderr, "tierkvd: %s needs a value\n", arg);
                return EXIT_CONFIG;
            } else {
                value = argv[++i];
            }
        }
        if (apply && tkvd_config_set(cfg, ckey, value, arg, err, sizeof(err)) != TKV_OK) {
            fprintf(stderr, "tierkvd: %s\n", err);
            return EXIT_CONFIG;
        }
    }
    return 0;
}

/* ---- folders, pid file, detaching ------------------------------------------------------------ */

static int mkdir_p(const char *path, mode_t mode)
{
    char buf[PATH_MAX];
    if (snprintf(buf, sizeof(buf), "%s", path) >= (int)sizeof(buf)) {
        errno = ENAMETOOLONG;
        return -1;
    }
    for (char *p = buf + 1; *p; p++) {
        if (*p != '/')
            continue;
        *p = 0;
        if (mkdir(buf, mode) != 0 && errno != EEXIST)
            return -1;
        *p = '/';
    }
    if (mkdir(buf, mode) != 0 && errno != EEXIST)
        return -1;
    struct stat st;
    if (stat(buf, &st) != 0)
        return -1;
    if (!S_ISDIR(st.st_mode)) {
        errno = ENOTDIR;
        return -1;
    }
    return 0;
}

/* Locks the pid file (flock: released by the kernel when the daemon dies, so a stale file
 * never blocks a start). Returns the fd, -1 on error, -2 if a live daemon holds it. */
static int lock_pid_file(const char *path, long *holder)
{
    int fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0)
        return -1;
    if (flock(fd, LOCK_EX | LOCK_NB) != 0) {
        char buf[32] = {0};
        ssize_t n = pread(fd, buf, sizeof(buf) - 1, 0);
        *holder = n > 0 ? strtol(buf, NULL, 10) : 0;
        close(fd);
        return -2;
    }
    return fd;
}

static int write_pid(int fd)
{
    char buf[32];
    int n = snprintf(buf, sizeof(buf), "%ld\n", (long)getpid());
    if (ftruncate(fd, 0) != 0 || pwrite(fd, buf, (size_t)n, 0) != n)
        return -1;
    return 0;
}

/* Forks; the parent waits for the child to report start-up (one byte: its exit code) and
 * exits with it, so `tierkvd` returns only when the daemon serves or has failed. */
static int detach(int *ready_fd)
{
    int p[2];
    if (pipe2(p, O_CLOEXEC) != 0)
        return -1;
    pid_t pid = fork();
    if (pid < 0)
        return -1;
    if (pid > 0) {
        close(p[1]);
        unsigned char code = EXIT_RUNTIME;
        ssize_t n;
        do
            n = read(p[0], &code, 1);
        while (n < 0 && errno == EINTR);
        _exit(n == 1 ? code : EXIT_RUNTIME);
    }
    close(p[0]);
    setsid();
    /* stderr stays the terminal's until the log file is open (release_stderr), so start-up
     * errors still reach whoever started the daemon. */
    int devnull = open("/dev/null", O_RDWR);
    if (devnull >= 0) {
        dup2(devnull, STDIN_FILENO);
        dup2(devnull, STDOUT_FILENO);
        if (devnull > STDERR_FILENO)
            close(devnull);
    }
    *ready_fd = p[1];
    return 0;
}

static void release_stderr(void)
{
    int devnull = open("/dev/null", O_WRONLY);
    if (devnull >= 0) {
        dup2(devnull, STDERR_FILENO);
        if (devnull > STDERR_FILENO)
            close(devnull);
    }
}

static void report_ready(int *ready_fd, unsigned char code)
{
    if (*ready_fd < 0)
        return;
    if (write(*ready_fd, &code, 1) != 1)
        TKV_LOG(TKV_LOG_WARN, "could not report start-up to the parent: %s", strerror(errno));
    close(*ready_fd);
    *ready_fd = -1;
}

static void write_http_file(const char *path, const char *addr, uint16_t port)
{
    char tmp[PATH_MAX + 8];
    snprintf(tmp, sizeof(tmp), "%s.tmp", path);
    FILE *f = fopen(tmp, "w");
    if (!f || fprintf(f, "%s:%u\n", addr, (unsigned)port) < 0 || fclose(f) != 0 ||
        rename(tmp, path) != 0)
        TKV_LOG(TKV_LOG_WARN, "cannot write %s: %s", path, strerror(errno));
}

/* ---- the daemon's state, and its life in steps --------------------------------------------- */

/* Everything a running tierkvd holds. Each step below takes what it needs from here and leaves
 * what it made; shut_down() undoes whatever exists, whichever step stopped the start. A new
 * tier or server gets its field here, its start in the step it belongs to and its stop in
 * shut_down(). */
typedef struct daemon_state {
    tkvd_config cfg;
    cli cl;
    int pid_fd, ready_fd;       /* pid file lock; pipe to the waiting parent (-1: none) */
    bool log_open;
    sigset_t sigs;              /* taken by run() with sigwait */
    tkvd_metrics metrics;
    tkvd_gpu *gpu;
    tkv_store_opts *so;
    tkv_store *store;
    tkv_l4 *l4;                 /* the shared tier, or NULL when l4_redis_nodes is empty */
    tkvd_attach *attach;
    tkvd_service svc;           /* the gRPC methods' context */
    tkvd_server *server;
    tkvd_http_source hsrc;      /* borrowed by the HTTP server until it stops */
    tkvd_http *http;
    char http_file[PATH_MAX];   /* "" until written */
} daemon_state;

/* Defaults < file < flags, then the checks across keys. Returns 0 to go on, -1 to exit 0
 * (--help, --version, --check-config done), or an exit code. */
static int load_config(daemon_state *d, int argc, char **argv)
{
    char err[TKVD_ERR_LEN];
    int rc = parse_args(argc, argv, &d->cfg, &d->cl, false);
    if (rc != 0)
        return rc;
    if (d->cl.config_path &&
        tkvd_config_load(&d->cfg, d->cl.config_path, err, sizeof(err)) != TKV_OK) {
        fprintf(stderr, "tierkvd: %s\n", err);
        return EXIT_CONFIG;
    }
    rc = parse_args(argc, argv, &d->cfg, &d->cl, true);
    if (rc == 0 && tkvd_config_finish(&d->cfg, err, sizeof(err)) != TKV_OK) {
        fprintf(stderr, "tierkvd: %s\n", err);
        rc = EXIT_CONFIG;
    }
    if (rc != 0)
        return rc;
    if (d->cl.check_only) {
        tkvd_config_print(&d->cfg, stdout);
        printf("# block_bytes = %zu, l2 = %" PRIu64 " blocks\n", d->cfg.block_bytes,
               tkvd_config_l2_blocks(&d->cfg));
        return -1;
    }
    return 0;
}

/* Folders, the pid file, detaching, the log and the signal mask: from here on the process is
 * the one daemon of its pid file. Returns 0 or an exit code. */
static int become_daemon(daemon_state *d)
{
    const tkvd_config *cfg = &d->cfg;
    tkv_log_level = cfg->log_level;
    if (mkdir_p(cfg->data_dir, 0750) != 0) {
        fprintf(stderr, "tierkvd: data_dir %s: %s\n", cfg->data_dir, strerror(errno));
        return EXIT_CONFIG;
    }
    if (mkdir_p(cfg->run_dir, 0755) != 0) {
        fprintf(stderr, "tierkvd: run_dir %s: %s\n", cfg->run_dir, strerror(errno));
        return EXIT_CONFIG;
    }
    /* Check the lock before detaching so that "already running" reaches the terminal. */
    long holder = 0;
    d->pid_fd = lock_pid_file(cfg->pid_file, &holder);
    if (d->pid_fd == -2) {
        fprintf(stderr, "tierkvd: another tierkvd (pid %ld) is running with pid file %s\n",
                holder, cfg->pid_file);
        d->pid_fd = -1;
        return EXIT_RUNNING;
    }
    if (d->pid_fd < 0) {
        fprintf(stderr, "tierkvd: pid file %s: %s\n", cfg->pid_file, strerror(errno));
        return EXIT_RUNTIME;
    }
    if (!cfg->foreground) {
        /* flock belongs to the open file description, which the child shares: the lock
         * survives the parent's exit. gRPC is not initialised yet, so fork is safe. */
        if (detach(&d->ready_fd) != 0) {
            fprintf(stderr, "tierkvd: cannot detach: %s\n", strerror(errno));
            return EXIT_RUNTIME;
        }
    }
    if (write_pid(d->pid_fd) != 0) {
        fprintf(stderr, "tierkvd: pid file %s: %s\n", cfg->pid_file, strerror(errno));
        return EXIT_RUNTIME;
    }
    if (tkv_log_open(*cfg->log_file ? cfg->log_file : NULL) != TKV_OK) {
        fprintf(stderr, "tierkvd: cannot open log file %s\n", cfg->log_file);
        return EXIT_CONFIG;
    }
    d->log_open = true;
    if (!cfg->foreground)
        release_stderr();

    /* Every thread created from here inherits this mask; main takes the signals with sigwait. */
    sigemptyset(&d->sigs);
    sigaddset(&d->sigs, SIGTERM);
    sigaddset(&d->sigs, SIGINT);
    sigaddset(&d->sigs, SIGHUP);
    pthread_sigmask(SIG_BLOCK, &d->sigs, NULL);
    signal(SIGPIPE, SIG_IGN);

    TKV_LOG(TKV_LOG_INFO, "tierkvd %s starting: model '%s', %u layers, %u kv heads, head dim %u, "
            "%u tokens/block, %s, %s; block %zu bytes; l2 %" PRIu64 " blocks; l3 %s",
            TKVD_VERSION, cfg->geometry.model_id, cfg->geometry.num_layers,
            cfg->geometry.num_kv_heads, cfg->geometry.head_dim, cfg->geometry.block_tokens,
            tkvd_dtype_name(cfg->geometry.dtype), tkvd_scale_mode_name(cfg->geometry.scale_mode),
            cfg->block_bytes, tkvd_config_l2_blocks(cfg), cfg->l3_enabled ? cfg->l3_dir : "off");
    return 0;
}

/* Each tenant's own L2 region (its quota_l2_blocks, or a share of what the quotas leave: a
 * memfd of its own, all it may map), the same in L1 where there is a GPU tier of l1_blocks
 * (an allocation of its own), its L3 quota and guaranteed share, its L4 quota, and its name
 * for the refusal log line and its L3 records, under its store id (tkvd_tenant_store_id). */
static bool set_tenant_quotas(tkv_store_opts *so, const tkvd_config *cfg, uint64_t l1_blocks)
{
    if (!tkvd_tenants_enabled(&cfg->tenants))
        return true;
    uint64_t regions[TKVD_TENANT_MAX], l1_regions[TKVD_TENANT_MAX];
    char err[256];
    if (tkvd_tenants_l2_regions(&cfg->tenants, tkvd_config_l2_blocks(cfg), regions, err,
                                sizeof(err)) != TKV_OK ||
        (l1_blocks && tkvd_tenants_l1_regions(&cfg->tenants, l1_blocks, l1_regions, err,
                                              sizeof(err)) != TKV_OK)) {
        TKV_LOG(TKV_LOG_ERROR, "%s", err);
        return false;
    }
    for (size_t i = 0; i < cfg->tenants.n; i++) {
        const tkvd_tenant *t = cfg->tenants.v[i];
        unsigned id = tkvd_tenant_store_id(t);
        if (tkv_store_opts_set_l2_region(so, id, regions[i]) != TKV_OK ||
            tkv_store_opts_set_tenant_name(so, id, t->name) != TKV_OK)
            return false;
        if ((t->quota[3] || t->guaranteed[3]) &&
            tkv_store_opts_set_tenant_quota(so, id, TKV_TIER_L3, t->quota[3],
                                            t->guaranteed[3]) != TKV_OK)
            return false;
        if (l1_blocks && tkv_store_opts_set_l1_region(so, id, l1_regions[i]) != TKV_OK)
            return false;
        if (t->quota[4] && tkv_store_opts_set_tenant_l4_quota(so, id, t->quota[4]) != TKV_OK)
            return false;
    }
    return true;
}

/* The store's options from the configuration (the L1 tier's where the GPU is open).
 * Returns 0 or an exit code. */
static int store_options(daemon_state *d)
{
    const tkvd_config *cfg = &d->cfg;
    tkv_store_opts *so = d->so = tkv_store_opts_new();
    uint64_t l1_blocks = d->gpu ? cfg->l1_bytes / cfg->block_bytes : 0;
    if (d->gpu && tkv_store_opts_set_l1(so, l1_blocks, &tkvd_gpu_l1_ops, d->gpu) != TKV_OK) {
        TKV_LOG(TKV_LOG_ERROR, "the store refused the L1 tier");
        return EXIT_RUNTIME;
    }
    if (tkv_store_opts_set_block(so, cfg->block_bytes, cfg->geometry.block_tokens) != TKV_OK ||
        tkv_store_opts_set_fingerprint(so, cfg->fingerprint) != TKV_OK ||
        tkv_store_opts_set_l2_blocks(so, tkvd_config_l2_blocks(cfg)) != TKV_OK ||
        tkv_store_opts_set_l3(so, cfg->l3_enabled ? cfg->l3_dir : NULL,
                              cfg->l3_capacity_bytes) != TKV_OK ||
        tkv_store_opts_set_l3_zstd_level(so, cfg->zstd_level) != TKV_OK ||
        tkv_store_opts_set_l3_io_mode(so, cfg->io_mode) != TKV_OK ||
        tkv_store_opts_set_write_through(so, cfg->write_through) != TKV_OK ||
        tkv_store_opts_set_policy(so, cfg->policy) != TKV_OK ||
        tkv_store_opts_set_workers(so, cfg->store_workers) != TKV_OK ||
        tkv_store_opts_set_lease_ttl_ms(so, cfg->lease_ttl_ms, cfg->lease_ttl_max_ms) != TKV_OK ||
        tkv_store_opts_set_l4(so, d->l4) != TKV_OK || !set_tenant_quotas(so, cfg, l1_blocks)) {
        TKV_LOG(TKV_LOG_ERROR, "the store refused the configuration (see the lines above)");
        return EXIT_CONFIG;
    }
    return 0;
}

/* The tiers: the GPU's L1 pool where there is one, then the store (L2 pool + L3), then the L2
 * pool pinned for the GPU's DMA. Returns 0 or an exit code. */
static int open_store(daemon_state *d)
{
    const tkvd_config *cfg = &d->cfg;
    /* The GPU tier: where a GPU exists and l1_bytes > 0. Without one the daemon serves L2 + L3
     * (the embedded default on a machine with no GPU). */
    if (cfg->l1_bytes / cfg->block_bytes > 0) {
        int rc = tkvd_gpu_open(cfg->gpu_device, cfg->block_bytes, &d->gpu);
        if (rc != TKV_OK && rc != TKV_EUNSUPPORTED) {
            TKV_LOG(TKV_LOG_ERROR, "gpu: cannot set up the L1 pool (%s); lower l1_bytes or set "
                    "it to 0", tkv_strerror(rc));
            return EXIT_RUNTIME;
        }
    }
    /* The shared tier first: the store hands blocks to it from its first write-back. */
    if (*cfg->l4_redis_nodes && tkvd_config_open_l4(cfg, &d->l4) != TKV_OK)
        return EXIT_CONFIG;
    int code = store_options(d);
    if (code != 0)
        return code;
    int rc = tkv_store_open(d->so, &d->store);
    if (rc == TKV_EGEOMETRY) {
        TKV_LOG(TKV_LOG_ERROR, "l3_dir %s holds blocks of another geometry or model; use another "
                "data_dir/l3_dir or the geometry it was made with", cfg->l3_dir);
        return EXIT_CONFIG;
    }
    if (rc != TKV_OK) {
        TKV_LOG(TKV_LOG_ERROR, "cannot open the store: %s", tkv_strerror(rc));
        return EXIT_RUNTIME;
    }
    /* L1: one allocation per region of the store's (a tenant's own, exported on its own). */
    if (d->gpu) {
        unsigned n1 = tkv_store_l1_num_regions(d->store);
        uint64_t first[TKVD_GPU_MAX_REGIONS], num[TKVD_GPU_MAX_REGIONS];
        for (unsigned r = 0; r < n1 && r < TKVD_GPU_MAX_REGIONS; r++)
            tkv_store_l1_region_at(d->store, r, &first[r], &num[r]);
        int grc = n1 > TKVD_GPU_MAX_REGIONS ? TKV_EINVAL
                                            : tkvd_gpu_alloc_l1(d->gpu, first, num, n1);
        if (grc != TKV_OK) {
            TKV_LOG(TKV_LOG_ERROR, "gpu: cannot set up the L1 pool (%s); lower l1_bytes or set "
                    "it to 0", tkv_strerror(grc));
            return EXIT_RUNTIME;
        }
    }
    /* Each L2 region is its own memfd mapping: pinned one by one (a registration may not
     * span two mappings), addressed from the one base. */
    uint64_t reg_bytes[TKV_STORE_TENANTS_MAX];
    unsigned num_reg = tkv_store_l2_num_regions(d->store);
    for (unsigned r = 0; r < num_reg; r++) {
        uint64_t off = 0;
        tkv_store_l2_region_at(d->store, r, &off, &reg_bytes[r]);
    }
    if (d->gpu && tkvd_gpu_pin_l2(d->gpu, tkv_store_l2_ptr(d->store, 0),
                                  tkv_store_l2_bytes(d->store), reg_bytes, num_reg,
                                  tkv_store_l2_slot_stride(d->store)) != TKV_OK) {
        TKV_LOG(TKV_LOG_ERROR, "gpu: cannot pin the L2 pool for DMA");
        return EXIT_RUNTIME;
    }
    return 0;
}

/* The attach socket, the gRPC server and HTTP, in that order (engines may attach before the
 * first call). Returns 0 or an exit code. */
static int start_servers(daemon_state *d)
{
    const tkvd_config *cfg = &d->cfg;
    if (tkvd_attach_start(cfg->attach_socket, d->store, cfg->fingerprint, &d->metrics,
                          &d->attach) != TKV_OK)
        return EXIT_RUNTIME;
    tkvd_attach_allow_writable(d->attach, cfg->attach_writable);
    tkvd_attach_set_tenants(d->attach, &cfg->tenants);
    if (d->gpu) { /* each region's own handle, for the clients of its tenant only */
        unsigned n1 = tkvd_gpu_num_regions(d->gpu);
        tkv_attach_gpu *infos = tkv_xcalloc(n1 ? n1 : 1, sizeof(*infos));
        for (unsigned r = 0; r < n1; r++)
            tkvd_gpu_attach_info(d->gpu, r, &infos[r]); /* an empty region: zeroed, no L1 */
        tkvd_attach_offer_gpu(d->attach, infos, n1);
        free(infos);
    }

    tkvd_service *svc = &d->svc;
    svc->store = d->store;
    svc->cfg = &d->cfg;
    svc->metrics = &d->metrics;
    svc->attach = d->attach;
    svc->keycache = tkvd_keycache_new(cfg->key_cache_bytes, cfg->geometry.block_tokens);
    svc->version = TKVD_VERSION;
    svc->rates.pcie_gbps = tkvd_gpu_h2d_gbps(d->gpu);
    svc->gpu = d->gpu;
    svc->rates.l3_read_gbps = cfg->l3_read_mbps / 1000.0;
    atomic_init(&svc->stopping, false);
    atomic_init(&svc->abort_waits, false);
    tkvd_fast_enable(svc);

    tkvd_server_opts sopts = { /* copied by tkvd_server_start */
        .unix_path = cfg->grpc_socket,
        .tcp_addr = cfg->grpc_tcp,
        .tls_cert_file = cfg->tls_cert,
        .tls_key_file = cfg->tls_key,
        .tls_client_ca_file = cfg->tls_client_ca,
        .cq_threads = cfg->cq_threads,
        .workers = cfg->rpc_workers,
        .max_recv_bytes = tkvd_service_max_recv_bytes(cfg),
        .max_send_bytes = tkvd_service_max_send_bytes(cfg),
        .drain_timeout_ms = cfg->drain_timeout_ms,
        .ctx = svc,
        .on_drain_timeout = tkvd_service_abort_waits,
        .metrics = &d->metrics,
    };
    sopts.methods = tkvd_service_methods(&sopts.num_methods);
    if (tkvd_server_start(&sopts, &d->server) != TKV_OK)
        return EXIT_RUNTIME;
    TKV_LOG(TKV_LOG_INFO, "grpc: messages up to %zu bytes in, %zu out (%u blocks per rpc)",
            sopts.max_recv_bytes, sopts.max_send_bytes, cfg->max_blocks_per_rpc);

    d->hsrc = (tkvd_http_source){
        .store = d->store,
        .metrics = &d->metrics,
        .geometry = &d->cfg.geometry,
        .policy_name = cfg->policy,
        .version = TKVD_VERSION,
        .tenants = &cfg->tenants,
        .l4 = d->l4,
    };
    if (cfg->http_enabled) {
        if (tkvd_http_start(cfg->http_address, (uint16_t)cfg->http_port, &d->hsrc,
                            &d->http) != TKV_OK) {
            TKV_LOG(TKV_LOG_ERROR, "http: cannot listen on %s:%u", cfg->http_address,
                    cfg->http_port);
            return EXIT_RUNTIME;
        }
        uint16_t port = tkvd_http_port(d->http);
        snprintf(d->http_file, sizeof(d->http_file), "%s/tierkvd.http", cfg->run_dir);
        write_http_file(d->http_file, cfg->http_address, port);
        TKV_LOG(TKV_LOG_INFO, "http: listening on %s:%u", cfg->http_address, (unsigned)port);
    }
    return 0;
}

/* Serving: tells the waiting parent, then takes signals until SIGTERM or SIGINT (SIGHUP
 * reopens the log). Returns 0, the exit code of a clean stop. */
static int run(daemon_state *d)
{
    TKV_LOG(TKV_LOG_INFO, "tierkvd ready (pid %ld)", (long)getpid());
    report_ready(&d->ready_fd, 0);
    for (;;) {
        int sig = 0;
        if (sigwait(&d->sigs, &sig) != 0)
            continue;
        if (sig == SIGHUP) {
            if (tkv_log_reopen() == TKV_OK)
                TKV_LOG(TKV_LOG_INFO, "SIGHUP: log reopened");
            else
                TKV_LOG(TKV_LOG_ERROR, "SIGHUP: cannot reopen the log");
            continue;
        }
        TKV_LOG(TKV_LOG_INFO, "%s: stopping (draining in-flight calls)",
                sig == SIGTERM ? "SIGTERM" : "SIGINT");
        return 0;
    }
}

/* The orderly stop, also of a start that failed part-way (every stop takes NULL): servers
 * first (gRPC drains its in-flight calls), then the store (write-backs finish), then the GPU
 * pool, the files in the run folder and the pid file. Reports code to a waiting parent. */
static void shut_down(daemon_state *d, int code)
{
    atomic_store(&d->svc.stopping, true);
    tkvd_server_stop(d->server);
    tkvd_http_stop(d->http);
    tkvd_attach_stop(d->attach);
    if (d->store) {
        uint64_t t0 = tkv_now_ns();
        tkv_store_close(d->store);
        TKV_LOG(TKV_LOG_INFO, "store closed (write-backs finished) in %" PRIu64 " ms",
                (tkv_now_ns() - t0) / 1000000u);
    }
    tkvd_keycache_free(d->svc.keycache); /* after every server: no call derives keys now */
    d->svc.keycache = NULL;
    tkv_l4_close(d->l4);    /* after the store: its write-back hands blocks to L4 */
    tkvd_gpu_close(d->gpu); /* after the store: its workers may still be copying */
    tkv_store_opts_free(d->so);
    if (d->pid_fd >= 0) /* the lock proves the socket is ours (or a dead daemon's) */
        unlink(d->cfg.grpc_socket);
    if (d->http_file[0])
        unlink(d->http_file);
    if (d->pid_fd >= 0) {
        unlink(d->cfg.pid_file);
        close(d->pid_fd);
    }
    if (code == 0)
        TKV_LOG(TKV_LOG_INFO, "tierkvd stopped");
    else if (d->log_open) /* before that, the reason went to stderr already */
        TKV_LOG(TKV_LOG_ERROR, "tierkvd failed to start or run (exit %d)", code);
    report_ready(&d->ready_fd, (unsigned char)code);
}

/* ---- main ------------------------------------------------------------------------------------- */

int main(int argc, char **argv)
{
    static daemon_state d; /* static: large (paths), and zeroed */
    d.pid_fd = d.ready_fd = -1;
    tkvd_metrics_init(&d.metrics);
    tkvd_config_init(&d.cfg);

    int code = load_config(&d, argc, argv);
    if (code != 0) { /* nothing started yet */
        tkvd_config_free(&d.cfg);
        return code < 0 ? 0 : code;
    }
    code = become_daemon(&d);
    if (code == 0)
        code = open_store(&d);
    if (code == 0)
        code = start_servers(&d);
    if (code == 0)
        code = run(&d);
    shut_down(&d, code);
    tkvd_config_free(&d.cfg);
    return code;
}
