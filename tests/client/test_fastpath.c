/* test_fastpath.c - the attach connection's fast path against a real tierkvd:
 *
 *   1. clients killed with SIGKILL in the middle of their calls (a lookup holding leases,
 *      a multi-record Put, an open allocation, a prefetch wait) leave 0 leases behind, and
 *      the daemon keeps serving;
 *   2. the protocol itself, spoken raw on the attach socket: an unknown call, a lean lookup
 *      whose lengths do not add up, a scope naming another client, a malformed protobuf
 *      request are each answered with their status and the connection stays; a record with
 *      a bad magic or an announced length over the limit ends the connection.
 * (The 32-client load over the fast path is client_test_load --fast.)
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>

#include "harness.h"
#include "tkv_attach.h"
#include "tkv_fast.h"

#define BT TKVT_BLOCK_TOKENS
#define CHECK(cond, ...)                                                                  \
    do {                                                                                  \
        if (!(cond)) {                                                                    \
            fprintf(stderr, "fastpath: %s:%d: ", __FILE__, __LINE__);                     \
            fprintf(stderr, __VA_ARGS__);                                                 \
            fprintf(stderr, "\n");                                                        \
            goto fail;                                                                    \
        }                                                                                 \
    } while (0)

static tkvt_daemon g_d;

/* ---- 1. killed clients ------------------------------------------------------------------------ */

/* The child: attach, then loop over calls that hold daemon state until killed. Writes one
 * byte to ready_fd once it is well into its loop. */
static void child_main(int ready_fd, int mode)
{
    kvc_client *c;
    if (tkvt_connect(&g_d, 1, &c) != KVC_OK)
        _exit(2);
    size_t bb = kvc_block_bytes(c);
    enum { kBlocks = 40 }; /* 40 x 2 KiB: a Put of several records */
    uint32_t *tokens = malloc(kBlocks * BT * sizeof(uint32_t));
    uint8_t *payload = malloc(kBlocks * bb);
    for (int i = 0; i < kBlocks; i++)
        tkvt_payload(7, (uint32_t)i, payload + (size_t)i * bb, bb);
    for (unsigned long n = 0;; n++) {
        tkvt_tokens(1000 + n % 64, tokens, kBlocks * BT);
        kvc_lease *l;
        if (kvc_put(c, tokens, kBlocks * BT, 0, payload, kBlocks, NULL) != KVC_OK ||
            kvc_lookup(c, tokens, kBlocks * BT, 60000, &l) != KVC_OK)
            _exit(3);
        if (mode == 1 && kvc_lease_num_blocks(l) > 0)
            kvc_wait(c, l, KVC_TIER_L2, 1000);
        uint64_t id;
        if (kvc_alloc(c, 4, &id, NULL) != KVC_OK) /* left open: the daemon must abort it */
            _exit(4);
        /* leases are kept (never released): only the death of the client ends them */
        if (n == 20 && write(ready_fd, "x", 1) != 1)
            _exit(5);
    }
}

static int test_kill(void)
{
    for (int round = 0; round < 4; round++) {
        int p[2];
        if (pipe(p) != 0)
            return -1;
        pid_t pid = fork();
        if (pid == 0) {
            close(p[0]);
            child_main(p[1], round % 2);
        }
        close(p[1]);
        char b;
        if (read(p[0], &b, 1) != 1) {
            fprintf(stderr, "fastpath: child %d never got going\n", round);
            close(p[0]);
            return -1;
        }
        close(p[0]);
        tkvt_sleep_ms(3 + 7 * round); /* somewhere inside a call */
        kill(pid, SIGKILL);
        waitpid(pid, NULL, 0);
    }
    /* the parent's first gRPC use comes after the forks (gRPC does not survive fork) */
    kvc_client *c = NULL;
    if (tkvt_connect(&g_d, 0, &c) != KVC_OK) {
        fprintf(stderr, "fastpath: connect after the kills: %s\n", kvc_last_error());
        return -1;
    }
    kvc_stats st;
    int rc = -1;
    for (double until = tkvt_now() + 10; tkvt_now() < until; tkvt_sleep_ms(20))
        if (kvc_stats_get(c, &st) == KVC_OK && st.leases_active == 0 && st.clients_connected == 0)
            break;
    CHECK(kvc_stats_get(c, &st) == KVC_OK, "stats: %s", kvc_last_error());
    CHECK(st.leases_active == 0, "%llu leases left by killed clients",
          (unsigned long long)st.leases_active);
    CHECK(st.clients_connected == 0, "%llu clients still counted", (unsigned long long)st.clients_connected);
    /* still serving: a fresh attached client finds what the dead ones put */
    kvc_client *a = NULL;
    CHECK(tkvt_connect(&g_d, 1, &a) == KVC_OK, "attach after the kills: %s", kvc_last_error());
    uint32_t tokens[40 * BT];
    tkvt_tokens(1000, tokens, 40 * BT);
    kvc_lease *l;
    CHECK(kvc_lookup(a, tokens, 40 * BT, 0, &l) == KVC_OK, "lookup: %s", kvc_last_error());
    CHECK(kvc_lease_num_blocks(l) == 40, "the dead clients' blocks: %u of 40 found",
          kvc_lease_num_blocks(l));
    size_t bb = kvc_block_bytes(a);
    uint8_t *got = malloc(40 * bb), *want = malloc(bb);
    int exact = kvc_get(a, l, 0, 40, got, 40 * bb) == KVC_OK;
    for (uint32_t i = 0; exact && i < 40; i++) {
        tkvt_payload(7, i, want, bb);
        exact = memcmp(want, got + (size_t)i * bb, bb) == 0;
    }
    free(got);
    free(want);
    kvc_release(a, l);
    CHECK(exact, "blocks read back differ");
    printf("fastpath: 4 clients killed mid-call: 0 leases left, daemon serving\n");
    rc = 0;
fail:
    kvc_close(a);
    kvc_close(c);
    return rc;
}

/* ---- 2. the protocol, raw ------------------------------------------------------------------------ */

/* Attaches by hand with the fast path asked for; returns the socket and the client id. */
static int raw_attach(const uint8_t fp[32], uint64_t *client_id)
{
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    if (strlen(g_d.attach) >= sizeof(sa.sun_path))
        return -1;
    memcpy(sa.sun_path, g_d.attach, strlen(g_d.attach) + 1);
    if (fd < 0 || connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0)
        return -1;
    tkv_attach_hello h = {.magic = TKV_ATTACH_MAGIC, .version = TKV_ATTACH_VERSION,
                          .flags = TKV_ATTACH_HELLO_FAST, .pid = (uint32_t)getpid()};
    memcpy(h.fingerprint, fp, 32);
    tkv_attach_reply rep;
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctl;
    struct iovec iov = {&rep, sizeof(rep)};
    struct msghdr mh = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = ctl.buf,
                        .msg_controllen = sizeof(ctl.buf)};
    if (send(fd, &h, sizeof(h), 0) != sizeof(h) || recvmsg(fd, &mh, 0) != sizeof(rep) ||
        rep.status != 0 || !(rep.flags & TKV_ATTACH_F_FAST)) {
        close(fd);
        return -1;
    }
    struct cmsghdr *cm = CMSG_FIRSTHDR(&mh);
    if (cm && cm->cmsg_type == SCM_RIGHTS) {
        int memfd;
        memcpy(&memfd, CMSG_DATA(cm), sizeof(int));
        close(memfd);
    }
    *client_id = rep.client_id;
    return fd;
}

/* One call: returns the reply's status (-1: the connection ended). */
static int raw_call(int fd, uint16_t op, uint16_t flags, const void *p, size_t len)
{
    static uint8_t *buf;
    static size_t cap;
    tkv_fast_hdr h;
    size_t got = 0;
    char why[160];
    if (!tkv_fast_send(fd, op, flags, 0, 0, p, len) ||
        tkv_fast_recv(fd, &h, &buf, &cap, 1u << 20, &got, why, sizeof(why)) != 1)
        return -1;
    return h.status;
}

/* A lean single-prompt lookup of n_tokens tokens, with client_id in its scope. */
static size_t lean_lookup(uint8_t *out, const uint8_t fp[32], uint64_t client_id, uint32_t n_tokens)
{
    tkv_fast_lookup_hdr h = {.client_id = client_id, .num_prompts = 1};
    memcpy(h.fingerprint, fp, 32);
    memcpy(out, &h, sizeof(h));
    memcpy(out + sizeof(h), &n_tokens, 4);
    uint32_t *t = (uint32_t *)(void *)(out + sizeof(h) + 4);
    tkvt_tokens(5, t, n_tokens);
    return sizeof(h) + 4 + 4 * (size_t)n_tokens;
}

static int hexval(char ch) { return ch <= '9' ? ch - '0' : ch - 'a' + 10; }

static int test_protocol(void)
{
    kvc_client *c = NULL;
    int fd = -1, fd2 = -1, rc = -1;
    if (tkvt_connect(&g_d, 0, &c) != KVC_OK)
        return -1;
    char hex[65];
    uint8_t fp[32];
    kvc_fingerprint_hex(c, hex);
    for (int i = 0; i < 32; i++)
        fp[i] = (uint8_t)(hexval(hex[2 * i]) << 4 | hexval(hex[2 * i + 1]));
    uint64_t id = 0, id2 = 0;
    fd = raw_attach(fp, &id);
    fd2 = raw_attach(fp, &id2);
    CHECK(fd >= 0 && fd2 >= 0, "raw attach failed");
    static uint8_t msg[64 * 1024];
    size_t n = lean_lookup(msg, fp, id, 4 * BT);
    CHECK(raw_call(fd, TKV_FAST_LOOKUP, TKV_FAST_LEAN, msg, n) == 0, "a valid lean lookup failed");
    CHECK(raw_call(fd, 99, 0, "", 0) == 12, "unknown call: not UNIMPLEMENTED");
    CHECK(raw_call(fd, TKV_FAST_LOOKUP, TKV_FAST_LEAN, msg, n - 4) == 3,
          "lean lookup with a short token array: not INVALID_ARGUMENT");
    n = lean_lookup(msg, fp, id2, 4 * BT);
    CHECK(raw_call(fd, TKV_FAST_LOOKUP, TKV_FAST_LEAN, msg, n) == 3,
          "a scope naming another connection's client: not INVALID_ARGUMENT");
    CHECK(raw_call(fd, TKV_FAST_LOOKUP, 0, "\xff\xff\xff", 3) == 3,
          "malformed protobuf: not INVALID_ARGUMENT");
    fp[0] ^= 1;
    n = lean_lookup(msg, fp, id, 4 * BT);
    fp[0] ^= 1;
    CHECK(raw_call(fd, TKV_FAST_LOOKUP, TKV_FAST_LEAN, msg, n) == 9,
          "wrong fingerprint: not FAILED_PRECONDITION");
    n = lean_lookup(msg, fp, id, 4 * BT);
    CHECK(raw_call(fd, TKV_FAST_LOOKUP, TKV_FAST_LEAN, msg, n) == 0,
          "the connection did not survive answered errors");
    /* a record with a bad magic ends the connection */
    tkv_fast_hdr bad = {.magic = 0x12345678, .op = TKV_FAST_LOOKUP};
    CHECK(send(fd, &bad, sizeof(bad), 0) == sizeof(bad), "send");
    char b[256];
    ssize_t got;
    while ((got = recv(fd, b, sizeof(b), 0)) > 0) {
    }
    CHECK(got == 0, "bad magic: the connection stays open");
    /* so does a message announced larger than the daemon's limit */
    tkv_fast_hdr big = {.magic = TKV_FAST_MAGIC, .op = TKV_FAST_PUT, .len = 0x7fffffffu,
                        .flags = TKV_FAST_MORE};
    CHECK(send(fd2, &big, sizeof(big), 0) == sizeof(big), "send");
    while ((got = recv(fd2, b, sizeof(b), 0)) > 0) {
    }
    CHECK(got == 0, "oversize message: the connection stays open");
    printf("fastpath: protocol errors answered; bad records end the connection\n");
    rc = 0;
fail:
    if (fd >= 0)
        close(fd);
    if (fd2 >= 0)
        close(fd2);
    kvc_close(c);
    return rc;
}

int main(void)
{
    if (tkvt_daemon_start(&g_d, NULL) != 0)
        return 1;
    int rc = test_kill() == 0 && test_protocol() == 0 ? 0 : 1;
    int st = tkvt_daemon_stop(&g_d);
    if (st != 0) {
        fprintf(stderr, "fastpath: tierkvd did not exit cleanly (status %d)\n", st);
        rc = 1;
    }
    return rc;
}
