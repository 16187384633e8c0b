"""A model with frozen biases and shift inside registered layers, and the explicit float64
K-FAC of its trainable parameters only (shared by the single- and multi-process tests)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_reference import explicit_conv_patches, kronecker_precondition, outer_mean

BATCH, DAMPING = 6, 0.05
OPTIONS = {"damping": DAMPING, "kl_clip": None, "normalization": "unit-wise"}


class FrozenNet(nn.Module):
    """A Conv2d, a Linear and a LayerNorm whose biases are frozen, and a trainable head."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(2, 3, 3, padding=1)
        self.fc = nn.Linear(3 * 4 * 4, 5)
        self.ln = nn.LayerNorm(5)
        self.head = nn.Linear(5, 4)
        nn.init.normal_(self.ln.weight, 1.0, 0.3)  # a non-trivial scale, and shift
        nn.init.normal_(self.ln.bias, 0.0, 0.3)
        for layer in (self.conv, self.fc, self.ln):
            layer.bias.requires_grad_(False)

    def forward(self, x: Tensor) -> Tensor:
        h = self.fc(torch.tanh(self.conv(x)).flatten(1))
        return self.head(torch.tanh(self.ln(h)))


def frozen_net(seed: int = 0) -> FrozenNet:
    torch.manual_seed(seed)
    return FrozenNet().double()


def frozen_batch(seed: int = 3) -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(BATCH, 2, 4, 4, generator=generator, dtype=torch.float64)
    return inputs, torch.randint(0, 4, (BATCH,), generator=generator)


def _recorded(model: nn.Module, names: tuple[str, ...]) -> dict[str, list[Tensor]]:
    """Each named layer's input and output (outputs keep their gradient)."""
    modules = dict(model.named_modules())
    record: dict[str, list[Tensor]] = {}

    def hook(name: str):  # type: ignore[no-untyped-def]
        def store(module: nn.Module, args: tuple[Tensor, ...], output: Tensor) -> None:
            output.retain_grad()
            record[name] = [args[0].detach(), output]

        return store

    for name in names:
        modules[name].register_forward_hook(hook(name))
    return record


def explicit_reference(model: FrozenNet, inputs: Tensor, targets: Tensor) -> dict[str, Tensor]:
    """K-FAC of the trainable parameters only, by explicit loops: the factors of ``conv``,
    ``fc`` (no bias column) and ``ln`` (γ alone), and their preconditioned weight
    gradients (``head``'s too)."""
    record = _recorded(model, ("conv", "fc", "ln", "head"))
    F.cross_entropy(model(inputs), targets).backward()
    out: dict[str, Tensor] = {}
    # conv: A over every patch (no constant 1), G = (1/B) Σₙ Σₛ δδᵀ with δ = B·g.
    x, y = record["conv"]
    patches = [
        p for example in explicit_conv_patches(x, (3, 3), (1, 1), (1, 1), (1, 1)) for p in example
    ]
    grads = [BATCH * y.grad[n, :, i, j] for n in range(BATCH) for i in range(4) for j in range(4)]
    out["conv/A"] = outer_mean(patches)
    out["conv/G"] = sum(torch.outer(g, g) for g in grads) / BATCH
    # fc, head: A = (1/N) Σ a aᵀ (head: with the constant 1), G = (1/N) Σ δδᵀ, δ = N·g.
    for name in ("fc", "head"):
        a, y = record[name]
        rows = [a[n] if name == "fc" else torch.cat([a[n], a.new_ones(1)]) for n in range(BATCH)]
        out[f"{name}/A"] = outer_mean(rows)
        out[f"{name}/G"] = outer_mean([BATCH * y.grad[n] for n in range(BATCH)])
    # ln: per unit F_γγ = (1/E) Σₑ (E·gₑ·x̂ₑ)², x̂ normalized explicitly; β frozen: no F_ββ.
    a, y = record["ln"]
    normalized = torch.stack(
        [(row - row.mean()) / torch.sqrt(row.var(unbiased=False) + model.ln.eps) for row in a]
    )
    u = BATCH * y.grad * normalized
    out["ln/F"] = (u * u).mean(dim=0)
    out["ln.weight"] = model.ln.weight.grad / (out["ln/F"] + DAMPING)
    for name in ("conv", "fc"):
        weight = getattr(model, name).weight
        matrix = weight.grad.reshape(weight.shape[0], -1)
        v = kronecker_precondition(matrix, out[f"{name}/A"], out[f"{name}/G"], DAMPING)
        out[f"{name}.weight"] = v.reshape(weight.shape)
    head = torch.cat([model.head.weight.grad, model.head.bias.grad[:, None]], dim=1)
    out["head"] = kronecker_precondition(head, out["head/A"], out["head/G"], DAMPING)
    return out


def check_against_reference(
    grads: dict[str, Tensor | None], expected: dict[str, Tensor], label: str = ""
) -> None:
    """The preconditioned gradients of one step against :func:`explicit_reference`."""
    for name in ("conv.weight", "fc.weight", "ln.weight"):
        got = grads[name]
        assert got is not None
        torch.testing.assert_close(
            got, expected[name], rtol=1e-8, atol=1e-11, msg=f"{label} {name}"
        )
    head = torch.cat([grads["head.weight"], grads["head.bias"][:, None]], dim=1)  # type: ignore[index]
    torch.testing.assert_close(head, expected["head"], rtol=1e-8, atol=1e-11, msg=label)
    for name in ("conv.bias", "fc.bias", "ln.bias"):
        assert grads[name] is None, f"{label} {name}: a frozen parameter got a gradient"
