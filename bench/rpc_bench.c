/* rpc_bench.c - the service's request/response costs, each against a ceiling measured in
 * the same run on the same machine:
 *
 *   lookup round trip (p50, p99) and lookups/s on the fast path (attached clients: the attach
 *       connection) and on gRPC (the UNIX socket), and blocks/s looked up in batches
 *       (kvc_lookup_batch, 64 prompts per call) on both
 *       vs redis-benchmark GET on a local redis-server (TCP on 127.0.0.1, same client counts)
 *   get bandwidth through the mapped L2 pool (and by value, for reference)
 *       vs plain memcpy of the same bytes
 *
 * It starts its own tierkvd (this build's, temp dir) and redis-server (temp dir, TCP on
 * 127.0.0.1), and stops both. Prints a table, or one JSON object with --json.
 *
 *   build/bench/rpc_bench [--json] [--seconds S] [--threads N] [--key-cache-bytes B]
 *
 * --key-cache-bytes goes to tierkvd (0: every lookup derives its keys with SHA-256).
 */
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "harness.h"

#define LOOKUP_BLOCKS 16    /* a 1024-token prompt at 64 tokens per block */
#define GET_BLOCKS 256      /* 32 MiB of 128 KiB blocks */

#define BATCH_PROMPTS 64    /* prompts per kvc_lookup_batch */

typedef struct bench {
    double seconds;
    int threads;
    kvc_client *c;          /* attached */
    kvc_client *cv;         /* by value */
    kvc_client *tc[256];    /* one client per thread (attached or not, per measurement) */
    uint32_t *tokens;       /* LOOKUP_BLOCKS blocks */
    int batch;              /* threads call kvc_lookup_batch */
    atomic_ulong lookups;   /* prompts looked up */
    atomic_int stop;
    atomic_int failed;
} bench;

typedef struct path_result {
    double p50_us, p99_us, lookups_s, batch_p50_us, batch_blocks_s, daemon_p50_us;
    double p50_1_us, p99_1_us; /* a 1-block prompt: one key to derive, like a GET's one key */
} path_result;

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

/* ---- redis ------------------------------------------------------------------------------ */

typedef struct redis_result {
    double rps, p50_us, p99_us;
} redis_result;

static int redis_bench(int port, int clients, int n, redis_result *r)
{
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "redis-benchmark -h 127.0.0.1 -p %d -t get -n %d -c %d --csv "
             "2>/dev/null", port, n, clients);
    FILE *p = popen(cmd, "r");
    if (!p)
        return -1;
    char line[512];
    int ok = -1;
    while (fgets(line, sizeof(line), p)) {
        double rps, avg, mn, p50, p95, p99;
        if (sscanf(line, "\"GET\",\"%lf\",\"%lf\",\"%lf\",\"%lf\",\"%lf\",\"%lf\"", &rps, &avg,
                   &mn, &p50, &p95, &p99) == 6) {
            r->rps = rps;
            r->p50_us = p50 * 1000;
            r->p99_us = p99 * 1000;
            ok = 0;
        }
    }
    int st = pclose(p);
    return (ok == 0 && WIFEXITED(st) && WEXITSTATUS(st) == 0) ? 0 : -1;
}

static pid_t redis_start(const char *dir, int port)
{
    char sock[256], port_s[16];
    snprintf(sock, sizeof(sock), "%s/redis.started", dir);
    snprintf(port_s, sizeof(port_s), "%d", port);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open("/dev/null", O_WRONLY);
        if (fd >= 0) {
            dup2(fd, STDOUT_FILENO);
            dup2(fd, STDERR_FILENO);
        }
        execlp("redis-server", "redis-server", "--bind", "127.0.0.1", "--port", port_s, "--save",
               "", "--appendonly", "no", "--dir", dir, (char *)NULL);
        _exit(127);
    }
    /* ready when it answers; the key redis-benchmark GETs, so every GET finds a value */
    char cmd[512];
    snprintf(cmd, sizeof(cmd), "redis-cli -h 127.0.0.1 -p %d set key:__rand_int__ xxx "
             ">/dev/null 2>&1", port);
    double deadline = tkvt_now() + 10;
    while (tkvt_now() < deadline && system(cmd) != 0)
        tkvt_sleep_ms(50);
    if (tkvt_now() >= deadline) {
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
        return -1;
    }
    return pid;
}

/* ---- tierkv ----------------------------------------------------------------------------- */

typedef struct thread_arg {
    bench *b;
    kvc_client *c;
} thread_arg;

/* One lookup of a LOOKUP_BLOCKS-block prompt (or a batch of BATCH_PROMPTS of them) and the
 * release of its leases; returns the prompts looked up, 0 on failure. */
static int lookup_once(bench *b, kvc_client *c, int batch)
{
    size_t n_tok = (size_t)LOOKUP_BLOCKS * kvc_block_tokens(c);
    kvc_lease *ls[BATCH_PROMPTS];
    const uint32_t *toks[BATCH_PROMPTS];
    size_t ns[BATCH_PROMPTS];
    int n = batch ? BATCH_PROMPTS : 1;
    for (int i = 0; i < n; i++) {
        toks[i] = b->tokens;
        ns[i] = n_tok;
    }
    int r = batch ? kvc_lookup_batch(c, toks, ns, (size_t)n, 0, ls)
                  : kvc_lookup(c, b->tokens, n_tok, 0, &ls[0]);
    if (r != KVC_OK) {
        fprintf(stderr, "rpc_bench: lookup: %s\n", kvc_last_error());
        return 0;
    }
    int ok = 1;
    for (int i = 0; i < n; i++) {
        ok = ok && kvc_lease_num_blocks(ls[i]) == LOOKUP_BLOCKS;
        kvc_release(c, ls[i]);
    }
    return ok ? n : 0;
}

static void *lookup_loop(void *arg)
{
    thread_arg *ta = arg;
    bench *b = ta->b;
    unsigned long n = 0;
    while (!atomic_load(&b->stop)) {
        int got = lookup_once(b, ta->c, b->batch);
        if (!got) {
            atomic_store(&b->failed, 1);
            break;
        }
        n += (unsigned long)got;
    }
    atomic_fetch_add(&b->lookups, n);
    return NULL;
}

/* Round trip of one call at a time on c (p50, p99 in us), n calls after 200 of warm-up. */
static int round_trip(bench *b, kvc_client *c, int batch, int n, double *p50, double *p99)
{
    double *lat = malloc((size_t)n * sizeof(double));
    for (int i = 0; i < n + 200; i++) {
        double t0 = tkvt_now();
        int got = lookup_once(b, c, batch);
        double t1 = tkvt_now();
        if (!got) {
            free(lat);
            return -1;
        }
        if (i >= 200)
            lat[i - 200] = (t1 - t0) * 1e6;
    }
    qsort(lat, (size_t)n, sizeof(double), cmp_double);
    *p50 = lat[n / 2];
    *p99 = lat[(int)(n * 0.99)];
    free(lat);
    return 0;
}

/* Prompts looked up per second by b->threads threads, each with its own client. */
static double throughput(bench *b, int batch)
{
    pthread_t th[256];
    thread_arg ta[256];
    atomic_store(&b->stop, 0);
    atomic_store(&b->lookups, 0);
    b->batch = batch;
    double t0 = tkvt_now();
    for (int i = 0; i < b->threads; i++) {
        ta[i] = (thread_arg){b, b->tc[i]};
        pthread_create(&th[i], NULL, lookup_loop, &ta[i]);
    }
    tkvt_sleep_ms((int)(b->seconds * 1000));
    atomic_store(&b->stop, 1);
    for (int i = 0; i < b->threads; i++)
        pthread_join(th[i], NULL);
    return atomic_load(&b->lookups) / (tkvt_now() - t0);
}

/* Round trip of kvc_lookup alone (p50, p99 in us) for a prompt of num_blocks blocks that
 * hits, 20,000 calls after 200 of warm-up; each lease is released outside the timing. */
static int lookup_latency(bench *b, kvc_client *c, uint32_t num_blocks, double *p50, double *p99)
{
    size_t n_tok = (size_t)num_blocks * kvc_block_tokens(c);
    double *lat = malloc(20000 * sizeof(double));
    for (int i = 0; i < 20200; i++) {
        kvc_lease *l;
        double t0 = tkvt_now();
        int x = kvc_lookup(c, b->tokens, n_tok, 0, &l);
        double t1 = tkvt_now();
        if (x != KVC_OK || kvc_lease_num_blocks(l) != num_blocks) {
            fprintf(stderr, "rpc_bench: lookup: %s\n", kvc_last_error());
            free(lat);
            return -1;
        }
        kvc_release(c, l);
        if (i >= 200)
            lat[i - 200] = (t1 - t0) * 1e6;
    }
    qsort(lat, 20000, sizeof(double), cmp_double);
    *p50 = lat[10000];
    *p99 = lat[19800];
    free(lat);
    return 0;
}

/* Everything for one path: clients attached (fast path) or not (gRPC). The single-lookup
 * round trip times kvc_lookup alone; the release that follows is outside the timing. */
static int measure_path(bench *b, const tkvt_daemon *d, int attached, path_result *r)
{
    kvc_opts *o = kvc_opts_new();
    kvc_opts_set_socket(o, d->sock);
    if (attached)
        kvc_opts_set_attach_socket(o, d->attach);
    int rc = -1, made = 0;
    for (; made < b->threads; made++)
        if (kvc_connect(o, &b->tc[made]) != KVC_OK) {
            fprintf(stderr, "rpc_bench: connect: %s\n", kvc_last_error());
            goto out;
        }
    kvc_client *c = b->tc[0];
    if (lookup_latency(b, c, LOOKUP_BLOCKS, &r->p50_us, &r->p99_us) != 0 ||
        lookup_latency(b, c, 1, &r->p50_1_us, &r->p99_1_us) != 0)
        goto out;
    kvc_stats st;
    if (kvc_stats_get(c, &st) == KVC_OK)
        r->daemon_p50_us = st.lookup_p50_us; /* the handler's own time, transport excluded */
    double bp99;
    if (round_trip(b, c, 1, 500, &r->batch_p50_us, &bp99) != 0)
        goto out;
    r->lookups_s = throughput(b, 0);
    r->batch_blocks_s = throughput(b, 1) * LOOKUP_BLOCKS;
    rc = atomic_load(&b->failed) ? -1 : 0;
out:
    for (int i = 0; i < made; i++)
        kvc_close(b->tc[i]);
    kvc_opts_free(o);
    return rc;
}

static double gbps(double bytes, double s) { return bytes / s / 1e9; }

int main(int argc, char **argv)
{
    int json = 0;
    double seconds = 3;
    int threads = 4;
    const char *key_cache = "32M";
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--json") == 0)
            json = 1;
        else if (strcmp(argv[i], "--seconds") == 0 && i + 1 < argc)
            seconds = atof(argv[++i]);
        else if (strcmp(argv[i], "--threads") == 0 && i + 1 < argc)
            threads = atoi(argv[++i]);
        else if (strcmp(argv[i], "--key-cache-bytes") == 0 && i + 1 < argc)
            key_cache = argv[++i];
        else {
            fprintf(stderr, "usage: rpc_bench [--json] [--seconds S] [--threads N] "
                    "[--key-cache-bytes B]\n");
            return 1;
        }
    }
    if (seconds <= 0 || threads < 1 || threads > 256) {
        fprintf(stderr, "rpc_bench: --seconds > 0 and --threads 1..256\n");
        return 1;
    }

    /* 4 layers x 2 KV heads x head dim 128 x 64 tokens, fp8: 128 KiB blocks, a realistic
     * page for bandwidth; lookups do not depend on the block size */
    tkvt_daemon d;
    const char *extra[] = {"--num-layers", "4", "--num-kv-heads", "2", "--head-dim", "128",
                           "--block-tokens", "64", "--model-id", "rpc-bench", "--l2-blocks",
                           "1024", "--max-blocks-per-rpc", "64", "--key-cache-bytes", key_cache,
                           NULL};
    if (tkvt_daemon_start(&d, extra) != 0)
        return 1;
    int redis_port = 20000 + (int)(getpid() % 20000);
    pid_t redis = redis_start(d.dir, redis_port);
    int rc = 1;
    bench b;
    memset(&b, 0, sizeof(b));
    b.seconds = seconds;
    b.threads = threads;
    uint8_t *src = NULL, *dst = NULL;

    kvc_opts *o = kvc_opts_new();
    kvc_opts_set_socket(o, d.sock);
    kvc_opts_set_attach_socket(o, d.attach);
    if (kvc_connect(o, &b.c) != KVC_OK) {
        fprintf(stderr, "rpc_bench: %s\n", kvc_last_error());
        kvc_opts_free(o);
        goto out;
    }
    kvc_opts_set_attach_socket(o, NULL);
    if (kvc_connect(o, &b.cv) != KVC_OK) {
        fprintf(stderr, "rpc_bench: %s\n", kvc_last_error());
        kvc_opts_free(o);
        goto out;
    }
    kvc_opts_free(o);
    const uint32_t P = kvc_block_tokens(b.c);
    const size_t bb = kvc_block_bytes(b.c);
    const size_t nbytes = (size_t)GET_BLOCKS * bb;
    uint32_t *tokens = malloc((size_t)GET_BLOCKS * P * sizeof(uint32_t));
    b.tokens = tokens;
    tkvt_tokens(42, tokens, (size_t)GET_BLOCKS * P);
    src = malloc(nbytes);
    dst = malloc(nbytes);
    for (uint32_t i = 0; i < GET_BLOCKS; i++)
        tkvt_payload(42, i, src + (size_t)i * bb, bb);
    if (kvc_put(b.c, tokens, (size_t)GET_BLOCKS * P, 0, src, GET_BLOCKS, NULL) != KVC_OK) {
        fprintf(stderr, "rpc_bench: put: %s\n", kvc_last_error());
        goto out;
    }
    /* The put's write-through to L3 (zstd + disk, 32 MiB) would otherwise share the 2 cores
     * with the first timings; redis, the ceiling, has no such work going on. */
    if (kvc_flush(b.c) != KVC_OK) {
        fprintf(stderr, "rpc_bench: flush: %s\n", kvc_last_error());
        goto out;
    }

    /* 1-2. lookups on the fast path and on gRPC: round trips, lookups/s, batched blocks/s */
    path_result fast = {0}, grpc = {0};
    if (measure_path(&b, &d, 1, &fast) != 0 || measure_path(&b, &d, 0, &grpc) != 0)
        goto out;

    /* 3. get bandwidth: mapped pool, by value, and memcpy of the same bytes */
    kvc_lease *l;
    if (kvc_lookup(b.c, tokens, (size_t)GET_BLOCKS * P, 0, &l) != KVC_OK ||
        kvc_lease_num_blocks(l) != GET_BLOCKS || kvc_wait(b.c, l, KVC_TIER_L2, 0) != KVC_OK) {
        fprintf(stderr, "rpc_bench: lookup for get: %s\n", kvc_last_error());
        goto out;
    }
    uint32_t mapped = 0;
    for (uint32_t i = 0; i < GET_BLOCKS; i++)
        mapped += kvc_lease_block_ptr(b.c, l, i) != NULL;
    kvc_lease *lv;
    if (kvc_lookup(b.cv, tokens, (size_t)GET_BLOCKS * P, 0, &lv) != KVC_OK) {
        fprintf(stderr, "rpc_bench: lookup: %s\n", kvc_last_error());
        kvc_release(b.c, l);
        goto out;
    }
    /* Interleaved rounds, best of each: on a shared machine the neighbours' load comes and
     * goes, and interleaving exposes the three copies to the same conditions. The first
     * round also takes the page faults of the fresh mapping and buffers; it is not counted. */
    double best_mapped = 0, best_value = 0, best_memcpy = 0;
    int exact = 1;
    double t_end = tkvt_now() + 3 * seconds;
    for (int round = 0; round < 4 || tkvt_now() < t_end; round++) {
        double ta = tkvt_now();
        int r1 = kvc_get(b.c, l, 0, GET_BLOCKS, dst, nbytes);
        double tb = tkvt_now();
        exact = exact && r1 == KVC_OK && memcmp(dst, src, nbytes) == 0;
        double tc = tkvt_now();
        int r2 = kvc_get(b.cv, lv, 0, GET_BLOCKS, dst, nbytes);
        double td = tkvt_now();
        exact = exact && r2 == KVC_OK && memcmp(dst, src, nbytes) == 0;
        double te = tkvt_now();
        memcpy(dst, src, nbytes);
        __asm__ __volatile__("" : : "r"(dst) : "memory"); /* keep the copy */
        double tf = tkvt_now();
        if (r1 != KVC_OK || r2 != KVC_OK) {
            fprintf(stderr, "rpc_bench: get: %s\n", kvc_last_error());
            break;
        }
        if (round == 0)
            continue;
        if (gbps((double)nbytes, tb - ta) > best_mapped)
            best_mapped = gbps((double)nbytes, tb - ta);
        if (gbps((double)nbytes, td - tc) > best_value)
            best_value = gbps((double)nbytes, td - tc);
        if (gbps((double)nbytes, tf - te) > best_memcpy)
            best_memcpy = gbps((double)nbytes, tf - te);
    }
    kvc_release(b.c, l);
    kvc_release(b.cv, lv);
    double mapped_gbps = best_mapped, value_gbps = best_value, memcpy_gbps = best_memcpy;

    /* 4. the ceiling: redis GET over TCP on 127.0.0.1, 1 client (latency) and N (throughput) */
    redis_result r1 = {0, 0, 0}, rn = {0, 0, 0};
    int have_redis = redis > 0 && redis_bench(redis_port, 1, 50000, &r1) == 0 &&
                     redis_bench(redis_port, threads, 200000, &rn) == 0;
    if (!have_redis)
        fprintf(stderr, "rpc_bench: redis-server/redis-benchmark did not run; no ceiling\n");

    if (json) {
        printf("{\"lookup_blocks\":%d,\"batch_prompts\":%d,\"block_bytes\":%zu,\"threads\":%d,"
               "\"key_cache_bytes\":\"%s\",\"daemon_lookup_p50_us\":%.1f,", LOOKUP_BLOCKS,
               BATCH_PROMPTS, bb, threads, key_cache, fast.daemon_p50_us);
        const char *names[2] = {"fast", "grpc"};
        const path_result *paths[2] = {&fast, &grpc};
        for (int i = 0; i < 2; i++)
            printf("\"%s\":{\"lookup_p50_us\":%.1f,\"lookup_p99_us\":%.1f,\"lookup1_p50_us\":%.1f,"
                   "\"lookup1_p99_us\":%.1f,\"lookups_per_s\":%.0f,\"batch_p50_us\":%.1f,"
                   "\"batch_blocks_per_s\":%.0f},", names[i], paths[i]->p50_us, paths[i]->p99_us,
                   paths[i]->p50_1_us, paths[i]->p99_1_us, paths[i]->lookups_s,
                   paths[i]->batch_p50_us, paths[i]->batch_blocks_s);
        printf("\"redis_get_p50_us\":%.1f,\"redis_get_p99_us\":%.1f,\"redis_gets_per_s\":%.0f,"
               "\"redis_gets_per_s_1client\":%.0f,\"fast_p50_over_redis_p50\":%.2f,"
               "\"fast_lookup1_p50_over_redis_p50\":%.2f,\"get_mapped_gbps\":%.2f,"
               "\"get_value_gbps\":%.2f,\"memcpy_gbps\":%.2f,\"mapped_blocks\":%u,"
               "\"get_bytes\":%zu,\"bit_exact\":%s}\n",
               r1.p50_us, r1.p99_us, rn.rps, r1.rps, r1.p50_us > 0 ? fast.p50_us / r1.p50_us : 0,
               r1.p50_us > 0 ? fast.p50_1_us / r1.p50_us : 0, mapped_gbps, value_gbps, memcpy_gbps,
               mapped, nbytes, exact ? "true" : "false");
    } else {
        printf("rpc_bench: tierkvd lookups (fast path, gRPC) vs redis-server GET (same machine)\n");
        printf("%-40s %11s %11s %11s\n", "", "fast path", "gRPC", "redis GET");
        printf("%-40s %11.1f %11.1f %11.1f\n", "round trip p50 (us), 1 client", fast.p50_us,
               grpc.p50_us, r1.p50_us);
        printf("%-40s %11.1f %11.1f %11.1f\n", "round trip p99 (us), 1 client", fast.p99_us,
               grpc.p99_us, r1.p99_us);
        printf("%-40s %11.1f %11.1f %11.1f\n", "1-block lookup p50 (us), 1 client", fast.p50_1_us,
               grpc.p50_1_us, r1.p50_us);
        printf("%-40s %11.0f %11.0f %11.0f\n", "lookups/s (GETs/s), threads/clients",
               fast.lookups_s, grpc.lookups_s, rn.rps);
        printf("%-40s %11.0f %11.0f\n", "blocks/s looked up in batches", fast.batch_blocks_s,
               grpc.batch_blocks_s);
        printf("(a %d-block prompt per lookup, released after it; batches of %d prompts; %d "
               "threads, one client each)\n", LOOKUP_BLOCKS, BATCH_PROMPTS, threads);
        printf("%-40s %11.2f\n", "get through the mapped pool (GB/s)", mapped_gbps);
        printf("%-40s %11.2f\n", "get by value over gRPC (GB/s)", value_gbps);
        printf("%-40s %11.2f\n", "memcpy of the same bytes (GB/s)", memcpy_gbps);
        printf("mapped get = %.0f%% of memcpy; %u of %d blocks mapped; %zu bytes per get; "
               "bit-exact %s\n",
               100 * mapped_gbps / memcpy_gbps, mapped, GET_BLOCKS, nbytes, exact ? "yes" : "NO");
    }
    rc = exact ? 0 : 1;
out:
    free(src);
    free(dst);
    free(b.tokens);
    kvc_close(b.c);
    kvc_close(b.cv);
    if (redis > 0) {
        kill(redis, SIGTERM);
        waitpid(redis, NULL, 0);
    }
    if (tkvt_daemon_stop(&d) != 0)
        rc = 1;
    return rc;
}
