"""Hugging Face ``transformers`` models: GPT-2's ``Conv1D`` is preconditioned as the Linear
layer it is, and a tiny GPT-2 and a tiny LLaMA get the explicit float64 K-FAC of their
registered layers (factors and a preconditioned gradient), with HF's gradient checkpointing
on or off. Configs are built in code (no download); skipped without ``transformers``."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import pytest
import torch
from torch import Tensor, nn

from kfac_reference import kronecker_precondition, outer_mean
from spdkfac import KFACPreconditioner

BATCH, LENGTH, VOCAB, DAMPING = 2, 5, 64, 0.1


class Conv1D(nn.Module):
    """``transformers.pytorch_utils.Conv1D`` as it is written there (``x @ W + b``, ``W``
    stored ``[nx, nf]``), so the adapter is tested where transformers is absent too."""

    def __init__(self, nf: int, nx: int) -> None:
        super().__init__()
        self.nf = nf
        self.weight = nn.Parameter(torch.randn(nx, nf) * 0.5)
        self.bias = nn.Parameter(torch.randn(nf) * 0.1)

    def forward(self, x: Tensor) -> Tensor:
        size_out = (*x.size()[:-1], self.nf)
        return torch.addmm(self.bias, x.view(-1, x.size(-1)), self.weight).view(size_out)


def test_a_conv1d_is_preconditioned_as_the_linear_layer_with_the_transposed_weight() -> None:
    torch.manual_seed(0)
    conv = nn.Sequential(Conv1D(3, 4), nn.Tanh(), nn.Linear(3, 2)).double()
    linear = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2)).double()
    with torch.no_grad():
        linear[0].weight.copy_(conv[0].weight.t())
        linear[0].bias.copy_(conv[0].bias)
        linear[2].load_state_dict(conv[2].state_dict())
    inputs = torch.randn(6, 5, 4, dtype=torch.float64)
    options: dict[str, Any] = {"damping": DAMPING, "kl_clip": None, "lr": 0.1}
    conv_precond = KFACPreconditioner(conv, **options)
    linear_precond = KFACPreconditioner(linear, **options)
    assert conv_precond.layers == ["0", "2"]
    for model, precond in ((conv, conv_precond), (linear, linear_precond)):
        model(inputs).square().mean().backward()
        assert precond.step()
    for got, expected in zip(conv_precond.factors("0"), linear_precond.factors("0"), strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-10, atol=1e-13)
    torch.testing.assert_close(
        conv[0].weight.grad, linear[0].weight.grad.t(), rtol=1e-9, atol=1e-12
    )
    torch.testing.assert_close(conv[0].bias.grad, linear[0].bias.grad, rtol=1e-9, atol=1e-12)


def _transformers() -> Any:
    """``transformers``, or skip. PyPI's torchvision beside the CPU torch wheel fails to
    import, and transformers imports it when it finds it: it is hidden then (it counts as
    absent to spdkfac already, :mod:`spdkfac.support.optional`)."""
    try:
        import torchvision  # noqa: F401
    except Exception:
        sys.modules["torchvision"] = None  # type: ignore[assignment]
    return pytest.importorskip("transformers", reason="transformers is not installed")


def _gpt2() -> nn.Module:
    hf = _transformers()
    config = hf.GPT2Config(
        n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16,
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    torch.manual_seed(0)
    return hf.GPT2LMHeadModel(config).double().train()


def _llama(tied: bool = False) -> nn.Module:
    hf = _transformers()
    config = hf.LlamaConfig(
        num_hidden_layers=1, hidden_size=32, intermediate_size=48, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=16,
        tie_word_embeddings=tied,
    )  # fmt: skip
    torch.manual_seed(0)
    return hf.LlamaForCausalLM(config).double().train()


#: What K-FAC takes in each model (named_modules order) and what it leaves to the optimizer.
KFAC_LAYERS = {
    "gpt2": ["transformer.wpe", "transformer.h.0.attn.c_attn", "transformer.h.0.attn.c_proj",
             "transformer.h.0.mlp.c_fc", "transformer.h.0.mlp.c_proj", "lm_head"],
    "llama": ["model.embed_tokens", *(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo"),
              *(f"model.layers.0.mlp.{p}_proj" for p in ("gate", "up", "down")), "lm_head"],
}  # fmt: skip
# A tied head owns the shared weight: the embedding gets no block of its own.
KFAC_LAYERS["llama-tied"] = KFAC_LAYERS["llama"][1:]
LEFT_ALONE = {"gpt2": r"LayerNorm \(3\)", "llama": r"LlamaRMSNorm \(3\)", "llama-tied": "RMSNorm"}
BUILD = {"gpt2": _gpt2, "llama": _llama, "llama-tied": lambda: _llama(tied=True)}


def _tokens() -> tuple[Tensor, Tensor]:
    generator = torch.Generator().manual_seed(5)
    return torch.randint(0, VOCAB, (BATCH, LENGTH), generator=generator), torch.zeros(0)


def _record(model: nn.Module, names: list[str]) -> dict[str, list[Tensor]]:
    """Each Kronecker layer's input and output (outputs keep their gradient)."""
    record: dict[str, list[Tensor]] = {}
    modules = dict(model.named_modules())
    for name in names:

        def store(
            module: nn.Module, args: tuple[Any, ...], output: Tensor, name: str = name
        ) -> None:
            if output.requires_grad:  # (a reentrant checkpoint's first forward has none)
                output.retain_grad()
                record[name] = [args[0].detach(), output]

        modules[name].register_forward_hook(store)
    return record


def _explicit_factors(
    name: str, module: nn.Module, inputs: Tensor, output: Tensor
) -> tuple[Tensor, Tensor]:
    """K-FAC-expand by explicit loops over the N = B·T rows: A = (1/N) Σ āāᵀ (one-hot for
    an embedding: its diagonal), G = (1/N) Σ δδᵀ with δ = N·g."""
    grads = output.grad.reshape(-1, output.shape[-1])
    count = grads.shape[0]
    g_factor = outer_mean([count * grads[n] for n in range(count)])
    if isinstance(module, nn.Embedding):
        ids = inputs.reshape(-1)
        a_factor = torch.stack([(ids == v).double().mean() for v in range(module.num_embeddings)])
        return a_factor, g_factor
    rows = inputs.reshape(-1, inputs.shape[-1])
    has_bias = getattr(module, "bias", None) is not None
    a_factor = outer_mean([torch.cat([r, r.new_ones(1)]) if has_bias else r for r in rows])
    return a_factor, g_factor


def _weight_matrix(module: nn.Module) -> Tensor:
    """``[∇W, ∇b]`` as ``[out, in(+1)]``: the Conv1D weight transposed."""
    grad = module.weight.grad
    grad = grad.t() if type(module).__name__ == "Conv1D" else grad
    bias = getattr(module, "bias", None)
    return grad if bias is None else torch.cat([grad, bias.grad[:, None]], dim=1)


Stepped = tuple[KFACPreconditioner, dict[str, list[Tensor]], dict[str, Tensor]]


def _step(model: nn.Module, reentrant: bool | None = None) -> Stepped:
    """One training step (with HF's gradient checkpointing unless ``reentrant`` is None):
    the preconditioner, each layer's input and output, and the plain gradient matrices
    before ``step()`` replaced them."""
    if reentrant is not None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)  # an alias, deprecated in v5
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": reentrant}
            )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        precond = KFACPreconditioner(model, damping=DAMPING, kl_clip=None, lr=0.1)
    record = _record(model, precond.layers)
    tokens, _ = _tokens()
    model(input_ids=tokens, labels=tokens, use_cache=False).loss.backward()
    modules = dict(model.named_modules())
    raw = {name: _weight_matrix(modules[name]).clone() for name in precond.layers}
    assert precond.step()
    return precond, record, raw


@pytest.mark.parametrize("kind", ["gpt2", "llama", "llama-tied"])
def test_a_tiny_model_gets_the_explicit_kfac_of_its_layers(kind: str) -> None:
    model = BUILD[kind]()
    with pytest.warns(UserWarning, match=LEFT_ALONE[kind]):
        KFACPreconditioner(model, lr=0.1).remove()
    precond, record, raw = _step(model)
    assert sorted(precond.layers) == sorted(KFAC_LAYERS[kind])
    modules = dict(model.named_modules())
    for name in KFAC_LAYERS[kind]:
        a_factor, g_factor = _explicit_factors(name, modules[name], *record[name])
        got_a, got_g = precond.factors(name)
        torch.testing.assert_close(got_a, a_factor, rtol=1e-9, atol=1e-12, msg=f"{name} A")
        torch.testing.assert_close(got_g, g_factor, rtol=1e-9, atol=1e-12, msg=f"{name} G")
    name = KFAC_LAYERS[kind][1]  # one preconditioned gradient: the block's first projection
    a_factor, g_factor = _explicit_factors(name, modules[name], *record[name])
    expected = kronecker_precondition(raw[name], a_factor, g_factor, DAMPING)
    torch.testing.assert_close(_weight_matrix(modules[name]), expected, rtol=1e-8, atol=1e-11)


CHECKPOINTING = [(kind, reentrant) for kind in ("gpt2", "llama") for reentrant in (False, True)]


@pytest.mark.parametrize(("kind", "reentrant"), CHECKPOINTING)
def test_hf_gradient_checkpointing_gives_the_same_factors(kind: str, reentrant: bool) -> None:
    plain, _, _ = _step(BUILD[kind]())
    checkpointed, _, _ = _step(BUILD[kind](), reentrant=reentrant)
    for name in KFAC_LAYERS[kind]:
        for got, expected in zip(checkpointed.factors(name), plain.factors(name), strict=True):
            torch.testing.assert_close(got, expected, rtol=1e-9, atol=1e-12, msg=name)


@pytest.mark.parametrize(("kind", "reentrant"), CHECKPOINTING)
def test_hf_gradient_checkpointing_captures_each_call_once(
    kind: str, reentrant: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    from spdkfac.curvature.kronecker import KroneckerBlock

    calls: dict[str, int] = {}
    capture = KroneckerBlock.capture_input

    def counting(block: KroneckerBlock, inputs: Tensor) -> Any:
        calls[block.name] = calls.get(block.name, 0) + 1
        return capture(block, inputs)

    monkeypatch.setattr(KroneckerBlock, "capture_input", counting)
    _step(BUILD[kind](), reentrant=reentrant)
    assert calls == dict.fromkeys(KFAC_LAYERS[kind], 1)
