"""End-to-end: small CNN blocks written here, exported with pnnx, compiled, run, compared
with torch (max|pmx - torch| / max|torch| <= 1e-4). Batch-norm statistics are random so
folding them is really exercised."""

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F


def randomize_bn(module, seed=0):
    g = torch.Generator().manual_seed(seed)
    for m in module.modules():
        if isinstance(m, (nn.BatchNorm1d, nn.BatchNorm2d)):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.5)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
            m.weight.data.copy_(torch.randn(m.num_features, generator=g))
            m.bias.data.copy_(torch.randn(m.num_features, generator=g))
    return module.eval()


class TinyCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 8, 3, padding=1)
        self.bn = nn.BatchNorm2d(8)
        self.c2 = nn.Conv2d(8, 8, 3, padding="same", groups=8)
        self.fc = nn.Linear(8, 4)

    def forward(self, x):
        y = F.relu(self.bn(self.c(x)))
        y = y + self.c2(y) * 0.5 - torch.sqrt(torch.abs(y))
        y = F.max_pool2d(y, 2, ceil_mode=True)
        a, b = torch.chunk(y, 2, 1)
        y = torch.cat([b, a], 1)
        y = y.view(1, 8, -1).mean(-1)
        return F.softmax(self.fc(y), -1)


def test_tiny_cnn(check_model):
    torch.manual_seed(0)
    check_model("tiny_cnn", randomize_bn(TinyCNN()), (torch.rand(1, 3, 17, 17),))
