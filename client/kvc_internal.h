/* kvc_internal.h - what libkvclient's modules share and engines never see (not installed;
 * the version script keeps these symbols out of the shared object). */
#ifndef KVC_INTERNAL_H
#define KVC_INTERNAL_H

#include "kvclient.h"

struct tkvk_layout;

/* Sets the calling thread's kvc_last_error() to "<name of code>: <message>"; returns code. */
__attribute__((format(printf, 2, 3))) int tkv_kvc_fail(int code, const char *fmt, ...);

/* The kernels' layout of the client's geometry with block_stride = that tier's pool stride
 * (kvclient.c, which holds the geometry; engine.c turns it into the public kvc_layout).
 * KVC_EINVAL for a tier other than L1/L2, KVC_EUNSUPPORTED for a geometry outside the kernels'
 * shapes, KVC_EPROTO when the daemon's block size disagrees with the layout's. */
int tkv_kvc_kernel_layout(const kvc_client *c, int tier, struct tkvk_layout *out);

#endif
