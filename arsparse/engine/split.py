"""Two half batches on two CUDA streams (``Generator(streams=2)``).

A decode step is, layer after layer, attention that waits on memory then matrix products that wait
on arithmetic, and at batch 256 a projection's tiles do not fill an H200's 132 SMs. Two independent
half batches, each with its own cache and step, captured into one CUDA graph on two streams (forked
from the capturing stream and joined back), leave the GPU free to run one half's attention beside the
other's matrix products. The images are those of one runner up to float rounding: every image keeps
its own sampling key and the halves are separate sequences, but a half's kernels may split their
sums differently (a split-KV kernel chooses its splits by the rows; cuBLAS its tiles), which can
flip a near-tied token. (``arsparse bench --profile`` profiles eager steps: the halves one after the
other, not overlapped.) Measured (BENCHMARKS runs 19, 36 and 38): the halves' kernels do run side by side, but
beside each other they run longer (the products' kernel time more than doubles), so at batch 256 this is
slower than one runner; it stays off by default.
"""
from __future__ import annotations

from dataclasses import replace

import torch

from .generator import _Plan, _Runner, _Stepping, step_buffers


class SplitRunner(_Stepping):
    """A runner of ``plan.batch >= 2`` images as two half :class:`_Runner` s whose buffers are halves of
    its own (so ``Generator.prepare`` fills them as one)."""

    def __init__(self, gpt, plan: _Plan, device: torch.device, use_graphs: bool, kernel: str = "torch",
                 compile_step: bool = False, policy=None):
        if plan.batch < 2:
            raise ValueError(f"two streams need at least 2 images in the batch, got {plan.batch}")
        self.plan, self.P, self.N = plan, gpt.config.cls_token_num, gpt.config.image_tokens
        b, h = plan.batch, plan.batch // 2
        buffers = step_buffers(b, self.N, device)
        for name, t in buffers.items():
            setattr(self, name, t)
        self.parts = (slice(0, h), slice(h, b))
        self.halves = [_Runner(gpt, replace(plan, batch=s.stop - s.start), device, False, kernel, compile_step, policy,
                               buffers={name: t[s] for name, t in buffers.items()}) for s in self.parts]
        self.graph = None
        if use_graphs:
            self._capture()

    @property
    def rows(self) -> int:
        return sum(r.rows for r in self.halves)

    def set_prompt_mask(self, mask: torch.Tensor | None) -> None:
        for r, s in zip(self.halves, self.parts):
            r.set_prompt_mask(None if mask is None else mask[s])

    def start(self, cond: torch.Tensor) -> None:
        for r, s in zip(self.halves, self.parts):
            r.start(cond[s])

    def decode_step(self) -> None:
        for r in self.halves:
            r.decode_step()

    def _capture(self) -> None:
        for r in self.halves:
            r.warm_up()
        streams = [torch.cuda.Stream() for _ in self.halves]
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            main = torch.cuda.current_stream()
            for r, stream in zip(self.halves, streams):  # fork: each half on its own stream
                stream.wait_stream(main)
                with torch.cuda.stream(stream):
                    r.decode_step()
            for stream in streams:  # join
                main.wait_stream(stream)
