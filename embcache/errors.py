"""One exception hierarchy for embcache.

Every error derives from ``EmbCacheError`` and, where one fits, from the matching builtin,
so callers may catch either. Messages name the offending value and what to do instead.
An operation that raises one of these has changed nothing.
"""

from __future__ import annotations


class EmbCacheError(Exception):
    """Base of every error raised by embcache."""


class InvalidArgumentError(EmbCacheError, ValueError):
    """An argument has the right type but a value the operation cannot accept."""


class InvalidTypeError(EmbCacheError, TypeError):
    """An argument has the wrong type."""


class NotAllocatedError(EmbCacheError, KeyError):
    """An offset given to the allocator is not the start of a live allocation."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class TransitionError(EmbCacheError, RuntimeError):
    """An action is not allowed from the entry's current state (see ``embcache.core.lifecycle``)."""


class ClosedError(EmbCacheError, RuntimeError):
    """The cache or request has been closed."""


class RequestError(EmbCacheError, RuntimeError):
    """A request was used against its contract (duplicate id, insert of a key it may not fill)."""


class LockOrderError(EmbCacheError, RuntimeError):
    """A lock was taken against the hierarchy, or blocking work was done under a cache lock."""


class StoreConfigError(EmbCacheError, ValueError):
    """A global-store configuration value is missing or invalid."""


class StoreUnavailableError(EmbCacheError, RuntimeError):
    """An optional store backend cannot be imported or reached."""


class InvariantError(EmbCacheError, AssertionError):
    """``check_invariants()`` found the internal state inconsistent (a bug in embcache)."""


class TensorParallelError(EmbCacheError, RuntimeError):
    """Another rank of the tensor-parallel group failed, disagreed, or a collective failed."""
