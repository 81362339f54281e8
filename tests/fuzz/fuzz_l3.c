/* fuzz_l3.c - L3 recovery (storage/l3.c: tkv_l3_open's index and segment checks, then scan
 * and checksummed reads) from arbitrary files: a real store of three blocks is laid out once,
 * and each input damages a copy of it before it is opened again. Whatever the files hold, the
 * store opens or refuses with an error, and a block it serves is the block that was put
 * (its checksum is checked on the way) -- never a crash, a leak or wrong bytes.
 *
 * Input: byte 0 picks the damage: 0 = the segment file's whole content; 1 = bytes written
 * over the segment at a 4-byte offset (mod its size + 1); 2 = index records put into RocksDB
 * ([key length u8][key][value length u16 LE][value], repeated). */
#include <dirent.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <sys/stat.h>

#include <rocksdb/c.h>

#include "tkv_base.h"
#include "tkv_l3.h"

#define kBlockBytes 4096
#define kBlocks 3

static char g_base[200], g_tmpl[256], g_work[256], g_seg_name[64];
static uint8_t g_fp[32];
static uint8_t g_payload[kBlocks][kBlockBytes];

static tkv_l3_opts *opts(void)
{
    tkv_l3_opts *o = tkv_l3_opts_new();
    tkv_l3_opts_set_fingerprint(o, g_fp);
    tkv_l3_opts_set_max_block_bytes(o, kBlockBytes);
    tkv_l3_opts_set_io_mode(o, TKV_IO_PSYNC);
    tkv_l3_opts_set_auto_compact(o, 0);
    tkv_l3_opts_set_segment_bytes(o, 1 << 20);
    return o;
}

static void rm_tree(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d)
        return;
    struct dirent *e;
    char p[512];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        snprintf(p, sizeof(p), "%s/%s", dir, e->d_name);
        struct stat st;
        if (lstat(p, &st) == 0 && S_ISDIR(st.st_mode))
            rm_tree(p);
        else
            unlink(p);
    }
    closedir(d);
    rmdir(dir);
}

static void copy_tree(const char *from, const char *to)
{
    if (mkdir(to, 0700) != 0)
        abort();
    DIR *d = opendir(from);
    if (!d)
        abort();
    struct dirent *e;
    char a[512], b[512];
    static char buf[1 << 16];
    while ((e = readdir(d))) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, ".."))
            continue;
        snprintf(a, sizeof(a), "%s/%s", from, e->d_name);
        snprintf(b, sizeof(b), "%s/%s", to, e->d_name);
        struct stat st;
        if (lstat(a, &st) != 0)
            abort();
        if (S_ISDIR(st.st_mode)) {
            copy_tree(a, b);
            continue;
        }
        int in = open(a, O_RDONLY), out = open(b, O_WRONLY | O_CREAT | O_TRUNC, 0600);
        if (in < 0 || out < 0)
            abort();
        ssize_t n;
        while ((n = read(in, buf, sizeof(buf))) > 0)
            if (write(out, buf, (size_t)n) != n)
                abort();
        close(in);
        close(out);
    }
    closedir(d);
}

static void remove_base(void)
{
    rm_tree(g_base);
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    tkv_log_level = -1;
    for (int i = 0; i < 32; i++)
        g_fp[i] = (uint8_t)(i * 7 + 1);
    /* tmpfs: RocksDB's open dominates each input; no disk sync on top of it */
    snprintf(g_base, sizeof(g_base), "/dev/shm/tkv-fuzz-l3-%d", (int)getpid());
    rm_tree(g_base);
    if (mkdir(g_base, 0700) != 0)
        abort();
    atexit(remove_base);
    snprintf(g_work, sizeof(g_work), "%s/work", g_base);
    snprintf(g_tmpl, sizeof(g_tmpl), "%s/tmpl", g_base);
    tkv_l3_opts *o = opts();
    tkv_l3 *l3;
    if (tkv_l3_open(g_tmpl, o, &l3) != TKV_OK)
        abort();
    tkv_l3_put_req reqs[kBlocks];
    uint32_t tokens[kBlocks][16];
    memset(reqs, 0, sizeof(reqs));
    for (int i = 0; i < kBlocks; i++) {
        for (int j = 0; j < kBlockBytes; j++) /* block 0 compresses, the others do not */
            g_payload[i][j] = (uint8_t)(i == 0 ? j / 64 : (j * 2654435761u + (unsigned)i) >> 13);
        for (int j = 0; j < 16; j++)
            tokens[i][j] = (uint32_t)(100 * i + j);
        memset(reqs[i].key.b, 0xa0 + i, TKV_KEY_BYTES);
        if (i)
            reqs[i].parent = reqs[i - 1].key;
        reqs[i].payload = g_payload[i];
        reqs[i].len = kBlockBytes;
        reqs[i].tokens = tokens[i];
        reqs[i].num_tokens = 16;
    }
    if (tkv_l3_put_batch(l3, reqs, kBlocks) != TKV_OK)
        abort();
    tkv_l3_close(l3);
    tkv_l3_opts_free(o);
    DIR *d = opendir(g_tmpl);
    struct dirent *e;
    while ((e = readdir(d)))
        if (!strncmp(e->d_name, "seg-", 4))
            snprintf(g_seg_name, sizeof(g_seg_name), "%s", e->d_name);
    closedir(d);
    if (!g_seg_name[0])
        abort();
    return 0;
}

static int g_index_forged;

static int check_cb(void *arg, const tkv_l3_info *info)
{
    tkv_l3 *l3 = arg;
    static uint8_t dst[kBlockBytes];
    tkv_l3_get_req g = {.key = info->key, .dst = dst, .cap = sizeof(dst)};
    tkv_l3_get_batch(l3, &g, 1);
    if (g.status == TKV_OK && g.len > sizeof(dst))
        abort();
    /* With the index itself forged, a record may name another block's payload (consistent
     * with its checksum): only damaged payloads under the true index must never be served. */
    if (g.status == TKV_OK && !g_index_forged) {
        /* Served bytes are the block that was put under that key, whole. */
        int i = info->key.b[0] - 0xa0;
        if (i < 0 || i >= kBlocks || g.len != kBlockBytes || memcmp(dst, g_payload[i], kBlockBytes))
            abort();
    }
    return 0;
}

static void put_index_records(const uint8_t *p, size_t n)
{
    char path[600], *err = NULL;
    snprintf(path, sizeof(path), "%s/index", g_work);
    rocksdb_options_t *ro = rocksdb_options_create();
    rocksdb_t *db = rocksdb_open(ro, path, &err);
    if (!db) {
        free(err);
        rocksdb_options_destroy(ro);
        return;
    }
    rocksdb_writeoptions_t *wo = rocksdb_writeoptions_create();
    while (n >= 1) {
        size_t kl = p[0];
        if (n < 1 + kl + 2)
            break;
        const uint8_t *k = p + 1;
        size_t vl = p[1 + kl] | (size_t)p[2 + kl] << 8;
        if (n < 3 + kl + vl)
            vl = n - 3 - kl;
        rocksdb_put(db, wo, (const char *)k, kl, (const char *)p + 3 + kl, vl, &err);
        free(err);
        err = NULL;
        p += 3 + kl + vl;
        n -= 3 + kl + vl;
    }
    rocksdb_writeoptions_destroy(wo);
    rocksdb_close(db);
    rocksdb_options_destroy(ro);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    if (n < 1)
        return 0;
    rm_tree(g_work);
    copy_tree(g_tmpl, g_work);
    char seg[600];
    snprintf(seg, sizeof(seg), "%s/%s", g_work, g_seg_name);
    int mode = data[0] % 3;
    g_index_forged = mode == 2;
    if (mode == 0) {
        int fd = open(seg, O_WRONLY | O_TRUNC);
        if (fd < 0 || (n > 1 && write(fd, data + 1, n - 1) != (ssize_t)(n - 1)))
            abort();
        close(fd);
    } else if (mode == 1 && n >= 5) {
        struct stat st;
        int fd = open(seg, O_WRONLY);
        if (fd < 0 || fstat(fd, &st) != 0)
            abort();
        uint32_t off;
        memcpy(&off, data + 1, 4);
        off %= (uint32_t)st.st_size + 1;
        if (n > 5 && pwrite(fd, data + 5, n - 5, off) != (ssize_t)(n - 5))
            abort();
        close(fd);
    } else if (mode == 2) {
        put_index_records(data + 1, n - 1);
    }
    tkv_l3_opts *o = opts();
    tkv_l3 *l3;
    if (tkv_l3_open(g_work, o, &l3) == TKV_OK) {
        tkv_l3_scan(l3, check_cb, l3);
        tkv_l3_close(l3);
    }
    tkv_l3_opts_free(o);
    return 0;
}
