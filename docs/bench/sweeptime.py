"""Timing helpers shared by the launch sweeps (kernel-sweep.sh, matvec-sweep.sh), GPU only."""
import itertools

import triton.testing


def timeit(fn) -> float:
    """Median us of a call replayed from a CUDA graph (at 2 rows a kernel takes a few us, less than
    the wrapper's host time), after 100 ms of replays (the clocks fall while the host compiles)."""
    triton.testing.do_bench_cudagraph(fn, rep=100)
    return triton.testing.do_bench_cudagraph(fn, rep=200, return_mode="median") * 1e3


def rounds(fns: dict, n: int = 3) -> dict:
    """{name: (median, spread) us} over n interleaved rounds of every fn (built and warmed first):
    one setting timed twice, far apart, shows how much of a difference is noise."""
    times = {name: [] for name in fns}
    for _ in range(n):
        for name, fn in fns.items():
            times[name].append(timeit(fn))
    return {name: (sorted(t)[len(t) // 2], max(t) - min(t)) for name, t in times.items()}


def rotating(make, nbytes: int):
    """A cycle of enough sets of buffers (``make()`` each, ``nbytes`` per set) that one pass over
    them (> 150 MB) does not fit in the 50 MB L2: a step reads every layer's weights and cache once,
    so a sweep must not time the cache. One set when a set alone is that large."""
    return itertools.cycle([make() for _ in range(max(1, -(-150 * 2**20 // nbytes)))])
