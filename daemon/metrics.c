/* metrics.c - the daemon's lock-free counters and lookup latency histogram. */
#include "tkvd_metrics.h"

#include <math.h>
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
