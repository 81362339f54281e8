/* tkvd_fastpath.h - the attach connection's fast path (proto/tkv_attach.h, "the fast path"):
 * an attached client's critical-path calls (lookup, batched lookup, prefetch/wait, release,
 * alloc/write/commit, put) carried as length-prefixed protobuf records on its attach socket,
 * served by the same handler table as gRPC (tkvd_service_dispatch).
 *
 * One thread per fast connection serves its calls in order, so a client has at most one call
 * in flight and one request and one reply in memory (each at most the service's message
 * limits). The caller identity is the connection: kernel SO_PEERCRED uid/gid/pid and its
 * client_id, which owns the call's leases whatever the message says. When the client goes
 * (close, crash, SIGKILL), the thread finishes the call in progress and only then hands the
 * connection back to the attach thread, which releases every lease it made.
 */
#ifndef TKVD_FASTPATH_H
#define TKVD_FASTPATH_H

#include <stdint.h>

#include "tkvd_service.h"

typedef struct tkvd_fast tkvd_fast;

/* Makes svc->attach serve the fast path for clients that ask for it (call once, after svc is
 * complete; clients attached before then keep using gRPC). The attach object owns the result
 * and stops it in tkvd_attach_stop. No-op when svc->attach is NULL. */
void tkvd_fast_enable(tkvd_service *svc);

/* For attach.c: starts serving connection fd (blocking I/O from now on) for client_id.
 * done(arg, client_id) is called from the serving thread when the connection ended; the
 * thread no longer touches fd after it. Returns 0, or -1 when no thread could be started. */
int tkvd_fast_serve(tkvd_fast *f, int fd, uint64_t client_id,
                    void (*done)(void *arg, uint64_t client_id), void *arg);
/* For attach.c: wakes every serving thread (shutdown of its socket), joins them, frees f. */
void tkvd_fast_stop(tkvd_fast *f);

#endif
