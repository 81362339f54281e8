/* fuzz_l3.c - what a damaged or forged L3 store on disk reaches (storage/l3.c, included so
 * its recovery steps are called directly): index records parsed and checked against their
 * segment (rec_parse, load_one, the cut of segment tails), then every block recovery keeps
 * read back through the real read path (checksum, zstd), plus segment file names and the
 * meta record. Whatever the bytes, a block that is served is the block that was put -- never
 * a crash, a leak or wrong bytes.
 *
 * Only RocksDB's own open and iteration are left out: one store is opened once (its index
 * holds the meta record only) and each input's records are handed to the same per-entry step
 * (idx_entry) its iterator feeds, in the order the iterator would give them. A real store of
 * three blocks is laid out once; its segment and records are the undamaged base.
 *
 * Input: byte 0 % 5 picks what the rest is: 0 = the segment file's whole content; 1 = bytes
 * written over the segment at a 4-byte offset (mod its size + 1); 2 = index records
 * ([key length u8][key][value length u16 LE][value], repeated) over the true segment; 3 = a
 * directory entry's name; 4 = the meta record's value. */
#include "../../storage/l3.c"

#include <sys/mman.h>

#define kBlockBytes 4096
#define kBlocks 3

typedef struct fz_rec {
    char k[256];
    size_t klen;
    const uint8_t *v;
    size_t vlen;
    size_t order; /* input position: a later put of the same key wins, as in RocksDB */
} fz_rec;

static char g_base[200];
static uint8_t g_fp[32];
static uint8_t g_payload[kBlocks][kBlockBytes];
static tkv_l3 *g_l3;      /* the work store: its index holds the meta record only */
static int g_segfd = -1;  /* memfd: the segment image of the current input */
static uint32_t g_seg_id;
static uint8_t *g_seg;    /* the true segment's bytes */
static size_t g_seg_len;
static fz_rec g_true[kBlocks];
static uint8_t g_true_v[kBlocks][L3_REC_HDR + 4 * 16];
static size_t g_num_true;
static uint8_t *g_dst;    /* read destination, O_DIRECT-aligned like a caller's buffer */

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

static void at_exit(void)
{
    tkv_l3_close(g_l3);
    rm_tree(g_base);
}

static int collect_true(void *arg, const tkv_key *key, const uint8_t *v, size_t vlen, int prc,
                        const l3_rec *r)
{
    (void)arg;
    (void)r;
    if (prc != TKV_OK || g_num_true == kBlocks || vlen > sizeof(g_true_v[0]))
        abort();
    fz_rec *t = &g_true[g_num_true];
    idx_key(key, t->k);
    t->klen = L3_KEY_LEN;
    memcpy(g_true_v[g_num_true], v, vlen);
    t->v = g_true_v[g_num_true];
    t->vlen = vlen;
    t->order = g_num_true++;
    return 0;
}

int LLVMFuzzerInitialize(int *argc, char ***argv)
{
    (void)argc;
    (void)argv;
    tkv_log_level = -1; /* refusals and drops are the expected outcome: no log lines */
    for (int i = 0; i < 32; i++)
        g_fp[i] = (uint8_t)(i * 7 + 1);
    snprintf(g_base, sizeof(g_base), "/dev/shm/tkv-fuzz-l3-%d", (int)getpid());
    rm_tree(g_base);
    if (mkdir(g_base, 0700) != 0)
        abort();
    char tmpl[256], work[256];
    snprintf(tmpl, sizeof(tmpl), "%s/tmpl", g_base);
    snprintf(work, sizeof(work), "%s/work", g_base);

    /* The template: three blocks put by the real write path. */
    tkv_l3_opts *o = opts();
    tkv_l3 *l3;
    if (tkv_l3_open(tmpl, o, &l3) != TKV_OK)
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
    if (tkv_l3_put_batch(l3, reqs, kBlocks) != TKV_OK || idx_iterate(l3, collect_true, NULL) != 0 ||
        g_num_true != kBlocks)
        abort();
    g_seg_id = l3->cur_id;
    char seg[600];
    seg_path(l3, g_seg_id, seg, sizeof(seg));
    tkv_l3_close(l3); /* trims the segment to its cursor */
    int fd = open(seg, O_RDONLY);
    struct stat st;
    if (fd < 0 || fstat(fd, &st) != 0 || st.st_size == 0)
        abort();
    g_seg_len = (size_t)st.st_size;
    g_seg = tkv_xmalloc(g_seg_len);
    if (pread(fd, g_seg, g_seg_len, 0) != (ssize_t)g_seg_len)
        abort();
    close(fd);

    if (tkv_l3_open(work, o, &g_l3) != TKV_OK || g_l3->num_blocks != 0)
        abort();
    tkv_l3_opts_free(o);
    g_segfd = memfd_create("tkv-fuzz-seg", MFD_CLOEXEC);
    g_dst = xaligned(4096, kBlockBytes);
    if (g_segfd < 0)
        abort();
    /* after RocksDB's first open: its statics are torn down after this runs */
    atexit(at_exit);
    return 0;
}

/* ---- modes 0-2: recovery and reads ---- */

typedef struct fz_state {
    load_arg a;
    r_item items[64];
    size_t n;
} fz_state;

/* Recovery's step for one record (load_one); what it keeps is read back afterwards. */
static int admit(void *arg, const tkv_key *key, const uint8_t *v, size_t vlen, int prc,
                 const l3_rec *r)
{
    fz_state *st = arg;
    uint64_t before = g_l3->num_blocks;
    load_one(&st->a, key, v, vlen, prc, r);
    if (g_l3->num_blocks == before)
        return 0;
    if (prc != TKV_OK || r->seg != g_seg_id)
        abort(); /* kept: a parsed record in an existing segment */
    if (st->n < sizeof(st->items) / sizeof(st->items[0])) {
        r_item *it = &st->items[st->n++];
        memset(it, 0, sizeof(*it));
        it->key = *key;
        it->rec = *r;
        it->rec.tokens = NULL;
    }
    return 0;
}

/* RocksDB's order: bytewise by key, then the later put first so it shadows the earlier. */
static int rec_cmp(const void *pa, const void *pb)
{
    const fz_rec *a = pa, *b = pb;
    size_t n = a->klen < b->klen ? a->klen : b->klen;
    int c = memcmp(a->k, b->k, n);
    if (c)
        return c;
    if (a->klen != b->klen)
        return a->klen < b->klen ? -1 : 1;
    return a->order > b->order ? -1 : a->order < b->order;
}

static size_t parse_records(const uint8_t *p, size_t n, fz_rec *out, size_t cap)
{
    size_t m = 0;
    while (n >= 1 && m < cap) {
        size_t kl = p[0];
        if (n < 1 + kl + 2)
            break;
        size_t vl = p[1 + kl] | (size_t)p[2 + kl] << 8;
        if (n < 3 + kl + vl)
            vl = n - 3 - kl;
        fz_rec *r = &out[m];
        memcpy(r->k, p + 1, kl);
        r->klen = kl;
        r->v = p + 3 + kl;
        r->vlen = vl;
        r->order = m++;
        p += 3 + kl + vl;
        n -= 3 + kl + vl;
    }
    return m;
}

static void recover_and_read(const uint8_t *img, size_t img_len, fz_rec *recs, size_t n,
                             int forged)
{
    /* Written over the last image and cut to length only when that differs: no page of the
     * memfd is freed and allocated again per input. */
    static size_t size;
    if ((img_len && pwrite(g_segfd, img, img_len, 0) != (ssize_t)img_len) ||
        (size != img_len && ftruncate(g_segfd, (off_t)img_len) != 0))
        abort();
    size = img_len;
    l3_seg *s = tkv_xcalloc(1, sizeof(*s));
    s->id = g_seg_id;
    s->fd = dup(g_segfd);
    s->end = img_len;
    if (s->fd < 0)
        abort();
    seg_insert(g_l3, s);

    /* What the iterator would hand over: from the first key >= "k", each key once. */
    qsort(recs, n, sizeof(*recs), rec_cmp);
    static fz_state st;
    memset(&st, 0, sizeof(st));
    st.a.l3 = g_l3;
    st.a.ref_end = tkv_xcalloc(g_l3->segs_cap, sizeof(*st.a.ref_end));
    st.a.drop = rocksdb_writebatch_create();
    for (size_t i = 0; i < n; i++) {
        if (i && recs[i].klen == recs[i - 1].klen &&
            !memcmp(recs[i].k, recs[i - 1].k, recs[i].klen))
            continue; /* shadowed */
        if (rec_cmp(&recs[i], &(fz_rec){.k = "k", .klen = 1, .order = SIZE_MAX}) < 0)
            continue; /* before the seek target */
        if (idx_entry(g_l3, recs[i].k, recs[i].klen, recs[i].v, recs[i].vlen, admit, &st) < 0)
            break;
    }
    /* The dropped records would be deleted from the index here (idx_commit). */
    int rc = recover_segments(g_l3, st.a.ref_end);
    if (rc == TKV_OK && g_l3->num_blocks && !g_l3->segs[g_seg_id])
        abort(); /* a kept block's segment is never deleted */

    /* Reads, item by item as tkv_l3_get_batch sets them up after its lookup. */
    for (size_t i = 0; i < st.n; i++) {
        r_item *it = &st.items[i];
        it->dst = g_dst;
        it->cap = kBlockBytes;
        it->status = L3_PENDING;
        if (it->cap < it->rec.raw_len) {
            it->status = TKV_EINVAL;
            continue;
        }
        it->seg = seg_ref(g_l3, it->rec.seg);
        if (!it->seg)
            it->status = TKV_ECORRUPT;
    }
    for (size_t i = 0; i < st.n; i++) {
        r_item *it = &st.items[i];
        r_run(g_l3, it, 1); /* one at a time: the destination is shared */
        if (it->status != TKV_OK)
            continue;
        if (it->len > kBlockBytes)
            abort();
        /* Under the true index, what is served is the block put under that key, whole; a
         * forged record may name another block's bytes (consistent with its checksum). */
        int b = it->key.b[0] - 0xa0;
        if (!forged && (b < 0 || b >= kBlocks || it->len != kBlockBytes ||
                        memcmp(g_dst, g_payload[b], kBlockBytes)))
            abort();
    }

    if (g_l3->segs[g_seg_id])
        size = g_l3->segs[g_seg_id]->end; /* recovery may have cut the file */
    rocksdb_writebatch_destroy(st.a.drop);
    free(st.a.ref_end);
    for (uint32_t id = 0; id < g_l3->segs_cap; id++) {
        if (g_l3->segs[id]) {
            if (g_l3->segs[id]->refs)
                abort(); /* every read released its reference */
            close(g_l3->segs[id]->fd);
            free(g_l3->segs[id]);
            g_l3->segs[id] = NULL;
        }
    }
    g_l3->num_blocks = g_l3->raw_bytes = g_l3->stored_bytes = g_l3->disk_bytes = 0;
    g_l3->cur_id = 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t n)
{
    if (n < 1)
        return 0;
    int mode = data[0] % 5;
    const uint8_t *p = data + 1;
    size_t m = n - 1;
    static fz_rec recs[512];
    static uint8_t img[1 << 16];
    if (mode == 0) {
        memcpy(recs, g_true, sizeof(g_true));
        recover_and_read(p, m, recs, kBlocks, 0);
    } else if (mode == 1) {
        memcpy(img, g_seg, g_seg_len);
        size_t len = g_seg_len;
        if (m >= 4) {
            uint32_t off;
            memcpy(&off, p, 4);
            off %= (uint32_t)g_seg_len + 1;
            size_t w = m - 4;
            if (off + w > sizeof(img))
                w = sizeof(img) - off;
            memcpy(img + off, p + 4, w);
            if (off + w > len)
                len = off + w;
        }
        memcpy(recs, g_true, sizeof(g_true));
        recover_and_read(img, len, recs, kBlocks, 0);
    } else if (mode == 2) {
        size_t k = parse_records(p, m, recs, sizeof(recs) / sizeof(recs[0]));
        recover_and_read(g_seg, g_seg_len, recs, k, 1);
    } else if (mode == 3) {
        char name[300];
        size_t k = m < sizeof(name) - 1 ? m : sizeof(name) - 1;
        memcpy(name, p, k);
        name[k] = 0;
        uint32_t id = 0;
        if (seg_name_id(name, &id)) {
            /* only the name seg_path gives that id: two names never alias one segment */
            char want[600], got[600];
            seg_path(g_l3, id, want, sizeof(want));
            snprintf(got, sizeof(got), "%s/%s", g_l3->dir, name);
            if (id == 0 || id >= 0x7fffffffu || strcmp(want, got) != 0)
                abort();
        }
    } else {
        int rc = meta_parse(g_l3, p, m);
        if ((rc == TKV_OK) != (m == L3_META_LEN && !memcmp(p, L3_META_MAGIC, 8) &&
                               !memcmp(p + 8, g_fp, TKV_KEY_BYTES)))
            abort();
    }
    return 0;
}
