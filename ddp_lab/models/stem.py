"""The first convolution computed as a space-to-depth convolution: same parameters, same function.

AlexNet's first layer sees 3 input channels. Tensor-core convolutions want the channel count to be a
multiple of 8, so in channels_last cuDNN pads the input to 8 channels (a copy of the whole batch,
`nhwcAddPaddingKernel`) and then runs a kernel that wastes 5/8 of its work: this one layer takes a
share of a bf16 AlexNet step far above its share of the FLOPs (docs/results/h200-step-variants).

A stride-s convolution is exactly a stride-1 convolution over the s x s space-to-depth image:
pixel (s*b + d) of the padded input becomes pixel b of channel (c, dy, dx), and kernel tap k
becomes tap k // s of channel (c, k % s). For AlexNet (11x11, stride 4, padding 2) that is a 3x3
convolution over 48 channels of a 57x57 image; the 11x11 kernel is zero-padded to 12x12, which
costs 19% more multiply-adds but runs on efficient kernels. The weight is rearranged on every call
(64 x 3 x 11 x 11: nothing), so the parameters, the state dict and checkpoints stay those of the
plain layer, and autograd maps the gradient back through the same rearrangement.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn


class SpaceToDepthConv2d(nn.Conv2d):
    """An `nn.Conv2d` (groups 1, dilation 1, zero padding, stride s > 1) whose forward runs as a
    stride-1 convolution over the s x s space-to-depth input. Outputs equal the plain layer's up to
    floating-point summation order."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        s = self.stride
        if (s[0] != s[1] or s[0] < 2 or self.groups != 1 or self.dilation != (1, 1)
                or self.padding_mode != "zeros" or isinstance(self.padding, str)):
            raise ValueError(f"space-to-depth needs a square stride > 1, groups 1, dilation 1 and "
                             f"numeric zero padding; got {self}")

    @classmethod
    def from_conv(cls, conv: nn.Conv2d) -> "SpaceToDepthConv2d":
        """The same layer (sharing its parameters) with the space-to-depth forward."""
        new = cls(conv.in_channels, conv.out_channels, conv.kernel_size, conv.stride,
                  conv.padding, conv.dilation, conv.groups, bias=conv.bias is not None,
                  padding_mode=conv.padding_mode, device=conv.weight.device,
                  dtype=conv.weight.dtype)
        new.weight, new.bias = conv.weight, conv.bias
        return new

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        s, (kh, kw), (ph, pw) = self.stride[0], self.kernel_size, self.padding
        n, c, h, w = x.shape
        out_h, out_w = (h + 2 * ph - kh) // s + 1, (w + 2 * pw - kw) // s + 1
        hb, wb = math.ceil((h + 2 * ph) / s), math.ceil((w + 2 * pw) / s)
        kbh, kbw = math.ceil(kh / s), math.ceil(kw / s)
        channels_last = x.is_contiguous(memory_format=torch.channels_last) and c > 1
        # Zero padding as the plain layer has it, plus up to s-1 more rows/columns at the end so
        # the image splits into whole s x s blocks (no output reads them).
        x = F.pad(x, (pw, wb * s - w - pw, ph, hb * s - h - ph))
        if channels_last:  # one copy, written in channels_last order: (n, hb, wb, c, dy, dx)
            x = (x.permute(0, 2, 3, 1).reshape(n, hb, s, wb, s, c).permute(0, 1, 3, 5, 2, 4)
                 .reshape(n, hb, wb, c * s * s).permute(0, 3, 1, 2))
        else:  # (n, c, dy, dx, hb, wb)
            x = (x.reshape(n, c, hb, s, wb, s).permute(0, 1, 3, 5, 2, 4)
                 .reshape(n, c * s * s, hb, wb))
        weight = F.pad(self.weight, (0, kbw * s - kw, 0, kbh * s - kh))
        weight = (weight.reshape(self.out_channels, c, kbh, s, kbw, s).permute(0, 1, 3, 5, 2, 4)
                  .reshape(self.out_channels, c * s * s, kbh, kbw))
        if channels_last:
            weight = weight.contiguous(memory_format=torch.channels_last)
        out = F.conv2d(x, weight, self.bias)
        return out[:, :, :out_h, :out_w]


def space_to_depth_stem(model: nn.Module) -> nn.Module:
    """Replace the model's first Conv2d, in place, by its space-to-depth form."""
    for parent in model.modules():
        for name, child in parent.named_children():
            if isinstance(child, nn.Conv2d):
                setattr(parent, name, SpaceToDepthConv2d.from_conv(child))
                return model
    raise ValueError("the model has no Conv2d to turn into a space-to-depth stem")
