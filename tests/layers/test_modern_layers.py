"""New curvature blocks against explicit float64 references.

Linear expand / reduce, Embedding, normalization layers, grouped Conv2d, Conv1d.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from kfac_reference import outer_mean, with_one
from spdkfac import KFACPreconditioner

B, T, D, CLASSES = 3, 4, 5, 6


def _one_step(model: nn.Module, **options: object) -> KFACPreconditioner:
    options.setdefault("kl_clip", None)
    return KFACPreconditioner(model, **options)  # type: ignore[arg-type]


def _seq_model() -> tuple[nn.Linear, nn.Linear, nn.Module]:
    layer = nn.Linear(D, 4).double()
    head = nn.Linear(4, CLASSES).double()
    return layer, head, nn.Sequential(layer, nn.Tanh(), head)


def _token_loss(logits: Tensor, targets: Tensor) -> Tensor:
    return F.cross_entropy(logits.reshape(-1, CLASSES), targets.reshape(-1))


@pytest.mark.parametrize("sharing", ["expand", "reduce"])
def test_linear_weight_sharing_factors_match_explicit_loops(sharing: str) -> None:
    torch.manual_seed(0)
    layer, head, model = _seq_model()
    inputs = torch.randn(B, T, D, dtype=torch.float64)
    targets = torch.randint(0, CLASSES, (B, T))
    precond = _one_step(model, weight_sharing=sharing)
    _token_loss(model(inputs), targets).backward()
    precond.step()
    a_factor, g_factor = precond.factors("0")

    # ∂L/∂y for every position of the batch-and-position mean loss, by autograd on a leaf.
    hidden = layer(inputs).detach().requires_grad_(True)
    _token_loss(head(torch.tanh(hidden)), targets).backward()
    assert hidden.grad is not None
    grads = hidden.grad
    if sharing == "expand":
        rows = B * T
        a_ref = outer_mean([with_one(inputs[n, t]) for n in range(B) for t in range(T)])
        g_ref = outer_mean([rows * grads[n, t] for n in range(B) for t in range(T)])
    else:
        means = [with_one(sum(inputs[n, t] for t in range(T)) / T) for n in range(B)]  # type: ignore[arg-type]
        a_ref = outer_mean(means)
        sums = [sum(grads[n, t] for t in range(T)) for n in range(B)]
        g_ref = B * T * sum(torch.outer(s, s) for s in sums)  # type: ignore[misc]
    torch.testing.assert_close(a_factor, a_ref, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(g_factor, g_ref, rtol=1e-10, atol=1e-12)


def test_reduce_is_exact_for_a_linear_layer_whose_loss_sees_the_summed_positions() -> None:
    """Eschenhagen et al. (NeurIPS 2023, Sec. 3): with the shared dimension reduced before
    the loss, K-FAC-reduce of one example is its exact (empirical) curvature; expand is not."""
    torch.manual_seed(1)
    layer = nn.Linear(D, 3).double()
    inputs = torch.randn(1, T, D, dtype=torch.float64)
    target = torch.randn(1, 3, dtype=torch.float64)

    def loss_of(model: nn.Module) -> Tensor:
        return 0.5 * (model(inputs).sum(dim=1) - target).pow(2).sum()

    results = {}
    for sharing in ("expand", "reduce"):
        precond = _one_step(layer, weight_sharing=sharing)
        layer.zero_grad()
        loss_of(layer).backward()
        grad = torch.cat([layer.weight.grad, layer.bias.grad[:, None]], dim=1)  # type: ignore[index]
        precond.step()
        a_factor, g_factor = precond.factors("")
        results[sharing] = torch.kron(a_factor, g_factor)  # type: ignore[arg-type]
        precond.remove()
    # Explicit curvature: vec(∇)vec(∇)ᵀ in the column-major vec that A ⊗ G acts on.
    vec = grad.t().reshape(-1)
    explicit = torch.outer(vec, vec)
    # Our factors assume a loss averaged over the T positions: T times this summed loss's.
    torch.testing.assert_close(results["reduce"], T * explicit, rtol=1e-10, atol=1e-10)
    assert not torch.allclose(results["expand"], T * explicit, rtol=1e-3)


def test_embedding_is_a_bias_free_linear_on_one_hot_inputs() -> None:
    torch.manual_seed(2)
    vocab = 7
    embedding = nn.Embedding(vocab, D, padding_idx=0).double()
    head = nn.Linear(D, CLASSES).double()
    model = nn.Sequential(embedding, nn.Tanh(), head)
    tokens = torch.randint(0, vocab, (B, T))
    tokens[0, 0] = 0
    targets = torch.randint(0, CLASSES, (B, T))
    # The same weights as a Linear layer on one-hot inputs.
    linear = nn.Linear(vocab, D, bias=False).double()
    with torch.no_grad():
        linear.weight.copy_(embedding.weight.t())
    reference = nn.Sequential(linear, nn.Tanh(), copy.deepcopy(head))
    one_hot = F.one_hot(tokens, vocab).double()

    precond = _one_step(model, damping=0.01)
    ref_precond = _one_step(reference, damping=0.01)
    for _ in range(2):
        for net, data, kfac in ((model, tokens, precond), (reference, one_hot, ref_precond)):
            net.zero_grad()
            _token_loss(net(data), targets).backward()
            kfac.step()
    a_diag, g_factor = precond.factors("0")
    a_full, g_ref = ref_precond.factors("0")
    torch.testing.assert_close(torch.diag(a_diag), a_full)  # type: ignore[arg-type]
    torch.testing.assert_close(g_factor, g_ref)
    # Preconditioned gradient: Ĝ ∇ Â with Â = (diag(a) + γI)⁻¹ (explicit solves).
    assert embedding.weight.grad is not None and linear.weight.grad is not None
    # Columns other than padding_idx's: the one-hot Linear's (A is diagonal, so columns do
    # not mix); padding_idx's row has no plain gradient and keeps a zero update.
    torch.testing.assert_close(
        embedding.weight.grad.t()[:, 1:], linear.weight.grad[:, 1:], rtol=1e-9, atol=1e-12
    )
    assert embedding.weight.grad[0].abs().max() == 0


def _per_example_unit_grads(
    norm: nn.Module, inputs: Tensor, head: nn.Module, targets: Tensor, examples: list[Tensor]
) -> list[Tensor]:
    """[∂ℓₑ/∂γ, ∂ℓₑ/∂β] of every example's own loss, by a separate autograd call each."""
    shares = []
    for index in examples:
        norm.zero_grad()
        logits = head(norm(inputs)[index])
        F.cross_entropy(
            logits.reshape(-1, CLASSES), targets[index].reshape(-1), reduction="sum"
        ).backward()
        bias = getattr(norm, "bias", None)
        beta = (
            torch.zeros(norm.weight.numel(), dtype=torch.float64)
            if bias is None
            else bias.grad.reshape(-1)
        )
        shares.append(torch.stack([norm.weight.grad.reshape(-1), beta], dim=1))
    return shares


@pytest.mark.parametrize("kind", ["layernorm", "rmsnorm", "groupnorm"])
@pytest.mark.parametrize("mode", ["unit-wise", "diagonal"])
def test_normalization_blocks_match_per_example_gradients(kind: str, mode: str) -> None:
    torch.manual_seed(3)
    channel_first = kind == "groupnorm"
    norm = {
        "layernorm": lambda: nn.LayerNorm(D),
        "rmsnorm": lambda: nn.RMSNorm(D, eps=1e-6),
        "groupnorm": lambda: nn.GroupNorm(1, D),  # per-example statistics
    }[kind]().double()
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    head = nn.Linear(D, CLASSES).double()
    if channel_first:
        inputs = torch.randn(B, D, T, dtype=torch.float64)
        model: nn.Module = nn.Sequential(norm, _Transpose(), head)
        targets = torch.randint(0, CLASSES, (B, T))
        examples = [torch.tensor([n]) for n in range(B)]
        apply_head = nn.Sequential(_Transpose(), head)
    else:
        inputs = torch.randn(B, T, D, dtype=torch.float64)
        model = nn.Sequential(norm, head)
        targets = torch.randint(0, CLASSES, (B, T))
        examples = [(torch.tensor([n]), torch.tensor([t])) for n in range(B) for t in range(T)]
        apply_head = head
    precond = _one_step(model, normalization=mode)
    assert precond.batchnorm_layers == ["0"]
    _token_loss(model(inputs), targets).backward()
    precond.step()
    fisher, _ = precond.batchnorm_blocks("0")

    # δ = E·g makes each example's share its own loss's gradient: a row's loss for the
    # trailing layers (E = B·T rows); for the channel-first ones (E = B) the mean of its T
    # positions' losses, while the reference sums them.
    shares = _per_example_unit_grads(norm, inputs, apply_head, targets, examples)
    scale = 1.0 / T if channel_first else 1.0
    gamma = torch.stack([s[:, 0] for s in shares]) * scale
    beta = torch.stack([s[:, 1] for s in shares]) * scale
    cross = (
        torch.zeros(norm.weight.numel(), dtype=torch.float64)
        if mode == "diagonal"
        else (gamma * beta).mean(0)
    )
    expected = torch.stack([(gamma * gamma).mean(0), cross, (beta * beta).mean(0)], dim=1)
    torch.testing.assert_close(fisher, expected, rtol=1e-9, atol=1e-12)


class _Transpose(nn.Module):
    def forward(self, x: Tensor) -> Tensor:
        return x.transpose(1, 2)


class _Split(nn.Module):
    """A grouped convolution written as ``groups`` separate convolutions."""

    def __init__(self, grouped: nn.Module, make: type[nn.Module]) -> None:
        super().__init__()
        groups = grouped.groups  # type: ignore[union-attr]
        weights = grouped.weight.chunk(groups, dim=0)  # type: ignore[union-attr]
        biases = grouped.bias.chunk(groups)  # type: ignore[union-attr]
        self.parts = nn.ModuleList()
        for weight, bias in zip(weights, biases, strict=True):
            part = make(
                weight.shape[1],
                weight.shape[0],
                grouped.kernel_size,  # type: ignore[union-attr]
                stride=grouped.stride,  # type: ignore[union-attr]
                padding=grouped.padding,  # type: ignore[union-attr]
            ).double()
            with torch.no_grad():
                part.weight.copy_(weight)
                part.bias.copy_(bias)  # type: ignore[union-attr]
            self.parts.append(part)

    def forward(self, x: Tensor) -> Tensor:
        chunks = x.chunk(len(self.parts), dim=1)
        return torch.cat([part(c) for part, c in zip(self.parts, chunks, strict=True)], dim=1)


@pytest.mark.parametrize(
    ("make", "shape", "channels", "groups"),
    [(nn.Conv2d, (5, 6), 4, 2), (nn.Conv1d, (7,), 4, 4)],
    ids=["conv2d-groups2", "conv1d-depthwise"],
)
def test_grouped_convolution_equals_the_split_convolutions(
    make: type[nn.Module], shape: tuple[int, ...], channels: int, groups: int
) -> None:
    torch.manual_seed(4)
    grouped = make(channels, 2 * channels, 3, stride=1, padding=1, groups=groups).double()
    split = _Split(grouped, make)
    head = nn.Linear(2 * channels * int(torch.tensor(shape).prod()), CLASSES).double()
    model = nn.Sequential(grouped, nn.Tanh(), nn.Flatten(), head)
    reference = nn.Sequential(split, nn.Tanh(), nn.Flatten(), copy.deepcopy(head))
    inputs = torch.randn(B, channels, *shape, dtype=torch.float64)
    targets = torch.randint(0, CLASSES, (B,))
    kfac = _one_step(model, damping=0.05)
    ref_kfac = _one_step(reference, damping=0.05)
    for _ in range(2):
        for net, precond in ((model, kfac), (reference, ref_kfac)):
            net.zero_grad()
            F.cross_entropy(net(inputs), targets).backward()
            precond.step()
    a_stack, g_stack = kfac.factors("0")
    for group in range(groups):
        a_ref, g_ref = ref_kfac.factors(f"0.parts.{group}")
        torch.testing.assert_close(a_stack[group], a_ref)  # type: ignore[index]
        torch.testing.assert_close(g_stack[group], g_ref)  # type: ignore[index]
    grad = grouped.weight.grad
    ref_grad = torch.cat([p.weight.grad for p in split.parts])  # type: ignore[misc]
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    ref_bias = torch.cat([p.bias.grad for p in split.parts])  # type: ignore[misc]
    torch.testing.assert_close(grouped.bias.grad, ref_bias, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize(
    "conv_options",
    [
        {"stride": 2, "padding": 1, "dilation": 2},
        {"padding": "same", "padding_mode": "reflect"},
    ],
    ids=["strided-dilated", "same-reflect"],
)
def test_conv1d_equals_conv2d_on_a_height_one_image(conv_options: dict[str, object]) -> None:
    torch.manual_seed(5)
    conv1d = nn.Conv1d(3, 4, 3, **conv_options).double()  # type: ignore[arg-type]
    options2d = {
        key: (0, value) if key in ("padding",) and isinstance(value, int) else value
        for key, value in conv_options.items()
    }
    options2d.update(
        {key: (1, value) for key, value in conv_options.items() if key in ("stride", "dilation")}
    )
    conv2d = nn.Conv2d(3, 4, (1, 3), **options2d).double()  # type: ignore[arg-type]
    with torch.no_grad():
        conv2d.weight.copy_(conv1d.weight[:, :, None])
        conv2d.bias.copy_(conv1d.bias)  # type: ignore[union-attr]
    inputs = torch.randn(B, 3, 9, dtype=torch.float64)
    targets = torch.randint(0, 4, (B,))
    results = []
    for conv, data in ((conv1d, inputs), (conv2d, inputs[:, :, None])):
        precond = _one_step(conv, damping=0.05)
        for _ in range(2):
            conv.zero_grad()
            F.cross_entropy(conv(data).flatten(2).mean(dim=2), targets).backward()
            precond.step()
        results.append((precond.factors(""), conv.weight.grad.reshape(4, -1)))  # type: ignore[union-attr]
    (a1, g1), grad1 = results[0]
    (a2, g2), grad2 = results[1]
    torch.testing.assert_close(a1, a2)
    torch.testing.assert_close(g1, g2)
    torch.testing.assert_close(grad1, grad2, rtol=1e-9, atol=1e-12)
