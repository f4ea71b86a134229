"""Figures of an :class:`~arsparse.analysis.report.Analysis` (matplotlib, Agg backend, PNG).

Each ``plot_*`` function takes the analysis and an output path and returns the path; :func:`draw_all`
draws every figure it has data for. Needs the ``plots`` extra (``pip install 'arsparse[plots]'``).
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from .metrics import CATEGORIES

COLORS = {"prompt": "#7b3294", "sinks": "#c2a5cf", "local": "#1b7837", "bands": "#a6dba0", "rest": "#d9d9d9"}
PHASE_STYLE = {"prefill": dict(color="#2166ac", ls="--"), "decode": dict(color="#b2182b", ls="-"),
               "decode-uncond": dict(color="#f4a582", ls=":"), "prefill-own": dict(color="#4d4d4d", ls="-.")}
DPI = 90


def _plt():
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("the figures need matplotlib: pip install 'arsparse[plots]'") from e
    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    path = Path(path)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    _plt().close(fig)
    return path


def _phases(a, wanted=("prefill", "decode")):
    return [p for p in wanted if p in a.summary["phases"]]


def plot_mass(a, path) -> Path:
    """Per-head stacked bars: prompt / sinks / local / bands / rest, one panel per phase."""
    plt = _plt()
    s = a.summary
    phases = _phases(a)
    fig, axes = plt.subplots(len(phases), 1, figsize=(11, 2.6 * len(phases)), sharex=True, squeeze=False)
    nl, nh = len(s["layers"]), len(s["heads"])
    x = torch.arange(nl * nh).float() + torch.arange(nl).repeat_interleave(nh).float() * 0.6  # gaps between layers
    for ax, p in zip(axes[:, 0], phases):
        bottom = torch.zeros(nl * nh)
        for c in CATEGORIES:
            v = torch.tensor(s["phases"][p]["mass"][c]["per_head"], dtype=torch.float32).flatten()
            ax.bar(x.tolist(), v.tolist(), bottom=bottom.tolist(), width=0.9, color=COLORS[c], label=c, linewidth=0)
            bottom += v
        ax.set_ylim(0, 1)
        ax.set_ylabel(f"{p}\nshare of mass")
        centers = [float(x[i * nh: (i + 1) * nh].mean()) for i in range(nl)]
        ax.set_xticks(centers)
        ax.set_xticklabels([str(li) for li in s["layers"]], fontsize=7 if nl > 20 else 9)
    axes[0, 0].legend(ncol=5, loc="lower left", bbox_to_anchor=(0, 1.02), frameon=False)
    axes[-1, 0].set_xlabel(f"layer (bars: heads {s['heads'][0]}..{s['heads'][-1]})")
    return _save(fig, path)


def plot_offsets(a, path) -> Path:
    """Mean mass per query against backward offset, full range and the first rows, peaks at k*W."""
    plt = _plt()
    s = a.summary
    W = s["layout"]["row_stride"]
    fig, axes = plt.subplots(1, 2, figsize=(12, 3.8))
    for p in _phases(a, ("prefill", "decode", "decode-uncond")):
        prof = [float("nan") if v is None else v for v in s["phases"][p]["offset_profile"]["overall"]]
        st = PHASE_STYLE[p]
        axes[0].plot(range(len(prof)), prof, lw=0.8, label=p, **st)
        n = min(len(prof), 3 * W + W // 2 + 1)
        axes[1].plot(range(n), prof[:n], lw=1.2, marker=".", ms=3, label=p, **st)
    for ax in axes:
        ax.set_yscale("log")
        ax.set_xlabel("backward offset q − key")
        lo, hi = ax.get_xlim()
        for k in range(1, int(hi // W) + 1):
            ax.axvline(k * W, color="k", lw=0.5, ls=":", alpha=0.6)
    axes[0].set_ylabel("mean attention per query")
    axes[0].set_title("all offsets")
    axes[1].set_title(f"first rows (dotted: multiples of the row width {W})")
    axes[1].legend(frameon=False)
    return _save(fig, path)


def plot_bands(a, path) -> Path:
    """The (k, delta) band map: prefill, decode and their difference, in % of a query's mass."""
    plt = _plt()
    s = a.summary
    K, D = s["config"]["band_rows"], s["config"]["band_width"]
    maps = {p: torch.tensor(s["phases"][p]["bands"]["overall"]) * 100 for p in _phases(a)}
    panels = list(maps.items())
    if "prefill" in maps and "decode" in maps:
        panels.append(("decode − prefill", maps["decode"] - maps["prefill"]))
    fig, axes = plt.subplots(1, len(panels), figsize=(3.6 * len(panels), 0.6 * K + 1.6), squeeze=False)
    vmax = max(float(m.max()) for p, m in panels if p in maps)
    for ax, (p, m) in zip(axes[0], panels):
        diff = p not in maps
        lim = float(m.abs().max()) or 1.0
        im = ax.imshow(m.numpy(), cmap="RdBu_r" if diff else "viridis", vmin=-lim if diff else 0,
                       vmax=lim if diff else vmax, aspect="auto")
        ax.set_xticks(range(2 * D + 1))
        ax.set_xticklabels([str(d) for d in range(-D, D + 1)])
        ax.set_yticks(range(K))
        ax.set_yticklabels([str(k) for k in range(1, K + 1)])
        ax.set_xlabel("δ (column offset; 0 = straight above)")
        ax.set_title(p)
        for k in range(K):
            for d in range(2 * D + 1):
                ax.text(d, k, f"{float(m[k, d]):.1f}", ha="center", va="center", fontsize=6,
                        color="k" if diff or float(m[k, d]) > 0.6 * vmax else "w")
        fig.colorbar(im, ax=ax, fraction=0.05, pad=0.02)
    axes[0, 0].set_ylabel("k (rows back)")
    return _save(fig, path)


def plot_coverage(a, path) -> Path:
    """Keys needed for 90 / 95 / 99 % of a query's mass, by image row, against the causal keys."""
    plt = _plt()
    s = a.summary
    fig, ax = plt.subplots(figsize=(7, 4))
    ps = s["config"]["coverage"]
    shades = [0.45, 0.7, 1.0]
    for p in _phases(a):
        cov = s["phases"][p]["coverage"]["keys"]["by_row"]
        st = PHASE_STYLE[p]
        for j, share in enumerate(ps):
            y = [float("nan") if r[j] is None else r[j] for r in cov]
            ax.plot(range(len(y)), y, color=st["color"], ls=st["ls"], alpha=shades[j % 3], lw=1.4,
                    label=f"{p} {100 * share:g} %")
    ck = [float("nan") if v is None else v for v in s["phases"]["decode"]["coverage"]["causal_keys_by_row"]]
    ax.plot(range(len(ck)), ck, color="k", lw=1, ls=":", label="keys a query can read")
    ax.set_yscale("log")
    ax.set_xlabel("image row of the query")
    ax.set_ylabel("keys (sorted by weight)")
    ax.set_title("keys needed to cover a share of each query's mass")
    ax.legend(fontsize=7, ncol=2, frameon=False)
    return _save(fig, path)


def plot_recall(a, path) -> Path:
    """Recall against budget for each offset policy (its defaults and rho sweep) and the oracle top-k:
    against kept entries (memory, left; with the scored policies' budgets on the oracle line) and
    against entries read per step (traffic, right)."""
    plt = _plt()
    s = a.summary
    dense = s["layout"]["prefix_len"] + s["layout"]["grid_h"] * s["layout"]["grid_w"] - 1
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.3), sharey=True)
    cmap = plt.get_cmap("tab10")
    groups: dict[str, list] = {}
    for nm, info in a.policies.items():
        if info.get("kind") == "dense":
            continue
        groups.setdefault(info.get("policy", nm), []).append(nm)
    for ax, key in zip(axes, ("kept", "read")):
        for i, (pol, names) in enumerate(sorted(groups.items())):
            items = sorted(names, key=lambda nm: a.policies[nm][key])
            xs = [a.policies[nm][key] / dense for nm in items]
            for p in _phases(a):
                ys = [100 * s["phases"][p]["recall"][nm]["overall"] for nm in items]
                ax.plot(xs, ys, marker="o" if p == "decode" else "x", ms=4, color=cmap(i % 10),
                        ls=PHASE_STYLE[p]["ls"], label=f"{pol} ({p})")
            for x, nm in zip(xs, items):
                if a.policies[nm].get("setting") == "default":
                    ax.annotate("default", (x, 100 * s["phases"]["decode"]["recall"][nm]["overall"]), fontsize=6,
                                xytext=(3, -9), textcoords="offset points", color=cmap(i % 10))
        for p in _phases(a):
            orc = s["phases"][p]["oracle"]
            if orc:
                ax.plot([b / dense for b in orc["budgets"]], [100 * v for v in orc["overall"]], color="k",
                        ls=PHASE_STYLE[p]["ls"], lw=1, label=f"oracle top-k ({p})")
        ax.set_xscale("log")
        ax.grid(alpha=0.3)
        ax.set_ylim(0, 101)
    orc = s["phases"]["decode"]["oracle"]
    for nm, b in a.scored.items():
        if orc and b["kept"] in orc["budgets"]:
            axes[0].plot(b["kept"] / dense, 100 * orc["overall"][orc["budgets"].index(b["kept"])], marker="D",
                         ms=3.5, color="k", ls="none")
    if a.scored:
        axes[0].plot([], [], marker="D", ms=3.5, color="k", ls="none", label="scored policies' budgets (oracle)")
    axes[0].set_xlabel("kept entries / dense (rho, memory)")
    axes[1].set_xlabel("entries read per step / dense (traffic; oracle: k / dense)")
    axes[0].set_ylabel("recall: % of dense attention mass read")
    axes[0].legend(fontsize=7, frameon=False, loc="upper left")
    return _save(fig, path)


def _pool(m: torch.Tensor, f: int) -> torch.Tensor:
    if f <= 1:
        return m
    T = m.shape[0] // f * f
    x = torch.nan_to_num(m[:T, :T], nan=0.0)
    return x.view(T // f, f, T // f, f).mean((1, 3))


def plot_maps(a, path) -> Path:
    """Full attention maps (log10, queries x keys) of the shown heads, prefill and decode."""
    plt = _plt()
    phases = [p for p in ("prefill", "decode") if any(k[0] == p for k in a.maps)]
    heads = a.shown_heads
    fig, axes = plt.subplots(len(heads), len(phases), figsize=(3.3 * len(phases), 3.0 * len(heads)), squeeze=False)
    T = next(iter(a.maps.values())).shape[0]
    f = max(1, math.ceil(T / 320))
    im = None
    for i, (li, h, why) in enumerate(heads):
        for j, p in enumerate(phases):
            ax = axes[i, j]
            m = a.maps.get((p, li, h))
            if m is None:
                ax.axis("off")
                continue
            lg = torch.log10(_pool(m, f).clamp_min(1e-6))
            im = ax.imshow(lg.numpy(), cmap="magma", vmin=-5, vmax=0, interpolation="nearest")
            ax.set_title(f"{p}: L{li} H{h} ({why})", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
            if j == 0:
                ax.set_ylabel("query position", fontsize=7)
            if i == len(heads) - 1:
                ax.set_xlabel("key position", fontsize=7)
    if im is not None:
        fig.colorbar(im, ax=axes, fraction=0.03, pad=0.02, label="log10 attention")
    return _save(fig, path)


def plot_query(a, path) -> Path:
    """One query's attention laid back onto the image grid, for the shown heads, prefill and decode."""
    plt = _plt()
    lay = a.summary["layout"]
    P, H, Wd, W = lay["prefix_len"], lay["grid_h"], lay["grid_w"], lay["row_stride"]
    q = a.query_pos
    qr, qc = divmod(q - P, W)
    phases = [p for p in ("prefill", "decode") if any(k[0] == p for k in a.maps)]
    has_img = bool(a.images) and a.meta.get("pixel_tokens", False)
    ncol = len(a.shown_heads) + int(has_img)
    fig, axes = plt.subplots(len(phases), ncol, figsize=(2.3 * ncol, 2.5 * len(phases)), squeeze=False)
    im = None
    for i, p in enumerate(phases):
        j0 = 0
        if has_img:
            ax = axes[i, 0]
            ax.imshow(a.images[p].float().numpy(), cmap="gray", interpolation="nearest")
            ax.add_patch(plt.Rectangle((qc - 0.5, qr - 0.5), 1, 1, fill=False, ec="r", lw=1.2))
            ax.set_title(f"{p} image", fontsize=8)
            ax.set_xticks([])
            ax.set_yticks([])
            j0 = 1
        for j, (li, h, why) in enumerate(a.shown_heads):
            ax = axes[i, j0 + j]
            m = a.maps.get((p, li, h))
            if m is None:
                ax.axis("off")
                continue
            row = m[q]  # (T,)
            grid = torch.full((H, Wd), float("nan"))
            for r in range(H):
                for c in range(Wd):
                    pos = P + r * W + c
                    if pos <= q and pos < row.numel():
                        grid[r, c] = float(row[pos])
            im = ax.imshow(torch.log10(grid.clamp_min(1e-6)).numpy(), cmap="magma", vmin=-5, vmax=0,
                           interpolation="nearest")
            ax.add_patch(plt.Rectangle((qc - 0.5, qr - 0.5), 1, 1, fill=False, ec="c", lw=1.2))
            ax.set_title(f"L{li} H{h}, prompt {100 * float(row[:P].sum()):.1f} %", fontsize=7)
            ax.set_xticks([])
            ax.set_yticks([])
    if im is not None:
        fig.colorbar(im, ax=axes, fraction=0.02, pad=0.02, label="log10 attention")
    return _save(fig, path)


def draw_all(a, out) -> dict:
    """Every figure into ``out``; -> {name: path}."""
    out = Path(out)
    figs = {"mass": plot_mass(a, out / "mass.png"), "offsets": plot_offsets(a, out / "offsets.png")}
    if a.summary["config"]["band_rows"]:
        figs["bands"] = plot_bands(a, out / "bands.png")
    figs["coverage"] = plot_coverage(a, out / "coverage.png")
    if a.policies or a.scored:
        figs["recall"] = plot_recall(a, out / "recall.png")
    if a.maps:
        figs["maps"] = plot_maps(a, out / "maps.png")
        figs["query"] = plot_query(a, out / "query.png")
    return figs
