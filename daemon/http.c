/* http.c - the daemon's HTTP side: /metrics, /api/stats, /api/prefixes, /dashboard.
 *
 * libmicrohttpd with its internal polling thread: one thread serves every connection, which
 * is plenty for a handful of scrapers and browsers, and keeps the daemon's thread count fixed
 * however many connections arrive. Every handler is read-only: it snapshots the store's
 * counters (tkv_store_get_stats), the daemon's own counters (tkvd_metrics) and, for
 * /api/prefixes, the block list (tkv_store_list), renders the answer into one heap buffer and
 * hands that buffer to MHD.
 *
 * Limits (why each exists):
 *   - kMaxConnections: a scraper or browser needs one or two; a runaway client must not be able
 *     to hold every file descriptor of the daemon.
 *   - kConnMemoryBytes: MHD keeps a request's line and headers in this per-connection pool,
 *     so it bounds what one request may cost; past it MHD refuses the request itself.
 *   - kMaxUrlBytes / kMaxHeaderBytes: our own, tighter bounds, answered 400 with a reason.
 *   - no request bodies: every resource is GET; a body is a malformed request (400).
 */
#include "tkvd_http.h"

#include <arpa/inet.h>
#include <inttypes.h>
#include <math.h>
#include <microhttpd.h>
#include <netinet/in.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>

#include "tkv_base.h"

enum {
    kMaxConnections = 64,
    kConnMemoryBytes = 32 * 1024,
    kMaxUrlBytes = 1024,
    kMaxHeaderBytes = 8 * 1024,
    kConnTimeoutS = 30,
    kPrefixesDefault = 20,
    kPrefixesMax = 1000,
    kIdHexChars = 16, /* key prefixes shown as ids: 8 bytes, enough to tell chains apart */
};

/* Assets generated at build time by daemon/dashboard.cmake (Chart.js from libjs-chart.js and
 * the page sources in daemon/dashboard/), so the daemon serves its page with nothing fetched
 * at run time. */
extern const unsigned char tkvd_asset_index_html[];
extern const size_t tkvd_asset_index_html_len;
extern const unsigned char tkvd_asset_dashboard_js[];
extern const size_t tkvd_asset_dashboard_js_len;
extern const unsigned char tkvd_asset_style_css[];
extern const size_t tkvd_asset_style_css_len;
extern const unsigned char tkvd_asset_chart_js[];
extern const size_t tkvd_asset_chart_js_len;

struct tkvd_http {
    struct MHD_Daemon *mhd;
    const tkvd_http_source *src;
    uint16_t port;
};

/* ============================================================================================
 * Growable text buffer (allocation aborts on OOM, the project's single policy)
 * ========================================================================================== */

typedef struct http_buf {
    char *p;
    size_t len, cap;
} http_buf;

static void buf_reserve(http_buf *b, size_t extra)
{
    if (b->len + extra + 1 <= b->cap)
        return;
    size_t cap = b->cap ? b->cap : 4096;
    while (cap < b->len + extra + 1)
        cap *= 2;
    b->p = tkv_xrealloc(b->p, cap);
    b->cap = cap;
}

static void buf_printf(http_buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_printf(http_buf *b, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    TKV_ASSERT(n >= 0);
    buf_reserve(b, (size_t)n);
    va_start(ap, fmt);
    vsnprintf(b->p + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
}

/* JSON string with the escapes RFC 8259 requires; other bytes pass through (the sources are
 * our own configuration strings, validated as UTF-8-free identifiers upstream or not). */
static void buf_json_str(http_buf *b, const char *s)
{
    buf_printf(b, "\"");
    for (const unsigned char *c = (const unsigned char *)(s ? s : ""); *c; c++) {
        if (*c == '"' || *c == '\\')
            buf_printf(b, "\\%c", *c);
        else if (*c < 0x20 || *c == 0x7f)
            buf_printf(b, "\\u%04x", *c);
        else
            buf_printf(b, "%c", *c);
    }
    buf_printf(b, "\"");
}

/* Prometheus label value: backslash, double quote and newline escaped. */
static void buf_prom_label(http_buf *b, const char *s)
{
    for (const char *c = s ? s : ""; *c; c++) {
        if (*c == '\\' || *c == '"')
            buf_printf(b, "\\%c", *c);
        else if (*c == '\n')
            buf_printf(b, "\\n");
        else
            buf_printf(b, "%c", *c);
    }
}

/* A double that JSON accepts: NaN and infinities (which JSON lacks) become null. */
static void buf_json_num(http_buf *b, double v)
{
    if (isfinite(v))
        buf_printf(b, "%.6g", v);
    else
        buf_printf(b, "null");
}

/* ============================================================================================
 * Snapshot of every figure the handlers show
 * ========================================================================================== */

typedef struct http_snapshot {
    tkv_store_stats st;
    uint64_t block_bytes, block_tokens;
    uint64_t rpc_total, rpc_errors, rpc_lookups;
    uint64_t lat_bucket[TKVD_LAT_BUCKETS], lat_count, lat_sum_ns;
    uint64_t clients_connected, clients_total;
    double p50_us, p90_us, p99_us;
    uint64_t now_ms, start_ms;
} http_snapshot;

static const char *const kTierName[TKV_NUM_TIERS] = {"none", "l1", "l2", "l3"};

static void snapshot_take(const tkvd_http_source *src, http_snapshot *s)
{
    memset(s, 0, sizeof(*s));
    tkv_store_get_stats(src->store, &s->st);
    s->block_bytes = tkv_store_block_bytes(src->store);
    s->block_tokens = tkv_store_block_tokens(src->store);
    s->now_ms = tkv_wall_ms();
    s->start_ms = s->now_ms;
    tkvd_metrics *m = src->metrics;
    if (!m)
        return; /* a store served on its own (tests, tools): daemon counters read as zero */
    s->rpc_total = atomic_load_explicit(&m->rpc_total, memory_order_relaxed);
    s->rpc_errors = atomic_load_explicit(&m->rpc_errors, memory_order_relaxed);
    s->rpc_lookups = atomic_load_explicit(&m->lookups, memory_order_relaxed);
    for (int i = 0; i < TKVD_LAT_BUCKETS; i++) {
        s->lat_bucket[i] = atomic_load_explicit(&m->lat_bucket[i], memory_order_relaxed);
        s->lat_count += s->lat_bucket[i];
    }
    s->lat_sum_ns = atomic_load_explicit(&m->lat_sum_ns, memory_order_relaxed);
    s->clients_connected = atomic_load_explicit(&m->clients_connected, memory_order_relaxed);
    s->clients_total = atomic_load_explicit(&m->clients_total, memory_order_relaxed);
    s->p50_us = tkvd_metrics_lookup_quantile_us(m, 0.50);
    s->p90_us = tkvd_metrics_lookup_quantile_us(m, 0.90);
    s->p99_us = tkvd_metrics_lookup_quantile_us(m, 0.99);
    if (m->start_ms && m->start_ms <= s->now_ms)
        s->start_ms = m->start_ms;
}

/* The engine reports an unlimited tier (L3 without a capacity) as UINT64_MAX blocks; here
 * that is 0, which /metrics and /api/stats document as "absent or unlimited". */
static uint64_t cap_blocks(const http_snapshot *s, int t)
{
    uint64_t c = s->st.capacity_blocks_tier[t];
    return c == UINT64_MAX ? 0 : c;
}

static uint64_t cap_bytes(const http_snapshot *s, int t)
{
    uint64_t c = cap_blocks(s, t);
    if (s->block_bytes && c > UINT64_MAX / s->block_bytes)
        return 0;
    return c * s->block_bytes;
}

static double ratio(uint64_t num, uint64_t den)
{
    return den ? (double)num / (double)den : 0.0;
}

/* ============================================================================================
 * GET /metrics: Prometheus text exposition format 0.0.4, base units (seconds, bytes)
 * ========================================================================================== */

static void prom_family(http_buf *b, const char *name, const char *type, const char *help)
{
    buf_printf(b, "# HELP %s %s\n# TYPE %s %s\n", name, help, name, type);
}

static void prom_u64(http_buf *b, const char *name, const char *type, const char *help,
                     uint64_t v)
{
    prom_family(b, name, type, help);
    buf_printf(b, "%s %" PRIu64 "\n", name, v);
}

/* One family with a `tier` label over l1..l3. */
static void prom_tiers(http_buf *b, const char *name, const char *type, const char *help,
                       const uint64_t v[TKV_NUM_TIERS])
{
    prom_family(b, name, type, help);
    for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++)
        buf_printf(b, "%s{tier=\"%s\"} %" PRIu64 "\n", name, kTierName[t], v[t]);
}

static void render_metrics(const tkvd_http_source *src, const http_snapshot *s, http_buf *b)
{
    const tkv_store_stats *st = &s->st;
    uint64_t tmp[TKV_NUM_TIERS];

    prom_family(b, "tierkv_build_info", "gauge",
                "Version, eviction policy and model of this daemon (value is always 1).");
    buf_printf(b, "tierkv_build_info{version=\"");
    buf_prom_label(b, src->version);
    buf_printf(b, "\",policy=\"");
    buf_prom_label(b, src->policy_name);
    buf_printf(b, "\",model=\"");
    buf_prom_label(b, src->geometry ? src->geometry->model_id : "");
    buf_printf(b, "\",block_tokens=\"%" PRIu64 "\"} 1\n", s->block_tokens);
    prom_family(b, "tierkv_start_time_seconds", "gauge",
                "Start time of the daemon since the Unix epoch.");
    buf_printf(b, "tierkv_start_time_seconds %.3f\n", (double)s->start_ms / 1000.0);
    prom_u64(b, "tierkv_block_bytes", "gauge", "Bytes of one KV block (all layers, K and V).",
             s->block_bytes);

    /* ---- lookups and hits ---- */
    prom_u64(b, "tierkv_lookups_total", "counter", "Prefix lookups served by the cache engine.",
             st->lookups);
    prom_u64(b, "tierkv_lookup_blocks_total", "counter",
             "Full blocks asked about by lookups (hits plus misses).", st->lookup_keys);
    prom_tiers(b, "tierkv_lookup_hit_blocks_total", "counter",
               "Blocks found by lookups, by the fastest tier that held them.",
               st->hit_blocks_tier);
    for (int t = 0; t < TKV_NUM_TIERS; t++)
        tmp[t] = st->hit_blocks_tier[t] * s->block_tokens;
    prom_tiers(b, "tierkv_lookup_hit_tokens_total", "counter",
               "Prompt tokens covered by hit blocks (prefill saved), by tier.", tmp);
    prom_u64(b, "tierkv_lookup_miss_blocks_total", "counter",
             "Full blocks asked about by lookups that were not cached.", st->miss_blocks);

    /* ---- residency ---- */
    prom_tiers(b, "tierkv_tier_blocks", "gauge", "Blocks resident in each tier.", st->blocks_tier);
    prom_tiers(b, "tierkv_tier_bytes", "gauge", "Bytes resident in each tier.", st->bytes_tier);
    for (int t = 0; t < TKV_NUM_TIERS; t++)
        tmp[t] = cap_blocks(s, t);
    prom_tiers(b, "tierkv_tier_capacity_blocks", "gauge",
               "Capacity of each tier in blocks (0: tier absent or unlimited).", tmp);
    for (int t = 0; t < TKV_NUM_TIERS; t++)
        tmp[t] = cap_bytes(s, t);
    prom_tiers(b, "tierkv_tier_capacity_bytes", "gauge",
               "Capacity of each tier in bytes (0: tier absent or unlimited).", tmp);

    /* ---- movement between tiers ---- */
    prom_u64(b, "tierkv_promotions_total", "counter", "Blocks promoted to a faster tier.",
             st->promotions);
    prom_u64(b, "tierkv_promotion_bytes_total", "counter", "Bytes promoted to a faster tier.",
             st->promotion_bytes);
    prom_u64(b, "tierkv_demotions_total", "counter", "Blocks demoted to a slower tier.",
             st->demotions);
    prom_u64(b, "tierkv_demotion_bytes_total", "counter", "Bytes demoted to a slower tier.",
             st->demotion_bytes);
    prom_u64(b, "tierkv_evictions_total", "counter", "Blocks evicted from a tier.",
             st->evictions);
    prom_u64(b, "tierkv_writeback_queue_blocks", "gauge", "Blocks waiting to be written down.",
             st->writeback_queue);

    /* ---- faults ---- */
    prom_u64(b, "tierkv_checksum_failures_total", "counter",
             "Blocks dropped because their payload failed its checksum.", st->checksum_failures);
    prom_u64(b, "tierkv_io_errors_total", "counter", "I/O errors reported by the local store.",
             st->io_errors);
    prom_u64(b, "tierkv_l3_readonly", "gauge",
             "1 when the local store turned read-only after write errors.",
             st->l3_readonly ? 1 : 0);

    /* ---- data path ---- */
    prom_u64(b, "tierkv_puts_total", "counter", "Put operations.", st->puts);
    prom_u64(b, "tierkv_put_blocks_total", "counter", "Blocks offered by put operations.",
             st->put_blocks);
    prom_u64(b, "tierkv_put_duplicate_blocks_total", "counter",
             "Blocks offered by put that were already cached (dropped).", st->put_dup_blocks);
    prom_u64(b, "tierkv_put_rejected_blocks_total", "counter",
             "Blocks offered by put that the policy did not admit.", st->put_rejected_blocks);
    prom_u64(b, "tierkv_gets_total", "counter", "By-value get operations.", st->gets);
    prom_u64(b, "tierkv_get_bytes_total", "counter", "Bytes returned by by-value gets.",
             st->get_bytes);
    prom_u64(b, "tierkv_leases_active", "gauge", "Leases pinning blocks now.", st->leases_active);
    prom_u64(b, "tierkv_leases_expired_total", "counter",
             "Leases that ended because their time-to-live passed.", st->leases_expired);
    prom_u64(b, "tierkv_allocations_active", "gauge",
             "Zero-copy write allocations not yet committed or aborted.", st->allocs_active);

    /* ---- the daemon ---- */
    prom_u64(b, "tierkv_rpcs_total", "counter", "RPCs answered.", s->rpc_total);
    prom_u64(b, "tierkv_rpc_errors_total", "counter", "RPCs answered with a non-OK status.",
             s->rpc_errors);
    prom_u64(b, "tierkv_clients_connected", "gauge", "Attach-socket connections open now.",
             s->clients_connected);
    prom_u64(b, "tierkv_clients_total", "counter", "Attach-socket connections accepted.",
             s->clients_total);

    if (tkvd_tenants_enabled(src->tenants)) {
        const tkvd_tenants *ts = src->tenants;
        prom_family(b, "tierkv_tenant_rpcs_total", "counter", "RPCs admitted, per tenant.");
        for (size_t i = 0; i < ts->n; i++)
            buf_printf(b, "tierkv_tenant_rpcs_total{tenant=\"%s\"} %" PRIu64 "\n", ts->v[i]->name,
                       atomic_load_explicit(&src->metrics->tenant_rpcs[i + 1], memory_order_relaxed));
        prom_family(b, "tierkv_tenant_denied_total", "counter",
                    "Calls and attaches refused for tenant reasons (forged namespace, another "
                    "tenant's id, no tenant), per tenant; \"\" = callers that are no tenant.");
        buf_printf(b, "tierkv_tenant_denied_total{tenant=\"\"} %" PRIu64 "\n",
                   atomic_load_explicit(&src->metrics->tenant_denied[0], memory_order_relaxed));
        for (size_t i = 0; i < ts->n; i++)
            buf_printf(b, "tierkv_tenant_denied_total{tenant=\"%s\"} %" PRIu64 "\n", ts->v[i]->name,
                       atomic_load_explicit(&src->metrics->tenant_denied[i + 1], memory_order_relaxed));

        /* Blocks held and quota figures, from the store's per-tenant accounting. */
        tkv_store_tenant_stats *tst = tkv_xcalloc(ts->n ? ts->n : 1, sizeof(*tst));
        for (size_t i = 0; i < ts->n; i++)
            tkv_store_get_tenant_stats(src->store, tkvd_tenant_store_id(ts->v[i]), &tst[i]);
        static const char *const tier_name[TKV_NUM_TIERS] = {"", "l1", "l2", "l3"};
        prom_family(b, "tierkv_tenant_blocks", "gauge", "Blocks held, per tenant and tier (l4: "
                    "blocks this daemon put into L4 for it).");
        for (size_t i = 0; i < ts->n; i++) {
            for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++)
                buf_printf(b, "tierkv_tenant_blocks{tenant=\"%s\",tier=\"%s\"} %" PRIu64 "\n",
                           ts->v[i]->name, tier_name[t], tst[i].blocks_tier[t]);
            buf_printf(b, "tierkv_tenant_blocks{tenant=\"%s\",tier=\"l4\"} %" PRIu64 "\n",
                       ts->v[i]->name, tst[i].l4_blocks);
        }
        prom_family(b, "tierkv_tenant_quota_blocks", "gauge",
                    "Configured quota per tenant and tier (0 = no limit).");
        for (size_t i = 0; i < ts->n; i++) {
            for (int t = TKV_TIER_L1; t <= TKV_TIER_L3; t++)
                buf_printf(b, "tierkv_tenant_quota_blocks{tenant=\"%s\",tier=\"%s\"} %" PRIu64
                           "\n", ts->v[i]->name, tier_name[t], tst[i].max_blocks_tier[t]);
            buf_printf(b, "tierkv_tenant_quota_blocks{tenant=\"%s\",tier=\"l4\"} %" PRIu64 "\n",
                       ts->v[i]->name, tst[i].max_l4_blocks);
        }
        prom_family(b, "tierkv_tenant_refused_tier_blocks_total", "counter",
                    "Blocks refused for a tenant's quota or others' shares, per tier.");
        for (size_t i = 0; i < ts->n; i++) {
            for (int t = TKV_TIER_L1; t <= TKV_TIER_L3; t++)
                buf_printf(b, "tierkv_tenant_refused_tier_blocks_total{tenant=\"%s\",tier=\"%s\"} %"
                           PRIu64 "\n", ts->v[i]->name, tier_name[t],
                           tst[i].refused_blocks_tier[t]);
            buf_printf(b, "tierkv_tenant_refused_tier_blocks_total{tenant=\"%s\",tier=\"l4\"} %"
                       PRIu64 "\n", ts->v[i]->name, tst[i].refused_l4_blocks);
        }
        prom_family(b, "tierkv_tenant_guaranteed_blocks", "gauge",
                    "Guaranteed share per tenant and tier (0 = none).");
        for (size_t i = 0; i < ts->n; i++)
            for (int t = TKV_TIER_L1; t <= TKV_TIER_L3; t++)
                buf_printf(b, "tierkv_tenant_guaranteed_blocks{tenant=\"%s\",tier=\"%s\"} %"
                           PRIu64 "\n", ts->v[i]->name, tier_name[t],
                           tst[i].guaranteed_blocks_tier[t]);
        prom_family(b, "tierkv_tenant_refused_blocks_total", "counter",
                    "Blocks a tenant's put, alloc, promotion, write-back to L3 or write to L4 "
                    "could not store within its quota.");
        for (size_t i = 0; i < ts->n; i++)
            buf_printf(b, "tierkv_tenant_refused_blocks_total{tenant=\"%s\"} %" PRIu64 "\n",
                       ts->v[i]->name, tst[i].refused_blocks);
        prom_family(b, "tierkv_tenant_own_evictions_total", "counter",
                    "Own blocks a tenant evicted to stay within its quota or L2 region.");
        for (size_t i = 0; i < ts->n; i++)
            buf_printf(b, "tierkv_tenant_own_evictions_total{tenant=\"%s\"} %" PRIu64 "\n",
                       ts->v[i]->name, tst[i].own_evictions);
        prom_family(b, "tierkv_tenant_guarded_skips_total", "counter",
                    "Times a tenant's block was spared eviction by its guaranteed share.");
        for (size_t i = 0; i < ts->n; i++)
            buf_printf(b, "tierkv_tenant_guarded_skips_total{tenant=\"%s\"} %" PRIu64 "\n",
                       ts->v[i]->name, tst[i].guarded_skips);
        free(tst);
    }

    prom_family(b, "tierkv_lookup_duration_seconds", "histogram",
                "Lookup RPC latency, from request to answer.");
    uint64_t cum = 0;
    for (int i = 0; i < TKVD_LAT_BUCKETS; i++) {
        cum += s->lat_bucket[i];
        if (isinf(tkvd_latency_bounds_us[i]))
            buf_printf(b, "tierkv_lookup_duration_seconds_bucket{le=\"+Inf\"} %" PRIu64 "\n", cum);
        else
            buf_printf(b, "tierkv_lookup_duration_seconds_bucket{le=\"%.9g\"} %" PRIu64 "\n",
                       tkvd_latency_bounds_us[i] / 1e6, cum);
    }
    buf_printf(b, "tierkv_lookup_duration_seconds_sum %.9g\n", (double)s->lat_sum_ns / 1e9);
    buf_printf(b, "tierkv_lookup_duration_seconds_count %" PRIu64 "\n", cum);
    if (src->l4) {
        char l4text[8192];
        tkvd_metrics_l4_prom(src->l4, l4text, sizeof(l4text));
        buf_printf(b, "%s", l4text);
    }
}

/* ============================================================================================
 * GET /api/stats: the same figures as JSON, plus derived ones
 * ========================================================================================== */

static const char *dtype_name(uint32_t d)
{
    return d == TKV_DTYPE_BF16 ? "bf16" : "fp8_e4m3";
}

static const char *io_mode_name(int m)
{
    switch (m) {
    case 1: return "io_uring";
    case 2: return "psync";
    default: return "off";
    }
}

#define JU64(name, v) buf_printf(b, "\"%s\":%" PRIu64 ",", name, (uint64_t)(v))

static void render_stats(const tkvd_http_source *src, const http_snapshot *s, http_buf *b)
{
    const tkv_store_stats *st = &s->st;
    uint64_t hit_blocks = 0;
    for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++)
        hit_blocks += st->hit_blocks_tier[t];
    /* The engine's own total is the truth when it keeps one; the per-tier sum is the fallback. */
    if (st->hit_blocks)
        hit_blocks = st->hit_blocks;

    buf_printf(b, "{\"version\":");
    buf_json_str(b, src->version);
    buf_printf(b, ",\"policy\":");
    buf_json_str(b, src->policy_name);
    buf_printf(b, ",");
    JU64("now_ms", s->now_ms);
    JU64("start_ms", s->start_ms);
    JU64("uptime_s", (s->now_ms - s->start_ms) / 1000);

    buf_printf(b, "\"geometry\":{");
    if (src->geometry) {
        const tkv_geometry *g = src->geometry;
        JU64("num_layers", g->num_layers);
        JU64("num_kv_heads", g->num_kv_heads);
        JU64("head_dim", g->head_dim);
        buf_printf(b, "\"dtype\":\"%s\",\"scale_mode\":\"%s\",\"model_id\":", dtype_name(g->dtype),
                   g->scale_mode == TKV_SCALE_PER_TOKEN_HEAD ? "per_token_head" : "per_tensor");
        buf_json_str(b, g->model_id);
        buf_printf(b, ",");
    }
    JU64("block_tokens", s->block_tokens);
    buf_printf(b, "\"block_bytes\":%" PRIu64 "},", s->block_bytes);

    JU64("lookups", st->lookups);
    JU64("lookup_blocks", st->lookup_keys);
    JU64("hit_blocks", hit_blocks);
    JU64("miss_blocks", st->miss_blocks);
    buf_printf(b, "\"hit_rate\":");
    buf_json_num(b, ratio(hit_blocks, st->lookup_keys));
    buf_printf(b, ",");
    JU64("query_tokens", st->lookup_keys * s->block_tokens);
    JU64("prefill_tokens_saved", hit_blocks * s->block_tokens);

    buf_printf(b, "\"tiers\":[");
    for (int t = TKV_TIER_L1; t < TKV_NUM_TIERS; t++) {
        buf_printf(b, "%s{\"tier\":\"%s\",", t == TKV_TIER_L1 ? "" : ",", kTierName[t]);
        JU64("hit_blocks", st->hit_blocks_tier[t]);
        JU64("hit_tokens", st->hit_blocks_tier[t] * s->block_tokens);
        buf_printf(b, "\"hit_rate\":");
        buf_json_num(b, ratio(st->hit_blocks_tier[t], st->lookup_keys));
        buf_printf(b, ",");
        JU64("blocks", st->blocks_tier[t]);
        JU64("bytes", st->bytes_tier[t]);
        JU64("capacity_blocks", cap_blocks(s, t));
        JU64("capacity_bytes", cap_bytes(s, t));
        buf_printf(b, "\"unlimited\":%s,\"occupancy\":",
                   st->capacity_blocks_tier[t] == UINT64_MAX ? "true" : "false");
        buf_json_num(b, ratio(st->blocks_tier[t], cap_blocks(s, t)));
        buf_printf(b, "}");
    }
    buf_printf(b, "],");

    JU64("promotions", st->promotions);
    JU64("promotion_bytes", st->promotion_bytes);
    JU64("demotions", st->demotions);
    JU64("demotion_bytes", st->demotion_bytes);
    JU64("evictions", st->evictions);
    JU64("writeback_queue", st->writeback_queue);
    JU64("checksum_failures", st->checksum_failures);
    JU64("io_errors", st->io_errors);
    buf_printf(b, "\"l3_readonly\":%s,\"l3_io_mode\":\"%s\",", st->l3_readonly ? "true" : "false",
               io_mode_name(st->l3_io_mode));
    JU64("puts", st->puts);
    JU64("put_blocks", st->put_blocks);
    JU64("put_duplicate_blocks", st->put_dup_blocks);
    JU64("put_rejected_blocks", st->put_rejected_blocks);
    JU64("gets", st->gets);
    JU64("get_bytes", st->get_bytes);
    {
        char l4json[1024];
        tkvd_metrics_l4_json(src->l4, l4json, sizeof(l4json));
        buf_printf(b, "%s,", l4json);
    }
    JU64("leases_active", st->leases_active);
    JU64("leases_expired", st->leases_expired);
    JU64("allocations_active", st->allocs_active);
    JU64("rpcs", s->rpc_total);
    JU64("rpc_errors", s->rpc_errors);
    JU64("clients_connected", s->clients_connected);
    JU64("clients_total", s->clients_total);

    buf_printf(b, "\"lookup_latency_us\":{");
    JU64("count", s->lat_count);
    buf_printf(b, "\"mean\":");
    buf_json_num(b, s->lat_count ? (double)s->lat_sum_ns / 1e3 / (double)s->lat_count : 0.0);
    buf_printf(b, ",\"p50\":");
    buf_json_num(b, s->p50_us);
    buf_printf(b, ",\"p90\":");
    buf_json_num(b, s->p90_us);
    buf_printf(b, ",\"p99\":");
    buf_json_num(b, s->p99_us);
    buf_printf(b, ",\"buckets\":[");
    for (int i = 0; i < TKVD_LAT_BUCKETS; i++) {
        buf_printf(b, "%s{\"le\":", i ? "," : "");
        buf_json_num(b, tkvd_latency_bounds_us[i]); /* +Inf -> null */
        buf_printf(b, ",\"count\":%" PRIu64 "}", s->lat_bucket[i]);
    }
    buf_printf(b, "]}}\n");
}

/* ============================================================================================
 * GET /api/prefixes?top=N[&by=tokens_saved|hits]: the hottest cached prefixes
 *
 * The block list is a forest: each block names its parent key, and a block's `hits` counts the
 * lookups that reached it (a lookup that reaches a block has reached all its ancestors). A
 * "prefix" here is the path from the first block of a chain to a block X where reuse changes:
 *   - a tip (no cached child): a whole cached prompt prefix;
 *   - a branch point (2+ cached children): a prefix shared by several prompts (a system prompt,
 *     a conversation's earlier turns);
 *   - a hit boundary (its only child was reached by fewer lookups).
 * Blocks in the middle of a non-branching run with the same hits add nothing a reader needs.
 * Per prefix:
 *   depth, tokens  X's position + 1, in blocks and tokens (the prompt prefix length)
 *   blocks         cached blocks on the path (< depth when an ancestor was evicted)
 *   hits           lookups that reused at least this whole prefix (X's hits)
 *   tokens_saved   hits x tokens: the prefill those lookups skipped thanks to this prefix
 * Ranked by tokens_saved (or hits). Ids are hex prefixes of keys; tokens are never shown (the
 * keys are one-way hashes). Cost: O(blocks) time and memory per request.
 * ========================================================================================== */

typedef struct prefix_node {
    tkv_block_info b;
    int64_t parent;          /* index in the node array, -1 when not cached */
    int64_t root;            /* first cached block of its path */
    uint32_t children;       /* cached READY children */
    uint32_t path_blocks, path_l2, path_l3, path_pinned; /* over root..this block */
    uint64_t max_child_hits;
    uint64_t path_last_ms;
    bool done;               /* path_* computed */
} prefix_node;

typedef struct prefix_list {
    prefix_node *nodes;
    size_t num, cap;
} prefix_list;

typedef struct prefix_row {
    int64_t node;
    uint32_t depth;
    uint64_t hits, tokens_saved;
} prefix_row;

static int prefix_collect(void *arg, const tkv_block_info *b)
{
    prefix_list *l = arg;
    if (b->state != TKV_BLOCK_READY)
        return 0; /* WRITING/EVICTING blocks are not visible to lookups, so not cached prefixes */
    if (l->num == l->cap) {
        l->cap = l->cap ? 2 * l->cap : 256;
        l->nodes = tkv_xrealloc(l->nodes, l->cap * sizeof(*l->nodes));
    }
    memset(&l->nodes[l->num], 0, sizeof(l->nodes[0]));
    l->nodes[l->num].b = *b;
    l->nodes[l->num].parent = -1;
    l->num++;
    return 0;
}

static uint64_t key_hash(const tkv_key *k)
{
    uint64_t h;
    memcpy(&h, k->b, sizeof(h)); /* SHA-256 output: any 8 bytes are uniformly spread */
    return h;
}

/* Links every node to its cached parent through an open-addressing table keyed by key. */
static void prefix_link(prefix_list *l)
{
    size_t nslots = 16;
    while (nslots < 2 * l->num)
        nslots *= 2;
    int64_t *slot = tkv_xmalloc(nslots * sizeof(*slot));
    for (size_t i = 0; i < nslots; i++)
        slot[i] = -1;
    for (size_t i = 0; i < l->num; i++) {
        size_t h = key_hash(&l->nodes[i].b.key) & (nslots - 1);
        while (slot[h] >= 0)
            h = (h + 1) & (nslots - 1);
        slot[h] = (int64_t)i;
    }
    for (size_t i = 0; i < l->num; i++) {
        const tkv_key *pk = &l->nodes[i].b.parent;
        size_t h = key_hash(pk) & (nslots - 1);
        while (slot[h] >= 0) {
            int64_t j = slot[h];
            if ((size_t)j != i && memcmp(l->nodes[j].b.key.b, pk->b, TKV_KEY_BYTES) == 0) {
                prefix_node *p = &l->nodes[j];
                l->nodes[i].parent = j;
                p->children++;
                if (l->nodes[i].b.hits > p->max_child_hits)
                    p->max_child_hits = l->nodes[i].b.hits;
                break;
            }
            h = (h + 1) & (nslots - 1);
        }
    }
    free(slot);
}

/* Fills path_* of node i and of its ancestors that lack them: walk up to the first done
 * ancestor, then down again, so every node is computed once (O(n) over all calls). The walk
 * is bounded by n: SHA-256 chains cannot form a parent cycle, a damaged index might. */
static void prefix_path(prefix_list *l, int64_t i, int64_t *stack)
{
    size_t depth = 0;
    int64_t j = i;
    while (j >= 0 && !l->nodes[j].done && depth < l->num) {
        stack[depth++] = j;
        l->nodes[j].done = true; /* claimed: a cycle ends the walk here */
        j = l->nodes[j].parent;
    }
    const prefix_node *up = j >= 0 ? &l->nodes[j] : NULL;
    while (depth > 0) {
        prefix_node *n = &l->nodes[stack[--depth]];
        const tkv_block_info *b = &n->b;
        n->path_blocks = (up ? up->path_blocks : 0) + 1;
        n->path_l2 = (up ? up->path_l2 : 0) + (b->in_l2 ? 1 : 0);
        n->path_l3 = (up ? up->path_l3 : 0) + (b->in_l3 ? 1 : 0);
        n->path_pinned = (up ? up->path_pinned : 0) + (b->pins ? 1 : 0);
        n->path_last_ms = up && up->path_last_ms > b->last_access_ms ? up->path_last_ms
                                                                     : b->last_access_ms;
        n->root = up ? up->root : stack[depth];
        up = n;
    }
}

static int prefix_cmp(const void *pa, const void *pb, void *arg)
{
    const prefix_row *a = pa, *b = pb;
    bool rank_by_hits = *(const bool *)arg;
    uint64_t ka = rank_by_hits ? a->hits : a->tokens_saved;
    uint64_t kb = rank_by_hits ? b->hits : b->tokens_saved;
    if (ka != kb)
        return ka > kb ? -1 : 1;
    uint64_t sa = rank_by_hits ? a->tokens_saved : a->hits;
    uint64_t sb = rank_by_hits ? b->tokens_saved : b->hits;
    if (sa != sb)
        return sa > sb ? -1 : 1;
    if (a->depth != b->depth)
        return a->depth > b->depth ? -1 : 1;
    return a->node < b->node ? -1 : (a->node > b->node);
}

static void hex_id(const tkv_key *k, char out[kIdHexChars + 1])
{
    static const char digits[] = "0123456789abcdef";
    for (int i = 0; i < kIdHexChars / 2; i++) {
        out[2 * i] = digits[k->b[i] >> 4];
        out[2 * i + 1] = digits[k->b[i] & 15];
    }
    out[kIdHexChars] = '\0';
}

/* Builds the prefixes and renders the top `top` of them. TKV_OK or the store's error. */
static int render_prefixes(const tkvd_http_source *src, unsigned top, bool by_hits, http_buf *b)
{
    prefix_list l = {0};
    prefix_row *rows = NULL;
    int64_t *stack = NULL;
    size_t num_rows = 0, num_tips = 0;
    uint64_t block_tokens = tkv_store_block_tokens(src->store);
    int rc = tkv_store_list(src->store, prefix_collect, &l);
    if (rc != TKV_OK)
        goto fail;
    prefix_link(&l);

    size_t n = l.num ? l.num : 1;
    rows = tkv_xmalloc(n * sizeof(*rows));
    stack = tkv_xmalloc(n * sizeof(*stack));
    for (size_t i = 0; i < l.num; i++) {
        prefix_node *x = &l.nodes[i];
        num_tips += x->children == 0;
        if (x->children == 1 && x->max_child_hits >= x->b.hits)
            continue; /* inside a run: the same lookups reach its child */
        prefix_path(&l, (int64_t)i, stack);
        prefix_row *r = &rows[num_rows++];
        r->node = (int64_t)i;
        /* depth is "best known" in the store; the cached path is a lower bound */
        r->depth = x->b.depth + 1 > x->path_blocks ? x->b.depth + 1 : x->path_blocks;
        r->hits = x->b.hits;
        r->tokens_saved = x->b.hits * r->depth * block_tokens;
    }
    qsort_r(rows, num_rows, sizeof(*rows), prefix_cmp, &by_hits);

    buf_printf(b, "{\"top\":%u,\"by\":\"%s\",\"block_tokens\":%" PRIu64 ",\"num_blocks\":%zu,"
               "\"num_tips\":%zu,\"num_prefixes\":%zu,\"prefixes\":[", top,
               by_hits ? "hits" : "tokens_saved", block_tokens, l.num, num_tips, num_rows);
    for (size_t i = 0; i < num_rows && i < top; i++) {
        const prefix_row *r = &rows[i];
        const prefix_node *x = &l.nodes[r->node];
        char id[kIdHexChars + 1], root[kIdHexChars + 1];
        hex_id(&x->b.key, id);
        hex_id(&l.nodes[x->root].b.key, root);
        const char *kind = x->children == 0 ? "tip" : x->children > 1 ? "branch" : "boundary";
        const char *tier = x->path_l2 == x->path_blocks ? "l2"
                         : x->path_l3 == x->path_blocks ? "l3" : "mixed";
        buf_printf(b, "%s{\"id\":\"%s\",\"root\":\"%s\",\"kind\":\"%s\",\"children\":%u,"
                   "\"depth\":%u,\"tokens\":%" PRIu64 ",\"blocks\":%u,\"hits\":%" PRIu64
                   ",\"root_hits\":%" PRIu64 ",\"tokens_saved\":%" PRIu64 ",\"in_l2\":%u,"
                   "\"in_l3\":%u,\"pinned\":%u,\"tier\":\"%s\",\"last_access_ms\":%" PRIu64 "}",
                   i ? "," : "", id, root, kind, x->children, r->depth,
                   (uint64_t)r->depth * block_tokens, x->path_blocks, r->hits,
                   l.nodes[x->root].b.hits, r->tokens_saved, x->path_l2, x->path_l3,
                   x->path_pinned, tier, x->path_last_ms);
    }
    buf_printf(b, "]}\n");
fail:
    free(stack);
    free(rows);
    free(l.nodes);
    return rc;
}

/* ============================================================================================
 * Request handling
 * ========================================================================================== */

static enum MHD_Result http_reply(struct MHD_Connection *conn, unsigned status,
                                  const char *type, void *body, size_t len,
                                  enum MHD_ResponseMemoryMode mode)
{
    struct MHD_Response *r = MHD_create_response_from_buffer(len, body, mode);
    if (!r) {
        if (mode == MHD_RESPMEM_MUST_FREE)
            free(body);
        return MHD_NO;
    }
    MHD_add_response_header(r, MHD_HTTP_HEADER_CONTENT_TYPE, type);
    MHD_add_response_header(r, "X-Content-Type-Options", "nosniff");
    /* The page loads only its own script and style, all served from here. */
    MHD_add_response_header(r, "Content-Security-Policy",
                            "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'");
    MHD_add_response_header(r, MHD_HTTP_HEADER_CACHE_CONTROL, "no-store");
    if (status == MHD_HTTP_METHOD_NOT_ALLOWED)
        MHD_add_response_header(r, MHD_HTTP_HEADER_ALLOW, "GET, HEAD");
    enum MHD_Result ret = MHD_queue_response(conn, status, r);
    MHD_destroy_response(r);
    return ret;
}

static enum MHD_Result http_error(struct MHD_Connection *conn, unsigned status,
                                  const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static enum MHD_Result http_error(struct MHD_Connection *conn, unsigned status,
                                  const char *fmt, ...)
{
    char msg[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof(msg) - 1, fmt, ap);
    va_end(ap);
    if (n < 0)
        n = 0;
    if ((size_t)n > sizeof(msg) - 2)
        n = (int)sizeof(msg) - 2;
    msg[n++] = '\n';
    msg[n] = '\0';
    return http_reply(conn, status, "text/plain; charset=utf-8", tkv_xstrdup(msg), (size_t)n,
                      MHD_RESPMEM_MUST_FREE);
}

static enum MHD_Result reply_buf(struct MHD_Connection *conn, const char *type, http_buf *b)
{
    if (!b->p)
        buf_reserve(b, 0);
    return http_reply(conn, MHD_HTTP_OK, type, b->p, b->len, MHD_RESPMEM_MUST_FREE);
}

typedef struct header_tally {
    size_t bytes;
} header_tally;

static enum MHD_Result tally_header(void *cls, enum MHD_ValueKind kind, const char *key,
                                    const char *value)
{
    header_tally *t = cls;
    t->bytes += strlen(key) + (value ? strlen(value) : 0) + 4;
    return MHD_YES;
}

typedef struct query_check {
    const char *allowed[4];
    const char *bad; /* first argument not in allowed */
    unsigned count;
} query_check;

static enum MHD_Result check_arg(void *cls, enum MHD_ValueKind kind, const char *key,
                                 const char *value)
{
    query_check *q = cls;
    q->count++;
    for (int i = 0; i < 4 && q->allowed[i]; i++)
        if (strcmp(key, q->allowed[i]) == 0)
            return MHD_YES;
    if (!q->bad)
        q->bad = key;
    return MHD_YES;
}

/* Strict decimal in [lo, hi]: no sign, no spaces, no trailing bytes. */
static bool parse_uint(const char *s, unsigned lo, unsigned hi, unsigned *out)
{
    if (!s || !*s || strlen(s) > 9)
        return false;
    unsigned v = 0;
    for (const char *c = s; *c; c++) {
        if (*c < '0' || *c > '9')
            return false;
        v = v * 10 + (unsigned)(*c - '0');
    }
    if (v < lo || v > hi)
        return false;
    *out = v;
    return true;
}

static enum MHD_Result serve_asset(struct MHD_Connection *conn, const char *type,
                                   const unsigned char *data, size_t len)
{
    return http_reply(conn, MHD_HTTP_OK, type, (void *)data, len, MHD_RESPMEM_PERSISTENT);
}

static enum MHD_Result http_handle(void *cls, struct MHD_Connection *conn, const char *url,
                                   const char *method, const char *version,
                                   const char *upload_data, size_t *upload_data_size,
                                   void **con_cls)
{
    tkvd_http *h = cls;
    /* MHD calls once when the headers are in, then again for each body chunk; answering on the
     * first call means a body is never read (the connection is closed after the reply). */
    if (*upload_data_size != 0) {
        *upload_data_size = 0;
        return MHD_YES; /* already answered on the first call */
    }
    (void)con_cls;

    if (strcmp(method, MHD_HTTP_METHOD_GET) != 0 && strcmp(method, MHD_HTTP_METHOD_HEAD) != 0)
        return http_error(conn, MHD_HTTP_METHOD_NOT_ALLOWED, "method %.32s not allowed: use GET",
                          method);
    /* RFC 9112 section 3.2: a server MUST answer 400 to an HTTP/1.1 request without Host. */
    if (strcmp(version, MHD_HTTP_VERSION_1_1) == 0 &&
        !MHD_lookup_connection_value(conn, MHD_HEADER_KIND, MHD_HTTP_HEADER_HOST))
        return http_error(conn, MHD_HTTP_BAD_REQUEST, "HTTP/1.1 request without a Host header");
    if (url[0] != '/')
        return http_error(conn, MHD_HTTP_BAD_REQUEST, "request target must be a path ('/...')");
    if (strlen(url) > kMaxUrlBytes)
        return http_error(conn, MHD_HTTP_BAD_REQUEST, "request path longer than %d bytes",
                          kMaxUrlBytes);
    header_tally tally = {0};
    MHD_get_connection_values(conn, MHD_HEADER_KIND, tally_header, &tally);
    if (tally.bytes > kMaxHeaderBytes)
        return http_error(conn, MHD_HTTP_BAD_REQUEST, "request headers larger than %d bytes",
                          kMaxHeaderBytes);
    const char *clen = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                                   MHD_HTTP_HEADER_CONTENT_LENGTH);
    const char *te = MHD_lookup_connection_value(conn, MHD_HEADER_KIND,
                                                 MHD_HTTP_HEADER_TRANSFER_ENCODING);
    if ((clen && strcmp(clen, "0") != 0) || te)
        return http_error(conn, MHD_HTTP_BAD_REQUEST, "GET requests carry no body");

    query_check q = {.allowed = {NULL}};
    if (strcmp(url, "/api/prefixes") == 0) {
        q.allowed[0] = "top";
        q.allowed[1] = "by";
    }
    MHD_get_connection_values(conn, MHD_GET_ARGUMENT_KIND, check_arg, &q);
    if (q.bad)
        return http_error(conn, MHD_HTTP_BAD_REQUEST, "unknown query parameter '%.64s' for %.64s",
                          q.bad, url);

    const tkvd_http_source *src = h->src;
    http_buf b = {0};
    if (strcmp(url, "/metrics") == 0) {
        http_snapshot s;
        snapshot_take(src, &s);
        render_metrics(src, &s, &b);
        return reply_buf(conn, "text/plain; version=0.0.4; charset=utf-8", &b);
    }
    if (strcmp(url, "/api/stats") == 0) {
        http_snapshot s;
        snapshot_take(src, &s);
        render_stats(src, &s, &b);
        return reply_buf(conn, "application/json", &b);
    }
    if (strcmp(url, "/api/prefixes") == 0) {
        unsigned top = kPrefixesDefault;
        const char *v = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "top");
        if (v && !parse_uint(v, 1, kPrefixesMax, &top))
            return http_error(conn, MHD_HTTP_BAD_REQUEST,
                              "top must be an integer in 1..%d, got '%.32s'", kPrefixesMax, v);
        const char *by = MHD_lookup_connection_value(conn, MHD_GET_ARGUMENT_KIND, "by");
        if (by && strcmp(by, "hits") != 0 && strcmp(by, "tokens_saved") != 0)
            return http_error(conn, MHD_HTTP_BAD_REQUEST,
                              "by must be 'hits' or 'tokens_saved', got '%.32s'", by);
        int rc = render_prefixes(src, top, by && strcmp(by, "hits") == 0, &b);
        if (rc != TKV_OK) {
            free(b.p);
            return http_error(conn, MHD_HTTP_SERVICE_UNAVAILABLE, "cannot list blocks: %s",
                              tkv_strerror(rc));
        }
        return reply_buf(conn, "application/json", &b);
    }
    if (strcmp(url, "/") == 0) {
        struct MHD_Response *r = MHD_create_response_from_buffer(0, NULL, MHD_RESPMEM_PERSISTENT);
        if (!r)
            return MHD_NO;
        MHD_add_response_header(r, MHD_HTTP_HEADER_LOCATION, "/dashboard/");
        enum MHD_Result ret = MHD_queue_response(conn, MHD_HTTP_FOUND, r);
        MHD_destroy_response(r);
        return ret;
    }
    if (strcmp(url, "/dashboard") == 0 || strcmp(url, "/dashboard/") == 0 ||
        strcmp(url, "/dashboard/index.html") == 0)
        return serve_asset(conn, "text/html; charset=utf-8", tkvd_asset_index_html,
                           tkvd_asset_index_html_len);
    if (strcmp(url, "/dashboard/dashboard.js") == 0)
        return serve_asset(conn, "text/javascript; charset=utf-8", tkvd_asset_dashboard_js,
                           tkvd_asset_dashboard_js_len);
    if (strcmp(url, "/dashboard/style.css") == 0)
        return serve_asset(conn, "text/css; charset=utf-8", tkvd_asset_style_css,
                           tkvd_asset_style_css_len);
    if (strcmp(url, "/dashboard/chart.min.js") == 0)
        return serve_asset(conn, "text/javascript; charset=utf-8", tkvd_asset_chart_js,
                           tkvd_asset_chart_js_len);
    return http_error(conn, MHD_HTTP_NOT_FOUND,
                      "no such resource: %.128s (try /metrics, /api/stats, /api/prefixes, "
                      "/dashboard)", url);
}

/* MHD reports its own trouble (bind failures, refused requests) through here. */
static void http_log(void *cls, const char *fmt, va_list ap)
{
    char line[512];
    vsnprintf(line, sizeof(line), fmt, ap);
    size_t n = strlen(line);
    while (n && line[n - 1] == '\n')
        line[--n] = '\0';
    TKV_LOG(TKV_LOG_WARN, "http: %s", line);
}

/* ============================================================================================
 * Lifecycle
 * ========================================================================================== */

int tkvd_http_start(const char *addr, uint16_t port, const tkvd_http_source *src,
                    tkvd_http **out)
{
    if (!src || !src->store || !out)
        return TKV_EINVAL;
    if (!addr)
        addr = "127.0.0.1";
    struct sockaddr_storage ss;
    memset(&ss, 0, sizeof(ss));
    unsigned flags = MHD_USE_INTERNAL_POLLING_THREAD | MHD_USE_ERROR_LOG;
    struct sockaddr_in *s4 = (struct sockaddr_in *)&ss;
    struct sockaddr_in6 *s6 = (struct sockaddr_in6 *)&ss;
    if (inet_pton(AF_INET, addr, &s4->sin_addr) == 1) {
        s4->sin_family = AF_INET;
        s4->sin_port = htons(port);
    } else if (inet_pton(AF_INET6, addr, &s6->sin6_addr) == 1) {
        s6->sin6_family = AF_INET6;
        s6->sin6_port = htons(port);
        flags |= MHD_USE_IPv6;
    } else {
        TKV_LOG(TKV_LOG_ERROR, "http: '%s' is not an IPv4 or IPv6 address", addr);
        return TKV_EINVAL;
    }

    tkvd_http *h = tkv_xcalloc(1, sizeof(*h));
    h->src = src;
    /* The logger goes first so that MHD's own start-up complaints reach our log too. */
    h->mhd = MHD_start_daemon(flags | MHD_USE_POLL, port, NULL, NULL, http_handle, h,
                              MHD_OPTION_EXTERNAL_LOGGER, http_log, NULL,
                              MHD_OPTION_SOCK_ADDR, (struct sockaddr *)&ss,
                              MHD_OPTION_CONNECTION_LIMIT, (unsigned)kMaxConnections,
                              MHD_OPTION_CONNECTION_MEMORY_LIMIT, (size_t)kConnMemoryBytes,
                              MHD_OPTION_CONNECTION_TIMEOUT, (unsigned)kConnTimeoutS,
                              MHD_OPTION_END);
    if (!h->mhd) {
        TKV_LOG(TKV_LOG_ERROR, "http: cannot listen on %s:%u", addr, (unsigned)port);
        free(h);
        return TKV_EIO;
    }
    const union MHD_DaemonInfo *info = MHD_get_daemon_info(h->mhd, MHD_DAEMON_INFO_BIND_PORT);
    h->port = info ? info->port : port;
    TKV_LOG(TKV_LOG_DEBUG, "http: listening on %s:%u (/metrics, /api/stats, /dashboard)", addr,
            (unsigned)h->port);
    *out = h;
    return TKV_OK;
}

uint16_t tkvd_http_port(const tkvd_http *h)
{
    return h ? h->port : 0;
}

void tkvd_http_stop(tkvd_http *h)
{
    if (!h)
        return;
    MHD_stop_daemon(h->mhd);
    free(h);
}
