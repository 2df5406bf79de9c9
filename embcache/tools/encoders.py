"""A small real vision encoder, the image hash, and synthetic images, for the demo and tests.

``TinyViT`` is a vision transformer in the shape of the encoders multimodal LLMs use (Qwen2-VL
style): 14x14 patches embedded by a linear layer, 2-D sin-cos positions, a few pre-norm
attention blocks (over every patch, or with ``window=w`` within consecutive runs of ``w``
patches in raster order, so that the cost grows linearly with the image, as in the windowed
layers of Qwen2.5-VL's encoder), then a patch merger that concatenates each ``merge x merge``
square of patches and projects it to the LLM's hidden size. So an image of ``H x W`` pixels gives
``(H / patch) * (W / patch) / merge**2`` tokens, like the real thing. Each image is encoded on
its own (images differ in size), so an image's embedding does not depend on what it was batched
with: the bytes a cache serves are the bytes a fresh encode would give.

Weights are drawn from a generator seeded with ``seed``, independent of torch's global RNG.
The model computes in float32 and returns ``dtype`` (bf16 by default, as serving does);
outputs are deterministic for a given input, torch build and thread count.

The image hash (``image_key``) names an image by its pixels: ``"img-"`` followed by the
hexadecimal BLAKE2b-128 digest (personalised ``b"embcache-img-v1"``) of the ASCII header
``"{dtype}:{d0}x{d1}x...;"`` and then the tensor's raw bytes in C order. The header keeps two
images with the same bytes but another shape or dtype apart. Hashing costs one pass over the
pixels (about 1 ms per megapixel) and no copy for a contiguous CPU tensor.

Why here and not in ``models/``: ``models/`` holds the reference models of the cache that the
tests compare against; this encoder is runtime code the demo (and users trying embcache out)
import, so it lives in the package.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from embcache.driver.item import Item
from embcache.errors import InvalidArgumentError, InvalidTypeError

__all__ = ["TinyViT", "image_key", "synthetic_image"]

_HASH_PERSON = b"embcache-img-v1"


def image_key(image: torch.Tensor) -> str:
    """The cache key of ``image``: a hash of its dtype, shape and pixels (module docstring)."""
    if not isinstance(image, torch.Tensor):
        raise InvalidTypeError(f"image must be a torch.Tensor, got {type(image).__name__}")
    pixels = image.detach().to("cpu").contiguous()
    digest = hashlib.blake2b(digest_size=16, person=_HASH_PERSON)
    shape = "x".join(str(d) for d in pixels.shape)
    digest.update(f"{pixels.dtype}:{shape};".encode("ascii"))
    if pixels.numel():
        digest.update(pixels.reshape(-1).view(torch.uint8).numpy().data)
    return "img-" + digest.hexdigest()


def synthetic_image(seed: int, height: int, width: int) -> torch.Tensor:
    """A deterministic RGB image (uint8, ``3 x height x width``): noise over a colour ramp."""
    if height <= 0 or width <= 0:
        raise InvalidArgumentError(f"image size must be positive, got {height}x{width}")
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randint(0, 64, (3, height, width), generator=generator, dtype=torch.int32)
    base = torch.randint(0, 192, (3, 1, 1), generator=generator, dtype=torch.int32)
    ramp = torch.arange(width, dtype=torch.int32).view(1, 1, width) * 64 // width
    return (noise + base + ramp).clamp(0, 255).to(torch.uint8)


class _Block(nn.Module):
    """A pre-norm transformer block: self-attention then an MLP, both residual."""

    def __init__(self, width: int, heads: int, mlp_ratio: int, window: int | None) -> None:
        super().__init__()
        self.heads = heads
        self.window = window
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, mlp_ratio * width)
        self.fc2 = nn.Linear(mlp_ratio * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.shape[0]
        qkv = self.qkv(self.norm1(x))
        run = self.window or tokens
        full = tokens // run * run
        parts = [self._attend(qkv[:full], run)] if full else []
        if full < tokens:
            parts.append(self._attend(qkv[full:], tokens - full))
        x = x + self.proj(torch.cat(parts) if len(parts) > 1 else parts[0])
        out: torch.Tensor = x + self.fc2(F.gelu(self.fc1(self.norm2(x))))
        return out

    def _attend(self, qkv: torch.Tensor, run: int) -> torch.Tensor:
        """Self-attention within each run of ``run`` consecutive rows of ``qkv``."""
        tokens = qkv.shape[0]
        width = qkv.shape[1] // 3
        q, k, v = qkv.view(tokens // run, run, 3, self.heads, -1).permute(2, 0, 3, 1, 4)
        attended = F.scaled_dot_product_attention(q, k, v)  # runs x heads x run x head_dim
        return attended.transpose(1, 2).reshape(tokens, width)


class TinyViT(nn.Module):
    """A seeded, deterministic vision transformer: images in, ``tokens x hidden_size`` out.

    Call it with a sequence of images (``3 x H x W``, uint8 0..255 or float 0..1, ``H`` and
    ``W`` multiples of ``patch_size * merge``); it returns one tensor per image, of
    ``token_count(H, W) x hidden_size`` elements, ``dtype``, on ``device``. This is the encoder
    protocol ``EncodePipeline`` calls. ``window``: each block attends within consecutive runs
    of that many patches (raster order); None attends over every patch of the image.
    """

    def __init__(
        self,
        hidden_size: int = 1024,
        *,
        patch_size: int = 14,
        merge: int = 2,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        mlp_ratio: int = 4,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        seed: int = 0,
        window: int | None = None,
    ) -> None:
        super().__init__()
        for name, value in (
            ("hidden_size", hidden_size),
            ("patch_size", patch_size),
            ("merge", merge),
            ("width", width),
            ("depth", depth),
            ("heads", heads),
            ("mlp_ratio", mlp_ratio),
            ("window", 1 if window is None else window),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise InvalidArgumentError(f"{name} must be a positive int, got {value!r}")
        if width % heads or width % 4:
            raise InvalidArgumentError(
                f"width must be a multiple of heads ({heads}) and of 4, got {width}"
            )
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise InvalidTypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        self.hidden_size = hidden_size
        self.patch_size = patch_size
        self.merge = merge
        self.width = width
        self.dtype = dtype
        self.patch_embed = nn.Linear(3 * patch_size * patch_size, width)
        self.blocks = nn.ModuleList(_Block(width, heads, mlp_ratio, window) for _ in range(depth))
        self.merge_norm = nn.LayerNorm(width)
        self.merger = nn.Sequential(
            nn.Linear(merge * merge * width, merge * merge * width),
            nn.GELU(),
            nn.Linear(merge * merge * width, hidden_size),
        )
        self._init_weights(seed)
        self.to(torch.device(device))
        self.eval()

    @property
    def device(self) -> torch.device:
        """Where the weights, and therefore every output, live."""
        return self.patch_embed.weight.device

    def token_count(self, height: int, width: int) -> int:
        """Tokens an image of ``height x width`` pixels gives: patches / merge**2."""
        self._check_size(height, width)
        return (height // self.patch_size) * (width // self.patch_size) // self.merge**2

    def item(self, image: torch.Tensor) -> Item:
        """The cache item of ``image``: its hash, ``tokens x hidden_size``, ``dtype``."""
        if not isinstance(image, torch.Tensor) or image.dim() != 3 or image.shape[0] != 3:
            raise InvalidArgumentError(
                f"an image is a 3 x H x W tensor, got {getattr(image, 'shape', image)!r}"
            )
        tokens = self.token_count(image.shape[1], image.shape[2])
        return Item(image_key(image), (tokens, self.hidden_size), self.dtype)

    def forward(self, images: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """Encode each image on its own; one ``tokens x hidden_size`` tensor per image."""
        if isinstance(images, torch.Tensor):
            raise InvalidTypeError("TinyViT takes a sequence of images, not one tensor")
        with torch.no_grad():
            return [self._encode_one(image) for image in images]

    # -- internals --
    def _check_size(self, height: int, width: int) -> None:
        step = self.patch_size * self.merge
        if height <= 0 or width <= 0 or height % step or width % step:
            raise InvalidArgumentError(
                f"image size {height}x{width} must be positive multiples of "
                f"patch_size * merge = {step}"
            )

    def _encode_one(self, image: torch.Tensor) -> torch.Tensor:
        if image.dim() != 3 or image.shape[0] != 3:
            raise InvalidArgumentError(f"an image is 3 x H x W, got {tuple(image.shape)}")
        _, height, width = image.shape
        self._check_size(height, width)
        p, m = self.patch_size, self.merge
        pixels = image.to(self.device)
        pixels = pixels.float() / 255.0 if not pixels.is_floating_point() else pixels.float()
        rows, cols = height // p, width // p
        patches = pixels.unfold(1, p, p).unfold(2, p, p)  # 3 x rows x cols x p x p
        patches = patches.permute(1, 2, 0, 3, 4).reshape(rows * cols, 3 * p * p)
        x = self.patch_embed(patches) + _positions(rows, cols, self.width, self.device)
        for block in self.blocks:
            x = block(x)
        x = self.merge_norm(x).view(rows // m, m, cols // m, m, self.width)
        x = x.permute(0, 2, 1, 3, 4).reshape(rows * cols // (m * m), m * m * self.width)
        out: torch.Tensor = self.merger(x)
        return out.to(self.dtype)

    def _init_weights(self, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in sorted(self.named_parameters()):
                if name.endswith("bias"):
                    param.zero_()
                elif param.dim() == 1:  # LayerNorm scale
                    param.fill_(1.0)
                else:
                    std = 1.0 / math.sqrt(param.shape[1])
                    param.copy_(torch.randn(param.shape, generator=generator) * std)


def _positions(rows: int, cols: int, width: int, device: torch.device) -> torch.Tensor:
    """2-D sin-cos position embeddings, ``rows * cols x width``: half for rows, half for cols."""
    quarter = width // 4
    freqs = 1.0 / (10000.0 ** (torch.arange(quarter, device=device, dtype=torch.float32) / quarter))
    r = torch.arange(rows, device=device, dtype=torch.float32)[:, None] * freqs
    c = torch.arange(cols, device=device, dtype=torch.float32)[:, None] * freqs
    row_part = torch.cat([r.sin(), r.cos()], dim=1)[:, None, :].expand(rows, cols, 2 * quarter)
    col_part = torch.cat([c.sin(), c.cos()], dim=1)[None, :, :].expand(rows, cols, 2 * quarter)
    return torch.cat([row_part, col_part], dim=2).reshape(rows * cols, 4 * quarter)
