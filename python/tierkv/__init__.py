"""tierkv - Python binding of libkvclient, the client of tierkvd (the tierkv KV-cache daemon),
and the engine integrations built on it: tierkv.vllm (a vLLM KV connector) and tierkv.sglang
(an SGLang HiCache storage backend). tierkv.kv holds the block payload layout (needs torch).
"""
from .client import (TIER_L1, TIER_L2, TIER_L3, TIER_NONE, AttachError, Busy, Cancelled,  # noqa: F401
                     Client, DataLoss, Full, Geometry, GeometryMismatch, InternalError,
                     InvalidArgument, Lease, NotFound, ProtocolError, TierKVError, TimedOut,
                     Unavailable, Unsupported, buffer_address, strerror)
from .keys import chain_keys, fingerprint  # noqa: F401

__version__ = "0.1.0"
