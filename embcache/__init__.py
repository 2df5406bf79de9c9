"""embcache: a formally checked embedding cache for multimodal LLM serving."""

from embcache.allocator import RangeAllocator

__all__ = ["RangeAllocator"]
