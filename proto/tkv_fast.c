/* tkv_fast.c - the fast path's records and lean lookup encoding (see tkv_fast.h). */
#include "tkv_fast.h"

#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

/* ---- records ---------------------------------------------------------------------------------- */

static bool grow(uint8_t **buf, size_t *cap, size_t n, char *why, size_t why_cap)
{
    uint8_t *p = realloc(*buf, n);
    if (!p) {
        snprintf(why, why_cap, "out of memory for a %zu-byte message", n);
        return false;
    }
    *buf = p;
    *cap = n;
    return true;
}

/* One record into h and dst (room bytes). */
static ssize_t recv_record(int fd, tkv_fast_hdr *h, uint8_t *dst, size_t room, int *msg_flags)
{
    struct iovec iov[2] = {{h, sizeof(*h)}, {dst, room}};
    struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
    for (;;) {
        ssize_t n = recvmsg(fd, &mh, 0);
        if (n >= 0) {
            *msg_flags = mh.msg_flags;
            return n;
        }
        if (errno != EINTR)
            return -1;
    }
}

int tkv_fast_recv(int fd, tkv_fast_hdr *hdr, uint8_t **buf, size_t *cap, size_t max, size_t *len,
                  char *why, size_t why_cap)
{
    const uint16_t known = TKV_FAST_MORE | TKV_FAST_LEAN;
    size_t got = 0;
    if (*cap < TKV_FAST_FRAG_BYTES && !grow(buf, cap, TKV_FAST_FRAG_BYTES, why, why_cap))
        return -1;
    for (bool first = true;; first = false) {
        tkv_fast_hdr h;
        size_t room = *cap - got < TKV_FAST_FRAG_BYTES ? *cap - got : TKV_FAST_FRAG_BYTES;
        int mf = 0;
        ssize_t n = recv_record(fd, &h, *buf + got, room, &mf);
        if (n == 0 || (n < 0 && (errno == ECONNRESET || errno == EPIPE)))
            return 0;
        if (n < 0) {
            snprintf(why, why_cap, "recv: %s", strerror(errno));
            return -1;
        }
        if ((size_t)n < sizeof(h) || (mf & (MSG_TRUNC | MSG_CTRUNC)) || h.magic != TKV_FAST_MAGIC ||
            (h.flags & ~known)) {
            snprintf(why, why_cap, "malformed record (%zd bytes)", n);
            return -1;
        }
        if (first) {
            if (h.len > max) {
                snprintf(why, why_cap, "message of %u bytes exceeds the limit (%zu)", h.len, max);
                return -1;
            }
            *hdr = h;
            if (*cap < h.len && !grow(buf, cap, h.len, why, why_cap))
                return -1;
        } else if (h.len != hdr->len || h.op != hdr->op ||
                   (h.flags & TKV_FAST_LEAN) != (hdr->flags & TKV_FAST_LEAN)) {
            snprintf(why, why_cap, "a record of another message inside message op %u", hdr->op);
            return -1;
        }
        got += (size_t)n - sizeof(h);
        if (got > hdr->len) {
            snprintf(why, why_cap, "records carry more than the %u bytes announced", hdr->len);
            return -1;
        }
        if (!(h.flags & TKV_FAST_MORE))
            break;
        if (got == hdr->len) {
            snprintf(why, why_cap, "a record after the announced %u bytes", hdr->len);
            return -1;
        }
    }
    if (got != hdr->len) {
        snprintf(why, why_cap, "message ended after %zu of %u bytes", got, hdr->len);
        return -1;
    }
    hdr->flags &= TKV_FAST_LEAN;
    *len = got;
    return 1;
}

bool tkv_fast_send(int fd, uint16_t op, uint16_t flags, uint32_t timeout_ms, int32_t status,
                   const uint8_t *p, size_t len)
{
    size_t off = 0;
    do {
        size_t n = len - off < TKV_FAST_FRAG_BYTES ? len - off : TKV_FAST_FRAG_BYTES;
        tkv_fast_hdr h = {.magic = TKV_FAST_MAGIC, .op = op, .len = (uint32_t)len,
                          .status = status, .timeout_ms = timeout_ms,
                          .flags = (uint16_t)(flags | (off + n < len ? TKV_FAST_MORE : 0))};
        struct iovec iov[2] = {{&h, sizeof(h)}, {(void *)(p + off), n}};
        struct msghdr mh = {.msg_iov = iov, .msg_iovlen = 2};
        ssize_t w = sendmsg(fd, &mh, MSG_NOSIGNAL);
        if (w < 0 && errno == EINTR)
            continue;
        if (w != (ssize_t)(sizeof(h) + n))
            return false;
        off += n;
    } while (off < len);
    return true;
}

/* ---- the lean lookup encoding ------------------------------------------------------------------- */

/* The prompts of a Lookup (one) or LookupBatch request, as (tokens, count) pairs. */
static size_t prompts_of(const ProtobufCMessage *rq, const Tierkv__V1__BlockScope **scope,
                         uint32_t *ttl_ms, const uint32_t **toks, size_t *ns, size_t cap)
{
    if (rq->descriptor == &tierkv__v1__lookup_request__descriptor) {
        const Tierkv__V1__LookupRequest *r = (const Tierkv__V1__LookupRequest *)rq;
        *scope = r->scope;
        *ttl_ms = r->lease_ttl_ms;
        toks[0] = r->tokens;
        ns[0] = r->n_tokens;
        return 1;
    }
    const Tierkv__V1__LookupBatchRequest *r = (const Tierkv__V1__LookupBatchRequest *)rq;
    *scope = r->scope;
    *ttl_ms = r->lease_ttl_ms;
    if (r->n_prompts > cap)
        return SIZE_MAX;
    for (size_t i = 0; i < r->n_prompts; i++) {
        toks[i] = r->prompts[i]->tokens;
        ns[i] = r->prompts[i]->n_tokens;
    }
    return r->n_prompts;
}

size_t tkv_fast_lean_size(const ProtobufCMessage *rq)
{
    const Tierkv__V1__BlockScope *scope;
    uint32_t ttl;
    const uint32_t *toks[TKV_FAST_MAX_PROMPTS];
    size_t ns[TKV_FAST_MAX_PROMPTS];
    size_t n = prompts_of(rq, &scope, &ttl, toks, ns, TKV_FAST_MAX_PROMPTS);
    if (n == SIZE_MAX || !scope || scope->fingerprint.len != 32 || strlen(scope->namespace_) > 255)
        return 0;
    uint64_t bytes = sizeof(tkv_fast_lookup_hdr) + 4 * (uint64_t)n + strlen(scope->namespace_);
    for (size_t i = 0; i < n; i++) {
        if (ns[i] > UINT32_MAX)
            return 0;
        bytes += 4 * (uint64_t)ns[i];
    }
    return bytes > UINT32_MAX ? 0 : (size_t)bytes;
}

void tkv_fast_lean_encode(const ProtobufCMessage *rq, uint8_t *out)
{
    const Tierkv__V1__BlockScope *scope;
    tkv_fast_lookup_hdr h;
    const uint32_t *toks[TKV_FAST_MAX_PROMPTS];
    size_t ns[TKV_FAST_MAX_PROMPTS];
    memset(&h, 0, sizeof(h));
    size_t n = prompts_of(rq, &scope, &h.ttl_ms, toks, ns, TKV_FAST_MAX_PROMPTS);
    memcpy(h.fingerprint, scope->fingerprint.data, 32);
    h.client_id = scope->client_id;
    h.ns_len = (uint32_t)strlen(scope->namespace_);
    h.num_prompts = (uint32_t)n;
    memcpy(out, &h, sizeof(h));
    uint8_t *p = out + sizeof(h);
    for (size_t i = 0; i < n; i++, p += 4) {
        uint32_t c = (uint32_t)ns[i];
        memcpy(p, &c, 4);
    }
    for (size_t i = 0; i < n; p += 4 * ns[i], i++)
        if (ns[i])
            memcpy(p, toks[i], 4 * ns[i]);
    memcpy(p, scope->namespace_, h.ns_len);
}

const ProtobufCMessage *tkv_fast_lean_decode(uint16_t op, const uint8_t *p, size_t len,
                                             tkv_fast_lookup *out, char *why, size_t why_cap)
{
    tkv_fast_lookup_hdr h;
    if (op != TKV_FAST_LOOKUP && op != TKV_FAST_LOOKUP_BATCH) {
        snprintf(why, why_cap, "call %u has no lean encoding", op);
        return NULL;
    }
    if (len < sizeof(h)) {
        snprintf(why, why_cap, "lean lookup of %zu bytes, shorter than its header", len);
        return NULL;
    }
    memcpy(&h, p, sizeof(h));
    if (h.reserved != 0 || h.ns_len > 255 || h.num_prompts > TKV_FAST_MAX_PROMPTS ||
        (op == TKV_FAST_LOOKUP && h.num_prompts != 1)) {
        snprintf(why, why_cap, "lean lookup header out of range (%u prompts, namespace %u bytes)",
                 h.num_prompts, h.ns_len);
        return NULL;
    }
    uint64_t need = sizeof(h) + 4 * (uint64_t)h.num_prompts + h.ns_len;
    if (need > len) {
        snprintf(why, why_cap, "lean lookup: %zu bytes, its header needs %" PRIu64 "", len, need);
        return NULL;
    }
    const uint8_t *counts = p + sizeof(h);
    uint64_t total = 0;
    for (uint32_t i = 0; i < h.num_prompts; i++) {
        uint32_t c;
        memcpy(&c, counts + 4 * (size_t)i, 4);
        total += c;
    }
    if (need + 4 * total != len) {
        snprintf(why, why_cap, "lean lookup: %zu bytes, its counts add up to %" PRIu64 "", len,
                 need + 4 * total);
        return NULL;
    }
    const uint8_t *ns = p + len - h.ns_len;
    if (memchr(ns, 0, h.ns_len)) {
        snprintf(why, why_cap, "lean lookup: the namespace holds a NUL byte");
        return NULL;
    }
    memcpy(out->ns, ns, h.ns_len);
    out->ns[h.ns_len] = '\0';
    tierkv__v1__block_scope__init(&out->scope);
    out->scope.namespace_ = out->ns;
    out->scope.fingerprint.data = (uint8_t *)p; /* the header's first member */
    out->scope.fingerprint.len = 32;
    out->scope.client_id = h.client_id;
    /* payloads are malloc'ed buffers and the header is a multiple of 4 bytes: aligned */
    uint32_t *tok = (uint32_t *)(void *)(p + sizeof(h) + 4 * (size_t)h.num_prompts);
    if (op == TKV_FAST_LOOKUP) {
        tierkv__v1__lookup_request__init(&out->single);
        out->single.scope = &out->scope;
        out->single.n_tokens = (size_t)total;
        out->single.tokens = tok;
        out->single.lease_ttl_ms = h.ttl_ms;
        return &out->single.base;
    }
    tierkv__v1__lookup_batch_request__init(&out->batch);
    for (uint32_t i = 0; i < h.num_prompts; i++) {
        uint32_t c;
        memcpy(&c, counts + 4 * (size_t)i, 4);
        tierkv__v1__prompt__init(&out->prompts[i]);
        out->prompts[i].n_tokens = c;
        out->prompts[i].tokens = tok;
        out->prompt_ptrs[i] = &out->prompts[i];
        tok += c;
    }
    out->batch.scope = &out->scope;
    out->batch.n_prompts = h.num_prompts;
    out->batch.prompts = out->prompt_ptrs;
    out->batch.lease_ttl_ms = h.ttl_ms;
    return &out->batch.base;
}

/* ---- the lean lookup reply ---------------------------------------------------------------------- */

/* The results of a LookupBatchResponse (*res) or a LookupResponse (1, *res NULL); SIZE_MAX
 * for any other message. */
static size_t results_of(const ProtobufCMessage *rsp, Tierkv__V1__LookupResponse *const **res)
{
    if (rsp->descriptor == &tierkv__v1__lookup_batch_response__descriptor) {
        const Tierkv__V1__LookupBatchResponse *b = (const Tierkv__V1__LookupBatchResponse *)rsp;
        *res = b->results;
        return b->n_results;
    }
    *res = NULL;
    return rsp->descriptor == &tierkv__v1__lookup_response__descriptor ? 1 : SIZE_MAX;
}

static const Tierkv__V1__LookupResponse *result_at(const ProtobufCMessage *rsp,
                                                   Tierkv__V1__LookupResponse *const *res,
                                                   size_t i)
{
    return res ? res[i] : (const Tierkv__V1__LookupResponse *)rsp;
}

size_t tkv_fast_lean_reply_size(const ProtobufCMessage *rsp)
{
    Tierkv__V1__LookupResponse *const *res;
    size_t n = results_of(rsp, &res);
    if (n == SIZE_MAX || n > TKV_FAST_MAX_PROMPTS)
        return 0;
    uint64_t bytes = sizeof(tkv_fast_reply_hdr) + n * (uint64_t)sizeof(tkv_fast_result);
    for (size_t i = 0; i < n; i++) {
        const Tierkv__V1__LookupResponse *r = result_at(rsp, res, i);
        if (r->n_blocks > UINT32_MAX)
            return 0;
        bytes += r->n_blocks * (uint64_t)sizeof(tkv_fast_loc);
    }
    return bytes > UINT32_MAX ? 0 : (size_t)bytes;
}

void tkv_fast_lean_reply_encode(const ProtobufCMessage *rsp, uint8_t *out)
{
    Tierkv__V1__LookupResponse *const *res;
    size_t n = results_of(rsp, &res);
    tkv_fast_reply_hdr h = {.num_results = (uint32_t)n, .reserved = 0};
    memcpy(out, &h, sizeof(h));
    uint8_t *p = out + sizeof(h);
    for (size_t i = 0; i < n; i++) {
        const Tierkv__V1__LookupResponse *r = result_at(rsp, res, i);
        tkv_fast_result x = {.lease_id = r->lease_id, .num_hit_blocks = r->num_hit_blocks,
                             .num_hit_tokens = r->num_hit_tokens,
                             .num_query_blocks = r->num_query_blocks,
                             .num_locs = (uint32_t)r->n_blocks};
        memcpy(p, &x, sizeof(x));
        p += sizeof(x);
        for (size_t j = 0; j < r->n_blocks; j++) {
            const Tierkv__V1__BlockLoc *b = r->blocks[j];
            tkv_fast_loc l = {.l2_offset = b->l2_offset, .l1_offset = b->l1_offset,
                              .tier = (uint32_t)b->tier, .in_l2 = b->in_l2 != 0,
                              .in_l3 = b->in_l3 != 0, .in_l1 = b->in_l1 != 0, .reserved = 0};
            memcpy(p, &l, sizeof(l));
            p += sizeof(l);
        }
    }
}

/* One block, laid out in this order (each part's alignment is that of the structs):
 * [batch response][results][result pointers][locations][location pointers]. */
ProtobufCMessage *tkv_fast_lean_reply_decode(uint16_t op, const uint8_t *p, size_t len,
                                             char *why, size_t why_cap)
{
    tkv_fast_reply_hdr h;
    if (op != TKV_FAST_LOOKUP && op != TKV_FAST_LOOKUP_BATCH) {
        snprintf(why, why_cap, "call %u has no lean reply", op);
        return NULL;
    }
    if (len < sizeof(h)) {
        snprintf(why, why_cap, "lean reply of %zu bytes, shorter than its header", len);
        return NULL;
    }
    memcpy(&h, p, sizeof(h));
    if (h.reserved != 0 || h.num_results > TKV_FAST_MAX_PROMPTS ||
        (op == TKV_FAST_LOOKUP && h.num_results != 1)) {
        snprintf(why, why_cap, "lean reply header out of range (%u results)", h.num_results);
        return NULL;
    }
    /* first pass: the lengths add up, every field in range */
    size_t off = sizeof(h), total_locs = 0;
    for (uint32_t i = 0; i < h.num_results; i++) {
        tkv_fast_result x;
        if (len - off < sizeof(x)) {
            snprintf(why, why_cap, "lean reply: result %u cut off at byte %zu of %zu", i, off, len);
            return NULL;
        }
        memcpy(&x, p + off, sizeof(x));
        off += sizeof(x);
        if (x.num_locs > (len - off) / sizeof(tkv_fast_loc)) {
            snprintf(why, why_cap, "lean reply: result %u announces %u locations, %zu bytes left",
                     i, x.num_locs, len - off);
            return NULL;
        }
        for (uint32_t j = 0; j < x.num_locs; j++, off += sizeof(tkv_fast_loc)) {
            tkv_fast_loc l;
            memcpy(&l, p + off, sizeof(l));
            if (l.tier > TIERKV__V1__TIER__TIER_L3 || l.in_l2 > 1 || l.in_l3 > 1 || l.in_l1 > 1 ||
                l.reserved) {
                snprintf(why, why_cap, "lean reply: result %u location %u out of range", i, j);
                return NULL;
            }
        }
        total_locs += x.num_locs;
    }
    if (off != len) {
        snprintf(why, why_cap, "lean reply: %zu bytes, its records take %zu", len, off);
        return NULL;
    }
    size_t nr = h.num_results;
    size_t bytes = sizeof(Tierkv__V1__LookupBatchResponse) +
                   nr * (sizeof(Tierkv__V1__LookupResponse) + sizeof(void *)) +
                   total_locs * (sizeof(Tierkv__V1__BlockLoc) + sizeof(void *));
    uint8_t *mem = malloc(bytes);
    if (!mem) {
        snprintf(why, why_cap, "out of memory for a %zu-byte reply", bytes);
        return NULL;
    }
    Tierkv__V1__LookupBatchResponse *batch = (Tierkv__V1__LookupBatchResponse *)(void *)mem;
    Tierkv__V1__LookupResponse *results = (Tierkv__V1__LookupResponse *)(void *)(batch + 1);
    Tierkv__V1__LookupResponse **result_ptrs = (Tierkv__V1__LookupResponse **)(void *)(results + nr);
    Tierkv__V1__BlockLoc *locs = (Tierkv__V1__BlockLoc *)(void *)(result_ptrs + nr);
    Tierkv__V1__BlockLoc **loc_ptrs = (Tierkv__V1__BlockLoc **)(void *)(locs + total_locs);
    /* second pass: fill */
    off = sizeof(h);
    for (size_t i = 0; i < nr; i++) {
        tkv_fast_result x;
        memcpy(&x, p + off, sizeof(x));
        off += sizeof(x);
        Tierkv__V1__LookupResponse *r = &results[i];
        tierkv__v1__lookup_response__init(r);
        r->lease_id = x.lease_id;
        r->num_hit_blocks = x.num_hit_blocks;
        r->num_hit_tokens = x.num_hit_tokens;
        r->num_query_blocks = x.num_query_blocks;
        r->n_blocks = x.num_locs;
        r->blocks = x.num_locs ? loc_ptrs : NULL;
        for (uint32_t j = 0; j < x.num_locs; j++, off += sizeof(tkv_fast_loc)) {
            tkv_fast_loc l;
            memcpy(&l, p + off, sizeof(l));
            tierkv__v1__block_loc__init(locs);
            locs->tier = (Tierkv__V1__Tier)l.tier;
            locs->in_l2 = l.in_l2;
            locs->in_l3 = l.in_l3;
            locs->in_l1 = l.in_l1;
            locs->l2_offset = l.l2_offset;
            locs->l1_offset = l.l1_offset;
            *loc_ptrs++ = locs++;
        }
        result_ptrs[i] = r;
    }
    if (op == TKV_FAST_LOOKUP) {
        /* the single response must be the block's start, so that free() of it frees all */
        memmove(mem, results, sizeof(*results));
        return (ProtobufCMessage *)(void *)mem;
    }
    tierkv__v1__lookup_batch_response__init(batch);
    batch->n_results = nr;
    batch->results = nr ? result_ptrs : NULL;
    return &batch->base;
}
