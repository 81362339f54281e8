/* tkvd_tenant.h - tenants: who may act as which namespace, from the peer's proven identity.
 *
 * A tenant is a name (which is also the namespace salt of every key it derives, so two
 * tenants never share a key) and the identities that may act as it: UNIX peers by uid or gid
 * (SO_PEERCRED, which the kernel fills in and the peer cannot forge), TCP peers by the subject
 * of a client certificate the TLS handshake verified, or a bearer token (kept only as its
 * SHA-256, compared in constant time). Configured by `tenant.<name>.<field> = value` lines
 * (docs/config.md). With no tenant configured the daemon serves one default tenant whose
 * namespace is whatever the request names -- the single-user behaviour of `make demo`.
 *
 * Thread safety: built by the config before any thread starts, read-only afterwards; every
 * lookup here is pure.
 */
#ifndef TKVD_TENANT_H
#define TKVD_TENANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <sys/types.h>

#define TKVD_TENANT_MAX 64          /* tenants per daemon */
#define TKVD_TENANT_NAME_MAX 63     /* bytes of a name ([A-Za-z0-9_.-]) */
#define TKVD_TENANT_IDS_MAX 64      /* uids, gids, subjects or tokens per tenant, each */
#define TKVD_TOKEN_HASH_BYTES 32

typedef struct tkvd_tenant {
    char name[TKVD_TENANT_NAME_MAX + 1];
    uint32_t index;                 /* position in the table, 0-based; stable for the life */
    uint32_t uids[TKVD_TENANT_IDS_MAX], gids[TKVD_TENANT_IDS_MAX];
    size_t num_uids, num_gids;
    char *subjects[TKVD_TENANT_IDS_MAX];     /* TLS client-certificate subjects, exact match */
    size_t num_subjects;
    uint8_t tokens[TKVD_TENANT_IDS_MAX][TKVD_TOKEN_HASH_BYTES]; /* SHA-256 of bearer tokens */
    size_t num_tokens;
    bool admin;         /* may list, flush, verify and evict every tenant's blocks */
    bool map_pool;      /* its engines are trusted with its L1 blocks: they may map its own L1
                         * region (CUDA IPC maps read-write) and place blocks in L1 */
    /* quota_lN_blocks / guaranteed_lN_blocks, by tier N (index 0 unused):
     *   L1, L2: the size of its own region (0 = an equal share of what the quotas leave);
     *           a guarantee is accepted up to the region (the region is all its own);
     *   L3:     the most blocks it may hold (0 = no limit), and the blocks no other tenant's
     *           load evicts (0 = none);
     *   L4:     the most blocks it may put into L4 from this daemon (0 = no limit); no
     *           guarantee (always 0): the cluster evicts. */
    uint64_t quota[5], guaranteed[5];
} tkvd_tenant;

/* The tenant id of its blocks in the store (tkv_store_put_as): index + 1, 0 = no tenant. */
static inline unsigned tkvd_tenant_store_id(const tkvd_tenant *t)
{
    return t ? t->index + 1 : 0;
}

typedef struct tkvd_tenants {
    tkvd_tenant *v[TKVD_TENANT_MAX];
    size_t n;
} tkvd_tenants;

/* How a caller proved who it is (filled by the transport; fields not proven stay unset). */
typedef struct tkvd_identity {
    bool has_ucred;                 /* a UNIX peer: SO_PEERCRED */
    uid_t uid;
    gid_t gid;
    pid_t pid;
    const char *tls_subject;        /* verified client certificate's subject, or NULL */
    const char *token;              /* bearer token the call presented, or NULL */
    size_t token_len;
} tkvd_identity;

/* Owner ids (leases, allocations, attach client ids) carry their tenant in the top byte, so
 * an id one tenant learnt or guessed is refused for another: tag = (index + 1) << 56. */
#define TKVD_OWNER_TAG_SHIFT 56
static inline uint64_t tkvd_tenant_tag(const tkvd_tenant *t)
{
    return t ? (uint64_t)(t->index + 1) << TKVD_OWNER_TAG_SHIFT : 0;
}
static inline bool tkvd_tenant_owns(const tkvd_tenant *t, uint64_t owner)
{
    return (owner >> TKVD_OWNER_TAG_SHIFT) == (t ? (uint64_t)t->index + 1 : 0);
}

void tkvd_tenants_free(tkvd_tenants *t);

/* Sets `field` of tenant `name` (created on first mention) from text; uid, gid, tls_subject
 * and token_sha256 append, admin and map_pool are booleans (uid and gid also take comma-separated lists). origin prefixes the
 * message in err. TKV_OK or TKV_EINVAL. */
int tkvd_tenants_set(tkvd_tenants *t, const char *name, const char *field, const char *value,
                     const char *origin, char *err, size_t err_len);

/* Whole-table checks: a guaranteed share fits within the tenant's quota; every tenant names
 * at least one identity; no uid, subject or token
 * belongs to two tenants (gids may overlap: a uid match wins, then the first tenant by
 * gid). TKV_OK or TKV_EINVAL. */
int tkvd_tenants_finish(const tkvd_tenants *t, char *err, size_t err_len);

/* Each tenant's own L2 region in blocks (regions[i] for tenant v[i]): its quota_l2_blocks,
 * else an equal share of what the quotas leave of l2_blocks. TKV_EINVAL (said in err) when
 * the quotas exceed L2, a share is 0, or a guarantee exceeds its region. */
int tkvd_tenants_l2_regions(const tkvd_tenants *t, uint64_t l2_blocks, uint64_t *regions,
                            char *err, size_t err_len);
/* The same for L1 (quota_l1_blocks, guaranteed_l1_blocks), where the daemon has a GPU tier
 * of l1_blocks. */
int tkvd_tenants_l1_regions(const tkvd_tenants *t, uint64_t l1_blocks, uint64_t *regions,
                            char *err, size_t err_len);

/* True when tenants are configured (namespaces are then derived, never taken from requests). */
static inline bool tkvd_tenants_enabled(const tkvd_tenants *t)
{
    return t && t->n > 0;
}

/* The tenant the peer proved to be, or NULL (refuse the call). Order: bearer token, TLS
 * subject, uid, gid. A token that matches no tenant yields NULL even if another identity
 * would match: a wrong credential is never silently ignored. */
const tkvd_tenant *tkvd_tenant_of_peer(const tkvd_tenants *t, const tkvd_identity *peer);

const tkvd_tenant *tkvd_tenant_by_name(const tkvd_tenants *t, const char *name);

/* SHA-256 of a token (what token_sha256 holds). */
void tkvd_token_hash(const void *token, size_t len, uint8_t out[TKVD_TOKEN_HASH_BYTES]);

/* Prints the table as config lines (tokens as their hashes). */
void tkvd_tenants_print(const tkvd_tenants *t, FILE *f);

#endif
