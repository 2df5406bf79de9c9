"""Drivers that put embcache inside a serving stack, one module per stack.

``embcache.integrations.sglang`` is a drop-in ``EmbeddingCacheController`` for SGLang's
multimodal encoder server; ``embcache.integrations.sglang_install`` turns it on in every rank.
Each driver is built on the public API only (``EmbeddingCache``, ``Request``, ``Item``,
``stats()``, the store classes).
"""
