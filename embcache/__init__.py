"""embcache: a formally checked embedding cache for multimodal LLM serving.

An encode worker keeps vision-encoder outputs (embeddings, keyed by a hash of the image) in
one pool, a large uint8 tensor; entries are pinned while a request reads them, evicted in LRU
order (or as a ``policy`` says) with contiguity in mind when the pool is full, and shared across
workers through a global store (Mooncake) when one is given; with none, the pool is the whole
cache. A pure core (``embcache.core``) holds
the state machine; ``EmbeddingCache`` is the driver that does the I/O around it.

- ``EmbeddingCache(capacity_bytes, store=...)``: the cache. ``cache.request(id)`` opens a
  ``Request`` (a context manager): ``lookup`` items, ``wait`` for store loads, ``insert``
  fresh encoder outputs, read ``embeddings()`` (views into the pool, valid inside the block).
  ``cache.lookup(id, items)`` opens a request and looks up in one step.
  ``cache.insert(keys, tensors)`` inserts with no request (the entries end idle).
  ``cache.stats()`` is a ``CacheStats`` snapshot; quarantined ranges are freed by fences the
  cache starts itself (``FencePolicy``) or by ``cache.fence()``.
- ``EncodePipeline(cache, encoder).encode(request_id, items, inputs)``: all of the above for
  one call, returning one tensor of the items' embeddings concatenated along dim 0.
- ``Item(key, shape, dtype)``: what is looked up. Statuses: ``ItemStatus``, ``Status``,
  ``Reason``. Stores: ``embcache.store.mooncake.MooncakeStore``; none (the default): no global tier.
  ``embcache.testing.FaultInjectingStore`` is the fault-injecting test double.
- Errors: all derive from ``EmbCacheError`` and the matching builtin (``embcache.errors``).
- ``embcache.tools.metrics``: Prometheus metrics (extra ``metrics``). ``python -m embcache demo``:
  the main job. The design, its states and invariants: ``embcache/DESIGN.md``.
"""

from importlib.metadata import PackageNotFoundError, version

from embcache.core.lifecycle import EntryState
from embcache.core.outcomes import ItemStatus, Reason, Status
from embcache.driver.cache import CacheStats, EmbeddingCache
from embcache.driver.fencing import FencePolicy
from embcache.driver.item import Item
from embcache.driver.request import Request
from embcache.pipeline import EncodePipeline, Encoder, PipelineStats, TensorParallelError
from embcache.store import GlobalStore, TransferOutcome

from embcache.errors import (  # isort: skip
    ClosedError,
    EmbCacheError,
    InvalidArgumentError,
    InvalidTypeError,
    InvariantError,
    LockOrderError,
    NotAllocatedError,
    RequestError,
    StoreConfigError,
    StoreUnavailableError,
    TransitionError,
)

try:
    __version__ = version("embcache")
except PackageNotFoundError:  # a checkout used without installing it
    __version__ = "0+unknown"

__all__ = [
    "CacheStats",
    "ClosedError",
    "EmbCacheError",
    "EmbeddingCache",
    "EncodePipeline",
    "Encoder",
    "EntryState",
    "FencePolicy",
    "GlobalStore",
    "InvalidArgumentError",
    "InvalidTypeError",
    "InvariantError",
    "Item",
    "ItemStatus",
    "LockOrderError",
    "NotAllocatedError",
    "PipelineStats",
    "Reason",
    "Request",
    "RequestError",
    "Status",
    "StoreConfigError",
    "StoreUnavailableError",
    "TensorParallelError",
    "TransferOutcome",
    "TransitionError",
    "__version__",
]
