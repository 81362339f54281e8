/* test_l3.c - unit suite of the L3 store (storage/l3.c) on a real file system, real RocksDB
 * and real io_uring.
 *
 * The whole suite runs once per I/O path: `storage_test_l3` uses pread/pwrite (always
 * available), `storage_test_l3 --io=uring` uses io_uring and exits 77 (skipped) only where
 * the kernel refuses io_uring (registered in tests/storage/l3.cmake).
 */
#include <check.h>
#include <errno.h>
#include <fcntl.h>
#include <liburing.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <rocksdb/c.h>

#include "l3_testutil.h"
#include "tkv_l3.h"
#include "tkv_l3_hooks.h"

static int g_io_mode = TKV_IO_PSYNC;
static char *g_dir;

#define BLK (64 * 1024)

static void setup(void) { g_dir = tu_mkdtemp("l3"); }
static void teardown(void)
{
    tu_rmdir(g_dir);
    g_dir = NULL;
}

static tkv_l3 *open_ok(int level, uint64_t segment_bytes)
{
    tkv_l3 *l3 = NULL;
    int rc = tu_l3_open(g_dir, g_io_mode, level, BLK, segment_bytes, 1, &l3);
    ck_assert_msg(rc == TKV_OK, "open: %s", tkv_strerror(rc));
    tkv_l3_stats st;
    tkv_l3_get_stats(l3, &st);
    ck_assert_int_eq(st.io_mode, g_io_mode);
    return l3;
}

/* Puts blocks [first, first+n) of a chain with payload fill(seed = index). */
static void put_range(tkv_l3 *l3, uint64_t first, size_t n, size_t len, int compressible)
{
    tkv_l3_put_req *reqs = calloc(n, sizeof(*reqs));
    uint8_t **bufs = calloc(n, sizeof(*bufs));
    uint32_t tokens[64];
    for (size_t i = 0; i < n; i++) {
        uint64_t id = first + i;
        bufs[i] = malloc(len);
        if (compressible)
            tu_fill_compressible(bufs[i], len, id);
        else
            tu_fill_random(bufs[i], len, id);
        for (int t = 0; t < 64; t++)
            tokens[t] = (uint32_t)(id * 64 + (uint64_t)t);
        tu_key(&reqs[i].key, 1, id);
        tu_key(&reqs[i].parent, 1, id - 1);
        reqs[i].payload = bufs[i];
        reqs[i].len = len;
        reqs[i].tokens = tokens; /* copied into the record at commit; same for all: fine */
        reqs[i].num_tokens = 64;
    }
    int rc = tkv_l3_put_batch(l3, reqs, n);
    ck_assert_msg(rc == TKV_OK, "put_batch: %s", tkv_strerror(rc));
    for (size_t i = 0; i < n; i++) {
        ck_assert(reqs[i].status == TKV_OK || reqs[i].status == TKV_EEXIST);
        free(bufs[i]);
    }
    free(bufs);
    free(reqs);
}

/* Reads block id and compares it with what put_range wrote; returns the status. */
static int check_block(tkv_l3 *l3, uint64_t id, size_t len, int compressible)
{
    uint8_t *want = malloc(len), *got = malloc(BLK + 4096);
    if (compressible)
        tu_fill_compressible(want, len, id);
    else
        tu_fill_random(want, len, id);
    tkv_l3_get_req g = {.dst = got, .cap = BLK + 4096};
    tu_key(&g.key, 1, id);
    int rc = tkv_l3_get_batch(l3, &g, 1);
    ck_assert_int_eq(rc, g.status);
    if (rc == TKV_OK) {
        ck_assert_uint_eq(g.len, len);
        ck_assert_msg(memcmp(want, got, len) == 0, "block %llu differs",
                      (unsigned long long)id);
    } else {
        /* whatever failed, the wrong bytes are not handed out */
        ck_assert(g.len == 0 || rc == TKV_EINVAL);
    }
    free(want);
    free(got);
    return rc;
}

/* ---- round trip ------------------------------------------------------------------------- */

START_TEST(test_round_trip)
{
    tkv_l3 *l3 = open_ok(1, 0);
    put_range(l3, 0, 16, BLK, 0);
    put_range(l3, 16, 5, 10007, 0); /* unaligned length: padded slots, bounce buffers */
    for (uint64_t i = 0; i < 16; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 0), TKV_OK);
    for (uint64_t i = 16; i < 21; i++)
        ck_assert_int_eq(check_block(l3, i, 10007, 0), TKV_OK);
    ck_assert_int_eq(check_block(l3, 999, BLK, 0), TKV_ENOTFOUND);

    /* a batch read with everything in flight, into aligned buffers (the zero-copy path) */
    tkv_l3_get_req g[16];
    void *bufs[16];
    for (int i = 0; i < 16; i++) {
        ck_assert_int_eq(posix_memalign(&bufs[i], 4096, BLK), 0);
        g[i] = (tkv_l3_get_req){.dst = bufs[i], .cap = BLK};
        tu_key(&g[i].key, 1, (uint64_t)i);
    }
    ck_assert_int_eq(tkv_l3_get_batch(l3, g, 16), TKV_OK);
    uint8_t *want = malloc(BLK);
    for (int i = 0; i < 16; i++) {
        tu_fill_random(want, BLK, (uint64_t)i);
        ck_assert_int_eq(g[i].status, TKV_OK);
        ck_assert(memcmp(want, bufs[i], BLK) == 0);
        free(bufs[i]);
    }
    free(want);

    /* duplicates are reported, not stored twice */
    tkv_l3_stats st;
    tkv_l3_get_stats(l3, &st);
    ck_assert_uint_eq(st.num_blocks, 21);
    put_range(l3, 0, 2, BLK, 0);
    tkv_l3_stats st2;
    tkv_l3_get_stats(l3, &st2);
    ck_assert_uint_eq(st2.num_blocks, 21);
    ck_assert_uint_eq(st2.disk_bytes, st.disk_bytes);

    /* a too-small destination is refused with the needed length */
    uint8_t small[100];
    tkv_l3_get_req s = {.dst = small, .cap = sizeof(small)};
    tu_key(&s.key, 1, 0);
    ck_assert_int_eq(tkv_l3_get_batch(l3, &s, 1), TKV_EINVAL);
    ck_assert_uint_eq(s.len, BLK);
    tkv_l3_close(l3);
}
END_TEST

START_TEST(test_capacity)
{
    uint8_t fp[TKV_KEY_BYTES];
    tu_fingerprint(fp, 1);
    tkv_l3_opts *o = tkv_l3_opts_new();
    tkv_l3_opts_set_fingerprint(o, fp);
    tkv_l3_opts_set_max_block_bytes(o, BLK);
    tkv_l3_opts_set_io_mode(o, g_io_mode);
    tkv_l3_opts_set_zstd_level(o, 0);
    tkv_l3_opts_set_capacity_bytes(o, 4 * BLK);
    tkv_l3_opts_set_auto_compact(o, 0); /* the test compacts itself, at a known moment */
    tkv_l3 *l3 = NULL;
    ck_assert_int_eq(tkv_l3_open(g_dir, o, &l3), TKV_OK);
    tkv_l3_opts_free(o);
    put_range(l3, 0, 4, BLK, 0);
    /* full: refused with EFULL (the caller evicts), not a failure of the store */
    uint8_t *b = calloc(1, BLK);
    tkv_l3_put_req r = {.payload = b, .len = BLK};
    tu_key(&r.key, 1, 4);
    ck_assert_int_eq(tkv_l3_put_batch(l3, &r, 1), TKV_EFULL);
    tkv_l3_stats st;
    tkv_l3_get_stats(l3, &st);
    ck_assert_int_eq(st.readonly, 0);
    /* deleting and compacting makes room again */
    tkv_key k[3];
    for (int i = 0; i < 3; i++)
        tu_key(&k[i], 1, (uint64_t)i);
    ck_assert_int_eq(tkv_l3_delete(l3, k, 3), TKV_OK);
    ck_assert_int_eq(tkv_l3_put_batch(l3, &r, 1), TKV_EFULL); /* dead bytes still on disk */
    uint64_t reclaimed = 0;
    ck_assert_int_eq(tkv_l3_compact(l3, &reclaimed), TKV_OK);
    ck_assert_int_eq(tkv_l3_put_batch(l3, &r, 1), TKV_OK);
    ck_assert_int_eq(check_block(l3, 3, BLK, 0), TKV_OK);
    free(b);
    tkv_l3_close(l3);
}
END_TEST

START_TEST(test_bad_input)
{
    tkv_l3 *l3 = open_ok(1, 0);
    uint8_t *big = calloc(1, BLK + 1);
    tkv_l3_put_req r = {.payload = big, .len = BLK + 1};
    tu_key(&r.key, 9, 9);
    ck_assert_int_eq(tkv_l3_put_batch(l3, &r, 1), TKV_EINVAL); /* over max_block_bytes */
    r.len = 0;
    ck_assert_int_eq(tkv_l3_put_batch(l3, &r, 1), TKV_EINVAL);
    r.len = 10;
    r.num_tokens = 5; /* tokens missing */
    ck_assert_int_eq(tkv_l3_put_batch(l3, &r, 1), TKV_EINVAL);
    ck_assert_int_eq(tkv_l3_put_batch(NULL, &r, 1), TKV_EINVAL);
    free(big);
    tkv_l3_close(l3);

    tkv_l3_opts *o = tkv_l3_opts_new();
    ck_assert_int_eq(tkv_l3_opts_set_zstd_level(o, -1), TKV_EINVAL);
    ck_assert_int_eq(tkv_l3_opts_set_queue_depth(o, 0), TKV_EINVAL);
    ck_assert_int_eq(tkv_l3_opts_set_compact_dead_fraction(o, 1.5), TKV_EINVAL);
    ck_assert_int_eq(tkv_l3_opts_set_io_mode(o, 7), TKV_EINVAL);
    tkv_l3 *x = NULL;
    ck_assert_int_eq(tkv_l3_open(g_dir, o, &x), TKV_EINVAL); /* no fingerprint */
    ck_assert_ptr_null(x);
    tkv_l3_opts_free(o);
}
END_TEST

/* ---- codecs ----------------------------------------------------------------------------- */

START_TEST(test_raw_vs_zstd)
{
    tkv_l3 *l3 = open_ok(3, 0);
    put_range(l3, 0, 4, BLK, 1); /* compressible: stored as zstd frames */
    tkv_l3_stats st;
    tkv_l3_get_stats(l3, &st);
    ck_assert_uint_eq(st.raw_bytes, 4 * BLK);
    ck_assert_uint_lt(st.stored_bytes, st.raw_bytes / 4);
    put_range(l3, 4, 4, BLK, 0); /* random: does not shrink, stored raw */
    tkv_l3_stats st2;
    tkv_l3_get_stats(l3, &st2);
    ck_assert_uint_eq(st2.stored_bytes - st.stored_bytes, 4 * BLK);
    for (uint64_t i = 0; i < 4; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 1), TKV_OK);
    for (uint64_t i = 4; i < 8; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 0), TKV_OK);
    tkv_l3_close(l3);

    /* level 0 stores everything raw */
    tu_rmdir(g_dir);
    g_dir = tu_mkdtemp("l3");
    l3 = open_ok(0, 0);
    put_range(l3, 0, 4, BLK, 1);
    tkv_l3_get_stats(l3, &st);
    ck_assert_uint_eq(st.stored_bytes, 4 * BLK);
    for (uint64_t i = 0; i < 4; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 1), TKV_OK);
    tkv_l3_close(l3);
}
END_TEST

/* ---- corruption ------------------------------------------------------------------------- */

static void flip_byte(tkv_l3 *l3, uint64_t id, uint64_t at)
{
    tkv_key k;
    tu_key(&k, 1, id);
    char path[4096];
    uint64_t off, stored;
    ck_assert_int_eq(tkv_l3_locate(l3, &k, path, sizeof(path), &off, &stored), TKV_OK);
    ck_assert_uint_lt(at, stored);
    int fd = open(path, O_RDWR);
    ck_assert_int_ge(fd, 0);
    uint8_t b;
    ck_assert_int_eq(pread(fd, &b, 1, (off_t)(off + at)), 1);
    b ^= 0x40;
    ck_assert_int_eq(pwrite(fd, &b, 1, (off_t)(off + at)), 1);
    fsync(fd);
    close(fd);
    /* O_DIRECT reads bypass the page cache, but a buffered fallback must not serve a stale
     * page either: drop the cached pages of the file. */
    fd = open(path, O_RDONLY);
    posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    close(fd);
}

START_TEST(test_checksum_corruption)
{
    tkv_l3 *l3 = open_ok(1, 0);
    put_range(l3, 0, 4, BLK, 0);
    put_range(l3, 4, 2, BLK, 1); /* a zstd frame too */
    flip_byte(l3, 1, 777);
    flip_byte(l3, 4, 3);
    uint8_t *got = malloc(BLK);
    tkv_l3_get_req g = {.dst = got, .cap = BLK};
    tu_key(&g.key, 1, 1);
    memset(got, 0xAB, BLK);
    ck_assert_int_eq(tkv_l3_get_batch(l3, &g, 1), TKV_ECHECKSUM);
    uint8_t *want = malloc(BLK);
    tu_fill_random(want, BLK, 1);
    ck_assert(memcmp(want, got, BLK) != 0); /* never the (wrong) payload */
    /* the record was dropped */
    ck_assert_int_eq(check_block(l3, 1, BLK, 0), TKV_ENOTFOUND);
    ck_assert_int_eq(check_block(l3, 4, BLK, 1), TKV_ECHECKSUM);
    ck_assert_int_eq(check_block(l3, 4, BLK, 1), TKV_ENOTFOUND);
    ck_assert_int_eq(check_block(l3, 0, BLK, 0), TKV_OK);
    ck_assert_int_eq(check_block(l3, 5, BLK, 1), TKV_OK);
    tkv_l3_stats st;
    tkv_l3_get_stats(l3, &st);
    ck_assert_uint_eq(st.checksum_failures, 2);
    ck_assert_uint_eq(st.num_blocks, 4);

    /* verify finds a flipped block without a get, and drops it */
    flip_byte(l3, 2, BLK - 1);
    uint64_t checked = 0, bad = 0;
    ck_assert_int_eq(tkv_l3_verify(l3, NULL, NULL, &checked, &bad), TKV_OK);
    ck_assert_uint_eq(checked, 4);
    ck_assert_uint_eq(bad, 1);
    ck_assert_int_eq(check_block(l3, 2, BLK, 0), TKV_ENOTFOUND);
    ck_assert_int_eq(check_block(l3, 3, BLK, 0), TKV_OK);
    free(want);
    free(got);
    tkv_l3_close(l3);
}
END_TEST

/* ---- restart ---------------------------------------------------------------------------- */

static int count_cb(void *arg, const tkv_l3_info *info)
{
    size_t *n = arg;
    ck_assert_uint_eq(info->num_tokens, 64);
    ck_assert_uint_eq(info->raw_bytes, BLK);
    (*n)++;
    return 0;
}

START_TEST(test_reopen)
{
    tkv_l3 *l3 = open_ok(1, 256 * 1024); /* several segments */
    put_range(l3, 0, 20, BLK, 0);
    tkv_key del;
    tu_key(&del, 1, 7);
    ck_assert_int_eq(tkv_l3_delete(l3, &del, 1), TKV_OK);
    tkv_l3_close(l3);

    l3 = open_ok(1, 256 * 1024);
    tkv_l3_stats st;
    tkv_l3_get_stats(l3, &st);
    ck_assert_uint_eq(st.num_blocks, 19);
    for (uint64_t i = 0; i < 20; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 0), i == 7 ? TKV_ENOTFOUND : TKV_OK);
    size_t n = 0;
    ck_assert_int_eq(tkv_l3_scan(l3, count_cb, &n), TKV_OK);
    ck_assert_uint_eq(n, 19);
    put_range(l3, 20, 3, BLK, 0); /* appending after a restart */
    tkv_l3_close(l3);
    l3 = open_ok(1, 256 * 1024);
    for (uint64_t i = 0; i < 23; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 0), i == 7 ? TKV_ENOTFOUND : TKV_OK);
    tkv_l3_close(l3);
}
END_TEST

/* ---- record versions: the owner's tag in version 2, version 1 still read --------------- */

typedef struct tag_seen {
    uint64_t tag[4];
    int seen[4];
} tag_seen;

static int tag_cb(void *arg, const tkv_l3_info *info)
{
    tag_seen *ts = arg;
    for (uint64_t id = 0; id < 4; id++) {
        tkv_key k;
        tu_key(&k, 1, id);
        if (memcmp(k.b, info->key.b, TKV_KEY_BYTES) == 0) {
            ts->tag[id] = info->tenant_tag;
            ts->seen[id]++;
        }
    }
    ck_assert_uint_eq(info->num_tokens, 64);
    return 0;
}

/* Four blocks are put with owner tags; two of their records are rewritten in the version-1
 * layout (no tag, 108-byte header) straight in RocksDB, as a store written before tags holds
 * them. After a reopen every block reads back bit-exact, the version-2 records keep their tags
 * and the version-1 ones report none; a record with the version byte of neither is dropped. */
START_TEST(test_record_versions)
{
    tkv_l3 *l3 = open_ok(1, 1 << 20);
    tkv_l3_put_req reqs[4];
    uint8_t *bufs[4];
    uint32_t tokens[64];
    memset(reqs, 0, sizeof(reqs));
    for (uint64_t id = 0; id < 4; id++) {
        bufs[id] = malloc(BLK);
        tu_fill_random(bufs[id], BLK, id);
        for (int t = 0; t < 64; t++)
            tokens[t] = (uint32_t)(id * 64 + (uint64_t)t);
        tu_key(&reqs[id].key, 1, id);
        tu_key(&reqs[id].parent, 1, id - 1);
        reqs[id].payload = bufs[id];
        reqs[id].len = BLK;
        reqs[id].tokens = tokens;
        reqs[id].num_tokens = 64;
        reqs[id].tenant_tag = 0x7e4a000000000000ull + id;
    }
    ck_assert_int_eq(tkv_l3_put_batch(l3, reqs, 4), TKV_OK);
    for (int i = 0; i < 4; i++)
        free(bufs[i]);
    tkv_l3_close(l3);

    char path[512];
    snprintf(path, sizeof(path), "%s/index", g_dir);
    rocksdb_options_t *o = rocksdb_options_create();
    char *err = NULL;
    rocksdb_t *db = rocksdb_open(o, path, &err);
    ck_assert_msg(db && !err, "rocksdb_open: %s", err ? err : "?");
    rocksdb_readoptions_t *ro = rocksdb_readoptions_create();
    rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
    for (uint64_t id = 0; id < 3; id++) {
        char k[1 + TKV_KEY_BYTES];
        tkv_key key;
        tu_key(&key, 1, id);
        k[0] = 'k';
        memcpy(k + 1, key.b, TKV_KEY_BYTES);
        size_t vlen = 0;
        char *v = rocksdb_get(db, ro, k, sizeof(k), &vlen, &err);
        ck_assert_msg(v && !err, "record %llu", (unsigned long long)id);
        ck_assert_uint_eq(vlen, 116 + 4 * 64);
        ck_assert_int_eq(v[0], 2);
        if (id < 2) { /* the version-1 layout: no tag */
            v[0] = 1;
            memmove(v + 108, v + 116, vlen - 116);
            vlen -= 8;
        } else {      /* a version this store never wrote */
            v[0] = 3;
        }
        rocksdb_put(db, wo, k, sizeof(k), v, vlen, &err);
        ck_assert_msg(!err, "rocksdb_put: %s", err ? err : "?");
        rocksdb_free(v);
    }
    rocksdb_readoptions_destroy(ro);
    rocksdb_writeoptions_destroy(wo);
    rocksdb_close(db);
    rocksdb_options_destroy(o);

    l3 = open_ok(1, 1 << 20);
    tag_seen ts = {{0}, {0}};
    ck_assert_int_eq(tkv_l3_scan(l3, tag_cb, &ts), TKV_OK);
    ck_assert(ts.seen[0] == 1 && ts.seen[1] == 1 && ts.seen[3] == 1);
    ck_assert_int_eq(ts.seen[2], 0); /* unknown version: dropped at open */
    ck_assert_uint_eq(ts.tag[0], 0);
    ck_assert_uint_eq(ts.tag[1], 0);
    ck_assert_uint_eq(ts.tag[3], 0x7e4a000000000003ull);
    ck_assert_int_eq(check_block(l3, 0, BLK, 0), TKV_OK);
    ck_assert_int_eq(check_block(l3, 1, BLK, 0), TKV_OK);
    ck_assert_int_eq(check_block(l3, 2, BLK, 0), TKV_ENOTFOUND);
    ck_assert_int_eq(check_block(l3, 3, BLK, 0), TKV_OK);
    tkv_l3_close(l3);
}
END_TEST

static off_t file_size(const char *path)
{
    struct stat st;
    ck_assert_int_eq(stat(path, &st), 0);
    return st.st_size;
}

START_TEST(test_tail_truncation)
{
    tkv_l3 *l3 = open_ok(1, 0);
    put_range(l3, 0, 3, BLK, 0);
    tkv_key k;
    tu_key(&k, 1, 2);
    char path[4096];
    uint64_t off, stored;
    ck_assert_int_eq(tkv_l3_locate(l3, &k, path, sizeof(path), &off, &stored), TKV_OK);
    tkv_l3_close(l3);
    off_t before = file_size(path);
    ck_assert_int_eq(before, (off_t)(off + stored));

    /* a payload that was written but whose record never committed (a crash in between) */
    int fd = open(path, O_WRONLY | O_APPEND);
    uint8_t *junk = malloc(3 * BLK + 123);
    tu_fill_random(junk, 3 * BLK + 123, 42);
    ck_assert_int_eq(write(fd, junk, 3 * BLK + 123), 3 * BLK + 123);
    close(fd);
    free(junk);
    /* and a segment no record points into */
    char orphan[4200];
    snprintf(orphan, sizeof(orphan), "%s/seg-000000ff.dat", g_dir);
    fd = open(orphan, O_CREAT | O_WRONLY, 0644);
    ck_assert_int_eq(write(fd, "x", 1), 1);
    close(fd);

    l3 = open_ok(1, 0);
    ck_assert_int_eq(file_size(path), before);
    ck_assert_int_eq(access(orphan, F_OK), -1);
    for (uint64_t i = 0; i < 3; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 0), TKV_OK);
    put_range(l3, 3, 2, BLK, 0);
    for (uint64_t i = 0; i < 5; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 0), TKV_OK);
    tkv_l3_close(l3);

    /* a segment cut short under its records: those records are dropped, others kept */
    ck_assert_int_eq(truncate(path, (off_t)(off + stored / 2)), 0);
    l3 = open_ok(1, 0);
    ck_assert_int_eq(check_block(l3, 2, BLK, 0), TKV_ENOTFOUND);
    ck_assert_int_eq(check_block(l3, 0, BLK, 0), TKV_OK);
    ck_assert_int_eq(check_block(l3, 1, BLK, 0), TKV_OK);
    tkv_l3_close(l3);
}
END_TEST

START_TEST(test_fingerprint_mismatch)
{
    tkv_l3 *l3 = open_ok(1, 0);
    put_range(l3, 0, 1, BLK, 0);
    tkv_l3_close(l3);
    tkv_l3 *other = NULL;
    ck_assert_int_eq(tu_l3_open(g_dir, g_io_mode, 1, BLK, 0, 2, &other), TKV_EGEOMETRY);
    ck_assert_ptr_null(other);
    l3 = open_ok(1, 0); /* the right geometry still opens and keeps its data */
    ck_assert_int_eq(check_block(l3, 0, BLK, 0), TKV_OK);
    tkv_l3_close(l3);
}
END_TEST

/* ---- compaction ------------------------------------------------------------------------- */

typedef struct reader_arg {
    tkv_l3 *l3;
    int stop; /* atomic */
    const uint8_t *live; /* by id: 1 = must read back exactly */
    size_t n;
    size_t reads, bad;
} reader_arg;

static void *reader_main(void *p)
{
    reader_arg *a = p;
    uint8_t *want = malloc(BLK), *got = malloc(BLK);
    uint64_t i = 0;
    while (!__atomic_load_n(&a->stop, __ATOMIC_ACQUIRE)) {
        uint64_t id = i++ % a->n;
        if (!a->live[id])
            continue;
        tkv_l3_get_req g = {.dst = got, .cap = BLK};
        tu_key(&g.key, 1, id);
        tu_fill_random(want, BLK, id);
        int rc = tkv_l3_get_batch(a->l3, &g, 1);
        if (rc != TKV_OK || g.len != BLK || memcmp(want, got, BLK) != 0)
            a->bad++;
        a->reads++;
    }
    free(want);
    free(got);
    return NULL;
}

START_TEST(test_compaction)
{
    enum { N = 48 };
    tkv_l3 *l3 = open_ok(1, 4 * BLK); /* 4 blocks per segment */
    put_range(l3, 0, N, BLK, 0);
    tkv_l3_stats st0;
    tkv_l3_get_stats(l3, &st0);
    ck_assert_uint_eq(st0.disk_bytes, (uint64_t)N * BLK);

    /* delete 3 of every 4 blocks, then compact while readers hammer the live ones */
    uint8_t live[N];
    tkv_key dead[N];
    size_t num_dead = 0;
    for (uint64_t i = 0; i < N; i++) {
        live[i] = (i % 4) == 1;
        if (!live[i])
            tu_key(&dead[num_dead++], 1, i);
    }
    ck_assert_int_eq(tkv_l3_delete(l3, dead, num_dead), TKV_OK);
    reader_arg ra[2];
    pthread_t th[2];
    for (int t = 0; t < 2; t++) {
        ra[t] = (reader_arg){.l3 = l3, .live = live, .n = N};
        pthread_create(&th[t], NULL, reader_main, &ra[t]);
    }
    usleep(20000);
    uint64_t reclaimed = 0;
    ck_assert_int_eq(tkv_l3_compact(l3, &reclaimed), TKV_OK);
    usleep(20000);
    for (int t = 0; t < 2; t++) {
        __atomic_store_n(&ra[t].stop, 1, __ATOMIC_RELEASE);
        pthread_join(th[t], NULL);
        ck_assert_uint_eq(ra[t].bad, 0);
        ck_assert_uint_gt(ra[t].reads, 0);
    }
    ck_assert_uint_ge(reclaimed, (uint64_t)(N - 4) * BLK);
    tkv_l3_stats st;
    tkv_l3_get_stats(l3, &st);
    ck_assert_uint_eq(st.compactions, 1);
    ck_assert_uint_eq(st.num_blocks, N / 4);
    ck_assert_uint_le(st.disk_bytes, (uint64_t)(N / 4 + 4) * BLK);
    for (uint64_t i = 0; i < N; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 0), live[i] ? TKV_OK : TKV_ENOTFOUND);

    /* the segment that was being appended to during the first run is sealed now and may
     * go in a second run; after that nothing is over the threshold */
    ck_assert_int_eq(tkv_l3_compact(l3, &reclaimed), TKV_OK);
    ck_assert_uint_le(reclaimed, 4 * BLK);
    ck_assert_int_eq(tkv_l3_compact(l3, &reclaimed), TKV_OK);
    ck_assert_uint_eq(reclaimed, 0);
    tkv_l3_close(l3);

    /* the moves survive a restart, and the old segments are gone for good */
    l3 = open_ok(1, 4 * BLK);
    for (uint64_t i = 0; i < N; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 0), live[i] ? TKV_OK : TKV_ENOTFOUND);
    tkv_l3_get_stats(l3, &st);
    ck_assert_uint_le(st.disk_bytes, (uint64_t)(N / 4 + 4) * BLK);
    tkv_l3_close(l3);
}
END_TEST

START_TEST(test_auto_compaction)
{
    enum { N = 24 };
    tu_auto_compact = 1;
    tkv_l3 *l3 = open_ok(0, 4 * BLK);
    tu_auto_compact = 0;
    put_range(l3, 0, N, BLK, 0);
    tkv_key dead[N];
    size_t num_dead = 0;
    for (uint64_t i = 0; i < N; i++)
        if (i % 4 != 0)
            tu_key(&dead[num_dead++], 1, i);
    ck_assert_int_eq(tkv_l3_delete(l3, dead, num_dead), TKV_OK);
    /* the compactor runs on its own thread: wait for it (bounded) */
    tkv_l3_stats st;
    for (int tries = 0; tries < 500; tries++) {
        tkv_l3_get_stats(l3, &st);
        if (st.compactions > 0 && st.disk_bytes <= (uint64_t)(N / 4) * BLK)
            break;
        usleep(10000);
    }
    ck_assert_uint_ge(st.compactions, 1);
    ck_assert_uint_le(st.disk_bytes, (uint64_t)(N / 4) * BLK);
    for (uint64_t i = 0; i < N; i++)
        ck_assert_int_eq(check_block(l3, i, BLK, 0), i % 4 == 0 ? TKV_OK : TKV_ENOTFOUND);
    tkv_l3_close(l3);
}
END_TEST

/* ---- concurrency ------------------------------------------------------------------------ */

typedef struct worker_arg {
    tkv_l3 *l3;
    int id;
    int failures;
} worker_arg;

static void *worker_main(void *p)
{
    worker_arg *a = p;
    enum { PER = 24, BATCH = 4 };
    uint8_t *got = malloc(BATCH * (size_t)BLK), *want = malloc(BLK);
    for (uint64_t b = 0; b < PER / BATCH; b++) {
        uint64_t first = (uint64_t)a->id * 1000 + b * BATCH;
        put_range(a->l3, first, BATCH, BLK, (a->id & 1));
        tkv_l3_get_req g[BATCH];
        for (int i = 0; i < BATCH; i++) {
            g[i] = (tkv_l3_get_req){.dst = got + (size_t)i * BLK, .cap = BLK};
            tu_key(&g[i].key, 1, first + (uint64_t)i);
        }
        if (tkv_l3_get_batch(a->l3, g, BATCH) != TKV_OK)
            a->failures++;
        for (int i = 0; i < BATCH; i++) {
            if (a->id & 1)
                tu_fill_compressible(want, BLK, first + (uint64_t)i);
            else
                tu_fill_random(want, BLK, first + (uint64_t)i);
            if (g[i].status != TKV_OK || memcmp(want, got + (size_t)i * BLK, BLK) != 0)
                a->failures++;
        }
    }
    free(got);
    free(want);
    return NULL;
}

START_TEST(test_concurrent)
{
    enum { T = 4 };
    tkv_l3 *l3 = open_ok(1, 16 * BLK);
    pthread_t th[T];
    worker_arg wa[T];
    for (int t = 0; t < T; t++) {
        wa[t] = (worker_arg){.l3 = l3, .id = t};
        pthread_create(&th[t], NULL, worker_main, &wa[t]);
    }
    for (int t = 0; t < T; t++) {
        pthread_join(th[t], NULL);
        ck_assert_int_eq(wa[t].failures, 0);
    }
    tkv_l3_stats st;
    tkv_l3_get_stats(l3, &st);
    ck_assert_uint_eq(st.num_blocks, T * 24);
    ck_assert_uint_eq(st.writes, T * 24);
    tkv_l3_close(l3);
    l3 = open_ok(1, 16 * BLK);
    tkv_l3_get_stats(l3, &st);
    ck_assert_uint_eq(st.num_blocks, T * 24);
    for (int t = 0; t < T; t++)
        for (uint64_t i = 0; i < 24; i++)
            ck_assert_int_eq(check_block(l3, (uint64_t)t * 1000 + i, BLK, t & 1), TKV_OK);
    tkv_l3_close(l3);
}
END_TEST

static Suite *l3_suite(void)
{
    Suite *s = suite_create(g_io_mode == TKV_IO_URING ? "l3 (io_uring)" : "l3 (psync)");
    TCase *tc = tcase_create("core");
    tcase_add_checked_fixture(tc, setup, teardown);
    tcase_set_timeout(tc, 120);
    tcase_add_test(tc, test_round_trip);
    tcase_add_test(tc, test_bad_input);
    tcase_add_test(tc, test_capacity);
    tcase_add_test(tc, test_raw_vs_zstd);
    tcase_add_test(tc, test_checksum_corruption);
    tcase_add_test(tc, test_reopen);
    tcase_add_test(tc, test_tail_truncation);
    tcase_add_test(tc, test_fingerprint_mismatch);
    tcase_add_test(tc, test_compaction);
    tcase_add_test(tc, test_auto_compaction);
    tcase_add_test(tc, test_concurrent);
    tcase_add_test(tc, test_record_versions);
    suite_add_tcase(s, tc);
    return s;
}

int main(int argc, char **argv)
{
    /* the corruption tests log errors on purpose; TKV_TEST_VERBOSE=1 shows them */
    if (!getenv("TKV_TEST_VERBOSE"))
        tkv_log_level = TKV_LOG_ERROR - 1;
    for (int i = 1; i < argc; i++) {
        if (strcmp(argv[i], "--io=uring") == 0) {
            g_io_mode = TKV_IO_URING;
        } else if (strcmp(argv[i], "--io=psync") == 0) {
            g_io_mode = TKV_IO_PSYNC;
        } else {
            fprintf(stderr, "usage: %s [--io=psync|--io=uring]\n", argv[0]);
            return 2;
        }
    }
    if (g_io_mode == TKV_IO_URING) {
        /* Probe with a bare ring: opening a store here would start RocksDB's background
         * threads, which the forked test processes would inherit without the threads. */
        struct io_uring ring;
        int rc = io_uring_queue_init(4, &ring, 0);
        if (rc < 0) {
            fprintf(stderr, "io_uring is refused on this machine (%s): skipped\n",
                    strerror(-rc));
            return 77;
        }
        io_uring_queue_exit(&ring);
    }
    SRunner *sr = srunner_create(l3_suite());
    srunner_run_all(sr, CK_NORMAL);
    int failed = srunner_ntests_failed(sr);
    srunner_free(sr);
    return failed ? 1 : 0;
}
