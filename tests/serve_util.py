"""Shared by the serving tests: a tiny model with a matching tokenizer, and its offline reference."""
import base64
import io

import numpy as np
import torch
from PIL import Image

from arsparse import policies
from arsparse.engine.generator import Generator
from arsparse.tokenizers import PaletteTokenizer, to_pil
from conftest import random_gpt

# A 4x4 grid (16 tokens, vocab 48 = the palette's grey levels): every request takes a few ms on the CPU.
DIAGONAL_4x4 = dict(local=3, rows=1, band=1, sinks=1)


def tiny_model(seed: int = 2, model_type: str = "c2i"):
    return random_gpt(model_type, image_tokens=16, seed=seed), PaletteTokenizer(48)


def make_app(gpt, tok, policy="dense", policy_args=None, **config):
    from arsparse.serve import ServeConfig, create_app

    cfg = dict(max_batch=8, max_images=4, max_queue=64)
    cfg.update(config)
    return create_app(gpt, tok, model_name="tiny", policy=policy, policy_args=policy_args,
                      config=ServeConfig(**cfg), cfg_scale=2.0)


def offline_tokens(gpt, body: dict, cfg_scale_default: float = 2.0) -> torch.Tensor:
    """What ``Generator.sample_tokens`` gives for a request body (CPU, fp32)."""
    name = body.get("policy") or "dense"
    gen = Generator(gpt, device="cpu", policy=policies.get(name, **(body.get("policy_args") or {})))
    n = body.get("n", 1)
    cfg = body.get("cfg_scale")
    return gen.sample_tokens([body["class_label"]] * n, cfg_scale=cfg_scale_default if cfg is None else cfg,
                             temperature=body.get("temperature", 1.0), top_k=body.get("top_k", 0),
                             top_p=body.get("top_p", 1.0), seed=body["seed"], cfg_interval=body.get("cfg_interval", -1))


def png_pixels(data: bytes) -> np.ndarray:
    with Image.open(io.BytesIO(data)) as im:
        return np.asarray(im.convert("RGB"))


def offline_pixels(tok, gpt, tokens: torch.Tensor) -> list[np.ndarray]:
    grid = (gpt.config.grid_h, gpt.config.grid_w)
    return [np.asarray(im.convert("RGB")) for im in to_pil(tok.decode(tokens, grid=grid))]


def b64_pixels(text: str) -> np.ndarray:
    return png_pixels(base64.b64decode(text))
