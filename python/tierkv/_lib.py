"""_lib.py - loads libkvclient with ctypes and declares the host-side C API of
client/kvclient.h (argument and result types of every function the package calls).

The library is found, in order: $TIERKV_LIBKVCLIENT (a path to libkvclient.so), then the
system's loader search (ldconfig, LD_LIBRARY_PATH) for libkvclient.so.0 / libkvclient.so.
Loaded once, on first use.
"""
import ctypes
import ctypes.util
import os
import threading

c_u32, c_u64, c_i64, c_int, c_size, c_dbl = (ctypes.c_uint32, ctypes.c_uint64, ctypes.c_int64,
                                             ctypes.c_int, ctypes.c_size_t, ctypes.c_double)
c_vp, c_cp = ctypes.c_void_p, ctypes.c_char_p
P_u32, P_u64 = ctypes.POINTER(c_u32), ctypes.POINTER(c_u64)


class PutResult(ctypes.Structure):
    _fields_ = [("num_stored", c_u32), ("num_duplicate", c_u32), ("num_rejected", c_u32)]


class Iov(ctypes.Structure):
    """kvc_iov: one piece of a block. An array of them is laid out as int64 (address, bytes)
    pairs on the 64-bit ABIs the package supports (checked in client.py)."""
    _fields_ = [("base", c_vp), ("len", c_size)]


class TierStats(ctypes.Structure):
    _fields_ = [("tier", c_int), ("blocks", c_u64), ("bytes", c_u64),
                ("capacity_blocks", c_u64), ("hit_blocks", c_u64)]


class Stats(ctypes.Structure):
    _fields_ = [(n, c_u64) for n in (
        "lookups", "hit_blocks", "miss_blocks", "hit_tokens", "promotions", "promotion_bytes",
        "demotions", "demotion_bytes", "evictions", "checksum_failures", "io_errors",
        "leases_active", "clients_connected")] + [
        ("lookup_p50_us", c_dbl), ("lookup_p99_us", c_dbl)] + [(n, c_u64) for n in (
            "uptime_s", "puts", "put_blocks", "gets", "get_bytes")] + [
        ("l3_readonly", c_int), ("policy", ctypes.c_char * 32), ("tiers", TierStats * 4),
        ("num_layers", c_u32), ("num_kv_heads", c_u32), ("head_dim", c_u32),
        ("block_tokens", c_u32), ("block_bytes", c_u64), ("kv_dtype", ctypes.c_char * 16),
        ("scale_mode", ctypes.c_char * 16), ("model_id", ctypes.c_char * 128)]


class Health(ctypes.Structure):
    _fields_ = [("status", ctypes.c_char * 16), ("version", ctypes.c_char * 32),
                ("notes", ctypes.c_char * 512)]


# name: (restype, argtypes). The host-side section and the pool accessors: the engine-side
# kernels (kvc_store, kvc_attend, kvc_merge) take parameter structs and are for C/CUDA engines.
_SIGS = {
    "kvc_strerror": (c_cp, [c_int]),
    "kvc_last_error": (c_cp, []),
    "kvc_tier_name": (c_cp, [c_int]),
    "kvc_opts_new": (c_vp, []),
    "kvc_opts_free": (None, [c_vp]),
    "kvc_opts_set_socket": (c_int, [c_vp, c_cp]),
    "kvc_opts_set_target": (c_int, [c_vp, c_cp]),
    "kvc_opts_set_attach_socket": (c_int, [c_vp, c_cp]),
    "kvc_opts_set_namespace": (c_int, [c_vp, c_cp]),
    "kvc_opts_set_geometry": (c_int, [c_vp, c_u32, c_u32, c_u32, c_u32, c_cp, c_cp, c_cp]),
    "kvc_opts_set_timeout_ms": (c_int, [c_vp, c_u32]),
    "kvc_opts_set_max_blocks_per_call": (c_int, [c_vp, c_u32]),
    "kvc_opts_set_trusted": (c_int, [c_vp, c_int]),
    "kvc_opts_set_lease_ttl_ms": (c_int, [c_vp, c_u32]),
    "kvc_connect": (c_int, [c_vp, ctypes.POINTER(c_vp)]),
    "kvc_close": (None, [c_vp]),
    "kvc_block_bytes": (c_size, [c_vp]),
    "kvc_block_tokens": (c_u32, [c_vp]),
    "kvc_is_attached": (c_int, [c_vp]),
    "kvc_client_id": (c_u64, [c_vp]),
    "kvc_fingerprint_hex": (None, [c_vp, ctypes.c_char * 65]),
    "kvc_lookup": (c_int, [c_vp, P_u32, c_size, c_u32, ctypes.POINTER(c_vp)]),
    "kvc_lookup_batch": (c_int, [c_vp, ctypes.POINTER(P_u32), ctypes.POINTER(c_size), c_size,
                                 c_u32, ctypes.POINTER(c_vp)]),
    "kvc_lease_id": (c_u64, [c_vp]),
    "kvc_lease_num_blocks": (c_u32, [c_vp]),
    "kvc_lease_num_query_blocks": (c_u32, [c_vp]),
    "kvc_lease_tier": (c_int, [c_vp, c_u32]),
    "kvc_lease_block_ptr": (c_vp, [c_vp, c_vp, c_u32]),
    "kvc_prefetch": (c_int, [c_vp, c_vp, c_int, P_u64]),
    "kvc_wait": (c_int, [c_vp, c_vp, c_int, c_u32]),
    "kvc_get": (c_int, [c_vp, c_vp, c_u32, c_u32, c_vp, c_size]),
    "kvc_release": (c_int, [c_vp, c_vp]),
    "kvc_put": (c_int, [c_vp, P_u32, c_size, c_u32, c_vp, c_u32, ctypes.POINTER(PutResult)]),
    # iov: kvc_iov[] by address (an int64 array of (address, bytes) pairs: see client.py)
    "kvc_get_scatter": (c_int, [c_vp, c_vp, c_u32, c_u32, c_vp, c_u32]),
    "kvc_put_gather": (c_int, [c_vp, P_u32, c_size, c_u32, c_vp, c_u32, c_u32,
                               ctypes.POINTER(PutResult)]),
    "kvc_alloc": (c_int, [c_vp, c_u32, P_u64, P_u64]),
    "kvc_write": (c_int, [c_vp, c_u64, c_u32, c_vp, c_size]),
    "kvc_commit": (c_int, [c_vp, c_u64, P_u32, c_size, c_u32, c_u32, ctypes.POINTER(PutResult)]),
    "kvc_abort": (c_int, [c_vp, c_u64]),
    # the engine side's pool accessors (plain arithmetic on the client: no kernel structs)
    "kvc_has_l1": (c_int, [c_vp]),
    "kvc_pool_base": (c_vp, [c_vp, c_int]),
    "kvc_pool_num_blocks": (c_i64, [c_vp, c_int]),
    "kvc_lease_block_id": (c_i64, [c_vp, c_vp, c_u32, c_int]),
    "kvc_stats_get": (c_int, [c_vp, ctypes.POINTER(Stats)]),
    "kvc_health_get": (c_int, [c_vp, ctypes.POINTER(Health)]),
    "kvc_evict": (c_int, [c_vp, c_int, P_u32, c_size, P_u32, P_u32]),
    "kvc_flush": (c_int, [c_vp]),
}

_lock = threading.Lock()
_lib = None


def _find():
    path = os.environ.get("TIERKV_LIBKVCLIENT")
    if path:
        return path
    for name in ("libkvclient.so.0", "libkvclient.so"):
        try:
            ctypes.CDLL(name)
            return name
        except OSError:
            pass
    found = ctypes.util.find_library("kvclient")
    if found:
        return found
    raise OSError("libkvclient not found: set TIERKV_LIBKVCLIENT to the path of "
                  "libkvclient.so, or install it (cmake --install)")


def lib():
    """The loaded library, with every declared function typed."""
    global _lib
    with _lock:
        if _lib is None:
            handle = ctypes.CDLL(_find())
            for name, (res, args) in _SIGS.items():
                fn = getattr(handle, name, None)
                if fn is None:  # an older libkvclient: that method raises Unsupported
                    continue
                fn.restype = res
                fn.argtypes = args
            _lib = handle
        return _lib
