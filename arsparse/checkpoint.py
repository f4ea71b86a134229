"""Reading, checking and writing model weights.

LlamaGen publishes ``.pt`` files in several layouts (a raw state dict, or one
nested under ``"model"``, ``"module"``, ``"state_dict"`` or ``"ema"``, possibly
next to optimiser state and an ``argparse.Namespace``). :func:`read_state_dict`
turns any of these, or a ``.safetensors`` file, into a flat
``{name: tensor}`` dict; :func:`load_into` loads it strictly with readable
errors; :func:`save_safetensors` and :func:`convert` write safetensors.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

__all__ = [
    "CheckpointError",
    "read_state_dict",
    "load_into",
    "save_safetensors",
    "convert",
]

#: Wrapper entries tried, in order, when no ``key`` is given.
WRAPPER_KEYS = ("model", "module", "state_dict")
#: Prefixes stripped when every key carries them (DDP, torch.compile).
STRIP_PREFIXES = ("module.", "_orig_mod.")
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
SAFETENSORS_SUFFIX = ".safetensors"
_MAX_LISTED = 20


class CheckpointError(ValueError):
    """A checkpoint cannot be read, or does not match the model."""


def _is_tensor_dict(obj: Any) -> bool:
    return (isinstance(obj, Mapping) and len(obj) > 0
            and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items()))


def _describe(obj: Any) -> str:
    if isinstance(obj, Mapping):
        entries = ", ".join(f"{k!r}: {type(v).__name__}" for k, v in list(obj.items())[:_MAX_LISTED])
        more = f", ... ({len(obj)} entries)" if len(obj) > _MAX_LISTED else ""
        return "{" + entries + more + "}"
    return type(obj).__name__


def _load_raw(path: Path) -> Any:
    suffix = path.suffix.lower()
    if suffix == SAFETENSORS_SUFFIX:
        from safetensors.torch import load_file
        try:
            return load_file(str(path), device="cpu")
        except Exception as exc:  # safetensors raises its own error types
            raise CheckpointError(f"{path}: not a readable safetensors file ({exc})") from exc
    if suffix in TORCH_SUFFIXES:
        try:
            with torch.serialization.safe_globals([argparse.Namespace]):
                return torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # (torch's own message is many lines, its first says what went wrong)
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise CheckpointError(
                f"{path}: not a checkpoint torch.load(weights_only=True) can read ({first}). Only tensors, plain "
                "containers and argparse.Namespace are accepted; re-save the weights as a "
                "state dict or convert them with arsparse.checkpoint.convert."
            ) from exc
    raise CheckpointError(
        f"{path}: unknown checkpoint extension {path.suffix!r}; expected "
        f"{SAFETENSORS_SUFFIX} or one of {', '.join(TORCH_SUFFIXES)}"
    )


def _unwrap(obj: Any, key: str | None, path: Path) -> dict[str, torch.Tensor]:
    if key is not None:
        if not isinstance(obj, Mapping) or key not in obj:
            raise CheckpointError(f"{path}: no entry {key!r}; the file holds {_describe(obj)}")
        obj = obj[key]
    else:
        for _ in range(len(WRAPPER_KEYS)):  # wrappers may nest, e.g. {"state_dict": {"model": ...}}
            if _is_tensor_dict(obj) or not isinstance(obj, Mapping):
                break
            found = next((k for k in WRAPPER_KEYS if isinstance(obj.get(k), Mapping)), None)
            if found is None:
                break
            obj = obj[found]
    if not _is_tensor_dict(obj):
        hint = " Pass key='ema' to load the EMA weights." if isinstance(obj, Mapping) and "ema" in obj else ""
        raise CheckpointError(
            f"{path}: no state dict of tensors found (looked for a raw state dict or one under "
            f"{list(WRAPPER_KEYS)}{'' if key is None else f' and {key!r}'}); the file holds "
            f"{_describe(obj)}.{hint}"
        )
    return dict(obj)


def _strip_prefixes(sd: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    changed = True
    while changed:
        changed = False
        for prefix in STRIP_PREFIXES:
            if sd and all(k.startswith(prefix) for k in sd):
                sd = {k[len(prefix):]: v for k, v in sd.items()}
                changed = True
    return sd


def read_state_dict(path: str | os.PathLike, key: str | None = None) -> dict[str, torch.Tensor]:
    """Read a flat state dict from a checkpoint file, on CPU.

    Parameters
    ----------
    path : str or os.PathLike
        ``.safetensors`` or a torch pickle (``.pt``, ``.pth``, ``.bin``,
        ``.ckpt``), loaded with ``weights_only=True``.
    key : str, optional
        Entry holding the state dict (e.g. ``"ema"``). By default a raw state
        dict is used, else the first of ``"model"``, ``"module"``,
        ``"state_dict"`` that holds one. ``"ema"`` is only used when asked.

    Returns
    -------
    dict of str to torch.Tensor
        Parameter names with a leading ``module.`` / ``_orig_mod.`` removed
        when every key has it.

    Raises
    ------
    CheckpointError
        Missing file, unknown extension, unreadable file or no tensors.
    """
    p = Path(path)
    if not p.is_file():
        raise CheckpointError(f"checkpoint not found: {p}" + (" (it is a directory)" if p.is_dir() else ""))
    return _strip_prefixes(_unwrap(_load_raw(p), key, p))


def _listing(title: str, items: list[str]) -> str:
    shown = items[:_MAX_LISTED]
    lines = [f"  {title} ({len(items)}):"] + [f"    {s}" for s in shown]
    if len(items) > len(shown):
        lines.append(f"    ... and {len(items) - len(shown)} more")
    return "\n".join(lines)


def _shape(t: Any) -> str:
    return str(tuple(t.shape)) if isinstance(t, torch.Tensor) else f"<{type(t).__name__}>"


def load_into(module: nn.Module, state_dict: Mapping[str, torch.Tensor], *, what: str = "GPT",
              optional: Iterable[str] = ("quantize.codebook_used",),
              ignore: Iterable[str] = ("freqs_cis",)) -> list[str]:
    """Strictly load ``state_dict`` into ``module``.

    Every tensor of ``module.state_dict()`` must be present with the same
    shape, and no unknown tensor may be left over; values are cast to the
    dtype of the module's own tensor for that name.

    Parameters
    ----------
    module : nn.Module
        Destination model.
    state_dict : Mapping of str to torch.Tensor
        Source weights (e.g. from :func:`read_state_dict`).
    what : str
        Model name used in error messages (``"GPT"``, ``"VQ"`` ...).
    optional : iterable of str
        Names that may be absent (statistics rather than weights, such as
        LlamaGen's ``quantize.codebook_used``); the module keeps its values.
    ignore : iterable of str
        Extra names in the checkpoint that are dropped rather than rejected
        (tensors the model recomputes, such as LlamaGen's ``freqs_cis``).

    Returns
    -------
    list of str
        The ``optional`` names that were absent.

    Raises
    ------
    CheckpointError
        Listing missing keys, unexpected keys and shape mismatches
        (up to 20 of each, with counts).
    """
    optional, ignore = set(optional), set(ignore)
    own = module.state_dict()
    missing = sorted(k for k in own if k not in state_dict and k not in optional)
    unexpected = sorted(k for k in state_dict if k not in own and k not in ignore)
    mismatched = [
        f"{k}: expected {tuple(own[k].shape)}, got {_shape(state_dict[k])}"
        for k in sorted(own)
        if k in state_dict and (not isinstance(state_dict[k], torch.Tensor)
                                or tuple(state_dict[k].shape) != tuple(own[k].shape))
    ]
    if missing or unexpected or mismatched:
        parts = [f"{len(missing)} missing", f"{len(unexpected)} unexpected", f"{len(mismatched)} shape mismatches"]
        sections = [_listing(t, items) for t, items in
                    (("missing keys", missing), ("unexpected keys", unexpected), ("shape mismatches", mismatched))
                    if items]
        raise CheckpointError(
            f"{what} checkpoint does not match the model ({', '.join(parts)}; "
            f"model has {len(own)} tensors, checkpoint {len(state_dict)}):\n" + "\n".join(sections)
        )
    full = {k: (state_dict[k].to(dtype=t.dtype) if k in state_dict else t) for k, t in own.items()}
    module.load_state_dict(full, strict=True)
    return sorted(k for k in own if k not in state_dict)


def check_output_file(path: str | os.PathLike, suffix: str = SAFETENSORS_SUFFIX) -> Path:
    """``path`` as a file that can be written: the right suffix, and no file where a folder of it must be
    (checked before the work whose result it will hold, so that no work is lost)."""
    p = Path(path)
    if p.suffix.lower() != suffix:
        raise CheckpointError(f"{p}: the output must end in {suffix}")
    if p.is_dir():
        raise CheckpointError(f"{p} is a folder; give a file name ending in {suffix}")
    for parent in p.parents:
        if parent.exists():
            if not parent.is_dir():
                raise CheckpointError(f"cannot write {p}: {parent} is a file, not a folder")
            try:  # (a probe file: permissions, read-only mounts and /proc all refuse here, not after the work)
                tempfile.TemporaryFile(dir=parent).close()
            except OSError as exc:
                raise CheckpointError(f"cannot write {p}: {parent} does not take new files ({exc.strerror})") from None
            break
    return p


def save_safetensors(state_dict: Mapping[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """Write tensors to a ``.safetensors`` file.

    Each tensor is detached, moved to CPU and copied into its own contiguous
    storage, so views and tensors sharing memory (tied weights) are saved as
    independent entries. The file is written atomically.

    Parameters
    ----------
    state_dict : Mapping of str to torch.Tensor
    path : str or os.PathLike
        Destination; must end in ``.safetensors``.
    metadata : dict of str to str, optional
        Free-form header metadata.
    """
    p = check_output_file(path)
    if metadata is not None and not (isinstance(metadata, Mapping) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise CheckpointError(f"metadata must be a dict of str to str, got {metadata!r}")
    tensors = {}
    for k, v in state_dict.items():
        if not isinstance(k, str) or not isinstance(v, torch.Tensor):
            raise CheckpointError(f"cannot save entry {k!r} of type {type(v).__name__}: only str -> Tensor")
        tensors[k] = v.detach().to("cpu").contiguous().clone()
    if not tensors:
        raise CheckpointError(f"{p}: refusing to write a checkpoint with no tensors")

    from safetensors.torch import save_file

    p.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=dict(metadata) if metadata else None)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # (mkstemp's file is private; the output gets the usual mode)
        os.replace(tmp, p)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def convert(src: str | os.PathLike, dst: str | os.PathLike, key: str | None = None,
            metadata: dict[str, str] | None = None) -> int:
    """Convert any readable checkpoint to a flat ``.safetensors`` file.

    Parameters
    ----------
    src : str or os.PathLike
        Input checkpoint (see :func:`read_state_dict`).
    dst : str or os.PathLike
        Output ``.safetensors`` path.
    key : str, optional
        Entry to extract, e.g. ``"ema"``.
    metadata : dict of str to str, optional
        Extra header metadata; ``format`` and ``source`` are filled in, and a safetensors source's own
        header (e.g. the ``arsparse.*`` configs :func:`arsparse.load_gpt` rebuilds the model from) is kept.

    Returns
    -------
    int
        Number of tensors written.
    """
    out = check_output_file(dst)
    if out.resolve() == Path(src).resolve():
        raise CheckpointError(f"{dst}: the output must be another file than the input")
    sd = read_state_dict(src, key=key)
    from .loading import read_metadata

    meta = {**read_metadata(src), "format": "pt", "source": Path(src).name}
    if key is not None:
        meta["source_key"] = key
    meta.update(metadata or {})
    save_safetensors(sd, dst, meta)
    return len(sd)
