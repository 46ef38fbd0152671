"""The plugin manager: per-engine state, ordering, validation, disabling, names."""
from __future__ import annotations

import sys

import pytest
from plugins_for_tests import Recorder

import pipekernel as pk
from pipekernel import plugin_manager as pmod
from pipekernel.errors import ConfigError, UnknownNameError
from pipekernel.plugin_manager import (make_plugin_manager, make_precision, make_transport,
                                       provided_names)


class Misspelt:
    @pk.hookimpl
    def pipekernel_before_instrucion(self, instruction):  # sic
        pass


class WrongParameter:
    @pk.hookimpl
    def pipekernel_before_instruction(self, instrucion):  # sic
        pass


class Half:
    """Overrides the built-in fp32 policy and adds a name."""

    name = "half"

    @pk.hookimpl
    def pipekernel_make_precision(self, name, options):
        return ("mine", name, dict(options)) if name in ("fp32", "half") else None

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
    assert {"rec", "rec#2", "half", "pipekernel.builtin", "precision", "partition"} <= names
    assert pm.sources["precision"][0] == "pipekernel" and pm.sources["rec"] == ("", "")


def test_managers_are_independent():
    first, second = make_plugin_manager([Half()]), make_plugin_manager()
    assert first.get_plugin("half") is not None and second.get_plugin("half") is None
    assert make_precision(first, "fp32", {})[0] == "mine"
    assert type(make_precision(second, "fp32", {})).__name__ == "FP32"


def test_an_installed_plugin_overrides_a_trylast_default_and_lists_its_names():
    pm = make_plugin_manager([Half()], autoload=False)
    assert make_precision(pm, "half", {"x": 1}) == ("mine", "half", {"x": 1})
    assert provided_names(pm, "precision") == {"fp32": "precision", "half": "half"}
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
    with pytest.raises(ConfigError, match="pipekernel.builtin"):
        make_plugin_manager(disabled=["pipekernel.builtin"])


def test_unknown_precision_lists_the_available_names():
    with pytest.raises(UnknownNameError) as err:
        make_precision(make_plugin_manager([Half()]), "fp8", {})
    assert "fp32, half" in err.value.hint


def test_unknown_transport_lists_installed_names_and_how_to_publish():
    with pytest.raises(UnknownNameError) as err:
        make_transport(make_plugin_manager(), "carrier-pigeon", {"timeout": 1})
    text = str(err.value)
    assert "unknown transport 'carrier-pigeon'; installed transports: gloo, nccl" in text
    assert '[project.entry-points."pipekernel.transports"]' in text
    assert 'carrier-pigeon = "your_package.module:MyTransport"' in text


def test_only_the_selected_transport_is_imported():
    for name in [m for m in sys.modules if m.startswith("pipekernel.transports.")]:
        sys.modules.pop(name)
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
