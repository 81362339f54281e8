/* tkvd_attach.h - the attach socket (proto/tkv_attach.h): hands the L2 pool's memfd (with
 * tenants, the caller's tenant's region of it) to local clients and ties their leases to the
 * connection.
 *
 * One thread polls the listening SOCK_SEQPACKET socket and every connection. A connection
 * must send a valid hello (magic, version, the daemon's fingerprint) within 5 s; it then gets
 * a client_id and the memfd (SCM_RIGHTS), and stays open silently. When it closes, every
 * lease and allocation made under its client_id is released (tkv_store_release_owner).
 * tkvd_metrics.clients_connected counts the attached connections.
 */
#ifndef TKVD_ATTACH_H
#define TKVD_ATTACH_H

#include <stdbool.h>
#include <stdint.h>

#include "tkv_attach.h"
#include "tkv_store.h"
#include "tkvd_metrics.h"
#include "tkvd_tenant.h"

typedef struct tkvd_attach tkvd_attach;

/* Binds path (a stale socket file is replaced) and starts the thread. store, fingerprint and
 * metrics must outlive the returned object. TKV_EIO with a log line on bind failure. */
int tkvd_attach_start(const char *path, tkv_store *store, const uint8_t fingerprint[32],
                      tkvd_metrics *metrics, tkvd_attach **out);
/* Lets trusted peers (the daemon's own uid, or root) that ask for it map the L2 pool writable
 * (TKV_ATTACH_HELLO_WRITABLE); others always get a read-only descriptor. Default off. */
void tkvd_attach_allow_writable(tkvd_attach *a, bool on);
/* With tenants configured (t->n > 0; t must outlive the attach), a peer is admitted only as
 * the tenant its SO_PEERCRED uid/gid names; it gets the memfd of that tenant's own L2 region
 * (tkv_store_l2_region: no other tenant's block lies in it), and the handle of that tenant's
 * own L1 region (an allocation holding only its L1 blocks) when the tenant is marked map_pool
 * (CUDA IPC maps read-write: its engines are trusted with its L1 blocks). Its client_id
 * carries the tenant's tag (tkvd_tenant_tag), so leases made under it are that tenant's. Call
 * right after start. */
void tkvd_attach_set_tenants(tkvd_attach *a, const tkvd_tenants *t);
/* Makes every later handshake offer the GPU pool: gpu[r] (copied; num_regions of them) is the
 * message of L1 region r (tkv_store_l1_region_at). A client whose tenant's blocks live in
 * region r gets a reply with TKV_ATTACH_F_L1 followed by gpu[r], that region's handle alone;
 * where gpu[r].num_chunks is 0 (an empty region) it gets no L1. Call before clients attach
 * (right after start). */
void tkvd_attach_offer_gpu(tkvd_attach *a, const tkv_attach_gpu *gpu, unsigned num_regions);
/* Serves the fast path (tkvd_fastpath.h) on the connections of clients that ask for it from
 * now on; the attach object owns f and stops it first in tkvd_attach_stop. */
struct tkvd_fast;
void tkvd_attach_serve_fast(tkvd_attach *a, struct tkvd_fast *f);
/* True while an attach connection with this client_id is open (thread-safe). */
bool tkvd_attach_client_live(tkvd_attach *a, uint64_t client_id);
/* Closes the listener and every connection (releasing their leases), joins the thread,
 * unlinks the socket file. NULL is ignored. */
void tkvd_attach_stop(tkvd_attach *a);

#endif
