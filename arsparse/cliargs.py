"""Argument types and the model-choosing flags shared by every ``arsparse`` subcommand."""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path


def int_list(text: str) -> list[int]:
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        out = []
    if not out:  # (an empty list would silently mean "the default")
        raise argparse.ArgumentTypeError(f"expected one or more comma-separated integers like 1,2,3, got {text!r}")
    return out


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return v


def finite_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = float("nan")
    if not math.isfinite(v):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return v


def need_extra(extra: str, what: str, *modules: str) -> None:
    """Refuse, before any work, when a module of the optional dependencies ``extra`` (pyproject.toml)
    is missing: ``need_extra("plots", "the figures need", "matplotlib")``."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ValueError(f"{what} the {extra} extra ({e.name or module} is missing): "
                             f"pip install 'arsparse[{extra}]'") from None


FEATURE_KEYS = ("caption_embs", "emb_masks")  # LlamaGen's names: T5 features and their padding masks


def _read_tensors(path: str, what: str) -> dict:
    """name -> tensor of a .pt / .npy / .npz / .safetensors file (a bare tensor or array is named "")."""
    import torch

    p = Path(path)
    if not p.is_file():
        raise ValueError(f"{what} file not found: {p}")
    if p.suffix in (".npy", ".npz"):
        import numpy as np

        obj = np.load(p)
        items = {k: obj[k] for k in obj.files} if p.suffix == ".npz" else {"": obj}
        return {k: torch.from_numpy(np.asarray(v)) for k, v in items.items()}
    if p.suffix == ".safetensors":
        from safetensors.torch import load_file

        return load_file(str(p))
    obj = torch.load(p, map_location="cpu", weights_only=True)
    items = obj if isinstance(obj, dict) else {"": obj}
    items = {k: v for k, v in items.items() if isinstance(v, torch.Tensor)}
    if not items:
        raise ValueError(f"{p} holds no tensor")
    return items


def load_captions(path: str, mask_path: str | None = None):
    """Caption features (B, n, C) float32 and their padding mask (B, n) or None.

    ``path``: .pt / .npy / .npz / .safetensors; with several tensors, ``caption_embs`` (and
    ``emb_masks``, True/1 at real tokens), as LlamaGen's T5 embedder returns them, else the first.
    ``mask_path``: a file holding the mask instead (``emb_masks`` or its first tensor).
    """
    items = _read_tensors(path, "caption-feature")
    feats = items.get(FEATURE_KEYS[0], next(iter(items.values())))
    mask = items.get(FEATURE_KEYS[1])
    if mask_path is not None:
        if mask is not None:
            raise ValueError(f"{path} already holds emb_masks; leave out --caption-mask or use a file without them")
        masks = _read_tensors(mask_path, "caption-mask")
        mask = masks.get(FEATURE_KEYS[1], next(iter(masks.values())))
    if feats.dim() == 2:  # one caption
        feats = feats[None]
        mask = mask[None] if mask is not None and mask.dim() == 1 else mask
    if feats.dim() != 3 or not feats.is_floating_point():
        raise ValueError(f"caption features must be float (B, tokens, dim), got {feats.dtype} {tuple(feats.shape)}")
    return feats.float(), mask


def load_features(path: str):
    """Caption features (B, P, C) as float32 (see :func:`load_captions`; a mask is ignored)."""
    return load_captions(path)[0]


def add_model_args(p: argparse.ArgumentParser,
                   vq_help: str = "VQ tokenizer checkpoint for --gpt-ckpt (not needed for a file arsparse trained: "
                                  "it names its tokenizer)") -> None:
    """--model, or --gpt-ckpt with its preset, grid, type and VQ tokenizer."""
    p.add_argument("--model", help="bundle name (see `arsparse models`); default: the shipped default")
    p.add_argument("--gpt-ckpt", help="GPT checkpoint (.pt/.pth/.safetensors), instead of --model")
    p.add_argument("--gpt-preset", help="GPT size for --gpt-ckpt (inferred from the weights when omitted)")
    p.add_argument("--image-tokens", type=int, help="tokens per image for --gpt-ckpt (256, 576, ...)")
    p.add_argument("--model-type", choices=["c2i", "t2i"], help="checked against --gpt-ckpt")
    p.add_argument("--vq-ckpt", help=vq_help)
    p.add_argument("--vq-preset", choices=["VQ-16", "VQ-8"],
                   help="VQ size of a weights-only --vq-ckpt (default VQ-16); a file with a config header needs none")


def build_model(args, need_tokenizer: bool = True):
    """-> (gpt, tokenizer or None, name, recommended guidance scale) from the :func:`add_model_args` flags."""
    from .bundles import BUNDLES, DEFAULT_MODEL, load_model
    from .loading import TOKENIZER_META, load_gpt, load_vq, read_metadata
    from .tokenizers import make_tokenizer

    if args.gpt_ckpt:
        if args.model:
            raise ValueError("give either --model or --gpt-ckpt, not both")
        gpt = load_gpt(args.gpt_ckpt, preset=args.gpt_preset, image_tokens=args.image_tokens,
                       model_type=args.model_type)
        tok = None
        if args.vq_ckpt:
            tok = load_vq(args.vq_ckpt, preset=args.vq_preset)
        elif need_tokenizer:  # (a file arsparse trained names its tokenizer: a palette, or the VQ file beside it)
            named = read_metadata(args.gpt_ckpt).get(TOKENIZER_META)
            if named is None:
                raise ValueError("--gpt-ckpt needs --vq-ckpt to turn tokens into images (the file names no tokenizer)")
            tok = make_tokenizer(json.loads(named), base_dir=Path(args.gpt_ckpt).parent)
        if tok is not None and tok.vocab_size != gpt.config.vocab_size:
            raise ValueError(f"the tokenizer ({args.vq_ckpt or 'named by the file'}) has {tok.vocab_size} codes but "
                             f"--gpt-ckpt {args.gpt_ckpt} predicts {gpt.config.vocab_size} token ids: give the "
                             "tokenizer the GPT was trained with")
        return gpt, tok, Path(args.gpt_ckpt).name, 4.0
    name = args.model or DEFAULT_MODEL
    gpt, tok = load_model(name)
    return gpt, tok, name, BUNDLES[name].cfg_scale
