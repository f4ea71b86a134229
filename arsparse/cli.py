"""The one command line: ``arsparse generate | models | policies | convert | bench | data | train | eval | analyze | serve``."""
from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from .cliargs import add_model_args, build_model, finite_float, int_list, load_captions, positive_int


IMAGE_NAME = re.compile(r"\d{4,}_(class|caption)\d+\.png")  # the images generate writes: 0003_class7.png


def cmd_generate(args) -> int:
    from .engine.generator import Generator
    from .tokenizers import save_grid, to_pil

    from .bundles import BUNDLES
    from .policies import get, parse_args, parse_spec

    gpt, tok, name, cfg_scale = build_model(args)
    cfg = gpt.config
    policy_name, own = parse_spec(args.policy)  # ("diagonal:rows=2" as eval and bench take it; its settings win)
    policy_args = {**parse_args(args.policy_arg), **own}
    policy = get(policy_name, **policy_args)
    if args.cfg_scale is not None:
        cfg_scale = args.cfg_scale
    elif not args.gpt_ckpt:  # (a bundle: the policy's own calibrated guidance, where the bundle has one)
        cfg_scale = BUNDLES[name].guidance(policy_name, policy_args)
    gen = Generator(gpt, tok, device=args.device, dtype=args.dtype, policy=policy, kernel=args.kernel,
                    compile=args.compile, matvec=args.matvec)
    masks, extra = None, {}
    if cfg.model_type == "t2i":
        if not args.caption_features:
            raise ValueError("this is a text-conditional model: give --caption-features FILE (B, 120, 2048)")
        from .prompt_mask import pad_captions

        feats, mask = load_captions(args.caption_features, args.caption_mask)
        # as LlamaGen's sampler: real tokens moved to the end (unless --no-left-padding), padding zeroed
        feats, mask = pad_captions(feats, mask, cfg.cls_token_num, left_padding=not args.no_left_padding)
        n = args.num_images or feats.shape[0]
        conds, masks = feats[torch.arange(n) % feats.shape[0]], mask[torch.arange(n) % feats.shape[0]]
        extra = dict(caption_tokens=mask.sum(1).tolist(), left_padding=not args.no_left_padding)
    else:
        if args.caption_features or args.caption_mask or args.no_left_padding:
            raise ValueError("--caption-features, --caption-mask and --no-left-padding are for text-conditional (t2i) "
                             "models; this one is class-conditional: give --classes")
        classes = args.classes or list(range(min(cfg.num_classes, 8)))
        bad = [c for c in classes if not 0 <= c < cfg.num_classes]
        if bad:
            raise ValueError(f"classes {bad} are out of range: this model has classes 0..{cfg.num_classes - 1}")
        n = args.num_images or len(classes)
        conds = torch.tensor([classes[i % len(classes)] for i in range(n)])
    if n < 1:
        raise ValueError(f"--num-images must be >= 1, got {n}")
    if args.matvec:
        from .kernels.triton.matvec import MAX_ROWS

        per_image = 1 if cfg_scale == 1.0 else 2
        if min(n, args.batch_size) * per_image > MAX_ROWS:
            raise ValueError(f"--matvec (latency mode) takes batches of at most {MAX_ROWS // per_image} images "
                             f"{'with' if per_image == 2 else 'without'} guidance; got {min(n, args.batch_size)}: "
                             f"lower --batch-size, or drop --matvec (--compile suits larger batches)")

    out = Path(args.out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    images, t0 = [], time.perf_counter()
    from tqdm.auto import tqdm

    bs = args.batch_size
    for start in tqdm(range(0, n, bs), desc="batches", unit="batch", disable=args.quiet):
        seeds = [args.seed + i for i in range(start, min(n, start + bs))]
        tokens = gen.sample_tokens(conds[start : start + bs], cfg_scale=cfg_scale, temperature=args.temperature,
                                   top_k=args.top_k, top_p=args.top_p, seed=seeds, cfg_interval=args.cfg_interval,
                                   progress=not args.quiet,
                                   prompt_mask=None if masks is None else masks[start : start + bs])
        images.append(gen.decode_images(tokens))
    images = torch.cat(images)
    elapsed = time.perf_counter() - t0
    for old in (out / "images").iterdir():  # an earlier run's images (by their names), not to mix with these
        if IMAGE_NAME.fullmatch(old.name) and old.is_file():
            old.unlink()
    for i, img in enumerate(to_pil(images)):  # at the model's own resolution
        label = f"class{int(conds[i])}" if cfg.model_type == "c2i" else f"caption{i % conds.shape[0]}"
        img.save(out / "images" / f"{i:04d}_{label}.png")
    size = list(images.shape[-2:])
    scale = max(1, -(-128 // images.shape[-1]))  # small images (28 px) are enlarged in the grid
    if scale > 1:
        images = torch.nn.functional.interpolate(images, scale_factor=scale, mode="nearest")
    save_grid(images, out / "grid.png", nrow=args.nrow)
    info = dict(num_images=n, seconds=round(elapsed, 3), images_per_s=round(n / elapsed, 3), policy=policy.describe(),
                image_size=size, cfg_scale=cfg_scale, device=str(gen.device), dtype=str(gen.dtype), matvec=args.matvec, **extra)
    (out / "generate.json").write_text(json.dumps(info, indent=2))
    print(f"wrote {n} images to {out / 'images'} and {out / 'grid.png'} ({elapsed:.1f} s, {n / elapsed:.2f} images/s)")
    return 0


def cmd_models(args) -> int:
    from .bundles import BUNDLES, DEFAULT_MODEL
    from .models.config import GPT_PRESETS
    from .models.vq import VQ_PRESETS

    rows = []
    for b in BUNDLES.values():
        c = b.gpt_config() if b.available else None
        rows.append(dict(name=b.name, default=b.name == DEFAULT_MODEL, installed=b.available, description=b.description,
                         image_tokens=c and c.image_tokens, grid=c and [c.grid_h, c.grid_w],
                         params=c and c.num_params(), cfg_scale=b.cfg_scale))
    if args.json:
        print(json.dumps(dict(bundles=rows, gpt_presets=GPT_PRESETS, vq_presets=list(VQ_PRESETS)), indent=2))
        return 0
    print("Bundles (arsparse generate --model NAME):")
    for r in rows:
        mark = "*" if r["default"] else " "
        size = f"{r['params'] / 1e6:7.1f}M" if r["params"] else "missing "
        print(f" {mark} {r['name']:<20} {size}  {r['description']}")
    print("\nGPT presets (for --gpt-ckpt with --gpt-preset):")
    for name, p in GPT_PRESETS.items():
        print(f"   {name:<10} layers={p['n_layer']:<3} heads={p['n_head']:<3} dim={p['dim']}")
    print(f"\nVQ presets: {', '.join(VQ_PRESETS)}   (* = default)")
    return 0


def policy_rows(gpt, cfg_rows: int = 2) -> list[dict]:
    """Every registered policy at its defaults on ``gpt``: budget and KV bytes per image."""
    from . import policies

    cfg = gpt.config
    rows = []
    for name in policies.names():
        pol = policies.get(name)
        d = pol.describe()
        try:
            b = pol.budget(gpt.layout, cfg.n_layer, cfg.n_head)
            d.update(read=round(b.read, 1), kept=b.kept, dense=b.dense, rho=round(b.rho, 4),
                     kv_bytes_per_image=b.kept * cfg.kv_bytes_per_token(2) * cfg_rows)
        except policies.PolicyError as e:  # e.g. needs calibration or does not fit this model
            d.update(note=str(e))
        rows.append(d)
    return rows


def cmd_policies(args) -> int:
    from .bundles import DEFAULT_MODEL, load_model

    args.model = args.model or DEFAULT_MODEL
    gpt, _ = load_model(args.model)
    rows = policy_rows(gpt)
    if args.json:
        print(json.dumps(dict(model=args.model, rows=rows), indent=2))
        return 0
    print(f"Policies on {args.model} (grid {gpt.config.grid_h}x{gpt.config.grid_w}, prompt {gpt.config.cls_token_num}); "
          f"KV per image in bf16 with guidance (2 sequences):")
    print(f"{'name':<20}{'kind':<8}{'read':>8}{'kept':>7}{'rho':>8}{'KV MB':>9}  parameters")
    for r in rows:
        if "kept" in r:
            print(f"{r['name']:<20}{r['kind']:<8}{r['read']:>8}{r['kept']:>7}{r['rho']:>8.3f}"
                  f"{r['kv_bytes_per_image'] / 1e6:>9.2f}  {r['params']}")
        else:
            print(f"{r['name']:<20}{r['kind']:<8}{'':>32}  {r['params']}  ({r['note']})")
        print(f"{'':<20}{r['source']}")
    return 0


def cmd_convert(args) -> int:
    from .checkpoint import convert

    n = convert(args.src, args.dst, key=args.key)
    print(f"wrote {n} tensors to {args.dst}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="arsparse", description="Fast autoregressive image generation with sparse attention.")
    sub = p.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="generate images")
    add_model_args(g)
    g.add_argument("--classes", type=int_list, help="class labels, e.g. 1,2,3 (cycled to --num-images)")
    g.add_argument("--caption-features",
                   help="t2i: file of T5 features (B, <=120, 2048): .pt, .npy, .npz or .safetensors; with keys "
                        "caption_embs and emb_masks (True/1 at real tokens) as LlamaGen's T5 embedder returns them, "
                        "else its first tensor (fewer than 120 tokens: all real, padded here)")
    g.add_argument("--caption-mask", help="t2i: file of the features' padding masks (B, tokens), True/1 at real tokens")
    g.add_argument("--no-left-padding", action="store_true",
                   help="t2i: keep the real caption tokens first (LlamaGen's flag; default: moved to the end)")
    g.add_argument("--num-images", type=positive_int, help="images to make (default: one per class or caption; classes 0..7 when none given)")
    g.add_argument("--batch-size", type=positive_int, default=32)
    g.add_argument("--seed", type=int, default=0, help="image i uses seed+i")
    g.add_argument("--cfg-scale", type=finite_float, default=None,
                   help="classifier-free guidance, 1 = off (default: the bundle's for the policy, e.g. fashion-c2i: 2, "
                        "diagonal at its defaults 1.697; 4.0 for checkpoints)")
    g.add_argument("--cfg-interval", type=int, default=-1, help="guide only the first tokens (LlamaGen's; -1 = all)")
    g.add_argument("--temperature", type=finite_float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 = off, 1 = greedy")
    g.add_argument("--top-p", type=finite_float, default=1.0, help="1 = off")
    g.add_argument("--device", default=None, help="cpu, cuda, cuda:1 (default: cuda if available)")
    g.add_argument("--dtype", default=None, choices=["fp32", "bf16", "fp16"], help="default: bf16 on cuda, fp32 on cpu")
    g.add_argument("--kernel", default=None, choices=["torch", "triton"],
                   help="decode attention: Triton kernels or the PyTorch reference (default: triton on cuda)")
    g.add_argument("--compile", action="store_true", help="torch.compile each block and the sampling (CUDA; fewer launches)")
    g.add_argument("--matvec", action="store_true",
                   help="latency mode: decode steps of at most 16 rows (8 images with guidance) through Triton "
                        "matrix-vector kernels with the norms, RoPE and SwiGLU folded in; larger batches take the "
                        "PyTorch blocks (CUDA; not with --compile)")
    g.add_argument("--policy", default="dense",
                   help="sparse-attention policy (see `arsparse policies`), optionally with its settings as eval "
                        "and bench take them: diagonal:rows=2,band=1 (these win over --policy-arg)")
    g.add_argument("--policy-arg", action="append", default=[], metavar="KEY=VALUE",
                   help="policy parameter, repeatable: --policy-arg rows=3 --policy-arg band=2")
    g.add_argument("--out", default="out",
                   help="output folder: grid.png, images/, generate.json; a folder used before has its earlier "
                        "images (images/NNNN_classK.png, NNNN_captionK.png) replaced by this run's, once they "
                        "are made; other files are left alone")
    g.add_argument("--nrow", type=positive_int, default=8, help="images per row of grid.png")
    g.add_argument("--quiet", action="store_true", help="no progress bars")
    g.set_defaults(func=cmd_generate)

    m = sub.add_parser("models", help="list the model bundles and presets")
    m.add_argument("--json", action="store_true")
    m.set_defaults(func=cmd_models)

    pp = sub.add_parser("policies", help="list the sparse-attention policies, their parameters, budgets and sources")
    pp.add_argument("--model", default=None, help="model whose layout sets the budgets (default: the default model)")
    pp.add_argument("--json", action="store_true")
    pp.set_defaults(func=cmd_policies)

    c = sub.add_parser("convert", help="convert a checkpoint (.pt/.pth, any LlamaGen layout) to .safetensors")
    c.add_argument("src")
    c.add_argument("dst")
    c.add_argument("--key", help="sub-dictionary to extract, e.g. ema")
    c.set_defaults(func=cmd_convert)

    from .analysis.cli import add_analyze_parser
    from .bench import add_bench_parser
    from .data.cli import add_data_parser
    from .eval.cli import add_eval_parser
    from .serve.cli import add_serve_parser
    from .training.cli import add_train_parser

    add_bench_parser(sub)
    add_data_parser(sub)
    add_train_parser(sub)
    add_eval_parser(sub)
    add_analyze_parser(sub)
    add_serve_parser(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if getattr(args, "batch_size", None) is not None and args.batch_size < 1:
        print("arsparse: error: --batch-size must be >= 1", file=sys.stderr)
        return 2
    from .data import EmojiDataError, FashionDataError

    try:
        return args.func(args)
    except (ValueError, FashionDataError, EmojiDataError, OSError) as e:  # bad input, missing data, unwritable output
        print(f"arsparse: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
