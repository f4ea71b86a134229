"""Experiment: would two half batches on two CUDA streams beat one batch on one?

A decode step at batch 256 is attention (memory-bound: the ring kernel 1.8 of diagonal's 4.0 ms, the
dense split kernel 8.5 of 10.3) then matmuls (compute-bound: 1.6 ms), layer after layer, one waiting
for the other. Two independent half batches, each its own captured step on its own stream, could
overlap one's attention with the other's matmuls, if the GPU runs their blocks side by side. This
times, for each policy, N - 1 decode steps (graph replays, after a prefill) of:

  one     - one runner at the whole batch, one stream (what the engine does)
  serial  - two runners at half the batch, one after the other on one stream (the control)
  streams - the same two runners on two streams, so their kernels may overlap

On the H200: PYTHONPATH=. python3 docs/bench/overlap.py [--batch 256] [--policies "dense;diagonal"]
(prints a table; JSON in $OUT/overlap.json). Random GPT-XL weights, 576 tokens, guidance 4, compiled.
"""
import argparse
import json
import os

import torch

from arsparse.bench import _random_gpt
from arsparse.engine.generator import Generator
from arsparse.models.config import gpt_config
from arsparse.policies import get


def runners(gen: Generator, batches: list[int]):
    """A captured runner per batch size, each with its own cache (the generator keeps only its last)."""
    out = []
    for b in batches:
        gen._runner = None  # (the previous runner stays alive: we hold it)
        cond = torch.arange(b) % gen.config.num_classes
        run, c, _ = gen.prepare(cond, cfg_scale=4.0, seed=len(out))
        out.append((run, c))
    return out


def time_steps(pairs, streams, N: int) -> float:
    """ms per decode step of all runners together: prefill, then N - 1 replays each, runner i on streams[i]."""
    main = torch.cuda.current_stream()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    for s in streams:
        s.wait_stream(main)
    with torch.no_grad():
        for (run, c), s in zip(pairs, streams):
            with torch.cuda.stream(s):
                run._emit(run.prefill_logits(c), torch.zeros((), dtype=torch.long, device=c.device))
        for s in streams:
            main.wait_stream(s)
        start.record()
        for s in streams:
            s.wait_stream(main)
        for _ in range(N - 1):
            for (run, _), s in zip(pairs, streams):
                with torch.cuda.stream(s):
                    run.graph.replay()
        for s in streams:
            main.wait_stream(s)
        end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / (N - 1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--policies", default="dense;diagonal")
    ap.add_argument("--image-tokens", type=int, default=576)
    args = ap.parse_args()
    cfg = gpt_config("GPT-XL", image_tokens=args.image_tokens)
    gpt = _random_gpt(cfg, "cuda", torch.bfloat16)
    N, half = cfg.image_tokens, args.batch // 2
    rows = []
    for name in args.policies.split(";"):
        gen = Generator(gpt, device="cuda", dtype="bf16", compile=True, policy=None if name == "dense" else get(name))
        one = runners(gen, [args.batch])
        two = runners(gen, [half, args.batch - half])
        s1, s2 = torch.cuda.Stream(), torch.cuda.Stream()
        time_steps(one, [s1], 32)  # warm-up
        time_steps(two, [s1, s2], 32)
        row = dict(policy=name, batch=args.batch, one_ms=time_steps(one, [s1], N),
                   serial_ms=time_steps(two, [s1, s1], N), streams_ms=time_steps(two, [s1, s2], N))
        row["gain"] = row["one_ms"] / row["streams_ms"]
        rows.append(row)
        print(f"{name}: one stream {row['one_ms']:.3f} ms/step, two halves serial {row['serial_ms']:.3f}, "
              f"two streams {row['streams_ms']:.3f} ({row['gain']:.2f}x one)", flush=True)
        del one, two
        gen.release()
    out = os.environ.get("OUT", "/tmp/out")
    os.makedirs(out, exist_ok=True)
    json.dump(dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, rows=rows),
              open(f"{out}/overlap.json", "w"), indent=1)


if __name__ == "__main__":
    main()
