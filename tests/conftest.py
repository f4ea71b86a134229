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


@pytest.fixture(params=["c2i", "t2i"])
def model_type(request):
    return request.param
