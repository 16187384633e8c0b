"""What differs between image classification and language modelling, one object per task.

The trainer runs the same loop for both; its :class:`Task` (``TASKS[kind]`` for the kind
of the dataset, see :data:`spdkfac.training.config.DATASET_KINDS`) loads the data, builds
the model, makes a batch, computes the loss, scores the model at each evaluation (see
:class:`~spdkfac.training.evaluation.EvalSchedule`) and at the end, and words the results.

=================  ==========================================  ===========================
                   image                                       text
=================  ==========================================  ===========================
batch              images and labels, crop/flip, erasing,      byte windows at random
                   mixup                                       offsets, next-byte targets
loss               cross-entropy (soft with mixup)             mean over all B·T tokens
each evaluation    ``test_accuracy`` on the test set           ``val_loss``,
                                                               ``val_bits_per_byte``
at the end         (nothing more)                              ``test_loss``,
                                                               ``test_bits_per_byte``
=================  ==========================================  ===========================

With ``val_split`` > 0 a part of the training data is held out and each evaluation scores
it instead (for tuning without looking at the test set): images score ``val_accuracy`` on
a fixed random subset of the training images, text scores ``val_loss`` and
``val_bits_per_byte`` on the last stretch of the training split.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from torch.utils.data import Dataset, TensorDataset

from spdkfac.comm import Communicator
from spdkfac.data.augment import RunningMixup, random_crop_flip, random_erasing, soft_cross_entropy
from spdkfac.data.gcide import load_gcide_corpus
from spdkfac.data.text import (
    VOCAB_SIZE,
    TextCorpus,
    TextCorpusError,
    TextWindows,
    load_text_corpus,
)
from spdkfac.models import ModelKind, build_model
from spdkfac.training.config import DATASET_KINDS, TrainConfig
from spdkfac.training.loop import evaluate_accuracy, evaluate_loss, token_cross_entropy
from spdkfac.training.metrics import EpochMetrics
from spdkfac.training.setup import load_datasets, split_validation

__all__ = ["TASKS", "Batch", "ImageTask", "Task", "TaskData", "TextTask", "task_for"]

#: (inputs, targets, soft targets or None) of one optimizer step on this rank.
Batch = tuple[Tensor, Tensor, Tensor | None]


@dataclass(frozen=True)
class TaskData:
    """A run's data as its task loaded it.

    Attributes:
        train: The sampler's dataset: one index is one training example (an image, or a
            stretch of ``seq_len`` bytes).
        evaluation: (inputs, targets) scored at each evaluation: the test set of images,
            the validation split of a text, or with ``val_split`` the held-out training
            examples.
        final: (inputs, targets) scored once at the end (a text's test split), or None.
        model_args: Keyword arguments of :func:`spdkfac.models.build_model`.
        num_classes: Classes of the labels (mixup's one-hot width) or the vocabulary.
        evaluation_name: The prefix of the evaluation's scores (``"test"`` or ``"val"``).
    """

    train: Dataset[Any]
    evaluation: tuple[Tensor, Tensor]
    final: tuple[Tensor, Tensor] | None
    model_args: dict[str, Any] = field(default_factory=dict)
    num_classes: int = 10
    evaluation_name: str = "test"


class Task(ABC):
    """The task-specific parts of a training run (see the module's table)."""

    kind: ModelKind

    @abstractmethod
    def load(self, config: TrainConfig) -> TaskData:
        """Read the dataset (a missing path is an error naming it)."""

    def build_model(self, config: TrainConfig, data: TaskData) -> nn.Module:
        """The configured model, freshly initialized from the current RNG state."""
        return build_model(config.model, **data.model_args)

    @abstractmethod
    def batch(
        self,
        data: TaskData,
        indices: Sequence[int],
        generator: torch.Generator,
        config: TrainConfig,
        mixup: RunningMixup | None,
    ) -> Batch:
        """The examples at ``indices``, their randomness drawn from ``generator``."""

    @abstractmethod
    def loss(
        self, logits: Tensor, targets: Tensor, soft: Tensor | None, config: TrainConfig
    ) -> Tensor:
        """The mean training loss of a micro-batch."""

    @abstractmethod
    def evaluate(self, model: nn.Module, data: TaskData, comm: Communicator) -> dict[str, float]:
        """The scores of an evaluation's row on ``data.evaluation`` (a collective)."""

    def final_scores(
        self, model: nn.Module, data: TaskData, comm: Communicator
    ) -> dict[str, float]:
        """Scores computed once at the end of the run (a collective; none by default)."""
        return {}

    @abstractmethod
    def describe(self, scores: dict[str, float]) -> str:
        """An evaluation's scores for the progress bar."""

    @abstractmethod
    def summary_scores(
        self, metrics: Sequence[EpochMetrics], final: dict[str, float], config: TrainConfig
    ) -> dict[str, Any]:
        """The run's headline numbers for ``summary.json``."""

    @abstractmethod
    def headline(self, scores: dict[str, Any], config: TrainConfig) -> str:
        """The start of the final line ``spdkfac train`` prints."""


class ImageTask(Task):
    """Image classification: top-1 test accuracy at each evaluation, time to a target."""

    kind: ModelKind = "image"

    def load(self, config: TrainConfig) -> TaskData:
        train, test, classes, channels, size = load_datasets(config)
        name = "test"
        if config.val_split > 0:
            train, test = split_validation(train, config.val_split)
            name = "val"
        images, labels = test.tensors
        model_args = {"num_classes": classes, "in_channels": channels, "input_size": size}
        return TaskData(train, (images, labels), None, model_args, classes, name)

    def batch(
        self,
        data: TaskData,
        indices: Sequence[int],
        generator: torch.Generator,
        config: TrainConfig,
        mixup: RunningMixup | None,
    ) -> Batch:
        assert isinstance(data.train, TensorDataset)
        images, labels = (t[list(indices)] for t in data.train.tensors)
        if config.augment:
            images = random_crop_flip(images, generator, padding=4 if images.shape[-1] >= 32 else 2)
        if config.random_erasing > 0:
            images = random_erasing(images, generator, p=config.random_erasing)
        soft = None
        if mixup is not None:
            images, soft = mixup(images, labels, generator, num_classes=data.num_classes)
        return images, labels, soft

    def loss(
        self, logits: Tensor, targets: Tensor, soft: Tensor | None, config: TrainConfig
    ) -> Tensor:
        if soft is not None:
            return soft_cross_entropy(logits, soft, label_smoothing=config.label_smoothing)
        return torch.nn.functional.cross_entropy(
            logits, targets, label_smoothing=config.label_smoothing
        )

    def evaluate(self, model: nn.Module, data: TaskData, comm: Communicator) -> dict[str, float]:
        accuracy = evaluate_accuracy(model, *data.evaluation, comm)
        return {f"{data.evaluation_name}_accuracy": accuracy}

    def describe(self, scores: dict[str, float]) -> str:
        return " ".join(
            f"{key.removesuffix('_accuracy')} acc {value:.4f}" for key, value in scores.items()
        )

    def summary_scores(
        self, metrics: Sequence[EpochMetrics], final: dict[str, float], config: TrainConfig
    ) -> dict[str, Any]:
        key = _accuracy_key(config)
        accuracies = [m.scores[key] for m in metrics]
        reached = [m for m in metrics if m.scores[key] >= config.target_accuracy]
        # The first evaluation at or above the target: as fine as the evaluation schedule.
        return {
            "best_accuracy": max(accuracies, default=0.0),
            "final_accuracy": accuracies[-1] if accuracies else 0.0,
            "epochs_to_target": reached[0].epoch if reached else None,
            "steps_to_target": reached[0].step if reached else None,
            "seconds_to_target": reached[0].train_seconds if reached else None,
        }

    def headline(self, scores: dict[str, Any], config: TrainConfig) -> str:
        target = config.target_accuracy
        reached = (
            f"reached {target:.2%} at epoch {scores['epochs_to_target']:g} (step "
            f"{scores['steps_to_target']}) after {scores['seconds_to_target']:.1f} s of training"
            if scores["epochs_to_target"] is not None
            else f"did not reach {target:.2%}"
        )
        split = "validation" if config.val_split > 0 else "test"
        return (
            f"best {split} accuracy {scores['best_accuracy']:.4f}, final "
            f"{scores['final_accuracy']:.4f}; {reached}"
        )


def _accuracy_key(config: TrainConfig) -> str:
    return "val_accuracy" if config.val_split > 0 else "test_accuracy"


def _loss_scores(prefix: str, loss: float) -> dict[str, float]:
    return {f"{prefix}_loss": loss, f"{prefix}_bits_per_byte": loss / math.log(2)}


def _load_corpus(config: TrainConfig) -> TextCorpus:
    """``--dataset text`` (a file or directory, default fortunes) or ``gcide``."""
    if config.dataset == "gcide":
        return load_gcide_corpus(config.data, seq_len=config.seq_len)
    return load_text_corpus(config.data, seq_len=config.seq_len)


class TextTask(Task):
    """Byte-level language modelling: validation loss and bits per byte (= loss / ln 2).

    Training windows start at random offsets within their stretch of text, except on
    ``gcide``: a corpus larger than a run reads, whose windows keep their fixed starts so
    that no byte is trained on twice within an epoch.
    """

    kind: ModelKind = "text"

    def load(self, config: TrainConfig) -> TaskData:
        corpus = _load_corpus(config)
        train, evaluation = corpus.train, corpus.validation
        if config.val_split > 0:
            cut = len(train) - int(len(train) * config.val_split)
            train, evaluation = train[:cut], train[cut:]
            if min(len(train), len(evaluation)) < config.seq_len + 1:
                raise TextCorpusError(
                    f"val_split {config.val_split} of the {len(corpus.train)}-byte training "
                    f"split of {corpus.path} leaves {len(train)} bytes to train on and "
                    f"{len(evaluation)} held out; each needs --seq-len + 1 = "
                    f"{config.seq_len + 1}"
                )
        model_args = {
            "vocab_size": VOCAB_SIZE,
            "block_size": config.seq_len,
            "n_layer": config.gpt_layers,
            "n_head": config.gpt_heads,
            "d_model": config.gpt_dim,
            "dropout": config.gpt_dropout,
        }
        return TaskData(
            TextWindows(train, config.seq_len, random_offsets=config.dataset != "gcide"),
            TextWindows(evaluation, config.seq_len).tensors(),
            TextWindows(corpus.test, config.seq_len).tensors(),
            model_args,
            VOCAB_SIZE,
            "val",
        )

    def batch(
        self,
        data: TaskData,
        indices: Sequence[int],
        generator: torch.Generator,
        config: TrainConfig,
        mixup: RunningMixup | None,
    ) -> Batch:
        assert isinstance(data.train, TextWindows)
        inputs, targets = data.train.batch(list(indices), generator)
        return inputs, targets, None

    def loss(
        self, logits: Tensor, targets: Tensor, soft: Tensor | None, config: TrainConfig
    ) -> Tensor:
        return token_cross_entropy(logits, targets, label_smoothing=config.label_smoothing)

    def evaluate(self, model: nn.Module, data: TaskData, comm: Communicator) -> dict[str, float]:
        return _loss_scores(data.evaluation_name, evaluate_loss(model, *data.evaluation, comm))

    def final_scores(
        self, model: nn.Module, data: TaskData, comm: Communicator
    ) -> dict[str, float]:
        assert data.final is not None
        return _loss_scores("test", evaluate_loss(model, *data.final, comm))

    def describe(self, scores: dict[str, float]) -> str:
        return f"val loss {scores['val_loss']:.4f} val bpb {scores['val_bits_per_byte']:.4f}"

    def summary_scores(
        self, metrics: Sequence[EpochMetrics], final: dict[str, float], config: TrainConfig
    ) -> dict[str, Any]:
        bits = [m.scores["val_bits_per_byte"] for m in metrics]
        return {
            "best_val_bits_per_byte": min(bits, default=None),
            "final_val_loss": metrics[-1].scores["val_loss"] if metrics else None,
            "final_val_bits_per_byte": bits[-1] if bits else None,
            **final,
        }

    def headline(self, scores: dict[str, Any], config: TrainConfig) -> str:
        def number(key: str) -> str:
            value = scores.get(key)
            return "n/a" if value is None else f"{value:.4f}"

        return (
            f"validation bits/byte best {number('best_val_bits_per_byte')}, final "
            f"{number('final_val_bits_per_byte')} (loss {number('final_val_loss')}); test "
            f"bits/byte {number('test_bits_per_byte')} (loss {number('test_loss')})"
        )


#: The task of each kind of dataset.
TASKS: dict[ModelKind, Task] = {"image": ImageTask(), "text": TextTask()}


def task_for(config: TrainConfig) -> Task:
    """The task of the configured dataset."""
    return TASKS[DATASET_KINDS[config.dataset]]
