"""The shipped model: its bytes match the model card, it loads, and it models held-out data."""
import hashlib
import re

import pytest
import torch

import arsparse
from arsparse.bundles import BUNDLES, DEFAULT_MODEL, WEIGHTS_DIR


def test_default_is_a_shipped_model_whose_hash_matches_its_card():
    b = BUNDLES[DEFAULT_MODEL]
    assert b.gpt_file is not None, "the default model must be a trained, shipped one"
    path = WEIGHTS_DIR / b.gpt_file
    card = path.with_suffix(".md").read_text()
    want = re.search(r"sha256 `([0-9a-f]{64})`", card).group(1)
    assert hashlib.sha256(path.read_bytes()).hexdigest() == want


def test_shipped_fashion_model_fits_held_out_images():
    """Teacher-forced NLL on real test images is near the card's 1.256 bits/token, far below chance (5 bits)."""
    data = pytest.importorskip("arsparse.data.fashion")
    try:
        images, labels = data.load_fashion("test")
    except data.FashionDataError as e:
        pytest.skip(f"Fashion-MNIST not installed: {e}")
    gpt, tok = arsparse.load_model("fashion-c2i")
    idx = torch.randperm(images.shape[0], generator=torch.Generator().manual_seed(0))[:24]
    tokens = tok.bytes_to_tokens(images[idx]).flatten(1)
    with torch.no_grad():
        logits = gpt.logits(labels[idx], tokens)
    bits = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()) / torch.log(torch.tensor(2.0))
    assert 0.9 < bits < 1.6
    with torch.no_grad():  # the class matters: the wrong label costs bits
        wrong = gpt.logits((labels[idx] + 5) % 10, tokens)
    bits_wrong = torch.nn.functional.cross_entropy(wrong.flatten(0, 1), tokens.flatten()) / torch.log(torch.tensor(2.0))
    assert bits_wrong > bits + 0.02
