"""Programmatic dependent launch (Hopper and later) for the decode kernels (the constexpr ``PDL``).

In a CUDA graph each kernel normally starts only when the one before it has finished: the SMs sit
idle while the last programs of one launch drain and the first of the next are scheduled, and a
kernel of a few microseconds (the latency mode's projections, BENCHMARKS run 8) never fills the
memory pipeline. Launched with PDL, a kernel may start as soon as every program of the one before
has called ``gdc_launch_dependents`` (our kernels call it first thing); it must then call
``gdc_wait`` (which returns once that kernel has finished and its writes are visible) before it
reads anything the step writes or writes anything itself. Before the wait a kernel reads only what
no kernel of the step writes: weights, norm weights, the step's RoPE table (written by ordinary
launches, which start only after everything before them has finished). Every program waits
before it ends, so completion stays transitive along a chain of PDL launches.

On by default (``ENABLED``; BENCHMARKS run 10: the latency mode's step at batch 1 went from 1.363 to
1.103 ms); ``arsparse bench --variant pdl=0`` times it off. Never in the interpreter
(it cannot run the instructions; it runs programs one after another anyway) or off CUDA.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

#: 1: the decode kernels (matvec, dense split + combine, ring) launch with PDL on GPUs of compute
#: capability 9 or later.
ENABLED = 1


def pdl_args(device: torch.device) -> dict:
    """The launch arguments of a kernel with a ``PDL`` constexpr: ``PDL`` and Triton's ``launch_pdl``."""
    on = (bool(ENABLED) and device.type == "cuda" and os.environ.get("TRITON_INTERPRET") != "1"
          and torch.cuda.get_device_capability(device)[0] >= 9)
    return dict(PDL=on, launch_pdl=on)


@triton.jit
def launch_next(PDL: tl.constexpr):
    """Let the next launch start once every program of this one has got here (with PDL)."""
    if PDL:
        gdc_launch_dependents()


@triton.jit
def wait_prior(PDL: tl.constexpr):
    """Wait (with PDL) until the launch before this one has finished and its writes are visible."""
    if PDL:
        gdc_wait()
