"""A compact Fashion-MNIST classifier: the fixed feature space of the eval's Fréchet distance.

``FashionClassifier`` is a five-layer CNN (155 k parameters) trained here, on the CPU, on the
60,000 Fashion-MNIST training images; its weights ship as ``arsparse/weights/fashion-classifier.safetensors``
with a model card beside them. :meth:`FashionClassifier.features` gives the 128-d penultimate
activations the eval compares generated and real images with; :meth:`FashionClassifier.forward`
gives class logits, for the accuracy of generated images against their requested class.

Reproduce the shipped file (about 5 minutes on one CPU thread)::

    OMP_NUM_THREADS=1 python -m arsparse.eval.classifier --out arsparse/weights/fashion-classifier.safetensors
"""
from __future__ import annotations

import argparse
import hashlib
import json
import math
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..bundles import WEIGHTS_DIR

__all__ = ["CLASSIFIER_FILE", "FashionClassifier", "load_classifier", "to_classifier_input", "train_classifier",
           "sha256_file", "classifier_accuracy"]

CLASSIFIER_FILE = WEIGHTS_DIR / "fashion-classifier.safetensors"
META_KEY = "arsparse.classifier"
IMAGE_SIZE = 28


def _block(cin: int, cout: int) -> nn.Sequential:
    return nn.Sequential(nn.Conv2d(cin, cout, 3, padding=1, bias=False), nn.BatchNorm2d(cout), nn.ReLU(inplace=True))


class FashionClassifier(nn.Module):
    """(B, 1, 28, 28) grey images in [-1, 1] -> 10 class logits; ``features`` -> (B, 128).

    conv16 - conv32 - pool - conv64 - conv64 - pool - conv128 - global mean - fc128 (features) - fc10.
    """

    feature_dim = 128

    def __init__(self, num_classes: int = 10):
        super().__init__()
        self.body = nn.Sequential(_block(1, 16), _block(16, 32), nn.MaxPool2d(2),  # 14x14
                                  _block(32, 64), _block(64, 64), nn.MaxPool2d(2),  # 7x7
                                  _block(64, 128))
        self.fc = nn.Linear(128, self.feature_dim)
        self.drop = nn.Dropout(0.2)
        self.head = nn.Linear(self.feature_dim, num_classes)

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 1, 28, 28) -> (B, 128) penultimate activations (after the ReLU)."""
        h = self.body(x).mean(dim=(2, 3))  # (B, 128)
        return F.relu(self.fc(h))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.drop(self.features(x)))


def to_classifier_input(images: torch.Tensor) -> torch.Tensor:
    """Images as the eval holds them -> the classifier's input (B, 1, 28, 28) float in [-1, 1].

    Accepts (B, 3, H, W) / (B, 1, H, W) floats in [-1, 1] (RGB is averaged to grey) or (B, H, W)
    uint8 bytes; other sizes are resized (area average down, bilinear up) to 28 x 28.
    """
    if images.dtype == torch.uint8:
        x = images.float().div(127.5).sub(1.0)
        x = x.unsqueeze(1) if x.dim() == 3 else x
    else:
        x = images.float()
    if x.dim() != 4 or x.shape[1] not in (1, 3):
        raise ValueError(f"images must be (B, 1|3, H, W) floats or (B, H, W) uint8, got {tuple(images.shape)}")
    if x.shape[1] == 3:
        x = x.mean(dim=1, keepdim=True)
    if tuple(x.shape[-2:]) != (IMAGE_SIZE, IMAGE_SIZE):
        mode = "area" if min(x.shape[-2:]) > IMAGE_SIZE else "bilinear"
        x = F.interpolate(x, size=(IMAGE_SIZE, IMAGE_SIZE), mode=mode,
                          **({} if mode == "area" else {"align_corners": False}))
    return x.clamp(-1.0, 1.0)


def sha256_file(path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def load_classifier(path=None, device="cpu") -> FashionClassifier:
    """The shipped classifier (or the one at ``path``), strictly loaded, in eval mode."""
    from safetensors.torch import load_file

    from ..checkpoint import load_into

    p = Path(path) if path is not None else CLASSIFIER_FILE
    if not p.is_file():
        raise FileNotFoundError(f"classifier weights not found: {p} (train them with "
                                "`python -m arsparse.eval.classifier --out {p}`)")
    model = FashionClassifier()
    load_into(model, load_file(str(p)), what="classifier")
    return model.to(device).eval()


@torch.no_grad()
def classifier_accuracy(model: FashionClassifier, images: torch.Tensor, labels: torch.Tensor, batch: int = 500) -> float:
    """Top-1 accuracy on (B, 28, 28) uint8 images or (B, C, H, W) floats in [-1, 1]."""
    dev = next(model.parameters()).device
    hits = 0
    for i in range(0, len(images), batch):
        x = to_classifier_input(images[i : i + batch]).to(dev)
        hits += int((model(x).argmax(-1).cpu() == labels[i : i + batch]).sum())
    return hits / max(len(images), 1)


def _quantise(x: torch.Tensor, levels: int) -> torch.Tensor:
    """[-1, 1] -> the nearest of ``levels`` grey levels (what a palette tokenizer round trip does)."""
    q = ((x + 1) * 0.5 * (levels - 1)).round() / (levels - 1)
    return q * 2 - 1


def train_classifier(epochs: int = 6, batch: int = 128, lr: float = 3e-3, seed: int = 0, root=None,
                     log=print) -> tuple[FashionClassifier, dict]:
    """Train :class:`FashionClassifier` on the Fashion-MNIST training set (CPU, deterministic).

    AdamW (weight decay 5e-4), linear warm-up over 200 steps then cosine to 0, label smoothing 0.05;
    augmentation: random horizontal flip, random shifts of up to 2 pixels, and for half of the
    images a quantisation to 32 grey levels (the shipped image model's palette).
    Returns the model (eval mode) and a summary with the test accuracy.
    """
    from ..data.fashion import load_fashion

    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed)
    xtr, ytr = load_fashion("train", root=root)
    xte, yte = load_fashion("test", root=root)
    xtr = xtr.float().div(127.5).sub(1.0).unsqueeze(1)  # (60000, 1, 28, 28)
    model = FashionClassifier()
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=5e-4)
    steps_per_epoch = len(xtr) // batch
    total = epochs * steps_per_epoch
    warm = 200
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
            x, y = xtr[idx], ytr[idx]
            flip = torch.rand(len(x), generator=g) < 0.5
            x = torch.where(flip[:, None, None, None], x.flip(-1), x)
            dx, dy = torch.randint(-2, 3, (2,), generator=g).tolist()
            x = F.pad(x, (2, 2, 2, 2), value=-1.0)[:, :, 2 + dy : 30 + dy, 2 + dx : 30 + dx]
            quant = torch.rand(len(x), generator=g) < 0.5
            x = torch.where(quant[:, None, None, None], _quantise(x, 32), x)
            loss = F.cross_entropy(model(x), y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            run_loss += float(loss.detach())
        model.eval()
        acc = classifier_accuracy(model, xte, yte)
        history.append({"epoch": epoch + 1, "train_loss": run_loss / steps_per_epoch, "test_acc": acc,
                        "time_s": round(time.time() - t0, 1)})
        log(f"epoch {epoch + 1}/{epochs}: train loss {run_loss / steps_per_epoch:.4f}, test accuracy {acc:.4f} "
            f"({time.time() - t0:.0f} s)")
    quant_acc = classifier_accuracy(model, _quantise(xte.float().div(127.5).sub(1.0).unsqueeze(1), 32), yte)
    summary = {"epochs": epochs, "batch": batch, "lr": lr, "seed": seed, "test_accuracy": history[-1]["test_acc"],
               "test_accuracy_32_levels": quant_acc, "train_time_s": round(time.time() - t0, 1),
               "torch": torch.__version__, "threads": torch.get_num_threads(), "history": history,
               "parameters": sum(p.numel() for p in model.parameters())}
    return model, summary


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m arsparse.eval.classifier",
                                description="train the Fashion-MNIST feature classifier of `arsparse eval`")
    p.add_argument("--out", default=str(CLASSIFIER_FILE), help="output .safetensors (default: the shipped file)")
    p.add_argument("--epochs", type=int, default=6)
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    from ..checkpoint import save_safetensors

    model, summary = train_classifier(args.epochs, args.batch, args.lr, args.seed)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(model.state_dict(), out, metadata={META_KEY: json.dumps({k: v for k, v in summary.items()
                                                                                if k != "history"})})
    summary["sha256"] = sha256_file(out)
    summary["bytes"] = out.stat().st_size
    out.with_suffix(".json").write_text(json.dumps(summary, indent=1))
    print(json.dumps({k: v for k, v in summary.items() if k != "history"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
