"""Compact CNN classifiers: the fixed feature space of the eval's Fréchet distance, one per data set.

:class:`ImageClassifier` is a five-layer CNN whose shape comes from a :class:`ClassifierSpec`:

- ``fashion`` (:class:`FashionClassifier`, 152 k parameters): (B, 1, 28, 28) grey, 10 classes;
  shipped as ``arsparse/weights/fashion-classifier.safetensors`` with a model card.
- ``emoji``: (B, 3, 64, 64) RGB, 18 classes (category x style), a stride-2 first layer;
  ``arsparse/weights/emoji-classifier.safetensors``.

:meth:`ImageClassifier.features` gives the 128-d penultimate activations the eval compares
generated and real images with; :meth:`ImageClassifier.forward` gives class logits, for the
accuracy of generated images against their requested class. The file's header holds the spec.

Reproduce the shipped files (CPU, one thread: about 10 minutes for fashion, 5 for emoji)::

    OMP_NUM_THREADS=1 arsparse train classifier --dataset fashion --out arsparse/weights/fashion-classifier.safetensors
    OMP_NUM_THREADS=1 arsparse train classifier --dataset emoji --out arsparse/weights/emoji-classifier.safetensors
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..bundles import WEIGHTS_DIR

__all__ = ["CLASSIFIER_FILE", "CLASSIFIER_FILES", "CLASSIFIER_SPECS", "ClassifierSpec", "FashionClassifier",
           "ImageClassifier", "classifier_accuracy", "load_classifier", "preprocess_images", "save_classifier",
           "sha256_file", "to_classifier_input", "train_classifier"]

META_KEY, SPEC_KEY = "arsparse.classifier", "arsparse.classifier_spec"


@dataclass(frozen=True)
class ClassifierSpec:
    """Shape of an :class:`ImageClassifier`.

    ``widths``: channels of the five conv layers (a 2x2 max-pool after the second and fourth);
    ``stem_stride``: stride of the first conv (2 halves large inputs at once).
    """

    in_channels: int = 1
    image_size: int = 28
    num_classes: int = 10
    widths: tuple[int, ...] = (16, 32, 64, 64, 128)
    stem_stride: int = 1

    def __post_init__(self):
        object.__setattr__(self, "widths", tuple(self.widths))
        if self.in_channels not in (1, 3):
            raise ValueError(f"ClassifierSpec.in_channels must be 1 or 3, got {self.in_channels!r}")
        if len(self.widths) != 5 or any(not isinstance(w, int) or w < 1 for w in self.widths):
            raise ValueError(f"ClassifierSpec.widths must be five positive ints, got {self.widths!r}")
        if self.stem_stride not in (1, 2) or self.image_size % (4 * self.stem_stride):
            raise ValueError(f"ClassifierSpec: image_size {self.image_size} must divide by 4 x stem_stride "
                             f"{self.stem_stride} (stem_stride 1 or 2)")
        if self.num_classes < 2:
            raise ValueError(f"ClassifierSpec.num_classes must be >= 2, got {self.num_classes!r}")


CLASSIFIER_SPECS: dict[str, ClassifierSpec] = {
    "fashion": ClassifierSpec(),
    "emoji": ClassifierSpec(in_channels=3, image_size=64, num_classes=18, widths=(32, 32, 64, 64, 128), stem_stride=2),
}
CLASSIFIER_FILES: dict[str, Path] = {name: WEIGHTS_DIR / f"{name}-classifier.safetensors" for name in CLASSIFIER_SPECS}
CLASSIFIER_FILE = CLASSIFIER_FILES["fashion"]


def _block(cin: int, cout: int, stride: int = 1) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, stride=stride, padding=1, bias=False), nn.BatchNorm2d(cout),
                         nn.ReLU(inplace=True))


class ImageClassifier(nn.Module):
    """(B, C, S, S) images in [-1, 1] -> class logits; ``features`` -> (B, 128).

    conv w0 (stride ``stem_stride``) - conv w1 - pool - conv w2 - conv w3 - pool - conv w4 -
    global mean - fc 128 (features) - dropout - fc ``num_classes``.
    """

    feature_dim = 128

    def __init__(self, spec: ClassifierSpec):
        super().__init__()
        self.spec = spec
        w = spec.widths
        self.body = nn.Sequential(_block(spec.in_channels, w[0], spec.stem_stride), _block(w[0], w[1]), nn.MaxPool2d(2),
                                  _block(w[1], w[2]), _block(w[2], w[3]), nn.MaxPool2d(2),
                                  _block(w[3], w[4]))
        self.fc = nn.Linear(w[4], self.feature_dim)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(self.feature_dim, spec.num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, C, S, S) -> (B, 128) penultimate activations (after the ReLU)."""
        h = self.body(x).mean(dim=(2, 3))  # (B, w4)
        return F.relu(self.fc(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x)))

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        """Images -> this classifier's input (see :func:`preprocess_images`)."""
        return preprocess_images(images, self.spec)


class FashionClassifier(ImageClassifier):
    """The Fashion-MNIST classifier: (B, 1, 28, 28) grey in [-1, 1] -> 10 logits."""

    def __init__(self):
        super().__init__(CLASSIFIER_SPECS["fashion"])


def preprocess_images(images: torch.Tensor, spec: ClassifierSpec) -> torch.Tensor:
    """Images as the eval or the data hold them -> a classifier's input (B, C, S, S) in [-1, 1].

    Accepts floats (B, 1|3, H, W) in [-1, 1], uint8 (B, H, W) grey or uint8 (B, H, W, 3) RGB.
    RGB is averaged to grey for a grey classifier and grey copied to RGB for a colour one;
    other sizes are resized (area average down, bilinear up) to ``spec.image_size``.
    """
    if images.dtype == torch.uint8:
        x = images.float().div(127.5).sub(1.0)
        if x.dim() == 3:
            x = x.unsqueeze(1)
        elif x.dim() == 4 and x.shape[-1] == 3:
            x = x.permute(0, 3, 1, 2)
    else:
        x = images.float()
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"images must be (B, 1|3, H, W) floats, (B, H, W) or (B, H, W, 3) uint8, "
                         f"got {images.dtype} {tuple(images.shape)}")
    c, s = spec.in_channels, spec.image_size
    if x.shape[1] != c:
        x = x.mean(dim=1, keepdim=True) if c == 1 else x.expand(-1, 3, -1, -1)
    if tuple(x.shape[-2:]) != (s, s):
        mode = "area" if min(x.shape[-2:]) > s else "bilinear"
        x = F.interpolate(x, size=(s, s), mode=mode, **({} if mode == "area" else {"align_corners": False}))
    return x.clamp(-1.0, 1.0)


def to_classifier_input(images: torch.Tensor) -> torch.Tensor:
    """Images -> the Fashion-MNIST classifier's input (B, 1, 28, 28) (see :func:`preprocess_images`)."""
    return preprocess_images(images, CLASSIFIER_SPECS["fashion"])


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_classifier(path=None, device="cpu", dataset: str = "fashion") -> ImageClassifier:
    """A classifier (``dataset``'s shipped one, or the one at ``path``), strictly loaded, in eval mode.

    The architecture comes from the file's header (``arsparse.classifier_spec``); files without it
    are the Fashion-MNIST classifier.
    """
    from ..checkpoint import load_into, read_state_dict
    from ..loading import read_metadata

    if dataset not in CLASSIFIER_FILES:
        raise ValueError(f"no classifier for dataset {dataset!r}; known: {', '.join(CLASSIFIER_FILES)}")
    p = Path(path) if path is not None else CLASSIFIER_FILES[dataset]
    if not p.is_file():
        raise FileNotFoundError(f"classifier weights not found: {p} (train them with "
                                f"`arsparse train classifier --dataset {dataset} --out {p}`)")
    sd = read_state_dict(p)  # (a clear error for a file that is not a readable checkpoint)
    meta = read_metadata(p)
    spec = ClassifierSpec(**json.loads(meta[SPEC_KEY])) if SPEC_KEY in meta else CLASSIFIER_SPECS["fashion"]
    model = ImageClassifier(spec)
    load_into(model, sd, what="classifier")
    return model.to(device).eval()


@torch.no_grad()
def classifier_accuracy(model: ImageClassifier, images: torch.Tensor, labels: torch.Tensor, batch: int = 500) -> float:
    """Top-1 accuracy on images in any format :meth:`ImageClassifier.preprocess` takes."""
    dev = next(model.parameters()).device
    hits = 0
    for i in range(0, len(images), batch):
        x = model.preprocess(images[i : i + batch].to(dev))
        hits += int((model(x).argmax(-1).cpu() == labels[i : i + batch]).sum())
    return hits / max(len(images), 1)


def _quantise(x: torch.Tensor, levels: int) -> torch.Tensor:
    """[-1, 1] -> the nearest of ``levels`` grey levels (what a palette tokenizer round trip does)."""
    q = ((x + 1) * 0.5 * (levels - 1)).round() / (levels - 1)
    return q * 2 - 1


def _shift(x: torch.Tensor, g: torch.Generator, pad: int, fill: float) -> torch.Tensor:
    """Shift the whole batch by one random offset of up to ``pad`` pixels each way, filling with ``fill``."""
    s = x.shape[-1]
    dx, dy = torch.randint(-pad, pad + 1, (2,), generator=g).tolist()
    return F.pad(x, (pad, pad, pad, pad), value=fill)[:, :, pad + dy : pad + dy + s, pad + dx : pad + dx + s]


def _augment(dataset: str, x: torch.Tensor, g: torch.Generator) -> torch.Tensor:
    """Random flips and shifts; fashion: 2 px on black, half quantised to 32 levels; emoji: 4 px on white."""
    flip = torch.rand(len(x), generator=g) < 0.5
    x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    if dataset == "fashion":
        x = _shift(x, g, 2, -1.0)
        quant = torch.rand(len(x), generator=g) < 0.5
        return torch.where(quant[:, None, None, None], _quantise(x, 32), x)
    return _shift(x, g, 4, 1.0)


def _data(dataset: str, root=None):
    """(train images (N, C, H, W) uint8, labels, test images, labels)."""
    if dataset == "fashion":
        from ..data.fashion import load_fashion

        (xtr, ytr), (xte, yte) = load_fashion("train", root=root), load_fashion("test", root=root)
        return xtr.unsqueeze(1), ytr, xte.unsqueeze(1), yte
    from ..data.emoji import load_emoji

    (xtr, ytr), (xte, yte) = load_emoji("train", cache_dir=root), load_emoji("test", cache_dir=root)
    return xtr.permute(0, 3, 1, 2).contiguous(), ytr, xte.permute(0, 3, 1, 2).contiguous(), yte


def train_classifier(dataset: str = "fashion", epochs: int = 6, batch: int = 128, lr: float = 3e-3, seed: int = 0,
                     root=None, device="cpu", log=print) -> tuple[ImageClassifier, dict]:
    """Train the ``dataset`` classifier on its training split (deterministic on the CPU).

    AdamW (weight decay 5e-4), linear warm-up over 200 steps then cosine to 0, label smoothing 0.05;
    augmentation: random horizontal flips and shifts (see :func:`_augment`).
    Returns the model (eval mode) and a summary with the held-out accuracy.
    """
    if dataset not in CLASSIFIER_SPECS:
        raise ValueError(f"no classifier for dataset {dataset!r}; known: {', '.join(CLASSIFIER_SPECS)}")
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    xtr, ytr, xte, yte = _data(dataset, root)  # uint8 (N, C, H, W)
    model = ImageClassifier(CLASSIFIER_SPECS[dataset]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
    steps_per_epoch = len(xtr) // batch
    total = epochs * steps_per_epoch
    warm = min(200, max(total // 10, 1))
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: (s + 1) / warm if s < warm else 0.5 * (1 + math.cos(math.pi * (s - warm) / max(total - warm, 1))))
    t0 = time.time()
    history = []
    for epoch in range(epochs):
        model.train()
        perm = torch.randperm(len(xtr), generator=g)
        run_loss = 0.0
        for s in range(steps_per_epoch):
            idx = perm[s * batch : (s + 1) * batch]
            x = _augment(dataset, xtr[idx].float().div(127.5).sub(1.0), g)
            loss = F.cross_entropy(model(x.to(device)), ytr[idx].to(device), label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run_loss += float(loss.detach())
        model.eval()
        acc = classifier_accuracy(model, xte, yte)
        history.append({"epoch": epoch + 1, "train_loss": run_loss / steps_per_epoch, "test_acc": acc,
                        "time_s": round(time.time() - t0, 1)})
        log(f"epoch {epoch + 1}/{epochs}: train loss {run_loss / steps_per_epoch:.4f}, held-out accuracy {acc:.4f} "
            f"({time.time() - t0:.0f} s)")
    summary = {"dataset": dataset, "epochs": epochs, "batch": batch, "lr": lr, "seed": seed,
               "test_accuracy": history[-1]["test_acc"] if history else None}
    if dataset == "fashion":
        summary["test_accuracy_32_levels"] = classifier_accuracy(model, _quantise(xte.float().div(127.5).sub(1.0), 32),
                                                                 yte)
    summary.update(train_time_s=round(time.time() - t0, 1), torch=torch.__version__, threads=torch.get_num_threads(),
                   device=str(device), history=history, parameters=sum(p.numel() for p in model.parameters()))
    return model.cpu(), summary


def save_classifier(model: ImageClassifier, summary: dict, out) -> dict:
    """Write the weights (fp32, spec and summary in the header) and ``<out>.json``; returns the summary + hash."""
    from ..checkpoint import save_safetensors

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {META_KEY: json.dumps({k: v for k, v in summary.items() if k != "history"}),
            SPEC_KEY: json.dumps(asdict(model.spec))}
    save_safetensors(model.state_dict(), out, metadata=meta)
    summary = dict(summary, sha256=sha256_file(out), bytes=out.stat().st_size)
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    return summary


#: Default epochs per data set (fashion: the shipped file's 6; emoji: 6.8 k images, so more passes).
DEFAULT_EPOCHS = {"fashion": 6, "emoji": 15}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arsparse.eval.classifier",
                                description="train the feature classifier of `arsparse eval` (also: "
                                            "`arsparse train classifier`)")
    p.add_argument("--dataset", choices=sorted(CLASSIFIER_SPECS), default="fashion")
    p.add_argument("--out", help="output .safetensors (default: out/<dataset>-classifier.safetensors)")
    p.add_argument("--epochs", type=int)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    args = p.parse_args(argv)
    return run(args)


def run(args) -> int:
    """Train and save as ``args`` say (shared by ``main`` and ``arsparse train classifier``)."""
    from ..checkpoint import check_output_file
    from ..engine.generator import resolve_device

    # (checked before minutes of training; the shipped file is replaced only when --out names it)
    out = check_output_file(args.out or f"out/{args.dataset}-classifier.safetensors")
    device = resolve_device(args.device)
    epochs = args.epochs or DEFAULT_EPOCHS[args.dataset]
    model, summary = train_classifier(args.dataset, epochs, args.batch, args.lr, args.seed, device=device)
    summary = save_classifier(model, summary, out)
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
