"""The tiny vision encoder and the image hash: shapes, determinism, dtype, the key format."""

from __future__ import annotations

import hashlib

import pytest
import torch

from embcache import EmbeddingCache, EncodePipeline, Item
from embcache.errors import InvalidArgumentError, InvalidTypeError
from embcache.tools.encoders import TinyViT, image_key, synthetic_image

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def vit() -> TinyViT:
    return TinyViT(hidden_size=40, width=32, depth=1, heads=2, seed=7)


def test_token_count_follows_patches_over_merge_squared(vit: TinyViT) -> None:
    assert vit.token_count(28, 28) == 1
    assert vit.token_count(56, 112) == (4 * 8) // 4
    big = TinyViT(hidden_size=8, width=16, depth=1, heads=2, merge=1)
    assert big.token_count(28, 28) == 4


def test_outputs_have_item_shapes_dtype_and_device(vit: TinyViT) -> None:
    images = [synthetic_image(1, 56, 56), synthetic_image(2, 28, 84)]
    outputs = vit(images)
    for image, out in zip(images, outputs, strict=True):
        it = vit.item(image)
        assert tuple(out.shape) == it.shape == (vit.token_count(*image.shape[1:]), 40)
        assert out.dtype == it.dtype == torch.bfloat16
        assert out.device == vit.device
        assert torch.isfinite(out.float()).all()
        assert not out.requires_grad


def test_deterministic_and_seeded(vit: TinyViT) -> None:
    image = synthetic_image(3, 56, 56)
    first = vit([image])[0]
    assert torch.equal(first, vit([image])[0])
    torch.manual_seed(12345)  # the global RNG plays no part
    same = TinyViT(hidden_size=40, width=32, depth=1, heads=2, seed=7)
    assert torch.equal(first, same([image])[0])
    other = TinyViT(hidden_size=40, width=32, depth=1, heads=2, seed=8)
    assert not torch.equal(first, other([image])[0])


def test_an_image_encodes_the_same_alone_or_in_a_batch(vit: TinyViT) -> None:
    a, b = synthetic_image(4, 56, 56), synthetic_image(5, 28, 56)
    assert torch.equal(vit([a])[0], vit([b, a])[1])


def test_windowed_attention_stays_within_runs_of_patches() -> None:
    image = synthetic_image(6, 56, 84)  # 4 x 6 patches of 14 px; merge 1: a token per patch
    changed = image.clone()
    changed[:, :14, :14] = 255 - changed[:, :14, :14]  # the first patch only
    rows = TinyViT(hidden_size=8, width=16, depth=1, heads=2, merge=1, window=6)
    moved = (rows([image])[0] != rows([changed])[0]).any(dim=1).view(4, 6)
    assert moved[0].all() and not moved[1:].any()  # the first run of 6 patches: row 0
    whole = TinyViT(hidden_size=8, width=16, depth=1, heads=2, merge=1)
    assert (whole([image])[0] != whole([changed])[0]).any(dim=1).all()
    uneven = TinyViT(hidden_size=8, width=16, depth=1, heads=2, merge=1, window=5)
    moved = (uneven([image])[0] != uneven([changed])[0]).any(dim=1)  # runs of 5, then one of 4
    assert moved[:5].all() and not moved[5:].any()
    last = synthetic_image(6, 56, 84)
    last[:, 42:, 70:] = 255 - last[:, 42:, 70:]  # the last patch: in the short run
    moved = (uneven([image])[0] != uneven([last])[0]).any(dim=1)
    assert moved[20:].all() and not moved[:20].any()


def test_float32_output_when_asked() -> None:
    vit = TinyViT(hidden_size=8, width=16, depth=1, heads=2, dtype=torch.float32)
    assert vit([synthetic_image(0, 28, 28)])[0].dtype == torch.float32


def test_image_key_hashes_dtype_shape_and_pixels() -> None:
    image = synthetic_image(6, 28, 56)
    key = image_key(image)
    assert key.startswith("img-") and len(key) == 4 + 32
    assert key == image_key(image.clone())
    digest = hashlib.blake2b(digest_size=16, person=b"embcache-img-v1")
    digest.update(b"torch.uint8:3x28x56;")
    digest.update(image.numpy().tobytes())
    assert key == "img-" + digest.hexdigest(), "the documented hash"
    changed = image.clone()
    changed[0, 0, 0] ^= 1
    assert image_key(changed) != key
    assert image_key(image.reshape(3, 56, 28)) != key, "same bytes, other shape"
    assert image_key(image.view(torch.int8)) != key, "same bytes, other dtype"
    assert image_key(image.transpose(1, 2).contiguous().transpose(1, 2)) == key, "any layout"


def test_synthetic_images_are_deterministic() -> None:
    assert torch.equal(synthetic_image(9, 28, 28), synthetic_image(9, 28, 28))
    assert not torch.equal(synthetic_image(9, 28, 28), synthetic_image(10, 28, 28))
    assert synthetic_image(9, 28, 42).shape == (3, 28, 42)


def test_bad_input_is_refused(vit: TinyViT) -> None:
    with pytest.raises(InvalidArgumentError, match="multiples of patch_size"):
        vit([synthetic_image(0, 30, 28)])
    with pytest.raises(InvalidArgumentError, match="3 x H x W"):
        vit.item(torch.zeros(28, 28))
    with pytest.raises(InvalidTypeError):
        vit(synthetic_image(0, 28, 28))
    with pytest.raises(InvalidTypeError):
        image_key([1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="heads"):
        TinyViT(width=30, heads=4)
    with pytest.raises(InvalidTypeError):
        TinyViT(dtype=torch.int8)
    with pytest.raises(InvalidArgumentError, match="window"):
        TinyViT(window=0)


def test_through_the_pipeline_cached_equals_fresh(vit: TinyViT) -> None:
    images = [synthetic_image(s, 56, 28) for s in range(3)]
    items: list[Item] = [vit.item(image) for image in images]
    with EmbeddingCache(1 << 20, pin_memory=False) as cache:
        pipeline = EncodePipeline(cache, vit)
        fresh = pipeline.encode("a", items, images)
        cached = pipeline.encode("b", items, images)
    assert pipeline.stats().local_hits == 3
    assert torch.equal(fresh, torch.cat(vit(images)))
    assert torch.equal(cached, fresh)
    assert cached.dtype == torch.bfloat16
