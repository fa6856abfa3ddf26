"""One registry per extension point: sync algorithms, collectives, models, data sets.

A name is declared once, beside what it names (`@SYNCS.register("ring")`), and resolved once
(`SYNCS["ring"]`); the config schema takes its choices from the same registry, so a new entry is
one decorator, not a list to update in several files. Entries keep the order they were declared
in (the order error messages and `--help`-style listings show).

What the config checks need to know about an entry is declared with it, as keywords:
`@MODELS.register("alexnet", image_sizes=(63, None))`; `details(name)` returns them. One of them
has a meaning here: `reads`, the keys of its config group an entry reads (`readers(key)`: the
entries that read `key`), so a key that only some entries read is refused off its default where
nothing reads it (ddp_lab/keys.py).

The four today, each declared beside its entries: COLLECTIVES (ddp_lab/comm/collective.py), SYNCS
(ddp_lab/sync/config.py), MODELS (ddp_lab/models/config.py), DATASETS (ddp_lab/data/config.py).
A new extension point (the gradient compressors to come) is one `Registry(...)` there, a
`key(..., choices=THAT)` in its config group, and a decorator on each entry.
"""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable, Iterator, Mapping

from ddp_lab.errors import ConfigError


class Registry:
    """Names of one kind (`what`, e.g. "sync algorithm") that the config key `key` chooses from."""

    def __init__(self, what: str, key: str):
        self.what, self.key = what, key
        self._entries: dict[str, object] = {}
        self._details: dict[str, Mapping] = {}

    def register(self, name: str, entry: object = None, **details) -> Callable:
        """`REG.register("x", obj)`, or `@REG.register("x")` above a class or function; `details`:
        what the config checks need to know about it (see the module docstring)."""
        def add(obj):
            if name in self._entries:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._entries[name] = obj
            self._details[name] = MappingProxyType(dict(details))
            return obj
        return add(entry) if entry is not None else add

    def __getitem__(self, name: str):
        if name not in self._entries:
            raise ConfigError(f"{self.key}={name!r} is not one of {', '.join(self._entries)}")
        return self._entries[name]

    def details(self, name: str) -> Mapping:
        """The keywords `name` was registered with."""
        self[name]  # an unknown name: the same one-line error
        return self._details[name]

    def readers(self, key: str) -> tuple[str, ...]:
        """The names whose entry reads `key` (lists it in its `reads`), in declaration order."""
        return tuple(n for n, d in self._details.items() if key in d.get("reads", ()))

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def names(self) -> tuple[str, ...]:
        return tuple(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.what!r}: {', '.join(self._entries)})"
