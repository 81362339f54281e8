/* tkvd_http.h - the daemon's HTTP side (libmicrohttpd): /metrics (Prometheus text),
 * /api/stats, /api/prefixes?top=N, /dashboard. Read-only: it never changes cache state.
 *
 * It reads the engine through the tkv_store API (stats, block list) and the daemon's own
 * counters (tkvd_metrics). Binds to 127.0.0.1 unless told otherwise.
 */
#ifndef TKVD_HTTP_H
#define TKVD_HTTP_H

#include <stdint.h>

#include "tkv_store.h"
#include "tkvd_metrics.h"

typedef struct tkvd_http tkvd_http;

typedef struct tkvd_http_source {
    tkv_store *store;
    tkvd_metrics *metrics;
    const tkv_geometry *geometry;
    const char *policy_name;
    const char *version;
    const tkvd_tenants *tenants;  /* NULL or empty: no tierkv_tenant_* families */
    tkv_l4 *l4;               /* the shared tier, or NULL when off */
} tkvd_http_source;

/* Starts serving on addr:port (addr NULL = "127.0.0.1"; port 0 = pick one, see
 * tkvd_http_port). src must outlive the server. TKV_EIO if the address cannot be bound. */
int tkvd_http_start(const char *addr, uint16_t port, const tkvd_http_source *src,
                    tkvd_http **out);
uint16_t tkvd_http_port(const tkvd_http *h);
/* Stops and frees; NULL is ignored. */
void tkvd_http_stop(tkvd_http *h);

#endif
