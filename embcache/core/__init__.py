"""The pure core: the cache's state machine, with no lock, thread, clock, torch or store.

It holds the entries, pins, waiters, the allocator, the eviction order, the quarantine and the
fences in one state (``CoreState``), changed by one function per DESIGN action
(``embcache/DESIGN.md``), and the request protocol over them (``CacheCore``, which holds the
state privately); each step returns one ``Effects`` record: what its driver must do. It
imports nothing from ``embcache`` outside this package except ``embcache.errors`` (exceptions
only, no imports); ``tests/test_core.py`` checks it. The driver's step runner
(``embcache.driver.runner``) holds the lock around it and does the I/O. Each module in one
line: the module map, ``docs/architecture.md``.
"""

from embcache.core.build import choose  # first: which build of the core's modules loads

choose()
