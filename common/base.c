/* base.c - error strings, assert, allocation policy, logging, clocks (see tkv_base.h). */
#include "tkv_base.h"

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

const char *tkv_strerror(int err)
{
    switch (err) {
    case TKV_OK: return "ok";
    case TKV_EINVAL: return "invalid argument";
    case TKV_ENOMEM: return "out of resources";
    case TKV_ENOTFOUND: return "not found";
    case TKV_EEXIST: return "already exists";
    case TKV_EFULL: return "tier full: nothing evictable";
    case TKV_EGEOMETRY: return "geometry or model fingerprint mismatch";
    case TKV_ECHECKSUM: return "checksum mismatch: block dropped";
    case TKV_EIO: return "I/O error";
    case TKV_EBUSY: return "block is pinned";
    case TKV_ESTATE: return "block in wrong state";
    case TKV_ECLOSED: return "shutting down";
    case TKV_ETIMEDOUT: return "timed out";
    case TKV_EUNSUPPORTED: return "not supported";
    case TKV_ENOSPC: return "no space left on device";
    case TKV_EREADONLY: return "tier is read-only after errors";
    case TKV_ECORRUPT: return "corrupt on-disk data";
    case TKV_EXPIRED: return "lease expired";
    default: return "unknown error";
    }
}

void tkv_assert_fail(const char *expr, const char *file, int line)
{
    fprintf(stderr, "tierkv: assertion failed: %s (%s:%d)\n", expr, file, line);
    fflush(stderr);
    abort();
}

static void oom(size_t n)
{
    fprintf(stderr, "tierkv: out of memory allocating %zu bytes\n", n);
    fflush(stderr);
    abort();
}

void *tkv_xmalloc(size_t n)
{
    void *p = malloc(n ? n : 1);
    if (!p)
        oom(n);
    return p;
}

void *tkv_xcalloc(size_t n, size_t size)
{
    void *p = calloc(n ? n : 1, size ? size : 1);
    if (!p)
        oom(n * size);
    return p;
}

void *tkv_xrealloc(void *p, size_t n)
{
    void *q = realloc(p, n ? n : 1);
    if (!q)
        oom(n);
    return q;
}

char *tkv_xstrdup(const char *s)
{
    size_t n = strlen(s) + 1;
    char *p = tkv_xmalloc(n);
    memcpy(p, s, n);
    return p;
}

/* ---- logging ---- */

int tkv_log_level = TKV_LOG_INFO;
static pthread_mutex_t log_mu = PTHREAD_MUTEX_INITIALIZER;
static FILE *log_fp;     /* NULL = stderr */
static char *log_path;

int tkv_log_open(const char *path)
{
    int rc = TKV_OK;
    pthread_mutex_lock(&log_mu);
    if (log_fp)
        fclose(log_fp);
    log_fp = NULL;
    free(log_path);
    log_path = NULL;
    if (path) {
        log_fp = fopen(path, "ae");
        if (!log_fp)
            rc = TKV_EIO;
        else
            log_path = tkv_xstrdup(path);
    }
    pthread_mutex_unlock(&log_mu);
    return rc;
}

int tkv_log_reopen(void)
{
    int rc = TKV_OK;
    pthread_mutex_lock(&log_mu);
    if (log_path) {
        FILE *fp = fopen(log_path, "ae");
        if (fp) {
            fclose(log_fp);
            log_fp = fp;
        } else {
            rc = TKV_EIO; /* keep writing to the old file rather than lose lines */
        }
    }
    pthread_mutex_unlock(&log_mu);
    return rc;
}

int tkv_log_level_parse(const char *name)
{
    static const char *names[] = {"error", "warn", "info", "debug"};
    for (int i = 0; i < 4; i++)
        if (name && strcmp(name, names[i]) == 0)
            return i;
    return TKV_EINVAL;
}

void tkv_log_write(int level, const char *file, int line, const char *fmt, ...)
{
    static const char tag[] = "EWID";
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);

    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    struct tm tm;
    gmtime_r(&ts.tv_sec, &tm);
    const char *base = strrchr(file, '/');
    base = base ? base + 1 : file;

    pthread_mutex_lock(&log_mu);
    FILE *fp = log_fp ? log_fp : stderr;
    fprintf(fp, "%04d-%02d-%02dT%02d:%02d:%02d.%03ldZ %c %s:%d %s\n", tm.tm_year + 1900,
            tm.tm_mon + 1, tm.tm_mday, tm.tm_hour, tm.tm_min, tm.tm_sec, ts.tv_nsec / 1000000,
            tag[level < 0 ? 0 : level > 3 ? 3 : level], base, line, msg);
    fflush(fp);
    pthread_mutex_unlock(&log_mu);
}

uint64_t tkv_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

uint64_t tkv_wall_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (uint64_t)ts.tv_sec * 1000ull + (uint64_t)ts.tv_nsec / 1000000ull;
}
