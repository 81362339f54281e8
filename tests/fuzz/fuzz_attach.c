/* fuzz_attach.c - the attach handshake (daemon/attach.c's on_hello, reached by including the
 * source) on arbitrary hello messages over a real SOCK_SEQPACKET socket pair, with and
 * without tenants: every input is refused with a reply or answered with the pool descriptor,
 * never a crash, a leak (descriptors included) or undefined behaviour.
 *
 * Input: byte 0 bit 0 = tenants on (the caller's uid is tenant "me", map_pool per bit 1);
 * the rest is the hello message. */
#include "../../daemon/attach.c"

#include <sys/socket.h>

static tkv_store *g_store;
static tkvd_metrics g_metrics;
static tkvd_tenants g_tenants, g_tenants_nomap;
static uint8_t g_fp[32];

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    tkv_log_level = -1;
    tkv_store_opts *o = tkv_store_opts_new();
    tkv_store_opts_set_block(o, 4096, 16);
    for (int i = 0; i < 32; i++)
        g_fp[i] = (uint8_t)(0x40 + i); /* "@AB...": easy for the fuzzer to find */
    tkv_store_opts_set_fingerprint(o, g_fp);
    tkv_store_opts_set_l2_blocks(o, 16);
    tkv_store_opts_set_workers(o, 1);
    if (tkv_store_open(o, &g_store) != TKV_OK)
        abort();
    tkv_store_opts_free(o);
    tkvd_metrics_init(&g_metrics);
    char uid[32], err[256];
    snprintf(uid, sizeof(uid), "%u", (unsigned)getuid());
    if (tkvd_tenants_set(&g_tenants, "me", "uid", uid, "fuzz", err, sizeof(err)) != TKV_OK ||
        tkvd_tenants_set(&g_tenants, "me", "map_pool", "on", "fuzz", err, sizeof(err)) != TKV_OK ||
        tkvd_tenants_set(&g_tenants_nomap, "me", "uid", uid, "fuzz", err, sizeof(err)) != TKV_OK)
        abort();
    return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    if (n < 1)
        return 0;
    int sv[2];
    if (socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, sv) != 0)
        abort();
    tkvd_attach a;
    memset(&a, 0, sizeof(a));
    a.store = g_store;
    memcpy(a.fp, g_fp, 32);
    a.metrics = &g_metrics;
    a.next_id = 1;
    a.allow_writable = true;
    pthread_mutex_init(&a.mu, NULL);
    if (data[0] & 1)
        a.tenants = (data[0] & 2) ? &g_tenants : &g_tenants_nomap;
    a.conns = tkv_xcalloc(1, sizeof(*a.conns));
    a.cap_conns = 1;
    a.num_conns = 1;
    a.conns[0] = (conn){.fd = sv[1], .client_id = 0, .opened_ns = tkv_now_ns()};
    if (send(sv[0], data + 1, n - 1, MSG_DONTWAIT) != (ssize_t)(n - 1))
        abort();
    bool kept = on_hello(&a, 0);
    /* Whatever came back: a reply, with at most one descriptor, and only when accepted. */
    tkv_attach_reply rep;
    union {
        char buf[CMSG_SPACE(4 * sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {.iov_base = &rep, .iov_len = sizeof(rep)};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                        .msg_controllen = sizeof(ctl.buf)};
    ssize_t got = recvmsg(sv[0], &mh, MSG_DONTWAIT | MSG_CMSG_CLOEXEC);
    int num_fds = 0;
    for (struct cmsghdr *cm = got > 0 ? CMSG_FIRSTHDR(&mh) : NULL; cm; cm = CMSG_NXTHDR(&mh, cm)) {
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS) {
            int k = (int)((cm->cmsg_len - CMSG_LEN(0)) / sizeof(int));
            for (int i = 0; i < k; i++) {
                int fd;
                memcpy(&fd, CMSG_DATA(cm) + i * sizeof(int), sizeof(int));
                close(fd);
                num_fds++;
            }
        }
    }
    if (got >= 0 && got != 0 && got != (ssize_t)sizeof(rep))
        abort();
    if (got == (ssize_t)sizeof(rep) && (rep.status == TKV_OK) != (num_fds == 1))
        abort(); /* a descriptor only with an accepted hello, and always then */
    if (got == (ssize_t)sizeof(rep) && rep.status == TKV_OK && !kept)
        abort();
    if (kept && a.conns[0].client_id == 0 && got > 0)
        abort();
    close_conn(&a, 0); /* closes sv[1], releases the client's leases */
    close(sv[0]);
    free(a.conns);
    pthread_mutex_destroy(&a.mu);
    return 0;
}
