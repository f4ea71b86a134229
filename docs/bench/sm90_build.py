"""The decode kernels' engine builds for sm_90, without a GPU: SASS instructions (whole kernel, and per
pass of its main loop), registers, spills, shared memory, and the global loads issued ahead: in the
main loop (else the kernel) before its first shuffle or matrix product, i.e. before it waits on any
loaded tile. What BENCHMARKS.md quotes for untimed kernel forms; proxies only: run 12's ring kernel got
faster with fewer instructions, but run 13's dense split kernel got 31 % slower with fewer
instructions and registers, when its loads ahead fell from 17 to 2 (ptxas put each load next to its
use, so their latencies add up). Versions schedule differently: Triton 3.9 (its own ptxas) issues
dense-64-prefetch's next-tile loads after the current tile's score reduction (0 ahead), Triton 3.6
before it (16): count with the H200's 3.6.

    PYTHONPATH=. python3 docs/bench/sm90_build.py [BUILD ...]     # default: every build below

Triton compiles as the launch would specialise it (pointers and strides divisible by 16; the
engine's constexprs) and disassembles with the nvdisasm/ptxas it ships. The H200 image has Triton
3.6: `pip install --target /tmp/t36 --no-deps triton==3.6.0` and put /tmp/t36 first on PYTHONPATH to
count what it builds.
"""
import collections
import importlib
import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.backends.nvidia.compiler import get_ptxas  # (the ptxas Triton itself assembles with)
from triton.compiler import ASTSource

_RING_PTR = dict(OFF="*i64", POS="*i64", SPAN="*i32", KSUM="*fp32", VSUM="*fp32", ROPE="*fp32",
                 **{n: "*bf16" for n in ("Q", "KN", "VN", "PK", "PV", "SK", "SV", "RK", "RV", "OUT")})
_RING = dict(G=1, ROWS=1, BLOCK_P=1, BLOCK_D=64, BLOCK_O=64, BLOCK_S=4, HAS_SPAN=False, HAS_REST=False,
             LATE_CAST=False, HEADS_FIRST=False, EARLY=True, MERGED=True, ALIGN=16, HAS_ROPE=True)
_DENSE_PTR = dict(POS="*i64", SPAN="*i32", O_PART="*fp32", M_PART="*fp32", L_PART="*fp32",
                  **{n: "*bf16" for n in ("Q", "KN", "VN", "K", "V", "OUT")})
_DENSE = dict(G=1, BLOCK_G=1, BLOCK_N=128, BLOCK_D=64, DIRECT=True, HAS_SPAN=False)
_MV_PTR = dict(ROPE="*fp32", **{n: "*bf16" for n in ("X", "F", "NW", "W", "W3", "RES", "Y", "XS")})
_MV = dict(BLOCK_M=2, BLOCK_N=4, HAS_F=False, HAS_NORM=False, GLU=False, HAS_RES=False, HAS_ROPE=False, PDL=True,
           ONE_CHUNK=True)
_EVICT_PTR = dict(SCORE="*fp32", POS="*i64", EV="*u8", K="*i64", RANK="*i32", OUT="*i8")
#: build -> (module, kernel, pointer types, constexprs, num_warps, num_stages): GPT-XL's shapes (20 heads of 64;
#: the latency mode's projections at 2 rows: wqkv with the residual add, norm and RoPE, wo, w1/w3, w2)
BUILDS = {
    "ring": ("_ring", "ring_decode_kernel", _RING_PTR, _RING, 1, 3),
    "ring-three-tiles": ("_ring", "ring_decode_kernel", _RING_PTR, dict(_RING, MERGED=False), 1, 3),
    "ring-rope-in-block": ("_ring", "ring_decode_kernel", _RING_PTR, dict(_RING, HAS_ROPE=False), 1, 3),
    "ring-remainder": ("_ring", "ring_decode_kernel", _RING_PTR, dict(_RING, HAS_REST=True, ADD_NEW=True), 1, 3),
    "ring-persistent": ("_ring", "ring_decode_kernel", _RING_PTR, dict(_RING, PERSISTENT=True), 1, 3),
    "dense": ("_decode", "decode_split_kernel", _DENSE_PTR, _DENSE, 2, 3),
    "dense-64-prefetch": ("_decode", "decode_split_kernel", _DENSE_PTR, dict(_DENSE, BLOCK_N=64, PREFETCH=True), 2, 3),
    "dense-64": ("_decode", "decode_split_kernel", _DENSE_PTR, dict(_DENSE, BLOCK_N=64), 2, 3),
    "dense-4warps": ("_decode", "decode_split_kernel", _DENSE_PTR, _DENSE, 4, 3),
    "dense-dot": ("_decode", "decode_split_kernel", _DENSE_PTR, dict(_DENSE, BLOCK_G=16, DOT=True), 2, 3),
    "dense-64-dot": ("_decode", "decode_split_kernel", _DENSE_PTR, dict(_DENSE, BLOCK_N=64, BLOCK_G=16, DOT=True),
                     2, 3),
    "dense-64-dot-persistent": ("_decode", "decode_split_kernel", _DENSE_PTR,
                                dict(_DENSE, BLOCK_N=64, BLOCK_G=16, DOT=True, PERSISTENT=True), 2, 3),
    "matvec-qkv": ("_matvec", "matvec_kernel", _MV_PTR, dict(_MV, BLOCK_K=2048, HAS_F=True, HAS_NORM=True,
                                                             HAS_ROPE=True), 4, 2),
    "matvec-wo": ("_matvec", "matvec_kernel", _MV_PTR, dict(_MV, BLOCK_K=2048, HAS_RES=True), 4, 2),
    "matvec-w13": ("_matvec", "matvec_kernel", _MV_PTR, dict(_MV, BLOCK_K=2048, HAS_NORM=True, GLU=True), 4, 2),
    "matvec-w2": ("_matvec", "matvec_kernel", _MV_PTR, dict(_MV, BLOCK_K=4096, HAS_RES=True), 4, 2),
    "evict-one": ("_evict", "evict_one_kernel", _EVICT_PTR, dict(BLOCK_R=32, BLOCK_C=64), 4, 3),
    "evict-many": ("_evict", "evict_many_kernel", _EVICT_PTR, dict(BLOCK_T=64, BLOCK_I=32, BLOCK_J=64), 4, 3),
}


def build(module: str, name: str, pointers: dict, const: dict, warps: int, stages: int) -> dict:
    kernel = getattr(importlib.import_module(f"arsparse.kernels.triton.{module}"), name)
    const = {**{p.name: p.default for p in kernel.params if p.is_constexpr and p.has_default}, **const}
    sig = {n: "constexpr" if n in const else pointers.get(n, "fp32" if n == "scale" else "i32") for n in kernel.arg_names}
    # pointers (torch allocations) and strides/sizes that are multiples of 16 elements, as the launch specialises
    div = {n for n in kernel.arg_names if n not in const and (sig[n].startswith("*") or n.startswith("s") and n != "scale"
                                                              or n in ("D", "S", "chunk", "K", "N", "head_dim"))}
    src = ASTSource(fn=kernel, signature=sig, attrs={(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in div},
                    constexprs={(kernel.arg_names.index(n),): v for n, v in const.items()})
    built = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages))
    tools = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    with tempfile.TemporaryDirectory() as tmp:
        cubin, ptx = os.path.join(tmp, "k.cubin"), os.path.join(tmp, "k.ptx")
        open(cubin, "wb").write(built.asm["cubin"])
        open(ptx, "w").write(built.asm["ptx"])
        sass = subprocess.run([os.path.join(tools, "nvdisasm"), "-c", cubin], capture_output=True, text=True,
                              check=True).stdout
        info = subprocess.run([get_ptxas(90).path, "--gpu-name", "sm_90a", "-v", ptx, "-o", os.devnull],
                              capture_output=True, text=True, check=True).stderr
    count, labels, loop, start, ops, loads, waits = 0, {}, None, 0, collections.Counter(), [], []
    for line in sass.splitlines():
        label = re.match(r"\s*(\.L_x_\d+):", line)
        if label:
            labels[label.group(1)] = count
        if not re.match(r"\s*/\*[0-9a-f]{4}\*/", line):
            continue
        op = re.search(r"\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        ops[op.group(1) if op else "?"] += 1
        if op and op.group(1) in ("LDG", "LDGSTS"):
            loads.append(count)
        if op and op.group(1) in ("SHFL", "HMMA"):
            waits.append(count)
        back = re.search(r"BRA[^`]*`\((\.L_x_\d+)\)", line)
        if back and back.group(1) in labels and count - labels[back.group(1)] + 1 > (loop or 1):  # (not the final self-loop)
            loop, start = count - labels[back.group(1)] + 1, labels[back.group(1)]
        count += 1
    num = lambda pattern: int(m.group(1)) if (m := re.search(pattern, info)) else None  # noqa: E731
    first_wait = min((i for i in waits if i >= start), default=count)
    ahead = sum(start <= i < first_wait for i in loads)
    return dict(instructions=count, loop=loop, loads_ahead=ahead, registers=num(r"Used (\d+) registers"),
                spills=num(r"(\d+) bytes spill stores"), shared=built.metadata.shared,
                top=" ".join(f"{k}:{v}" for k, v in ops.most_common(8)))


if __name__ == "__main__":
    os.environ["TRITON_INTERPRET"] = "0"
    names = sys.argv[1:] or list(BUILDS)
    unknown = set(names) - set(BUILDS)
    if unknown:
        sys.exit(f"unknown builds {sorted(unknown)}; known: {', '.join(BUILDS)}")
    print(f"Triton {triton.__version__}, sm_90\n\n| build | instructions | main loop pass | loads ahead | registers "
          "| spill bytes | shared bytes | most frequent |\n|---|---|---|---|---|---|---|---|")
    for n in names:
        r = build(*BUILDS[n])
        print(f"| {n} | {r['instructions']} | {r['loop'] or '-'} | {r['loads_ahead']} | {r['registers']} | {r['spills']} | {r['shared']} "
              f"| {r['top']} |")
