"""Argument types and the model-choosing flags shared by every ``arsparse`` subcommand."""
from __future__ import annotations

import argparse
from pathlib import Path


def int_list(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 1,2,3, got {text!r}") from None


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def load_features(path: str):
    """Caption features (B, P, C) from .pt / .npy / .safetensors (the first tensor), as float32."""
    import torch

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"caption-feature file not found: {p}")
    if p.suffix == ".npy":
        import numpy as np

        return torch.from_numpy(np.load(p)).float()
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        return next(iter(load_file(str(p)).values())).float()
    obj = torch.load(p, map_location="cpu", weights_only=True)
    if isinstance(obj, dict):
        obj = next(iter(obj.values()))
    if not isinstance(obj, torch.Tensor):
        raise ValueError(f"{p} holds no tensor")
    return obj.float()


def add_model_args(p: argparse.ArgumentParser, vq_help: str = "VQ tokenizer checkpoint for --gpt-ckpt") -> None:
    """--model, or --gpt-ckpt with its preset, grid, type and VQ tokenizer."""
    p.add_argument("--model", help="bundle name (see `arsparse models`); default: the shipped default")
    p.add_argument("--gpt-ckpt", help="GPT checkpoint (.pt/.pth/.safetensors), instead of --model")
    p.add_argument("--gpt-preset", help="GPT size for --gpt-ckpt (inferred from the weights when omitted)")
    p.add_argument("--image-tokens", type=int, help="tokens per image for --gpt-ckpt (256, 576, ...)")
    p.add_argument("--model-type", choices=["c2i", "t2i"], help="checked against --gpt-ckpt")
    p.add_argument("--vq-ckpt", help=vq_help)
    p.add_argument("--vq-preset", default="VQ-16", choices=["VQ-16", "VQ-8"])


def build_model(args, need_tokenizer: bool = True):
    """-> (gpt, tokenizer or None, name, recommended guidance scale) from the :func:`add_model_args` flags."""
    from .bundles import BUNDLES, DEFAULT_MODEL, load_model
    from .loading import load_gpt, load_vq

    if args.gpt_ckpt:
        if args.model:
            raise ValueError("give either --model or --gpt-ckpt, not both")
        if need_tokenizer and not args.vq_ckpt:
            raise ValueError("--gpt-ckpt needs --vq-ckpt to turn tokens into images")
        gpt = load_gpt(args.gpt_ckpt, preset=args.gpt_preset, image_tokens=args.image_tokens,
                       model_type=args.model_type)
        tok = load_vq(args.vq_ckpt, preset=args.vq_preset) if args.vq_ckpt else None
        return gpt, tok, Path(args.gpt_ckpt).name, 4.0
    name = args.model or DEFAULT_MODEL
    gpt, tok = load_model(name)
    return gpt, tok, name, BUNDLES[name].cfg_scale
