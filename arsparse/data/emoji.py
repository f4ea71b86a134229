"""Colour emoji at 64 x 64, from the npm packages ``emoji-datasource-google`` / ``-twitter``.

Each package (iamcal's emoji-data) holds ``emoji.json`` (one entry per emoji, with ``category``,
``subcategory``, ``image`` and ``has_img_<style>``; skin-tone variants nested under
``skin_variations``) and one 64 x 64 PNG per emoji under ``img/<style>/64/``. The images are
Google's Noto Color Emoji (Apache-2.0) and Twitter's Twemoji (CC-BY-4.0).

:func:`fetch_emoji` runs ``npm pack`` for the two packages (pinned versions) and keeps only
``emoji.json`` and the 64 px PNGs, under a cache directory::

    <cache>/google/emoji.json, <cache>/google/64/*.png   (and the same for twitter)
    <cache>/emoji-64.npz                                 decoded arrays, written on first load

The cache is ``$ARSPARSE_DATA/emoji`` when that variable is set, else ``~/.cache/arsparse/emoji``.
The ``.npz`` alone is enough to load the data (it is what travels to machines with no network).

Classes are category x style, style-major: ``"Smileys & Emotion/google"`` is 0, ...,
``"Flags/twitter"`` is 17 (:data:`EMOJI_CLASSES`); the tiny ``Component`` category (five skin-tone
swatches) is dropped. Skin-tone variants are kept, as separate images. About 10 % of the emoji
are held out, chosen by a hash of the base emoji's code point sequence, so the held-out emoji
are the same in both styles and include all their skin-tone variants.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

__all__ = [
    "EMOJI_CATEGORIES",
    "EMOJI_CLASSES",
    "EMOJI_LICENCES",
    "EMOJI_PACKAGES",
    "EMOJI_STYLES",
    "EmojiData",
    "EmojiDataError",
    "composite_on_white",
    "emoji_cache_dir",
    "emoji_entries",
    "emoji_summary",
    "fetch_emoji",
    "is_held_out",
    "load_emoji",
    "load_emoji_table",
    "save_emoji_table",
]

#: npm package and pinned version per style (the held-out split depends on the emoji set).
EMOJI_PACKAGES: dict[str, tuple[str, str]] = {
    "google": ("emoji-datasource-google", "16.0.0"),
    "twitter": ("emoji-datasource-twitter", "16.0.0"),
}
EMOJI_STYLES: tuple[str, ...] = tuple(EMOJI_PACKAGES)
#: The categories kept, in Unicode's order (``Component`` is dropped).
EMOJI_CATEGORIES: tuple[str, ...] = (
    "Smileys & Emotion", "People & Body", "Animals & Nature", "Food & Drink", "Travel & Places",
    "Activities", "Objects", "Symbols", "Flags",
)
#: Class names in label order: style-major, ``"<category>/<style>"``.
EMOJI_CLASSES: tuple[str, ...] = tuple(f"{c}/{s}" for s in EMOJI_STYLES for c in EMOJI_CATEGORIES)
EMOJI_LICENCES: dict[str, str] = {
    "google": "Noto Color Emoji by Google, Apache License 2.0",
    "twitter": "Twemoji by Twitter, Inc. and other contributors, CC-BY 4.0",
}
IMAGE_SIZE = 64
HELD_OUT_PER_MILLE = 100  # 10 %
DATA_ENV = "ARSPARSE_DATA"
NPZ_NAME = "emoji-64.npz"
_NPZ_FORMAT = 1


class EmojiDataError(RuntimeError):
    """The emoji data is missing, incomplete or unreadable."""


def emoji_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir``, else ``$ARSPARSE_DATA/emoji``, else ``~/.cache/arsparse/emoji``."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(DATA_ENV)
    if env:
        return Path(env) / "emoji"
    return Path.home() / ".cache" / "arsparse" / "emoji"


def _versions() -> dict[str, str]:
    return {s: f"{name}@{ver}" for s, (name, ver) in EMOJI_PACKAGES.items()}


def _style_complete(d: Path, style: str) -> bool:
    marker = d / style / "FETCHED"
    return marker.is_file() and marker.read_text().strip() == _versions()[style]


def _hint(d: Path) -> str:
    return f"fetch it with `arsparse data fetch emoji --cache-dir {d}` (needs npm and the network)"


def fetch_emoji(cache_dir: str | os.PathLike | None = None, quiet: bool = False, timeout_s: float = 600.0) -> Path:
    """Make sure the emoji PNGs and ``emoji.json`` of both styles are in the cache; returns its path.

    For each style that is missing, runs ``npm pack <package>@<version>`` (one tarball, about
    60-75 MB) into a temporary folder and extracts only ``emoji.json`` and ``img/<style>/64/*.png``
    (about 14 MB per style); the tarball is deleted. A style already fetched is left alone.

    Raises
    ------
    EmojiDataError
        npm is not installed, or ``npm pack`` fails or times out.
    """
    d = emoji_cache_dir(cache_dir)
    todo = [s for s in EMOJI_STYLES if not _style_complete(d, s)]
    if not todo:
        return d
    npm = shutil.which("npm")
    if npm is None:
        raise EmojiDataError(f"emoji data not in {d} and npm is not installed: install npm "
                             "(`apt-get install npm`), then " + _hint(d))
    from tqdm.auto import tqdm

    for style in todo:
        spec = _versions()[style]
        if not quiet:
            print(f"fetching {spec} with `npm pack` into {d} ...", flush=True)
        with tempfile.TemporaryDirectory(prefix="arsparse-npm-") as tmp:
            try:
                r = subprocess.run([npm, "pack", spec, "--pack-destination", tmp, "--silent"], capture_output=True,
                                   text=True, timeout=timeout_s)
            except subprocess.TimeoutExpired:
                raise EmojiDataError(f"`npm pack {spec}` did not finish in {timeout_s:g} s (no network?)") from None
            tarballs = sorted(Path(tmp).glob("*.tgz"))
            if r.returncode != 0 or not tarballs:
                raise EmojiDataError(f"`npm pack {spec}` failed (exit {r.returncode}): {r.stderr.strip()[-500:]}")
            out = d / style
            if out.exists():
                shutil.rmtree(out)
            (out / "64").mkdir(parents=True)
            prefix = f"package/img/{style}/64/"
            with tarfile.open(tarballs[0], "r:gz") as tar:
                members = [m for m in tar.getmembers() if m.isfile() and (
                    m.name == "package/emoji.json" or (m.name.startswith(prefix) and m.name.endswith(".png")
                                                       and "/" not in m.name[len(prefix):]))]
                for m in tqdm(members, desc=f"extract {style}", unit="file", disable=quiet, mininterval=1.0):
                    dest = out / ("emoji.json" if m.name.endswith("emoji.json") else "64/" + m.name[len(prefix):])
                    with tar.extractfile(m) as src, open(dest, "wb") as f:
                        shutil.copyfileobj(src, f)
            if not (out / "emoji.json").is_file():
                raise EmojiDataError(f"{tarballs[0].name} has no package/emoji.json: not an emoji-datasource package")
            (out / "FETCHED").write_text(spec + "\n")
        if not quiet:
            print(f"{spec}: {len(members) - 1} PNGs", flush=True)
    return d


# ---- the index ----------------------------------------------------------------------------------

def is_held_out(base_code: str) -> bool:
    """Whether the emoji with this base ``unified`` code (e.g. ``"1F600"``) is in the held-out split."""
    h = int.from_bytes(hashlib.sha256(base_code.upper().encode()).digest()[:4], "big")
    return h % 1000 < HELD_OUT_PER_MILLE


def emoji_entries(meta: list[dict], style: str) -> list[dict]:
    """Rows ``{code, base, image, category, subcategory, label, test}`` for one style's images.

    One row per emoji of a kept category with ``has_img_<style>``, plus one per skin-tone variant
    that has an image; ``base`` is the unified code of the emoji the variant belongs to.
    """
    if style not in EMOJI_PACKAGES:
        raise ValueError(f"style must be one of {EMOJI_STYLES}, got {style!r}")
    key = f"has_img_{style}"
    rows = []
    for e in sorted(meta, key=lambda e: e.get("sort_order", 0)):
        cat = e.get("category")
        if cat not in EMOJI_CATEGORIES:
            continue
        label = EMOJI_STYLES.index(style) * len(EMOJI_CATEGORIES) + EMOJI_CATEGORIES.index(cat)
        test = is_held_out(e["unified"])
        variants = [e] + [v for _, v in sorted((e.get("skin_variations") or {}).items())]
        for v in variants:
            if v.get(key):
                rows.append(dict(code=v["unified"], base=e["unified"], image=v["image"], category=cat,
                                 subcategory=e.get("subcategory", ""), label=label, test=test))
    return rows


def composite_on_white(image) -> np.ndarray:
    """A PIL image (any mode, alpha or not) -> (H, W, 3) uint8 RGB over a white background."""
    a = np.asarray(image.convert("RGBA"), dtype=np.float32)  # (H, W, 4)
    alpha = a[..., 3:] / 255.0
    return np.round(a[..., :3] * alpha + 255.0 * (1.0 - alpha)).clip(0, 255).astype(np.uint8)


@dataclass
class EmojiData:
    """All emoji images of both styles, with their labels and split.

    ``images`` (N, 64, 64, 3) uint8 RGB on white; ``labels`` (N,) int64 into :data:`EMOJI_CLASSES`;
    ``codes`` (N,) unified codes; ``base`` (N,) the code of the base emoji; ``test`` (N,) bool.
    """

    images: np.ndarray
    labels: np.ndarray
    codes: np.ndarray
    base: np.ndarray
    test: np.ndarray

    def subset(self, keep: np.ndarray) -> "EmojiData":
        """The rows selected by a boolean mask or an index array."""
        return EmojiData(self.images[keep], self.labels[keep], self.codes[keep], self.base[keep], self.test[keep])

    def split(self, split: str) -> tuple[torch.Tensor, torch.Tensor]:
        """``"train"``, ``"test"`` or ``"all"`` -> (images (N, 64, 64, 3) uint8, labels (N,) int64)."""
        if split not in ("train", "test", "all"):
            raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
        keep = np.ones(len(self.labels), bool) if split == "all" else (self.test if split == "test" else ~self.test)
        return torch.from_numpy(self.images[keep].copy()), torch.from_numpy(self.labels[keep].astype(np.int64))


def _decode(d: Path, quiet: bool) -> EmojiData:
    from PIL import Image
    from tqdm.auto import tqdm

    rows = []
    for style in EMOJI_STYLES:
        if not _style_complete(d, style):
            raise EmojiDataError(f"emoji data not found in {d} (no {NPZ_NAME}, and {style} is not fetched): {_hint(d)}")
        meta = json.loads((d / style / "emoji.json").read_text())
        rows += [dict(r, path=d / style / "64" / r["image"]) for r in emoji_entries(meta, style)]
    images = np.empty((len(rows), IMAGE_SIZE, IMAGE_SIZE, 3), np.uint8)
    for i, r in enumerate(tqdm(rows, desc="decode emoji PNGs", unit="img", disable=quiet, mininterval=1.0)):
        try:
            with Image.open(r["path"]) as im:
                if im.size != (IMAGE_SIZE, IMAGE_SIZE):
                    raise EmojiDataError(f"{r['path']}: expected {IMAGE_SIZE}x{IMAGE_SIZE}, got {im.size}")
                images[i] = composite_on_white(im)
        except OSError as exc:
            raise EmojiDataError(f"{r['path']}: cannot read ({exc}); fetch again: {_hint(d)}") from exc
    return EmojiData(images, np.array([r["label"] for r in rows], np.int64), np.array([r["code"] for r in rows]),
                     np.array([r["base"] for r in rows]), np.array([r["test"] for r in rows], bool))


def load_emoji_table(cache_dir: str | os.PathLike | None = None, fetch: bool = False,
                     quiet: bool = True) -> EmojiData:
    """Every emoji image with its label and split, from ``<cache>/emoji-64.npz``.

    When the ``.npz`` is missing (or from other package versions), decodes the PNGs (fetching them
    first if ``fetch``) and writes it. Raises :class:`EmojiDataError` when neither is there.
    """
    d = emoji_cache_dir(cache_dir)
    npz = d / NPZ_NAME
    want = _npz_version()
    if npz.is_file():
        try:
            with np.load(npz, allow_pickle=False) as z:
                if str(z["version"]) == want:
                    return EmojiData(z["images"], z["labels"].astype(np.int64), z["codes"], z["base"],
                                     z["test"].astype(bool))
        except (OSError, KeyError, ValueError) as exc:
            if not quiet:
                print(f"{npz}: unreadable ({exc}); rebuilding it", flush=True)
    if fetch:
        fetch_emoji(d, quiet=quiet)
    data = _decode(d, quiet)
    save_emoji_table(data, d)
    return data


def _npz_version() -> str:
    return json.dumps({"format": _NPZ_FORMAT, "packages": _versions()}, sort_keys=True)


def save_emoji_table(data: EmojiData, cache_dir: str | os.PathLike) -> Path:
    """Write ``data`` as ``<cache_dir>/emoji-64.npz`` (compressed), which :func:`load_emoji_table` reads alone.

    Also how a subset travels: a smaller ``EmojiData`` saved into another folder is a data set
    that every loader takes through its ``cache_dir`` / ``root`` argument.
    """
    d = Path(cache_dir)
    d.mkdir(parents=True, exist_ok=True)
    npz = d / NPZ_NAME
    tmp = npz.with_name(npz.name + ".tmp.npz")
    np.savez_compressed(tmp, images=data.images, labels=data.labels, codes=data.codes, base=data.base,
                        test=data.test, version=np.array(_npz_version()))
    os.replace(tmp, npz)
    return npz


def load_emoji(split: str = "train", cache_dir: str | os.PathLike | None = None,
               fetch: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """One split of the emoji data: (images (N, 64, 64, 3) uint8 RGB on white, labels (N,) int64).

    ``split``: ``"train"`` (about 90 %), ``"test"`` (the held-out emoji) or ``"all"``.
    """
    return load_emoji_table(cache_dir, fetch=fetch).split(split)


def emoji_summary(data: EmojiData) -> str:
    """Class names with their train / held-out counts, one per line."""
    lines = [f"{'label':>5}  {'class':<28}{'train':>7}{'test':>6}"]
    for i, name in enumerate(EMOJI_CLASSES):
        m = data.labels == i
        lines.append(f"{i:>5}  {name:<28}{int((m & ~data.test).sum()):>7}{int((m & data.test).sum()):>6}")
    lines.append(f"{'':>5}  {'total':<28}{int((~data.test).sum()):>7}{int(data.test.sum()):>6}  "
                 f"({len(np.unique(data.base))} emoji, {len(np.unique(data.base[data.test]))} held out)")
    return "\n".join(lines)
