"""The cache's pool: a new uint8 tensor, or one the caller gives (for example a mapping of
shared memory that other processes read), and its zero-copy views (an entry's bytes as a
tensor of its shape and dtype)."""

from __future__ import annotations

import ctypes
import functools
import math
from collections.abc import Sequence

import torch

from embcache.core.entries import Entry, ItemLike
from embcache.core.outcomes import TransferOutcome
from embcache.driver import parallel_copy
from embcache.driver.locks import CHECKING, assert_unlocked
from embcache.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["PoolViews", "make_pool", "payload_nbytes"]


def make_pool(capacity_bytes: int, pin_memory: bool, pool: object = None) -> torch.Tensor:
    """``pool`` if it can be the pool (a contiguous 1-D uint8 CPU tensor of ``capacity_bytes``
    elements), else ``InvalidTypeError``/``InvalidArgumentError``; with None a new tensor,
    pinned when asked. O(1) (the kernel zero-fills a new tensor's pages on first touch)."""
    if pool is None:
        return torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=pin_memory)
    if not isinstance(pool, torch.Tensor):
        raise InvalidTypeError(f"pool must be a torch.Tensor or None, got {type(pool).__name__}")
    if pool.dtype != torch.uint8 or pool.dim() != 1 or not pool.is_contiguous():
        raise InvalidArgumentError(
            f"pool must be a contiguous 1-D uint8 tensor, got {pool.dtype} of shape "
            f"{tuple(pool.shape)}: pass torch.empty(capacity_bytes, dtype=torch.uint8) or a view"
        )
    if pool.device.type != "cpu" or pool.numel() != capacity_bytes:
        raise InvalidArgumentError(
            f"pool must be a CPU tensor of capacity_bytes={capacity_bytes!r} bytes, got "
            f"{pool.numel()} bytes on {pool.device}"
        )
    return pool


class PoolViews:
    """Views of one uint8 pool tensor, and copies into it.

    Design notes (numbers: ``benchmarks/INSTRUCTIONS.md``, "Where the wall time goes"). Torch's
    generated method bindings (``as_strided``, ``view``, ``detach``, ``copy_``) release the
    interpreter lock around the op, and a view's kernel takes it back to link the new tensor to
    its base: with any other Python thread ready to run (the I/O pool's worker after a publish,
    asyncio's executor), the caller loses the lock in every such call and waits for it
    (``pthread_cond_timedwait`` under ``THPVariable_as_strided`` in py-spy: 61% of the view's
    time in the SGLang adapter's hit). Indexing (``THPVariable_getitem``) keeps the lock. So a
    view is a slice of a base view made once per (dtype, shape past the first dimension,
    phase): the pool as rows of that shape, starting ``phase`` elements in, so that the
    entry's first element begins a row. Bases are few (the phase is below the row's element
    count and a multiple of the alignment); past ``MAX_BASES`` a view falls back to
    ``as_strided``.

    A copy in goes by ``memmove`` where ``copy_`` would do no more than copy bytes (a plain CPU
    tensor, contiguous, of the entry's dtype and shape, no lazy conjugate or negation bit):
    ``copy_`` of a view costs a ``no_grad`` block (about 1 us), the view and its dispatch
    (about 1.3 us) for a 256 B item, and at 3.9 MiB it splits the copy over the intra-op
    threads, which on a loaded machine left it waiting for a descheduled helper thread
    (median 16 ms against 0.1 ms). Below ``RELEASE_BYTES`` the ``memmove`` keeps the
    interpreter lock (a few microseconds at most); above, it releases it while it copies."""

    MAX_BASES = 256
    RELEASE_BYTES = 256 * 1024

    def __init__(self, pool: torch.Tensor) -> None:
        self._pool = pool
        self._typed: dict[torch.dtype, torch.Tensor] = {}
        self._bases: dict[tuple[torch.dtype, tuple[int, ...], int], torch.Tensor] = {}
        self._base = pool.data_ptr()

    def sizes(self) -> dict[str, int]:
        """``typed_views``: one pool view per dtype seen; ``view_bases``: the base views
        (at most ``MAX_BASES``); ``strides``: the process-wide cache of row-major strides by
        shape (at most 1024). O(1)."""
        return {
            "typed_views": len(self._typed),
            "view_bases": len(self._bases),
            "strides": _strides.cache_info().currsize,
        }

    def views(
        self, ranges: Sequence[tuple[int, ItemLike | Entry] | None]
    ) -> list[torch.Tensor | None]:
        """Per range, ``item``'s bytes at ``offset`` as a tensor of its shape and dtype
        (zero-copy: a slice of a base view, class docstring); None for None. One frame for
        all of them: this runs on every hit. O(len(ranges))."""
        out: list[torch.Tensor | None] = []
        for r in ranges:
            if r is None:
                out.append(None)
                continue
            offset, item = r
            dtype: torch.dtype = item.dtype  # type: ignore[assignment]
            shape: tuple[int, ...] = item.shape
            start = offset // dtype.itemsize
            if len(shape) == 1:
                typed = self._typed.get(dtype)  # (``_typed_view`` inlined)
                if typed is None:
                    typed = self._typed_view(dtype)
                out.append(typed[start : start + shape[0]])
                continue
            inner = shape[1:]
            row = math.prod(inner)
            phase = start % row
            base = self._bases.get((dtype, inner, phase))
            if base is None:
                base = self._new_base(dtype, inner, phase)
                if base is None:
                    typed = self._typed_view(dtype)
                    out.append(typed.as_strided(shape, _strides(shape), start))
                    continue
            first = start // row
            out.append(base[first : first + shape[0]])
        return out

    def _typed_view(self, dtype: torch.dtype) -> torch.Tensor:
        """The whole pool viewed as ``dtype``, made once (a race makes two, both valid)."""
        typed = self._typed.get(dtype)
        if typed is None:
            typed = self._typed.setdefault(dtype, self._pool.view(dtype))
        return typed

    def _new_base(
        self, dtype: torch.dtype, inner: tuple[int, ...], phase: int
    ) -> torch.Tensor | None:
        """The pool as rows of shape ``inner`` from element ``phase``; None past MAX_BASES."""
        if len(self._bases) >= self.MAX_BASES:
            return None
        typed = self._typed_view(dtype)
        row = math.prod(inner)
        shape = ((typed.numel() - phase) // row, *inner)
        base = typed.as_strided(shape, _strides(shape), phase)
        return self._bases.setdefault((dtype, inner, phase), base)

    def copy_in(
        self, filling: list[tuple[Entry, torch.Tensor]]
    ) -> tuple[list[TransferOutcome], BaseException | None]:
        """Copy each tensor into its entry's range, with no lock held (the lock-order check
        refuses it under one): OK per copy; the first copy that raises fails itself and every
        copy after it (FAILED), and its error is returned."""
        if CHECKING.on:  # (off: the guard would do nothing; skip its call)
            assert_unlocked("payload copy")
        outcomes = [TransferOutcome.FAILED] * len(filling)
        for i, (entry, tensor) in enumerate(filling):
            try:
                if bytes_only(tensor, entry):
                    copy_bytes(self._base + entry.offset, tensor.data_ptr(), tensor.nbytes)
                else:
                    _check_strided(tensor)
                    (view,) = self.views(((entry.offset, entry),))
                    assert view is not None  # (a range gives a view)
                    with torch.no_grad():
                        view.copy_(tensor)
            except BaseException as exc:
                return outcomes, exc
            outcomes[i] = TransferOutcome.OK
        return outcomes, None


# memmove through ctypes: a PYFUNCTYPE call keeps the interpreter lock, a CFUNCTYPE one
# (``ctypes.memmove``) releases it while it copies.
memmove = ctypes.PYFUNCTYPE(ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t)(
    ctypes._memmove_addr  # type: ignore[attr-defined]
)
memmove_releasing = ctypes.memmove


def copy_bytes(dst: int, src: int, nbytes: int) -> None:
    """Copy ``nbytes`` from address ``src`` to address ``dst`` (host memory): keeps the
    interpreter lock below ``PoolViews.RELEASE_BYTES``, releases it while it copies above,
    and from ``parallel_copy.SPLIT_BYTES`` splits it over helper threads (``split_copy``)."""
    if nbytes >= parallel_copy.SPLIT_BYTES:
        parallel_copy.split_copy(dst, src, nbytes)
    else:
        (memmove_releasing if nbytes >= PoolViews.RELEASE_BYTES else memmove)(dst, src, nbytes)


def bytes_only(tensor: torch.Tensor, entry: ItemLike | Entry) -> bool:
    """Whether ``copy_`` of ``tensor`` into ``entry``'s view would only copy its bytes: a plain
    CPU tensor, contiguous, of the entry's dtype and shape (no broadcast, no conversion), not
    quantized, with no lazy conjugate or negation bit to apply. ``is_conj`` is asked only of a
    complex dtype (torch sets the bit on no other): each such call lets go of the interpreter
    lock, and a fresh output of a busy server then waits to get it back."""
    return (
        type(tensor) is torch.Tensor
        and tensor.is_cpu
        and tensor.dtype == entry.dtype
        and tensor.shape == entry.shape
        and tensor.layout is torch.strided
        and tensor.is_contiguous()
        and not tensor.is_quantized
        and not (tensor.dtype.is_complex and tensor.is_conj())  # (a bit only complex ones carry)
        and not tensor.is_neg()
    )


def _check_strided(tensor: torch.Tensor) -> None:
    """``InvalidTypeError`` for a tensor with no strided bytes to copy (sparse, meta,
    quantized: its scale would be lost); torch's own error would name no embcache class."""
    if tensor.layout is not torch.strided or tensor.is_meta or tensor.is_quantized:
        raise InvalidTypeError(
            f"a {tensor.layout} {tensor.dtype} tensor on {tensor.device} cannot be cached: "
            "pass a dense (strided), non-quantized tensor with data"
        )


def payload_nbytes(entry: Entry) -> int:
    """The payload bytes of ``entry`` (its range may be larger: rounded to the alignment)."""
    dtype: torch.dtype = entry.dtype  # type: ignore[assignment]
    return math.prod(entry.shape) * dtype.itemsize


@functools.lru_cache(maxsize=1024)
def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Row-major (contiguous) strides of ``shape``, in elements."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))
