"""Model registry: `model.name` -> constructor(num_classes, dropout)."""

from ddp_lab.models.alexnet import AlexNet, AlexNetCifar

MODELS = {"alexnet": AlexNet, "alexnet_cifar": AlexNetCifar}


def build_model(name: str, num_classes: int, dropout: float):
    return MODELS[name](num_classes=num_classes, dropout=dropout)


__all__ = ["AlexNet", "AlexNetCifar", "MODELS", "build_model"]
