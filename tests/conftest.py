import pytest
import torch

from arsparse.models.config import gpt_config
from arsparse.models.gpt import GPT


def random_gpt(model_type="c2i", image_tokens=16, seed=0, **kw) -> GPT:
    """A tiny GPT with fresh random weights large enough to give peaked, position-dependent logits."""
    torch.manual_seed(seed)
    extra = dict(vocab_size=48, num_classes=7) if model_type == "c2i" else dict(vocab_size=48, cls_token_num=5, caption_dim=12)
    extra.update(kw)
    cfg = gpt_config("GPT-tiny", image_tokens=image_tokens, model_type=model_type, **extra)
    model = GPT(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.25)
    return model.eval()


def random_cond(model: GPT, batch: int, seed: int = 1) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    cfg = model.config
    if cfg.model_type == "c2i":
        return torch.randint(0, cfg.num_classes, (batch,), generator=g)
    return torch.randn(batch, cfg.cls_token_num, cfg.caption_dim, generator=g)


def random_slot_tables(B, H, Hkv, P, C, D, dtype, seed, device="cpu"):
    """Inputs of slot-table decode attention and the PyTorch reference's answer.

    Fresh random q, prompt and slot tables, about 40% of the slots free and every slot of row 0,
    kv head 0 free; free slots' K/V are NaN, so reading one poisons the result. Returns the inputs
    (q, prompt_k, prompt_v, slot_k, slot_v, slot_pos) on ``device`` and the reference (out (B, H, D),
    the slots' weights summed over each group (B, Hkv, C)), computed on the CPU before the poisoning.
    """
    from arsparse.kernels.reference import slot_decode_attention_ref

    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    q, pk, pv, k, v = rnd(B, H, D), rnd(B, Hkv, P, D), rnd(B, Hkv, P, D), rnd(B, Hkv, C, D), rnd(B, Hkv, C, D)
    spos = torch.randint(0, 4 * C, (B, Hkv, C), generator=g)
    spos[torch.rand(B, Hkv, C, generator=g) < 0.4] = -1
    spos[0, 0] = -1
    ref = slot_decode_attention_ref(q, pk, pv, k, v, spos)
    free = (spos < 0)[..., None]
    k, v = k.masked_fill(free, float("nan")), v.masked_fill(free, float("nan"))
    return [t.to(device) for t in (q, pk, pv, k, v, spos)], ref


@pytest.fixture(params=["c2i", "t2i"])
def model_type(request):
    return request.param
