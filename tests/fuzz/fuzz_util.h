/* fuzz_util.h - what the libFuzzer harnesses share: the input as a file (the parsers under
 * test read paths, as they do in the daemon). */
#ifndef TKV_FUZZ_UTIL_H
#define TKV_FUZZ_UTIL_H

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <unistd.h>

/* Writes data into one memfd (reused across inputs) and returns a path that opens it. */
static inline const char *fuzz_as_file(const uint8_t *data, size_t n)
{
    static int fd = -1;
    static char path[64];
    if (fd < 0) {
        fd = memfd_create("tkv-fuzz-input", MFD_CLOEXEC);
        if (fd < 0)
            abort();
        snprintf(path, sizeof(path), "/proc/self/fd/%d", fd);
    }
    if (ftruncate(fd, 0) != 0 || (n && pwrite(fd, data, n, 0) != (ssize_t)n))
        abort();
    return path;
}

#endif
