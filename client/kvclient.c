/* kvclient.c - libkvclient: gRPC (C core + protobuf-c) control plane, attach-socket data
 * plane. Contracts are in kvclient.h.
 *
 * Threading model: one grpc_channel per client (HTTP/2 multiplexes concurrent calls over one
 * connection); each call makes its own grpc_call and its own pluck completion queue, so no
 * lock is held across a round trip and threads sharing a client never wait on each other
 * here. The only mutable shared state is immutable after kvc_connect.
 */
#include "kvclient.h"

#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/time.h>
#include <sys/un.h>
#include <unistd.h>

#include <grpc/byte_buffer.h>
#include <grpc/byte_buffer_reader.h>
#include <grpc/grpc.h>
#include <grpc/grpc_security.h>
#include <grpc/slice.h>
#include <grpc/support/time.h>

#include "tierkv.pb-c.h"
#include "tkv_attach.h"
#include "tkv_fast.h"
#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_kernels.h"
#include "kvc_internal.h"

#ifdef TKVK_HAVE_CUDA
#include <cuda_runtime_api.h>
#endif

/* Largest payload we put in one request. The daemon's receive limit is its own choice; 3 MiB
 * stays under gRPC's default 4 MiB with room for the tokens and framing. */
#define KVC_MAX_MSG_PAYLOAD (3u << 20)
/* What we accept from the daemon in one reply (Get answers are split by the client too). */
#define KVC_MAX_RECV_BYTES (64 << 20)
#define KVC_DEFAULT_SOCKET "/run/tierkv/tierkv.sock"
#define KVC_NS_MAX 255

/* =========================================================================================
 * errors
 * ========================================================================================= */

static _Thread_local char tls_err[512];

const char *kvc_strerror(int status)
{
    switch (status) {
    case KVC_OK: return "ok";
    case KVC_EINVAL: return "invalid argument";
    case KVC_EUNAVAILABLE: return "daemon unavailable";
    case KVC_ENOTFOUND: return "not found (unknown or expired lease or allocation)";
    case KVC_EGEOMETRY: return "geometry fingerprint mismatch";
    case KVC_EFULL: return "resource exhausted";
    case KVC_EDATALOSS: return "checksum failure: block dropped";
    case KVC_ETIMEDOUT: return "timed out";
    case KVC_EBUSY: return "failed precondition";
    case KVC_EPROTO: return "malformed reply from daemon";
    case KVC_EATTACH: return "attach failed";
    case KVC_EUNSUPPORTED: return "not supported by the daemon";
    case KVC_EINTERNAL: return "daemon internal error";
    case KVC_ECANCELLED: return "cancelled";
    default: return "unknown error";
    }
}

const char *kvc_last_error(void) { return tls_err; }

int tkv_kvc_fail(int code, const char *fmt, ...)
{
    int n = snprintf(tls_err, sizeof(tls_err), "%s: ", kvc_strerror(code));
    if (n < 0 || (size_t)n >= sizeof(tls_err))
        return code;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(tls_err + n, sizeof(tls_err) - (size_t)n, fmt, ap);
    va_end(ap);
    return code;
}

/* This file's calls use the short name. */
#define fail tkv_kvc_fail

const char *kvc_tier_name(int tier)
{
    switch (tier) {
    case KVC_TIER_NONE: return "none";
    case KVC_TIER_L1: return "L1";
    case KVC_TIER_L2: return "L2";
    case KVC_TIER_L3: return "L3";
    default: return "?";
    }
}

/* =========================================================================================
 * options
 * ========================================================================================= */

struct kvc_opts {
    char *target;       /* full gRPC target, or NULL */
    char *socket;       /* UNIX socket path, or NULL */
    char *attach;       /* attach socket path, or NULL */
    char *ns;
    bool have_geometry;
    tkv_geometry geometry;
    uint32_t timeout_ms;
    uint32_t lease_ttl_ms;
    uint32_t max_blocks_per_call;
    bool trusted;       /* ask for a writable L2 mapping */
};

kvc_opts *kvc_opts_new(void)
{
    kvc_opts *o = tkv_xcalloc(1, sizeof(*o));
    o->ns = tkv_xstrdup("");
    o->timeout_ms = 10000;
    o->max_blocks_per_call = 64;
    return o;
}

void kvc_opts_free(kvc_opts *o)
{
    if (!o)
        return;
    free(o->target);
    free(o->socket);
    free(o->attach);
    free(o->ns);
    free(o);
}

/* The string options: which field, its longest value, whether NULL (unset) is allowed. */
#define kSunPathMax (sizeof(((struct sockaddr_un *)0)->sun_path) - 1) /* 108 with the NUL */
enum { OPT_SOCKET, OPT_TARGET, OPT_ATTACH, OPT_NS };
static const struct {
    size_t offset, max;
    const char *what;
    bool allow_null;
} kStrOpts[] = {
    [OPT_SOCKET] = {offsetof(kvc_opts, socket), kSunPathMax, "socket path", false},
    [OPT_TARGET] = {offsetof(kvc_opts, target), 1024, "target", false},
    [OPT_ATTACH] = {offsetof(kvc_opts, attach), kSunPathMax, "attach socket path", true},
    [OPT_NS] = {offsetof(kvc_opts, ns), KVC_NS_MAX, "namespace", false},
};

static int set_str(kvc_opts *o, int which, const char *v)
{
    if (!o)
        return fail(KVC_EINVAL, "options are NULL");
    const char *what = kStrOpts[which].what;
    size_t max = kStrOpts[which].max;
    bool allow_null = kStrOpts[which].allow_null;
    if (!v && !allow_null)
        return fail(KVC_EINVAL, "%s must not be NULL", what);
    if (v && strlen(v) > max)
        return fail(KVC_EINVAL, "%s longer than %zu bytes", what, max);
    if (v && v[0] == '\0' && which != OPT_NS)
        return fail(KVC_EINVAL, "%s must not be empty", what);
    char **dst = (char **)((char *)o + kStrOpts[which].offset);
    free(*dst);
    *dst = v ? tkv_xstrdup(v) : NULL;
    return KVC_OK;
}

int kvc_opts_set_socket(kvc_opts *o, const char *path) { return set_str(o, OPT_SOCKET, path); }
int kvc_opts_set_target(kvc_opts *o, const char *target) { return set_str(o, OPT_TARGET, target); }
int kvc_opts_set_attach_socket(kvc_opts *o, const char *path) { return set_str(o, OPT_ATTACH, path); }
int kvc_opts_set_namespace(kvc_opts *o, const char *ns) { return set_str(o, OPT_NS, ns); }

int kvc_opts_set_geometry(kvc_opts *o, uint32_t num_layers, uint32_t num_kv_heads,
                          uint32_t head_dim, uint32_t block_tokens, const char *kv_dtype,
                          const char *scale_mode, const char *model_id)
{
    if (!o)
        return fail(KVC_EINVAL, "options are NULL");
    tkv_geometry g;
    memset(&g, 0, sizeof(g));
    g.num_layers = num_layers;
    g.num_kv_heads = num_kv_heads;
    g.head_dim = head_dim;
    g.block_tokens = block_tokens;
    if (!kv_dtype || strcmp(kv_dtype, "fp8_e4m3") == 0)
        g.dtype = TKV_DTYPE_FP8_E4M3;
    else if (strcmp(kv_dtype, "bf16") == 0)
        g.dtype = TKV_DTYPE_BF16;
    else
        return fail(KVC_EINVAL, "kv dtype '%s' is not fp8_e4m3 or bf16", kv_dtype);
    if (!scale_mode || strcmp(scale_mode, "per_tensor") == 0)
        g.scale_mode = TKV_SCALE_PER_TENSOR;
    else if (strcmp(scale_mode, "per_token_head") == 0)
        g.scale_mode = TKV_SCALE_PER_TOKEN_HEAD;
    else
        return fail(KVC_EINVAL, "scale mode '%s' is not per_tensor or per_token_head",
                    scale_mode);
    if (!model_id || strlen(model_id) >= TKV_MODEL_ID_MAX)
        return fail(KVC_EINVAL, "model id missing or longer than %d bytes",
                    TKV_MODEL_ID_MAX - 1);
    memcpy(g.model_id, model_id, strlen(model_id) + 1);
    char why[160];
    if (tkv_geometry_validate(&g, why, sizeof(why)) != TKV_OK)
        return fail(KVC_EINVAL, "geometry: %s", why);
    o->geometry = g;
    o->have_geometry = true;
    return KVC_OK;
}

int kvc_opts_set_timeout_ms(kvc_opts *o, uint32_t timeout_ms)
{
    if (!o)
        return fail(KVC_EINVAL, "options are NULL");
    if (timeout_ms == 0)
        return fail(KVC_EINVAL, "timeout must be > 0 ms");
    o->timeout_ms = timeout_ms;
    return KVC_OK;
}

int kvc_opts_set_max_blocks_per_call(kvc_opts *o, uint32_t n)
{
    if (!o)
        return fail(KVC_EINVAL, "options are NULL");
    if (n == 0 || n > 4096)
        return fail(KVC_EINVAL, "max blocks per call must be 1..4096, got %u", n);
    o->max_blocks_per_call = n;
    return KVC_OK;
}

int kvc_opts_set_trusted(kvc_opts *o, int trusted)
{
    if (!o)
        return fail(KVC_EINVAL, "options are NULL");
    if (trusted != 0 && trusted != 1)
        return fail(KVC_EINVAL, "trusted must be 0 or 1, not %d", trusted);
    o->trusted = trusted == 1;
    return KVC_OK;
}

int kvc_opts_set_lease_ttl_ms(kvc_opts *o, uint32_t ttl_ms)
{
    if (!o)
        return fail(KVC_EINVAL, "options are NULL");
    o->lease_ttl_ms = ttl_ms;
    return KVC_OK;
}

/* =========================================================================================
 * client and the unary call
 * ========================================================================================= */

struct kvc_client {
    grpc_channel *channel;
    char *target;
    char *ns;
    uint8_t fingerprint[TKV_KEY_BYTES];
    size_t block_bytes;
    uint32_t block_tokens;
    uint32_t timeout_ms;
    uint32_t lease_ttl_ms;
    uint32_t blocks_per_msg;     /* payloads per Put/Get message */
    Tierkv__V1__BlockScope scope; /* every request's scope (namespace, fingerprint, id) */
    /* attach (data plane) */
    int attach_fd;               /* -1 when not attached */
    bool fast;                   /* the daemon serves calls on attach_fd (the fast path) */
    pthread_mutex_t fast_mu;     /* one call at a time on attach_fd; held by that call */
    uint8_t *fast_buf;           /* reply buffer of the fast path (under fast_mu) */
    size_t fast_cap;
    uint32_t fast_wait_ms;       /* attach_fd's receive timeout now (0 = none) */
    uint64_t client_id;
    const uint8_t *pool;         /* PROT_READ mapping of the L2 pool, or NULL */
    uint64_t pool_bytes;
    bool trusted;                /* asked for a writable mapping */
    bool pool_writable;          /* pool is mapped PROT_READ|PROT_WRITE */
    /* the daemon's geometry, for the kernels' layout (engine.c) */
    uint32_t num_layers, num_kv_heads, head_dim;
    int kv_dtype, scale_mode;    /* TKVK_DTYPE_*, TKVK_SCALE_* */
    /* L1 (GPU) pool, from the attach extension: one chunk mapped by CUDA IPC */
    bool daemon_has_l1;          /* the reply announced an L1 pool */
    uint64_t l1_bytes;
    void *l1_base;               /* device pointer, or NULL when not mapped here */
    char l1_why[160];            /* why l1_base is NULL */
};

struct kvc_lease {
    uint64_t id;
    uint32_t num_blocks;
    uint32_t num_query_blocks;
    uint8_t *tier;               /* num_blocks entries */
    uint8_t *in_l2;
    uint64_t *l2_offset;
    uint8_t *in_l1;
    uint64_t *l1_offset;
};

static gpr_timespec deadline_ms(uint32_t ms)
{
    if (ms == 0)
        return gpr_inf_future(GPR_CLOCK_MONOTONIC);
    return gpr_time_add(gpr_now(GPR_CLOCK_MONOTONIC),
                        gpr_time_from_millis((int64_t)ms, GPR_TIMESPAN));
}

static int map_status(grpc_status_code st, const char *msg)
{
    switch (st) {
    case GRPC_STATUS_OK: return KVC_OK;
    case GRPC_STATUS_INVALID_ARGUMENT:
    case GRPC_STATUS_OUT_OF_RANGE: return KVC_EINVAL;
    case GRPC_STATUS_UNAVAILABLE: return KVC_EUNAVAILABLE;
    case GRPC_STATUS_NOT_FOUND: return KVC_ENOTFOUND;
    case GRPC_STATUS_FAILED_PRECONDITION:
        /* the proto reserves FAILED_PRECONDITION for a geometry mismatch and for pinned
         * blocks; the message tells which */
        return (msg && (strstr(msg, "geometry") || strstr(msg, "fingerprint"))) ? KVC_EGEOMETRY
                                                                                : KVC_EBUSY;
    case GRPC_STATUS_RESOURCE_EXHAUSTED: return KVC_EFULL;
    case GRPC_STATUS_DATA_LOSS: return KVC_EDATALOSS;
    case GRPC_STATUS_DEADLINE_EXCEEDED: return KVC_ETIMEDOUT;
    case GRPC_STATUS_UNIMPLEMENTED: return KVC_EUNSUPPORTED;
    case GRPC_STATUS_CANCELLED: return KVC_ECANCELLED;
    case GRPC_STATUS_ALREADY_EXISTS: return KVC_EBUSY;
    default: return KVC_EINTERNAL;
    }
}

/* Blocks a request carries in pieces (kvc_put_gather): they are written after the packed
 * message as elements of its repeated bytes field `field`, each gathered from its pieces
 * straight into the wire buffer. Protobuf lets a repeated field's elements follow the other
 * fields, and Put's blocks is its last field, so these are the bytes protobuf-c itself would
 * write for the same blocks held contiguously. */
typedef struct msg_tail {
    uint32_t field;              /* field number (wire type 2) */
    const kvc_iov *iov;          /* num_blocks * iov_per_block pieces, validated */
    uint32_t iov_per_block, num_blocks;
    size_t block_bytes;
} msg_tail;

static size_t varint_put(uint64_t v, uint8_t *out)
{
    size_t n = 0;
    for (; v >= 0x80; v >>= 7)
        out[n++] = (uint8_t)(v | 0x80);
    out[n++] = (uint8_t)v;
    return n;
}

/* The tail's field header (tag and length) of one block, in hdr; returns its size. */
static size_t tail_header(const msg_tail *t, uint8_t hdr[20])
{
    size_t n = varint_put((uint64_t)t->field << 3 | 2u, hdr);
    return n + varint_put(t->block_bytes, hdr + n);
}

/* Packed size of req plus its tail (t may be NULL). */
static size_t msg_size(const ProtobufCMessage *req, const msg_tail *t)
{
    size_t n = protobuf_c_message_get_packed_size(req);
    if (t) {
        uint8_t hdr[20];
        n += (size_t)t->num_blocks * (tail_header(t, hdr) + t->block_bytes);
    }
    return n;
}

/* Packs req and its tail into out (msg_size bytes). */
static void msg_pack(const ProtobufCMessage *req, const msg_tail *t, uint8_t *out)
{
    out += protobuf_c_message_pack(req, out);
    if (!t)
        return;
    uint8_t hdr[20];
    size_t hn = tail_header(t, hdr);
    for (uint32_t b = 0; b < t->num_blocks; b++) {
        memcpy(out, hdr, hn);
        out += hn;
        const kvc_iov *v = t->iov + (size_t)b * t->iov_per_block;
        for (uint32_t i = 0; i < t->iov_per_block; i++) {
            if (v[i].len)
                memcpy(out, v[i].base, v[i].len);
            out += v[i].len;
        }
    }
}

static grpc_byte_buffer *pack_message(const ProtobufCMessage *req, const msg_tail *tail)
{
    size_t n = msg_size(req, tail);
    grpc_slice s = grpc_slice_malloc(n);
    msg_pack(req, tail, GRPC_SLICE_START_PTR(s));
    grpc_byte_buffer *bb = grpc_raw_byte_buffer_create(&s, 1);
    grpc_slice_unref(s);
    return bb;
}

static ProtobufCMessage *unpack_message(grpc_byte_buffer *bb, const ProtobufCMessageDescriptor *d)
{
    grpc_byte_buffer_reader r;
    if (!grpc_byte_buffer_reader_init(&r, bb))
        return NULL;
    grpc_slice s = grpc_byte_buffer_reader_readall(&r);
    grpc_byte_buffer_reader_destroy(&r);
    ProtobufCMessage *m =
        protobuf_c_message_unpack(d, NULL, GRPC_SLICE_LENGTH(s), GRPC_SLICE_START_PTR(s));
    grpc_slice_unref(s);
    return m;
}

/* Records the outcome of a finished call: KVC_OK, or the mapped status with the daemon's
 * message in the thread's last error. */
static int call_status(const char *method, grpc_status_code st, grpc_slice details)
{
    if (st == GRPC_STATUS_OK)
        return KVC_OK;
    char msg[384];
    size_t n = GRPC_SLICE_LENGTH(details);
    if (n >= sizeof(msg))
        n = sizeof(msg) - 1;
    memcpy(msg, GRPC_SLICE_START_PTR(details), n);
    msg[n] = '\0';
    int code = map_status(st, msg);
    return fail(code, "%s: grpc status %d: %s", method, (int)st, msg[0] ? msg : "(no message)");
}

/* The four ops that open a call from this side: metadata, the one request message, the
 * half-close, and receiving the daemon's initial metadata. */
static void request_ops(grpc_op ops[4], grpc_byte_buffer *send, grpc_metadata_array *initial_md)
{
    ops[0].op = GRPC_OP_SEND_INITIAL_METADATA;
    ops[1].op = GRPC_OP_SEND_MESSAGE;
    ops[1].data.send_message.send_message = send;
    ops[2].op = GRPC_OP_SEND_CLOSE_FROM_CLIENT;
    ops[3].op = GRPC_OP_RECV_INITIAL_METADATA;
    ops[3].data.recv_initial_metadata.recv_initial_metadata = initial_md;
}

/* Frees what a call from this side used, once it is over. */
static void call_end(grpc_completion_queue *cq, grpc_call *call, grpc_byte_buffer *send,
                     grpc_slice details, grpc_metadata_array *initial_md,
                     grpc_metadata_array *trailing_md)
{
    grpc_byte_buffer_destroy(send);
    grpc_slice_unref(details);
    grpc_metadata_array_destroy(initial_md);
    grpc_metadata_array_destroy(trailing_md);
    grpc_call_unref(call);
    grpc_completion_queue_shutdown(cq);
    grpc_completion_queue_destroy(cq);
}

/* A unary call on the gRPC channel (see unary). */
static int grpc_unary(kvc_client *c, const char *method, const ProtobufCMessage *req,
                      const msg_tail *tail, const ProtobufCMessageDescriptor *d,
                      ProtobufCMessage **resp, uint32_t timeout_ms)
{
    int rc = KVC_OK;
    *resp = NULL;
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_slice mslice = grpc_slice_from_static_string(method);
    grpc_call *call = grpc_channel_create_call(c->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq,
                                               mslice, NULL, deadline_ms(timeout_ms), NULL);
    grpc_byte_buffer *send = pack_message(req, tail);
    grpc_byte_buffer *recv = NULL;
    grpc_metadata_array initial_md, trailing_md;
    grpc_metadata_array_init(&initial_md);
    grpc_metadata_array_init(&trailing_md);
    grpc_status_code st = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();

    grpc_op ops[6];
    memset(ops, 0, sizeof(ops));
    request_ops(ops, send, &initial_md);
    ops[4].op = GRPC_OP_RECV_MESSAGE;
    ops[4].data.recv_message.recv_message = &recv;
    ops[5].op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    ops[5].data.recv_status_on_client.trailing_metadata = &trailing_md;
    ops[5].data.recv_status_on_client.status = &st;
    ops[5].data.recv_status_on_client.status_details = &details;

    grpc_call_error ce = grpc_call_start_batch(call, ops, 6, (void *)1, NULL);
    if (ce != GRPC_CALL_OK) {
        rc = fail(KVC_EINTERNAL, "%s: grpc_call_start_batch: %d", method, (int)ce);
        goto fail;
    }
    grpc_event ev = grpc_completion_queue_pluck(cq, (void *)1,
                                                gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    TKV_ASSERT(ev.type == GRPC_OP_COMPLETE);
    rc = call_status(method, st, details);
    if (rc != KVC_OK)
        goto fail;
    if (!recv) {
        rc = fail(KVC_EPROTO, "%s: OK status without a reply message", method);
        goto fail;
    }
    *resp = unpack_message(recv, d);
    if (!*resp)
        rc = fail(KVC_EPROTO, "%s: reply does not parse as %s", method, d->name);
fail:
    if (recv)
        grpc_byte_buffer_destroy(recv);
    call_end(cq, call, send, details, &initial_md, &trailing_md);
    return rc;
}

/* The fast path's bound on a reply: the daemon's replies to the calls it carries are far
 * smaller (a LookupBatch of 256 long prompts is a few MiB). */
#define kFastMaxReply (64u << 20)

/* Callers of this process waiting for a fast-path reply now. */
static atomic_int g_fast_waiters;

/* How long the one waiting caller spins for its reply before it sleeps in recv. */
#define kFastSpinNs 50000u

/* Spins (non-blocking peeks) until a reply is readable on fd or kFastSpinNs pass. A reply
 * comes back in a few us, sooner than a host whose cores idle wakes a sleeping thread (on an
 * idle 2-core VM a lookup's round trip was ~100 us asleep). Only the process's one waiting
 * caller spins: with more waiters than cores, spinning takes the CPU the daemon needs (an
 * unconditional spin cost 4 threads on 2 cores 40% of their lookups/s). */
static void spin_for_reply(int fd)
{
    uint64_t end = tkv_now_ns() + kFastSpinNs;
    char b;
    while (recv(fd, &b, 1, MSG_PEEK | MSG_DONTWAIT) < 0 && errno == EAGAIN &&
           tkv_now_ns() < end)
        ;
}

/* A unary call on the attach connection (proto/tkv_attach.h), under c->fast_mu. A broken
 * connection or a reply that does not arrive in time ends the fast path for this client (a
 * late reply would answer the next call); calls then take gRPC. *flat: *resp is one block
 * (a lean reply: free()), not protobuf-c's unpacked tree. */
static int fast_unary(kvc_client *c, const char *method, uint16_t op, const ProtobufCMessage *req,
                      const msg_tail *tail, const ProtobufCMessageDescriptor *d,
                      ProtobufCMessage **resp, bool *flat, uint32_t timeout_ms)
{
    /* lookups go in the lean encoding (tokens as they are), the rest as protobuf */
    bool lean = !tail && (op == TKV_FAST_LOOKUP || op == TKV_FAST_LOOKUP_BATCH);
    size_t n = lean ? tkv_fast_lean_size(req) : 0;
    lean = n > 0;
    if (!lean)
        n = msg_size(req, tail);
    uint32_t small[1024];
    uint8_t *p = n <= sizeof(small) ? (uint8_t *)small : tkv_xmalloc(n);
    if (lean)
        tkv_fast_lean_encode(req, p);
    else
        msg_pack(req, tail, p);
    bool sent = tkv_fast_send(c->attach_fd, op, lean ? TKV_FAST_LEAN : 0, timeout_ms, 0, p, n);
    if (p != (uint8_t *)small)
        free(p);
    if (!sent) {
        c->fast = false;
        return fail(KVC_EUNAVAILABLE, "%s: attach connection lost: %s", method, strerror(errno));
    }
    /* The daemon answers a deadline itself; the slack covers its reply on a loaded host. The
     * wait is the socket's receive timeout, set only when it changes: one syscall fewer per
     * call than a poll. */
    uint32_t wait_ms = timeout_ms ? (timeout_ms > UINT32_MAX - 5000 ? UINT32_MAX : timeout_ms + 5000) : 0;
    if (wait_ms != c->fast_wait_ms) {
        struct timeval tv = {.tv_sec = wait_ms / 1000, .tv_usec = (wait_ms % 1000) * 1000};
        if (setsockopt(c->attach_fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) != 0) {
            c->fast = false;
            return fail(KVC_EUNAVAILABLE, "%s: attach connection: %s", method, strerror(errno));
        }
        c->fast_wait_ms = wait_ms;
    }
    tkv_fast_hdr h;
    size_t len = 0;
    char why[160];
    if (atomic_fetch_add(&g_fast_waiters, 1) == 0)
        spin_for_reply(c->attach_fd);
    int got = tkv_fast_recv(c->attach_fd, &h, &c->fast_buf, &c->fast_cap, kFastMaxReply, &len,
                            why, sizeof(why));
    atomic_fetch_sub(&g_fast_waiters, 1);
    if (got <= 0) {
        bool late = errno == EAGAIN || errno == EWOULDBLOCK;
        c->fast = false;
        return fail(late ? KVC_ETIMEDOUT : KVC_EUNAVAILABLE, "%s: attach connection: %s", method,
                    late ? "no reply in time" : why);
    }
    if (h.op != op) {
        c->fast = false;
        return fail(KVC_EPROTO, "%s: fast-path reply for call %u", method, h.op);
    }
    if (h.status != GRPC_STATUS_OK) {
        char msg[384];
        size_t m = len < sizeof(msg) - 1 ? len : sizeof(msg) - 1;
        memcpy(msg, c->fast_buf, m);
        msg[m] = '\0';
        return fail(map_status((grpc_status_code)h.status, msg), "%s: status %d: %s", method,
                    (int)h.status, msg[0] ? msg : "(no message)");
    }
    if (h.flags & TKV_FAST_LEAN) {
        if (!lean) {
            c->fast = false;
            return fail(KVC_EPROTO, "%s: lean fast-path reply to a protobuf request", method);
        }
        *resp = tkv_fast_lean_reply_decode(op, c->fast_buf, len, why, sizeof(why));
        if (!*resp)
            return fail(KVC_EPROTO, "%s: %s", method, why);
        *flat = true;
        return KVC_OK;
    }
    *resp = protobuf_c_message_unpack(d, NULL, len, c->fast_buf);
    if (!*resp)
        return fail(KVC_EPROTO, "%s: reply does not parse as %s", method, d->name);
    return KVC_OK;
}

/* One unary call: req -> *resp (unpacked with d; the caller frees it with
 * protobuf_c_message_free_unpacked, or with free() when *flat: a lean reply). timeout_ms 0 =
 * no deadline. A call the fast path carries (op != 0) goes on the attach connection when it
 * is attached and free. */
static int unary(kvc_client *c, const char *method, uint16_t op, const ProtobufCMessage *req,
                 const msg_tail *tail, const ProtobufCMessageDescriptor *d,
                 ProtobufCMessage **resp, bool *flat, uint32_t timeout_ms)
{
    *resp = NULL;
    *flat = false;
    if (op && c->fast && pthread_mutex_trylock(&c->fast_mu) == 0) {
        if (c->fast) {
            int rc = fast_unary(c, method, op, req, tail, d, resp, flat, timeout_ms);
            pthread_mutex_unlock(&c->fast_mu);
            return rc;
        }
        pthread_mutex_unlock(&c->fast_mu);
    }
    return grpc_unary(c, method, req, tail, d, resp, timeout_ms);
}

/* The fast path's id of each method (0: gRPC only), for UNARY's name. */
enum {
    kOp_Lookup = TKV_FAST_LOOKUP, kOp_LookupBatch = TKV_FAST_LOOKUP_BATCH,
    kOp_Prefetch = TKV_FAST_PREFETCH, kOp_Release = TKV_FAST_RELEASE, kOp_Alloc = TKV_FAST_ALLOC,
    kOp_WriteSlot = TKV_FAST_WRITE_SLOT, kOp_Commit = TKV_FAST_COMMIT, kOp_Put = TKV_FAST_PUT,
    kOp_Get = 0, kOp_Stats = 0, kOp_Health = 0, kOp_CostCheck = 0, kOp_Evict = 0, kOp_Flush = 0,
    kOp_ListBlocks = 0,
};

/* What a call does with its reply (rsp is the method's response message, freed after);
 * returns KVC_OK or a failure. NULL: the reply carries nothing the caller needs. */
typedef int (*take_fn)(kvc_client *c, const void *rsp, void *arg);

/* The one shape of a unary call: send req (with its tail of gathered blocks, or NULL), hand
 * the reply to take, free it. */
static int call(kvc_client *c, const char *method, uint16_t op, const ProtobufCMessage *req,
                const msg_tail *tail, const ProtobufCMessageDescriptor *d, uint32_t timeout_ms,
                take_fn take, void *arg)
{
    ProtobufCMessage *rsp = NULL;
    bool flat = false;
    int rc = unary(c, method, op, req, tail, d, &rsp, &flat, timeout_ms);
    if (rc == KVC_OK && take)
        rc = take(c, rsp, arg);
    if (flat)
        free(rsp);
    else if (rsp)
        protobuf_c_message_free_unpacked(rsp, NULL);
    return rc;
}

/* CALL(c, Lookup, &req, lookup_response, timeout, take, arg); CALL_TAIL with a msg_tail */
#define CALL_TAIL(c, name, req, tail, rsp_type, tmo, take, arg)                                  \
    call((c), "/tierkv.v1.Cache/" #name, kOp_##name, &(req)->base, (tail),                     \
         &tierkv__v1__##rsp_type##__descriptor, (tmo), (take), (arg))
#define CALL(c, name, req, rsp_type, tmo, take, arg)                                             \
    CALL_TAIL(c, name, req, NULL, rsp_type, tmo, take, arg)

static void scope_init(kvc_client *c, Tierkv__V1__BlockScope *s)
{
    tierkv__v1__block_scope__init(s);
    s->namespace_ = c->ns;
    s->fingerprint.data = c->fingerprint;
    s->fingerprint.len = TKV_KEY_BYTES;
    s->client_id = c->client_id;
}

/* =========================================================================================
 * connect / attach / close
 * ========================================================================================= */

/* Receives the GPU-tier message that follows a reply with TKV_ATTACH_F_L1 and, when built
 * with CUDA and the daemon's device is visible here, opens its pool by CUDA IPC. A client that
 * cannot map L1 (no CUDA, other device, several chunks) still attaches: only the engine-side
 * L1 calls then fail, with l1_why as the reason. */
static int attach_gpu(kvc_client *c, int fd, const char *path)
{
    tkv_attach_gpu *g = tkv_xcalloc(1, sizeof(*g));
    int rc = KVC_OK;
    ssize_t n = recv(fd, g, sizeof(*g), 0);
    if (n != (ssize_t)sizeof(*g) || g->magic != TKV_ATTACH_MAGIC || g->num_chunks < 1 ||
        g->num_chunks > TKV_ATTACH_MAX_CHUNKS || g->chunk_bytes == 0 ||
        g->l1_bytes != (uint64_t)g->num_chunks * g->chunk_bytes) {
        rc = fail(KVC_EATTACH, "GPU pool message from %s is malformed (%zd bytes%s%s)", path, n,
                  n < 0 ? ": " : "", n < 0 ? strerror(errno) : "");
        goto out;
    }
    g->pci_bus_id[sizeof(g->pci_bus_id) - 1] = '\0';
    c->daemon_has_l1 = true;
    c->l1_bytes = g->l1_bytes;
    if (g->num_chunks != 1) {
        /* the kernels address one pool base; a pool of several chunks is not contiguous */
        snprintf(c->l1_why, sizeof(c->l1_why), "the L1 pool has %u chunks; engines map only "
                 "single-chunk pools", g->num_chunks);
        goto out;
    }
#ifdef TKVK_HAVE_CUDA
    {
        int prev = -1, dev = -1;
        cudaError_t e = cudaGetDevice(&prev);
        if (e == cudaSuccess)
            e = cudaDeviceGetByPCIBusId(&dev, g->pci_bus_id);
        if (e != cudaSuccess) {
            snprintf(c->l1_why, sizeof(c->l1_why), "device %s of the L1 pool is not usable "
                     "here: %s", g->pci_bus_id, cudaGetErrorString(e));
            cudaGetLastError(); /* do not leave the error sticky for the engine */
            goto out;
        }
        cudaIpcMemHandle_t h;
        memcpy(&h, g->handles[0], sizeof(h));
        void *p = NULL;
        if ((e = cudaSetDevice(dev)) == cudaSuccess)
            e = cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess);
        cudaSetDevice(prev); /* the caller's current device is its own business */
        if (e != cudaSuccess) {
            snprintf(c->l1_why, sizeof(c->l1_why), "cudaIpcOpenMemHandle of the L1 pool "
                     "(device %s): %s", g->pci_bus_id, cudaGetErrorString(e));
            cudaGetLastError();
            goto out;
        }
        c->l1_base = p;
    }
#else
    snprintf(c->l1_why, sizeof(c->l1_why), "libkvclient was built without CUDA");
#endif
out:
    free(g);
    return rc;
}

static int attach(kvc_client *c, const char *path)
{
    int rc = KVC_OK;
    int memfd = -1;
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return fail(KVC_EATTACH, "socket: %s", strerror(errno));
    struct sockaddr_un sa;
    memset(&sa, 0, sizeof(sa));
    sa.sun_family = AF_UNIX;
    memcpy(sa.sun_path, path, strlen(path) + 1); /* length checked by the setter */
    /* the handshake must not hang on a wedged daemon: bound it by the call timeout */
    struct timeval tv = {.tv_sec = c->timeout_ms / 1000, .tv_usec = (c->timeout_ms % 1000) * 1000};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) != 0) {
        rc = fail(KVC_EATTACH, "connect %s: %s", path, strerror(errno));
        goto fail;
    }
    tkv_attach_hello hello;
    memset(&hello, 0, sizeof(hello));
    hello.magic = TKV_ATTACH_MAGIC;
    hello.version = TKV_ATTACH_VERSION;
    memcpy(hello.fingerprint, c->fingerprint, TKV_KEY_BYTES);
    hello.pid = (uint32_t)getpid();
    hello.flags = (c->trusted ? TKV_ATTACH_HELLO_WRITABLE : 0) | TKV_ATTACH_HELLO_FAST;
    if (send(fd, &hello, sizeof(hello), MSG_NOSIGNAL) != (ssize_t)sizeof(hello)) {
        rc = fail(KVC_EATTACH, "send hello to %s: %s", path, strerror(errno));
        goto fail;
    }
    tkv_attach_reply reply;
    memset(&reply, 0, sizeof(reply));
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } ctrl;
    memset(&ctrl, 0, sizeof(ctrl));
    struct iovec iov = {.iov_base = &reply, .iov_len = sizeof(reply)};
    struct msghdr mh;
    memset(&mh, 0, sizeof(mh));
    mh.msg_iov = &iov;
    mh.msg_iovlen = 1;
    mh.msg_control = ctrl.buf;
    mh.msg_controllen = sizeof(ctrl.buf);
    ssize_t n = recvmsg(fd, &mh, MSG_CMSG_CLOEXEC);
    if (n < 0) {
        rc = fail(KVC_EATTACH, "receive attach reply from %s: %s", path, strerror(errno));
        goto fail;
    }
    for (struct cmsghdr *cm = CMSG_FIRSTHDR(&mh); cm; cm = CMSG_NXTHDR(&mh, cm))
        if (cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS &&
            cm->cmsg_len == CMSG_LEN(sizeof(int)))
            memcpy(&memfd, CMSG_DATA(cm), sizeof(int));
    if (n != (ssize_t)sizeof(reply) || reply.magic != TKV_ATTACH_MAGIC) {
        rc = fail(KVC_EATTACH, "attach reply from %s is malformed (%zd bytes)", path, n);
        goto fail;
    }
    reply.message[sizeof(reply.message) - 1] = '\0';
    if (reply.status != 0) {
        rc = fail(reply.status == TKV_EGEOMETRY ? KVC_EGEOMETRY : KVC_EATTACH,
                  "daemon refused attach: %s (%s)", reply.message, tkv_strerror(reply.status));
        goto fail;
    }
    if (memfd < 0) {
        rc = fail(KVC_EATTACH, "attach reply carried no pool descriptor");
        goto fail;
    }
    if (reply.block_bytes != c->block_bytes || reply.block_tokens != c->block_tokens) {
        rc = fail(KVC_EATTACH, "attach reply geometry (%llu bytes/%u tokens) differs from "
                  "Stats (%zu/%u)", (unsigned long long)reply.block_bytes, reply.block_tokens,
                  c->block_bytes, c->block_tokens);
        goto fail;
    }
    struct stat stt;
    if (fstat(memfd, &stt) != 0 || (uint64_t)stt.st_size < reply.l2_bytes) {
        rc = fail(KVC_EATTACH, "pool descriptor is smaller than the announced %llu bytes",
                  (unsigned long long)reply.l2_bytes);
        goto fail;
    }
    if (c->trusted && !(reply.flags & TKV_ATTACH_F_WRITABLE)) {
        rc = fail(KVC_EATTACH, "daemon did not grant the writable pool mapping asked for");
        goto fail;
    }
    /* writable only when asked for and granted: a read-only descriptor cannot be mapped so */
    c->pool_writable = c->trusted;
    if (reply.l2_bytes > 0) {
        int prot = c->pool_writable ? PROT_READ | PROT_WRITE : PROT_READ;
        void *p = mmap(NULL, reply.l2_bytes, prot, MAP_SHARED, memfd, 0);
        if (p == MAP_FAILED) {
            rc = fail(KVC_EATTACH, "mmap pool (%llu bytes): %s",
                      (unsigned long long)reply.l2_bytes, strerror(errno));
            goto fail;
        }
        c->pool = p;
        c->pool_bytes = reply.l2_bytes;
    }
    close(memfd); /* the mapping keeps the pool alive */
    memfd = -1;
    if (reply.flags & TKV_ATTACH_F_L1) {
        rc = attach_gpu(c, fd, path);
        if (rc != KVC_OK)
            goto fail;
    }
    /* the connection stays open and silent; no timeout on it from now on */
    struct timeval zero = {0, 0};
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &zero, sizeof(zero));
    c->attach_fd = fd;
    c->client_id = reply.client_id;
    c->fast = (reply.flags & TKV_ATTACH_F_FAST) != 0;
    return KVC_OK;
fail:
    if (memfd >= 0)
        close(memfd);
    close(fd);
    return rc;
}

static void copy_cstr(char *dst, size_t cap, const char *src)
{
    size_t n = src ? strlen(src) : 0;
    if (n >= cap)
        n = cap - 1;
    if (n)
        memcpy(dst, src, n);
    dst[n] = '\0';
}

int kvc_connect(const kvc_opts *o, kvc_client **out)
{
    int rc = KVC_OK;
    Tierkv__V1__StatsResponse *st = NULL;
    if (!o || !out)
        return fail(KVC_EINVAL, "options or out pointer is NULL");
    *out = NULL;

    grpc_init();
    kvc_client *c = tkv_xcalloc(1, sizeof(*c));
    c->attach_fd = -1;
    pthread_mutex_init(&c->fast_mu, NULL);
    c->timeout_ms = o->timeout_ms;
    c->lease_ttl_ms = o->lease_ttl_ms;
    c->trusted = o->trusted;
    c->ns = tkv_xstrdup(o->ns);
    if (o->target) {
        c->target = tkv_xstrdup(o->target);
    } else {
        const char *path = o->socket ? o->socket : getenv("TIERKV_SOCKET");
        if (!path || !*path)
            path = KVC_DEFAULT_SOCKET;
        size_t n = strlen(path) + 6;
        c->target = tkv_xmalloc(n);
        snprintf(c->target, n, "unix:%s", path);
    }

    grpc_arg args[2];
    memset(args, 0, sizeof(args));
    args[0].type = GRPC_ARG_INTEGER;
    args[0].key = GRPC_ARG_MAX_RECEIVE_MESSAGE_LENGTH;
    args[0].value.integer = KVC_MAX_RECV_BYTES;
    args[1].type = GRPC_ARG_INTEGER;
    args[1].key = GRPC_ARG_MAX_SEND_MESSAGE_LENGTH;
    args[1].value.integer = KVC_MAX_RECV_BYTES;
    grpc_channel_args cargs = {.num_args = 2, .args = args};
    grpc_channel_credentials *creds = grpc_insecure_credentials_create();
    c->channel = grpc_channel_create(c->target, creds, &cargs);
    grpc_channel_credentials_release(creds);
    if (!c->channel) {
        rc = fail(KVC_EINVAL, "cannot create a channel to %s", c->target);
        goto fail;
    }

    /* Stats tells the daemon's geometry: adopt it, or check ours against it now, so a
     * mismatch is one clear error at connect rather than one per call. */
    Tierkv__V1__StatsRequest sreq = TIERKV__V1__STATS_REQUEST__INIT;
    bool st_flat; /* op 0: gRPC, never flat */
    rc = unary(c, "/tierkv.v1.Cache/Stats", 0, &sreq.base, NULL,
               &tierkv__v1__stats_response__descriptor, (ProtobufCMessage **)&st, &st_flat,
               c->timeout_ms);
    if (rc != KVC_OK) {
        char why[sizeof(tls_err)];
        copy_cstr(why, sizeof(why), tls_err);
        rc = fail(rc == KVC_ETIMEDOUT ? KVC_ETIMEDOUT : KVC_EUNAVAILABLE,
                  "cannot reach tierkvd at %s (%s)", c->target, why);
        goto fail;
    }
    const Tierkv__V1__Geometry *dg = st->geometry;
    if (!dg || dg->fingerprint.len != TKV_KEY_BYTES || dg->block_bytes == 0 ||
        dg->block_tokens == 0) {
        rc = fail(KVC_EPROTO, "daemon's Stats carries no usable geometry");
        goto fail;
    }
    if (o->have_geometry) {
        tkv_geometry_fingerprint(&o->geometry, c->fingerprint);
        if (memcmp(c->fingerprint, dg->fingerprint.data, TKV_KEY_BYTES) != 0) {
            rc = fail(KVC_EGEOMETRY,
                      "client geometry (model %s, %u layers, %u kv heads, head dim %u, %u "
                      "tokens/block) differs from the daemon's (model %s, %u, %u, %u, %u)",
                      o->geometry.model_id, o->geometry.num_layers, o->geometry.num_kv_heads,
                      o->geometry.head_dim, o->geometry.block_tokens,
                      dg->model_id ? dg->model_id : "?", dg->num_layers, dg->num_kv_heads,
                      dg->head_dim, dg->block_tokens);
            goto fail;
        }
        size_t bb = tkv_geometry_block_bytes(&o->geometry);
        if (bb != dg->block_bytes) {
            rc = fail(KVC_EPROTO, "daemon block size %llu differs from the geometry's %zu",
                      (unsigned long long)dg->block_bytes, bb);
            goto fail;
        }
    } else {
        memcpy(c->fingerprint, dg->fingerprint.data, TKV_KEY_BYTES);
    }
    c->block_bytes = (size_t)dg->block_bytes;
    c->block_tokens = dg->block_tokens;
    c->num_layers = dg->num_layers;
    c->num_kv_heads = dg->num_kv_heads;
    c->head_dim = dg->head_dim;
    c->kv_dtype = (dg->kv_dtype && strcmp(dg->kv_dtype, "bf16") == 0) ? TKVK_DTYPE_BF16
                                                                       : TKVK_DTYPE_FP8_E4M3;
    c->scale_mode = (dg->scale_mode && strcmp(dg->scale_mode, "per_token_head") == 0)
                        ? TKVK_SCALE_PER_TOKEN_HEAD
                        : TKVK_SCALE_PER_TENSOR;
    /* both bounds hold: the daemon's block count per message and the byte size */
    c->blocks_per_msg = (uint32_t)(KVC_MAX_MSG_PAYLOAD / c->block_bytes);
    if (c->blocks_per_msg > o->max_blocks_per_call)
        c->blocks_per_msg = o->max_blocks_per_call;
    if (c->blocks_per_msg == 0)
        c->blocks_per_msg = 1;
    protobuf_c_message_free_unpacked(&st->base, NULL);
    st = NULL;

    if (o->attach) {
        rc = attach(c, o->attach);
        if (rc != KVC_OK)
            goto fail;
    }
    scope_init(c, &c->scope); /* the client's identity is fixed from here on */
    *out = c;
    return KVC_OK;
fail:
    if (st)
        protobuf_c_message_free_unpacked(&st->base, NULL);
    kvc_close(c);
    return rc;
}

void kvc_close(kvc_client *c)
{
    if (!c)
        return;
    if (c->pool)
        munmap((void *)c->pool, c->pool_bytes);
#ifdef TKVK_HAVE_CUDA
    if (c->l1_base)
        cudaIpcCloseMemHandle(c->l1_base);
#endif
    if (c->attach_fd >= 0)
        close(c->attach_fd);
    pthread_mutex_destroy(&c->fast_mu);
    free(c->fast_buf);
    if (c->channel)
        grpc_channel_destroy(c->channel);
    free(c->target);
    free(c->ns);
    free(c);
    grpc_shutdown();
}

size_t kvc_block_bytes(const kvc_client *c) { return c ? c->block_bytes : 0; }
uint32_t kvc_block_tokens(const kvc_client *c) { return c ? c->block_tokens : 0; }
int kvc_is_attached(const kvc_client *c) { return c && c->pool ? 1 : 0; }
uint64_t kvc_client_id(const kvc_client *c) { return c ? c->client_id : 0; }

void kvc_fingerprint_hex(const kvc_client *c, char out[65])
{
    static const char hex[] = "0123456789abcdef";
    for (int i = 0; i < TKV_KEY_BYTES; i++) {
        out[2 * i] = hex[c->fingerprint[i] >> 4];
        out[2 * i + 1] = hex[c->fingerprint[i] & 15];
    }
    out[64] = '\0';
}

/* =========================================================================================
 * lookup, leases, prefetch, get
 * ========================================================================================= */

static int check_tokens(const kvc_client *c, const uint32_t *tokens, size_t num_tokens)
{
    if (!c)
        return fail(KVC_EINVAL, "client is NULL");
    if (num_tokens && !tokens)
        return fail(KVC_EINVAL, "tokens is NULL with %zu tokens", num_tokens);
    /* the daemon keys only full blocks; a request far beyond what one message may carry is
     * rejected here with a clear reason rather than by the transport */
    if (num_tokens > (size_t)(KVC_MAX_RECV_BYTES / 8))
        return fail(KVC_EINVAL, "%zu tokens is more than one request may carry", num_tokens);
    return KVC_OK;
}

/* Copies block locations from a reply into the lease (count entries). */
static int lease_set_locs(kvc_lease *l, Tierkv__V1__BlockLoc **locs, size_t count)
{
    for (size_t i = 0; i < count; i++) {
        const Tierkv__V1__BlockLoc *b = locs[i];
        l->tier[i] = (uint8_t)b->tier;
        l->in_l2[i] = b->in_l2 ? 1 : 0;
        l->l2_offset[i] = b->l2_offset;
        l->in_l1[i] = b->in_l1 ? 1 : 0;
        l->l1_offset[i] = b->l1_offset;
    }
    return KVC_OK;
}

/* A lease from a Lookup reply for a query of num_tokens tokens; NULL (with the error set)
 * when the reply does not add up. */
static kvc_lease *lease_from(kvc_client *c, const Tierkv__V1__LookupResponse *resp,
                             size_t num_tokens)
{
    if (resp->n_blocks != resp->num_hit_blocks ||
        (resp->num_hit_blocks > 0 && resp->lease_id == 0) ||
        resp->num_hit_blocks > resp->num_query_blocks ||
        (uint64_t)resp->num_query_blocks * c->block_tokens > num_tokens) {
        fail(KVC_EPROTO, "Lookup reply inconsistent: %u hit blocks, %zu locations, "
             "%u query blocks, lease %llu", resp->num_hit_blocks, resp->n_blocks,
             resp->num_query_blocks, (unsigned long long)resp->lease_id);
        return NULL;
    }
    /* one allocation: the lease, then its offsets (8-byte aligned after the struct) and flags */
    size_t n = (size_t)resp->num_hit_blocks + 1;
    kvc_lease *l = tkv_xcalloc(1, sizeof(*l) + n * (2 * sizeof(uint64_t) + 3));
    l->id = resp->lease_id;
    l->num_blocks = resp->num_hit_blocks;
    l->num_query_blocks = resp->num_query_blocks;
    l->l2_offset = (uint64_t *)(void *)(l + 1);
    l->l1_offset = l->l2_offset + n;
    l->tier = (uint8_t *)(l->l1_offset + n);
    l->in_l2 = l->tier + n;
    l->in_l1 = l->in_l2 + n;
    lease_set_locs(l, resp->blocks, resp->n_blocks);
    return l;
}

typedef struct take_lease_arg {
    kvc_lease **out;
    size_t num_tokens;
} take_lease_arg;

static int take_lease(kvc_client *c, const void *rsp, void *arg)
{
    take_lease_arg *a = arg;
    *a->out = lease_from(c, rsp, a->num_tokens);
    return *a->out ? KVC_OK : KVC_EPROTO;
}

int kvc_lookup(kvc_client *c, const uint32_t *tokens, size_t num_tokens, uint32_t ttl_ms,
               kvc_lease **out)
{
    int rc = check_tokens(c, tokens, num_tokens);
    if (rc != KVC_OK)
        return rc;
    if (!out)
        return fail(KVC_EINVAL, "out pointer is NULL");
    *out = NULL;
    Tierkv__V1__LookupRequest req = TIERKV__V1__LOOKUP_REQUEST__INIT;
    req.scope = &c->scope;
    req.n_tokens = num_tokens;
    req.tokens = (uint32_t *)tokens;
    req.lease_ttl_ms = ttl_ms ? ttl_ms : c->lease_ttl_ms;
    take_lease_arg a = {out, num_tokens};
    return CALL(c, Lookup, &req, lookup_response, c->timeout_ms, take_lease, &a);
}

typedef struct take_batch_arg {
    kvc_lease **out;
    const size_t *num_tokens;
    size_t num_prompts;
} take_batch_arg;

/* All or nothing: a reply that does not add up releases every lease it granted. */
static int take_batch(kvc_client *c, const void *rsp, void *arg)
{
    const Tierkv__V1__LookupBatchResponse *r = rsp;
    take_batch_arg *a = arg;
    int rc = KVC_OK;
    size_t done = 0;
    if (r->n_results != a->num_prompts)
        rc = fail(KVC_EPROTO, "LookupBatch answered %zu results for %zu prompts", r->n_results,
                  a->num_prompts);
    for (; rc == KVC_OK && done < a->num_prompts; done++) {
        a->out[done] = lease_from(c, r->results[done], a->num_tokens[done]);
        if (!a->out[done])
            rc = KVC_EPROTO;
    }
    if (rc == KVC_OK)
        return KVC_OK;
    for (size_t i = 0; i < r->n_results; i++) {
        kvc_lease *l = i < done ? a->out[i] : NULL;
        if (!l && r->results[i]->lease_id) {
            l = tkv_xcalloc(1, sizeof(*l));
            l->id = r->results[i]->lease_id;
        }
        kvc_release(c, l);
        if (i < a->num_prompts)
            a->out[i] = NULL;
    }
    return rc;
}

int kvc_lookup_batch(kvc_client *c, const uint32_t *const *tokens, const size_t *num_tokens,
                     size_t num_prompts, uint32_t ttl_ms, kvc_lease **out)
{
    if (!c || !out || (num_prompts && (!tokens || !num_tokens)))
        return fail(KVC_EINVAL, "client, tokens, num_tokens or out is NULL");
    if (num_prompts > 256)
        return fail(KVC_EINVAL, "%zu prompts in one batch, at most 256", num_prompts);
    int rc = KVC_OK;
    for (size_t i = 0; i < num_prompts && rc == KVC_OK; i++)
        rc = check_tokens(c, tokens[i], num_tokens[i]);
    if (rc != KVC_OK)
        return rc;
    Tierkv__V1__LookupBatchRequest req = TIERKV__V1__LOOKUP_BATCH_REQUEST__INIT;
    req.scope = &c->scope;
    Tierkv__V1__Prompt *prompts = tkv_xcalloc(num_prompts + 1, sizeof(*prompts));
    Tierkv__V1__Prompt **ptrs = tkv_xcalloc(num_prompts + 1, sizeof(*ptrs));
    for (size_t i = 0; i < num_prompts; i++) {
        tierkv__v1__prompt__init(&prompts[i]);
        prompts[i].n_tokens = num_tokens[i];
        prompts[i].tokens = (uint32_t *)tokens[i];
        ptrs[i] = &prompts[i];
    }
    req.n_prompts = num_prompts;
    req.prompts = ptrs;
    req.lease_ttl_ms = ttl_ms ? ttl_ms : c->lease_ttl_ms;
    take_batch_arg ta = {out, num_tokens, num_prompts};
    rc = CALL(c, LookupBatch, &req, lookup_batch_response, c->timeout_ms, take_batch, &ta);
    free(prompts);
    free(ptrs);
    return rc;
}

uint64_t kvc_lease_id(const kvc_lease *l) { return l ? l->id : 0; }
uint32_t kvc_lease_num_blocks(const kvc_lease *l) { return l ? l->num_blocks : 0; }
uint32_t kvc_lease_num_query_blocks(const kvc_lease *l) { return l ? l->num_query_blocks : 0; }

int kvc_lease_tier(const kvc_lease *l, uint32_t i)
{
    return (l && i < l->num_blocks) ? l->tier[i] : KVC_TIER_NONE;
}

static void lease_free(kvc_lease *l)
{
    if (!l)
        return;
    free(l); /* its arrays live in the same allocation (lease_from) */
}

int kvc_release(kvc_client *c, kvc_lease *l)
{
    if (!l)
        return KVC_OK;
    int rc = KVC_OK;
    if (!c) {
        rc = fail(KVC_EINVAL, "client is NULL");
    } else if (l->id) {
        Tierkv__V1__ReleaseRequest req = TIERKV__V1__RELEASE_REQUEST__INIT;
        req.lease_id = l->id;
        rc = CALL(c, Release, &req, release_response, c->timeout_ms, NULL, NULL);
    }
    lease_free(l);
    return rc;
}

typedef struct take_prefetch_arg {
    kvc_lease *l;
    bool wait;
    uint64_t *ticket;
} take_prefetch_arg;

static int take_prefetch(kvc_client *c, const void *rsp, void *arg)
{
    const Tierkv__V1__PrefetchResponse *resp = rsp;
    take_prefetch_arg *a = arg;
    kvc_lease *l = a->l;
    int rc = KVC_OK;
    (void)c;
    if (a->ticket)
        *a->ticket = resp->ticket;
    if (a->wait) {
        if (resp->n_blocks > l->num_blocks) {
            rc = fail(KVC_EPROTO, "Prefetch answered %zu locations for a lease of %u blocks",
                      resp->n_blocks, l->num_blocks);
        } else {
            lease_set_locs(l, resp->blocks, resp->n_blocks);
            if (resp->n_blocks < l->num_blocks) {
                /* blocks that failed their checksum were dropped: the prefix ends before */
                l->num_blocks = (uint32_t)resp->n_blocks;
                rc = fail(KVC_EDATALOSS, "Prefetch: lease %llu now covers %zu blocks",
                          (unsigned long long)l->id, resp->n_blocks);
            }
        }
    }
    return rc;
}

static int prefetch_call(kvc_client *c, kvc_lease *l, int tier, bool wait, uint32_t timeout_ms,
                         uint64_t *ticket)
{
    if (!c || !l)
        return fail(KVC_EINVAL, "client or lease is NULL");
    if (tier != KVC_TIER_L2 && tier != KVC_TIER_L1)
        return fail(KVC_EINVAL, "prefetch target tier must be L1 or L2, not %s",
                    kvc_tier_name(tier));
    if (l->id == 0) /* nothing hit: nothing to promote */
        return KVC_OK;
    Tierkv__V1__PrefetchRequest req = TIERKV__V1__PREFETCH_REQUEST__INIT;
    req.lease_id = l->id;
    req.tier = (Tierkv__V1__Tier)tier;
    req.wait = wait;
    req.timeout_ms = timeout_ms;
    /* the RPC deadline leaves the daemon room to answer DEADLINE_EXCEEDED itself */
    uint32_t rpc_ms = !wait ? c->timeout_ms : timeout_ms ? timeout_ms + c->timeout_ms : 0;
    take_prefetch_arg a = {l, wait, ticket};
    return CALL(c, Prefetch, &req, prefetch_response, rpc_ms, take_prefetch, &a);
}


int kvc_prefetch(kvc_client *c, kvc_lease *l, int tier, uint64_t *ticket)
{
    return prefetch_call(c, l, tier, false, 0, ticket);
}

int kvc_wait(kvc_client *c, kvc_lease *l, int tier, uint32_t timeout_ms)
{
    return prefetch_call(c, l, tier, true, timeout_ms, NULL);
}

static int take_cost(kvc_client *c, const void *rsp, void *arg)
{
    const Tierkv__V1__CostCheckResponse *r = rsp;
    kvc_cost *out = arg;
    (void)c;
    out->restore_ms = r->restore_ms;
    out->use_cache = r->use_cache ? 1 : 0;
    out->blocks_in_tier = r->blocks_in_tier;
    out->blocks_from_l2 = r->blocks_from_l2;
    out->blocks_from_l3 = r->blocks_from_l3;
    out->pcie_gbps = r->pcie_gbps;
    out->l3_read_gbps = r->l3_read_gbps;
    return KVC_OK;
}


int kvc_cost_check(kvc_client *c, const kvc_lease *l, double prefill_ms, int tier,
                   kvc_cost *out)
{
    if (!c || !l || !out)
        return fail(KVC_EINVAL, "client, lease or out is NULL");
    if (!(prefill_ms > 0))
        return fail(KVC_EINVAL, "prefill estimate must be > 0 ms");
    if (tier != KVC_TIER_L1 && tier != KVC_TIER_L2)
        return fail(KVC_EINVAL, "cost check tier must be L1 or L2, not %s", kvc_tier_name(tier));
    memset(out, 0, sizeof(*out));
    if (l->id == 0) { /* nothing hit: there is nothing to restore, recompute */
        out->use_cache = 0;
        return KVC_OK;
    }
    Tierkv__V1__CostCheckRequest req = TIERKV__V1__COST_CHECK_REQUEST__INIT;
    req.lease_id = l->id;
    req.prefill_ms = prefill_ms;
    req.tier = (Tierkv__V1__Tier)tier;
    int rc = CALL(c, CostCheck, &req, cost_check_response, c->timeout_ms, take_cost, out);
    if (rc != KVC_OK)
        return rc;
    if ((uint64_t)out->blocks_in_tier + out->blocks_from_l2 + out->blocks_from_l3 > l->num_blocks)
        return fail(KVC_EPROTO, "CostCheck counts %u+%u+%u blocks for a lease of %u",
                    out->blocks_in_tier, out->blocks_from_l2, out->blocks_from_l3, l->num_blocks);
    return KVC_OK;
}

const void *kvc_lease_block_ptr(const kvc_client *c, const kvc_lease *l, uint32_t i)
{
    if (!c || !l || !c->pool || i >= l->num_blocks || !l->in_l2[i])
        return NULL;
    uint64_t off = l->l2_offset[i];
    if (off > c->pool_bytes || c->pool_bytes - off < c->block_bytes)
        return NULL; /* an offset outside the pool is never dereferenced */
    return c->pool + off;
}

/* Where a get puts its blocks: one flat buffer (kvc_get), or pieces (kvc_get_scatter). Block
 * b counts from the get's first block. */
typedef struct get_sink {
    uint8_t *flat;               /* block after block, or NULL */
    const kvc_iov *iov;          /* iov_per_block pieces per block, validated */
    uint32_t iov_per_block;
    size_t block_bytes;
} get_sink;

static void sink_put(const get_sink *s, uint32_t b, const uint8_t *src)
{
    if (s->flat) {
        memcpy(s->flat + (size_t)b * s->block_bytes, src, s->block_bytes);
        return;
    }
    const kvc_iov *v = s->iov + (size_t)b * s->iov_per_block;
    for (uint32_t i = 0; i < s->iov_per_block; i++) {
        if (v[i].len)
            memcpy(v[i].base, src, v[i].len);
        src += v[i].len;
    }
}

typedef struct take_get_arg {
    const get_sink *sink;
    uint32_t first;              /* lease index of the message's first block */
    uint32_t sink_first;         /* its index in the sink */
    uint32_t n;
} take_get_arg;

static int take_get(kvc_client *c, const void *rsp, void *arg)
{
    const Tierkv__V1__GetResponse *resp = rsp;
    take_get_arg *a = arg;
    if (resp->n_blocks != a->n)
        return fail(KVC_EPROTO, "Get answered %zu blocks for %u asked", resp->n_blocks, a->n);
    for (uint32_t i = 0; i < a->n; i++)
        if (resp->blocks[i].len != c->block_bytes)
            return fail(KVC_EPROTO, "Get block %u has %zu bytes, expected %zu", a->first + i,
                        resp->blocks[i].len, c->block_bytes);
    for (uint32_t i = 0; i < a->n; i++)
        sink_put(a->sink, a->sink_first + i, resp->blocks[i].data);
    return KVC_OK;
}

/* By-value Get of lease blocks [first, first + count) into the sink from its block
 * sink_first on, split into messages that stay under the size limit. */
static int get_by_value(kvc_client *c, const kvc_lease *l, uint32_t first, uint32_t count,
                        const get_sink *sink, uint32_t sink_first)
{
    uint32_t per_msg = c->blocks_per_msg;
    while (count > 0) {
        uint32_t n = count < per_msg ? count : per_msg;
        Tierkv__V1__GetRequest req = TIERKV__V1__GET_REQUEST__INIT;
        req.lease_id = l->id;
        req.first = first;
        req.count = n;
        take_get_arg a = {sink, first, sink_first, n};
        int rc = CALL(c, Get, &req, get_response, c->timeout_ms, take_get, &a);
        if (rc != KVC_OK)
            return rc;
        first += n;
        sink_first += n;
        count -= n;
    }
    return KVC_OK;
}

/* Checks a get's block range against the lease; count 0 becomes "to the end" when to_end. */
static int check_range(const kvc_client *c, const kvc_lease *l, uint32_t first, uint32_t *count,
                       bool to_end)
{
    if (!c || !l)
        return fail(KVC_EINVAL, "client or lease is NULL");
    if (first > l->num_blocks)
        return fail(KVC_EINVAL, "first block %u beyond the lease's %u blocks", first,
                    l->num_blocks);
    if (*count == 0 && to_end)
        *count = l->num_blocks - first;
    if (*count > l->num_blocks - first)
        return fail(KVC_EINVAL, "blocks %u..%u beyond the lease's %u blocks", first,
                    first + *count - 1, l->num_blocks);
    return KVC_OK;
}

/* Lease blocks [first, first + count) into the sink: a block in the mapped L2 pool by a copy
 * from the mapping, runs of the others by value. */
static int get_blocks(kvc_client *c, const kvc_lease *l, uint32_t first, uint32_t count,
                      const get_sink *sink)
{
    uint32_t i = first, end = first + count;
    while (i < end) {
        const void *p = kvc_lease_block_ptr(c, l, i);
        if (p) {
            /* mapped: the lease pins the block in L2, so its slot cannot be reused under us */
            sink_put(sink, i - first, p);
            i++;
            continue;
        }
        uint32_t j = i + 1;
        while (j < end && !kvc_lease_block_ptr(c, l, j))
            j++;
        int rc = get_by_value(c, l, i, j - i, sink, i - first);
        if (rc != KVC_OK)
            return rc;
        i = j;
    }
    return KVC_OK;
}

int kvc_get(kvc_client *c, const kvc_lease *l, uint32_t first, uint32_t count, void *dst,
            size_t dst_len)
{
    int rc = check_range(c, l, first, &count, true);
    if (rc != KVC_OK)
        return rc;
    if (!dst)
        return fail(KVC_EINVAL, "destination is NULL");
    if (dst_len / c->block_bytes < count)
        return fail(KVC_EINVAL, "destination of %zu bytes is smaller than %u blocks of %zu",
                    dst_len, count, c->block_bytes);
    get_sink sink = {.flat = dst, .block_bytes = c->block_bytes};
    return get_blocks(c, l, first, count, &sink);
}

/* Does [p, p + len) meet [base, base + bytes)? */
static bool meets(uintptr_t p, size_t len, uintptr_t base, uint64_t bytes)
{
    return base && bytes && p < base + bytes && base < p + len;
}

/* The checks of kvc_iov pieces (kvclient.h) for num_blocks blocks; a get's pieces must also
 * stay out of this client's mappings (a write there faults, or with a writable mapping
 * corrupts the daemon's blocks). */
static int check_iov(const kvc_client *c, const kvc_iov *iov, uint32_t iov_per_block,
                     uint32_t num_blocks, bool writes)
{
    if (iov_per_block == 0 || iov_per_block > KVC_IOV_MAX)
        return fail(KVC_EINVAL, "%u pieces per block: must be 1..%u", iov_per_block,
                    (unsigned)KVC_IOV_MAX);
    if (num_blocks && !iov)
        return fail(KVC_EINVAL, "pieces (iov) is NULL for %u blocks", num_blocks);
    for (uint32_t b = 0; b < num_blocks; b++) {
        const kvc_iov *v = iov + (size_t)b * iov_per_block;
        size_t sum = 0;
        for (uint32_t i = 0; i < iov_per_block; i++) {
            uintptr_t p = (uintptr_t)v[i].base;
            size_t len = v[i].len;
            if (len == 0)
                continue;
            if (!p)
                return fail(KVC_EINVAL, "block %u piece %u: base is NULL with %zu bytes", b, i,
                            len);
            if (len > UINTPTR_MAX - p)
                return fail(KVC_EINVAL, "block %u piece %u: %zu bytes from %p wrap the address "
                            "space", b, i, len, v[i].base);
            if (len > c->block_bytes - sum)
                return fail(KVC_EINVAL, "block %u: pieces 0..%u hold more than the block's %zu "
                            "bytes", b, i, c->block_bytes);
            sum += len;
            if (writes && (meets(p, len, (uintptr_t)c->pool, c->pool_bytes) ||
                           meets(p, len, (uintptr_t)c->l1_base, c->l1_bytes)))
                return fail(KVC_EINVAL, "block %u piece %u: %zu bytes at %p lie in the "
                            "daemon's mapped pool", b, i, len, v[i].base);
        }
        if (sum != c->block_bytes)
            return fail(KVC_EINVAL, "block %u: its %u pieces hold %zu bytes, a block is %zu", b,
                        iov_per_block, sum, c->block_bytes);
    }
    return KVC_OK;
}

int kvc_get_scatter(kvc_client *c, const kvc_lease *l, uint32_t first, uint32_t count,
                    const kvc_iov *iov, uint32_t iov_per_block)
{
    int rc = check_range(c, l, first, &count, false);
    if (rc == KVC_OK)
        rc = check_iov(c, iov, iov_per_block, count, true);
    if (rc != KVC_OK || count == 0)
        return rc;
    get_sink sink = {.iov = iov, .iov_per_block = iov_per_block, .block_bytes = c->block_bytes};
    return get_blocks(c, l, first, count, &sink);
}

/* =========================================================================================
 * put, alloc / write / commit
 * ========================================================================================= */

/* Adds a Put's or Commit's counts to res (may be NULL). */
static int take_put(kvc_client *c, const void *rsp, void *arg)
{
    kvc_put_result *res = arg;
    (void)c;
    if (!res)
        return KVC_OK;
    if (((const ProtobufCMessage *)rsp)->descriptor == &tierkv__v1__put_response__descriptor) {
        const Tierkv__V1__PutResponse *r = rsp;
        res->num_stored += r->num_stored;
        res->num_duplicate += r->num_duplicate;
        res->num_rejected += r->num_rejected;
    } else {
        const Tierkv__V1__CommitResponse *r = rsp;
        res->num_stored += r->num_stored;
        res->num_duplicate += r->num_duplicate;
    }
    return KVC_OK;
}

/* The checks every put makes of its prompt and block range (num_blocks > 0). */
static int check_put(const kvc_client *c, size_t num_tokens, uint32_t first_block,
                     uint32_t num_blocks)
{
    if (((uint64_t)first_block + num_blocks) * c->block_tokens > num_tokens)
        return fail(KVC_EINVAL, "blocks %u..%u need %llu tokens, got %zu", first_block,
                    first_block + num_blocks - 1,
                    (unsigned long long)((uint64_t)first_block + num_blocks) * c->block_tokens,
                    num_tokens);
    return KVC_OK;
}

int kvc_put(kvc_client *c, const uint32_t *tokens, size_t num_tokens, uint32_t first_block,
            const void *payloads, uint32_t num_blocks, kvc_put_result *res)
{
    int rc = check_tokens(c, tokens, num_tokens);
    if (rc != KVC_OK)
        return rc;
    if (res)
        memset(res, 0, sizeof(*res));
    if (num_blocks == 0)
        return KVC_OK;
    if (!payloads)
        return fail(KVC_EINVAL, "payloads is NULL");
    if ((rc = check_put(c, num_tokens, first_block, num_blocks)) != KVC_OK)
        return rc;
    uint32_t per_msg = c->blocks_per_msg;
    ProtobufCBinaryData *bins = tkv_xcalloc(per_msg, sizeof(*bins));
    const uint8_t *src = payloads;
    uint32_t done = 0;
    while (done < num_blocks) {
        uint32_t n = num_blocks - done < per_msg ? num_blocks - done : per_msg;
        uint32_t first = first_block + done;
        Tierkv__V1__PutRequest req = TIERKV__V1__PUT_REQUEST__INIT;
        req.scope = &c->scope;
        /* the prompt prefix through the last block of this message: the daemon derives the
         * chain keys from it */
        req.n_tokens = (size_t)(first + n) * c->block_tokens;
        req.tokens = (uint32_t *)tokens;
        req.first_block = first;
        req.n_blocks = n;
        for (uint32_t i = 0; i < n; i++) {
            bins[i].data = (uint8_t *)src + (size_t)(done + i) * c->block_bytes;
            bins[i].len = c->block_bytes;
        }
        req.blocks = bins;
        rc = CALL(c, Put, &req, put_response, c->timeout_ms, take_put, res);
        if (rc != KVC_OK)
            break;
        done += n;
    }
    free(bins);
    return rc;
}

int kvc_put_gather(kvc_client *c, const uint32_t *tokens, size_t num_tokens,
                   uint32_t first_block, const kvc_iov *iov, uint32_t iov_per_block,
                   uint32_t num_blocks, kvc_put_result *res)
{
    int rc = check_tokens(c, tokens, num_tokens);
    if (rc != KVC_OK)
        return rc;
    if (res)
        memset(res, 0, sizeof(*res));
    if (num_blocks == 0)
        return KVC_OK;
    if ((rc = check_put(c, num_tokens, first_block, num_blocks)) != KVC_OK ||
        (rc = check_iov(c, iov, iov_per_block, num_blocks, false)) != KVC_OK)
        return rc;
    /* the blocks go in the tail: gathered from their pieces into the message itself */
    const ProtobufCFieldDescriptor *fd = protobuf_c_message_descriptor_get_field_by_name(
        &tierkv__v1__put_request__descriptor, "blocks");
    TKV_ASSERT(fd && fd->type == PROTOBUF_C_TYPE_BYTES && fd->label == PROTOBUF_C_LABEL_REPEATED);
    uint32_t per_msg = c->blocks_per_msg, done = 0;
    while (done < num_blocks) {
        uint32_t n = num_blocks - done < per_msg ? num_blocks - done : per_msg;
        uint32_t first = first_block + done;
        Tierkv__V1__PutRequest req = TIERKV__V1__PUT_REQUEST__INIT;
        req.scope = &c->scope;
        req.n_tokens = (size_t)(first + n) * c->block_tokens; /* as kvc_put */
        req.tokens = (uint32_t *)tokens;
        req.first_block = first;
        msg_tail tail = {.field = fd->id,
                         .iov = iov + (size_t)done * iov_per_block,
                         .iov_per_block = iov_per_block, .num_blocks = n,
                         .block_bytes = c->block_bytes};
        rc = CALL_TAIL(c, Put, &req, &tail, put_response, c->timeout_ms, take_put, res);
        if (rc != KVC_OK)
            break;
        done += n;
    }
    return rc;
}

int kvc_alloc(kvc_client *c, uint32_t num_blocks, uint64_t *alloc_id, uint64_t *offsets)
{
    return kvc_alloc_tier(c, KVC_TIER_L2, num_blocks, alloc_id, offsets);
}

typedef struct take_alloc_arg {
    uint64_t *alloc_id, *offsets;
    uint32_t num_blocks;
} take_alloc_arg;

static int take_alloc(kvc_client *c, const void *rsp, void *arg)
{
    const Tierkv__V1__AllocResponse *resp = rsp;
    take_alloc_arg *a = arg;
    (void)c;
    if (resp->alloc_id == 0 || resp->n_offsets != a->num_blocks)
        return fail(KVC_EPROTO, "Alloc answered id %llu with %zu offsets for %u blocks",
                    (unsigned long long)resp->alloc_id, resp->n_offsets, a->num_blocks);
    *a->alloc_id = resp->alloc_id;
    if (a->offsets)
        memcpy(a->offsets, resp->offsets, a->num_blocks * sizeof(uint64_t));
    return KVC_OK;
}

int kvc_alloc_tier(kvc_client *c, int tier, uint32_t num_blocks, uint64_t *alloc_id,
                   uint64_t *offsets)
{
    if (!c || !alloc_id)
        return fail(KVC_EINVAL, "client or alloc_id is NULL");
    if (tier != KVC_TIER_L1 && tier != KVC_TIER_L2)
        return fail(KVC_EINVAL, "alloc tier must be L1 or L2, not %s", kvc_tier_name(tier));
    if (num_blocks == 0)
        return fail(KVC_EINVAL, "cannot allocate 0 blocks");
    Tierkv__V1__AllocRequest req = TIERKV__V1__ALLOC_REQUEST__INIT;
    req.scope = &c->scope;
    req.num_blocks = num_blocks;
    req.tier = (Tierkv__V1__Tier)tier;
    take_alloc_arg a = {alloc_id, offsets, num_blocks};
    return CALL(c, Alloc, &req, alloc_response, c->timeout_ms, take_alloc, &a);
}

int kvc_write(kvc_client *c, uint64_t alloc_id, uint32_t index, const void *payload, size_t len)
{
    if (!c || !payload)
        return fail(KVC_EINVAL, "client or payload is NULL");
    if (len != c->block_bytes)
        return fail(KVC_EINVAL, "payload of %zu bytes, a block is %zu", len, c->block_bytes);
    Tierkv__V1__WriteSlotRequest req = TIERKV__V1__WRITE_SLOT_REQUEST__INIT;
    req.alloc_id = alloc_id;
    req.index = index;
    req.payload.data = (uint8_t *)payload;
    req.payload.len = len;
    return CALL(c, WriteSlot, &req, write_slot_response, c->timeout_ms, NULL, NULL);
}

int kvc_commit(kvc_client *c, uint64_t alloc_id, const uint32_t *tokens, size_t num_tokens,
               uint32_t first_block, uint32_t num_blocks, kvc_put_result *res)
{
    int rc = check_tokens(c, tokens, num_tokens);
    if (rc != KVC_OK)
        return rc;
    if (res)
        memset(res, 0, sizeof(*res));
    if (((uint64_t)first_block + num_blocks) * c->block_tokens > num_tokens)
        return fail(KVC_EINVAL, "committing blocks %u..%u needs %llu tokens, got %zu",
                    first_block, first_block + num_blocks - 1,
                    (unsigned long long)((uint64_t)first_block + num_blocks) * c->block_tokens,
                    num_tokens);
    Tierkv__V1__CommitRequest req = TIERKV__V1__COMMIT_REQUEST__INIT;
    req.scope = &c->scope;
    req.alloc_id = alloc_id;
    req.n_tokens = (size_t)(first_block + num_blocks) * c->block_tokens;
    req.tokens = (uint32_t *)tokens;
    req.first_block = first_block;
    req.num_blocks = num_blocks;
    return CALL(c, Commit, &req, commit_response, c->timeout_ms, take_put, res);
}

int kvc_abort(kvc_client *c, uint64_t alloc_id)
{
    if (!c || alloc_id == 0)
        return fail(KVC_EINVAL, "client is NULL or allocation id is 0");
    Tierkv__V1__ReleaseRequest req = TIERKV__V1__RELEASE_REQUEST__INIT;
    req.alloc_id = alloc_id;
    return CALL(c, Release, &req, release_response, c->timeout_ms, NULL, NULL);
}

/* =========================================================================================
 * operations
 * ========================================================================================= */

static int take_stats(kvc_client *c, const void *rsp, void *arg)
{
    const Tierkv__V1__StatsResponse *r = rsp;
    kvc_stats *out = arg;
    (void)c;
    out->lookups = r->lookups;
    out->hit_blocks = r->hit_blocks;
    out->miss_blocks = r->miss_blocks;
    out->hit_tokens = r->hit_tokens;
    out->promotions = r->promotions;
    out->promotion_bytes = r->promotion_bytes;
    out->demotions = r->demotions;
    out->demotion_bytes = r->demotion_bytes;
    out->evictions = r->evictions;
    out->checksum_failures = r->checksum_failures;
    out->io_errors = r->io_errors;
    out->leases_active = r->leases_active;
    out->clients_connected = r->clients_connected;
    out->lookup_p50_us = r->lookup_p50_us;
    out->lookup_p99_us = r->lookup_p99_us;
    out->uptime_s = r->uptime_s;
    out->puts = r->puts;
    out->put_blocks = r->put_blocks;
    out->gets = r->gets;
    out->get_bytes = r->get_bytes;
    out->l3_readonly = r->l3_readonly ? 1 : 0;
    copy_cstr(out->policy, sizeof(out->policy), r->policy);
    for (int t = 0; t < 4; t++)
        out->tiers[t].tier = t;
    for (size_t i = 0; i < r->n_tiers; i++) {
        const Tierkv__V1__TierStats *ts = r->tiers[i];
        if (ts->tier < 0 || ts->tier > 3)
            continue; /* a tier this client does not know yet */
        kvc_tier_stats *d = &out->tiers[ts->tier];
        d->blocks = ts->blocks;
        d->bytes = ts->bytes;
        d->capacity_blocks = ts->capacity_blocks;
        d->hit_blocks = ts->hit_blocks;
    }
    if (r->geometry) {
        const Tierkv__V1__Geometry *g = r->geometry;
        out->num_layers = g->num_layers;
        out->num_kv_heads = g->num_kv_heads;
        out->head_dim = g->head_dim;
        out->block_tokens = g->block_tokens;
        out->block_bytes = g->block_bytes;
        copy_cstr(out->kv_dtype, sizeof(out->kv_dtype), g->kv_dtype);
        copy_cstr(out->scale_mode, sizeof(out->scale_mode), g->scale_mode);
        copy_cstr(out->model_id, sizeof(out->model_id), g->model_id);
    }
    return KVC_OK;
}

/* A getter's arguments: both set; *out cleared. */
static int getter_args(const kvc_client *c, void *out, size_t out_bytes)
{
    if (!c || !out)
        return fail(KVC_EINVAL, "client or out is NULL");
    memset(out, 0, out_bytes);
    return KVC_OK;
}

int kvc_stats_get(kvc_client *c, kvc_stats *out)
{
    Tierkv__V1__StatsRequest req = TIERKV__V1__STATS_REQUEST__INIT;
    int rc = getter_args(c, out, sizeof(*out));
    return rc != KVC_OK ? rc : CALL(c, Stats, &req, stats_response, c->timeout_ms, take_stats, out);
}

static int take_health(kvc_client *c, const void *rsp, void *arg)
{
    const Tierkv__V1__HealthResponse *r = rsp;
    kvc_health *out = arg;
    (void)c;
    copy_cstr(out->status, sizeof(out->status), r->status);
    copy_cstr(out->version, sizeof(out->version), r->version);
    size_t used = 0;
    for (size_t i = 0; i < r->n_notes; i++) {
        int n = snprintf(out->notes + used, sizeof(out->notes) - used, "%s%s", i ? "; " : "",
                         r->notes[i] ? r->notes[i] : "");
        if (n < 0 || (size_t)n >= sizeof(out->notes) - used)
            break; /* truncated: the rest does not fit */
        used += (size_t)n;
    }
    return KVC_OK;
}

int kvc_health_get(kvc_client *c, kvc_health *out)
{
    Tierkv__V1__HealthRequest req = TIERKV__V1__HEALTH_REQUEST__INIT;
    int rc = getter_args(c, out, sizeof(*out));
    return rc != KVC_OK ? rc : CALL(c, Health, &req, health_response, c->timeout_ms, take_health, out);
}

static void hex32(const ProtobufCBinaryData *b, char out[65])
{
    static const char hex[] = "0123456789abcdef";
    size_t n = b->len < 32 ? b->len : 32;
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = hex[b->data[i] >> 4];
        out[2 * i + 1] = hex[b->data[i] & 15];
    }
    out[2 * n] = '\0';
}

typedef struct take_list_arg {
    kvc_block_fn fn;
    void *arg;
    uint64_t *total;
} take_list_arg;

static int take_list(kvc_client *c, const void *rsp, void *arg)
{
    const Tierkv__V1__ListBlocksResponse *r = rsp;
    take_list_arg *a = arg;
    (void)c;
    if (a->total)
        *a->total = r->total;
    for (size_t i = 0; i < r->n_blocks; i++) {
        const Tierkv__V1__BlockInfo *b = r->blocks[i];
        kvc_block_info bi;
        memset(&bi, 0, sizeof(bi));
        hex32(&b->key, bi.key_hex);
        hex32(&b->parent, bi.parent_hex);
        bi.depth = b->depth;
        copy_cstr(bi.state, sizeof(bi.state), b->state);
        bi.in_l2 = b->in_l2;
        bi.in_l3 = b->in_l3;
        bi.pins = b->pins;
        bi.hits = b->hits;
        bi.last_access_ms = b->last_access_ms;
        if (a->fn(a->arg, &bi) != 0)
            break;
    }
    return KVC_OK;
}

int kvc_list_blocks(kvc_client *c, int tier, uint32_t limit, kvc_block_fn fn, void *arg,
                    uint64_t *total)
{
    if (!c || !fn)
        return fail(KVC_EINVAL, "client or callback is NULL");
    if (tier < KVC_TIER_NONE || tier > KVC_TIER_L3)
        return fail(KVC_EINVAL, "tier %d is not none, L1, L2 or L3", tier);
    Tierkv__V1__ListBlocksRequest req = TIERKV__V1__LIST_BLOCKS_REQUEST__INIT;
    req.limit = limit;
    req.tier = (Tierkv__V1__Tier)tier;
    take_list_arg a = {fn, arg, total};
    return CALL(c, ListBlocks, &req, list_blocks_response, c->timeout_ms, take_list, &a);
}


static int take_evict(kvc_client *c, const void *rsp, void *arg)
{
    const Tierkv__V1__EvictResponse *r = rsp;
    uint32_t **counts = arg;
    (void)c;
    if (counts[0])
        *counts[0] = r->num_evicted;
    if (counts[1])
        *counts[1] = r->num_pinned;
    return KVC_OK;
}

int kvc_evict(kvc_client *c, int tier, const uint32_t *tokens, size_t num_tokens,
              uint32_t *num_evicted, uint32_t *num_pinned)
{
    int rc = check_tokens(c, tokens, num_tokens);
    if (rc != KVC_OK)
        return rc;
    if (tier != KVC_TIER_L1 && tier != KVC_TIER_L2 && tier != KVC_TIER_L3)
        return fail(KVC_EINVAL, "evict tier must be L1, L2 or L3, not %s", kvc_tier_name(tier));
    Tierkv__V1__EvictRequest req = TIERKV__V1__EVICT_REQUEST__INIT;
    req.tier = (Tierkv__V1__Tier)tier;
    req.scope = &c->scope;
    req.n_tokens = num_tokens;
    req.tokens = (uint32_t *)tokens;
    uint32_t *counts[2] = {num_evicted, num_pinned};
    return CALL(c, Evict, &req, evict_response, c->timeout_ms, take_evict, counts);
}

int kvc_flush(kvc_client *c)
{
    if (!c)
        return fail(KVC_EINVAL, "client is NULL");
    Tierkv__V1__FlushRequest req = TIERKV__V1__FLUSH_REQUEST__INIT;
    /* a flush waits for the disk: give it more than one ordinary call */
    return CALL(c, Flush, &req, flush_response, c->timeout_ms * 6, NULL, NULL);
}

/* Verify is the one server-streaming method: send the request, then read progress messages
 * one batch at a time until the stream ends, then the status. */
int kvc_verify(kvc_client *c, uint32_t timeout_ms, kvc_progress_fn fn, void *arg, uint64_t *bad)
{
    static const char method[] = "/tierkv.v1.Cache/Verify";
    if (!c)
        return fail(KVC_EINVAL, "client is NULL");
    int rc = KVC_OK;
    bool cancelled = false, got_any = false;
    uint64_t last_bad = 0;
    grpc_completion_queue *cq = grpc_completion_queue_create_for_pluck(NULL);
    grpc_call *call = grpc_channel_create_call(
        c->channel, NULL, GRPC_PROPAGATE_DEFAULTS, cq, grpc_slice_from_static_string(method),
        NULL, deadline_ms(timeout_ms), NULL);
    Tierkv__V1__VerifyRequest req = TIERKV__V1__VERIFY_REQUEST__INIT;
    grpc_byte_buffer *send = pack_message(&req.base, NULL);
    grpc_metadata_array initial_md, trailing_md;
    grpc_metadata_array_init(&initial_md);
    grpc_metadata_array_init(&trailing_md);
    grpc_status_code st = GRPC_STATUS_UNKNOWN;
    grpc_slice details = grpc_empty_slice();
    uintptr_t tag = 1;

    grpc_op ops[4];
    memset(ops, 0, sizeof(ops));
    request_ops(ops, send, &initial_md);
    if (grpc_call_start_batch(call, ops, 4, (void *)tag, NULL) != GRPC_CALL_OK) {
        rc = fail(KVC_EINTERNAL, "Verify: cannot start the call");
        goto status;
    }
    grpc_completion_queue_pluck(cq, (void *)tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    for (;;) {
        grpc_byte_buffer *recv = NULL;
        grpc_op op;
        memset(&op, 0, sizeof(op));
        op.op = GRPC_OP_RECV_MESSAGE;
        op.data.recv_message.recv_message = &recv;
        tag++;
        if (grpc_call_start_batch(call, &op, 1, (void *)tag, NULL) != GRPC_CALL_OK)
            break;
        grpc_completion_queue_pluck(cq, (void *)tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
        if (!recv)
            break; /* end of stream (or failure: the status tells) */
        Tierkv__V1__VerifyProgress *p = (Tierkv__V1__VerifyProgress *)unpack_message(
            recv, &tierkv__v1__verify_progress__descriptor);
        grpc_byte_buffer_destroy(recv);
        if (!p) {
            rc = fail(KVC_EPROTO, "Verify: a progress message does not parse");
            grpc_call_cancel(call, NULL);
            break;
        }
        got_any = true;
        last_bad = p->bad;
        int stop = fn ? fn(arg, p->done, p->total, p->bad) : 0;
        protobuf_c_message_free_unpacked(&p->base, NULL);
        if (stop) {
            cancelled = true;
            grpc_call_cancel(call, NULL);
            break;
        }
    }
status:;
    grpc_op sop;
    memset(&sop, 0, sizeof(sop));
    sop.op = GRPC_OP_RECV_STATUS_ON_CLIENT;
    sop.data.recv_status_on_client.trailing_metadata = &trailing_md;
    sop.data.recv_status_on_client.status = &st;
    sop.data.recv_status_on_client.status_details = &details;
    tag++;
    if (grpc_call_start_batch(call, &sop, 1, (void *)tag, NULL) == GRPC_CALL_OK)
        grpc_completion_queue_pluck(cq, (void *)tag, gpr_inf_future(GPR_CLOCK_REALTIME), NULL);
    if (rc == KVC_OK) {
        if (cancelled)
            rc = fail(KVC_ECANCELLED, "Verify: stopped by the progress callback");
        else
            rc = call_status("Verify", st, details);
        if (rc == KVC_OK && !got_any)
            rc = fail(KVC_EPROTO, "Verify: the stream ended without a progress message");
    }
    if (bad)
        *bad = last_bad;
    call_end(cq, call, send, details, &initial_md, &trailing_md);
    return rc;
}

/* =========================================================================================
 * engine side: the pools as the kernels see them (the kernels and the public layout: engine.c)
 * ========================================================================================= */

/* storage/pool.c rounds every L2 slot up to a page, so an L2 offset / this stride is a slot */
#define KVC_L2_SLOT_ALIGN 4096u

static size_t l2_stride(const kvc_client *c)
{
    return (c->block_bytes + KVC_L2_SLOT_ALIGN - 1) & ~(size_t)(KVC_L2_SLOT_ALIGN - 1);
}

int kvc_has_l1(const kvc_client *c) { return c && c->l1_base ? 1 : 0; }

int kvc_pool_writable(const kvc_client *c, int tier)
{
    if (!c)
        return 0;
    if (tier == KVC_TIER_L1)
        return c->l1_base ? 1 : 0; /* device memory mapped by CUDA IPC is always writable */
    if (tier == KVC_TIER_L2)
        return c->pool && c->pool_writable ? 1 : 0;
    return 0;
}

int tkv_kvc_kernel_layout(const kvc_client *c, int tier, tkvk_layout *out)
{
    if (!c || !out)
        return fail(KVC_EINVAL, "client or layout is NULL");
    if (tier != KVC_TIER_L1 && tier != KVC_TIER_L2)
        return fail(KVC_EINVAL, "pool tier must be L1 or L2, not %s", kvc_tier_name(tier));
    int rc = tkvk_layout_init(out, (int)c->num_layers, (int)c->num_kv_heads, (int)c->head_dim,
                              (int)c->block_tokens, c->kv_dtype, c->scale_mode);
    if (rc != TKVK_OK)
        return fail(KVC_EUNSUPPORTED, "the daemon's geometry has no kernel layout: %s",
                    tkvk_last_error());
    /* the daemon sizes blocks from the same geometry; a difference would misplace every page */
    if (out->block_stride != c->block_bytes)
        return fail(KVC_EPROTO, "kernel layout block of %zu bytes differs from the daemon's %zu",
                    out->block_stride, c->block_bytes);
    out->block_stride = tier == KVC_TIER_L2 ? l2_stride(c) : c->block_bytes;
    return KVC_OK;
}

void *kvc_pool_base(const kvc_client *c, int tier)
{
    if (!c) {
        fail(KVC_EINVAL, "client is NULL");
        return NULL;
    }
    if (tier == KVC_TIER_L2) {
        if (!c->pool)
            fail(KVC_EATTACH, "the L2 pool is not mapped (client not attached)");
        return (void *)c->pool;
    }
    if (tier == KVC_TIER_L1) {
        if (!c->l1_base)
            fail(KVC_EUNAVAILABLE, "the L1 pool is not mapped: %s",
                 c->daemon_has_l1 ? c->l1_why
                 : c->pool        ? "the daemon has no GPU tier"
                                  : "client not attached");
        return c->l1_base;
    }
    fail(KVC_EINVAL, "pool tier must be L1 or L2, not %s", kvc_tier_name(tier));
    return NULL;
}

int64_t kvc_pool_num_blocks(const kvc_client *c, int tier)
{
    if (!c)
        return 0;
    if (tier == KVC_TIER_L2 && c->pool)
        return (int64_t)(c->pool_bytes / l2_stride(c));
    if (tier == KVC_TIER_L1 && c->l1_base)
        return (int64_t)(c->l1_bytes / c->block_bytes);
    return 0;
}

int64_t kvc_offset_block_id(const kvc_client *c, int tier, uint64_t offset)
{
    if (!c || (tier != KVC_TIER_L1 && tier != KVC_TIER_L2))
        return -1;
    uint64_t stride = tier == KVC_TIER_L2 ? l2_stride(c) : c->block_bytes;
    /* a daemon offset that is not a slot of the mapped pool is refused, never dereferenced */
    if (offset % stride != 0 || (int64_t)(offset / stride) >= kvc_pool_num_blocks(c, tier))
        return -1;
    return (int64_t)(offset / stride);
}

int64_t kvc_lease_block_id(const kvc_client *c, const kvc_lease *l, uint32_t i, int tier)
{
    if (!c || !l || i >= l->num_blocks)
        return -1;
    if (tier == KVC_TIER_L2 && l->in_l2[i])
        return kvc_offset_block_id(c, tier, l->l2_offset[i]);
    if (tier == KVC_TIER_L1 && l->in_l1[i])
        return kvc_offset_block_id(c, tier, l->l1_offset[i]);
    return -1;
}
