"""A full ``precond.step()`` on each device equals the float64 CPU run within float32
tolerance (a small CNN and the built-in GPT), and state dicts cross devices."""

from __future__ import annotations

import io
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac import KFACPreconditioner
from spdkfac.models.gpt import GPT

Batch = tuple[Tensor, Tensor]
STEPS = 3
VOCAB = 13


def _cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 6, 3, padding=1),
        nn.ReLU(),
        nn.Conv2d(6, 8, 3, stride=2, padding=1),
        nn.ReLU(),
        nn.Flatten(),
        nn.Linear(8 * 4 * 4, 5),
    )


def _gpt() -> nn.Module:
    torch.manual_seed(0)
    return GPT(vocab_size=VOCAB, block_size=8, n_layer=1, n_head=2, d_model=16)


def _cnn_batch(step: int) -> Batch:
    generator = torch.Generator().manual_seed(step)
    return torch.randn(16, 3, 8, 8, generator=generator), torch.randint(
        0, 5, (16,), generator=generator
    )


def _gpt_batch(step: int) -> Batch:
    tokens = torch.randint(0, VOCAB, (6, 9), generator=torch.Generator().manual_seed(step))
    return tokens[:, :-1], tokens[:, 1:]


MODELS: dict[str, tuple[Callable[[], nn.Module], Callable[[int], Batch]]] = {
    "cnn": (_cnn, _cnn_batch),
    "gpt": (_gpt, _gpt_batch),
}


def _loss(model: nn.Module, batch: Batch, device: torch.device, dtype: torch.dtype) -> Tensor:
    inputs, targets = batch
    inputs = inputs.to(device, dtype) if inputs.is_floating_point() else inputs.to(device)
    logits = model(inputs)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.to(device).reshape(-1))


class _Run:
    """A model, its SGD optimizer and preconditioner on one device, in one dtype."""

    def __init__(self, name: str, device: torch.device, dtype: torch.dtype) -> None:
        build, self.batch = MODELS[name]
        self.device, self.dtype = device, dtype
        self.model = build().to(device, dtype)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1, momentum=0.9)
        self.precond = KFACPreconditioner(
            self.model,
            damping=0.1,
            inv_update_steps=2,
            optimizer=self.optimizer,
            normalization="diagonal" if name == "gpt" else None,
        )

    def step(self, index: int) -> None:
        self.optimizer.zero_grad()
        _loss(self.model, self.batch(index), self.device, self.dtype).backward()
        assert self.precond.step()
        self.optimizer.step()

    def params(self) -> dict[str, Tensor]:
        return {n: p.detach().double().cpu() for n, p in self.model.named_parameters()}


def _assert_params_close(run: _Run, reference: _Run) -> None:
    expected = reference.params()
    for name, value in run.params().items():
        torch.testing.assert_close(value, expected[name], rtol=1e-3, atol=1e-5, msg=name)


@pytest.mark.parametrize("name", MODELS)
def test_a_full_step_matches_the_float64_cpu_run(device: torch.device, name: str) -> None:
    run = _Run(name, device, torch.float32)
    reference = _Run(name, torch.device("cpu"), torch.float64)
    for step in range(STEPS):
        run.step(step)
        reference.step(step)
    assert run.precond.steps == STEPS
    for layer in run.precond.layers:
        for factor, expected in zip(
            run.precond.factors(layer), reference.precond.factors(layer), strict=True
        ):
            assert factor is not None and expected is not None
            assert factor.device == device
            torch.testing.assert_close(factor.double().cpu(), expected, rtol=1e-4, atol=1e-6)
    _assert_params_close(run, reference)
    moved = reference.params()
    assert any(
        not torch.equal(moved[n], p.double()) for n, p in MODELS[name][0]().named_parameters()
    )


def _through_bytes(state: object, map_location: str) -> dict[str, object]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, map_location=map_location, weights_only=False)
    assert isinstance(loaded, dict)
    return loaded


def _tensors(value: object) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _resume(source: _Run, device: torch.device) -> _Run:
    """A run on ``device`` continuing ``source``: parameters, optimizer and preconditioner
    state saved on the source's device, loaded with ``map_location`` onto ``device``."""
    target = _Run("cnn", device, torch.float32)
    location = str(device)
    target.model.load_state_dict(_through_bytes(source.model.state_dict(), location))
    target.optimizer.load_state_dict(_through_bytes(source.optimizer.state_dict(), location))
    state = _through_bytes(source.precond.state_dict(), location)
    assert all(t.device.type == device.type for t in _tensors(state))
    target.precond.load_state_dict(state)
    return target


def test_state_dict_crosses_devices(device: torch.device) -> None:
    cpu = torch.device("cpu")
    run = _Run("cnn", device, torch.float32)
    for step in range(2):
        run.step(step)
    on_cpu = _resume(run, cpu)  # saved on the device, loaded on the CPU
    back = _resume(on_cpu, device)  # and back
    assert back.precond.steps == on_cpu.precond.steps == run.precond.steps
    for step in range(2, 4):  # an inverse step (inv_update_steps=2) and a reuse step
        for each in (run, on_cpu, back):
            each.step(step)
    _assert_params_close(on_cpu, run)
    _assert_params_close(back, run)
    if device == cpu:  # the same device and the same numbers: bit for bit
        for name, value in back.params().items():
            assert torch.equal(value, run.params()[name]), name
