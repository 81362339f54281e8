/* tkvd_server.h - tierkvd's gRPC server on the gRPC C core API: listeners, completion-queue
 * threads, a pool for blocking handlers, and the call state machine. It knows nothing about
 * the cache: methods are a table of handlers that turn request bytes into reply bytes.
 *
 * Threads: cq_threads completion-queue threads, each owning one completion queue on which
 * every method is requested; non-blocking handlers run inline on them (they only take the
 * store's short locks), handlers marked `blocking` (and every streaming one) are queued to
 * rpc_workers pool threads so a long prefetch-wait, flush or verify never stalls the others.
 *
 * Lifetime: tkvd_server_start -> (serve) -> tkvd_server_stop, which stops accepting calls,
 * lets in-flight ones finish for drain_timeout_ms, cancels what is left, and frees all.
 */
#ifndef TKVD_SERVER_H
#define TKVD_SERVER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include <grpc/status.h>

#include "tkvd_metrics.h"

typedef struct tkvd_server tkvd_server;

/* What a handler answers: a status and, when OK and unary, the serialized reply (malloc'ed;
 * the server frees it). msg is the status message for a non-OK code. */
typedef struct tkvd_reply {
    grpc_status_code code;
    char msg[256];
    uint8_t *buf;
    size_t len;
} tkvd_reply;

/* A server-streaming call's sender. tkvd_stream_send blocks until the message was handed to
 * the transport; it returns false when the call is gone (client cancelled, deadline,
 * shutdown) and the handler should stop. Only the handler's own thread may call it. */
typedef struct tkvd_stream tkvd_stream;
bool tkvd_stream_send(tkvd_stream *st, const uint8_t *buf, size_t len);

/* What the transport knows of a call: its deadline and who sent it. */
typedef struct tkvd_call_info {
    int timeout_ms;     /* time left until the client's deadline; -1 = none */
    const void *arg;    /* the method's tkvd_method.arg */
    bool is_unix;       /* arrived on the UNIX socket (else TCP) */
    char peer[96];      /* gRPC's peer string: "unix:...", "ipv4:127.0.0.1:port", ... */
    char tls_subject[128]; /* TCP+TLS with a client certificate verified against the
                            * tls_client_ca: its subject (RFC 2253, "O=..,CN=.."); else "" */
    char token[160];    /* the "authorization" metadata, when the client sent one; else "" */
    bool has_cred;      /* UNIX peer: uid/gid/pid are the kernel's SO_PEERCRED of its socket */
    uint32_t uid, gid, pid;
} tkvd_call_info;

typedef void (*tkvd_unary_fn)(void *ctx, const tkvd_call_info *ci, const uint8_t *req,
                              size_t len, tkvd_reply *out);
typedef void (*tkvd_stream_fn)(void *ctx, const tkvd_call_info *ci, const uint8_t *req,
                               size_t len, tkvd_stream *st, tkvd_reply *out);

typedef struct tkvd_method {
    const char *path;          /* "/tierkv.v1.Cache/Lookup" */
    tkvd_unary_fn unary;       /* exactly one of unary / stream */
    tkvd_stream_fn stream;
    bool blocking;             /* run on the worker pool */
    const void *arg;           /* handed to the handler as tkvd_call_info.arg */
} tkvd_method;

typedef struct tkvd_server_opts {
    const char *unix_path;     /* required */
    const char *tcp_addr;      /* NULL or "" = none */
    const char *tls_cert_file, *tls_key_file; /* both set -> TLS on TCP */
    const char *tls_client_ca_file; /* set -> TCP clients must present a certificate it signed */
    unsigned cq_threads, workers;
    size_t max_recv_bytes, max_send_bytes;
    uint32_t drain_timeout_ms;
    const tkvd_method *methods;
    size_t num_methods;
    void *ctx;                 /* passed to every handler */
    /* Called (with ctx) when the drain time is over, before the remaining calls are
     * cancelled: handlers blocked in waits of their own should give up. May be NULL. */
    void (*on_drain_timeout)(void *ctx);
    tkvd_metrics *metrics;     /* rpc_total / rpc_errors */
} tkvd_server_opts;

/* Binds the listeners and starts the threads. Calls grpc_init (and stop grpc_shutdown).
 * TKV_EIO with a log line when a listener cannot be bound or a PEM file cannot be read. */
int tkvd_server_start(const tkvd_server_opts *o, tkvd_server **out);
/* Drains and frees (see the lifetime note above). NULL is ignored. */
void tkvd_server_stop(tkvd_server *s);

#endif
