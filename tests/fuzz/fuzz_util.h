/* fuzz_util.h - what the libFuzzer harnesses share: the input as a stream. */
#ifndef TKV_FUZZ_UTIL_H
#define TKV_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

/* The input as a read-only stream over its bytes (fclose it): the parsers' stream readers
 * (tkvd_config_read, trace_read) get what their path loaders would read from a file, with no
 * file and no system call per input. */
static inline FILE *fuzz_as_stream(const uint8_t *data, size_t n)
{
    FILE *f = fmemopen((void *)(n ? data : (const uint8_t *)""), n, "r");
    if (!f)
        abort();
    return f;
}

#endif
