"""The typed read-only views of an engine in ``pipekernel.plugin`` (issue 29, item 2): what
hooks and checkpoints may read, and that the objects passed provide all of it."""
from __future__ import annotations

import dataclasses
import inspect

import pytest

import pipekernel as pk
from pipekernel.engine.assembly import Assembly
from pipekernel.engine.assembly_step import StageBuild
from pipekernel.plugin import EngineView, RuntimeView, StageView
from pipekernel.stage.runtime import StageRuntime


def _members(protocol: type) -> set[str]:
    """A Protocol's attributes and methods, its bases' included."""
    names: set[str] = set()
    for cls in protocol.__mro__:
        if cls.__module__ != "pipekernel.extend.views":
            continue
        names |= set(getattr(cls, "__annotations__", {}))
        names |= {n for n, v in vars(cls).items() if (inspect.isfunction(v)
                  or isinstance(v, property)) and not n.startswith("_")}
    return names


def _provided(cls: type) -> set[str]:
    names = {n for n in dir(cls) if not n.startswith("_")}
    if dataclasses.is_dataclass(cls):
        names |= {f.name for f in dataclasses.fields(cls)}
    return names


@pytest.mark.parametrize("protocol, cls", [(EngineView, pk.PipelineEngine),
                                           (StageView, pk.PipelineEngine),
                                           (StageView, StageBuild)])
def test_what_hooks_get_provides_every_member_of_its_view(protocol, cls):
    missing = _members(protocol) - _provided(cls)
    assert not missing, f"{cls.__name__} lacks {sorted(missing)} of {protocol.__name__}"


def test_the_runtime_provides_its_view():
    methods = {n for n, v in vars(RuntimeView).items() if inspect.isfunction(v)
               and not n.startswith("_")}  # its attributes are the runtime's instance's
    assert methods <= _provided(StageRuntime), methods - _provided(StageRuntime)
    assert {"handlers", "inputs_of", "flush"} <= methods


def test_views_are_documented_and_read_only():
    for view in (EngineView, StageView, RuntimeView):
        assert view.__doc__ and len(view.__doc__.splitlines()) > 3, view
    assert dataclasses.fields(Assembly) and Assembly.__dataclass_params__.frozen
    assert StageBuild.__dataclass_params__.frozen
    module = inspect.getattr_static(pk.PipelineEngine, "module")  # engine/fields.py
    assert isinstance(module, property) and module.fset is None  # read-only
    # one field list: the engine and the StageBuild read a stage member through one property
    assert inspect.getattr_static(StageBuild, "module") is module
