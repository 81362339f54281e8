/* metrics.c - the daemon's lock-free counters and lookup latency histogram. */
#include "tkvd_metrics.h"

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <string.h>

#include "tkv_base.h"

/* Roughly x2 steps from 5 us: a cached lookup is tens of microseconds, a slow one milliseconds. */
const double tkvd_latency_bounds_us[TKVD_LAT_BUCKETS] = {
    5, 10, 20, 40, 80, 160, 320, 640, 1280, 2560, 5120, 10240, 20480, 40960, 81920, INFINITY};

void tkvd_metrics_init(tkvd_metrics *m)
{
    memset(m, 0, sizeof(*m));
    m->start_ms = tkv_wall_ms();
}

void tkvd_metrics_observe_lookup(tkvd_metrics *m, uint64_t elapsed_ns)
{
    double us = (double)elapsed_ns / 1000.0;
    int i = 0;
    while (i < TKVD_LAT_BUCKETS - 1 && us > tkvd_latency_bounds_us[i])
        i++;
    atomic_fetch_add_explicit(&m->lat_bucket[i], 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->lat_sum_ns, elapsed_ns, memory_order_relaxed);
}

double tkvd_metrics_lookup_quantile_us(const tkvd_metrics *m, double q)
{
    uint64_t counts[TKVD_LAT_BUCKETS], total = 0;
    for (int i = 0; i < TKVD_LAT_BUCKETS; i++) {
        counts[i] = atomic_load_explicit(&m->lat_bucket[i], memory_order_relaxed);
        total += counts[i];
    }
    if (total == 0)
        return 0.0;
    double rank = q * (double)total, seen = 0;
    for (int i = 0; i < TKVD_LAT_BUCKETS; i++) {
        if (counts[i] && seen + (double)counts[i] >= rank) {
            double lo = i ? tkvd_latency_bounds_us[i - 1] : 0.0;
            double hi = tkvd_latency_bounds_us[i];
            if (isinf(hi))
                return lo;
            return lo + (hi - lo) * ((rank - seen) / (double)counts[i]);
        }
        seen += (double)counts[i];
    }
    return tkvd_latency_bounds_us[TKVD_LAT_BUCKETS - 2];
}

/* ---- the shared tier (L4) ------------------------------------------------------------------ */

#define L4_PUT(...)                                                                    \
    do {                                                                               \
        int n_ = snprintf(buf + used, used < cap ? cap - used : 0, __VA_ARGS__);       \
        if (n_ > 0)                                                                    \
            used += (size_t)n_;                                                        \
    } while (0)

static size_t l4_family(char *buf, size_t cap, size_t used, const char *name, const char *type,
                        const char *help, uint64_t v)
{
    L4_PUT("# HELP %s %s\n# TYPE %s %s\n%s %" PRIu64 "\n", name, help, name, type, name, v);
    return used;
}

size_t tkvd_metrics_l4_prom(tkv_l4 *l4, char *buf, size_t cap)
{
    tkv_l4_stats st;
    tkv_l4_get_stats(l4, &st);
    size_t used = 0;
    used = l4_family(buf, cap, used, "tierkv_l4_up", "gauge",
                     "1 when the Redis Cluster of L4 answers with every slot served; 0 while "
                     "lookups are served from the local tiers alone.", (uint64_t)st.healthy);
    used = l4_family(buf, cap, used, "tierkv_l4_lookups_total", "counter",
                     "Lookups that read the rest of their chain from L4.", st.lookups);
    used = l4_family(buf, cap, used, "tierkv_l4_skipped_lookups_total", "counter",
                     "Lookups that did not ask L4 because it was down.", st.skipped_lookups);
    used = l4_family(buf, cap, used, "tierkv_l4_hit_blocks_total", "counter",
                     "Blocks found intact in L4 and promoted to L2.", st.hit_blocks);
    used = l4_family(buf, cap, used, "tierkv_l4_hit_bytes_total", "counter",
                     "Payload bytes read from L4.", st.hit_bytes);
    used = l4_family(buf, cap, used, "tierkv_l4_put_blocks_total", "counter",
                     "Blocks written down to L4.", st.put_blocks);
    used = l4_family(buf, cap, used, "tierkv_l4_put_bytes_total", "counter",
                     "Payload bytes written down to L4.", st.put_bytes);
    used = l4_family(buf, cap, used, "tierkv_l4_put_dropped_total", "counter",
                     "Blocks not written to L4: over l4_bytes_budget, or L4 down.",
                     st.put_dropped);
    used = l4_family(buf, cap, used, "tierkv_l4_put_errors_total", "counter",
                     "Blocks whose write to L4 failed.", st.put_errors);
    used = l4_family(buf, cap, used, "tierkv_l4_checksum_failures_total", "counter",
                     "Values in L4 that failed their checks (missed and deleted).",
                     st.checksum_failures);
    used = l4_family(buf, cap, used, "tierkv_l4_errors_total", "counter",
                     "Redis commands that failed (node down, error reply).", st.errors);
    used = l4_family(buf, cap, used, "tierkv_l4_timeouts_total", "counter",
                     "Redis commands that passed l4_timeout_ms.", st.timeouts);
    L4_PUT("# HELP tierkv_l4_redirects_total MOVED and ASK redirects followed.\n"
           "# TYPE tierkv_l4_redirects_total counter\n"
           "tierkv_l4_redirects_total{kind=\"moved\"} %" PRIu64 "\n"
           "tierkv_l4_redirects_total{kind=\"ask\"} %" PRIu64 "\n", st.moved, st.ask);
    used = l4_family(buf, cap, used, "tierkv_l4_connect_failures_total", "counter",
                     "Failed connects to Redis nodes (each retried with back-off).",
                     st.connect_failures);
    used = l4_family(buf, cap, used, "tierkv_l4_slot_map_loads_total", "counter",
                     "CLUSTER SLOTS maps loaded.", st.map_loads);
    used = l4_family(buf, cap, used, "tierkv_l4_queue_bytes", "gauge",
                     "Bytes waiting to be written down to L4.", st.queue_bytes);
    L4_PUT("# HELP tierkv_l4_read_seconds Latency of a lookup's read round to L4.\n"
           "# TYPE tierkv_l4_read_seconds histogram\n");
    uint64_t cum = 0;
    for (int i = 0; i < TKV_L4_LAT_BUCKETS; i++) {
        cum += st.lat_bucket[i];
        if (isinf(tkv_l4_latency_bounds_us[i]))
            L4_PUT("tierkv_l4_read_seconds_bucket{le=\"+Inf\"} %" PRIu64 "\n", cum);
        else
            L4_PUT("tierkv_l4_read_seconds_bucket{le=\"%g\"} %" PRIu64 "\n",
                   tkv_l4_latency_bounds_us[i] / 1e6, cum);
    }
    L4_PUT("tierkv_l4_read_seconds_sum %.6f\ntierkv_l4_read_seconds_count %" PRIu64 "\n",
           (double)st.lat_sum_ns / 1e9, cum);
    return used < cap ? used : cap ? cap - 1 : 0;
}

size_t tkvd_metrics_l4_json(tkv_l4 *l4, char *buf, size_t cap)
{
    size_t used = 0;
    if (!l4) {
        L4_PUT("\"l4\":{\"configured\":false}");
        return used < cap ? used : cap ? cap - 1 : 0;
    }
    tkv_l4_stats st;
    tkv_l4_get_stats(l4, &st);
    L4_PUT("\"l4\":{\"configured\":true,\"up\":%s,\"lookups\":%" PRIu64 ",\"hit_blocks\":%" PRIu64
           ",\"put_blocks\":%" PRIu64 ",\"put_dropped\":%" PRIu64 ",\"checksum_failures\":%" PRIu64
           ",\"errors\":%" PRIu64 ",\"timeouts\":%" PRIu64 ",\"redirects\":%" PRIu64 "}",
           st.healthy ? "true" : "false", st.lookups, st.hit_blocks, st.put_blocks,
           st.put_dropped, st.checksum_failures, st.errors, st.timeouts, st.moved + st.ask);
    return used < cap ? used : cap ? cap - 1 : 0;
}
