"""The plugin manager: per-engine state, ordering, validation, disabling, names."""
from __future__ import annotations

import sys

import pytest
from plugins_for_tests import Recorder

import pipekernel as pk
from pipekernel.step.precision import Precision
from pipekernel.extend import manager as pmod
from pipekernel.errors import ConfigError, UnknownNameError
from pipekernel.extend.manager import (make_plugin_manager, make_precision, make_transport,
                                       provided_names)


class Misspelt:
    @pk.hookimpl
    def pipekernel_before_instrucion(self, instruction):  # sic
        pass


class WrongParameter:
    @pk.hookimpl
    def pipekernel_before_instruction(self, instrucion):  # sic
        pass


class Mine(Precision):
    def __init__(self, name, options):
        self.tag = ("mine", name, dict(options))


class Half:
    """Overrides the built-in fp32 policy and adds a name."""

    name = "half"

    @pk.hookimpl
    def pipekernel_make_precision(self, name, options):
        return Mine(name, options) if name in ("fp32", "half") else None

    @pk.hookimpl
    def pipekernel_list_names(self, kind):
        return ["half"] if kind == "precision" else None


def test_misspelt_hook_is_rejected_with_the_plugin_name():
    with pytest.raises(ConfigError, match="tests.test_plugin_manager.Misspelt|Misspelt") as err:
        make_plugin_manager([Misspelt()], autoload=False)
    assert "pipekernel_before_instrucion" in str(err.value)
    assert "pipekernel_before_instruction" in err.value.hint  # the real names are listed


def test_unknown_hook_parameter_is_rejected_with_the_plugin_name():
    with pytest.raises(ConfigError, match="WrongParameter") as err:
        make_plugin_manager([WrongParameter()], autoload=False)
    assert "instrucion" in str(err.value)


def test_plugin_objects_are_named_for_errors_and_disabling():
    pm = make_plugin_manager([Recorder("rec"), Recorder("rec"), Half()], autoload=False)
    names = {n for n, p in pm.list_name_plugin() if p is not None}
    assert {"rec", "rec#2", "half", "pipekernel.extend.builtin", "precision", "partition"} <= names
    assert pm.sources["precision"][0] == "pipekernel" and pm.sources["rec"] == ("", "")


def test_managers_are_independent():
    first, second = make_plugin_manager([Half()]), make_plugin_manager()
    assert first.get_plugin("half") is not None and second.get_plugin("half") is None
    assert make_precision(first, "fp32", {}).tag[0] == "mine"
    assert type(make_precision(second, "fp32", {})).__name__ == "FP32"


def test_an_installed_plugin_overrides_a_trylast_default_and_lists_its_names():
    pm = make_plugin_manager([Half()], autoload=False)
    assert make_precision(pm, "half", {"x": 1}).tag == ("mine", "half", {"x": 1})
    assert provided_names(pm, "precision") == {"fp32": "precision", "bf16": "precision",
                                               "fp16": "precision", "amp-bf16": "precision",
                                               "half": "half"}
    assert provided_names(pm, "partition") == {"uniform": "partition",
                                               "parameters": "partition",
                                               "type:<regex>": "partition",
                                               "memory": "partition"}


def test_disabled_by_argument_and_environment(monkeypatch):
    assert make_plugin_manager([Half()], disabled=["half"]).get_plugin("half") is None
    monkeypatch.setenv("PIPEKERNEL_DISABLE_PLUGINS", " half , precision")
    pm = make_plugin_manager([Half()])
    assert pm.get_plugin("half") is None and pm.get_plugin("precision") is None
    with pytest.raises(UnknownNameError, match="unknown precision 'fp32'") as err:
        make_precision(pm, "fp32", {})
    assert "available precisions: none" in err.value.hint


def test_the_core_defaults_cannot_be_disabled():
    with pytest.raises(ConfigError, match="pipekernel.extend.builtin"):
        make_plugin_manager(disabled=["pipekernel.extend.builtin"])


def test_unknown_precision_lists_the_available_names():
    with pytest.raises(UnknownNameError) as err:
        make_precision(make_plugin_manager([Half()]), "fp8", {})
    assert "fp32, half" in err.value.hint


def test_unknown_transport_lists_installed_names_and_how_to_publish():
    with pytest.raises(UnknownNameError) as err:
        make_transport(make_plugin_manager(), "carrier-pigeon", {"timeout": 1})
    text = str(err.value)
    assert ("unknown transport 'carrier-pigeon'; installed transports: cupy-nccl, gloo, nccl, "
            "staged") in text
    assert '[project.entry-points."pipekernel.transports"]' in text
    assert 'carrier-pigeon = "your_package.module:MyTransport"' in text


def test_only_the_selected_transport_is_imported(monkeypatch):
    # the modules come back afterwards: a test after this one in the same process (pytest
    # -n orders files differently) must see the objects its imports bound, not new copies
    for name in [m for m in sys.modules if m.startswith("pipekernel.transports.")]:
        monkeypatch.delitem(sys.modules, name)
    with pytest.raises(UnknownNameError):
        make_transport(make_plugin_manager(), "nope", {"timeout": 1})
    assert not [m for m in sys.modules if m.startswith("pipekernel.transports.")]
    assert "cupy" not in sys.modules


def test_auto_transport_follows_cuda(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pmod.auto_transport() == "nccl"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pmod.auto_transport() == "gloo"
    seen = []

    class Spy:
        @pk.hookimpl
        def pipekernel_make_transport(self, name, options):
            seen.append((name, options))
            return "a transport"

    assert make_transport(make_plugin_manager([Spy()]), "auto", {"timeout": 3}) == "a transport"
    assert seen == [("gloo", {"timeout": 3})]


@pytest.mark.skipif(pytest.importorskip("torch").cuda.is_available(), reason="needs no CUDA")
def test_nccl_without_cuda_says_so():
    with pytest.raises(ConfigError, match="needs CUDA"):
        make_transport(make_plugin_manager(), "nccl", {"timeout": 1})


def test_the_same_plugin_object_twice_is_a_config_error():
    recorder = Recorder("twice")
    with pytest.raises(ConfigError, match="registered twice"):
        make_plugin_manager([recorder, recorder], autoload=False)


def test_a_plugin_that_fails_to_import_is_named_and_listing_goes_on(monkeypatch):
    import importlib.metadata

    from pipekernel.extend.inventory import inventory

    broken = importlib.metadata.EntryPoint(name="broken", value="no_such_module_xyz:Plugin",
                                           group=pmod.PLUGINS_GROUP)
    real = pmod.entry_points
    monkeypatch.setattr(pmod, "entry_points", lambda group: real(group) + (
        [broken] if group == pmod.PLUGINS_GROUP else []))
    with pytest.raises(pmod.PluginLoadError) as err:
        make_plugin_manager()
    assert err.value.plugin == "broken" and "no_such_module_xyz" in str(err.value)
    assert "PIPEKERNEL_DISABLE_PLUGINS=broken" in err.value.hint
    assert make_plugin_manager(disabled=["broken"]).get_plugin("precision") is not None
    monkeypatch.setattr("pipekernel.extend.inventory.entry_points", pmod.entry_points)
    status = {e.name: e.status for e in inventory()["plugins"]}
    assert status["broken"].startswith("failed to load: ModuleNotFoundError")
    assert status["precision"] == ""


def test_installed_plugins_load_after_the_defaults_and_override_them(monkeypatch):
    import importlib.metadata

    # sorts before "partition"/"precision" by name, yet must be registered after them
    installed = importlib.metadata.EntryPoint(
        name="aaa_override", value="plugins_for_tests:FP32Override", group=pmod.PLUGINS_GROUP)
    real = pmod.entry_points
    monkeypatch.setattr(pmod, "entry_points", lambda group: sorted(
        real(group) + ([installed] if group == pmod.PLUGINS_GROUP else []),
        key=lambda ep: ep.name))
    pm = make_plugin_manager()
    order = [name for name, _ in pm.list_name_plugin()]  # registration order
    assert order.index("aaa_override") > order.index("precision")
    assert type(make_precision(pm, "fp32", {})).__name__ == "OverriddenFP32"
    assert type(make_precision(make_plugin_manager(autoload=False), "fp32", {})).__name__ == "FP32"


def test_the_core_never_imports_plugins_or_transports_by_name():
    import ast
    from pathlib import Path

    core = Path(pk.__file__).parent
    offenders = []
    for path in core.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.name}: {n}" for n in names
                          if n.startswith(("pipekernel.plugins", "pipekernel.transports"))]
    assert offenders == []


class _Extra:  # an instruction class only this test knows
    pass


class _ClaimsExtra:
    def __init__(self, name):
        self.name = name

    @pk.hookimpl
    def pipekernel_register_instructions(self):
        return {_Extra: lambda instruction: None}


def test_two_plugins_claiming_one_instruction_is_an_error_naming_both():
    from pipekernel.engine.assembly_step import plugin_handlers

    one, other = _ClaimsExtra("one"), _ClaimsExtra("other")
    assert set(plugin_handlers(make_plugin_manager([one], autoload=False), None)) == {_Extra}
    pm = make_plugin_manager([one, other], autoload=False)
    with pytest.raises(ConfigError, match="both register a handler for instruction _Extra") \
            as err:
        plugin_handlers(pm, None)
    names = [pm.get_name(one), pm.get_name(other)]
    assert all(repr(n) in str(err.value) for n in names), (names, str(err.value))
