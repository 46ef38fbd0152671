"""One pluggy ``PluginManager`` per engine: no module-level plugin state.

Order of registration (pluggy calls the last registered first):

1. the core's own hook implementations (:mod:`pipekernel.builtin`), all ``trylast``;
2. built-in plugins published by pipekernel itself in the ``pipekernel.plugins``
   entry-point group (always, even with autoload off: they are the defaults);
3. third-party plugins from the same group (unless autoload is off);
4. the ``plugins=[...]`` passed to the engine.

So a user plugin overrides an installed one, which overrides a default.
"""
from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable
from typing import Any

import pluggy

from pipekernel import builtin, hookspecs
from pipekernel.errors import ConfigError, UnknownNameError
from pipekernel.precision import REQUIRED

__all__ = ["make_plugin_manager", "PLUGINS_GROUP", "TRANSPORTS_GROUP", "entry_points"]

PLUGINS_GROUP = "pipekernel.plugins"
TRANSPORTS_GROUP = "pipekernel.transports"
DISABLE_ENV = "PIPEKERNEL_DISABLE_PLUGINS"
NO_AUTOLOAD_ENV = "PIPEKERNEL_DISABLE_PLUGIN_AUTOLOAD"


def entry_points(group: str) -> list[importlib.metadata.EntryPoint]:
    """The installed entry points of ``group``, sorted by name (metadata only, no imports)."""
    return sorted(importlib.metadata.entry_points(group=group), key=lambda ep: ep.name)


def _is_builtin(ep: importlib.metadata.EntryPoint) -> bool:
    return ep.value.startswith("pipekernel.")


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def make_plugin_manager(plugins: Iterable[Any] = (), *, autoload: bool | None = None,
                        disabled: Iterable[str] = ()) -> pluggy.PluginManager:
    """Build a fresh plugin manager.

    :param plugins: plugin objects or modules for this manager only.
    :param autoload: load third-party ``pipekernel.plugins`` entry points;
        default: on, unless ``PIPEKERNEL_DISABLE_PLUGIN_AUTOLOAD`` is set.
    :param disabled: entry-point names of plugins not to load (also read from
        the comma-separated ``PIPEKERNEL_DISABLE_PLUGINS``).
    :raises ConfigError: if a plugin implements a hook that does not exist.
    """
    pm = pluggy.PluginManager("pipekernel")
    pm.add_hookspecs(hookspecs)
    pm.register(builtin, name="pipekernel.builtin")
    blocked = {*disabled, *_env_list(DISABLE_ENV)}
    if autoload is None:
        autoload = not os.environ.get(NO_AUTOLOAD_ENV)
    for ep in entry_points(PLUGINS_GROUP):
        if ep.name in blocked or not (autoload or _is_builtin(ep)):
            continue
        if pm.get_plugin(ep.name) is None:
            pm.register(ep.load(), name=ep.name)
    for plugin in plugins:
        pm.register(plugin)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        raise ConfigError(f"plugin {err.plugin!r} is invalid: {err}",
                          hint="hook names must match pipekernel.hookspecs exactly") from err
    return pm


def resolve_schedule(pm: pluggy.PluginManager, name: str) -> Any:
    """The schedule class registered as ``name``."""
    table: dict[str, Any] = {}
    for contribution in reversed(pm.hook.pipekernel_register_schedules()):
        table.update(contribution or {})
    if name not in table:
        raise UnknownNameError(f"unknown schedule {name!r}",
                               hint=f"available schedules: {', '.join(sorted(table))}")
    return table[name]


def make_transport(pm: pluggy.PluginManager, name: str, options: dict[str, Any]) -> Any:
    transport = pm.hook.pipekernel_make_transport(name=name, options=options)
    if transport is None:
        names = ", ".join(ep.name for ep in entry_points(TRANSPORTS_GROUP)) or "none"
        raise UnknownNameError(
            f"unknown transport {name!r}; installed transports: {names}",
            hint=f"install a package that publishes {name!r} in the {TRANSPORTS_GROUP!r} "
                 "entry-point group, or pick one of the installed names")
    return transport


def make_precision(pm: pluggy.PluginManager, name: str, options: dict[str, Any]) -> Any:
    precision = pm.hook.pipekernel_make_precision(name=name, options=options)
    if precision is None:
        raise UnknownNameError(f"unknown precision {name!r}",
                               hint="use 'fp32', 'bf16', 'fp16', 'amp-bf16' or install a "
                                    "precision plugin that provides it")
    missing = [m for m in REQUIRED if not callable(getattr(precision, m, None))]
    if missing:
        raise ConfigError(f"precision {name!r} ({type(precision).__name__}) lacks "
                          f"{', '.join(missing)}",
                          hint="subclass pipekernel.precision.Precision, which has defaults "
                               "for every method")
    return precision
