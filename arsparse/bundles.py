"""Named model bundles (a GPT plus its tokenizer) that ``arsparse.load_model(name)`` knows.

Shipped bundles read weights from ``arsparse/weights`` (each with a model card beside it);
``random-*`` bundles are LlamaGen architectures with seeded random weights, for speed work on
real model sizes (their images are noise).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from .data.emoji import EMOJI_CLASSES
from .data.fashion import FASHION_CLASSES
from .models.config import GPTConfig, gpt_config
from .models.gpt import GPT
from .models.vq import VQConfig, VQModel, vq_config
from .tokenizers import ImageTokenizer, VQTokenizer, make_tokenizer

WEIGHTS_DIR = Path(__file__).parent / "weights"


@dataclass(frozen=True)
class Bundle:
    """A named (GPT, tokenizer) pair.

    Shipped bundles read ``gpt_file`` from :data:`WEIGHTS_DIR`; its safetensors header holds the
    GPT config and the tokenizer description. Random bundles carry their configs and a seed.
    ``cfg_scale`` is the guidance this model is best sampled with; ``class_names`` name its classes.
    ``policy_cfg_scales``: (policy, guidance) pairs calibrated for a policy at its default settings
    (``arsparse eval --match-guidance``: the scale at which its guided distribution is as far from its
    unconditional one as dense's at ``cfg_scale``); :meth:`guidance` picks the one a sampler gets.
    """

    name: str
    description: str
    gpt: GPTConfig | None = None
    vq: VQConfig | None = None
    gpt_file: str | None = None
    vq_file: str | None = None
    seed: int = 0
    cfg_scale: float = 4.0
    class_names: tuple[str, ...] | None = None
    how_to_get: str = ""
    policy_cfg_scales: tuple[tuple[str, float], ...] = ()

    @property
    def files(self) -> list[str]:
        """The weight files this bundle needs under :data:`WEIGHTS_DIR`."""
        return [f for f in (self.gpt_file, self.vq_file) if f]

    @property
    def available(self) -> bool:
        return all((WEIGHTS_DIR / f).is_file() for f in self.files)

    def guidance(self, policy: str = "dense", policy_args: dict | None = None) -> float:
        """The guidance ``policy`` (with ``policy_args``) samples with by default (:func:`policy_guidance`)."""
        return policy_guidance(dict(self.policy_cfg_scales), self.cfg_scale, policy, policy_args)

    def gpt_config(self) -> GPTConfig:
        if self.gpt is not None:
            return self.gpt
        from .loading import GPT_META, read_metadata

        return GPTConfig(**json.loads(read_metadata(WEIGHTS_DIR / self.gpt_file)[GPT_META]))


BUNDLES: dict[str, Bundle] = {b.name: b for b in [
    Bundle("fashion-c2i", "trained here: Fashion-MNIST, 10 classes, 28x28 one token per pixel (32 grey levels), "
           "17.7M-parameter LlamaGen GPT, fine-tuned for diagonal's read sets",
           gpt_file="fashion-c2i.safetensors", cfg_scale=2.0, class_names=FASHION_CLASSES,
           policy_cfg_scales=(("diagonal", 1.697),)),  # (--match-guidance at 2: BENCHMARKS run 40)
    Bundle("emoji-c2i", "trained here: colour emoji (Google + Twitter styles), 18 classes = category x style, "
           "64x64 RGB through a VQ trained here (32x32 = 1024 tokens, 1024 codes), 18.5M-parameter LlamaGen GPT, "
           "fine-tuned for diagonal's read sets",
           gpt_file="emoji-c2i.safetensors", vq_file="emoji-vq.safetensors", cfg_scale=3.0, class_names=EMOJI_CLASSES,
           how_to_get="train them on a GPU with docs/models/emoji-train.sh (about 12 minutes on one H200) "
                      "and copy emoji-c2i.safetensors and emoji-vq.safetensors into that folder"),
    Bundle("random-small", "GPT-small (6 layers, dim 384) + VQ-16 (ch 32), random weights, 16x16 tokens, 256 px",
           gpt_config("GPT-small", image_tokens=256), vq_config("VQ-16", ch=32)),
    Bundle("random-gpt-b", "LlamaGen GPT-B + VQ-16, random weights, 16x16 tokens, 256 px",
           gpt_config("GPT-B", image_tokens=256), vq_config("VQ-16")),
    Bundle("random-gpt-xl-384", "LlamaGen GPT-XL + VQ-16, random weights, 24x24 tokens, 384 px",
           gpt_config("GPT-XL", image_tokens=576), vq_config("VQ-16")),
]}

DEFAULT_MODEL = "fashion-c2i"


def policy_guidance(scales: dict[str, float], default: float, policy: str, policy_args: dict | None = None) -> float:
    """``scales[policy]`` (a guidance calibrated for the policy at its default settings) where the
    arguments leave ``policy`` at those settings, else ``default``."""
    scale = scales.get(policy)
    if scale is None or not policy_args:
        return default if scale is None else scale
    from .policies import get

    return scale if get(policy, **policy_args).describe() == get(policy).describe() else default


def _random_init(module: torch.nn.Module, seed: int) -> None:
    """LlamaGen's initialisation (normal, std 0.02), reproducible from ``seed``."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def load_model(name: str = DEFAULT_MODEL, device="cpu", dtype: torch.dtype = torch.float32) -> tuple[GPT, ImageTokenizer]:
    """Load a named bundle -> (gpt, tokenizer). ``device``: cpu, cuda or cuda:N; ``dtype``: fp32, bf16, fp16
    or a ``torch.dtype``."""
    from .loading import TOKENIZER_META, device_dtype, load_gpt, read_metadata

    if name not in BUNDLES:
        raise ValueError(f"unknown model {name!r}; available: {', '.join(BUNDLES)} (see `arsparse models`)")
    device, dtype = device_dtype(device, dtype)
    b = BUNDLES[name]
    if not b.available:
        missing = ", ".join(f for f in b.files if not (WEIGHTS_DIR / f).is_file())
        raise ValueError(f"model {name!r} is listed but its weights are not installed: {missing} missing under "
                         f"{WEIGHTS_DIR}" + (f"; {b.how_to_get}" if b.how_to_get else ""))
    if b.gpt_file:
        path = WEIGHTS_DIR / b.gpt_file
        gpt = load_gpt(path, device=device, dtype=dtype)
        tok = make_tokenizer(json.loads(read_metadata(path)[TOKENIZER_META]), base_dir=WEIGHTS_DIR)
        return gpt, tok.to(device)
    gpt = GPT(b.gpt)
    _random_init(gpt, b.seed)
    vq = VQModel(b.vq)
    _random_init(vq, b.seed + 1)
    return gpt.to(device=device, dtype=dtype).eval(), VQTokenizer(vq.to(device).eval())
