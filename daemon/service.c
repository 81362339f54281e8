/* service.c - the tierkv.v1.Cache RPC handlers (see tkvd_service.h). */
#include "tkvd_service.h"

#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tierkv.pb-c.h"
#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_l3.h"

#define kMaxNamespaceBytes 255
#define kListMax 10000          /* ListBlocks answers at most this many blocks */
#define kWaitSliceMs 200        /* blocking waits re-check shutdown this often */
#define kVerifyReportNs 100000000ull /* Verify streams progress at most every 100 ms */

/* ---- status mapping and replies -------------------------------------------------------------- */

/* TKV_E* -> gRPC status, as annotated in storage/tkv_base.h. */
static grpc_status_code status_of(int err)
{
    switch (err) {
    case TKV_OK: return GRPC_STATUS_OK;
    case TKV_EINVAL: return GRPC_STATUS_INVALID_ARGUMENT;
    case TKV_ENOMEM:
    case TKV_EFULL:
    case TKV_ENOSPC: return GRPC_STATUS_RESOURCE_EXHAUSTED;
    case TKV_ENOTFOUND:
    case TKV_EXPIRED: return GRPC_STATUS_NOT_FOUND;
    case TKV_EEXIST: return GRPC_STATUS_ALREADY_EXISTS;
    case TKV_EGEOMETRY:
    case TKV_EBUSY:
    case TKV_ESTATE: return GRPC_STATUS_FAILED_PRECONDITION;
    case TKV_ECHECKSUM:
    case TKV_ECORRUPT: return GRPC_STATUS_DATA_LOSS;
    case TKV_EIO:
    case TKV_ECLOSED:
    case TKV_EREADONLY: return GRPC_STATUS_UNAVAILABLE;
    case TKV_ETIMEDOUT: return GRPC_STATUS_DEADLINE_EXCEEDED;
    case TKV_EUNSUPPORTED: return GRPC_STATUS_UNIMPLEMENTED;
    default: return GRPC_STATUS_INTERNAL;
    }
}

static void fail_with(tkvd_reply *out, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static void fail_with(tkvd_reply *out, grpc_status_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->msg, sizeof(out->msg), fmt, ap);
    va_end(ap);
    out->code = code;
}

/* A store error: "<what>: <tkv_strerror>" with the mapped code. */
static void fail_store(tkvd_reply *out, int err, const char *what)
{
    if (err == TKV_ENOTFOUND)
        fail_with(out, status_of(err), "%s: not found (unknown, released or ended)", what);
    else
        fail_with(out, status_of(err), "%s: %s", what, tkv_strerror(err));
}

#define PACK_REPLY(out, fn, msg)                                   \
    do {                                                           \
        size_t n_ = fn##__get_packed_size(msg);                    \
        (out)->buf = tkv_xmalloc(n_ ? n_ : 1);                     \
        (out)->len = fn##__pack((msg), (out)->buf);                \
    } while (0)

#define UNPACK_OR_FAIL(var, fn, name, req, len, out)                                            \
    var = fn##__unpack(NULL, (len), (req));                                                     \
    if (!var) {                                                                                 \
        fail_with((out), GRPC_STATUS_INVALID_ARGUMENT,                                          \
                  "malformed " name ": %zu bytes are not a valid protobuf message", (size_t)(len)); \
        return;                                                                                 \
    }

/* ---- validation helpers --------------------------------------------------------------------- */

static void hex_prefix(const uint8_t *b, size_t n, char *out)
{
    static const char digits[] = "0123456789abcdef";
    for (size_t i = 0; i < n; i++) {
        out[2 * i] = digits[b[i] >> 4];
        out[2 * i + 1] = digits[b[i] & 15];
    }
    out[2 * n] = 0;
}

/* ---- tenants ----------------------------------------------------------------------------------- */

/* A refusal for tenant reasons: PERMISSION_DENIED (or the code given), counted per tenant
 * (tierkv_tenant_denied_total) and logged at most once a second with the number held back,
 * so a client hammering the daemon with forged requests cannot flood the log. */
static void deny(tkvd_service *svc, const tkvd_call_info *ci, tkvd_reply *out,
                 grpc_status_code code, const char *fmt, ...) __attribute__((format(printf, 5, 6)));
static void deny(tkvd_service *svc, const tkvd_call_info *ci, tkvd_reply *out,
                 grpc_status_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(out->msg, sizeof(out->msg), fmt, ap);
    va_end(ap);
    out->code = code;
    size_t slot = ci->tenant ? ci->tenant->index + 1 : 0;
    atomic_fetch_add_explicit(&svc->metrics->tenant_denied[slot], 1, memory_order_relaxed);
    uint64_t now_ms = tkv_now_ns() / 1000000u;
    uint64_t last = atomic_load_explicit(&svc->metrics->deny_log_ms, memory_order_relaxed);
    if (now_ms - last >= 1000 &&
        atomic_compare_exchange_strong(&svc->metrics->deny_log_ms, &last, now_ms)) {
        uint64_t held = atomic_exchange(&svc->metrics->deny_log_held, 0);
        TKV_LOG(TKV_LOG_WARN, "refused a call of tenant %s (uid %d pid %d): %s%s",
                ci->tenant ? ci->tenant->name : "(none)", ci->peer.has_ucred ? (int)ci->peer.uid : -1,
                ci->peer.has_ucred ? (int)ci->peer.pid : -1, out->msg,
                held ? " (and earlier refusals not logged)" : "");
    } else {
        atomic_fetch_add_explicit(&svc->metrics->deny_log_held, 1, memory_order_relaxed);
    }
}

bool tkvd_service_authorize(void *ctx, const tkvd_method *m, tkvd_call_info *ci, tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    const tkvd_tenants *ts = &svc->cfg->tenants;
    if (!tkvd_tenants_enabled(ts))
        return true;
    /* Health answers liveness probes of anyone who can reach the socket; it shows nothing
     * of any tenant. */
    if (strcmp(m->path, "/tierkv.v1.Cache/Health") == 0)
        return true;
    ci->tenant = tkvd_tenant_of_peer(ts, &ci->peer);
    if (!ci->tenant) {
        char who[160];
        if (ci->peer.token)
            snprintf(who, sizeof(who), "bearer token matches none");
        else if (ci->peer.tls_subject)
            snprintf(who, sizeof(who), "client certificate subject '%.100s' matches none",
                     ci->peer.tls_subject);
        else if (ci->peer.has_ucred)
            snprintf(who, sizeof(who), "uid %u / gid %u match none", (unsigned)ci->peer.uid,
                     (unsigned)ci->peer.gid);
        else
            snprintf(who, sizeof(who), "no identity proven");
        deny(svc, ci, out, GRPC_STATUS_PERMISSION_DENIED,
             "no tenant for this caller (%s): see the tenant.* keys in the daemon's config", who);
        return false;
    }
    atomic_fetch_add_explicit(&svc->metrics->tenant_rpcs[ci->tenant->index + 1], 1,
                              memory_order_relaxed);
    /* These act on every tenant's blocks at once. */
    static const char *const kAdminOnly[] = {"/tierkv.v1.Cache/ListBlocks", "/tierkv.v1.Cache/Flush",
                                             "/tierkv.v1.Cache/Verify"};
    for (size_t i = 0; i < sizeof(kAdminOnly) / sizeof(kAdminOnly[0]); i++) {
        if (strcmp(m->path, kAdminOnly[i]) == 0 && !ci->tenant->admin) {
            deny(svc, ci, out, GRPC_STATUS_PERMISSION_DENIED,
                 "%s acts on every tenant's blocks: tenant %s is not an admin tenant",
                 m->path + strlen("/tierkv.v1.Cache/"), ci->tenant->name);
            return false;
        }
    }
    return true;
}

/* The owner id leases and allocations of this call are made for: the attach client id (which
 * already carries the tenant tag), or the tenant's tag alone. */
static uint64_t call_owner(const tkvd_call_info *ci, const Tierkv__V1__BlockScope *scope)
{
    if (scope && scope->client_id)
        return scope->client_id;
    return tkvd_tenant_tag(ci->tenant);
}

/* A lease or allocation id another tenant's call made is answered as if it did not exist
 * (the answer must not tell B that A holds lease N), and counted as a refusal. */
static bool check_owned(tkvd_service *svc, const tkvd_call_info *ci, uint64_t lease_id,
                        uint64_t alloc_id, const char *what, tkvd_reply *out)
{
    if (!ci->tenant)
        return true;
    uint64_t owner = 0;
    int rc = lease_id ? tkv_store_lease_owner(svc->store, lease_id, &owner)
                      : tkv_store_alloc_owner(svc->store, alloc_id, &owner);
    if (rc != TKV_OK || tkvd_tenant_owns(ci->tenant, owner))
        return true; /* the handler reports a missing id itself */
    deny(svc, ci, out, GRPC_STATUS_NOT_FOUND, "%s: not found (unknown, released or ended)", what);
    return false;
}

/* Checks the request's scope; on failure fills out and returns false. */
static bool check_scope(tkvd_service *svc, const tkvd_call_info *ci,
                        const Tierkv__V1__BlockScope *scope, tkvd_reply *out)
{
    if (!scope) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT,
                  "scope missing: requests that touch blocks carry namespace and fingerprint");
        return false;
    }
    if (scope->fingerprint.len != TKV_KEY_BYTES) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT,
                  "scope.fingerprint: %zu bytes, expected %d (SHA-256 of the geometry)",
                  scope->fingerprint.len, TKV_KEY_BYTES);
        return false;
    }
    if (memcmp(scope->fingerprint.data, svc->cfg->fingerprint, TKV_KEY_BYTES) != 0) {
        const tkv_geometry *g = &svc->cfg->geometry;
        char theirs[17], ours[17];
        hex_prefix(scope->fingerprint.data, 8, theirs);
        hex_prefix(svc->cfg->fingerprint, 8, ours);
        fail_with(out, GRPC_STATUS_FAILED_PRECONDITION,
                  "geometry mismatch: client fingerprint %s.. != daemon's %s.. (daemon serves "
                  "model '%s', %u layers, %u kv heads, head dim %u, %u tokens/block, %s, %s)",
                  theirs, ours, g->model_id, g->num_layers, g->num_kv_heads, g->head_dim,
                  g->block_tokens, tkvd_dtype_name(g->dtype), tkvd_scale_mode_name(g->scale_mode));
        return false;
    }
    if (strlen(scope->namespace_) > kMaxNamespaceBytes) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "scope.namespace: %zu bytes, at most %d",
                  strlen(scope->namespace_), kMaxNamespaceBytes);
        return false;
    }
    /* With tenants the namespace is the caller's tenant: a request may leave it empty or name
     * it, never another. */
    if (ci->tenant && *scope->namespace_ && strcmp(scope->namespace_, ci->tenant->name) != 0) {
        deny(svc, ci, out, GRPC_STATUS_PERMISSION_DENIED,
             "scope.namespace '%.64s': this caller acts as tenant '%s' and may name no other",
             scope->namespace_, ci->tenant->name);
        return false;
    }
    if (ci->tenant && scope->client_id && !tkvd_tenant_owns(ci->tenant, scope->client_id)) {
        deny(svc, ci, out, GRPC_STATUS_PERMISSION_DENIED,
             "scope.client_id %" PRIu64 ": attached as another tenant than '%s'", scope->client_id,
             ci->tenant->name);
        return false;
    }
    if (scope->client_id && !(svc->attach && tkvd_attach_client_live(svc->attach, scope->client_id))) {
        fail_with(out, GRPC_STATUS_NOT_FOUND,
                  "scope.client_id %" PRIu64 ": no attached client with this id (attach first, "
                  "or send 0)", scope->client_id);
        return false;
    }
    return true;
}

static bool check_tokens(tkvd_service *svc, size_t n_tokens, tkvd_reply *out)
{
    if (n_tokens > svc->cfg->max_prompt_tokens) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "tokens: %zu exceeds max_prompt_tokens (%u)",
                  n_tokens, svc->cfg->max_prompt_tokens);
        return false;
    }
    return true;
}

/* Keys of the first num_blocks full blocks of tokens, in the scope's namespace -- with
 * tenants, the caller's tenant's (check_scope refused any other). */
static tkv_key *derive_keys(tkvd_service *svc, const tkvd_call_info *ci,
                            const Tierkv__V1__BlockScope *scope, const uint32_t *tokens,
                            size_t num_blocks)
{
    tkv_key root;
    const char *ns = ci->tenant ? ci->tenant->name : scope->namespace_;
    tkv_key_root(svc->cfg->fingerprint, ns, strlen(ns), &root);
    tkv_key *keys = tkv_xmalloc((num_blocks ? num_blocks : 1) * sizeof(*keys));
    size_t n = tkv_key_chain(&root, tokens, num_blocks * svc->cfg->geometry.block_tokens,
                             svc->cfg->geometry.block_tokens, keys, num_blocks);
    TKV_ASSERT(n == num_blocks);
    return keys;
}

static const char *tier_name(int t)
{
    switch (t) {
    case TKV_TIER_L1: return "L1";
    case TKV_TIER_L2: return "L2";
    case TKV_TIER_L3: return "L3";
    default: return "none";
    }
}

/* Fills a repeated BlockLoc from store locations; the messages live in `store`. */
static void fill_locs(const tkv_block_loc *locs, size_t n, Tierkv__V1__BlockLoc *store,
                      Tierkv__V1__BlockLoc **ptrs)
{
    for (size_t i = 0; i < n; i++) {
        tierkv__v1__block_loc__init(&store[i]);
        store[i].tier = (Tierkv__V1__Tier)locs[i].tier;
        store[i].in_l2 = locs[i].in_l2;
        store[i].in_l3 = locs[i].in_l3;
        store[i].l2_offset = locs[i].in_l2 ? locs[i].l2_offset : 0;
        store[i].in_l1 = locs[i].in_l1;
        store[i].l1_offset = locs[i].in_l1 ? locs[i].l1_offset : 0;
        ptrs[i] = &store[i];
    }
}

/* A lease never holds more blocks than the longest prompt a Lookup accepts. */
static size_t max_lease_blocks(const tkvd_service *svc)
{
    return svc->cfg->max_prompt_tokens / svc->cfg->geometry.block_tokens;
}

/* Waits for a prefetch ticket in slices, so that the end of the drain on shutdown is
 * noticed; timeout_ms < 0 = none. */
static int wait_ticket(tkvd_service *svc, uint64_t ticket, int timeout_ms, int *status)
{
    uint64_t start = tkv_now_ns();
    for (;;) {
        int slice = kWaitSliceMs;
        if (timeout_ms >= 0) {
            uint64_t spent_ms = (tkv_now_ns() - start) / 1000000u;
            if (spent_ms >= (uint64_t)timeout_ms)
                return TKV_ETIMEDOUT;
            if ((uint64_t)timeout_ms - spent_ms < (uint64_t)slice)
                slice = (int)((uint64_t)timeout_ms - spent_ms);
        }
        int rc = tkv_store_wait(svc->store, ticket, slice, status);
        if (rc != TKV_ETIMEDOUT)
            return rc;
        if (atomic_load(&svc->abort_waits))
            return TKV_ECLOSED;
    }
}

/* ---- Lookup ----------------------------------------------------------------------------------- */

static void h_lookup(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                     tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    uint64_t t0 = tkv_now_ns();
    Tierkv__V1__LookupRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__lookup_request, "LookupRequest", req, len, out);
    tkv_key *keys = NULL;
    tkv_block_loc *locs = NULL;
    Tierkv__V1__BlockLoc *loc_msgs = NULL;
    Tierkv__V1__BlockLoc **loc_ptrs = NULL;
    if (!check_scope(svc, ci, rq->scope, out) || !check_tokens(svc, rq->n_tokens, out))
        goto done;
    uint32_t P = svc->cfg->geometry.block_tokens;
    size_t num_blocks = rq->n_tokens / P;
    Tierkv__V1__LookupResponse rsp = TIERKV__V1__LOOKUP_RESPONSE__INIT;
    rsp.num_query_blocks = (uint32_t)num_blocks;
    if (num_blocks > 0) {
        keys = derive_keys(svc, ci, rq->scope, rq->tokens, num_blocks);
        locs = tkv_xcalloc(num_blocks, sizeof(*locs));
        uint64_t lease = 0;
        size_t hit = 0;
        int rc = tkv_store_lookup(svc->store, keys, num_blocks, call_owner(ci, rq->scope),
                                  rq->lease_ttl_ms, &lease, &hit, locs);
        if (rc != TKV_OK) {
            fail_store(out, rc, "lookup");
            goto done;
        }
        rsp.num_hit_blocks = (uint32_t)hit;
        rsp.num_hit_tokens = (uint32_t)(hit * P);
        rsp.lease_id = lease;
        loc_msgs = tkv_xcalloc(hit ? hit : 1, sizeof(*loc_msgs));
        loc_ptrs = tkv_xcalloc(hit ? hit : 1, sizeof(*loc_ptrs));
        fill_locs(locs, hit, loc_msgs, loc_ptrs);
        rsp.n_blocks = hit;
        rsp.blocks = loc_ptrs;
    }
    PACK_REPLY(out, tierkv__v1__lookup_response, &rsp);
    tkvd_metrics *m = svc->metrics;
    atomic_fetch_add_explicit(&m->lookups, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->lookup_query_tokens, (uint64_t)num_blocks * P, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->lookup_hit_tokens, rsp.num_hit_tokens, memory_order_relaxed);
    tkvd_metrics_observe_lookup(m, tkv_now_ns() - t0);
done:
    free(keys);
    free(locs);
    free(loc_msgs);
    free(loc_ptrs);
    tierkv__v1__lookup_request__free_unpacked(rq, NULL);
}

/* ---- Prefetch --------------------------------------------------------------------------------- */

/* True when the store has a GPU tier (a backend attached L1 slots). */
static bool has_l1(tkvd_service *svc)
{
    tkv_store_stats st;
    tkv_store_get_stats(svc->store, &st);
    return st.capacity_blocks_tier[TKV_TIER_L1] > 0;
}

/* Checks a target tier for Prefetch/Alloc: NONE means L2. Returns the tier or -1 (out filled). */
static int target_tier(tkvd_service *svc, int tier, const char *what, tkvd_reply *out)
{
    if (tier == TKV_TIER_NONE || tier == TKV_TIER_L2)
        return TKV_TIER_L2;
    if (tier == TKV_TIER_L1 && has_l1(svc))
        return TKV_TIER_L1;
    if (tier == TKV_TIER_L1) {
        fail_with(out, GRPC_STATUS_UNIMPLEMENTED, "%s: this daemon has no GPU (L1) tier", what);
        return -1;
    }
    fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "%s: tier %d is not a target (TIER_L2 or TIER_L1)",
              what, tier);
    return -1;
}

static void h_prefetch(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                       tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__PrefetchRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__prefetch_request, "PrefetchRequest", req, len, out);
    tkv_block_loc *locs = NULL;
    Tierkv__V1__BlockLoc *loc_msgs = NULL;
    Tierkv__V1__BlockLoc **loc_ptrs = NULL;
    char what[64];
    snprintf(what, sizeof(what), "prefetch lease %" PRIu64, rq->lease_id);
    if (rq->lease_id == 0) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "prefetch: lease_id missing (0)");
        goto done;
    }
    if (!check_owned(svc, ci, rq->lease_id, 0, what, out))
        goto done;
    int tier = target_tier(svc, rq->tier, "prefetch", out);
    if (tier < 0)
        goto done;
    uint64_t ticket = 0;
    int rc = tkv_store_prefetch(svc->store, rq->lease_id, tier, NULL, NULL, &ticket);
    if (rc != TKV_OK) {
        fail_store(out, rc, what);
        goto done;
    }
    Tierkv__V1__PrefetchResponse rsp = TIERKV__V1__PREFETCH_RESPONSE__INIT;
    rsp.ticket = ticket;
    if (rq->wait) {
        int timeout = rq->timeout_ms ? (int)(rq->timeout_ms > INT32_MAX ? INT32_MAX : rq->timeout_ms) : -1;
        if (ci->timeout_ms >= 0 && (timeout < 0 || ci->timeout_ms < timeout))
            timeout = ci->timeout_ms;
        int status = TKV_OK;
        rc = wait_ticket(svc, ticket, timeout, &status);
        if (rc == TKV_ETIMEDOUT) {
            fail_with(out, GRPC_STATUS_DEADLINE_EXCEEDED, "%s: promotion not finished after %d ms",
                      what, timeout);
            goto done;
        }
        if (rc != TKV_OK) {
            fail_store(out, rc, what);
            goto done;
        }
        if (status != TKV_OK) {
            fail_store(out, status, what);
            goto done;
        }
        size_t cap = max_lease_blocks(svc), n = 0;
        locs = tkv_xcalloc(cap, sizeof(*locs));
        rc = tkv_store_lease_locs(svc->store, rq->lease_id, locs, cap, &n);
        if (rc != TKV_OK) {
            fail_store(out, rc, what);
            goto done;
        }
        if (n > cap)
            n = cap;
        loc_msgs = tkv_xcalloc(n ? n : 1, sizeof(*loc_msgs));
        loc_ptrs = tkv_xcalloc(n ? n : 1, sizeof(*loc_ptrs));
        fill_locs(locs, n, loc_msgs, loc_ptrs);
        rsp.n_blocks = n;
        rsp.blocks = loc_ptrs;
        rsp.done = 1;
    }
    PACK_REPLY(out, tierkv__v1__prefetch_response, &rsp);
done:
    free(locs);
    free(loc_msgs);
    free(loc_ptrs);
    tierkv__v1__prefetch_request__free_unpacked(rq, NULL);
}

/* ---- Put -------------------------------------------------------------------------------------- */

/* Checks that tokens hold the full blocks first..first+count-1. */
static bool check_block_range(tkvd_service *svc, size_t n_tokens, uint32_t first, size_t count,
                              const char *what, tkvd_reply *out)
{
    uint32_t P = svc->cfg->geometry.block_tokens;
    size_t full = n_tokens / P;
    if ((uint64_t)first + count > full) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT,
                  "%s: blocks %u..%" PRIu64 " need %" PRIu64 " tokens, the request has %zu "
                  "(%zu full blocks of %u)", what, first, (uint64_t)first + count - 1,
                  ((uint64_t)first + count) * P, n_tokens, full, P);
        return false;
    }
    return true;
}

static void h_put(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                  tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__PutRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__put_request, "PutRequest", req, len, out);
    tkv_key *keys = NULL;
    const void **payloads = NULL;
    if (!check_scope(svc, ci, rq->scope, out) || !check_tokens(svc, rq->n_tokens, out))
        goto done;
    size_t n = rq->n_blocks;
    if (n == 0) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "put: no blocks");
        goto done;
    }
    if (n > svc->cfg->max_blocks_per_rpc) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "put: %zu blocks exceed max_blocks_per_rpc (%u)",
                  n, svc->cfg->max_blocks_per_rpc);
        goto done;
    }
    if (!check_block_range(svc, rq->n_tokens, rq->first_block, n, "put", out))
        goto done;
    payloads = tkv_xcalloc(n, sizeof(*payloads));
    for (size_t i = 0; i < n; i++) {
        if (rq->blocks[i].len != svc->cfg->block_bytes) {
            fail_with(out, GRPC_STATUS_INVALID_ARGUMENT,
                      "put: blocks[%zu] has %zu bytes, a block of this geometry has %zu", i,
                      rq->blocks[i].len, svc->cfg->block_bytes);
            goto done;
        }
        payloads[i] = rq->blocks[i].data;
    }
    uint32_t P = svc->cfg->geometry.block_tokens;
    size_t chain = (size_t)rq->first_block + n;
    keys = derive_keys(svc, ci, rq->scope, rq->tokens, chain);
    const tkv_key *parent = rq->first_block ? &keys[rq->first_block - 1] : NULL;
    /* The split of the blocks not stored into duplicates and rejections comes from the store's
     * counters; under concurrent puts it is approximate (num_stored is exact). */
    tkv_store_stats before, after;
    tkv_store_get_stats(svc->store, &before);
    size_t stored = 0;
    int rc = tkv_store_put(svc->store, parent, keys + rq->first_block,
                           rq->tokens + (size_t)rq->first_block * P, payloads, n, &stored);
    if (rc != TKV_OK) {
        fail_store(out, rc, "put");
        goto done;
    }
    tkv_store_get_stats(svc->store, &after);
    uint64_t rejected = after.put_rejected_blocks - before.put_rejected_blocks;
    if (rejected > n - stored)
        rejected = n - stored;
    Tierkv__V1__PutResponse rsp = TIERKV__V1__PUT_RESPONSE__INIT;
    rsp.num_stored = (uint32_t)stored;
    rsp.num_rejected = (uint32_t)rejected;
    rsp.num_duplicate = (uint32_t)(n - stored - rejected);
    PACK_REPLY(out, tierkv__v1__put_response, &rsp);
done:
    free(keys);
    free(payloads);
    tierkv__v1__put_request__free_unpacked(rq, NULL);
}

/* ---- Get -------------------------------------------------------------------------------------- */

static void h_get(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                  tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__GetRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__get_request, "GetRequest", req, len, out);
    tkv_block_loc *locs = NULL;
    uint8_t *data = NULL;
    ProtobufCBinaryData *bins = NULL;
    char what[64];
    snprintf(what, sizeof(what), "get lease %" PRIu64, rq->lease_id);
    if (rq->lease_id == 0) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "get: lease_id missing (0)");
        goto done;
    }
    if (!check_owned(svc, ci, rq->lease_id, 0, what, out))
        goto done;
    size_t cap = max_lease_blocks(svc), num = 0;
    locs = tkv_xcalloc(cap, sizeof(*locs));
    int rc = tkv_store_lease_locs(svc->store, rq->lease_id, locs, cap, &num);
    if (rc != TKV_OK) {
        fail_store(out, rc, what);
        goto done;
    }
    if (rq->first >= num) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "%s: first %u is out of range (%zu blocks)",
                  what, rq->first, num);
        goto done;
    }
    size_t count = rq->count ? rq->count : num - rq->first;
    if ((uint64_t)rq->first + count > num) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "%s: blocks %u..%" PRIu64 " out of range "
                  "(%zu blocks)", what, rq->first, (uint64_t)rq->first + count - 1, num);
        goto done;
    }
    if (count > svc->cfg->max_blocks_per_rpc) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT,
                  "%s: %zu blocks exceed max_blocks_per_rpc (%u); get them in pieces", what, count,
                  svc->cfg->max_blocks_per_rpc);
        goto done;
    }
    size_t bb = svc->cfg->block_bytes;
    data = tkv_xmalloc(count * bb);
    bins = tkv_xcalloc(count, sizeof(*bins));
    for (size_t i = 0; i < count; i++) {
        rc = tkv_store_get(svc->store, rq->lease_id, (uint32_t)(rq->first + i), data + i * bb, bb);
        if (rc != TKV_OK) {
            char w[96];
            snprintf(w, sizeof(w), "%s block %zu", what, rq->first + i);
            fail_store(out, rc, w);
            goto done;
        }
        bins[i].data = data + i * bb;
        bins[i].len = bb;
    }
    Tierkv__V1__GetResponse rsp = TIERKV__V1__GET_RESPONSE__INIT;
    rsp.n_blocks = count;
    rsp.blocks = bins;
    PACK_REPLY(out, tierkv__v1__get_response, &rsp);
done:
    free(locs);
    free(data);
    free(bins);
    tierkv__v1__get_request__free_unpacked(rq, NULL);
}

/* ---- Alloc / WriteSlot / Commit / Release ----------------------------------------------------- */

static void h_alloc(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                    tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__AllocRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__alloc_request, "AllocRequest", req, len, out);
    uint64_t *offsets = NULL;
    if (!check_scope(svc, ci, rq->scope, out) || target_tier(svc, rq->tier, "alloc", out) < 0)
        goto done;
    if (rq->num_blocks == 0 || rq->num_blocks > svc->cfg->max_blocks_per_rpc) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "alloc: num_blocks %u not in [1, %u]",
                  rq->num_blocks, svc->cfg->max_blocks_per_rpc);
        goto done;
    }
    offsets = tkv_xcalloc(rq->num_blocks, sizeof(*offsets));
    uint64_t id = 0;
    int rc = tkv_store_alloc_tier(svc->store, target_tier(svc, rq->tier, "alloc", out),
                                  rq->num_blocks, call_owner(ci, rq->scope), &id, offsets);
    if (rc != TKV_OK) {
        fail_store(out, rc, "alloc");
        goto done;
    }
    Tierkv__V1__AllocResponse rsp = TIERKV__V1__ALLOC_RESPONSE__INIT;
    rsp.alloc_id = id;
    rsp.n_offsets = rq->num_blocks;
    rsp.offsets = offsets;
    PACK_REPLY(out, tierkv__v1__alloc_response, &rsp);
done:
    free(offsets);
    tierkv__v1__alloc_request__free_unpacked(rq, NULL);
}

static void h_write_slot(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                         tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__WriteSlotRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__write_slot_request, "WriteSlotRequest", req, len, out);
    char what[80];
    snprintf(what, sizeof(what), "write_slot alloc %" PRIu64 " slot %u", rq->alloc_id, rq->index);
    if (rq->alloc_id == 0) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "write_slot: alloc_id missing (0)");
    } else if (!check_owned(svc, ci, 0, rq->alloc_id, what, out)) {
        /* out filled */
    } else if (rq->payload.len != svc->cfg->block_bytes) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "%s: payload has %zu bytes, a block has %zu",
                  what, rq->payload.len, svc->cfg->block_bytes);
    } else {
        int rc = tkv_store_alloc_write(svc->store, rq->alloc_id, rq->index, rq->payload.data);
        if (rc != TKV_OK) {
            fail_store(out, rc, what);
        } else {
            Tierkv__V1__WriteSlotResponse rsp = TIERKV__V1__WRITE_SLOT_RESPONSE__INIT;
            PACK_REPLY(out, tierkv__v1__write_slot_response, &rsp);
        }
    }
    tierkv__v1__write_slot_request__free_unpacked(rq, NULL);
}

static void h_commit(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                     tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__CommitRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__commit_request, "CommitRequest", req, len, out);
    tkv_key *keys = NULL;
    char what[64];
    snprintf(what, sizeof(what), "commit alloc %" PRIu64, rq->alloc_id);
    if (!check_scope(svc, ci, rq->scope, out) || !check_tokens(svc, rq->n_tokens, out))
        goto done;
    if (rq->alloc_id == 0) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "commit: alloc_id missing (0)");
        goto done;
    }
    if (!check_owned(svc, ci, 0, rq->alloc_id, what, out))
        goto done;
    if (rq->num_blocks > svc->cfg->max_blocks_per_rpc) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "%s: num_blocks %u exceeds max_blocks_per_rpc (%u)",
                  what, rq->num_blocks, svc->cfg->max_blocks_per_rpc);
        goto done;
    }
    if (!check_block_range(svc, rq->n_tokens, rq->first_block, rq->num_blocks, what, out))
        goto done;
    uint32_t P = svc->cfg->geometry.block_tokens;
    size_t chain = (size_t)rq->first_block + rq->num_blocks;
    keys = derive_keys(svc, ci, rq->scope, rq->tokens, chain);
    const tkv_key *parent = rq->first_block ? &keys[rq->first_block - 1] : NULL;
    size_t stored = 0;
    int rc = tkv_store_commit(svc->store, rq->alloc_id, parent, keys + rq->first_block,
                              rq->tokens + (size_t)rq->first_block * P, rq->num_blocks, &stored);
    if (rc != TKV_OK) {
        fail_store(out, rc, what);
        goto done;
    }
    Tierkv__V1__CommitResponse rsp = TIERKV__V1__COMMIT_RESPONSE__INIT;
    rsp.num_stored = (uint32_t)stored;
    rsp.num_duplicate = (uint32_t)(rq->num_blocks - stored);
    PACK_REPLY(out, tierkv__v1__commit_response, &rsp);
done:
    free(keys);
    tierkv__v1__commit_request__free_unpacked(rq, NULL);
}

static void h_release(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                      tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__ReleaseRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__release_request, "ReleaseRequest", req, len, out);
    char what[64];
    if (!rq->lease_id == !rq->alloc_id) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT,
                  "release: give exactly one of lease_id and alloc_id");
    } else {
        int rc;
        if (rq->lease_id)
            snprintf(what, sizeof(what), "release lease %" PRIu64, rq->lease_id);
        else
            snprintf(what, sizeof(what), "release alloc %" PRIu64, rq->alloc_id);
        if (!check_owned(svc, ci, rq->lease_id, rq->alloc_id, what, out))
            rc = TKV_OK; /* out filled */
        else if (rq->lease_id)
            rc = tkv_store_lease_release(svc->store, rq->lease_id);
        else
            rc = tkv_store_abort(svc->store, rq->alloc_id);
        if (out->code != GRPC_STATUS_OK) {
            /* refused by check_owned */
        } else if (rc != TKV_OK) {
            fail_store(out, rc, what);
        } else {
            Tierkv__V1__ReleaseResponse rsp = TIERKV__V1__RELEASE_RESPONSE__INIT;
            PACK_REPLY(out, tierkv__v1__release_response, &rsp);
        }
    }
    tierkv__v1__release_request__free_unpacked(rq, NULL);
}

/* ---- Stats / ListBlocks / Health ---------------------------------------------------------------- */

static void h_stats(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                    tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__StatsRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__stats_request, "StatsRequest", req, len, out);
    tierkv__v1__stats_request__free_unpacked(rq, NULL);
    const tkvd_config *cfg = svc->cfg;
    tkvd_metrics *m = svc->metrics;
    tkv_store_stats st;
    tkv_store_get_stats(svc->store, &st);

    Tierkv__V1__Geometry geo = TIERKV__V1__GEOMETRY__INIT;
    geo.num_layers = cfg->geometry.num_layers;
    geo.num_kv_heads = cfg->geometry.num_kv_heads;
    geo.head_dim = cfg->geometry.head_dim;
    geo.block_tokens = cfg->geometry.block_tokens;
    geo.kv_dtype = (char *)tkvd_dtype_name(cfg->geometry.dtype);
    geo.scale_mode = (char *)tkvd_scale_mode_name(cfg->geometry.scale_mode);
    geo.model_id = (char *)cfg->geometry.model_id;
    geo.fingerprint.data = (uint8_t *)cfg->fingerprint;
    geo.fingerprint.len = TKV_KEY_BYTES;
    geo.block_bytes = cfg->block_bytes;

    /* L2 always; L3 when enabled; L1 when a GPU tier is attached. */
    Tierkv__V1__TierStats tiers[3];
    Tierkv__V1__TierStats *tier_ptrs[3];
    size_t num_tiers = 0;
    for (int t = TKV_TIER_L1; t <= TKV_TIER_L3; t++) {
        if (t == TKV_TIER_L3 && !cfg->l3_enabled)
            continue;
        if (t == TKV_TIER_L1 && st.capacity_blocks_tier[TKV_TIER_L1] == 0)
            continue;
        Tierkv__V1__TierStats *ts = &tiers[num_tiers];
        tierkv__v1__tier_stats__init(ts);
        ts->tier = (Tierkv__V1__Tier)t;
        ts->blocks = st.blocks_tier[t];
        ts->bytes = st.bytes_tier[t];
        ts->capacity_blocks = st.capacity_blocks_tier[t];
        ts->hit_blocks = st.hit_blocks_tier[t];
        tier_ptrs[num_tiers] = ts;
        num_tiers++;
    }

    Tierkv__V1__StatsResponse rsp = TIERKV__V1__STATS_RESPONSE__INIT;
    rsp.lookups = st.lookups;
    rsp.hit_blocks = st.hit_blocks;
    rsp.miss_blocks = st.miss_blocks;
    rsp.hit_tokens = atomic_load_explicit(&m->lookup_hit_tokens, memory_order_relaxed);
    rsp.n_tiers = num_tiers;
    rsp.tiers = tier_ptrs;
    rsp.promotions = st.promotions;
    rsp.promotion_bytes = st.promotion_bytes;
    rsp.demotions = st.demotions;
    rsp.demotion_bytes = st.demotion_bytes;
    rsp.evictions = st.evictions;
    rsp.checksum_failures = st.checksum_failures;
    rsp.io_errors = st.io_errors;
    rsp.leases_active = st.leases_active;
    rsp.clients_connected = atomic_load_explicit(&m->clients_connected, memory_order_relaxed);
    rsp.lookup_p50_us = tkvd_metrics_lookup_quantile_us(m, 0.50);
    rsp.lookup_p99_us = tkvd_metrics_lookup_quantile_us(m, 0.99);
    uint64_t now_ms = tkv_wall_ms();
    rsp.uptime_s = now_ms > m->start_ms ? (now_ms - m->start_ms) / 1000 : 0;
    rsp.geometry = &geo;
    rsp.puts = st.puts;
    rsp.put_blocks = st.put_blocks;
    rsp.gets = st.gets;
    rsp.get_bytes = st.get_bytes;
    rsp.l3_readonly = st.l3_readonly != 0;
    rsp.policy = (char *)cfg->policy;
    PACK_REPLY(out, tierkv__v1__stats_response, &rsp);
}

typedef struct list_ctx {
    int tier;
    size_t limit, count;
    uint64_t total;
    tkv_block_info *infos;
} list_ctx;

static int list_cb(void *arg, const tkv_block_info *b)
{
    list_ctx *lc = arg;
    if (lc->tier == TKV_TIER_L1 && !b->in_l1)
        return 0;
    if (lc->tier == TKV_TIER_L2 && !b->in_l2)
        return 0;
    if (lc->tier == TKV_TIER_L3 && !b->in_l3)
        return 0;
    lc->total++;
    if (lc->count < lc->limit)
        lc->infos[lc->count++] = *b;
    return 0;
}

static const char *state_name(uint8_t s)
{
    switch (s) {
    case TKV_BLOCK_WRITING: return "writing";
    case TKV_BLOCK_READY: return "ready";
    case TKV_BLOCK_EVICTING: return "evicting";
    default: return "unknown";
    }
}

static void h_list_blocks(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                          tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__ListBlocksRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__list_blocks_request, "ListBlocksRequest", req, len, out);
    int tier = (int)rq->tier;
    list_ctx lc = {.tier = tier};
    Tierkv__V1__BlockInfo *msgs = NULL;
    Tierkv__V1__BlockInfo **ptrs = NULL;
    if (tier < TKV_TIER_NONE || tier > TKV_TIER_L3) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "list_blocks: unknown tier %d", tier);
        goto done;
    }
    lc.limit = rq->limit && rq->limit < kListMax ? rq->limit : kListMax;
    Tierkv__V1__ListBlocksResponse rsp = TIERKV__V1__LIST_BLOCKS_RESPONSE__INIT;
    lc.infos = tkv_xcalloc(lc.limit, sizeof(*lc.infos));
    int rc = tkv_store_list(svc->store, list_cb, &lc);
    if (rc != TKV_OK) {
        fail_store(out, rc, "list_blocks");
        goto done;
    }
    msgs = tkv_xcalloc(lc.count ? lc.count : 1, sizeof(*msgs));
    ptrs = tkv_xcalloc(lc.count ? lc.count : 1, sizeof(*ptrs));
    for (size_t i = 0; i < lc.count; i++) {
        tkv_block_info *b = &lc.infos[i];
        Tierkv__V1__BlockInfo *bi = &msgs[i];
        tierkv__v1__block_info__init(bi);
        bi->key.data = b->key.b;
        bi->key.len = TKV_KEY_BYTES;
        bi->parent.data = b->parent.b;
        bi->parent.len = TKV_KEY_BYTES;
        bi->depth = b->depth;
        bi->state = (char *)state_name(b->state);
        bi->in_l1 = b->in_l1;
        bi->in_l2 = b->in_l2;
        bi->in_l3 = b->in_l3;
        bi->pins = b->pins;
        bi->hits = b->hits;
        bi->last_access_ms = b->last_access_ms;
        ptrs[i] = bi;
    }
    rsp.n_blocks = lc.count;
    rsp.blocks = ptrs;
    rsp.total = lc.total;
    PACK_REPLY(out, tierkv__v1__list_blocks_response, &rsp);
done:
    free(lc.infos);
    free(msgs);
    free(ptrs);
    tierkv__v1__list_blocks_request__free_unpacked(rq, NULL);
}

static void h_health(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                     tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__HealthRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__health_request, "HealthRequest", req, len, out);
    tierkv__v1__health_request__free_unpacked(rq, NULL);
    tkv_store_stats st;
    tkv_store_get_stats(svc->store, &st);
    char notes[4][160];
    char *note_ptrs[4];
    size_t n = 0;
    bool degraded = false;
    if (st.l3_readonly) {
        snprintf(notes[n], sizeof(notes[n]), "l3 read-only after write errors (%" PRIu64 " I/O errors)",
                 st.io_errors);
        degraded = true;
        n++;
    } else if (st.io_errors) {
        snprintf(notes[n++], sizeof(notes[0]), "%" PRIu64 " I/O errors so far", st.io_errors);
    }
    if (st.checksum_failures)
        snprintf(notes[n++], sizeof(notes[0]), "%" PRIu64 " blocks dropped on checksum failure",
                 st.checksum_failures);
    if (!svc->cfg->l3_enabled)
        snprintf(notes[n++], sizeof(notes[0]), "l3 off by configuration");
    if (svc->cfg->l3_enabled)
        snprintf(notes[n++], sizeof(notes[0]), "l3 io: %s",
                 st.l3_io_mode == TKV_IO_URING ? "io_uring" : "pread/pwrite");
    for (size_t i = 0; i < n; i++)
        note_ptrs[i] = notes[i];
    Tierkv__V1__HealthResponse rsp = TIERKV__V1__HEALTH_RESPONSE__INIT;
    rsp.status = atomic_load(&svc->stopping) ? "stopping" : degraded ? "degraded" : "serving";
    rsp.version = (char *)svc->version;
    rsp.n_notes = n;
    rsp.notes = note_ptrs;
    PACK_REPLY(out, tierkv__v1__health_response, &rsp);
}

/* ---- Evict / Flush / Verify ---------------------------------------------------------------------- */

static void h_evict(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                    tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__EvictRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__evict_request, "EvictRequest", req, len, out);
    tkv_key *keys = NULL;
    int tier = (int)rq->tier;
    if (tier == TKV_TIER_L1 && !has_l1(svc)) {
        fail_with(out, GRPC_STATUS_UNIMPLEMENTED, "evict: this daemon has no GPU (L1) tier");
        goto done;
    }
    if (tier != TKV_TIER_L1 && tier != TKV_TIER_L2 && tier != TKV_TIER_L3) {
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "evict: tier must be TIER_L1, TIER_L2 or "
                  "TIER_L3, not %d", tier);
        goto done;
    }
    if (tier == TKV_TIER_L3 && !svc->cfg->l3_enabled) {
        fail_with(out, GRPC_STATUS_FAILED_PRECONDITION, "evict: l3 is off in this daemon");
        goto done;
    }
    size_t num_keys = 0;
    if (ci->tenant && rq->n_tokens == 0 && !ci->tenant->admin) {
        deny(svc, ci, out, GRPC_STATUS_PERMISSION_DENIED,
             "evict: without tokens it acts on every tenant's blocks; tenant %s is not an admin "
             "tenant (name the prompt whose blocks to evict)", ci->tenant->name);
        goto done;
    }
    if (rq->n_tokens > 0 || rq->scope) {
        if (!check_scope(svc, ci, rq->scope, out) || !check_tokens(svc, rq->n_tokens, out))
            goto done;
        num_keys = rq->n_tokens / svc->cfg->geometry.block_tokens;
        if (rq->n_tokens > 0 && num_keys == 0) {
            fail_with(out, GRPC_STATUS_INVALID_ARGUMENT,
                      "evict: %zu tokens hold no full block of %u", rq->n_tokens,
                      svc->cfg->geometry.block_tokens);
            goto done;
        }
        if (num_keys)
            keys = derive_keys(svc, ci, rq->scope, rq->tokens, num_keys);
    }
    size_t evicted = 0, pinned = 0;
    int rc = tkv_store_evict(svc->store, tier, keys, num_keys, &evicted, &pinned);
    if (rc != TKV_OK) {
        fail_store(out, rc, "evict");
        goto done;
    }
    TKV_LOG(TKV_LOG_INFO, "evict %s: %zu blocks out, %zu pinned", tier_name(tier), evicted, pinned);
    Tierkv__V1__EvictResponse rsp = TIERKV__V1__EVICT_RESPONSE__INIT;
    rsp.num_evicted = (uint32_t)evicted;
    rsp.num_pinned = (uint32_t)pinned;
    PACK_REPLY(out, tierkv__v1__evict_response, &rsp);
done:
    free(keys);
    tierkv__v1__evict_request__free_unpacked(rq, NULL);
}

static void h_flush(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                    tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__FlushRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__flush_request, "FlushRequest", req, len, out);
    tierkv__v1__flush_request__free_unpacked(rq, NULL);
    int rc = tkv_store_flush(svc->store);
    if (rc != TKV_OK) {
        fail_store(out, rc, "flush");
        return;
    }
    Tierkv__V1__FlushResponse rsp = TIERKV__V1__FLUSH_RESPONSE__INIT;
    PACK_REPLY(out, tierkv__v1__flush_response, &rsp);
}

typedef struct verify_ctx {
    tkvd_stream *st;
    bool gone;             /* the client went away: stop sending */
    uint64_t last_ns;
} verify_ctx;

static bool send_progress(verify_ctx *vc, uint64_t done, uint64_t total, uint64_t bad)
{
    Tierkv__V1__VerifyProgress p = TIERKV__V1__VERIFY_PROGRESS__INIT;
    p.done = done;
    p.total = total;
    p.bad = bad;
    uint8_t buf[64];
    size_t n = tierkv__v1__verify_progress__pack(&p, buf);
    TKV_ASSERT(n <= sizeof(buf));
    if (!tkvd_stream_send(vc->st, buf, n))
        vc->gone = true;
    return !vc->gone;
}

/* The store's progress callback: runs on this worker thread, between block checks. The
 * bad count is only known at the end, so intermediate messages carry 0. */
static void verify_progress(void *arg, uint64_t done, uint64_t total)
{
    verify_ctx *vc = arg;
    uint64_t now = tkv_now_ns();
    if (vc->gone || done >= total || now - vc->last_ns < kVerifyReportNs)
        return;
    vc->last_ns = now;
    send_progress(vc, done, total, 0);
}

static void h_verify(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                     tkvd_stream *st, tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__VerifyRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__verify_request, "VerifyRequest", req, len, out);
    tierkv__v1__verify_request__free_unpacked(rq, NULL);
    verify_ctx vc = {.st = st, .last_ns = tkv_now_ns()};
    uint64_t checked = 0, bad = 0;
    int rc = tkv_store_verify(svc->store, verify_progress, &vc, &checked, &bad);
    if (rc != TKV_OK) {
        fail_store(out, rc, "verify");
        return;
    }
    if (bad)
        TKV_LOG(TKV_LOG_WARN, "verify: %" PRIu64 " of %" PRIu64 " blocks failed their checksum "
                "and were dropped", bad, checked);
    if (!send_progress(&vc, checked, checked, bad))
        fail_with(out, GRPC_STATUS_CANCELLED, "verify: client went away");
}

void tkvd_service_abort_waits(void *ctx)
{
    tkvd_service *svc = ctx;
    atomic_store(&svc->abort_waits, true);
}

/* ---- cost check ------------------------------------------------------------------------------ */

static void h_cost_check(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                         tkvd_reply *out)
{
    tkvd_service *svc = ctx;
    Tierkv__V1__CostCheckRequest *rq;
    UNPACK_OR_FAIL(rq, tierkv__v1__cost_check_request, "CostCheckRequest", req, len, out);
    tkv_block_loc *locs = NULL;
    if (!(rq->prefill_ms >= 0) || rq->prefill_ms > 1e9) { /* also refuses NaN */
        fail_with(out, GRPC_STATUS_INVALID_ARGUMENT, "cost_check: prefill_ms %g not in [0, 1e9]",
                  rq->prefill_ms);
        goto done;
    }
    int tier = (int)rq->tier == TKV_TIER_NONE ? (has_l1(svc) ? TKV_TIER_L1 : TKV_TIER_L2)
                                         : target_tier(svc, rq->tier, "cost_check", out);
    if (tier < 0)
        goto done;
    if (!check_owned(svc, ci, rq->lease_id, 0, "cost_check", out))
        goto done;
    size_t cap = max_lease_blocks(svc), n = 0;
    locs = tkv_xcalloc(cap, sizeof(*locs));
    int rc = tkv_store_lease_locs(svc->store, rq->lease_id, locs, cap, &n);
    if (rc != TKV_OK) {
        fail_store(out, rc, "cost_check");
        goto done;
    }
    tkvd_cost cost = tkvd_cost_estimate(&svc->rates, locs, n < cap ? n : cap, tier,
                                        tkv_store_block_bytes(svc->store));
    Tierkv__V1__CostCheckResponse rsp = TIERKV__V1__COST_CHECK_RESPONSE__INIT;
    rsp.restore_ms = cost.restore_ms;
    rsp.use_cache = cost.restore_ms < rq->prefill_ms;
    rsp.blocks_in_tier = cost.in_tier;
    rsp.blocks_from_l2 = cost.from_l2;
    rsp.blocks_from_l3 = cost.from_l3;
    rsp.pcie_gbps = cost.pcie_gbps;
    rsp.l3_read_gbps = cost.l3_read_gbps;
    PACK_REPLY(out, tierkv__v1__cost_check_response, &rsp);
done:
    free(locs);
    tierkv__v1__cost_check_request__free_unpacked(rq, NULL);
}

/* ---- table and limits ------------------------------------------------------------------------- */

static const tkvd_method kMethods[] = {
    {"/tierkv.v1.Cache/Lookup", h_lookup, NULL, false},
    {"/tierkv.v1.Cache/Prefetch", h_prefetch, NULL, true},
    {"/tierkv.v1.Cache/Put", h_put, NULL, true},
    {"/tierkv.v1.Cache/Get", h_get, NULL, true},
    {"/tierkv.v1.Cache/Alloc", h_alloc, NULL, true},
    {"/tierkv.v1.Cache/WriteSlot", h_write_slot, NULL, false},
    {"/tierkv.v1.Cache/Commit", h_commit, NULL, true},
    {"/tierkv.v1.Cache/Release", h_release, NULL, false},
    {"/tierkv.v1.Cache/Stats", h_stats, NULL, false},
    {"/tierkv.v1.Cache/ListBlocks", h_list_blocks, NULL, true},
    {"/tierkv.v1.Cache/Evict", h_evict, NULL, true},
    {"/tierkv.v1.Cache/Flush", h_flush, NULL, true},
    {"/tierkv.v1.Cache/Verify", NULL, h_verify, true},
    {"/tierkv.v1.Cache/Health", h_health, NULL, false},
    {"/tierkv.v1.Cache/CostCheck", h_cost_check, NULL, false},
};

const tkvd_method *tkvd_service_methods(size_t *num_methods)
{
    *num_methods = sizeof(kMethods) / sizeof(kMethods[0]);
    return kMethods;
}

/* The largest legal request is a Put of max_blocks_per_rpc blocks with a prompt of
 * max_prompt_tokens tokens (5 bytes per varint token at most) plus framing; a larger message
 * cannot be valid, so the transport refuses it (RESOURCE_EXHAUSTED) before parsing. */
size_t tkvd_service_max_recv_bytes(const tkvd_config *cfg)
{
    uint64_t n = (uint64_t)cfg->max_blocks_per_rpc * (cfg->block_bytes + 16) +
                 (uint64_t)cfg->max_prompt_tokens * 5 + 4096;
    return n > INT32_MAX ? INT32_MAX : (size_t)n;
}

/* The largest reply is a Get of max_blocks_per_rpc blocks (or a ListBlocks of kListMax
 * entries, ~110 bytes each). */
size_t tkvd_service_max_send_bytes(const tkvd_config *cfg)
{
    uint64_t get = (uint64_t)cfg->max_blocks_per_rpc * (cfg->block_bytes + 16) + 4096;
    uint64_t list = (uint64_t)kListMax * 128 + 4096;
    uint64_t n = get > list ? get : list;
    return n > INT32_MAX ? INT32_MAX : (size_t)n;
}
