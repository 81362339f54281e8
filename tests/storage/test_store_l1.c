/* test_store_l1.c - the store's L1 tier, driven through a backend that keeps L1 in host memory
 * (the daemon's backend is CUDA; the store's accounting, leases, promotion, commit-with-copy-
 * down, eviction and checksum handling are the same code either way, and are tested here on
 * every machine): prefetch L3/L2 -> L1 bit-exact, alloc in L1 -> commit -> L2 copy + write-
 * through, L1 capacity and pins, L1 eviction, a corrupted L2 copy never reaching L1. */
#include <check.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "l3_testutil.h"
#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_store.h"

#define BLK 8192u
#define TOK 16u
#define L1_BLOCKS 8u

/* ---- host-memory L1 backend ---- */
typedef struct host_l1 {
    uint8_t *mem;        /* L1_BLOCKS * BLK */
    tkv_store *store;    /* for the L2 base */
    int promotes, demotes;
} host_l1;

static uint64_t hl1_offset(void *ctx, uint64_t slot) { return slot * BLK; }

static int hl1_promote(void *ctx, const uint64_t *l1_slots, const uint64_t *l2_offsets, size_t n)
{
    host_l1 *h = ctx;
    for (size_t i = 0; i < n; i++)
        memcpy(h->mem + l1_slots[i] * BLK, tkv_store_l2_ptr(h->store, l2_offsets[i]), BLK);
    h->promotes++;
    return TKV_OK;
}

static int hl1_demote(void *ctx, const uint64_t *l2_offsets, const uint64_t *l1_slots, size_t n)
{
    host_l1 *h = ctx;
    for (size_t i = 0; i < n; i++)
        memcpy(tkv_store_l2_ptr(h->store, l2_offsets[i]), h->mem + l1_slots[i] * BLK, BLK);
    h->demotes++;
    return TKV_OK;
}

static const tkv_l1_ops hl1_ops = {hl1_offset, hl1_promote, hl1_demote};

static char *g_dir;
static host_l1 g_l1;
static tkv_key g_root;
static uint8_t g_fp[32];

static tkv_store *open_store(uint64_t l2_blocks, bool l3)
{
    tkv_geometry g = {2, 1, 64, TOK, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TENSOR, "l1-test"};
    tkv_geometry_fingerprint(&g, g_fp);
    tkv_key_root(g_fp, "", 0, &g_root);
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_block(o, BLK, TOK), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_fingerprint(o, g_fp), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l2_blocks(o, l2_blocks), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l3(o, l3 ? g_dir : NULL, 0), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l3_io_mode(o, TKV_IO_PSYNC), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l1(o, L1_BLOCKS, &hl1_ops, &g_l1), TKV_OK);
    tkv_store *s = NULL;
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_OK);
    tkv_store_opts_free(o);
    g_l1.store = s;
    return s;
}

static void setup(void)
{
    g_dir = tu_mkdtemp("store-l1");
    memset(&g_l1, 0, sizeof(g_l1));
    g_l1.mem = tkv_xcalloc(L1_BLOCKS, BLK);
}

static void teardown(void)
{
    free(g_l1.mem);
    tu_rmdir(g_dir);
}

static void chain(uint32_t c, uint32_t n, uint32_t *tokens, tkv_key *keys)
{
    for (uint32_t i = 0; i < n * TOK; i++)
        tokens[i] = c * 7919u + i;
    ck_assert_uint_eq(tkv_key_chain(&g_root, tokens, (size_t)n * TOK, TOK, keys, n), n);
}

static void payload(uint8_t *buf, uint32_t c, uint32_t i)
{
    uint64_t x = tu_mix(((uint64_t)c << 32) | i);
    for (size_t k = 0; k < BLK; k += 8) {
        x = tu_mix(x + k);
        memcpy(buf + k, &x, 8);
    }
}

static void put_chain(tkv_store *s, uint32_t c, uint32_t n, tkv_key *keys)
{
    uint32_t tokens[16 * TOK];
    uint8_t *bufs = tkv_xmalloc((size_t)n * BLK);
    const void *ptrs[16];
    chain(c, n, tokens, keys);
    for (uint32_t i = 0; i < n; i++) {
        payload(bufs + (size_t)i * BLK, c, i);
        ptrs[i] = bufs + (size_t)i * BLK;
    }
    size_t stored = 0;
    ck_assert_int_eq(tkv_store_put(s, NULL, keys, tokens, ptrs, n, &stored), TKV_OK);
    ck_assert_uint_eq(stored, n);
    free(bufs);
}

/* Looks keys up and prefetches to L1; returns the lease (status of the promotion in *status). */
static uint64_t lookup_to_l1(tkv_store *s, const tkv_key *keys, uint32_t n, int *status,
                             tkv_block_loc *locs)
{
    uint64_t lease = 0, ticket = 0;
    size_t hit = 0;
    ck_assert_int_eq(tkv_store_lookup(s, keys, n, 1, 0, &lease, &hit, locs), TKV_OK);
    ck_assert_uint_eq(hit, n);
    ck_assert_int_eq(tkv_store_prefetch(s, lease, TKV_TIER_L1, NULL, NULL, &ticket), TKV_OK);
    ck_assert_int_eq(tkv_store_wait(s, ticket, 10000, status), TKV_OK);
    size_t nb = 0;
    ck_assert_int_eq(tkv_store_lease_locs(s, lease, locs, n, &nb), TKV_OK);
    ck_assert_uint_eq(nb, n);
    return lease;
}

START_TEST(prefetch_to_l1_is_bit_exact_from_l2_and_l3)
{
    tkv_store *s = open_store(64, true);
    tkv_key keys[6];
    tkv_block_loc locs[6];
    uint8_t want[BLK];
    put_chain(s, 1, 6, keys);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    /* half the chain only in L3: evict its tail from L2 */
    size_t ev = 0, pin = 0;
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L2, keys + 3, 3, &ev, &pin), TKV_OK);
    ck_assert_uint_eq(ev, 3);
    int status = -1;
    uint64_t lease = lookup_to_l1(s, keys, 6, &status, locs);
    ck_assert_int_eq(status, TKV_OK);
    for (uint32_t i = 0; i < 6; i++) {
        ck_assert_int_eq(locs[i].tier, TKV_TIER_L1);
        ck_assert(locs[i].in_l1 && locs[i].l1_offset != TKV_NO_OFFSET);
        payload(want, 1, i);
        ck_assert_msg(memcmp(g_l1.mem + locs[i].l1_offset, want, BLK) == 0, "block %u differs", i);
    }
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L1], 6);
    ck_assert_uint_eq(st.capacity_blocks_tier[TKV_TIER_L1], L1_BLOCKS);
    /* pinned L1 blocks are never evicted */
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L1, NULL, 0, &ev, &pin), TKV_OK);
    ck_assert_uint_eq(ev, 0);
    ck_assert_uint_eq(pin, 6);
    ck_assert_int_eq(tkv_store_lease_release(s, lease), TKV_OK);
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L1, NULL, 0, &ev, &pin), TKV_OK);
    ck_assert_uint_eq(ev, 6);
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L1], 0);
    /* L1 eviction leaves the copy below: still a full hit, now from L2/L3 */
    uint64_t l2 = 0;
    size_t hit = 0;
    ck_assert_int_eq(tkv_store_lookup(s, keys, 6, 1, 0, &l2, &hit, locs), TKV_OK);
    ck_assert_uint_eq(hit, 6);
    ck_assert_int_ne(locs[0].tier, TKV_TIER_L1);
    tkv_store_lease_release(s, l2);
    tkv_store_close(s);
}
END_TEST

START_TEST(l1_capacity_evicts_unpinned_tails_and_reports_full)
{
    tkv_store *s = open_store(64, false);
    tkv_key a[6], b[6];
    tkv_block_loc locs[6];
    put_chain(s, 2, 6, a);
    put_chain(s, 3, 6, b);
    int status = -1;
    uint64_t la = lookup_to_l1(s, a, 6, &status, locs);
    ck_assert_int_eq(status, TKV_OK);
    /* 6 pinned in L1 of 8: chain b cannot fit while a is held */
    uint64_t lb = lookup_to_l1(s, b, 6, &status, locs);
    ck_assert_int_eq(status, TKV_EFULL);
    int in_l1 = 0;
    for (int i = 0; i < 6; i++)
        in_l1 += locs[i].in_l1;
    ck_assert_int_eq(in_l1, 2);
    tkv_store_lease_release(s, lb);
    tkv_store_lease_release(s, la);
    /* unpinned now: b's promotion evicts what it needs */
    lb = lookup_to_l1(s, b, 6, &status, locs);
    ck_assert_int_eq(status, TKV_OK);
    for (int i = 0; i < 6; i++)
        ck_assert(locs[i].in_l1);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_le(st.blocks_tier[TKV_TIER_L1], L1_BLOCKS);
    tkv_store_lease_release(s, lb);
    tkv_store_close(s);
}
END_TEST

START_TEST(alloc_in_l1_commit_copies_down_and_writes_through)
{
    tkv_store *s = open_store(64, true);
    uint32_t tokens[3 * TOK];
    tkv_key keys[3];
    chain(4, 3, tokens, keys);
    uint64_t id = 0, offs[4];
    ck_assert_int_eq(tkv_store_alloc_tier(s, TKV_TIER_L1, 4, 9, &id, offs), TKV_OK);
    uint8_t buf[BLK];
    ck_assert_int_eq(tkv_store_alloc_write(s, id, 0, buf), TKV_EINVAL); /* engines write L1 */
    for (uint32_t i = 0; i < 3; i++)
        payload(g_l1.mem + offs[i], 4, i);
    size_t stored = 0;
    ck_assert_int_eq(tkv_store_commit(s, id, NULL, keys, tokens, 3, &stored), TKV_OK);
    ck_assert_uint_eq(stored, 3);
    ck_assert_int_ge(g_l1.demotes, 1);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    tkv_block_loc locs[3];
    uint64_t lease = 0;
    size_t hit = 0;
    ck_assert_int_eq(tkv_store_lookup(s, keys, 3, 1, 0, &lease, &hit, locs), TKV_OK);
    ck_assert_uint_eq(hit, 3);
    for (uint32_t i = 0; i < 3; i++) {
        ck_assert(locs[i].in_l1 && locs[i].in_l2 && locs[i].in_l3);
        ck_assert_uint_eq(locs[i].l1_offset, offs[i]);
        ck_assert_int_eq(tkv_store_get(s, lease, i, buf, BLK), TKV_OK);
        uint8_t want[BLK];
        payload(want, 4, i);
        ck_assert_msg(memcmp(buf, want, BLK) == 0, "L2 copy of block %u differs", i);
    }
    tkv_store_lease_release(s, lease);
    /* the unused fourth slot went back: 8 - 3 L1 slots are free, all allocatable */
    uint64_t id2 = 0, offs2[5];
    ck_assert_int_eq(tkv_store_alloc_tier(s, TKV_TIER_L1, 5, 9, &id2, offs2), TKV_OK);
    ck_assert_uint_eq(tkv_store_release_owner(s, 9), 1);
    tkv_store_close(s);
}
END_TEST

START_TEST(corrupt_l2_copy_never_reaches_l1)
{
    tkv_store *s = open_store(64, false);
    tkv_key keys[4];
    tkv_block_loc locs[4];
    put_chain(s, 5, 4, keys);
    uint64_t lease = 0;
    size_t hit = 0;
    ck_assert_int_eq(tkv_store_lookup(s, keys, 4, 1, 0, &lease, &hit, locs), TKV_OK);
    uint8_t *slot = tkv_store_l2_ptr(s, locs[2].l2_offset);
    slot[100] ^= 0x40; /* a flipped bit in host memory */
    tkv_store_lease_release(s, lease);
    int status = -1;
    lease = lookup_to_l1(s, keys, 4, &status, locs);
    ck_assert_int_eq(status, TKV_ECHECKSUM);
    ck_assert(!locs[2].in_l1 && !locs[2].in_l2);
    ck_assert(locs[1].in_l1);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_ge(st.checksum_failures, 1);
    tkv_store_lease_release(s, lease);
    /* the damaged block is gone: the prefix now ends before it */
    ck_assert_int_eq(tkv_store_lookup(s, keys, 4, 1, 0, &lease, &hit, locs), TKV_OK);
    ck_assert_uint_eq(hit, 2);
    tkv_store_lease_release(s, lease);
    tkv_store_close(s);
}
END_TEST

START_TEST(no_l1_tier_is_refused_cleanly)
{
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_l1(o, 0, &hl1_ops, NULL), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_l1(o, 4, NULL, NULL), TKV_EINVAL);
    uint8_t fp[32] = {1};
    ck_assert_int_eq(tkv_store_opts_set_block(o, BLK, TOK), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_fingerprint(o, fp), TKV_OK);
    tkv_store *s = NULL;
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_OK);
    tkv_store_opts_free(o);
    uint64_t id, off;
    ck_assert_int_eq(tkv_store_alloc_tier(s, TKV_TIER_L1, 1, 1, &id, &off), TKV_EUNSUPPORTED);
    size_t ev, pin;
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L1, NULL, 0, &ev, &pin), TKV_EUNSUPPORTED);
    tkv_store_close(s);
}
END_TEST

int main(void)
{
    Suite *su = suite_create("store_l1");
    TCase *tc = tcase_create("l1");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, prefetch_to_l1_is_bit_exact_from_l2_and_l3);
    tcase_add_test(tc, l1_capacity_evicts_unpinned_tails_and_reports_full);
    tcase_add_test(tc, alloc_in_l1_commit_copies_down_and_writes_through);
    tcase_add_test(tc, corrupt_l2_copy_never_reaches_l1);
    tcase_add_test(tc, no_l1_tier_is_refused_cleanly);
    suite_add_tcase(su, tc);
    SRunner *sr = srunner_create(su);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
