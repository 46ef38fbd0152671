"""Checkpoint files: where each piece lives in a checkpoint directory, writing one durably,
and reading ``latest``, ``meta.json``, a layer file or a rank file with an error that names
the file and what it was for; which checkpoints a root holds, and deleting the older ones
(:mod:`pipekernel.engine.checkpoint` has the format and the contract).
"""
from __future__ import annotations

import json
import os
import re
import shutil
import uuid
from typing import Any

import torch

from pipekernel.engine.checkpoint_data import load_file
from pipekernel.errors import ConfigError, DataError, PipelineError

#: The newest format this code reads (it reads this version and older): 2 is a checkpoint
#: of sharded stages through torch.distributed.checkpoint (``meta["format"] == "dcp"``,
#: :mod:`pipekernel.engine.checkpoint_dcp`), written before issue 45 and read since.
FORMAT_VERSION = 2
#: The version of checkpoints of layer files, the one format written (unchanged since 1,
#: so a pipekernel that predates DCP checkpoints still reads them).
LAYER_FORMAT_VERSION = 1


def _write_file(path: str, obj: Any) -> None:
    """Write ``obj`` with ``torch.save`` (bytes for JSON) to ``path`` and fsync it.

    Every checkpoint file goes through here (tests replace ``pipekernel.engine.checkpoint._write_file``
    to simulate crashes)."""
    with open(path, "wb") as f:
        if isinstance(obj, bytes):
            f.write(obj)
        else:
            torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def layer_file(index: int) -> str:
    return f"layer-{index:05d}.pt"


def rank_file(rank: int) -> str:
    return f"rank-{rank:05d}.pt"


def _older(directory: str, incomplete: bool = False) -> str:
    """The fix line for a checkpoint that cannot be read: which older ones there are and
    the two calls that load one."""
    root, tag = os.path.split(os.path.normpath(directory))
    others = [t for t in checkpoint_tags(root) if t != tag]
    there = f" ({', '.join(others)} under {root})" if others else f" (none under {root})"
    return (("the checkpoint is incomplete: " if incomplete else "")
            + f"load an older tag{there}: engine.load_checkpoint(root, tag=...), or "
              "pipekernel train --resume TAG")


def latest_tag(root: str) -> str:
    """The tag ``root/latest`` points at (``DataError`` if there is none)."""
    pointer = os.path.join(root, "latest")
    try:
        with open(pointer) as f:
            tag = f.read().strip()
    except FileNotFoundError:
        raise DataError(f"no checkpoint in {root}: {pointer} does not exist",
                        hint="save one first (engine.save_checkpoint(root)) or pass tag=") from None
    except OSError as err:
        raise DataError(f"cannot read {pointer}: {err}", hint="check the path") from err
    if not tag:
        raise DataError(f"{pointer} is empty", hint="pass tag= explicitly")
    return tag


def read_meta(root: str, tag: str | None = None) -> tuple[str, dict[str, Any]]:
    """``(directory, metadata)`` of checkpoint ``tag`` (default: ``latest``) under ``root``.

    Raises ``DataError`` for a missing or unreadable ``meta.json`` and ``ConfigError``
    for a format version newer than :data:`FORMAT_VERSION`."""
    tag = tag if tag is not None else latest_tag(root)
    directory = os.path.join(root, tag)
    meta_path = os.path.join(directory, "meta.json")
    try:
        with open(meta_path, "rb") as f:
            meta = json.loads(f.read().decode())
    except FileNotFoundError:
        raise DataError(f"checkpoint {tag!r}: {meta_path} is missing",
                        hint=f"the checkpoint is incomplete or {tag!r} is not a checkpoint "
                             f"under {root}") from None
    except (OSError, ValueError) as err:
        raise DataError(f"checkpoint {tag!r}: cannot read {meta_path} (truncated or "
                        f"corrupt): {err}", hint=_older(directory)) from err
    version = meta.get("format_version")
    if not isinstance(version, int) or version > FORMAT_VERSION:
        raise ConfigError(
            f"checkpoint {directory} has format version {version!r}, newer than the version "
            f"{FORMAT_VERSION} this pipekernel reads (written by pipekernel "
            f"{meta.get('pipekernel_version', '?')})",
            hint="upgrade pipekernel to the version that wrote it, or newer")
    return directory, meta


def _load(directory: str, path: str, what: str, trust: bool) -> Any:
    """The file ``path`` of the checkpoint ``directory``, as data only unless ``trust``
    (:mod:`pipekernel.engine.checkpoint_data`); missing, truncated or corrupt: a
    ``DataError`` naming it and ``what`` it holds."""
    try:
        return load_file(path, path, trust=trust)
    except PipelineError:
        raise
    except FileNotFoundError:
        raise DataError(f"checkpoint file {path} {what} is missing",
                        hint=_older(directory, incomplete=True)) from None
    except Exception as err:  # noqa: BLE001 - torch raises many types for a bad zip
        raise DataError(f"checkpoint file {path} {what} is truncated or corrupt: {err}",
                        hint=_older(directory)) from err


def _read_layer(directory: str, meta: dict, index: int, trust: bool = False) -> dict[str, Any]:
    """Layer ``index``'s file, as data only unless ``trust``."""
    path = os.path.join(directory, layer_file(index))
    payload = _load(directory, path, f"for layer {index} ({meta['layers'][index]['type']})",
                    trust)
    if not isinstance(payload, dict) or payload.get("layer") != index:
        raise DataError(f"checkpoint file {path} does not hold layer {index}",
                        hint="the checkpoint directory was modified by hand")
    _check_layer_payload(path, payload, meta["layers"][index].get("shapes"))
    return payload


def _check_layer_payload(path: str, payload: dict, shapes: dict | None) -> None:
    """``DataError`` unless the file holds what a layer file holds: its tensors of the
    shapes ``meta.json`` lists (checked against the model before), the optimizer state and
    hyperparameters as dicts per parameter. Checked when read, so a bad file is refused
    before anything is applied."""
    state = payload.get("state")
    fix = "the checkpoint directory was modified by hand: load an older tag"
    if not isinstance(state, dict) or not all(torch.is_tensor(v) for v in state.values()):
        raise DataError(f"checkpoint file {path}: 'state' is not a dict of tensors "
                        f"({type(state).__name__})", hint=fix)
    if shapes is not None:
        got = {k: list(v.shape) for k, v in state.items()}
        if got != shapes:
            wrong = sorted(k for k in {*got, *shapes} if got.get(k) != shapes.get(k))
            raise DataError(f"checkpoint file {path} holds {wrong[0]!r} of shape "
                            f"{got.get(wrong[0], 'missing')}, and its meta.json says "
                            f"{shapes.get(wrong[0], 'missing')}", hint=fix)
    for field in ("optimizer", "param_groups"):
        value = payload.get(field, {})
        if not isinstance(value, dict) or not all(isinstance(v, dict) for v in value.values()):
            raise DataError(f"checkpoint file {path}: {field!r} is not a dict of dicts per "
                            f"parameter ({type(value).__name__})", hint=fix)


def _read_rank(directory: str, rank: int, trust: bool = False) -> dict[str, Any]:
    """Rank ``rank``'s file, as data only unless ``trust``."""
    path = os.path.join(directory, rank_file(rank))
    payload = _load(directory, path, f"(rank {rank}'s RNG, precision and scheduler state)",
                    trust)
    _check_rank_payload(path, rank, payload)
    return payload


def _check_rank_payload(path: str, rank: int, payload: Any) -> None:
    """``DataError`` unless ``payload`` has the types a rank file holds (checked when read:
    a bad file is refused before anything is applied)."""
    fix = "the checkpoint directory was modified by hand: load an older tag"
    if not isinstance(payload, dict):
        raise DataError(f"checkpoint file {path} holds a {type(payload).__name__}, not rank "
                        f"{rank}'s state", hint=fix)
    rng = payload.get("rng", {})
    cpu = rng.get("cpu") if isinstance(rng, dict) else None
    checks = (("rng", isinstance(rng, dict) and isinstance(rng.get("python", ()), (tuple, list))
               and (cpu is None or torch.is_tensor(cpu) and cpu.dtype == torch.uint8
                    and cpu.shape == torch.get_rng_state().shape)),
              ("precision", isinstance(payload.get("precision", {}), dict)),
              ("lr_scheduler", isinstance(payload.get("lr_scheduler") or {}, dict)))
    for field, ok in checks:
        if not ok:
            raise DataError(f"checkpoint file {path}: {field!r} is not what pipekernel wrote "
                            f"({type(payload.get(field)).__name__})", hint=fix)
    for field in ("global_steps", "skipped_steps", "data_position"):
        value = payload.get(field, 0)
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise DataError(f"checkpoint file {path}: {field!r} is {value!r}, not a count",
                            hint=fix)


# -- the tags under a root: listing and pruning ------------------------------------------------

#: The tags ``save`` writes by default (``global_step{N}``); pruning touches only these.
_STEP_TAG = re.compile(r"global_step(\d+)")


def checkpoint_tags(root: str) -> list[str]:
    """The complete checkpoints under ``root`` (directories holding a ``meta.json``):
    ``global_step{N}`` tags by step, then any other tag by name; ``[]`` if ``root``
    does not exist."""
    try:
        names = os.listdir(root)
    except (FileNotFoundError, NotADirectoryError):
        return []
    tags = [n for n in names if not n.startswith(".")
            and os.path.isfile(os.path.join(root, n, "meta.json"))]

    def order(tag: str) -> tuple:
        match = _STEP_TAG.fullmatch(tag)
        return (0, int(match.group(1)), "") if match else (1, 0, tag)

    return sorted(tags, key=order)


def prune(root: str, keep_last: int, current: str) -> list[str]:
    """Delete the ``global_step{N}`` checkpoints under ``root`` older than ``current``
    (a lower ``N``) but the ``keep_last - 1`` newest of them; return the deleted tags.

    Never deletes ``current``, the tag ``latest`` names, a tag of another form (a
    hand-named ``best``) or a checkpoint of a later step than ``current`` (left by a run
    that was resumed from an older tag: it goes once this run's steps pass it). Not
    collective: one process calls it, after ``save`` returned on every rank (so no rank
    still writes). Each directory is first renamed to a hidden name, then removed, so
    a crash part-way never leaves a half-deleted directory that looks like a checkpoint.
    ``keep_last <= 0`` keeps everything.

    :raises OSError: a checkpoint could not be renamed or removed (those before it are
        deleted).
    """
    match = _STEP_TAG.fullmatch(current)
    if keep_last <= 0 or match is None:
        return []
    step = int(match.group(1))
    try:
        protected = {current, latest_tag(root)}
    except DataError:
        protected = {current}
    older = [t for t in checkpoint_tags(root) if (m := _STEP_TAG.fullmatch(t))
             and int(m.group(1)) < step and t not in protected]
    doomed = older[:max(len(older) - (keep_last - 1), 0)]
    for tag in doomed:
        trash = os.path.join(root, f".old-{tag}-{uuid.uuid4().hex[:8]}")
        os.rename(os.path.join(root, tag), trash)
        shutil.rmtree(trash)
    return doomed
