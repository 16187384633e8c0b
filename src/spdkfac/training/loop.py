"""One training step, shared by ``spdkfac train``, ``spdkfac demo`` and ``spdkfac bench``.

:func:`train_step` is the body every loop runs per optimizer step: clear the gradients,
forward and backward each micro-batch (all-reducing gradients once, on the last one),
let K-FAC precondition them, and apply the update unless K-FAC skipped the step. What
differs between the callers stays with them: the trainer's augmentation, fault injection,
weight rescaling and LR schedule; the benchmark's timing marks (:class:`StepHooks`).
:func:`evaluate_accuracy` and :func:`evaluate_loss` score a model on a held-out set, each
rank its own shard. Losses take the class dimension last, so the same pass serves image
classifiers (logits ``[N, C]``, labels ``[N]``) and language models (logits ``[B, T, V]``,
next-token targets ``[B, T]``, the mean over all B·T tokens).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from spdkfac.comm import Communicator
from spdkfac.preconditioner import KFACPreconditioner

__all__ = [
    "LossPass",
    "StepHooks",
    "StepOutcome",
    "clip_gradients",
    "cross_entropy_pass",
    "evaluate_accuracy",
    "evaluate_loss",
    "token_cross_entropy",
    "train_step",
]

#: Runs the forward pass of one micro-batch and returns its (mean) loss.
LossPass = Callable[[], Tensor]


@dataclass(frozen=True)
class StepHooks:
    """Callbacks at the phase boundaries of :func:`train_step` (None: nothing).

    Attributes:
        before_forward: After the gradients are cleared, before the first forward pass.
        before_update: After the last backward pass (gradients all-reduced), before the
            K-FAC step and the optimizer step.
    """

    before_forward: Callable[[], None] | None = None
    before_update: Callable[[], None] | None = None


_NO_HOOKS = StepHooks()


@dataclass(frozen=True)
class StepOutcome:
    """What one :func:`train_step` did.

    Attributes:
        losses: Each micro-batch's loss, detached (read them only when needed: reading
            a tensor's value waits for the device).
        applied: Whether the optimizer stepped (False when K-FAC skipped the step).
    """

    losses: tuple[Tensor, ...]
    applied: bool

    @property
    def mean_loss(self) -> float:
        """The step's loss: the mean over its micro-batches, summed in order as floats."""
        total = 0.0
        for loss in self.losses:
            total += float(loss) / len(self.losses)
        return total


def token_cross_entropy(
    logits: Tensor, targets: Tensor, *, label_smoothing: float = 0.0, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy with the classes last: logits ``[..., C]``, targets ``[...]``.

    Every leading position counts as one example: ``[N, C]`` logits are plain
    classification, ``[B, T, V]`` a language model's loss over all B·T tokens.
    """
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(
        flat, targets.reshape(-1), label_smoothing=label_smoothing, reduction=reduction
    )


def cross_entropy_pass(model: nn.Module, inputs: Tensor, targets: Tensor) -> LossPass:
    """The plain pass: cross-entropy of ``model(inputs)`` on ``targets`` (classes last)."""
    return lambda: token_cross_entropy(model(inputs), targets)


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    preconditioner: KFACPreconditioner | None,
    passes: Sequence[LossPass],
    *,
    hooks: StepHooks = _NO_HOOKS,
    grad_clip: float = 0.0,
) -> StepOutcome:
    """One optimizer step over the micro-batches of ``passes`` (gradient accumulation).

    Each pass's loss is backpropagated divided by the number of passes, so the gradient is
    that of the mean loss. Under ``DistributedDataParallel`` every pass but the last runs in
    ``no_sync()``: gradients are all-reduced once, on the last backward pass.

    Args:
        model: The model ``passes`` run (possibly wrapped in ``DistributedDataParallel``).
        optimizer: Stepped after preconditioning, unless K-FAC skips the step.
        preconditioner: K-FAC, or None for the plain optimizer.
        passes: One callable per micro-batch, running its forward pass.
        hooks: Callbacks at the phase boundaries, e.g. timing marks.
        grad_clip: When > 0, the averaged gradients are clipped to this global L2 norm
            (:func:`clip_gradients`) after ``hooks.before_update`` and before K-FAC.

    Returns:
        The detached losses and whether the update was applied.

    Raises:
        ValueError: If ``passes`` is empty.
    """
    if not passes:
        raise ValueError("passes must hold at least one micro-batch, got none")
    optimizer.zero_grad(set_to_none=True)
    if hooks.before_forward is not None:
        hooks.before_forward()
    ddp = model if isinstance(model, nn.parallel.DistributedDataParallel) else None
    losses = []
    for index, loss_pass in enumerate(passes):
        last = index == len(passes) - 1
        with ddp.no_sync() if ddp is not None and not last else contextlib.nullcontext():
            loss = loss_pass()
            # One pass backpropagates its loss as is (the same gradients as dividing by 1).
            (loss if len(passes) == 1 else loss / len(passes)).backward()
        losses.append(loss.detach())
    if hooks.before_update is not None:
        hooks.before_update()
    if grad_clip > 0:
        clip_gradients(model.parameters(), grad_clip)
    applied = preconditioner.step() if preconditioner is not None else True
    if applied:
        optimizer.step()
    return StepOutcome(tuple(losses), applied)


def clip_gradients(parameters: Iterable[Tensor], max_norm: float) -> Tensor:
    """Scale the gradients so their global L2 norm is at most ``max_norm``, as
    ``torch.nn.utils.clip_grad_norm_`` does; their norm before clipping.

    A non-finite norm leaves the gradients as they are: the step then goes on as any step
    with non-finite gradients does (K-FAC skips it; a plain optimizer applies them).
    Every rank of a data-parallel run holds the same averaged gradients, so every rank
    decides the same.
    """
    held = [p for p in parameters if p.grad is not None]
    norm = torch.nn.utils.get_total_norm([p.grad for p in held if p.grad is not None])
    if bool(torch.isfinite(norm)):
        torch.nn.utils.clip_grads_with_norm_(held, max_norm, norm)
    return norm


def evaluate_accuracy(
    model: nn.Module, images: Tensor, labels: Tensor, comm: Communicator
) -> float:
    """Top-1 accuracy on the whole test set, rank ``r`` scoring examples ``r, r + P, …``.

    A collective (one all-reduce); ``model`` is left in training mode.

    Args:
        model: The model to score (possibly wrapped in ``DistributedDataParallel``).
        images: Every test input, the same on each rank.
        labels: Their class indices.
        comm: This rank's communicator.

    Returns:
        The fraction of test examples whose highest logit is their label.
    """
    model.eval()
    counts = torch.zeros(2, dtype=torch.float64)
    shard = torch.arange(comm.rank, len(labels), comm.world_size)
    with torch.no_grad():
        # Chunks of 128: on a CPU, chunks of 1000 (activations of megabytes per layer) took
        # twice as long (ResNet-20, 28x28 images, one thread).
        for part in _even_chunks(shard, len(labels), comm.world_size, 128):
            counts[0] += int((model(images[part]).argmax(1) == labels[part]).sum())
            counts[1] += len(part)
    model.train()
    comm.all_reduce_sum(counts).wait()
    return float(counts[0] / counts[1])


def evaluate_loss(
    model: nn.Module, inputs: Tensor, targets: Tensor, comm: Communicator, *, batch_size: int = 64
) -> float:
    """Mean cross-entropy over every target of a held-out set, rank ``r`` scoring ``r, r + P, …``.

    A collective (one all-reduce of the loss sum and the target count); ``model`` is left
    in training mode.

    Args:
        model: The model to score (possibly wrapped in ``DistributedDataParallel``).
        inputs: Every example (e.g. token windows ``[N, T]``), the same on each rank.
        targets: Their targets (``[N]`` labels or ``[N, T]`` next tokens).
        comm: This rank's communicator.
        batch_size: Examples per forward pass.

    Returns:
        The loss summed over all targets of all examples, divided by their number.
    """
    model.eval()
    totals = torch.zeros(2, dtype=torch.float64)
    shard = torch.arange(comm.rank, len(targets), comm.world_size)
    with torch.no_grad():
        for part in _even_chunks(shard, len(targets), comm.world_size, batch_size):
            summed = token_cross_entropy(model(inputs[part]), targets[part], reduction="sum")
            totals[0] += float(summed)
            totals[1] += targets[part].numel()
    model.train()
    comm.all_reduce_sum(totals).wait()
    return float(totals[0] / totals[1])


def _even_chunks(shard: Tensor, total: int, world_size: int, size: int) -> list[Tensor]:
    """``shard`` in chunks of ``size``, as many on every rank (those past a short shard's
    end empty): FSDP2 gathers parameters in every forward pass, so every rank runs the
    same number of them."""
    longest = -(-total // world_size)
    return [shard[start : start + size] for start in range(0, longest, size)]
