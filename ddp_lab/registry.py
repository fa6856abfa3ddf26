"""One registry per extension point: sync algorithms, collectives, models, data sets.

A name is declared once, beside what it names (`@SYNCS.register("ring")`), and resolved once
(`SYNCS["ring"]`); the config schema takes its choices from the same registry, so a new entry is
one decorator, not a list to update in several files. Entries keep the order they were declared
in (the order error messages and `--help`-style listings show)."""

from __future__ import annotations

from typing import Callable, Iterator

from ddp_lab.errors import ConfigError


class Registry:
    """Names of one kind (`what`, e.g. "sync algorithm") that the config key `key` chooses from."""

    def __init__(self, what: str, key: str):
        self.what, self.key = what, key
        self._entries: dict[str, object] = {}

    def register(self, name: str, entry: object = None) -> Callable:
        """`REG.register("x", obj)`, or `@REG.register("x")` above a class or function."""
        def add(obj):
            if name in self._entries:
                raise ValueError(f"{self.what} {name!r} is registered twice")
            self._entries[name] = obj
            return obj
        return add(entry) if entry is not None else add

    def __getitem__(self, name: str):
        if name not in self._entries:
            raise ConfigError(f"{self.key}={name!r} is not one of {', '.join(self._entries)}")
        return self._entries[name]

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
