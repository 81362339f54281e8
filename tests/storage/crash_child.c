/* crash_child.c - the process the crash test kills: writes blocks into the store at argv[1]
 * forever and reports on fd 3 each block once it is durable, and each block it is about to
 * delete. Usage: storage_crash_child DIR ROUND psync|uring|store
 *
 *   store        through the whole store: tkv_store_put, then tkv_store_flush (write-through
 *                to L3); a block is reported once the flush returned
 *   psync|uring  through tkv_l3 directly: reported once put_batch returned OK; also deletes
 *                and compacts now and then, so kills land inside compactions too */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crash_payload.h"
#include "tkv_l3.h"
#include "tkv_store.h"

static void report(uint8_t type, uint64_t id)
{
    uint8_t msg[9];
    msg[0] = type;
    memcpy(msg + 1, &id, 8);
    /* 9 bytes < PIPE_BUF: the write is atomic, so a kill never leaves half a message */
    if (write(3, msg, sizeof(msg)) != (ssize_t)sizeof(msg))
        exit(3);
}

static int via_store(const char *dir, uint64_t round)
{
    uint8_t fp[TKV_KEY_BYTES];
    tu_fingerprint(fp, 1);
    tkv_store_opts *o = tkv_store_opts_new();
    tkv_store_opts_set_block(o, CRASH_MAX_BLOCK, 16);
    tkv_store_opts_set_fingerprint(o, fp);
    tkv_store_opts_set_l2_blocks(o, 64);
    tkv_store_opts_set_l3(o, dir, 0);
    tkv_store_opts_set_write_through(o, true);
    tkv_store_opts_set_workers(o, 2);
    tkv_store *s = NULL;
    int rc = tkv_store_open(o, &s);
    tkv_store_opts_free(o);
    if (rc != TKV_OK) {
        fprintf(stderr, "crash child: store open: %s\n", tkv_strerror(rc));
        return 1;
    }
    uint8_t *bufs = malloc(4 * (size_t)CRASH_MAX_BLOCK);
    uint64_t next = 0;
    for (uint64_t batch = 0; next + 4 < CRASH_IDS_PER_ROUND; batch++) {
        size_t n = 1 + (size_t)(tu_mix(round * 7919 + batch) % 4);
        tkv_key keys[4], parent;
        uint32_t tokens[4 * 16];
        const void *payloads[4];
        uint64_t first = round * CRASH_IDS_PER_ROUND + next;
        crash_key(&parent, first - 1);
        for (size_t i = 0; i < n; i++) {
            uint64_t id = first + i;
            crash_fill(bufs + i * CRASH_MAX_BLOCK, id);
            crash_key(&keys[i], id);
            for (int t = 0; t < 16; t++)
                tokens[i * 16 + (size_t)t] = (uint32_t)(id + (uint64_t)t);
            payloads[i] = bufs + i * CRASH_MAX_BLOCK;
        }
        size_t stored = 0;
        rc = tkv_store_put(s, &parent, keys, tokens, payloads, n, &stored);
        if (rc == TKV_OK)
            rc = tkv_store_flush(s);
        if (rc != TKV_OK) {
            fprintf(stderr, "crash child: store put/flush: %s\n", tkv_strerror(rc));
            return 1;
        }
        next += n;
        /* durable only when the store took them (admission may refuse) and flushed */
        if (stored == n)
            for (size_t i = 0; i < n; i++)
                report(CRASH_MSG_DURABLE, first + i);
    }
    free(bufs);
    tkv_store_close(s);
    return 0;
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s DIR ROUND psync|uring|store\n", argv[0]);
        return 2;
    }
    tkv_log_level = TKV_LOG_ERROR - 1;
    uint64_t round = strtoull(argv[2], NULL, 10);
    if (strcmp(argv[3], "store") == 0)
        return via_store(argv[1], round);
    int mode = strcmp(argv[3], "uring") == 0 ? TKV_IO_URING : TKV_IO_PSYNC;
    tu_auto_compact = 1; /* the background compactor runs too, and gets killed mid-way */
    tkv_l3 *l3 = NULL;
    int rc = tu_l3_open(argv[1], mode, 1, CRASH_MAX_BLOCK, 256 * 1024, 1, &l3);
    if (rc != TKV_OK) {
        fprintf(stderr, "crash child: open: %s\n", tkv_strerror(rc));
        return 1;
    }
    uint8_t *bufs[4];
    for (int i = 0; i < 4; i++)
        bufs[i] = malloc(CRASH_MAX_BLOCK);
    uint32_t tokens[16];
    uint64_t next = 0;
    for (uint64_t batch = 0; next + 4 < CRASH_IDS_PER_ROUND; batch++) {
        size_t n = 1 + (size_t)(tu_mix(round * 7919 + batch) % 4);
        tkv_l3_put_req reqs[4];
        memset(reqs, 0, sizeof(reqs));
        for (size_t i = 0; i < n; i++) {
            uint64_t id = round * CRASH_IDS_PER_ROUND + next++;
            crash_fill(bufs[i], id);
            for (int t = 0; t < 16; t++)
                tokens[t] = (uint32_t)(id + (uint64_t)t);
            crash_key(&reqs[i].key, id);
            crash_key(&reqs[i].parent, id - 1);
            reqs[i].payload = bufs[i];
            reqs[i].len = crash_len(id);
            reqs[i].tokens = tokens;
            reqs[i].num_tokens = 16;
        }
        rc = tkv_l3_put_batch(l3, reqs, n);
        if (rc != TKV_OK) {
            fprintf(stderr, "crash child: put: %s\n", tkv_strerror(rc));
            return 1;
        }
        for (size_t i = 0; i < n; i++)
            report(CRASH_MSG_DURABLE, round * CRASH_IDS_PER_ROUND + next - n + i);
        if (batch % 3 == 2 && next > 8) { /* delete an earlier block of this round */
            uint64_t id = round * CRASH_IDS_PER_ROUND + tu_mix(batch) % (next - 4);
            tkv_key k;
            crash_key(&k, id);
            report(CRASH_MSG_DELETING, id);
            if (tkv_l3_delete(l3, &k, 1) != TKV_OK)
                return 1;
        }
        if (batch % 16 == 15) {
            uint64_t reclaimed;
            rc = tkv_l3_compact(l3, &reclaimed);
            if (rc != TKV_OK) {
                fprintf(stderr, "crash child: compact: %s\n", tkv_strerror(rc));
                return 1;
            }
        }
    }
    for (int i = 0; i < 4; i++)
        free(bufs[i]);
    tkv_l3_close(l3);
    return 0;
}
