/* l3_testutil.h - helpers shared by the L3 store's tests (test_l3, test_crash, test_diskfull):
 * scratch directories, deterministic payloads, keys. Header-only; static functions. */
#ifndef L3_TESTUTIL_H
#define L3_TESTUTIL_H

#include <ftw.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tkv_base.h"
#include "tkv_keys.h"
#include "tkv_l3.h"

/* Scratch directories go under TKV_TEST_TMPDIR, else TMPDIR, else /tmp. */
static inline char *tu_mkdtemp(const char *tag)
{
    const char *base = getenv("TKV_TEST_TMPDIR");
    if (!base || !*base)
        base = getenv("TMPDIR");
    if (!base || !*base)
        base = "/tmp";
    char *path = tkv_xmalloc(strlen(base) + strlen(tag) + 32);
    sprintf(path, "%s/tierkv-%s-XXXXXX", base, tag);
    if (!mkdtemp(path)) {
        perror("mkdtemp");
        abort();
    }
    return path;
}

static inline int tu_rm_one(const char *p, const struct stat *sb, int flag, struct FTW *ftw)
{
    (void)sb;
    (void)flag;
    (void)ftw;
    return remove(p);
}

/* Removes the tree and frees the path. */
static inline void tu_rmdir(char *path)
{
    if (!path)
        return;
    nftw(path, tu_rm_one, 16, FTW_DEPTH | FTW_PHYS);
    free(path);
}

static inline uint64_t tu_mix(uint64_t x)
{
    x ^= x >> 31;
    x *= 0x7fb5d329728ea185ull;
    x ^= x >> 27;
    x *= 0x81dadef4bc2dd44dull;
    x ^= x >> 33;
    return x;
}

/* Incompressible bytes, a function of (seed, position). */
static inline void tu_fill_random(void *dst, size_t n, uint64_t seed)
{
    uint8_t *p = dst;
    uint64_t s = tu_mix(seed + 1);
    size_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t v = tu_mix(s + i);
        memcpy(p + i, &v, 8);
    }
    for (; i < n; i++)
        p[i] = (uint8_t)tu_mix(s + i);
}

/* Compressible bytes (a small alphabet, long runs), still a function of the seed. */
static inline void tu_fill_compressible(void *dst, size_t n, uint64_t seed)
{
    uint8_t *p = dst;
    for (size_t i = 0; i < n; i++)
        p[i] = (uint8_t)((seed * 7 + i / 64) % 5);
}

static inline void tu_key(tkv_key *k, uint64_t a, uint64_t b)
{
    for (int i = 0; i < 4; i++) {
        uint64_t v = tu_mix(a * 0x9e3779b97f4a7c15ull + b * 31 + (uint64_t)i);
        memcpy(k->b + 8 * i, &v, 8);
    }
}

static inline void tu_fingerprint(uint8_t fp[TKV_KEY_BYTES], uint8_t tag)
{
    for (int i = 0; i < TKV_KEY_BYTES; i++)
        fp[i] = (uint8_t)(tag * 17 + i);
}

/* Background compaction in stores opened by tu_l3_open: off by default, so tests that count
 * compactions or check reclaimed bytes see only their own; a program may switch it on. */
static int tu_auto_compact = 0;

/* Opens an L3 store with the common test settings. */
static inline int tu_l3_open(const char *dir, int io_mode, int level, size_t max_block,
                             uint64_t segment_bytes, uint8_t fp_tag, tkv_l3 **out)
{
    uint8_t fp[TKV_KEY_BYTES];
    tu_fingerprint(fp, fp_tag);
    tkv_l3_opts *o = tkv_l3_opts_new();
    tkv_l3_opts_set_fingerprint(o, fp);
    tkv_l3_opts_set_max_block_bytes(o, max_block);
    tkv_l3_opts_set_zstd_level(o, level);
    tkv_l3_opts_set_io_mode(o, io_mode);
    tkv_l3_opts_set_queue_depth(o, 8);
    tkv_l3_opts_set_auto_compact(o, tu_auto_compact);
    if (segment_bytes)
        tkv_l3_opts_set_segment_bytes(o, segment_bytes);
    int rc = tkv_l3_open(dir, o, out);
    tkv_l3_opts_free(o);
    return rc;
}

#endif
