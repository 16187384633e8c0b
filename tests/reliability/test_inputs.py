"""Bad input (docs/reliability.md I1, I3, I4): clear errors before any collective."""

from __future__ import annotations

import inspect
import re
from collections.abc import Sequence
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.futures import Future

from spdkfac import KFACPreconditioner
from spdkfac.cli import main
from spdkfac.comm import (
    LocalCommunicator,
    TorchDistributedCommunicator,
    barrier,
    completed,
    init_distributed,
)


class _CountingGroup:
    """A group of two identical ranks whose collectives only count themselves."""

    rank = 0
    world_size = 2
    device = torch.device("cpu")

    def __init__(self) -> None:
        self.calls: list[str] = []

    def all_reduce_sum(self, tensor: Tensor) -> Future[Tensor]:
        self.calls.append("all_reduce_sum")
        return completed(tensor)

    def all_reduce_average(self, tensor: Tensor) -> Future[Tensor]:
        self.calls.append("all_reduce_average")
        return completed(tensor)

    def all_reduce_max(self, tensor: Tensor) -> Future[Tensor]:
        self.calls.append("all_reduce_max")
        return completed(tensor)

    def broadcast(self, tensor: Tensor, src: int) -> Future[Tensor]:
        self.calls.append("broadcast")
        return completed(tensor)

    def all_gather(self, tensor: Tensor) -> Future[list[Tensor]]:
        self.calls.append("all_gather")
        future: Future[list[Tensor]] = Future()
        future.set_result([tensor, tensor.clone()])
        return future

    def reduce_scatter(self, chunks: Sequence[Tensor]) -> Future[Tensor]:
        self.calls.append("reduce_scatter")
        return completed(chunks[0].clone())

    def duplicate(self) -> _CountingGroup:
        return self


def _model() -> nn.Module:
    return nn.Sequential(nn.Linear(4, 5), nn.Tanh(), nn.Linear(5, 3))


# (option, invalid value, text the error must show: default the value's repr)
INVALID: list[tuple[str, object, str | None]] = [
    ("model", "not a model", "str"),
    ("damping", 0.0, None),
    ("damping", -1.0, None),
    ("damping", float("nan"), None),
    ("damping", "0.1", None),
    ("factor_decay", 0.0, None),
    ("factor_decay", 1.5, None),
    ("factor_decay", None, None),
    ("factor_update_steps", 0, None),
    ("factor_update_steps", 2.5, None),
    ("factor_update_steps", True, None),
    ("inv_update_steps", -1, None),
    ("inv_update_steps", "3", None),
    ("kl_clip", 0.0, None),
    ("kl_clip", float("inf"), None),
    ("kl_clip", "big", None),
    ("lr", -0.1, None),
    ("lr", float("nan"), None),
    ("inverse_method", "lu", None),
    ("inverse_method", None, None),
    ("inverse_method", "eigenbasis", None),
    ("grafting", "rms", None),
    ("grafting", 1, None),
    ("inverse_dtype", torch.int32, None),
    ("inverse_dtype", "bf16", None),
    ("factor_dtype", torch.int64, None),
    ("auto_candidates", ("sgd",), "'sgd'"),
    ("auto_candidates", "d-kfac", None),
    ("auto_candidates", (), None),
    ("auto_trial_steps", 0, None),
    ("auto_rounds", 0, None),
    ("skip_layers", "fc", None),
    ("skip_layers", 5, None),
    ("skip_layers", [3], "3"),
    ("strategy", "kfac", None),
    ("strategy", None, None),
    ("placement", "random", None),
    ("process_group", "world", None),
    ("cost_model", 42, None),
    ("factor_options", "fast", None),
    ("factor_exchange", "eager", None),
    ("accumulation_steps", 0, None),
    ("accumulation_steps", 1.5, None),
    ("factor_comm_dtype", torch.int8, None),
    ("factor_comm_dtype", "bf16", None),
    ("comm_scheduler", "pace", None),
    ("comm_scheduler", None, None),
    ("bucket_cap_mb", 0.0, None),
    ("bucket_cap_mb", float("nan"), None),
    ("fusion_warmup_steps", 0, None),
    ("max_inverse_failures", -1, None),
    ("max_inverse_failures", 1.5, None),
    ("grad_scaler", 1.0, None),
    ("profile", "yes", None),
    ("optimizer", "sgd", None),
    ("batchnorm", "full", None),
    ("normalization", "full", None),
    ("weight_sharing", "shared", None),
    ("batchnorm_damping_multiplier", 0.0, None),
    ("config", {"damping": 0.1}, None),
]


def test_every_option_has_an_invalid_case() -> None:
    assert set(inspect.signature(KFACPreconditioner).parameters) == {c[0] for c in INVALID}


@pytest.mark.parametrize(("option", "value", "shown"), INVALID)
def test_invalid_option_fails_before_any_collective(
    option: str, value: object, shown: str | None
) -> None:
    group = _CountingGroup()
    kwargs: dict[str, object] = {"process_group": group, option: value}
    model = kwargs.pop("model", _model())
    with pytest.raises((ValueError, TypeError)) as info:
        KFACPreconditioner(model, **kwargs)  # type: ignore[arg-type]
    message = str(info.value)
    assert option in message, message
    assert (repr(value) if shown is None else shown) in message, message
    # Raised before the first collective, so every rank of a real group fails alike.
    assert group.calls == []


def test_errors_found_after_agreement_still_name_the_option(tmp_path: Path) -> None:
    # A skip_layers name that matches nothing is found while discovering layers and raised
    # after the ranks compared notes (every rank raises); a missing cost model file is
    # loaded by rank 0 and its failure broadcast.
    group = _CountingGroup()
    with pytest.raises(ValueError, match="skip_layers entry 'nope' matches no module"):
        KFACPreconditioner(_model(), skip_layers=["nope"], process_group=group)
    assert group.calls == ["all_gather"]
    group = _CountingGroup()
    missing = tmp_path / "costs.json"
    with pytest.raises(OSError, match=re.escape(str(missing))):
        KFACPreconditioner(_model(), cost_model=missing, process_group=group)
    assert group.calls == ["all_gather", "broadcast"]


CLI_ERRORS: list[tuple[str, list[str]]] = [
    ("train", ["--epochs", "0"]),
    ("train", ["--strategy", "x"]),
    ("train", ["--lr", "-1"]),
    ("bench", ["--iters", "0"]),
    ("bench", ["--variants", "nope"]),
    ("bench", ["--model", "vgg"]),
    ("bench", ["--link", "fast"]),
    ("bench", ["--timeout", "-1"]),
    ("bench", ["--iters", "3", "--warmup", "3"]),
    ("simulate", ["--workers", "0"]),
    ("simulate", ["--overlap", "2"]),
    ("simulate", ["--strategies", "nope"]),
    ("simulate", ["--model", "nope"]),
    ("simulate", ["--preset", "nope"]),
    ("simulate", ["--inv-update-steps", "0"]),
    ("demo", ["--epochs", "0"]),
    ("demo", ["--damping", "-1"]),
    ("demo", ["--model", "vgg"]),
    ("calibrate", ["--sizes", "2"]),
    ("calibrate", ["--dims", "0"]),
    ("calibrate", ["--max-seconds", "0"]),
    ("calibrate", ["--method", "lu"]),
    ("calibrate", ["--repeats", "0"]),
] + [(verb, ["--bogus"]) for verb in ("train", "bench", "simulate", "demo", "calibrate")]


@pytest.fixture
def no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torchrun-like environment in which joining a process group fails the test."""

    def refuse(*args: object, **kwargs: object) -> None:
        raise AssertionError("a process group was started before the arguments were checked")

    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0"}.items():
        monkeypatch.setenv(name, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "9")
    monkeypatch.setattr(dist, "init_process_group", refuse)


@pytest.mark.usefixtures("no_process_group")
@pytest.mark.parametrize(("verb", "flags"), CLI_ERRORS)
def test_bad_cli_flags_exit_2_before_any_process_group(
    verb: str, flags: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as info:
        main([verb, *flags])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage: spdkfac" in err and "error:" in err
    assert not dist.is_initialized()


@pytest.mark.usefixtures("no_process_group")
def test_calibrate_bad_output_path_exits_2_before_any_process_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "missing" / "costs.json"
    assert main(["calibrate", "--out", str(out), "--no-png"]) == 2
    assert f"directory {out.parent}" in capsys.readouterr().err
    assert not dist.is_initialized()


def test_world_size_one_needs_no_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        monkeypatch.delenv(name, raising=False)
    assert not dist.is_initialized()
    communicator = init_distributed()
    assert isinstance(communicator, LocalCommunicator)
    barrier(communicator)
    generator = torch.Generator().manual_seed(0)
    for strategy in ("d-kfac", "mpd-kfac", "spd-kfac"):
        torch.manual_seed(0)
        model = _model()
        precond = KFACPreconditioner(model, strategy=strategy, factor_update_steps=2)
        assert precond.communicator.world_size == 1 and precond.fusion_plan is None
        for _ in range(3):
            model.zero_grad()
            model(torch.randn(8, 4, generator=generator)).pow(2).mean().backward()
            assert precond.step()
        assert precond.steps == 3
    assert not dist.is_initialized()


def test_distributed_only_features_without_a_process_group_say_so(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    assert not dist.is_initialized()
    with pytest.raises(ValueError, match=r"needs torch\.distributed to be initialized"):
        TorchDistributedCommunicator()
    with pytest.raises(ValueError, match=r"process_group must be a torch\.distributed"):
        KFACPreconditioner(_model(), process_group=object())
    # torchrun's variables without its rendezvous address: torch names what is missing.
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        init_distributed(backend="gloo")
    assert not dist.is_initialized()
