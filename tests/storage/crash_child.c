/* crash_child.c - the process the crash test kills: writes blocks to the L3 store at argv[1]
 * forever and reports on fd 3 each block once it is durable (put_batch returned OK), and each
 * block it is about to delete. Also deletes and compacts now and then, so kills land inside
 * compactions too. Usage: storage_crash_child DIR ROUND psync|uring */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "crash_payload.h"
#include "tkv_l3.h"

static void report(uint8_t type, uint64_t id)
{
    uint8_t msg[9];
    msg[0] = type;
    memcpy(msg + 1, &id, 8);
    /* 9 bytes < PIPE_BUF: the write is atomic, so a kill never leaves half a message */
    if (write(3, msg, sizeof(msg)) != (ssize_t)sizeof(msg))
        exit(3);
}

int main(int argc, char **argv)
{
    if (argc != 4) {
        fprintf(stderr, "usage: %s DIR ROUND psync|uring\n", argv[0]);
        return 2;
    }
    tkv_log_level = TKV_LOG_ERROR - 1;
    uint64_t round = strtoull(argv[2], NULL, 10);
    int mode = strcmp(argv[3], "uring") == 0 ? TKV_IO_URING : TKV_IO_PSYNC;
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
