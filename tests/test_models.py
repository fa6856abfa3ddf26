import pytest
import torch

from ddp_lab.models import AlexNet, AlexNetCifar, SpaceToDepthConv2d, build_model


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


@pytest.mark.parametrize("name,size,convs", [("alexnet", 224, 2_469_696),
                                             ("alexnet_cifar", 32, 2_251_584)])
def test_fc_width_sets_the_two_hidden_layers(name, size, convs):
    """The convolutions keep their parameters; the classifier's are in_features x w + w x w +
    w x classes, plus biases."""
    m = build_model(name, num_classes=10, dropout=0.5, fc_width=64)
    hidden = [l for l in m.classifier if isinstance(l, torch.nn.Linear)]
    assert [(l.in_features, l.out_features) for l in hidden][1:] == [(64, 64), (64, 10)]
    assert n_params(m.features) == convs
    first = hidden[0].in_features
    assert n_params(m) == convs + first * 64 + 64 + 64 * 64 + 64 + 64 * 10 + 10
    assert m(torch.randn(2, 3, size, size)).shape == (2, 10)
    assert n_params(build_model(name, 10, 0.5)) == n_params(build_model(name, 10, 0.5,
                                                                        fc_width=4096))


@pytest.mark.parametrize("kernel,stride,padding,size", [
    (11, 4, 2, 224),  # torchvision AlexNet's first layer
    (3, 2, 1, 32),    # AlexNet-CIFAR's first layer
    (5, 3, 0, 31),    # kernel not a multiple of the stride, no padding
    (4, 2, 3, 17),    # padding wider than the stride, odd size
])
@pytest.mark.parametrize("channels_last", [False, True])
def test_space_to_depth_conv_is_the_same_function_and_gradient(kernel, stride, padding, size,
                                                               channels_last):
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, kernel, stride, padding).double()
    s2d = SpaceToDepthConv2d.from_conv(conv)
    assert s2d.weight is conv.weight and s2d.bias is conv.bias  # shared, not copied
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = torch.randn(2, 3, size, size + 1, dtype=torch.float64).contiguous(memory_format=fmt)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    a, b = conv(xa), s2d(xb)
    assert a.shape == b.shape
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    g = torch.randn_like(a)
    for ga, gb in zip(torch.autograd.grad(a, [xa, conv.weight, conv.bias], g),
                      torch.autograd.grad(b, [xb, conv.weight, conv.bias], g)):
        torch.testing.assert_close(gb, ga, rtol=0, atol=1e-10)


def test_space_to_depth_stem_keeps_parameters_state_dict_and_outputs():
    torch.manual_seed(0)
    plain = build_model("alexnet_cifar", 10, 0.0).double()
    stem = build_model("alexnet_cifar", 10, 0.0, stem="space_to_depth").double()
    assert isinstance(stem.features[0], SpaceToDepthConv2d)
    assert list(stem.state_dict()) == list(plain.state_dict())
    stem.load_state_dict(plain.state_dict())  # checkpoints move between the two stems
    x = torch.randn(3, 3, 32, 32, dtype=torch.float64)
    torch.testing.assert_close(stem(x), plain(x), rtol=0, atol=1e-12)
    assert n_params(stem) == n_params(plain)


def test_space_to_depth_refuses_a_layer_it_cannot_rewrite():
    with pytest.raises(ValueError, match="space-to-depth"):
        SpaceToDepthConv2d(3, 8, 3, stride=1)
    with pytest.raises(ValueError, match="space-to-depth"):
        SpaceToDepthConv2d.from_conv(torch.nn.Conv2d(4, 8, 3, stride=2, groups=2))
