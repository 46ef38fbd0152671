"""One pluggy ``PluginManager`` per engine: no module-level plugin state.

Order of registration (pluggy calls the last registered first):

1. the core's own hook implementations (:mod:`pipekernel.extend.builtin`), all ``trylast``;
2. built-in plugins published by pipekernel itself in the ``pipekernel.plugins``
   entry-point group (always, even with autoload off: they are the defaults);
3. third-party plugins from the same group (unless autoload is off);
4. the ``plugins=[...]`` passed to the engine.

So a user plugin overrides an installed one, which overrides a default.
An entry point names a module or a class; a class is instantiated once per
manager, so its state belongs to one engine. Any of 2.–4. can be disabled by name (``disabled=`` or the comma-separated
``PIPEKERNEL_DISABLE_PLUGINS``); a disabled plugin is never imported.
"""
from __future__ import annotations

import importlib.metadata
import os
import sys
import warnings
import types
from collections.abc import Iterable
from typing import Any, cast

import pluggy

from pipekernel.extend import builtin, hookspecs
from pipekernel.extend.installed import PLUGINS_GROUP, TRANSPORTS_GROUP, entry_points
from pipekernel.errors import ConfigError, UnknownNameError, did_you_mean
from pipekernel.step.precision import REQUIRED

__all__ = ["make_plugin_manager", "PluginManager", "PluginLoadError", "PLUGINS_GROUP", "TRANSPORTS_GROUP",
           "DISABLE_ENV", "NO_AUTOLOAD_ENV", "entry_points", "plugin_name", "resolve_schedule",
           "make_transport", "check_transport_name", "make_precision", "provided_names"]

DISABLE_ENV = "PIPEKERNEL_DISABLE_PLUGINS"
NO_AUTOLOAD_ENV = "PIPEKERNEL_DISABLE_PLUGIN_AUTOLOAD"
#: The core's own implementations: they cannot be disabled (pytest's "essential plugins").
ESSENTIAL = "pipekernel.extend.builtin"
#: The distribution whose entry points count as built-in defaults.
DISTRIBUTION = "pipekernel"

_PUBLISH_HINT = ("publish one from your package's pyproject.toml:\n"
                 '    [project.entry-points."{group}"]\n'
                 '    {name} = "your_package.module:{obj}"\n'
                 "  then `pip install` the package (see docs/writing-a-plugin.md)")


class PluginLoadError(ConfigError):
    """An installed plugin's entry point failed to import; ``plugin`` is its name."""

    def __init__(self, message: str, *, plugin: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.plugin = plugin


class PluginManager(pluggy.PluginManager):
    """A pluggy manager that also remembers where each plugin came from.

    ``sources`` maps a registered plugin's name to ``(distribution, version)``
    (``("", "")`` for plugins passed as objects); ``pipekernel plugins`` and
    error messages use it.
    """

    def __init__(self) -> None:
        super().__init__("pipekernel")
        self.sources: dict[str, tuple[str, str]] = {}


def distribution_of(ep: importlib.metadata.EntryPoint) -> tuple[str, str]:
    """``(distribution name, version)`` that publishes ``ep``."""
    dist = getattr(ep, "dist", None)
    return (dist.name, dist.version) if dist is not None else ("", "")


def _is_builtin(ep: importlib.metadata.EntryPoint) -> bool:
    return distribution_of(ep)[0] == DISTRIBUTION


def _env_list(name: str) -> list[str]:
    return [item.strip() for item in os.environ.get(name, "").split(",") if item.strip()]


def plugin_name(pm: pluggy.PluginManager, plugin: Any) -> str:
    """The name ``plugin`` is registered under when passed as an object.

    A module keeps its ``__name__``; an object its ``name`` attribute if it is a
    string, else its class's qualified name (``#2``, ``#3`` ... for repeats), so
    that errors and ``disabled=`` can refer to it.
    """
    if isinstance(plugin, types.ModuleType):
        name = plugin.__name__
    else:
        own = getattr(plugin, "name", None)
        cls = type(plugin) if not isinstance(plugin, type) else plugin
        name = own if isinstance(own, str) else f"{cls.__module__}.{cls.__qualname__}"
    base, n = name, 1
    while pm.get_plugin(name) is not None:
        n += 1
        name = f"{base}#{n}"
    return name


def _load(ep: importlib.metadata.EntryPoint) -> Any:
    try:
        return ep.load()
    except Exception as err:  # any import-time failure of third-party code
        dist, version = distribution_of(ep)
        origin = f" (from {dist} {version})" if dist else ""
        raise PluginLoadError(
            f"plugin {ep.name!r}{origin} failed to load {ep.value!r}: "
            f"{type(err).__name__}: {err}", plugin=ep.name,
            hint=f"fix or uninstall it, or disable it: {DISABLE_ENV}={ep.name} or "
                 f"PipelineEngine(disable_plugins=[{ep.name!r}])") from err


def _register(pm: PluginManager, plugin: Any, name: str, source: tuple[str, str]) -> None:
    try:
        if pm.register(plugin, name=name) is not None:
            pm.sources[name] = source
    except pluggy.PluginValidationError as err:
        raise ConfigError(f"plugin {name!r} is invalid: {err}",
                          hint="hook implementations must use hook names and parameter names "
                               "from pipekernel.extend.hookspecs (see docs/hooks.md)") from err
    except ValueError as err:  # already registered
        raise ConfigError(f"plugin {name!r} is registered twice: {err}",
                          hint="pass each plugin object once") from err


def make_plugin_manager(plugins: Iterable[Any] = (), *, autoload: bool | None = None,
                        disabled: Iterable[str] = ()) -> PluginManager:
    """Build a fresh plugin manager.

    :param plugins: plugin objects or modules for this manager only.
    :param autoload: load third-party ``pipekernel.plugins`` entry points;
        default: on, unless ``PIPEKERNEL_DISABLE_PLUGIN_AUTOLOAD`` is set.
        Embedded hosts usually pass ``False`` and list their plugins explicitly.
    :param disabled: names of plugins not to load: entry-point names, or the
        names of objects in ``plugins`` (also read from the comma-separated
        ``PIPEKERNEL_DISABLE_PLUGINS``). A disabled entry point is not imported.
    :raises ConfigError: if a plugin implements a hook that does not exist or
        takes a parameter its hook does not have (naming the plugin), or if the
        core's essential implementations are disabled.
    """
    pm = PluginManager()
    pm.add_hookspecs(hookspecs)
    blocked = {*disabled, *_env_list(DISABLE_ENV)}
    if ESSENTIAL in blocked:
        raise ConfigError(f"{ESSENTIAL!r} holds the core's defaults and cannot be disabled",
                          hint="override its hooks with a plugin instead")
    _register(pm, builtin, ESSENTIAL, (DISTRIBUTION, _own_version()))
    for name in blocked:
        pm.set_blocked(name)  # also blocks plugin objects registered under that name
    if autoload is None:
        autoload = not os.environ.get(NO_AUTOLOAD_ENV)
    eps = entry_points(PLUGINS_GROUP)
    ordered = [ep for ep in eps if _is_builtin(ep)] + \
              ([ep for ep in eps if not _is_builtin(ep)] if autoload else [])
    for ep in ordered:
        if not pm.is_blocked(ep.name) and not pm.has_plugin(ep.name):
            plugin = _load(ep)
            if isinstance(plugin, type):  # a class: one instance per manager, so per engine
                plugin = plugin()
            _register(pm, plugin, ep.name, distribution_of(ep))
    given = []
    for plugin in plugins:
        given.append(plugin_name(pm, plugin))
        _register(pm, plugin, given[-1], ("", ""))
    _warn_unknown_disabled(blocked, [*(ep.name for ep in eps), *given], pm)
    try:
        pm.check_pending()
    except pluggy.PluginValidationError as err:
        name = pm.get_name(err.plugin) or repr(err.plugin)
        hooks = ", ".join(sorted(h for h in dir(hookspecs) if h.startswith("pipekernel_")))
        raise ConfigError(f"plugin {name!r} is invalid: {err}",
                          hint=f"hook names must match pipekernel.extend.hookspecs exactly: {hooks}"
                          ) from err
    return pm


def _warn_unknown_disabled(blocked: set[str], installed: list[str],
                           pm: pluggy.PluginManager) -> None:
    """A disabled name that names no plugin is most likely a typo: say so, with the fix."""
    known = sorted({*installed,
                    *(name for name, plugin in pm.list_name_plugin() if plugin is not None)})
    for name in sorted(blocked - set(known)):
        warnings.warn(f"plugin {name!r} was disabled but no installed plugin has that name"
                      f"{did_you_mean(name, known)}; installed: {', '.join(known)}",
                      stacklevel=3)


def _own_version() -> str:
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return ""


def provided_names(pm: pluggy.PluginManager, kind: str) -> dict[str, str]:
    """``{name: plugin}`` of every name plugins provide for ``kind``
    (``"schedule"``, ``"precision"``, ``"partition"``, ...), via
    ``pipekernel_list_names``; a later-registered plugin wins a shared name."""
    found: dict[str, str] = {}
    for impl in pm.hook.pipekernel_list_names.get_hookimpls():  # first registered first
        # the hookspec's return type (pluggy's impl.function is typed to return object)
        names = cast("Iterable[object] | None",
                     impl.function(**({"kind": kind} if "kind" in impl.argnames else {})))
        for name in names or ():
            found[str(name)] = impl.plugin_name
    return found


def _available(pm: pluggy.PluginManager, kind: str) -> str:
    return ", ".join(sorted(provided_names(pm, kind))) or "none"


def registered_schedules(pm: pluggy.PluginManager) -> dict[str, Any]:
    """Every schedule the plugins register, ``{name: class}`` (a later plugin wins)."""
    table: dict[str, Any] = {}
    for contribution in reversed(pm.hook.pipekernel_register_schedules()):
        table.update(contribution or {})
    return table


def resolve_schedule(pm: pluggy.PluginManager, name: str) -> Any:
    """The schedule class registered as ``name``."""
    table = registered_schedules(pm)
    if name not in table:
        raise UnknownNameError(f"unknown schedule {name!r}{did_you_mean(name, table)}",
                               hint=f"available schedules: {', '.join(sorted(table))}; add one "
                                    "with a plugin implementing pipekernel_register_schedules")
    return table[name]


def auto_transport(options: dict[str, Any] | None = None) -> str:
    """What ``transport="auto"`` selects: ``"nccl"`` when this process's stage will run
    on CUDA, else ``"gloo"`` (why: :func:`auto_reason`)."""
    return _auto(options)[0]


def auto_reason(options: dict[str, Any] | None = None) -> str:
    """Why ``transport="auto"`` selects what it does, in words."""
    return _auto(options)[1]


def _auto(options: dict[str, Any] | None) -> tuple[str, str]:
    """A process group that exists already (the host's, Ray Train's) decides by its
    backend: a gloo group stays on the CPU even on a machine with GPUs. Otherwise CUDA
    decides: a GPU for every process of the node (``cuda:LOCAL_RANK``), nccl; no CUDA, or
    fewer GPUs than processes (4 ranks on a one-GPU laptop), gloo."""
    import torch  # the engine has imported it already; the CLI must not need it
    import torch.distributed as dist

    group = (options or {}).get("group")
    if dist.is_available() and dist.is_initialized():
        backend = str(dist.get_backend(group))
        chosen = "nccl" if "nccl" in backend and torch.cuda.is_available() else "gloo"
        return chosen, f"the process group's backend is {backend}"
    if not torch.cuda.is_available():
        return "gloo", "no CUDA device"
    gpus, local = torch.cuda.device_count() or 1, _local_world_size()  # available: >= 1
    if local > gpus:  # every rank of the node decides the same: no rank on nccl alone
        return "gloo", (f"{local} processes on this node but {gpus} GPU(s): nccl needs one "
                        "GPU per process")
    return "nccl", f"{gpus} GPU(s) for {local} process(es) on this node"


def _local_world_size() -> int:
    """Processes on this node (torchrun's and pk.launch's ``LOCAL_WORLD_SIZE``, SLURM's
    tasks per node), 1 when no launcher says."""
    for key in ("LOCAL_WORLD_SIZE", "SLURM_NTASKS_PER_NODE"):
        value = os.environ.get(key, "").split("(")[0]
        if value.isdigit():
            return int(value)
    return 1


#: the transports ``"auto"`` chose that this process announced: once each, not per engine
_ANNOUNCED: set[str] = set()


def make_transport(pm: pluggy.PluginManager, name: str, options: dict[str, Any]) -> Any:
    """Ask the plugins for the transport ``name`` (``pipekernel_make_transport``).

    ``"auto"`` is resolved first (:func:`auto_transport`) and the plugins are asked for
    ``"nccl"`` or ``"gloo"``; rank 0 prints the choice once per process (one line, stderr).
    """
    if name == "auto":
        chosen, why = _auto(options)
        transport = make_transport(pm, chosen, options)
        if getattr(transport, "rank", 0) == 0 and chosen not in _ANNOUNCED:
            _ANNOUNCED.add(chosen)
            print(f"pipekernel: transport 'auto' chose {chosen!r} ({why}; stages on "
                  f"{getattr(transport, 'device', '?')}); pass transport= to choose another",
                  file=sys.stderr, flush=True)
        return transport
    transport = pm.hook.pipekernel_make_transport(name=name, options=options)
    if transport is None:
        raise _unknown_transport(name)
    return transport


def check_transport_name(pm: pluggy.PluginManager, name: str) -> None:
    """Raise what :func:`make_transport` would for a name no installed transport (entry
    point) and no plugin (``pipekernel_list_names(kind="transport")``) has, without making
    one: a launcher checks before it starts any process."""
    known = [ep.name for ep in entry_points(TRANSPORTS_GROUP)]
    if name != "auto" and name not in known and name not in provided_names(pm, "transport"):
        raise _unknown_transport(name)


def _unknown_transport(name: str) -> UnknownNameError:
    installed = [ep.name for ep in entry_points(TRANSPORTS_GROUP)]
    names = ", ".join(installed) or "none"
    return UnknownNameError(
        f"unknown transport {name!r}{did_you_mean(name, [*installed, 'auto'])}; "
        f"installed transports: {names}",
        hint=f"pick one of the installed names (or 'auto'), install a package that "
             f"provides {name!r}, or " + _PUBLISH_HINT.format(
                 group=TRANSPORTS_GROUP, name=name, obj="MyTransport"))


def make_precision(pm: pluggy.PluginManager, name: str, options: dict[str, Any]) -> Any:
    """Ask the plugins for the precision policy ``name`` (``pipekernel_make_precision``).

    :raises UnknownNameError: no plugin provides ``name`` (listing those that exist).
    :raises ConfigError: the policy lacks a method of
        :data:`pipekernel.step.precision.REQUIRED`.
    """
    precision = pm.hook.pipekernel_make_precision(name=name, options=options)
    if precision is None:
        raise UnknownNameError(f"unknown precision {name!r}"
                               f"{did_you_mean(name, provided_names(pm, 'precision'))}",
                               hint=f"available precisions: {_available(pm, 'precision')}; or "
                                    "install a precision plugin that provides it")
    missing = [m for m in REQUIRED if not callable(getattr(precision, m, None))]
    if missing:
        raise ConfigError(f"precision {name!r} ({type(precision).__name__}) lacks "
                          f"{', '.join(missing)}",
                          hint="subclass pipekernel.step.precision.Precision, which has defaults "
                               "for every method")
    return precision
