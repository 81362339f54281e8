/* attach.c - the attach socket: memfd hand-over and connection-scoped leases
 * (see tkvd_attach.h and proto/tkv_attach.h). */
#include "tkvd_attach.h"

#include <errno.h>
#include <poll.h>
#include <stdarg.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "tkv_attach.h"
#include "tkv_base.h"
#include "tkvd_fastpath.h"

#define kHelloTimeoutNs (5ull * 1000000000ull) /* a silent connection is dropped after 5 s */
#define kMaxConns 4096

typedef struct conn {
    int fd;
    uint64_t client_id;   /* 0 until the hello was accepted */
    uint64_t opened_ns;
    bool fast;            /* its fast-path thread reads it: not polled here */
} conn;

struct tkvd_attach {
    char *path;
    int listen_fd, wake_fd;
    tkv_store *store;
    uint8_t fp[32];
    tkvd_metrics *metrics;
    pthread_t thread;
    atomic_bool stop;
    pthread_mutex_t mu;   /* guards conns/num_conns for tkvd_attach_client_live */
    conn *conns;
    size_t num_conns, cap_conns;
    uint64_t next_id;
    bool allow_writable;  /* trusted peers (same uid or root) may map L2 writable */
    bool have_gpu;
    tkv_attach_gpu *gpu;  /* per L1 region: its message, sent after the reply to a client of
                           * a tenant in it (num_chunks 0: an empty region, no L1) */
    unsigned num_gpu;
    const tkvd_tenants *tenants; /* NULL or empty: no tenants */
    tkvd_fast *fast;      /* serves fast-path connections; NULL = none offered */
    uint64_t *fast_done;  /* client ids whose fast connection ended (guarded by mu) */
    size_t num_fast_done, cap_fast_done;
};

void tkvd_attach_set_tenants(tkvd_attach *a, const tkvd_tenants *t)
{
    pthread_mutex_lock(&a->mu);
    a->tenants = t;
    pthread_mutex_unlock(&a->mu);
}

void tkvd_attach_serve_fast(tkvd_attach *a, tkvd_fast *f)
{
    pthread_mutex_lock(&a->mu);
    a->fast = f;
    pthread_mutex_unlock(&a->mu);
}

/* A fast-path thread finished with its connection: the attach thread closes it. */
static void fast_done(void *arg, uint64_t client_id)
{
    tkvd_attach *a = arg;
    pthread_mutex_lock(&a->mu);
    if (a->num_fast_done == a->cap_fast_done) {
        a->cap_fast_done = a->cap_fast_done ? 2 * a->cap_fast_done : 16;
        a->fast_done = tkv_xrealloc(a->fast_done, a->cap_fast_done * sizeof(*a->fast_done));
    }
    a->fast_done[a->num_fast_done++] = client_id;
    pthread_mutex_unlock(&a->mu);
    uint64_t one = 1;
    if (write(a->wake_fd, &one, sizeof(one)) != sizeof(one))
        TKV_LOG(TKV_LOG_WARN, "attach: wake-up write failed: %s", strerror(errno));
}

void tkvd_attach_allow_writable(tkvd_attach *a, bool on)
{
    pthread_mutex_lock(&a->mu);
    a->allow_writable = on;
    pthread_mutex_unlock(&a->mu);
}

void tkvd_attach_offer_gpu(tkvd_attach *a, const tkv_attach_gpu *gpu, unsigned num_regions)
{
    tkv_attach_gpu *copy = tkv_xmalloc((num_regions ? num_regions : 1) * sizeof(*copy));
    memcpy(copy, gpu, num_regions * sizeof(*copy));
    pthread_mutex_lock(&a->mu);
    free(a->gpu);
    a->gpu = copy;
    a->num_gpu = num_regions;
    a->have_gpu = num_regions > 0;
    pthread_mutex_unlock(&a->mu);
}

bool tkvd_attach_client_live(tkvd_attach *a, uint64_t client_id)
{
    if (!client_id)
        return false;
    bool live = false;
    pthread_mutex_lock(&a->mu);
    for (size_t i = 0; i < a->num_conns && !live; i++)
        live = a->conns[i].client_id == client_id;
    pthread_mutex_unlock(&a->mu);
    return live;
}

/* Sends a reply; with the memfd of the tenant's L2 region attached when status is OK. */
static int send_reply(tkvd_attach *a, int fd, const tkv_attach_reply *rep, bool with_fd,
                      unsigned store_tenant)
{
    struct iovec iov = {.iov_base = (void *)rep, .iov_len = sizeof(*rep)};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1};
    if (with_fd) {
        memset(&ctl, 0, sizeof(ctl));
        mh.msg_control = ctl.buf;
        mh.msg_controllen = sizeof(ctl.buf);
        struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
        cm->cmsg_level = SOL_SOCKET;
        cm->cmsg_type = SCM_RIGHTS;
        cm->cmsg_len = CMSG_LEN(sizeof(int));
        int rw = -1, ro = -1;
        tkv_store_l2_region(a->store, store_tenant, NULL, NULL, &rw, &ro);
        int memfd = (rep->flags & TKV_ATTACH_F_WRITABLE) ? rw : ro;
        memcpy(CMSG_DATA(cm), &memfd, sizeof(int));
    }
    ssize_t n = sendmsg(fd, &mh, MSG_NOSIGNAL | MSG_DONTWAIT);
    return n == (ssize_t)sizeof(*rep) ? 0 : -1;
}

static void reject(tkvd_attach *a, int fd, int status, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
static void reject(tkvd_attach *a, int fd, int status, const char *fmt, ...)
{
    tkv_attach_reply rep;
    memset(&rep, 0, sizeof(rep));
    rep.magic = TKV_ATTACH_MAGIC;
    rep.status = status;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(rep.message, sizeof(rep.message), fmt, ap);
    va_end(ap);
    TKV_LOG(TKV_LOG_INFO, "attach: refused a client: %s", rep.message);
    send_reply(a, fd, &rep, false, 0);
}

/* Handles the hello on conns[i]. Returns false if the connection must be closed. */
static bool on_hello(tkvd_attach *a, size_t i)
{
    conn *c = &a->conns[i];
    tkv_attach_hello h;
    ssize_t n = recv(c->fd, &h, sizeof(h), MSG_DONTWAIT | MSG_TRUNC);
    if (n == 0)
        return false;
    if (n < 0)
        return errno == EAGAIN || errno == EINTR;
    if (n != (ssize_t)sizeof(h)) {
        reject(a, c->fd, TKV_EINVAL, "hello has %zd bytes, expected %zu", n, sizeof(h));
        return false;
    }
    if (h.magic != TKV_ATTACH_MAGIC) {
        reject(a, c->fd, TKV_EINVAL, "bad magic 0x%08x (expected 0x%08x)", h.magic, TKV_ATTACH_MAGIC);
        return false;
    }
    if (h.version != TKV_ATTACH_VERSION) {
        reject(a, c->fd, TKV_EUNSUPPORTED, "protocol version %u not supported (daemon speaks %u)",
               h.version, TKV_ATTACH_VERSION);
        return false;
    }
    const uint32_t known = TKV_ATTACH_HELLO_WRITABLE | TKV_ATTACH_HELLO_FAST;
    if (h.flags & ~known) {
        reject(a, c->fd, TKV_EINVAL, "unknown hello flags 0x%x", h.flags & ~known);
        return false;
    }
    uint64_t tag = 0;
    unsigned store_tenant = 0;   /* whose L2 region the client maps */
    bool may_l1 = true;          /* may map its L1 region (read-write: CUDA IPC has no other) */
    pthread_mutex_lock(&a->mu);
    const tkvd_tenants *ts = a->tenants;
    pthread_mutex_unlock(&a->mu);
    if (tkvd_tenants_enabled(ts)) {
        struct ucred cred;
        socklen_t cl = sizeof(cred);
        if (getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0) {
            reject(a, c->fd, TKV_EIO, "cannot read the peer's credentials: %s", strerror(errno));
            return false;
        }
        tkvd_identity peer = {.has_ucred = true, .uid = cred.uid, .gid = cred.gid, .pid = cred.pid};
        const tkvd_tenant *t = tkvd_tenant_of_peer(ts, &peer);
        if (!t) {
            atomic_fetch_add_explicit(&a->metrics->tenant_denied[0], 1, memory_order_relaxed);
            reject(a, c->fd, TKV_EINVAL, "uid %u / gid %u is no tenant of this daemon",
                   (unsigned)cred.uid, (unsigned)cred.gid);
            return false;
        }
        /* Every tenant maps its own L2 region only (a memfd of its own: no offset reaches
         * another's bytes), and its own L1 region only (an allocation of its own, the only
         * handle it is sent), that one only when map_pool: CUDA IPC maps read-write, so the
         * tenant's engines must be trusted with its L1 blocks. */
        may_l1 = t->map_pool;
        store_tenant = tkvd_tenant_store_id(t);
        tag = tkvd_tenant_tag(t);
    }
    int region_fd = -1;
    tkv_store_l2_region(a->store, store_tenant, NULL, NULL, NULL, &region_fd);
    if (region_fd < 0) { /* an empty region (the config gives every tenant one): nothing to map */
        reject(a, c->fd, TKV_EUNSUPPORTED, "no L2 region to map for this caller");
        return false;
    }
    bool writable = false;
    if (h.flags & TKV_ATTACH_HELLO_WRITABLE) {
        struct ucred cred;
        socklen_t cl = sizeof(cred);
        pthread_mutex_lock(&a->mu);
        bool allowed = a->allow_writable;
        pthread_mutex_unlock(&a->mu);
        if (!allowed || getsockopt(c->fd, SOL_SOCKET, SO_PEERCRED, &cred, &cl) != 0 ||
            (cred.uid != 0 && cred.uid != getuid())) {
            reject(a, c->fd, TKV_EINVAL, "a writable pool mapping is only for trusted engines "
                   "(the daemon's own user, with attach_writable on)");
            return false;
        }
        writable = true;
    }
    if (memcmp(h.fingerprint, a->fp, sizeof(a->fp)) != 0) {
        reject(a, c->fd, TKV_EGEOMETRY, "geometry mismatch: the client's fingerprint differs "
               "from the daemon's");
        return false;
    }
    tkv_attach_reply rep;
    memset(&rep, 0, sizeof(rep));
    rep.magic = TKV_ATTACH_MAGIC;
    rep.status = TKV_OK;
    /* The id is live and counted before the client can learn it: a Lookup or Stats sent
     * right after the reply must find its owner registered and itself connected. */
    pthread_mutex_lock(&a->mu);
    rep.client_id = tag | (a->next_id++ & ((UINT64_C(1) << TKVD_OWNER_TAG_SHIFT) - 1));
    c->client_id = rep.client_id;
    pthread_mutex_unlock(&a->mu);
    atomic_fetch_add_explicit(&a->metrics->clients_connected, 1, memory_order_relaxed);
    tkv_store_l2_region(a->store, store_tenant, NULL, &rep.l2_bytes, NULL, NULL);
    rep.block_bytes = tkv_store_block_bytes(a->store);
    rep.block_tokens = tkv_store_block_tokens(a->store);
    pthread_mutex_lock(&a->mu);
    unsigned l1_region = 0;
    bool gpu = a->have_gpu && may_l1 &&
               tkv_store_l1_region(a->store, store_tenant, &l1_region) == TKV_OK &&
               l1_region < a->num_gpu && a->gpu[l1_region].num_chunks > 0;
    tkv_attach_gpu gmsg;
    if (gpu)
        gmsg = a->gpu[l1_region];
    tkvd_fast *fast = (h.flags & TKV_ATTACH_HELLO_FAST) ? a->fast : NULL;
    pthread_mutex_unlock(&a->mu);
    rep.flags = (gpu ? TKV_ATTACH_F_L1 : 0) | (writable ? TKV_ATTACH_F_WRITABLE : 0) |
                (fast ? TKV_ATTACH_F_FAST : 0);
    if (send_reply(a, c->fd, &rep, true, store_tenant) != 0 ||
        (gpu && send(c->fd, &gmsg, sizeof(gmsg), MSG_NOSIGNAL | MSG_DONTWAIT) !=
                    (ssize_t)sizeof(gmsg))) {
        TKV_LOG(TKV_LOG_INFO, "attach: could not answer pid %u: %s", h.pid, strerror(errno));
        pthread_mutex_lock(&a->mu);
        c->client_id = 0; /* the client never learnt it: close_conn must not uncount it */
        pthread_mutex_unlock(&a->mu);
        atomic_fetch_sub_explicit(&a->metrics->clients_connected, 1, memory_order_relaxed);
        return false;
    }
    atomic_fetch_add_explicit(&a->metrics->clients_total, 1, memory_order_relaxed);
    if (fast) {
        if (tkvd_fast_serve(fast, c->fd, rep.client_id, fast_done, a) != 0) {
            TKV_LOG(TKV_LOG_WARN, "attach: no fast-path thread for pid %u; closing", h.pid);
            return false;
        }
        c->fast = true;
    }
    TKV_LOG(TKV_LOG_INFO, "attach: client %llu (pid %u) attached", (unsigned long long)rep.client_id,
            h.pid);
    return true;
}

static void close_conn(tkvd_attach *a, size_t i)
{
    pthread_mutex_lock(&a->mu);
    conn c = a->conns[i];
    a->conns[i] = a->conns[--a->num_conns];
    pthread_mutex_unlock(&a->mu);
    close(c.fd);
    if (c.client_id) {
        size_t n = tkv_store_release_owner(a->store, c.client_id);
        atomic_fetch_sub_explicit(&a->metrics->clients_connected, 1, memory_order_relaxed);
        TKV_LOG(TKV_LOG_INFO, "attach: client %llu detached; %zu leases/allocations released",
                (unsigned long long)c.client_id, n);
    }
}

/* Closes the connections whose fast-path thread ended (only this thread closes). */
static void close_fast_done(tkvd_attach *a)
{
    pthread_mutex_lock(&a->mu);
    uint64_t *ids = a->fast_done;
    size_t num = a->num_fast_done;
    a->fast_done = NULL;
    a->num_fast_done = a->cap_fast_done = 0;
    pthread_mutex_unlock(&a->mu);
    for (size_t j = 0; j < num; j++)
        for (size_t i = a->num_conns; i-- > 0;)
            if (a->conns[i].fast && a->conns[i].client_id == ids[j]) {
                close_conn(a, i);
                break;
            }
    free(ids);
}

static void accept_new(tkvd_attach *a)
{
    for (;;) {
        int fd = accept4(a->listen_fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
        if (fd < 0) {
            if (errno != EAGAIN && errno != EINTR && errno != ECONNABORTED)
                TKV_LOG(TKV_LOG_WARN, "attach: accept: %s", strerror(errno));
            return;
        }
        if (a->num_conns >= kMaxConns) {
            reject(a, fd, TKV_ENOMEM, "too many attached clients (%d)", kMaxConns);
            close(fd);
            continue;
        }
        pthread_mutex_lock(&a->mu);
        if (a->num_conns == a->cap_conns) {
            a->cap_conns = a->cap_conns ? 2 * a->cap_conns : 16;
            a->conns = tkv_xrealloc(a->conns, a->cap_conns * sizeof(*a->conns));
        }
        a->conns[a->num_conns++] = (conn){.fd = fd, .client_id = 0, .opened_ns = tkv_now_ns()};
        pthread_mutex_unlock(&a->mu);
    }
}

static void *attach_main(void *arg)
{
    tkvd_attach *a = arg;
    struct pollfd *pfds = NULL;
    size_t cap = 0;
    while (!atomic_load(&a->stop)) {
        /* Only this thread changes the set, so reading num_conns unlocked here is safe. */
        size_t n = a->num_conns;
        if (cap < n + 2) {
            cap = 2 * (n + 2);
            pfds = tkv_xrealloc(pfds, cap * sizeof(*pfds));
        }
        pfds[0] = (struct pollfd){.fd = a->listen_fd, .events = POLLIN};
        pfds[1] = (struct pollfd){.fd = a->wake_fd, .events = POLLIN};
        for (size_t i = 0; i < n; i++) /* a negative fd is skipped by poll */
            pfds[i + 2] = (struct pollfd){.fd = a->conns[i].fast ? -1 : a->conns[i].fd,
                                          .events = POLLIN};
        int rc = poll(pfds, n + 2, 1000);
        if (rc < 0 && errno != EINTR) {
            TKV_LOG(TKV_LOG_ERROR, "attach: poll: %s", strerror(errno));
            break;
        }
        if (rc > 0 && (pfds[1].revents & POLLIN)) {
            uint64_t v;
            if (read(a->wake_fd, &v, sizeof(v)) < 0 && errno != EAGAIN)
                TKV_LOG(TKV_LOG_WARN, "attach: wake-up read failed: %s", strerror(errno));
        }
        close_fast_done(a);
        uint64_t now = tkv_now_ns();
        /* Walk backwards: close_conn moves the last entry into the freed slot. */
        for (size_t i = n; i-- > 0;) {
            conn *c = &a->conns[i];
            short re = rc > 0 ? pfds[i + 2].revents : 0;
            bool keep = true;
            if (c->fast) {
                /* its thread owns it until fast_done */
            } else if (c->client_id == 0) {
                if (re & POLLIN)
                    keep = on_hello(a, i);
                else if (re & (POLLHUP | POLLERR | POLLNVAL))
                    keep = false;
                else if (now - c->opened_ns > kHelloTimeoutNs) {
                    reject(a, c->fd, TKV_ETIMEDOUT, "no hello within 5 s");
                    keep = false;
                }
            } else if (re & (POLLIN | POLLHUP | POLLERR | POLLNVAL)) {
                /* Attached connections are silent: anything readable is EOF or a protocol
                 * violation; either way the client is done. */
                char b;
                ssize_t got = recv(c->fd, &b, 1, MSG_DONTWAIT);
                keep = got < 0 && (errno == EAGAIN || errno == EINTR) && !(re & (POLLHUP | POLLERR));
            }
            if (!keep)
                close_conn(a, i);
        }
        if (rc > 0 && (pfds[0].revents & POLLIN))
            accept_new(a);
    }
    free(pfds);
    /* The fast-path threads go first: they read connections that are closed below. */
    tkvd_fast_stop(a->fast);
    a->fast = NULL;
    while (a->num_conns)
        close_conn(a, a->num_conns - 1);
    return NULL;
}

int tkvd_attach_start(const char *path, tkv_store *store, const uint8_t fingerprint[32],
                      tkvd_metrics *metrics, tkvd_attach **out)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(path) >= sizeof(sa.sun_path)) {
        TKV_LOG(TKV_LOG_ERROR, "attach: socket path too long: %s", path);
        return TKV_EINVAL;
    }
    memcpy(sa.sun_path, path, strlen(path) + 1);
    tkvd_attach *a = tkv_xcalloc(1, sizeof(*a));
    a->path = tkv_xstrdup(path);
    a->store = store;
    memcpy(a->fp, fingerprint, 32);
    a->metrics = metrics;
    /* Client ids start high and differ per daemon start, so an id from a previous daemon
     * life does not name a new client by accident. */
    a->next_id = ((tkv_wall_ms() & 0xffffffu) << 24) | 1u;
    pthread_mutex_init(&a->mu, NULL);
    a->wake_fd = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
    a->listen_fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
    if (a->wake_fd < 0 || a->listen_fd < 0) {
        TKV_LOG(TKV_LOG_ERROR, "attach: socket: %s", strerror(errno));
        goto fail;
    }
    unlink(path); /* a stale socket of a dead daemon (the pid file proved it dead) */
    if (bind(a->listen_fd, (struct sockaddr *)&sa, sizeof(sa)) != 0 || listen(a->listen_fd, 128) != 0) {
        TKV_LOG(TKV_LOG_ERROR, "attach: cannot listen on %s: %s", path, strerror(errno));
        goto fail;
    }
    if (pthread_create(&a->thread, NULL, attach_main, a) != 0) {
        TKV_LOG(TKV_LOG_ERROR, "attach: cannot start its thread");
        unlink(path);
        goto fail;
    }
    TKV_LOG(TKV_LOG_INFO, "attach: listening on %s", path);
    *out = a;
    return TKV_OK;
fail:
    if (a->listen_fd >= 0)
        close(a->listen_fd);
    if (a->wake_fd >= 0)
        close(a->wake_fd);
    pthread_mutex_destroy(&a->mu);
    free(a->path);
    free(a);
    return TKV_EIO;
}

void tkvd_attach_stop(tkvd_attach *a)
{
    if (!a)
        return;
    atomic_store(&a->stop, true);
    uint64_t one = 1;
    if (write(a->wake_fd, &one, sizeof(one)) != sizeof(one))
        TKV_LOG(TKV_LOG_WARN, "attach: wake-up write failed: %s", strerror(errno));
    pthread_join(a->thread, NULL);
    close(a->listen_fd);
    close(a->wake_fd);
    unlink(a->path);
    free(a->conns);
    free(a->fast_done);
    free(a->gpu);
    pthread_mutex_destroy(&a->mu);
    free(a->path);
    free(a);
}
