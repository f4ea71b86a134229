"""Named model bundles (a GPT plus its tokenizer) that ``arsparse.load_model(name)`` knows.

Shipped bundles read weights from ``arsparse/weights``; ``random-*`` bundles are LlamaGen
architectures with seeded random weights, for speed work and for trying the tool before any
training (their images are noise).
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from .models.config import GPTConfig, gpt_config
from .models.gpt import GPT
from .models.vq import VQConfig, VQModel, vq_config
from .tokenizers import VQTokenizer

WEIGHTS_DIR = Path(__file__).parent / "weights"


@dataclass(frozen=True)
class Bundle:
    name: str
    description: str
    gpt: GPTConfig
    vq: VQConfig
    gpt_file: str | None = None  # under WEIGHTS_DIR; None: random weights
    vq_file: str | None = None
    seed: int = 0

    @property
    def available(self) -> bool:
        return all((WEIGHTS_DIR / f).is_file() for f in (self.gpt_file, self.vq_file) if f)


BUNDLES: dict[str, Bundle] = {b.name: b for b in [
    Bundle("random-small", "GPT-small (6 layers, dim 384) + VQ-16 (ch 32), random weights, 16x16 tokens, 256 px",
           gpt_config("GPT-small", image_tokens=256), vq_config("VQ-16", ch=32)),
    Bundle("random-gpt-b", "LlamaGen GPT-B + VQ-16, random weights, 16x16 tokens, 256 px",
           gpt_config("GPT-B", image_tokens=256), vq_config("VQ-16")),
    Bundle("random-gpt-xl-384", "LlamaGen GPT-XL + VQ-16, random weights, 24x24 tokens, 384 px",
           gpt_config("GPT-XL", image_tokens=576), vq_config("VQ-16")),
]}

DEFAULT_MODEL = "random-small"


def _random_init(module: torch.nn.Module, seed: int) -> None:
    """LlamaGen's initialisation (normal, std 0.02), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def load_model(name: str = DEFAULT_MODEL, device="cpu", dtype: torch.dtype = torch.float32) -> tuple[GPT, VQTokenizer]:
    """Load a named bundle -> (gpt, tokenizer)."""
    from .loading import load_gpt, load_vq

    if name not in BUNDLES:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(BUNDLES)} (see `arsparse models`)")
    b = BUNDLES[name]
    if not b.available:
        raise ValueError(f"model {name!r} is listed but its weights are not installed under {WEIGHTS_DIR}")
    if b.gpt_file:
        gpt = load_gpt(WEIGHTS_DIR / b.gpt_file, device=device, dtype=dtype)
    else:
        gpt = GPT(b.gpt)
        _random_init(gpt, b.seed)
        gpt = gpt.to(device=device, dtype=dtype).eval()
    if b.vq_file:
        tok = load_vq(WEIGHTS_DIR / b.vq_file, device=device)
    else:
        vq = VQModel(b.vq)
        _random_init(vq, b.seed + 1)
        tok = VQTokenizer(vq.to(device).eval())
    return gpt, tok
