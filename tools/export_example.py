"""Export the example model shipped in tools/example/ (a small residual CNN, ~60 KB).

    pip install -e '.[test]' && python tools/export_example.py

Writes tools/example/cnn.pnnx.param and cnn.pnnx.bin, and cnn_input.npy /
cnn_expected.npy (torch's output on a fixed input) so `pmx run` can be checked by hand.
"""

import contextlib
import io
import os
import pathlib
import shutil
import tempfile

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

OUT = pathlib.Path(__file__).resolve().parent / "example"


class ExampleCNN(nn.Module):
    """Conv-BN-ReLU stem, a residual block, a depthwise-separable block, SE, classifier."""

    def __init__(self, classes=10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, stride=2, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.res = nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Conv2d(16, 16, 3, padding=1, bias=False),
            nn.BatchNorm2d(16),
        )
        self.dw = nn.Sequential(
            nn.Conv2d(16, 16, 3, stride=2, padding=1, groups=16, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU6(),
            nn.Conv2d(16, 32, 1, bias=False),
            nn.BatchNorm2d(32),
            nn.Hardswish(),
        )
        self.se1 = nn.Conv2d(32, 8, 1)
        self.se2 = nn.Conv2d(8, 32, 1)
        self.fc = nn.Linear(32, classes)

    def forward(self, x):
        x = self.stem(x)
        x = F.relu(x + self.res(x))
        x = self.dw(x)
        s = torch.sigmoid(self.se2(F.relu(self.se1(F.adaptive_avg_pool2d(x, 1)))))
        x = F.adaptive_avg_pool2d(x * s, 1).flatten(1)
        return F.softmax(self.fc(x), dim=1)


def main():
    import pnnx

    torch.manual_seed(0)
    model = ExampleCNN().eval()
    g = torch.Generator().manual_seed(1)
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.2)
            m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
    x = torch.rand(1, 3, 64, 64, generator=g)
    OUT.mkdir(exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        cwd = os.getcwd()
        os.chdir(tmp)
        try:
            with contextlib.redirect_stdout(io.StringIO()):
                pnnx.export(model, "cnn.pt", (x,))
        finally:
            os.chdir(cwd)
        for name in ("cnn.pnnx.param", "cnn.pnnx.bin"):
            shutil.copy(pathlib.Path(tmp) / name, OUT / name)
    with torch.no_grad():
        np.save(OUT / "cnn_expected.npy", model(x).numpy())
    np.save(OUT / "cnn_input.npy", x.numpy())
    print(f"wrote {OUT}/cnn.pnnx.param, cnn.pnnx.bin ({(OUT / 'cnn.pnnx.bin').stat().st_size} bytes)")


if __name__ == "__main__":
    main()
