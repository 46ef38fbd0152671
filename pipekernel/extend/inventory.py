"""What is installed: transports, plugins, schedules, precisions, partition methods.

Used by ``pipekernel plugins``. Transports are read from entry-point metadata
only (no transport module is imported, so neither is ``cupy``); plugins are
loaded into a fresh plugin manager, as an engine would load them, and asked
for the names they provide. Each entry says which distribution and version it
comes from.
"""
from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any

from pipekernel.extend.manager import (DISABLE_ENV, PLUGINS_GROUP, TRANSPORTS_GROUP,
                                       PluginLoadError, distribution_of, entry_points, make_plugin_manager,
                                       provided_names)

__all__ = ["Entry", "inventory", "format_inventory", "KINDS"]

#: Sections in the order they are printed.
KINDS = ("transports", "plugins", "schedules", "precisions", "partitions")


@dataclass(frozen=True)
class Entry:
    """One installed thing: its ``name``, where it comes from and what provides it."""

    name: str
    distribution: str
    version: str
    provider: str  # entry-point value, or the plugin that registers the name
    status: str = ""  # "disabled", "not loaded (autoload off)", or ""


def _source(pm: Any, plugin: str) -> tuple[str, str]:
    return pm.sources.get(plugin, ("", ""))


def _named(pm: Any, kind: str) -> list[Entry]:
    return [Entry(name, *_source(pm, plugin), plugin)
            for name, plugin in sorted(provided_names(pm, kind).items())]


def _schedules(pm: Any) -> list[Entry]:
    found: dict[str, str] = {}
    for impl in pm.hook.pipekernel_register_schedules.get_hookimpls():  # first registered first
        for name in impl.function() or {}:
            found[name] = impl.plugin_name
    return [Entry(name, *_source(pm, plugin), plugin) for name, plugin in sorted(found.items())]


def _plugins(pm: Any) -> list[Entry]:
    entries = []
    for ep in entry_points(PLUGINS_GROUP):
        status = ("disabled" if pm.is_blocked(ep.name) else
                  "" if pm.has_plugin(ep.name) else "not loaded (autoload off)")
        entries.append(Entry(ep.name, *distribution_of(ep), ep.value, status))
    return entries


def inventory(*, autoload: bool | None = None, disabled: Iterable[str] = (),
              plugins: Iterable[Any] = ()) -> dict[str, list[Entry]]:
    """Everything installed, by kind (see :data:`KINDS`); arguments as for
    :func:`~pipekernel.extend.manager.make_plugin_manager`."""
    broken: dict[str, str] = {}
    while True:  # list what works; show what does not load instead of failing
        try:
            pm = make_plugin_manager(plugins, autoload=autoload, disabled=[*disabled, *broken])
            break
        except PluginLoadError as err:
            if err.plugin in broken:
                raise
            broken[err.plugin] = err.message.split(": ", 1)[-1]
    found = {
        "transports": [Entry(ep.name, *distribution_of(ep), ep.value)
                       for ep in entry_points(TRANSPORTS_GROUP)],
        "plugins": _plugins(pm),
        "schedules": _schedules(pm),
        "precisions": _named(pm, "precision"),
        "partitions": _named(pm, "partition"),
    }
    found["plugins"] = [replace(e, status=f"failed to load: {broken[e.name]}")
                        if e.name in broken else e for e in found["plugins"]]
    return found


def format_inventory(found: dict[str, list[Entry]], as_json: bool = False) -> str:
    """Text (aligned columns, one section per kind) or JSON."""
    if as_json:
        return json.dumps({kind: [asdict(e) for e in entries] for kind, entries in found.items()},
                          indent=2)
    lines: list[str] = []
    for kind in KINDS:
        entries = found.get(kind, [])
        lines.append(f"{kind}:" if entries else f"{kind}: none")
        width = max((len(e.name) for e in entries), default=0)
        dist_width = max((len(f"{e.distribution} {e.version}") for e in entries), default=0)
        for e in entries:
            dist = f"{e.distribution} {e.version}".strip() or "(not installed)"
            status = f"  [{e.status}]" if e.status else ""
            lines.append(f"  {e.name:<{width}}  {dist:<{dist_width}}  {e.provider}{status}")
    lines.append(f"(disable a plugin with {DISABLE_ENV}=name1,name2; select a transport by "
                 "name with PipelineEngine(transport=...))")
    return "\n".join(lines)
