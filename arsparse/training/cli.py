"""``arsparse train model | tokenizer | classifier | export``: train the models arsparse ships.

Also runnable alone: ``python -m arsparse.training.cli model --dataset fashion ...``.

Training is resumable: ``model`` and ``tokenizer`` write ``<out>/ckpt.pt`` every ``--ckpt-every``
steps and before ``--time-limit`` seconds have passed; run the same command with ``--resume``
again and it continues where it stopped (and starts fresh when there is no checkpoint yet), until
the last step, when it writes the weights (``model.safetensors`` / ``<vq>.safetensors``) and
``train_log.json``.
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


def _probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = None
    if v is None or not 0.0 <= v < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {text!r}")
    return v


def _dropouts(args) -> dict[str, float | None]:
    """TrainConfig dropout overrides: ``--dropout P`` sets LlamaGen's trio (token, resid, ffn); each flag wins over it."""
    trio = dict.fromkeys(("token_dropout_p", "resid_dropout_p", "ffn_dropout_p"), args.dropout)
    given = dict(token_dropout_p=args.token_dropout, resid_dropout_p=args.resid_dropout,
                 ffn_dropout_p=args.ffn_dropout, attn_dropout_p=args.attn_dropout, drop_path_rate=args.drop_path)
    return {**trio, **{k: v for k, v in given.items() if v is not None}}


def _float_list(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers like 1.5,3, got {text!r}") from None


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _palette_config(ds, recipe: dict, levels: int | None) -> dict:
    tok = dict(recipe.get("tokenizer") or {"type": "palette", "levels": 256})
    if levels is not None:
        tok["levels"] = levels
    return tok


def _vq_path(ds, given: str | None) -> Path:
    from .vq_trainer import VQ_RECIPES

    if given:
        return Path(given)
    r = VQ_RECIPES[ds.tokenizer_recipe]
    return Path("out") / ds.tokenizer_recipe / f"{r['name']}.safetensors"


def _distill_cfg(args, recipe: str) -> float | None:
    """``--distill-cfg``, else the guidance the model of this recipe ships with (None: the config's default)."""
    if args.distill_cfg is not None:
        return args.distill_cfg
    from ..bundles import BUNDLES

    return BUNDLES[recipe].cfg_scale if recipe in BUNDLES else None


def _check_sparse_flags(args, cfg) -> None:
    """Refuse the sparse-aware and distillation flags where the run has no use for them (not ignore them)."""
    for needs, on, flags in (("--sparse-policy POLICY", cfg.sparse_policy is not None,
                              ("sparse_weight", "sparse_loss", "sparse_mix")),
                             ("--sparse-loss distill", cfg.sparse_loss == "distill",
                              ("distill_pool", "distill_cfg", "distill_divergence"))):
        given = ["--" + f.replace("_", "-") for f in flags if getattr(args, f) is not None]
        if given and not on:
            raise ValueError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with {needs}")


def cmd_train_model(args) -> int:
    from ..checkpoint import check_output_file
    from ..loading import load_vq
    from ..tokenizers import vq_file_config
    from .datasets import DATASETS, load_token_dataset, make_tokenizer
    from .loop import check_resumable, run_device
    from .trainer import MODEL_NAME, RECIPES, load_checkpoint, recipe_config, train_gpt

    ds = DATASETS[args.dataset]
    recipe = RECIPES[ds.recipe]
    device = args.device or _default_device()
    grid = {}
    if ds.tokenizer_kind == "palette":
        if args.vq:
            raise ValueError(f"dataset {ds.name!r} is tokenised one token per pixel: --vq does not apply")
        tok_cfg = _palette_config(ds, recipe, args.levels)
        tokenizer = make_tokenizer(tok_cfg)
    else:
        if args.levels is not None:
            raise ValueError(f"--levels is for palette data sets; {ds.name!r} is tokenised by a VQ (--vq)")
        if args.hflip:  # (a VQ's codes of a mirrored image are not its codes mirrored)
            raise ValueError(f"--hflip is for palette data sets; {ds.name!r} is tokenised by a VQ (--vq)")
        vq = _vq_path(ds, args.vq)
        if not vq.is_file():
            raise FileNotFoundError(f"VQ tokenizer {vq} not found: train it first with "
                                    f"`arsparse train tokenizer --dataset {ds.name}` (or give --vq PATH)")
        tokenizer = load_vq(vq)  # (on the CPU until the config has checked the device)
        tok_cfg = vq_file_config(vq)
        side = ds.image_size // tokenizer.downsample
        grid = dict(grid_h=side, grid_w=side)
    out = args.out or str(Path("out") / ds.recipe)
    cfg = recipe_config(
        ds.recipe, out, preset=args.preset, dim=args.dim, n_layer=args.layers, n_head=args.heads,
        vocab_size=tokenizer.vocab_size, tokenizer=tok_cfg, steps=args.steps, batch_size=args.batch_size,
        lr=args.lr, warmup=args.warmup, seed=args.seed, hflip=True if args.hflip else None,
        compile=True if args.compile else None, time_limit_s=args.time_limit, ckpt_every=args.ckpt_every,
        eval_every=args.eval_every, eval_samples=args.eval_samples, device=device,
        progress=not args.quiet, init_from=args.init_from, sparse_policy=args.sparse_policy,
        sparse_weight=args.sparse_weight, sparse_loss=args.sparse_loss, sparse_mix=args.sparse_mix,
        distill_pool=args.distill_pool, distill_cfg_scale=_distill_cfg(args, ds.recipe),
        distill_divergence=args.distill_divergence,
        **_dropouts(args), **grid,
    )
    _check_sparse_flags(args, cfg)
    check_output_file(Path(cfg.out_dir) / MODEL_NAME)  # (a file in the folder's place, /proc: refused before the data)
    # (as train_gpt would find them, but before the data, whose first tokenising can take minutes)
    if check_resumable(cfg, args.resume, load_checkpoint) is None and cfg.init_from and not Path(cfg.init_from).is_file():
        raise FileNotFoundError(f"--init-from: no weights file at {cfg.init_from}")
    if ds.tokenizer_kind != "palette":  # (a CUDA device where there is none: refused here, not as a traceback)
        tokenizer = tokenizer.to(run_device(cfg))
    tokens, labels, val_tokens, val_labels = load_token_dataset(args.dataset, tokenizer, root=args.data_root)
    result = train_gpt(cfg, tokens, labels, val_tokens, val_labels, resume=args.resume,
                       stop_after=args.stop_after, started_at=_T0)
    best = result.history.get("best")
    summary = {"finished": result.finished, "step": result.step, "steps": cfg.steps,
               "ckpt": str(result.ckpt_path), "model": str(result.model_path) if result.model_path else None,
               "final_val_bpt": result.final_val_bpt, "best": str(result.best_path) if result.best_path else None,
               "best_step": best["step"] if best else None, "best_val_bpt": best["val_bpt"] if best else None}
    print(json.dumps(summary))
    return 0


def cmd_train_tokenizer(args) -> int:
    from .datasets import DATASETS, make_tokenizer
    from .trainer import RECIPES

    ds = DATASETS[args.dataset]
    if ds.tokenizer_kind == "palette":
        tok_cfg = _palette_config(ds, RECIPES[ds.recipe], args.levels)
        make_tokenizer(tok_cfg)  # validates
        out = Path(args.out or Path("out") / ds.recipe)
        out.mkdir(parents=True, exist_ok=True)
        path = out / "tokenizer.json"
        path.write_text(json.dumps(tok_cfg, indent=1) + "\n")
        print(f"{args.dataset}: a palette tokenizer has no weights to train; wrote its config {tok_cfg} to {path}")
        return 0
    if args.levels is not None:
        raise ValueError(f"--levels is for palette data sets; {ds.name!r} trains a VQ")
    return _train_vq(args, ds)


def _train_vq(args, ds) -> int:
    from .vq_trainer import load_vq_checkpoint, train_vq, vq_recipe_config

    cfg = vq_recipe_config(
        ds.tokenizer_recipe, args.out or str(Path("out") / ds.tokenizer_recipe), ch=args.ch,
        codebook_size=args.codebook_size, steps=args.steps, batch_size=args.batch_size, lr=args.lr,
        warmup=args.warmup, seed=args.seed, restart_every=args.restart_every,
        compile=True if args.compile else None, time_limit_s=args.time_limit, ckpt_every=args.ckpt_every,
        eval_every=args.eval_every, eval_samples=args.eval_samples, device=args.device or _default_device(),
        progress=not args.quiet)
    from ..checkpoint import check_output_file
    from ..data.emoji import load_emoji
    from .loop import check_resumable

    check_output_file(Path(cfg.out_dir) / f"{cfg.name}.safetensors")  # (these as train_vq would, before the data)
    check_resumable(cfg, args.resume, load_vq_checkpoint)
    images, _ = load_emoji("train", cache_dir=args.data_root, fetch=True)
    val, _ = load_emoji("test", cache_dir=args.data_root)
    r = train_vq(cfg, images, val, resume=args.resume, stop_after=args.stop_after, started_at=_T0)
    print(json.dumps({"finished": r.finished, "step": r.step, "steps": cfg.steps, "ckpt": str(r.ckpt_path),
                      "vq": str(r.vq_path) if r.vq_path else None, "final_val": r.final_val}))
    return 0


def cmd_train_classifier(args) -> int:
    from ..eval.classifier import run

    return run(args)


def cmd_train_export(args) -> int:
    from .card import export_bundle

    files = export_bundle(args.model, args.gpt_dir, args.vq_dir, args.out, ship=args.ship, commands=args.command,
                          cfg_scales=args.cfg_scales, device=args.device, rows=args.rows, seed=args.seed,
                          progress=not args.quiet)
    for kind, path in files.items():
        print(f"{kind:>10}: {path}")
    return 0


def _add_run_args(p: argparse.ArgumentParser) -> None:
    """--out, --resume, --device, --time-limit, --stop-after: the resumable-run flags of model and tokenizer."""
    p.add_argument("--resume", action="store_true",
                   help="continue from <out>/ckpt.pt if it exists (else start fresh); without it an existing "
                        "checkpoint is an error")
    p.add_argument("--device", help="torch device (default: cuda when available, else cpu)")
    p.add_argument("--time-limit", type=_positive_float, metavar="SECONDS",
                   help="stop with a checkpoint before this many seconds since start (e.g. 540 in a 10-minute slot)")
    p.add_argument("--stop-after", type=positive_int, metavar="STEPS", help="stop with a checkpoint after this many steps")
    p.add_argument("--data-root", help="folder holding the dataset's files (default: $ARSPARSE_DATA/<name>, "
                                       "then the system package's folder or ~/.cache/arsparse/<name>)")
    p.add_argument("--quiet", action="store_true", help="plain log lines instead of a progress bar")


def _add_opt_args(g) -> None:
    g.add_argument("--steps", type=positive_int)
    g.add_argument("--batch-size", type=positive_int)
    g.add_argument("--lr", type=_positive_float)
    g.add_argument("--warmup", type=int, help="steps of linear warm-up to --lr, then cosine decay (default: the "
                                            "recipe's, cut to a quarter of --steps for a shorter run; at most --steps)")
    g.add_argument("--seed", type=int)
    g.add_argument("--compile", action="store_true", help="torch.compile the model (off by default)")
    g.add_argument("--ckpt-every", type=positive_int)
    g.add_argument("--eval-every", type=positive_int)
    g.add_argument("--eval-samples", type=positive_int, help="validation images per evaluation (default: all)")


def _add_subcommands(parser: argparse.ArgumentParser) -> None:
    from ..eval.classifier import CLASSIFIER_SPECS
    from .datasets import DATASETS
    from .trainer import RECIPES
    from .vq_trainer import VQ_RECIPES

    sub = parser.add_subparsers(dest="train_command", required=True, metavar="{model,tokenizer,classifier,export}")
    names = sorted(DATASETS)
    ds_help = "; ".join(f"{d.name}: {d.description}" for d in DATASETS.values())

    m = sub.add_parser(
        "model", help="train a class-conditional GPT on a tokenised dataset (resumable)",
        description="Train a LlamaGen-architecture GPT on a dataset. Defaults come from the dataset's recipe ("
                    + ", ".join(f"{d.name} -> {d.recipe}" for d in DATASETS.values()) + "). The run writes "
                    "<out>/ckpt.pt as it goes and stops cleanly before --time-limit; rerun the same command with "
                    "--resume to continue. At the end it writes <out>/model.safetensors (loads with "
                    "arsparse.load_gpt(path)) and <out>/train_log.json; with held-out data, <out>/best.safetensors "
                    "holds the weights of the best held-out evaluation (what `train export` ships). VQ data sets "
                    "(emoji) are tokenised once with --vq (cached beside the data).")
    m.add_argument("--dataset", choices=names, default="fashion", help=ds_help)
    m.add_argument("--out", help="output folder (default: out/<recipe>)")
    m.add_argument("--vq", help="VQ tokenizer (.safetensors) for VQ data sets (default: "
                                "out/<tokenizer recipe>/<name>.safetensors, e.g. out/emoji-vq/emoji-vq.safetensors)")
    _add_run_args(m)
    g = m.add_argument_group("model (defaults from the recipe)")
    g.add_argument("--preset", help="GPT size preset the overrides apply to")
    g.add_argument("--dim", type=positive_int)
    g.add_argument("--layers", type=positive_int)
    g.add_argument("--heads", type=positive_int)
    g.add_argument("--levels", type=positive_int, help="grey levels of the palette tokenizer = vocabulary (2..256)")
    g = m.add_argument_group("optimisation (defaults from the recipe)")
    _add_opt_args(g)
    g.add_argument("--hflip", action="store_true", help="flip half of each batch's token grids left to right "
                                                        "(palette tokenizers only)")
    g = m.add_argument_group("regularisation: LlamaGen's dropouts, active in training only (defaults from the recipe)")
    g.add_argument("--dropout", type=_probability, metavar="P",
                   help="token, residual and FFN dropout at once (LlamaGen trains with 0.1); 0 turns them off")
    g.add_argument("--token-dropout", type=_probability, metavar="P", help="dropout on the input embeddings")
    g.add_argument("--resid-dropout", type=_probability, metavar="P", help="dropout on the attention output (after wo)")
    g.add_argument("--ffn-dropout", type=_probability, metavar="P", help="dropout on the feed-forward output (after w2)")
    g.add_argument("--attn-dropout", type=_probability, metavar="P", help="dropout on the attention weights")
    g.add_argument("--drop-path", type=_probability, metavar="P",
                   help="stochastic depth: drop rate of the last layer's branches (0 at the first, linear between)")
    g = m.add_argument_group("fine-tuning and sparse-aware training")
    g.add_argument("--init-from", metavar="WEIGHTS",
                   help="start from these weights (.safetensors/.pt of the recipe's architecture, e.g. a shipped "
                        "model: arsparse/weights/fashion-c2i.safetensors) instead of a fresh init")
    g.add_argument("--sparse-policy", metavar="POLICY",
                   help="also train with attention restricted to this offset policy's read sets (e.g. diagonal), "
                        "so that it loses less against dense")
    g.add_argument("--sparse-weight", type=_positive_float, metavar="W",
                   help="the sparse loss's share of the loss, in (0, 1] (default 0.5)")
    g.add_argument("--sparse-loss", choices=("data", "distill"),
                   help="the sparse share: cross-entropy on the data (default), or on-policy distillation: a KL "
                        "between the dense --init-from weights' and the policy's guided next-token distributions on "
                        "sequences the current weights sample under the policy")
    g.add_argument("--sparse-mix", choices=("sum", "split"),
                   help="sum (default): every row both ways, the two losses weighted (two forward passes); split: "
                        "round(W x batch) rows under the policy, the rest dense (one pass, the same mix on average)")
    g.add_argument("--distill-pool", type=positive_int, metavar="N",
                   help="distill: sequences sampled per refresh of the pool (default 1024; >= the batch size)")
    g.add_argument("--distill-cfg", type=_positive_float, metavar="SCALE",
                   help="distill: the guidance the pool is sampled with and the compared distributions use "
                        "(default: the shipped model's, e.g. 2 for fashion-c2i)")
    g.add_argument("--distill-divergence", choices=("reverse", "forward"),
                   help="distill: KL(policy || dense) per step, which sums to the KL between the two samplers "
                        "(reverse, default), or KL(dense || policy) (forward: covers modes, noisier samples)")
    m.set_defaults(func=cmd_train_model)

    t = sub.add_parser(
        "tokenizer", help="train the dataset's VQ tokenizer (resumable), or write a palette config",
        description="VQ datasets (emoji): train a LlamaGen-layout VQ with the dataset's tokenizer recipe ("
                    + ", ".join(VQ_RECIPES) + "): pixel L1 + L2, codebook and commitment losses, dead-code "
                    "restarts; resumable like `train model`; at the end <out>/<name>.safetensors (loads with "
                    "arsparse.load_vq(path)). Palette datasets (fashion) have no weights to train: this writes "
                    "the palette config to <out>/tokenizer.json.")
    t.add_argument("--dataset", choices=names, default="fashion", help=ds_help)
    t.add_argument("--out", help="output folder (default: out/<tokenizer recipe> or out/<recipe> for palettes)")
    t.add_argument("--levels", type=positive_int, help="grey levels of the palette tokenizer (2..256)")
    _add_run_args(t)
    g = t.add_argument_group("VQ (defaults from the tokenizer recipe)")
    g.add_argument("--ch", type=positive_int, help="base channels (a multiple of 32)")
    g.add_argument("--codebook-size", type=positive_int)
    g.add_argument("--restart-every", type=int, help="steps between dead-code restarts (0: none)")
    _add_opt_args(g)
    t.set_defaults(func=cmd_train_tokenizer)

    c = sub.add_parser(
        "classifier", help="train a data set's feature classifier for `arsparse eval` (CPU: minutes)",
        description="Train the small CNN whose features give the eval's fd_classifier and whose predictions give "
                    "class_accuracy. Writes the .safetensors (default: out/<dataset>-classifier.safetensors) "
                    "and a .json summary beside it.")
    c.add_argument("--dataset", choices=sorted(CLASSIFIER_SPECS), default="fashion")
    c.add_argument("--out", help="output .safetensors (default: out/<dataset>-classifier.safetensors; the "
                                 "shipped file is replaced only when named here)")
    c.add_argument("--epochs", type=positive_int, help="default: 6 for fashion, 15 for emoji")
    c.add_argument("--batch", type=positive_int, default=128)
    c.add_argument("--lr", type=_positive_float, default=3e-3)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--device", default="cpu")
    c.set_defaults(func=cmd_train_classifier)

    e = sub.add_parser(
        "export", help="ship a trained VQ model: bundle files, sample grids, train logs and a model card",
        description="From finished `train tokenizer` and `train model` folders, write into --out the bundle's "
                    "weights under their shipped names, sample grids (one column per class) at several guidance "
                    "scales, the train logs and the model card. Then move the .safetensors and the .md to "
                    "arsparse/weights/ and the .png and .json files to docs/models/.")
    e.add_argument("--model", default="emoji-c2i", help="bundle name (default: emoji-c2i)")
    e.add_argument("--gpt-dir", default="out/emoji-c2i", help="finished `train model` folder")
    e.add_argument("--vq-dir", default="out/emoji-vq", help="finished `train tokenizer` folder")
    e.add_argument("--out", required=True, help="output folder")
    e.add_argument("--ship", choices=("best", "last"), default="best",
                   help="which GPT weights to ship: best = <gpt-dir>/best.safetensors, the evaluation with the lowest "
                        "held-out loss (default; the last step when the run has none), last = <gpt-dir>/model.safetensors")
    e.add_argument("--command", action="append", default=[], help="a training command for the card (repeatable)")
    e.add_argument("--cfg-scales", type=_float_list, default=[1.5, 3.0, 5.0],
                   help="guidance scales of the extra grids (the bundle's own is always made)")
    e.add_argument("--rows", type=positive_int, default=4, help="samples per class in each grid")
    e.add_argument("--seed", type=int, default=100)
    e.add_argument("--device", default=None, help="default: cuda when available, else cpu")
    e.add_argument("--quiet", action="store_true")
    e.set_defaults(func=cmd_train_export)
    parser.epilog = "recipes: " + ", ".join(RECIPES) + "; tokenizer recipes: " + ", ".join(VQ_RECIPES)


def add_train_parser(subparsers) -> argparse.ArgumentParser:
    """Add ``train {model,tokenizer,classifier,export}`` to an ``argparse`` subparsers object.

    Each leaf sets ``func`` (``args.func(args) -> int``), as the other ``arsparse`` commands.
    """
    p = subparsers.add_parser("train", help="train the GPT, its tokenizer or the eval classifier; export a bundle",
                              description=__doc__.split("\n\n")[0])
    _add_subcommands(p)
    return p


def main(argv: list[str] | None = None) -> int:
    from ..data import EmojiDataError, FashionDataError

    parser = argparse.ArgumentParser(prog="python -m arsparse.training.cli",
                                     description="Same as `arsparse train`: " + __doc__.split("\n\n")[0])
    _add_subcommands(parser)
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, FileExistsError, FileNotFoundError, FashionDataError, EmojiDataError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
