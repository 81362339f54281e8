/* l4_bench.c - the shared tier's put and get rates against redis-benchmark on one cluster.
 *
 * Starts a Redis Cluster of 3 masters on 127.0.0.1 (free high ports, a temp folder, no
 * persistence), then for each value size measures, in the same run and on the same cluster:
 *   redis-benchmark --cluster -t set,get -d <value bytes> -n PN -c 3 -P <pipeline> (the peer:
 *               in cluster mode one thread per master, each with one connection to it, so 3
 *               connections with 16 requests in flight on each, 48 in all)
 *   tkv_l4 put: put_async of P x N blocks (--passes P = 4, --blocks N = 256), a flush after
 *               each N (one writer, one pipeline per node): as many SETs as the peer's
 *   tkv_l4 get: fetch_prefix of the same P x N blocks, chains of --chain (16) blocks, from
 *               --readers (3) threads: as many GETs as the peer's; each lookup spreads its
 *               16 GETs over the masters, so 48 in flight in all as in the peer (over 3 x 3
 *               connections)
 * The value size is what one Redis value holds in both: a record of tokens + payload of
 * <value bytes> - 128 and the 128-byte header. Rates are value bytes per second; the ratio
 * l4 / redis-benchmark is what docs/perf.md quotes. Every block a lookup returns has passed the
 * checks an engine's lookup makes (key, header, checksum); after the timed passes one more,
 * untimed, compares every block's tokens and payload with what was put, byte for byte.
 *
 *   build/bench/l4_bench [--blocks N] [--chain K] [--pipeline P] [--readers T] [--passes G]
 *                        [--reps R] [--size BYTES] [--json FILE]
 */
#include <arpa/inet.h>
#include <errno.h>
#include <ftw.h>
#include <netinet/in.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <hiredis/hiredis.h>

#include "tkv_base.h"
#include "tkv_l4.h"

#define NUM_MASTERS 3
#define TOKENS 16

static char g_dir[64];
static int g_port[NUM_MASTERS];
static pid_t g_pid[NUM_MASTERS];

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

static bool port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    bool ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    close(fd);
    return ok;
}

static bool cluster_ok(int port)
{
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    bool ok = false;
    if (c && !c->err) {
        redisReply *r = redisCommand(c, "CLUSTER INFO");
        ok = r && r->type == REDIS_REPLY_STRING && strstr(r->str, "cluster_state:ok");
        if (r)
            freeReplyObject(r);
    }
    if (c)
        redisFree(c);
    return ok;
}

static int start_cluster(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/tkv-l4bench-XXXXXX");
    if (!mkdtemp(g_dir))
        return -1;
    srand((unsigned)getpid());
    int base = 0;
    for (int a = 0; a < 200 && !base; a++) {
        int b = 20000 + rand() % 30000;
        bool ok = true;
        for (int i = 0; i < NUM_MASTERS && ok; i++)
            ok = port_free(b + i) && port_free(b + i + 10000);
        if (ok)
            base = b;
    }
    if (!base)
        return -1;
    for (int i = 0; i < NUM_MASTERS; i++) {
        g_port[i] = base + i;
        char dir[128], port[16], conf[64];
        snprintf(dir, sizeof(dir), "%s/r%d", g_dir, i);
        mkdir(dir, 0755);
        snprintf(port, sizeof(port), "%d", g_port[i]);
        snprintf(conf, sizeof(conf), "nodes-%d.conf", g_port[i]);
        pid_t p = fork();
        if (p == 0) {
            execlp("redis-server", "redis-server", "--bind", "127.0.0.1", "--port", port, "--dir",
                   dir, "--logfile", "redis.log", "--cluster-enabled", "yes",
                   "--cluster-config-file", conf, "--save", "", "--appendonly", "no",
                   "--protected-mode", "no", (char *)NULL);
            _exit(127);
        }
        g_pid[i] = p;
    }
    for (int i = 0; i < NUM_MASTERS; i++) {
        double deadline = now_s() + 10;
        redisContext *c = NULL;
        struct timeval tv = {1, 0};
        while (now_s() < deadline) {
            c = redisConnectWithTimeout("127.0.0.1", g_port[i], tv);
            if (c && !c->err)
                break;
            if (c)
                redisFree(c);
            c = NULL;
            usleep(50000);
        }
        if (!c)
            return -1;
        redisFree(c);
    }
    char cmd[512];
    snprintf(cmd, sizeof(cmd),
             "redis-cli --cluster create 127.0.0.1:%d 127.0.0.1:%d 127.0.0.1:%d --cluster-yes "
             ">%s/create.log 2>&1", g_port[0], g_port[1], g_port[2], g_dir);
    if (system(cmd) != 0)
        return -1;
    double deadline = now_s() + 20;
    for (;;) {
        int ok = 0;
        for (int i = 0; i < NUM_MASTERS; i++)
            ok += cluster_ok(g_port[i]);
        if (ok == NUM_MASTERS)
            return 0;
        if (now_s() > deadline)
            return -1;
        usleep(100000);
    }
}

static int rm_one(const char *p, const struct stat *sb, int f, struct FTW *w)
{
    (void)sb;
    (void)f;
    (void)w;
    return remove(p);
}

static void stop_cluster(void)
{
    for (int i = 0; i < NUM_MASTERS; i++) {
        if (g_pid[i] > 0) {
            kill(g_pid[i], SIGKILL);
            waitpid(g_pid[i], NULL, 0);
        }
    }
    if (g_dir[0])
        nftw(g_dir, rm_one, 16, FTW_DEPTH | FTW_PHYS);
}

static void flushall(void)
{
    for (int i = 0; i < NUM_MASTERS; i++) {
        struct timeval tv = {5, 0};
        redisContext *c = redisConnectWithTimeout("127.0.0.1", g_port[i], tv);
        if (c && !c->err) {
            redisReply *r = redisCommand(c, "FLUSHALL");
            if (r)
                freeReplyObject(r);
        }
        if (c)
            redisFree(c);
    }
}

/* redis-benchmark's SET and GET rates (requests/s) at this value size. */
static int peer(size_t value_bytes, int requests, int pipeline, double *set_rps, double *get_rps)
{
    char cmd[512];
    /* 64 keys, so every GET finds a value the SET phase wrote */
    snprintf(cmd, sizeof(cmd),
             "redis-benchmark --cluster -h 127.0.0.1 -p %d -t set,get -d %zu -n %d -c %d -P %d "
             "-r 64 --csv 2>/dev/null", g_port[0], value_bytes, requests, NUM_MASTERS, pipeline);
    FILE *f = popen(cmd, "r");
    if (!f)
        return -1;
    char line[512];
    *set_rps = *get_rps = 0;
    while (fgets(line, sizeof(line), f)) {
        double rps = 0;
        if (sscanf(line, "\"SET\",\"%lf\"", &rps) == 1)
            *set_rps = rps;
        else if (sscanf(line, "\"GET\",\"%lf\"", &rps) == 1)
            *get_rps = rps;
    }
    int st = pclose(f);
    return st == 0 && *set_rps > 0 && *get_rps > 0 ? 0 : -1;
}

static void fill(uint8_t *p, size_t n, uint64_t seed)
{
    uint64_t s = seed * 0x9e3779b97f4a7c15ull | 1;
    for (size_t i = 0; i + 8 <= n; i += 8) {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        memcpy(p + i, &s, 8);
    }
}

typedef struct result {
    size_t value_bytes;
    double peer_set_gbps, peer_get_gbps, l4_put_gbps, l4_get_gbps;
} result;

typedef struct reader {
    tkv_l4 *l4;
    const tkv_key *keys;
    int n, chain;
    size_t found;
} reader;

/* One lookup after another over its share of the blocks, chain blocks each. */
static void *reader_main(void *arg)
{
    reader *r = arg;
    tkv_l4_block *got = calloc((size_t)r->chain, sizeof(*got));
    for (int i = 0; i < r->n; i += r->chain) {
        size_t n = (size_t)(r->n - i < r->chain ? r->n - i : r->chain), found = 0;
        tkv_l4_fetch_prefix(r->l4, r->keys + i, n, got, &found);
        r->found += found;
        tkv_l4_blocks_free(got, found);
    }
    free(got);
    return NULL;
}

/* Reads every block once more and compares it with what was put (block i's payload is the
 * common pattern with its first byte = i, its tokens 0). The number of blocks that differ. */
static int verify_all(tkv_l4 *l4, const tkv_key *keys, int blocks, int chain, uint8_t *pay,
                      size_t payload)
{
    tkv_l4_block *got = calloc((size_t)chain, sizeof(*got));
    int wrong = 0;
    for (int i = 0; i < blocks; i += chain) {
        size_t n = (size_t)(blocks - i < chain ? blocks - i : chain), found = 0;
        tkv_l4_fetch_prefix(l4, keys + i, n, got, &found);
        wrong += (int)(n - found);
        for (size_t k = 0; k < found; k++) {
            int j = i + (int)k;
            pay[0] = (uint8_t)j;
            bool ok = memcmp(got[k].payload, pay, payload) == 0;
            for (int t = 0; t < TOKENS && ok; t++)
                ok = got[k].tokens[t] == 0;
            ok = ok && memcmp(got[k].parent.b, keys[j ? j - 1 : 0].b, TKV_KEY_BYTES) == 0;
            wrong += !ok;
        }
        tkv_l4_blocks_free(got, found);
    }
    free(got);
    return wrong;
}

static int g_readers = 3, g_passes = 4;

static int run_once(size_t value_bytes, int blocks, int chain, int pipeline, result *res)
{
    size_t payload = value_bytes - TKV_L4_HEADER_BYTES - TOKENS * 4;
    res->value_bytes = value_bytes;
    double set_rps, get_rps;
    flushall();
    int total_blocks = blocks * g_passes;
    if (peer(value_bytes, total_blocks, pipeline, &set_rps, &get_rps) != 0) {
        fprintf(stderr, "redis-benchmark failed\n");
        return -1;
    }
    res->peer_set_gbps = set_rps * (double)value_bytes / 1e9;
    res->peer_get_gbps = get_rps * (double)value_bytes / 1e9;
    flushall();

    char nodes[128];
    snprintf(nodes, sizeof(nodes), "127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d", g_port[0],
             g_port[1], g_port[2]);
    tkv_l4_opts *o = tkv_l4_opts_new();
    tkv_l4_opts_set_nodes(o, nodes);
    tkv_l4_opts_set_block(o, payload, TOKENS);
    tkv_l4_opts_set_write_budget(o, (uint64_t)blocks * value_bytes + (64u << 20));
    tkv_l4_opts_set_connections(o, (unsigned)g_readers);
    tkv_l4_opts_set_timeouts(o, 1000, 60000);
    tkv_l4 *l4 = NULL;
    int rc = tkv_l4_open(o, &l4);
    tkv_l4_opts_free(o);
    if (rc != TKV_OK)
        return -1;
    tkv_key *keys = calloc((size_t)total_blocks, sizeof(tkv_key));
    uint8_t *pay = malloc(payload);
    uint32_t tok[TOKENS] = {0};
    fill(pay, payload, value_bytes);
    for (int i = 0; i < total_blocks; i++)
        fill(keys[i].b, TKV_KEY_BYTES, (uint64_t)i * 7919 + value_bytes);

    /* N blocks, then a flush, P times: the write queue never holds more than N blocks */
    double t0 = now_s();
    for (int i = 0; i < total_blocks; i++) {
        pay[0] = (uint8_t)i;
        if (tkv_l4_put_async(l4, &keys[i], i ? &keys[i - 1] : &keys[0], tok, TOKENS, pay,
                             payload) != TKV_OK) {
            fprintf(stderr, "put_async %d refused\n", i);
            rc = -1;
            goto out;
        }
        if ((i + 1) % blocks == 0)
            tkv_l4_flush(l4, -1);
    }
    tkv_l4_flush(l4, -1);
    double t_put = now_s() - t0;
    tkv_l4_stats st;
    tkv_l4_get_stats(l4, &st);
    if (st.put_blocks != (uint64_t)total_blocks) {
        fprintf(stderr, "only %llu of %d blocks written\n", (unsigned long long)st.put_blocks,
                total_blocks);
        rc = -1;
        goto out;
    }
    res->l4_put_gbps = (double)total_blocks * (double)value_bytes / t_put / 1e9;

    reader rd[16];
    pthread_t th[16];
    t0 = now_s();
    for (int r = 0; r < g_readers; r++) {
        int from = total_blocks * r / g_readers, to = total_blocks * (r + 1) / g_readers;
        rd[r] = (reader){.l4 = l4, .keys = keys + from, .n = to - from, .chain = chain};
        pthread_create(&th[r], NULL, reader_main, &rd[r]);
    }
    size_t total = 0;
    for (int r = 0; r < g_readers; r++) {
        pthread_join(th[r], NULL);
        total += rd[r].found;
    }
    double t_get = now_s() - t0;
    if (total != (size_t)total_blocks) {
        fprintf(stderr, "only %zu of %d blocks read back\n", total, total_blocks);
        rc = -1;
        goto out;
    }
    res->l4_get_gbps = (double)total_blocks * (double)value_bytes / t_get / 1e9;
    int wrong = verify_all(l4, keys, total_blocks, chain, pay, payload);
    if (wrong) {
        fprintf(stderr, "%d of %d blocks read back wrong or missing\n", wrong, total_blocks);
        rc = -1;
        goto out;
    }
out:
    tkv_l4_close(l4);
    free(keys);
    free(pay);
    return rc;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return x < y ? -1 : x > y;
}

static double median(double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return v[n / 2];
}

/* The peer and tkv_l4 take turns, `reps` times, and each figure is the median of its runs:
 * on a shared machine a burst of other load then hits both sides alike. */
static int g_reps = 3;

static int run_size(size_t value_bytes, int blocks, int chain, int pipeline, result *res)
{
    double ps[16], pg[16], ls[16], lg[16];
    for (int r = 0; r < g_reps; r++) {
        result one;
        if (run_once(value_bytes, blocks, chain, pipeline, &one) != 0)
            return -1;
        ps[r] = one.peer_set_gbps;
        pg[r] = one.peer_get_gbps;
        ls[r] = one.l4_put_gbps;
        lg[r] = one.l4_get_gbps;
    }
    res->value_bytes = value_bytes;
    res->peer_set_gbps = median(ps, g_reps);
    res->peer_get_gbps = median(pg, g_reps);
    res->l4_put_gbps = median(ls, g_reps);
    res->l4_get_gbps = median(lg, g_reps);
    return 0;
}

int main(int argc, char **argv)
{
    int blocks = 256, chain = 16, pipeline = 16;
    unsigned long long only_size = 0;
    const char *json = NULL;
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--blocks") && i + 1 < argc)
            blocks = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--chain") && i + 1 < argc)
            chain = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--pipeline") && i + 1 < argc)
            pipeline = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--readers") && i + 1 < argc)
            g_readers = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--reps") && i + 1 < argc)
            g_reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--passes") && i + 1 < argc)
            g_passes = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--size") && i + 1 < argc)
            only_size = strtoull(argv[++i], NULL, 10);
        else if (!strcmp(argv[i], "--json") && i + 1 < argc)
            json = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--blocks N] [--chain K] [--pipeline P] [--readers T] "
                    "[--passes G] [--reps R] [--size BYTES] [--json FILE]\n"
                    "  --size: one value size (<= 1 MiB + 128: one chunk) instead of 64 KiB and\n"
                    "          1 MiB + 128 (the header)\n"
                    "  --passes P: tkv_l4 puts and gets P x N blocks (a flush after each N);\n"
                    "          the peer sends P x N requests of each kind (default 4)\n",
                    argv[0]);
            return 2;
        }
    }
    if (blocks < 1 || chain < 1 || pipeline < 1 || g_reps < 1 || g_reps > 16 || g_readers < 1 ||
        g_readers > 16 || g_passes < 1 || g_passes > 64 ||
        (only_size &&
         (only_size < TKV_L4_HEADER_BYTES + TOKENS * 4 + 8 ||
          only_size > (1u << 20) + TKV_L4_HEADER_BYTES))) {
        fprintf(stderr, "bad arguments (see --help)\n");
        return 2;
    }
    if (system("command -v redis-server >/dev/null && command -v redis-benchmark >/dev/null") != 0) {
        fprintf(stderr, "redis-server / redis-benchmark not installed\n");
        return 77;
    }
    tkv_log_level = TKV_LOG_WARN;

    if (start_cluster() != 0) {
        fprintf(stderr, "could not start a Redis Cluster (see %s)\n", g_dir);
        stop_cluster();
        return 1;
    }
    size_t sizes[] = {64u << 10, (1u << 20) + TKV_L4_HEADER_BYTES};
    int num_sizes = 2;
    if (only_size) {
        sizes[0] = (size_t)only_size;
        num_sizes = 1;
    }
    result res[2];
    int rc = 0;
    printf("%-12s %14s %14s %7s %14s %14s %7s\n", "value bytes", "r-b SET GB/s", "l4 put GB/s",
           "ratio", "r-b GET GB/s", "l4 get GB/s", "ratio");
    for (int s = 0; s < num_sizes && rc == 0; s++) {
        rc = run_size(sizes[s], blocks, chain, pipeline, &res[s]);
        if (rc == 0)
            printf("%-12zu %14.3f %14.3f %7.2f %14.3f %14.3f %7.2f\n", res[s].value_bytes,
                   res[s].peer_set_gbps, res[s].l4_put_gbps,
                   res[s].l4_put_gbps / res[s].peer_set_gbps, res[s].peer_get_gbps,
                   res[s].l4_get_gbps, res[s].l4_get_gbps / res[s].peer_get_gbps);
    }
    if (rc == 0 && json) {
        FILE *f = fopen(json, "w");
        if (f) {
            fprintf(f, "{\"bench\":\"l4\",\"blocks\":%d,\"chain\":%d,\"pipeline\":%d,"
                    "\"readers\":%d,\"passes\":%d,\"sizes\":[", blocks, chain, pipeline, g_readers,
                    g_passes);
            for (int s = 0; s < num_sizes; s++)
                fprintf(f, "%s{\"value_bytes\":%zu,\"peer_set_gbps\":%.4f,\"l4_put_gbps\":%.4f,"
                        "\"peer_get_gbps\":%.4f,\"l4_get_gbps\":%.4f}", s ? "," : "",
                        res[s].value_bytes, res[s].peer_set_gbps, res[s].l4_put_gbps,
                        res[s].peer_get_gbps, res[s].l4_get_gbps);
            fprintf(f, "]}\n");
            fclose(f);
        }
    }
    stop_cluster();
    return rc ? 1 : 0;
}
