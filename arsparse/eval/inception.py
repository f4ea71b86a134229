"""Inception-v3 pool features for the standard FID, from weights the user points to.

No Inception weights can be installed from a package registry, so this feature space is optional:
``arsparse eval --inception PATH`` (or ``$ARSPARSE_INCEPTION``). The network is written here with
torchvision's module and key layout (``Conv2d_1a_3x3.conv.weight`` ... ``Mixed_7c.branch_pool.bn.*``,
``fc.*``), so either of two public checkpoints loads strictly:

- ``pt_inception-2015-12-05-6726825d.pth`` (the pytorch-fid package's port of the TensorFlow graph
  that defined FID; a 1008-way ``fc``): **the standard FID**. That graph's pools differ from
  torchvision's, and are reproduced here: the 3x3 average pools of the mixed blocks leave the
  padding out of the mean, and the last block (``Mixed_7c``) takes a 3x3 max pool instead.
- ``inception_v3_google-0cc3c7bd.pth`` (torchvision; 1000-way ``fc``, an auxiliary head that is
  dropped on loading): torchvision's pools. Its distances are not comparable with published FIDs,
  and the result says so.

Features are the 2048-d global average pool after ``Mixed_7c`` for images resized (bilinear) to
299 x 299, grey replicated to RGB, in [-1, 1] (what both checkpoints expect).
"""
from __future__ import annotations

import os
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["InceptionV3", "InceptionFeatures", "find_inception_weights", "load_inception"]

ENV = "ARSPARSE_INCEPTION"
SIZE = 299
#: Output classes of each checkpoint's ``fc`` -> whether it is the TensorFlow FID graph.
FC_CLASSES = {1008: True, 1000: False}


class ConvBN(nn.Module):
    """Conv (no bias) + BatchNorm (eps 1e-3) + ReLU; children ``conv`` and ``bn``."""

    def __init__(self, cin: int, cout: int, kernel, stride: int = 1, padding=0):
        super().__init__()
        self.conv = nn.Conv2d(cin, cout, kernel, stride=stride, padding=padding, bias=False)
        self.bn = nn.BatchNorm2d(cout, eps=1e-3)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


def _chain(x, *convs):
    for c in convs:
        x = c(x)
    return x


def _row(cin, cout):  # 1x7 then 7x1 (and 1x3 / 3x1) convolutions keep the size
    return ConvBN(cin, cout, (1, 7), padding=(0, 3))


def _col(cin, cout):
    return ConvBN(cin, cout, (7, 1), padding=(3, 0))


class _Mixed(nn.Module):
    """A mixed block whose last branch pools the input (3x3, stride 1) and projects it (``branch_pool``).

    ``tf_pools``: average pools leave the padding out of the mean; ``max_pool``: a max pool instead."""

    def __init__(self, cin: int, pool_out: int, tf_pools: bool, max_pool: bool = False):
        super().__init__()
        self.branch_pool = ConvBN(cin, pool_out, 1)
        self.tf_pools, self.max_pool = tf_pools, max_pool

    def pool(self, x):
        """The 3x3 (stride 1, same size) pool of the last branch."""
        if self.max_pool:
            return F.max_pool2d(x, 3, stride=1, padding=1)
        return F.avg_pool2d(x, 3, stride=1, padding=1, count_include_pad=not self.tf_pools)

    def pooled(self, x):
        return self.branch_pool(self.pool(x))


class MixedA(_Mixed):  # 35 x 35: 1x1, 5x5, double 3x3, pool
    def __init__(self, cin: int, pool_out: int, tf_pools: bool):
        super().__init__(cin, pool_out, tf_pools)
        self.branch1x1 = ConvBN(cin, 64, 1)
        self.branch5x5_1, self.branch5x5_2 = ConvBN(cin, 48, 1), ConvBN(48, 64, 5, padding=2)
        self.branch3x3dbl_1 = ConvBN(cin, 64, 1)
        self.branch3x3dbl_2, self.branch3x3dbl_3 = ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, padding=1)

    def forward(self, x):
        return torch.cat([self.branch1x1(x), _chain(x, self.branch5x5_1, self.branch5x5_2),
                          _chain(x, self.branch3x3dbl_1, self.branch3x3dbl_2, self.branch3x3dbl_3),
                          self.pooled(x)], 1)


class MixedB(nn.Module):  # 35 -> 17: strided 3x3, double 3x3, max pool
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3 = ConvBN(cin, 384, 3, stride=2)
        self.branch3x3dbl_1 = ConvBN(cin, 64, 1)
        self.branch3x3dbl_2, self.branch3x3dbl_3 = ConvBN(64, 96, 3, padding=1), ConvBN(96, 96, 3, stride=2)

    def forward(self, x):
        return torch.cat([self.branch3x3(x), _chain(x, self.branch3x3dbl_1, self.branch3x3dbl_2, self.branch3x3dbl_3),
                          F.max_pool2d(x, 3, stride=2)], 1)


class MixedC(_Mixed):  # 17 x 17: 1x1, factorised 7x7, double factorised 7x7, pool
    def __init__(self, cin: int, c7: int, tf_pools: bool):
        super().__init__(cin, 192, tf_pools)
        self.branch1x1 = ConvBN(cin, 192, 1)
        self.branch7x7_1, self.branch7x7_2, self.branch7x7_3 = ConvBN(cin, c7, 1), _row(c7, c7), _col(c7, 192)
        self.branch7x7dbl_1, self.branch7x7dbl_2 = ConvBN(cin, c7, 1), _col(c7, c7)
        self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5 = _row(c7, c7), _col(c7, c7), _row(c7, 192)

    def forward(self, x):
        dbl = (self.branch7x7dbl_1, self.branch7x7dbl_2, self.branch7x7dbl_3, self.branch7x7dbl_4, self.branch7x7dbl_5)
        return torch.cat([self.branch1x1(x), _chain(x, self.branch7x7_1, self.branch7x7_2, self.branch7x7_3),
                          _chain(x, *dbl), self.pooled(x)], 1)


class MixedD(nn.Module):  # 17 -> 8: 1x1 + strided 3x3, factorised 7x7 + strided 3x3, max pool
    def __init__(self, cin: int):
        super().__init__()
        self.branch3x3_1, self.branch3x3_2 = ConvBN(cin, 192, 1), ConvBN(192, 320, 3, stride=2)
        self.branch7x7x3_1, self.branch7x7x3_2 = ConvBN(cin, 192, 1), _row(192, 192)
        self.branch7x7x3_3, self.branch7x7x3_4 = _col(192, 192), ConvBN(192, 192, 3, stride=2)

    def forward(self, x):
        return torch.cat([_chain(x, self.branch3x3_1, self.branch3x3_2),
                          _chain(x, self.branch7x7x3_1, self.branch7x7x3_2, self.branch7x7x3_3, self.branch7x7x3_4),
                          F.max_pool2d(x, 3, stride=2)], 1)


class MixedE(_Mixed):  # 8 x 8: 1x1, 3x3 split into 1x3 | 3x1, double 3x3 split likewise, pool
    def __init__(self, cin: int, tf_pools: bool, max_pool: bool):
        super().__init__(cin, 192, tf_pools, max_pool)
        self.branch1x1 = ConvBN(cin, 320, 1)
        self.branch3x3_1 = ConvBN(cin, 384, 1)
        self.branch3x3_2a = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3_2b = ConvBN(384, 384, (3, 1), padding=(1, 0))
        self.branch3x3dbl_1, self.branch3x3dbl_2 = ConvBN(cin, 448, 1), ConvBN(448, 384, 3, padding=1)
        self.branch3x3dbl_3a = ConvBN(384, 384, (1, 3), padding=(0, 1))
        self.branch3x3dbl_3b = ConvBN(384, 384, (3, 1), padding=(1, 0))

    def forward(self, x):
        a = self.branch3x3_1(x)
        d = _chain(x, self.branch3x3dbl_1, self.branch3x3dbl_2)
        return torch.cat([self.branch1x1(x), self.branch3x3_2a(a), self.branch3x3_2b(a),
                          self.branch3x3dbl_3a(d), self.branch3x3dbl_3b(d), self.pooled(x)], 1)


class InceptionV3(nn.Module):
    """Inception-v3 without its auxiliary head: (B, 3, 299, 299) in [-1, 1] -> ``num_classes`` logits.

    ``tf_pools``: the TensorFlow FID graph's pools (see the module docstring); with 1008 classes that
    is the pytorch-fid checkpoint's network, with 1000 and ``tf_pools=False`` torchvision's.
    """

    feature_dim = 2048

    def __init__(self, num_classes: int = 1008, tf_pools: bool = True):
        super().__init__()
        self.tf_pools = tf_pools
        self.Conv2d_1a_3x3 = ConvBN(3, 32, 3, stride=2)
        self.Conv2d_2a_3x3 = ConvBN(32, 32, 3)
        self.Conv2d_2b_3x3 = ConvBN(32, 64, 3, padding=1)
        self.Conv2d_3b_1x1 = ConvBN(64, 80, 1)
        self.Conv2d_4a_3x3 = ConvBN(80, 192, 3)
        self.Mixed_5b, self.Mixed_5c, self.Mixed_5d = (MixedA(c, p, tf_pools) for c, p in ((192, 32), (256, 64), (288, 64)))
        self.Mixed_6a = MixedB(288)
        self.Mixed_6b, self.Mixed_6c, self.Mixed_6d, self.Mixed_6e = (MixedC(768, c7, tf_pools)
                                                                      for c7 in (128, 160, 160, 192))
        self.Mixed_7a = MixedD(768)
        self.Mixed_7b = MixedE(1280, tf_pools, max_pool=False)
        self.Mixed_7c = MixedE(2048, tf_pools, max_pool=tf_pools)
        self.fc = nn.Linear(self.feature_dim, num_classes)

    def pooled(self, x: torch.Tensor) -> torch.Tensor:
        """(B, 3, H, W) in [-1, 1] -> (B, 2048) pool features (FID's "pool3")."""
        x = _chain(x, self.Conv2d_1a_3x3, self.Conv2d_2a_3x3, self.Conv2d_2b_3x3)
        x = _chain(F.max_pool2d(x, 3, stride=2), self.Conv2d_3b_1x1, self.Conv2d_4a_3x3)
        x = _chain(F.max_pool2d(x, 3, stride=2), self.Mixed_5b, self.Mixed_5c, self.Mixed_5d, self.Mixed_6a,
                   self.Mixed_6b, self.Mixed_6c, self.Mixed_6d, self.Mixed_6e, self.Mixed_7a, self.Mixed_7b,
                   self.Mixed_7c)
        return F.adaptive_avg_pool2d(x, 1).flatten(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.pooled(x))


def find_inception_weights(path=None) -> Path | None:
    """``path``, else ``$ARSPARSE_INCEPTION``, else None (no Inception weights can be installed here)."""
    path = path or os.environ.get(ENV) or None
    if path is None:
        return None
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"Inception weights not found: {p} (give pytorch-fid's "
                                "pt_inception-2015-12-05-6726825d.pth or torchvision's inception_v3_google-*.pth)")
    return p


def load_inception(path=None, device="cpu") -> InceptionV3:
    """Inception-v3 from ``path`` (see :func:`find_inception_weights`), strictly loaded, in eval mode.

    The checkpoint's ``fc`` decides the network: 1008 classes -> the TensorFlow FID graph, 1000 ->
    torchvision's (its ``AuxLogits.*`` are dropped). Raises ValueError for anything else, and the
    checkpoint loader's error (missing, unexpected and mis-shaped keys) for a wrong layout.
    """
    from ..checkpoint import load_into

    p = find_inception_weights(path)
    if p is None:
        raise FileNotFoundError(f"no Inception weights given: --inception PATH or ${ENV}")
    try:
        sd = torch.load(p, map_location="cpu", weights_only=True)
    except Exception as e:  # (pickle, zip or tensor errors of a file that is not a checkpoint)
        raise ValueError(f"{p}: cannot be read as a PyTorch checkpoint ({type(e).__name__}: {e})") from None
    for key in ("state_dict", "model"):  # (a checkpoint wrapped as some training scripts save it)
        if isinstance(sd, dict) and isinstance(sd.get(key), dict):
            sd = sd[key]
    fc = sd.get("fc.weight") if isinstance(sd, dict) else None
    if fc is None or fc.dim() != 2 or fc.shape[0] not in FC_CLASSES:
        raise ValueError(f"{p}: not an Inception-v3 checkpoint with torchvision's key layout (need fc.weight of "
                         f"shape (1008 or 1000, 2048), got {None if fc is None else tuple(fc.shape)})")
    net = InceptionV3(num_classes=fc.shape[0], tf_pools=FC_CLASSES[fc.shape[0]])
    sd = {k: v for k, v in sd.items() if not k.startswith("AuxLogits.")}
    batch_counts = [k for k in net.state_dict() if k.endswith("num_batches_tracked")]  # (older files lack them)
    load_into(net, sd, what="Inception-v3", optional=batch_counts)
    return net.to(device).eval()


class InceptionFeatures(nn.Module):
    """Images in [-1, 1] (B, 1|3, H, W) -> (B, 2048) Inception pool features at 299 x 299."""

    def __init__(self, net: InceptionV3):
        super().__init__()
        self.net = net
        self.standard_fid = net.tf_pools and net.fc.out_features == 1008

    def preprocess(self, images: torch.Tensor) -> torch.Tensor:
        x = images.float().clamp(-1, 1)
        if x.shape[1] == 1:
            x = x.expand(-1, 3, -1, -1)
        if tuple(x.shape[-2:]) != (SIZE, SIZE):  # (as pytorch-fid: bilinear, no antialiasing)
            x = F.interpolate(x, size=(SIZE, SIZE), mode="bilinear", align_corners=False)
        return x

    @torch.no_grad()
    def forward(self, images: torch.Tensor) -> torch.Tensor:
        return self.net.pooled(self.preprocess(images.to(self.net.fc.weight.device)))
