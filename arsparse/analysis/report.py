"""The whole measurement on one model (:func:`analyze`) and its write-up (:func:`write_report`).

Phases (what "prefill" and "decode" mean here):

* ``prefill``: one teacher-forced forward over ``[condition, image tokens 0..N-2]`` of **real**
  images (Fashion-MNIST test images for ``fashion-c2i``), conditional rows only, no guidance: the
  parallel processing that training and prompt prefill see. It includes the prompt (the
  condition tokens), whose queries are not counted (they can only read the prompt).
* ``decode``: the engine's cached generation (``Generator.sample_tokens``, dense KV cache,
  classifier-free guidance at the bundle's scale) of the model's **own** samples, one query per
  step, conditional rows. ``decode-uncond``: the guidance (null-condition) rows of the same steps.
* ``prefill-own`` (control): a teacher-forced pass over the generated tokens. With exact
  arithmetic it equals ``decode`` (the cache computes the same function); the difference between
  the two measures float rounding only, so ``decode`` minus ``prefill`` is the effect of the data
  (real images vs the model's guided samples), not of the computation path.

When no real images are available, ``prefill`` runs on the model's own samples (and the report
says so); ``decode`` minus ``prefill`` is then rounding only.
"""
from __future__ import annotations

import dataclasses
import json
import math
import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .capture import AttentionCapture, capture_decode, capture_teacher_forced
from .metrics import CATEGORIES, AttentionStats, MetricConfig, ReadSet, asymmetry

__all__ = ["Analysis", "analyze", "build_read_sets", "held_out_tokens", "write_report"]

DEFAULT_RHOS = (1 / 16, 1 / 8, 1 / 4, 1 / 2)


@dataclass
class Analysis:
    """What :func:`analyze` measured. ``summary`` / ``asymmetry`` are JSON-able dicts."""

    summary: dict
    asymmetry: dict
    meta: dict
    control: dict | None
    maps: dict = field(default_factory=dict)  # (phase, layer, head) -> (T, T) float32, sequence 0
    shown_heads: list = field(default_factory=list)
    query_pos: int = 0
    images: dict = field(default_factory=dict)  # phase -> (grid_h, grid_w) token grid of sequence 0
    policies: dict = field(default_factory=dict)  # read-set name -> description
    scored: dict = field(default_factory=dict)  # scored policy -> budget
    notes: list = field(default_factory=list)


# -- inputs ---------------------------------------------------------------------------------------


def held_out_tokens(gpt, tok, classes: list[int], model_name: str | None = None) -> tuple[torch.Tensor | None, str]:
    """Held-out real images of ``classes`` as tokens (B, N), or (None, why there are none).

    The images are the held-out split of the data the model was trained on: a shipped bundle's (its
    header says which: the Fashion-MNIST test split, or the held-out emoji through the bundle's VQ),
    else Fashion-MNIST's for a 28x28, 10-class model with a palette tokenizer (a checkpoint given by
    path). Image ``i`` is the ``j``-th held-out image of class ``classes[i]``, ``j`` = how often that
    class came before in the list.
    """
    from ..data.emoji import EmojiDataError
    from ..data.fashion import FashionDataError
    from ..eval.evaluate import emoji_heldout, fashion_heldout, model_dataset
    from ..tokenizers import VQTokenizer

    cfg = gpt.config
    dataset = model_dataset(model_name) if model_name else None
    if dataset is None and (cfg.grid_h, cfg.grid_w, cfg.num_classes) == (28, 28, 10):
        dataset = "fashion"
    if dataset == "fashion" and not hasattr(tok, "bytes_to_tokens"):
        return None, "the tokenizer does not map pixels to tokens (not a palette tokenizer)"
    if dataset == "emoji" and not isinstance(tok, VQTokenizer):
        return None, "no VQ tokenizer to turn the emoji into tokens"
    if dataset not in ("fashion", "emoji"):
        return None, "no held-out images for this model (they exist for the shipped models and fashion-like ones)"
    try:
        held = fashion_heldout(tok) if dataset == "fashion" else emoji_heldout(tok)
    except (FashionDataError, EmojiDataError) as e:
        return None, f"its held-out images are not installed ({e})"
    seen: dict[int, int] = {}
    pick = []
    for c in classes:
        idx = (held.cond == c).nonzero()[:, 0]
        if len(idx) == 0:
            return None, f"the held-out images have none of class {c}"
        j = seen.get(c, 0)
        seen[c] = j + 1
        pick.append(int(idx[j % len(idx)]))
    tokens = held.tokens[pick]  # (B, N)
    if tokens.shape[1] != cfg.image_tokens or int(tokens.max()) >= cfg.vocab_size:
        return None, "the tokenizer's tokens do not fit the model (length or vocabulary)"
    return tokens, f"{held.description}: images {pick} (classes {classes})"


def build_read_sets(gpt, rhos=DEFAULT_RHOS, names=None) -> tuple[list[ReadSet], dict, list[str]]:
    """Read sets of every registered policy that has one (``dense`` and the offset policies), at their
    defaults and at each ``rho`` of the sweep; the budgets of the scored policies (for the oracle).

    Returns ``(read_sets, scored, notes)``: ``scored`` maps ``"name"`` and ``"name@rho=r"`` to their
    budget dict; ``notes`` says which settings could not be built and why.
    """
    from .. import policies
    from ..policies import PolicyError

    cfg, layout = gpt.config, gpt.layout
    L, H = cfg.n_layer, cfg.n_head
    sets, scored, notes = [], {}, []
    for name in (names or policies.names()):
        base = policies.get(name)
        kind = getattr(base, "kind", "")
        settings = [("", {})]
        if kind != "dense" and "rho" in base.params():
            settings += [(f"@rho={r:.4g}", dict(rho=r)) for r in rhos]
        for suffix, params in settings:
            label = name + suffix
            try:
                pol = policies.get(name, **params)
                if suffix and pol == base:  # the sweep point is the default itself
                    continue
                if kind == "scored":
                    b = pol.budget(layout, L, H)
                    scored[label] = dict(policy=name, params=pol.params(), read=float(b.read), kept=int(b.kept),
                                         dense=int(b.dense), rho=float(b.rho))
                    continue
                pol = pol.prepare(gpt)
                rs = ReadSet.from_policy(label, pol, layout, L, H)
            except (PolicyError, TypeError, NotImplementedError) as e:
                notes.append(f"{label}: {e}")
                continue
            params_shown = {k: v for k, v in pol.params().items() if k != "table"}
            rs.info.update(policy=name, kind=kind, params=params_shown, setting=suffix.lstrip("@") or "default")
            sets.append(rs)
    return sets, scored, notes


def _oracle_budgets(layout, read_sets, scored) -> list[int]:
    dense = layout.prefix_len + layout.image_tokens - 1
    grid = {max(1, round(dense * r)) for r in (1 / 256, 1 / 128, 1 / 64, 1 / 32, 1 / 16, 1 / 12, 1 / 8, 1 / 6,
                                                1 / 4, 1 / 3, 1 / 2, 2 / 3, 3 / 4, 1.0)}
    grid.update(int(rs.info["kept"]) for rs in read_sets if "kept" in rs.info)
    grid.update(int(b["kept"]) for b in scored.values())
    return sorted(b for b in grid if 1 <= b <= dense)


def _choose_heads(summary: dict, phase: str, n: int = 4) -> list[tuple[int, int, str]]:
    """A few telling heads: the most local-window-bound, the most diagonal, the broadest, the most
    content-driven, the most prompt/sink-bound (the first ``n`` distinct ones)."""
    ph = summary["phases"][phase]
    layers, heads = summary["layers"], summary["heads"]
    lb = torch.tensor(ph["heads"]["local_band_share"], dtype=torch.float64)
    pes = torch.tensor([[float("nan") if v is None else v for v in r] for r in ph["heads"]["position_share"]],
                       dtype=torch.float64)
    ps = torch.tensor(ph["mass"]["prompt"]["per_head"], dtype=torch.float64) + torch.tensor(
        ph["mass"]["sinks"]["per_head"], dtype=torch.float64)
    picks = []

    def add(flat: int, why: str):
        li, hi = divmod(flat, lb.shape[1])
        key = (layers[li], heads[hi])
        if key not in [(a, b) for a, b, _ in picks]:
            picks.append((*key, why))

    bands = torch.tensor(ph["mass"]["bands"]["per_head"], dtype=torch.float64)
    local = torch.tensor(ph["mass"]["local"]["per_head"], dtype=torch.float64)
    add(int(local.argmax()), "most local-window mass")
    add(int(bands.argmax()), "most band mass")
    add(int(lb.argmin()), "broadest")
    add(int(torch.nan_to_num(pes, nan=2.0).argmin()), "most content-driven")
    add(int(ps.argmax()), "most prompt/sink mass")
    return picks[:n]


# -- the measurement ------------------------------------------------------------------------------


@torch.no_grad()
def analyze(gpt, tok=None, *, num_images: int = 8, classes=None, cond=None, real_tokens="auto", steps=None,
            layers=None, heads=None, config: MetricConfig | None = None, cfg_scale: float = 4.0,
            temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int = 0, device=None, dtype=None,
            policies: bool = True, rhos=DEFAULT_RHOS, control: bool = True, progress: bool = True,
            model_name: str = "") -> Analysis:
    """Measure where ``gpt`` attends, in prefill (teacher forcing on real images) and decode (cached
    generation of its own samples); see the module docstring for the phases.

    Parameters
    ----------
    gpt, tok : the model and its tokenizer (used to tokenise the held-out images only).
    num_images : sequences per phase.
    classes : c2i class labels (cycled to ``num_images``; default 0, 1, 2, ...).
    cond : conditions instead of ``classes`` (t2i: caption features (B, P, C); default: the
        unconditional caption, without guidance).
    real_tokens : "auto" (held-out images of the data the model was trained on: :func:`held_out_tokens`),
        None (own samples), or (B, N) tokens.
    steps : image indices of the recorded queries (both phases); default all.
    layers, heads : which to record (default all).
    config : metric parameters.
    cfg_scale, temperature, top_k, top_p, seed : sampling of the decode phase.
    device, dtype : where to run (default: CUDA if available; bf16 on CUDA, fp32 on CPU).
    policies : measure the recall of the registered policies (offset policies swept over ``rhos``).
    control : also run ``prefill-own`` (teacher forcing over the generated tokens).
    """
    from tqdm.auto import tqdm

    from ..engine.generator import Generator

    t0 = time.perf_counter()
    cfg = gpt.config
    layout = gpt.layout
    gen = Generator(gpt, tok, device=device, dtype=dtype, cuda_graphs=False, compile=False)
    gpt = gen.gpt
    dev = gen.device
    notes: list[str] = []
    bar = tqdm(total=6 if control else 5, desc="analyze", unit="stage", disable=not progress)

    # conditions
    if cond is None:
        if cfg.model_type == "c2i":
            base = list(classes) if classes else list(range(cfg.num_classes))
            cls_list = [int(base[i % len(base)]) for i in range(num_images)]
            cond = torch.tensor(cls_list)
        else:
            cls_list = None
            cond = gpt.cls_embedding.uncond_embedding.detach().float().cpu()[None].expand(num_images, -1, -1).clone()
            if cfg_scale != 1.0:
                notes.append("t2i model without caption features: sampled from the unconditional caption, guidance off")
                cfg_scale = 1.0
    else:
        cond = torch.as_tensor(cond)
        cls_list = cond.tolist() if cfg.model_type == "c2i" else None
    B = cond.shape[0]

    # policies
    bar.set_postfix_str("policies")
    read_sets, scored, pol_notes = build_read_sets(gpt, rhos) if policies else ([], {}, [])
    notes += [f"policy setting skipped: {n}" for n in pol_notes]
    budgets = _oracle_budgets(layout, read_sets, scored)
    stats = AttentionStats(layout, cfg.n_layer, cfg.n_head, layers=layers, heads=heads, config=config,
                           read_sets=read_sets, oracle_budgets=budgets)
    bar.update()

    # decode: the engine's cached generation, guided
    bar.set_postfix_str("decode")
    t = time.perf_counter()
    with AttentionCapture(gpt, stats, steps=steps) as cap:
        gen_tokens = capture_decode(gen, cap, cond, cfg_scale=cfg_scale, temperature=temperature, top_k=top_k,
                                    top_p=top_p, seed=seed, progress=progress).cpu()
    t_decode = time.perf_counter() - t
    bar.update()

    # prefill: teacher forcing on real images (or on the samples)
    bar.set_postfix_str("prefill")
    real_note = "given tokens"
    if isinstance(real_tokens, str):
        if real_tokens != "auto":
            raise ValueError(f"real_tokens must be 'auto', None or a tensor, got {real_tokens!r}")
        real_tokens, real_note = (held_out_tokens(gpt, tok, cls_list, model_name) if cls_list is not None
                                  else (None, "a t2i model has no real images here"))
    elif real_tokens is None:
        real_note = "real images not requested"
    if real_tokens is not None:
        real_tokens = torch.as_tensor(real_tokens).long()
        if real_tokens.shape != (B, cfg.image_tokens):
            raise ValueError(f"real tokens must be ({B}, {cfg.image_tokens}), got {tuple(real_tokens.shape)}")
        prefill_tokens, prefill_source = real_tokens, "real"
    else:
        prefill_tokens, prefill_source = gen_tokens, "own samples"
        notes.append(f"prefill runs on the model's own samples ({real_note}): decode minus prefill is float "
                     f"rounding only")
    t = time.perf_counter()
    with AttentionCapture(gpt, stats, steps=steps) as cap:
        logits = capture_teacher_forced(gpt, cap, cond, prefill_tokens, "prefill")
    nll = _bits(logits, prefill_tokens.to(logits.device))
    t_prefill = time.perf_counter() - t
    bar.update()

    nll_own = None
    if control and prefill_source == "real":
        bar.set_postfix_str("prefill-own")
        with AttentionCapture(gpt, stats, steps=steps) as cap:
            logits = capture_teacher_forced(gpt, cap, cond, gen_tokens, "prefill-own")
        nll_own = _bits(logits, gen_tokens.to(logits.device))
    if control:
        bar.update()

    bar.set_postfix_str("summary")
    summary = stats.summary()
    # sequence i of both phases has condition i (a real image of class c vs a sample of class c): paired
    asym = asymmetry(summary, "decode", "prefill", paired=True)
    ctl = None
    if "prefill-own" in summary["phases"]:
        d = asymmetry(summary, "decode", "prefill-own")
        ctl = dict(max_abs_mass_diff=max(abs(v) for c in CATEGORIES for v in _flat(d["mass"][c]["per_head"])),
                   max_abs_recall_diff=max([abs(v) for r in d["recall"].values() for v in _flat(r["per_head"])],
                                           default=0.0),
                   max_abs_keys90_diff=max(abs(v) for v in _flat(d["coverage"]["keys"]["per_head"])))
    bar.update()

    # full maps of a few heads, sequence 0, for the figures
    bar.set_postfix_str("maps")
    shown = _choose_heads(summary, "decode")
    keep = [(li, h) for li, h, _ in shown]
    mstats = AttentionStats(layout, cfg.n_layer, cfg.n_head, layers=sorted({li for li, _ in keep}), heads=None,
                            config=config, keep=keep, keep_rows=1)
    with AttentionCapture(gpt, mstats) as cap:
        capture_teacher_forced(gpt, cap, cond[:1], prefill_tokens[:1], "prefill")
        capture_teacher_forced(gpt, cap, cond[:1], gen_tokens[:1], "decode")
    maps = {k: v[0] for k, v in mstats.maps.items()}
    bar.update()
    bar.close()

    r, c = layout.grid_h // 2, layout.grid_w // 2
    pixel = tok is not None and hasattr(tok, "tokens_to_bytes")
    meta = dict(model=model_name, config=dataclasses.asdict(cfg), layout=summary["layout"],
                num_images=B, conditions=cls_list if cls_list is not None else "captions",
                prefill_source=prefill_source, prefill_data=real_note,
                sampling=dict(cfg_scale=cfg_scale, temperature=temperature, top_k=top_k, top_p=top_p, seed=seed),
                steps="all" if steps is None else sorted(int(s) for s in steps),
                device=str(dev), dtype=str(gen.dtype).replace("torch.", ""), torch=torch.__version__,
                python=platform.python_version(), date=time.strftime("%Y-%m-%d"),
                nll_bits_per_token=dict(prefill=nll, prefill_own=nll_own), pixel_tokens=pixel,
                seconds=dict(total=round(time.perf_counter() - t0, 1), decode=round(t_decode, 1),
                             prefill=round(t_prefill, 1)))
    return Analysis(summary=summary, asymmetry=asym, meta=meta, control=ctl, maps=maps, shown_heads=shown,
                    query_pos=layout.position(r, c),
                    images={p: (tok.tokens_to_bytes(t[0]) if pixel else t[0]).view(layout.grid_h, layout.grid_w)
                            for p, t in (("prefill", prefill_tokens), ("decode", gen_tokens))},
                    policies={rs.name: rs.info for rs in read_sets}, scored=scored, notes=notes)


def _bits(logits: torch.Tensor, tokens: torch.Tensor) -> float:
    ce = torch.nn.functional.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), tokens.reshape(-1))
    return round(float(ce) / math.log(2), 4)


def _flat(x):
    if isinstance(x, list):
        for v in x:
            yield from _flat(v)
    elif x is not None:
        yield x


# -- writing --------------------------------------------------------------------------------------


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.1f}"


def _num(x, nd=1) -> str:
    return "–" if x is None else f"{x:.{nd}f}"


def write_report(a: Analysis, out, command: str = "", figures: bool = True) -> dict:
    """Write ``stats.json``, the figures and ``report.md`` to ``out``; returns the paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    figs = {}
    if figures:
        from . import plots

        figs = plots.draw_all(a, out)
    stats = dict(meta=dict(a.meta, command=command), notes=a.notes, summary=a.summary, asymmetry=a.asymmetry,
                 control=a.control, policies=a.policies, scored_policies=a.scored,
                 shown_heads=[dict(layer=li, head=h, why=w) for li, h, w in a.shown_heads],
                 query_position=a.query_pos, figures={k: Path(v).name for k, v in figs.items()})
    (out / "stats.json").write_text(json.dumps(stats, separators=(",", ":")) + "\n")
    (out / "report.md").write_text(render_markdown(a, figs, command))
    return dict(report=out / "report.md", stats=out / "stats.json", **figs)


def _concentration(ph: dict) -> float:
    """Mass on prompt + sinks + local window + bands: what a diagonal-style read set targets."""
    return sum(ph["mass"][c]["overall"] for c in ("prompt", "sinks", "local", "bands"))


def render_markdown(a: Analysis, figs: dict, command: str = "") -> str:
    s, m = a.summary, a.meta
    lay, cfg = s["layout"], s["config"]
    phases = [p for p in ("prefill", "decode", "decode-uncond", "prefill-own") if p in s["phases"]]
    P = {p: s["phases"][p] for p in phases}
    W, K, D = lay["row_stride"], cfg["band_rows"], cfg["band_width"]
    L = []
    w = L.append
    name = m["model"] or "model"
    w(f"# Attention characterization: {name}\n")
    w(f"Generated by `arsparse analyze` on {m['date']} ({m['device']}, {m['dtype']}, torch {m['torch']}); "
      f"{m['seconds']['total']:.0f} s in all.")
    if command:
        w(f"\n```bash\n{command}\n```")
    w("")
    w("## What was measured\n")
    w(f"Model: {lay['grid_h']}x{lay['grid_w']} tokens (row stride {W}) after a prompt of {lay['prefix_len']} "
      f"condition token(s); {m['config']['n_layer']} layers x {m['config']['n_head']} heads; "
      f"{m['num_images']} sequences per phase, conditions {m['conditions']}.\n")
    w("Phases (each *query* is one image position attending to every earlier key, prompt included; "
      "prompt queries are not counted):\n")
    w(f"- **prefill** — one teacher-forced forward over the condition and the image tokens of "
      f"**{'real images: ' + m['prefill_data'] if m['prefill_source'] == 'real' else 'the model’s own samples'}**, "
      f"conditional rows only, no guidance: the parallel pass that training and prompt prefill compute "
      f"(teacher-forced NLL {m['nll_bits_per_token']['prefill']} bits/token).")
    w(f"- **decode** — the engine's cached generation (`Generator.sample_tokens`, dense KV cache) of the "
      f"model's **own samples** with classifier-free guidance {m['sampling']['cfg_scale']}, temperature "
      f"{m['sampling']['temperature']}, seed {m['sampling']['seed']}: at every step the weights of the "
      f"step's query over the cached keys, conditional rows.")
    if "decode-uncond" in P:
        w("- **decode-uncond** — the same steps, the guidance rows (null condition, same tokens).")
    if "prefill-own" in P:
        w("- **prefill-own** (control) — a teacher-forced pass over the generated tokens. It is the same function "
          "as decode in exact arithmetic; measured differences: "
          f"mass {a.control['max_abs_mass_diff']:.1e}, recall {a.control['max_abs_recall_diff']:.1e}, "
          f"keys@90% {a.control['max_abs_keys90_diff']:.2f} (max over heads). So **decode − prefill is the effect "
          f"of the data** (real images vs guided own samples), not of the computation path.")
    for n in a.notes:
        w(f"- Note: {n}")
    w("")
    w(f"Key categories (a partition, first match wins): **prompt** (condition tokens), **sinks** (first "
      f"{cfg['sinks']} image tokens), **local** (last {cfg['local']} positions, the query included), "
      f"**bands** (key = q − k·{W} + δ, k = 1..{K}, |δ| ≤ {D}; δ = 0 straight above, δ > 0 to the right), "
      f"**rest**. Coverage: keys (by decreasing weight) needed for 90/95/99 % of a query's mass.\n")

    # overall table
    w("## Where the mass goes\n")
    w("| phase | prompt % | sinks % | local % | bands % | rest % | keys for 90 % | 95 % | 99 % | mean causal keys |")
    w("|---|---|---|---|---|---|---|---|---|---|")
    for p in phases:
        ph = P[p]
        nq = ph["queries_by_row"]
        mean_keys = sum(k * n for k, n in zip(ph["coverage"]["causal_keys_by_row"], nq) if k is not None) / max(sum(nq), 1)
        ks = ph["coverage"]["keys"]["overall"]
        w(f"| {p} | " + " | ".join(_pct(ph["mass"][c]["overall"]) for c in CATEGORIES)
          + " | " + " | ".join(_num(k) for k in ks) + f" | {mean_keys:.0f} |")
    asy = a.asymmetry
    se = asy.get("stderr", {})
    w("| decode − prefill | " + " | ".join(f"{100 * asy['mass'][c]['overall']:+.2f}" for c in CATEGORIES) + " | "
      + " | ".join(f"{k:+.1f}" for k in asy["coverage"]["keys"]["overall"]) + " | |")
    if se.get("mass") and None not in se["mass"].values():
        w("| its standard error | " + " | ".join(f"{100 * se['mass'][c]:.2f}" for c in CATEGORIES) + " | "
          + " | ".join(_num(k) for k in se["keys"]) + " | |")
    w("")
    w("Standard error of the difference from its spread over the sequences, paired by condition (sequence i of "
      "both phases has the same condition; each sequence's mean over layers, heads and queries; `stats.json` → "
      "`per_sequence`).\n")
    cp, cd = _concentration(P["prefill"]), _concentration(P["decode"])
    w(f"Prompt + sinks + local + bands: prefill {100 * cp:.1f} %, decode {100 * cd:.1f} % "
      f"({'more' if cd > cp else 'less'} in decode by {100 * abs(cd - cp):.1f} points).\n")
    if "mass" in figs:
        w(f"![per-head mass]({Path(figs['mass']).name})\n")
        w("Per (layer, head): the stacked shares of the five categories, prefill (top) and decode (bottom).\n")

    # offsets and bands
    w("## Offsets and diagonal bands\n")
    for p in ("prefill", "decode"):
        prof = P[p]["offset_profile"]["overall"]
        top = sorted(((v, o) for o, v in enumerate(prof) if v is not None), reverse=True)[:10]
        w(f"- {p}: largest mean mass per reaching query at backward offsets "
          + ", ".join(f"{o} ({_offset_name(o, W)}: {100 * v:.2f} %)" for v, o in top) + ".")
    w("")
    if "offsets" in figs:
        w(f"![mass by offset]({Path(figs['offsets']).name})\n")
        w(f"Mean attention per query at each backward offset (image keys, averaged over heads and layers); dashed "
          f"lines at multiples of the row width {W}.\n")
    if K:
        w("Band map (mean mass per query at key = q − k·W + δ, all heads and layers), in %:\n")
        w("| k \\ δ | " + " | ".join(str(d) for d in range(-D, D + 1)) + " |")
        w("|---|" + "---|" * (2 * D + 1))
        for p in ("prefill", "decode"):
            for ki, row in enumerate(P[p]["bands"]["overall"]):
                w(f"| {p} k={ki + 1} | " + " | ".join(f"{100 * v:.2f}" for v in row) + " |")
        w("")
    if "bands" in figs:
        w(f"![band map]({Path(figs['bands']).name})\n")

    # coverage
    w("## How many keys a query needs\n")
    w("Keys needed for 90 % of the mass, by image row of the query (mean over heads and layers), against the "
      "keys a query can read:\n")
    w("| row | " + " | ".join(f"{p} 90 %" for p in ("prefill", "decode")) + " | causal keys |")
    w("|---|---|---|---|")
    R = lay["grid_h"]
    for r in sorted({0, 1, 2, R // 4, R // 2, 3 * R // 4, R - 1}):
        vals = [P[p]["coverage"]["keys"]["by_row"][r][0] for p in ("prefill", "decode")]
        ck = P["decode"]["coverage"]["causal_keys_by_row"][r]
        w(f"| {r} | " + " | ".join(_num(v) for v in vals) + f" | {_num(ck, 0)} |")
    w("")
    if "coverage" in figs:
        w(f"![coverage]({Path(figs['coverage']).name})\n")

    # per layer
    w("## Per layer\n")
    w("| layer | prefill local+bands % | decode local+bands % | prefill rest % | decode rest % | "
      "prefill keys 90 % | decode keys 90 % |")
    w("|---|---|---|---|---|---|---|")
    for i, li in enumerate(s["layers"]):
        lbp = P["prefill"]["mass"]["local"]["per_layer"][i] + P["prefill"]["mass"]["bands"]["per_layer"][i]
        lbd = P["decode"]["mass"]["local"]["per_layer"][i] + P["decode"]["mass"]["bands"]["per_layer"][i]
        w(f"| {li} | {_pct(lbp)} | {_pct(lbd)} | {_pct(P['prefill']['mass']['rest']['per_layer'][i])} | "
          f"{_pct(P['decode']['mass']['rest']['per_layer'][i])} | "
          f"{_num(P['prefill']['coverage']['keys']['per_layer'][i][0])} | "
          f"{_num(P['decode']['coverage']['keys']['per_layer'][i][0])} |")
    w("")

    # heads
    w("## Head classes\n")
    w(f"*Local* heads put at least {100 * cfg['local_threshold']:.0f} % of their mass on the local window and the "
      f"bands, *broad* ones less. *Spatial* heads have a position-explained share of at least "
      f"{100 * cfg['spatial_threshold']:.0f} % (within a query row, the attention at each offset is the same for "
      f"every query), *semantic* ones less (where they look depends on content). Stability: the share of queries "
      f"whose row alone gives the head the same class.\n")
    w("| phase | local | broad | spatial | semantic | local/broad stability | spatial/semantic stability |")
    w("|---|---|---|---|---|---|---|")
    for p in phases:
        hd = P[p]["heads"]
        c = hd["counts"]
        w(f"| {p} | {c['local']} | {c['broad']} | {c['spatial']} | {c['semantic']} | "
          f"{_pct(hd['mean_local_stability'])} % | {_pct(hd['mean_spatial_stability'])} % |")
    w("")
    w(f"Heads with the same class in prefill and decode: local/broad {_pct(asy['same_local_class'])} %, "
      f"spatial/semantic {_pct(asy['same_spatial_class'])} %.\n")
    w("| layer | " + " | ".join(f"h{h}" for h in s["heads"]) + " |")
    w("|---|" + "---|" * len(s["heads"]))
    hp, hd = P["prefill"]["heads"], P["decode"]["heads"]
    for i, li in enumerate(s["layers"]):
        cells = []
        for j in range(len(s["heads"])):
            cells.append(f"{hd['local_class'][i][j][0].upper()}{hd['spatial_class'][i][j][:3]} "
                         f"{_pct(hd['local_band_share'][i][j])}/{_pct(hp['local_band_share'][i][j])}")
        w(f"| {li} | " + " | ".join(cells) + " |")
    w("\nCell: decode class (L/B = local/broad, spa/sem), then local+bands % in decode / prefill.\n")
    if "maps" in figs:
        w(f"![attention maps]({Path(figs['maps']).name})\n")
        w("Attention maps (log scale; rows = queries, columns = keys) of sequence 0 for the heads listed: "
          + "; ".join(f"layer {li} head {h} ({why})" for li, h, why in a.shown_heads)
          + f". Prefill on the {'real' if m['prefill_source'] == 'real' else 'generated'} image, decode on the "
            "generated one (its cached-decode attention, recomputed in one teacher-forced pass over the same tokens: "
            "the same function up to float rounding).\n")
    if "query" in figs:
        r, c = divmod(a.query_pos - lay["prefix_len"], W)
        w(f"![one query]({Path(figs['query']).name})\n")
        w(f"One query (row {r}, column {c}, marked) laid back onto the image grid, same heads; keys after the "
          f"query are blank" + (". First column: the image." if m.get("pixel_tokens") else ".") + "\n")

    # policies
    if P["decode"]["recall"] or a.scored:
        w("## Policy recall\n")
        w("Share of the dense attention mass that each offset policy's read set captures (mean over queries, heads "
          "and layers), at its defaults and across its `rho` sweep, and the oracle top-k (the k heaviest keys of "
          "each query, k = the policy's kept entries) at the same budget.\n")
        w("| setting | read | kept | rho | recall prefill % | recall decode % | oracle top-k decode % |")
        w("|---|---|---|---|---|---|---|")
        orc_d = P["decode"]["oracle"]
        for nm, info in a.policies.items():
            ora = _oracle_at(orc_d, info.get("kept"))
            w(f"| {nm} | {_num(info.get('read'))} | {info.get('kept', '–')} | {_num(info.get('rho'), 3)} | "
              f"{_pct(P['prefill']['recall'][nm]['overall'])} | {_pct(P['decode']['recall'][nm]['overall'])} | "
              f"{_pct(ora)} |")
        w("")
        if a.scored:
            w("Scored policies choose their kept set from the attention seen so far; the oracle top-k at their kept "
              "budget is an upper bound on what any such set can capture:\n")
            w("| kept | rho | scored settings at this budget | oracle top-k prefill % | oracle top-k decode % |")
            w("|---|---|---|---|---|")
            by_kept: dict[int, list[str]] = {}
            for nm, b in a.scored.items():
                by_kept.setdefault(b["kept"], []).append(nm)
            for kept in sorted(by_kept):
                b = a.scored[by_kept[kept][0]]
                w(f"| {kept} | {b['rho']:.3f} | {', '.join(by_kept[kept])} | "
                  f"{_pct(_oracle_at(P['prefill']['oracle'], kept))} | {_pct(_oracle_at(orc_d, kept))} |")
            w("")
        if "recall" in figs:
            w(f"![recall]({Path(figs['recall']).name})\n")

    # expectation
    w("## Expectation check\n")
    w("Expectation: *decode attention concentrates on the prompt, the local window and the first diagonal bands, "
      "more than prefill attention does.*\n")
    w("| quantity | prefill | decode | decode − prefill (± s.e.) | expected in decode | observed |")
    w("|---|---|---|---|---|---|")
    for label, vp, vd, want, unit, err in expectation_rows(a):
        got = "higher" if vd > vp else "lower" if vd < vp else "equal"
        ok = "agrees" if got == want else "**disagrees**"
        if err is not None and abs(vd - vp) < 2 * err:
            ok += ", within 2 s.e."
        k = 100 if unit == "%" else 1
        fmt = (lambda v: f"{100 * v:.2f} %") if unit == "%" else (lambda v: f"{v:.1f}")
        diff = f"{k * (vd - vp):+.2f}" + (f" ± {k * err:.2f}" if err is not None else "")
        w(f"| {label} | {fmt(vp)} | {fmt(vd)} | {diff} | {want} | {got} ({ok}) |")
    w("")

    # findings
    w("## Findings\n")
    for line in findings(a):
        w(f"- {line}")
    w("")
    w("All numbers: `stats.json` (per phase, layer and head; `asymmetry` = decode − prefill).")
    return "\n".join(L) + "\n"


def _oracle_at(orc: dict, kept):
    if not orc or kept is None or kept not in orc["budgets"]:
        return None
    return orc["overall"][orc["budgets"].index(kept)]


def _offset_name(o: int, W: int) -> str:
    if o == 0:
        return "itself"
    k = round(o / W)
    d = k * W - o
    if k == 0 or abs(d) > W // 4:
        return f"{o} back"
    return f"k={k}, δ={d:+d}"


def expectation_rows(a: Analysis) -> list[tuple]:
    """(label, prefill, decode, expected direction in decode, unit) for the expectation check."""
    P, D = a.summary["phases"]["prefill"], a.summary["phases"]["decode"]

    def band1(ph):
        rows = ph["bands"]["overall"]
        return sum(rows[0]) if rows else 0.0

    cfg = a.summary["config"]
    se = a.asymmetry.get("stderr", {"mass": {}, "keys": [None]})
    sm = se["mass"]
    conc = None
    if all(sm.get(c) is not None for c in ("rest",)):
        conc = sm["rest"]  # prompt + sinks + local + bands = 1 - rest, per sequence too
    return [
        ("prompt mass", P["mass"]["prompt"]["overall"], D["mass"]["prompt"]["overall"], "higher", "%", sm.get("prompt")),
        (f"local window (last {cfg['local']})", P["mass"]["local"]["overall"], D["mass"]["local"]["overall"], "higher",
         "%", sm.get("local")),
        (f"first band (k = 1, δ in ±{cfg['band_width']}, raw)", band1(P), band1(D), "higher", "%", None),
        ("all bands (partition)", P["mass"]["bands"]["overall"], D["mass"]["bands"]["overall"], "higher", "%",
         sm.get("bands")),
        ("prompt + sinks + local + bands", _concentration(P), _concentration(D), "higher", "%", conc),
        ("rest of the image", P["mass"]["rest"]["overall"], D["mass"]["rest"]["overall"], "lower", "%", sm.get("rest")),
        ("keys for 90 % of the mass", P["coverage"]["keys"]["overall"][0], D["coverage"]["keys"]["overall"][0],
         "lower", "keys", se["keys"][0] if se["keys"] else None),
    ]


def _matched(a: Analysis, phase: str, rho: float = 0.125) -> list[tuple]:
    """Per offset policy, the setting whose rho is closest to ``rho``: (name, info, recall)."""
    best: dict[str, tuple] = {}
    rec = a.summary["phases"][phase]["recall"]
    for nm, info in a.policies.items():
        if info.get("kind") == "dense" or "rho" not in info:
            continue
        d = abs(math.log(info["rho"] / rho))
        pol = info.get("policy", nm)
        if pol not in best or d < best[pol][0]:
            best[pol] = (d, nm, info, rec[nm]["overall"])
    return [v[1:] for v in sorted(best.values(), key=lambda v: -v[3])]


def findings(a: Analysis) -> list[str]:
    """Plain-words findings with numbers, including where the data disagrees with the expectation
    "decode attention concentrates on the prompt, the local window and the first bands more than prefill"."""
    s = a.summary
    P, D = s["phases"]["prefill"], s["phases"]["decode"]
    out = []
    cp, cd = _concentration(P), _concentration(D)
    rest_p, rest_d = P["mass"]["rest"]["overall"], D["mass"]["rest"]["overall"]
    out.append(f"Prompt + sinks + local + bands hold {100 * cp:.1f} % of the mass in prefill and {100 * cd:.1f} % in "
               f"decode; the rest of the image holds {100 * rest_p:.1f} % / {100 * rest_d:.1f} %.")
    err = (a.asymmetry.get("stderr") or {}).get("mass", {}).get("rest")
    pm = f" ± {100 * err:.1f}" if err is not None else ""
    if cd > cp + 0.005:
        out.append(f"As expected, decode concentrates more than prefill, but only by {100 * (cd - cp):+.1f}{pm} points.")
    elif cd < cp - 0.005:
        out.append(f"Contrary to the expectation, decode concentrates *less* than prefill ({100 * (cd - cp):+.1f}{pm} points).")
    else:
        out.append(f"Decode and prefill concentrate about equally ({100 * (cd - cp):+.1f}{pm} points): no asymmetry to exploit.")
    for c in ("prompt", "local", "bands"):
        dp, dd = P["mass"][c]["overall"], D["mass"][c]["overall"]
        verdict = "more" if dd > dp else "less"
        out.append(f"{c.capitalize()}: {100 * dp:.2f} % prefill vs {100 * dd:.2f} % decode ({verdict} in decode).")
    if P["mass"]["prompt"]["overall"] < 0.05:
        out.append("The prompt gets little mass in both phases: LlamaGen zeroes q and k at condition positions "
                   "(RoPE table (0, 0)), so the prompt key scores 0 against every query and gets exp(0)/Z.")
    kp, kd = P["coverage"]["keys"]["overall"][0], D["coverage"]["keys"]["overall"][0]
    out.append(f"A query needs {kp:.1f} keys (prefill) / {kd:.1f} (decode) on average for 90 % of its mass.")
    top = sorted(((v, o) for o, v in enumerate(D["offset_profile"]["overall"]) if v is not None and o > 0),
                 reverse=True)[:6]
    W = s["layout"]["row_stride"]
    out.append("The heaviest backward offsets in decode: " + ", ".join(
        f"{o} ({_offset_name(o, W)}, {100 * v:.1f} %)" for v, o in top) + " per query.")
    kr = D["coverage"]["keys"]["by_row"]
    ck = D["coverage"]["causal_keys_by_row"]
    if kr and None not in (kr[0][0], kr[-1][0], ck[0], ck[-1]):
        out.append(f"Keys for 90 % grow with the position: {kr[0][0]:.1f} in the first row, {kr[-1][0]:.1f} in the "
                   f"last (of {ck[0]:.0f} and {ck[-1]:.0f} readable): a fixed-size read set covers less and less.")
    if D["recall"]:
        m = _matched(a, "decode")
        orc = D["oracle"]
        if m:
            parts = [f"{nm} {100 * r:.1f} % (reads {info['read']:.0f}, keeps {info['kept']})" for nm, info, r in m]
            kept = max(info["kept"] for _, info, _ in m)
            ora = _oracle_at(orc, kept)
            out.append("Recall in decode near rho = 1/8: " + "; ".join(parts)
                       + (f"; the oracle top-{kept} captures {100 * ora:.1f} %" if ora is not None else "")
                       + ". The mass is concentrated, but on keys chosen by content more than by fixed offsets.")
    hd = D["heads"]["counts"]
    out.append(f"Decode heads: {hd['local']} local / {hd['broad']} broad, {hd['spatial']} spatial / {hd['semantic']} "
               f"semantic; class stability across rows {100 * D['heads']['mean_local_stability']:.0f} % "
               f"(local/broad), {100 * D['heads']['mean_spatial_stability']:.0f} % (spatial/semantic); "
               f"{100 * a.asymmetry['same_local_class']:.0f} % of heads keep their local/broad class from prefill to decode.")
    return out
