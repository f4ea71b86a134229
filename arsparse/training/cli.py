"""``arsparse train model | tokenizer``: train the models arsparse ships.

Also runnable alone: ``python -m arsparse.training.cli model --dataset fashion ...``.

Training is resumable: ``model`` writes ``<out>/ckpt.pt`` every ``--ckpt-every`` steps and
before ``--time-limit`` seconds have passed; run the same command with ``--resume`` again and
it continues where it stopped (and starts fresh when there is no checkpoint yet), until the
last step, when it writes ``<out>/model.safetensors`` and ``<out>/train_log.json``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from ..cliargs import positive_int

__all__ = ["add_train_parser", "main"]

_T0 = time.monotonic()  # process start, roughly: the time limit counts from here


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"expected a positive number, got {text!r}")
    return v


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _tokenizer_config(ds, recipe: dict, levels: int | None) -> dict:
    if ds.tokenizer_kind != "palette":
        raise ValueError(f"dataset {ds.name!r} needs a trained VQ tokenizer, and VQ tokenizer training is not "
                         "written yet (arsparse train tokenizer only handles palette data sets so far)")
    tok = dict(recipe.get("tokenizer") or {"type": "palette", "levels": 256})
    if levels is not None:
        tok["levels"] = levels
    return tok


def cmd_train_model(args) -> int:
    from .datasets import DATASETS, load_token_dataset, make_tokenizer
    from .trainer import RECIPES, recipe_config, train_gpt

    ds = DATASETS[args.dataset]
    recipe = RECIPES[ds.recipe]
    tok_cfg = _tokenizer_config(ds, recipe, args.levels)
    tokenizer = make_tokenizer(tok_cfg)
    out = args.out or str(Path("out") / ds.recipe)
    cfg = recipe_config(
        ds.recipe, out, preset=args.preset, dim=args.dim, n_layer=args.layers, n_head=args.heads,
        vocab_size=tokenizer.vocab_size, tokenizer=tok_cfg, steps=args.steps, batch_size=args.batch_size,
        lr=args.lr, warmup=args.warmup, seed=args.seed, hflip=True if args.hflip else None,
        compile=True if args.compile else None, time_limit_s=args.time_limit, ckpt_every=args.ckpt_every,
        eval_every=args.eval_every, eval_samples=args.eval_samples, device=args.device or _default_device(),
        progress=not args.quiet,
    )
    tokens, labels, val_tokens, val_labels = load_token_dataset(args.dataset, tokenizer, root=args.data_root)
    result = train_gpt(cfg, tokens, labels, val_tokens, val_labels, resume=args.resume,
                       stop_after=args.stop_after, started_at=_T0)
    summary = {"finished": result.finished, "step": result.step, "steps": cfg.steps,
               "ckpt": str(result.ckpt_path), "model": str(result.model_path) if result.model_path else None,
               "final_val_bpt": result.final_val_bpt}
    print(json.dumps(summary))
    return 0


def cmd_train_tokenizer(args) -> int:
    from .datasets import DATASETS, make_tokenizer
    from .trainer import RECIPES

    ds = DATASETS[args.dataset]
    tok_cfg = _tokenizer_config(ds, RECIPES[ds.recipe], args.levels)
    make_tokenizer(tok_cfg)  # validates
    out = Path(args.out or Path("out") / ds.recipe)
    out.mkdir(parents=True, exist_ok=True)
    path = out / "tokenizer.json"
    path.write_text(json.dumps(tok_cfg, indent=1) + "\n")
    print(f"{args.dataset}: a palette tokenizer has no weights to train; wrote its config {tok_cfg} to {path}")
    return 0


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    from .datasets import DATASETS
    from .trainer import RECIPES

    sub = parser.add_subparsers(dest="train_command", required=True, metavar="{model,tokenizer}")
    names = sorted(DATASETS)
    ds_help = "; ".join(f"{d.name}: {d.description}" for d in DATASETS.values())

    m = sub.add_parser(
        "model", help="train a class-conditional GPT on a tokenised dataset (resumable)",
        description="Train a LlamaGen-architecture GPT on a dataset. Defaults come from the dataset's recipe ("
                    + ", ".join(f"{d.name} -> {d.recipe}" for d in DATASETS.values()) + "). The run writes "
                    "<out>/ckpt.pt as it goes and stops cleanly before --time-limit; rerun the same command with "
                    "--resume to continue. At the end it writes <out>/model.safetensors (loads with "
                    "arsparse.load_gpt(path)) and <out>/train_log.json.")
    m.add_argument("--dataset", choices=names, default=names[0], help=ds_help)
    m.add_argument("--out", help="output folder (default: out/<recipe>)")
    m.add_argument("--resume", action="store_true",
                   help="continue from <out>/ckpt.pt if it exists (else start fresh); without it an existing "
                        "checkpoint is an error")
    m.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    m.add_argument("--time-limit", type=_positive_float, metavar="SECONDS",
                   help="stop with a checkpoint before this many seconds since start (e.g. 540 in a 10-minute slot)")
    m.add_argument("--stop-after", type=positive_int, metavar="STEPS", help="stop with a checkpoint after this many steps")
    g = m.add_argument_group("model (defaults from the recipe)")
    g.add_argument("--preset", help="GPT size preset the overrides apply to")
    g.add_argument("--dim", type=positive_int)
    g.add_argument("--layers", type=positive_int)
    g.add_argument("--heads", type=positive_int)
    g.add_argument("--levels", type=positive_int, help="grey levels of the palette tokenizer = vocabulary (2..256)")
    g = m.add_argument_group("optimisation (defaults from the recipe)")
    g.add_argument("--steps", type=positive_int)
    g.add_argument("--batch-size", type=positive_int)
    g.add_argument("--lr", type=_positive_float)
    g.add_argument("--warmup", type=int)
    g.add_argument("--seed", type=int)
    g.add_argument("--hflip", action="store_true", help="flip half of each batch left to right")
    g.add_argument("--compile", action="store_true", help="torch.compile the loss (off by default)")
    g.add_argument("--ckpt-every", type=positive_int)
    g.add_argument("--eval-every", type=positive_int)
    g.add_argument("--eval-samples", type=positive_int, help="validation images per evaluation (default: all)")
    m.add_argument("--data-root", help="folder holding the dataset's files (default: $ARSPARSE_DATA/<name>, "
                                       "then the system package's folder)")
    m.add_argument("--quiet", action="store_true", help="plain log lines instead of a progress bar")
    m.set_defaults(func=cmd_train_model)

    t = sub.add_parser(
        "tokenizer", help="train (or write) the dataset's image tokenizer",
        description="Palette datasets (one token per pixel, e.g. fashion) have no tokenizer weights: this writes "
                    "the palette config to <out>/tokenizer.json. Training a VQ tokenizer (for RGB datasets such "
                    "as emoji) is not written yet; such datasets fail here with a clear error.")
    t.add_argument("--dataset", choices=names, default=names[0], help=ds_help)
    t.add_argument("--out", help="output folder (default: out/<recipe>)")
    t.add_argument("--levels", type=positive_int, help="grey levels of the palette tokenizer (2..256)")
    t.set_defaults(func=cmd_train_tokenizer)
    parser.epilog = "recipes: " + ", ".join(RECIPES)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``train {model,tokenizer}`` to an ``argparse`` subparsers object; returns the ``train`` parser.

    Each leaf sets ``func`` (``args.func(args) -> int``), as the other ``arsparse`` commands.
    """
    p = subparsers.add_parser("train", help="train the GPT (and tokenizer) on a dataset from a package registry",
                              description=__doc__.split("\n\n")[0])
    _add_subcommands(p)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m arsparse.training.cli",
                                     description="Same as `arsparse train`: " + __doc__.split("\n\n")[0])
    _add_subcommands(parser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError, RuntimeError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
