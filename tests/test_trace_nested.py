"""Tracing: every repeated layer stack becomes blocks (nested stacks, encoder-decoders), and the
module-chain fallback is checked against the model before it is used."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autoplan import models as zoo
from autoplan.graph.grouping import find_layer_container, find_layer_containers
from autoplan.graph.trace import extract_submodule, trace_model
from autoplan.graph.trace_errors import TraceError

# --------------------------------------------------------------------------------------------
# A torchvision-style ResNet-50 (layers 3, 4, 6, 3 of Bottlenecks), narrow so it runs fast.


class Bottleneck(nn.Module):
    expansion = 4

    def __init__(self, inplanes: int, planes: int, stride: int = 1, downsample: nn.Module | None = None):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.conv3 = nn.Conv2d(planes, planes * self.expansion, 1, bias=False)
        self.bn3 = nn.BatchNorm2d(planes * self.expansion)
        self.relu = nn.ReLU(inplace=True)
        self.downsample = downsample

    def forward(self, x):
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        return self.relu(out + identity)


class ResNet(nn.Module):
    def __init__(self, layers=(3, 4, 6, 3), width: int = 8, num_classes: int = 10):
        super().__init__()
        self.inplanes = width
        self.conv1 = nn.Conv2d(3, width, 7, stride=2, padding=3, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(kernel_size=3, stride=2, padding=1)
        self.layer1 = self._make_layer(width, layers[0])
        self.layer2 = self._make_layer(width * 2, layers[1], stride=2)
        self.layer3 = self._make_layer(width * 4, layers[2], stride=2)
        self.layer4 = self._make_layer(width * 8, layers[3], stride=2)
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(width * 8 * Bottleneck.expansion, num_classes)

    def _make_layer(self, planes: int, blocks: int, stride: int = 1) -> nn.Sequential:
        downsample = None
        if stride != 1 or self.inplanes != planes * Bottleneck.expansion:
            downsample = nn.Sequential(nn.Conv2d(self.inplanes, planes * Bottleneck.expansion, 1, stride=stride,
                                                 bias=False), nn.BatchNorm2d(planes * Bottleneck.expansion))
        layers = [Bottleneck(self.inplanes, planes, stride, downsample)]
        self.inplanes = planes * Bottleneck.expansion
        layers += [Bottleneck(self.inplanes, planes) for _ in range(1, blocks)]
        return nn.Sequential(*layers)

    def forward(self, x):
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


RESNET_BLOCKS = ["embedding", *[f"layer{i}.{j}" for i, n in zip((1, 2, 3, 4), (3, 4, 6, 3)) for j in range(n)], "fc"]


def _block_params(traced, model) -> list[int]:
    """Parameters per block, each parameter counted in the first block that uses it."""
    counted: set[str] = set()
    sizes = []
    for i in range(traced.num_blocks):
        sub, _, _ = extract_submodule(traced, i, i)
        names = {n for n, _ in sub.named_parameters()} - counted
        counted |= names
        sizes.append(sum(sub.get_parameter(n).numel() for n in names))
    assert {n for n, _ in model.named_parameters()} <= counted <= {
        n for n, _ in model.named_parameters(remove_duplicate=False)}  # a tied head is counted twice
    return sizes


def _recompose(traced, inputs):
    env = dict(zip(traced.input_names, inputs, strict=True))
    for i in range(traced.num_blocks):
        sub, names_in, names_out = extract_submodule(traced, i, i)
        env.update(zip(names_out, sub(*[env[n] for n in names_in]), strict=True))
    return env[names_out[-1]]


def test_resnet_every_bottleneck_is_a_block():
    torch.manual_seed(0)
    model = ResNet().eval()
    x = torch.randn(2, 3, 32, 32)
    traced = trace_model(model, (x,))
    assert traced.tracer == "fx"
    assert find_layer_containers(model) == ["layer1", "layer2", "layer3", "layer4"]
    assert traced.layer_containers == ["layer1", "layer2", "layer3", "layer4"]
    assert traced.layer_container == "layer3"  # the stack with the most layers, as before
    # The stem is one block; avgpool (stateless) stays with the last bottleneck, fc is its own.
    assert traced.block_names == RESNET_BLOCKS
    assert traced.block_modules[0] == ["conv1", "bn1", "relu", "maxpool"]
    assert traced.block_modules[-2] == ["layer4.2", "avgpool"]
    sizes = _block_params(traced, model)
    total = sum(sizes)
    # layer4 holds most of the parameters (one block before); now its largest bottleneck holds a quarter.
    assert sum(s for n, s in zip(traced.block_names, sizes) if n.startswith("layer4")) > 0.6 * total
    assert max(sizes) < 0.3 * total
    torch.testing.assert_close(_recompose(traced, (x,)), model(x))


def test_full_width_resnet50_has_no_dominant_block():
    with torch.device("meta"):
        model = ResNet(width=64, num_classes=1000)
    traced = trace_model(model, (torch.empty(8, 3, 224, 224, device="meta"),))
    assert traced.block_names == RESNET_BLOCKS
    sizes = _block_params(traced, model)
    assert sum(sizes) == 25_557_032  # torchvision's resnet50
    assert sum(s for n, s in zip(traced.block_names, sizes) if n.startswith("layer4")) > 0.58 * sum(sizes)
    assert max(sizes) < 0.24 * sum(sizes)  # layer4.0, with the downsampling projection


def test_resnet_user_leaves_replace_a_bottleneck():
    model = ResNet(layers=(2, 2, 2, 2)).eval()
    traced = trace_model(model, (torch.randn(2, 3, 32, 32),), leaf_modules=["layer4.1.conv2"])
    assert "layer4.1.conv2" in traced.block_names and "layer4.1" not in traced.block_names
    assert traced.block_names[-3:] == ["layer4.0", "layer4.1.conv2", "fc"]


def test_stack_of_pure_wrappers_gives_way_to_the_stacks_inside():
    """HF-ResNet-style `stages`: a ModuleList of stages that hold nothing but their layers."""

    class Stage(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.layers = nn.Sequential(*(Bottleneck(width * 4, width) for _ in range(2)))

        def forward(self, x):
            return self.layers(x)

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem = nn.Conv2d(3, 32, 3, padding=1)
            self.stages = nn.ModuleList(Stage(8) for _ in range(2))
            self.head = nn.Linear(32, 4)

        def forward(self, x):
            x = self.stem(x)
            for stage in self.stages:
                x = stage(x)
            return self.head(x.mean((2, 3)))

    traced = trace_model(Model(), (torch.randn(1, 3, 8, 8),))
    assert traced.layer_containers == ["stages.0.layers", "stages.1.layers"]
    assert traced.block_names == ["embedding", "stages.0.layers.0", "stages.0.layers.1", "stages.1.layers.0",
                                  "stages.1.layers.1", "head"]


def test_stack_inside_a_layer_is_not_split():
    """An MoE layer's experts are a stack too, but the layer (attention + experts) stays the unit."""

    class Expert(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(16, 32), nn.Linear(32, 16)

        def forward(self, x):
            return self.down(F.relu(self.up(x)))

    class MoELayer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.Linear(16, 16)
            self.experts = nn.ModuleList(Expert() for _ in range(4))

        def forward(self, x):
            x = x + self.attn(x)
            return x + sum(e(x) for e in self.experts)

    model = nn.Sequential(nn.Linear(8, 16), *(MoELayer() for _ in range(3)), nn.Linear(16, 2))
    assert find_layer_containers(model) == [""]
    traced = trace_model(model, (torch.randn(2, 8),))
    assert traced.block_names == ["0", "1", "2", "3", "4"]


# --------------------------------------------------------------------------------------------
# T5 (encoder-decoder): both stacks' layers are blocks.


def _t5():
    transformers = pytest.importorskip("transformers")
    config = transformers.T5Config(num_layers=2, num_decoder_layers=2, d_model=32, d_ff=64, num_heads=4, d_kv=8,
                                   vocab_size=128, use_cache=False)
    torch.manual_seed(0)
    return transformers.T5ForConditionalGeneration(config).eval()


T5_BLOCKS = ["embedding", "encoder.block.0", "encoder.block.1", "encoder.final_layer_norm", "decoder.embed_tokens",
             "decoder.block.0", "decoder.block.1", "decoder.final_layer_norm", "lm_head"]


def test_t5_encoder_and_decoder_layers_are_blocks():
    model = _t5()
    assert find_layer_containers(model) == ["encoder.block", "decoder.block"]
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0))
    decoder_ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    # Positional: forward(input_ids, attention_mask, decoder_input_ids).
    inputs = (ids, torch.ones(2, 8, dtype=torch.long), decoder_ids)
    traced = trace_model(model, inputs, tracer="export")
    assert traced.block_names == T5_BLOCKS
    # The second call of each stack's (stateless) dropout stays with the final norm before it.
    assert traced.block_modules[3] == ["encoder.final_layer_norm", "encoder.dropout"]
    assert traced.block_modules[4] == ["decoder.embed_tokens", "decoder.dropout"]
    sizes = _block_params(traced, model)
    assert max(sizes) < 0.3 * sum(sizes)  # the whole decoder was one block: half of the parameters
    torch.testing.assert_close(_recompose(traced, inputs), model(*inputs).logits)


# --------------------------------------------------------------------------------------------
# The built-in models keep their block names.


@pytest.mark.parametrize("spec, head", [
    ("gpt:num_layers=3,hidden_size=32,num_heads=4,vocab_size=64,max_seq_len=16", ["norm", "output"]),
    ("llama3-8b:num_layers=3,hidden_size=32,num_heads=4,num_kv_heads=2,vocab_size=64,max_seq_len=16",
     ["norm", "output"]),
])
def test_zoo_block_names_unchanged(spec, head):
    with torch.device("meta"):
        model = zoo.build_model(spec)
    traced = trace_model(model, (torch.zeros(2, 16, dtype=torch.long, device="meta"),))
    assert traced.tracer == "fx"
    assert traced.block_names == ["embedding", "layers.0", "layers.1", "layers.2", *head]
    assert traced.layer_container == "layers" and traced.layer_containers == ["layers"]
    assert find_layer_container(model) == "layers"


# --------------------------------------------------------------------------------------------
# The module-chain fallback is checked on a real input.


class _Layer(nn.Module):
    def __init__(self, hidden: int = 16):
        super().__init__()
        self.lin = nn.Linear(hidden, hidden)

    def forward(self, x):
        return x + torch.tanh(self.lin(x))


class _BranchOnValues(nn.Module):
    """Value-dependent branch: fx and export fail; the chain would call both `a` and `b`."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(8, 16)
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.a(x) if x.sum() > 0 else self.b(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


class _FunctionalBetween(nn.Module):
    """A functional op between children (and a value check that defeats fx and export)."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.inp(x) * 3.0
        for layer in self.layers:
            x = layer(x)
            if not torch.isfinite(x).all():
                raise FloatingPointError("non-finite activations")
        return self.head(x)


class _Chain(nn.Module):
    """A true chain (children in order, each on the previous output) with a value check."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.drop = nn.Dropout(0.5)
        self.layers = nn.ModuleList(_Layer() for _ in range(3))
        self.head = nn.Linear(16, 4)

    def forward(self, x):
        x = self.drop(self.inp(x))
        for layer in self.layers:
            x = layer(x)
            if not torch.isfinite(x).all():
                raise FloatingPointError("non-finite activations")
        return self.head(x)


@pytest.mark.parametrize(("model_class", "code"), [(_BranchOnValues, "if x.sum() > 0 else"),
                                                   (_FunctionalBetween, "if not torch.isfinite(x).all():")])
def test_module_chain_that_is_not_the_model_raises(model_class, code):
    """fx and export fail on the value check, and the chain is not the model: the line names the
    model's line that reads a value (the first thing to fix) and how (issue 29, item 10)."""
    with pytest.raises(TraceError) as info:
        trace_model(model_class(), (torch.randn(4, 8),))
    message = str(info.value)
    line = next(i for i, text in enumerate(Path(__file__).read_text().splitlines(), 1)
                if code in text and "def " not in text)
    assert "\n" not in message
    assert "reads a tensor's value" in message and f"test_trace_nested.py:{line} " in message, message
    assert "torch.where" in message


def test_module_chain_reordered_children_raises():
    """Children called in another order than registered: shapes fit, values do not."""

    class Reordered(_Chain):
        def forward(self, x):
            x = self.inp(x)
            for layer in reversed(self.layers):
                x = layer(x)
                if not torch.isfinite(x).all():
                    raise FloatingPointError("non-finite activations")
            return self.head(x)

    with pytest.raises(TraceError, match="max abs difference"):
        trace_model(Reordered(), (torch.randn(4, 8),), tracer="modules")


def test_module_chain_that_matches_is_used_and_noted():
    torch.manual_seed(0)
    model = _Chain().train()  # dropout active: both runs draw the same mask
    x = torch.randn(4, 8)
    traced = trace_model(model, (x,))
    assert traced.tracer == "modules"
    assert traced.block_names == ["embedding", "layers.0", "layers.1", "layers.2", "head"]
    assert "checked: the chain reproduces the model's output on a real input (a copy of the model)" in traced.note
    model.eval()
    torch.testing.assert_close(traced.gm(x), model(x))


def test_module_chain_on_meta_is_checked_on_a_materialized_copy():
    with torch.device("meta"):
        model = _Chain()
    traced = trace_model(model, (torch.empty(4, 8, device="meta"),))
    assert traced.tracer == "modules"
    assert "a CPU copy materialized from meta" in traced.note
    with torch.device("meta"):
        wrong = _FunctionalBetween()
    with pytest.raises(TraceError, match="reads a tensor's value"):
        trace_model(wrong, (torch.empty(4, 8, device="meta"),))


def test_module_chain_of_a_large_model_says_it_was_not_checked(monkeypatch):
    monkeypatch.setattr("autoplan.graph.module_chain._CHECK_MAX_PARAMS", 100)
    traced = trace_model(_Chain(), (torch.randn(4, 8),))
    assert "NOT checked against the model" in traced.note
