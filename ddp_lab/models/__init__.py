"""Model registry: `model.name` -> constructor(num_classes, dropout); `model.stem` picks how the
first convolution is computed (ddp_lab/models/stem.py)."""

from ddp_lab.models.alexnet import AlexNet, AlexNetCifar
from ddp_lab.models.stem import SpaceToDepthConv2d, space_to_depth_stem

MODELS = {"alexnet": AlexNet, "alexnet_cifar": AlexNetCifar}
STEMS = ("standard", "space_to_depth")


def build_model(name: str, num_classes: int, dropout: float, stem: str = "standard"):
    model = MODELS[name](num_classes=num_classes, dropout=dropout)
    return space_to_depth_stem(model) if stem == "space_to_depth" else model


__all__ = ["AlexNet", "AlexNetCifar", "MODELS", "STEMS", "SpaceToDepthConv2d", "build_model"]
