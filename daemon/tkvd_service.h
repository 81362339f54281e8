/* tkvd_service.h - the tierkv.v1.Cache handlers: validate each request, call the store, map
 * its errors to gRPC statuses with a one-line message (docs/design.md has the table).
 *
 * Keys are derived here from tokens (root salted with the namespace, then the chain), never
 * taken from clients. Every handler is thread-safe; the ones marked blocking in the method
 * table run on the server's worker pool: everything that may wait for I/O or for the store's
 * write-back (Put, Get, Alloc, Commit, Prefetch, Flush, Verify, Evict, ListBlocks).
 */
#ifndef TKVD_SERVICE_H
#define TKVD_SERVICE_H

#include <stdatomic.h>
#include <stddef.h>

#include "tkv_store.h"
#include "tkvd_attach.h"
#include "tkvd_config.h"
#include "tkvd_cost.h"
#include "tkvd_metrics.h"
#include "tkvd_server.h"

typedef struct tkvd_service {
    tkv_store *store;
    const tkvd_config *cfg;
    tkvd_metrics *metrics;
    tkvd_attach *attach;      /* NULL: no client_id is valid */
    tkvd_rates rates;         /* for the cost check */
    const char *version;
    atomic_bool stopping;     /* set on SIGTERM: Health says "stopping" */
    atomic_bool abort_waits;  /* set when the drain time is over: blocking waits give up */
} tkvd_service;

/* For tkvd_server_opts.on_drain_timeout (ctx = the tkvd_service). */
void tkvd_service_abort_waits(void *ctx);

/* For tkvd_server_opts.authorize (ctx = the tkvd_service): with tenants configured, maps the
 * caller's proven identity to its tenant (ci->tenant) and refuses callers that are none, and
 * non-admin tenants' ListBlocks/Flush/Verify, with PERMISSION_DENIED (counted, logged at most
 * once a second). Without tenants every call passes with ci->tenant NULL. */
bool tkvd_service_authorize(void *ctx, const tkvd_method *m, tkvd_call_info *ci, tkvd_reply *out);

/* The method table for tkvd_server_opts (static storage). */
const tkvd_method *tkvd_service_methods(size_t *num_methods);

/* Message-size limits for this configuration (the server's transport limits). */
size_t tkvd_service_max_recv_bytes(const tkvd_config *cfg);
size_t tkvd_service_max_send_bytes(const tkvd_config *cfg);

#endif
