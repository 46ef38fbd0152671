"""What is installed: entry-point groups and their entry points (metadata only, no
imports). Both the plugin manager and the core's own hook implementations read them, so
they live here, below both (no import circle)."""
from __future__ import annotations

import importlib.metadata

__all__ = ["PLUGINS_GROUP", "TRANSPORTS_GROUP", "entry_points"]

PLUGINS_GROUP = "pipekernel.plugins"
TRANSPORTS_GROUP = "pipekernel.transports"


def entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
    """The installed entry points of ``group``, sorted by name (metadata only, no imports)."""
    seen: dict[str, importlib.metadata.EntryPoint] = {}
    for ep in importlib.metadata.entry_points(group=group):
        seen.setdefault(ep.name, ep)  # a name installed twice: the first on sys.path wins
    return [seen[name] for name in sorted(seen)]
