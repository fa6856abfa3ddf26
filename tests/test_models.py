import torch

from ddp_lab.models import AlexNet, AlexNetCifar, build_model


def n_params(m):
    return sum(p.numel() for p in m.parameters())


def test_torchvision_alexnet_has_61_1m_parameters():
    assert round(n_params(AlexNet(num_classes=1000)) / 1e5) == 611


def test_alexnet_cifar_shape_and_parts():
    m = AlexNetCifar(num_classes=10, dropout=0.3)
    assert m(torch.randn(2, 3, 32, 32)).shape == (2, 10)
    convs = [l for l in m.modules() if isinstance(l, torch.nn.Conv2d)]
    fcs = [l for l in m.modules() if isinstance(l, torch.nn.Linear)]
    drops = [l for l in m.modules() if isinstance(l, torch.nn.Dropout)]
    assert len(convs) == 5 and len(fcs) == 3 and all(d.p == 0.3 for d in drops)


def test_num_classes_and_dropout_follow_arguments():
    m = build_model("alexnet", num_classes=7, dropout=0.0)
    assert m.classifier[-1].out_features == 7
    assert all(d.p == 0.0 for d in m.modules() if isinstance(d, torch.nn.Dropout))
