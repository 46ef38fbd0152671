"""Checkpoint files are data, not code: how every checkpoint reader of pipekernel unpickles.

A ``.pt`` file is a pickle, and a pickle can call any function while it loads (an
object's ``__reduce__`` naming ``os.system``). So every reader here loads data only by
default: ``torch.load(weights_only=True)`` (tensors, numbers, strings, containers, torch
dtypes and sizes), with exactly the few inert non-tensor classes a format needs allowed
by name for that one call (:class:`torch.serialization.safe_globals`, not the
process-global ``add_safe_globals``). Full unpickling happens only when the caller asked
for it (``trust_checkpoint=True`` and the switches of the facades, docs/checkpoints.md);
without it a file that needs more raises :class:`~pipekernel.errors.UntrustedCheckpointError`
naming the global it would have run, the file and the switch — before any state changed.

``torch.distributed.checkpoint`` unpickles its ``.metadata`` with plain ``pickle`` and its
non-tensor values with ``weights_only=False``: :func:`dcp_reader` and :func:`dcp_planner`
replace those two readers with data-only ones (the metadata's own dataclasses allowed).
"""
from __future__ import annotations

import io
import pickle
import re
from collections.abc import Sequence
from typing import Any

import torch

from pipekernel.errors import DataError, UntrustedCheckpointError

__all__ = ["load_file", "refusal", "dcp_load", "dcp_reader", "dcp_planner", "SWITCH"]

#: The switch the error names, for the calls of pipekernel's own API.
SWITCH = ("trust_checkpoint=True (engine.load_checkpoint / engine.resume / "
          "pk.load_sequential)")

#: torch's words for a global its data-only unpickler refused (two phrasings in 2.6+).
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


def refusal(error: BaseException, path: str, switch: str = SWITCH
            ) -> UntrustedCheckpointError | None:
    """The error to raise for ``error``, torch's data-only unpickler refusing ``path``:
    it names the global the file needs, the file, and ``switch``; ``None`` when ``error``
    is not such a refusal (a truncated or corrupt file: the caller says so)."""
    text = str(error)
    if not isinstance(error, pickle.UnpicklingError) or "Weights only load failed" not in text:
        return None
    found = _GLOBAL.search(text)
    if found is None:  # an opcode it does not know: garbage, or not a pickle at all
        return None
    name = found.group(1)
    return UntrustedCheckpointError(
        f"checkpoint file {path} is not data only: it holds an object of {name}, and "
        f"unpickling it would run {name}'s code (pipekernel loads checkpoints as data only)",
        hint=f"if the file comes from a source you trust, load it with {switch}; "
             "otherwise do not load it (nothing was loaded)",
        path=path, global_name=name)


def load_file(source: Any, path: str, *, trust: bool = False, allowed: Sequence[Any] = (),
              switch: str = SWITCH) -> Any:
    """``torch.load(source)`` onto the CPU as data only, ``allowed`` (classes, or
    ``(class, "module.name")`` pairs) allowed by name for this call; everything when
    ``trust``. ``path`` names the file in errors.

    :raises UntrustedCheckpointError: the file needs a global that is not allowed.
    :raises FileNotFoundError: and torch's own errors for a truncated or corrupt file, for
        the caller to word (it knows what the file was for).
    """
    if trust:
        return torch.load(source, map_location="cpu", weights_only=False)
    with torch.serialization.safe_globals(list(allowed)):
        try:
            return torch.load(source, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            refused = refusal(err, path, switch)
            if refused is None:  # garbage: torch's advice to unpickle fully would mislead
                raise pickle.UnpicklingError(f"not a torch.save file: {_reason(err)}") from err
            raise refused from None


def _reason(error: BaseException) -> str:
    """The line of a data-only unpickling error that says what was wrong."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    said = [line for line in lines if line.startswith(("Unsupported", "WeightsUnpickler"))
            and line.rstrip(":") != "WeightsUnpickler error"]
    return (said or lines or ["no reason given"])[-1][:200]


# -- torch.distributed.checkpoint ----------------------------------------------------------

def _metadata_classes() -> dict[tuple[str, str], Any]:
    """What DCP's ``.metadata`` pickles (torch 2.13, found by recording a save's
    ``find_class`` calls): its own dataclasses, ``torch.Size``, dtypes, a layout by name
    and the checkpoint's path."""
    import pathlib

    from torch.distributed.checkpoint import filesystem, metadata
    names = ("Metadata", "BytesStorageMetadata", "ChunkStorageMetadata", "MetadataIndex",
             "StorageMeta", "TensorProperties", "TensorStorageMetadata", "_MEM_FORMAT_ENCODING")
    allowed = {(metadata.__name__, n): getattr(metadata, n) for n in names
               if hasattr(metadata, n)}
    allowed[(filesystem.__name__, "_StorageInfo")] = filesystem._StorageInfo
    allowed[("torch", "Size")] = torch.Size
    allowed[("torch.serialization", "_get_layout")] = torch.serialization._get_layout
    allowed[("collections", "OrderedDict")] = __import__("collections").OrderedDict
    for cls in (pathlib.PosixPath, pathlib.WindowsPath, pathlib.PurePosixPath,
                pathlib.PureWindowsPath):
        allowed[(cls.__module__, cls.__name__)] = cls
        allowed[("pathlib", cls.__name__)] = cls
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """``pickle``'s documented way to restrict globals: only the metadata's classes and
    torch dtypes resolve; any other global (``os.system``) is refused by name."""

    allowed: dict[tuple[str, str], Any] = {}

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in self.allowed:
            return self.allowed[(module, name)]
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise pickle.UnpicklingError(f"Weights only load failed: GLOBAL {module}.{name} is "
                                     "not a class of torch.distributed.checkpoint's metadata")


def _read_metadata(file: Any, path: str) -> Any:
    """DCP's ``Metadata`` unpickled from ``file`` with only its own classes allowed."""
    from torch.distributed.checkpoint.metadata import Metadata

    _MetadataUnpickler.allowed = _metadata_classes()
    try:
        metadata = _MetadataUnpickler(file).load()
    except pickle.UnpicklingError as err:
        refused = refusal(err, path)
        if refused is not None:
            raise refused from None
        raise DataError(f"DCP metadata {path} is truncated or corrupt: {err}") from err
    except (EOFError, ValueError, TypeError, AttributeError, KeyError) as err:
        raise DataError(f"DCP metadata {path} is truncated or corrupt: "
                        f"{type(err).__name__}: {err}") from err
    if not isinstance(metadata, Metadata):
        raise DataError(f"DCP metadata {path} holds a {type(metadata).__name__}, not DCP's "
                        "Metadata", hint="the directory is not a torch.distributed.checkpoint")
    return metadata


def dcp_reader(path: str, trust: bool = False) -> Any:
    """A ``FileSystemReader`` of the DCP directory ``path`` whose ``.metadata`` is read as
    data only (unless ``trust``); the rest is DCP's own (tensors: ``weights_only=True``)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class DataOnlyReader(FileSystemReader):
        #: the refusal of the metadata, which DCP would bury in its own error
        refused: BaseException | None = None

        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            if trust:
                return super().read_metadata(*args, **kwargs)
            meta_path = self._get_metadata_path(kwargs.get("rank"))
            with self.fs.create_stream(meta_path, "rb") as file:
                try:
                    metadata = _read_metadata(file, str(meta_path))
                except DataError as err:
                    self.refused = self.refused or err
                    raise
            if getattr(metadata, "storage_meta", None) is None:
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return DataOnlyReader(path)


def dcp_planner(path: str, trust: bool = False) -> Any:
    """DCP's ``DefaultLoadPlanner`` with its non-tensor values (param-group
    hyperparameters) read as data only (unless ``trust``); ``path`` names the directory."""
    from torch.distributed.checkpoint import DefaultLoadPlanner

    class DataOnlyPlanner(DefaultLoadPlanner):
        def load_bytes(self, read_item: Any, value: io.BytesIO) -> None:
            fqn = read_item.dest_index.fqn
            loaded = load_file(value, f"{path} (value {fqn!r})", trust=trust)
            if self.flatten_state_dict:
                from torch.distributed.checkpoint._traverse import set_element
                set_element(self.original_state_dict, self.mappings[fqn], loaded)
            else:
                self.state_dict[fqn] = loaded

    return DataOnlyPlanner()


def dcp_load(state: dict[str, Any], path: str, trust: bool = False, **kwargs: Any) -> None:
    """``dcp.load(state)`` from the DCP directory ``path``, data only unless ``trust``;
    a refused or corrupt ``.metadata`` raises its own ``DataError`` (DCP would replace it
    with "metadata is None" after trying per-rank metadata files)."""
    import torch.distributed.checkpoint as dcp

    reader = dcp_reader(path, trust)
    try:
        dcp.load(state, checkpoint_id=path, storage_reader=reader,
                 planner=dcp_planner(path, trust), **kwargs)
    except BaseException as err:  # DCP's CheckpointException is a BaseException
        if reader.refused is not None and not isinstance(err, (KeyboardInterrupt, SystemExit)):
            raise reader.refused from None
        raise
