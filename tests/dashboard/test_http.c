/* test_http.c - daemon/http.c served over a real tkv_store (L2 + L3 in a temp dir), spoken to
 * over real TCP sockets: figures match the store, /metrics passes `promtool check metrics`,
 * /api/prefixes ranks chains right, and the server refuses what it should.
 *
 * Includes http.c (h2o's t/00unit habit) to reach the listening socket for the bind check.
 */
#include "../../daemon/http.c"

#include <check.h>
#include <ftw.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "tkv_keys.h"

enum { kBlockTokens = 16, kBlockBytes = 4096 };

/* ---- fixture: a store holding three chains, some of them looked up ------------------------ */

static char g_dir[256];
static tkv_store *g_store;
static tkvd_metrics g_metrics;
static tkv_geometry g_geom;
static tkvd_http_source g_src;
static tkvd_http *g_http;
static tkv_key g_root;
/* chain A: 4 blocks; chain B: A's first 2 blocks + 2 of its own; chain C: 1 block */
static tkv_key g_a[4], g_b[4], g_c[1];
static uint32_t g_tok_a[4 * kBlockTokens], g_tok_b[4 * kBlockTokens], g_tok_c[kBlockTokens];

static int rm_entry(const char *path, const struct stat *sb, int flag, struct FTW *ftw)
{
    return remove(path);
}

static void put_chain(const tkv_key *keys, const uint32_t *tokens, size_t n)
{
    static uint8_t payload[kBlockBytes];
    const void *payloads[8];
    for (size_t i = 0; i < n; i++) {
        memset(payload, (int)(0x40 + i), sizeof(payload));
        payloads[i] = payload;
    }
    size_t stored = 0;
    ck_assert_int_eq(tkv_store_put(g_store, NULL, keys, tokens, payloads, n, &stored), TKV_OK);
}

static void lookup(const tkv_key *keys, size_t n, size_t expect_hit)
{
    uint64_t t0 = tkv_now_ns(), lease = 0;
    size_t hit = 0;
    ck_assert_int_eq(tkv_store_lookup(g_store, keys, n, 1, 0, &lease, &hit, NULL), TKV_OK);
    ck_assert_uint_eq(hit, expect_hit);
    tkvd_metrics_observe_lookup(&g_metrics, tkv_now_ns() - t0);
    atomic_fetch_add(&g_metrics.lookups, 1);
    atomic_fetch_add(&g_metrics.rpc_total, 1);
    if (lease)
        ck_assert_int_eq(tkv_store_lease_release(g_store, lease), TKV_OK);
}

static void setup(void)
{
    snprintf(g_dir, sizeof(g_dir), "/tmp/tkv-test-http-XXXXXX");
    ck_assert_ptr_nonnull(mkdtemp(g_dir));
    char l3dir[300];
    snprintf(l3dir, sizeof(l3dir), "%s/l3", g_dir);

    memset(&g_geom, 0, sizeof(g_geom));
    g_geom = (tkv_geometry){.num_layers = 2, .num_kv_heads = 2, .head_dim = 64,
                            .block_tokens = kBlockTokens, .dtype = TKV_DTYPE_FP8_E4M3,
                            .scale_mode = TKV_SCALE_PER_TENSOR};
    snprintf(g_geom.model_id, sizeof(g_geom.model_id), "test-\"model\"");
    uint8_t fp[TKV_KEY_BYTES];
    tkv_geometry_fingerprint(&g_geom, fp);
    tkv_key_root(fp, "", 0, &g_root);

    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_block(o, kBlockBytes, kBlockTokens), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_fingerprint(o, fp), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l2_blocks(o, 64), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l3(o, l3dir, 0), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_workers(o, 2), TKV_OK);
    ck_assert_int_eq(tkv_store_open(o, &g_store), TKV_OK);
    tkv_store_opts_free(o);

    for (uint32_t i = 0; i < 4 * kBlockTokens; i++) {
        g_tok_a[i] = 1000 + i;
        g_tok_b[i] = i < 2 * kBlockTokens ? g_tok_a[i] : 5000 + i;
    }
    for (uint32_t i = 0; i < kBlockTokens; i++)
        g_tok_c[i] = 9000 + i;
    ck_assert_uint_eq(tkv_key_chain(&g_root, g_tok_a, 4 * kBlockTokens, kBlockTokens, g_a, 4), 4);
    ck_assert_uint_eq(tkv_key_chain(&g_root, g_tok_b, 4 * kBlockTokens, kBlockTokens, g_b, 4), 4);
    ck_assert_uint_eq(tkv_key_chain(&g_root, g_tok_c, kBlockTokens, kBlockTokens, g_c, 1), 1);
    put_chain(g_a, g_tok_a, 4);
    put_chain(g_b, g_tok_b, 4);
    put_chain(g_c, g_tok_c, 1);

    tkvd_metrics_init(&g_metrics);
    lookup(g_a, 4, 4);
    lookup(g_a, 4, 4);
    lookup(g_a, 4, 4);
    lookup(g_b, 4, 4);
    tkv_key miss[2];
    uint32_t other[2 * kBlockTokens];
    for (uint32_t i = 0; i < 2 * kBlockTokens; i++)
        other[i] = 77777 + i;
    tkv_key_chain(&g_root, other, 2 * kBlockTokens, kBlockTokens, miss, 2);
    lookup(miss, 2, 0);

    g_src = (tkvd_http_source){.store = g_store, .metrics = &g_metrics, .geometry = &g_geom,
                               .policy_name = "tierkv", .version = "0.1.0-test"};
    ck_assert_int_eq(tkvd_http_start(NULL, 0, &g_src, &g_http), TKV_OK);
    ck_assert_uint_ne(tkvd_http_port(g_http), 0);
}

static void teardown(void)
{
    tkvd_http_stop(g_http);
    g_http = NULL;
    tkv_store_close(g_store);
    g_store = NULL;
    nftw(g_dir, rm_entry, 16, FTW_DEPTH | FTW_PHYS);
}

/* ---- a minimal HTTP/1.1 client over a real socket ----------------------------------------- */

typedef struct reply {
    int status;
    char *raw;     /* whole response, NUL-terminated */
    char *body;    /* into raw */
    size_t body_len;
} reply;

static void reply_free(reply *r)
{
    free(r->raw);
    memset(r, 0, sizeof(*r));
}

/* Sends req as is and reads until the server closes. */
static reply http_raw(const char *req, size_t req_len)
{
    reply r = {0};
    int fd = socket(AF_INET, SOCK_STREAM, 0);
    ck_assert_int_ge(fd, 0);
    struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(tkvd_http_port(g_http))};
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ck_assert_int_eq(connect(fd, (struct sockaddr *)&a, sizeof(a)), 0);
    size_t off = 0;
    while (off < req_len) {
        ssize_t n = send(fd, req + off, req_len - off, MSG_NOSIGNAL);
        if (n <= 0)
            break; /* the server may answer and close before reading an oversize request */
        off += (size_t)n;
    }
    shutdown(fd, SHUT_WR);
    size_t cap = 1 << 16, len = 0;
    r.raw = tkv_xmalloc(cap);
    for (;;) {
        if (len + 1 == cap)
            r.raw = tkv_xrealloc(r.raw, cap *= 2);
        ssize_t n = recv(fd, r.raw + len, cap - len - 1, 0);
        if (n <= 0)
            break;
        len += (size_t)n;
    }
    close(fd);
    r.raw[len] = '\0';
    if (sscanf(r.raw, "HTTP/1.%*d %d", &r.status) != 1)
        r.status = -1;
    char *sep = strstr(r.raw, "\r\n\r\n");
    r.body = sep ? sep + 4 : r.raw + len;
    r.body_len = (size_t)(r.raw + len - r.body);
    return r;
}

static reply http_get(const char *path)
{
    char req[4096];
    int n = snprintf(req, sizeof(req),
                     "GET %s HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n", path);
    ck_assert_int_lt(n, (int)sizeof(req));
    return http_raw(req, (size_t)n);
}

static bool has_header(const reply *r, const char *line)
{
    char *end = strstr(r->raw, "\r\n\r\n");
    char *p = strcasestr(r->raw, line);
    return p && (!end || p < end);
}

/* Value of "name":<u64> in a flat part of a JSON document, starting at from. */
static uint64_t json_u64(const char *from, const char *name)
{
    char pat[128];
    snprintf(pat, sizeof(pat), "\"%s\":", name);
    const char *p = strstr(from, pat);
    ck_assert_msg(p != NULL, "no %s in %s", name, from);
    return strtoull(p + strlen(pat), NULL, 10);
}

/* Value of an unlabelled Prometheus sample. */
static uint64_t prom_u64_value(const char *body, const char *series)
{
    char pat[200];
    snprintf(pat, sizeof(pat), "\n%s ", series);
    const char *p = strstr(body, pat);
    ck_assert_msg(p != NULL, "no series %s", series);
    return strtoull(p + strlen(pat), NULL, 10);
}

/* ---- tests ------------------------------------------------------------------------------- */

START_TEST(binds_loopback_by_default)
{
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(g_http->mhd, MHD_DAEMON_INFO_LISTEN_FD);
    ck_assert_ptr_nonnull(info);
    struct sockaddr_storage ss;
    socklen_t len = sizeof(ss);
    ck_assert_int_eq(getsockname(info->listen_fd, (struct sockaddr *)&ss, &len), 0);
    ck_assert_int_eq(ss.ss_family, AF_INET);
    struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
    ck_assert_uint_eq(ntohl(s4->sin_addr.s_addr), INADDR_LOOPBACK);
    ck_assert_uint_eq(ntohs(s4->sin_port), tkvd_http_port(g_http));

    /* An explicit address is honoured, a bad one is refused, a taken port is an I/O error. */
    tkvd_http *h2 = NULL;
    tkv_log_level = -1; /* the two refusals below log errors, as they should */
    ck_assert_int_eq(tkvd_http_start("not-an-address", 0, &g_src, &h2), TKV_EINVAL);
    ck_assert_int_eq(tkvd_http_start("127.0.0.1", tkvd_http_port(g_http), &g_src, &h2), TKV_EIO);
    tkv_log_level = TKV_LOG_ERROR;
    ck_assert_ptr_null(h2);
    ck_assert_int_eq(tkvd_http_start("::1", 0, &g_src, &h2), TKV_OK);
    ck_assert_uint_ne(tkvd_http_port(h2), 0);
    tkvd_http_stop(h2);
}
END_TEST

START_TEST(stats_match_store)
{
    tkv_store_stats st;
    tkv_store_get_stats(g_store, &st);
    reply r = http_get("/api/stats");
    ck_assert_int_eq(r.status, 200);
    ck_assert(has_header(&r, "Content-Type: application/json"));
    ck_assert_uint_eq(json_u64(r.body, "lookups"), st.lookups);
    ck_assert_uint_eq(st.lookups, 5);
    ck_assert_uint_eq(json_u64(r.body, "lookup_blocks"), st.lookup_keys);
    ck_assert_uint_eq(json_u64(r.body, "hit_blocks"), 16);
    ck_assert_uint_eq(json_u64(r.body, "miss_blocks"), st.miss_blocks);
    ck_assert_uint_eq(json_u64(r.body, "prefill_tokens_saved"), 16 * kBlockTokens);
    ck_assert_uint_eq(json_u64(r.body, "puts"), st.puts);
    ck_assert_uint_eq(json_u64(r.body, "rpcs"), 5);
    ck_assert_uint_eq(json_u64(r.body, "block_bytes"), kBlockBytes);
    ck_assert_uint_eq(json_u64(r.body, "block_tokens"), kBlockTokens);
    /* hit rate = 16 hit blocks of 18 asked */
    const char *hr = strstr(r.body, "\"hit_rate\":");
    ck_assert_ptr_nonnull(hr);
    ck_assert_double_eq_tol(strtod(hr + 11, NULL), 16.0 / 18.0, 1e-5);
    /* per tier: the sum of the tiers' hit blocks is the total, and each tier's block count is
     * the store's */
    const char *l2 = strstr(r.body, "{\"tier\":\"l2\"");
    const char *l3 = strstr(r.body, "{\"tier\":\"l3\"");
    ck_assert_ptr_nonnull(l2);
    ck_assert_ptr_nonnull(l3);
    ck_assert_uint_eq(json_u64(l2, "blocks"), st.blocks_tier[TKV_TIER_L2]);
    ck_assert_uint_eq(json_u64(l2, "hit_blocks"), st.hit_blocks_tier[TKV_TIER_L2]);
    ck_assert_uint_eq(json_u64(l3, "hit_blocks"), st.hit_blocks_tier[TKV_TIER_L3]);
    ck_assert_uint_eq(json_u64(l2, "capacity_blocks"), 64);
    ck_assert_uint_eq(json_u64(l2, "capacity_bytes"), 64 * kBlockBytes);
    ck_assert_uint_eq(st.hit_blocks_tier[1] + st.hit_blocks_tier[2] + st.hit_blocks_tier[3], 16);
    /* latency: 5 lookups observed; the model id was JSON-escaped */
    ck_assert_uint_eq(json_u64(strstr(r.body, "\"lookup_latency_us\""), "count"), 5);
    ck_assert_ptr_nonnull(strstr(r.body, "\"model_id\":\"test-\\\"model\\\"\""));
    reply_free(&r);
}
END_TEST

START_TEST(metrics_promtool_clean)
{
    reply r = http_get("/metrics");
    ck_assert_int_eq(r.status, 200);
    ck_assert(has_header(&r, "Content-Type: text/plain; version=0.0.4"));
    ck_assert_uint_eq(prom_u64_value(r.body - 1, "tierkv_lookups_total"), 5);
    ck_assert_ptr_nonnull(strstr(r.body, "# TYPE tierkv_lookup_duration_seconds histogram\n"));
    ck_assert_ptr_nonnull(strstr(r.body, "tierkv_lookup_duration_seconds_bucket{le=\"+Inf\"} 5\n"));
    ck_assert_uint_eq(prom_u64_value(r.body, "tierkv_lookup_duration_seconds_count"), 5);
    ck_assert_ptr_nonnull(strstr(r.body, "tierkv_tier_capacity_blocks{tier=\"l2\"} 64\n"));
    ck_assert_ptr_nonnull(strstr(r.body, "model=\"test-\\\"model\\\"\""));

    /* Prometheus's own parser and linter: promtool reads the exposition on stdin and exits 0
     * only when it parses and has no lint problems. */
    char path[300];
    snprintf(path, sizeof(path), "%s/metrics.txt", g_dir);
    FILE *f = fopen(path, "w");
    ck_assert_ptr_nonnull(f);
    ck_assert_uint_eq(fwrite(r.body, 1, r.body_len, f), r.body_len);
    fclose(f);
    char cmd[800];
    snprintf(cmd, sizeof(cmd), "promtool check metrics < %s > %s.out 2>&1", path, path);
    int rc = system(cmd);
    char out[4096] = "";
    snprintf(cmd, sizeof(cmd), "%s.out", path);
    f = fopen(cmd, "r");
    if (f) {
        size_t n = fread(out, 1, sizeof(out) - 1, f);
        out[n] = '\0';
        fclose(f);
    }
    ck_assert_msg(WIFEXITED(rc) && WEXITSTATUS(rc) == 0, "promtool check metrics failed (%d): %s",
                  rc, out);
    reply_free(&r);
}
END_TEST

/* The fixture's forest: A0-A1 shared by A and B (4 lookups reached them), A2-A3 (3), B2-B3 (1),
 * C0 (never hit). Prefixes: A1 (branch point, 2 blocks, 4 hits), A3 (tip, 4 blocks, 3 hits),
 * B3 (tip, 4 blocks, 1 hit), C0 (tip, 0 hits); A0, A2, B2 sit inside runs and are not listed. */
static const char *prefix_entry(const char *body, const tkv_key *k)
{
    char id[kIdHexChars + 1], want[64];
    hex_id(k, id);
    snprintf(want, sizeof(want), "{\"id\":\"%s\"", id);
    return strstr(body, want);
}

START_TEST(prefixes_ranked)
{
    reply r = http_get("/api/prefixes?top=3");
    ck_assert_int_eq(r.status, 200);
    ck_assert_uint_eq(json_u64(r.body, "num_blocks"), 7);
    ck_assert_uint_eq(json_u64(r.body, "num_tips"), 3);
    ck_assert_uint_eq(json_u64(r.body, "num_prefixes"), 4);
    ck_assert_uint_eq(json_u64(r.body, "top"), 3);
    ck_assert_ptr_nonnull(strstr(r.body, "\"by\":\"tokens_saved\""));
    /* by tokens saved: A3 (3 x 64 tokens) > A1 (4 x 32) > B3 (1 x 64); C0 cut by top=3 */
    const char *a3 = prefix_entry(r.body, &g_a[3]), *a1 = prefix_entry(r.body, &g_a[1]);
    const char *b3 = prefix_entry(r.body, &g_b[3]);
    ck_assert_msg(a3 && a1 && b3, "missing prefixes: %s", r.body);
    ck_assert_ptr_eq(a3, strstr(r.body, "\"prefixes\":[") + 12);
    ck_assert(a3 < a1 && a1 < b3);
    ck_assert_ptr_null(prefix_entry(r.body, &g_c[0]));
    ck_assert_ptr_null(prefix_entry(r.body, &g_a[0]));
    ck_assert_ptr_null(prefix_entry(r.body, &g_a[2]));

    char root[kIdHexChars + 1], want[64];
    hex_id(&g_a[0], root);
    snprintf(want, sizeof(want), "\"root\":\"%s\"", root);
    ck_assert_ptr_nonnull(strstr(a3, want));
    ck_assert_ptr_nonnull(strstr(a3, "\"kind\":\"tip\""));
    ck_assert_uint_eq(json_u64(a3, "depth"), 4);
    ck_assert_uint_eq(json_u64(a3, "tokens"), 4 * kBlockTokens);
    ck_assert_uint_eq(json_u64(a3, "blocks"), 4);
    ck_assert_uint_eq(json_u64(a3, "hits"), 3);
    ck_assert_uint_eq(json_u64(a3, "root_hits"), 4);
    ck_assert_uint_eq(json_u64(a3, "tokens_saved"), 3 * 4 * kBlockTokens);
    ck_assert_ptr_nonnull(strstr(a1, "\"kind\":\"branch\""));
    ck_assert_uint_eq(json_u64(a1, "children"), 2);
    ck_assert_uint_eq(json_u64(a1, "depth"), 2);
    ck_assert_uint_eq(json_u64(a1, "hits"), 4);
    ck_assert_uint_eq(json_u64(a1, "tokens_saved"), 4 * 2 * kBlockTokens);
    ck_assert_ptr_nonnull(strstr(b3, want)); /* B shares A's root */
    ck_assert_uint_eq(json_u64(b3, "blocks"), 4);
    ck_assert_uint_eq(json_u64(b3, "tokens_saved"), 1 * 4 * kBlockTokens);
    /* every block of the fixture is in L2 (64 slots) */
    ck_assert_ptr_nonnull(strstr(a3, "\"in_l2\":4"));
    /* lengths and ids only: no token lists */
    ck_assert_ptr_null(strstr(r.body, "\"tokens\":["));
    reply_free(&r);

    /* by hits: A1 (4) first; top=1000 lists all four, C0 last */
    r = http_get("/api/prefixes?top=1000&by=hits");
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "\"by\":\"hits\""));
    a1 = prefix_entry(r.body, &g_a[1]);
    ck_assert_ptr_eq(a1, strstr(r.body, "\"prefixes\":[") + 12);
    const char *c0 = prefix_entry(r.body, &g_c[0]);
    ck_assert_ptr_nonnull(c0);
    ck_assert(c0 > prefix_entry(r.body, &g_b[3]));
    ck_assert_uint_eq(json_u64(c0, "hits"), 0);
    ck_assert_uint_eq(json_u64(c0, "depth"), 1);
    reply_free(&r);
}
END_TEST

/* A chain whose first block was evicted from every tier: its other blocks stay listed, with
 * their known depth but fewer cached blocks, rooted at the first block still cached. */
START_TEST(prefixes_after_eviction)
{
    ck_assert_int_eq(tkv_store_flush(g_store), TKV_OK);
    size_t evicted = 0, pinned = 0;
    ck_assert_int_eq(tkv_store_evict(g_store, TKV_TIER_L2, &g_a[0], 1, &evicted, &pinned), TKV_OK);
    ck_assert_int_eq(tkv_store_evict(g_store, TKV_TIER_L3, &g_a[0], 1, &evicted, &pinned), TKV_OK);
    reply r = http_get("/api/prefixes?top=10");
    ck_assert_int_eq(r.status, 200);
    ck_assert_uint_eq(json_u64(r.body, "num_blocks"), 6);
    const char *a1 = prefix_entry(r.body, &g_a[1]), *a3 = prefix_entry(r.body, &g_a[3]);
    ck_assert_msg(a1 && a3, "%s", r.body);
    ck_assert_uint_eq(json_u64(a1, "depth"), 2);
    ck_assert_uint_eq(json_u64(a1, "blocks"), 1);
    ck_assert_uint_eq(json_u64(a3, "depth"), 4);
    ck_assert_uint_eq(json_u64(a3, "blocks"), 3);
    char root[kIdHexChars + 1], want[64];
    hex_id(&g_a[1], root);
    snprintf(want, sizeof(want), "\"root\":\"%s\"", root);
    ck_assert_ptr_nonnull(strstr(a3, want));
    reply_free(&r);
}
END_TEST

START_TEST(refuses_bad_requests)
{
    static const char *const bad_top[] = {"/api/prefixes?top=0", "/api/prefixes?top=1001",
                                          "/api/prefixes?top=abc", "/api/prefixes?top=5x",
                                          "/api/prefixes?top=-1", "/api/prefixes?top=",
                                          "/api/prefixes?top=99999999999",
                                          "/api/prefixes?by=size", "/api/prefixes?topp=3",
                                          "/metrics?x=1"};
    for (size_t i = 0; i < sizeof(bad_top) / sizeof(bad_top[0]); i++) {
        reply r = http_get(bad_top[i]);
        ck_assert_msg(r.status == 400, "%s -> %d", bad_top[i], r.status);
        reply_free(&r);
    }
    reply r = http_get("/nope");
    ck_assert_int_eq(r.status, 404);
    ck_assert_ptr_nonnull(strstr(r.body, "no such resource"));
    reply_free(&r);
    r = http_get("/metrics/");
    ck_assert_int_eq(r.status, 404);
    reply_free(&r);

    static const char post[] = "POST /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n"
                               "Connection: close\r\n\r\nhi";
    r = http_raw(post, sizeof(post) - 1);
    ck_assert_int_eq(r.status, 405);
    ck_assert(has_header(&r, "Allow: GET, HEAD"));
    reply_free(&r);
    static const char del[] = "DELETE /api/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    r = http_raw(del, sizeof(del) - 1);
    ck_assert_int_eq(r.status, 405);
    reply_free(&r);

    /* malformed: a request line without a version, a bad version token, a header line
     * without a colon, a bad Content-Length, a target that is not a path, HTTP/1.1 without
     * Host, a body on GET: all 400 */
    static const char *const malformed[] = {
        "GET /metrics\r\n\r\n",
        "GET /metrics FOO/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: x\r\nno colon here\r\nConnection: close\r\n\r\n",
        "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: abc\r\nConnection: close\r\n\r\n",
        "GET metrics HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
    };
    for (size_t i = 0; i < sizeof(malformed) / sizeof(malformed[0]); i++) {
        r = http_raw(malformed[i], strlen(malformed[i]));
        ck_assert_msg(r.status == 400, "%s -> %d", malformed[i], r.status);
        reply_free(&r);
    }
    /* bytes that are not HTTP at all: MHD closes the connection without an answer */
    static const char garbage[] = "\x01\x02GARBAGE\r\n\r\n";
    r = http_raw(garbage, sizeof(garbage) - 1);
    ck_assert_msg(r.status == 400 || r.status == -1, "garbage -> %d", r.status);
    ck_assert_ptr_null(strstr(r.raw, " 200 "));
    reply_free(&r);
    static const char nohost[] = "GET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n";
    r = http_raw(nohost, sizeof(nohost) - 1);
    ck_assert_int_eq(r.status, 400);
    reply_free(&r);
    static const char body[] = "GET /metrics HTTP/1.1\r\nHost: x\r\nContent-Length: 3\r\n"
                               "Connection: close\r\n\r\nabc";
    r = http_raw(body, sizeof(body) - 1);
    ck_assert_int_eq(r.status, 400);
    reply_free(&r);

    /* oversize: a long path, many header bytes (both under MHD's pool: our 400) */
    char *big = tkv_xmalloc(64 * 1024);
    memset(big, 'a', 64 * 1024);
    char *req = tkv_xmalloc(70 * 1024);
    int n = snprintf(req, 70 * 1024, "GET /%.*s HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n",
                     2000, big);
    r = http_raw(req, (size_t)n);
    ck_assert_int_eq(r.status, 400);
    reply_free(&r);
    n = snprintf(req, 70 * 1024, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: %.*s\r\n"
                 "Connection: close\r\n\r\n", 12000, big);
    r = http_raw(req, (size_t)n);
    ck_assert_int_eq(r.status, 400);
    reply_free(&r);
    /* ...and past the per-connection memory bound MHD refuses it itself (a 4xx, never 200) */
    n = snprintf(req, 70 * 1024, "GET /metrics HTTP/1.1\r\nHost: x\r\nX-Pad: %.*s\r\n"
                 "Connection: close\r\n\r\n", 60000, big);
    r = http_raw(req, (size_t)n);
    ck_assert_msg(r.status >= 400 && r.status < 500, "huge request -> %d", r.status);
    reply_free(&r);
    free(req);
    free(big);

    /* the server still answers after all that */
    r = http_get("/api/stats");
    ck_assert_int_eq(r.status, 200);
    reply_free(&r);
}
END_TEST

START_TEST(serves_dashboard)
{
    reply r = http_get("/dashboard");
    ck_assert_int_eq(r.status, 200);
    ck_assert(has_header(&r, "Content-Type: text/html"));
    ck_assert_ptr_nonnull(strstr(r.body, "<script src=\"/dashboard/chart.min.js\">"));
    ck_assert_ptr_nonnull(strstr(r.body, "id=\"conn-status\""));
    reply_free(&r);

    /* Chart.js is the Debian file, byte for byte, embedded at build time */
    struct stat sb;
    ck_assert_int_eq(stat(TKVD_CHARTJS_PATH, &sb), 0);
    r = http_get("/dashboard/chart.min.js");
    ck_assert_int_eq(r.status, 200);
    ck_assert(has_header(&r, "Content-Type: text/javascript"));
    ck_assert_uint_eq(r.body_len, (size_t)sb.st_size);
    ck_assert_ptr_nonnull(strstr(r.body, "Chart.js v"));
    reply_free(&r);

    r = http_get("/dashboard/dashboard.js");
    ck_assert_int_eq(r.status, 200);
    ck_assert_ptr_nonnull(strstr(r.body, "/api/stats"));
    reply_free(&r);
    r = http_get("/dashboard/style.css");
    ck_assert_int_eq(r.status, 200);
    ck_assert(has_header(&r, "Content-Type: text/css"));
    reply_free(&r);
    r = http_get("/");
    ck_assert_int_eq(r.status, 302);
    ck_assert(has_header(&r, "Location: /dashboard/"));
    reply_free(&r);

    /* HEAD is GET without the body */
    static const char head[] = "HEAD /api/stats HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n";
    r = http_raw(head, sizeof(head) - 1);
    ck_assert_int_eq(r.status, 200);
    ck_assert_uint_eq(r.body_len, 0);
    reply_free(&r);
}
END_TEST

/* Many connections at once: more than the limit are turned away, none crash the server. */
START_TEST(connection_limit)
{
    int fds[kMaxConnections + 16];
    int n = 0;
    for (; n < kMaxConnections + 16; n++) {
        fds[n] = socket(AF_INET, SOCK_STREAM, 0);
        struct sockaddr_in a = {.sin_family = AF_INET, .sin_port = htons(tkvd_http_port(g_http))};
        a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
        ck_assert_int_eq(connect(fds[n], (struct sockaddr *)&a, sizeof(a)), 0);
    }
    for (int i = 0; i < n; i++)
        close(fds[i]);
    usleep(100 * 1000);
    reply r = http_get("/metrics");
    ck_assert_int_eq(r.status, 200);
    reply_free(&r);
}
END_TEST

static Suite *http_suite(void)
{
    Suite *s = suite_create("http");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, binds_loopback_by_default);
    tcase_add_test(tc, stats_match_store);
    tcase_add_test(tc, metrics_promtool_clean);
    tcase_add_test(tc, prefixes_ranked);
    tcase_add_test(tc, prefixes_after_eviction);
    tcase_add_test(tc, refuses_bad_requests);
    tcase_add_test(tc, serves_dashboard);
    tcase_add_test(tc, connection_limit);
    suite_add_tcase(s, tc);
    return s;
}

int main(void)
{
    signal(SIGPIPE, SIG_IGN);
    tkv_log_level = TKV_LOG_ERROR;
    SRunner *sr = srunner_create(http_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
