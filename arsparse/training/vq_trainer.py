"""Training a LlamaGen-layout VQ tokenizer on RGB images, resumable like the GPT trainer.

One validated :class:`VQTrainConfig`; :func:`train_vq` trains a :class:`~arsparse.models.vq.VQModel`
with a pixel reconstruction loss (``l1_weight`` x L1 + ``l2_weight`` x L2 on images in ``[-1, 1]``)
plus LlamaGen's codebook and commitment losses (codes and features l2-normalised; commitment
weight ``commit_beta``). LlamaGen also trains with a perceptual (LPIPS) and an adversarial loss;
both need pretrained networks that cannot be installed here, and at a downsampling of 2 (a token
per 2 x 2 pixels) pixel losses are enough.

Codebook usage: every ``restart_every`` steps, each code that no token used since the previous
restart is moved onto a randomly chosen (normalised) encoder output of the current batch, and
its AdamW moments are reset ("dead-code restart"). The log records, per window, the fraction of
codes used and the perplexity of the code distribution; each evaluation records them on the
held-out images too, with the reconstruction error and PSNR.

As in :mod:`arsparse.training.trainer`, the batch, the flips and the restarts of step ``s`` are
drawn from generators seeded by ``(seed, s)``, a checkpoint holds everything else that changes
(model, optimiser, usage counts, RNG states, history), and ``time_limit_s`` stops the run with a
checkpoint in time, so a run resumes across short commands and on the CPU exactly.

Files under ``out_dir``: ``ckpt.pt``, ``train_log.json`` and, at the end, ``<name>.safetensors``
(the VQ config in its header: ``arsparse.load_vq(path)`` rebuilds it alone).
"""
from __future__ import annotations

import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from ..checkpoint import save_safetensors
from ..loading import config_metadata
from ..models.vq import VQConfig, VQModel, vq_config
from .loop import TrainLoop, recipe_warmup, run_device, start_clock, write_json
from .trainer import _DTYPES, RunConfig, _fingerprint, _seed_of, batch_indices

__all__ = ["VQ_CKPT_FORMAT", "VQ_RECIPES", "VQTrainConfig", "VQTrainResult", "export_vq", "train_vq",
           "vq_batch", "vq_recipe_config"]

VQ_CKPT_FORMAT = "arsparse-train-vq/1"


@dataclass
class VQTrainConfig(RunConfig):
    """Everything that defines a VQ training run.

    Architecture (see :class:`~arsparse.models.vq.VQConfig`): ``ch``, ``ch_mult`` (its length sets
    the downsampling, ``2 ** (len - 1)``), ``z_channels``, ``num_res_blocks``, ``codebook_size``,
    ``codebook_embed_dim``, ``commit_beta``; images are ``image_size`` square RGB.

    Loss weights ``l1_weight`` / ``l2_weight``; ``restart_every`` steps between dead-code restarts
    (0: never); ``hflip``: mirror a random half of each batch. Optimisation and run control as in
    :class:`~arsparse.training.trainer.TrainConfig`. ``name``: the exported file's stem.
    """

    ch: int = 64
    ch_mult: tuple[int, ...] = (1, 2)
    z_channels: int = 64
    num_res_blocks: int = 2
    codebook_size: int = 1024
    codebook_embed_dim: int = 8
    commit_beta: float = 0.25
    image_size: int = 64
    l1_weight: float = 1.0
    l2_weight: float = 1.0
    restart_every: int = 200
    hflip: bool = True  # (RunConfig: False)
    export_dtype: str = "fp16"  # (RunConfig: bf16)
    name: str = "vq"

    def __post_init__(self):
        def bad(msg):
            raise ValueError(f"VQTrainConfig: {msg}")

        self.check_run_fields(bad)
        self.ch_mult = tuple(self.ch_mult)
        for f in ("image_size",):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                bad(f"{f} must be a positive int, got {v!r}")
        if isinstance(self.restart_every, bool) or not isinstance(self.restart_every, int) or self.restart_every < 0:
            bad(f"restart_every must be an int >= 0 (0: no restarts), got {self.restart_every!r}")
        if not (self.l1_weight >= 0 and self.l2_weight >= 0 and self.l1_weight + self.l2_weight > 0):
            bad(f"l1_weight and l2_weight must be >= 0 and not both 0, got {self.l1_weight}, {self.l2_weight}")
        if not isinstance(self.name, str) or not self.name or "/" in self.name:
            bad(f"name must be a file stem, got {self.name!r}")
        try:
            vc = self.vq_config()
        except ValueError as exc:
            bad(f"bad architecture: {exc}")
        if self.image_size % vc.downsample:
            bad(f"image_size {self.image_size} must be a multiple of the downsampling {vc.downsample}")

    def vq_config(self) -> VQConfig:
        """The architecture this config trains."""
        return vq_config("VQ-16", ch_mult=tuple(self.ch_mult), ch=self.ch, z_channels=self.z_channels,
                         num_res_blocks=self.num_res_blocks, codebook_size=self.codebook_size,
                         codebook_embed_dim=self.codebook_embed_dim, commit_loss_beta=self.commit_beta)

    @property
    def grid(self) -> int:
        """Tokens per image side."""
        return self.image_size // self.vq_config().downsample

    def to_dict(self) -> dict[str, Any]:
        return {**super().to_dict(), "ch_mult": list(self.ch_mult)}


#: Named VQ recipes; ``vq_recipe_config(name, out_dir, **overrides)`` turns one into a config.
VQ_RECIPES: dict[str, dict[str, Any]] = {
    # Emoji at 64 x 64 -> 32 x 32 = 1024 tokens (a token per 2 x 2 pixels, as the issue prefers:
    # LlamaGen's 32 x 32 grid at 512 px). Two stages (ch 64, 128), two residual blocks each,
    # attention at 32 x 32, z 64, 1024 l2-normalised codes of dimension 8: 3.8 M parameters,
    # 7.6 MB as fp16. Codebook 1024, not LlamaGen's 16384: a 2 x 2 RGB patch of an emoji (flat
    # colours, outlines, soft shading on white) needs few codes, and the GPT's softmax and data
    # (about 13 M tokens) favour a small vocabulary.
    #
    # Budget: 4000 steps of 128 = 512 k images (about 76 epochs of the 6.8 k training images,
    # flipped at random). 38.6 GFLOP per image per step (fwd + bwd); estimated 1,500-2,500
    # images/s on one H200 in bf16, so 3.5-6 minutes.
    "emoji-vq": dict(
        dataset="emoji", name="emoji-vq", ch=64, ch_mult=(1, 2), z_channels=64, num_res_blocks=2,
        codebook_size=1024, codebook_embed_dim=8, commit_beta=0.25, image_size=64,
        l1_weight=1.0, l2_weight=1.0, restart_every=200, hflip=True,
        steps=4000, batch_size=128, lr=4e-4, min_lr_ratio=0.05, warmup=200, weight_decay=0.0,
        betas=(0.9, 0.95), grad_clip=1.0, ckpt_every=1000, eval_every=1000, log_every=100, eval_samples=None,
        export_dtype="fp16",
    ),
}


def vq_recipe_config(name: str, out_dir: str, **overrides) -> VQTrainConfig:
    """A :class:`VQTrainConfig` from a named recipe plus overrides (``None`` values are ignored); without a
    ``warmup`` override the recipe's is cut to a quarter of ``steps`` at most (as :func:`recipe_config`)."""
    if name not in VQ_RECIPES:
        raise ValueError(f"unknown VQ recipe {name!r}; choose one of {', '.join(VQ_RECIPES)}")
    kw = dict(VQ_RECIPES[name])
    kw.update({k: v for k, v in overrides.items() if v is not None})
    recipe_warmup(kw, overrides)
    return VQTrainConfig(out_dir=out_dir, **kw)


@dataclass
class VQTrainResult:
    """What :func:`train_vq` did (``vq_path`` is set once all steps are done)."""

    step: int
    finished: bool
    out_dir: Path
    ckpt_path: Path
    vq_path: Path | None
    final_val: dict | None
    history: dict


# ---- pieces -------------------------------------------------------------------------------------

def to_unit(images: torch.Tensor) -> torch.Tensor:
    """(B, H, W, 3) uint8 -> (B, 3, H, W) float in [-1, 1]."""
    return images.permute(0, 3, 1, 2).float().div(127.5).sub(1.0)


def vq_batch(cfg: VQTrainConfig, step: int, images: torch.Tensor) -> torch.Tensor:
    """The training batch of update ``step``: (B, 3, H, W) in [-1, 1], a pure function of ``(seed, step)``.

    Rows come from :func:`~arsparse.training.trainer.batch_indices`; with ``hflip`` each is
    mirrored left to right with probability 1/2.
    """
    dev = images.device
    idx = batch_indices(cfg.seed, step, images.shape[0], cfg.batch_size).to(dev)
    x = to_unit(images[idx])  # (B, 3, H, W)
    if cfg.hflip:
        g = torch.Generator().manual_seed(_seed_of(cfg.seed, 1, step))
        flip = (torch.rand(cfg.batch_size, generator=g) < 0.5).to(dev)
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    return x


def forward(model: VQModel, x: torch.Tensor, bf16: bool, encoder=None, decoder=None):
    """Reconstruct ``x`` with the quantiser in fp32 and the convolutions under bf16 autocast.

    Returns ``(recon (B, 3, H, W) fp32, z (B*h*w, D) normalised features, ids (B, h*w), losses)``.
    """
    dev = x.device.type
    encoder, decoder = encoder or model.encoder, decoder or model.decoder
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
        z = model.quant_conv(encoder(x))  # (B, D, h, w)
    with torch.autocast(dev, enabled=False):
        z = z.float()
        z_q, ids, losses = model.quantize(z)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=bf16):
        recon = decoder(model.post_quant_conv(z_q))
    feats = z.detach().permute(0, 2, 3, 1).reshape(-1, z.shape[1])  # (B*h*w, D)
    if model.quantize.l2_norm:
        feats = F.normalize(feats, dim=-1)
    return recon.float(), feats, ids, losses


def usage_stats(counts: torch.Tensor) -> dict[str, float]:
    """Fraction of codes used and perplexity (exp of the entropy) of a (K,) count vector."""
    total = counts.sum().clamp_min(1).double()
    p = counts.double() / total
    ent = -(p[p > 0] * p[p > 0].log()).sum()
    return {"usage": float((counts > 0).double().mean()), "perplexity": float(ent.exp())}


@torch.no_grad()
def evaluate_vq(model: VQModel, images: torch.Tensor, batch_size: int, bf16: bool) -> dict[str, float]:
    """Held-out reconstruction: mean L1 and L2 on [-1, 1], PSNR (dB, peak-to-peak 2), code usage, perplexity."""
    was = model.training
    model.eval()
    dev = model.quant_conv.weight.device
    l1 = l2 = 0.0
    counts = torch.zeros(model.config.codebook_size, dtype=torch.long, device=dev)
    for i in range(0, images.shape[0], batch_size):
        x = to_unit(images[i:i + batch_size].to(dev))
        recon, _, ids, _ = forward(model, x, bf16)
        recon = recon.clamp(-1, 1)
        l1 += float((recon - x).abs().sum())
        l2 += float((recon - x).pow(2).sum())
        counts += torch.bincount(ids.flatten(), minlength=counts.numel())
    model.train(was)
    n = images.shape[0] * images.shape[1] * images.shape[2] * 3
    mse = l2 / n
    return {"l1": l1 / n, "l2": mse, "psnr": 10 * math.log10(4.0 / max(mse, 1e-12)), **usage_stats(counts)}


@torch.no_grad()
def restart_dead_codes(model: VQModel, opt: torch.optim.Optimizer, counts: torch.Tensor, feats: torch.Tensor,
                       generator: torch.Generator) -> int:
    """Move every code with ``counts == 0`` onto a random row of ``feats`` (B*h*w, D); returns how many.

    The moved rows' AdamW moments are zeroed, so the new codes start with a clean optimiser state.
    """
    dead = (counts == 0).nonzero().flatten()
    if dead.numel() == 0:
        return 0
    pick = torch.randint(0, feats.shape[0], (dead.numel(),), generator=generator).to(feats.device)
    w = model.quantize.embedding.weight
    w[dead] = feats[pick].to(w.dtype)
    for v in opt.state.get(w, {}).values():
        if isinstance(v, torch.Tensor) and v.shape == w.shape:
            v[dead] = 0
    return int(dead.numel())


def _check_images(cfg: VQTrainConfig, images, what: str) -> None:
    want = (cfg.image_size, cfg.image_size, 3)
    if not isinstance(images, torch.Tensor) or images.dtype != torch.uint8 or images.dim() != 4 \
            or tuple(images.shape[1:]) != want:
        got = f"{images.dtype} {tuple(images.shape)}" if isinstance(images, torch.Tensor) else type(images).__name__
        raise ValueError(f"{what} images must be a uint8 (N, {want[0]}, {want[1]}, 3) tensor, got {got}")


def load_vq_checkpoint(path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"VQ training checkpoint not found: {p}")
    ckpt = torch.load(p, map_location="cpu", weights_only=True)
    if not isinstance(ckpt, dict) or ckpt.get("format") != VQ_CKPT_FORMAT:
        raise ValueError(f"{p} is not an arsparse VQ training checkpoint (format {VQ_CKPT_FORMAT!r})")
    return ckpt


# ---- the loop -----------------------------------------------------------------------------------

def train_vq(cfg: VQTrainConfig, images: torch.Tensor, val_images: torch.Tensor | None = None, *,
             resume: bool = True, stop_after: int | None = None, started_at: float | None = None) -> VQTrainResult:
    """Train (or resume training) a VQ tokenizer on ``images`` (N, H, W, 3) uint8.

    ``val_images``: held-out images, evaluated every ``eval_every`` steps and at the end.
    ``resume``, ``stop_after`` and ``started_at`` as in :func:`arsparse.training.trainer.train_gpt`.
    """
    t_start = start_clock(started_at, stop_after)
    _check_images(cfg, images, "training")
    if val_images is not None:
        _check_images(cfg, val_images, "validation")
        if cfg.eval_samples is not None:
            val_images = val_images[:cfg.eval_samples]
    if images.shape[0] < cfg.batch_size:
        raise ValueError(f"batch_size {cfg.batch_size} is larger than the training set ({images.shape[0]} images)")
    device = run_device(cfg)
    bf16 = cfg.use_bf16()
    data_id = _fingerprint(images, val_images)

    vcfg = cfg.vq_config()
    torch.manual_seed(cfg.seed)
    model = VQModel(vcfg).to(device).train()
    model.quantize.track_usage = False  # codes are counted here, without a GPU sync per step
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay,
                            **({"fused": True} if device.type == "cuda" else {}))
    K = vcfg.codebook_size
    since_restart = torch.zeros(K, dtype=torch.long, device=device)
    loop = TrainLoop(cfg, model, opt, t_start=t_start, stop_after=stop_after, fmt=VQ_CKPT_FORMAT, data_id=data_id,
                     arch=("vq_config", _vq_dict(vcfg)), history={"train": [], "val": [], "restarts": []},
                     extra_state=lambda: {"since_restart": since_restart.cpu()})
    ckpt = loop.resume(resume, load_vq_checkpoint, data="images")
    if ckpt is not None:
        since_restart.copy_(ckpt["since_restart"])
        del ckpt

    if loop.step == 0:
        n_params = loop.num_params
        loop.log(f"training a VQ: ch {cfg.ch} x {list(cfg.ch_mult)}, {K} codes of dim {cfg.codebook_embed_dim}, "
                 f"{cfg.image_size} px -> {cfg.grid}x{cfg.grid} tokens ({n_params / 1e6:.2f} M parameters, "
                 f"{n_params * _DTYPES[cfg.export_dtype].itemsize / 1e6:.1f} MB as {cfg.export_dtype}); "
                 f"{images.shape[0]} images, {cfg.steps} steps of {cfg.batch_size} on {device}"
                 f"{' (bf16 autocast)' if bf16 else ''}")

    dev_images = images.to(device)
    encoder = torch.compile(model.encoder) if cfg.compile else model.encoder
    decoder = torch.compile(model.decoder) if cfg.compile else model.decoder
    keys = ("loss", "l1", "l2", "codebook", "commit")
    window = torch.zeros(len(keys), device=device)
    window_counts = torch.zeros(K, dtype=torch.long, device=device)

    def train_step(step: int) -> None:
        x = vq_batch(cfg, step, dev_images)  # (B, 3, H, W)
        recon, feats, ids, q = forward(model, x, bf16, encoder, decoder)
        l1 = (recon - x).abs().mean()
        l2 = (recon - x).pow(2).mean()
        loss = cfg.l1_weight * l1 + cfg.l2_weight * l2 + q["codebook"] + q["commit"]
        loop.update(loss)
        flat = ids.flatten()
        ones = torch.ones_like(flat)
        since_restart.index_add_(0, flat, ones)  # bincount would synchronise the GPU
        window_counts.index_add_(0, flat, ones)
        window.add_(torch.stack([loss.detach(), l1.detach(), l2.detach(), q["codebook"].detach(),
                                 q["commit"].detach()]).float())
        done = step + 1
        if cfg.restart_every and done % cfg.restart_every == 0 and done < cfg.steps:
            g = torch.Generator().manual_seed(_seed_of(cfg.seed, 3, done))
            n = restart_dead_codes(model, opt, since_restart, feats, g)
            loop.history["restarts"].append({"step": done, "codes": n})
            since_restart.zero_()

    def summarise(n: int) -> tuple[dict, dict, str]:
        rec = {**dict(zip(keys, (window / n).tolist())), **usage_stats(window_counts)}
        window.zero_()
        window_counts.zero_()
        return rec, {"l1": f"{rec['l1']:.4f}", "used": f"{rec['usage']:.2f}"}, (
            f"loss {rec['loss']:.4f} (L1 {rec['l1']:.4f}, L2 {rec['l2']:.5f}, codebook {rec['codebook']:.4f}), "
            f"codes used {rec['usage']:.3f}")

    def run_eval() -> dict:
        t0 = time.monotonic()
        r = evaluate_vq(model, val_images, cfg.batch_size, bf16)
        loop.history["val"].append({"step": loop.step, **r, "time_s": round(loop.train_time, 2)})
        loop.log(f"step {loop.step}: held-out L1 {r['l1']:.4f}, PSNR {r['psnr']:.2f} dB, codes used "
                 f"{r['usage']:.3f}, perplexity {r['perplexity']:.0f} ({time.monotonic() - t0:.1f} s)")
        return r

    has_val = val_images is not None
    out = Path(cfg.out_dir)
    if not loop.run(train_step, summarise, run_eval if has_val else None, desc="train vq"):
        return VQTrainResult(loop.step, False, out, loop.ckpt_path, None, None, loop.history)

    val = loop.history["val"]
    if val and val[-1]["step"] == loop.step:
        final = val[-1]
    else:
        final = run_eval() if has_val else None
    loop.save("finished")
    vq_path = export_vq(loop.ckpt_path, out / f"{cfg.name}.safetensors", dtype=cfg.export_dtype)
    record = loop.record(finished=True)
    record["final_val"] = final
    write_json(record, loop.log_path)
    loop.log(f"done: {loop.step} steps in {loop.train_time / 60:.1f} min; VQ -> {vq_path}")
    return VQTrainResult(loop.step, True, out, loop.ckpt_path, vq_path, final, loop.history)


def _vq_dict(vcfg: VQConfig) -> dict:
    return json.loads(config_metadata(vcfg)["arsparse.vq"])


def export_vq(ckpt_path: str | os.PathLike, out_path: str | os.PathLike, dtype: str = "fp16") -> Path:
    """Write the VQ of a training checkpoint as a self-describing ``.safetensors`` (``load_vq`` reads it alone).

    The rolling ``quantize.codebook_used`` statistic is left out (a loader treats it as optional).
    """
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be one of {sorted(_DTYPES)}, got {dtype!r}")
    ckpt = load_vq_checkpoint(ckpt_path)
    sd = {k: (v.to(_DTYPES[dtype]) if v.is_floating_point() else v) for k, v in ckpt["model"].items()
          if k != "quantize.codebook_used"}
    meta = {"arsparse.vq": json.dumps(ckpt["vq_config"])}
    c = ckpt["config"]
    meta["arsparse.train"] = json.dumps({"step": ckpt["step"], "steps": c["steps"], "dataset": c.get("dataset"),
                                         "seed": c["seed"], "image_size": c["image_size"],
                                         "val": ckpt["history"].get("val", [])[-1:]})
    out = Path(out_path)
    save_safetensors(sd, out, meta)
    return out

