/* tenant.c - the tenant table and peer-to-tenant mapping (see tkvd_tenant.h). */
#include "tkvd_tenant.h"

#include <ctype.h>
#include <errno.h>
#include <stdarg.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include <openssl/evp.h>

#include "tkv_base.h"

static void set_err(char *err, size_t len, const char *fmt, ...) __attribute__((format(printf, 3, 4)));
static void set_err(char *err, size_t len, const char *fmt, ...)
{
    if (!err || !len)
        return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, len, fmt, ap);
    va_end(ap);
}

void tkvd_token_hash(const void *token, size_t len, uint8_t out[TKVD_TOKEN_HASH_BYTES])
{
    unsigned int n = 0;
    int ok = EVP_Digest(token, len, out, &n, EVP_sha256(), NULL);
    TKV_ASSERT(ok && n == TKVD_TOKEN_HASH_BYTES);
}

void tkvd_tenants_free(tkvd_tenants *t)
{
    for (size_t i = 0; i < t->n; i++) {
        for (size_t j = 0; j < t->v[i]->num_subjects; j++)
            free(t->v[i]->subjects[j]);
        free(t->v[i]);
    }
    t->n = 0;
}

static bool name_ok(const char *s)
{
    size_t n = strlen(s);
    if (n == 0 || n > TKVD_TENANT_NAME_MAX)
        return false;
    for (size_t i = 0; i < n; i++)
        if (!isalnum((unsigned char)s[i]) && s[i] != '_' && s[i] != '-' && s[i] != '.')
            return false;
    return true;
}

const tkvd_tenant *tkvd_tenant_by_name(const tkvd_tenants *t, const char *name)
{
    for (size_t i = 0; t && i < t->n; i++)
        if (strcmp(t->v[i]->name, name) == 0)
            return t->v[i];
    return NULL;
}

/* A decimal u32 id list "1000, 1001". Appends to ids; false on a bad item or overflow. */
static bool parse_ids(const char *value, uint32_t *ids, size_t *num, char *why, size_t why_len)
{
    const char *p = value;
    if (!*p) {
        snprintf(why, why_len, "empty list");
        return false;
    }
    for (;;) {
        while (*p == ' ' || *p == '\t')
            p++;
        if (!isdigit((unsigned char)*p)) {
            snprintf(why, why_len, "'%s' is not a list of decimal ids", value);
            return false;
        }
        errno = 0;
        char *end;
        unsigned long long v = strtoull(p, &end, 10);
        /* (uid_t)-1 means "no id" to the kernel: never a peer's id. */
        if (errno || v >= UINT32_MAX) {
            snprintf(why, why_len, "id out of range in '%s'", value);
            return false;
        }
        if (*num >= TKVD_TENANT_IDS_MAX) {
            snprintf(why, why_len, "more than %d ids", TKVD_TENANT_IDS_MAX);
            return false;
        }
        ids[(*num)++] = (uint32_t)v;
        p = end;
        while (*p == ' ' || *p == '\t')
            p++;
        if (!*p)
            return true;
        if (*p != ',') {
            snprintf(why, why_len, "'%s' is not a list of decimal ids", value);
            return false;
        }
        p++;
    }
}

static int hexval(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    c = (char)tolower((unsigned char)c);
    return c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;
}

/* The tier N of a block-count field, "quota_lN_blocks" (N 1..4, *is_quota) or
 * "guaranteed_lN_blocks" (N 1..3: L4 has no guarantee, the cluster evicts); 0 for any other. */
static int count_field(const char *field, bool *is_quota)
{
    *is_quota = strncmp(field, "quota_l", 7) == 0;
    const char *rest = *is_quota ? field + 7
                       : strncmp(field, "guaranteed_l", 12) == 0 ? field + 12 : NULL;
    if (!rest || rest[0] < '1' || rest[0] > (*is_quota ? '4' : '3') ||
        strcmp(rest + 1, "_blocks") != 0)
        return 0;
    return rest[0] - '0';
}

int tkvd_tenants_set(tkvd_tenants *t, const char *name, const char *field, const char *value,
                     const char *origin, char *err, size_t err_len)
{
    if (!name_ok(name)) {
        set_err(err, err_len, "%s: tenant name '%s': 1..%d characters of A-Z a-z 0-9 _ - .",
                origin, name, TKVD_TENANT_NAME_MAX);
        return TKV_EINVAL;
    }
    tkvd_tenant *tn = (tkvd_tenant *)tkvd_tenant_by_name(t, name);
    bool fresh = false;
    if (!tn) {
        if (t->n >= TKVD_TENANT_MAX) {
            set_err(err, err_len, "%s: more than %d tenants", origin, TKVD_TENANT_MAX);
            return TKV_EINVAL;
        }
        tn = tkv_xcalloc(1, sizeof(*tn));
        memcpy(tn->name, name, strlen(name) + 1);
        tn->index = (uint32_t)t->n;
        fresh = true;
    }
    char why[256] = "";
    int rc = TKV_EINVAL, tier;
    bool is_quota;
    if (strcmp(field, "uid") == 0) {
        if (!parse_ids(value, tn->uids, &tn->num_uids, why, sizeof(why)))
            goto bad;
    } else if (strcmp(field, "gid") == 0) {
        if (!parse_ids(value, tn->gids, &tn->num_gids, why, sizeof(why)))
            goto bad;
    } else if (strcmp(field, "tls_subject") == 0) {
        if (!*value) {
            snprintf(why, sizeof(why), "must not be empty");
            goto bad;
        }
        if (tn->num_subjects >= TKVD_TENANT_IDS_MAX) {
            snprintf(why, sizeof(why), "more than %d subjects", TKVD_TENANT_IDS_MAX);
            goto bad;
        }
        tn->subjects[tn->num_subjects++] = tkv_xstrdup(value);
    } else if (strcmp(field, "token_sha256") == 0) {
        if (strlen(value) != 2 * TKVD_TOKEN_HASH_BYTES) {
            snprintf(why, sizeof(why), "expected %d hex digits (sha256sum of the token), got %zu "
                     "characters", 2 * TKVD_TOKEN_HASH_BYTES, strlen(value));
            goto bad;
        }
        if (tn->num_tokens >= TKVD_TENANT_IDS_MAX) {
            snprintf(why, sizeof(why), "more than %d tokens", TKVD_TENANT_IDS_MAX);
            goto bad;
        }
        uint8_t *h = tn->tokens[tn->num_tokens];
        for (int i = 0; i < TKVD_TOKEN_HASH_BYTES; i++) {
            int hi = hexval(value[2 * i]), lo = hexval(value[2 * i + 1]);
            if (hi < 0 || lo < 0) {
                snprintf(why, sizeof(why), "'%s' is not hex", value);
                goto bad;
            }
            h[i] = (uint8_t)(hi << 4 | lo);
        }
        tn->num_tokens++;
    } else if (strcmp(field, "admin") == 0 || strcmp(field, "map_pool") == 0) {
        bool *slot = field[0] == 'a' ? &tn->admin : &tn->map_pool;
        if (!strcasecmp(value, "on") || !strcasecmp(value, "true") || !strcmp(value, "1") ||
            !strcasecmp(value, "yes"))
            *slot = true;
        else if (!strcasecmp(value, "off") || !strcasecmp(value, "false") || !strcmp(value, "0") ||
                 !strcasecmp(value, "no"))
            *slot = false;
        else {
            snprintf(why, sizeof(why), "'%s' is not a boolean (on/off)", value);
            goto bad;
        }
    } else if ((tier = count_field(field, &is_quota)) != 0) {
        uint64_t *slot = is_quota ? &tn->quota[tier] : &tn->guaranteed[tier];
        errno = 0;
        char *end = NULL;
        unsigned long long v = isdigit((unsigned char)value[0]) ? strtoull(value, &end, 10) : 0;
        if (!end || *end || errno || v > (1ull << 40)) {
            snprintf(why, sizeof(why), "'%s' is not a block count (decimal, at most 2^40)", value);
            goto bad;
        }
        *slot = v;
    } else {
        snprintf(why, sizeof(why), "unknown tenant field '%s' (uid, gid, tls_subject, "
                 "token_sha256, admin, map_pool, quota_l1_blocks, guaranteed_l1_blocks, "
                 "quota_l2_blocks, guaranteed_l2_blocks, quota_l3_blocks, guaranteed_l3_blocks, "
                 "quota_l4_blocks)", field);
        goto bad;
    }
    if (fresh)
        t->v[t->n++] = tn;
    return TKV_OK;
bad:
    set_err(err, err_len, "%s: tenant.%s.%s: %s", origin, name, field, why);
    if (fresh)
        free(tn);
    return rc;
}

int tkvd_tenants_finish(const tkvd_tenants *t, char *err, size_t err_len)
{
    for (size_t i = 0; i < t->n; i++) {
        const tkvd_tenant *a = t->v[i];
        for (int tier = 1; tier <= 3; tier++)
            if (a->quota[tier] && a->guaranteed[tier] > a->quota[tier]) {
                set_err(err, err_len, "tenant.%s: guaranteed_l%d_blocks %llu exceeds its "
                        "quota_l%d_blocks %llu", a->name, tier,
                        (unsigned long long)a->guaranteed[tier], tier,
                        (unsigned long long)a->quota[tier]);
                return TKV_EINVAL;
            }
        if (!a->num_uids && !a->num_gids && !a->num_subjects && !a->num_tokens) {
            set_err(err, err_len, "tenant.%s: names no identity (uid, gid, tls_subject or "
                    "token_sha256): nobody could act as it", a->name);
            return TKV_EINVAL;
        }
        for (size_t j = i + 1; j < t->n; j++) {
            const tkvd_tenant *b = t->v[j];
            for (size_t x = 0; x < a->num_uids; x++)
                for (size_t y = 0; y < b->num_uids; y++)
                    if (a->uids[x] == b->uids[y]) {
                        set_err(err, err_len, "uid %u belongs to tenants %s and %s", a->uids[x],
                                a->name, b->name);
                        return TKV_EINVAL;
                    }
            for (size_t x = 0; x < a->num_subjects; x++)
                for (size_t y = 0; y < b->num_subjects; y++)
                    if (strcmp(a->subjects[x], b->subjects[y]) == 0) {
                        set_err(err, err_len, "tls_subject '%s' belongs to tenants %s and %s",
                                a->subjects[x], a->name, b->name);
                        return TKV_EINVAL;
                    }
            for (size_t x = 0; x < a->num_tokens; x++)
                for (size_t y = 0; y < b->num_tokens; y++)
                    if (memcmp(a->tokens[x], b->tokens[y], TKVD_TOKEN_HASH_BYTES) == 0) {
                        set_err(err, err_len, "one token_sha256 belongs to tenants %s and %s",
                                a->name, b->name);
                        return TKV_EINVAL;
                    }
        }
    }
    return TKV_OK;
}

/* Each tenant's own region of tier `tier` (1 or 2) in blocks: its quota, else an equal share
 * of what the quotas leave of total_blocks. */
static int tier_regions(const tkvd_tenants *t, int tier, uint64_t total_blocks,
                        uint64_t *regions, char *err, size_t err_len)
{
    const char *what = tier == 1 ? "L1" : "L2";
    const char *raise = tier == 1 ? "l1_bytes" : "l2_bytes";
    uint64_t fixed = 0;
    size_t num_rest = 0;
    for (size_t i = 0; i < t->n; i++) {
        uint64_t q = t->v[i]->quota[tier];
        fixed += q;
        num_rest += q == 0;
    }
    if (fixed > total_blocks) {
        set_err(err, err_len, "the tenants' quota_l%d_blocks add up to %llu blocks, more than %s "
                "holds (%llu): each tenant's quota is an %s region of its own", tier,
                (unsigned long long)fixed, what, (unsigned long long)total_blocks, what);
        return TKV_EINVAL;
    }
    uint64_t share = num_rest ? (total_blocks - fixed) / num_rest : 0;
    for (size_t i = 0; i < t->n; i++) {
        const tkvd_tenant *a = t->v[i];
        uint64_t q = a->quota[tier], g = a->guaranteed[tier];
        regions[i] = q ? q : share;
        if (regions[i] == 0) {
            set_err(err, err_len, "tenant.%s: no %s left for its region (%s %llu blocks, the "
                    "quotas take %llu): raise %s or give it a quota_l%d_blocks", a->name, what,
                    what, (unsigned long long)total_blocks, (unsigned long long)fixed, raise,
                    tier);
            return TKV_EINVAL;
        }
        if (g > regions[i]) {
            set_err(err, err_len, "tenant.%s: guaranteed_l%d_blocks %llu exceeds its %s region "
                    "(%llu blocks)", a->name, tier, (unsigned long long)g, what,
                    (unsigned long long)regions[i]);
            return TKV_EINVAL;
        }
    }
    return TKV_OK;
}

int tkvd_tenants_l2_regions(const tkvd_tenants *t, uint64_t l2_blocks, uint64_t *regions,
                            char *err, size_t err_len)
{
    return tier_regions(t, 2, l2_blocks, regions, err, err_len);
}

int tkvd_tenants_l1_regions(const tkvd_tenants *t, uint64_t l1_blocks, uint64_t *regions,
                            char *err, size_t err_len)
{
    return tier_regions(t, 1, l1_blocks, regions, err, err_len);
}

/* Constant time in the hash bytes, so response times do not reveal how much of a guess
 * matched a stored hash. */
static bool hash_eq(const uint8_t *a, const uint8_t *b)
{
    uint8_t d = 0;
    for (int i = 0; i < TKVD_TOKEN_HASH_BYTES; i++)
        d |= a[i] ^ b[i];
    return d == 0;
}

const tkvd_tenant *tkvd_tenant_of_peer(const tkvd_tenants *t, const tkvd_identity *peer)
{
    if (!t || !peer)
        return NULL;
    if (peer->token) {
        uint8_t h[TKVD_TOKEN_HASH_BYTES];
        tkvd_token_hash(peer->token, peer->token_len, h);
        const tkvd_tenant *found = NULL;
        /* Every stored hash is compared, a match or not: the time does not depend on which
         * tenant (if any) the token belongs to. */
        for (size_t i = 0; i < t->n; i++)
            for (size_t j = 0; j < t->v[i]->num_tokens; j++)
                if (hash_eq(h, t->v[i]->tokens[j]) && !found)
                    found = t->v[i];
        return found;
    }
    if (peer->tls_subject) {
        for (size_t i = 0; i < t->n; i++)
            for (size_t j = 0; j < t->v[i]->num_subjects; j++)
                if (strcmp(peer->tls_subject, t->v[i]->subjects[j]) == 0)
                    return t->v[i];
    }
    if (peer->has_ucred) {
        for (size_t i = 0; i < t->n; i++)
            for (size_t j = 0; j < t->v[i]->num_uids; j++)
                if (t->v[i]->uids[j] == (uint32_t)peer->uid)
                    return t->v[i];
        for (size_t i = 0; i < t->n; i++)
            for (size_t j = 0; j < t->v[i]->num_gids; j++)
                if (t->v[i]->gids[j] == (uint32_t)peer->gid)
                    return t->v[i];
    }
    return NULL;
}

void tkvd_tenants_print(const tkvd_tenants *t, FILE *f)
{
    for (size_t i = 0; i < t->n; i++) {
        const tkvd_tenant *a = t->v[i];
        for (size_t j = 0; j < a->num_uids; j++)
            fprintf(f, "tenant.%s.uid = %u\n", a->name, a->uids[j]);
        for (size_t j = 0; j < a->num_gids; j++)
            fprintf(f, "tenant.%s.gid = %u\n", a->name, a->gids[j]);
        for (size_t j = 0; j < a->num_subjects; j++)
            fprintf(f, "tenant.%s.tls_subject = \"%s\"\n", a->name, a->subjects[j]);
        if (a->admin)
            fprintf(f, "tenant.%s.admin = on\n", a->name);
        if (a->map_pool)
            fprintf(f, "tenant.%s.map_pool = on\n", a->name);
        for (int tier = 1; tier <= 4; tier++) {
            if (a->quota[tier])
                fprintf(f, "tenant.%s.quota_l%d_blocks = %llu\n", a->name, tier,
                        (unsigned long long)a->quota[tier]);
            if (a->guaranteed[tier])
                fprintf(f, "tenant.%s.guaranteed_l%d_blocks = %llu\n", a->name, tier,
                        (unsigned long long)a->guaranteed[tier]);
        }
        for (size_t j = 0; j < a->num_tokens; j++) {
            fprintf(f, "tenant.%s.token_sha256 = ", a->name);
            for (int k = 0; k < TKVD_TOKEN_HASH_BYTES; k++)
                fprintf(f, "%02x", a->tokens[j][k]);
            fputc('\n', f);
        }
    }
}
