/* test_fastpath.c - the attach connection's fast path against a real tierkvd:
 *
 *   1. clients killed with SIGKILL in the middle of their calls (a lookup holding leases,
 *      a multi-record Put, an open allocation, a prefetch wait) leave 0 leases behind, and
 *      the daemon keeps serving;
 *   2. the protocol itself, spoken raw on the attach socket: an unknown call, a lean lookup
 *      whose lengths do not add up, a scope naming another client, a malformed protobuf
 *      request are each answered with their status and the connection stays; a record with
 *      a bad magic or an announced length over the limit ends the connection; a lean lookup
 *      is answered lean;
 *   3. the lean reply encoding in-process: responses come back field for field, and replies
 *      whose lengths do not add up or whose fields are out of range are refused.
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

/* The last raw_call's reply: header and payload. */
static tkv_fast_hdr g_rh;
static uint8_t *g_rbuf;
static size_t g_rcap, g_rlen;

/* One call: returns the reply's status (-1: the connection ended). */
static int raw_call(int fd, uint16_t op, uint16_t flags, const void *p, size_t len)
{
    char why[160];
    if (!tkv_fast_send(fd, op, flags, 0, 0, p, len) ||
        tkv_fast_recv(fd, &g_rh, &g_rbuf, &g_rcap, 1u << 20, &g_rlen, why, sizeof(why)) != 1)
        return -1;
    return g_rh.status;
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
    char why[160];
    ProtobufCMessage *lr = NULL;
    CHECK((g_rh.flags & TKV_FAST_LEAN) &&
              (lr = tkv_fast_lean_reply_decode(TKV_FAST_LOOKUP, g_rbuf, g_rlen, why, sizeof(why))),
          "a lean lookup's reply is not lean");
    const Tierkv__V1__LookupResponse *lrr = (const Tierkv__V1__LookupResponse *)lr;
    bool lean_ok = lr->descriptor == &tierkv__v1__lookup_response__descriptor &&
                   lrr->num_query_blocks == 4 && lrr->num_hit_blocks == 0 && lrr->n_blocks == 0;
    free(lr);
    CHECK(lean_ok, "lean reply: wrong descriptor or counts");
    CHECK(raw_call(fd, TKV_FAST_RELEASE, 0, "", 0) != 0 && !(g_rh.flags & TKV_FAST_LEAN),
          "a protobuf request's (error) reply is lean");
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

/* ---- 3. the lean reply encoding --------------------------------------------------------------- */

static Tierkv__V1__BlockLoc g_locs[17];
static Tierkv__V1__BlockLoc *g_loc_ptrs[17];

static void fill_result(Tierkv__V1__LookupResponse *r, uint64_t lease, size_t n, size_t first)
{
    tierkv__v1__lookup_response__init(r);
    r->lease_id = lease;
    r->num_hit_blocks = (uint32_t)n;
    r->num_hit_tokens = (uint32_t)(n * BT);
    r->num_query_blocks = (uint32_t)(n + 3);
    r->n_blocks = n;
    r->blocks = n ? &g_loc_ptrs[first] : NULL;
}

static bool same_result(const Tierkv__V1__LookupResponse *a, const Tierkv__V1__LookupResponse *b)
{
    if (a->lease_id != b->lease_id || a->num_hit_blocks != b->num_hit_blocks ||
        a->num_hit_tokens != b->num_hit_tokens || a->num_query_blocks != b->num_query_blocks ||
        a->n_blocks != b->n_blocks)
        return false;
    for (size_t i = 0; i < a->n_blocks; i++) {
        const Tierkv__V1__BlockLoc *x = a->blocks[i], *y = b->blocks[i];
        if (x->tier != y->tier || x->in_l2 != y->in_l2 || x->in_l3 != y->in_l3 ||
            x->in_l1 != y->in_l1 || x->l2_offset != y->l2_offset || x->l1_offset != y->l1_offset)
            return false;
    }
    return true;
}

/* A copy of enc (n bytes) with one u32 at byte off replaced by v, decoded: must be refused. */
static bool refused_with(uint16_t op, const uint8_t *enc, size_t n, size_t off, uint32_t v)
{
    static uint8_t tmp[4096];
    char why[160];
    memcpy(tmp, enc, n);
    memcpy(tmp + off, &v, 4);
    ProtobufCMessage *m = tkv_fast_lean_reply_decode(op, tmp, n, why, sizeof(why));
    free(m);
    return m == NULL;
}

static int test_lean_reply(void)
{
    int rc = -1;
    uint8_t *enc = NULL;
    ProtobufCMessage *dec = NULL;
    char why[160];
    for (size_t i = 0; i < 17; i++) {
        tierkv__v1__block_loc__init(&g_locs[i]);
        g_locs[i].tier = (Tierkv__V1__Tier)(i % 4);
        g_locs[i].in_l2 = i % 2;
        g_locs[i].in_l3 = i % 3 == 0;
        g_locs[i].in_l1 = i % 5 == 0;
        g_locs[i].l2_offset = (uint64_t)i * 131072 + 7;
        g_locs[i].l1_offset = i % 5 == 0 ? (uint64_t)1 << 40 | i : 0;
        g_loc_ptrs[i] = &g_locs[i];
    }
    /* a batch of three: no hit, one block, sixteen */
    Tierkv__V1__LookupResponse res[3], *res_ptrs[3] = {&res[0], &res[1], &res[2]};
    fill_result(&res[0], 0, 0, 0);
    fill_result(&res[1], 11, 1, 0);
    fill_result(&res[2], UINT64_MAX, 16, 1);
    Tierkv__V1__LookupBatchResponse batch = TIERKV__V1__LOOKUP_BATCH_RESPONSE__INIT;
    batch.n_results = 3;
    batch.results = res_ptrs;
    size_t n = tkv_fast_lean_reply_size(&batch.base);
    CHECK(n == sizeof(tkv_fast_reply_hdr) + 3 * sizeof(tkv_fast_result) + 17 * sizeof(tkv_fast_loc),
          "lean batch reply: %zu bytes", n);
    enc = malloc(n);
    tkv_fast_lean_reply_encode(&batch.base, enc);
    dec = tkv_fast_lean_reply_decode(TKV_FAST_LOOKUP_BATCH, enc, n, why, sizeof(why));
    CHECK(dec && dec->descriptor == &tierkv__v1__lookup_batch_response__descriptor,
          "lean batch reply does not decode: %s", dec ? "wrong type" : why);
    const Tierkv__V1__LookupBatchResponse *db = (const Tierkv__V1__LookupBatchResponse *)dec;
    CHECK(db->n_results == 3, "lean batch reply: %zu results", db->n_results);
    for (int i = 0; i < 3; i++)
        CHECK(same_result(db->results[i], &res[i]), "lean batch reply: result %d differs", i);
    free(dec);
    dec = NULL;
    /* the batch's encoding is no single lookup's reply (3 results) */
    CHECK(!tkv_fast_lean_reply_decode(TKV_FAST_LOOKUP, enc, n, why, sizeof(why)),
          "three results taken as one lookup's reply");
    /* out of range or lengths that do not add up: refused, whatever the place */
    /* the third result's first location; its num_locs is the u32 before it */
    size_t loc0 = sizeof(tkv_fast_reply_hdr) + 3 * sizeof(tkv_fast_result) + sizeof(tkv_fast_loc);
    size_t loc_tier = loc0 + 2 * sizeof(uint64_t);
    CHECK(!tkv_fast_lean_reply_decode(TKV_FAST_LOOKUP_BATCH, enc, n - 1, why, sizeof(why)) &&
              !tkv_fast_lean_reply_decode(TKV_FAST_LOOKUP_BATCH, enc, n - sizeof(tkv_fast_loc),
                                          why, sizeof(why)) &&
              !tkv_fast_lean_reply_decode(TKV_FAST_PUT, enc, n, why, sizeof(why)),
          "a cut reply, or one to a call without a lean reply, was taken");
    CHECK(refused_with(TKV_FAST_LOOKUP_BATCH, enc, n, 0, TKV_FAST_MAX_PROMPTS + 1) &&
              refused_with(TKV_FAST_LOOKUP_BATCH, enc, n, 0, 4) &&
              refused_with(TKV_FAST_LOOKUP_BATCH, enc, n, 0, 2) &&
              refused_with(TKV_FAST_LOOKUP_BATCH, enc, n, 4, 1) &&
              refused_with(TKV_FAST_LOOKUP_BATCH, enc, n, loc0 - 4, 17) &&
              refused_with(TKV_FAST_LOOKUP_BATCH, enc, n, loc0 - 4, 0xffffffffu) &&
              refused_with(TKV_FAST_LOOKUP_BATCH, enc, n, loc_tier, 4) &&
              refused_with(TKV_FAST_LOOKUP_BATCH, enc, n, loc_tier + 4, 2) &&
              refused_with(TKV_FAST_LOOKUP_BATCH, enc, n, loc_tier + 4, 1u << 24),
          "a reply with a field out of range was taken");
    free(enc);
    enc = NULL;
    /* one lookup's reply, freed with free() alone (ASan sees a leak otherwise) */
    n = tkv_fast_lean_reply_size(&res[2].base);
    CHECK(n == sizeof(tkv_fast_reply_hdr) + sizeof(tkv_fast_result) + 16 * sizeof(tkv_fast_loc),
          "lean lookup reply: %zu bytes", n);
    enc = malloc(n);
    tkv_fast_lean_reply_encode(&res[2].base, enc);
    dec = tkv_fast_lean_reply_decode(TKV_FAST_LOOKUP, enc, n, why, sizeof(why));
    CHECK(dec && dec->descriptor == &tierkv__v1__lookup_response__descriptor &&
              same_result((const Tierkv__V1__LookupResponse *)dec, &res[2]),
          "lean lookup reply does not come back: %s", dec ? "differs" : why);
    Tierkv__V1__StatsRequest other = TIERKV__V1__STATS_REQUEST__INIT;
    CHECK(tkv_fast_lean_reply_size(&other.base) == 0, "a Stats message has a lean size");
    printf("fastpath: lean replies come back field for field; bad ones are refused\n");
    rc = 0;
fail:
    free(dec);
    free(enc);
    return rc;
}

int main(void)
{
    if (test_lean_reply() != 0)
        return 1;
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
