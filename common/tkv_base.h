/* tkv_base.h - the one error model, assert, log and allocation policy of tierkv's internals.
 *
 * Every module below the public client API returns `int`: TKV_OK (0) or a negative
 * TKV_E* code from this list. "Cannot happen" is TKV_ASSERT (file:line, abort); "can fail"
 * is a returned status. Out-of-memory is decided once, here: tkv_xmalloc() and friends log
 * and abort, because a cache daemon that half-built a structure is worse than one that
 * restarts (the L3 index survives a restart; see docs/design.md).
 */
#ifndef TKV_BASE_H
#define TKV_BASE_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

enum {
    TKV_OK = 0,
    TKV_EINVAL = -1,       /* bad argument or malformed input            (INVALID_ARGUMENT) */
    TKV_ENOMEM = -2,       /* a bounded resource other than memory ran out (RESOURCE_EXHAUSTED) */
    TKV_ENOTFOUND = -3,    /* no such key / lease / block                (NOT_FOUND) */
    TKV_EEXIST = -4,       /* already present                            (ALREADY_EXISTS) */
    TKV_EFULL = -5,        /* tier full and nothing evictable            (RESOURCE_EXHAUSTED) */
    TKV_EGEOMETRY = -6,    /* geometry / model fingerprint mismatch      (FAILED_PRECONDITION) */
    TKV_ECHECKSUM = -7,    /* payload failed its checksum; block dropped  (DATA_LOSS) */
    TKV_EIO = -8,          /* I/O error from the OS                      (UNAVAILABLE) */
    TKV_EBUSY = -9,        /* block is pinned by a lease                 (FAILED_PRECONDITION) */
    TKV_ESTATE = -10,      /* block in the wrong state for this operation (FAILED_PRECONDITION) */
    TKV_ECLOSED = -11,     /* object is shutting down                    (UNAVAILABLE) */
    TKV_ETIMEDOUT = -12,   /* deadline passed                            (DEADLINE_EXCEEDED) */
    TKV_EUNSUPPORTED = -13,/* valid but not supported here               (UNIMPLEMENTED) */
    TKV_ENOSPC = -14,      /* disk full                                  (RESOURCE_EXHAUSTED) */
    TKV_EREADONLY = -15,   /* tier degraded to read-only after errors    (UNAVAILABLE) */
    TKV_ECORRUPT = -16,    /* on-disk structure is damaged               (DATA_LOSS) */
    TKV_EXPIRED = -17,     /* lease expired                              (NOT_FOUND) */
};

/* Static message for a TKV_* code; never NULL. */
const char *tkv_strerror(int err);

/* ---- assert: "cannot happen" ---- */
void tkv_assert_fail(const char *expr, const char *file, int line) __attribute__((noreturn));
#define TKV_ASSERT(e) ((e) ? (void)0 : tkv_assert_fail(#e, __FILE__, __LINE__))

/* ---- allocation: abort on OOM (the single policy) ---- */
void *tkv_xmalloc(size_t n);
void *tkv_xcalloc(size_t n, size_t size);
void *tkv_xrealloc(void *p, size_t n);
char *tkv_xstrdup(const char *s);

/* ---- logging ----
 * TKV_LOG does not evaluate its arguments when the level is below the threshold.
 * Thread-safe; lines are written whole. tkv_log_open(NULL) logs to stderr.
 * tkv_log_reopen() reopens the same path (SIGHUP, for logrotate); async-signal-unsafe:
 * call it from a normal thread after the signal was noted. */
enum { TKV_LOG_ERROR = 0, TKV_LOG_WARN = 1, TKV_LOG_INFO = 2, TKV_LOG_DEBUG = 3 };
extern int tkv_log_level;
int tkv_log_open(const char *path);
int tkv_log_reopen(void);
int tkv_log_level_parse(const char *name); /* "error".."debug" -> level, or TKV_EINVAL */
void tkv_log_write(int level, const char *file, int line, const char *fmt, ...)
    __attribute__((format(printf, 4, 5)));
#define TKV_LOG(level, ...)                                                  \
    do {                                                                     \
        if ((level) <= tkv_log_level)                                        \
            tkv_log_write((level), __FILE__, __LINE__, __VA_ARGS__);         \
    } while (0)

/* ---- time ---- */
uint64_t tkv_now_ns(void);       /* CLOCK_MONOTONIC */
uint64_t tkv_wall_ms(void);      /* CLOCK_REALTIME, for records and logs */

#ifdef __cplusplus
}
#endif
#endif
