"""Small convolutional networks the tests compile whole: a ResNet (basic blocks, batch norm, max
and adaptive average pooling, a linear head; two blocks, or ResNet-18's [2, 2, 2, 2]), a UNet level (pooling down, transposed conv and
upsampling up, skip concatenation) and a ConvNeXt block (depthwise 7×7 conv, LayerNorm, GELU MLP)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class BasicBlock(nn.Module):
    """ResNet's basic block: two 3×3 conv + BN, a strided 1×1 conv + BN shortcut where it downsamples."""

    def __init__(self, cin: int, cout: int, stride: int):
        super().__init__()
        self.conv1, self.bn1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False), nn.BatchNorm2d(cout)
        self.conv2, self.bn2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = (nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))
                     if stride != 1 or cin != cout else nn.Identity())

    def forward(self, x):
        return F.relu(self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x))))) + self.down(x))


class TinyResNet(nn.Module):
    """A 7×7 stem with max pooling, two basic blocks (the second downsamples), global average
    pooling and a linear classifier; ``c`` channels after the stem."""

    def __init__(self, c: int = 8, classes: int = 10):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, c, 7, 2, 3, bias=False), nn.BatchNorm2d(c), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.layers = nn.Sequential(BasicBlock(c, c, 1), BasicBlock(c, 2 * c, 2))
        self.fc = nn.Linear(2 * c, classes)

    def forward(self, x):
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class ResNet18(TinyResNet):
    """ResNet-18's layout at width ``c`` (torchvision's has c = 64): the stem, four stages of two
    basic blocks with c, 2c, 4c, 8c channels (the last three downsample in their first block),
    global average pooling and a linear classifier."""

    def __init__(self, c: int = 8, classes: int = 10):
        super().__init__(c, classes)
        widths = [c, c, 2 * c, 4 * c, 8 * c]
        self.layers = nn.Sequential(*(BasicBlock(widths[i] if j == 0 else widths[i + 1], widths[i + 1],
                                                 2 if j == 0 and i > 0 else 1)
                                      for i in range(4) for j in range(2)))
        self.fc = nn.Linear(8 * c, classes)


class UNetBlock(nn.Module):
    """One UNet level: a double conv, a max-pooled path down and up again (transposed conv;
    bilinear and nearest upsampling), skip concatenation, a 1×1 head. ``norm``: "batch" (batch
    norm) or "group" (group norm of two groups) after the first conv."""

    def __init__(self, c: int = 4, norm: str = "batch"):
        super().__init__()
        normalize = {"batch": lambda: nn.BatchNorm2d(c), "group": lambda: nn.GroupNorm(2, c)}[norm]()
        self.enc = nn.Sequential(nn.Conv2d(3, c, 3, padding=1), normalize, nn.ReLU(),
                                 nn.Conv2d(c, c, 3, padding=1), nn.ReLU())
        self.mid = nn.Sequential(nn.Conv2d(c, 2 * c, 3, padding=1), nn.ReLU())
        self.up = nn.ConvTranspose2d(2 * c, c, 2, stride=2)
        self.dec = nn.Conv2d(3 * c, c, 3, padding=1)
        self.head = nn.Conv2d(c, 2, 1)

    def forward(self, x):
        skip = self.enc(x)
        mid = self.mid(F.max_pool2d(skip, 2))
        coarse = F.interpolate(F.avg_pool2d(skip, 2), scale_factor=2, mode="bilinear")
        y = F.relu(self.dec(torch.cat([skip, self.up(mid), coarse], 1)))
        return self.head(y + F.interpolate(mid, scale_factor=2, mode="nearest")[:, :y.shape[1]])


class ConvNeXtBlock(nn.Module):
    """ConvNeXt's block: depthwise 7×7 conv, LayerNorm over channels, an inverted-bottleneck MLP
    with GELU, layer scale and the residual."""

    def __init__(self, c: int = 16):
        super().__init__()
        self.dw = nn.Conv2d(c, c, 7, padding=3, groups=c)
        self.norm = nn.LayerNorm(c, eps=1e-6)
        self.pw1, self.pw2 = nn.Linear(c, 4 * c), nn.Linear(4 * c, c)
        self.gamma = nn.Parameter(torch.full((c,), 0.5))

    def forward(self, x):
        y = self.norm(self.dw(x).permute(0, 2, 3, 1))
        y = self.gamma * self.pw2(F.gelu(self.pw1(y)))
        return x + y.permute(0, 3, 1, 2)


def randomize_batch_norms(model: nn.Module, g: torch.Generator) -> nn.Module:
    """``model`` in eval mode with random batch-norm statistics and affine parameters (fresh
    ones are 0 / 1: the identity)."""
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.BatchNorm2d):
                m.running_mean.copy_(torch.randn(m.num_features, generator=g) * 0.1)
                m.running_var.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.weight.copy_(torch.rand(m.num_features, generator=g) + 0.5)
                m.bias.copy_(torch.randn(m.num_features, generator=g) * 0.1)
    return model.eval()
