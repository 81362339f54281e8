/* tkv_l3_hooks.h - internal helpers of the L3 store shared with its tests and benchmark.
 *
 * Not part of the storage API: the tier manager uses tkv_l3.h only.
 */
#ifndef TKV_L3_HOOKS_H
#define TKV_L3_HOOKS_H

#include <stddef.h>
#include <stdint.h>

#include "tkv_l3.h"

#ifdef __cplusplus
extern "C" {
#endif

/* Fault injection for tests: after `after_bytes` more payload bytes have been written,
 * every payload write of this store fails with errno `err` (e.g. ENOSPC) as if the OS
 * had returned it. err == 0 switches injection off. Thread-safe. */
void tkv_l3_inject_write_error(tkv_l3 *l3, int err, uint64_t after_bytes);

/* Where a block's payload lies on disk: the segment file's path (dir/seg-XXXXXXXX.dat) and
 * the byte offset and stored length there. For the crash and corruption tests, which flip
 * bytes on disk. TKV_ENOTFOUND when the key is not indexed. */
int tkv_l3_locate(tkv_l3 *l3, const tkv_key *key, char *path, size_t path_len,
                  uint64_t *offset, uint64_t *stored_len);

#ifdef __cplusplus
}
#endif
#endif
