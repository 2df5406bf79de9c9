"""The pure core: the cache's state machine, with no lock, thread, clock, torch or store.

One module per concern: ``lifecycle`` (entry states and the transition table), ``entries``
(entries and request records), ``cache_core`` (``CacheCore``: one method per DESIGN action),
``protocol`` (how a request's calls compose the actions), ``allocator`` (best fit, no lock),
``eviction`` (contiguity-aware victims), ``policy`` (eviction order and admission),
``invariants`` (``check_invariants``), ``stats`` (the counters' snapshot) and ``outcomes``
(item statuses, reasons, transfer outcomes). It imports nothing from ``embcache`` outside this
package except ``embcache.errors`` (exceptions only, no imports); ``tests/test_core.py`` checks
it. The driver (``embcache.cache``) holds the lock around it and does the I/O.
"""
