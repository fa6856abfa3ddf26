"""The model group: `model.*`'s keys and their checks, and MODELS, the names `model=` chooses from
(each model registers itself beside its code with the input sizes it takes)."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING

from ddp_lab.errors import ConfigError
from ddp_lab.keys import get, is_set, key
from ddp_lab.registry import Registry

# model.name -> a constructor (num_classes, dropout, fc_width) -> nn.Module, registered with
# image_sizes=(low, high): the square inputs (px; high None: no upper bound) it can take, whatever
# its stem. tests/test_config_audit.py checks both ends on the meta device.
MODELS = Registry("model", "model")
STEMS = ("standard", "space_to_depth")


@dataclass
class ModelConfig:
    name: str = key(MISSING, choices=MODELS)  # alexnet | alexnet_cifar
    # The input resolution the architecture is built for; the sizes each model can take: its
    # image_sizes in MODELS (alexnet_cifar 31..46 px, alexnet >= 63)
    image_size: int = key(MISSING, positive=True)
    # classes for data without labels of its own (synthetic), >= 2
    default_classes: int = MISSING
    dropout: float = key(0.5, at_least=0, below=1)  # 0 turns dropout off
    # How the first convolution is computed: standard | space_to_depth (same parameters and
    # function, a stride-1 conv over the space-to-depth image: ddp_lab/models/stem.py)
    stem: str = key("standard", choices=STEMS)
    # Width of the two hidden fully connected layers, where AlexNet keeps most of its parameters:
    # fewer gradient bytes to send for about the same compute (the tests' runs use 512)
    fc_width: int = key(4096, positive=True)


def image_size_problem(name: str, image_size: int) -> str | None:
    """Why model `name` cannot take image_size x image_size inputs, or None if it can."""
    low, high = MODELS.details(name)["image_sizes"]
    if low <= image_size and (high is None or image_size <= high):
        return None
    sizes = f"{low}..{high} px" if high else f"at least {low} px"
    return f"model={name} takes inputs of {sizes}, not {image_size}"


def check_model(cfg) -> None:
    """The model's input size, and the data's where it is given one of its own."""
    for dotted in ("model.image_size", "data.image_size"):
        problem = image_size_problem(cfg.model.name, get(cfg, dotted))
        if problem and (dotted == "model.image_size" or is_set(cfg, dotted)):
            raise ConfigError(f"{dotted}={get(cfg, dotted)}: {problem}")
