"""Model registry: `model.name` -> constructor(num_classes, dropout, fc_width); `model.stem`
picks how the first convolution is computed (ddp_lab/models/stem.py)."""

from ddp_lab.models.alexnet import AlexNet, AlexNetCifar
from ddp_lab.models.stem import SpaceToDepthConv2d, space_to_depth_stem

MODELS = {"alexnet": AlexNet, "alexnet_cifar": AlexNetCifar}
STEMS = ("standard", "space_to_depth")
# The square input sizes (px; None: no upper bound) each model can take, whatever its stem.
# AlexNet-CIFAR's classifier expects the 2x2 map its stride-2 stem and three 2x pools leave of
# 31..46 px; torchvision's AlexNet pools adaptively to 6x6, but below 63 px its convolutions and
# pools leave no map at all. tests/test_config_audit.py checks both ends on the meta device.
IMAGE_SIZES = {"alexnet": (63, None), "alexnet_cifar": (31, 46)}


def build_model(name: str, num_classes: int, dropout: float, stem: str = "standard",
                fc_width: int = 4096):
    model = MODELS[name](num_classes=num_classes, dropout=dropout, fc_width=fc_width)
    return space_to_depth_stem(model) if stem == "space_to_depth" else model


def image_size_problem(name: str, image_size: int) -> str | None:
    """Why model `name` cannot take image_size x image_size inputs, or None if it can."""
    low, high = IMAGE_SIZES[name]
    if low <= image_size and (high is None or image_size <= high):
        return None
    sizes = f"{low}..{high} px" if high else f"at least {low} px"
    return f"model={name} takes inputs of {sizes}, not {image_size}"


__all__ = ["AlexNet", "AlexNetCifar", "IMAGE_SIZES", "MODELS", "STEMS", "SpaceToDepthConv2d",
           "build_model", "image_size_problem"]
