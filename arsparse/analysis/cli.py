"""``arsparse analyze``: measure where a model attends and write ``report.md``, ``stats.json`` and figures."""
from __future__ import annotations

import argparse
import shlex
import sys
import time
from pathlib import Path

from ..cliargs import add_model_args, build_model, finite_float, int_list, load_features, need_extra

__all__ = ["add_analyze_parser", "cmd_analyze", "parse_steps"]


def _float_list(text: str) -> list[float]:
    try:
        out = []
        for x in text.split(","):
            x = x.strip()
            if x:
                num, _, den = x.partition("/")
                out.append(float(num) / float(den) if den else float(num))
        return out
    except (ValueError, ZeroDivisionError):
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 1/16,0.125, got {text!r}") from None


def parse_steps(text: str | None, n_steps: int) -> list[int] | None:
    """``"all"`` / None -> None; else comma-separated items ``i``, ``a-b`` (inclusive) or ``a:b[:s]``
    (Python slice, either end optional) -> sorted image indices in 0..n_steps-1."""
    if text is None or text.strip().lower() == "all":
        return None
    out: set[int] = set()
    for item in text.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            if ":" in item:
                parts = [int(p) if p.strip() else None for p in item.split(":")]
                if len(parts) > 3:
                    raise ValueError
                out.update(range(n_steps)[slice(*parts)])
            elif "-" in item[1:]:
                a, b = item.split("-", 1)
                out.update(range(int(a), int(b) + 1))
            else:
                out.add(int(item))
        except ValueError:
            raise ValueError(f"--decode-steps: cannot read {item!r} (use e.g. all, 0:783:4, 10-20, 5)") from None
    bad = sorted(i for i in out if not 0 <= i < n_steps)
    if bad:
        raise ValueError(f"--decode-steps: {bad[:5]} out of range 0..{n_steps - 1} (image index of the query token)")
    if not out:
        raise ValueError("--decode-steps selects no step")
    return sorted(out)


def cmd_analyze(args) -> int:
    import torch

    from ..checkpoint import check_output_file
    from ..engine.generator import sampling_rows
    from .metrics import MetricConfig
    from .report import DEFAULT_RHOS, analyze, write_report

    bad = [r for r in args.rho or [] if not 0 < r <= 1]
    if bad:
        raise ValueError(f"--rho: {bad} out of range; each rho (kept / dense) must be in (0, 1]")
    # (checked before the work, whose results would otherwise be lost at the end)
    check_output_file(Path(args.out) / "stats.json", suffix=".json")
    need_extra("plots", "analyze draws figures and needs", "matplotlib")
    gpt, tok, name, cfg_scale = build_model(args, need_tokenizer=False)
    cfg = gpt.config
    cfg_scale = cfg_scale if args.cfg_scale is None else args.cfg_scale
    sampling_rows(1, cfg_scale=cfg_scale, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    cond = None
    if cfg.model_type == "c2i" and args.caption_features:
        raise ValueError("--caption-features is for text-conditional (t2i) models; this one is class-conditional: "
                         "give --classes")
    if cfg.model_type == "t2i" and args.caption_features:
        feats = load_features(args.caption_features)
        cond = feats[torch.arange(args.num_images) % feats.shape[0]]
    if args.classes and cfg.model_type == "c2i":
        bad = [c for c in args.classes if not 0 <= c < cfg.num_classes]
        if bad:
            raise ValueError(f"classes {bad} are out of range: this model has classes 0..{cfg.num_classes - 1}")
    if args.num_images < 1:
        raise ValueError(f"--num-images must be >= 1, got {args.num_images}")
    steps = parse_steps(args.decode_steps, cfg.image_tokens - 1)
    config = MetricConfig(sinks=args.sinks, local=args.local, band_rows=args.band_rows, band_width=args.band_width)
    t0 = time.perf_counter()
    a = analyze(gpt, tok, num_images=args.num_images, classes=args.classes, cond=cond,
                real_tokens="auto" if args.real == "auto" else None, steps=steps, layers=args.layers,
                heads=args.heads, config=config, cfg_scale=cfg_scale,
                temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed, device=args.device,
                dtype=args.dtype, policies=not args.no_policies, rhos=args.rho or DEFAULT_RHOS,
                control=not args.no_control, progress=not args.quiet, model_name=name)
    argv = sys.argv[1:]
    command = "arsparse " + shlex.join(argv[argv.index("analyze"):]) if "analyze" in argv else ""
    paths = write_report(a, args.out, command=command)
    print(f"wrote {paths['report']} and {paths['stats']} and {len(paths) - 2} figures "
          f"({time.perf_counter() - t0:.0f} s)")
    return 0


def add_analyze_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``analyze`` to the ``arsparse`` sub-commands; returns its parser."""
    a = subparsers.add_parser(
        "analyze", help="measure where the model attends (prefill vs decode) and write a report",
        description="Capture attention in a teacher-forced pass over real images (prefill) and in cached, guided "
                    "generation of the model's own samples (decode); write DIR/report.md, DIR/stats.json and PNG "
                    "figures: prompt / sink / local / diagonal-band mass, keys needed for 90/95/99 %% of the mass, "
                    "policy recall, head classes.")
    add_model_args(a, vq_help="VQ tokenizer for --gpt-ckpt (optional: only images need it)")
    a.add_argument("--out", required=True, help="output folder: report.md, stats.json, *.png")
    a.add_argument("--num-images", type=int, default=8, help="sequences per phase (default 8)")
    a.add_argument("--classes", type=int_list, help="c2i class labels, cycled (default 0, 1, 2, ...)")
    a.add_argument("--caption-features", help="t2i: T5 features (B, 120, 2048) file; default the empty caption")
    a.add_argument("--decode-steps", default="all",
                   help="queries to record, as image indices of the query token (0..N-2; both phases): "
                        "all (default), 0:783:4, 100-200, 5,10")
    a.add_argument("--layers", type=int_list, help="layers to record (default all)")
    a.add_argument("--heads", type=int_list, help="heads to record (default all)")
    a.add_argument("--sinks", type=int, default=4, help="first image tokens counted as sinks (default 4)")
    a.add_argument("--local", type=int, default=16, help="local window, query included (default 16)")
    a.add_argument("--band-rows", type=int, default=4, help="diagonal bands k = 1..K rows back (default 4)")
    a.add_argument("--band-width", type=int, default=4, help="band half-width D, delta in -D..D (default 4)")
    a.add_argument("--rho", type=_float_list, help="rho sweep of the offset policies (default 1/16,1/8,1/4,1/2)")
    a.add_argument("--no-policies", action="store_true", help="skip the policy recall")
    a.add_argument("--no-control", action="store_true", help="skip the prefill-own control pass")
    a.add_argument("--real", choices=["auto", "none"], default="auto",
                   help="prefill on real images when the model has them (its held-out split: the Fashion-MNIST "
                        "test set for fashion-c2i, the held-out emoji for emoji-c2i)")
    a.add_argument("--cfg-scale", type=finite_float, default=None, help="decode guidance (default: the bundle's)")
    a.add_argument("--temperature", type=finite_float, default=1.0)
    a.add_argument("--top-k", type=int, default=0)
    a.add_argument("--top-p", type=finite_float, default=1.0)
    a.add_argument("--seed", type=int, default=0)
    a.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    a.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="default: bf16 on cuda, fp32 on cpu")
    a.add_argument("--quiet", action="store_true", help="no progress bars")
    a.set_defaults(func=cmd_analyze)
    return a
