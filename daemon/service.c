/* service.c - the tierkv.v1.Cache RPC handlers (see tkvd_service.h). */
#include "tkvd_service.h"

#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "tierkv.pb-c.h"
#include "tkv_attach.h"
#include "tkv_fast.h"
#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_l3.h"
#include "tkvd_gpu.h"

#define kMaxNamespaceBytes 255
#define kListMax 10000          /* ListBlocks answers at most this many blocks */
#define kWaitSliceMs 200        /* blocking waits re-check shutdown this often */
#define kVerifyReportNs 100000000ull /* Verify streams progress at most every 100 ms */

/* ---- status mapping and call outcome --------------------------------------------------------- */

/* TKV_E* -> gRPC status, as annotated in common/tkv_base.h. */
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

/* Fails the call with code and a one-line message; returns false (for validators). */
static bool fail_with(tkvd_call *k, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool fail_with(tkvd_call *k, grpc_status_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->msg, sizeof(k->msg), fmt, ap);
    va_end(ap);
    k->code = code;
    return false;
}

/* A store error: "<what>: <tkv_strerror>" with the mapped code. Returns true when rc is OK. */
static bool store_ok(tkvd_call *k, int rc, const char *what)
{
    if (rc == TKV_OK)
        return true;
    if (rc == TKV_ENOTFOUND)
        return fail_with(k, status_of(rc), "%s: not found (unknown, released or ended)", what);
    return fail_with(k, status_of(rc), "%s: %s", what, tkv_strerror(rc));
}

/* Zeroed memory that lives until the reply is packed (for the reply's repeated fields). */
static void *call_alloc(tkvd_call *k, size_t n, size_t size)
{
    if (k->num_scratch == k->cap_scratch) {
        k->cap_scratch = k->cap_scratch ? 2 * k->cap_scratch : 16;
        k->scratch = tkv_xrealloc(k->scratch, k->cap_scratch * sizeof(*k->scratch));
    }
    void *p = tkv_xcalloc(n ? n : 1, size);
    k->scratch[k->num_scratch++] = p;
    return p;
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

/* A refusal for tenant reasons (PERMISSION_DENIED, or NOT_FOUND where existence must not be
 * revealed), counted per tenant (tierkv_tenant_denied_total) and logged at most once a second
 * per tenant with the number held back, so a client hammering the daemon with forged requests
 * cannot flood the log, nor hide another tenant's refusals behind its own. */
static bool deny(tkvd_call *k, grpc_status_code code, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));
static bool deny(tkvd_call *k, grpc_status_code code, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(k->msg, sizeof(k->msg), fmt, ap);
    va_end(ap);
    k->code = code;
    tkvd_metrics *m = k->svc->metrics;
    size_t slot = k->tenant ? k->tenant->index + 1 : 0;
    atomic_fetch_add_explicit(&m->tenant_denied[slot], 1, memory_order_relaxed);
    uint64_t now_ms = tkv_now_ns() / 1000000u;
    uint64_t last = atomic_load_explicit(&m->deny_log_ms[slot], memory_order_relaxed);
    if ((last == 0 || now_ms - last >= 1000) &&
        atomic_compare_exchange_strong(&m->deny_log_ms[slot], &last, now_ms)) {
        uint64_t held = atomic_exchange(&m->deny_log_held[slot], 0);
        TKV_LOG(TKV_LOG_WARN, "refused a call of tenant %s (uid %d pid %d, %s): %s (%" PRIu64
                " more refusals since the last line)", k->tenant ? k->tenant->name : "(none)",
                k->peer.has_cred ? (int)k->peer.uid : -1, k->peer.has_cred ? (int)k->peer.pid : -1,
                k->peer.addr, k->msg, held);
    } else {
        atomic_fetch_add_explicit(&m->deny_log_held[slot], 1, memory_order_relaxed);
    }
    return false;
}

/* With tenants configured: who the peer proved to be (k->tenant), or a refusal. Health answers
 * anyone who can reach a socket (it shows nothing of any tenant); ListBlocks, Flush and Verify
 * act on every tenant's blocks and are for admin tenants. */
static bool admit(tkvd_call *k, const char *path)
{
    const tkvd_tenants *ts = &k->svc->cfg->tenants;
    if (!tkvd_tenants_enabled(ts) || strcmp(path, "/tierkv.v1.Cache/Health") == 0)
        return true;
    tkvd_identity id = {.has_ucred = k->peer.has_cred, .uid = k->peer.uid, .gid = k->peer.gid,
                        .pid = (pid_t)k->peer.pid};
    if (k->peer.tls_subject[0])
        id.tls_subject = k->peer.tls_subject;
    if (k->peer.token[0]) {
        /* `authorization: Bearer <token>`; any other form presents a token nobody has */
        const char *t = k->peer.token;
        if (strncasecmp(t, "Bearer ", 7) == 0)
            t += 7;
        else
            t = "";
        id.token = t;
        id.token_len = strlen(t);
    }
    k->tenant = tkvd_tenant_of_peer(ts, &id);
    if (!k->tenant) {
        char who[160];
        if (id.token)
            snprintf(who, sizeof(who), "bearer token matches none");
        else if (id.tls_subject)
            snprintf(who, sizeof(who), "client certificate subject '%.100s' matches none",
                     id.tls_subject);
        else if (id.has_ucred)
            snprintf(who, sizeof(who), "uid %u / gid %u match none", (unsigned)id.uid,
                     (unsigned)id.gid);
        else
            snprintf(who, sizeof(who), "no identity proven");
        return deny(k, GRPC_STATUS_PERMISSION_DENIED,
                    "no tenant for this caller (%s): see the tenant.* keys in the daemon's config",
                    who);
    }
    atomic_fetch_add_explicit(&k->svc->metrics->tenant_rpcs[k->tenant->index + 1], 1,
                              memory_order_relaxed);
    static const char *const kAdminOnly[] = {"/tierkv.v1.Cache/ListBlocks",
                                             "/tierkv.v1.Cache/Flush", "/tierkv.v1.Cache/Verify"};
    for (size_t i = 0; i < sizeof(kAdminOnly) / sizeof(kAdminOnly[0]); i++)
        if (strcmp(path, kAdminOnly[i]) == 0 && !k->tenant->admin)
            return deny(k, GRPC_STATUS_PERMISSION_DENIED,
                        "%s acts on every tenant's blocks: tenant %s is not an admin tenant",
                        path + strlen("/tierkv.v1.Cache/"), k->tenant->name);
    return true;
}

/* A lease or allocation id another tenant's call made is answered as if it did not exist
 * (the answer must not tell B that A holds lease N), and counted as a refusal. */
static bool check_owned(tkvd_call *k, uint64_t lease_id, uint64_t alloc_id, const char *what)
{
    if (!k->tenant || (!lease_id && !alloc_id))
        return true;
    uint64_t owner = 0;
    int rc = lease_id ? tkv_store_lease_owner(k->svc->store, lease_id, &owner)
                      : tkv_store_alloc_owner(k->svc->store, alloc_id, &owner);
    if (rc != TKV_OK || tkvd_tenant_owns(k->tenant, owner))
        return true; /* the handler reports a missing id itself */
    return deny(k, GRPC_STATUS_NOT_FOUND, "%s: not found (unknown, released or ended)", what);
}

/* Checks the request's scope; on failure fails the call and returns false. */
static bool check_scope(tkvd_call *k, const Tierkv__V1__BlockScope *scope)
{
    tkvd_service *svc = k->svc;
    if (!scope)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT,
                         "scope missing: requests that touch blocks carry namespace and fingerprint");
    if (scope->fingerprint.len != TKV_KEY_BYTES)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT,
                         "scope.fingerprint: %zu bytes, expected %d (SHA-256 of the geometry)",
                         scope->fingerprint.len, TKV_KEY_BYTES);
    if (memcmp(scope->fingerprint.data, svc->cfg->fingerprint, TKV_KEY_BYTES) != 0) {
        const tkv_geometry *g = &svc->cfg->geometry;
        char theirs[17], ours[17];
        hex_prefix(scope->fingerprint.data, 8, theirs);
        hex_prefix(svc->cfg->fingerprint, 8, ours);
        return fail_with(k, GRPC_STATUS_FAILED_PRECONDITION,
                         "geometry mismatch: client fingerprint %s.. != daemon's %s.. (daemon serves "
                         "model '%s', %u layers, %u kv heads, head dim %u, %u tokens/block, %s, %s)",
                         theirs, ours, g->model_id, g->num_layers, g->num_kv_heads, g->head_dim,
                         g->block_tokens, tkvd_dtype_name(g->dtype),
                         tkvd_scale_mode_name(g->scale_mode));
    }
    if (strlen(scope->namespace_) > kMaxNamespaceBytes)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "scope.namespace: %zu bytes, at most %d",
                         strlen(scope->namespace_), kMaxNamespaceBytes);
    /* With tenants the namespace is the caller's tenant: a request may leave it empty or name
     * it, never another. */
    if (k->tenant && *scope->namespace_ && strcmp(scope->namespace_, k->tenant->name) != 0)
        return deny(k, GRPC_STATUS_PERMISSION_DENIED,
                    "scope.namespace '%.64s': this caller acts as tenant '%s' and may name no other",
                    scope->namespace_, k->tenant->name);
    if (k->tenant && scope->client_id && !tkvd_tenant_owns(k->tenant, scope->client_id))
        return deny(k, GRPC_STATUS_PERMISSION_DENIED,
                    "scope.client_id %" PRIu64 ": attached as another tenant than '%s'",
                    scope->client_id, k->tenant->name);
    if (k->peer.kind == TKVD_PEER_ATTACH) {
        /* the connection is the client: the message cannot name another one */
        if (scope->client_id && scope->client_id != k->peer.attach_id)
            return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT,
                             "scope.client_id %" PRIu64 " is not this connection's (%" PRIu64 ")",
                             scope->client_id, k->peer.attach_id);
    } else if (scope->client_id &&
               !(svc->attach && tkvd_attach_client_live(svc->attach, scope->client_id))) {
        return fail_with(k, GRPC_STATUS_NOT_FOUND,
                         "scope.client_id %" PRIu64 ": no attached client with this id (attach "
                         "first, or send 0)", scope->client_id);
    }
    return true;
}

/* The one place where a call's identity becomes the owner of its leases and the namespace its
 * keys live in. Without tenants the namespace is the one the message names; with tenants it
 * is the caller's tenant (check_scope refused any other), and every owner id carries the
 * tenant's tag (attach client ids already do), so its leases and allocations are its own. */
static void bind_scope(tkvd_call *k, const Tierkv__V1__BlockScope *scope)
{
    k->ns = k->tenant ? k->tenant->name : scope->namespace_;
    k->ns_len = strlen(k->ns);
    k->owner_id = k->peer.kind == TKVD_PEER_ATTACH ? k->peer.attach_id : scope->client_id;
    if (k->tenant && !k->owner_id)
        k->owner_id = tkvd_tenant_tag(k->tenant);
}

static bool check_tokens(tkvd_call *k, size_t n_tokens)
{
    if (n_tokens > k->svc->cfg->max_prompt_tokens)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "tokens: %zu exceeds max_prompt_tokens (%u)",
                         n_tokens, k->svc->cfg->max_prompt_tokens);
    return true;
}

/* Keys of the first num_blocks full blocks of tokens, in the call's namespace. */
static tkv_key *derive_keys(tkvd_call *k, const uint32_t *tokens, size_t num_blocks)
{
    const tkvd_config *cfg = k->svc->cfg;
    tkv_key *keys = call_alloc(k, num_blocks, sizeof(*keys));
    tkvd_keycache_derive(k->svc->keycache, cfg->fingerprint, k->ns, k->ns_len, tokens,
                         num_blocks, cfg->geometry.block_tokens, keys);
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

/* The caller's tenant's L1 region as a range of pool offsets (the allocation its attach got
 * the handle of); false where there is none (no GPU tier, an empty region). */
static bool l1_region_of(tkvd_call *k, uint64_t *base, uint64_t *bytes)
{
    unsigned r = 0;
    *base = *bytes = 0;
    return k->svc->gpu &&
           tkv_store_l1_region(k->svc->store, tkvd_tenant_store_id(k->tenant), &r) == TKV_OK &&
           tkvd_gpu_region(k->svc->gpu, r, base, bytes) == TKV_OK && *bytes > 0;
}

/* A repeated BlockLoc from store locations, in call scratch memory. L2 offsets are told
 * relative to the caller's tenant's L2 region (the memfd its attach got), L1 offsets relative
 * to its L1 region (the one allocation whose handle it got): a block outside them (none should
 * be: a lease holds its tenant's blocks, and those of no tenant sit in region 0, shared with
 * no one where tenants are configured) is shown as not in that tier, so no offset of another
 * region ever reaches a client. */
static Tierkv__V1__BlockLoc **loc_msgs(tkvd_call *k, const tkv_block_loc *locs, size_t n)
{
    Tierkv__V1__BlockLoc *msgs = call_alloc(k, n, sizeof(*msgs));
    Tierkv__V1__BlockLoc **ptrs = call_alloc(k, n, sizeof(*ptrs));
    uint64_t base = 0, bytes = 0, base1 = 0, bytes1 = 0;
    tkv_store_l2_region(k->svc->store, tkvd_tenant_store_id(k->tenant), &base, &bytes, NULL, NULL);
    if (!l1_region_of(k, &base1, &bytes1))
        bytes1 = UINT64_MAX; /* an L1 backend of no regions: its offsets as they are */
    for (size_t i = 0; i < n; i++) {
        tierkv__v1__block_loc__init(&msgs[i]);
        bool in_l2 = locs[i].in_l2 && locs[i].l2_offset >= base &&
                     locs[i].l2_offset - base < bytes;
        bool in_l1 = locs[i].in_l1 && locs[i].l1_offset >= base1 &&
                     locs[i].l1_offset - base1 < bytes1;
        int tier = locs[i].tier;
        if (tier == TKV_TIER_L1 && !in_l1)
            tier = in_l2 ? TKV_TIER_L2 : locs[i].in_l3 ? TKV_TIER_L3 : TKV_TIER_NONE;
        if (tier == TKV_TIER_L2 && !in_l2)
            tier = locs[i].in_l3 ? TKV_TIER_L3 : TKV_TIER_NONE;
        msgs[i].tier = (Tierkv__V1__Tier)tier;
        msgs[i].in_l2 = in_l2;
        msgs[i].in_l3 = locs[i].in_l3;
        msgs[i].l2_offset = in_l2 ? locs[i].l2_offset - base : 0;
        msgs[i].in_l1 = in_l1;
        msgs[i].l1_offset = in_l1 ? locs[i].l1_offset - base1 : 0;
        ptrs[i] = &msgs[i];
    }
    return ptrs;
}

/* A lease never holds more blocks than the longest prompt a Lookup accepts. */
static size_t max_lease_blocks(const tkvd_service *svc)
{
    return svc->cfg->max_prompt_tokens / svc->cfg->geometry.block_tokens;
}

/* The current locations of a lease's blocks (at most max_lease_blocks), in scratch memory. */
static bool lease_locs(tkvd_call *k, uint64_t lease_id, const char *what, tkv_block_loc **locs,
                       size_t *n)
{
    size_t cap = max_lease_blocks(k->svc);
    *locs = call_alloc(k, cap, sizeof(**locs));
    if (!store_ok(k, tkv_store_lease_locs(k->svc->store, lease_id, *locs, cap, n), what))
        return false;
    if (*n > cap)
        *n = cap;
    return true;
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

/* True when the store has a GPU tier (a backend attached L1 slots). */
static bool has_l1(tkvd_service *svc)
{
    tkv_store_stats st;
    tkv_store_get_stats(svc->store, &st);
    return st.capacity_blocks_tier[TKV_TIER_L1] > 0;
}

/* Checks a target tier for Prefetch/Alloc/CostCheck: NONE means L2. Returns the tier or -1
 * (the call failed). */
static int target_tier(tkvd_call *k, int tier, const char *what)
{
    if (tier == TKV_TIER_NONE || tier == TKV_TIER_L2)
        return TKV_TIER_L2;
    /* Each tenant's L1 blocks live in an allocation of its own, and its engines get that
     * one's handle at attach, read-write (CUDA IPC has no read-only mapping): only map_pool
     * tenants (engines trusted with their tenant's L1 blocks) get it, and only they may place
     * blocks there. */
    if (tier == TKV_TIER_L1 && has_l1(k->svc) && k->tenant && !k->tenant->map_pool) {
        deny(k, GRPC_STATUS_PERMISSION_DENIED, "%s: tenant '%s' may not use L1 (its engines "
             "would map its L1 region read-write): set tenant.%s.map_pool = on for trusted "
             "engines", what, k->tenant->name, k->tenant->name);
        return -1;
    }
    if (tier == TKV_TIER_L1 && has_l1(k->svc))
        return TKV_TIER_L1;
    if (tier == TKV_TIER_L1)
        fail_with(k, GRPC_STATUS_UNIMPLEMENTED, "%s: this daemon has no GPU (L1) tier", what);
    else
        fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "%s: tier %d is not a target (TIER_L2 or TIER_L1)",
                  what, tier);
    return -1;
}

/* Checks that tokens hold the full blocks first..first+count-1. */
static bool check_block_range(tkvd_call *k, size_t n_tokens, uint32_t first, size_t count,
                              const char *what)
{
    uint32_t P = k->svc->cfg->geometry.block_tokens;
    size_t full = n_tokens / P;
    if ((uint64_t)first + count > full)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT,
                         "%s: blocks %u..%" PRIu64 " need %" PRIu64 " tokens, the request has %zu "
                         "(%zu full blocks of %u)", what, first, (uint64_t)first + count - 1,
                         ((uint64_t)first + count) * P, n_tokens, full, P);
    return true;
}

static bool check_blocks_per_rpc(tkvd_call *k, size_t n, const char *what)
{
    if (n > k->svc->cfg->max_blocks_per_rpc)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "%s: %zu blocks exceed max_blocks_per_rpc "
                         "(%u); send them in pieces", what, n, k->svc->cfg->max_blocks_per_rpc);
    return true;
}

/* ==== the handlers ===============================================================================
 * Each call is a validator (v_*: checks every field the generic checks do not; no side
 * effects) and a handler (h_*: does the work; may still fail on the store's answer). Both get
 * the decoded request; the handler fills the reply message the dispatcher initialised. */

/* ---- Lookup / LookupBatch --------------------------------------------------------------------- */

/* One prompt's lookup into rsp (shared by Lookup and each prompt of LookupBatch). */
static bool lookup_one(tkvd_call *k, const uint32_t *tokens, size_t n_tokens, uint32_t ttl_ms,
                       Tierkv__V1__LookupResponse *rsp)
{
    tkvd_service *svc = k->svc;
    uint64_t t0 = tkv_now_ns();
    uint32_t P = svc->cfg->geometry.block_tokens;
    size_t num_blocks = n_tokens / P;
    rsp->num_query_blocks = (uint32_t)num_blocks;
    if (num_blocks > 0) {
        tkv_key *keys = derive_keys(k, tokens, num_blocks);
        tkv_block_loc *locs = call_alloc(k, num_blocks, sizeof(*locs));
        uint64_t lease = 0;
        size_t hit = 0;
        int rc = tkv_store_lookup_as(svc->store, tkvd_tenant_store_id(k->tenant), keys,
                                     num_blocks, k->owner_id, ttl_ms, &lease, &hit, locs);
        if (!store_ok(k, rc, "lookup"))
            return false;
        rsp->num_hit_blocks = (uint32_t)hit;
        rsp->num_hit_tokens = (uint32_t)(hit * P);
        rsp->lease_id = lease;
        rsp->n_blocks = hit;
        rsp->blocks = loc_msgs(k, locs, hit);
    }
    tkvd_metrics *m = svc->metrics;
    atomic_fetch_add_explicit(&m->lookups, 1, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->lookup_query_tokens, (uint64_t)num_blocks * P, memory_order_relaxed);
    atomic_fetch_add_explicit(&m->lookup_hit_tokens, rsp->num_hit_tokens, memory_order_relaxed);
    tkvd_metrics_observe_lookup(m, tkv_now_ns() - t0);
    return true;
}

static void h_lookup(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__LookupRequest *rq = req;
    lookup_one(k, rq->tokens, rq->n_tokens, rq->lease_ttl_ms, out);
}

#define kMaxBatchPrompts 256
#define kBatchTokenFactor 4     /* a batch holds at most 4 x max_prompt_tokens tokens */

static bool v_lookup_batch(tkvd_call *k, const void *req)
{
    const Tierkv__V1__LookupBatchRequest *rq = req;
    uint64_t limit = (uint64_t)kBatchTokenFactor * k->svc->cfg->max_prompt_tokens, total = 0;
    if (rq->n_prompts > kMaxBatchPrompts)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "lookup_batch: %zu prompts, at most %d",
                         rq->n_prompts, kMaxBatchPrompts);
    for (size_t i = 0; i < rq->n_prompts; i++) {
        if (!check_tokens(k, rq->prompts[i]->n_tokens))
            return false;
        total += rq->prompts[i]->n_tokens;
    }
    if (total > limit)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "lookup_batch: %" PRIu64 " tokens in all, "
                         "at most %" PRIu64 " (%d x max_prompt_tokens)", total, limit,
                         kBatchTokenFactor);
    return true;
}

static void h_lookup_batch(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__LookupBatchRequest *rq = req;
    Tierkv__V1__LookupBatchResponse *rsp = out;
    size_t n = rq->n_prompts, done = 0;
    Tierkv__V1__LookupResponse *msgs = call_alloc(k, n, sizeof(*msgs));
    Tierkv__V1__LookupResponse **ptrs = call_alloc(k, n, sizeof(*ptrs));
    for (; done < n; done++) {
        tierkv__v1__lookup_response__init(&msgs[done]);
        ptrs[done] = &msgs[done];
        const Tierkv__V1__Prompt *p = rq->prompts[done];
        if (!lookup_one(k, p->tokens, p->n_tokens, rq->lease_ttl_ms, &msgs[done]))
            break;
    }
    if (done < n) { /* all or nothing: the caller never learns these leases */
        for (size_t i = 0; i < done; i++)
            if (msgs[i].lease_id)
                tkv_store_lease_release(k->svc->store, msgs[i].lease_id);
        return;
    }
    rsp->n_results = n;
    rsp->results = ptrs;
}

/* ---- Prefetch --------------------------------------------------------------------------------- */

static bool v_prefetch(tkvd_call *k, const void *req)
{
    const Tierkv__V1__PrefetchRequest *rq = req;
    if (rq->lease_id == 0)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "prefetch: lease_id missing (0)");
    char what[64];
    snprintf(what, sizeof(what), "prefetch lease %" PRIu64, rq->lease_id);
    return check_owned(k, rq->lease_id, 0, what) && target_tier(k, rq->tier, "prefetch") >= 0;
}

static void h_prefetch(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__PrefetchRequest *rq = req;
    Tierkv__V1__PrefetchResponse *rsp = out;
    tkvd_service *svc = k->svc;
    char what[64];
    snprintf(what, sizeof(what), "prefetch lease %" PRIu64, rq->lease_id);
    uint64_t ticket = 0;
    int rc = tkv_store_prefetch(svc->store, rq->lease_id, target_tier(k, rq->tier, "prefetch"),
                                NULL, NULL, &ticket);
    if (!store_ok(k, rc, what))
        return;
    rsp->ticket = ticket;
    if (!rq->wait)
        return;
    int timeout = rq->timeout_ms ? (int)(rq->timeout_ms > INT32_MAX ? INT32_MAX : rq->timeout_ms) : -1;
    if (k->timeout_ms >= 0 && (timeout < 0 || k->timeout_ms < timeout))
        timeout = k->timeout_ms;
    int status = TKV_OK;
    rc = wait_ticket(svc, ticket, timeout, &status);
    if (rc == TKV_ETIMEDOUT) {
        fail_with(k, GRPC_STATUS_DEADLINE_EXCEEDED, "%s: promotion not finished after %d ms",
                  what, timeout);
        return;
    }
    tkv_block_loc *locs;
    size_t n = 0;
    if (!store_ok(k, rc, what) || !store_ok(k, status, what) || !lease_locs(k, rq->lease_id, what, &locs, &n))
        return;
    rsp->n_blocks = n;
    rsp->blocks = loc_msgs(k, locs, n);
    rsp->done = 1;
}

/* ---- Put -------------------------------------------------------------------------------------- */

static bool v_put(tkvd_call *k, const void *req)
{
    const Tierkv__V1__PutRequest *rq = req;
    if (rq->n_blocks == 0)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "put: no blocks");
    if (!check_blocks_per_rpc(k, rq->n_blocks, "put") ||
        !check_block_range(k, rq->n_tokens, rq->first_block, rq->n_blocks, "put"))
        return false;
    for (size_t i = 0; i < rq->n_blocks; i++)
        if (rq->blocks[i].len != k->svc->cfg->block_bytes)
            return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT,
                             "put: blocks[%zu] has %zu bytes, a block of this geometry has %zu", i,
                             rq->blocks[i].len, k->svc->cfg->block_bytes);
    return true;
}

static void h_put(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__PutRequest *rq = req;
    Tierkv__V1__PutResponse *rsp = out;
    tkvd_service *svc = k->svc;
    size_t n = rq->n_blocks;
    const void **payloads = call_alloc(k, n, sizeof(*payloads));
    for (size_t i = 0; i < n; i++)
        payloads[i] = rq->blocks[i].data;
    uint32_t P = svc->cfg->geometry.block_tokens;
    tkv_key *keys = derive_keys(k, rq->tokens, (size_t)rq->first_block + n);
    const tkv_key *parent = rq->first_block ? &keys[rq->first_block - 1] : NULL;
    /* The split of the blocks not stored into duplicates and rejections comes from the store's
     * counters; under concurrent puts it is approximate (num_stored is exact). */
    tkv_store_stats before, after;
    tkv_store_get_stats(svc->store, &before);
    size_t stored = 0;
    int rc = tkv_store_put_as(svc->store, tkvd_tenant_store_id(k->tenant), parent,
                              keys + rq->first_block, rq->tokens + (size_t)rq->first_block * P,
                              payloads, n, &stored);
    if (!store_ok(k, rc, "put"))
        return;
    tkv_store_get_stats(svc->store, &after);
    uint64_t rejected = after.put_rejected_blocks - before.put_rejected_blocks;
    if (rejected > n - stored)
        rejected = n - stored;
    rsp->num_stored = (uint32_t)stored;
    rsp->num_rejected = (uint32_t)rejected;
    rsp->num_duplicate = (uint32_t)(n - stored - rejected);
}

/* ---- Get -------------------------------------------------------------------------------------- */

static bool v_get(tkvd_call *k, const void *req)
{
    const Tierkv__V1__GetRequest *rq = req;
    if (rq->lease_id == 0)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "get: lease_id missing (0)");
    char what[64];
    snprintf(what, sizeof(what), "get lease %" PRIu64, rq->lease_id);
    return check_owned(k, rq->lease_id, 0, what);
}

static void h_get(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__GetRequest *rq = req;
    Tierkv__V1__GetResponse *rsp = out;
    char what[64];
    snprintf(what, sizeof(what), "get lease %" PRIu64, rq->lease_id);
    tkv_block_loc *locs;
    size_t num = 0;
    if (!lease_locs(k, rq->lease_id, what, &locs, &num))
        return;
    if (rq->first >= num) {
        fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "%s: first %u is out of range (%zu blocks)",
                  what, rq->first, num);
        return;
    }
    size_t count = rq->count ? rq->count : num - rq->first;
    if ((uint64_t)rq->first + count > num) {
        fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "%s: blocks %u..%" PRIu64 " out of range "
                  "(%zu blocks)", what, rq->first, (uint64_t)rq->first + count - 1, num);
        return;
    }
    if (!check_blocks_per_rpc(k, count, what))
        return;
    size_t bb = k->svc->cfg->block_bytes;
    uint8_t *data = call_alloc(k, count, bb);
    ProtobufCBinaryData *bins = call_alloc(k, count, sizeof(*bins));
    for (size_t i = 0; i < count; i++) {
        int rc = tkv_store_get(k->svc->store, rq->lease_id, (uint32_t)(rq->first + i),
                               data + i * bb, bb);
        if (rc != TKV_OK) {
            char w[96];
            snprintf(w, sizeof(w), "%s block %zu", what, rq->first + i);
            store_ok(k, rc, w);
            return;
        }
        bins[i].data = data + i * bb;
        bins[i].len = bb;
    }
    rsp->n_blocks = count;
    rsp->blocks = bins;
}

/* ---- Alloc / WriteSlot / Commit / Release ----------------------------------------------------- */

static bool v_alloc(tkvd_call *k, const void *req)
{
    const Tierkv__V1__AllocRequest *rq = req;
    if (target_tier(k, rq->tier, "alloc") < 0)
        return false;
    if (rq->num_blocks == 0 || rq->num_blocks > k->svc->cfg->max_blocks_per_rpc)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "alloc: num_blocks %u not in [1, %u]",
                         rq->num_blocks, k->svc->cfg->max_blocks_per_rpc);
    return true;
}

static void h_alloc(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__AllocRequest *rq = req;
    Tierkv__V1__AllocResponse *rsp = out;
    uint64_t *offsets = call_alloc(k, rq->num_blocks, sizeof(*offsets));
    uint64_t id = 0;
    int rc = tkv_store_alloc_as(k->svc->store, tkvd_tenant_store_id(k->tenant),
                                target_tier(k, rq->tier, "alloc"), rq->num_blocks, k->owner_id,
                                &id, offsets);
    if (!store_ok(k, rc, "alloc"))
        return;
    /* Relative to the tenant's region of that tier (the mapping its attach got); the store
     * took the slots there, so every offset lies inside it. */
    uint64_t base = 0, bytes = 0;
    if (target_tier(k, rq->tier, "alloc") == TKV_TIER_L2)
        tkv_store_l2_region(k->svc->store, tkvd_tenant_store_id(k->tenant), &base, &bytes, NULL,
                            NULL);
    else if (!l1_region_of(k, &base, &bytes))
        bytes = UINT64_MAX; /* an L1 backend of no regions (none but the GPU's has them) */
    for (uint32_t i = 0; i < rq->num_blocks; i++) {
        TKV_ASSERT(offsets[i] >= base && offsets[i] - base < bytes);
        offsets[i] -= base;
    }
    rsp->alloc_id = id;
    rsp->n_offsets = rq->num_blocks;
    rsp->offsets = offsets;
}

static bool v_write_slot(tkvd_call *k, const void *req)
{
    const Tierkv__V1__WriteSlotRequest *rq = req;
    if (rq->alloc_id == 0)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "write_slot: alloc_id missing (0)");
    if (rq->payload.len != k->svc->cfg->block_bytes)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "write_slot alloc %" PRIu64 " slot %u: "
                         "payload has %zu bytes, a block has %zu", rq->alloc_id, rq->index,
                         rq->payload.len, k->svc->cfg->block_bytes);
    char what[80];
    snprintf(what, sizeof(what), "write_slot alloc %" PRIu64 " slot %u", rq->alloc_id, rq->index);
    return check_owned(k, 0, rq->alloc_id, what);
}

static void h_write_slot(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__WriteSlotRequest *rq = req;
    (void)out;
    char what[80];
    snprintf(what, sizeof(what), "write_slot alloc %" PRIu64 " slot %u", rq->alloc_id, rq->index);
    store_ok(k, tkv_store_alloc_write(k->svc->store, rq->alloc_id, rq->index, rq->payload.data), what);
}

static bool v_commit(tkvd_call *k, const void *req)
{
    const Tierkv__V1__CommitRequest *rq = req;
    if (rq->alloc_id == 0)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "commit: alloc_id missing (0)");
    char what[64];
    snprintf(what, sizeof(what), "commit alloc %" PRIu64, rq->alloc_id);
    return check_owned(k, 0, rq->alloc_id, what) &&
           check_blocks_per_rpc(k, rq->num_blocks, "commit") &&
           check_block_range(k, rq->n_tokens, rq->first_block, rq->num_blocks, "commit");
}

static void h_commit(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__CommitRequest *rq = req;
    Tierkv__V1__CommitResponse *rsp = out;
    char what[64];
    snprintf(what, sizeof(what), "commit alloc %" PRIu64, rq->alloc_id);
    uint32_t P = k->svc->cfg->geometry.block_tokens;
    tkv_key *keys = derive_keys(k, rq->tokens, (size_t)rq->first_block + rq->num_blocks);
    const tkv_key *parent = rq->first_block ? &keys[rq->first_block - 1] : NULL;
    size_t stored = 0;
    /* A commit of no blocks may carry no tokens: no pointer arithmetic on a NULL array. */
    const uint32_t *tokens = rq->num_blocks ? rq->tokens + (size_t)rq->first_block * P : NULL;
    int rc = tkv_store_commit(k->svc->store, rq->alloc_id, parent, keys + rq->first_block,
                              tokens, rq->num_blocks, &stored);
    if (!store_ok(k, rc, what))
        return;
    rsp->num_stored = (uint32_t)stored;
    rsp->num_duplicate = (uint32_t)(rq->num_blocks - stored);
}

static bool v_release(tkvd_call *k, const void *req)
{
    const Tierkv__V1__ReleaseRequest *rq = req;
    if (!rq->lease_id == !rq->alloc_id)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT,
                         "release: give exactly one of lease_id and alloc_id");
    char what[64];
    if (rq->lease_id)
        snprintf(what, sizeof(what), "release lease %" PRIu64, rq->lease_id);
    else
        snprintf(what, sizeof(what), "release alloc %" PRIu64, rq->alloc_id);
    return check_owned(k, rq->lease_id, rq->alloc_id, what);
}

static void h_release(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__ReleaseRequest *rq = req;
    (void)out;
    char what[64];
    int rc;
    if (rq->lease_id) {
        snprintf(what, sizeof(what), "release lease %" PRIu64, rq->lease_id);
        rc = tkv_store_lease_release(k->svc->store, rq->lease_id);
    } else {
        snprintf(what, sizeof(what), "release alloc %" PRIu64, rq->alloc_id);
        rc = tkv_store_abort(k->svc->store, rq->alloc_id);
    }
    store_ok(k, rc, what);
}

/* ---- Stats / ListBlocks / Health ---------------------------------------------------------------- */

static void h_stats(tkvd_call *k, const void *req, void *out)
{
    (void)req;
    Tierkv__V1__StatsResponse *rsp = out;
    const tkvd_config *cfg = k->svc->cfg;
    tkvd_metrics *m = k->svc->metrics;
    tkv_store_stats st;
    tkv_store_get_stats(k->svc->store, &st);

    Tierkv__V1__Geometry *geo = call_alloc(k, 1, sizeof(*geo));
    tierkv__v1__geometry__init(geo);
    geo->num_layers = cfg->geometry.num_layers;
    geo->num_kv_heads = cfg->geometry.num_kv_heads;
    geo->head_dim = cfg->geometry.head_dim;
    geo->block_tokens = cfg->geometry.block_tokens;
    geo->kv_dtype = (char *)tkvd_dtype_name(cfg->geometry.dtype);
    geo->scale_mode = (char *)tkvd_scale_mode_name(cfg->geometry.scale_mode);
    geo->model_id = (char *)cfg->geometry.model_id;
    geo->fingerprint.data = (uint8_t *)cfg->fingerprint;
    geo->fingerprint.len = TKV_KEY_BYTES;
    geo->block_bytes = cfg->block_bytes;

    /* L2 always; L3 when enabled; L1 when a GPU tier is attached. */
    Tierkv__V1__TierStats *tiers = call_alloc(k, 3, sizeof(*tiers));
    Tierkv__V1__TierStats **tier_ptrs = call_alloc(k, 3, sizeof(*tier_ptrs));
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

    rsp->lookups = st.lookups;
    rsp->hit_blocks = st.hit_blocks;
    rsp->miss_blocks = st.miss_blocks;
    rsp->hit_tokens = atomic_load_explicit(&m->lookup_hit_tokens, memory_order_relaxed);
    rsp->n_tiers = num_tiers;
    rsp->tiers = tier_ptrs;
    rsp->promotions = st.promotions;
    rsp->promotion_bytes = st.promotion_bytes;
    rsp->demotions = st.demotions;
    rsp->demotion_bytes = st.demotion_bytes;
    rsp->evictions = st.evictions;
    rsp->checksum_failures = st.checksum_failures;
    rsp->io_errors = st.io_errors;
    rsp->leases_active = st.leases_active;
    rsp->clients_connected = atomic_load_explicit(&m->clients_connected, memory_order_relaxed);
    rsp->lookup_p50_us = tkvd_metrics_lookup_quantile_us(m, 0.50);
    rsp->lookup_p99_us = tkvd_metrics_lookup_quantile_us(m, 0.99);
    uint64_t now_ms = tkv_wall_ms();
    rsp->uptime_s = now_ms > m->start_ms ? (now_ms - m->start_ms) / 1000 : 0;
    rsp->geometry = geo;
    rsp->puts = st.puts;
    rsp->put_blocks = st.put_blocks;
    rsp->gets = st.gets;
    rsp->get_bytes = st.get_bytes;
    rsp->l3_readonly = st.l3_readonly != 0;
    rsp->policy = (char *)cfg->policy;
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

static bool v_list_blocks(tkvd_call *k, const void *req)
{
    const Tierkv__V1__ListBlocksRequest *rq = req;
    if ((int)rq->tier < TKV_TIER_NONE || (int)rq->tier > TKV_TIER_L3)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "list_blocks: unknown tier %d", (int)rq->tier);
    return true;
}

static void h_list_blocks(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__ListBlocksRequest *rq = req;
    Tierkv__V1__ListBlocksResponse *rsp = out;
    list_ctx lc = {.tier = (int)rq->tier};
    lc.limit = rq->limit && rq->limit < kListMax ? rq->limit : kListMax;
    lc.infos = call_alloc(k, lc.limit, sizeof(*lc.infos));
    if (!store_ok(k, tkv_store_list(k->svc->store, list_cb, &lc), "list_blocks"))
        return;
    Tierkv__V1__BlockInfo *msgs = call_alloc(k, lc.count, sizeof(*msgs));
    Tierkv__V1__BlockInfo **ptrs = call_alloc(k, lc.count, sizeof(*ptrs));
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
    rsp->n_blocks = lc.count;
    rsp->blocks = ptrs;
    rsp->total = lc.total;
}

static void h_health(tkvd_call *k, const void *req, void *out)
{
    (void)req;
    Tierkv__V1__HealthResponse *rsp = out;
    tkvd_service *svc = k->svc;
    tkv_store_stats st;
    tkv_store_get_stats(svc->store, &st);
    enum { kNotes = 4, kNoteBytes = 160 };
    char *notes = call_alloc(k, kNotes, kNoteBytes);
    char **note_ptrs = call_alloc(k, kNotes, sizeof(*note_ptrs));
    size_t n = 0;
    bool degraded = false;
    for (size_t i = 0; i < kNotes; i++)
        note_ptrs[i] = notes + i * kNoteBytes;
    if (st.l3_readonly) {
        snprintf(note_ptrs[n++], kNoteBytes, "l3 read-only after write errors (%" PRIu64 " I/O errors)",
                 st.io_errors);
        degraded = true;
    } else if (st.io_errors) {
        snprintf(note_ptrs[n++], kNoteBytes, "%" PRIu64 " I/O errors so far", st.io_errors);
    }
    if (st.checksum_failures)
        snprintf(note_ptrs[n++], kNoteBytes, "%" PRIu64 " blocks dropped on checksum failure",
                 st.checksum_failures);
    if (!svc->cfg->l3_enabled)
        snprintf(note_ptrs[n++], kNoteBytes, "l3 off by configuration");
    else
        snprintf(note_ptrs[n++], kNoteBytes, "l3 io: %s",
                 st.l3_io_mode == TKV_IO_URING ? "io_uring" : "pread/pwrite");
    rsp->status = atomic_load(&svc->stopping) ? "stopping" : degraded ? "degraded" : "serving";
    rsp->version = (char *)svc->version;
    rsp->n_notes = n;
    rsp->notes = note_ptrs;
}

/* ---- Evict / Flush / Verify ---------------------------------------------------------------------- */

static bool v_evict(tkvd_call *k, const void *req)
{
    const Tierkv__V1__EvictRequest *rq = req;
    int tier = (int)rq->tier;
    if (tier == TKV_TIER_L1 && !has_l1(k->svc))
        return fail_with(k, GRPC_STATUS_UNIMPLEMENTED, "evict: this daemon has no GPU (L1) tier");
    if (tier != TKV_TIER_L1 && tier != TKV_TIER_L2 && tier != TKV_TIER_L3)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "evict: tier must be TIER_L1, TIER_L2 or "
                         "TIER_L3, not %d", tier);
    if (tier == TKV_TIER_L3 && !k->svc->cfg->l3_enabled)
        return fail_with(k, GRPC_STATUS_FAILED_PRECONDITION, "evict: l3 is off in this daemon");
    if (rq->n_tokens > 0 && !rq->scope)
        return check_scope(k, rq->scope); /* fails: tokens are read in a scope */
    if (k->tenant && rq->n_tokens == 0 && !k->tenant->admin)
        return deny(k, GRPC_STATUS_PERMISSION_DENIED,
                    "evict: without tokens it acts on every tenant's blocks; tenant %s is not an "
                    "admin tenant (name the prompt whose blocks to evict)", k->tenant->name);
    uint32_t P = k->svc->cfg->geometry.block_tokens;
    if (rq->n_tokens > 0 && rq->n_tokens / P == 0)
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "evict: %zu tokens hold no full block of %u",
                         rq->n_tokens, P);
    return true;
}

static void h_evict(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__EvictRequest *rq = req;
    Tierkv__V1__EvictResponse *rsp = out;
    int tier = (int)rq->tier;
    size_t num_keys = rq->n_tokens / k->svc->cfg->geometry.block_tokens;
    tkv_key *keys = num_keys ? derive_keys(k, rq->tokens, num_keys) : NULL;
    size_t evicted = 0, pinned = 0;
    int rc = tkv_store_evict(k->svc->store, tier, keys, num_keys, &evicted, &pinned);
    if (!store_ok(k, rc, "evict"))
        return;
    TKV_LOG(TKV_LOG_INFO, "evict %s: %zu blocks out, %zu pinned", tier_name(tier), evicted, pinned);
    rsp->num_evicted = (uint32_t)evicted;
    rsp->num_pinned = (uint32_t)pinned;
}

static void h_flush(tkvd_call *k, const void *req, void *out)
{
    (void)req;
    (void)out;
    store_ok(k, tkv_store_flush(k->svc->store), "flush");
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

static void h_verify(tkvd_call *k, const void *req, void *out)
{
    (void)req;
    (void)out;
    verify_ctx vc = {.st = k->stream, .last_ns = tkv_now_ns()};
    uint64_t checked = 0, bad = 0;
    if (!store_ok(k, tkv_store_verify(k->svc->store, verify_progress, &vc, &checked, &bad), "verify"))
        return;
    if (bad)
        TKV_LOG(TKV_LOG_WARN, "verify: %" PRIu64 " of %" PRIu64 " blocks failed their checksum "
                "and were dropped", bad, checked);
    if (!send_progress(&vc, checked, checked, bad))
        fail_with(k, GRPC_STATUS_CANCELLED, "verify: client went away");
}

void tkvd_service_abort_waits(void *ctx)
{
    tkvd_service *svc = ctx;
    atomic_store(&svc->abort_waits, true);
}

/* ---- cost check ------------------------------------------------------------------------------ */

static bool v_cost_check(tkvd_call *k, const void *req)
{
    const Tierkv__V1__CostCheckRequest *rq = req;
    if (!(rq->prefill_ms >= 0) || rq->prefill_ms > 1e9) /* also refuses NaN */
        return fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "cost_check: prefill_ms %g not in [0, 1e9]",
                         rq->prefill_ms);
    if (!check_owned(k, rq->lease_id, 0, "cost_check"))
        return false;
    return (int)rq->tier == TKV_TIER_NONE || target_tier(k, rq->tier, "cost_check") >= 0;
}

static void h_cost_check(tkvd_call *k, const void *req, void *out)
{
    const Tierkv__V1__CostCheckRequest *rq = req;
    Tierkv__V1__CostCheckResponse *rsp = out;
    tkvd_service *svc = k->svc;
    int tier = (int)rq->tier == TKV_TIER_NONE ? (has_l1(svc) ? TKV_TIER_L1 : TKV_TIER_L2)
                                              : target_tier(k, rq->tier, "cost_check");
    tkv_block_loc *locs;
    size_t n = 0;
    if (!lease_locs(k, rq->lease_id, "cost_check", &locs, &n))
        return;
    tkvd_cost cost = tkvd_cost_estimate(&svc->rates, locs, n, tier, tkv_store_block_bytes(svc->store));
    rsp->restore_ms = cost.restore_ms;
    rsp->use_cache = cost.restore_ms < rq->prefill_ms;
    rsp->blocks_in_tier = cost.in_tier;
    rsp->blocks_from_l2 = cost.from_l2;
    rsp->blocks_from_l3 = cost.from_l3;
    rsp->pcie_gbps = cost.pcie_gbps;
    rsp->l3_read_gbps = cost.l3_read_gbps;
}

/* ==== the table, the dispatcher and the gRPC adapter ============================================ */

enum {
    kScope = 1,         /* the request has a required `scope`: checked and bound first */
    kScopeIfSet = 2,    /* an optional `scope`: checked and bound when present */
    kBlocking = 4,      /* may wait for I/O or the store's write-back (gRPC: worker pool) */
    kStream = 8,        /* server-streaming (gRPC only); no reply message */
};

typedef struct handler {
    const char *path;                              /* gRPC method path */
    const ProtobufCMessageDescriptor *req, *rsp;   /* rsp NULL for streams */
    bool (*validate)(tkvd_call *k, const void *req); /* NULL: nothing beyond the scope */
    void (*run)(tkvd_call *k, const void *req, void *rsp);
    unsigned flags;
    uint32_t fast_op;                              /* TKV_FAST_* id, 0 = gRPC only */
} handler;

#define M(name) "/tierkv.v1.Cache/" name
#define D(type) &tierkv__v1__##type##__descriptor
static const handler kHandlers[] = {
    {M("Lookup"), D(lookup_request), D(lookup_response), NULL, h_lookup, kScope, TKV_FAST_LOOKUP},
    {M("LookupBatch"), D(lookup_batch_request), D(lookup_batch_response), v_lookup_batch,
     h_lookup_batch, kScope, TKV_FAST_LOOKUP_BATCH},
    {M("Prefetch"), D(prefetch_request), D(prefetch_response), v_prefetch, h_prefetch, kBlocking,
     TKV_FAST_PREFETCH},
    {M("Put"), D(put_request), D(put_response), v_put, h_put, kScope | kBlocking, TKV_FAST_PUT},
    {M("Get"), D(get_request), D(get_response), v_get, h_get, kBlocking, 0},
    {M("Alloc"), D(alloc_request), D(alloc_response), v_alloc, h_alloc, kScope | kBlocking,
     TKV_FAST_ALLOC},
    {M("WriteSlot"), D(write_slot_request), D(write_slot_response), v_write_slot, h_write_slot, 0,
     TKV_FAST_WRITE_SLOT},
    {M("Commit"), D(commit_request), D(commit_response), v_commit, h_commit, kScope | kBlocking,
     TKV_FAST_COMMIT},
    {M("Release"), D(release_request), D(release_response), v_release, h_release, 0, TKV_FAST_RELEASE},
    {M("Stats"), D(stats_request), D(stats_response), NULL, h_stats, 0, 0},
    {M("ListBlocks"), D(list_blocks_request), D(list_blocks_response), v_list_blocks, h_list_blocks,
     kBlocking, 0},
    {M("Evict"), D(evict_request), D(evict_response), v_evict, h_evict, kScopeIfSet | kBlocking, 0},
    {M("Flush"), D(flush_request), D(flush_response), NULL, h_flush, kBlocking, 0},
    {M("Verify"), D(verify_request), NULL, NULL, h_verify, kStream | kBlocking, 0},
    {M("Health"), D(health_request), D(health_response), NULL, h_health, 0, 0},
    {M("CostCheck"), D(cost_check_request), D(cost_check_response), v_cost_check, h_cost_check, 0, 0},
};
#undef M
#undef D
#define kNumHandlers (sizeof(kHandlers) / sizeof(kHandlers[0]))

int tkvd_service_fast_method(uint32_t op)
{
    for (size_t i = 0; op && i < kNumHandlers; i++)
        if (kHandlers[i].fast_op == op)
            return (int)i;
    return -1;
}

/* The request's `scope` field, when its message type has one. */
static const Tierkv__V1__BlockScope *request_scope(const handler *h, const ProtobufCMessage *rq)
{
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field_by_name(h->req, "scope");
    if (!f)
        return NULL;
    return *(const Tierkv__V1__BlockScope *const *)((const uint8_t *)rq + f->offset);
}

/* Every request with a `tokens` field holds one prompt of at most max_prompt_tokens. */
static bool check_request_tokens(tkvd_call *k, const handler *h, const ProtobufCMessage *rq)
{
    const ProtobufCFieldDescriptor *f = protobuf_c_message_descriptor_get_field_by_name(h->req, "tokens");
    if (!f)
        return true;
    return check_tokens(k, *(const size_t *)((const uint8_t *)rq + f->quantifier_offset));
}

void tkvd_service_call(tkvd_service *svc, tkvd_call *k, int method, const ProtobufCMessage *rq,
                       uint8_t **rsp, size_t *rsp_len)
{
    TKV_ASSERT(method >= 0 && (size_t)method < kNumHandlers);
    const handler *h = &kHandlers[method];
    TKV_ASSERT(rq->descriptor == h->req);
    k->svc = svc;
    k->code = GRPC_STATUS_OK;
    *rsp = NULL;
    *rsp_len = 0;
    /* Admitted once per call: tkvd_service_dispatch already did before parsing. */
    if (!k->tenant && !admit(k, h->path))
        return;
    const Tierkv__V1__BlockScope *scope = request_scope(h, rq);
    bool scoped = (h->flags & kScope) || ((h->flags & kScopeIfSet) && scope);
    if (scoped && check_scope(k, scope))
        bind_scope(k, scope);
    if (k->code == GRPC_STATUS_OK && check_request_tokens(k, h, rq) &&
        (!h->validate || h->validate(k, rq))) {
        ProtobufCMessage *out = NULL;
        if (h->rsp) {
            out = call_alloc(k, 1, h->rsp->sizeof_message);
            protobuf_c_message_init(h->rsp, out);
        }
        h->run(k, rq, out);
        if (k->code == GRPC_STATUS_OK && out && k->lean_reply) {
            size_t n = tkv_fast_lean_reply_size(out);
            TKV_ASSERT(n > 0); /* a lookup's reply within the limits the validators enforce */
            *rsp = tkv_xmalloc(n);
            tkv_fast_lean_reply_encode(out, *rsp);
            *rsp_len = n;
        } else if (k->code == GRPC_STATUS_OK && out) {
            size_t n = protobuf_c_message_get_packed_size(out);
            *rsp = tkv_xmalloc(n ? n : 1);
            *rsp_len = protobuf_c_message_pack(out, *rsp);
        }
    }
    for (size_t i = 0; i < k->num_scratch; i++)
        free(k->scratch[i]);
    free(k->scratch);
    k->scratch = NULL;
    k->num_scratch = k->cap_scratch = 0;
}

void tkvd_service_dispatch(tkvd_service *svc, tkvd_call *k, int method, const uint8_t *req,
                           size_t len, uint8_t **rsp, size_t *rsp_len)
{
    TKV_ASSERT(method >= 0 && (size_t)method < kNumHandlers);
    const handler *h = &kHandlers[method];
    *rsp = NULL;
    *rsp_len = 0;
    k->svc = svc;
    /* Admission before parsing: a caller that is no tenant learns nothing, not even whether
     * its bytes were a valid message. */
    if (!admit(k, h->path))
        return;
    ProtobufCMessage *rq = protobuf_c_message_unpack(h->req, NULL, len, req);
    if (!rq) {
        k->svc = svc;
        fail_with(k, GRPC_STATUS_INVALID_ARGUMENT, "malformed %s: %zu bytes are not a valid "
                  "protobuf message", h->req->short_name, len);
        return;
    }
    tkvd_service_call(svc, k, method, rq, rsp, rsp_len);
    protobuf_c_message_free_unpacked(rq, NULL);
}

/* gRPC: the call's peer as the server saw it, then the one dispatch. */
static void grpc_dispatch(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                          tkvd_stream *st, tkvd_reply *out)
{
    tkvd_call k;
    memset(&k, 0, sizeof(k));
    k.timeout_ms = ci->timeout_ms;
    k.stream = st;
    k.peer.kind = ci->is_unix ? TKVD_PEER_GRPC_UNIX : TKVD_PEER_GRPC_TCP;
    memcpy(k.peer.addr, ci->peer, sizeof(k.peer.addr));
    memcpy(k.peer.tls_subject, ci->tls_subject, sizeof(k.peer.tls_subject));
    memcpy(k.peer.token, ci->token, sizeof(k.peer.token));
    k.peer.has_cred = ci->has_cred;
    k.peer.uid = ci->uid;
    k.peer.gid = ci->gid;
    k.peer.pid = ci->pid;
    int method = (int)((const handler *)ci->arg - kHandlers);
    tkvd_service_dispatch(ctx, &k, method, req, len, &out->buf, &out->len);
    out->code = k.code;
    memcpy(out->msg, k.msg, sizeof(out->msg));
}

static void grpc_unary(void *ctx, const tkvd_call_info *ci, const uint8_t *req, size_t len,
                       tkvd_reply *out)
{
    grpc_dispatch(ctx, ci, req, len, NULL, out);
}

static tkvd_method kMethods[kNumHandlers];
static pthread_once_t kMethodsOnce = PTHREAD_ONCE_INIT;

static void build_methods(void)
{
    for (size_t i = 0; i < kNumHandlers; i++) {
        const handler *h = &kHandlers[i];
        bool stream = h->flags & kStream;
        kMethods[i] = (tkvd_method){h->path, stream ? NULL : grpc_unary,
                                    stream ? grpc_dispatch : NULL, (h->flags & kBlocking) != 0, h};
    }
}

const tkvd_method *tkvd_service_methods(size_t *num_methods)
{
    pthread_once(&kMethodsOnce, build_methods);
    *num_methods = kNumHandlers;
    return kMethods;
}

/* The largest legal request is a Put of max_blocks_per_rpc blocks with a prompt of
 * max_prompt_tokens tokens, or a LookupBatch of kBatchTokenFactor times that many tokens
 * (5 bytes per varint token at most), plus framing; a larger message
 * cannot be valid, so the transport refuses it (RESOURCE_EXHAUSTED) before parsing. */
size_t tkvd_service_max_recv_bytes(const tkvd_config *cfg)
{
    uint64_t put = (uint64_t)cfg->max_blocks_per_rpc * (cfg->block_bytes + 16) +
                   (uint64_t)cfg->max_prompt_tokens * 5 + 4096;
    uint64_t batch = (uint64_t)kBatchTokenFactor * cfg->max_prompt_tokens * 5 +
                     (uint64_t)kMaxBatchPrompts * 8 + 4096;
    uint64_t n = put > batch ? put : batch;
    return n > INT32_MAX ? INT32_MAX : (size_t)n;
}

/* The largest reply is a Get of max_blocks_per_rpc blocks, a ListBlocks of kListMax entries
 * (~110 bytes each) or a LookupBatch's locations (~30 bytes per block). */
size_t tkvd_service_max_send_bytes(const tkvd_config *cfg)
{
    uint64_t get = (uint64_t)cfg->max_blocks_per_rpc * (cfg->block_bytes + 16) + 4096;
    uint64_t list = (uint64_t)kListMax * 128 + 4096;
    uint64_t batch = (uint64_t)kBatchTokenFactor * cfg->max_prompt_tokens /
                     cfg->geometry.block_tokens * 32 + (uint64_t)kMaxBatchPrompts * 32 + 4096;
    uint64_t n = get > list ? get : list;
    n = n > batch ? n : batch;
    return n > INT32_MAX ? INT32_MAX : (size_t)n;
}
