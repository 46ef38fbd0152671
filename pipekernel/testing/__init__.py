"""Helpers for testing pipekernel and code built on it.

* :func:`run_ranks` — the one way tests start processes: gloo, free port,
  per-rank results, a failing rank re-raised with its rank and traceback,
  everything killed after a timeout.
* :func:`reference_train` — the parity oracle: the same layers on one process
  with gradient accumulation.
* :class:`HostSyncs` — counts the calls that synchronise the host with a GPU,
  also where the tensors live on the CPU (so the count is tested without one).
* :func:`check_transport` — the transport conformance suite on ranks it starts;
  :func:`run_transport_conformance` — the same suite on ranks you started
  (:mod:`pipekernel.testing.conformance`).
"""
from __future__ import annotations

import types
from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipekernel.testing.conformance import run_transport_conformance
from pipekernel.comm.transport import Transport
from pipekernel.launcher.launch import launch
from pipekernel.errors import ConfigError
from pipekernel.nested import tensors_to
from pipekernel.model.aux_loss import aux_losses
from pipekernel.extend.manager import make_plugin_manager, make_transport
from pipekernel.model.module import PipelineModule

__all__ = ["run_ranks", "check_transport", "run_transport_conformance", "reference_train", "reference_eval", "assert_parity", "TensorBytes",
           "HostSyncs"]


def run_ranks(fn: Callable[..., Any], nprocs: int, *args: Any, timeout: float = 300.0,
              env: dict[str, str] | None = None) -> list[Any]:
    """Run ``fn(*args)`` on ``nprocs`` gloo processes (one thread each); results by rank.

    ``timeout`` only guards against a hang the engine's own timeouts missed: it is generous
    because a starved machine takes minutes to start processes that import torch."""
    return launch(fn, nprocs, args, timeout=timeout, threads=1, env=env)


def _forward_loss(stage: torch.nn.Module, loss_fn: Callable, item: Sequence[Any],
                  device: torch.device | str | None = None) -> torch.Tensor:
    """``loss_fn(stage(inputs), labels)`` plus the aux losses the layers added
    (``pk.add_aux_loss``), as the engine's objective."""
    inputs, labels = item
    if device is not None:
        inputs, labels = tensors_to(inputs, device), tensors_to(labels, device)  # dicts too
    with aux_losses() as aux:
        loss = loss_fn(stage(inputs), labels)
    if aux:
        if isinstance(loss, (tuple, list)):
            raise ValueError("reference_train: aux losses with loss_reduction='tokens'")
        loss = loss + torch.stack([a.float() for a in aux]).sum().to(loss.dtype)
    return loss


def reference_train(module: PipelineModule, optimizer: Callable[[list], torch.optim.Optimizer],
                    batches: Sequence[Sequence[Sequence[Any]]], micro_batches: int | Sequence[int],
                    hook: Callable[[torch.nn.Module], None] | None = None,
                    device: torch.device | str | None = None, loss_reduction: str = "mean"
                    ) -> tuple[list[float], dict[str, torch.Tensor]]:
    """Train all layers on one process: ``batches[step][replica]`` is a list of
    ``micro_batches`` items ``(inputs, labels)``; each step accumulates
    ``loss / (micro_batches * replicas)`` over every replica's micro-batches (``loss``
    including the aux losses the layers add with ``pk.add_aux_loss``).

    :param micro_batches: micro-batches per step, or one count per step (a ramp).
    :param hook: called with the model after backward, before the step (e.g. clipping).
    :param loss_reduction: ``"tokens"``: ``loss_fn`` returns ``(loss_sum, token_count)``
        and each step backwards ``loss_sum / (tokens of the whole step)`` per micro-batch
        (every forward of the step first); the step's loss is that token mean.
    :param device: train there (model and batches moved; ``None``: where the model is
        built, the CPU); the returned ``state_dict`` stays on that device.
    :returns: per-step mean losses and the final ``state_dict``.
    """
    loss_fn = _loss_fn_of(module, "reference_train")
    model = module.build_stage(0, [0, len(module.layers)])
    if device is not None:
        model = model.to(device)
    opt = optimizer(list(model.parameters()))
    losses = []
    counts = [micro_batches] * len(batches) if isinstance(micro_batches, int) else micro_batches
    for replicas, count in zip(batches, counts):
        if loss_reduction == "tokens":
            losses.append(_token_step(model, loss_fn, replicas, count, device))
            if hook is not None:
                hook(model)
            opt.step()
            opt.zero_grad(set_to_none=True)
            continue
        total = 0.0
        scale = 1.0 / (count * len(replicas))
        for items in replicas:
            for item in list(items)[:count]:
                loss = _forward_loss(model, loss_fn, item, device)
                (loss * scale).backward()
                total += loss.item() * scale
        if hook is not None:
            hook(model)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(total)
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def _token_step(model: torch.nn.Module, loss_fn: Callable, replicas: Sequence[Sequence[Any]],
                count: int, device: torch.device | str | None) -> float:
    """One reference step of ``loss_reduction="tokens"``: forwards, then backwards."""
    results = [_forward_loss(model, loss_fn, item, device)
               for items in replicas for item in list(items)[:count]]
    tokens = sum(float(n) for _, n in results)
    for loss_sum, _ in results:
        (loss_sum / tokens).backward()
    return sum(loss_sum.item() for loss_sum, _ in results) / tokens


def _loss_fn_of(module: PipelineModule, what: str) -> Callable[..., Any]:
    """``module.loss_fn``, or a ``ConfigError`` saying the oracle needs one."""
    if module.loss_fn is None:
        raise ConfigError(f"{what} computes losses: the PipelineModule has no loss_fn",
                          hint="pass PipelineModule(..., loss_fn=fn), the same the engine uses")
    return module.loss_fn


def _naming(key: str) -> Callable[[str], str]:
    """``assert_close``'s ``msg``: its message prefixed with the parameter's name."""
    return lambda message: f"parameter {key}: {message}"


def reference_eval(module: PipelineModule, state: dict[str, torch.Tensor],
                   items: Sequence[Sequence[Any]]) -> tuple[float, list[Any]]:
    """Mean loss and outputs of the full model (weights ``state``) over ``items``."""
    loss_fn = _loss_fn_of(module, "reference_eval")
    model = module.build_stage(0, [0, len(module.layers)])
    model.load_state_dict(state)
    model.eval()
    with torch.no_grad():
        outputs = [model(inputs) for inputs, _ in items]
        losses = [loss_fn(out, labels).item() for out, (_, labels) in zip(outputs, items)]
    return sum(losses) / len(losses), outputs


def assert_parity(losses: Sequence[float], reference_losses: Sequence[float],
                  params: dict[str, torch.Tensor], reference_params: dict[str, torch.Tensor],
                  rtol: float = 1e-5, atol: float = 1e-6) -> None:
    """Losses equal step by step and every parameter a stage holds equals the reference."""
    if len(losses) != len(reference_losses):
        raise AssertionError(f"{len(losses)} losses vs {len(reference_losses)} in the reference")
    for step, (a, b) in enumerate(zip(losses, reference_losses)):
        if abs(a - b) > atol + rtol * abs(b):
            raise AssertionError(f"step {step}: loss {a!r} != reference {b!r}")
    if not params:
        raise AssertionError("no parameters to compare")
    for key, value in params.items():
        if key not in reference_params:
            raise AssertionError(f"parameter {key} is not in the reference model")
        torch.testing.assert_close(value, reference_params[key], rtol=rtol, atol=atol,
                                   msg=_naming(key))


class TensorBytes:
    """Count the bytes of tensors that operators create while active: live now and peak.

    A ``TorchDispatchMode``: every operator output's storage is counted once while
    any tensor using it is alive, including tensors autograd saves for backward and
    activations that checkpointing recomputes. Tensors made before entering (inputs,
    parameters) and their views are not counted. Works on any device; slow, for tests and benchmarks.

    >>> with TensorBytes() as counter:
    ...     loss = model(x).sum(); loss.backward()
    >>> counter.peak
    """

    def __init__(self) -> None:
        import weakref

        from torch.utils._python_dispatch import TorchDispatchMode
        from torch.utils._pytree import tree_leaves

        counter = self
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}

        def release(key: int) -> None:
            entry = counter._refs[key]
            entry[1] -= 1
            if entry[1] == 0:
                del counter._refs[key]
                counter.live -= entry[0]

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                # a view of a tensor made before entering (a parameter's .t()) is not new memory
                inputs = {x.untyped_storage().data_ptr() for x in tree_leaves((args, kwargs))
                          if isinstance(x, torch.Tensor) and x.device.type != "meta"}
                for t in (out if isinstance(out, (tuple, list)) else (out,)):
                    if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                        continue
                    storage = t.untyped_storage()
                    key = storage.data_ptr()
                    if key == 0 or (key in inputs and key not in counter._refs):
                        continue
                    entry = counter._refs.setdefault(key, [storage.nbytes(), 0])
                    if entry[1] == 0:
                        counter.live += entry[0]
                        counter.peak = max(counter.peak, counter.live)
                    entry[1] += 1
                    weakref.finalize(t, release, key)
                return out

        self._mode = _Mode()

    def __enter__(self) -> TensorBytes:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def _conformance_worker(transport: str | Callable[..., Transport], options: dict[str, Any],
            timeout_check: float | None) -> list[str]:
    if isinstance(transport, str):
        instance = make_transport(make_plugin_manager(), transport, dict(options))
    else:
        instance = transport(**options)
    try:
        return run_transport_conformance(instance, timeout_check=timeout_check)
    finally:
        instance.close()


def check_transport(transport: str | Callable[..., Transport], nprocs: int = 3, *,
                    options: dict[str, Any] | None = None, timeout_check: float | None = 1.0,
                    timeout: float = 180.0) -> list[str]:
    """Run the suite on ``nprocs`` local processes; raise if any rank fails.

    :param transport: an installed transport name (``pipekernel.transports``
        entry point) or a picklable factory called with ``**options``.
    :param nprocs: processes (1 runs :data:`SOLO_CHECKS` only; 3 or more also checks
        proper subgroups).
    :param options: transport options (default ``{"timeout": 60}``).
    :param timeout_check: see :func:`run_transport_conformance`.
    :param timeout: seconds before every process is killed.
    :returns: the names of the checks that passed (rank 0's list).
    """
    opts = {"timeout": 60.0, **(options or {})}
    results = launch(_conformance_worker, nprocs, (transport, opts, timeout_check), timeout=timeout)
    return results[0]


#: Tensor methods that make the host wait for the device when the tensor is on a GPU.
_READS = frozenset({"__bool__", "__float__", "__int__", "__index__", "__complex__", "item",
                    "tolist", "numpy", "cpu"})


class HostSyncs:
    """Counts host synchronisations inside a ``with`` block, wherever the tensors live.

    On a GPU each of these blocks the host until the device caught up: reading a tensor
    (``bool(t)``, ``float(t)``, ``int(t)``, ``t.item()``, ``t.tolist()``, ``t.numpy()``,
    ``t.cpu()``), making a tensor from host data on a device (``torch.tensor(data,
    device=...)``: a pageable copy, which torch synchronises), and indexing with a host
    list (``t[[1, 2]] = 0``: the index is copied to the device). Counted from the calls
    themselves (a ``TorchFunctionMode``), so a CPU run counts what a GPU run would pay.
    ``records`` holds ``(what, "file:line")`` of each, the line being the first frame in
    ``pipekernel`` (else the caller).

    Not counted (no Python-visible call): a host sync inside a C++ library (a NCCL or
    gloo wait) and ``.to("cpu")``/``copy_`` between devices (on a CPU-only run every
    tensor is on the CPU, so they cannot be told from no-ops).
    """

    def __init__(self) -> None:
        from torch.overrides import TorchFunctionMode

        counter = self
        self.records: list[tuple[str, str]] = []

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                name = getattr(func, "__name__", "")
                if name in _READS or (name in ("tensor", "as_tensor") and args
                                      and not isinstance(args[0], torch.Tensor)
                                      and kwargs.get("device") is not None) or (
                        name in ("__setitem__", "__getitem__") and len(args) > 1
                        and isinstance(args[1], list)):
                    counter.records.append((name, _where()))
                return func(*args, **kwargs)

        self._mode = _Mode()

    @property
    def count(self) -> int:
        """How many synchronising calls were seen."""
        return len(self.records)

    def __enter__(self) -> HostSyncs:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


def _where() -> str:
    """``file:line`` of the first caller frame outside torch and this module."""
    import os
    import sys

    skip = (os.path.dirname(torch.__file__), __file__)
    frame: types.FrameType | None = sys._getframe(2)
    while frame is not None and frame.f_code.co_filename.startswith(skip):
        frame = frame.f_back
    if frame is None:
        return "?"
    name = frame.f_code.co_filename
    return f"{'/'.join(name.split(os.sep)[-2:])}:{frame.f_lineno}"
