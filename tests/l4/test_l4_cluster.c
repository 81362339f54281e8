/* test_l4_cluster.c - the shared tier (L4) on a real Redis Cluster: 3 masters + 3 replicas of
 * redis-server started here on 127.0.0.1 (free high ports, a temp folder, AUTH on), and two
 * tierkvd daemons with separate data folders standing for two hosts.
 *
 * In order (each test sees what the ones before did to the cluster):
 *   1. the router follows ASK (a slot being migrated) and MOVED (after it moved);
 *   2. the L4 module splits a block over 1 MiB into chunks, reads it back bit-exact, and
 *      misses a chunk with flipped bytes and a block torn between two writers;
 *   3. host A puts a prompt; host B, which never saw it, hits it from L4, bit-exact;
 *   4. bytes flipped in Redis (SETRANGE) are detected: a miss, counted, never served;
 *   5. a master killed under load: lookups and gets go on on both hosts through the
 *      failover, nothing wrong is served, and new prompts hit from L4 after it;
 *   6. every Redis process down: both hosts keep serving from their local tiers with no
 *      error to their clients, and say L4 is down (metrics and /api/stats).
 * Beside them, a store with two tenants over the cluster: one tenant's L4 quota stops its
 * blocks going to L4 past the quota (counted, refused), the other's are not held back.
 * Exits 77 (skipped) when redis-server or redis-cli is not installed.
 */
#include <check.h>
#include <arpa/inet.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <sys/socket.h>

#include <hiredis/hiredis.h>

#include "harness.h"
#include "tkv_base.h"
#include "tkv_csum.h"
#include "tkv_keys.h"
#include "tkv_l4.h"
#include "tkv_rcluster.h"
#include "tkv_store.h"

#define NUM_REDIS 6
#define PASSWORD "tierkv-l4-test"
#define BT TKVT_BLOCK_TOKENS

static char g_dir[64];
static int g_port[NUM_REDIS];
static pid_t g_pid[NUM_REDIS];
static char g_nodes[256];
static tkvt_daemon g_a, g_b;

/* ============================================================================================
 * The cluster
 * ========================================================================================== */

static bool port_free(int port)
{
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    int one = 1;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    bool ok = bind(fd, (struct sockaddr *)&a, sizeof(a)) == 0;
    close(fd);
    return ok;
}

/* Six ports p (and their cluster bus ports p + 10000) free on loopback. */
static int pick_ports(void)
{
    srand((unsigned)getpid() ^ (unsigned)time(NULL));
    for (int attempt = 0; attempt < 200; attempt++) {
        int base = 20000 + rand() % 30000;
        bool ok = true;
        for (int i = 0; i < NUM_REDIS && ok; i++)
            ok = port_free(base + i) && port_free(base + i + 10000);
        if (ok) {
            for (int i = 0; i < NUM_REDIS; i++)
                g_port[i] = base + i;
            return 0;
        }
    }
    return -1;
}

static redisContext *rconn(int port)
{
    struct timeval tv = {1, 0};
    redisContext *c = redisConnectWithTimeout("127.0.0.1", port, tv);
    if (!c || c->err) {
        if (c)
            redisFree(c);
        return NULL;
    }
    redisSetTimeout(c, tv);
    redisReply *r = redisCommand(c, "AUTH %s", PASSWORD);
    bool ok = r && r->type == REDIS_REPLY_STATUS;
    if (r)
        freeReplyObject(r);
    if (!ok) {
        redisFree(c);
        return NULL;
    }
    return c;
}

/* One command to one node; the reply (caller frees) or NULL. */
static redisReply *rcmd_argv(int port, int argc, const char **argv, const size_t *len)
{
    redisContext *c = rconn(port);
    if (!c)
        return NULL;
    redisReply *r = redisCommandArgv(c, argc, argv, len);
    redisFree(c);
    return r;
}

static redisReply *rcmd(int port, const char *cmd)
{
    /* split on spaces: the test's commands have no quoted arguments */
    char buf[512];
    const char *argv[16];
    int argc = 0;
    snprintf(buf, sizeof(buf), "%s", cmd);
    for (char *save = NULL, *t = strtok_r(buf, " ", &save); t && argc < 16;
         t = strtok_r(NULL, " ", &save))
        argv[argc++] = t;
    return rcmd_argv(port, argc, argv, NULL);
}

static bool info_has(int port, const char *section, const char *needle)
{
    char cmd[64];
    snprintf(cmd, sizeof(cmd), "%s %s", strcmp(section, "cluster") ? "INFO" : "CLUSTER",
             strcmp(section, "cluster") ? section : "INFO");
    redisReply *r = rcmd(port, cmd);
    bool has = r && r->type == REDIS_REPLY_STRING && strstr(r->str, needle);
    if (r)
        freeReplyObject(r);
    return has;
}

static int start_redis(int i)
{
    char dir[128], port[16], log[160], conf[64];
    snprintf(dir, sizeof(dir), "%s/r%d", g_dir, i);
    mkdir(dir, 0755);
    snprintf(port, sizeof(port), "%d", g_port[i]);
    snprintf(log, sizeof(log), "%s/redis.log", dir);
    snprintf(conf, sizeof(conf), "nodes-%d.conf", g_port[i]);
    pid_t p = fork();
    if (p < 0)
        return -1;
    if (p == 0) {
        setpgid(0, 0);
        execlp("redis-server", "redis-server", "--bind", "127.0.0.1", "--port", port,
               "--dir", dir, "--logfile", log, "--cluster-enabled", "yes",
               "--cluster-config-file", conf, "--cluster-node-timeout", "1000",
               "--cluster-require-full-coverage", "no", "--save", "", "--appendonly", "no",
               "--requirepass", PASSWORD, "--masterauth", PASSWORD, "--protected-mode", "no",
               (char *)NULL);
        _exit(127);
    }
    g_pid[i] = p;
    return 0;
}

static void stop_redis(int i)
{
    if (g_pid[i] > 0) {
        kill(g_pid[i], SIGKILL);
        waitpid(g_pid[i], NULL, 0);
        g_pid[i] = 0;
    }
}

static int start_cluster(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/tkv-l4-XXXXXX");
    if (!mkdtemp(g_dir) || pick_ports() != 0)
        return -1;
    for (int i = 0; i < NUM_REDIS; i++)
        if (start_redis(i) != 0)
            return -1;
    for (int i = 0; i < NUM_REDIS; i++) {
        double deadline = tkvt_now() + 10;
        redisContext *c = NULL;
        while (!(c = rconn(g_port[i])) && tkvt_now() < deadline)
            tkvt_sleep_ms(50);
        if (!c)
            return -1;
        redisFree(c);
    }
    char cmd[512];
    int n = snprintf(cmd, sizeof(cmd), "redis-cli -a %s --no-auth-warning --cluster create",
                     PASSWORD);
    for (int i = 0; i < NUM_REDIS; i++)
        n += snprintf(cmd + n, sizeof(cmd) - (size_t)n, " 127.0.0.1:%d", g_port[i]);
    snprintf(cmd + n, sizeof(cmd) - (size_t)n, " --cluster-replicas 1 --cluster-yes >%s/create.log 2>&1",
             g_dir);
    if (system(cmd) != 0)
        return -1;
    /* every node sees every slot served, and every replica has synced */
    double deadline = tkvt_now() + 20;
    for (;;) {
        int ok = 0, synced = 0, replicas = 0;
        for (int i = 0; i < NUM_REDIS; i++) {
            ok += info_has(g_port[i], "cluster", "cluster_state:ok") &&
                  info_has(g_port[i], "cluster", "cluster_slots_ok:16384");
            if (info_has(g_port[i], "replication", "role:slave")) {
                replicas++;
                synced += info_has(g_port[i], "replication", "master_link_status:up");
            }
        }
        if (ok == NUM_REDIS && replicas == NUM_REDIS / 2 && synced == replicas)
            break;
        if (tkvt_now() > deadline) {
            fprintf(stderr, "cluster did not settle: %d ok, %d/%d replicas synced\n", ok,
                    synced, replicas);
            return -1;
        }
        tkvt_sleep_ms(100);
    }
    snprintf(g_nodes, sizeof(g_nodes), "127.0.0.1:%d,127.0.0.1:%d,127.0.0.1:%d", g_port[0],
             g_port[1], g_port[2]);
    return 0;
}

/* Ports of the nodes that are masters now (alive ones only). */
static int masters(int *out)
{
    int n = 0;
    for (int i = 0; i < NUM_REDIS; i++)
        if (g_pid[i] > 0 && info_has(g_port[i], "replication", "role:master"))
            out[n++] = i;
    return n;
}

/* Every key of this test's L4 on the live masters ("tkv4:*"), into keys (malloc'ed). */
static size_t l4_keys(char ***keys, int **owner)
{
    size_t n = 0;
    *keys = NULL;
    *owner = NULL;
    int m[NUM_REDIS], nm = masters(m);
    for (int j = 0; j < nm; j++) {
        redisReply *r = rcmd(g_port[m[j]], "KEYS tkv4:*");
        if (!r)
            continue;
        for (size_t e = 0; r->type == REDIS_REPLY_ARRAY && e < r->elements; e++) {
            *keys = realloc(*keys, (n + 1) * sizeof(char *));
            *owner = realloc(*owner, (n + 1) * sizeof(int));
            (*keys)[n] = strdup(r->element[e]->str);
            (*owner)[n] = g_port[m[j]];
            n++;
        }
        freeReplyObject(r);
    }
    return n;
}

static void free_keys(char **keys, int *owner, size_t n)
{
    for (size_t i = 0; i < n; i++)
        free(keys[i]);
    free(keys);
    free(owner);
}

/* ============================================================================================
 * The daemons
 * ========================================================================================== */

/* GET path from a daemon's HTTP side (port in <run>/tierkvd.http); body into buf. */
static int http_get(const tkvt_daemon *d, const char *path, char *buf, size_t cap)
{
    char f[160];
    snprintf(f, sizeof(f), "%s/run/tierkvd.http", d->dir);
    FILE *fp = fopen(f, "r");
    int port = 0;
    if (!fp)
        return -1;
    char line[128] = "";
    if (fgets(line, sizeof(line), fp) && strrchr(line, ':')) /* "addr:port" */
        port = atoi(strrchr(line, ':') + 1);
    fclose(fp);
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    if (connect(fd, (struct sockaddr *)&a, sizeof(a)) != 0) {
        close(fd);
        return -1;
    }
    char req[256];
    int n = snprintf(req, sizeof(req), "GET %s HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n", path);
    if (write(fd, req, (size_t)n) != n) {
        close(fd);
        return -1;
    }
    size_t got = 0;
    ssize_t k;
    while (got + 1 < cap && (k = read(fd, buf + got, cap - 1 - got)) > 0)
        got += (size_t)k;
    buf[got] = 0;
    close(fd);
    return 0;
}

/* A metric's value from /metrics (first sample of that name), or -1. */
static double metric(const tkvt_daemon *d, const char *name)
{
    static char body[1 << 18];
    if (http_get(d, "/metrics", body, sizeof(body)) != 0)
        return -1;
    char pat[128];
    snprintf(pat, sizeof(pat), "\n%s ", name);
    const char *p = strstr(body, pat);
    return p ? atof(p + strlen(pat)) : -1;
}

static void prompt(uint64_t seed, uint32_t nblocks, uint32_t *tokens)
{
    tkvt_tokens(seed, tokens, (size_t)nblocks * BT);
}

static void put_prompt(kvc_client *c, uint64_t seed, uint32_t nblocks)
{
    uint32_t *tokens = malloc((size_t)nblocks * BT * sizeof(uint32_t));
    prompt(seed, nblocks, tokens);
    size_t bb = kvc_block_bytes(c);
    uint8_t *pay = malloc((size_t)nblocks * bb);
    for (uint32_t i = 0; i < nblocks; i++)
        tkvt_payload(seed, i, pay + (size_t)i * bb, bb);
    kvc_put_result r;
    int rc = kvc_put(c, tokens, (size_t)nblocks * BT, 0, pay, nblocks, &r);
    ck_assert_msg(rc == KVC_OK, "put: %s", kvc_last_error());
    free(pay);
    free(tokens);
}

/* Looks the prompt up and gets every hit block, each checked bit for bit against what was
 * put. Returns the number of hit blocks; every call must succeed. */
static uint32_t lookup_check(kvc_client *c, uint64_t seed, uint32_t nblocks)
{
    uint32_t *tokens = malloc((size_t)nblocks * BT * sizeof(uint32_t));
    prompt(seed, nblocks, tokens);
    kvc_lease *l = NULL;
    int rc = kvc_lookup(c, tokens, (size_t)nblocks * BT, 0, &l);
    ck_assert_msg(rc == KVC_OK, "lookup: %s", kvc_last_error());
    uint32_t n = kvc_lease_num_blocks(l);
    size_t bb = kvc_block_bytes(c);
    if (n) {
        uint8_t *got = malloc((size_t)n * bb), *want = malloc(bb);
        rc = kvc_get(c, l, 0, 0, got, (size_t)n * bb);
        ck_assert_msg(rc == KVC_OK, "get: %s", kvc_last_error());
        for (uint32_t i = 0; i < n; i++) {
            tkvt_payload(seed, i, want, bb);
            ck_assert_msg(memcmp(want, got + (size_t)i * bb, bb) == 0,
                          "prompt %llu block %u: wrong bytes served", (unsigned long long)seed, i);
        }
        free(got);
        free(want);
    }
    ck_assert_int_eq(kvc_release(c, l), KVC_OK);
    free(tokens);
    return n;
}

/* ============================================================================================
 * 1. the router: ASK while a slot migrates, MOVED once it moved
 * ========================================================================================== */

static int owner_of_slot(int slot, int *others, int *nothers)
{
    redisReply *r = rcmd(g_port[0], "CLUSTER SLOTS");
    int owner = -1;
    for (size_t i = 0; r && i < r->elements; i++) {
        redisReply *e = r->element[i];
        int port = (int)e->element[2]->element[1]->integer;
        if (slot >= e->element[0]->integer && slot <= e->element[1]->integer)
            owner = port;
    }
    *nothers = 0;
    for (size_t i = 0; r && i < r->elements; i++) {
        int port = (int)r->element[i]->element[2]->element[1]->integer;
        bool seen = port == owner;
        for (int j = 0; j < *nothers; j++)
            seen |= others[j] == port;
        if (!seen)
            others[(*nothers)++] = port;
    }
    if (r)
        freeReplyObject(r);
    return owner;
}

static char *node_id(int port)
{
    redisReply *r = rcmd(port, "CLUSTER MYID");
    char *id = r && r->type == REDIS_REPLY_STRING ? strdup(r->str) : NULL;
    if (r)
        freeReplyObject(r);
    return id;
}

static int rc_one(tkv_rc *rc, const char *a0, const char *a1, const char *a2, redisReply **out)
{
    const char *argv[3] = {a0, a1, a2};
    size_t len[3] = {strlen(a0), strlen(a1), a2 ? strlen(a2) : 0};
    tkv_rc_cmd c = {.argc = a2 ? 3 : 2, .argv = argv, .argvlen = len, .key_arg = 1};
    int st = tkv_rc_exec(rc, &c, 1);
    *out = c.reply;
    return st;
}

/* Large values come back bit-exact whatever the path: read past hiredis into a pool buffer
 * (top-level bulks of 64 KiB or more), built by hiredis (smaller ones, array elements), next
 * to nil answers, pipelined on one node and spread over all of them. */
START_TEST(router_large_values_bit_exact)
{
    tkv_rc_opts o = {.nodes = g_nodes, .password = PASSWORD};
    tkv_rc *rc = NULL;
    ck_assert_int_eq(tkv_rc_open(&o, &rc), TKV_OK);
    static const size_t sizes[] = {5, (64u << 10) - 1, 64u << 10, (200u << 10) + 7, 1u << 20,
                                   (1u << 20) + 129, 3};
    enum { NV = sizeof(sizes) / sizeof(sizes[0]), ROUNDS = 3 };
    char keys[2 * NV][32];
    char *vals[NV];
    const char *argv[4 * NV + 1][3 + NV];
    size_t len[4 * NV + 1][3 + NV];
    tkv_rc_cmd cmds[4 * NV + 1];
    for (int i = 0; i < (int)NV; i++) {
        vals[i] = malloc(sizes[i]);
        for (size_t b = 0; b < sizes[i]; b++)
            vals[i][b] = (char)(b * 131 + (size_t)i * 7 + (b >> 13));
        snprintf(keys[i], sizeof(keys[i]), "{big}:%d", i);     /* one node, pipelined */
        snprintf(keys[NV + i], sizeof(keys[i]), "spread:%d", i); /* every node */
    }
    memset(cmds, 0, sizeof(cmds));
    for (int i = 0; i < 2 * (int)NV; i++) {
        argv[i][0] = "SET", argv[i][1] = keys[i], argv[i][2] = vals[i % NV];
        len[i][0] = 3, len[i][1] = strlen(keys[i]), len[i][2] = sizes[i % NV];
        cmds[i] = (tkv_rc_cmd){.argc = 3, .argv = argv[i], .argvlen = len[i], .key_arg = 1};
    }
    ck_assert_int_eq(tkv_rc_exec(rc, cmds, 2 * NV), TKV_OK);
    for (int i = 0; i < 2 * (int)NV; i++)
        freeReplyObject(cmds[i].reply);
    /* each round asks the GETs for the sum of their strings from another offset (and the
     * missing keys for one they cannot have): taken as the bytes arrive for large values,
     * at the end for the others */
    static const size_t sum_from[ROUNDS] = {0, 128, 33};
    for (int round = 0; round < ROUNDS; round++) {
        /* GET each key, a missing key between them, and one MGET of the {big} keys */
        size_t n = 0;
        for (int i = 0; i < 2 * (int)NV; i++) {
            argv[n][0] = "GET", argv[n][1] = keys[i];
            len[n][0] = 3, len[n][1] = strlen(keys[i]);
            cmds[n] = (tkv_rc_cmd){.argc = 2, .argv = argv[n], .argvlen = len[n], .key_arg = 1,
                                   .sum_reply = 1, .sum_from = sum_from[round]};
            n++;
            argv[n][0] = "GET", argv[n][1] = "{big}:none";
            len[n][0] = 3, len[n][1] = 10;
            cmds[n] = (tkv_rc_cmd){.argc = 2, .argv = argv[n], .argvlen = len[n], .key_arg = 1,
                                   .sum_reply = 1};
            n++;
        }
        argv[n][0] = "MGET";
        len[n][0] = 4;
        for (int i = 0; i < (int)NV; i++)
            argv[n][1 + i] = keys[i], len[n][1 + i] = strlen(keys[i]);
        cmds[n] = (tkv_rc_cmd){.argc = 1 + NV, .argv = argv[n], .argvlen = len[n], .key_arg = 1};
        n++;
        ck_assert_int_eq(tkv_rc_exec(rc, cmds, n), TKV_OK);
        for (size_t k = 0; k + 1 < n; k += 2) {
            redisReply *r = cmds[k].reply;
            size_t want = sizes[(k / 2) % NV];
            ck_assert_int_eq(r->type, REDIS_REPLY_STRING);
            ck_assert_uint_eq(r->len, want);
            ck_assert(memcmp(r->str, vals[(k / 2) % NV], want) == 0);
            ck_assert_int_eq(r->str[want], '\0');
            size_t from = sum_from[round];
            ck_assert_int_eq(cmds[k].summed, want >= from);
            if (want >= from)
                ck_assert_uint_eq(cmds[k].sum,
                                  tkv_csum64(vals[(k / 2) % NV] + from, want - from));
            ck_assert_int_eq(cmds[k + 1].reply->type, REDIS_REPLY_NIL);
            ck_assert_int_eq(cmds[k + 1].summed, 0);
            if (k & 2)
                tkv_rc_reply_free(r);
            else
                freeReplyObject(r);
            tkv_rc_reply_free(cmds[k + 1].reply);
        }
        redisReply *m = cmds[n - 1].reply;
        ck_assert_int_eq(m->type, REDIS_REPLY_ARRAY);
        ck_assert_uint_eq(m->elements, NV);
        for (int i = 0; i < (int)NV; i++) {
            ck_assert_uint_eq(m->element[i]->len, sizes[i]);
            ck_assert(memcmp(m->element[i]->str, vals[i], sizes[i]) == 0);
        }
        freeReplyObject(m);
    }
    for (int i = 0; i < (int)NV; i++)
        free(vals[i]);
    tkv_rc_close(rc);
}
END_TEST

START_TEST(router_follows_ask_and_moved)
{
    tkv_rc_opts o = {.nodes = g_nodes, .password = PASSWORD};
    tkv_rc *rc = NULL;
    ck_assert_int_eq(tkv_rc_open(&o, &rc), TKV_OK);
    ck_assert(tkv_rc_healthy(rc));
    /* a pipelined batch over every master: 300 SETs, 300 GETs */
    enum { N = 300 };
    char keys[N][32], vals[N][32];
    const char *argv[2 * N][3];
    size_t len[2 * N][3];
    tkv_rc_cmd cmds[2 * N];
    memset(cmds, 0, sizeof(cmds));
    for (int i = 0; i < N; i++) {
        snprintf(keys[i], sizeof(keys[i]), "rt:%d", i);
        snprintf(vals[i], sizeof(vals[i]), "value-%d", i * 7);
        const char *s[3] = {"SET", keys[i], vals[i]}, *g[3] = {"GET", keys[i], NULL};
        for (int k = 0; k < 3; k++) {
            argv[i][k] = s[k];
            len[i][k] = s[k] ? strlen(s[k]) : 0;
            argv[N + i][k] = g[k];
            len[N + i][k] = g[k] ? strlen(g[k]) : 0;
        }
        cmds[i] = (tkv_rc_cmd){.argc = 3, .argv = argv[i], .argvlen = len[i], .key_arg = 1};
        cmds[N + i] = (tkv_rc_cmd){.argc = 2, .argv = argv[N + i], .argvlen = len[N + i],
                                   .key_arg = 1};
    }
    ck_assert_int_eq(tkv_rc_exec(rc, cmds, 2 * N), TKV_OK);
    for (int i = 0; i < N; i++) {
        ck_assert_int_eq(cmds[N + i].reply->type, REDIS_REPLY_STRING);
        ck_assert_str_eq(cmds[N + i].reply->str, vals[i]);
        freeReplyObject(cmds[i].reply);
        freeReplyObject(cmds[N + i].reply);
    }

    /* migrate the slot of {mig}: while it is MIGRATING, a key the source lacks is ASKed */
    int slot = tkv_rc_key_slot("{mig}", 5), others[NUM_REDIS], nothers = 0;
    int src = owner_of_slot(slot, others, &nothers);
    ck_assert_int_ge(src, 0);
    ck_assert_int_ge(nothers, 2);
    int dst = others[0];
    char *src_id = node_id(src), *dst_id = node_id(dst);
    ck_assert_ptr_nonnull(src_id);
    ck_assert_ptr_nonnull(dst_id);
    redisReply *r = NULL;
    ck_assert_int_eq(rc_one(rc, "SET", "{mig}:old", "before", &r), TKV_OK);
    freeReplyObject(r);
    char cmd[256];
    snprintf(cmd, sizeof(cmd), "CLUSTER SETSLOT %d IMPORTING %s", slot, src_id);
    r = rcmd(dst, cmd);
    ck_assert(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    snprintf(cmd, sizeof(cmd), "CLUSTER SETSLOT %d MIGRATING %s", slot, dst_id);
    r = rcmd(src, cmd);
    ck_assert(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    tkv_rc_stats st0 = {0}, st1 = {0}, st2 = {0};
    tkv_rc_add_stats(rc, &st0);
    ck_assert_int_eq(rc_one(rc, "SET", "{mig}:new", "during", &r), TKV_OK);
    ck_assert_int_eq(r->type, REDIS_REPLY_STATUS);
    freeReplyObject(r);
    tkv_rc_add_stats(rc, &st1);
    ck_assert_uint_gt(st1.ask, st0.ask);
    /* the new key went to the destination (which answers for the slot only after ASKING) */
    redisContext *dc = rconn(dst);
    ck_assert_ptr_nonnull(dc);
    r = redisCommand(dc, "ASKING");
    freeReplyObject(r);
    r = redisCommand(dc, "EXISTS {mig}:new");
    ck_assert(r && r->type == REDIS_REPLY_INTEGER && r->integer == 1);
    freeReplyObject(r);
    redisFree(dc);

    /* move the old key and finish: the source now answers MOVED */
    const char *mig[] = {"MIGRATE", "127.0.0.1", NULL, "", "0", "5000", "AUTH", PASSWORD,
                         "KEYS", "{mig}:old"};
    char dport[16];
    snprintf(dport, sizeof(dport), "%d", dst);
    mig[2] = dport;
    r = rcmd_argv(src, 10, mig, NULL);
    ck_assert_msg(r && r->type == REDIS_REPLY_STATUS, "MIGRATE: %s", r ? r->str : "no reply");
    freeReplyObject(r);
    snprintf(cmd, sizeof(cmd), "CLUSTER SETSLOT %d NODE %s", slot, dst_id);
    int ms[NUM_REDIS], nm = masters(ms);
    for (int j = 0; j < nm; j++) {
        r = rcmd(g_port[ms[j]], cmd);
        ck_assert(r && r->type == REDIS_REPLY_STATUS);
        freeReplyObject(r);
    }
    ck_assert_int_eq(rc_one(rc, "GET", "{mig}:old", NULL, &r), TKV_OK);
    ck_assert_int_eq(r->type, REDIS_REPLY_STRING);
    ck_assert_str_eq(r->str, "before");
    freeReplyObject(r);
    tkv_rc_add_stats(rc, &st2);
    ck_assert_uint_gt(st2.moved, st1.moved);
    /* the map was updated: the next command goes straight there */
    ck_assert_int_eq(rc_one(rc, "GET", "{mig}:new", NULL, &r), TKV_OK);
    ck_assert_str_eq(r->str, "during");
    freeReplyObject(r);
    tkv_rc_stats st3 = {0};
    tkv_rc_add_stats(rc, &st3);
    ck_assert_uint_eq(st3.moved, st2.moved);
    free(src_id);
    free(dst_id);
    tkv_rc_close(rc);
}
END_TEST

/* ============================================================================================
 * 2. the L4 module: chunks, damage, tears
 * ========================================================================================== */

#define BIG_BYTES ((5u << 19) + 3) /* 2.5 MiB + 3: three chunks, the last one short */

static tkv_l4 *open_l4(size_t block_bytes)
{
    tkv_l4_opts *o = tkv_l4_opts_new();
    ck_assert_int_eq(tkv_l4_opts_set_nodes(o, g_nodes), TKV_OK);
    ck_assert_int_eq(tkv_l4_opts_set_block(o, block_bytes, BT), TKV_OK);
    ck_assert_int_eq(tkv_l4_opts_set_auth(o, NULL, PASSWORD), TKV_OK);
    tkv_l4 *l4 = NULL;
    ck_assert_int_eq(tkv_l4_open(o, &l4), TKV_OK);
    tkv_l4_opts_free(o);
    ck_assert(tkv_l4_healthy(l4));
    return l4;
}

static void big_block(uint64_t seed, uint8_t *p, uint32_t *tok)
{
    tkvt_payload(seed, 0, p, BIG_BYTES);
    tkvt_tokens(seed, tok, BT);
}

START_TEST(l4_splits_checks_and_misses_damage)
{
    tkv_l4 *l4 = open_l4(BIG_BYTES);
    uint8_t *pay = malloc(BIG_BYTES);
    uint32_t tok[BT];
    tkv_key keys[3], root = {{0}};
    for (int i = 0; i < 3; i++) {
        for (int b = 0; b < TKV_KEY_BYTES; b++) /* random-looking, as SHA-256 keys are */
            keys[i].b[b] = (uint8_t)tkvt_mix((uint64_t)getpid() * 131 + (uint64_t)i * 64 + (uint64_t)b);
        big_block(100 + (uint64_t)i, pay, tok);
        ck_assert_int_eq(tkv_l4_put_async(l4, &keys[i], i ? &keys[i - 1] : &root, tok, BT, pay,
                                          BIG_BYTES), TKV_OK);
    }
    /* a second put of a block just queued is not written again */
    ck_assert_int_eq(tkv_l4_put_async(l4, &keys[0], &root, tok, BT, pay, BIG_BYTES), TKV_EEXIST);
    /* wrong sizes are refused */
    ck_assert_int_eq(tkv_l4_put_async(l4, &keys[0], &root, tok, BT, pay, BIG_BYTES - 1),
                     TKV_EINVAL);
    ck_assert_int_eq(tkv_l4_flush(l4, 10000), TKV_OK);
    tkv_l4_stats st;
    tkv_l4_get_stats(l4, &st);
    ck_assert_uint_eq(st.put_blocks, 3);
    ck_assert_uint_eq(st.put_errors, 0);

    /* three values per block, on one node (the hash tag) */
    char rk[96];
    for (uint32_t c = 0; c < 3; c++) {
        size_t n = tkv_l4_redis_key(&keys[1], c, rk);
        ck_assert_uint_eq(tkv_rc_key_slot(rk, n), tkv_rc_key_slot(rk, tkv_l4_redis_key(&keys[1], 0, rk)));
    }
    tkv_l4_block got[3];
    size_t found = 0;
    ck_assert_int_eq(tkv_l4_fetch_prefix(l4, keys, 3, got, &found), TKV_OK);
    ck_assert_uint_eq(found, 3);
    for (int i = 0; i < 3; i++) {
        big_block(100 + (uint64_t)i, pay, tok);
        ck_assert_mem_eq(got[i].payload, pay, BIG_BYTES);
        ck_assert_mem_eq(got[i].tokens, tok, sizeof(tok));
        ck_assert_mem_eq(got[i].parent.b, (i ? keys[i - 1] : root).b, TKV_KEY_BYTES);
    }
    tkv_l4_blocks_free(got, found);

    /* flip a byte in the middle chunk of block 1: blocks 0 only; the bad value is deleted */
    tkv_rc_opts ro = {.nodes = g_nodes, .password = PASSWORD};
    tkv_rc *rc = NULL;
    ck_assert_int_eq(tkv_rc_open(&ro, &rc), TKV_OK);
    size_t n = tkv_l4_redis_key(&keys[1], 1, rk);
    const char *sr[4] = {"SETRANGE", rk, "700000", "\x5a"};
    size_t srl[4] = {8, n, 6, 1};
    tkv_rc_cmd c = {.argc = 4, .argv = sr, .argvlen = srl, .key_arg = 1};
    ck_assert_int_eq(tkv_rc_exec(rc, &c, 1), TKV_OK);
    freeReplyObject(c.reply);
    ck_assert_int_eq(tkv_l4_fetch_prefix(l4, keys, 3, got, &found), TKV_OK);
    ck_assert_uint_eq(found, 1);
    ck_assert_mem_eq(got[0].payload, (big_block(100, pay, tok), pay), BIG_BYTES);
    tkv_l4_blocks_free(got, found);
    tkv_l4_get_stats(l4, &st);
    ck_assert_uint_eq(st.checksum_failures, 1);
    const char *ex[2] = {"EXISTS", rk};
    size_t exl[2] = {6, n};
    c = (tkv_rc_cmd){.argc = 2, .argv = ex, .argvlen = exl, .key_arg = 1};
    ck_assert_int_eq(tkv_rc_exec(rc, &c, 1), TKV_OK);
    ck_assert_int_eq(c.reply->integer, 0);
    freeReplyObject(c.reply);

    /* a block torn between two writers: chunk 2 of one write under chunks 0..1 of another */
    n = tkv_l4_redis_key(&keys[0], 2, rk);
    const char *g[2] = {"GET", rk};
    size_t gl[2] = {3, n};
    c = (tkv_rc_cmd){.argc = 2, .argv = g, .argvlen = gl, .key_arg = 1};
    ck_assert_int_eq(tkv_rc_exec(rc, &c, 1), TKV_OK);
    redisReply *old2 = c.reply;
    ck_assert_int_eq(old2->type, REDIS_REPLY_STRING);
    tkv_l4 *other = open_l4(BIG_BYTES); /* another host: it has not seen keys[0] */
    big_block(999, pay, tok);
    ck_assert_int_eq(tkv_l4_put_async(other, &keys[0], &root, tok, BT, pay, BIG_BYTES), TKV_OK);
    ck_assert_int_eq(tkv_l4_flush(other, 10000), TKV_OK);
    const char *s[3] = {"SET", rk, old2->str};
    size_t sl[3] = {3, n, old2->len};
    c = (tkv_rc_cmd){.argc = 3, .argv = s, .argvlen = sl, .key_arg = 1};
    ck_assert_int_eq(tkv_rc_exec(rc, &c, 1), TKV_OK);
    freeReplyObject(c.reply);
    freeReplyObject(old2);
    ck_assert_int_eq(tkv_l4_fetch_prefix(other, keys, 1, got, &found), TKV_OK);
    ck_assert_uint_eq(found, 0);
    tkv_l4_get_stats(other, &st);
    ck_assert_uint_eq(st.checksum_failures, 1);
    tkv_l4_close(other);
    tkv_rc_close(rc);
    tkv_l4_close(l4);
    free(pay);
}
END_TEST

/* A store with no L3 over the cluster (so a put hands its blocks to L4 at once): tenant 1 may
 * put 5 blocks into L4, tenant 2 has no limit. Each puts 12 one-block chains; only tenant 1's
 * first 5 reach Redis, the other 7 are refused and counted; all 12 of tenant 2's get there. */
#define QBLK 4096u
START_TEST(l4_tenant_quota_holds)
{
    tkv_l4 *l4 = open_l4(QBLK);
    tkv_store_opts *o = tkv_store_opts_new();
    uint8_t fp[TKV_KEY_BYTES];
    tkv_geometry g = {2, 1, 64, BT, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TENSOR, "l4-quota"};
    tkv_geometry_fingerprint(&g, fp);
    ck_assert_int_eq(tkv_store_opts_set_block(o, QBLK, BT), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_fingerprint(o, fp), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l2_blocks(o, 256), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l4(o, l4), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_l4_quota(o, 1, 5), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_name(o, 1, "capped"), TKV_OK);
    tkv_store *s = NULL;
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_OK);
    tkv_store_opts_free(o);
    static uint8_t pay[QBLK];
    tkv_key keys[2][12];
    for (unsigned tn = 1; tn <= 2; tn++) {
        char ns[32];
        snprintf(ns, sizeof(ns), "l4q-%u-%d", tn, (int)getpid());
        tkv_key root;
        tkv_key_root(fp, ns, strlen(ns), &root);
        for (uint32_t i = 0; i < 12; i++) {
            uint32_t tok[BT];
            tkvt_tokens(1000u * tn + i, tok, BT);
            ck_assert_uint_eq(tkv_key_chain(&root, tok, BT, BT, &keys[tn - 1][i], 1), 1);
            tkvt_payload(1000u * tn + i, 0, pay, QBLK);
            const void *p = pay;
            size_t stored = 0;
            ck_assert_int_eq(tkv_store_put_as(s, tn, &root, &keys[tn - 1][i], tok, &p, 1, &stored),
                             TKV_OK);
            ck_assert_uint_eq(stored, 1);
        }
    }
    ck_assert_int_eq(tkv_l4_flush(l4, 10000), TKV_OK);
    tkv_store_tenant_stats ts;
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 1, &ts), TKV_OK);
    ck_assert_uint_eq(ts.l4_blocks, 5);
    ck_assert_uint_eq(ts.max_l4_blocks, 5);
    ck_assert_uint_eq(ts.refused_l4_blocks, 7);
    ck_assert_uint_ge(ts.refused_blocks, 7);
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 2, &ts), TKV_OK);
    ck_assert_uint_eq(ts.l4_blocks, 12);
    ck_assert_uint_eq(ts.refused_l4_blocks, 0);
    /* What Redis holds: tenant 1's first 5 only, every one of tenant 2's. */
    for (unsigned tn = 1; tn <= 2; tn++)
        for (uint32_t i = 0; i < 12; i++) {
            tkv_l4_block b;
            size_t found = 0;
            ck_assert_int_eq(tkv_l4_fetch_prefix(l4, &keys[tn - 1][i], 1, &b, &found), TKV_OK);
            ck_assert_msg(found == (tn == 2 || i < 5), "tenant %u block %u: found %zu", tn, i,
                          found);
            if (found) {
                tkvt_payload(1000u * tn + i, 0, pay, QBLK);
                ck_assert_mem_eq(b.payload, pay, QBLK);
            }
            tkv_l4_blocks_free(&b, found);
        }
    tkv_store_close(s);
    tkv_l4_close(l4);
}
END_TEST

/* ============================================================================================
 * 3..6. two hosts
 * ========================================================================================== */

START_TEST(host_b_hits_what_host_a_put)
{
    kvc_client *a, *b;
    ck_assert_msg(tkvt_connect(&g_a, 0, &a) == KVC_OK, "%s", kvc_last_error());
    ck_assert_msg(tkvt_connect(&g_b, 0, &b) == KVC_OK, "%s", kvc_last_error());
    ck_assert_int_eq(lookup_check(b, 1, 40), 0); /* nobody has it yet */
    put_prompt(a, 1, 40);
    ck_assert_int_eq(kvc_flush(a), KVC_OK); /* L3, then the L4 write queue */
    ck_assert_int_eq(lookup_check(b, 1, 40), 40);
    ck_assert(metric(&g_b, "tierkv_l4_hit_blocks_total") >= 40);
    ck_assert(metric(&g_b, "tierkv_l4_up") == 1);
    ck_assert(metric(&g_a, "tierkv_l4_put_blocks_total") >= 40);
    /* B promoted them: a second lookup is local (no more L4 hits) */
    double before = metric(&g_b, "tierkv_l4_hit_blocks_total");
    ck_assert_int_eq(lookup_check(b, 1, 40), 40);
    ck_assert(metric(&g_b, "tierkv_l4_hit_blocks_total") == before);
    /* a longer prompt: B has 40 blocks locally and finds the rest in L4 */
    put_prompt(a, 1, 60);
    ck_assert_int_eq(kvc_flush(a), KVC_OK);
    ck_assert_int_eq(lookup_check(b, 1, 60), 60);
    ck_assert(metric(&g_b, "tierkv_l4_hit_blocks_total") == before + 20);
    kvc_close(a);
    kvc_close(b);
}
END_TEST

typedef struct l4val {
    char rkey[96];
    int port;
    uint8_t key[TKV_KEY_BYTES], parent[TKV_KEY_BYTES];
} l4val;

/* Puts prompt `seed` on host A and returns its values in Redis in chain order (from each
 * value's header: key at byte 8, parent at byte 40). */
static size_t put_and_find(kvc_client *a, uint64_t seed, uint32_t nb, l4val *out)
{
    char **k0, **k1;
    int *o0, *o1;
    size_t n0 = l4_keys(&k0, &o0);
    put_prompt(a, seed, nb);
    ck_assert_int_eq(kvc_flush(a), KVC_OK);
    size_t n1 = l4_keys(&k1, &o1), m = 0;
    ck_assert_uint_eq(n1, n0 + nb);
    l4val *v = calloc(nb, sizeof(*v));
    for (size_t i = 0; i < n1; i++) {
        bool old = false;
        for (size_t j = 0; j < n0 && !old; j++)
            old = strcmp(k0[j], k1[i]) == 0;
        if (old)
            continue;
        const char *argv[2] = {"GET", k1[i]};
        redisReply *r = rcmd_argv(o1[i], 2, argv, NULL);
        ck_assert(r && r->type == REDIS_REPLY_STRING && r->len >= TKV_L4_HEADER_BYTES);
        snprintf(v[m].rkey, sizeof(v[m].rkey), "%s", k1[i]);
        v[m].port = o1[i];
        memcpy(v[m].key, r->str + 8, TKV_KEY_BYTES);
        memcpy(v[m].parent, r->str + 40, TKV_KEY_BYTES);
        freeReplyObject(r);
        m++;
    }
    ck_assert_uint_eq(m, nb);
    /* the head's parent is no key of the prompt; then follow the chain */
    for (size_t i = 0; i < nb; i++) {
        size_t found = nb;
        for (size_t j = 0; j < nb && found == nb; j++) {
            bool parent_here = false;
            for (size_t k = 0; k < nb && !parent_here; k++)
                parent_here = memcmp(v[j].parent, v[k].key, TKV_KEY_BYTES) == 0;
            if (i == 0 ? !parent_here : memcmp(v[j].parent, out[i - 1].key, TKV_KEY_BYTES) == 0)
                found = j;
        }
        ck_assert_uint_lt(found, nb);
        out[i] = v[found];
    }
    free(v);
    free_keys(k0, o0, n0);
    free_keys(k1, o1, n1);
    return nb;
}

static void setrange(const l4val *v, const char *offset, const char *bytes, size_t len)
{
    const char *argv[4] = {"SETRANGE", v->rkey, offset, bytes};
    size_t al[4] = {8, strlen(v->rkey), strlen(offset), len};
    redisReply *r = rcmd_argv(v->port, 4, argv, al);
    ck_assert(r && r->type == REDIS_REPLY_INTEGER);
    freeReplyObject(r);
}

START_TEST(flipped_bytes_in_redis_are_missed)
{
    kvc_client *a, *b;
    ck_assert_msg(tkvt_connect(&g_a, 0, &a) == KVC_OK, "%s", kvc_last_error());
    ck_assert_msg(tkvt_connect(&g_b, 0, &b) == KVC_OK, "%s", kvc_last_error());
    l4val v[16];
    double bad = metric(&g_b, "tierkv_l4_checksum_failures_total");
    ck_assert(bad >= 0);

    /* a payload byte of block 5: B hits blocks 0..4, every byte of them checked */
    put_and_find(a, 2, 16, v);
    setrange(&v[5], "1000", "\xa5", 1);
    ck_assert_int_eq(lookup_check(b, 2, 16), 5);
    ck_assert(metric(&g_b, "tierkv_l4_checksum_failures_total") == bad + 1);
    /* the damaged value was deleted: later lookups stop there as a plain miss */
    ck_assert_int_eq(lookup_check(b, 2, 16), 5);
    ck_assert(metric(&g_b, "tierkv_l4_checksum_failures_total") == bad + 1);
    const char *ex[2] = {"EXISTS", v[5].rkey};
    redisReply *r = rcmd_argv(v[5].port, 2, ex, NULL);
    ck_assert(r && r->integer == 0);
    freeReplyObject(r);

    /* a header byte of block 0 (the key it claims): nothing hits */
    put_and_find(a, 3, 16, v);
    setrange(&v[0], "20", "\x01\x02", 2);
    ck_assert_int_eq(lookup_check(b, 3, 16), 0);
    ck_assert(metric(&g_b, "tierkv_l4_checksum_failures_total") == bad + 2);

    /* a token of block 9 (the record's first bytes) and a value cut short at block 12 */
    put_and_find(a, 4, 16, v);
    setrange(&v[9], "130", "\xff", 1);
    ck_assert_int_eq(lookup_check(b, 4, 16), 9);
    const char *set[3] = {"SET", v[9].rkey, "short"};
    r = rcmd_argv(v[9].port, 3, set, NULL);
    ck_assert(r && r->type == REDIS_REPLY_STATUS);
    freeReplyObject(r);
    ck_assert_int_eq(lookup_check(b, 4, 16), 9);
    ck_assert(metric(&g_b, "tierkv_l4_checksum_failures_total") == bad + 4);
    /* A, which holds the prompts locally, is unaffected */
    ck_assert_int_eq(lookup_check(a, 2, 16), 16);
    ck_assert_int_eq(lookup_check(a, 4, 16), 16);
    kvc_close(a);
    kvc_close(b);
}
END_TEST

START_TEST(a_master_killed_under_load)
{
    kvc_client *a, *b;
    ck_assert_msg(tkvt_connect(&g_a, 0, &a) == KVC_OK, "%s", kvc_last_error());
    ck_assert_msg(tkvt_connect(&g_b, 0, &b) == KVC_OK, "%s", kvc_last_error());
    int ms[NUM_REDIS];
    ck_assert_int_eq(masters(ms), 3);
    int victim = ms[1];
    const uint32_t nb = 8;
    uint64_t seed = 1000;
    double t_kill = 0, t_failover = 0;
    uint32_t full_after = 0, rounds_after = 0, hits_during = 0;
    double end = tkvt_now() + 25;
    while (tkvt_now() < end) {
        /* A puts a new prompt; B reads the one A put last round, and its own */
        put_prompt(a, seed, nb);
        ck_assert_int_eq(kvc_flush(a), KVC_OK);
        uint32_t hit = lookup_check(b, seed, nb);
        ck_assert_int_eq(lookup_check(a, seed, nb), nb); /* A's own: always local */
        seed++;
        if (!t_kill && seed == 1010) {
            stop_redis(victim); /* kill -9 */
            t_kill = tkvt_now();
        }
        if (t_kill && !t_failover) {
            hits_during += hit;
            int now_m[NUM_REDIS];
            if (masters(now_m) == 3)
                t_failover = tkvt_now();
        } else if (t_failover && tkvt_now() > t_failover + 2.0) {
            /* the router has found the promoted replica by now */
            rounds_after++;
            full_after += hit == nb;
            if (rounds_after == 10)
                break;
        }
    }
    ck_assert_msg(t_failover > 0, "no failover within the test's time");
    ck_assert_uint_eq(rounds_after, 10);
    ck_assert_uint_eq(full_after, 10); /* every prompt put after the failover hits from L4 */
    fprintf(stderr, "failover after %.1f s; %u blocks hit from L4 meanwhile\n",
            t_failover - t_kill, hits_during);
    /* and everything from before the kill that survived is still right (or a miss) */
    for (uint64_t s = 1000; s < 1010; s++)
        lookup_check(b, s, nb);
    kvc_close(a);
    kvc_close(b);
}
END_TEST

START_TEST(redis_down_the_hosts_serve_locally)
{
    for (int i = 0; i < NUM_REDIS; i++)
        stop_redis(i);
    kvc_client *a, *b;
    ck_assert_msg(tkvt_connect(&g_a, 0, &a) == KVC_OK, "%s", kvc_last_error());
    ck_assert_msg(tkvt_connect(&g_b, 0, &b) == KVC_OK, "%s", kvc_last_error());
    /* what each host holds locally keeps being served; new puts and lookups just work */
    for (int round = 0; round < 20; round++) {
        ck_assert_int_eq(lookup_check(b, 1, 60), 60);
        ck_assert_int_eq(lookup_check(a, 1, 60), 60);
        put_prompt(b, 5000 + (uint64_t)round, 4);
        ck_assert_int_eq(lookup_check(b, 5000 + (uint64_t)round, 4), 4);
        ck_assert_int_eq(lookup_check(a, 5000 + (uint64_t)round, 4), 0); /* not shared now */
    }
    ck_assert_int_eq(kvc_flush(b), KVC_OK);
    /* and both say so */
    double deadline = tkvt_now() + 10;
    while (metric(&g_b, "tierkv_l4_up") != 0 && tkvt_now() < deadline)
        tkvt_sleep_ms(100);
    ck_assert(metric(&g_b, "tierkv_l4_up") == 0);
    ck_assert(metric(&g_a, "tierkv_l4_up") == 0);
    static char body[1 << 16];
    ck_assert_int_eq(http_get(&g_b, "/api/stats", body, sizeof(body)), 0);
    ck_assert_msg(strstr(body, "\"l4\":{\"configured\":true,\"up\":false"), "%s", body);
    kvc_close(a);
    kvc_close(b);
}
END_TEST

/* ============================================================================================
 * config: the l4_* keys are validated before anything starts
 * ========================================================================================== */

/* Runs tierkvd --check-config with args; its exit status, its output into out. */
static int check_config(const char *args, char *out, size_t cap)
{
    char cmd[1024];
    snprintf(cmd, sizeof(cmd), "%s/daemon/tierkvd --check-config --data-dir %s/cfg %s 2>&1",
             tkvt_build_dir(), g_dir, args);
    FILE *f = popen(cmd, "r");
    ck_assert_ptr_nonnull(f);
    size_t n = fread(out, 1, cap - 1, f);
    out[n] = 0;
    int st = pclose(f);
    return WIFEXITED(st) ? WEXITSTATUS(st) : -1;
}

START_TEST(l4_keys_are_validated)
{
    static char out[1 << 16];
    const struct {
        const char *args, *says;
    } bad[] = {
        {"--l4-redis-nodes 127.0.0.1", "expected host:port"},
        {"--l4-redis-nodes 127.0.0.1:0", "port must be 1..65535"},
        {"--l4-redis-nodes a:1,", "empty entry"},
        {"--l4-redis-nodes 'a b:1'", "bad host name"},
        {"--l4-redis-nodes a:1 --l4-redis-user u", "l4_redis_user needs l4_redis_password"},
        {"--l4-redis-password p", "need l4_redis_nodes"},
        {"--l4-redis-nodes a:1 --l4-timeout-ms 0", "out of range"},
        {"--l4-redis-nodes a:1 --l4-connections 65", "out of range"},
        {"--l4-redis-nodes a:1 --l4-bytes-budget 12Q", "is not a size"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        int code = check_config(bad[i].args, out, sizeof(out));
        ck_assert_msg(code == 2, "%s: exit %d: %s", bad[i].args, code, out);
        ck_assert_msg(strstr(out, bad[i].says), "%s: %s", bad[i].args, out);
    }
    /* a good one; the password is never printed */
    int code = check_config("--l4-redis-nodes 127.0.0.1:7000,redis-2:7001 --l4-redis-user u "
                            "--l4-redis-password hunter2 --l4-bytes-budget 1G", out, sizeof(out));
    ck_assert_msg(code == 0, "exit %d: %s", code, out);
    ck_assert_msg(strstr(out, "l4_redis_nodes = \"127.0.0.1:7000,redis-2:7001\""), "%s", out);
    ck_assert_msg(strstr(out, "l4_bytes_budget = 1073741824"), "%s", out);
    ck_assert_msg(!strstr(out, "hunter2"), "the password was printed: %s", out);
}
END_TEST

static bool have(const char *prog)
{
    char cmd[128];
    snprintf(cmd, sizeof(cmd), "command -v %s >/dev/null 2>&1", prog);
    return system(cmd) == 0;
}

int main(void)
{
    if (!have("redis-server") || !have("redis-cli")) {
        fprintf(stderr, "redis-server / redis-cli not installed: skipped\n");
        return 77;
    }
    int failed = 1;
    if (start_cluster() != 0) {
        fprintf(stderr, "could not start the Redis Cluster (logs in %s)\n", g_dir);
        goto out;
    }
    const char *extra[] = {"--l4-redis-nodes", g_nodes, "--l4-redis-password", PASSWORD,
                           "--l4-timeout-ms", "500", "--l4-connect-timeout-ms", "200", NULL};
    if (tkvt_daemon_start(&g_a, extra) != 0 || tkvt_daemon_start(&g_b, extra) != 0)
        goto out;
    Suite *s = suite_create("l4_cluster");
    TCase *tc = tcase_create("l4_cluster");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, l4_keys_are_validated);
    tcase_add_test(tc, router_follows_ask_and_moved);
    tcase_add_test(tc, router_large_values_bit_exact);
    tcase_add_test(tc, l4_splits_checks_and_misses_damage);
    tcase_add_test(tc, l4_tenant_quota_holds);
    tcase_add_test(tc, host_b_hits_what_host_a_put);
    tcase_add_test(tc, flipped_bytes_in_redis_are_missed);
    tcase_add_test(tc, a_master_killed_under_load);
    tcase_add_test(tc, redis_down_the_hosts_serve_locally);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    failed = srunner_ntests_failed(sr);
    srunner_free(sr);
out:
    if (g_a.pid && tkvt_daemon_stop(&g_a) != 0)
        failed = 1;
    if (g_b.pid && tkvt_daemon_stop(&g_b) != 0)
        failed = 1;
    for (int i = 0; i < NUM_REDIS; i++)
        stop_redis(i);
    if (g_dir[0] && !failed)
        tkvt_rmtree(g_dir);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
