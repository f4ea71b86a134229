"""``arsparse bench``: decode speed on the GPU, against the bandwidth floor measured in the same run.

Two floors per row, both from rates measured at the start of the run: the **bandwidth floor** (bytes the
step must move over the copy bandwidth: every weight once, and the K/V entries the policy reads) and the
**arithmetic floor**, which also counts FLOPs at the measured matrix-product rate: the step's two phases
each take the longer of their bytes and their FLOPs, in sequence (every layer's products need its
attention's output and the reverse), i.e. ``max(weights / bandwidth, product FLOPs / rate) + max(K/V read
/ bandwidth, attention FLOPs / rate)``. Where a row is near its arithmetic floor and far from its bandwidth
floor, the matrix products bound it.
"""
from __future__ import annotations

import json
import platform
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from .cliargs import finite_float
from .engine.cache import KERNELS
from .engine.generator import COMPILE_MODES, Generator
from .layout import Layout
from .models.config import GPTConfig, gpt_config
from .models.gpt import GPT


@dataclass
class BenchRow:
    policy: str
    kernel: str
    batch: int
    max_batch: bool  # the batch was the largest the policy's cache allows
    rows: int  # sequences in the cache (2x batch with guidance)
    ms_per_step: float
    prefill_ms: float
    images_per_s: float
    tokens_per_s: float
    peak_mem_gb: float
    kv_bytes_per_image: int
    kv_read_bytes_per_step: float
    weight_bytes: int
    floor_ms_per_step: float
    ratio_to_floor: float
    flops_per_step: float  # matrix products (2 per weight and row) plus attention (4 per entry read and head dim)
    arith_floor_ms_per_step: float  # (see the module doc)
    ratio_to_arith_floor: float
    setup_s: float  # allocation, compilation and graph capture for this batch
    profile: list | None = None  # [(kernel, ms per step)], with --profile
    variant: str = ""  # the --variant whose settings timed this row ("": the run's own)


@dataclass(frozen=True)
class Variant:
    """Kernel settings for some of a run's rows, on top of the run's own (``arsparse bench --variant``):
    the same model, compiled once, timed again with other launch settings in the same process."""

    label: str = ""
    streams: int | None = None
    pdl: int | None = None  # programmatic dependent launch of the decode kernels (kernels/triton/_pdl.py)
    w13: int | None = None  # compiled path: w1 and w3 as one matrix product (models/gpt.py MERGE_FFN)
    ring: dict = field(default_factory=dict)  # ring kernel LAUNCH keys
    dense: dict = field(default_factory=dict)  # dense split kernel LAUNCH keys
    matvec: dict = field(default_factory=dict)  # matvec kernel LAUNCH keys
    slots: dict = field(default_factory=dict)  # slot-table kernel (scored policies) LAUNCH keys


_SWITCHES = ("pdl", "w13")  # (the variant settings that are 0 or 1)


def parse_variant(spec: str) -> Variant:
    """``"streams=2,pdl=1,ring.rows_per_program=2,matvec.weights_first=0,dense.prefetch=1,slots.block_n=128"``
    -> a checked Variant."""
    from .kernels.triton import decode, matvec, ring, slots

    kw, given = {}, {"ring": {}, "matvec": {}, "dense": {}, "slots": {}}  # given: kernel -> {key: value text}
    for item in filter(None, (t.strip() for t in spec.split(","))):
        key, sep, value = (t.strip() for t in item.partition("="))
        kernel, dot, name = key.partition(".")
        if not sep or not value:
            raise ValueError(f"a variant is KEY=VALUE pairs separated by commas, got {item!r}")
        if dot and kernel in given:
            given[kernel][name] = value
        elif key in ("streams", *_SWITCHES) and value.isdigit():
            kw[key] = int(value)
        else:
            raise ValueError(f"unknown variant setting {item!r}: allowed streams=1|2, "
                             f"{', '.join(k + '=0|1' for k in _SWITCHES)}, "
                             f"ring.KEY=VALUE ({', '.join(sorted(ring.LAUNCH_KEYS))}), matvec.KEY=INT "
                             f"({', '.join(sorted(matvec.LAUNCH))}), dense.KEY=INT ({', '.join(sorted(decode.LAUNCH))}), "
                             f"slots.KEY=INT ({', '.join(sorted(slots.LAUNCH))})")
    if kw.get("streams", 1) not in (1, 2) or any(kw.get(k, 0) not in (0, 1) for k in _SWITCHES):
        raise ValueError(f"variant streams must be 1 or 2, {', '.join(_SWITCHES)} 0 or 1, got {spec!r}")
    if given["ring"]:  # checked by the kernels' own parsers
        parsed = ring.parse_launch(",".join(f"{k}={v}" for k, v in given["ring"].items()))
        kw["ring"] = {k: parsed[k] for k in given["ring"]}
    for name, module in (("matvec", matvec), ("dense", decode), ("slots", slots)):
        if given[name]:
            if not all(v.isdigit() for v in given[name].values()):
                raise ValueError(f"{name} variant settings take integers, got {given[name]}")
            parsed = module.parse_launch(json.dumps({k: int(v) for k, v in given[name].items()}))
            kw[name] = {k: parsed[k] for k in given[name]}
    return Variant(label=spec.strip(), **kw)


@contextmanager
def _applied(variant: Variant):
    """The kernels' module settings as ``variant`` says, restored afterwards."""
    from .kernels.triton import _pdl, decode, matvec, ring, slots
    from .models import gpt

    saved = dict(ring.LAUNCH), dict(matvec.LAUNCH), dict(decode.LAUNCH), dict(slots.LAUNCH), _pdl.ENABLED, gpt.MERGE_FFN
    ring.LAUNCH, matvec.LAUNCH = {**ring.LAUNCH, **variant.ring}, {**matvec.LAUNCH, **variant.matvec}
    decode.LAUNCH, slots.LAUNCH = {**decode.LAUNCH, **variant.dense}, {**slots.LAUNCH, **variant.slots}
    if variant.pdl is not None:
        _pdl.ENABLED = variant.pdl
    if variant.w13 is not None:
        gpt.MERGE_FFN = bool(variant.w13)
    try:
        yield
    finally:
        ring.LAUNCH, matvec.LAUNCH, decode.LAUNCH, slots.LAUNCH, _pdl.ENABLED, gpt.MERGE_FFN = saved


def _median_seconds(run, reps: int = 10) -> float:
    """GPU time of ``run()`` in seconds, median of ``reps`` after two warm-up calls (CUDA events)."""
    times = []
    for i in range(reps + 2):
        e = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
        e[0].record()
        run()
        e[1].record()
        torch.cuda.synchronize()
        if i >= 2:
            times.append(e[0].elapsed_time(e[1]) / 1e3)
    return sorted(times)[len(times) // 2]


def graph_call_us(fn, reps: int = 20, launches: int = 50) -> float:
    """Microseconds per call of ``fn(i)``: the calls i < ``reps`` captured in one CUDA graph (as the engine runs a
    step), the graph replayed ``launches`` times after a warm-up on a side stream (the docs/bench experiments)."""
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(reps):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(launches):
        g.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (reps * launches)


def copy_bandwidth(device, nbytes: int = 2 << 30, reps: int = 10) -> float:
    """Device-to-device copy bandwidth in bytes/s, counting bytes read plus written (median of reps)."""
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * nbytes / _median_seconds(lambda: dst.copy_(src), reps)


def matmul_throughput(device, dtype, n: int = 8192, reps: int = 10) -> float:
    """Matrix-product rate in FLOP/s: ``(n, n) @ (n, n)`` in ``dtype``, median of reps."""
    a, b = (torch.randn(n, n, device=device).to(dtype) for _ in range(2))
    return 2 * n**3 / _median_seconds(lambda: torch.mm(a, b), reps)


def step_flops(cfg: GPTConfig, rows: int, read: float) -> tuple[float, float]:
    """FLOPs of one decode step of ``rows`` sequences reading ``read`` entries per query and head:
    (matrix products: 2 per weight of every layer's projections and the output head, per row;
    attention: q.k and p.v, 4 per entry, head dimension, head and layer, per row)."""
    q, kv = cfg.n_head * cfg.head_dim, cfg.kv_heads * cfg.head_dim
    per_layer = cfg.dim * (q + 2 * kv) + q * cfg.dim + 3 * cfg.dim * cfg.ffn_hidden
    products = 2.0 * rows * (cfg.n_layer * per_layer + cfg.vocab_size * cfg.dim)
    return products, 4.0 * rows * cfg.n_layer * cfg.n_head * cfg.head_dim * read


def step_floors(weight_bytes: float, kv_read_bytes: float, flops: tuple[float, float], bandwidth: float,
                rate: float) -> tuple[float, float]:
    """(bandwidth floor, arithmetic floor) of a step in ms (see the module doc); ``flops`` as
    :func:`step_flops` gives them, ``bandwidth`` in bytes/s, ``rate`` in FLOP/s."""
    products, attention = flops
    byte_floor = (weight_bytes + kv_read_bytes) / bandwidth
    arith = max(weight_bytes / bandwidth, products / rate) + max(kv_read_bytes / bandwidth, attention / rate)
    return byte_floor * 1e3, arith * 1e3


def step_weight_bytes(cfg: GPTConfig, dtype_bytes: int) -> int:
    """Weights one decode step reads: every layer, the final norm and the output head."""
    kv = cfg.kv_heads * cfg.head_dim
    per_layer = cfg.dim * (cfg.dim + 2 * kv) + cfg.dim * cfg.dim + 3 * cfg.dim * cfg.ffn_hidden + 2 * cfg.dim
    return (cfg.n_layer * per_layer + cfg.dim + cfg.vocab_size * cfg.dim) * dtype_bytes


def _random_gpt(cfg: GPTConfig, device, dtype) -> GPT:
    with torch.device(device):
        gpt = GPT(cfg)
    with torch.no_grad():
        for p in gpt.parameters():
            p.normal_(0.0, 0.02) if p.dim() >= 2 else p.fill_(1.0)
    return gpt.to(dtype)


def _kernel_settings() -> dict:
    """The ring and dense kernels' launch settings and PDL (None without Triton), and the merged w1/w3, in
    effect."""
    from .models import gpt

    try:
        from .kernels.triton import _pdl, decode, ring
    except ImportError:
        return dict(ring_launch=None, dense_launch=None, pdl=None, w13=gpt.MERGE_FFN)
    return dict(ring_launch=dict(ring.LAUNCH), dense_launch=dict(decode.LAUNCH), pdl=_pdl.ENABLED, w13=gpt.MERGE_FFN)


def _matvec_launch() -> dict:
    from .kernels.triton import matvec

    return dict(matvec.LAUNCH)


def bench_policies(specs: list[str], layout, n_layer: int, n_head: int, match_budget: bool = False) -> list:
    """``(label, policy)`` for each spec, ``name`` or ``name:key=value,...``; with ``match_budget``, as
    :func:`arsparse.policies.build_policies` matches them, each label that took a matched ``rho`` gains it."""
    from .policies import build_policies, budget_follows, parse_spec

    built, _ = build_policies(specs, {}, match_budget, layout, n_layer, n_head)
    out = []
    for spec, policy in built.items():
        if match_budget and budget_follows(*parse_spec(spec)):
            spec = f"{spec}{',' if ':' in spec else ':'}rho={policy.rho:.4f}"
        out.append((spec, policy))
    return out


def bench(preset: str, image_tokens: int, batches: list, policies: list[str], kernels: list[str],
          cfg_scale: float = 4.0, dtype=torch.bfloat16, device="cuda", seed: int = 0, compile: bool | str = False,
          memory_gb: float | None = None, out: str | None = None, profile: bool = False, matvec: bool = False,
          streams: int = 1, variants: tuple = (), match_budget: bool = False, layers: int | None = None) -> dict:
    """Time full generations (prefill + every decode step) for each policy x kernel x batch.

    ``batches`` holds ints or ``"max"`` (the largest batch the policy's cache allows in ``memory_gb``,
    default the free GPU memory; backed off by 10% if the step runs out of memory). ``policies`` are
    ``name`` or ``name:key=value,key=value``. With ``out``, the JSON is rewritten after every row. With
    ``profile``, each row also gets the GPU time per decode step of its top kernels. ``matvec``: the
    blocks through the Triton matrix-vector kernels (steps of at most 16 rows; see ``Generator``).
    ``variants``: :class:`Variant` s, each timed again for every policy, kernel and batch after the
    run's own settings (rows labelled with the variant; ratios to dense within a variant).
    ``match_budget``: see :func:`bench_policies`. ``layers``: the preset with this many transformer
    blocks instead of its own (checked by GPTConfig; a step of one block gives the cost outside the blocks).
    """
    from .engine.throughput import max_batch

    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        raise ValueError("arsparse bench measures GPU speed: it needs a CUDA device, and "
                         f"{'none is available here' if not torch.cuda.is_available() else f'{device} is not one'}")
    cfg = gpt_config(preset, image_tokens=image_tokens, **({} if layers is None else dict(n_layer=layers)))
    chosen = bench_policies(policies, Layout(cfg.cls_token_num, cfg.grid_h, cfg.grid_w), cfg.n_layer, cfg.n_head,
                            match_budget)  # (bad names and budgets fail here, before the model is built)
    gpt = _random_gpt(cfg, device, dtype)
    bw = copy_bandwidth(device)
    rate = matmul_throughput(device, dtype)
    eb = torch.finfo(dtype).bits // 8
    wbytes = step_weight_bytes(cfg, eb)
    mem = None if memory_gb is None else int(memory_gb * 2**30)
    rows_out = []
    meta = dict(gpu=torch.cuda.get_device_name(device), torch=torch.__version__, date=time.strftime("%Y-%m-%d"),
                host=platform.node(), model=preset, layers=cfg.n_layer, tokens=image_tokens, dtype=str(dtype),
                cfg_scale=cfg_scale, compile=compile, matvec=matvec, streams=streams, copy_bandwidth_gb_s=bw / 1e9,
                matmul_tflops=rate / 1e12, **_kernel_settings(),
                matvec_launch=_matvec_launch() if matvec else None)

    def result() -> dict:
        rows = [asdict(r) for r in rows_out]
        _add_ratios(rows)
        return dict(meta, rows=rows)

    for variant, (spec, policy), kernel in ((v, p, k) for v in (Variant(), *variants) for p in chosen for k in kernels):
        budget = policy.prepare(gpt).budget(gpt.layout, cfg.n_layer, cfg.n_head)
        with _applied(variant):
            gen = Generator(gpt, device=device, dtype=dtype, kernel=kernel, compile=compile, policy=policy,
                            matvec=matvec, streams=variant.streams or streams)
            for want in tqdm(batches, desc=f"bench {spec} {kernel} {variant.label}".rstrip(), unit="batch"):
                B = max_batch(gpt, gen.policy, mem, guidance=cfg_scale != 1.0, dtype=dtype) if want == "max" else want
                for attempt in range(4):
                    try:
                        row = _time_one(gen, B, cfg_scale, seed, budget, wbytes, bw, rate, eb, profile)
                        break
                    except torch.OutOfMemoryError:
                        gen.release()
                        if want != "max" or attempt == 3:
                            raise
                        B = int(B * 0.9)  # the estimate missed some workspace: back off
                rows_out.append(BenchRow(policy=spec, kernel=kernel, max_batch=want == "max", variant=variant.label,
                                         **row))
                if out:
                    Path(out).write_text(json.dumps(result(), indent=2))  # partial results survive a crash
            gen.release()
    return result()


def _time_one(gen: Generator, B: int, cfg_scale: float, seed: int, budget, wbytes: int, bw: float, rate: float,
              eb: int, profile: bool = False) -> dict:
    """One full generation of B images after a short warm-up; the fields of a BenchRow."""
    device, cfg = gen.device, gen.config
    N = cfg.image_tokens
    gen.release()
    cond = torch.arange(B) % cfg.num_classes
    torch.cuda.reset_peak_memory_stats(device)
    t0 = time.perf_counter()
    run, c, _ = gen.prepare(cond, cfg_scale=cfg_scale, seed=seed)  # allocates, captures
    setup_s = time.perf_counter() - t0
    with torch.no_grad():  # warm-up: prefill and a few replays
        run.start(c)
        for _ in range(min(16, N - 1)):
            run.advance()
    torch.cuda.synchronize()
    e = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    with torch.no_grad():
        e[0].record()
        run.start(c)
        e[1].record()
        for _ in range(N - 1):
            run.advance()
        e[2].record()
    torch.cuda.synchronize()
    prefill_ms, decode_ms = e[0].elapsed_time(e[1]), e[1].elapsed_time(e[2])
    total_s = (prefill_ms + decode_ms) / 1e3
    R = run.rows
    kv_read = R * budget.read * cfg.kv_bytes_per_token(eb)  # mean over the decode steps
    flops = step_flops(cfg, R, budget.read)
    floor_ms, arith_ms = step_floors(wbytes, kv_read, flops, bw, rate)
    ms_step = decode_ms / (N - 1)
    top = _profile_step(run, c, N) if profile else None
    return dict(batch=B, rows=R, ms_per_step=ms_step, prefill_ms=prefill_ms, images_per_s=B / total_s,
                tokens_per_s=B * N / total_s, peak_mem_gb=torch.cuda.max_memory_allocated(device) / 1e9,
                kv_bytes_per_image=(R // run.plan.batch) * budget.kept * cfg.kv_bytes_per_token(eb),
                kv_read_bytes_per_step=kv_read, weight_bytes=wbytes, floor_ms_per_step=floor_ms,
                ratio_to_floor=ms_step / floor_ms, flops_per_step=sum(flops), arith_floor_ms_per_step=arith_ms,
                ratio_to_arith_floor=ms_step / arith_ms, setup_s=setup_s, profile=top)


def _profile_step(run, c, N: int, steps: int = 3, top: int = 12) -> list:
    """GPU time per decode step by kernel, mid-generation, from eager steps: [(kernel, ms/step), ...]."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        run.start(c)
        for _ in range(N // 2):
            run.advance()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(steps):
                run.decode_step()
            torch.cuda.synchronize()
    times = [(e.key, getattr(e, "device_time_total", 0) or getattr(e, "cuda_time_total", 0)) for e in prof.key_averages()]
    times = sorted(((k, t / steps / 1e3) for k, t in times if t > 0), key=lambda kt: -kt[1])
    return [[k[:90], round(t, 4)] for k, t in times[:top]] + [["(all kernels)", round(sum(t for _, t in times), 4)]]


def _add_ratios(rows: list[dict]) -> None:
    """Speed-up over dense (same kernel and variant) at the same batch, and max batch against dense's max
    batch; and against the fastest dense row of any kernel and variant in the run, at the same batch (or
    each at its max batch): the smallest speed-up over any dense setting timed in the run."""
    all_dense = [d for d in rows if d["policy"].split(":")[0] == "dense"]
    for r in rows:
        dense = [d for d in all_dense if d["kernel"] == r["kernel"] and d.get("variant", "") == r.get("variant", "")]
        same = [d for d in dense if d["batch"] == r["batch"]]
        r["x_dense_same_batch"] = r["images_per_s"] / same[0]["images_per_s"] if same else None
        top = [d for d in dense if d["max_batch"]]
        r["x_dense_max_batch"] = r["images_per_s"] / top[0]["images_per_s"] if top and r["max_batch"] else None
        peers = [d["images_per_s"] for d in all_dense
                 if (d["max_batch"] and r["max_batch"]) or (not d["max_batch"] and not r["max_batch"]
                                                           and d["batch"] == r["batch"])]
        r["x_fastest_dense"] = r["images_per_s"] / max(peers) if peers else None


def markdown_table(result: dict) -> str:
    def x(v):
        return "" if v is None else f"{v:.2f}"

    lines = ["| policy | kernel | batch | ms/step | floor ms/step | x floor | x floor with FLOPs | images/s "
             "| x dense (same batch) | x dense (max batch) | x fastest dense | tokens/s | peak GB | KV MB/image "
             "| KV GB read/step |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        batch = f"{r['batch']} (max)" if r["max_batch"] else str(r["batch"])
        policy = f"{r['policy']} [{r['variant']}]" if r.get("variant") else r["policy"]
        lines.append(f"| {policy} | {r['kernel']} | {batch} | {r['ms_per_step']:.3f} | {r['floor_ms_per_step']:.3f} | "
                     f"{r['ratio_to_floor']:.2f} | {x(r.get('ratio_to_arith_floor'))} | {r['images_per_s']:.1f} | "
                     f"{x(r['x_dense_same_batch'])} | {x(r['x_dense_max_batch'])} | {x(r.get('x_fastest_dense'))} | "
                     f"{r['tokens_per_s']:.0f} | {r['peak_mem_gb']:.1f} | "
                     f"{r['kv_bytes_per_image'] / 1e6:.1f} | {r['kv_read_bytes_per_step'] / 1e9:.2f} |")
    return "\n".join(lines)


def plot_bench(result: dict, path) -> None:
    """The rows as pictures: ms per decode step against the row's bandwidth floor (|) and arithmetic
    floor (x), and images per second with the speed-up over dense (at the same batch, or each at its
    largest)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = result["rows"]
    labels = [f"{r['policy']}{' [' + r['variant'] + ']' if r.get('variant') else ''}, batch {r['batch']}"
              + (" (max)" if r["max_batch"] else "") for r in rows]
    y = range(len(rows))
    fig, (ax_t, ax_i) = plt.subplots(1, 2, figsize=(13, 1.2 + 0.42 * len(rows)), sharey=True)
    ax_t.barh(y, [r["ms_per_step"] for r in rows], color="tab:blue", alpha=0.75, label="measured")
    ax_t.scatter([r["floor_ms_per_step"] for r in rows], y, marker="|", s=260, color="black", label="bandwidth floor")
    arith = [(i, r["arith_floor_ms_per_step"]) for i, r in enumerate(rows) if r.get("arith_floor_ms_per_step")]
    if arith:
        ax_t.scatter([a for _, a in arith], [i for i, _ in arith], marker="x", s=60, color="tab:red",
                     label="arithmetic floor")
    ax_t.set_xlabel("ms per decode step")
    ax_t.set_yticks(list(y), labels)
    ax_t.invert_yaxis()
    ax_t.legend(fontsize=8, loc="lower left", bbox_to_anchor=(0, 1), ncol=3, frameon=False)
    ax_i.barh(y, [r["images_per_s"] for r in rows], color="tab:green", alpha=0.75)
    for i, r in enumerate(rows):
        x = r.get("x_dense_same_batch") or r.get("x_dense_max_batch")
        if x:
            ax_i.annotate(f" {x:.2f}x dense{' at its max batch' if r['max_batch'] else ''}", (r["images_per_s"], i),
                          va="center", fontsize=8)
    ax_i.set_xlabel("images per second")
    for ax in (ax_t, ax_i):
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(f"{result['gpu']}, {result['model']}, {result['tokens']} tokens, torch {result['torch']}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_bench(args) -> int:
    from .policies import split_specs

    try:
        batches = [b if b == "max" else int(b) for b in args.batch.split(",")]
    except ValueError:
        raise ValueError(f"--batch takes comma-separated integers or 'max', got {args.batch!r}") from None
    if any(b != "max" and b < 1 for b in batches):
        raise ValueError(f"--batch sizes must be >= 1 (or max), got {args.batch!r}")
    if args.layers is not None and args.layers < 1:
        raise ValueError(f"--layers must be >= 1, got {args.layers}")
    if args.memory_gb is not None and not args.memory_gb > 0:
        raise ValueError(f"--memory-gb must be > 0, got {args.memory_gb}")
    if args.memory_gb is not None and "max" not in batches:
        raise ValueError("--memory-gb sets the budget of --batch max; add max to --batch or leave --memory-gb out")
    kernels = args.kernels.split(",")
    if any(k not in KERNELS for k in kernels):
        raise ValueError(f"--kernels takes {' or '.join(KERNELS)}, comma-separated; got {args.kernels!r}")
    if args.llamagen_src:  # (before the timing, not after it)
        from .reference_sampler import _import_llamagen

        _import_llamagen(args.llamagen_src)
    if args.out:  # (a .json beside which the .png goes; checked before the timing, as its rows are written)
        from .checkpoint import check_output_file

        check_output_file(args.out, suffix=".json")
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if args.ring_launch:  # the offset policies' ring kernel, for this run (the launch sweep's candidates)
        from .kernels.triton import ring

        ring.LAUNCH = ring.parse_launch(args.ring_launch)
    if args.matvec_launch:  # the matvec kernel's, likewise (docs/bench/matvec-sweep.sh writes one)
        from .kernels.triton import matvec

        matvec.LAUNCH = matvec.parse_launch(args.matvec_launch)
    variants = tuple(parse_variant(v) for v in args.variant)
    result = bench(args.preset, args.image_tokens, batches, split_specs(args.policies), kernels,
                   cfg_scale=1.0 if args.no_cfg else args.cfg_scale, compile=args.compile or False, memory_gb=args.memory_gb,
                   out=args.out, profile=args.profile, matvec=args.matvec, streams=args.streams, variants=variants,
                   match_budget=args.match_budget, layers=args.layers)
    if args.llamagen_src:
        from .reference_sampler import time_llamagen

        result["reference"] = [time_llamagen(args.llamagen_src, args.preset, args.image_tokens, b,
                                             cfg_scale=1.0 if args.no_cfg else args.cfg_scale)
                               for b in batches if b != "max"]
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=2))
        try:
            plot_bench(result, Path(args.out).with_suffix(".png"))
        except ImportError:
            print("(no picture: matplotlib is not installed; pip install 'arsparse[plots]')")
    print(f"\n{result['gpu']}, torch {result['torch']}, {result['model']} {result['tokens']} tokens, copy bandwidth "
          f"{result['copy_bandwidth_gb_s']:.0f} GB/s, matrix products {result['matmul_tflops']:.0f} TFLOP/s")
    print(markdown_table(result))
    for r in result["rows"]:
        for name, ms in r["profile"] or []:
            print(f"  {r['policy']}{' [' + r['variant'] + ']' if r['variant'] else ''} batch {r['batch']}: "
                  f"{ms:8.3f} ms/step  {name}")
    for ref in result.get("reference", []):
        ours = {r["policy"]: r["images_per_s"] for r in result["rows"] if r["batch"] == ref["batch"] and not r["variant"]}
        vs = ", ".join(f"{p} {v / ref['images_per_s']:.1f}x" for p, v in ours.items())
        print(f"LlamaGen public sampler, batch {ref['batch']}: {ref['images_per_s']:.2f} images/s "
              f"({ref['ms_per_step']:.2f} ms/step); arsparse: {vs}")
    return 0


def add_bench_parser(sub) -> None:
    b = sub.add_parser("bench", help="time decoding on the GPU against its bandwidth and arithmetic floors")
    b.add_argument("--preset", default="GPT-XL")
    b.add_argument("--image-tokens", type=int, default=576)
    b.add_argument("--layers", type=int, help="transformer blocks instead of the preset's (e.g. 1: what a step "
                   "costs outside the blocks)")
    b.add_argument("--batch", default="1,8,64,256", help="comma-separated batch sizes, or max (throughput mode)")
    b.add_argument("--policies", default="dense",
                   help="policies with optional settings, separated by ';' or ',': 'dense;diagonal;h2o:rho=0.14' "
                        "or 'dense,diagonal:rows=2,band=3,streaming'")
    b.add_argument("--match-budget", action="store_true",
                   help="each policy with a rho its spec leaves unset keeps the most entries that fit in diagonal's "
                        "memory (as arsparse eval --match-budget)")
    b.add_argument("--memory-gb", type=finite_float, help="memory budget for --batch max (default: free GPU memory)")
    b.add_argument("--kernels", default="triton", help="decode attention kernels to compare: torch,triton")
    b.add_argument("--cfg-scale", type=finite_float, default=4.0)
    b.add_argument("--no-cfg", action="store_true", help="no classifier-free guidance (half the rows)")
    b.add_argument("--compile", nargs="?", const="default", choices=COMPILE_MODES, metavar="MODE",
                   help="torch.compile the step before capture (slow to build); MODE: "
                        f"{' or '.join(COMPILE_MODES)} (default: default)")
    b.add_argument("--profile", action="store_true", help="also list each row's top GPU kernels per decode step")
    b.add_argument("--matvec", action="store_true",
                   help="latency mode: steps of at most 16 rows (batch 8 with guidance) through Triton matrix-vector "
                        "kernels with the block's norms, RoPE, SwiGLU and residual adds folded in (not with --compile)")
    b.add_argument("--streams", type=int, default=1, choices=[1, 2],
                   help="2: each batch as two half batches on two CUDA streams in one graph (one half's attention "
                        "beside the other's matrix products)")
    b.add_argument("--ring-launch", metavar="KEY=VALUE,...",
                   help="settings of the offset policies' ring kernel for this run (rows_per_program, late_cast, "
                        "heads_first, early_loads, merged, programs (0: one per row block and head; N: N programs that "
                        "take those in turn), num_warps, num_stages; see docs/bench/kernel-sweep.sh), "
                        "recorded in the JSON")
    b.add_argument("--matvec-launch", metavar="JSON",
                   help="settings of the --matvec kernel for this run, a JSON object with keys of its LAUNCH "
                        "(block_n, block_k, max_tile, num_warps, num_stages, weights_first), recorded in the JSON")
    b.add_argument("--variant", action="append", default=[], metavar="KEY=VALUE,...",
                   help="also time every policy and batch with these settings on top of the run's, in the same "
                        "process (compiled once); repeatable. Keys: streams, pdl (0 or 1: programmatic dependent launch), "
                        "w13 (0 or 1: with --compile, each block's w1 and w3 as one matrix product), "
                        "ring.KEY (as --ring-launch), matvec.KEY (as --matvec-launch), dense.KEY (the dense split "
                        "kernel: block_n, small_block_n, num_warps, num_stages, small_splits, programs (0: one per "
                        "row, kv head and split; N: N programs that take those in turn), dot, small_dot and "
                        "prefetch 0|1), "
                        "slots.KEY (the scored policies' slot kernel: block_n, late_cast 0|1, num_warps, num_stages), "
                        "e.g. 'ring.early_loads=1,pdl=1' or 'dense.block_n=64,dense.prefetch=1'")
    b.add_argument("--llamagen-src", help="a LlamaGen checkout: also time its public sampler at each integer batch")
    b.add_argument("--out", help="write the JSON here (a .json file), and beside it a picture of the rows (.png)")
    b.set_defaults(func=cmd_bench)
