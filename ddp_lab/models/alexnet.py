"""AlexNet at two resolutions: torchvision's (224 px, 61.1 M parameters with 1000 classes) and an
AlexNet-style net for 32 px inputs with the same shape of computation: five convolutions with ReLU
and max-pooling, then three fully connected layers with dropout. Both keep most parameters in the
FC layers, which is what makes AlexNet communication-heavy under data parallelism."""

from __future__ import annotations

from torch import nn

from ddp_lab.models.config import MODELS


# torchvision's AlexNet pools adaptively to 6x6, but below 63 px its convolutions and pools leave
# no map at all.
@MODELS.register("alexnet", image_sizes=(63, None))
def AlexNet(num_classes: int = 1000, dropout: float = 0.5, fc_width: int = 4096) -> nn.Module:
    """torchvision's AlexNet (the one-GPU variant of Krizhevsky et al.), randomly initialised;
    its two hidden fully connected layers `fc_width` wide (4096: 54.5 M of its 61.1 M
    parameters)."""
    # Imported here: torchvision.models loads every model family (seconds on a small VM), which
    # every rank of an AlexNet-CIFAR run would otherwise pay at start-up.
    from torchvision.models import alexnet as torchvision_alexnet

    model = torchvision_alexnet(weights=None, num_classes=num_classes, dropout=dropout)
    if fc_width != 4096:
        fc = model.classifier
        fc[1], fc[4] = nn.Linear(fc[1].in_features, fc_width), nn.Linear(fc_width, fc_width)
        fc[6] = nn.Linear(fc_width, num_classes)
    return model


# Its classifier expects the 2x2 map its stride-2 stem and three 2x pools leave of 31..46 px.
@MODELS.register("alexnet_cifar", image_sizes=(31, 46))
class AlexNetCifar(nn.Module):
    """AlexNet for 32x32 inputs: 3x3 kernels, three 2x pools (32 -> 16 -> 8 -> 4 -> 2), FC
    1024-fc_width-fc_width (4096: 21 M of its 23.3 M parameters)."""

    def __init__(self, num_classes: int = 10, dropout: float = 0.5, fc_width: int = 4096):
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(3, 64, kernel_size=3, stride=2, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(64, 192, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
            nn.Conv2d(192, 384, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(384, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(256, 256, kernel_size=3, padding=1), nn.ReLU(inplace=True),
            nn.MaxPool2d(kernel_size=2),
        )
        self.classifier = nn.Sequential(
            nn.Dropout(p=dropout), nn.Linear(256 * 2 * 2, fc_width), nn.ReLU(inplace=True),
            nn.Dropout(p=dropout), nn.Linear(fc_width, fc_width), nn.ReLU(inplace=True),
            nn.Linear(fc_width, num_classes),
        )

        # He init for the ReLU convs (torchvision's VGG init). With PyTorch's default init the
        # signal fades through eight layers without normalisation and SGD stalls at chance.
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
                nn.init.zeros_(m.bias)
            elif isinstance(m, nn.Linear):
                nn.init.normal_(m.weight, 0, 0.01)
                nn.init.zeros_(m.bias)

    def forward(self, x):
        return self.classifier(self.features(x).flatten(1))
