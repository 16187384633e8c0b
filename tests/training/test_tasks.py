"""Per-task pieces of ``spdkfac train``: token losses, loss evaluation, metric rows, options."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac.comm import LocalCommunicator
from spdkfac.training.config import TrainConfig, incompatible_fields
from spdkfac.training.loop import evaluate_loss, token_cross_entropy
from spdkfac.training.metrics import EpochMetrics, TrainSummary
from spdkfac.training.tasks import TASKS, ImageTask, TextTask, task_for

__all__: list[str] = []


def test_token_cross_entropy_is_the_mean_over_every_position() -> None:
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 5, 7, generator=generator)
    targets = torch.randint(0, 7, (3, 5), generator=generator)
    by_hand = torch.stack(
        [F.cross_entropy(logits[b, t : t + 1], targets[b, t : t + 1]) for b in range(3)
         for t in range(5)]
    ).mean()  # fmt: skip
    torch.testing.assert_close(token_cross_entropy(logits, targets), by_hand)
    flat = logits[:, 0]  # plain classification is the same call
    torch.testing.assert_close(
        token_cross_entropy(flat, targets[:, 0]), F.cross_entropy(flat, targets[:, 0])
    )


class _Bigram(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = nn.Embedding(6, 6)

    def forward(self, tokens: Tensor) -> Tensor:
        out: Tensor = self.table(tokens)
        return out


def test_evaluate_loss_is_the_mean_over_all_targets_in_any_batching() -> None:
    torch.manual_seed(0)
    model = _Bigram()
    inputs = torch.randint(0, 6, (7, 4))
    targets = torch.randint(0, 6, (7, 4))
    with torch.no_grad():
        expected = float(token_cross_entropy(model(inputs), targets))
    comm = LocalCommunicator()
    for batch in (1, 3, 64):
        assert evaluate_loss(model, inputs, targets, comm, batch_size=batch) == pytest.approx(
            expected, rel=1e-6
        )
    assert model.training


def test_rows_keep_the_image_columns_and_round_trip() -> None:
    row = EpochMetrics(epoch=1, step=10, train_loss=0.5, scores={"test_accuracy": 0.9},
                       epoch_seconds=2.0, train_seconds=2.0, lr=0.1, skipped_steps=0)  # fmt: skip
    flat = row.row()
    assert list(flat) == ["epoch", "step", "train_loss", "test_accuracy", "epoch_seconds",
                          "train_seconds", "lr", "skipped_steps"]  # fmt: skip
    assert EpochMetrics.from_row(flat) == row
    summary = TrainSummary(scores={"best_accuracy": 0.9}, median_iteration_ms=1.0, steps=10,
                           world_size=1, metrics=[row])  # fmt: skip
    data = summary.to_dict()
    assert list(data)[:2] == ["best_accuracy", "median_iteration_ms"]
    assert data["metrics"] == [flat]


def test_text_scores_and_summary() -> None:
    config = TrainConfig(model="gpt", dataset="text")
    task = task_for(config)
    assert isinstance(task, TextTask) and TASKS["image"].kind == "image"
    rows = [
        EpochMetrics(epoch=e, step=e, train_loss=1.0, epoch_seconds=1.0, train_seconds=e,
                     lr=0.1, skipped_steps=0,
                     scores={"val_loss": loss, "val_bits_per_byte": loss / math.log(2)})
        for e, loss in ((1, 2.0), (2, 1.0), (3, 1.5))
    ]  # fmt: skip
    scores = task.summary_scores(rows, {"test_loss": 1.4, "test_bits_per_byte": 2.0}, config)
    assert scores["best_val_bits_per_byte"] == pytest.approx(1.0 / math.log(2))
    assert scores["final_val_loss"] == 1.5 and scores["test_bits_per_byte"] == 2.0
    assert "test bits/byte 2.0000" in task.headline(scores, config)
    assert task.describe(rows[0].scores) == "val loss 2.0000 val bpb 2.8854"
    assert isinstance(task_for(TrainConfig()), ImageTask)


def test_optimizer_table_and_kind_checks() -> None:
    assert TrainConfig(optimizer="kfac-adamw").uses_kfac
    assert TrainConfig(optimizer="adamw").base_optimizer == "adamw"
    assert not TrainConfig(optimizer="sgd").uses_kfac
    with pytest.raises(ValueError, match="reads text but dataset 'cifar10' holds image"):
        TrainConfig(model="gpt", dataset="cifar10")
    with pytest.raises(ValueError, match="random_erasing"):
        TrainConfig(model="gpt", dataset="text", random_erasing=0.5)


def test_options_added_later_count_as_their_default_when_resuming() -> None:
    text = {"model": "gpt", "dataset": "text"}
    saved = TrainConfig(**text).to_dict()
    for key in ("seq_len", "gpt_layers", "gpt_heads", "gpt_dim", "gpt_dropout"):
        del saved[key]
    assert incompatible_fields(saved, TrainConfig(**text)) == []
    assert incompatible_fields(saved, TrainConfig(**text, seq_len=64)) == ["seq_len"]
