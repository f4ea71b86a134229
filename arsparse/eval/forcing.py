"""Teacher forcing through a policy's decode path, fast enough to sweep budgets on a GPU.

Offset policies and dense teacher-force in one masked pass (``gpt.logits(cond, tokens, policy=p)``).
Scored policies have to run the evicting cache token by token; eagerly that is about 1,400-2,400
small kernel launches per step on a 10-layer model (fashion-c2i), so host-bound. On CUDA,
:func:`forced_logits` captures that step once in a CUDA graph (as sampling does) and replays it for
every position, feeding the teacher's token into the step's static input.
"""
from __future__ import annotations

import warnings

import torch

__all__ = ["forced_logits", "forced_guidance_pairs"]


def _uses_decode_loop(policy) -> bool:
    from ..policies.scored import ScoredPolicy

    return isinstance(policy, ScoredPolicy)


@torch.no_grad()
def forced_logits(gpt, cond: torch.Tensor, tokens: torch.Tensor, policy=None, graphs: bool | None = None) -> torch.Tensor:
    """Teacher-forced logits (B, T, V) under ``policy`` (None = dense), equal to ``gpt.logits(cond, tokens, policy)``.

    ``graphs``: replay a captured decode step for scored policies (default: on CUDA). Where the
    capture fails, the eager loop runs instead (with a warning). ``graphs=False`` on a scored policy
    still runs this module's own step loop (the reference path is ``gpt.logits``).
    """
    if policy is None:
        return gpt.logits(cond, tokens)
    if not _uses_decode_loop(policy):
        return gpt.logits(cond, tokens, policy=policy)
    device = next(gpt.parameters()).device
    use_graphs = device.type == "cuda" if graphs is None else graphs
    if use_graphs:
        try:
            return _decode_loop(gpt, cond, tokens, policy, graphs=True)
        except RuntimeError as e:  # capture not supported here: the same loop, eager
            warnings.warn(f"teacher forcing under {policy.name}: CUDA graph capture failed ({e}); running eagerly")
    return _decode_loop(gpt, cond, tokens, policy, graphs=False)


@torch.no_grad()
def forced_guidance_pairs(gpt, cond: torch.Tensor, tokens: torch.Tensor, policy, batch: int):
    """Teacher-forced (conditional, unconditional) fp32 logits, each (b, N, V), ``batch`` images at a time,
    under ``policy`` (None = dense): the two halves classifier-free guidance combines, the unconditional
    from the null class as the engine guides every token. Yields ``(lc, lu, b * N)``."""
    dev = next(gpt.parameters()).device
    null = gpt.config.num_classes
    for i in range(0, len(tokens), batch):
        c, t = cond[i : i + batch].to(dev), tokens[i : i + batch].to(dev)
        lc = forced_logits(gpt, c, t, policy).float()  # (b, N, V)
        lu = forced_logits(gpt, torch.full_like(c, null), t, policy).float()  # (b, N, V)
        yield lc, lu, t.numel()


def _decode_loop(gpt, cond, tokens, policy, graphs: bool) -> torch.Tensor:
    from ..engine.generator import Generator, _Plan, _Runner

    p = next(gpt.parameters())
    gen = Generator(gpt, device=p.device, dtype=p.dtype, cuda_graphs=False, compile=False, policy=policy)
    cond, tokens = torch.as_tensor(cond).to(gen.device), tokens.to(gen.device)
    gpt.check_cond(cond, allow_null=True)
    gpt.check_tokens(tokens, cond.shape[0])  # (the steps would broadcast, or index past the cache or the vocabulary)
    B, T = tokens.shape
    run = _Runner(gen.gpt, _Plan(B, False, 0, False), gen.device, False, gen.kernel, policy=gen.policy)
    logits = torch.empty(B, gpt.config.vocab_size, dtype=p.dtype, device=gen.device)  # the step's static output

    def step():
        logits.copy_(run.step_logits())

    graph = None
    if graphs:  # warm up on a side stream, then capture (the cache is reset by the prefill below)
        run.cache.phase = "decode"
        run.cache.pos.fill_(gpt.config.cls_token_num)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                step()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            step()
    out = torch.empty(B, T, gpt.config.vocab_size, dtype=p.dtype, device=gen.device)  # (B, T, V)
    out[:, 0] = run.prefill_logits(cond)
    for t in range(1, T):
        run.cur.copy_(tokens[:, t - 1])
        if graph is not None:
            graph.replay()
        else:
            step()
        out[:, t] = logits
    return out
