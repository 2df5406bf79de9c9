"""A tiny LLaVA written on the spot: a CLIP vision tower, LLaVA's projector and a Llama language
model of two layers each, with its weights drawn from a fixed seed, a word-level tokenizer and
a LLaVA processor, all saved to one folder that vLLM loads offline. Nothing is downloaded.

The weights are scaled up from transformers' initialisation (std 0.02) so that the greedy
answer depends on the image and the top logit leads the next one clearly: two engines that
compute the same numbers then give the same tokens, whatever their batching.

    python -m tests.engine.tiny_llava OUT_DIR   # needs the engine environment (.ci/engine_env)

``images(n)`` gives the engine tier's images: ``n`` distinct PIL images from fixed seeds.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

SEED = 1234
IMAGE_SIZE = 84  # pixels a side; 14-pixel patches: 36 image tokens per image
PATCH = 14
WIDTH = 128  # the language model's hidden size; head_dim 64 (vLLM's CPU attention has no 16)
WORDS = [f"w{i}" for i in range(200)]
SPECIAL = ["<unk>", "<s>", "</s>", "<pad>", "<image>"]
VERSION = "5"  # written into the folder; bump when anything above changes


def images(n: int, offset: int = 0) -> list[Any]:
    """``n`` distinct RGB images, image ``i`` from seed ``SEED + offset + i``."""
    import numpy as np
    from PIL import Image

    out = []
    for i in range(offset, offset + n):
        rng = np.random.default_rng(SEED + i)
        pixels = rng.integers(0, 256, size=(IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
        out.append(Image.fromarray(pixels, "RGB"))
    return out


def write(out: Path) -> Path:
    """Write the model, tokenizer and processor into ``out`` (skipped when already there)."""
    stamp = out / "embcache-tiny-llava.json"
    if stamp.exists() and json.loads(stamp.read_text()).get("version") == VERSION:
        return out
    import torch
    from safetensors.torch import save_file
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import (
        CLIPImageProcessor,
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
        LlavaProcessor,
        PreTrainedTokenizerFast,
    )

    out.mkdir(parents=True, exist_ok=True)
    vocab = {tok: i for i, tok in enumerate(SPECIAL + WORDS)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    core.add_special_tokens(SPECIAL)  # "<image>" repeated with no spaces is still one token each
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="<pad>",
        extra_special_tokens={"image_token": "<image>"},
        model_max_length=512,
    )
    vision = CLIPVisionConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        image_size=IMAGE_SIZE,
        patch_size=PATCH,
        projection_dim=32,
    )
    text = LlamaConfig(
        vocab_size=len(vocab),
        hidden_size=WIDTH,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=512,
        bos_token_id=vocab["<s>"],
        eos_token_id=vocab["</s>"],
        pad_token_id=vocab["<pad>"],
        tie_word_embeddings=False,
    )
    config = LlavaConfig(
        vision_config=vision.to_dict(),
        text_config=text.to_dict(),
        image_token_index=vocab["<image>"],
        vision_feature_layer=-1,
        vision_feature_select_strategy="full",
        projector_hidden_act="gelu",
    )
    config.vision_config.model_type = "clip_vision_model"
    torch.manual_seed(SEED)
    model = LlavaForConditionalGeneration(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                param.normal_(0.0, 0.2 if "vision" in name else 0.15)
        model.lm_head.weight.mul_(4.0)
    model.config.architectures = ["LlavaForConditionalGeneration"]
    model.config.save_pretrained(out)
    save_file(_vllm_names(model.state_dict()), str(out / "model.safetensors"), {"format": "pt"})
    image_processor = CLIPImageProcessor(
        size={"shortest_edge": IMAGE_SIZE},
        crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE},
        do_center_crop=True,
    )
    processor = LlavaProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        patch_size=PATCH,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,
    )
    processor.save_pretrained(out)
    tokenizer.save_pretrained(out)
    stamp.write_text(json.dumps({"version": VERSION, "seed": SEED}))
    return out


def _vllm_names(state: dict[str, Any]) -> dict[str, Any]:
    """The weights under the names of the original LLaVA checkpoints, which vLLM's LLaVA loads
    (transformers 5 saves ``vision_tower.embeddings...``; vLLM wants ``vision_model`` there)."""
    out = {}
    for name, tensor in state.items():
        name = name.removeprefix("model.")
        if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model."):
            name = "vision_tower.vision_model." + name.removeprefix("vision_tower.")
        elif name.startswith("language_model.") and not name.startswith("language_model.model."):
            name = "language_model.model." + name.removeprefix("language_model.")
        elif name.startswith("lm_head."):
            name = "language_model." + name
        out[name] = tensor.contiguous()
    return out


if __name__ == "__main__":
    print(write(Path(sys.argv[1])))
