"""The driver: ``EmbeddingCache`` and ``Request`` around the pure core (``embcache.core``).

It owns what the core leaves out: the lock and its hierarchy checker (``locks``), the pool
and its copies (``pool``; large ones split over helper threads: ``parallel_copy``), the I/O
threads and their wake-ups (``cache``, ``wakeups``), a request's bodies, in-place fills among
them (``request``), fences (``fencing``), the poison debug mode (``poison``), traces
(``trace``), what is looked up (``item``), the public ``RangeAllocator`` (``allocator``) and
the ``GlobalStore`` protocol it calls (``global_store``; stores implement it in
``embcache.store``).
"""
