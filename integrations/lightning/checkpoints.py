"""Checkpoints of ``PipelineStrategy``: a file Lightning reads, and pipekernel's directory.

``ModelCheckpoint`` / ``trainer.save_checkpoint(path)`` write two things:

* ``path`` (e.g. ``epoch=0-step=2.ckpt``): a **regular Lightning checkpoint file**,
  written by rank 0 after every rank saved, whose ``state_dict`` holds the **whole
  model** under the names the module has in one process -- the module's own names for
  layers built in ``__init__``, ``pipeline.<layer>.<name>`` for ``LayerSpec`` layers
  (see :func:`pipekernel.lightning.attach_whole_model`) -- plus the Trainer's state.
  ``LightningModule.load_from_checkpoint(path)`` loads it in one process, no process
  group. (``PipelineStrategy(whole_model_file=False)`` skips the whole model for models
  one process cannot hold; the file then keeps the Trainer's state only.)
* :func:`pipeline_dir` of it, ``path + ".pipeline"``: pipekernel's checkpoint (every rank
  its layers, weights and optimizer state by parameter name, RNG, the Trainer's state in
  the rank files; ``docs/checkpoints.md``), which ``Trainer.fit(ckpt_path=path)`` resumes
  from (bit-exact at the same shape) and ``pk.load_sequential`` reads.
"""
from __future__ import annotations

import io
import os
import shutil
from typing import Any

import torch

from pipekernel.engine.checkpoint_data import load_file
from pipekernel.engine.checkpoint_files import _read_layer, read_meta
from pipekernel.errors import ConfigError, DataError, PipelineError, UntrustedCheckpointError

__all__ = ["pipeline_dir", "CHECKPOINT_TAG", "CheckpointMixin"]

#: The tag of the pipekernel checkpoint inside :func:`pipeline_dir`.
CHECKPOINT_TAG = "checkpoint"
SUFFIX = ".pipeline"


def pipeline_dir(path: Any) -> str:
    """The pipekernel checkpoint directory that goes with the Lightning checkpoint file
    ``path`` (a symlink such as ``last.ckpt`` is followed)."""
    return os.path.realpath(os.fspath(path)) + SUFFIX


class CheckpointMixin:
    """The checkpoint half of :class:`~pipekernel.lightning.PipelineStrategy`."""

    @property
    def restore_checkpoint_after_setup(self) -> bool:
        return True  # the engine (and its stage) must exist to load into

    @property
    def lightning_restore_optimizer(self) -> bool:
        return False  # in pipekernel's checkpoint, by parameter name

    def _own_key(self, key: str) -> bool:
        return key.startswith(self.stage_attribute + ".")

    def lightning_module_state_dict(self) -> dict[str, Any]:
        """What the LightningModule holds besides the stage (the stage's weights are in
        pipekernel's layer files)."""
        state = self.lightning_module.state_dict()
        return {k: v for k, v in state.items() if not self._own_key(k)}

    def optimizer_state(self, optimizer: Any) -> dict[str, Any]:
        return {}  # in pipekernel's layer files

    def save_checkpoint(self, checkpoint: dict[str, Any], filepath: Any,
                        storage_options: Any = None) -> None:
        """Every rank writes its layers to :func:`pipeline_dir`; then rank 0 writes the
        Lightning file ``filepath`` (see the module docstring)."""
        if storage_options is not None:
            raise TypeError("Trainer.save_checkpoint(..., storage_options=...) is not "
                            "supported by PipelineStrategy: pipekernel writes the files")
        filepath = self.broadcast(os.fspath(filepath))  # one path for every rank
        engine = self._need_engine("save_checkpoint")
        state = {k: v for k, v in checkpoint.items() if k != "optimizer_states"}
        buffer = io.BytesIO()
        torch.save(state, buffer)
        directory = pipeline_dir(filepath)
        engine.save_checkpoint(directory, tag=CHECKPOINT_TAG,
                               client_state={"lightning": buffer.getvalue()})
        if self.global_rank == 0:
            whole = dict(state)
            whole["state_dict"] = {**state.get("state_dict", {}),
                                   **(self._whole_model_state(directory)
                                      if self.whole_model_file else {})}
            whole["pipekernel"] = {"directory": os.path.basename(directory),
                                   "whole_model": bool(self.whole_model_file)}
            partial = filepath + ".partial"
            torch.save(whole, partial)
            os.replace(partial, filepath)  # atomic: a reader never sees half a file
        self.barrier("pipekernel checkpoint file")

    def _whole_model_state(self, directory: str) -> dict[str, torch.Tensor]:
        """Every layer's weights from the layer files of ``directory`` (fp32 masters),
        named as in one process; a tied layer under each index where it occurs, as a
        module's ``state_dict`` lists it. Read from the files, not through a model: no
        layer is built, and this rank's live layers are not touched."""
        layer_dir, meta = read_meta(directory, CHECKPOINT_TAG)
        states: dict[int, dict[str, torch.Tensor]] = {}
        out = {}
        for entry in meta["layers"]:
            index, canonical = entry["index"], entry.get("canonical", entry["index"])
            if canonical not in states:
                has_file = meta["layers"][canonical].get("file")
                states[canonical] = (_read_layer(layer_dir, meta, canonical)["state"]
                                     if has_file else {})
            prefix = self._layer_names.get(index, f"{self.stage_attribute}.{index}")
            out.update({f"{prefix}.{name}": value for name, value in states[canonical].items()})
        return out

    def remove_checkpoint(self, filepath: Any) -> None:
        """``ModelCheckpoint(save_top_k=...)`` dropping an old checkpoint: both parts."""
        if self.is_global_zero:
            path = os.fspath(filepath)
            directory = pipeline_dir(path)
            if os.path.isdir(directory) and not os.path.islink(path):
                shutil.rmtree(directory)
            if os.path.lexists(path):
                os.remove(path)

    def load_checkpoint(self, checkpoint_path: Any, weights_only: bool | None = None
                        ) -> dict[str, Any]:
        """Load the pipekernel checkpoint of ``checkpoint_path`` (at any stage or replica
        count; bit-exact at the same shape) and return the Trainer's state saved with it.

        ``weights_only`` is Lightning's (``Trainer.fit(..., weights_only=...)``): ``None``
        (the default) and ``True`` load every file as data only — as Lightning's own
        strategies do for a local file, torch's ``weights_only`` default — and only
        ``False`` unpickles fully; a file that needs it otherwise raises
        ``UntrustedCheckpointError`` naming the global and that switch."""
        try:
            return self._load_pipeline_checkpoint(checkpoint_path, weights_only is False)
        except UntrustedCheckpointError as err:
            err.hint = ("if the checkpoint comes from a source you trust, resume with "
                        "trainer.fit(..., ckpt_path=..., weights_only=False); otherwise do not "
                        "load it (nothing was loaded)")
            raise

    def _load_pipeline_checkpoint(self, checkpoint_path: Any, trust: bool) -> dict[str, Any]:
        path = self.broadcast(os.fspath(checkpoint_path))
        engine = self._need_engine("load_checkpoint")
        directory = pipeline_dir(path)
        if not os.path.isdir(directory):
            raise ConfigError(f"{path} has no pipekernel checkpoint next to it ({directory})",
                              hint="resume from a checkpoint saved with "
                                   "Trainer(strategy=PipelineStrategy(...)); a plain Lightning "
                                   "checkpoint loads with LightningModule.load_from_checkpoint")
        result = engine.load_checkpoint(directory, trust_checkpoint=trust)
        blob = (result.get("client_state") or {}).get("lightning")
        if blob is None:
            raise ConfigError(f"{directory} holds a pipekernel checkpoint without the Trainer's "
                              "state", hint="resume it with PipelineEngine.load_checkpoint; "
                              "Trainer(ckpt_path=...) needs one saved through the Trainer")
        where = f"{directory} (the Trainer's state in rank files' client_state)"
        try:
            return load_file(io.BytesIO(blob), where, trust=trust)
        except PipelineError:
            raise
        except Exception as err:  # noqa: BLE001 - torch raises many types for bad bytes
            raise DataError(f"checkpoint {where} is truncated or corrupt: {err}",
                            hint="resume from another checkpoint") from err

    def load_model_state_dict(self, checkpoint: Any, strict: bool = True) -> None:
        """The stage's weights came with :meth:`load_checkpoint`; this loads the rest."""
        module = self.lightning_module
        missing, unexpected = module.load_state_dict(checkpoint.get("state_dict", {}),
                                                     strict=False)
        missing = [k for k in missing if not self._own_key(k)]
        if strict and (missing or unexpected):
            raise ConfigError(f"{type(module).__name__} does not match the checkpoint: "
                              f"missing {missing}, unexpected {unexpected}",
                              hint="load it into the module it was saved from, or set "
                                   "self.strict_loading = False")
