"""Prefetching into the L2 from inside a kernel (the matvec, ring and dense kernels' ``PF_MODE``).

A decode kernel that waits on its own loads leaves the memory idle between its waves of programs.
A program can instead name lines that a later launch (matvec: the next projection's weights) or a
later program of its own launch (ring: the program ``ahead`` places on) will read, so that they
come from the L2 when asked for. ``prefetch.global.L2`` writes no register and is not waited for.

Modes (a constexpr): 0 off; 1 prefetch (CUDA); for tests in the interpreter, which cannot run PTX
(fp32 buffers): 2 adds 1 at each address a launch names, so a test sees exactly which lines; 3 adds
1 at every lane's address, masked lanes too, as mode 1 sends them, so a test can check that none
falls outside the tensor.
"""
import triton
import triton.language as tl

#: Bytes per line the hardware fetches (one prefetch per line).
LINE_BYTES = 128


def line_elems(element_size: int) -> int:
    """Elements of ``element_size`` bytes per line (at least 1)."""
    return max(1, LINE_BYTES // element_size)


COUNT_MODES = {False: None, True: 2, "lanes": 3}


def mode_for(enabled: bool, device, count: bool | str = False) -> int:
    """The kernels' PF_MODE: 0 unless ``enabled``; then for tests ``count`` True -> 2, ``"lanes"`` -> 3;
    else 1 on CUDA and 0 elsewhere (the interpreter cannot run the PTX; prefetching changes no result)."""
    if count not in COUNT_MODES:
        raise ValueError(f"count_prefetch must be False, True or 'lanes', got {count!r}")
    if not enabled:
        return 0
    return COUNT_MODES[count] or int(device.type == "cuda")


def row_args(enabled: bool, device, count: bool | str, element_size: int, block_d: int) -> dict:
    """PF_MODE, PF_LINE, PF_NL of a kernel that prefetches cache rows of ``block_d`` elements (NL lines each)."""
    line = line_elems(element_size)
    return dict(PF_MODE=mode_for(enabled, device, count), PF_LINE=line, PF_NL=max(1, block_d // line))


@triton.jit
def touch(ptrs, mask, MODE: tl.constexpr):
    """Prefetch the lines holding ``ptrs`` (MODE 1; every pointer must be a valid address, masked
    lanes included: callers point them at a line they prefetch anyway) or add 1 at the unmasked
    pointers (MODE 2)."""
    if MODE == 1:
        tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs],
                                  dtype=tl.int32, is_pure=False, pack=1)
    elif MODE == 2:
        tl.atomic_add(ptrs, 1.0, mask=mask)
    elif MODE == 3:  # every lane, as MODE 1 addresses them: a test's guard zones around the tensor stay 0
        tl.atomic_add(ptrs, 1.0)


@triton.jit
def touch_range(P, numel, pid, nprog, LINE: tl.constexpr, BLOCK: tl.constexpr, MODE: tl.constexpr):
    """Program ``pid`` of ``nprog`` takes its share of the lines of ``P[0:numel]`` (contiguous): line
    starts ``l * LINE``, then the last element (its line, where ``P`` is not line-aligned)."""
    lines = tl.cdiv(numel, LINE) + 1
    per = tl.cdiv(lines, nprog)
    start = pid * per
    end = tl.minimum(start + per, lines)
    for l0 in range(start, end, BLOCK):
        line = l0 + tl.arange(0, BLOCK)
        mask = line < end
        elem = tl.minimum(tl.where(mask, line, l0) * LINE, numel - 1)
        touch(P + elem, mask, MODE)


@triton.jit
def touch_rows(K, V, base, idx, keep, sk, sv, dl, D, MODE: tl.constexpr):
    """Prefetch (or count) the lines of cache rows ``base + idx * sk`` of K and ``base + idx * sv`` of V
    where ``keep`` (BX,); ``dl`` (NL,): the line starts within a row of D elements."""
    m = keep[:, None] & (dl < D)[None, :]  # (BX, NL)
    touch(K + tl.where(m, base + idx[:, None] * sk + dl[None, :], 0), m, MODE)
    touch(V + tl.where(m, base + idx[:, None] * sv + dl[None, :], 0), m, MODE)
