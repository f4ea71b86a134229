"""Budget sweep: every policy at a list of memory budgets, and where each comes within a tolerance of dense.

:func:`sweep` evaluates each policy at each requested budget ``rho`` (kept / dense KV entries per
sequence, layer and head) on the same held-out images, conditions and seeds:

* always the teacher-forced NLL (bits/token), KL(dense || policy) and top-1 agreement, which cost
  one teacher-forced pass per (policy, budget);
* with ``frechet=True`` also the Fréchet distances and class accuracy of ``num_samples`` generated
  images per (policy, budget), which costs a full generation each (and, with ``kid_subsets``, the
  kernel distances of the same images; with ``fd_infinity``, each Fréchet distance extrapolated to
  infinitely many samples too, whose relative gaps the finite-sample bias does not compress).

A budget is met by :func:`~arsparse.policies.policy_at_budget`: the most kept entries that do
not exceed ``floor(rho * dense)``. Policies keep whole units (``diagonal`` whole image rows), so
the *actual* kept / dense of each row is recorded and is what the crossings and the plot use.

:func:`crossing` then finds, per policy and metric, the smallest kept fraction from which on the
policy stays within ``tolerance`` of dense (relative cost ``(x - dense) / dense <= tolerance``),
interpolating linearly between the two sweep points around the last one above it.
"""
from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path
from typing import Iterable, Sequence

import torch

from ..policies import policy_at_budget, spec_params
from .evaluate import (EvalConfig, HeldOut, note_infinity, prepare_bench, run_info,
                       sampled_quality, teacher_forced_metrics)

__all__ = ["DEFAULT_RHOS", "SWEEP_METRICS", "check_rhos", "parse_rhos", "crossing", "rel_key", "sweep", "sweep_markdown",
           "plot_sweep", "write_sweep"]

#: The default budgets (kept / dense) of ``arsparse eval --sweep-rho``.
DEFAULT_RHOS = (0.06, 0.09, 0.12, 0.18, 0.25, 0.35, 0.5)
#: Metrics a sweep finds crossings for (lower is better for each), with their labels.
SWEEP_METRICS = {"nll_bits_per_token": "NLL", "fd_classifier": "FD classifier", "fd_mobilenet": "FD MobileNetV2",
                 "fid": "FID", "fd_classifier_inf": "FD classifier (extrapolated)",
                 "fd_mobilenet_inf": "FD MobileNetV2 (extrapolated)", "fid_inf": "FID (extrapolated)",
                 "kid_classifier": "KID classifier", "kid_mobilenet": "KID MobileNetV2", "kid": "KID"}
_RHO_HELP = "rho is kept / dense KV entries, a number in (0, 1]"


def check_rhos(values: Iterable) -> tuple[float, ...]:
    """Sweep budgets, each in (0, 1], none twice -> sorted tuple; ValueError naming the bad one otherwise."""
    out = []
    for v in values:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= 1:
            raise ValueError(f"sweep budget {v!r} is out of range: {_RHO_HELP}")
        if float(v) in out:
            raise ValueError(f"sweep budget {v!r} is listed twice")
        out.append(float(v))
    if not out:
        raise ValueError(f"the sweep needs at least one budget ({_RHO_HELP})")
    return tuple(sorted(out))


def parse_rhos(text: str) -> tuple[float, ...]:
    """``"0.06,0.12,0.25"`` -> ``(0.06, 0.12, 0.25)``, checked by :func:`check_rhos`."""
    items = [x.strip() for x in str(text).split(",")]
    values = []
    for x in items:
        try:
            values.append(float(x))
        except ValueError:
            raise ValueError(f"sweep budgets must be comma-separated numbers like 0.06,0.12,0.25 ({_RHO_HELP}); "
                             f"{x!r} in {text!r} is not a number") from None
    return check_rhos(values)


def crossing(points: Sequence[tuple[float, float | None]], tolerance: float = 0.02) -> dict:
    """Where a policy comes within ``tolerance`` of dense, from (kept fraction, relative cost) points.

    ``points``: (rho, (x - dense) / dense) in any order; points without a cost (None) are skipped and
    points at the same rho are averaged. The answer is the smallest rho from which on every point is
    within (cost <= tolerance): below the last point above the tolerance no answer is claimed, and
    between it and the next point the cost is interpolated linearly.

    Returns a dict: ``rho`` (None when not reached), ``status`` (``"interpolated"``, ``"at or below
    the smallest budget"``, ``"not reached within the sweep"``, ``"no data"``), ``between`` (the two
    sweep points interpolated between, else None) and ``text`` for a table.
    """
    merged: dict[float, list[float]] = {}
    for rho, cost in points:
        if cost is not None and math.isfinite(cost):
            merged.setdefault(float(rho), []).append(float(cost))
    pts = sorted((r, sum(c) / len(c)) for r, c in merged.items())
    if not pts:
        return dict(rho=None, status="no data", between=None, text="—")
    above = [i for i, (_, c) in enumerate(pts) if c > tolerance]
    if not above:
        r = pts[0][0]
        return dict(rho=r, status="at or below the smallest budget", between=None, text=f"≤ {r:.3f}")
    i = above[-1]
    if i == len(pts) - 1:
        return dict(rho=None, status="not reached within the sweep", between=None,
                    text=f"not reached within the sweep (≤ {pts[-1][0]:.3f})")
    (r0, c0), (r1, c1) = pts[i], pts[i + 1]
    r = r0 + (c0 - tolerance) * (r1 - r0) / (c0 - c1)  # c0 > tolerance >= c1
    return dict(rho=r, status="interpolated", between=[r0, r1], text=f"{r:.3f}")


def _derived(pol, layout) -> dict:
    """What a policy's ``rho`` turned into: diagonal's rows, streaming's window, a scored policy's capacity."""
    out = {}
    for key, method in (("rows", "n_rows"), ("recent", "n_recent"), ("capacity", "capacity")):
        if callable(getattr(pol, method, None)):
            out[key] = int(getattr(pol, method)(layout))
    return out


def rel_key(metric: str) -> str:
    """The row key of a metric's cost relative to dense: ``rel_to_dense`` for the NLL, ``<metric>_rel_to_dense``."""
    return "rel_to_dense" if metric == "nll_bits_per_token" else f"{metric}_rel_to_dense"


def _rel(x, ref):
    if x is None or ref is None or ref <= 0:  # (an unbiased KID of dense may fall to or below 0)
        return None
    return (x - ref) / abs(ref)


@torch.no_grad()
def sweep(gpt, tokenizer, config: EvalConfig, rhos: Iterable[float] = DEFAULT_RHOS, heldout: HeldOut | None = None,
          classifier=None, mobilenet=None, frechet: bool = False, tolerance: float = 0.02, out_dir=None,
          model_name: str = "", notes: list[str] | None = None, progress: bool = True, command: str | None = None,
          mobilenet_off: bool = False, inception=None) -> dict:
    """Every policy of ``config.policies`` at every budget of ``rhos``; returns the result (also written to ``out_dir``).

    ``config`` supplies the policies (dense is the reference and is not swept), their other
    parameters (``policy_args``; a ``rho`` there is refused), the teacher-forcing images
    (``nll_images``, ``nll_batch``) and, with ``frechet``, the generation settings. ``heldout``,
    ``classifier``, ``mobilenet``, ``inception`` as in :func:`~arsparse.eval.evaluate.evaluate`. A (policy, budget)
    that the policy cannot take (e.g. too small for one image row) is a row with an ``error``.
    """
    from .. import policies as P
    from ..policies.base import dense_entries

    cfg = config
    rhos = check_rhos(rhos)
    if not isinstance(tolerance, (int, float)) or not 0 <= tolerance < 1:
        raise ValueError(f"tolerance must be a fraction in [0, 1) (0.02 = 2 %), got {tolerance!r}")
    if cfg.nll_images < 1:
        raise ValueError("the sweep measures teacher-forced NLL: nll_images must be at least 1")
    for name, params in cfg.policy_args.items():
        if "rho" in params:
            raise ValueError(f"--policy-arg {name}:rho conflicts with the sweep, which sets every policy's budget")
    notes = list(notes or [])
    mcfg, layout = gpt.config, gpt.layout
    t_start = time.time()
    bench = prepare_bench(gpt, tokenizer, cfg, heldout, classifier, mobilenet, notes, progress, mobilenet_off,
                          features=frechet, inception=inception)
    dense_n = dense_entries(layout)

    # -- every (policy, budget) -------------------------------------------------------------
    dense = P.get("dense")
    b = dense.budget(layout, mcfg.n_layer, mcfg.n_head)
    rows = [dict(policy="dense", rho_requested=1.0, rho=1.0, kept=b.kept, dense=dense_n, read=round(b.read, 2),
                 params={}, error=None, nll_bits_per_token=None, kl_to_dense=None, top1_agreement=None)]
    runs = {"dense": (dense, rows[0])}  # name@rho -> (policy, its row), for the ones that run
    for spec in (n for n in cfg.policies if n != "dense"):
        name, params = spec_params(spec, cfg.policy_args)
        for r in rhos:
            row = dict(policy=spec, rho_requested=r, rho=None, kept=None, dense=dense_n, read=None, params=None,
                       error=None, nll_bits_per_token=None, kl_to_dense=None, top1_agreement=None)
            try:
                pol = policy_at_budget(name, params, math.floor(r * dense_n + 1e-9), layout, mcfg.n_layer,
                                       mcfg.n_head).prepare(gpt)
                b = pol.budget(layout, mcfg.n_layer, mcfg.n_head)
            except P.PolicyError as e:
                row["error"] = str(e)
            else:
                row.update(rho=round(b.rho, 4), kept=b.kept, read=round(b.read, 2), params=pol.params(),
                           derived=_derived(pol, layout))
                runs[f"{spec}@{r:g}"] = (pol, row)
            rows.append(row)
    skipped = [f"{r['policy']}@{r['rho_requested']:g}" for r in rows if r["error"]]
    if skipped:
        notes.append(f"not run (the policy cannot take that budget; see each row's error): {', '.join(skipped)}")

    result = dict(
        model=model_name, command=command, **run_info(bench),
        config=dict(asdict(cfg), rhos=list(rhos), frechet=frechet, tolerance=tolerance),
        nll_data=bench.data_note, nll_images=len(bench.nll_tokens),
        fd_reference=bench.ref_note if frechet else None,
        conditions=(f"image i has class i % {mcfg.num_classes} and seed {cfg.seed} + i, for every policy and budget"
                    if frechet else None),
        metrics=[], tolerance=tolerance, rows=rows, crossings={}, notes=notes, complete=False)

    # -- one policy at a time (dense first): teacher forcing, then optionally generation ---------------
    groups: dict[str, dict] = {}
    for key, (pol, row) in runs.items():
        groups.setdefault(row["policy"], {})[key] = pol
    for i, (name, group) in enumerate(groups.items()):
        forced = teacher_forced_metrics(gpt, bench.nll_cond, bench.nll_tokens,
                                        {k: None if k == "dense" else p for k, p in group.items()}, cfg.nll_batch,
                                        progress, graphs=cfg.cuda_graphs, desc=f"teacher forcing {name}")
        for key in group:
            runs[key][1].update({k: forced[key][k] for k in ("nll_bits_per_token", "kl_to_dense", "top1_agreement")})
            if frechet:
                q, _ = sampled_quality(gpt, tokenizer, bench, cfg, group[key] if key != "dense" else None,
                                       f"generate {key}", progress)
                note_infinity(q.pop("fd_dims", {}), cfg.num_samples, notes, q if key == "dense" else None)
                runs[key][1].update(q)
        _summarize(result, done=i + 1 == len(groups))
        result["wall_s"] = round(time.time() - t_start, 1)
        if out_dir is not None:  # after every policy, so a run cut short keeps what it measured
            write_sweep(result, out_dir)
    return result


def _summarize(result: dict, done: bool) -> None:
    """Costs relative to dense and the crossings, from the rows measured so far."""
    rows, tol = result["rows"], result["tolerance"]
    metrics = [m for m in SWEEP_METRICS if any(r.get(m) is not None for r in rows)]
    for r in rows:
        for m in metrics:
            r[rel_key(m)] = _rel(r.get(m), rows[0].get(m))
    crossings = {}
    for name in dict.fromkeys(r["policy"] for r in rows[1:]):
        mine = [r for r in rows if r["policy"] == name and not r["error"]]
        crossings[name] = {m: crossing([(r["rho"], r.get(rel_key(m))) for r in mine], tol) for m in metrics}
    result.update(metrics=metrics, crossings=crossings, complete=done)


# ---------------------------------------------------------------------------------------------
def _pct(v) -> str:
    return "—" if v is None else f"{100 * v:+.1f}%".replace("-0.0%", "+0.0%")


def sweep_markdown(result: dict) -> str:
    """The crossings, then per metric a policy x budget table of the cost relative to dense."""
    rhos = result["config"]["rhos"]
    tol = result["tolerance"]
    metrics = result["metrics"]
    rows = result["rows"]
    dense = rows[0]
    lines = [f"Smallest kept / dense from which each policy stays within {100 * tol:g}% of dense "
             "(interpolated between sweep points):", "",
             "| policy | " + " | ".join(f"{SWEEP_METRICS[m]} within {100 * tol:g}%" for m in metrics) + " |",
             "|---|" + "---|" * len(metrics)]
    for name, per in result["crossings"].items():
        lines.append(f"| `{name}` | " + " | ".join(per[m]["text"] for m in metrics) + " |")
    for m in metrics:
        ref = dense.get(m)
        lines += ["", f"{SWEEP_METRICS[m]} relative to dense ({ref:.4g}); actual kept / dense in parentheses:", "",
                  "| policy | " + " | ".join(f"rho {r:g}" for r in rhos) + " |", "|---|" + "---|" * len(rhos)]
        for name in result["crossings"]:
            cells = []
            for r in rhos:
                row = next(x for x in rows if x["policy"] == name and x["rho_requested"] == r)
                cells.append("n/a" if row["error"] else f"{_pct(row[rel_key(m)])} ({row['rho']:.3f})")
            lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot_sweep(result: dict, path) -> None:
    """One panel per metric: cost relative to dense (%) against the actual kept / dense, a line per
    policy, the tolerance drawn, each crossing marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    metrics, tol = result["metrics"], 100 * result["tolerance"]
    cols = min(4, len(metrics))
    grid_rows = -(-len(metrics) // cols)
    fig, axes = plt.subplots(grid_rows, cols, figsize=(6.4 * cols, 4.6 * grid_rows), squeeze=False)
    for ax in axes.flat[len(metrics):]:
        ax.axis("off")
    names = list(result["crossings"])
    colours = plt.get_cmap("tab10")
    for ax, m in zip(axes.flat, metrics):
        for i, name in enumerate(names):
            pts = sorted((r["rho"], 100 * r[rel_key(m)]) for r in result["rows"]
                         if r["policy"] == name and not r["error"] and r.get(rel_key(m)) is not None)
            if not pts:
                continue
            ax.plot(*zip(*pts), marker="o", ms=4, color=colours(i % 10), label=name)
            c = result["crossings"][name][m]
            if c["status"] == "interpolated":
                ax.plot([c["rho"]], [tol], marker="x", ms=9, mew=2, color=colours(i % 10))
        ax.axhline(tol, color="black", ls="--", lw=1, label=f"dense + {tol:g}%")
        ax.axhline(0, color="grey", lw=0.5)
        ax.set_yscale("symlog", linthresh=1.0)  # linear within 1 %, logarithmic beyond
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
        ax.set_xlabel("kept / dense KV entries (actual)")
        ax.set_ylabel(f"{SWEEP_METRICS[m]} relative to dense (%)")
        ax.set_title(f"{result.get('model') or 'model'}: {SWEEP_METRICS[m]}")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_sweep(result: dict, out_dir) -> None:
    """``sweep.json`` (everything), ``sweep.md`` (what it was measured on and the tables), ``sweep.png``."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "sweep.json").write_text(json.dumps(result, indent=1))
    c = result["config"]
    lines = [f"# arsparse eval --sweep-rho: {result['model'] or 'model'}", "",
             f"{result['date']}, {result['device_name']} ({result['device']}, {result['dtype']}), torch {result['torch']}"
             + (f"; command: `{result['command']}`" if result.get("command") else ""), "",
             f"- budgets requested (kept / dense): {', '.join(f'{r:g}' for r in c['rhos'])}; each policy keeps the "
             "most entries that fit, so its actual kept / dense is recorded and used",
             f"- teacher forcing (NLL, KL, top-1): {result['nll_images']} images; {result['nll_data']}"]
    if c["frechet"]:
        lines.append(f"- generation: {c['num_samples']} images per policy and budget; {result['conditions']}; "
                     f"guidance {c['cfg_scale']}; Fréchet reference: {result['fd_reference']}")
        if c.get("fd_infinity"):
            lines.append("- \"(extrapolated)\": Fréchet distances extrapolated to infinitely many generated samples "
                         "(d_inf + k / n fitted over random subsets of half to all of them, the same subsets for every "
                         "policy and budget; Chong & Forsyth 2020)")
    lines += [f"- note: {n}" for n in result["notes"]]
    if not result["complete"]:
        lines.append("- **partial**: the run stopped before every policy was measured")
    lines += ["", sweep_markdown(result), "", "![sweep](sweep.png)", ""]
    (out / "sweep.md").write_text("\n".join(lines))
    plot_sweep(result, out / "sweep.png")
