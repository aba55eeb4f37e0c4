"""A torchvision-style ResNet with nested stages of bottlenecks, as a user's model file
(`tests/user_models/convnet.py:build`): stem, four stages of Bottleneck blocks, pooling and a
classifier. Small widths so a test runs in seconds; the nesting is what matters."""

from __future__ import annotations

import torch
from torch import nn


class Bottleneck(nn.Module):
    def __init__(self, channels: int, width: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(channels, width, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.conv2 = nn.Conv2d(width, width, 3, stride=stride, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(width)
        self.conv3 = nn.Conv2d(width, channels * (2 if stride > 1 else 1), 1, bias=False)
        self.bn3 = nn.BatchNorm2d(channels * (2 if stride > 1 else 1))
        self.relu = nn.ReLU()
        self.down = (nn.Sequential(nn.Conv2d(channels, 2 * channels, 1, stride=stride, bias=False),
                                   nn.BatchNorm2d(2 * channels)) if stride > 1 else nn.Identity())

    def forward(self, x):
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.relu(self.bn2(self.conv2(out)))
        return self.relu(self.bn3(self.conv3(out)) + self.down(x))


class ResNet(nn.Module):
    def __init__(self, width: int = 8, depths: tuple[int, ...] = (2, 2, 3, 2), classes: int = 10):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU()
        stages, channels = [], width
        for i, depth in enumerate(depths):
            stride = 1 if i == 0 else 2
            blocks = [Bottleneck(channels, channels // 2 or 1, stride)]
            channels = channels * (2 if stride > 1 else 1)
            blocks += [Bottleneck(channels, channels // 2) for _ in range(depth - 1)]
            stages.append(nn.Sequential(*blocks))
        self.layer1, self.layer2, self.layer3, self.layer4 = stages
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(channels, classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


def build():
    return ResNet(), (torch.randn(2, 3, 16, 16),)
