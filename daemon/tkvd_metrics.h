/* tkvd_metrics.h - the daemon's own counters (beyond tkv_store_stats), shared between the
 * gRPC side (which updates them) and the HTTP side (which renders /metrics, /api/stats and
 * the dashboard). Lock-free: every field is updated with relaxed atomics from any thread.
 */
#ifndef TKVD_METRICS_H
#define TKVD_METRICS_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

#include "tkvd_tenant.h"
#include "tkv_l4.h"

/* Lookup latency histogram: bucket i counts lookups that took <= tkvd_latency_bounds_us[i]
 * (the last bucket is +Inf). Fixed bounds, so percentiles are exact to a bucket. */
#define TKVD_LAT_BUCKETS 16
extern const double tkvd_latency_bounds_us[TKVD_LAT_BUCKETS]; /* last = INFINITY */

typedef struct tkvd_metrics {
    _Atomic uint64_t rpc_total;          /* RPCs answered */
    _Atomic uint64_t rpc_errors;         /* RPCs answered with a non-OK status */
    _Atomic uint64_t lookups;            /* Lookup RPCs */
    _Atomic uint64_t lookup_hit_tokens;  /* tokens covered by hit blocks */
    _Atomic uint64_t lookup_query_tokens;/* tokens in full blocks asked about */
    _Atomic uint64_t lat_bucket[TKVD_LAT_BUCKETS];
    _Atomic uint64_t lat_sum_ns;
    _Atomic uint64_t clients_connected;  /* attach-socket connections now open */
    _Atomic uint64_t clients_total;
    uint64_t start_ms;                   /* wall clock at start (set once) */
    /* per tenant, slot = tenant index + 1 (slot 0: callers that are no tenant) */
    _Atomic uint64_t tenant_rpcs[TKVD_TENANT_MAX + 1];
    _Atomic uint64_t tenant_denied[TKVD_TENANT_MAX + 1];
    /* the refusal log line's rate limit, per tenant slot: last line (ms), refusals held back */
    _Atomic uint64_t deny_log_ms[TKVD_TENANT_MAX + 1], deny_log_held[TKVD_TENANT_MAX + 1];
} tkvd_metrics;

void tkvd_metrics_init(tkvd_metrics *m);
void tkvd_metrics_observe_lookup(tkvd_metrics *m, uint64_t elapsed_ns);
/* Percentile (0..1) of lookup latency in microseconds, interpolated inside the bucket. */
double tkvd_metrics_lookup_quantile_us(const tkvd_metrics *m, double q);

/* The L4 families (tierkv_l4_*) as Prometheus text / as a JSON member "l4":{...} (for
 * /api/stats; {"configured":false} when l4 is NULL), written into buf (NUL-terminated,
 * truncated at cap). Returns the length written. */
size_t tkvd_metrics_l4_prom(tkv_l4 *l4, char *buf, size_t cap);
size_t tkvd_metrics_l4_json(tkv_l4 *l4, char *buf, size_t cap);

#endif
