"""Ship a trained VQ-based model: its weights under the bundle's names, sample grids and a model card.

:func:`export_bundle` takes the output folders of ``arsparse train tokenizer`` and ``arsparse train
model`` and writes, into one flat folder (what comes back from a GPU run)::

    <model>.safetensors, <vq>.safetensors    the bundle's files (the GPT's header names the VQ by sha256)
    <model>.md                               the model card (data, licence, commands, steps, losses, hashes)
    <model>-samples.png                      a grid at the bundle's guidance, one column per class
    <model>-samples-cfg<S>.png               the same seeds at other guidance scales
    <model>-train_log.json, <vq>-train_log.json

Then ``<model>.safetensors``, ``<vq>.safetensors`` and ``<model>.md`` go to ``arsparse/weights/``; the
grids and logs to ``docs/models/`` (the card links the grid there).
"""
from __future__ import annotations

import datetime
import json
import shutil
import warnings
from pathlib import Path

import torch

__all__ = ["export_bundle", "model_card", "sample_grid"]


def _mb(path: Path) -> str:
    return f"{path.stat().st_size / 1e6:.1f} MB"


@torch.no_grad()
def sample_grid(gpt, tokenizer, path, cfg_scale: float, rows: int = 4, seed: int = 100, device=None,
                progress: bool = False) -> Path:
    """Sample ``rows`` images per class (one column per class, image (r, c) has seed ``seed + r * C + c``)."""
    from ..engine.generator import Generator
    from ..tokenizers import save_grid

    n_cls = gpt.config.num_classes
    gen = Generator(gpt, tokenizer, device=device)
    cond = torch.arange(n_cls).repeat(rows)  # (rows * C,)
    tokens = gen.sample_tokens(cond, cfg_scale=cfg_scale, seed=[seed + i for i in range(len(cond))],
                               progress=progress)
    save_grid(gen.decode_images(tokens), path, nrow=n_cls)
    return Path(path)


def _bf16(config: dict) -> bool:
    return str(config.get("device", "")).startswith("cuda") if config.get("bf16") is None else bool(config["bf16"])


def _fmt_history(rows: list[dict], key: str, spec: str) -> str:
    return ", ".join(f"{r[key]:{spec}} (step {r['step']})" for r in rows)


def _dropout_text(gc: dict) -> str:
    """``", dropout 0.1 on ..."`` from a GPT config dict (old logs have no dropout fields: "")."""
    where = {"token_dropout_p": "the input embeddings", "attn_dropout_p": "the attention weights",
             "resid_dropout_p": "the attention output", "ffn_dropout_p": "the feed-forward output"}
    parts = [f"{gc[k]:g} on {w}" for k, w in where.items() if gc.get(k)]
    text = f", dropout {', '.join(parts)}" if parts else ""
    if gc.get("drop_path_rate"):
        text += f", stochastic depth up to {gc['drop_path_rate']:g}"
    return text


def _shipped_text(shipped: dict, gval: list[dict], last_step: int) -> str:
    """Which step's weights the bundle holds and why, for the losses line of the card."""
    best = min(gval, key=lambda r: r["val_bpt"]) if gval else None
    text = f"; best {best['val_bpt']:.3f} at step {best['step']}" if best else ""
    step = shipped["step"]
    if shipped.get("selected") != "best":
        return text + f"; shipped: step {step}" + (" (the last step)." if step == last_step else ".")
    val = shipped["val"][0]["val_bpt"]
    since = shipped.get("best_since", 0)
    if since:
        return text + (f"; shipped: step {step} (best held-out from step {since} on, {val:.3f}: the best weights "
                       f"of the earlier steps were not carried over a resume).")
    return text + f"; shipped: step {step} (best held-out at step {step}, chosen by best-checkpoint selection)."


def model_card(name: str, gpt_path: Path, vq_path: Path, gpt_log: dict, vq_log: dict, data: dict,
               commands: list[str], cfg_scale: float, grid_rel: str, extra_grids: list[str],
               shipped: dict | None = None) -> str:
    """The markdown model card of a GPT + VQ bundle (see :func:`export_bundle` for the inputs).

    ``shipped``: the ``arsparse.train`` header entry of the shipped GPT (step, selected, val); default: the
    last step.
    """
    from ..eval.classifier import sha256_file

    g, v = gpt_log["config"], vq_log["config"]
    gc, vc = gpt_log["gpt_config"], vq_log["vq_config"]
    gval, vval = gpt_log["history"].get("val", []), vq_log["history"].get("val", [])
    gtrain, vtrain = gpt_log["history"].get("train", []), vq_log["history"].get("train", [])
    shipped = shipped or {"step": gpt_log["step"], "selected": "last"}
    restarts = vq_log["history"].get("restarts", [])
    vfin = vq_log.get("final_val") or (vval[-1] if vval else {})
    down = 2 ** (len(vc["encoder_ch_mult"]) - 1)
    lines = [
        f"# Model card: {name}", "",
        "A class-conditional autoregressive image model trained by arsparse (GPT and VQ tokenizer both trained "
        "here), shipped so that `arsparse generate --model " + name + "` makes real images with no download.", "",
        f"- **Files:** `{gpt_path.name}` (fp16 GPT, {_mb(gpt_path)}), sha256 `{sha256_file(gpt_path)}`; "
        f"`{vq_path.name}` (fp16 VQ, {_mb(vq_path)}), sha256 `{sha256_file(vq_path)}`. The GPT's header holds its "
        "config (`arsparse.gpt`), the tokenizer (`arsparse.tokenizer`: the VQ file's name and sha256) and a "
        "training summary (`arsparse.train`); the VQ's header holds its config (`arsparse.vq`).",
        f"- **GPT:** LlamaGen architecture (same module and key layout as the public checkpoints): dim {gc['dim']}, "
        f"{gc['n_layer']} layers, {gc['n_head']} heads, 2-D RoPE; {gpt_log['num_params'] / 1e6:.2f} M parameters; "
        f"c2i with {gc['num_classes']} classes plus the null class of classifier-free guidance (label dropout "
        f"{gc['class_dropout_prob']}).",
        f"- **VQ tokenizer:** LlamaGen VQ layout, ch {vc['ch']} x {list(vc['encoder_ch_mult'])}, z {vc['z_channels']}, "
        f"{vc['num_res_blocks']} residual blocks per stage; {vc['codebook_size']} l2-normalised codes of dimension "
        f"{vc['codebook_embed_dim']}; {vq_log['num_params'] / 1e6:.2f} M parameters. A token per {down} x {down} "
        f"pixels: {v['image_size']} x {v['image_size']} RGB -> {gc['grid_h']} x {gc['grid_w']} = "
        f"{gc['grid_h'] * gc['grid_w']} tokens in raster order.",
        f"- **Data:** {data['description']}", f"- **Licence of the images:** {data['licence']}",
        f"- **Classes:** {data['classes']}",
        f"- **VQ training:** {vq_log['step']} steps of {v['batch_size']} images, AdamW (lr {v['lr']:g}, betas "
        f"{v['betas'][0]}/{v['betas'][1]}), {v['warmup']} warm-up steps then cosine to {v['lr'] * v['min_lr_ratio']:g}; "
        f"loss {v['l1_weight']:g} x L1 + {v['l2_weight']:g} x L2 + codebook + {v['commit_beta']:g} x commitment; "
        f"random left-right flips{', bf16 autocast' if _bf16(v) else ''}; codes unused for {v['restart_every']} steps "
        f"restarted on encoder outputs of the batch ({sum(r['codes'] for r in restarts)} restarts in all, "
        f"{restarts[-1]['codes'] if restarts else 0} at the last). {vq_log['device']}, torch {vq_log['torch']}, "
        f"{vq_log['train_time_s'] / 60:.1f} minutes of training"
        + (f" ({vtrain[-1]['images_per_s']:.0f} images/s)." if vtrain else "."),
        f"- **VQ quality on the held-out emoji:** L1 {vfin.get('l1', float('nan')):.4f}, PSNR "
        f"{vfin.get('psnr', float('nan')):.2f} dB, {vfin.get('usage', 0) * 100:.1f} % of the codes used, code "
        f"perplexity {vfin.get('perplexity', float('nan')):.0f}. By step: PSNR "
        + (_fmt_history(vval, "psnr", ".2f") or "—") + ".",
        f"- **GPT training:** {gpt_log['step']} steps of {g['batch_size']} sequences, AdamW (lr {g['lr']:g}, betas "
        f"{g['betas'][0]}/{g['betas'][1]}, weight decay {g['weight_decay']}), {g['warmup']} warm-up steps then "
        f"cosine to {g['lr'] * g['min_lr_ratio']:g}, gradient clip {g['grad_clip']}{_dropout_text(gc)}"
        f"{', bf16 autocast' if _bf16(g) else ''}. "
        f"{gpt_log['device']}, torch {gpt_log['torch']}, {gpt_log['train_time_s'] / 60:.1f} minutes of training"
        + (f" ({gtrain[-1]['images_per_s']:.0f} sequences/s)." if gtrain else "."),
        f"- **GPT losses (bits per token, {gc['vocab_size']}-way):** train "
        + (f"{gtrain[-1]['train_bpt']:.3f} at the end" if gtrain else "—") + "; held-out "
        + (_fmt_history(gval, "val_bpt", ".3f") or "—") + _shipped_text(shipped, gval, gpt_log["step"]),
        "- **Commands** (run from the repository root; `docs/models/emoji-train.sh` runs them in resumable chunks):",
        "", "  ```bash", *[f"  {c}" for c in commands], "  ```",
        f"- **Logs:** `docs/models/{name}-train_log.json`, `docs/models/{vq_path.stem}-train_log.json`.",
        f"- **Sampling:** guidance {cfg_scale:g} is the bundle's default. Samples at {cfg_scale:g}, seeds from 100, "
        "one column per class (the order of the classes above):", "", f"  ![samples]({grid_rel})",
    ]
    if extra_grids:
        lines += ["", "  Same seeds at other guidance scales: " + ", ".join(f"[{g_}]({g_})" for g_ in extra_grids)
                  + "."]
    lines += ["", f"Card written by `arsparse train export` on {datetime.date.today().isoformat()}.", ""]
    return "\n".join(lines)


def _emoji_data_text() -> dict:
    from ..data.emoji import EMOJI_CLASSES, EMOJI_LICENCES, EMOJI_PACKAGES, emoji_summary, load_emoji_table

    pkgs = ", ".join(f"`{n}@{v}`" for n, v in EMOJI_PACKAGES.values())
    try:
        t = load_emoji_table()
        counts = f"{int((~t.test).sum())} training and {int(t.test.sum())} held-out images"
        table = "\n\n  ```\n" + "\n".join("  " + line for line in emoji_summary(t).splitlines()) + "\n  ```"
    except Exception:  # the card is still written without the data at hand
        counts, table = "about 6.8 k training and 0.8 k held-out images", ""
    return {
        "description": f"the 64 px PNGs of the npm packages {pkgs} (iamcal's emoji-data), alpha composited on "
                       f"white: {counts}, skin-tone variants included, the Component category (skin-tone "
                       "swatches) dropped. About 10 % of the emoji are held out by a hash of their code point "
                       "sequence, the same emoji in both styles with all their variants. The GPT also sees a "
                       "mirror image of every training emoji outside Symbols and Flags.",
        "licence": "; ".join(EMOJI_LICENCES.values()) + ". The trained weights are derived from these images.",
        "classes": ", ".join(f"{i} {c}" for i, c in enumerate(EMOJI_CLASSES)) + table,
    }


def export_bundle(name: str, gpt_dir, vq_dir, out_dir, commands: list[str] = (), cfg_scales=(1.5, 3.0, 5.0),
                  device=None, rows: int = 4, seed: int = 100, progress: bool = True,
                  ship: str = "best") -> dict[str, Path]:
    """Write a bundle's files, grids, logs and card into ``out_dir`` (see the module docstring).

    ``gpt_dir`` / ``vq_dir``: finished ``arsparse train model`` / ``tokenizer`` output folders. The VQ file
    is the one the GPT's header names, checked by sha256. ``ship``: ``"best"`` ships ``best.safetensors``
    (the best held-out evaluation; the last step, with a warning, when the run wrote none), ``"last"``
    ``model.safetensors``; the card says which step it is and why. Returns the written paths by kind.
    """
    from ..bundles import BUNDLES
    from ..loading import TOKENIZER_META, load_gpt, read_metadata
    from ..tokenizers import make_tokenizer
    from .trainer import BEST_NAME, MODEL_NAME, read_train_meta

    if name not in BUNDLES or not BUNDLES[name].vq_file:
        raise ValueError(f"{name!r} is not a shipped VQ bundle; choose one of "
                         f"{', '.join(n for n, b in BUNDLES.items() if b.vq_file)}")
    b = BUNDLES[name]
    gpt_dir, vq_dir, out = Path(gpt_dir), Path(vq_dir), Path(out_dir)
    if ship not in ("best", "last"):
        raise ValueError(f"ship must be 'best' or 'last', got {ship!r}")
    gpt_src = gpt_dir / MODEL_NAME
    for p in (gpt_src, gpt_dir / "train_log.json", vq_dir / "train_log.json"):
        if not p.is_file():
            raise FileNotFoundError(f"{p} is missing: finish the training runs first")
    if ship == "best":
        if (gpt_dir / BEST_NAME).is_file():
            gpt_src = gpt_dir / BEST_NAME
        else:
            warnings.warn(f"{gpt_dir / BEST_NAME} not found (a run without held-out data, or from before "
                          f"best-checkpoint selection): shipping the last step, {gpt_src}", stacklevel=2)
    tok_cfg = json.loads(read_metadata(gpt_src)[TOKENIZER_META])
    make_tokenizer(tok_cfg, base_dir=vq_dir)  # the VQ exists and matches the GPT's hash
    if tok_cfg.get("file") != b.vq_file:
        raise ValueError(f"the GPT names its tokenizer {tok_cfg!r} but the bundle expects the VQ {b.vq_file!r}; "
                         f"train the tokenizer with its recipe's name")
    out.mkdir(parents=True, exist_ok=True)
    files = {"gpt": out / b.gpt_file, "vq": out / b.vq_file}
    shutil.copyfile(gpt_src, files["gpt"])
    shutil.copyfile(vq_dir / b.vq_file, files["vq"])
    logs = {"gpt_log": out / f"{name}-train_log.json", "vq_log": out / f"{Path(b.vq_file).stem}-train_log.json"}
    shutil.copyfile(gpt_dir / "train_log.json", logs["gpt_log"])
    shutil.copyfile(vq_dir / "train_log.json", logs["vq_log"])

    gpt = load_gpt(files["gpt"])
    tok = make_tokenizer(tok_cfg, base_dir=out)
    grids = {}
    for s in sorted(set(cfg_scales) | {b.cfg_scale}):
        path = out / (f"{name}-samples.png" if s == b.cfg_scale else f"{name}-samples-cfg{s:g}.png")
        grids[s] = sample_grid(gpt, tok, path, s, rows=rows, seed=seed, device=device, progress=progress)
    gpt_log, vq_log = json.loads(logs["gpt_log"].read_text()), json.loads(logs["vq_log"].read_text())
    data = _emoji_data_text() if gpt_log["config"].get("dataset") == "emoji" else {
        "description": str(gpt_log["config"].get("dataset")), "licence": "see the data set", "classes": ""}
    extra = [f"../../docs/models/{p.name}" for s, p in grids.items() if s != b.cfg_scale]
    card = model_card(name, files["gpt"], files["vq"], gpt_log, vq_log, data, list(commands), b.cfg_scale,
                      f"../../docs/models/{grids[b.cfg_scale].name}", extra, shipped=read_train_meta(gpt_src))
    files["card"] = out / f"{name}.md"
    files["card"].write_text(card)
    return {**files, **logs, **{f"grid_{s:g}": p for s, p in grids.items()}}
