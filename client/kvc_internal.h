/* kvc_internal.h - what libkvclient's modules share and engines never see (not installed;
 * the version script keeps these symbols out of the shared object). */
#ifndef KVC_INTERNAL_H
#define KVC_INTERNAL_H

/* Sets the calling thread's kvc_last_error() to "<name of code>: <message>"; returns code. */
__attribute__((format(printf, 2, 3))) int tkv_kvc_fail(int code, const char *fmt, ...);

#endif
