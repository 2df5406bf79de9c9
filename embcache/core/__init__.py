"""The pure core: the cache's state machine, with no lock, thread, clock, torch or store.

It holds the entries, pins, waiters, the allocator, the eviction order, the quarantine and the
fences, with one method per DESIGN action (``Actions``, ``embcache/DESIGN.md``) and the
request protocol over them (``CacheCore``, which holds the actions privately); each step
returns one ``Effects`` record: what its driver must do. It imports nothing from ``embcache``
outside this package except ``embcache.errors`` (exceptions only, no imports);
``tests/test_core.py`` checks it. The driver (``embcache.driver.cache``) holds the lock around it
and does the I/O. Each module in one line: the module map, ``docs/architecture.md``.
"""

from embcache.core.build import choose  # first: which build of the core's modules loads

choose()
