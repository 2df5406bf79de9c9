"""Every tensor layout torch makes, through every front end that copies a tensor into the pool.

A layout is drawn for a target shape and dtype (``make``): contiguous, with a storage offset,
rows with a step, a column slice (a tensor-parallel shard: rows dense, not contiguous), a
transpose or permutation, an expand (stride 0), ``as_strided`` (padded or overlapping rows),
a view of another dtype's storage, for complex dtypes the lazy conjugate bit, and the lazy
negation bit (every dtype torch negates). Its contents are random bytes (0/1
for bool). Zero-size dims and 0-d tensors are drawn too: they are refused with a specific error
that leaves the cache as it was.

Front end x layout kind is enumerated (a ``parametrize`` over the full product: each pair runs,
none is left to chance); Hypothesis draws only the dtype, shapes and contents within a pair.
Each pair runs both answer paths of its front end: one item per call, then one call of several
items mixing a hit with misses. A planted ``EncodePipeline`` answer copy that ignores the lazy
bits (raw bytes of a conjugated or negated output) fails the pairs of those kinds.

The front ends: ``Request.insert`` and ``EmbeddingCache.insert`` (``PoolViews.copy_in``: the
``memmove`` fast path for a plain contiguous tensor, ``copy_`` into a pool view otherwise),
``EncodePipeline`` (its encoder returns the drawn tensor), in-place fills
(``begin_fill``/``end_fill``, the writer copying into the pool as vLLM's worker does), the
SGLang adapter (``store_to_pool_async``; every kind, both paths) and the vLLM worker's
``save_caches`` (every kind but the conjugate bit, its outputs being float16; one item a step:
a hit never reaches the save). Each time the
bytes served equal those of ``tensor.contiguous()`` (with the lazy bits resolved), and the
copy path taken is the one the layout calls for (``CopySpy``); a test names the path of each
layout and checks both paths are reached. A planted layout-blind fast path (rows dense taken
for contiguous) fails the property.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure

import embcache.driver.pool as pool_module
from embcache import EmbeddingCache, EncodePipeline, EntryState, Item, Status, TransferOutcome
from embcache.errors import InvalidArgumentError, InvalidTypeError

# ---------------------------------------------------------------------------- dtypes


def _makeable(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is a plain (not quantized) dtype whose CPU tensors view bytes."""
    if dtype in _QUANTIZED:
        return False
    try:
        torch.zeros(8, dtype=torch.uint8).view(dtype)
    except (RuntimeError, TypeError):
        return False
    return True


_QUANTIZED = {torch.qint8, torch.quint8, torch.qint32, torch.quint4x2, torch.quint2x4}
ALL_DTYPES = sorted(
    {d for d in vars(torch).values() if isinstance(d, torch.dtype)}, key=lambda d: str(d)
)
DTYPES = [d for d in ALL_DTYPES if _makeable(d)]  # every dtype the cache keeps the bytes of


def _copyable(dtype: torch.dtype) -> bool:
    """Whether torch can copy a strided ``dtype`` tensor (the bit-width placeholders, such as
    ``int4`` or ``bits8``, have no copy kernel: only their contiguous bytes can be cached)."""
    try:
        torch.zeros(8, dtype=torch.uint8).view(dtype)[::2].contiguous()
    except (RuntimeError, NotImplementedError):
        return False
    return True


def _negatable(dtype: torch.dtype) -> bool:
    """Whether torch's lazy negation bit can be set and resolved on a CPU ``dtype`` tensor
    (every signed and unsigned number type; not bool, nor the float8 and bit-width ones)."""
    try:
        with warnings.catch_warnings():  # (complex32: "experimental")
            warnings.simplefilter("ignore", UserWarning)
            torch._neg_view(torch.zeros(2, dtype=dtype)).resolve_neg()
    except (RuntimeError, NotImplementedError, TypeError):
        return False
    return True


COPYABLE = [d for d in DTYPES if _copyable(d)]
CONTIGUOUS_KINDS = ["contiguous", "storage offset", "another dtype's storage"]
COMPLEX = [d for d in DTYPES if d in (torch.complex64, torch.complex128)]
NEGATABLE = [d for d in COPYABLE if _negatable(d)]

# ---------------------------------------------------------------------------- layouts
KINDS = [
    "contiguous",
    "storage offset",
    "rows with a step",
    "column slice",
    "transpose",
    "permute",
    "expand",
    "padded rows (as_strided)",
    "overlapping rows (as_strided)",
    "another dtype's storage",
    "another dtype's storage, every other row",
    "conjugate bit",
    "negation bit",
]
# the copy each layout takes in ``PoolViews.copy_in`` (the fast path wants plain contiguous)
# when no dim is 1 (a dim of size 1 makes many of them contiguous: ``path_for``)
PATH = dict.fromkeys(KINDS, "copy_") | {
    "contiguous": "memmove",
    "storage offset": "memmove",
    "another dtype's storage": "memmove",
}


def dtypes_for(kind: str) -> list[torch.dtype]:
    """The dtypes ``kind`` can be made of: the lazy conjugate bit on complex ones, the lazy
    negation bit on those torch negates, the strided kinds on those torch can copy, the
    contiguous kinds on every dtype the cache keeps."""
    if kind == "conjugate bit":
        return COMPLEX
    if kind == "negation bit":
        return NEGATABLE
    return DTYPES if kind in CONTIGUOUS_KINDS else COPYABLE


def path_for(tensor: torch.Tensor) -> str:
    """The copy ``PoolViews.copy_in`` must take: ``memmove`` for a plain contiguous tensor
    with no lazy bit, else ``copy_``."""
    plain = tensor.is_contiguous() and not (tensor.is_conj() or tensor.is_neg())
    return "memmove" if plain else "copy_"


def fresh(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A new contiguous tensor of random bytes (0/1 for bool)."""
    gen = torch.Generator().manual_seed(seed)
    n = math.prod(shape)
    if dtype is torch.bool:
        return torch.randint(0, 2, shape, generator=gen).to(torch.bool)
    raw = torch.randint(0, 256, (n * dtype.itemsize,), generator=gen, dtype=torch.uint8)
    return raw.view(dtype).view(shape)


def make(kind: str, shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` laid out as ``kind`` says (the module docstring)."""
    rows, tail = shape[0], shape[1:]
    if kind == "contiguous":
        return fresh(shape, dtype, seed)
    if kind == "storage offset":
        n = math.prod(shape)
        return fresh((n + 3,), dtype, seed)[3:].view(shape)
    if kind == "rows with a step":
        return fresh((rows * 3, *tail), dtype, seed)[1::3]
    if kind == "column slice":  # rank 1's shard of a 3-way TP output
        wide = fresh((*shape[:-1], shape[-1] * 3), dtype, seed)
        return wide[..., shape[-1] : 2 * shape[-1]]
    if kind == "transpose":
        if len(shape) < 2:
            return fresh((rows, 2), dtype, seed)[:, 1]
        swapped = (*shape[:-2], shape[-1], shape[-2])
        return fresh(swapped, dtype, seed).transpose(-1, -2)
    if kind == "permute":
        order = list(reversed(range(len(shape))))
        return fresh(tuple(shape[i] for i in order), dtype, seed).permute(*order)
    if kind == "expand":
        return fresh((1, *tail), dtype, seed).expand(shape)
    if kind in ("padded rows (as_strided)", "overlapping rows (as_strided)"):
        row = math.prod(tail)
        step = row + 5 if kind.startswith("padded") else max(1, row // 2)
        strides = (step, *_contiguous_strides(tail))
        base = fresh((2 + step * (rows - 1) + row,), dtype, seed)
        return base.as_strided(shape, strides, 2)
    if kind.startswith("another dtype's storage"):  # bytes of int8/uint8 viewed as dtype
        every_other = kind.endswith("every other row")
        stored = (rows * (2 if every_other else 1), *tail)
        if dtype is torch.bool:
            storage = fresh(stored, dtype, seed).view(torch.uint8)
        else:
            other = torch.int8 if dtype is torch.uint8 else torch.uint8
            storage = fresh((*stored[:-1], stored[-1] * dtype.itemsize), other, seed)
        back = storage.view(dtype)
        return back[::2] if every_other else back
    if kind == "conjugate bit":
        return fresh(shape, dtype, seed).conj()
    if kind == "negation bit":
        return torch._neg_view(fresh(shape, dtype, seed))
    raise AssertionError(kind)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= dim
    return tuple(reversed(strides))


def raw_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """The bytes of ``tensor.contiguous()`` as a 1-D uint8 tensor (no copy kernel needed for
    a contiguous tensor: its elements are dense from its storage offset)."""
    dense = tensor.contiguous()
    return dense.as_strided((dense.numel(),), (1,)).view(torch.uint8)


def expected(tensor: torch.Tensor) -> bytes:
    """The bytes of ``tensor.contiguous()``, lazy conjugate and negation applied."""
    return bytes(raw_bytes(tensor.resolve_conj().resolve_neg()).numpy())


def served(view: torch.Tensor | None) -> bytes:
    assert view is not None, "not served"
    return bytes(raw_bytes(view).numpy())


class Drawn(tuple[str, torch.Tensor]):
    """(kind, tensor), shown by layout (many of these dtypes cannot print their values)."""

    def __repr__(self) -> str:
        kind, t = self
        return (
            f"Drawn({kind!r}, {t.dtype} {tuple(t.shape)} strides {t.stride()} "
            f"offset {t.storage_offset()})"
        )


@st.composite
def layouts(
    draw: st.DrawFn,
    dtypes: list[torch.dtype] = DTYPES,
    shapes: st.SearchStrategy[tuple[int, ...]] | None = None,
) -> tuple[str, torch.Tensor]:
    """(kind, tensor): a layout of ``KINDS`` over a drawn shape and dtype."""
    dtype = draw(st.sampled_from(dtypes))
    shape = draw(shapes or st.lists(st.integers(1, 5), min_size=1, max_size=3).map(tuple))
    kind = draw(st.sampled_from([k for k in KINDS if dtype in dtypes_for(k)]))
    return Drawn((kind, make(kind, shape, dtype, draw(st.integers(0, 2**31 - 1)))))


# ---------------------------------------------------------------------------- the copy spy
class CopySpy:
    """Counts the copies of ``PoolViews.copy_in`` by path: ``memmove`` (either of the two
    ``memmove`` functions, into ``pool``: the pipeline's own byte copies into its answer do
    not count) or ``copy_`` (a copy into a pool view)."""

    def __init__(self, pool: torch.Tensor) -> None:
        self.counts = {"memmove": 0, "copy_": 0}
        self._pool = range(pool.data_ptr(), pool.data_ptr() + pool.nbytes)

    @contextlib.contextmanager
    def installed(self) -> Iterator[CopySpy]:
        saved = (pool_module.memmove, pool_module.memmove_releasing, pool_module.bytes_only)
        fast, releasing, bytes_only = saved

        def count_memmove(move: Callable[..., Any]) -> Callable[..., Any]:
            def spy(*args: Any) -> Any:
                if args[0] in self._pool:
                    self.counts["memmove"] += 1
                return move(*args)

            return spy

        def spy_bytes_only(tensor: torch.Tensor, entry: Any) -> bool:
            answer = pool_module_bytes_only(tensor, entry)
            if not answer:
                self.counts["copy_"] += 1
            return answer

        pool_module_bytes_only = bytes_only
        # the copy paths are module globals that ``copy_in`` looks up at each call
        pool_module.memmove = count_memmove(fast)
        pool_module.memmove_releasing = count_memmove(releasing)
        pool_module.bytes_only = spy_bytes_only
        try:
            yield self
        finally:
            pool_module.memmove, pool_module.memmove_releasing, pool_module.bytes_only = saved

    def took(self) -> str:
        paths = [p for p, n in self.counts.items() if n]
        assert len(paths) == 1, self.counts
        return paths[0]


def new_cache(**options: Any) -> EmbeddingCache:
    return EmbeddingCache(1 << 16, pin_memory=False, auto_fence=None, **options)


_keys = (f"k{n}" for n in itertools.count())


def state(cache: EmbeddingCache) -> tuple[Any, ...]:
    stats = cache.stats()
    return (
        stats.entries_by_state,
        stats.allocated_bytes,
        stats.pinned_entries,
        stats.open_requests,
    )


# ---------------------------------------------------------------------------- front ends
# Each front end takes (key, tensor) pairs in ONE call (some keys may be cached already: hits)
# and returns the bytes that call's answer gives each item, in order; the test then reads
# every key back from the cache. One pair per call, and several mixing hits and misses, are
# the two answer paths each front end has.
Pairs = list[tuple[str, torch.Tensor]]


def read_back(cache: EmbeddingCache, pairs: Pairs) -> list[bytes]:
    """What the cache serves for each key, looked up in one request."""
    with cache.request(f"read-{pairs[0][0]}") as r:
        r.lookup([Item.of(k, t) for k, t in pairs], prefetch=False)
        return [served(view) for view in r.embeddings()]


def insert_by_request(cache: EmbeddingCache, pairs: Pairs) -> list[bytes]:
    """Look every item up, insert the misses, answer from the same request."""
    with cache.request(f"r-{pairs[0][0]}") as r:
        statuses = r.lookup([Item.of(k, t) for k, t in pairs], prefetch=False)
        misses = [p for p, s in zip(pairs, statuses, strict=True) if s.status is not Status.HIT]
        keys, tensors = [k for k, _ in misses], [t for _, t in misses]
        assert r.insert(keys, tensors, publish=False) == [True] * len(misses)
        return [served(view) for view in r.embeddings()]


def insert_by_cache(cache: EmbeddingCache, pairs: Pairs) -> list[bytes]:
    """``EmbeddingCache.insert`` of every item (a cached one is left alone), then read."""
    present = [cache.entry_state(k) is not EntryState.ABSENT for k, _ in pairs]
    answer = cache.insert([k for k, _ in pairs], [t for _, t in pairs], publish=False)
    assert answer == [not p for p in present]
    return read_back(cache, pairs)


class Encoder:
    """Returns the tensors it is given for each key, as laid out."""

    device = torch.device("cpu")

    def __init__(self, outputs: dict[str, torch.Tensor]) -> None:
        self.outputs = outputs

    def __call__(self, inputs: list[str]) -> list[torch.Tensor]:
        return [self.outputs[key] for key in inputs]


def insert_by_pipeline(cache: EmbeddingCache, pairs: Pairs) -> list[bytes]:
    """One ``encode`` call: hits copied from the pool, misses encoded; its answer's rows."""
    pipeline = EncodePipeline(cache, Encoder(dict(pairs)))
    items = [Item.of(k, t) for k, t in pairs]
    out = pipeline.encode(f"p-{pairs[0][0]}", items, [k for k, _ in pairs])
    at = list(itertools.accumulate((t.shape[0] for _, t in pairs), initial=0))
    return [served(out[at[n] : at[n + 1]]) for n in range(len(pairs))]


def insert_by_fill(cache: EmbeddingCache, pairs: Pairs) -> list[bytes]:
    """begin_fill, a writer copying into the pool at each offset (as vLLM's worker), end_fill
    (a cached key gets no offset: nothing to write), then the same request's answer."""
    items = [Item.of(k, t) for k, t in pairs]
    with cache.request(f"f-{pairs[0][0]}") as r:
        offsets = r.begin_fill(items)
        filled = []
        for item, (key, tensor), offset in zip(items, pairs, offsets, strict=True):
            if offset is None:
                assert cache.entry_state(key) is EntryState.READY, "no offset for a miss"
                continue
            target = cache.pool[offset : offset + item.nbytes]
            if tensor.dtype in COPYABLE:
                target.view(item.dtype).view(item.shape).copy_(tensor)
            else:  # no copy kernel: the writer copies the (contiguous) bytes
                target.copy_(raw_bytes(tensor))
            filled.append(key)
        outcomes = [TransferOutcome.OK] * len(filled)
        assert r.end_fill(filled, outcomes, publish=False) == [True] * len(filled)
        r.lookup(items, prefetch=False)
        return [served(view) for view in r.embeddings()[-len(items) :]]


FRONT_ENDS: dict[str, Callable[[EmbeddingCache, Pairs], list[bytes]]] = {
    "Request.insert": insert_by_request,
    "EmbeddingCache.insert": insert_by_cache,
    "EncodePipeline": insert_by_pipeline,
    "begin_fill/end_fill": insert_by_fill,
}
COPIES_IN = {"Request.insert", "EmbeddingCache.insert", "EncodePipeline"}  # through copy_in


def check_call(cache: EmbeddingCache, front_end: str, kind: str, pairs: Pairs) -> None:
    """One call of ``front_end`` with ``pairs``: its answer and the cache's bytes are those of
    each ``tensor.contiguous()`` (lazy bits resolved); each miss copied by its own path."""
    misses = [t for k, t in pairs if cache.entry_state(k) is EntryState.ABSENT]
    with CopySpy(cache.pool).installed() as spy:
        got = FRONT_ENDS[front_end](cache, pairs)
    want = [expected(t) for _, t in pairs]
    hits = len(pairs) - len(misses)
    assert got == want, f"{front_end}, {kind}, {hits} hits: the call answered other bytes"
    assert read_back(cache, pairs) == want, f"{front_end}, {kind}: the cache serves other bytes"
    if front_end in COPIES_IN:
        paths = {p: sum(path_for(t) == p for t in misses) for p in ("memmove", "copy_")}
        assert spy.counts == paths, f"{front_end}, {kind}: {spy.counts}"
    else:  # the writer copies: the cache copies nothing
        assert spy.counts == {"memmove": 0, "copy_": 0}, spy.counts


def check_layout(front_end: str, kind: str, tensor: torch.Tensor) -> None:
    """``tensor`` alone, by one call of ``front_end``."""
    cache = new_cache()
    try:
        check_call(cache, front_end, kind, [(next(_keys), tensor)])
        cache.check_invariants()
    finally:
        cache.close()


@st.composite
def batches(draw: st.DrawFn, kind: str, min_tail: int = 0) -> list[torch.Tensor]:
    """Two to four tensors laid out as ``kind``: one dtype and one shape after dim 0 (an
    encoder call's outputs), rows, contents and the dtype drawn."""
    dtype = draw(st.sampled_from(dtypes_for(kind)))
    tail = tuple(draw(st.lists(st.integers(1, 5), min_size=min_tail, max_size=2)))
    rows = draw(st.lists(st.integers(1, 5), min_size=2, max_size=4))
    return [make(kind, (n, *tail), dtype, draw(st.integers(0, 2**31 - 1))) for n in rows]


# Each (front end, kind) pair is its own test; Hypothesis spreads the profile's examples over
# the kinds, so a run costs what one drawn test per front end did.
PER_PAIR = settings(max_examples=max(10, settings.default.max_examples // len(KINDS)))


@pytest.mark.parametrize(("front_end", "kind"), list(itertools.product(FRONT_ENDS, KINDS)))
@PER_PAIR
@given(data=st.data())
def test_every_layout_through_every_front_end(
    front_end: str, kind: str, data: st.DataObject
) -> None:
    """The full product, each pair enumerated: one item per call (the first tensor), then one
    call of every tensor, the first now a hit and the rest misses."""
    tensors = data.draw(batches(kind), label="tensors")
    keys = [next(_keys) for _ in tensors]
    cache = new_cache()
    try:
        check_call(cache, front_end, kind, [(keys[0], tensors[0])])
        check_call(cache, front_end, kind, list(zip(keys, tensors, strict=True)))
        cache.check_invariants()
    finally:
        cache.close()


@pytest.mark.parametrize("kind", KINDS)
def test_each_layout_takes_its_named_copy_path(kind: str) -> None:
    """Each layout, one dtype each, by ``Request.insert``: the path of ``PATH``; both paths
    are reached (memmove for plain contiguous tensors, ``copy_`` for every other layout)."""
    dtype = torch.complex64 if "bit" in kind else torch.float32
    tensor = make(kind, (4, 3, 6), dtype, seed=7)
    assert path_for(tensor) == PATH[kind]
    check_layout("Request.insert", kind, tensor)
    assert set(PATH.values()) == {"memmove", "copy_"}


BAD_SHAPES = st.one_of(
    st.just(()),  # 0-d
    st.lists(st.integers(0, 3), min_size=1, max_size=3).filter(lambda s: 0 in s).map(tuple),
)


@pytest.mark.parametrize("front_end", ["Request.insert", "EmbeddingCache.insert", "EncodePipeline"])
@given(dtype=st.sampled_from(DTYPES), shape=BAD_SHAPES)
def test_zero_size_and_0d_tensors_are_refused_leaving_the_cache_as_it_was(
    front_end: str, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    tensor = torch.empty(shape, dtype=dtype)
    cache = new_cache()
    try:
        before = state(cache)
        with pytest.raises((InvalidArgumentError, InvalidTypeError)):
            FRONT_ENDS[front_end](cache, [(next(_keys), tensor)])
        assert state(cache) == before
        cache.check_invariants()
    finally:
        cache.close()


UNCOPYABLE: dict[str, Callable[[], torch.Tensor]] = {
    "sparse COO": lambda: torch.eye(4).to_sparse(),
    "sparse CSR": lambda: torch.eye(4).to_sparse_csr(),
    "meta": lambda: torch.empty(4, 4, device="meta"),
    "quantized": lambda: torch.quantize_per_tensor(torch.ones(4, 4), 0.1, 0, torch.qint8),
}


@pytest.mark.parametrize("what", list(UNCOPYABLE))
@pytest.mark.parametrize("front_end", ["Request.insert", "EmbeddingCache.insert"])
def test_a_tensor_with_no_plain_bytes_is_refused_leaving_the_cache_as_it_was(
    front_end: str, what: str
) -> None:
    """Sparse, meta and quantized tensors have no strided bytes to copy: a specific error,
    and nothing of the insert stays (the range is freed, no pin, no request)."""
    tensor = UNCOPYABLE[what]()
    cache = new_cache()
    try:
        before = state(cache)
        with pytest.raises(InvalidTypeError, match="cannot be cached"):
            FRONT_ENDS[front_end](cache, [(next(_keys), tensor)])
        assert state(cache) == before
        cache.check_invariants()
    finally:
        cache.close()


# ---------------------------------------------------------------------------- the plant
def rows_dense_bytes_only(tensor: torch.Tensor, entry: Any) -> bool:
    """The planted bug of issue 42: the fast path takes a tensor whose rows are dense (the
    last dim's stride is 1) as if it were contiguous."""
    return (
        type(tensor) is torch.Tensor
        and tensor.is_cpu
        and tensor.dtype == entry.dtype
        and tuple(tensor.shape) == tuple(entry.shape)
        and tensor.layout is torch.strided
        and (tensor.dim() == 0 or tensor.stride(-1) == 1)
        and not tensor.is_conj()
        and not tensor.is_neg()
    )


@pytest.mark.parametrize("front_end", sorted(COPIES_IN))
def test_a_layout_blind_fast_path_fails_the_property(
    front_end: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(pool_module, "bytes_only", rows_dense_bytes_only)

    @settings(database=None)
    @given(drawn=layouts())
    def served_as_contiguous(drawn: tuple[str, torch.Tensor]) -> None:
        kind, tensor = drawn
        cache = new_cache()
        try:
            pairs = [(next(_keys), tensor)]
            got = FRONT_ENDS[front_end](cache, pairs) + read_back(cache, pairs)
            assert got == [expected(tensor)] * 2, f"{kind}: served other bytes"
        finally:
            cache.close()

    # The plant reads past a broadcast tensor's storage, bytes that may by chance equal the
    # right ones on Hypothesis's replay: a failure it cannot replay (FlakyFailure) still
    # caught the plant, if what failed was the property.
    with pytest.raises((AssertionError, FlakyFailure)) as caught:
        served_as_contiguous()
    failures = caught.value.exceptions if isinstance(caught.value, FlakyFailure) else [caught.value]
    assert any("served other bytes" in str(failure) for failure in failures), caught.value


# ---------------------------------------------------------------------------- SGLang
def sglang_insert(ctl: Any, pairs: Pairs) -> list[bytes]:
    """``store_to_pool_async`` + ``wait_store_to_pool`` of every pair in one call (a cached
    key is skipped), then what the adapter's cache serves for each: SGLang's ``(tokens, dim)``
    rows of it."""
    from embcache.integrations.sglang import as_2d
    from tests.support.sglang_mmencoder import Modality

    keys, tensors = [k for k, _ in pairs], [t for _, t in pairs]
    ctl.wait_store_to_pool(ctl.store_to_pool_async(keys, tensors, Modality.IMAGE))
    with ctl.cache.request(f"s-{keys[0]}") as r:
        r.lookup([Item.of(k, as_2d(t)) for k, t in pairs], prefetch=False)
        return [served(view) for view in r.embeddings()]


@pytest.mark.parametrize("kind", KINDS)
@PER_PAIR
@given(data=st.data())
def test_every_layout_through_the_sglang_adapter(kind: str, data: st.DataObject) -> None:
    """One item per call, then one call of every tensor (the first now cached)."""
    from embcache.integrations.sglang import EmbeddingCacheController, as_2d
    from embcache.testing import FaultInjectingStore
    from tests.support.sglang_mmencoder import Modality

    tensors = data.draw(batches(kind, min_tail=1), label="tensors")  # one width: SGLang's dim
    pairs = [(next(_keys), t) for t in tensors]
    store = FaultInjectingStore(delay_seconds=0.0)
    ctl = EmbeddingCacheController(
        store,
        max_pool_size_gb=(64 << 10) / (1 << 30),
        hidden_dims={Modality.IMAGE: tensors[0].shape[-1]},
        dtype=tensors[0].dtype,
    )
    try:
        for call in (pairs[:1], pairs):
            want = [expected(t) for _, t in call]
            assert want == [expected(as_2d(t)) for _, t in call]
            assert sglang_insert(ctl, call) == want, f"SGLang adapter, {kind}: other bytes"
    finally:
        ctl.close()
        store.release_holds()


def test_a_0d_tensor_is_skipped_by_the_sglang_adapter() -> None:
    """SGLang skips an item it cannot cache (wrong width, no rows): a 0-d tensor has no width,
    so it is skipped too, not an IndexError."""
    from embcache.integrations.sglang import EmbeddingCacheController
    from embcache.testing import FaultInjectingStore
    from tests.support.sglang_mmencoder import Modality

    store = FaultInjectingStore(delay_seconds=0.0)
    ctl = EmbeddingCacheController(
        store, max_pool_size_gb=(64 << 10) / (1 << 30), hidden_dims={Modality.IMAGE: 4}
    )
    try:
        assert ctl.store_to_pool_async(["k"], [torch.tensor(1.0)], Modality.IMAGE) == []
        assert ctl.cache.stats().allocated_bytes == 0
    finally:
        ctl.close()


# ---------------------------------------------------------------------------- vLLM
@pytest.fixture(scope="module")
def vllm_pair() -> Iterator[tuple[Any, Any]]:
    """A scheduler-role connector made by vLLM's factory and rank 0's worker connector, in
    this process (``tests.vllm_connector.vllm_replay.LocalRank``); vLLM from its wheel."""
    from tests.support import vllm_wheel

    vllm_wheel.install_or_skip()
    from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorRole
    from vllm.distributed.ec_transfer.ec_connector.factory import ECConnectorFactory

    from tests.vllm_connector.vllm_replay import LocalRank, vllm_config

    extra = {"pool_bytes": 256 * 1024}
    sched = ECConnectorFactory.create_connector(
        vllm_config("ec_both", extra, 1), ECConnectorRole.SCHEDULER
    )
    rank = LocalRank("ec_both", extra, 1, 0)
    yield sched, rank.connector
    sched.shutdown()


def vllm_save(sched: Any, worker: Any, key: str, tensor: torch.Tensor) -> bytes:
    """One step: the scheduler reserves ``key``'s range, rank 0 saves ``tensor`` there
    (``save_caches``), its ack makes the entry READY; the bytes the scheduler's cache serves."""
    from vllm.v1.outputs import ECConnectorOutput

    from tests.support.vllm_wheel import SchedulerOutput
    from tests.vllm_connector.vllm_replay import DTYPE, FakeRequest

    rows = tensor.shape[0]
    request = FakeRequest(f"v-{key}", [key], {key: rows}, 1)
    assert sched.ensure_cache_available(request, 0)
    assert not sched.has_cache_item(key)
    sched.update_state_after_alloc(request, 0)
    meta = sched.build_connector_meta(SchedulerOutput())
    assert [t.key for t in meta.saves] == [key] and tensor.dtype == DTYPE
    worker.bind_connector_metadata(meta)
    encoder_cache = {key: tensor}
    worker.save_caches(encoder_cache=encoder_cache, mm_hash=key)
    acks = worker.build_connector_worker_meta()
    worker.clear_connector_metadata()
    sched.request_finished(request)
    sched.update_connector_output(ECConnectorOutput(ec_connector_worker_meta=acks))
    cache = sched.scheduler_side.cache
    with cache.request(f"read-{key}") as r:
        r.lookup([Item(key, tuple(tensor.shape), DTYPE)], prefetch=False)
        got = served(r.embeddings()[0])
    cache.remove(key)
    return got


VLLM_KINDS = [k for k in KINDS if k != "conjugate bit"]  # its outputs are float16: no conj


@pytest.mark.parametrize("kind", VLLM_KINDS)
@settings(max_examples=10, deadline=None)
@given(data=st.data())
def test_every_layout_through_the_vllm_workers_save(
    vllm_pair: tuple[Any, Any], kind: str, data: st.DataObject
) -> None:
    from tests.vllm_connector.vllm_replay import DTYPE, WIDTH

    sched, worker = vllm_pair
    rows = data.draw(st.integers(1, 6))
    tensor = make(kind, (rows, WIDTH), DTYPE, data.draw(st.integers(0, 2**31 - 1)))
    got = vllm_save(sched, worker, next(_keys), tensor)
    assert got == expected(tensor), f"vLLM save, {kind}: other bytes"
    sched.check_invariants()


def test_the_fast_path_check_asks_is_conj_only_of_a_complex_tensor(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``is_conj`` lets go of the interpreter lock (a wait to get it back on a busy server),
    and torch sets the conjugate bit on complex tensors only: a real output is not asked."""
    asked: list[torch.dtype] = []
    is_conj = torch.Tensor.is_conj

    def counting(tensor: torch.Tensor) -> bool:
        asked.append(tensor.dtype)
        return is_conj(tensor)

    monkeypatch.setattr(torch.Tensor, "is_conj", counting)
    real = fresh((2, 8), torch.bfloat16, 0)
    complex_ = fresh((2, 8), torch.complex64, 0)
    assert pool_module.bytes_only(real, Item.of("real", real))
    assert pool_module.bytes_only(complex_, Item.of("complex", complex_))
    assert not pool_module.bytes_only(complex_.conj(), Item.of("conj", complex_))
    assert asked == [torch.complex64, torch.complex64]
