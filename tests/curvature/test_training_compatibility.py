"""Training-loop compatibility of the curvature blocks: torch.compile, activation
checkpointing, keyword inputs, attention, tied weights, lazy and meta models."""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from spdkfac import KFACPreconditioner


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.ReLU(), nn.Linear(8, 3))


def _train(model: nn.Module, call: nn.Module, steps: int = 2, **options: object) -> list[Tensor]:
    precond = KFACPreconditioner(model, normalization="unit-wise", kl_clip=None, **options)  # type: ignore[arg-type]
    torch.manual_seed(1)
    inputs, targets = torch.randn(5, 4, 6), torch.randint(0, 3, (5, 4))
    for _ in range(steps):
        model.zero_grad()
        F.cross_entropy(call(inputs).reshape(-1, 3), targets.reshape(-1)).backward()
        assert precond.step()
    return [p.grad.clone() for p in model.parameters()]  # type: ignore[union-attr]


def test_compiled_model_gives_the_eager_preconditioned_gradients() -> None:
    eager = _model()
    compiled_source = copy.deepcopy(eager)
    # The "eager" backend runs Dynamo's tracing (where hooks could be lost or reordered)
    # without Inductor's code generation, which only changes float rounding and takes
    # minutes on a small CPU.
    compiled = torch.compile(compiled_source, backend="eager")
    expected = _train(eager, eager)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Dynamo's notes on traced helpers
        got = _train(compiled_source, compiled)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b)


def test_compiled_model_keeps_the_users_layer_names() -> None:
    model = _model()
    precond = KFACPreconditioner(torch.compile(model, backend="eager"), skip_layers=["3"])
    assert precond.layers == ["0"]
    assert set(precond.state_dict()["layers"]) == {"0"}


class _Checkpointed(nn.Module):
    def __init__(self, inner: nn.Module, reentrant: bool) -> None:
        super().__init__()
        self.inner = inner
        self.reentrant = reentrant

    def forward(self, x: Tensor) -> Tensor:
        if self.reentrant:  # the reentrant variant needs an input that requires grad
            x = x.detach().requires_grad_(True)
        out = checkpoint(self.inner, x, use_reentrant=self.reentrant)
        assert isinstance(out, Tensor)
        return out


@pytest.mark.parametrize("reentrant", [False, True])
def test_activation_checkpointing_captures_each_layer_once(reentrant: bool) -> None:
    plain = _model()
    wrapped = _Checkpointed(copy.deepcopy(plain), reentrant)
    expected = _train(plain, plain, steps=3)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)  # "extra passes" would be a bug
        got = _train(wrapped, wrapped, steps=3)
    for a, b in zip(expected, got, strict=True):
        torch.testing.assert_close(a, b)


class _KeywordCall(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(6, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(input=x)


def test_a_layer_called_with_a_keyword_input_is_captured() -> None:
    torch.manual_seed(0)
    model = _KeywordCall()
    precond = KFACPreconditioner(model)
    F.cross_entropy(model(torch.randn(4, 6)), torch.randint(0, 3, (4,))).backward()
    precond.step()
    a_factor, g_factor = precond.factors("fc")
    assert a_factor is not None and g_factor is not None


class _Attention(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(8, 2, batch_first=True)
        self.fc = nn.Linear(8, 3)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc(self.attn(x, x, x, need_weights=False)[0])


def test_multihead_attention_is_listed_with_the_way_out() -> None:
    with pytest.warns(UserWarning, match=r"MultiheadAttention \(1\).*nn.Linear"):
        precond = KFACPreconditioner(_Attention())
    assert precond.layers == ["fc"]  # out_proj is never called through its forward


class _Tied(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 6)
        self.mix = nn.Linear(6, 6)
        self.head = nn.Linear(6, 10, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: Tensor) -> Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def test_a_tied_weight_is_preconditioned_once_by_the_output_head() -> None:
    torch.manual_seed(0)
    model = _Tied()
    precond = KFACPreconditioner(model, kl_clip=None)
    assert precond.layers == ["mix", "head"]
    tokens = torch.randint(0, 10, (3, 5))
    F.cross_entropy(model(tokens).reshape(-1, 10), tokens.reshape(-1)).backward()
    plain = model.head.weight.grad.clone()  # type: ignore[union-attr]
    precond.step()
    # One preconditioning with the head's factors: Ĝ ∇ Â (a second one would differ).
    a_inverse, g_inverse = precond.inverses("head")
    expected = g_inverse @ plain @ a_inverse  # type: ignore[operator]
    torch.testing.assert_close(model.head.weight.grad, expected)


def test_lazy_and_meta_models_get_a_clear_error() -> None:
    with pytest.raises(ValueError, match="not materialized"):
        KFACPreconditioner(nn.Sequential(nn.LazyLinear(3)))
    with torch.device("meta"):
        meta = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="meta device"):
        KFACPreconditioner(meta)


def test_fullgraph_compilation_is_refused_with_a_clear_error() -> None:
    compiled = torch.compile(_model(), fullgraph=True, backend="eager")
    with pytest.raises(ValueError, match=r"fullgraph=True\) is not supported"):
        KFACPreconditioner(compiled, lr=0.1)
