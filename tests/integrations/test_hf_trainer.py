"""KFACOptimizer inside Hugging Face ``transformers.Trainer`` (tiny GPT-2 and LLaMA from
configs, no download)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from spdkfac import KFACOptimizer, KFACPreconditioner

transformers = pytest.importorskip("transformers", reason="transformers is not installed")

OPTIONS = {"damping": 0.01, "factor_update_steps": 1, "inv_update_steps": 2}


def _gpt2() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.GPT2Config(
        vocab_size=32, n_positions=16, n_embd=16, n_layer=1, n_head=2, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0,
    )  # fmt: skip
    return transformers.GPT2LMHeadModel(config).double()


def _llama() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=16,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(config).double()


MODELS: dict[str, Callable[[], torch.nn.Module]] = {"gpt2": _gpt2, "llama": _llama}
#: The Trainer's loss over the model's mean: it divides the summed token loss by its
#: num_items_in_batch, every one of the 32 label tokens for GPT-2 (no ``loss_type``), the 28
#: shifted ones for LLaMA (``ForCausalLM`` shifts), where the model's mean divides by 28.
SCALE = {"gpt2": 28 / 32, "llama": 1.0}


def _data() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    rows = torch.randint(0, 32, (4, 8), generator=g)
    return [{"input_ids": row, "labels": row} for row in rows]


def _train(model: torch.nn.Module, out: Path, steps: int, resume: bool = False) -> KFACOptimizer:
    # --8<-- [start:hf]
    optimizer = KFACOptimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3), **OPTIONS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=steps, per_device_train_batch_size=4,
        max_grad_norm=0.0, save_strategy="steps", save_steps=2, report_to=[],
        use_cpu=True, logging_strategy="no", seed=0,
    )  # fmt: skip
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=_data(), optimizers=(optimizer, scheduler)
    )
    trainer.train(resume_from_checkpoint=resume or None)
    # --8<-- [end:hf]
    return optimizer


def _by_hand(name: str, steps: int) -> torch.nn.Module:
    model = MODELS[name]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    pre = KFACPreconditioner(model, optimizer=opt, **OPTIONS)
    batch = torch.stack([row["input_ids"] for row in _data()])
    for _ in range(steps):
        opt.zero_grad()
        (model(input_ids=batch, labels=batch).loss * SCALE[name]).backward()
        if pre.step():
            opt.step()
    return model


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainer_equals_hand_written_steps(tmp_path: Path, name: str) -> None:
    model = MODELS[name]()
    optimizer = _train(model, tmp_path, 3)
    assert optimizer.preconditioner.steps == 3
    torch.testing.assert_close(
        list(_by_hand(name, 3).parameters()), list(model.parameters()), rtol=1e-6, atol=1e-9
    )


@pytest.mark.parametrize("name", sorted(MODELS))
def test_trainer_resume_restores_preconditioner(tmp_path: Path, name: str) -> None:
    """save_state at step 2 and resume_from_checkpoint equal 4 uninterrupted steps."""
    full = MODELS[name]()
    _train(full, tmp_path / "full", 4)
    first = MODELS[name]()
    _train(first, tmp_path / "cut", 2)
    resumed = MODELS[name]()
    optimizer = _train(resumed, tmp_path / "cut", 4, resume=True)
    assert optimizer.preconditioner.steps == 4
    torch.testing.assert_close(
        list(full.parameters()), list(resumed.parameters()), rtol=1e-6, atol=1e-9
    )
