"""The core's own hook implementations, all ``trylast`` so any plugin overrides them."""
from __future__ import annotations

from typing import Any

from pipekernel.extend.hookspecs import hookimpl
from pipekernel.extend.installed import TRANSPORTS_GROUP, entry_points
from pipekernel.schedules import BUILTIN_SCHEDULES


@hookimpl(trylast=True)
def pipekernel_make_transport(name: str, options: dict[str, Any]) -> Any:
    for ep in entry_points(TRANSPORTS_GROUP):
        if ep.name == name:  # import only the selected transport
            return ep.load()(**options)
    return None


@hookimpl(trylast=True)
def pipekernel_register_schedules() -> dict[str, Any]:
    return dict(BUILTIN_SCHEDULES)
