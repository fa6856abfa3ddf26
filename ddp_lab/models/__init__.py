"""Models: `model.name` -> a constructor(num_classes, dropout, fc_width) registered in MODELS
(ddp_lab/models/config.py, with the group's keys); `model.stem` picks how the first convolution
is computed (ddp_lab/models/stem.py)."""

from ddp_lab.models.alexnet import AlexNet, AlexNetCifar
from ddp_lab.models.config import MODELS, STEMS, ModelConfig, image_size_problem
from ddp_lab.models.stem import SpaceToDepthConv2d, space_to_depth_stem


def build_model(name: str, num_classes: int, dropout: float, stem: str = "standard",
                fc_width: int = 4096):
    model = MODELS[name](num_classes=num_classes, dropout=dropout, fc_width=fc_width)
    return space_to_depth_stem(model) if stem == "space_to_depth" else model


__all__ = ["AlexNet", "AlexNetCifar", "MODELS", "ModelConfig", "STEMS", "SpaceToDepthConv2d",
           "build_model", "image_size_problem"]
