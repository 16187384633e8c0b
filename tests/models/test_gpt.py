"""The built-in GPT: shapes, causality, weight tying, parameter count, names and init."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from spdkfac.models import BUILTIN_MODEL_NAMES, GPT, build_model, model_kind
from spdkfac.models.gpt import gpt_parameter_count

__all__: list[str] = []

TINY = {"vocab_size": 17, "block_size": 8, "n_layer": 2, "n_head": 2, "d_model": 16}


def _tiny(**overrides: object) -> GPT:
    torch.manual_seed(0)
    return GPT(**{**TINY, **overrides})  # type: ignore[arg-type]


def _tokens(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY["vocab_size"], (batch, length), generator=generator)


@pytest.mark.parametrize("length", [1, 5, 8])
def test_logits_have_one_row_per_position(length: int) -> None:
    logits = _tiny()(_tokens(3, length))
    assert logits.shape == (3, length, TINY["vocab_size"])
    assert torch.isfinite(logits).all()


def test_longer_than_the_block_or_not_2d_is_refused() -> None:
    model = _tiny()
    with pytest.raises(ValueError, match="exceeds block_size 8"):
        model(_tokens(1, 9))
    with pytest.raises(ValueError, match=r"\[B, T\]"):
        model(_tokens(1, 4)[0])


@pytest.mark.parametrize("position", [0, 3, 6])
def test_changing_a_later_token_leaves_earlier_logits_alone(position: int) -> None:
    model = _tiny().eval()
    tokens = _tokens(2, 8)
    changed = tokens.clone()
    changed[:, position + 1] = (changed[:, position + 1] + 5) % TINY["vocab_size"]
    with torch.no_grad():
        before, after = model(tokens), model(changed)
    torch.testing.assert_close(
        before[:, : position + 1], after[:, : position + 1], rtol=0, atol=1e-6
    )
    assert not torch.allclose(before[:, position + 1 :], after[:, position + 1 :])


def test_tied_head_is_the_token_embedding_parameter() -> None:
    model = _tiny()
    assert model.head.weight is model.tok_emb.weight
    assert sum(p is model.tok_emb.weight for p in model.parameters()) == 1
    untied = _tiny(tie_weights=False)
    assert untied.head.weight is not untied.tok_emb.weight
    assert untied.head.bias is None


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize(("layers", "ratio"), [(1, 4), (3, 2)])
def test_parameter_count_formula(tie: bool, layers: int, ratio: int) -> None:
    model = _tiny(tie_weights=tie, n_layer=layers, mlp_ratio=ratio)
    counted = sum(p.numel() for p in model.parameters())
    assert counted == gpt_parameter_count(
        TINY["vocab_size"], TINY["block_size"], layers, TINY["d_model"], ratio, tie
    )


def test_default_size_by_hand() -> None:
    # V·d + T·d + L·(12d² + 13d) + 2d with V = 256, T = 128, L = 2, d = 128, ratio 4, tied.
    expected = 256 * 128 + 128 * 128 + 2 * (12 * 128**2 + 13 * 128) + 2 * 128
    assert expected == 445_952
    assert sum(p.numel() for p in build_model("gpt").parameters()) == expected


def test_module_names_and_linear_attention() -> None:
    model = _tiny(n_layer=1)
    modules = dict(model.named_modules())
    expected = {
        "tok_emb": nn.Embedding, "pos_emb": nn.Embedding, "blocks.0.ln1": nn.LayerNorm,
        "blocks.0.attn.qkv": nn.Linear, "blocks.0.attn.proj": nn.Linear,
        "blocks.0.ln2": nn.LayerNorm, "blocks.0.mlp.fc": nn.Linear,
        "blocks.0.mlp.proj": nn.Linear, "ln_f": nn.LayerNorm, "head": nn.Linear,
    }  # fmt: skip
    for name, kind in expected.items():
        assert isinstance(modules[name], kind), name
    assert modules["blocks.0.attn.qkv"].out_features == 3 * 16
    assert modules["blocks.0.mlp.fc"].out_features == 4 * 16
    assert not any(isinstance(m, nn.MultiheadAttention) for m in model.modules())
    linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    assert linear == ["blocks.0.attn.qkv", "blocks.0.attn.proj", "blocks.0.mlp.fc",
                      "blocks.0.mlp.proj", "head"]  # fmt: skip


def test_gpt2_initialization() -> None:
    torch.manual_seed(0)
    layers = 8
    model = GPT(vocab_size=64, block_size=64, n_layer=layers, n_head=4, d_model=64)
    residual = 0.02 / math.sqrt(2 * layers)
    for block in model.blocks:
        assert isinstance(block, nn.Module)
        for name, param in block.named_parameters():
            if name.endswith("bias") and not name.startswith("ln"):
                assert torch.count_nonzero(param) == 0, name
        proj = torch.cat([block.attn.proj.weight.flatten(), block.mlp.proj.weight.flatten()])
        assert proj.std().item() == pytest.approx(residual, rel=0.1)
        assert block.mlp.fc.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.tok_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)
    assert model.pos_emb.weight.std().item() == pytest.approx(0.02, rel=0.1)


def test_backward_reaches_every_parameter() -> None:
    model = _tiny(dropout=0.1)
    tokens = _tokens(2, 8)
    logits = model(tokens)
    torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens.flatten()).backward()
    for name, param in model.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name


def test_registered_as_a_text_model() -> None:
    assert "gpt" in BUILTIN_MODEL_NAMES
    assert model_kind("GPT") == "text" and model_kind("resnet20") == "image"
    model = build_model("gpt", vocab_size=11, block_size=4, n_layer=1, d_model=8, n_head=2)
    assert isinstance(model, GPT) and model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 11)
    with pytest.raises(ValueError, match="image model"):
        build_model("mlp", block_size=4)


@pytest.mark.parametrize(
    ("option", "value"), [("n_head", 3), ("d_model", 0), ("n_layer", True), ("dropout", 1.0)]
)
def test_bad_sizes_are_refused(option: str, value: object) -> None:
    with pytest.raises(ValueError, match=option if option != "n_head" else "multiple"):
        GPT(**{**TINY, option: value})  # type: ignore[arg-type]
