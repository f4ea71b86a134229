"""The training loop the GPT and VQ trainers share: resume, step counter, time budget, progress, cadence.

A trainer builds its model, optimiser and data, then hands a :class:`TrainLoop` the parts that are
its own: a function that does one update (``step_fn``), one that summarises the loss window
(``window_fn``), one that evaluates (``eval_fn``), and the extra checkpoint fields. The loop owns
what both trainers do alike:

* resuming from ``out_dir/ckpt.pt`` (same config and data, else a clear error), model, optimiser,
  step, training time, history and RNG states;
* the learning-rate schedule (:func:`lr_at`), gradient clipping and the optimiser step;
* a progress bar, and every ``log_every`` steps a ``history["train"]`` row and a log line;
* an evaluation every ``eval_every`` steps and a checkpoint (plus ``train_log.json``) every
  ``ckpt_every`` steps;
* stopping, checkpointed, after ``stop_after`` steps or before ``time_limit_s`` would run out
  (:func:`out_of_time` keeps room for a step, a due evaluation and a save), so that a run can be
  split into short commands that resume each other exactly.

The config it reads is a trainer config with the fields :class:`~arsparse.training.trainer.RunConfig`
validates, plus ``to_dict()``.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

__all__ = ["CKPT_NAME", "LOG_NAME", "RECIPE_WARMUP_SHARE", "RESUMABLE_CHANGES", "TrainLoop", "check_resumable",
           "load_optimizer", "log", "lr_at", "out_of_time", "recipe_warmup", "start_clock"]

CKPT_NAME, LOG_NAME = "ckpt.pt", "train_log.json"

#: Fields that may differ between a checkpoint and the config that resumes it (they do not
#: change what is computed). ``steps`` may change too, with a warning (the schedule stretches).
RESUMABLE_CHANGES = frozenset({"out_dir", "device", "time_limit_s", "ckpt_every", "eval_every", "log_every",
                               "eval_samples", "compile", "progress", "export_dtype", "steps"})


#: The most of a run a recipe's warm-up takes: a run of fewer than 4 x the recipe's warm-up steps
#: (``--steps 10`` against fashion-c2i's 300; any 1000) warms up over a quarter of its steps instead
#: (2; 250), so that it reaches the peak rate and decays. The recipes' own runs are unchanged, and
#: a warmup given explicitly is kept as given (and refused above ``steps``).
RECIPE_WARMUP_SHARE = 0.25


def recipe_warmup(kw: dict, overrides: dict) -> None:
    """Cut the recipe's ``kw["warmup"]`` to :data:`RECIPE_WARMUP_SHARE` of ``kw["steps"]`` unless
    ``overrides`` gives a warmup, so that a short run reaches the peak learning rate and then decays."""
    steps = kw.get("steps")
    if overrides.get("warmup") is None and isinstance(steps, int) and isinstance(kw.get("warmup"), int):
        kw["warmup"] = min(kw["warmup"], int(steps * RECIPE_WARMUP_SHARE))


def check_resumable(cfg, resume: bool, load: Callable[[Path], dict]) -> dict | None:
    """The checkpoint in ``cfg.out_dir`` that a run of ``cfg`` would resume, checked (None if there is none).

    ``resume=False`` refuses an existing checkpoint, and one made with another config is refused: both
    before any data is read, when a command calls this first (:meth:`TrainLoop.resume` calls it too).
    """
    p = Path(cfg.out_dir) / CKPT_NAME
    if not p.exists():
        return None
    if not resume:
        raise FileExistsError(f"{p} exists: resume from it (resume=True / --resume) or choose another out_dir")
    ckpt = load(p)
    # fields the checkpoint lacks (it was made before they existed) count as their defaults
    defaults = {f.name: f.default for f in dataclasses.fields(cfg) if f.default is not dataclasses.MISSING}
    diff = config_diff({**defaults, **ckpt["config"]}, cfg.to_dict())
    if diff:
        lines = "\n".join(f"  {k}: checkpoint {a!r}, now {b!r}" for k, (a, b) in diff.items())
        raise ValueError(f"{p} was made with another config; resume with the same settings "
                         f"or choose another out_dir:\n{lines}")
    return ckpt


def lr_at(cfg, step: int) -> float:
    """Learning rate of update number ``step`` (0-based): linear warm-up, then cosine decay."""
    if cfg.warmup and step < cfg.warmup:
        return cfg.lr * (step + 1) / cfg.warmup
    span = max(1, cfg.steps - cfg.warmup)
    t = min(1.0, (step - cfg.warmup) / span)
    lo = cfg.lr * cfg.min_lr_ratio
    return lo + 0.5 * (cfg.lr - lo) * (1.0 + math.cos(math.pi * t))


def out_of_time(time_limit_s: float | None, t_start: float, step_time: float | None, save_time: float,
                eval_time: float = 0.0) -> bool:
    """Whether the next step, an evaluation due after it and a checkpoint would overrun the time limit."""
    if time_limit_s is None:
        return False
    reserve = 2 * (step_time or 0.0) + save_time + eval_time + 1.0
    return time.monotonic() - t_start + reserve >= time_limit_s


def start_clock(started_at: float | None, stop_after: int | None) -> float:
    """The ``time.monotonic()`` the time limit counts from (``started_at``, default now); checks ``stop_after``."""
    t_start = time.monotonic() if started_at is None else started_at
    if stop_after is not None and (isinstance(stop_after, bool) or not isinstance(stop_after, int) or stop_after < 1):
        raise ValueError(f"stop_after must be a positive int or None, got {stop_after!r}")
    return t_start


def log(msg: str, progress: bool) -> None:
    """A line on stderr that does not break the progress bar."""
    if progress:
        from tqdm.auto import tqdm
        tqdm.write(msg, file=sys.stderr)
    else:
        print(msg, file=sys.stderr, flush=True)


def load_optimizer(opt: torch.optim.Optimizer, ckpt: dict, progress: bool) -> None:
    """Restore the optimiser state of a checkpoint; a portable one (``portable_checkpoint``) has none."""
    if ckpt.get("optimizer") is not None:
        opt.load_state_dict(ckpt["optimizer"])
    else:
        log(f"the checkpoint is a portable one (no optimiser state): AdamW moments restart from zero at step "
            f"{ckpt['step']}", progress)


def atomic_torch_save(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    torch.save(obj, tmp)
    os.replace(tmp, path)


def write_json(obj: Any, path: Path) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(obj, indent=1))
    os.replace(tmp, path)


def config_diff(old: dict, new: dict) -> dict[str, tuple]:
    """The fields outside :data:`RESUMABLE_CHANGES` where two config dicts differ: ``{name: (old, new)}``."""
    return {k: (old.get(k), new.get(k)) for k in sorted(set(old) | set(new))
            if k not in RESUMABLE_CHANGES and old.get(k) != new.get(k)}


def run_device(cfg) -> torch.device:
    """``cfg.device``, refused at once when it is CUDA and there is none."""
    device = torch.device(cfg.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device {cfg.device!r} asked for, but CUDA is not available")
    return device


class TrainLoop:
    """One training command's share of a run: from the checkpoint (if any) to the last step or the time limit.

    Parameters
    ----------
    cfg
        The trainer config (run-control fields as :class:`~arsparse.training.trainer.RunConfig`).
    model, opt
        What is trained, and its optimiser (the loop sets its learning rate each step).
    t_start : float
        From :func:`start_clock`.
    stop_after : int, optional
        Stop (checkpointed) after this many steps in this call.
    fmt : str
        The checkpoint's ``format`` tag.
    data_id : str
        Fingerprint of the data; a checkpoint of other data is refused.
    arch : tuple[str, dict]
        The architecture's key and description, stored in the checkpoint and the log
        (``("gpt_config", {...})``).
    history : dict
        The empty history of a fresh run (``{"train": [], "val": [], ...}``); a resumed run's comes
        from its checkpoint: read ``loop.history``, not the dict given here.
    extra_state : callable, optional
        More checkpoint fields, called at each save.

    Attributes ``step``, ``train_time`` (seconds in training steps, over all calls) and ``history``
    are the run's progress; ``ckpt_path``, ``log_path`` and ``device`` its files and device.
    """

    def __init__(self, cfg, model: torch.nn.Module, opt: torch.optim.Optimizer, *, t_start: float,
                 stop_after: int | None, fmt: str, data_id: str, arch: tuple[str, dict], history: dict,
                 extra_state: Callable[[], dict] | None = None):
        self.cfg, self.model, self.opt = cfg, model, opt
        self.t_start, self.stop_after = t_start, stop_after
        self.fmt, self.data_id, self.arch, self.extra_state = fmt, data_id, arch, extra_state
        self.device = torch.device(cfg.device)
        out = Path(cfg.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self.ckpt_path, self.log_path = out / CKPT_NAME, out / LOG_NAME
        self.step, self.train_time, self.history = 0, 0.0, history
        self.num_params = sum(p.numel() for p in model.parameters())

    def log(self, msg: str) -> None:
        log(msg, self.cfg.progress)

    # ---- resume and save ----------------------------------------------------------------------

    def resume(self, resume: bool, load: Callable[[Path], dict], *, data: str = "data",
               same: str = "data set") -> dict | None:
        """Continue from ``ckpt.pt`` if there is one; returns it (for the trainer's own fields), else ``None``.

        ``resume=False`` refuses an existing checkpoint. ``load(path)`` reads and checks one; ``data``
        and ``same`` word the error when its data fingerprint differs ("trained on other {data} ...;
        resume with the same {same}").
        """
        p, cfg = self.ckpt_path, self.cfg
        ckpt = check_resumable(cfg, resume, load)
        if ckpt is None:
            if resume:
                self.log(f"no checkpoint at {p}: starting from step 0")
            return None
        if ckpt["data_id"] != self.data_id:
            raise ValueError(f"{p} was trained on other {data} (fingerprint {ckpt['data_id'][:12]}, "
                             f"now {self.data_id[:12]}); resume with the same {same}")
        if ckpt["config"]["steps"] != cfg.steps:
            warnings.warn(f"steps changed from {ckpt['config']['steps']} to {cfg.steps}: the cosine schedule "
                          f"is stretched from step {ckpt['step']} on", stacklevel=3)
        self.model.load_state_dict(ckpt["model"], strict=True)
        load_optimizer(self.opt, ckpt, cfg.progress)
        self.step, self.train_time, self.history = int(ckpt["step"]), float(ckpt["train_time_s"]), ckpt["history"]
        torch.set_rng_state(ckpt["rng"]["torch"])
        if self.device.type == "cuda" and ckpt["rng"].get("cuda") is not None:
            torch.cuda.set_rng_state(ckpt["rng"]["cuda"], self.device)
        self.log(f"resumed from {p} at step {self.step}/{cfg.steps}")
        return ckpt

    def record(self, finished: bool) -> dict:
        """The ``train_log.json`` content: progress, config, architecture, size, history."""
        dev = self.device
        return {"finished": finished, "step": self.step, "steps": self.cfg.steps,
                "train_time_s": round(self.train_time, 2), "num_params": self.num_params,
                "config": self.cfg.to_dict(), self.arch[0]: self.arch[1], "torch": torch.__version__,
                "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else self.cfg.device,
                "history": self.history}

    def save(self, reason: str) -> float:
        """Write ``ckpt.pt`` and an unfinished ``train_log.json``; returns the seconds it took."""
        t0 = time.monotonic()
        dev = self.device
        state = {"format": self.fmt, "step": self.step, "model": self.model.state_dict(),
                 "optimizer": self.opt.state_dict(), "config": self.cfg.to_dict(), self.arch[0]: self.arch[1],
                 "history": self.history, "data_id": self.data_id, "train_time_s": self.train_time,
                 **(self.extra_state() if self.extra_state else {}),
                 "rng": {"torch": torch.get_rng_state(),
                         "cuda": torch.cuda.get_rng_state(dev) if dev.type == "cuda" else None}}
        atomic_torch_save(state, self.ckpt_path)
        write_json(self.record(finished=False), self.log_path)
        dt = time.monotonic() - t0
        self.log(f"step {self.step}: checkpoint saved ({reason}, {dt:.1f} s) -> {self.ckpt_path}")
        return dt

    # ---- the loop -----------------------------------------------------------------------------

    def update(self, loss: torch.Tensor) -> None:
        """Backward, clip the gradients to ``grad_clip`` (0: no clipping), optimiser step, clear the gradients."""
        loss.backward()
        if self.cfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)

    def run(self, step_fn: Callable[[int], None], window_fn: Callable[[int], tuple[dict, dict, str]],
            eval_fn: Callable[[], Any] | None, *, desc: str) -> bool:
        """Train from ``self.step`` until ``steps``, ``stop_after`` or the time limit; ``True`` when all steps are done.

        ``step_fn(step)`` does update number ``step`` (0-based): the batch, the loss, :meth:`update`, and
        the trainer's own window sums. ``window_fn(n)`` summarises the last ``n`` steps and clears those
        sums: ``(fields, postfix, text)``; the ``history["train"]`` row is ``{"step", **fields, "lr",
        "images_per_s"}``, ``postfix`` goes to the progress bar and ``text`` into the log line.
        ``eval_fn()`` (``None``: no held-out data) evaluates and records into ``history["val"]``.
        A run that stops is checkpointed before this returns ``False``.
        """
        from tqdm.auto import tqdm

        cfg = self.cfg
        bar = tqdm(total=cfg.steps, initial=self.step, disable=not cfg.progress, desc=desc, unit="step",
                   dynamic_ncols=True, mininterval=1.0 if sys.stderr.isatty() else 30.0)
        window_n, window_t0 = 0, time.monotonic()
        step_time = None  # running estimate of seconds per step
        save_time = 2.0  # seconds; re-measured at each save
        eval_time = 0.0
        stopped = False
        last_saved = first_step = self.step
        try:
            while self.step < cfg.steps:
                if self.stop_after is not None and self.step - first_step >= self.stop_after:
                    stopped = True
                    break
                due_eval = eval_fn is not None and (self.step + 1) % cfg.eval_every == 0
                if out_of_time(cfg.time_limit_s, self.t_start, step_time, save_time, eval_time if due_eval else 0.0):
                    stopped = True
                    break
                t0 = time.monotonic()
                lr = lr_at(cfg, self.step)
                for group in self.opt.param_groups:
                    group["lr"] = lr
                step_fn(self.step)
                window_n += 1
                self.step += 1
                bar.update(1)

                if window_n == cfg.log_every or self.step == cfg.steps:
                    if self.device.type == "cuda":
                        torch.cuda.synchronize(self.device)
                    dt = time.monotonic() - window_t0
                    fields, postfix, text = window_fn(window_n)
                    ips = window_n * cfg.batch_size / dt
                    self.history["train"].append({"step": self.step, **fields, "lr": lr, "images_per_s": ips})
                    eta = (cfg.steps - self.step) * dt / window_n
                    bar.set_postfix(**postfix, lr=f"{lr:.2e}", img_s=f"{ips:.0f}", eta=f"{eta / 60:.1f}min",
                                    refresh=False)
                    if not cfg.progress or len(self.history["train"]) == 1:
                        self.log(f"step {self.step}: {text}, lr {lr:.2e}, {ips:.0f} images/s, ETA {eta / 60:.1f} min")
                    window_n, window_t0 = 0, time.monotonic()
                dt_step = time.monotonic() - t0
                self.train_time += dt_step
                step_time = dt_step if step_time is None else 0.9 * step_time + 0.1 * dt_step

                if eval_fn is not None and self.step % cfg.eval_every == 0 and self.step < cfg.steps:
                    t0 = time.monotonic()
                    eval_fn()
                    eval_time = time.monotonic() - t0
                    window_t0 += eval_time
                if self.step % cfg.ckpt_every == 0 and self.step < cfg.steps:
                    save_time = self.save(f"every {cfg.ckpt_every} steps")
                    last_saved = self.step
                    window_t0 += save_time
        finally:
            bar.close()

        if not stopped:
            return True
        why = (f"stop_after={self.stop_after}" if self.stop_after is not None and self.step - first_step >= self.stop_after
               else f"time limit {cfg.time_limit_s:g} s")
        if self.step != last_saved or not self.ckpt_path.exists():
            self.save(why)
        if self.step == first_step:
            warnings.warn(f"no training step fitted in the time limit ({cfg.time_limit_s:g} s); "
                          "give a larger time limit", stacklevel=3)
        self.log(f"stopped at step {self.step}/{cfg.steps} ({why}); run the same command again to resume")
        return False
