"""A config key declared with its rules, beside the code that reads it.

    momentum: float = key(0.9, at_least=0, below=1, only_with=("name", ("sgd",)))  # sgd

`key` is `dataclasses.field` with the rules in its metadata (OmegaConf ignores metadata: Hydra
still checks each value's type at composition). `check_keys` walks every group of the schema and
refuses, in one line naming the key, a value outside its rules:
    choices    one of these: a tuple, or a Registry (the names registered by then)
    positive   > 0;  at_least: >= it; with below (open) or at_most (closed) too: in that range
    only_with  (another key of the group, the values of it that read this one): with any other, a
               value off the default is refused, so a run never records a setting it did not have
    read_by    a Registry: only_with the group's `name`, for the entries that read this key
               (`Registry.readers`: each entry lists the keys it reads)
Floats, and lists of them, must be finite whatever their rules: nan passes no comparison, inf
every one. What needs more than one key at a time is code: each owner's `check(cfg)`, which
`ddp_lab.config.validate` calls after this walk.
"""

from __future__ import annotations

import math
import typing
from dataclasses import MISSING as NO_DEFAULT
from dataclasses import field, fields, is_dataclass

from omegaconf import DictConfig, ListConfig, OmegaConf

from ddp_lab.errors import ConfigError


def key(default=NO_DEFAULT, *, factory=None, choices=None, positive=False, at_least=None,
        below=None, at_most=None, only_with=None, read_by=None):
    """A dataclass field holding `default` (or made by `factory`), with the rules above."""
    rules = dict(choices=choices, positive=positive, at_least=at_least, below=below,
                 at_most=at_most, only_with=only_with, read_by=read_by)
    metadata = {k: v for k, v in rules.items() if v is not None and v is not False}
    if factory is not None:
        return field(default_factory=factory, metadata=metadata)
    return field(default=default, metadata=metadata)


def check_keys(cfg, schema) -> None:
    """Every key of every group of `schema` (a dataclass of groups) against its own rules, one
    kind of rule at a time, so a config with several problems reports the same one first."""
    groups = [(name, group) for name, group in typing.get_type_hints(schema).items()
              if is_dataclass(group)]
    for rule in (_check_choice, _check_finite, _check_range, _check_scope):
        for name, group in groups:
            hints = typing.get_type_hints(group)
            for f in fields(group):
                rule(cfg, f"{name}.{f.name}", f, hints[f.name])


def _check_choice(cfg, dotted: str, f, hint) -> None:
    allowed, value = f.metadata.get("choices"), get(cfg, dotted)
    if allowed is not None and value not in allowed:
        raise ConfigError(f"{dotted}={value!r} is not one of {', '.join(map(str, allowed))}")


def _check_finite(cfg, dotted: str, f, hint) -> None:
    value = get(cfg, dotted)
    numbers = value if hint == list[float] else [value] if hint is float else []
    if not all(math.isfinite(v) for v in numbers):
        raise ConfigError(f"{dotted}={text(value)} must be finite")


def _check_range(cfg, dotted: str, f, hint) -> None:
    rules, value = f.metadata, get(cfg, dotted)
    if rules.get("positive") and not value > 0:
        raise ConfigError(f"{dotted}={value} must be > 0")
    low = rules.get("at_least")
    high, closed = (rules["at_most"], True) if "at_most" in rules else (rules.get("below"), False)
    if low is None and high is not None:  # (positive=True with at_most: the range (0, high])
        if not (value <= high if closed else value < high):
            raise ConfigError(f"{dotted}={value} must be {'<=' if closed else '<'} {high:g}")
        return
    if low is None:
        return
    if high is None:
        if not value >= low:
            raise ConfigError(f"{dotted}={value} must be >= {low}")
    elif not (low <= value <= high if closed else low <= value < high):
        raise ConfigError(f"{dotted}={value} must be in [{low:g}, {high:g}{']' if closed else ')'}")


def _check_scope(cfg, dotted: str, f, hint) -> None:
    rules = f.metadata
    if "read_by" in rules:
        other, readers = "name", rules["read_by"].readers(f.name)
    elif "only_with" in rules:
        other, readers = rules["only_with"]
    else:
        return
    owner = f"{dotted.split('.')[0]}.{other}"
    value, chosen = get(cfg, dotted), get(cfg, owner)
    default = f.default_factory() if f.default_factory is not NO_DEFAULT else f.default
    if chosen not in readers and text(value) != text(default):
        raise ConfigError(f"{dotted}={text(value)} has no effect with {_option(owner, chosen)}, "
                          f"only with {_option(owner, *readers)}; leave it at {text(default)}")


# ---- shared by the owners' checks ------------------------------------------------------------

def get(cfg, dotted: str):
    node = cfg
    for part in dotted.split("."):
        node = getattr(node, part)
    return node


def text(value) -> str:
    """A value as it is written on the command line: true, [0.9,0.999], fp32."""
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (list, ListConfig)):
        return "[" + ",".join(map(str, value)) + "]"
    return str(value)


def _option(dotted: str, *values) -> str:
    """`sync=naive|ring` for a group's name, `train.compile=false` for any other key."""
    return f"{dotted.removesuffix('.name')}={'|'.join(map(text, values))}"


def is_set(cfg, dotted: str) -> bool:
    """Whether `dotted` was given a value of its own, not left interpolating another key's."""
    group, name = dotted.split(".")
    node = getattr(cfg, group)
    return not (isinstance(node, DictConfig) and OmegaConf.is_interpolation(node, name))
