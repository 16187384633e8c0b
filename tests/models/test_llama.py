"""The tiny LLaMA-style model: next-token logits for every position, causal, and a width
that its heads must divide."""

from __future__ import annotations

import pytest
import torch

from spdkfac.models.llama import Llama


def test_logits_for_every_position_depend_only_on_earlier_tokens() -> None:
    torch.manual_seed(0)
    model = Llama(11, 8, 2, 2, 12).double()
    tokens = torch.randint(0, 11, (3, 5))
    logits = model(tokens)
    assert logits.shape == (3, 5, 11)
    changed = tokens.clone()
    changed[:, -1] = (changed[:, -1] + 1) % 11
    torch.testing.assert_close(model(changed)[:, :-1], logits[:, :-1], rtol=1e-12, atol=1e-12)
    assert not torch.allclose(model(changed)[:, -1], logits[:, -1])


def test_a_width_its_heads_do_not_divide_is_refused() -> None:
    with pytest.raises(ValueError, match=r"dim \(10\) must be a multiple of heads \(4\)"):
        Llama(11, 10, 1, 4, 12)
