"""Tests for the model zoo: shapes, exact sizes, layer order and name lookup."""

from __future__ import annotations

import math
import sys
import types

import pytest
import torch
from torch import nn

from spdkfac.models import MODEL_NAMES, CifarResNet, build_model, wide_resnet
from spdkfac.models.imagenet import ImageNetResNet

__all__: list[str] = []

# Hand-derived parameter counts for 3-channel 32x32 input and 10 classes, with 1x1
# projection shortcuts (conv weights + BN weight/bias; convs have no bias):
#   stem:            conv 3*16*9 = 432, BN 2*16 = 32                          ->    464
#   stage1 block:    2 * 16*16*9 = 4608, 2 BN * 32 = 64                       ->  4,672
#   stage2 first:    16*32*9 + 32*32*9 = 13,824, 2 BN * 64, 1x1 16*32 + BN 64 -> 14,528
#   stage2 other:    2 * 32*32*9 = 18,432, 2 BN * 64 = 128                    -> 18,560
#   stage3 first:    32*64*9 + 64*64*9 = 55,296, 2 BN * 128, 1x1 32*64 + 128  -> 57,728
#   stage3 other:    2 * 64*64*9 = 73,728, 2 BN * 128 = 256                   -> 73,984
#   fc:              64*10 + 10                                               ->    650
# total(n) = 464 + n*4,672 + 14,528 + (n-1)*18,560 + 57,728 + (n-1)*73,984 + 650
#          = 97,216 n - 19,174  -> n=3: 272,474; n=5: 466,906; n=9: 855,770.
RESNET_CIFAR_PARAMS = {"resnet20": 272_474, "resnet32": 466_906, "resnet56": 855_770}

INPUT_CONFIGS = [(1, 28), (3, 32)]


def _num_params(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name", MODEL_NAMES)
@pytest.mark.parametrize(("channels", "size"), INPUT_CONFIGS)
def test_output_shape(name: str, channels: int, size: int) -> None:
    model = build_model(name, num_classes=7, in_channels=channels, input_size=size)
    out = model(torch.randn(2, channels, size, size))
    assert out.shape == (2, 7)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize(("name", "expected"), sorted(RESNET_CIFAR_PARAMS.items()))
def test_resnet_cifar_parameter_count(name: str, expected: int) -> None:
    model = build_model(name, num_classes=10, in_channels=3, input_size=32)
    assert _num_params(model) == expected


def test_small_model_parameter_counts() -> None:
    # mlp: 784*256+256 + 256*128+128 + 128*10+10 = 200,960 + 32,896 + 1,290.
    assert _num_params(build_model("mlp")) == 235_146
    # cnn: (1*32*9+32) + (32*64*9+64) + (64*64*9+64) + (64*3*3*128+128) + (128*10+10).
    assert _num_params(build_model("cnn")) == 320 + 18_496 + 36_928 + 73_856 + 1_290
    # The 1-channel ResNet-20 stem has 2*16*9 = 288 fewer weights than the CIFAR one.
    assert _num_params(build_model("resnet20", in_channels=1)) == 272_474 - 288


def test_wide_resnet_parameter_count() -> None:
    # WRN-16-4: two blocks per stage of 64/128/256 channels, 16-channel stem, 3x32x32 input,
    # 10 classes; every stage's first block has a 1x1 projection (16->64 changes width):
    #   stem:          3*16*9 = 432, BN 32                                        ->       464
    #   stage1 first:  16*64*9 = 9,216 + 64*64*9 = 36,864, 2 BN * 128,
    #                  1x1 16*64 = 1,024 + BN 128                                 ->    47,488
    #   stage1 other:  2 * 36,864 + 2 BN * 128                                    ->    73,984
    #   stage2 first:  64*128*9 = 73,728 + 128*128*9 = 147,456, 2 BN * 256,
    #                  1x1 64*128 = 8,192 + BN 256                                ->   230,144
    #   stage2 other:  2 * 147,456 + 2 BN * 256                                   ->   295,424
    #   stage3 first:  128*256*9 = 294,912 + 256*256*9 = 589,824, 2 BN * 512,
    #                  1x1 128*256 = 32,768 + BN 512                              ->   919,040
    #   stage3 other:  2 * 589,824 + 2 BN * 512                                   -> 1,180,672
    #   fc:            256*10 + 10                                                ->     2,570
    # total 2,749,786; its largest K-FAC factor is A of a 256-channel 3x3 conv: 2304.
    model = build_model("wrn16-4", num_classes=10, in_channels=3, input_size=32)
    assert _num_params(model) == 2_749_786
    convs = [m for m in model.modules() if isinstance(m, nn.Conv2d)]
    assert max(m.in_channels * m.kernel_size[0] * m.kernel_size[1] for m in convs) == 2304
    with pytest.raises(ValueError, match="6n\\+4"):
        wide_resnet(14, 4)


@pytest.mark.parametrize("name", MODEL_NAMES)
def test_named_modules_follow_forward_order(name: str) -> None:
    model = build_model(name, in_channels=3, input_size=32)
    declared = [n for n, m in model.named_modules() if isinstance(m, (nn.Conv2d, nn.Linear))]
    executed: list[str] = []
    for module_name in declared:
        module = model.get_submodule(module_name)
        module.register_forward_pre_hook(lambda _m, _a, n=module_name: executed.append(n))
    model(torch.randn(2, 3, 32, 32))
    assert executed == declared


@pytest.mark.parametrize(("depth", "blocks"), [(20, 3), (32, 5), (56, 9)])
def test_resnet_structure(depth: int, blocks: int) -> None:
    model = CifarResNet(depth)
    convs = {n: m for n, m in model.named_modules() if isinstance(m, nn.Conv2d)}
    # Stem + two per block + two projection shortcuts: depth - 1 weighted convs plus 2.
    assert len(convs) == 6 * blocks + 1 + 2 == depth - 1 + 2
    strided = sorted(n for n, m in convs.items() if m.stride == (2, 2))
    assert strided == [
        "layer2.0.conv1",
        "layer2.0.shortcut.0",
        "layer3.0.conv1",
        "layer3.0.shortcut.0",
    ]
    assert all(m.bias is None for m in convs.values())
    assert [m.out_features for m in model.modules() if isinstance(m, nn.Linear)] == [10]


def test_resnet_uses_kaiming_fan_out_init() -> None:
    torch.manual_seed(0)
    # A 32 -> 64 conv, so fan-out (64*9) and fan-in (32*9) scaling give different stds.
    conv = build_model("resnet20").get_submodule("layer3.0.conv1")
    assert isinstance(conv, nn.Conv2d)
    expected_std = math.sqrt(2.0 / (64 * 3 * 3))
    assert conv.weight.std().item() == pytest.approx(expected_std, rel=0.05)


def test_resnet_backward_reaches_every_parameter() -> None:
    model = build_model("resnet20", in_channels=1, input_size=28)
    loss = nn.functional.cross_entropy(model(torch.randn(4, 1, 28, 28)), torch.arange(4))
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert missing == []


@pytest.mark.parametrize("depth", [0, 2, 21, 51])
def test_resnet_rejects_bad_depth(depth: int) -> None:
    with pytest.raises(ValueError, match=f"got {depth}"):
        CifarResNet(depth)


def test_build_model_is_case_insensitive() -> None:
    assert isinstance(build_model("ResNet20"), CifarResNet)


def test_unknown_name_lists_valid_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # A None entry makes `import torchvision.models` raise ImportError even if installed.
    monkeypatch.setitem(sys.modules, "torchvision.models", None)
    with pytest.raises(ValueError, match="'vgg99'") as info:
        build_model("vgg99")
    for valid in MODEL_NAMES:
        assert valid in str(info.value)


@pytest.mark.parametrize("arg", ["num_classes", "in_channels", "input_size"])
def test_rejects_non_positive_sizes(arg: str) -> None:
    with pytest.raises(ValueError, match=arg):
        build_model("mlp", **{arg: 0})


def test_torchvision_fallback_uses_get_model(monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[tuple[str, object, int]] = []

    def get_model(name: str, *, weights: object, num_classes: int) -> nn.Module:
        calls.append((name, weights, num_classes))
        return nn.Linear(3, num_classes)

    fake = types.ModuleType("torchvision.models")
    fake.list_models = lambda: ["resnet50"]  # type: ignore[attr-defined]
    fake.get_model = get_model  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "torchvision.models", fake)
    # torchvision is used only when asked for: the prefix (issue #22).
    model = build_model("torchvision:resnet50", num_classes=5, in_channels=3)
    assert isinstance(model, nn.Linear)
    assert calls == [("resnet50", None, 5)]
    with pytest.raises(ValueError, match="in_channels=3"):
        build_model("torchvision:resnet50", in_channels=1)
    with pytest.raises(ValueError, match="unknown model name"):
        build_model("not_a_model", in_channels=3)
    with pytest.raises(ValueError, match="unknown model name 'torchvision:vgg99'"):
        build_model("torchvision:vgg99", in_channels=3)
    # The built-in name still builds this project's ResNet-50 with torchvision installed.
    assert isinstance(build_model("resnet50", num_classes=5, in_channels=3), ImageNetResNet)
    assert calls == [("resnet50", None, 5)]
