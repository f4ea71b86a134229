"""Fashion-MNIST, read from the files of the Debian package ``dataset-fashion-mnist``.

The package installs the four gzipped IDX files of Zalando's release under
``/usr/share/datasets/fashion-mnist/``::

    train-images-idx3-ubyte.gz  (60000, 28, 28) uint8
    train-labels-idx1-ubyte.gz  (60000,) uint8, classes 0..9
    t10k-images-idx3-ubyte.gz   (10000, 28, 28) uint8
    t10k-labels-idx1-ubyte.gz   (10000,) uint8

Nothing is downloaded at run time: the data comes from a package registry (apt), or from a
copy of those files in ``$ARSPARSE_DATA/fashion-mnist`` (plain or gzipped), which is how it
travels to machines that cannot reach a registry.
"""
from __future__ import annotations

import gzip
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "FASHION_CLASSES",
    "FASHION_PACKAGE",
    "FASHION_SYSTEM_DIR",
    "FashionDataError",
    "fetch_fashion",
    "find_fashion_dir",
    "load_fashion",
    "read_idx",
]

#: Class names in label order (Zalando's README).
FASHION_CLASSES: tuple[str, ...] = (
    "T-shirt/top", "Trouser", "Pullover", "Dress", "Coat",
    "Sandal", "Shirt", "Sneaker", "Bag", "Ankle boot",
)
FASHION_PACKAGE = "dataset-fashion-mnist"
FASHION_SYSTEM_DIR = Path("/usr/share/datasets/fashion-mnist")
DATA_ENV = "ARSPARSE_DATA"

_PREFIX = {"train": "train", "test": "t10k"}
_SIZES = {"train": 60000, "test": 10000}
_IMAGES, _LABELS = "images-idx3-ubyte", "labels-idx1-ubyte"
#: IDX element-type codes -> numpy dtypes (big-endian on disk).
_IDX_DTYPES = {0x08: np.dtype(np.uint8), 0x09: np.dtype(np.int8), 0x0B: np.dtype(">i2"),
               0x0C: np.dtype(">i4"), 0x0D: np.dtype(">f4"), 0x0E: np.dtype(">f8")}


class FashionDataError(RuntimeError):
    """Fashion-MNIST is missing or its files are unreadable."""


def _install_hint() -> str:
    return (f"install it with `apt-get install {FASHION_PACKAGE}` (files go to {FASHION_SYSTEM_DIR}), "
            f"or copy its four *-ubyte(.gz) files to ${DATA_ENV}/fashion-mnist/ and set {DATA_ENV}")


def _has_files(d: Path) -> bool:
    return all(_file(d, s, kind) is not None for s in _PREFIX for kind in (_IMAGES, _LABELS))


def _file(d: Path, split: str, kind: str) -> Path | None:
    stem = f"{_PREFIX[split]}-{kind}"
    for name in (stem + ".gz", stem):
        p = d / name
        if p.is_file():
            return p
    return None


def _candidates(root) -> list[Path]:
    if root is not None:
        return [Path(root)]
    out = []
    env = os.environ.get(DATA_ENV)
    if env:
        out.append(Path(env) / "fashion-mnist")
    out.append(FASHION_SYSTEM_DIR)
    return out


def find_fashion_dir(root: str | os.PathLike | None = None) -> Path:
    """Directory that holds the Fashion-MNIST IDX files.

    Parameters
    ----------
    root : str or os.PathLike, optional
        Look only here. By default ``$ARSPARSE_DATA/fashion-mnist`` (when the variable is
        set), then ``/usr/share/datasets/fashion-mnist``.

    Raises
    ------
    FashionDataError
        No candidate holds all four files; the message says how to install them.
    """
    tried = _candidates(root)
    for d in tried:
        if d.is_dir() and _has_files(d):
            return d
    where = ", ".join(str(d) for d in tried)
    raise FashionDataError(f"Fashion-MNIST not found (looked in {where}): {_install_hint()}")


def fetch_fashion(root: str | os.PathLike | None = None, quiet: bool = False,
                  timeout_s: float = 300.0) -> Path:
    """Make sure Fashion-MNIST is present, installing the Debian package when possible.

    Returns :func:`find_fashion_dir` when the files are already there. Otherwise, when running
    as root on a system with ``apt-get``, runs ``apt-get install -y dataset-fashion-mnist``
    (after ``apt-get update`` if the first try fails; each command limited to ``timeout_s``)
    and looks again. Anything else raises :class:`FashionDataError` with the command to run.
    """
    try:
        return find_fashion_dir(root)
    except FashionDataError as exc:
        missing = exc
    apt = shutil.which("apt-get")
    is_root = hasattr(os, "geteuid") and os.geteuid() == 0
    if root is not None or apt is None or not is_root:
        why = ("an explicit root was given" if root is not None else
               "apt-get is not available" if apt is None else "not running as root")
        raise FashionDataError(f"{missing} [not installing automatically: {why}]") from None
    out = subprocess.DEVNULL if quiet else None
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = [apt, "install", "-y", "-q", FASHION_PACKAGE]

    def run(args) -> int:
        try:
            return subprocess.run(args, stdout=out, stderr=out, env=env, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            raise FashionDataError(f"`{' '.join(args)}` did not finish in {timeout_s:g} s (no network?); "
                                   f"{_install_hint()}") from None

    if not quiet:
        print(f"Fashion-MNIST not found; installing the Debian package {FASHION_PACKAGE} ...", flush=True)
    if run(cmd) != 0:
        run([apt, "update", "-q"])
        rc = run(cmd)
        if rc != 0:
            raise FashionDataError(f"`apt-get install -y {FASHION_PACKAGE}` failed (exit {rc}); {_install_hint()}")
    return find_fashion_dir()


def read_idx(path: str | os.PathLike) -> np.ndarray:
    """Read an IDX file (optionally gzipped) into a numpy array of its native shape.

    IDX: two zero bytes, a type code, the number of dimensions ``n``, ``n`` big-endian
    uint32 sizes, then the data, big-endian.
    """
    p = Path(path)
    try:
        with open(p, "rb") as f:
            gz = f.read(2) == b"\x1f\x8b"
        opener = gzip.open if gz else open
        with opener(p, "rb") as f:
            raw = f.read()
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise FashionDataError(f"{p}: cannot read ({exc}); the file may be truncated: reinstall it "
                               f"(`apt-get install --reinstall {FASHION_PACKAGE}`)") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES or raw[3] == 0:
        raise FashionDataError(f"{p}: not an IDX file (bad magic number {raw[:4].hex() or '<empty>'})")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    head = 4 + 4 * ndim
    if len(raw) < head:
        raise FashionDataError(f"{p}: IDX header truncated")
    shape = tuple(int(v) for v in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    want = int(np.prod(shape)) * dtype.itemsize
    if len(raw) - head != want:
        raise FashionDataError(f"{p}: IDX header says shape {shape} ({want} bytes of data) but the file "
                               f"holds {len(raw) - head}; the file is corrupt or truncated")
    return np.frombuffer(raw, dtype=dtype, offset=head).reshape(shape).astype(dtype.newbyteorder("="))


def load_fashion(split: str = "train", root: str | os.PathLike | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Load one split of Fashion-MNIST.

    Parameters
    ----------
    split : {"train", "test"}
    root : str or os.PathLike, optional
        Directory of the IDX files; found with :func:`find_fashion_dir` by default.

    Returns
    -------
    images : torch.Tensor
        ``(N, 28, 28)`` uint8, 0 = background (black), 255 = white; N = 60000 or 10000.
    labels : torch.Tensor
        ``(N,)`` int64 in ``[0, 10)``; names in :data:`FASHION_CLASSES`.
    """
    if split not in _PREFIX:
        raise ValueError(f"split must be one of {sorted(_PREFIX)}, got {split!r}")
    d = find_fashion_dir(root)
    img_path, lab_path = _file(d, split, _IMAGES), _file(d, split, _LABELS)
    images, labels = read_idx(img_path), read_idx(lab_path)
    if images.dtype != np.uint8 or images.ndim != 3 or images.shape[1:] != (28, 28):
        raise FashionDataError(f"{img_path}: expected uint8 images (N, 28, 28), got {images.dtype} {images.shape}")
    if labels.dtype != np.uint8 or labels.ndim != 1:
        raise FashionDataError(f"{lab_path}: expected uint8 labels (N,), got {labels.dtype} {labels.shape}")
    if len(images) != len(labels):
        raise FashionDataError(f"{d}: {len(images)} images but {len(labels)} labels for split {split!r}")
    if labels.size and int(labels.max()) >= len(FASHION_CLASSES):
        raise FashionDataError(f"{lab_path}: label {int(labels.max())} out of range [0, {len(FASHION_CLASSES)})")
    return torch.from_numpy(images.copy()), torch.from_numpy(labels.astype(np.int64))
