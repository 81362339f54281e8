/* server.c - gRPC C core plumbing of tierkvd (see tkvd_server.h).
 *
 * Every call is one `rpc` object that lives from "requested" to "finished":
 *
 *   arm():   grpc_server_request_registered_call(..., tag NEW)   [payload pre-read by core]
 *   NEW ok:  re-arm the method on the same queue, then run the handler (inline, or queued to
 *            the worker pool when the method blocks), then finish()
 *   finish:  one batch {initial metadata, message (unary OK), status, recv-close}, tag FINISH
 *   FINISH:  count it in the metrics, unref the call, free
 *
 * Streaming sends are one batch at a time (tag STREAM): the worker thread starts the batch
 * and waits on the rpc's condition variable until a queue thread reports its completion.
 */
#include "tkvd_server.h"

#include <errno.h>
#include <poll.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_posix.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/alloc.h>
#include <grpc/support/time.h>

#include "tkv_base.h"

/* Outstanding requests per (method, queue): a burst of calls to one method finds a request
 * ready while the queue thread is busy re-arming. */
#define kRequestsPerMethod 2

enum { TAG_NEW = 1, TAG_FINISH, TAG_STREAM, TAG_SHUTDOWN };

struct rpc;
typedef struct tag {
    int kind;
    struct rpc *r;
} tag;

typedef struct rpc {
    tag t_new, t_finish, t_stream;
    tkvd_server *srv;
    unsigned iq;               /* queue index */
    size_t im;                 /* method index */
    grpc_call *call;
    grpc_call_details details_in; /* generic (unregistered) calls only */
    gpr_timespec deadline;
    grpc_metadata_array md;
    grpc_byte_buffer *payload;
    grpc_byte_buffer *reply_bb;
    grpc_slice details;
    int cancelled;
    bool md_sent;
    tkvd_reply reply;
    bool has_cred;             /* SO_PEERCRED, read as the call arrives (arrival_cred) */
    uint32_t uid, gid, pid;
    /* streaming handshake with the queue thread */
    pthread_mutex_t mu;
    pthread_cond_t cv;
    bool send_inflight, send_ok;
    struct rpc *next;          /* worker queue link */
} rpc;

struct tkvd_server {
    tkvd_server_opts o;
    tkvd_method *methods;
    void **handles;            /* registered method handles */
    /* The UNIX listener is the daemon's own: each accepted connection is handed to core with
     * grpc_server_add_channel_from_fd, whose calls report the peer "fd:<n>" -- the socket
     * SO_PEERCRED is read from (core's own UNIX listener exposes no peer credentials). */
    int unix_fd, unix_wake;
    pthread_t unix_thread;
    bool unix_started;
    bool verify_clients;       /* TLS asks for and verifies client certificates */
    grpc_server *server;
    grpc_completion_queue **cqs;
    pthread_t *cq_threads;
    unsigned num_cq_started;
    atomic_bool cqs_closing;
    tag t_shutdown;

    pthread_mutex_t mu;        /* shutdown_done + worker queue */
    pthread_cond_t cv_shutdown;
    pthread_cond_t cv_work;
    bool shutdown_done;
    bool workers_stop;
    rpc *work_head, *work_tail;
    pthread_t *workers;
    unsigned num_workers_started;
};

struct tkvd_stream {
    rpc r; /* never instantiated: a tkvd_stream * is the rpc itself */
};

/* ---- rpc objects ---------------------------------------------------------------------------- */

static rpc *rpc_new(tkvd_server *s, unsigned iq, size_t im)
{
    rpc *r = tkv_xcalloc(1, sizeof(*r));
    r->srv = s;
    r->iq = iq;
    r->im = im;
    r->t_new = (tag){TAG_NEW, r};
    r->t_finish = (tag){TAG_FINISH, r};
    r->t_stream = (tag){TAG_STREAM, r};
    r->details = grpc_empty_slice();
    grpc_call_details_init(&r->details_in);
    grpc_metadata_array_init(&r->md);
    pthread_mutex_init(&r->mu, NULL);
    pthread_cond_init(&r->cv, NULL);
    return r;
}

static void rpc_free(rpc *r)
{
    if (r->call)
        grpc_call_unref(r->call);
    grpc_metadata_array_destroy(&r->md);
    grpc_call_details_destroy(&r->details_in);
    if (r->payload)
        grpc_byte_buffer_destroy(r->payload);
    if (r->reply_bb)
        grpc_byte_buffer_destroy(r->reply_bb);
    grpc_slice_unref(r->details);
    free(r->reply.buf);
    pthread_mutex_destroy(&r->mu);
    pthread_cond_destroy(&r->cv);
    free(r);
}

/* Method index of calls to methods that are not registered: answered UNIMPLEMENTED. */
#define kGenericMethod SIZE_MAX

/* Requests are re-armed even while the server shuts down: a call that arrived before the
 * shutdown must find a request to be matched with (else core cancels it unanswered), and a
 * request made after the shutdown simply completes as failed. Only once the queues close
 * does arming stop. */
static void arm(tkvd_server *s, unsigned iq, size_t im)
{
    if (atomic_load(&s->cqs_closing))
        return;
    rpc *r = rpc_new(s, iq, im);
    if (im == kGenericMethod) {
        grpc_call_error e = grpc_server_request_call(s->server, &r->call, &r->details_in, &r->md,
                                                     s->cqs[iq], s->cqs[iq], &r->t_new);
        if (e != GRPC_CALL_OK) {
            TKV_LOG(TKV_LOG_ERROR, "grpc: request_call failed: %d", (int)e);
            rpc_free(r);
        }
        return;
    }
    grpc_call_error e = grpc_server_request_registered_call(
        s->server, s->handles[im], &r->call, &r->deadline, &r->md, &r->payload, s->cqs[iq],
        s->cqs[iq], &r->t_new);
    if (e != GRPC_CALL_OK) {
        TKV_LOG(TKV_LOG_ERROR, "grpc: request_registered_call(%s) failed: %d",
                s->methods[im].path, (int)e);
        rpc_free(r);
    }
}

/* ---- answering -------------------------------------------------------------------------------- */

static void finish(rpc *r)
{
    grpc_op ops[4];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    if (!r->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
        r->md_sent = true;
    }
    if (r->reply.code == GRPC_STATUS_OK && r->reply.buf) {
        /* The slice takes the handler's buffer without a copy (Get replies are megabytes). */
        grpc_slice sl = grpc_slice_new(r->reply.buf, r->reply.len, free);
        r->reply.buf = NULL;
        r->reply_bb = grpc_raw_byte_buffer_create(&sl, 1);
        grpc_slice_unref(sl);
        ops[n].op = GRPC_OP_SEND_MESSAGE;
        ops[n].data.send_message.send_message = r->reply_bb;
        n++;
    }
    grpc_slice_unref(r->details);
    r->details = grpc_slice_from_copied_string(r->reply.code == GRPC_STATUS_OK ? "" : r->reply.msg);
    ops[n].op = GRPC_OP_SEND_STATUS_FROM_SERVER;
    ops[n].data.send_status_from_server.status = r->reply.code;
    ops[n].data.send_status_from_server.status_details = &r->details;
    ops[n].data.send_status_from_server.trailing_metadata_count = 0;
    n++;
    ops[n].op = GRPC_OP_RECV_CLOSE_ON_SERVER;
    ops[n].data.recv_close_on_server.cancelled = &r->cancelled;
    n++;
    grpc_call_error e = grpc_call_start_batch(r->call, ops, n, &r->t_finish, NULL);
    if (e != GRPC_CALL_OK) {
        /* Cannot happen with a well-formed batch; free rather than leak. */
        TKV_LOG(TKV_LOG_ERROR, "grpc: finishing a call failed: %d", (int)e);
        rpc_free(r);
    }
}

static int timeout_left_ms(gpr_timespec deadline)
{
    gpr_timespec d = gpr_convert_clock_type(deadline, GPR_CLOCK_MONOTONIC);
    if (gpr_time_cmp(d, gpr_inf_future(GPR_CLOCK_MONOTONIC)) >= 0)
        return -1;
    gpr_timespec left = gpr_time_sub(d, gpr_now(GPR_CLOCK_MONOTONIC));
    int64_t ms = gpr_time_to_millis(left);
    if (ms < 0)
        return 0;
    return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

/* Copies at most cap-1 bytes of a slice or string, NUL-terminated. */
static void copy_bounded(char *dst, size_t cap, const char *src, size_t n)
{
    if (n >= cap)
        n = cap - 1;
    memcpy(dst, src, n);
    dst[n] = '\0';
}

/* A UNIX peer's credentials, read on the queue thread as the call arrives: the peer string
 * names the connection's fd only while it is open, so it is read before anything else can
 * happen. uid/gid/pid are the kernel's (SO_PEERCRED), not the client's word. */
static void arrival_cred(rpc *r)
{
    char *p = grpc_call_get_peer(r->call);
    if (p && strncmp(p, "fd:", 3) == 0) {
        char *end;
        long fd = strtol(p + 3, &end, 10);
        struct ucred uc;
        socklen_t ul = sizeof(uc);
        int domain = 0;
        socklen_t dl = sizeof(domain);
        if (!*end && fd >= 0 && fd <= INT32_MAX &&
            getsockopt((int)fd, SOL_SOCKET, SO_DOMAIN, &domain, &dl) == 0 && domain == AF_UNIX &&
            getsockopt((int)fd, SOL_SOCKET, SO_PEERCRED, &uc, &ul) == 0 && uc.pid > 0) {
            r->has_cred = true;
            r->uid = uc.uid;
            r->gid = uc.gid;
            r->pid = (uint32_t)uc.pid;
        }
    }
    gpr_free(p);
}

/* Who sent the call: the peer address and credentials, the verified TLS client certificate's
 * subject, a bearer token. */
static void call_peer(rpc *r, tkvd_call_info *ci)
{
    char *peer = grpc_call_get_peer(r->call);
    if (peer) {
        copy_bounded(ci->peer, sizeof(ci->peer), peer, strlen(peer));
        /* "fd:" = a connection of the daemon's own UNIX listener */
        ci->is_unix = strncmp(peer, "unix:", 5) == 0 || strncmp(peer, "fd:", 3) == 0;
        gpr_free(peer);
    }
    ci->has_cred = r->has_cred;
    ci->uid = r->uid;
    ci->gid = r->gid;
    ci->pid = r->pid;
    /* Only a certificate the handshake verified against tls_client_ca names anyone. */
    grpc_auth_context *ac = r->srv->verify_clients ? grpc_call_auth_context(r->call) : NULL;
    if (ac) {
        grpc_auth_property_iterator it =
            grpc_auth_context_find_properties_by_name(ac, GRPC_X509_SUBJECT_PROPERTY_NAME);
        const grpc_auth_property *p = grpc_auth_property_iterator_next(&it);
        /* A subject too long to keep whole names nobody (a cut one could match another). */
        if (p && p->value_length < sizeof(ci->tls_subject))
            copy_bounded(ci->tls_subject, sizeof(ci->tls_subject), p->value, p->value_length);
        grpc_auth_context_release(ac);
    }
    for (size_t i = 0; i < r->md.count; i++) {
        const grpc_metadata *md = &r->md.metadata[i];
        if (grpc_slice_str_cmp(md->key, "authorization") == 0) {
            /* Too long to keep whole: kept as a token no tenant has, so it is refused rather
             * than ignored. */
            if (GRPC_SLICE_LENGTH(md->value) < sizeof(ci->token))
                copy_bounded(ci->token, sizeof(ci->token), (const char *)GRPC_SLICE_START_PTR(md->value),
                             GRPC_SLICE_LENGTH(md->value));
            else
                copy_bounded(ci->token, sizeof(ci->token), "Bearer \x01", 8);
            break;
        }
    }
}

/* Runs the handler and finishes the call; on a queue thread or a worker. */
static void run(rpc *r)
{
    const tkvd_method *m = &r->srv->methods[r->im];
    tkvd_call_info ci = {.timeout_ms = timeout_left_ms(r->deadline), .arg = m->arg};
    call_peer(r, &ci);
    r->reply.code = GRPC_STATUS_OK;
    if (!r->payload) {
        r->reply.code = GRPC_STATUS_INVALID_ARGUMENT;
        snprintf(r->reply.msg, sizeof(r->reply.msg), "request message missing");
    } else {
        grpc_byte_buffer_reader rd;
        if (!grpc_byte_buffer_reader_init(&rd, r->payload)) {
            r->reply.code = GRPC_STATUS_INVALID_ARGUMENT;
            snprintf(r->reply.msg, sizeof(r->reply.msg), "request message cannot be decompressed");
        } else {
            grpc_slice sl = grpc_byte_buffer_reader_readall(&rd);
            grpc_byte_buffer_reader_destroy(&rd);
            if (m->unary)
                m->unary(r->srv->o.ctx, &ci, GRPC_SLICE_START_PTR(sl), GRPC_SLICE_LENGTH(sl),
                         &r->reply);
            else
                m->stream(r->srv->o.ctx, &ci, GRPC_SLICE_START_PTR(sl), GRPC_SLICE_LENGTH(sl),
                          (tkvd_stream *)r, &r->reply);
            grpc_slice_unref(sl);
        }
    }
    if (r->reply.code != GRPC_STATUS_OK) {
        free(r->reply.buf);
        r->reply.buf = NULL;
        TKV_LOG(TKV_LOG_DEBUG, "rpc %s: status %d: %s", m->path, (int)r->reply.code, r->reply.msg);
    }
    if (r->srv->o.metrics) {
        atomic_fetch_add_explicit(&r->srv->o.metrics->rpc_total, 1, memory_order_relaxed);
        if (r->reply.code != GRPC_STATUS_OK)
            atomic_fetch_add_explicit(&r->srv->o.metrics->rpc_errors, 1, memory_order_relaxed);
    }
    finish(r);
}

bool tkvd_stream_send(tkvd_stream *st, const uint8_t *buf, size_t len)
{
    rpc *r = (rpc *)st;
    grpc_slice sl = grpc_slice_from_copied_buffer((const char *)buf, len);
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&sl, 1);
    grpc_slice_unref(sl);
    grpc_op ops[2];
    size_t n = 0;
    memset(ops, 0, sizeof(ops));
    if (!r->md_sent) {
        ops[n].op = GRPC_OP_SEND_INITIAL_METADATA;
        n++;
    }
    ops[n].op = GRPC_OP_SEND_MESSAGE;
    ops[n].data.send_message.send_message = bb;
    n++;
    pthread_mutex_lock(&r->mu);
    r->send_inflight = true;
    pthread_mutex_unlock(&r->mu);
    grpc_call_error e = grpc_call_start_batch(r->call, ops, n, &r->t_stream, NULL);
    bool ok = false;
    if (e == GRPC_CALL_OK) {
        r->md_sent = true;
        pthread_mutex_lock(&r->mu);
        while (r->send_inflight)
            pthread_cond_wait(&r->cv, &r->mu);
        ok = r->send_ok;
        pthread_mutex_unlock(&r->mu);
    }
    grpc_byte_buffer_destroy(bb);
    return ok;
}

/* ---- threads ---------------------------------------------------------------------------------- */

static void *worker_main(void *arg)
{
    tkvd_server *s = arg;
    for (;;) {
        pthread_mutex_lock(&s->mu);
        while (!s->work_head && !s->workers_stop)
            pthread_cond_wait(&s->cv_work, &s->mu);
        rpc *r = s->work_head;
        if (!r) {
            pthread_mutex_unlock(&s->mu);
            return NULL;
        }
        s->work_head = r->next;
        if (!s->work_head)
            s->work_tail = NULL;
        pthread_mutex_unlock(&s->mu);
        run(r);
    }
}

static void enqueue(tkvd_server *s, rpc *r)
{
    pthread_mutex_lock(&s->mu);
    r->next = NULL;
    if (s->work_tail)
        s->work_tail->next = r;
    else
        s->work_head = r;
    s->work_tail = r;
    pthread_cond_signal(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
}

typedef struct cq_arg {
    tkvd_server *s;
    unsigned iq;
} cq_arg;

static void *cq_main(void *arg)
{
    cq_arg a = *(cq_arg *)arg;
    free(arg);
    tkvd_server *s = a.s;
    grpc_completion_queue *cq = s->cqs[a.iq];
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(cq, gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_QUEUE_SHUTDOWN)
            break;
        if (ev.type != GRPC_OP_COMPLETE)
            continue;
        tag *t = ev.tag;
        rpc *r = t->r;
        switch (t->kind) {
        case TAG_NEW:
            if (!ev.success) { /* the server is shutting down: the request was never matched */
                rpc_free(r);
                break;
            }
            arm(s, r->iq, r->im);
            arrival_cred(r);
            if (r->im == kGenericMethod) {
                char method[128];
                size_t n = GRPC_SLICE_LENGTH(r->details_in.method);
                snprintf(method, sizeof(method), "%.*s", (int)(n < 100 ? n : 100),
                         (const char *)GRPC_SLICE_START_PTR(r->details_in.method));
                r->reply.code = GRPC_STATUS_UNIMPLEMENTED;
                snprintf(r->reply.msg, sizeof(r->reply.msg),
                         "unknown method %s (this daemon serves tierkv.v1.Cache)", method);
                if (s->o.metrics) {
                    atomic_fetch_add_explicit(&s->o.metrics->rpc_total, 1, memory_order_relaxed);
                    atomic_fetch_add_explicit(&s->o.metrics->rpc_errors, 1, memory_order_relaxed);
                }
                finish(r);
            } else if (s->methods[r->im].blocking || s->methods[r->im].stream)
                enqueue(s, r);
            else
                run(r);
            break;
        case TAG_FINISH:
            rpc_free(r);
            break;
        case TAG_STREAM:
            pthread_mutex_lock(&r->mu);
            r->send_inflight = false;
            r->send_ok = ev.success;
            pthread_cond_signal(&r->cv);
            pthread_mutex_unlock(&r->mu);
            break;
        case TAG_SHUTDOWN:
            pthread_mutex_lock(&s->mu);
            s->shutdown_done = true;
            pthread_cond_broadcast(&s->cv_shutdown);
            pthread_mutex_unlock(&s->mu);
            break;
        default:
            TKV_ASSERT(!"unknown completion tag");
        }
    }
    return NULL;
}

/* ---- start / stop ----------------------------------------------------------------------------- */

static char *read_file(const char *path, char *err, size_t err_len)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        snprintf(err, err_len, "%s: %s", path, strerror(errno));
        return NULL;
    }
    size_t cap = 4096, len = 0;
    char *buf = tkv_xmalloc(cap);
    size_t n;
    while ((n = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += n;
        if (cap - len - 1 == 0) {
            if (cap >= (1u << 20)) {
                snprintf(err, err_len, "%s: larger than 1 MiB, not a PEM file", path);
                free(buf);
                fclose(f);
                return NULL;
            }
            cap *= 2;
            buf = tkv_xrealloc(buf, cap);
        }
    }
    fclose(f);
    buf[len] = 0;
    return buf;
}

static void *unix_accept_main(void *arg)
{
    tkvd_server *s = arg;
    for (;;) {
        struct pollfd pf[2] = {{.fd = s->unix_fd, .events = POLLIN}, {.fd = s->unix_wake, .events = POLLIN}};
        if (poll(pf, 2, -1) < 0) {
            if (errno == EINTR)
                continue;
            TKV_LOG(TKV_LOG_ERROR, "grpc: poll on the UNIX listener: %s", strerror(errno));
            return NULL;
        }
        if (pf[1].revents)
            return NULL;
        int fd = accept4(s->unix_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
                TKV_LOG(TKV_LOG_WARN, "grpc: accept on the UNIX listener: %s", strerror(errno));
            if (errno == EMFILE || errno == ENFILE)
                usleep(10000); /* out of descriptors: let calls finish before trying again */
            continue;
        }
        grpc_server_credentials *c = grpc_insecure_server_credentials_create();
        grpc_server_add_channel_from_fd(s->server, fd, c); /* core owns fd from here */
        grpc_server_credentials_release(c);
    }
}

static int listen_unix(tkvd_server *s, const char *path)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path)) {
        TKV_LOG(TKV_LOG_ERROR, "grpc: UNIX socket path too long: %s", path);
        return TKV_EIO;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1);
    s->unix_fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    s->unix_wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    if (s->unix_fd < 0 || s->unix_wake < 0) {
        TKV_LOG(TKV_LOG_ERROR, "grpc: socket: %s", strerror(errno));
        return TKV_EIO;
    }
    unlink(path); /* a stale socket of a dead daemon (the pid file proved it dead) */
    if (bind(s->unix_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(s->unix_fd, 512) != 0) {
        TKV_LOG(TKV_LOG_ERROR, "grpc: cannot listen on unix:%s: %s", path, strerror(errno));
        return TKV_EIO;
    }
    TKV_LOG(TKV_LOG_INFO, "grpc: listening on unix:%s", path);
    return TKV_OK;
}

/* Stops taking UNIX connections (before core's shutdown, so none is added after it). */
static void stop_unix(tkvd_server *s)
{
    if (s->unix_started) {
        uint64_t one = 1;
        if (write(s->unix_wake, &one, sizeof(one)) != sizeof(one))
            TKV_LOG(TKV_LOG_WARN, "grpc: wake-up write failed: %s", strerror(errno));
        pthread_join(s->unix_thread, NULL);
        s->unix_started = false;
    }
    if (s->unix_fd >= 0) {
        close(s->unix_fd);
        s->unix_fd = -1;
        unlink(s->o.unix_path);
    }
    if (s->unix_wake >= 0) {
        close(s->unix_wake);
        s->unix_wake = -1;
    }
}

static int add_port(tkvd_server *s, const char *addr, grpc_server_credentials *creds)
{
    int port = grpc_server_add_http2_port(s->server, addr, creds);
    grpc_server_credentials_release(creds);
    if (port == 0) {
        TKV_LOG(TKV_LOG_ERROR, "grpc: cannot listen on %s", addr);
        return TKV_EIO;
    }
    TKV_LOG(TKV_LOG_INFO, "grpc: listening on %s", addr);
    return TKV_OK;
}

static void join_all(tkvd_server *s)
{
    pthread_mutex_lock(&s->mu);
    s->workers_stop = true;
    pthread_cond_broadcast(&s->cv_work);
    pthread_mutex_unlock(&s->mu);
    for (unsigned i = 0; i < s->num_workers_started; i++)
        pthread_join(s->workers[i], NULL);
    atomic_store(&s->cqs_closing, true);
    for (unsigned i = 0; i < s->o.cq_threads; i++)
        grpc_completion_queue_shutdown(s->cqs[i]);
    for (unsigned i = 0; i < s->num_cq_started; i++)
        pthread_join(s->cq_threads[i], NULL);
}

static void free_server(tkvd_server *s)
{
    if (s->server)
        grpc_server_destroy(s->server);
    for (unsigned i = 0; i < s->o.cq_threads; i++)
        if (s->cqs[i])
            grpc_completion_queue_destroy(s->cqs[i]);
    free(s->cqs);
    free(s->cq_threads);
    free(s->workers);
    free(s->handles);
    free(s->methods);
    pthread_mutex_destroy(&s->mu);
    pthread_cond_destroy(&s->cv_shutdown);
    pthread_cond_destroy(&s->cv_work);
    free(s);
    grpc_shutdown();
}

int tkvd_server_start(const tkvd_server_opts *o, tkvd_server **out)
{
    TKV_ASSERT(o->unix_path && o->cq_threads > 0 && o->workers > 0 && o->num_methods > 0);
    TKV_ASSERT(o->max_recv_bytes <= INT32_MAX && o->max_send_bytes <= INT32_MAX);
    int rc = TKV_EIO;
    char *cert = NULL, *key = NULL, *ca = NULL;
    grpc_init();
    tkvd_server *s = tkv_xcalloc(1, sizeof(*s));
    s->unix_fd = s->unix_wake = -1;
    s->o = *o;
    s->methods = tkv_xcalloc(o->num_methods, sizeof(*s->methods));
    memcpy(s->methods, o->methods, o->num_methods * sizeof(*s->methods));
    s->o.methods = s->methods;
    s->handles = tkv_xcalloc(o->num_methods, sizeof(*s->handles));
    s->cqs = tkv_xcalloc(o->cq_threads, sizeof(*s->cqs));
    s->cq_threads = tkv_xcalloc(o->cq_threads, sizeof(*s->cq_threads));
    s->workers = tkv_xcalloc(o->workers, sizeof(*s->workers));
    s->t_shutdown = (tag){TAG_SHUTDOWN, NULL};
    pthread_mutex_init(&s->mu, NULL);
    pthread_cond_init(&s->cv_shutdown, NULL);
    pthread_cond_init(&s->cv_work, NULL);

    /* Limits sized from the geometry by the caller: a Put of max_blocks_per_rpc blocks plus its
     * tokens must fit, anything larger is refused by the transport with RESOURCE_EXHAUSTED
     * before it is buffered whole. */
    grpc_arg args[3];
    memset(args, 0, sizeof(args));
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = (int)o->max_recv_bytes;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = (int)o->max_send_bytes;
    args[2].type = GRPC_ARG_INTEGER;
    args[2].key = GRPC_ARG_ALLOW_REUSEPORT; /* a second daemon on the same TCP port must fail */
    args[2].value.integer = 0;
    grpc_channel_args cargs = {.num_args = 3, .args = args};
    s->server = grpc_server_create(&cargs, NULL);

    for (unsigned i = 0; i < o->cq_threads; i++) {
        s->cqs[i] = grpc_completion_queue_create_for_next(NULL);
        grpc_server_register_completion_queue(s->server, s->cqs[i], NULL);
    }
    for (size_t i = 0; i < o->num_methods; i++) {
        TKV_ASSERT(!o->methods[i].unary != !o->methods[i].stream);
        s->handles[i] = grpc_server_register_method(s->server, o->methods[i].path, NULL,
                                                    GRPC_SRM_PAYLOAD_READ_INITIAL_BYTE_BUFFER, 0);
        TKV_ASSERT(s->handles[i]);
    }

    if (listen_unix(s, o->unix_path) != TKV_OK)
        goto fail;
    if (o->tcp_addr && *o->tcp_addr) {
        grpc_server_credentials *creds;
        if (o->tls_cert_file && *o->tls_cert_file) {
            char why[512];
            cert = read_file(o->tls_cert_file, why, sizeof(why));
            key = cert ? read_file(o->tls_key_file, why, sizeof(why)) : NULL;
            if (!cert || !key) {
                TKV_LOG(TKV_LOG_ERROR, "grpc: TLS: %s", why);
                goto fail;
            }
            if (o->tls_client_ca_file && *o->tls_client_ca_file) {
                ca = read_file(o->tls_client_ca_file, why, sizeof(why));
                if (!ca) {
                    TKV_LOG(TKV_LOG_ERROR, "grpc: TLS: %s", why);
                    goto fail;
                }
                s->verify_clients = true;
            }
            grpc_ssl_pem_key_cert_pair pair = {.private_key = key, .cert_chain = cert};
            /* With a client CA the handshake itself refuses a peer without a certificate
             * that CA signed: no call of such a peer ever reaches a handler. */
            creds = grpc_ssl_server_credentials_create_ex(
                ca, &pair, 1,
                ca ? GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY
                   : GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE,
                NULL);
            if (!creds) {
                TKV_LOG(TKV_LOG_ERROR, "grpc: TLS: cannot use %s / %s", o->tls_cert_file,
                        o->tls_key_file);
                goto fail;
            }
        } else {
            creds = grpc_insecure_server_credentials_create();
        }
        if (add_port(s, o->tcp_addr, creds) != TKV_OK)
            goto fail;
    }
    grpc_server_start(s->server);
    TKV_ASSERT(pthread_create(&s->unix_thread, NULL, unix_accept_main, s) == 0);
    s->unix_started = true;

    /* A thread that cannot be created is out-of-resources: the one OOM policy (abort). */
    for (unsigned i = 0; i < o->workers; i++) {
        TKV_ASSERT(pthread_create(&s->workers[i], NULL, worker_main, s) == 0);
        s->num_workers_started++;
    }
    for (unsigned i = 0; i < o->cq_threads; i++)
        for (size_t m = 0; m < o->num_methods; m++)
            for (int k = 0; k < kRequestsPerMethod; k++)
                arm(s, i, m);
    for (unsigned i = 0; i < o->cq_threads; i++)
        arm(s, i, kGenericMethod);
    for (unsigned i = 0; i < o->cq_threads; i++) {
        cq_arg *a = tkv_xmalloc(sizeof(*a));
        *a = (cq_arg){s, i};
        TKV_ASSERT(pthread_create(&s->cq_threads[i], NULL, cq_main, a) == 0);
        s->num_cq_started++;
    }
    free(cert);
    free(key);
    free(ca);
    *out = s;
    return TKV_OK;

fail:
    /* No request was armed, so no call exists; destroy needs a completed shutdown all the
     * same, and core expects a started server for that. */
    atomic_store(&s->cqs_closing, true);
    grpc_server_start(s->server);
    grpc_server_shutdown_and_notify(s->server, s->cqs[0], &s->t_shutdown);
    grpc_server_cancel_all_calls(s->server);
    for (;;) {
        grpc_event ev = grpc_completion_queue_next(s->cqs[0], gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL);
        if (ev.type == GRPC_OP_COMPLETE && ev.tag == &s->t_shutdown)
            break;
    }
    for (unsigned i = 0; i < o->cq_threads; i++) {
        grpc_completion_queue_shutdown(s->cqs[i]);
        while (grpc_completion_queue_next(s->cqs[i], gpr_inf_future(GPR_CLOCK_MONOTONIC), NULL).type !=
               GRPC_QUEUE_SHUTDOWN)
            ;
    }
    free(cert);
    free(key);
    free(ca);
    stop_unix(s);
    free_server(s);
    return rc;
}

static bool wait_shutdown(tkvd_server *s, uint32_t timeout_ms)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_ms / 1000;
    ts.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (ts.tv_nsec >= 1000000000L) {
        ts.tv_sec++;
        ts.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&s->mu);
    while (!s->shutdown_done)
        if (pthread_cond_timedwait(&s->cv_shutdown, &s->mu, &ts) == ETIMEDOUT)
            break;
    bool done = s->shutdown_done;
    pthread_mutex_unlock(&s->mu);
    return done;
}

void tkvd_server_stop(tkvd_server *s)
{
    if (!s)
        return;
    stop_unix(s);
    /* No new calls from here; in-flight ones run to their end (the drain), then the tag. */
    grpc_server_shutdown_and_notify(s->server, s->cqs[0], &s->t_shutdown);
    if (!wait_shutdown(s, s->o.drain_timeout_ms)) {
        TKV_LOG(TKV_LOG_WARN, "grpc: calls still running after %u ms; cancelling them",
                s->o.drain_timeout_ms);
        if (s->o.on_drain_timeout)
            s->o.on_drain_timeout(s->o.ctx);
        grpc_server_cancel_all_calls(s->server);
        while (!wait_shutdown(s, 1000))
            ;
    }
    join_all(s);
    free_server(s);
}
