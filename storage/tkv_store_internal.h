/* tkv_store_internal.h - hooks into the tier manager for its own tests (internal).
 * Not part of the storage API. */
#ifndef TKV_STORE_INTERNAL_H
#define TKV_STORE_INTERNAL_H

#include "tkv_l3.h"
#include "tkv_store.h"

/* The store's L3 handle (NULL when L3 is off), e.g. for fault injection in tests. */
tkv_l3 *tkv_store_l3_handle(tkv_store *s);

#endif
