"""Time LlamaGen's own public sampler from a local checkout, on the same GPU as ``arsparse bench``.

arsparse does not ship LlamaGen's code: point ``--llamagen-src`` at a checkout (the folder that
holds ``autoregressive/models/gpt.py`` and ``generate.py``). The model gets random weights of the
same preset; the sampler runs as published (eager, its own KV cache and masked attention).
"""
from __future__ import annotations

import importlib
import sys
import time
from pathlib import Path

import torch


def _import_llamagen(src: str):
    root = Path(src).expanduser().resolve()
    for f in ("autoregressive/models/gpt.py", "autoregressive/models/generate.py"):
        if not (root / f).is_file():
            raise ValueError(f"--llamagen-src {src!r} has no {f}: point it at a LlamaGen checkout")
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    return (importlib.import_module("autoregressive.models.gpt"),
            importlib.import_module("autoregressive.models.generate"))


def _sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


@torch.no_grad()
def time_llamagen(src: str, preset: str, image_tokens: int, batch: int, cfg_scale: float = 4.0,
                  dtype=torch.bfloat16, device="cuda", num_classes: int = 1000) -> dict:
    """Images/s of LlamaGen's ``generate`` for ``batch`` class-conditional images (top-k/top-p off)."""
    gpt_mod, gen_mod = _import_llamagen(src)
    if preset not in gpt_mod.GPT_models:
        raise ValueError(f"LlamaGen has no preset {preset!r}; it has {sorted(gpt_mod.GPT_models)}")
    with torch.device(device):
        model = gpt_mod.GPT_models[preset](vocab_size=16384, block_size=image_tokens, num_classes=num_classes,
                                           cls_token_num=1, model_type="c2i")
    model = model.to(dtype).eval()
    with torch.no_grad():  # its init zeroes the output layer; random logits keep sampling honest
        model.output.weight.normal_(0.0, 0.02)
    cond = torch.arange(batch, device=device) % num_classes
    kw = dict(cfg_scale=cfg_scale, temperature=1.0, top_k=0, top_p=1.0, sample_logits=True)
    gen_mod.generate(model, cond, 16, **kw)  # warm-up (allocator, cuBLAS handles)
    _sync(device)
    t0 = time.perf_counter()
    tokens = gen_mod.generate(model, cond, image_tokens, **kw)
    _sync(device)
    seconds = time.perf_counter() - t0
    if tuple(tokens.shape) != (batch, image_tokens):
        raise RuntimeError(f"LlamaGen returned tokens of shape {tuple(tokens.shape)}")
    del model
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return dict(sampler="llamagen-public", preset=preset, tokens=image_tokens, batch=batch, seconds=seconds,
                images_per_s=batch / seconds, ms_per_step=seconds / image_tokens * 1e3)
