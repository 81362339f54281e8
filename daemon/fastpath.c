/* fastpath.c - the attach connection's fast path (see tkvd_fastpath.h). */
#include "tkvd_fastpath.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "tkv_fast.h"
#include "tkv_base.h"

typedef struct fconn {
    tkvd_fast *f;
    int fd;
    uint64_t client_id;
    void (*done)(void *arg, uint64_t client_id);
    void *done_arg;
    pthread_t thread;
    bool ended;            /* set (under mu) before done(): fd may be closed from then on */
    struct fconn *next;
} fconn;

struct tkvd_fast {
    tkvd_service *svc;
    size_t max_recv;
    pthread_mutex_t mu;
    fconn *conns;          /* serving threads, joined when ended or by tkvd_fast_stop */
    bool stopping;
};

/* ---- serving ---------------------------------------------------------------------------------- */

static void *serve_main(void *arg)
{
    fconn *c = arg;
    tkvd_fast *f = c->f;
    pthread_setname_np(pthread_self(), "tkvd-fast"); /* tests and operators count these */
    tkvd_peer peer = {.kind = TKVD_PEER_ATTACH, .attach_id = c->client_id};
    struct ucred cred;
    socklen_t cl = sizeof(cred);
    if (getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) == 0) {
        peer.has_cred = true;
        peer.uid = cred.uid;
        peer.gid = cred.gid;
        peer.pid = (uint32_t)cred.pid;
    }
    snprintf(peer.addr, sizeof(peer.addr), "attach:pid=%u", peer.pid);
    uint8_t *buf = NULL;
    size_t cap = 0;
    tkv_fast_lookup *lean = tkv_xmalloc(sizeof(*lean)); /* ~14 KiB: not on the stack */
    for (;;) {
        tkv_fast_hdr h = {0};
        size_t len = 0;
        char why[160];
        int r = tkv_fast_recv(c->fd, &h, &buf, &cap, f->max_recv, &len, why, sizeof(why));
        if (r > 0 && (h.status != 0 || h.reserved != 0)) {
            snprintf(why, sizeof(why), "request record with status %d", (int)h.status);
            r = -1;
        }
        if (r == 0)
            break;
        if (r < 0) {
            TKV_LOG(TKV_LOG_INFO, "fast path: client %llu: %s; closing its connection",
                    (unsigned long long)c->client_id, why);
            tkv_fast_send(c->fd, h.op, 0, 0, GRPC_STATUS_INVALID_ARGUMENT, (const uint8_t *)why,
                          strlen(why));
            break;
        }
        int method = tkvd_service_fast_method(h.op);
        bool sent;
        if (method < 0) {
            snprintf(why, sizeof(why), "fast path: unknown call %u", h.op);
            sent = tkv_fast_send(c->fd, h.op, 0, 0, GRPC_STATUS_UNIMPLEMENTED, (const uint8_t *)why,
                                 strlen(why));
        } else {
            tkvd_call k;
            memset(&k, 0, sizeof(k));
            k.peer = peer;
            k.timeout_ms = h.timeout_ms ? (int)(h.timeout_ms > INT32_MAX ? INT32_MAX : h.timeout_ms) : -1;
            uint8_t *rsp = NULL;
            size_t rsp_len = 0;
            if (h.flags & TKV_FAST_LEAN) {
                const ProtobufCMessage *rq = tkv_fast_lean_decode(h.op, buf, len, lean, k.msg,
                                                                  sizeof(k.msg));
                k.lean_reply = true; /* a lean request is answered lean (proto/tkv_fast.h) */
                if (rq)
                    tkvd_service_call(f->svc, &k, method, rq, &rsp, &rsp_len);
                else
                    k.code = GRPC_STATUS_INVALID_ARGUMENT;
            } else {
                tkvd_service_dispatch(f->svc, &k, method, buf, len, &rsp, &rsp_len);
            }
            tkvd_metrics *m = f->svc->metrics;
            atomic_fetch_add_explicit(&m->rpc_total, 1, memory_order_relaxed);
            if (k.code == GRPC_STATUS_OK) {
                sent = tkv_fast_send(c->fd, h.op, (uint16_t)(h.flags & TKV_FAST_LEAN), 0, 0, rsp,
                                     rsp_len);
            } else {
                atomic_fetch_add_explicit(&m->rpc_errors, 1, memory_order_relaxed);
                sent = tkv_fast_send(c->fd, h.op, 0, 0, k.code, (const uint8_t *)k.msg, strlen(k.msg));
            }
            free(rsp);
        }
        if (!sent)
            break;
        /* one large request does not keep its buffer for the life of the connection */
        if (cap > 4 * TKV_FAST_FRAG_BYTES) {
            free(buf);
            buf = NULL;
            cap = 0;
        }
    }
    free(buf);
    free(lean);
    pthread_mutex_lock(&f->mu);
    c->ended = true;
    pthread_mutex_unlock(&f->mu);
    c->done(c->done_arg, c->client_id); /* the attach thread closes fd and releases leases */
    return NULL;
}

int tkvd_fast_serve(tkvd_fast *f, int fd, uint64_t client_id,
                    void (*done)(void *arg, uint64_t client_id), void *arg)
{
    int fl = fcntl(fd, F_GETFL);
    if (fl < 0 || fcntl(fd, F_SETFL, fl & ~O_NONBLOCK) != 0)
        return -1;
    fconn *c = tkv_xcalloc(1, sizeof(*c));
    *c = (fconn){.f = f, .fd = fd, .client_id = client_id, .done = done, .done_arg = arg};
    pthread_mutex_lock(&f->mu);
    /* Reap the threads that ended, so a long-lived daemon does not collect their stacks. */
    fconn *ended = NULL;
    for (fconn **pp = &f->conns; *pp;) {
        fconn *e = *pp;
        if (e->ended) {
            *pp = e->next;
            e->next = ended;
            ended = e;
        } else {
            pp = &e->next;
        }
    }
    int rc = -1;
    if (!f->stopping && pthread_create(&c->thread, NULL, serve_main, c) == 0) {
        c->next = f->conns;
        f->conns = c;
        rc = 0;
    }
    pthread_mutex_unlock(&f->mu);
    if (rc != 0)
        free(c);
    while (ended) {
        fconn *next = ended->next;
        pthread_join(ended->thread, NULL);
        free(ended);
        ended = next;
    }
    return rc;
}

void tkvd_fast_stop(tkvd_fast *f)
{
    if (!f)
        return;
    pthread_mutex_lock(&f->mu);
    f->stopping = true;
    for (fconn *c = f->conns; c; c = c->next)
        if (!c->ended) /* the fd stays open until done(), which comes after ended */
            shutdown(c->fd, SHUT_RDWR);
    fconn *list = f->conns;
    f->conns = NULL;
    pthread_mutex_unlock(&f->mu);
    while (list) {
        fconn *next = list->next;
        pthread_join(list->thread, NULL);
        free(list);
        list = next;
    }
    pthread_mutex_destroy(&f->mu);
    free(f);
}

void tkvd_fast_enable(tkvd_service *svc)
{
    if (!svc->attach)
        return;
    tkvd_fast *f = tkv_xcalloc(1, sizeof(*f));
    f->svc = svc;
    f->max_recv = tkvd_service_max_recv_bytes(svc->cfg);
    pthread_mutex_init(&f->mu, NULL);
    tkvd_attach_serve_fast(svc->attach, f);
}
