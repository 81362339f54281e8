/* tkvd_service.h - the tierkv.v1.Cache handlers: validate each request, call the store, map
 * its errors to gRPC statuses with a one-line message (docs/design.md has the table).
 *
 * One table of handlers serves every transport: each entry names its request and reply
 * messages, a validation function beside the handler, and whether it may block.
 * tkvd_service_dispatch does unpack -> scope -> validate -> call -> pack once; the gRPC
 * server (tkvd_service_methods) and the attach socket's fast path (fastpath.c) both call it,
 * so each call has one implementation whatever carried it.
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

#include <protobuf-c/protobuf-c.h>

#include "tkv_store.h"
#include "tkvd_attach.h"
#include "tkvd_config.h"
#include "tkvd_cost.h"
#include "tkvd_keycache.h"
#include "tkvd_metrics.h"
#include "tkvd_server.h"

typedef struct tkvd_service {
    tkv_store *store;
    const tkvd_config *cfg;
    tkvd_metrics *metrics;
    tkvd_attach *attach;      /* NULL: no client_id is valid */
    tkvd_keycache *keycache;  /* NULL: every key derived */
    tkvd_rates rates;         /* for the cost check */
    struct tkvd_gpu *gpu;     /* the L1 pool (its regions' offsets), or NULL */
    const char *version;
    atomic_bool stopping;     /* set on SIGTERM: Health says "stopping" */
    atomic_bool abort_waits;  /* set when the drain time is over: blocking waits give up */
} tkvd_service;

/* Who is calling, as the transport established it (never as the message claims). */
typedef enum tkvd_peer_kind {
    TKVD_PEER_GRPC_UNIX = 1, /* gRPC on the UNIX socket */
    TKVD_PEER_GRPC_TCP,      /* gRPC on TCP (TLS when tls_subject is set) */
    TKVD_PEER_ATTACH,        /* the attach connection's fast path */
} tkvd_peer_kind;

typedef struct tkvd_peer {
    tkvd_peer_kind kind;
    bool has_cred;           /* uid/gid/pid are the kernel's SO_PEERCRED of the socket */
    uint32_t uid, gid, pid;
    uint64_t attach_id;      /* ATTACH: the connection's client_id (owns its leases) */
    char addr[96];           /* the transport's peer address ("unix:...", "ipv4:...") */
    char tls_subject[128];   /* verified TLS client certificate's subject, or "" */
    char token[160];         /* the `authorization` value the client presented, or "" */
} tkvd_peer;

/* One call's context: built by the transport, completed by the dispatcher (owner_id and
 * namespace, from tkvd_call_bind below), read by the handler. */
typedef struct tkvd_call {
    tkvd_service *svc;
    int timeout_ms;          /* until the client's deadline; -1 = none */
    tkvd_peer peer;
    tkvd_stream *stream;     /* server-streaming calls (gRPC only); else NULL */
    /* derived from the peer and the request's scope */
    uint64_t owner_id;       /* client_id that this call's leases/allocations belong to; 0 = none */
    const char *ns;          /* the namespace the call's keys are derived in */
    size_t ns_len;
    const tkvd_tenant *tenant; /* with tenants: who the peer proved to be (never NULL once
                              * admitted); without: NULL */
    bool lean_reply;         /* set by the transport: pack a lookup's reply in the fast path's
                              * lean encoding (proto/tkv_fast.h), not protobuf */
    /* outcome */
    grpc_status_code code;   /* GRPC_STATUS_OK unless the call failed */
    char msg[256];           /* one-line reason when code != OK */
    void **scratch;          /* reply allocations, freed after packing */
    size_t num_scratch, cap_scratch;
} tkvd_call;

/* Ids of the calls the attach fast path carries (proto/tkv_attach.h TKV_FAST_*) map to the
 * table through this; returns the entry index or -1 for an id the fast path does not carry. */
int tkvd_service_fast_method(uint32_t op);

/* Runs table entry `method` for a serialized request: unpack, bind the scope (owner and
 * namespace), validate, call, and on success pack the reply into *rsp (malloc'ed, the
 * caller frees; *rsp_len bytes). The outcome is in k->code / k->msg. Thread-safe. */
void tkvd_service_dispatch(tkvd_service *svc, tkvd_call *k, int method, const uint8_t *req,
                           size_t len, uint8_t **rsp, size_t *rsp_len);

/* The same for a request already decoded (rq of the entry's request type; the caller keeps
 * it): the fast path's lean encodings decode straight into the protobuf-c structs, and with
 * k->lean_reply (a Lookup or LookupBatch only) the reply is packed lean. */
void tkvd_service_call(tkvd_service *svc, tkvd_call *k, int method, const ProtobufCMessage *rq,
                       uint8_t **rsp, size_t *rsp_len);

/* For tkvd_server_opts.on_drain_timeout (ctx = the tkvd_service). */
void tkvd_service_abort_waits(void *ctx);

/* The method table for tkvd_server_opts (static storage). */
const tkvd_method *tkvd_service_methods(size_t *num_methods);

/* Message-size limits for this configuration (the server's transport limits). */
size_t tkvd_service_max_recv_bytes(const tkvd_config *cfg);
size_t tkvd_service_max_send_bytes(const tkvd_config *cfg);

#endif
