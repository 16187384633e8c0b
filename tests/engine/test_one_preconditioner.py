"""How a preconditioner's life is driven: ``skip_layers`` naming a container's class skips
what is inside it, ``step()`` after ``remove()`` is refused, and one model has at most one
live preconditioner (another one may be built after ``remove()``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner


class Block(nn.Module):
    """A user's container of two Linear layers."""

    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 4)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(torch.tanh(self.fc1(x)))


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.Tanh(), Block(), nn.Linear(4, 3))


def _backward(model: nn.Module) -> None:
    generator = torch.Generator().manual_seed(1)
    inputs = torch.randn(6, 4, generator=generator)
    F.cross_entropy(model(inputs), torch.arange(6) % 3).backward()


@pytest.mark.parametrize("entry", [Block, "Block"], ids=["type", "class name"])
def test_skip_layers_by_a_container_class_skips_its_children(entry: object) -> None:
    precond = KFACPreconditioner(_model(), lr=0.1, skip_layers=[entry])
    assert precond.layers == ["3"]


def test_skip_layers_by_name_still_skips_the_children_only_of_that_module() -> None:
    precond = KFACPreconditioner(_model(), lr=0.1, skip_layers=["0"])
    assert precond.layers == ["2.fc1", "2.fc2", "3"]


def test_step_after_remove_is_refused_and_a_second_remove_does_nothing() -> None:
    model = _model()
    precond = KFACPreconditioner(model, lr=0.1)
    _backward(model)
    assert precond.step()
    precond.remove()
    precond.remove()
    model.zero_grad()
    _backward(model)
    plain = model[3].weight.grad.clone()  # type: ignore[union-attr]
    with pytest.raises(RuntimeError, match=r"step\(\) after remove\(\)"):
        precond.step()
    torch.testing.assert_close(model[3].weight.grad, plain, rtol=0, atol=0)


def test_a_second_preconditioner_is_refused_naming_the_first() -> None:
    model = _model()
    first = KFACPreconditioner(model, lr=0.1)
    named = f"{id(first):#x}"
    with pytest.raises(ValueError, match=rf"already preconditioned by .*{named}.*remove\(\)"):
        KFACPreconditioner(model, lr=0.1)
    with pytest.raises(ValueError, match=rf"module '1' of this model .*{named}"):
        KFACPreconditioner(nn.Sequential(nn.Linear(4, 4), model[2]), lr=0.1)
    # The refused ones left nothing behind: the first still preconditions alone.
    _backward(model)
    assert first.step()


def test_after_remove_a_new_preconditioner_works() -> None:
    model = _model()
    first = KFACPreconditioner(model, lr=0.1, kl_clip=None, damping=0.1)
    _backward(model)
    first.step()
    first.remove()
    second = KFACPreconditioner(model, lr=0.1, kl_clip=None, damping=0.1)
    reference_model = _model()
    reference = KFACPreconditioner(reference_model, lr=0.1, kl_clip=None, damping=0.1)
    for net, precond in ((model, second), (reference_model, reference)):
        net.zero_grad()
        _backward(net)
        assert precond.step()
    for got, expected in zip(model.parameters(), reference_model.parameters(), strict=True):
        torch.testing.assert_close(got.grad, expected.grad, rtol=1e-6, atol=1e-8)
