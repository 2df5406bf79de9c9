"""embcache: a formally checked embedding cache for multimodal LLM serving."""

from embcache.allocator import RangeAllocator
from embcache.cache import CacheStats, EmbeddingCache
from embcache.item import Item
from embcache.pipeline import EncodePipeline, Encoder, PipelineStats, TensorParallelError
from embcache.request import Request
from embcache.states import EntryState
from embcache.status import ItemStatus, Reason, Status
from embcache.store import Fault, GlobalStore, InProcessStore, TransferOutcome

__all__ = [
    "CacheStats",
    "EmbeddingCache",
    "EncodePipeline",
    "Encoder",
    "EntryState",
    "Fault",
    "GlobalStore",
    "InProcessStore",
    "Item",
    "ItemStatus",
    "PipelineStats",
    "RangeAllocator",
    "Reason",
    "Request",
    "Status",
    "TensorParallelError",
    "TransferOutcome",
]
