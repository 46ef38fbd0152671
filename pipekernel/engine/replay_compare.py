"""The replay check's verdict (:mod:`pipekernel.engine.replay`): the gradients of the
schedule and of the replay compared, the module named, every rank told."""
from __future__ import annotations

import json
from typing import Any

import torch

from pipekernel.errors import ConsistencyError

__all__ = ["take_grads", "put_grads", "compare", "agree"]

#: relative tolerance of a gradient, by dtype (summation order differs from the schedule's)
_TOLERANCE = {torch.float64: 1e-9, torch.float32: 1e-4, torch.bfloat16: 3e-2,
              torch.float16: 1e-2}
_NAME_BYTES = 1000
#: how much a module's output summary may move (relative to its absolute sum) and be equal
_OUTPUT_TOLERANCE = 1e-3


def _named(engine: Any) -> list[tuple[str, torch.Tensor]]:
    seen, out = set(), []
    for name, p in engine.module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def take_grads(engine: Any) -> dict[str, torch.Tensor | None]:
    """Each trained parameter's accumulated gradient (on its precision master), by name;
    the parameters and masters are left without one."""
    grads = {}
    for name, p in _named(engine):
        master = engine.precision.master(p)
        grads[name] = master.grad
        master.grad = p.grad = None
    return grads


def put_grads(engine: Any, grads: dict[str, torch.Tensor | None]) -> None:
    """Give the parameters (their precision masters) back what :func:`take_grads` took."""
    for name, p in _named(engine):
        engine.precision.master(p).grad = grads.get(name)


def _differs(a: torch.Tensor | None, b: torch.Tensor | None) -> torch.Tensor | bool:
    """Whether two gradients differ beyond summation order (a 0-dim bool on the device)."""
    if a is None and b is None:
        return False
    if a is None or b is None:
        return bool((a if a is not None else b).abs().max() > 0)  # type: ignore[union-attr]
    if a.shape != b.shape:
        return True
    tol = _TOLERANCE.get(a.dtype, 1e-4)
    scale = torch.maximum(a.abs().max(), b.abs().max())
    return (a - b).abs().max() > tol * scale + torch.finfo(a.dtype).tiny


def compare(engine: Any, recorder: Any, scheduled: dict, replayed: dict
            ) -> dict[str, Any] | None:
    """``None`` when the schedule's gradients are the replay's, else what differs."""
    names = list(scheduled)
    flags = [_differs(scheduled[n], replayed.get(n)) for n in names]
    values = [bool(f) if isinstance(f, bool) else f for f in flags]
    device_flags = [f for f in values if isinstance(f, torch.Tensor)]
    read = iter(torch.stack(device_flags).tolist()) if device_flags else iter(())
    bad = [n for n, f in zip(names, values) if (next(read) if isinstance(f, torch.Tensor)
                                                 else f)]
    if not bad:
        return None
    found = _output_culprit(engine, recorder)
    if found is None:
        found = _gradient_culprit(bad, scheduled, replayed)
    found.update(stage=engine.stage, rank=engine.rank,
                 detail=f"{found['detail']}; {len(bad)} of {len(names)} parameter "
                        f"gradient(s) differ (first: {bad[0]!r})")
    return found


def _same_output(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if a.shape != b.shape:
        return False
    scale = b[1::3].repeat_interleave(3).abs() + 1e-30
    return bool(((a - b).abs() <= _OUTPUT_TOLERANCE * scale).all())


def _output_culprit(engine: Any, recorder: Any) -> dict[str, Any] | None:
    """The first module, in forward order, whose output changed for the same inputs: in
    the replay, or in a checkpoint's recompute."""
    runtime = engine.runtime
    for key in sorted(recorder.seen, key=lambda k: (runtime.positions[k[0]], k[1])):
        calls = recorder.seen[key].calls
        forward = calls.get("forward", [])
        for i, ((name, ours), (again, theirs)) in enumerate(zip(forward, calls.get("replay", []))):
            if name != again or not _same_output(ours, theirs):
                return _named_module(engine, name, key, "ran again on the same inputs, "
                                     "parameters, buffers and RNG state, it computed "
                                     "another output", "replay")
        occurrence: dict[str, int] = {}
        for name, theirs in calls.get("backward", []):
            k = occurrence[name] = occurrence.get(name, -1) + 1
            firsts = [s for n, s in forward if n == name]
            if k < len(firsts) and not _same_output(firsts[k], theirs):
                return _named_module(engine, name, key, "recomputed in the backward "
                                     "(activation checkpointing), it computed another "
                                     "output than in its forward", "recompute")
    return None


def _named_module(engine: Any, name: str, key: tuple[int, int], what: str,
                  how: str) -> dict[str, Any]:
    module = dict(engine.module.named_modules()).get(name)
    kind = type(module).__name__ if module is not None else "?"
    return {"module": name, "how": how,
            "detail": f"module {name!r} ({kind}), chunk {key[0]}, micro-batch {key[1]}: "
                      f"{what}",
            "hint": f"module {name!r} is not a function of its inputs, parameters, buffers "
                    "and the engine's RNG (a call counter outside its buffers, its own "
                    "random generator or Python's, a global, a cache): recomputation, a "
                    "split backward and reordering change what it computes. Keep such state "
                    "in a registered buffer and draw randomness from torch's default "
                    "generator, or leave the layer out of activation checkpointing"}


def _gradient_culprit(bad: list[str], scheduled: dict, replayed: dict) -> dict[str, Any]:
    """The last layer (forward order: the backward reaches it first) whose gradient differs."""
    last = max(bad, key=lambda n: (_index(n), bad.index(n)))
    module = last.rsplit(".", 1)[0]
    ours, theirs = scheduled.get(last), replayed.get(last)
    ratio = ""
    if ours is not None and theirs is not None and float(theirs.norm()) > 0:
        ratio = f" (norm {float(ours.norm()):.6g} in the schedule, {float(theirs.norm()):.6g} " \
                f"in the replay)"
    return {"module": module, "how": "gradient",
            "detail": f"module {module!r}: the gradient of {last!r} the schedule accumulated "
                      f"is not a plain backward's{ratio}",
            "hint": "the backward that reached this layer differs from one process's: a "
                    "micro-batch's gradient dropped or scaled, the loss normalised "
                    "differently, output gradients changed in transit, or a layer whose "
                    "backward depends on the order it runs in; rerun with check_every=1 "
                    "and compare with one process (pipekernel.testing.reference_train)"}


def _index(name: str) -> int:
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def agree(engine: Any, found: dict[str, Any] | None) -> None:
    """Every rank learns whether a stage failed (one all-reduce; a second carries the
    first failing rank's verdict) and raises the same error."""
    transport = engine.transport
    device, world = transport.device, transport.world_size
    flags = torch.zeros(world, dtype=torch.int64, device=device)
    flags[engine.rank] = int(found is not None)
    transport.all_reduce(flags, "max")
    failed = [r for r, f in enumerate(flags.tolist()) if f]
    if not failed:
        return
    text = torch.zeros(_NAME_BYTES, dtype=torch.int64, device=device)
    if engine.rank == failed[0]:
        data = message_bytes(found)  # type: ignore[arg-type]
        text[:len(data)] = torch.tensor(data, dtype=torch.int64, device=device)
    transport.all_reduce(text, "max")
    decoded = bytes(b for b in text.tolist() if b > 0).decode(errors="replace")
    verdict = json.loads(decoded)
    if len(failed) > 1:
        verdict["detail"] += f" (rank(s) {failed[1:]} failed too)"
    raise_found(engine, verdict)


def message_bytes(found: dict[str, Any]) -> list[int]:
    """``found`` as bytes for the all-reduce that tells every rank (cut to fit)."""
    data = json.dumps(found).encode()
    if len(data) > _NAME_BYTES:
        found = {**found, "detail": found.get("detail", "")[:200]}
        data = json.dumps(found).encode()[:_NAME_BYTES]
    return list(data)


def raise_found(engine: Any, found: dict[str, Any]) -> None:
    """The :class:`ConsistencyError` of a failed replay, on every rank alike."""
    raise ConsistencyError(
        f"verify_batch: stage {found['stage']} (rank {found['rank']}): {found['detail']} "
        f"(the batch after train step {engine.global_steps}; the schedule "
        f"{engine.schedule!r} and a plain replay of the same micro-batches disagree)",
        hint=found["hint"], check="replay", parameter=found["module"],
        ranks=[found["rank"]], rank=found["rank"], stage=found["stage"],
        train_step=engine.global_steps + 1)
