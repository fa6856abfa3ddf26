"""The registry every extension point declares its names in (ddp_lab/registry.py), and the four
that exist: each name registered once, beside its code, and the config's choices taken from them."""

from dataclasses import dataclass, field

import pytest
from omegaconf import OmegaConf

from ddp_lab.errors import ConfigError
from ddp_lab.keys import check_keys, key
from ddp_lab.registry import Registry


def test_a_registry_keeps_names_in_declaration_order_with_their_details():
    reg = Registry("widget", "widget")

    @reg.register("b", reads=("size",))
    class B:
        pass

    reg.register("a", "an entry")
    reg.register("c", object(), reads=("size", "colour"))
    assert reg.names() == ("b", "a", "c") and list(reg) == ["b", "a", "c"] and len(reg) == 3
    assert reg["b"] is B and reg["a"] == "an entry" and "a" in reg and "z" not in reg
    assert reg.details("b")["reads"] == ("size",) and dict(reg.details("a")) == {}
    assert reg.readers("size") == ("b", "c") and reg.readers("colour") == ("c",)
    assert reg.readers("weight") == ()
    with pytest.raises(TypeError):
        reg.details("b")["reads"] = ()  # read-only: declared once, at registration


def test_unknown_and_repeated_names_are_refused():
    reg = Registry("widget", "widget")
    reg.register("a", 1)
    with pytest.raises(ConfigError, match="^widget='z' is not one of a$"):
        reg["z"]
    with pytest.raises(ConfigError, match="^widget='z' is not one of a$"):
        reg.details("z")
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        reg.register("a", 2)


def test_the_extension_points_hold_their_entries_in_the_order_listings_show():
    from ddp_lab import comm
    from ddp_lab.data import DATASETS
    from ddp_lab.models import MODELS
    from ddp_lab.sync import SYNCS, BucketedSync

    assert comm.ALGOS == ("naive", "ring", "tree", "hring", "native")
    assert comm.OURS == ("naive", "ring", "tree", "hring")
    assert SYNCS.names() == ("none", "ddp", *comm.OURS, "fsdp")
    assert all(SYNCS[a] is BucketedSync for a in comm.OURS)
    assert MODELS.names() == ("alexnet", "alexnet_cifar")
    assert DATASETS.names() == ("digits", "synthetic", "cifar10", "imagefolder")


def test_keys_take_their_choices_and_scope_from_a_registry_when_checked():
    """A key's choices are the names registered by the time the config is checked, and a key only
    some entries read is refused off its default with the others (ddp_lab/keys.py)."""
    reg = Registry("widget", "widget")
    reg.register("plain", object)

    @dataclass
    class WidgetConfig:
        name: str = key("plain", choices=reg)
        size: int = key(1, at_least=0, read_by=reg)

    @dataclass
    class Schema:
        widget: WidgetConfig = field(default_factory=WidgetConfig)

    cfg = OmegaConf.structured(Schema)
    check_keys(cfg, Schema)
    cfg.widget.name = "sized"
    with pytest.raises(ConfigError, match="^widget.name='sized' is not one of plain$"):
        check_keys(cfg, Schema)
    reg.register("sized", object, reads=("size",))
    cfg.widget.size = 2
    check_keys(cfg, Schema)
    cfg.widget.name = "plain"
    with pytest.raises(ConfigError, match=r"^widget.size=2 has no effect with widget=plain, only "
                                          r"with widget=sized; leave it at 1$"):
        check_keys(cfg, Schema)
    cfg.widget.name, cfg.widget.size = "sized", -1
    with pytest.raises(ConfigError, match="^widget.size=-1 must be >= 0$"):
        check_keys(cfg, Schema)


@pytest.mark.parametrize("group", ["model", "data", "sync"])
def test_every_registered_name_is_a_config_group_option_and_back(group):
    """`model=x` chooses conf/model/x.yaml, whose `name: x` the registry must know: the two lists
    are the same (a new entry needs its YAML file, a YAML file its entry)."""
    import os

    from ddp_lab.cli import CONF_DIR
    from ddp_lab.data import DATASETS
    from ddp_lab.models import MODELS
    from ddp_lab.sync import SYNCS

    registry = {"model": MODELS, "data": DATASETS, "sync": SYNCS}[group]
    options = {f.removesuffix(".yaml") for f in os.listdir(os.path.join(CONF_DIR, group))}
    assert options == set(registry)
