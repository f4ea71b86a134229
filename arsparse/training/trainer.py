"""A small, honest trainer for the GPT on token data sets.

One validated :class:`TrainConfig`; :func:`train_gpt` trains with AdamW, linear warm-up then a
cosine decay, label dropout to the null class (so the model supports classifier-free guidance,
as LlamaGen's, which drops 10 % of labels), bf16 autocast on CUDA, and a resumable checkpoint
written every ``ckpt_every`` steps and whenever ``time_limit_s`` is about to run out, so a run
can be split into short commands (10 minutes each on the lent GPU) that resume each other.

Everything random in a step (the batch, the dropped labels, the flips) is drawn from a
generator seeded by ``(seed, step)``, so a resumed run sees exactly the batches of a straight
one, and on the CPU reaches exactly the same weights.

Files under ``out_dir``::

    ckpt.pt           model, optimiser, step, RNG states, config, loss history (resume from it)
    train_log.json    config, model size, train/val loss history (bits per token), timings
    model.safetensors the final weights, with the architecture in the header: load it with
                      ``arsparse.load_gpt(path)`` and no other argument
    best.safetensors  (with held-out data) the weights of the evaluation with the lowest held-out
                      loss so far, written when it improves; same format, ``"selected": "best"``
                      in its ``arsparse.train`` header entry

Sparse-aware training (``sparse_policy``, usually with ``init_from``: fine-tuning a trained model):
the loss is ``(1 - sparse_weight)`` x the dense cross-entropy plus ``sparse_weight`` x the
cross-entropy with attention restricted to an offset policy's read sets (the masks its ring cache
reads at decode time), so the model learns to put what it needs where that policy reads. Held-out
losses are then reported both ways and the best weights are those of the lowest weighted sum.
``sparse_mix="split"`` computes the same mix at the cost of one forward pass instead of two: the
first ``round(sparse_weight x batch_size)`` rows of each batch are trained under the policy and the
rest dense (the shares are then those row counts).
With ``sparse_loss="distill"`` the sparse share is instead on-policy distillation: a KL divergence
between the dense ``init_from`` weights' and the policy's guided next-token distributions on
sequences the current weights sample under the policy (:mod:`arsparse.training.distill`); the dense
share stays cross-entropy on the data. (Its pool is sampled afresh after a resume, so a resumed
distillation run is not bit-identical to a straight one.)

Regularisation: LlamaGen's dropouts (``token_dropout_p``, ``attn_dropout_p``, ``resid_dropout_p``,
``ffn_dropout_p``, ``drop_path_rate``; see :class:`~arsparse.models.config.GPTConfig`), drawn from
the global torch RNG, whose state the checkpoint keeps, so resuming stays exact.
"""
from __future__ import annotations

import hashlib
import json
import math
import os
import time
import warnings
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..checkpoint import load_into, read_state_dict, save_safetensors
from ..loading import config_metadata, read_metadata
from ..models.config import DROPOUT_FIELDS, GPT_PRESETS, GPTConfig, gpt_config
from ..models.gpt import GPT
from .distill import DIVERGENCES
from .loop import (CKPT_NAME, LOG_NAME, TrainLoop, atomic_torch_save, lr_at, recipe_warmup, run_device, start_clock,
                   write_json)

__all__ = [
    "BEST_NAME",
    "CKPT_NAME",
    "LOG_NAME",
    "MODEL_NAME",
    "RECIPES",
    "TrainConfig",
    "TrainResult",
    "export_model",
    "load_checkpoint",
    "lr_at",
    "make_batch",
    "portable_checkpoint",
    "read_train_meta",
    "recipe_config",
    "train_gpt",
]

MODEL_NAME, BEST_NAME = "model.safetensors", "best.safetensors"
TRAIN_META = "arsparse.train"
CKPT_FORMAT = "arsparse-train/1"
LN2 = math.log(2.0)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
SPARSE_LOSSES = ("data", "distill")
SPARSE_MIXES = ("sum", "split")


@dataclass
class RunConfig:
    """The optimisation and run-control fields every trainer config shares (GPT and VQ).

    ``out_dir``; ``steps``, ``batch_size``, ``lr``, ``min_lr_ratio``, ``warmup``, ``weight_decay``,
    ``betas``, ``grad_clip`` (see :class:`TrainConfig`); ``hflip``; ``bf16`` autocast (``None``: on
    for CUDA); ``compile``, ``seed``, ``ckpt_every`` / ``eval_every`` / ``log_every``,
    ``eval_samples``, ``time_limit_s``, ``device``, ``export_dtype``, ``progress``, ``dataset``.
    Subclasses call :meth:`check_run_fields` from their ``__post_init__``.
    """

    out_dir: str
    steps: int = 1000
    batch_size: int = 64
    lr: float = 3e-4
    min_lr_ratio: float = 0.1
    warmup: int = 100
    weight_decay: float = 0.0
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = 1.0
    hflip: bool = False
    bf16: bool | None = None
    compile: bool = False
    seed: int = 0
    ckpt_every: int = 1000
    eval_every: int = 500
    log_every: int = 50
    eval_samples: int | None = None
    time_limit_s: float | None = None
    device: str = "cpu"
    export_dtype: str = "bf16"
    progress: bool = True
    dataset: str | None = None

    def check_run_fields(self, bad) -> None:
        """Validate the fields above (``bad(msg)`` raises); ``out_dir`` becomes a string, ``betas`` a tuple."""
        if not isinstance(self.out_dir, (str, os.PathLike)) or not str(self.out_dir):
            bad(f"out_dir must be a path, got {self.out_dir!r}")
        self.out_dir = str(self.out_dir)
        for f in ("steps", "batch_size", "ckpt_every", "eval_every", "log_every"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(f"{f} must be a positive int, got {v!r}")
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or not 0 <= self.warmup <= self.steps:
            bad(f"warmup must be an int in [0, steps={self.steps}], got {self.warmup!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            bad(f"lr must be a positive number, got {self.lr!r}")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            bad(f"min_lr_ratio must be in [0, 1], got {self.min_lr_ratio!r}")
        if not 0.0 <= self.weight_decay < 1.0:
            bad(f"weight_decay must be in [0, 1), got {self.weight_decay!r}")
        self.betas = tuple(float(b) for b in self.betas)
        if len(self.betas) != 2 or not all(0.0 <= b < 1.0 for b in self.betas):
            bad(f"betas must be two numbers in [0, 1), got {self.betas!r}")
        if not self.grad_clip >= 0.0:
            bad(f"grad_clip must be >= 0 (0 disables clipping), got {self.grad_clip!r}")
        if self.eval_samples is not None and (isinstance(self.eval_samples, bool) or
                                              not isinstance(self.eval_samples, int) or self.eval_samples < 1):
            bad(f"eval_samples must be a positive int or None, got {self.eval_samples!r}")
        if self.time_limit_s is not None and not self.time_limit_s > 0:
            bad(f"time_limit_s must be > 0 or None, got {self.time_limit_s!r}")
        if self.export_dtype not in _DTYPES:
            bad(f"export_dtype must be one of {sorted(_DTYPES)}, got {self.export_dtype!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool) or self.seed < 0:
            bad(f"seed must be a non-negative int, got {self.seed!r}")
        try:
            torch.device(self.device)
        except (RuntimeError, TypeError) as exc:
            bad(f"device {self.device!r} is not a torch device ({exc})")

    def use_bf16(self) -> bool:
        return torch.device(self.device).type == "cuda" if self.bf16 is None else bool(self.bf16)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["betas"] = list(self.betas)
        return d


@dataclass
class TrainConfig(RunConfig):
    """Everything that defines a training run.

    Model: ``preset`` (a name of :data:`arsparse.models.config.GPT_PRESETS`) with optional
    ``dim`` / ``n_layer`` / ``n_head`` / ``multiple_of`` overrides; ``vocab_size``,
    ``num_classes`` and the token grid come from the data set.

    Optimisation: AdamW (``betas``, ``weight_decay`` on matrices and embeddings only, as
    LlamaGen), learning rate ``lr`` reached linearly over ``warmup`` steps, then a cosine decay
    to ``lr * min_lr_ratio`` at ``steps``; gradients clipped to norm ``grad_clip`` (0: off).

    ``class_dropout_prob``: probability that a training label is replaced by the null class
    (id ``num_classes``), which the model then learns as the unconditional input of
    classifier-free guidance. ``token_dropout_p``, ``attn_dropout_p``, ``resid_dropout_p``,
    ``ffn_dropout_p``, ``drop_path_rate``: LlamaGen's dropouts (0: off; LlamaGen trains with 0.1 on
    tokens, residual and FFN); they act in training only, and the exported files carry them as 0.
    ``hflip``: flip the token grid left to right for a random half of
    each batch; only meaningful when one token is one pixel (palette tokenizers), where it
    equals flipping the image before tokenising.

    Run control: ``bf16`` autocast (``None``: on for CUDA, off elsewhere), ``compile``
    (``torch.compile`` the loss; off by default), ``seed``, ``ckpt_every`` / ``eval_every`` /
    ``log_every`` in steps, ``eval_samples`` validation images per evaluation (``None``: all),
    ``time_limit_s`` (stop, checkpointed, before this many seconds have passed since
    :func:`train_gpt` started; ``None``: no limit), ``out_dir``.

    ``tokenizer``: JSON-able description of the tokenizer that made the tokens (e.g.
    ``PaletteTokenizer.config()``); stored in the exported header. ``dataset``: a name, logged.
    """

    preset: str = "GPT-tiny"
    dim: int | None = None
    n_layer: int | None = None
    n_head: int | None = None
    multiple_of: int | None = None
    vocab_size: int = 256
    num_classes: int = 10
    grid_h: int = 28
    grid_w: int = 28
    weight_decay: float = 0.05  # (RunConfig: 0)
    class_dropout_prob: float = 0.1
    token_dropout_p: float = 0.0
    attn_dropout_p: float = 0.0
    resid_dropout_p: float = 0.0
    ffn_dropout_p: float = 0.0
    drop_path_rate: float = 0.0
    tokenizer: dict | None = None
    init_from: str | None = None  #: weights of the same architecture to start from (fine-tuning)
    sparse_policy: str | None = None  #: an offset policy, e.g. "diagonal": sparse-aware training
    sparse_weight: float = 0.5  #: its share of the loss (with sparse_policy)
    #: the sparse share's loss: "data" (cross-entropy on the training images) or "distill" (on-policy
    #: distillation from the dense init_from weights: :mod:`arsparse.training.distill`)
    sparse_loss: str = "data"
    #: how the two shares mix: "sum" (every row both ways, two forward passes) or "split" (each row one way:
    #: the batch's first round(sparse_weight x batch_size) rows under the policy, the rest dense; one pass)
    sparse_mix: str = "sum"
    distill_pool: int = 1024  #: sequences sampled per refresh of the distillation pool
    distill_cfg_scale: float = 2.0  #: the guidance the pool is sampled with (and the compared distributions use)
    distill_divergence: str = "reverse"  #: KL(student || teacher) ("reverse") or KL(teacher || student)

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"TrainConfig: {msg}")

        self.check_run_fields(bad)
        if self.preset not in GPT_PRESETS:
            bad(f"unknown preset {self.preset!r}; choose one of {', '.join(GPT_PRESETS)}")
        for f in ("dim", "n_layer", "n_head", "multiple_of"):
            v = getattr(self, f)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                bad(f"{f} must be a positive int or None, got {v!r}")
        for f in ("vocab_size", "num_classes", "grid_h", "grid_w"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(f"{f} must be a positive int, got {v!r}")
        if not 0.0 <= self.class_dropout_prob < 1.0:
            bad(f"class_dropout_prob must be in [0, 1), got {self.class_dropout_prob!r}")
        if not (isinstance(self.sparse_weight, (int, float)) and 0.0 < self.sparse_weight <= 1.0):
            bad(f"sparse_weight must be in (0, 1], got {self.sparse_weight!r}")
        if self.sparse_policy is not None:
            try:
                sparse_policy(self.sparse_policy)
            except ValueError as exc:
                bad(str(exc))
        if self.sparse_loss not in SPARSE_LOSSES:
            bad(f"sparse_loss must be one of {', '.join(SPARSE_LOSSES)}, got {self.sparse_loss!r}")
        if self.sparse_mix not in SPARSE_MIXES:
            bad(f"sparse_mix must be one of {', '.join(SPARSE_MIXES)}, got {self.sparse_mix!r}")
        if self.sparse_mix == "split" and self.sparse_policy is None:
            bad("sparse_mix 'split' needs sparse_policy (what the sparse rows read)")
        if self.sparse_mix == "split" and not 1 <= self.sparse_rows < self.batch_size + (self.sparse_weight == 1):
            bad(f"sparse_mix 'split' trains round(sparse_weight x batch_size) rows under the policy and the rest "
                f"dense: {self.sparse_weight} x {self.batch_size} leaves {self.sparse_rows} of {self.batch_size} rows; "
                f"choose a sparse_weight that gives each share at least one row (or 1: every row sparse)")
        if self.sparse_loss == "distill":
            if self.sparse_policy is None or self.init_from is None:
                bad("sparse_loss 'distill' needs sparse_policy (what the student reads) and init_from (the dense "
                    "teacher: the weights the run starts from)")
            if isinstance(self.distill_pool, bool) or not isinstance(self.distill_pool, int) \
                    or self.distill_pool < self.batch_size:
                bad(f"distill_pool must be an int >= batch_size ({self.batch_size}), got {self.distill_pool!r}")
            if not (isinstance(self.distill_cfg_scale, (int, float)) and self.distill_cfg_scale >= 1):
                bad(f"distill_cfg_scale must be >= 1 (1: no guidance), got {self.distill_cfg_scale!r}")
            if self.distill_divergence not in DIVERGENCES:
                bad(f"distill_divergence must be one of {', '.join(DIVERGENCES)}, got {self.distill_divergence!r}")
        self.gpt_config()  # architecture errors surface now, not after the data is loaded

    def gpt_config(self) -> GPTConfig:
        """The architecture this config trains."""
        over = {k: getattr(self, k) for k in ("dim", "n_layer", "n_head", "multiple_of") if getattr(self, k) is not None}
        try:
            return gpt_config(self.preset, model_type="c2i", vocab_size=self.vocab_size, num_classes=self.num_classes,
                              class_dropout_prob=self.class_dropout_prob, grid_h=self.grid_h, grid_w=self.grid_w,
                              **{f: getattr(self, f) for f in DROPOUT_FIELDS}, **over)
        except ValueError as exc:
            raise ValueError(f"TrainConfig: bad architecture: {exc}") from None

    @property
    def sparse_rows(self) -> int:
        """Rows of a batch trained under the policy (every row with sparse_mix "sum")."""
        return round(self.sparse_weight * self.batch_size) if self.sparse_mix == "split" else self.batch_size

    @property
    def sparse_share(self) -> float:
        """The sparse loss's share of the objective (train and held-out)."""
        return self.sparse_rows / self.batch_size if self.sparse_mix == "split" else self.sparse_weight

    @property
    def image_tokens(self) -> int:
        return self.grid_h * self.grid_w

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"TrainConfig: unknown fields {sorted(unknown)}")
        return cls(**d)


#: Named training recipes: a model size and the hyperparameters that go with a data set.
#: ``recipe_config(name, out_dir, **overrides)`` turns one into a :class:`TrainConfig`.
RECIPES: dict[str, dict[str, Any]] = {
    # Fashion-MNIST, class-conditional, one token per pixel (28 x 28 = 784 tokens), 32 grey levels.
    #
    # Size: LlamaGen architecture at dim 384, 10 layers, 6 heads (head_dim 64), FFN 1024:
    # 17.7 M parameters, 33.8 MiB as bf16 safetensors. It is ~2x GPT-small's depth and fits
    # the "small to ship" bound (<= ~40 MB); 12 layers would be 40.6 MiB.
    #
    # Palette: 32 levels, not 256. Fashion-MNIST is 50 % exact-black background and smooth
    # shading; a 32-way softmax sees each level 8x more often, so the model learns the
    # distribution of intensities with far fewer steps than a 256-way one, whose neighbouring
    # classes are nearly interchangeable; 8-grey-level steps (256 / 32) are hardly visible in
    # 28 x 28 clothing images. 256 levels (exact) is one flag away (--levels 256).
    #
    # Budget: 5000 steps of 128 images = 640 k images (~10.7 epochs of the 60 k training set):
    # 9.5 minutes on one H200 at the measured 1,122 images/s (bf16, no torch.compile). The
    # shipped model is this recipe (arsparse/weights/fashion-c2i.md); held-out loss was flat
    # from step 3000 on, so more steps would need more regularisation, not just more time.
    #
    # No horizontal flips by default: Fashion-MNIST's footwear all points one way (the mean
    # ankle boot has 2.5x more ink in its right half), so flipping changes the distribution.
    "fashion-c2i": dict(
        dataset="fashion", preset="GPT-small", dim=384, n_layer=10, n_head=6, multiple_of=64,
        vocab_size=32, num_classes=10, grid_h=28, grid_w=28,
        steps=5000, batch_size=128, lr=1e-3, min_lr_ratio=0.1, warmup=300, weight_decay=0.05,
        betas=(0.9, 0.95), grad_clip=1.0, class_dropout_prob=0.1, hflip=False,
        ckpt_every=1000, eval_every=1000, log_every=100, eval_samples=None,
        tokenizer={"type": "palette", "levels": 32},
    ),
    # Colour emoji, class-conditional on category x style (18 classes: arsparse.data.emoji), through
    # the emoji-vq tokenizer (arsparse.training.vq_trainer.VQ_RECIPES): 64 x 64 -> 32 x 32 = 1024
    # tokens, vocabulary 1024. The tokenizer entry is filled in at run time (the VQ file's name and
    # sha256), so the exported GPT names the exact VQ it was trained with.
    #
    # Size: fashion-c2i's architecture (dim 384, 10 layers, 6 heads, FFN 1024): 18.5 M parameters,
    # 37.0 MB as fp16 safetensors; with the VQ (7.6 MB) 44.6 MB.
    #
    # Data: the 6,768 training emoji plus a mirror image of the 5,870 that are not Symbols or
    # Flags (mirrored text, arrows and flags are wrong): 12,638 sequences, 12.9 M tokens; the
    # mirroring is done on the images before the VQ (a VQ token grid does not mirror).
    #
    # Measured without dropout (one H200, bf16, 863 sequences/s): the model overfits early. A
    # 3000-step run (30 epochs) reached 0.10 bits/token on the training rows while held-out rose
    # from 2.25 (step 1000) to 5.10; with the schedule on 1200 steps (12 epochs, 3.0 minutes)
    # held-out was best at step 800 (2.18) and 2.37 at the end, which was shipped (step 1200).
    #
    # This recipe: LlamaGen's dropouts at its defaults (0.1 on the input embeddings, the attention
    # output and the feed-forward output; none on attention weights, no stochastic depth) and 2000
    # steps of 128 = 256 k sequences (20 epochs), held-out evaluated every 100 steps and the best
    # evaluation's weights kept (best.safetensors, which `train export` ships). Measured (one H200,
    # 2026-11-30, 5.2 minutes, 841 sequences/s): held-out 2.011 at step 1400 (shipped), 2.048 at
    # step 2000; train 1.195 at the end.
    "emoji-c2i": dict(
        dataset="emoji", preset="GPT-small", dim=384, n_layer=10, n_head=6, multiple_of=64,
        vocab_size=1024, num_classes=18, grid_h=32, grid_w=32,
        steps=2000, batch_size=128, lr=1e-3, min_lr_ratio=0.1, warmup=300, weight_decay=0.05,
        betas=(0.9, 0.95), grad_clip=1.0, class_dropout_prob=0.1, hflip=False,
        token_dropout_p=0.1, resid_dropout_p=0.1, ffn_dropout_p=0.1,
        ckpt_every=1000, eval_every=100, log_every=100, eval_samples=None, export_dtype="fp16",
        tokenizer=None,
    ),
}


def sparse_policy(spec: str):
    """The offset policy ``spec`` names (``"diagonal"``, ``"streaming:recent=64"``): sparse-aware training
    needs read sets fixed by position (masks); scored policies evict by what the model attends to."""
    from ..policies import resolve
    from ..policies.offset import OffsetPolicy

    try:
        policy = resolve(spec)
    except ValueError as exc:
        raise ValueError(f"sparse_policy: {exc}") from None
    if not isinstance(policy, OffsetPolicy):
        raise ValueError(f"sparse_policy must be an offset policy (read sets fixed by position: diagonal, streaming, "
                         f"diagonal-adaptive), got {spec!r}")
    return policy


def recipe_config(name: str, out_dir: str, **overrides) -> TrainConfig:
    """A :class:`TrainConfig` from a named recipe plus overrides (``None`` values are ignored).

    A ``preset`` override other than the recipe's drops the recipe's ``dim`` / ``n_layer`` /
    ``n_head`` / ``multiple_of``, so the preset's own sizes apply (then any given overrides).
    Without a ``warmup`` override the recipe's is cut to a quarter of ``steps`` at most
    (:func:`~arsparse.training.loop.recipe_warmup`).
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; choose one of {', '.join(RECIPES)}")
    kw = dict(RECIPES[name])
    kw["tokenizer"] = dict(kw["tokenizer"]) if kw.get("tokenizer") else None
    if overrides.get("preset") is not None and overrides["preset"] != kw.get("preset"):
        for k in ("dim", "n_layer", "n_head", "multiple_of"):
            kw.pop(k, None)
    kw.update({k: v for k, v in overrides.items() if v is not None})
    recipe_warmup(kw, overrides)
    return TrainConfig(out_dir=out_dir, **kw)


@dataclass
class TrainResult:
    """What :func:`train_gpt` did.

    ``finished``: all ``steps`` are done (and ``model.safetensors`` is written); otherwise the
    run stopped at ``time_limit_s`` with a checkpoint to resume from.
    """

    step: int
    finished: bool
    out_dir: Path
    ckpt_path: Path
    model_path: Path | None
    final_val_bpt: float | None
    history: dict[str, list] = field(default_factory=dict)
    best_path: Path | None = None  #: ``best.safetensors`` (runs with held-out data)


# ---- pieces -------------------------------------------------------------------------------------

def _seed_of(*keys: int) -> int:
    return int(np.random.SeedSequence([int(k) for k in keys]).generate_state(1, np.uint64)[0] >> 1)


def batch_indices(seed: int, step: int, n: int, batch_size: int) -> torch.Tensor:
    """Rows of step ``step``: consecutive slices of a per-epoch permutation (last partial batch dropped)."""
    per_epoch = n // batch_size
    if per_epoch < 1:
        raise ValueError(f"batch_size {batch_size} is larger than the data set ({n} rows)")
    epoch, k = divmod(step, per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(_seed_of(seed, 0, epoch)))
    return perm[k * batch_size:(k + 1) * batch_size]


def make_batch(cfg: TrainConfig, step: int, tokens: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The training batch of update ``step``, a pure function of ``(cfg.seed, step)`` and the data.

    Rows come from :func:`batch_indices`; each label is replaced by the null class
    (``num_classes``) with probability ``class_dropout_prob``; with ``hflip`` each row's token
    grid is mirrored left to right with probability 1/2.

    Returns
    -------
    x : torch.Tensor
        ``(B, T)`` int64 tokens on ``tokens.device``.
    y : torch.Tensor
        ``(B,)`` int64 labels, ``num_classes`` where dropped.
    """
    dev = tokens.device
    g = torch.Generator().manual_seed(_seed_of(cfg.seed, 1, step))
    idx = batch_indices(cfg.seed, step, tokens.shape[0], cfg.batch_size).to(dev, non_blocking=True)
    drop = torch.rand(cfg.batch_size, generator=g) < cfg.class_dropout_prob
    x = tokens[idx].long()  # (B, T)
    y = torch.where(drop.to(dev, non_blocking=True), cfg.num_classes, labels[idx].long())  # (B,)
    if cfg.hflip:
        flip = (torch.rand(cfg.batch_size, generator=g) < 0.5).to(dev, non_blocking=True)
        grid = x.view(-1, cfg.grid_h, cfg.grid_w)
        x = torch.where(flip[:, None, None], grid.flip(-1), grid).reshape(x.shape)
    return x, y


def init_weights(model: GPT, seed: int) -> None:
    """LlamaGen's initialisation: linear and embedding weights N(0, 0.02), output layer zero."""
    g = torch.Generator().manual_seed(_seed_of(seed, 2))
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                m.weight.copy_(torch.randn(m.weight.shape, generator=g) * 0.02)
                if getattr(m, "bias", None) is not None:
                    m.bias.zero_()
        model.output.weight.zero_()


def _param_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    decay = [p for p in model.parameters() if p.requires_grad and p.dim() >= 2]
    other = [p for p in model.parameters() if p.requires_grad and p.dim() < 2]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": other, "weight_decay": 0.0}]


def _fingerprint(*tensors: torch.Tensor | None) -> str:
    h = hashlib.sha1()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        a = t.detach().cpu().contiguous()
        h.update(str((tuple(a.shape), str(a.dtype))).encode())
        h.update(a.numpy().tobytes())
    return h.hexdigest()


def _check_data(cfg: TrainConfig, tokens, labels, what: str) -> None:
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.is_floating_point():
        got = tuple(tokens.shape) if isinstance(tokens, torch.Tensor) else type(tokens).__name__
        raise ValueError(f"{what} tokens must be an integer (N, T) tensor, got {got}")
    if tokens.shape[1] != cfg.image_tokens:
        raise ValueError(f"{what} tokens have {tokens.shape[1]} columns; the config's grid "
                         f"{cfg.grid_h}x{cfg.grid_w} needs {cfg.image_tokens}")
    if not isinstance(labels, torch.Tensor) or labels.dim() != 1 or labels.shape[0] != tokens.shape[0]:
        got = tuple(labels.shape) if isinstance(labels, torch.Tensor) else type(labels).__name__
        raise ValueError(f"{what} labels must be a (N,) tensor with N={tokens.shape[0]}, got {got}")
    if labels.is_floating_point():
        raise ValueError(f"{what} labels must be integers, got {labels.dtype}")
    if tokens.numel() and (int(tokens.min()) < 0 or int(tokens.max()) >= cfg.vocab_size):
        raise ValueError(f"{what} token ids must be in [0, {cfg.vocab_size}), got "
                         f"[{int(tokens.min())}, {int(tokens.max())}]")
    if labels.numel() and (int(labels.min()) < 0 or int(labels.max()) >= cfg.num_classes):
        raise ValueError(f"{what} labels must be in [0, {cfg.num_classes}), got "
                         f"[{int(labels.min())}, {int(labels.max())}]")


def _compact(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return tokens.to(torch.uint8 if vocab <= 256 else torch.int32)


def load_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read a training checkpoint written by :func:`train_gpt` (on CPU, ``weights_only``)."""
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"training checkpoint not found: {p}")
    ckpt = torch.load(p, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != CKPT_FORMAT:
        raise ValueError(f"{p} is not an arsparse training checkpoint (format {CKPT_FORMAT!r})")
    return ckpt


def portable_checkpoint(src: str | os.PathLike, dst: str | os.PathLike, dtype: str = "fp16") -> Path:
    """A small copy of a training checkpoint that resumes on another machine: weights in ``dtype``, no optimiser.

    Everything else (step, config, history, RNG states, data fingerprint) is kept, so ``--resume``
    from it continues the schedule and the batches where the run stopped; only the AdamW moments
    start again from zero (and the weights were rounded to ``dtype``). Works for the checkpoints
    of :func:`train_gpt` and of :func:`arsparse.training.vq_trainer.train_vq`. Returns ``dst``.
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    ckpt = torch.load(Path(src), map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or "model" not in ckpt or "step" not in ckpt:
        raise ValueError(f"{src} is not an arsparse training checkpoint")
    ckpt["model"] = {k: (v.to(_DTYPES[dtype]) if v.is_floating_point() else v) for k, v in ckpt["model"].items()}
    ckpt["optimizer"] = None
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_torch_save(ckpt, out)
    return out


@torch.no_grad()
def evaluate(model: GPT, tokens: torch.Tensor, labels: torch.Tensor, batch_size: int, bf16: bool,
             backend=None) -> float:
    """Mean next-token negative log-likelihood in bits per token, with the true labels (``backend``:
    attention as it computes it, e.g. a policy's read sets)."""
    was_training = model.training
    model.eval()
    dev = model.tok_embeddings.weight.device
    total, count = torch.zeros((), dtype=torch.float64, device=dev), 0
    for i in range(0, tokens.shape[0], batch_size):
        x = tokens[i:i + batch_size].to(dev, torch.long)
        y = labels[i:i + batch_size].to(dev, torch.long)
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
            logits = model.logits(y, x, backend=backend)
        total += nn.functional.cross_entropy(logits.float().flatten(0, 1), x.flatten(), reduction="sum").double()
        count += x.numel()
    model.train(was_training)
    return float(total) / max(count, 1) / LN2


# ---- the loop -----------------------------------------------------------------------------------

def train_gpt(cfg: TrainConfig, tokens: torch.Tensor, labels: torch.Tensor,
              val_tokens: torch.Tensor | None = None, val_labels: torch.Tensor | None = None,
              *, resume: bool = True, stop_after: int | None = None,
              started_at: float | None = None) -> TrainResult:
    """Train (or resume training) a class-conditional GPT on token sequences.

    Parameters
    ----------
    cfg : TrainConfig
    tokens : torch.Tensor
        ``(N, T)`` integer token ids in ``[0, vocab_size)``, ``T = grid_h * grid_w``, raster order.
    labels : torch.Tensor
        ``(N,)`` class ids in ``[0, num_classes)``.
    val_tokens, val_labels : torch.Tensor, optional
        Held-out data, evaluated every ``eval_every`` steps and at the end (bits per token). Each
        evaluation that beats the best so far writes its weights to ``best.safetensors``
        (``history["best"]`` records its step and loss, and survives a resume).
    resume : bool
        Continue from ``out_dir/ckpt.pt`` when it exists (it must come from the same
        config and data). ``False`` refuses to overwrite an existing checkpoint.
    stop_after : int, optional
        Stop (with a checkpoint) after this many steps in this call, as the time limit does.
    started_at : float, optional
        ``time.monotonic()`` from which ``time_limit_s`` counts (a CLI passes its own start, so
        that loading the data counts too); default: when this function is called.

    Returns
    -------
    TrainResult
    """
    t_start = start_clock(started_at, stop_after)
    _check_data(cfg, tokens, labels, "training")
    if (val_tokens is None) != (val_labels is None):
        raise ValueError("give both val_tokens and val_labels, or neither")
    if val_tokens is not None:
        _check_data(cfg, val_tokens, val_labels, "validation")
        if cfg.eval_samples is not None:
            val_tokens, val_labels = val_tokens[:cfg.eval_samples], val_labels[:cfg.eval_samples]
    n = tokens.shape[0]
    if n < cfg.batch_size:
        raise ValueError(f"batch_size {cfg.batch_size} is larger than the training set ({n} rows)")

    device = run_device(cfg)
    bf16 = cfg.use_bf16()
    data_id = _fingerprint(_compact(tokens, cfg.vocab_size), labels,
                           None if val_tokens is None else _compact(val_tokens, cfg.vocab_size), val_labels)

    gcfg = cfg.gpt_config()
    torch.manual_seed(cfg.seed)
    model = GPT(gcfg)
    init_weights(model, cfg.seed)
    model.to(device).train()
    opt = torch.optim.AdamW(_param_groups(model, cfg.weight_decay), lr=cfg.lr, betas=cfg.betas,
                            **({"fused": True} if device.type == "cuda" else {}))
    loop = TrainLoop(cfg, model, opt, t_start=t_start, stop_after=stop_after, fmt=CKPT_FORMAT, data_id=data_id,
                     arch=("gpt_config", asdict(gcfg)), history={"train": [], "val": []})
    loop.resume(resume, load_checkpoint, same="data set and tokenizer")
    if cfg.init_from is not None and loop.step == 0:  # fine-tuning: a fresh run starts from these weights
        if not Path(cfg.init_from).is_file():
            raise FileNotFoundError(f"init_from: no weights file at {cfg.init_from}")
        load_into(model, read_state_dict(cfg.init_from), what=f"init_from ({cfg.init_from}) for this architecture")
    backend = None  # sparse-aware training: attention restricted to the policy's read sets, built once (a
    if cfg.sparse_policy is not None:  # calibrated policy calibrates on the weights this call starts from)
        backend = sparse_policy(cfg.sparse_policy).prepare(model).attention_backend(
            model, gcfg.cls_token_num + cfg.image_tokens - 1, device)
    distiller = None
    if cfg.sparse_loss == "distill":  # (the teacher: the init_from weights, also when resuming)
        from .distill import OnPolicyDistiller

        distiller = OnPolicyDistiller(model, read_state_dict(cfg.init_from), cfg.sparse_policy, cfg.distill_pool,
                                      cfg.batch_size, cfg.distill_cfg_scale, device, cfg.seed, cfg.distill_divergence)
    out = Path(cfg.out_dir)
    best_path = out / BEST_NAME

    def save_best(bpt: float) -> None:
        since = loop.history.get("best_since", 0)
        row = next((e for e in reversed(loop.history["val"]) if e["step"] == loop.step), {"val_bpt": bpt})
        row = {k: v for k, v in row.items() if k != "time_s"} | {"step": loop.step}  # (sparse-aware: both losses)
        _write_weights(model.state_dict(), gcfg, cfg.to_dict(), loop.step, best_path, _DTYPES[cfg.export_dtype],
                       val=[row],
                       extra={"selected": "best", **({"best_since": since} if since else {})})
        loop.history["best"] = {"step": loop.step, "val_bpt": bpt}

    _reconcile_best(loop, best_path, save_best)

    if loop.step == 0:
        size_mb = loop.num_params * _DTYPES[cfg.export_dtype].itemsize / 1e6
        loop.log(f"training {gcfg.n_layer} layers x dim {gcfg.dim} ({loop.num_params / 1e6:.2f} M parameters, "
                 f"{size_mb:.1f} MB as {cfg.export_dtype}), vocab {gcfg.vocab_size}, {gcfg.grid_h}x{gcfg.grid_w} "
                 f"tokens, {n} training rows, {cfg.steps} steps of {cfg.batch_size} on {device}"
                 f"{' (bf16 autocast)' if bf16 else ''}")

    dev_tokens = _compact(tokens, cfg.vocab_size).to(device)
    dev_labels = labels.to(device, torch.long)
    loss_fn = torch.compile(model.loss) if cfg.compile else model.loss
    window_loss = torch.zeros((), device=device)
    window_kl = torch.zeros((), device=device)  # (distillation: the KL part alone)

    def train_step(step: int) -> None:
        x, y = make_batch(cfg, step, dev_tokens, dev_labels)  # (B, T), (B,)
        if distiller is not None:
            xs, ys = distiller.batch_at(model, step)  # sampled under the policy: (B, T), (B,)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=bf16):
            if backend is None:
                loss = loss_fn(y, x)
            else:
                w, n = cfg.sparse_share, cfg.sparse_rows  # (split: rows [:n] sparse, the rest dense)
                if distiller is None:
                    sparse = loss_fn(y[:n], x[:n], backend=backend)
                else:
                    sparse = distiller.loss(model, xs[:n], ys[:n], backend)
                    window_kl.add_(sparse.detach().float())
                loss = w * sparse
                if w < 1:
                    rest = slice(n, None) if cfg.sparse_mix == "split" else slice(None)
                    loss = loss + (1 - w) * loss_fn(y[rest], x[rest])
        loop.update(loss)
        window_loss.add_(loss.detach().float())

    def window(n: int) -> tuple[dict, dict, str]:
        bpt = float(window_loss) / n / LN2
        window_loss.zero_()
        if distiller is None:
            return {"train_bpt": bpt}, {"bpt": f"{bpt:.4f}"}, f"train {bpt:.4f} bits/token"
        kl = float(window_kl) / n
        window_kl.zero_()
        return ({"train_bpt": bpt, "distill_kl_nats": kl}, {"kl": f"{kl:.4f}"},
                f"train: loss {bpt:.4f} bits, {cfg.distill_divergence} KL to dense on {cfg.sparse_policy}'s samples "
                f"{kl:.4f} nats/token")

    def run_eval() -> float:
        """The held-out loss the best weights are chosen by (sparse-aware: the training objective's mix)."""
        t0 = time.monotonic()
        bpt = dense = evaluate(model, val_tokens, val_labels, cfg.batch_size * 2, bf16)
        entry = {"step": loop.step, "val_bpt": dense}
        if backend is not None:
            entry["val_bpt_sparse"] = sparse = evaluate(model, val_tokens, val_labels, cfg.batch_size * 2, bf16, backend)
            entry["val_objective"] = bpt = (1 - cfg.sparse_share) * dense + cfg.sparse_share * sparse
            loop.log(f"step {loop.step}: val {dense:.4f} bits/token dense, {sparse:.4f} under {cfg.sparse_policy} "
                     f"({100 * (sparse / dense - 1):+.1f} %)")
        loop.history["val"].append(dict(entry, time_s=round(loop.train_time, 2)))
        best = loop.history.get("best")
        if best is None or bpt < best["val_bpt"]:
            save_best(bpt)
            note = f"best so far -> {best_path.name}"
        else:
            note = f"best {best['val_bpt']:.4f} at step {best['step']}"
        what = "val" if backend is None else "objective"  # (sparse-aware: the mix the best weights are chosen by)
        loop.log(f"step {loop.step}: {what} {bpt:.4f} bits/token ({note}; {time.monotonic() - t0:.1f} s)")
        return bpt

    def best_or_none() -> Path | None:
        return best_path if loop.history.get("best") else None

    has_val = val_tokens is not None
    if not loop.run(train_step, window, run_eval if has_val else None, desc="train"):
        return TrainResult(loop.step, False, out, loop.ckpt_path, None, None, loop.history, best_or_none())

    val = loop.history["val"]
    if has_val and not (val and val[-1]["step"] == loop.step):  # (else a finished run, resumed again)
        run_eval()
    final = val[-1]["val_bpt"] if has_val else None  # dense, also after sparse-aware training
    loop.save("finished")
    model_path = export_model(loop.ckpt_path, out / MODEL_NAME, dtype=cfg.export_dtype)
    record = loop.record(finished=True)
    record["final_val_bpt"] = final
    write_json(record, loop.log_path)
    best = loop.history.get("best")
    loop.log(f"done: {loop.step} steps in {loop.train_time / 60:.1f} min of training; "
             f"{'final val %.4f bits/token; ' % final if final is not None else ''}model -> {model_path}"
             + (f"; best {'objective' if backend is not None else 'val'} {best['val_bpt']:.4f} at step {best['step']} "
                f"-> {best_path}" if best else ""))
    return TrainResult(loop.step, True, out, loop.ckpt_path, model_path, final, loop.history, best_or_none())


def read_train_meta(path: str | os.PathLike) -> dict | None:
    """The ``arsparse.train`` header entry of an exported GPT (step, steps, val, selected, ...), or ``None``."""
    meta = read_metadata(path)
    return json.loads(meta[TRAIN_META]) if TRAIN_META in meta else None


def _reconcile_best(loop: TrainLoop, best_path: Path, save_best) -> None:
    """Make ``best.safetensors`` agree with the resumed ``history["best"]`` before training goes on.

    A file that is not the recorded best (left by another run in this folder, or written after the
    checkpoint by a run that was then killed) is removed. A recorded best whose file is missing (a
    checkpoint carried to another machine without it) is rewritten when the weights at hand are those
    of its step; otherwise its weights are lost: selection starts again from this step, and
    ``history["best_since"]`` says so (the model card repeats it).
    """
    best = loop.history.get("best")
    on_disk = read_train_meta(best_path) if best_path.is_file() else None
    if best is not None and on_disk is not None and on_disk.get("selected") == "best" \
            and on_disk.get("step") == best["step"]:
        return
    if best_path.is_file():
        best_path.unlink()
    if best is None:
        return
    if best["step"] == loop.step:
        save_best(best["val_bpt"])
        return
    warnings.warn(f"{best_path} (the best held-out, {best['val_bpt']:.4f} bits/token at step {best['step']}) is "
                  f"missing or is not that step's: its weights are lost, and best-checkpoint selection starts "
                  f"again at step {loop.step}; carry best.safetensors with ckpt.pt to keep it", stacklevel=3)
    loop.history["best"] = None
    loop.history["best_since"] = loop.step


def _write_weights(state_dict: dict, gcfg: GPTConfig, cfg: dict, step: int, out: Path, dtype: torch.dtype, *,
                   val: list[dict], extra: dict | None = None) -> Path:
    """Weights as a self-describing ``.safetensors``: the inference architecture (dropouts 0) and the training
    summary (``arsparse.train``: step, steps, dataset, seed, ``val`` rows, the training dropouts if any, and
    ``extra``: ``{"selected": "best", "best_since": step}`` for a best checkpoint; nothing for the last,
    whose header is then what it was before best-checkpoint selection existed)."""
    sd = {k: (v.detach().to(dtype) if v.is_floating_point() else v) for k, v in state_dict.items()}
    meta = config_metadata(gcfg.without_dropout())
    train = {"step": step, "steps": cfg["steps"], "dataset": cfg.get("dataset"), "seed": cfg["seed"], "val": val}
    dropout = {f: getattr(gcfg, f) for f in DROPOUT_FIELDS if getattr(gcfg, f)}
    if dropout:
        train["dropout"] = dropout
    meta[TRAIN_META] = json.dumps({**train, **(extra or {})})
    if cfg.get("tokenizer"):
        meta["arsparse.tokenizer"] = json.dumps(cfg["tokenizer"])
    save_safetensors(sd, out, meta)
    return out


def export_model(ckpt_path: str | os.PathLike, out_path: str | os.PathLike | None = None,
                 dtype: str | torch.dtype = "bf16") -> Path:
    """Write the weights of a training checkpoint as a self-describing ``.safetensors``.

    Parameters
    ----------
    ckpt_path : str or os.PathLike
        ``ckpt.pt`` written by :func:`train_gpt` (finished or not).
    out_path : str or os.PathLike, optional
        Default: ``model.safetensors`` beside the checkpoint.
    dtype : {"bf16", "fp16", "fp32"} or torch.dtype
        Precision of the floating-point tensors in the file.

    Returns
    -------
    Path
        The file; ``arsparse.load_gpt(path)`` rebuilds the model from its header alone.
    """
    ckpt = load_checkpoint(ckpt_path)
    if isinstance(dtype, str):
        if dtype not in _DTYPES:
            raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
        dtype = _DTYPES[dtype]
    out = Path(out_path) if out_path is not None else Path(ckpt_path).with_name(MODEL_NAME)
    return _write_weights(ckpt["model"], GPTConfig(**ckpt["gpt_config"]), ckpt["config"], ckpt["step"], out, dtype,
                          val=ckpt["history"].get("val", [])[-1:])
