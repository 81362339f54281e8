/* test_store_tenant.c - per-tenant quotas and guaranteed shares in the tier manager
 * (storage/store.c): a tenant at its L2 quota evicts its own blocks first, never holds more
 * than the quota, is refused when its own blocks are all pinned; another tenant's load cannot
 * evict a tenant below its guaranteed share; alloc/commit is held to the same quota; bad
 * limits are refused; a tenant's own L2 region holds only its blocks and bounds it, and no
 * other tenant's lookup sees them; L3 quotas and guaranteed shares hold under a 3-tenant load;
 * L1 regions and quotas (a host-memory L1 backend) hold the same way; blocks recovered from L3
 * belong to their tenant (by name, across a reordering of the tenants) and count against its
 * quota from the start.
 * Deterministic counts on a real memfd pool, LRU policy, L3 only where a test says. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_store.h"

#define BLK 4096u
#define TOK 8u
#define L2 64u

static uint8_t g_fp[32];

static tkv_store *open_store(tkv_store_opts *o)
{
    tkv_geometry g = {2, 1, 64, TOK, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TENSOR, "tenant-test"};
    tkv_geometry_fingerprint(&g, g_fp);
    ck_assert_int_eq(tkv_store_opts_set_block(o, BLK, TOK), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_fingerprint(o, g_fp), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l2_blocks(o, L2), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_policy(o, "lru"), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_workers(o, 2), TKV_OK);
    tkv_store *s = NULL;
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_OK);
    tkv_store_opts_free(o);
    return s;
}

/* One-block chain number i of a tenant (keys under the tenant's own root, as the daemon
 * derives them). */
static void block_key(unsigned tenant, uint32_t i, tkv_key *key, uint32_t *tokens)
{
    char ns[16];
    snprintf(ns, sizeof(ns), "t%u", tenant);
    tkv_key root;
    tkv_key_root(g_fp, ns, strlen(ns), &root);
    for (uint32_t k = 0; k < TOK; k++)
        tokens[k] = i * 7919u + k;
    ck_assert_uint_eq(tkv_key_chain(&root, tokens, TOK, TOK, key, 1), 1);
}

static size_t put_one(tkv_store *s, unsigned tenant, uint32_t i)
{
    static uint8_t payload[BLK];
    memset(payload, (int)(tenant * 31 + i), BLK);
    tkv_key key;
    uint32_t tokens[TOK];
    block_key(tenant, i, &key, tokens);
    const void *p = payload;
    size_t stored = 0;
    int rc = tkv_store_put_as(s, tenant, NULL, &key, tokens, &p, 1, &stored);
    ck_assert(rc == TKV_OK || rc == TKV_EFULL);
    return stored;
}

static bool present(tkv_store *s, unsigned tenant, uint32_t i)
{
    tkv_key key;
    uint32_t tokens[TOK];
    block_key(tenant, i, &key, tokens);
    uint64_t lease = 0;
    size_t hit = 0;
    ck_assert_int_eq(tkv_store_lookup(s, &key, 1, 1, 0, &lease, &hit, NULL), TKV_OK);
    if (lease)
        tkv_store_lease_release(s, lease);
    return hit == 1;
}

static uint64_t held_in(tkv_store *s, unsigned tenant, int tier)
{
    tkv_store_tenant_stats ts;
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, tenant, &ts), TKV_OK);
    return ts.blocks_tier[tier];
}

static uint64_t held(tkv_store *s, unsigned tenant) { return held_in(s, tenant, TKV_TIER_L2); }

/* Hits of tenant `as`'s lookup of tenant `owner`'s block i (released at once); *loc gets its
 * location when it hit. */
static size_t lookup_as(tkv_store *s, unsigned as, unsigned owner, uint32_t i, tkv_block_loc *loc)
{
    tkv_key key;
    uint32_t tokens[TOK];
    block_key(owner, i, &key, tokens);
    uint64_t lease = 0;
    size_t hit = 0;
    tkv_block_loc l;
    ck_assert_int_eq(tkv_store_lookup_as(s, as, &key, 1, 1, 0, &lease, &hit, &l), TKV_OK);
    if (lease)
        tkv_store_lease_release(s, lease);
    if (hit && loc)
        *loc = l;
    return hit;
}

START_TEST(test_quota_and_guarantee)
{
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 1, TKV_TIER_L2, 20, 0), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 2, TKV_TIER_L2, 0, 16), TKV_OK);
    tkv_store *s = open_store(o);

    for (uint32_t i = 0; i < 16; i++)
        ck_assert_uint_eq(put_one(s, 2, i), 1);
    /* Tenant 1 fills far past its quota: each put beyond it evicts one of its own blocks,
     * although L2 has free slots and tenant 2's blocks are older (the LRU's first victims). */
    for (uint32_t i = 0; i < 300; i++) {
        ck_assert_uint_eq(put_one(s, 1, i), 1);
        ck_assert_uint_le(held(s, 1), 20);
    }
    ck_assert_uint_eq(held(s, 1), 20);
    ck_assert_uint_eq(held(s, 2), 16);
    for (uint32_t i = 280; i < 300; i++) /* the newest 20 are the ones kept */
        ck_assert(present(s, 1, i));
    ck_assert(!present(s, 1, 0));
    tkv_store_tenant_stats ts;
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 1, &ts), TKV_OK);
    ck_assert_uint_eq(ts.own_evictions, 280);
    ck_assert_uint_eq(ts.max_blocks_tier[TKV_TIER_L2], 20);

    /* Tenant 3 has no quota: it fills the tier, evicting tenant 1's blocks and its own, but
     * never tenant 2's, which hold exactly their guaranteed share. */
    for (uint32_t i = 0; i < 500; i++)
        ck_assert_uint_eq(put_one(s, 3, i), 1);
    ck_assert_uint_eq(held(s, 2), 16);
    ck_assert_uint_eq(held(s, 1), 0);
    ck_assert_uint_eq(held(s, 3), L2 - 16);
    for (uint32_t i = 0; i < 16; i++)
        ck_assert(present(s, 2, i));
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 2, &ts), TKV_OK);
    ck_assert_uint_gt(ts.guarded_skips, 0);

    /* Above its guarantee a tenant's extra blocks are fair game again. */
    for (uint32_t i = 16; i < 24; i++)
        ck_assert_uint_eq(put_one(s, 2, i), 1);
    for (uint32_t i = 500; i < 600; i++)
        ck_assert_uint_eq(put_one(s, 3, i), 1);
    ck_assert_uint_eq(held(s, 2), 16);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L2], L2);
    tkv_store_close(s);
}
END_TEST

START_TEST(test_quota_refusal_and_alloc)
{
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 1, TKV_TIER_L2, 4, 0), TKV_OK);
    tkv_store *s = open_store(o);
    tkv_key keys[4];
    uint32_t tokens[TOK];
    for (uint32_t i = 0; i < 4; i++) {
        ck_assert_uint_eq(put_one(s, 1, i), 1);
        block_key(1, i, &keys[i], tokens);
    }
    /* Every own block pinned: the next put has no own block to give up and is refused,
     * although L2 has 60 free slots. */
    uint64_t leases[4];
    for (uint32_t i = 0; i < 4; i++) {
        size_t hit = 0;
        ck_assert_int_eq(tkv_store_lookup(s, &keys[i], 1, 9, 0, &leases[i], &hit, NULL), TKV_OK);
        ck_assert_uint_eq(hit, 1);
    }
    ck_assert_uint_eq(put_one(s, 1, 100), 0);
    uint64_t aid = 0, offs[2];
    ck_assert_int_eq(tkv_store_alloc_as(s, 1, TKV_TIER_L2, 2, 9, &aid, offs), TKV_EFULL);
    tkv_store_tenant_stats ts;
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 1, &ts), TKV_OK);
    ck_assert_uint_eq(ts.refused_blocks, 3);
    ck_assert_uint_eq(held(s, 1), 4);
    /* Tenant 0 (no quota) is not affected. */
    ck_assert_uint_eq(put_one(s, 0, 1), 1);
    for (uint32_t i = 0; i < 4; i++)
        ck_assert_int_eq(tkv_store_lease_release(s, leases[i]), TKV_OK);

    /* Released, the same alloc evicts two own blocks and commits under the quota. */
    ck_assert_int_eq(tkv_store_alloc_as(s, 1, TKV_TIER_L2, 2, 9, &aid, offs), TKV_OK);
    tkv_key nk[2];
    uint32_t ntok[2 * TOK];
    block_key(1, 200, &nk[0], ntok);
    block_key(1, 201, &nk[1], ntok + TOK); /* two roots: commit chains them, fine for counts */
    static uint8_t payload[BLK];
    for (uint32_t i = 0; i < 2; i++)
        ck_assert_int_eq(tkv_store_alloc_write(s, aid, i, payload), TKV_OK);
    size_t stored = 0;
    ck_assert_int_eq(tkv_store_commit(s, aid, NULL, nk, ntok, 2, &stored), TKV_OK);
    ck_assert_uint_eq(stored, 2);
    ck_assert_uint_eq(held(s, 1), 4);
    ck_assert_uint_eq(held(s, 0), 1);
    tkv_store_close(s);
}
END_TEST

/* Own L2 regions: tenant 1 (8 slots) and 2 (16) each in a memfd of its own; tenant 3 and 0
 * share region 0 (the other 40). A tenant's load evicts only its own blocks, its blocks' offsets
 * lie in its region, and no other tenant's lookup sees them. */
START_TEST(test_regions)
{
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_l2_region(o, 0, 4), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_l2_region(o, 1, 8), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l2_region(o, 2, 16), TKV_OK);
    tkv_store *s = open_store(o);
    uint64_t off1 = 0, bytes1 = 0, off3 = 1, bytes3 = 0;
    int fd1 = -1, ro1 = -1, fd3 = -1;
    ck_assert_int_eq(tkv_store_l2_region(s, 1, &off1, &bytes1, &fd1, &ro1), TKV_OK);
    ck_assert_int_eq(tkv_store_l2_region(s, 3, &off3, &bytes3, &fd3, NULL), TKV_OK);
    ck_assert_uint_eq(off3, 0);
    ck_assert_uint_eq(bytes3, 40u * BLK);
    ck_assert_uint_eq(off1, 40u * BLK);
    ck_assert_uint_eq(bytes1, 8u * BLK);
    ck_assert_int_ge(ro1, 0);
    ck_assert_int_ne(fd1, fd3);
    ck_assert_uint_eq(tkv_store_l2_num_regions(s), 3);

    for (uint32_t i = 0; i < 16; i++)
        ck_assert_uint_eq(put_one(s, 2, i), 1);
    for (uint32_t i = 0; i < 100; i++) {
        ck_assert_uint_eq(put_one(s, 1, i), 1);
        ck_assert_uint_le(held(s, 1), 8);
    }
    for (uint32_t i = 0; i < 200; i++)
        ck_assert_uint_eq(put_one(s, 3, i), 1);
    ck_assert_uint_eq(held(s, 1), 8);
    ck_assert_uint_eq(held(s, 2), 16);
    ck_assert_uint_eq(held(s, 3), 40);
    tkv_block_loc loc;
    for (uint32_t i = 0; i < 16; i++) {
        ck_assert_uint_eq(lookup_as(s, 2, 2, i, &loc), 1);
        ck_assert(loc.in_l2);
        ck_assert_uint_ge(loc.l2_offset, off1 + bytes1);
        ck_assert_uint_lt(loc.l2_offset, off1 + bytes1 + 16u * BLK);
        ck_assert_uint_eq(lookup_as(s, 1, 2, i, NULL), 0); /* another tenant's: a miss */
        ck_assert_uint_eq(lookup_as(s, 3, 2, i, NULL), 0);
    }
    ck_assert_uint_eq(lookup_as(s, 1, 1, 99, &loc), 1);
    ck_assert_uint_ge(loc.l2_offset, off1);
    ck_assert_uint_lt(loc.l2_offset, off1 + bytes1);
    tkv_store_tenant_stats ts;
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 1, &ts), TKV_OK);
    ck_assert_uint_eq(ts.own_evictions, 92);
    ck_assert_uint_eq(ts.guaranteed_blocks_tier[TKV_TIER_L2], 8);

    /* A block of no tenant in region 0 becomes tenant 3's when 3 looks it up (same region);
     * tenant 1 sees it but cannot take it (it sits in another region). */
    ck_assert_uint_eq(put_one(s, 0, 7), 1);
    ck_assert_uint_eq(put_one(s, 0, 8), 1);
    uint64_t h0 = held(s, 0), h3 = held(s, 3);
    ck_assert_uint_eq(lookup_as(s, 3, 0, 7, NULL), 1);
    ck_assert_uint_eq(held(s, 0), h0 - 1);
    ck_assert_uint_eq(held(s, 3), h3 + 1);
    ck_assert_uint_eq(lookup_as(s, 1, 0, 7, NULL), 0); /* now tenant 3's */
    ck_assert_uint_eq(lookup_as(s, 1, 0, 8, NULL), 1);
    ck_assert_uint_eq(held(s, 0), h0 - 1);
    tkv_store_close(s);

    o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_l2_region(o, 1, L2 + 1), TKV_OK);
    tkv_geometry g = {2, 1, 64, TOK, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TENSOR, "tenant-test"};
    tkv_geometry_fingerprint(&g, g_fp);
    ck_assert_int_eq(tkv_store_opts_set_block(o, BLK, TOK), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_fingerprint(o, g_fp), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l2_blocks(o, L2), TKV_OK);
    s = NULL;
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_EINVAL); /* regions larger than L2 */
    ck_assert_ptr_null(s);
    tkv_store_opts_free(o);
}
END_TEST

/* L3 of 32 blocks: tenant 1's quota 10, tenant 2's guaranteed 8, tenant 3 unlimited. */
START_TEST(test_l3_quota)
{
    char dir[] = "/tmp/tkv-l3q-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_l3(o, dir, 32u * BLK), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 1, TKV_TIER_L3, 10, 0), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 2, TKV_TIER_L3, 0, 8), TKV_OK);
    tkv_store *s = open_store(o);
    for (uint32_t i = 0; i < 8; i++)
        ck_assert_uint_eq(put_one(s, 2, i), 1);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    ck_assert_uint_eq(held_in(s, 2, TKV_TIER_L3), 8);
    for (uint32_t i = 0; i < 60; i++) {
        ck_assert_uint_eq(put_one(s, 1, i), 1);
        if (i % 10 == 9) {
            ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
            ck_assert_uint_le(held_in(s, 1, TKV_TIER_L3), 10);
        }
    }
    ck_assert_uint_eq(held_in(s, 1, TKV_TIER_L3), 10);
    tkv_store_tenant_stats ts;
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 1, &ts), TKV_OK);
    ck_assert_uint_ge(ts.own_evictions, 50);
    ck_assert_uint_eq(ts.max_blocks_tier[TKV_TIER_L3], 10);
    for (uint32_t i = 0; i < 100; i++)
        ck_assert_uint_eq(put_one(s, 3, i), 1);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    ck_assert_uint_eq(held_in(s, 2, TKV_TIER_L3), 8);   /* its share, never evicted */
    ck_assert_uint_le(held_in(s, 1, TKV_TIER_L3), 10);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_le(st.blocks_tier[TKV_TIER_L3], 32);
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 2, &ts), TKV_OK);
    ck_assert_uint_gt(ts.guarded_skips, 0);
    ck_assert_uint_eq(ts.guaranteed_blocks_tier[TKV_TIER_L3], 8);
    tkv_store_close(s);
    char cmd[64];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* ---- L1: a host-memory backend keeping each region at its own address ---------------------
 * Like the daemon's GPU backend, offsets are region base + index in region, and the bases are
 * far apart, so an offset of one region never lands in another's. */
#define L1B 24u
#define L1_REGION_GAP (1u << 20)
static uint8_t g_l1mem[L1B * BLK];
static tkv_store *g_l1store;
static uint64_t g_l1first[8], g_l1size[8];
static unsigned g_l1nreg;

static unsigned hl1_region(uint64_t slot)
{
    for (unsigned r = 0; r < g_l1nreg; r++)
        if (slot >= g_l1first[r] && slot < g_l1first[r] + g_l1size[r])
            return r;
    ck_abort_msg("slot %llu in no region", (unsigned long long)slot);
    return 0;
}
static uint64_t hl1_offset(void *ctx, uint64_t slot)
{
    unsigned r = hl1_region(slot);
    return (uint64_t)r * L1_REGION_GAP + (slot - g_l1first[r]) * BLK;
}
static int hl1_promote(void *ctx, const uint64_t *l1, const uint64_t *l2, size_t n)
{
    for (size_t i = 0; i < n; i++)
        memcpy(g_l1mem + l1[i] * BLK, tkv_store_l2_ptr(g_l1store, l2[i]), BLK);
    return TKV_OK;
}
static int hl1_demote(void *ctx, const uint64_t *l2, const uint64_t *l1, size_t n)
{
    for (size_t i = 0; i < n; i++)
        memcpy(tkv_store_l2_ptr(g_l1store, l2[i]), g_l1mem + l1[i] * BLK, BLK);
    return TKV_OK;
}
static const tkv_l1_ops g_hl1 = {hl1_offset, hl1_promote, hl1_demote};

/* Allocates one L1 slot as tenant tn, writes block i's bytes into it and commits it. Returns
 * the allocation's status; *off gets the slot's offset. */
static int l1_commit_one(tkv_store *s, unsigned tn, uint32_t i, uint64_t *off)
{
    uint64_t aid = 0, o = 0;
    int rc = tkv_store_alloc_as(s, tn, TKV_TIER_L1, 1, 5, &aid, &o);
    if (rc != TKV_OK)
        return rc;
    unsigned r = (unsigned)(o / L1_REGION_GAP);
    memset(g_l1mem + (g_l1first[r] + (o % L1_REGION_GAP) / BLK) * BLK, (int)(tn * 31 + i), BLK);
    tkv_key key;
    uint32_t tokens[TOK];
    block_key(tn, i, &key, tokens);
    size_t stored = 0;
    ck_assert_int_eq(tkv_store_commit(s, aid, NULL, &key, tokens, 1, &stored), TKV_OK);
    ck_assert_uint_eq(stored, 1);
    if (off)
        *off = o;
    return TKV_OK;
}

/* L1 of 24 slots: tenants 1 and 2 have regions of 8 each; region 0 (the other 8) is shared
 * by tenant 3 (quota 4), tenant 4 (guaranteed 3) and tenant 5 (no limit). */
START_TEST(test_l1_regions_and_quota)
{
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_l1(o, L1B, &g_hl1, NULL), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l1_region(o, 1, 8), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l1_region(o, 2, 8), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 3, TKV_TIER_L1, 4, 0), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 4, TKV_TIER_L1, 0, 3), TKV_OK);
    /* The backend needs the layout before the first copy; it is the store's. */
    tkv_store *s = g_l1store = open_store(o);
    g_l1nreg = tkv_store_l1_num_regions(s);
    ck_assert_uint_eq(g_l1nreg, 3);
    for (unsigned r = 0; r < g_l1nreg; r++)
        ck_assert_int_eq(tkv_store_l1_region_at(s, r, &g_l1first[r], &g_l1size[r]), TKV_OK);
    ck_assert_uint_eq(g_l1size[0], 8);
    ck_assert_uint_eq(g_l1first[1], 8);
    ck_assert_uint_eq(g_l1first[2], 16);
    ck_assert_int_eq(tkv_store_l1_region_at(s, 3, NULL, NULL), TKV_EINVAL);
    unsigned r1 = 9, r3 = 9;
    ck_assert_int_eq(tkv_store_l1_region(s, 1, &r1), TKV_OK);
    ck_assert_int_eq(tkv_store_l1_region(s, 3, &r3), TKV_OK);
    ck_assert_uint_eq(r1, 1);
    ck_assert_uint_eq(r3, 0);

    /* Tenant 2 fills its region; tenant 1's load of 30 evicts only its own. */
    for (uint32_t i = 0; i < 8; i++)
        ck_assert_int_eq(l1_commit_one(s, 2, i, NULL), TKV_OK);
    for (uint32_t i = 0; i < 30; i++) {
        uint64_t off = 0;
        ck_assert_int_eq(l1_commit_one(s, 1, i, &off), TKV_OK);
        ck_assert_uint_ge(off, 1u * L1_REGION_GAP); /* in its region, nowhere else */
        ck_assert_uint_lt(off, 1u * L1_REGION_GAP + 8u * BLK);
        ck_assert_uint_le(held_in(s, 1, TKV_TIER_L1), 8);
    }
    ck_assert_uint_eq(held_in(s, 1, TKV_TIER_L1), 8);
    ck_assert_uint_eq(held_in(s, 2, TKV_TIER_L1), 8);
    tkv_block_loc loc;
    for (uint32_t i = 0; i < 8; i++) {
        ck_assert_uint_eq(lookup_as(s, 2, 2, i, &loc), 1);
        ck_assert(loc.in_l1);
        ck_assert_uint_eq(loc.l1_offset / L1_REGION_GAP, 2);
        ck_assert_uint_eq(lookup_as(s, 1, 2, i, NULL), 0); /* another tenant's: a miss */
    }
    tkv_store_tenant_stats ts;
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 1, &ts), TKV_OK);
    ck_assert_uint_eq(ts.own_evictions, 22);
    ck_assert_uint_eq(ts.max_blocks_tier[TKV_TIER_L1], 8);
    ck_assert_uint_eq(ts.guaranteed_blocks_tier[TKV_TIER_L1], 8);

    /* Region 0: 4 at tenant 4's share, tenant 3 held to its quota, tenant 5's load cannot
     * push tenant 4 below 3. */
    for (uint32_t i = 0; i < 3; i++)
        ck_assert_int_eq(l1_commit_one(s, 4, i, NULL), TKV_OK);
    for (uint32_t i = 0; i < 10; i++) {
        ck_assert_int_eq(l1_commit_one(s, 3, i, NULL), TKV_OK);
        ck_assert_uint_le(held_in(s, 3, TKV_TIER_L1), 4);
    }
    for (uint32_t i = 0; i < 20; i++)
        ck_assert_int_eq(l1_commit_one(s, 5, i, NULL), TKV_OK);
    ck_assert_uint_eq(held_in(s, 4, TKV_TIER_L1), 3);
    ck_assert_uint_le(held_in(s, 3, TKV_TIER_L1), 4);
    ck_assert_uint_eq(held_in(s, 3, TKV_TIER_L1) + held_in(s, 4, TKV_TIER_L1) +
                          held_in(s, 5, TKV_TIER_L1), 8);
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 4, &ts), TKV_OK);
    ck_assert_uint_gt(ts.guarded_skips, 0);

    /* Tenant 1 with every L1 block pinned: an L1 allocation is refused and counted, though
     * region 0 has unpinned blocks. Its lookups' prefetch to L1 of an L2-only block too. */
    uint64_t leases[8];
    uint32_t n = 0;
    for (uint32_t i = 22; i < 30; i++) {
        tkv_key key;
        uint32_t tokens[TOK];
        block_key(1, i, &key, tokens);
        size_t hit = 0;
        ck_assert_int_eq(tkv_store_lookup_as(s, 1, &key, 1, 9, 0, &leases[n], &hit, &loc),
                         TKV_OK);
        ck_assert_uint_eq(hit, 1);
        ck_assert(loc.in_l1);
        n++;
    }
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 1, &ts), TKV_OK);
    uint64_t refused_before = ts.refused_blocks_tier[TKV_TIER_L1];
    uint64_t aid = 0, off = 0;
    ck_assert_int_eq(tkv_store_alloc_as(s, 1, TKV_TIER_L1, 1, 9, &aid, &off), TKV_EFULL);
    tkv_key key;
    uint32_t tokens[TOK];
    block_key(1, 21, &key, tokens); /* evicted from L1, still in L2 */
    uint64_t lease = 0, ticket = 0;
    size_t hit = 0;
    ck_assert_int_eq(tkv_store_lookup_as(s, 1, &key, 1, 9, 0, &lease, &hit, &loc), TKV_OK);
    ck_assert_uint_eq(hit, 1);
    ck_assert(!loc.in_l1 && loc.in_l2);
    ck_assert_int_eq(tkv_store_prefetch(s, lease, TKV_TIER_L1, NULL, NULL, &ticket), TKV_OK);
    int status = 0;
    ck_assert_int_eq(tkv_store_wait(s, ticket, 10000, &status), TKV_OK);
    ck_assert_int_eq(status, TKV_EFULL);
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 1, &ts), TKV_OK);
    ck_assert_uint_eq(ts.refused_blocks_tier[TKV_TIER_L1], refused_before + 2);
    for (uint32_t i = 0; i < n; i++)
        ck_assert_int_eq(tkv_store_lease_release(s, leases[i]), TKV_OK);
    /* Released: the prefetch brings it up, bit-exact, into tenant 1's region. */
    ck_assert_int_eq(tkv_store_prefetch(s, lease, TKV_TIER_L1, NULL, NULL, &ticket), TKV_OK);
    ck_assert_int_eq(tkv_store_wait(s, ticket, 10000, &status), TKV_OK);
    ck_assert_int_eq(status, TKV_OK);
    size_t nl = 0;
    ck_assert_int_eq(tkv_store_lease_locs(s, lease, &loc, 1, &nl), TKV_OK);
    ck_assert(loc.in_l1);
    ck_assert_uint_eq(loc.l1_offset / L1_REGION_GAP, 1);
    uint8_t want[BLK];
    memset(want, 1 * 31 + 21, BLK);
    ck_assert_int_eq(memcmp(g_l1mem + (g_l1first[1] + (loc.l1_offset % L1_REGION_GAP) / BLK) * BLK,
                            want, BLK), 0);
    ck_assert_int_eq(tkv_store_lease_release(s, lease), TKV_OK);
    ck_assert_uint_eq(held_in(s, 1, TKV_TIER_L1), 8);
    tkv_store_close(s);
    g_l1store = NULL;

    o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_l1(o, L1B, &g_hl1, NULL), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l1_region(o, 1, L1B + 1), TKV_OK);
    tkv_geometry g = {2, 1, 64, TOK, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TENSOR, "tenant-test"};
    tkv_geometry_fingerprint(&g, g_fp);
    ck_assert_int_eq(tkv_store_opts_set_block(o, BLK, TOK), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_fingerprint(o, g_fp), TKV_OK);
    s = NULL;
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_EINVAL); /* regions larger than L1 */
    ck_assert_ptr_null(s);
    tkv_store_opts_free(o);
}
END_TEST

/* With L3 written through, a block committed into L1 is pinned for its write-back, which
 * needs only its L2 copy: a tenant at its L1 quota committing block after block must be able
 * to evict its own L1 blocks at once, not find them unevictable until they are durable (an
 * engine's allocation then failed with "nothing evictable"). */
START_TEST(test_l1_quota_under_write_back)
{
    char dir[] = "/tmp/tkv-l1wb-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_l3(o, dir, 0), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_write_through(o, true), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l1(o, L1B, &g_hl1, NULL), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l1_region(o, 1, 8), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 1, TKV_TIER_L1, 4, 0), TKV_OK);
    tkv_store *s = g_l1store = open_store(o);
    g_l1nreg = tkv_store_l1_num_regions(s);
    for (unsigned r = 0; r < g_l1nreg; r++)
        ck_assert_int_eq(tkv_store_l1_region_at(s, r, &g_l1first[r], &g_l1size[r]), TKV_OK);
    for (uint32_t i = 0; i < 200; i++) {
        ck_assert_int_eq(l1_commit_one(s, 1, i, NULL), TKV_OK);
        ck_assert_uint_le(held_in(s, 1, TKV_TIER_L1), 4);
    }
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    tkv_block_loc loc;
    ck_assert_uint_eq(lookup_as(s, 1, 1, 199, &loc), 1);
    ck_assert(loc.in_l1 && loc.in_l3);
    ck_assert_uint_eq(lookup_as(s, 1, 1, 0, &loc), 1); /* evicted from L1, durable below */
    ck_assert(!loc.in_l1 && loc.in_l3);
    tkv_store_close(s);
    g_l1store = NULL;
    char cmd[64];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

/* Blocks recovered from L3 are their tenant's: tenants "alpha" (id 1) and "beta" (id 2) put,
 * the store closes, and reopens with the two ids swapped (the config reordered) and a quota
 * for alpha. Each tenant holds its own blocks from the start, the other's lookup misses them,
 * and alpha's quota counts them. */
START_TEST(test_l3_recovery_keeps_tenants)
{
    char dir[] = "/tmp/tkv-l3t-XXXXXX";
    ck_assert_ptr_nonnull(mkdtemp(dir));
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_l3(o, dir, 0), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_name(o, 1, "alpha"), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_name(o, 2, "beta"), TKV_OK);
    tkv_store *s = open_store(o);
    for (uint32_t i = 0; i < 6; i++)
        ck_assert_uint_eq(put_one(s, 1, i), 1);
    for (uint32_t i = 0; i < 4; i++)
        ck_assert_uint_eq(put_one(s, 2, i), 1);
    ck_assert_uint_eq(put_one(s, 0, 0), 1);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    tkv_store_close(s);

    o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_l3(o, dir, 0), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_name(o, 1, "beta"), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_name(o, 2, "alpha"), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 2, TKV_TIER_L3, 6, 0), TKV_OK);
    s = open_store(o);
    ck_assert_uint_eq(held_in(s, 2, TKV_TIER_L3), 6);  /* alpha's, from the start */
    ck_assert_uint_eq(held_in(s, 1, TKV_TIER_L3), 4);  /* beta's */
    ck_assert_uint_eq(held_in(s, 0, TKV_TIER_L3), 1);  /* no tenant's stays no tenant's */
    /* Keys of the test are salted by the old ids: alpha's blocks are the "t1" chains. */
    for (uint32_t i = 0; i < 6; i++) {
        ck_assert_uint_eq(lookup_as(s, 1, 1, i, NULL), 0); /* beta cannot claim them */
        ck_assert_uint_eq(lookup_as(s, 2, 1, i, NULL), 1); /* alpha can */
    }
    for (uint32_t i = 0; i < 4; i++)
        ck_assert_uint_eq(lookup_as(s, 2, 2, i, NULL), 0);
    ck_assert_uint_eq(held_in(s, 2, TKV_TIER_L3), 6);
    /* Alpha is at its L3 quota with the recovered blocks: a new block takes an own one's room. */
    ck_assert_uint_eq(put_one(s, 2, 50), 1);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    ck_assert_uint_eq(held_in(s, 2, TKV_TIER_L3), 6);
    ck_assert_uint_eq(held_in(s, 1, TKV_TIER_L3), 4);
    tkv_store_tenant_stats ts;
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, 2, &ts), TKV_OK);
    ck_assert_uint_ge(ts.own_evictions, 1);
    tkv_store_close(s);
    char cmd[64];
    snprintf(cmd, sizeof(cmd), "rm -rf %s", dir);
    ck_assert_int_eq(system(cmd), 0);
}
END_TEST

START_TEST(test_bad_limits)
{
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, TKV_STORE_TENANTS_MAX, TKV_TIER_L2, 1, 0),
                     TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 1, TKV_TIER_L2, 4, 5), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 1, 9, 4, 0), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 1, TKV_TIER_L1, 4, 5), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_l1_region(o, 0, 4), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_l1_region(o, TKV_STORE_TENANTS_MAX, 4), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_tenant_l4_quota(o, TKV_STORE_TENANTS_MAX, 4), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_tenant_quota(o, 1, TKV_TIER_L3, 4, 0), TKV_OK);
    tkv_store *s = open_store(o);
    tkv_store_tenant_stats ts;
    ck_assert_int_eq(tkv_store_get_tenant_stats(s, TKV_STORE_TENANTS_MAX, &ts), TKV_EINVAL);
    tkv_key key;
    uint32_t tokens[TOK];
    block_key(1, 0, &key, tokens);
    const void *p = tokens;
    ck_assert_int_eq(tkv_store_put_as(s, TKV_STORE_TENANTS_MAX, NULL, &key, tokens, &p, 1, NULL),
                     TKV_EINVAL);
    tkv_store_close(s);
}
END_TEST

int main(void)
{
    Suite *su = suite_create("store_tenant");
    TCase *tc = tcase_create("quota");
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, test_quota_and_guarantee);
    tcase_add_test(tc, test_quota_refusal_and_alloc);
    tcase_add_test(tc, test_bad_limits);
    tcase_add_test(tc, test_regions);
    tcase_add_test(tc, test_l3_quota);
    tcase_add_test(tc, test_l1_regions_and_quota);
    tcase_add_test(tc, test_l1_quota_under_write_back);
    tcase_add_test(tc, test_l3_recovery_keeps_tenants);
    suite_add_tcase(su, tc);
    SRunner *sr = srunner_create(su);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
