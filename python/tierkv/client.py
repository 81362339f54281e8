"""client.py - Client and Lease: the host-side API of libkvclient (client/kvclient.h).

Every method is one C call however many blocks it moves (the library splits large puts and
gets into messages itself). Buffers are passed by address, never copied on the Python side:
numpy arrays and torch CPU tensors by their data pointer (C-contiguous required), bytes /
bytearray / memoryview through the buffer protocol. Failures raise TierKVError (a subclass
per code) carrying kvc_last_error(), i.e. the daemon's own message where there was one.
"""
import array
import ctypes
from dataclasses import dataclass

from . import _lib
from ._lib import PutResult

OK = 0
TIER_NONE, TIER_L1, TIER_L2, TIER_L3 = 0, 1, 2, 3


class TierKVError(Exception):
    """A libkvclient failure: .code is the KVC_E* value, str() the library's message."""
    code = None

    def __init__(self, code, message):
        super().__init__(message)
        self.code = code


class InvalidArgument(TierKVError): pass        # KVC_EINVAL        # noqa: E701
class Unavailable(TierKVError): pass            # KVC_EUNAVAILABLE  # noqa: E701
class NotFound(TierKVError): pass               # KVC_ENOTFOUND     # noqa: E701
class GeometryMismatch(TierKVError): pass       # KVC_EGEOMETRY     # noqa: E701
class Full(TierKVError): pass                   # KVC_EFULL         # noqa: E701
class DataLoss(TierKVError): pass               # KVC_EDATALOSS     # noqa: E701
class TimedOut(TierKVError): pass               # KVC_ETIMEDOUT     # noqa: E701
class Busy(TierKVError): pass                   # KVC_EBUSY         # noqa: E701
class ProtocolError(TierKVError): pass          # KVC_EPROTO        # noqa: E701
class AttachError(TierKVError): pass            # KVC_EATTACH       # noqa: E701
class Unsupported(TierKVError): pass            # KVC_EUNSUPPORTED  # noqa: E701
class InternalError(TierKVError): pass          # KVC_EINTERNAL     # noqa: E701
class Cancelled(TierKVError): pass              # KVC_ECANCELLED    # noqa: E701


_BY_CODE = {-1: InvalidArgument, -2: Unavailable, -3: NotFound, -4: GeometryMismatch, -5: Full,
            -6: DataLoss, -7: TimedOut, -8: Busy, -9: ProtocolError, -10: AttachError,
            -11: Unsupported, -12: InternalError, -13: Cancelled}


def _check(rc, what):
    if rc != OK:
        msg = _lib.lib().kvc_last_error().decode(errors="replace")
        raise _BY_CODE.get(rc, TierKVError)(rc, f"{what}: {msg}")
    return rc


def _s(text):
    return None if text is None else text.encode()


@dataclass(frozen=True)
class Geometry:
    """The model geometry the daemon stores (kvc_opts_set_geometry)."""
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_tokens: int
    kv_dtype: str = "bf16"           # "bf16" (unquantised) | "fp8_e4m3"
    scale_mode: str = "per_tensor"   # "per_tensor" | "per_token_head" (fp8 only)
    model_id: str = "model"


# ---- buffers by address ---------------------------------------------------------------------

def _tokens(tokens):
    """(pointer, count, keep-alive) for a token sequence as u32: a C-contiguous uint32 numpy
    array or torch int tensor is passed as is when it already is u32; anything else is
    converted once (values must be in 0..2^32-1)."""
    try:
        import numpy as np
        if isinstance(tokens, np.ndarray) and tokens.dtype == np.uint32 and \
                tokens.flags.c_contiguous and tokens.ndim == 1:
            return ctypes.cast(tokens.ctypes.data, _lib.P_u32), tokens.size, tokens
    except ImportError:
        pass
    if hasattr(tokens, "tolist") and not isinstance(tokens, (list, tuple)):
        tokens = tokens.tolist()
    try:
        buf = array.array("I", tokens)
    except (OverflowError, TypeError) as e:
        raise InvalidArgument(-1, f"tokens must be integers in 0..2^32-1: {e}") from None
    if buf.itemsize != 4:  # pragma: no cover - every supported ABI has a 4-byte unsigned int
        buf = array.array("L", tokens)
    n = len(buf)
    if n == 0:
        return None, 0, buf
    ptr = (ctypes.c_uint32 * n).from_buffer(buf)
    return ctypes.cast(ptr, _lib.P_u32), n, (buf, ptr)


def buffer_address(obj, writable):
    """(address, nbytes, keep-alive) of a host buffer without copying it: torch CPU tensor,
    numpy array, bytes (read-only), bytearray, memoryview."""
    mod = type(obj).__module__
    if mod.startswith("torch"):
        if obj.device.type != "cpu":
            raise InvalidArgument(-1, f"tensor on {obj.device}: libkvclient copies host memory")
        if not obj.is_contiguous():
            raise InvalidArgument(-1, "tensor is not contiguous")
        return obj.data_ptr(), obj.numel() * obj.element_size(), obj
    if mod.startswith("numpy"):
        if not obj.flags.c_contiguous:
            raise InvalidArgument(-1, "array is not C-contiguous")
        if writable and not obj.flags.writeable:
            raise InvalidArgument(-1, "array is read-only")
        return obj.ctypes.data, obj.nbytes, obj
    if isinstance(obj, bytes):
        if writable:
            raise InvalidArgument(-1, "bytes is read-only: pass a bytearray or an array")
        return ctypes.cast(ctypes.c_char_p(obj), ctypes.c_void_p).value, len(obj), obj
    mv = memoryview(obj)
    if not mv.c_contiguous:
        raise InvalidArgument(-1, "buffer is not contiguous")
    if mv.readonly:
        if writable:
            raise InvalidArgument(-1, "buffer is read-only")
        b = bytes(mv)  # a read-only memoryview cannot be addressed through ctypes otherwise
        return buffer_address(b, False)
    c = (ctypes.c_char * mv.nbytes).from_buffer(mv)
    return ctypes.addressof(c), mv.nbytes, (mv, c)


def _iov(iov, num_blocks):
    """(address, pieces per block, keep-alive) of a block-piece table: a C-contiguous int64 /
    uint64 numpy array or torch CPU tensor of shape [num_blocks, pieces, 2], each row
    (address, bytes) of one piece (kvclient.h's kvc_iov, which is two 8-byte words here). The
    library validates the pieces (lengths add up to block_bytes, no NULL or wrapping piece)."""
    if ctypes.sizeof(_lib.Iov) != 16 or _lib.ctypes.sizeof(ctypes.c_void_p) != 8:
        raise Unsupported(-11, "scatter/gather needs a 64-bit ABI (kvc_iov of two 8-byte words)")
    mod = type(iov).__module__
    if mod.startswith("torch"):
        import torch
        ok = iov.dtype in (torch.int64, torch.uint64) if hasattr(torch, "uint64") else \
            iov.dtype == torch.int64
        if not ok or iov.device.type != "cpu" or not iov.is_contiguous():
            raise InvalidArgument(-1, f"iov: a contiguous int64 CPU tensor, not {iov.dtype} "
                                      f"on {iov.device}")
        addr = iov.data_ptr()
    elif mod.startswith("numpy"):
        if iov.dtype.kind not in "iu" or iov.dtype.itemsize != 8 or not iov.flags.c_contiguous:
            raise InvalidArgument(-1, f"iov: a C-contiguous int64 array, not {iov.dtype}")
        addr = iov.ctypes.data
    else:
        raise InvalidArgument(-1, "iov: a numpy array or torch tensor [blocks, pieces, 2]")
    shape = tuple(iov.shape)
    if len(shape) != 3 or shape[2] != 2 or shape[0] != num_blocks:
        raise InvalidArgument(-1, f"iov of shape {shape}: expected [{num_blocks}, pieces, 2]")
    if num_blocks == 0:
        return None, max(shape[1], 1), iov
    return addr, shape[1], iov


def _newer(name):
    """A function only recent libkvclients have (typed at load when present)."""
    L = _lib.lib()
    if name not in L.__dict__:
        raise Unsupported(-11, f"this libkvclient has no {name}")
    return getattr(L, name)


class _DeviceBytes:
    """Device memory by address, for torch.as_tensor (the CUDA array interface, version 3)."""

    def __init__(self, ptr, num_blocks, block_bytes):
        self.__cuda_array_interface__ = {"shape": (num_blocks, block_bytes), "typestr": "|u1",
                                         "data": (ptr, False), "strides": None, "version": 3}


# ---- the client -----------------------------------------------------------------------------

class Lease:
    """The pinned result of a lookup; release it (or use `with`)."""

    def __init__(self, client, handle):
        self._c = client
        self._h = handle
        L = _lib.lib()
        self.id = L.kvc_lease_id(handle)
        self.num_blocks = L.kvc_lease_num_blocks(handle)
        self.num_query_blocks = L.kvc_lease_num_query_blocks(handle)

    @property
    def handle(self):
        if not self._h:
            raise InvalidArgument(-1, "lease already released")
        return self._h

    @property
    def num_tokens(self):
        return self.num_blocks * self._c.block_tokens

    def tier(self, i):
        return _lib.lib().kvc_lease_tier(self.handle, i)

    def tiers(self):
        L, h = _lib.lib(), self.handle
        return [L.kvc_lease_tier(h, i) for i in range(self.num_blocks)]

    def block_ids(self, tier):
        """Slot numbers of the hit blocks in tier's mapped pool (kvc_lease_block_id), -1 for a
        block not there (as of the lookup or the last wait: wait after a prefetch)."""
        L, c, h = _lib.lib(), self._c.handle, self.handle
        return [L.kvc_lease_block_id(c, h, i, tier) for i in range(self.num_blocks)]

    def block_view(self, i):
        """A read-only memoryview of hit block i in the mapped L2 pool (no copy), or None when
        the client is not attached or the block is not in L2. Valid while the lease is held."""
        ptr = _lib.lib().kvc_lease_block_ptr(self._c.handle, self.handle, i)
        if not ptr:
            return None
        arr = (ctypes.c_char * self._c.block_bytes).from_address(ptr)
        return memoryview(arr).toreadonly()

    def release(self):
        if self._h:
            h, self._h = self._h, None
            if not self._c._h:  # kvc_close already freed every lease of the client
                return
            _check(_lib.lib().kvc_release(self._c._h, h), "release")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.release()

    def __del__(self):
        if getattr(self, "_h", None) and getattr(self._c, "_h", None):
            try:
                _lib.lib().kvc_release(self._c._h, self._h)
            except Exception:  # noqa: BLE001 - interpreter shutdown
                pass
            self._h = None


class Client:
    """A connection to tierkvd. Geometry None adopts the daemon's."""

    def __init__(self, socket=None, *, target=None, attach_socket=None, namespace="",
                 geometry=None, timeout_ms=None, max_blocks_per_call=None, lease_ttl_ms=None,
                 trusted=False):
        L = _lib.lib()
        self._h = None
        o = L.kvc_opts_new()
        try:
            if socket is not None:
                _check(L.kvc_opts_set_socket(o, _s(socket)), "socket")
            if target is not None:
                _check(L.kvc_opts_set_target(o, _s(target)), "target")
            if attach_socket is not None:
                _check(L.kvc_opts_set_attach_socket(o, _s(attach_socket)), "attach socket")
            _check(L.kvc_opts_set_namespace(o, _s(namespace)), "namespace")
            if geometry is not None:
                g = geometry
                _check(L.kvc_opts_set_geometry(o, g.num_layers, g.num_kv_heads, g.head_dim,
                                               g.block_tokens, _s(g.kv_dtype), _s(g.scale_mode),
                                               _s(g.model_id)), "geometry")
            if timeout_ms is not None:
                _check(L.kvc_opts_set_timeout_ms(o, timeout_ms), "timeout")
            if max_blocks_per_call is not None:
                _check(L.kvc_opts_set_max_blocks_per_call(o, max_blocks_per_call), "max blocks")
            if lease_ttl_ms is not None:
                _check(L.kvc_opts_set_lease_ttl_ms(o, lease_ttl_ms), "lease ttl")
            if trusted:
                _check(L.kvc_opts_set_trusted(o, 1), "trusted")
            h = ctypes.c_void_p()
            _check(L.kvc_connect(o, ctypes.byref(h)), "connect")
            self._h = h.value
        finally:
            L.kvc_opts_free(o)
        self.block_bytes = L.kvc_block_bytes(self._h)
        self.block_tokens = L.kvc_block_tokens(self._h)
        self.attached = bool(L.kvc_is_attached(self._h))
        self.client_id = L.kvc_client_id(self._h)
        fp = (ctypes.c_char * 65)()
        L.kvc_fingerprint_hex(self._h, fp)
        self.fingerprint = fp.value.decode()
        st = self.stats()
        self.geometry = Geometry(st["num_layers"], st["num_kv_heads"], st["head_dim"],
                                 st["block_tokens"], st["kv_dtype"], st["scale_mode"],
                                 st["model_id"])

    @property
    def handle(self):
        if not self._h:
            raise InvalidArgument(-1, "client closed")
        return self._h

    @property
    def has_l1(self):
        """True when the daemon's GPU pool (L1) is mapped in this process (an attached client,
        a libkvclient built with CUDA, the pool's device visible here)."""
        return bool(_newer("kvc_has_l1")(self.handle))

    def l1_pool(self):
        """The mapped L1 pool as a torch uint8 CUDA tensor [pool blocks, block_bytes] (no copy:
        the daemon's memory, opened by CUDA IPC at connect). Slot i holds a block only while a
        lease or allocation holds it; read it after wait(lease, TIER_L1). Valid until close()."""
        if not self.has_l1:
            raise Unavailable(-2, "l1_pool: the daemon's L1 pool is not mapped in this process")
        pool = getattr(self, "_l1_pool", None)
        if pool is None:
            import torch
            L = _lib.lib()
            base = L.kvc_pool_base(self.handle, TIER_L1)
            n = L.kvc_pool_num_blocks(self.handle, TIER_L1)
            if not base or n <= 0:
                raise Unavailable(-2, f"l1_pool: {L.kvc_last_error().decode()}")
            # no device argument: torch takes the pointer's own device, never copies
            pool = torch.as_tensor(_DeviceBytes(base, n, self.block_bytes))
            self._l1_pool = pool
        return pool

    def close(self):
        if self._h:
            self._l1_pool = None  # the mapping ends with the client
            h, self._h = self._h, None
            _lib.lib().kvc_close(h)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass

    # ---- lookup and leases ----
    def lookup(self, tokens, ttl_ms=0):
        """Longest cached prefix (full blocks), pinned: a Lease (num_blocks may be 0)."""
        ptr, n, keep = _tokens(tokens)
        out = ctypes.c_void_p()
        _check(_lib.lib().kvc_lookup(self.handle, ptr, n, ttl_ms, ctypes.byref(out)), "lookup")
        del keep
        return Lease(self, out.value)

    def lookup_batch(self, prompts, ttl_ms=0):
        """lookup() of several prompts in one call (kvc_lookup_batch): a Lease per prompt, in
        order. All or nothing: on failure no lease remains."""
        L = _lib.lib()
        if "kvc_lookup_batch" not in L.__dict__:  # typed at load only when the library has it
            raise Unsupported(-11, "lookup_batch: this libkvclient has no kvc_lookup_batch")
        n = len(prompts)
        if n == 0:
            return []
        conv = [_tokens(p) for p in prompts]
        ptrs = (_lib.P_u32 * n)(*[c[0] for c in conv])
        lens = (ctypes.c_size_t * n)(*[c[1] for c in conv])
        out = (ctypes.c_void_p * n)()
        _check(L.kvc_lookup_batch(self.handle, ptrs, lens, n, ttl_ms, out), "lookup_batch")
        del conv
        return [Lease(self, out[i]) for i in range(n)]

    def prefetch(self, lease, tier=TIER_L2):
        t = ctypes.c_uint64()
        _check(_lib.lib().kvc_prefetch(self.handle, lease.handle, tier, ctypes.byref(t)),
               "prefetch")
        return t.value

    def wait(self, lease, tier=TIER_L2, timeout_ms=10000):
        """Raises DataLoss when a block failed its checksum (the lease then covers only the
        blocks before it: lease.num_blocks is refreshed either way)."""
        L = _lib.lib()
        rc = L.kvc_wait(self.handle, lease.handle, tier, timeout_ms)
        lease.num_blocks = L.kvc_lease_num_blocks(lease.handle)
        _check(rc, "wait")

    def get(self, lease, first=0, count=0, out=None):
        """Copies hit blocks first..first+count-1 (count 0 = to the end) into out (any writable
        host buffer of at least count * block_bytes bytes), or into a new bytearray."""
        if count == 0:
            count = lease.num_blocks - first
        need = count * self.block_bytes
        if out is None:
            out = bytearray(need)
        addr, nbytes, keep = buffer_address(out, True)
        _check(_lib.lib().kvc_get(self.handle, lease.handle, first, count, addr, nbytes), "get")
        del keep
        return out

    def get_scatter(self, lease, first, iov):
        """Copies hit blocks first..first+len(iov)-1 into pieces (kvc_get_scatter): iov is an
        int64 [blocks, pieces, 2] array or tensor of (address, bytes), block b's bytes going
        to its pieces in order. One C call for the whole batch; attached, each block is copied
        from the mapped L2 pool straight into its pieces. The caller keeps the pieces' memory
        alive during the call."""
        count = int(iov.shape[0]) if hasattr(iov, "shape") else -1
        addr, per_block, keep = _iov(iov, count)
        _check(_newer("kvc_get_scatter")(self.handle, lease.handle, first, count, addr,
                                         per_block), "get_scatter")
        del keep

    def release(self, lease):
        lease.release()

    # ---- writes ----
    def put(self, tokens, first_block, payloads, num_blocks=None):
        """Stores blocks first_block.. of the prompt; payloads holds num_blocks (default: its
        size / block_bytes) blocks back to back. Returns PutResult."""
        addr, nbytes, keep = buffer_address(payloads, False)
        if num_blocks is None:
            if nbytes % self.block_bytes:
                raise InvalidArgument(-1, f"payloads of {nbytes} bytes: not a whole number of "
                                          f"{self.block_bytes}-byte blocks")
            num_blocks = nbytes // self.block_bytes
        if nbytes < num_blocks * self.block_bytes:
            raise InvalidArgument(-1, f"payloads of {nbytes} bytes < {num_blocks} blocks")
        ptr, n, tkeep = _tokens(tokens)
        res = PutResult()
        _check(_lib.lib().kvc_put(self.handle, ptr, n, first_block, addr, num_blocks,
                                  ctypes.byref(res)), "put")
        del keep, tkeep
        return res

    def put_gather(self, tokens, first_block, iov):
        """put() of len(iov) blocks kept in pieces (kvc_put_gather): iov as get_scatter's,
        each piece copied once, straight into the request. Returns PutResult."""
        count = int(iov.shape[0]) if hasattr(iov, "shape") else -1
        addr, per_block, keep = _iov(iov, count)
        ptr, n, tkeep = _tokens(tokens)
        res = PutResult()
        _check(_newer("kvc_put_gather")(self.handle, ptr, n, first_block, addr, per_block,
                                        count, ctypes.byref(res)), "put_gather")
        del keep, tkeep
        return res

    def alloc(self, num_blocks):
        """Reserves L2 slots: (alloc_id, [byte offsets in the L2 pool])."""
        aid = ctypes.c_uint64()
        offs = (ctypes.c_uint64 * max(num_blocks, 1))()
        _check(_lib.lib().kvc_alloc(self.handle, num_blocks, ctypes.byref(aid), offs), "alloc")
        return aid.value, list(offs[:num_blocks])

    def write(self, alloc_id, index, payload):
        addr, nbytes, keep = buffer_address(payload, False)
        _check(_lib.lib().kvc_write(self.handle, alloc_id, index, addr, nbytes), "write")
        del keep

    def commit(self, alloc_id, tokens, first_block, num_blocks):
        ptr, n, keep = _tokens(tokens)
        res = PutResult()
        _check(_lib.lib().kvc_commit(self.handle, alloc_id, ptr, n, first_block, num_blocks,
                                     ctypes.byref(res)), "commit")
        del keep
        return res

    def abort(self, alloc_id):
        _check(_lib.lib().kvc_abort(self.handle, alloc_id), "abort")

    # ---- operations ----
    def stats(self):
        st = _lib.Stats()
        _check(_lib.lib().kvc_stats_get(self.handle, ctypes.byref(st)), "stats")
        out = {}
        for name, _ in _lib.Stats._fields_:
            v = getattr(st, name)
            if isinstance(v, bytes):
                v = v.decode(errors="replace")
            elif name == "tiers":
                v = {t.tier: {"blocks": t.blocks, "bytes": t.bytes,
                              "capacity_blocks": t.capacity_blocks, "hit_blocks": t.hit_blocks}
                     for t in v}
            out[name] = v
        return out

    def health(self):
        h = _lib.Health()
        _check(_lib.lib().kvc_health_get(self.handle, ctypes.byref(h)), "health")
        return {"status": h.status.decode(), "version": h.version.decode(),
                "notes": h.notes.decode(errors="replace")}

    def evict(self, tier, tokens=None):
        """Evicts unpinned blocks of tier (all, or only that prompt's): (evicted, pinned)."""
        ptr, n, keep = _tokens(tokens if tokens is not None else [])
        ev, pin = ctypes.c_uint32(), ctypes.c_uint32()
        _check(_lib.lib().kvc_evict(self.handle, tier, ptr, n, ctypes.byref(ev),
                                    ctypes.byref(pin)), "evict")
        del keep
        return ev.value, pin.value

    def flush(self):
        _check(_lib.lib().kvc_flush(self.handle), "flush")


def strerror(code):
    return _lib.lib().kvc_strerror(code).decode()
