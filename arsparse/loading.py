"""Build models from local checkpoints: LlamaGen's ``.pt`` files or our ``.safetensors``.

A safetensors file written by arsparse carries its architecture in the header (``arsparse.gpt`` /
``arsparse.vq``: JSON of the config), so it loads with no further arguments. A LlamaGen ``.pt``
holds weights only: the size comes from the preset (or is inferred from the weight shapes) and
the image grid from ``image_tokens``.
"""
from __future__ import annotations

import json
import warnings
from dataclasses import asdict
from pathlib import Path

import torch

from .checkpoint import CheckpointError, load_into, read_state_dict
from .models.config import DROPOUT_FIELDS, GPT_PRESETS, GPTConfig, gpt_config
from .models.gpt import GPT
from .models.vq import VQ_PRESETS, VQConfig, VQModel, vq_config
from .tokenizers import VQTokenizer

GPT_META, VQ_META, TOKENIZER_META = "arsparse.gpt", "arsparse.vq", "arsparse.tokenizer"


def read_metadata(path) -> dict[str, str]:
    """Header metadata of a safetensors file ({} for other formats)."""
    p = Path(path)
    if p.suffix.lower() != ".safetensors" or not p.is_file():
        return {}
    from safetensors import safe_open

    with safe_open(str(p), framework="pt") as f:
        return dict(f.metadata() or {})


def config_metadata(config) -> dict[str, str]:
    """Metadata entry that lets :func:`load_gpt` / :func:`load_vq` rebuild ``config``.

    A GPT's dropouts are written only when non-zero, so a file without dropout has the header it had
    before they existed (and loads in versions that do not know them).
    """
    if isinstance(config, GPTConfig):
        d = {k: v for k, v in asdict(config).items() if not (k in DROPOUT_FIELDS and v == 0)}
        return {GPT_META: json.dumps(d)}
    return {VQ_META: json.dumps(asdict(config))}


def _check_header_agrees(path, cfg, name: str, value, asked: dict) -> None:
    """The config in a file's header wins over the caller's arguments, so argument ``name`` (= ``value``),
    which asks for the config fields ``asked``, must agree with it: a CheckpointError naming both otherwise."""
    if all(getattr(cfg, k) == v for k, v in asked.items()):
        return
    implied = "" if list(asked) == [name] else " (" + ", ".join(f"{k}={v!r}" for k, v in asked.items()) + ")"
    have = ", ".join(f"{k}={getattr(cfg, k)!r}" for k in asked)
    raise CheckpointError(f"{name}={value!r}{implied} disagrees with the config in the header of {path} ({have}): "
                          f"leave {name} out (the header describes the model) or load a file that holds that model")


def device_dtype(device, dtype=torch.float32) -> tuple[torch.device, torch.dtype]:
    """``device`` and ``dtype`` in the spellings the command line takes (cpu, cuda, cuda:N; fp32, bf16, fp16,
    or torch's own), with a clear error for others; ``dtype`` None is fp32."""
    from .engine.generator import resolve_device, resolve_dtype

    device = resolve_device(device)
    dtype = torch.float32 if dtype is None else resolve_dtype(dtype, device)
    if not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point type (fp32, bf16 or fp16), got {dtype}")
    return device, dtype


def _infer_gpt_config(sd: dict, preset: str | None, image_tokens: int | None, model_type: str | None) -> GPTConfig:
    if "tok_embeddings.weight" not in sd:
        raise CheckpointError("not a LlamaGen GPT checkpoint: it has no 'tok_embeddings.weight' "
                              f"(first keys: {sorted(sd)[:5]})")
    vocab, dim = sd["tok_embeddings.weight"].shape
    n_layer = len({k.split(".")[1] for k in sd if k.startswith("layers.")})
    inferred_type = "t2i" if any(k.startswith("cls_embedding.cap_proj") for k in sd) else "c2i"
    if model_type is not None and model_type != inferred_type:
        raise CheckpointError(f"model_type={model_type!r} was asked for, but the checkpoint holds a {inferred_type} model")
    if preset is None:
        matches = [n for n, p in GPT_PRESETS.items() if p["dim"] == dim and p["n_layer"] == n_layer]
        if not matches:
            raise CheckpointError(f"no preset has dim={dim} and {n_layer} layers; pass preset= "
                                  f"(one of {', '.join(GPT_PRESETS)})")
        preset = matches[0]
    if image_tokens is None:
        image_tokens = 256
        warnings.warn("image_tokens not given and not stored in the checkpoint: assuming 256 (a 16x16 grid, "
                      "LlamaGen at 256 px with VQ-16); pass image_tokens=576 for its 384 px models", stacklevel=3)
    kw = dict(vocab_size=vocab)
    if inferred_type == "c2i":
        rows = sd["cls_embedding.embedding_table.weight"].shape[0] if "cls_embedding.embedding_table.weight" in sd else 1001
        kw["num_classes"] = rows - 1  # the extra row is the null class of guidance
    else:
        if "cls_embedding.uncond_embedding" in sd:
            kw["cls_token_num"], kw["caption_dim"] = sd["cls_embedding.uncond_embedding"].shape
    return gpt_config(preset, image_tokens=image_tokens, model_type=inferred_type, **kw)


def load_gpt(path, preset: str | None = None, image_tokens: int | None = None, model_type: str | None = None,
             key: str | None = None, device="cpu", dtype: torch.dtype = torch.float32) -> GPT:
    """Load a GPT from a local checkpoint, strictly.

    Parameters
    ----------
    path : str or Path
        ``.pt``/``.pth`` in any LlamaGen layout, or ``.safetensors``.
    preset : str, optional
        ``"GPT-B"`` ... ``"GPT-7B"``; inferred from the weight shapes when omitted.
    image_tokens : int, optional
        Tokens per image (256 for 256 px, 576 for 384 px with VQ-16); read from arsparse
        safetensors metadata when present.
    model_type : {"c2i", "t2i"}, optional
        Checked against the weights (which tell the two apart).
    key : str, optional
        Sub-dictionary of a ``.pt`` to load, e.g. ``"ema"``.
    device, dtype
        ``cpu``, ``cuda`` or ``cuda:N``; ``fp32``, ``bf16``, ``fp16`` or a ``torch.dtype``.

    A file with a config header (arsparse's safetensors) needs none of ``preset``, ``image_tokens``
    and ``model_type``; any given must agree with the header.
    """
    device, dtype = device_dtype(device, dtype)
    sd = read_state_dict(path, key=key)
    meta = read_metadata(path)
    if GPT_META in meta:
        cfg = GPTConfig(**json.loads(meta[GPT_META]))
        if image_tokens is not None and image_tokens != cfg.image_tokens:
            raise CheckpointError(f"{path} was trained for {cfg.image_tokens} image tokens, not {image_tokens}")
        if preset is not None:
            asked = gpt_config(preset)  # (an unknown preset: a ValueError naming the known ones)
            _check_header_agrees(path, cfg, "preset", preset, {k: getattr(asked, k) for k in GPT_PRESETS[preset]})
        if model_type is not None:
            _check_header_agrees(path, cfg, "model_type", model_type, {"model_type": model_type})
    else:
        cfg = _infer_gpt_config(sd, preset, image_tokens, model_type)
    model = GPT(cfg)
    load_into(model, sd, what=f"GPT ({path})")
    return model.to(device=device, dtype=dtype).eval()


def load_vq(path, preset: str | None = None, key: str | None = None, device="cpu", **overrides) -> VQTokenizer:
    """Load a LlamaGen VQ tokenizer (VQ-16 or VQ-8) from a local checkpoint, strictly.

    ``preset`` (default ``"VQ-16"``) and ``overrides`` (:class:`VQConfig` fields) size a weights-only
    file; a file with a config header (arsparse's safetensors) needs neither, and any given must agree
    with the header. ``device``: ``cpu``, ``cuda`` or ``cuda:N``.
    """
    device, _ = device_dtype(device)
    sd = read_state_dict(path, key=key)
    meta = read_metadata(path)
    if VQ_META in meta:
        cfg = VQConfig(**json.loads(meta[VQ_META]))
        asked = vq_config(preset or "VQ-16", **overrides)  # (unknown names: a ValueError naming the known ones)
        if preset is not None:
            _check_header_agrees(path, cfg, "preset", preset, {k: getattr(asked, k) for k in VQ_PRESETS[preset]})
        for name in overrides:
            keys = ("encoder_ch_mult", "decoder_ch_mult") if name == "ch_mult" else (name,)
            _check_header_agrees(path, cfg, name, overrides[name], {k: getattr(asked, k) for k in keys})
    else:
        if "quantize.embedding.weight" in sd:
            n, d = sd["quantize.embedding.weight"].shape
            overrides = {"codebook_size": n, "codebook_embed_dim": d, **overrides}
        cfg = vq_config(preset or "VQ-16", **overrides)
    model = VQModel(cfg)
    load_into(model, sd, what=f"VQ ({path})")
    return VQTokenizer(model.to(device).eval())
