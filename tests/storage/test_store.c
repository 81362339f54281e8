/* test_store.c - the tier manager (storage/store.c) on a real memfd pool, real RocksDB + segment
 * files in a scratch directory, real worker threads: lookup/lease/TTL/owner release, put/get
 * bit-exact, dedupe, alloc/commit, eviction with pins (tails first), write-through durability
 * across close/reopen, prefetch from L3 with many concurrent prefetches, demotion on eviction,
 * verify detecting a corrupted L2 slot, and a multi-threaded stress with content checks. */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "l3_testutil.h"
#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_l3_hooks.h"
#include "tkv_store.h"
#include "tkv_store_internal.h"

#define BLK 10000u   /* not a page multiple on purpose: slots are padded to 12288 */
#define TOK 16u
#define MAXC 64      /* chains */
#define MAXB 32      /* blocks per chain */

static char *g_dir;
static uint8_t g_fp[32];
static tkv_key g_root;

static void setup(void)
{
    g_dir = tu_mkdtemp("store");
    tkv_geometry g = {2, 1, 64, TOK, TKV_DTYPE_FP8_E4M3, TKV_SCALE_PER_TENSOR, "store-test"};
    tkv_geometry_fingerprint(&g, g_fp);
    tkv_key_root(g_fp, "ns", 2, &g_root);
}

static void teardown(void)
{
    tu_rmdir(g_dir);
    g_dir = NULL;
}

static void sleep_ms(unsigned ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

/* ---- deterministic chains: tokens, keys, payloads ---- */

static void chain_tokens(uint32_t c, uint32_t n, uint32_t *tokens)
{
    for (uint32_t i = 0; i < n * TOK; i++)
        tokens[i] = c * 1000003u + i;
}

static void chain_keys(uint32_t c, uint32_t n, tkv_key *keys)
{
    uint32_t tokens[MAXB * TOK];
    chain_tokens(c, n, tokens);
    ck_assert_uint_eq(tkv_key_chain(&g_root, tokens, (size_t)n * TOK, TOK, keys, n), n);
}

static void fill(uint8_t *buf, uint32_t c, uint32_t i)
{
    uint64_t x = tu_mix(((uint64_t)c << 32 | i) + 77);
    for (size_t k = 0; k < BLK; k += 8) {
        x = tu_mix(x + k);
        memcpy(buf + k, &x, BLK - k < 8 ? BLK - k : 8);
    }
}

static bool check_payload(const uint8_t *buf, uint32_t c, uint32_t i)
{
    uint8_t want[BLK];
    fill(want, c, i);
    return memcmp(buf, want, BLK) == 0;
}

static tkv_store *open_store(uint64_t l2_blocks, bool l3, bool write_through, uint64_t l3_cap)
{
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_block(o, BLK, TOK), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_fingerprint(o, g_fp), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l2_blocks(o, l2_blocks), TKV_OK);
    if (l3) {
        char path[512];
        snprintf(path, sizeof(path), "%s/l3", g_dir);
        ck_assert_int_eq(tkv_store_opts_set_l3(o, path, l3_cap), TKV_OK);
        ck_assert_int_eq(tkv_store_opts_set_l3_io_mode(o, TKV_IO_PSYNC), TKV_OK);
    }
    ck_assert_int_eq(tkv_store_opts_set_write_through(o, write_through), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_policy(o, "lru"), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_workers(o, 3), TKV_OK);
    tkv_store *s = NULL;
    int rc = tkv_store_open(o, &s);
    ck_assert_msg(rc == TKV_OK, "open: %s", tkv_strerror(rc));
    tkv_store_opts_free(o);
    return s;
}

/* Puts blocks [0, n) of chain c; *stored = how many were newly stored. */
static int put_chain_rc(tkv_store *s, uint32_t c, uint32_t n, size_t *stored)
{
    tkv_key keys[MAXB];
    uint32_t tokens[MAXB * TOK];
    static __thread uint8_t bufs[MAXB][BLK];
    const void *payloads[MAXB];
    chain_keys(c, n, keys);
    chain_tokens(c, n, tokens);
    for (uint32_t i = 0; i < n; i++) {
        fill(bufs[i], c, i);
        payloads[i] = bufs[i];
    }
    return tkv_store_put(s, NULL, keys, tokens, payloads, n, stored);
}

/* Puts blocks [0, n) of chain c, which must succeed; returns how many were newly stored. */
static size_t put_chain(tkv_store *s, uint32_t c, uint32_t n)
{
    size_t stored = 0;
    int rc = put_chain_rc(s, c, n, &stored);
    ck_assert_msg(rc == TKV_OK, "put: %s", tkv_strerror(rc));
    return stored;
}

static size_t lookup_chain(tkv_store *s, uint32_t c, uint32_t n, uint64_t owner, uint32_t ttl,
                           uint64_t *lease, tkv_block_loc *locs)
{
    tkv_key keys[MAXB];
    chain_keys(c, n, keys);
    size_t hit = 99;
    ck_assert_int_eq(tkv_store_lookup(s, keys, n, owner, ttl, lease, &hit, locs), TKV_OK);
    return hit;
}

typedef struct info_ctx {
    size_t n, in_l2, in_l3, pinned;
    tkv_block_info infos[1024];
} info_ctx;

static int collect_info(void *arg, const tkv_block_info *b)
{
    info_ctx *ic = arg;
    if (ic->n < 1024)
        ic->infos[ic->n] = *b;
    ic->n++;
    ic->in_l2 += b->in_l2;
    ic->in_l3 += b->in_l3;
    ic->pinned += b->pins != 0;
    return 0;
}

static int stop_after_two(void *arg, const tkv_block_info *b)
{
    return ++*(int *)arg == 2;
}

static const tkv_block_info *find_info(const info_ctx *ic, const tkv_key *k)
{
    for (size_t i = 0; i < ic->n && i < 1024; i++)
        if (memcmp(&ic->infos[i].key, k, sizeof(*k)) == 0)
            return &ic->infos[i];
    return NULL;
}

/* Tails first: a block cached in L2 has its parent cached in L2 too (chains put root first). */
static void assert_l2_prefix_closed(tkv_store *s)
{
    info_ctx *ic = calloc(1, sizeof(*ic));
    tkv_store_list(s, collect_info, ic);
    static const tkv_key zero;
    for (size_t i = 0; i < ic->n && i < 1024; i++) {
        const tkv_block_info *b = &ic->infos[i];
        if (!b->in_l2 || memcmp(&b->parent, &zero, sizeof(zero)) == 0)
            continue;
        const tkv_block_info *p = find_info(ic, &b->parent);
        ck_assert_msg(p && p->in_l2, "a block is in L2 while its parent is not");
    }
    free(ic);
}

/* ============================================================================================ */

START_TEST(options_are_validated)
{
    tkv_store_opts *o = tkv_store_opts_new();
    ck_assert_int_eq(tkv_store_opts_set_block(o, 0, 16), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_block(o, 4096, 0), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_block(o, (size_t)2 << 30, 16), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_l2_blocks(o, 0), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_l3(o, "", 0), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_l3_zstd_level(o, 20), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_l3_io_mode(o, 9), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_policy(o, "no-such-policy"), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_workers(o, 0), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_lease_ttl_ms(o, 10, 5), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_lease_ttl_ms(o, 0, 5), TKV_EINVAL);
    tkv_store *s = (tkv_store *)1;
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_EINVAL); /* block size + fingerprint required */
    ck_assert_ptr_null(s);
    ck_assert_int_eq(tkv_store_opts_set_block(o, BLK, TOK), TKV_OK);
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_opts_set_fingerprint(o, g_fp), TKV_OK);
    ck_assert_int_eq(tkv_store_opts_set_l2_blocks(o, 16), TKV_OK);
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_OK); /* default policy: "hazard" if registered */
    ck_assert_uint_eq(tkv_store_block_bytes(s), BLK);
    ck_assert_uint_eq(tkv_store_block_tokens(s), TOK);
    ck_assert_uint_eq(tkv_store_l2_bytes(s), 16u * 12288);
    ck_assert_int_ge(tkv_store_l2_fd(s), 0);
    tkv_store_close(s);
    tkv_store_opts_free(o);
}
END_TEST

START_TEST(put_lookup_get_bit_exact_and_dedupe)
{
    tkv_store *s = open_store(64, false, true, 0);
    ck_assert_uint_eq(put_chain(s, 1, 10), 10);
    ck_assert_uint_eq(put_chain(s, 1, 10), 0); /* duplicates dropped */
    ck_assert_uint_eq(put_chain(s, 1, 12), 2); /* extension: only the 2 new blocks */

    /* Ask for 14: 12 hit, 2 miss. */
    tkv_block_loc locs[MAXB];
    uint64_t lease = 0;
    ck_assert_uint_eq(lookup_chain(s, 1, 14, 5, 0, &lease, locs), 12);
    ck_assert_uint_ne(lease, 0);
    uint8_t buf[BLK + 64];
    for (uint32_t i = 0; i < 12; i++) {
        ck_assert_uint_eq(locs[i].tier, TKV_TIER_L2);
        ck_assert_uint_eq(locs[i].in_l2, 1);
        ck_assert_uint_eq(locs[i].in_l3, 0);
        ck_assert_uint_ne(locs[i].l2_offset, TKV_NO_OFFSET);
        /* zero-copy view and by-value copy agree with what was put */
        ck_assert(check_payload(tkv_store_l2_ptr(s, locs[i].l2_offset), 1, i));
        memset(buf, 0, sizeof(buf));
        ck_assert_int_eq(tkv_store_get(s, lease, i, buf, sizeof(buf)), TKV_OK);
        ck_assert(check_payload(buf, 1, i));
    }
    ck_assert_int_eq(tkv_store_get(s, lease, 12, buf, sizeof(buf)), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_get(s, lease, 0, buf, BLK - 1), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_get(s, lease + 100, 0, buf, sizeof(buf)), TKV_ENOTFOUND);
    ck_assert_ptr_null(tkv_store_l2_ptr(s, locs[0].l2_offset + 1));

    /* Another chain shares no prefix; a chain with an unknown first block hits nothing. */
    uint64_t l2 = 0;
    ck_assert_uint_eq(lookup_chain(s, 2, 4, 5, 0, &l2, NULL), 0);
    ck_assert_uint_eq(l2, 0);
    /* The same tokens under another namespace salt are a different chain: no hit. */
    tkv_key other_root, keys[4];
    uint32_t tokens[4 * TOK];
    chain_tokens(1, 4, tokens);
    tkv_key_root(g_fp, "other", 5, &other_root);
    tkv_key_chain(&other_root, tokens, 4 * TOK, TOK, keys, 4);
    size_t hit = 9;
    ck_assert_int_eq(tkv_store_lookup(s, keys, 4, 5, 0, &l2, &hit, NULL), TKV_OK);
    ck_assert_uint_eq(hit, 0);

    tkv_store_stats st;
    int calls = 0;
    ck_assert_int_eq(tkv_store_list(s, stop_after_two, &calls), TKV_OK);
    ck_assert_int_eq(calls, 2); /* a nonzero return stops the walk */
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.put_dup_blocks, 20);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L2], 12);
    ck_assert_uint_eq(st.leases_active, 1);
    ck_assert_uint_eq(st.hit_blocks, 12);
    ck_assert_uint_eq(st.gets, 12);
    ck_assert_int_eq(tkv_store_lease_release(s, lease), TKV_OK);
    ck_assert_int_eq(tkv_store_lease_release(s, lease), TKV_ENOTFOUND);
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.leases_active, 0);

    /* Bad input is refused, not crashed on. */
    size_t n;
    ck_assert_int_eq(tkv_store_lookup(s, NULL, 3, 0, 0, &l2, &n, NULL), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_put(s, NULL, NULL, NULL, NULL, 2, NULL), TKV_EINVAL);
    const void *nullp[1] = {NULL};
    ck_assert_int_eq(tkv_store_put(s, NULL, keys, tokens, nullp, 1, NULL), TKV_EINVAL);
    tkv_store_close(s);
}
END_TEST

START_TEST(leases_ttl_touch_owner)
{
    tkv_store_opts *o = tkv_store_opts_new();
    tkv_store_opts_set_block(o, BLK, TOK);
    tkv_store_opts_set_fingerprint(o, g_fp);
    tkv_store_opts_set_l2_blocks(o, 32);
    tkv_store_opts_set_lease_ttl_ms(o, 100, 1000);
    tkv_store *s;
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_OK);
    tkv_store_opts_free(o);
    put_chain(s, 1, 4);

    uint64_t a, b, c, d;
    ck_assert_uint_eq(lookup_chain(s, 1, 4, 7, 60, &a, NULL), 4);   /* short TTL */
    ck_assert_uint_eq(lookup_chain(s, 1, 2, 7, 5000, &b, NULL), 2); /* clamped to 1000 */
    ck_assert_uint_eq(lookup_chain(s, 1, 3, 8, 0, &c, NULL), 3);    /* default 100 */
    ck_assert_uint_eq(lookup_chain(s, 1, 1, 9, 1000, &d, NULL), 1);
    info_ctx *ic = calloc(1, sizeof(*ic));
    tkv_store_list(s, collect_info, ic);
    tkv_key keys[4];
    chain_keys(1, 4, keys);
    ck_assert_uint_eq(find_info(ic, &keys[0])->pins, 4);
    ck_assert_uint_eq(find_info(ic, &keys[3])->pins, 1);
    ck_assert_uint_eq(find_info(ic, &keys[0])->hits, 4);

    /* a expires (60 ms); touching c keeps it alive past its default 100 ms. */
    sleep_ms(40);
    ck_assert_int_eq(tkv_store_lease_touch(s, c, 400), TKV_OK);
    sleep_ms(150);
    int rc = tkv_store_lease_touch(s, a, 100);
    ck_assert_msg(rc == TKV_EXPIRED, "expired lease answered %s", tkv_strerror(rc));
    tkv_block_loc locs[4];
    size_t nb = 0;
    ck_assert_int_eq(tkv_store_lease_locs(s, c, locs, 4, &nb), TKV_OK);
    ck_assert_uint_eq(nb, 3);
    ck_assert_uint_eq(locs[2].tier, TKV_TIER_L2);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_ge(st.leases_expired, 1);
    ck_assert_uint_eq(st.leases_active, 3);

    /* The dead client's leases go with its owner id. */
    ck_assert_uint_eq(tkv_store_release_owner(s, 7), 1); /* b; a already expired */
    ck_assert_int_eq(tkv_store_lease_touch(s, b, 100), TKV_ENOTFOUND);
    ck_assert_uint_eq(tkv_store_release_owner(s, 7), 0);
    ck_assert_int_eq(tkv_store_lease_release(s, d), TKV_OK);

    /* The reaper expires c without anyone asking; then nothing is pinned. */
    sleep_ms(600);
    memset(ic, 0, sizeof(*ic));
    tkv_store_list(s, collect_info, ic);
    ck_assert_uint_eq(ic->pinned, 0);
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.leases_active, 0);
    free(ic);
    tkv_store_close(s);
}
END_TEST

START_TEST(alloc_write_commit_abort)
{
    tkv_store *s = open_store(16, false, true, 0);
    uint64_t id, offs[6];
    ck_assert_int_eq(tkv_store_alloc(s, 17, 1, &id, offs), TKV_EFULL);
    ck_assert_int_eq(tkv_store_alloc(s, 6, 1, &id, offs), TKV_OK);
    /* two slots written in place (as an engine would), two through alloc_write */
    uint8_t buf[BLK];
    for (uint32_t i = 0; i < 4; i++) {
        if (i < 2) {
            fill(tkv_store_l2_ptr(s, offs[i]), 3, i);
        } else {
            fill(buf, 3, i);
            ck_assert_int_eq(tkv_store_alloc_write(s, id, i, buf), TKV_OK);
        }
    }
    ck_assert_int_eq(tkv_store_alloc_write(s, id, 6, buf), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_alloc_write(s, id + 1, 0, buf), TKV_ENOTFOUND);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.allocs_active, 1);
    /* WRITING blocks are invisible */
    uint64_t lease;
    ck_assert_uint_eq(lookup_chain(s, 3, 4, 1, 0, &lease, NULL), 0);

    /* block 0 of chain 3 exists already: its slot is dropped as a duplicate */
    ck_assert_uint_eq(put_chain(s, 3, 1), 1);
    tkv_key keys[4];
    uint32_t tokens[4 * TOK];
    chain_keys(3, 4, keys);
    chain_tokens(3, 4, tokens);
    size_t stored = 0;
    ck_assert_int_eq(tkv_store_commit(s, id, NULL, keys, tokens, 4, &stored), TKV_OK);
    ck_assert_uint_eq(stored, 3);
    ck_assert_int_eq(tkv_store_commit(s, id, NULL, keys, tokens, 4, &stored), TKV_ENOTFOUND);
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.allocs_active, 0);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L2], 4); /* the 2 unused + 1 dup slots freed */

    tkv_block_loc locs[4];
    ck_assert_uint_eq(lookup_chain(s, 3, 4, 1, 0, &lease, locs), 4);
    for (uint32_t i = 0; i < 4; i++) {
        ck_assert_int_eq(tkv_store_get(s, lease, i, buf, sizeof(buf)), TKV_OK);
        ck_assert(check_payload(buf, 3, i));
    }
    tkv_store_lease_release(s, lease);

    /* abort and owner release give slots back: the whole pool can be allocated again */
    uint64_t o2[16];
    ck_assert_int_eq(tkv_store_alloc(s, 12, 2, &id, o2), TKV_OK);
    ck_assert_int_eq(tkv_store_abort(s, id), TKV_OK);
    ck_assert_int_eq(tkv_store_abort(s, id), TKV_ENOTFOUND);
    ck_assert_int_eq(tkv_store_alloc(s, 12, 2, &id, o2), TKV_OK);
    ck_assert_uint_eq(tkv_store_release_owner(s, 2), 1);
    ck_assert_int_eq(tkv_store_alloc(s, 16, 2, &id, o2), TKV_OK); /* evicts the 4 blocks */
    ck_assert_int_eq(tkv_store_abort(s, id), TKV_OK);
    tkv_store_close(s);
}
END_TEST

START_TEST(eviction_never_drops_pinned_and_goes_tails_first)
{
    tkv_store *s = open_store(8, false, true, 0);
    ck_assert_uint_eq(put_chain(s, 1, 4), 4);
    uint64_t lease;
    ck_assert_uint_eq(lookup_chain(s, 1, 4, 1, 10000, &lease, NULL), 4);
    /* 12 more blocks through an 8-slot L2 whose 4 slots are pinned */
    for (uint32_t c = 2; c < 5; c++) {
        put_chain(s, c, 4);
        assert_l2_prefix_closed(s);
    }
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_le(st.blocks_tier[TKV_TIER_L2], 8);
    ck_assert_uint_gt(st.evictions, 0);
    uint64_t l2;
    ck_assert_uint_eq(lookup_chain(s, 1, 4, 1, 0, &l2, NULL), 4); /* pinned chain intact */
    tkv_store_lease_release(s, l2);

    /* Explicit eviction skips and counts pinned blocks. */
    tkv_key keys[4];
    chain_keys(1, 4, keys);
    size_t ev = 9, pin = 9;
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L2, keys, 4, &ev, &pin), TKV_OK);
    ck_assert_uint_eq(ev, 0);
    ck_assert_uint_eq(pin, 4);
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L1, NULL, 0, &ev, &pin), TKV_EUNSUPPORTED);
    ck_assert_int_eq(tkv_store_evict(s, 7, NULL, 0, &ev, &pin), TKV_EINVAL);
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L3, NULL, 0, &ev, &pin), TKV_EUNSUPPORTED);

    /* Released: now they can go (without L3 they are dropped). */
    ck_assert_int_eq(tkv_store_lease_release(s, lease), TKV_OK);
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L2, keys + 2, 2, &ev, &pin), TKV_OK);
    ck_assert_uint_eq(ev, 2);
    ck_assert_uint_eq(pin, 0);
    ck_assert_uint_eq(lookup_chain(s, 1, 4, 1, 0, &l2, NULL), 2);
    tkv_store_lease_release(s, l2);
    assert_l2_prefix_closed(s);
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L2, NULL, 0, &ev, &pin), TKV_OK);
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L2], 0);
    /* L2 full of pinned allocations: a put finds no room and says so */
    uint64_t id, offs[8];
    ck_assert_int_eq(tkv_store_alloc(s, 8, 1, &id, offs), TKV_OK);
    tkv_key k1[1];
    chain_keys(9, 1, k1);
    uint32_t tokens[TOK] = {0};
    uint8_t buf[BLK];
    const void *pl[1] = {buf};
    size_t stored = 5;
    ck_assert_int_eq(tkv_store_put(s, NULL, k1, tokens, pl, 1, &stored), TKV_EFULL);
    ck_assert_uint_eq(stored, 0);
    tkv_store_close(s); /* with the allocation outstanding: freed by close */
}
END_TEST

/* A put longer than L2 streams through it in chunks (a quarter of L2 each). Room for a chunk
 * is never made by evicting the block it hangs under (the only tail left here), nor, without
 * L3, by cutting a chain in its middle: the put keeps the prefix that fits, all of it
 * reachable, and succeeds with the count stored. */
START_TEST(put_longer_than_l2_keeps_a_reachable_prefix)
{
    tkv_store *s = open_store(8, false, false, 0);
    size_t stored = 99;
    ck_assert_int_eq(put_chain_rc(s, 1, 16, &stored), TKV_OK);
    ck_assert_uint_eq(stored, 8);
    assert_l2_prefix_closed(s);
    uint64_t lease;
    ck_assert_uint_eq(lookup_chain(s, 1, 16, 1, 0, &lease, NULL), 8);
    tkv_store_lease_release(s, lease);
    /* another chain takes its room from the first one's tail */
    ck_assert_uint_eq(put_chain(s, 2, 4), 4);
    assert_l2_prefix_closed(s);
    ck_assert_uint_eq(lookup_chain(s, 1, 16, 1, 0, &lease, NULL), 4);
    tkv_store_lease_release(s, lease);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L2], 8);
    tkv_store_close(s);
}
END_TEST

START_TEST(write_through_survives_reopen)
{
    tkv_store *s = open_store(64, true, true, 0);
    ck_assert_uint_eq(put_chain(s, 1, 20), 20);
    ck_assert_uint_eq(put_chain(s, 2, 5), 5);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L3], 25);
    ck_assert_uint_eq(st.writeback_queue, 0);
    ck_assert_uint_ge(st.demotions, 25);
    tkv_store_close(s);

    s = open_store(64, true, true, 0);
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L3], 25);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L2], 0);
    tkv_block_loc locs[MAXB];
    uint64_t lease;
    ck_assert_uint_eq(lookup_chain(s, 1, 22, 1, 0, &lease, locs), 20);
    uint8_t buf[BLK];
    for (uint32_t i = 0; i < 20; i++) {
        ck_assert_uint_eq(locs[i].tier, TKV_TIER_L3);
        ck_assert_uint_eq(locs[i].l2_offset, TKV_NO_OFFSET);
        memset(buf, 0, sizeof(buf));
        ck_assert_int_eq(tkv_store_get(s, lease, i, buf, sizeof(buf)), TKV_OK);
        ck_assert(check_payload(buf, 1, i));
    }
    /* The chain structure came back from the parent keys. */
    info_ctx *ic = calloc(1, sizeof(*ic));
    tkv_store_list(s, collect_info, ic);
    ck_assert_uint_eq(ic->n, 25);
    tkv_key keys[20];
    chain_keys(1, 20, keys);
    for (uint32_t i = 0; i < 20; i++) {
        const tkv_block_info *b = find_info(ic, &keys[i]);
        ck_assert_ptr_nonnull(b);
        ck_assert_uint_eq(b->depth, i);
        ck_assert_uint_eq(b->state, TKV_BLOCK_READY);
        if (i)
            ck_assert_mem_eq(&b->parent, &keys[i - 1], sizeof(tkv_key));
    }
    free(ic);
    tkv_store_lease_release(s, lease);
    tkv_store_close(s);

    /* Another fingerprint refuses to open the same L3. */
    tkv_store_opts *o = tkv_store_opts_new();
    uint8_t fp2[32];
    memcpy(fp2, g_fp, 32);
    fp2[0] ^= 1;
    char path[512];
    snprintf(path, sizeof(path), "%s/l3", g_dir);
    tkv_store_opts_set_block(o, BLK, TOK);
    tkv_store_opts_set_fingerprint(o, fp2);
    tkv_store_opts_set_l3(o, path, 0);
    ck_assert_int_eq(tkv_store_open(o, &s), TKV_EGEOMETRY);
    tkv_store_opts_free(o);
}
END_TEST

/* ---- prefetch ---- */

static atomic_int g_callbacks;

static void on_done(void *arg, uint64_t ticket, int status)
{
    atomic_fetch_add(&g_callbacks, 1);
    *(int *)arg = status;
}

typedef struct pf_arg {
    tkv_store *s;
    uint32_t chain;
    int failures;
} pf_arg;

static void *prefetch_thread(void *p)
{
    pf_arg *a = p;
    for (int round = 0; round < 3; round++) {
        uint64_t lease = 0;
        tkv_key keys[8];
        chain_keys(a->chain, 8, keys);
        size_t hit = 0;
        if (tkv_store_lookup(a->s, keys, 8, a->chain, 0, &lease, &hit, NULL) != TKV_OK || hit != 8) {
            a->failures++;
            continue;
        }
        int cb_status = 12345, status = -1;
        uint64_t t1, t2;
        /* two prefetches of the same lease at once: the second waits for the first's blocks */
        if (tkv_store_prefetch(a->s, lease, TKV_TIER_L2, on_done, &cb_status, &t1) != TKV_OK ||
            tkv_store_prefetch(a->s, lease, TKV_TIER_L2, NULL, NULL, &t2) != TKV_OK) {
            a->failures++;
            continue;
        }
        if (tkv_store_wait(a->s, t1, 10000, &status) != TKV_OK || status != TKV_OK)
            a->failures++;
        if (tkv_store_wait(a->s, t2, 10000, &status) != TKV_OK || status != TKV_OK)
            a->failures++;
        tkv_block_loc locs[8];
        size_t nb;
        tkv_store_lease_locs(a->s, lease, locs, 8, &nb);
        uint8_t *buf = malloc(BLK);
        for (uint32_t i = 0; i < 8; i++) {
            if (!locs[i].in_l2 || !check_payload(tkv_store_l2_ptr(a->s, locs[i].l2_offset), a->chain, i))
                a->failures++;
            if (tkv_store_get(a->s, lease, i, buf, BLK) != TKV_OK || !check_payload(buf, a->chain, i))
                a->failures++;
        }
        free(buf);
        tkv_store_lease_release(a->s, lease);
        /* push the chain back down to L3 for the next round */
        size_t ev, pin;
        tkv_store_evict(a->s, TKV_TIER_L2, keys, 8, &ev, &pin);
    }
    return NULL;
}

START_TEST(prefetch_from_l3_many_at_once)
{
    tkv_store *s = open_store(128, true, true, 0);
    for (uint32_t c = 0; c < 8; c++)
        ck_assert_uint_eq(put_chain(s, c, 8), 8);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    size_t ev, pin;
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L2, NULL, 0, &ev, &pin), TKV_OK);
    ck_assert_uint_eq(ev, 64);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L2], 0);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L3], 64);

    uint64_t t;
    ck_assert_int_eq(tkv_store_prefetch(s, 999, TKV_TIER_L2, NULL, NULL, &t), TKV_ENOTFOUND);
    uint64_t lease;
    ck_assert_uint_eq(lookup_chain(s, 0, 8, 1, 0, &lease, NULL), 8);
    ck_assert_int_eq(tkv_store_prefetch(s, lease, TKV_TIER_L1, NULL, NULL, &t), TKV_EUNSUPPORTED);
    ck_assert_int_eq(tkv_store_prefetch(s, lease, TKV_TIER_L3, NULL, NULL, &t), TKV_EINVAL);
    /* A zero timeout answers at once: done, or TKV_ETIMEDOUT with the ticket still valid. */
    ck_assert_int_eq(tkv_store_prefetch(s, lease, TKV_TIER_L2, NULL, NULL, &t), TKV_OK);
    int wst = -1;
    int wrc = tkv_store_wait(s, t, 0, &wst);
    ck_assert(wrc == TKV_OK || wrc == TKV_ETIMEDOUT);
    if (wrc == TKV_ETIMEDOUT)
        ck_assert_int_eq(tkv_store_wait(s, t, -1, &wst), TKV_OK);
    ck_assert_int_eq(wst, TKV_OK);
    ck_assert_int_eq(tkv_store_wait(s, t, 0, &wst), TKV_ENOTFOUND); /* answered once */
    tkv_store_lease_release(s, lease);
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L2, NULL, 0, &ev, &pin), TKV_OK);
    ck_assert_uint_eq(ev, 8);

    atomic_store(&g_callbacks, 0);
    pthread_t th[8];
    pf_arg args[8];
    for (uint32_t c = 0; c < 8; c++) {
        args[c] = (pf_arg){s, c, 0};
        pthread_create(&th[c], NULL, prefetch_thread, &args[c]);
    }
    for (int c = 0; c < 8; c++) {
        pthread_join(th[c], NULL);
        ck_assert_int_eq(args[c].failures, 0);
    }
    ck_assert_int_eq(atomic_load(&g_callbacks), 8 * 3);
    tkv_store_get_stats(s, &st);
    ck_assert_uint_ge(st.promotions, 8 * 8 * 3);
    ck_assert_uint_eq(st.checksum_failures, 0);
    ck_assert_uint_eq(st.leases_active, 0);
    ck_assert_int_eq(tkv_store_wait(s, t + 1000, 0, NULL), TKV_ENOTFOUND);
    tkv_store_close(s);
}
END_TEST

START_TEST(demotion_on_eviction_without_write_through)
{
    tkv_store *s = open_store(8, true, false, 0);
    for (uint32_t c = 0; c < 4; c++)
        ck_assert_uint_eq(put_chain(s, c, 6), 6); /* 24 blocks through 8 slots */
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_le(st.blocks_tier[TKV_TIER_L2], 8);
    ck_assert_uint_ge(st.blocks_tier[TKV_TIER_L3], 16);
    ck_assert_uint_ge(st.demotions, 16);
    /* Nothing was lost: every block reads back bit-exact from whichever tier holds it. */
    uint8_t buf[BLK];
    for (uint32_t c = 0; c < 4; c++) {
        uint64_t lease;
        ck_assert_uint_eq(lookup_chain(s, c, 6, 1, 0, &lease, NULL), 6);
        for (uint32_t i = 0; i < 6; i++) {
            ck_assert_int_eq(tkv_store_get(s, lease, i, buf, sizeof(buf)), TKV_OK);
            ck_assert(check_payload(buf, c, i));
        }
        tkv_store_lease_release(s, lease);
    }
    /* flush writes down what is only in L2; a reopen then finds all 24 */
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    tkv_store_close(s);
    s = open_store(8, true, false, 0);
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L3], 24);
    tkv_store_close(s);
}
END_TEST

START_TEST(l3_capacity_evicts_tails)
{
    /* L3 room for 10 blocks: writing 3 chains of 6 keeps 10, dropping chain tails first. */
    tkv_store *s = open_store(64, true, true, 10 * (uint64_t)BLK);
    for (uint32_t c = 0; c < 3; c++) {
        put_chain(s, c, 6);
        ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    }
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_le(st.blocks_tier[TKV_TIER_L3], 10);
    ck_assert_uint_eq(st.blocks_tier[TKV_TIER_L2], 18);
    info_ctx *ic = calloc(1, sizeof(*ic));
    tkv_store_list(s, collect_info, ic);
    static const tkv_key zero;
    for (size_t i = 0; i < ic->n; i++) {
        const tkv_block_info *b = &ic->infos[i];
        if (b->in_l3 && memcmp(&b->parent, &zero, sizeof(zero)) != 0)
            ck_assert_msg(find_info(ic, &b->parent)->in_l3, "L3 kept a block but not its parent");
    }
    free(ic);
    tkv_store_close(s);
}
END_TEST

START_TEST(verify_finds_a_corrupted_l2_slot)
{
    /* Without L3: the bad block is dropped, the prefix before it stays. */
    tkv_store *s = open_store(16, false, true, 0);
    put_chain(s, 1, 4);
    tkv_block_loc locs[4];
    uint64_t lease;
    lookup_chain(s, 1, 4, 1, 0, &lease, locs);
    tkv_store_lease_release(s, lease);
    ((uint8_t *)tkv_store_l2_ptr(s, locs[2].l2_offset))[1234] ^= 0x40;
    uint64_t checked = 0, bad = 0;
    ck_assert_int_eq(tkv_store_verify(s, NULL, NULL, &checked, &bad), TKV_OK);
    ck_assert_uint_eq(checked, 4);
    ck_assert_uint_eq(bad, 1);
    ck_assert_uint_eq(lookup_chain(s, 1, 4, 1, 0, &lease, NULL), 2);
    tkv_store_lease_release(s, lease);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_eq(st.checksum_failures, 1);
    ck_assert_int_eq(tkv_store_verify(s, NULL, NULL, &checked, &bad), TKV_OK);
    ck_assert_uint_eq(bad, 0);
    tkv_store_close(s);

    /* With L3: the good L3 copy still serves the block. */
    s = open_store(16, true, true, 0);
    put_chain(s, 2, 4);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    lookup_chain(s, 2, 4, 1, 0, &lease, locs);
    tkv_store_lease_release(s, lease);
    ((uint8_t *)tkv_store_l2_ptr(s, locs[1].l2_offset))[0] ^= 1;
    ck_assert_int_eq(tkv_store_verify(s, NULL, NULL, &checked, &bad), TKV_OK);
    ck_assert_uint_eq(checked, 8); /* 4 in L2 + 4 in L3 */
    ck_assert_uint_eq(bad, 1);
    ck_assert_uint_eq(lookup_chain(s, 2, 4, 1, 0, &lease, locs), 4);
    ck_assert_uint_eq(locs[1].tier, TKV_TIER_L3);
    uint8_t buf[BLK];
    ck_assert_int_eq(tkv_store_get(s, lease, 1, buf, sizeof(buf)), TKV_OK);
    ck_assert(check_payload(buf, 2, 1));
    tkv_store_lease_release(s, lease);
    tkv_store_close(s);
}
END_TEST


START_TEST(corrupt_l3_block_is_never_promoted)
{
    tkv_store *s = open_store(32, true, true, 0);
    put_chain(s, 4, 4);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    tkv_store_close(s);

    /* Flip a byte of block 2's payload on disk. */
    char dir[512], seg[1024];
    snprintf(dir, sizeof(dir), "%s/l3", g_dir);
    tkv_l3_opts *lo = tkv_l3_opts_new();
    tkv_l3_opts_set_fingerprint(lo, g_fp);
    tkv_l3_opts_set_max_block_bytes(lo, BLK);
    tkv_l3_opts_set_io_mode(lo, TKV_IO_PSYNC);
    tkv_l3 *l3;
    ck_assert_int_eq(tkv_l3_open(dir, lo, &l3), TKV_OK);
    tkv_key keys[4];
    chain_keys(4, 4, keys);
    uint64_t off = 0, len = 0;
    ck_assert_int_eq(tkv_l3_locate(l3, &keys[2], seg, sizeof(seg), &off, &len), TKV_OK);
    tkv_l3_close(l3);
    tkv_l3_opts_free(lo);
    int fd = open(seg, O_RDWR);
    ck_assert_int_ge(fd, 0);
    uint8_t byte;
    ck_assert_int_eq(pread(fd, &byte, 1, (off_t)(off + len / 2)), 1);
    byte ^= 0x10;
    ck_assert_int_eq(pwrite(fd, &byte, 1, (off_t)(off + len / 2)), 1);
    close(fd);

    s = open_store(32, true, true, 0);
    uint64_t lease, ticket;
    ck_assert_uint_eq(lookup_chain(s, 4, 4, 1, 0, &lease, NULL), 4); /* the index still has it */
    int cb_status = 0, status = 0;
    ck_assert_int_eq(tkv_store_prefetch(s, lease, TKV_TIER_L2, on_done, &cb_status, &ticket), TKV_OK);
    ck_assert_int_eq(tkv_store_wait(s, ticket, 10000, &status), TKV_OK);
    ck_assert_int_eq(status, TKV_ECHECKSUM);
    ck_assert_int_eq(cb_status, TKV_ECHECKSUM);
    tkv_block_loc locs[4];
    size_t nb;
    ck_assert_int_eq(tkv_store_lease_locs(s, lease, locs, 4, &nb), TKV_OK);
    ck_assert_uint_eq(locs[0].tier, TKV_TIER_L2);
    ck_assert_uint_eq(locs[1].tier, TKV_TIER_L2);
    ck_assert_uint_eq(locs[2].tier, TKV_TIER_NONE); /* dropped, not shown as present */
    ck_assert_uint_eq(locs[3].tier, TKV_TIER_L2);
    uint8_t buf[BLK];
    ck_assert_int_eq(tkv_store_get(s, lease, 2, buf, sizeof(buf)), TKV_ENOTFOUND);
    ck_assert_int_eq(tkv_store_get(s, lease, 3, buf, sizeof(buf)), TKV_OK);
    ck_assert(check_payload(buf, 4, 3));
    tkv_store_lease_release(s, lease);
    ck_assert_uint_eq(lookup_chain(s, 4, 4, 1, 0, &lease, NULL), 2);
    tkv_store_lease_release(s, lease);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_ge(st.checksum_failures, 1);
    tkv_store_close(s);
}
END_TEST

START_TEST(l3_write_error_degrades_to_read_only)
{
    tkv_store *s = open_store(32, true, true, 0);
    put_chain(s, 5, 2);
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    tkv_l3_inject_write_error(tkv_store_l3_handle(s), ENOSPC, 0);
    put_chain(s, 6, 4);
    ck_assert_int_eq(tkv_store_flush(s), TKV_EREADONLY);
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_int_eq(st.l3_readonly, 1);
    ck_assert_uint_ge(st.io_errors, 1);
    /* L2 keeps serving everything, L3 keeps serving what it had. */
    uint64_t lease;
    uint8_t buf[BLK];
    ck_assert_uint_eq(lookup_chain(s, 6, 4, 1, 0, &lease, NULL), 4);
    for (uint32_t i = 0; i < 4; i++) {
        ck_assert_int_eq(tkv_store_get(s, lease, i, buf, sizeof(buf)), TKV_OK);
        ck_assert(check_payload(buf, 6, i));
    }
    tkv_store_lease_release(s, lease);
    size_t ev, pin;
    ck_assert_int_eq(tkv_store_evict(s, TKV_TIER_L2, NULL, 0, &ev, &pin), TKV_OK);
    ck_assert_uint_eq(ev, 6); /* read-only L3: L2 copies are dropped, not demoted */
    ck_assert_uint_eq(lookup_chain(s, 5, 2, 1, 0, &lease, NULL), 2);
    ck_assert_int_eq(tkv_store_get(s, lease, 1, buf, sizeof(buf)), TKV_OK);
    ck_assert(check_payload(buf, 5, 1));
    tkv_store_lease_release(s, lease);
    ck_assert_uint_eq(lookup_chain(s, 6, 4, 1, 0, &lease, NULL), 0);
    ck_assert_uint_eq(put_chain(s, 7, 3), 3); /* puts still land in L2 */
    tkv_store_close(s);
}
END_TEST

/* ---- stress: several threads, random operations, every read checked ---- */

typedef struct stress_arg {
    tkv_store *s;
    unsigned seed;
    int bad_reads;
    int ops;
} stress_arg;

static void *stress_thread(void *p)
{
    stress_arg *a = p;
    unsigned r = a->seed;
    uint8_t *buf = malloc(BLK);
    uint64_t end = tkv_now_ns() + 1500000000ull;
    while (tkv_now_ns() < end) {
        r = r * 1103515245u + 12345u;
        uint32_t c = (r >> 16) % 24, n = 1 + (r >> 8) % 8;
        switch ((r >> 4) % 6) {
        case 0:
        case 1:
            put_chain(a->s, c, n);
            break;
        case 2:
        case 3: {
            uint64_t lease;
            tkv_key keys[8];
            chain_keys(c, n, keys);
            size_t hit = 0;
            tkv_block_loc locs[8];
            if (tkv_store_lookup(a->s, keys, n, a->seed, 0, &lease, &hit, locs) != TKV_OK)
                a->bad_reads++;
            if (hit && (r & 1)) {
                uint64_t t;
                int st;
                if (tkv_store_prefetch(a->s, lease, TKV_TIER_L2, NULL, NULL, &t) == TKV_OK)
                    tkv_store_wait(a->s, t, -1, &st);
            }
            for (uint32_t i = 0; i < hit; i++) {
                int rc = tkv_store_get(a->s, lease, i, buf, BLK);
                /* a block may be gone (L2 only, evicted before the pin): never wrong bytes */
                if (rc == TKV_OK && !check_payload(buf, c, i))
                    a->bad_reads++;
                if (rc != TKV_OK && rc != TKV_ENOTFOUND)
                    a->bad_reads++;
            }
            if (hit)
                tkv_store_lease_release(a->s, lease);
            break;
        }
        case 4: {
            tkv_key keys[8];
            chain_keys(c, n, keys);
            size_t ev, pin;
            tkv_store_evict(a->s, (r & 2) ? TKV_TIER_L2 : TKV_TIER_L3, keys, n, &ev, &pin);
            break;
        }
        case 5: {
            uint64_t id, offs[4];
            if (tkv_store_alloc(a->s, 4, a->seed, &id, offs) == TKV_OK) {
                for (uint32_t i = 0; i < 4; i++)
                    fill(tkv_store_l2_ptr(a->s, offs[i]), c + 100, i);
                tkv_key keys[4];
                uint32_t tokens[4 * TOK];
                chain_keys(c + 100, 4, keys);
                chain_tokens(c + 100, 4, tokens);
                if (r & 8)
                    tkv_store_commit(a->s, id, NULL, keys, tokens, 4, NULL);
                else
                    tkv_store_abort(a->s, id);
            }
            break;
        }
        }
        a->ops++;
    }
    free(buf);
    return NULL;
}

START_TEST(stress_threads)
{
    tkv_store *s = open_store(48, true, true, 0);
    pthread_t th[4];
    stress_arg args[4];
    for (unsigned i = 0; i < 4; i++) {
        args[i] = (stress_arg){s, 1000 + i, 0, 0};
        pthread_create(&th[i], NULL, stress_thread, &args[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        ck_assert_int_eq(args[i].bad_reads, 0);
        /* Nobody starved for the whole run. (How many ops fit in 1.5 s is the disk's business:
         * write-through syncs, and a loaded CI disk can take a second for one.) */
        ck_assert_int_gt(args[i].ops, 0);
    }
    tkv_store_stats st;
    tkv_store_get_stats(s, &st);
    ck_assert_uint_le(st.blocks_tier[TKV_TIER_L2], 48);
    ck_assert_uint_eq(st.leases_active, 0);
    ck_assert_uint_eq(st.allocs_active, 0);
    ck_assert_uint_eq(st.checksum_failures, 0);
    /* Every L2 slot accounted for: all of them can be allocated once nothing is pinned. */
    ck_assert_int_eq(tkv_store_flush(s), TKV_OK);
    uint64_t id, offs[48];
    ck_assert_int_eq(tkv_store_alloc(s, 48, 1, &id, offs), TKV_OK);
    ck_assert_int_eq(tkv_store_abort(s, id), TKV_OK);
    uint64_t checked, bad;
    ck_assert_int_eq(tkv_store_verify(s, NULL, NULL, &checked, &bad), TKV_OK);
    ck_assert_uint_eq(bad, 0);
    tkv_store_close(s);
}
END_TEST

int main(void)
{
    tkv_log_level = TKV_LOG_WARN; /* the open/close lines of every case are noise here */
    Suite *s = suite_create("store");
    TCase *tc = tcase_create("store");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 60);
    tcase_add_test(tc, options_are_validated);
    tcase_add_test(tc, put_lookup_get_bit_exact_and_dedupe);
    tcase_add_test(tc, leases_ttl_touch_owner);
    tcase_add_test(tc, alloc_write_commit_abort);
    tcase_add_test(tc, eviction_never_drops_pinned_and_goes_tails_first);
    tcase_add_test(tc, put_longer_than_l2_keeps_a_reachable_prefix);
    tcase_add_test(tc, write_through_survives_reopen);
    tcase_add_test(tc, prefetch_from_l3_many_at_once);
    tcase_add_test(tc, demotion_on_eviction_without_write_through);
    tcase_add_test(tc, l3_capacity_evicts_tails);
    tcase_add_test(tc, verify_finds_a_corrupted_l2_slot);
    tcase_add_test(tc, corrupt_l3_block_is_never_promoted);
    tcase_add_test(tc, l3_write_error_degrades_to_read_only);
    tcase_add_test(tc, stress_threads);
    suite_add_tcase(s, tc);
    SRunner *sr = srunner_create(s);
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? EXIT_FAILURE : EXIT_SUCCESS;
}
