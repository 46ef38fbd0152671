"""The run-time sentinel (``PipelineEngine(check_every=K)``): every ``K`` train steps, after
the optimizer step, prove that the pipeline is still one model.

Three invariants, checked together with **one** all-reduce (``max``) of one int64 vector
over the world, built on the device without a host read per tensor:

* **replicas**: the data-parallel replicas of a stage (same tensor-parallel rank and FSDP2
  shard) hold bit-identical parameters and optimizer state (optimizer state is not
  compared under ZeRO-1, where it is sharded by design); under expert parallelism each
  slice of experts is compared over the replicas holding that slice (``replicas
  (experts)``: the expert-data-parallel group), since slices differ by design;
* **tied**: the copies of a tied layer on different stages are bit-identical;
* **normalisation**: every rank used the same micro-batch count, the same gradient
  scale (``loss_reduction="tokens"``) and the same loss divisor in its backward for the step;
* **transfers**: during the checked step's batch, every activation and gradient a stage
  received equals what its sender sent: both ends hash each transfer (the object as the
  model sees it: structure, dict keys, every tensor's bytes; before the wire splits it and
  after it joins it) into one sum per pipeline link and direction (:class:`TransferSums`).

Each value is an exact hash of a tensor's bytes (:func:`tensor_hash`) — not a float sum,
so one flipped bit shows. Each slot carries ``(h, -h)``; after the ``max`` reduction a slot
holds ``(max, -min)``, and ``max != min`` is a violation. Every rank reads the same reduced
vector, so every rank raises the same :class:`~pipekernel.errors.ConsistencyError` (no rank
is left waiting); a second small all-reduce, only then, finds which rank holds which value.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

import zlib

from pipekernel.comm.wire import flatten
from pipekernel.errors import ConfigError, ConsistencyError, PipelineError
from pipekernel.grid.expert_parallel import is_expert
from pipekernel.schedules import instructions as isa

__all__ = ["DEFAULT_CHECK_EVERY", "check_every_option", "Sentinel", "TransferSums",
           "tensor_hash", "object_hash"]

#: default ``check_every``: measured at well under 2% of step time (docs/faults.md)
DEFAULT_CHECK_EVERY = 100

_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_MASK = (1 << 62) - 1  # hashes stay in [0, 2**62): -h never overflows, and -2**62 is "none"
_NONE = -(1 << 62)
_CHUNK = 1 << 24  # elements hashed at once: bounds the int64 workspace (128 MiB)
_NAME_BYTES = 200
#: the normalisation slots: the batch's count, the token scale, the divisor the backward used
_NORM_NAMES = ("micro-batch count", "gradient scale", "loss divisor of the backward")
_NORM = len(_NORM_NAMES)


def check_every_option(value: Any, name: str = "check_every") -> int | None:
    """``check_every`` (or ``verify_every``) checked: a positive int, or ``None`` (off)."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        what = (f"check the invariants every K train steps (default {DEFAULT_CHECK_EVERY})"
                if name == "check_every" else
                "replay every K-th train batch before training it (engine.verify_batch)")
        raise ConfigError(f"{name} must be a positive int or None, got {value!r}",
                          hint=f"pass {name}=K to {what}, or {name}=None to turn it off")
    return value


_WEIGHTS: dict[Any, torch.Tensor] = {}  # device -> 1, 3, 5, ... (grown as needed)


def _weights(n: int, device: Any) -> torch.Tensor:
    """The first ``n`` odd numbers on ``device``, cached (a check re-reads, not rebuilds)."""
    cached = _WEIGHTS.get(device)
    if cached is None or cached.numel() < n:
        cached = torch.arange(max(n, 1024), dtype=torch.int64, device=device) * 2 + 1
        _WEIGHTS[device] = cached
    return cached[:n]


def tensor_hash(tensor: torch.Tensor) -> torch.Tensor:
    """An exact hash of ``tensor``'s bytes: a 0-dim int64 on its device, in ``[0, 2**62)``.

    The elements, viewed as integers of their own width, are summed with odd position
    weights modulo ``2**64`` (integer addition: the same on every device and in any
    reduction order). Changing any one element changes the hash; so does swapping two."""
    local = tensor.to_local() if hasattr(tensor, "to_local") else tensor
    flat = local.detach().contiguous().reshape(-1)
    if flat.dtype == torch.bool:
        flat = flat.view(torch.uint8)
    ints = flat.view(_INT_VIEW[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for start in range(0, ints.numel(), _CHUNK):
        part = ints[start:start + _CHUNK].to(torch.int64)
        weights = _weights(part.numel(), flat.device)
        if start:
            weights = weights + 2 * start
        total = total + (part * weights).sum()
    # fold the top two bits in: a flipped sign or top exponent bit still shows
    return total.bitwise_and(_MASK).bitwise_xor(total.bitwise_right_shift(62).bitwise_and(3))


def object_hash(obj: Any) -> torch.Tensor:
    """An exact hash of a nested object (what crosses a stage boundary): its structure
    (containers, dict keys, scalars) and every tensor's bytes, in order."""
    tensors, structure = flatten(obj)
    total: Any = zlib.crc32(repr(structure).encode())
    for i, t in enumerate(tensors):
        total = tensor_hash(t) * (2 * i + 3) + total
    if not isinstance(total, torch.Tensor):
        return torch.tensor(total & _MASK, dtype=torch.int64)
    return total.bitwise_and(_MASK)


#: (edge offset from the position, direction) of each transfer instruction: a link is the
#: edge between positions ``e`` and ``e + 1``; direction 0 carries activations, 1 gradients
_LINK = {isa.SendActivation: (0, 0), isa.RecvActivation: (-1, 0),
         isa.SendGrad: (-1, 1), isa.RecvGrad: (0, 1)}


class TransferSums:
    """One batch's transfer hashes on one rank, by link slot: the stage runtime calls
    :meth:`add` for each activation or gradient it sends to or receives from another stage
    (``runtime.transfer_sums``, set only for a checked step's batch)."""

    def __init__(self, pipeline: int, positions: int, device: Any) -> None:
        self.base = pipeline * positions * 2
        self.device = device
        self.sums: dict[int, torch.Tensor] = {}
        #: slot -> micro-batch -> its transfer's hash (read only after a failed check)
        self.parts: dict[int, dict[int, torch.Tensor]] = {}

    def add(self, instruction: Any, position: int, obj: Any) -> None:
        link = _LINK.get(type(instruction))
        if link is None:  # skip connections' transfers: not hashed
            return
        offset, direction = link
        slot = self.base + (position + offset) * 2 + direction
        h = object_hash(obj).to(self.device)
        self.parts.setdefault(slot, {})[instruction.micro_batch] = h
        h = h * (2 * instruction.micro_batch + 1)
        self.sums[slot] = (self.sums[slot] + h if slot in self.sums else h).bitwise_and(_MASK)


@dataclass
class _Slot:
    """One compared value: which check, where it sits in the vector, what it names."""

    check: str
    entry: str  # the parameter (global layer index key) or quantity
    stage: int | None
    more: str = ""


class Sentinel:
    """The checks of one engine; :meth:`check` runs them (collective: every rank)."""

    def __init__(self, engine: Any, every: int) -> None:
        self.engine, self.every = engine, every
        topo = engine.topology
        self.cells = topo.model_size * topo.shard_size  # slots per stage or tied key
        self.cell = topo.model_rank * topo.shard_size + topo.shard_rank
        tied = engine.pipeline_module.tied_stages(engine.bounds, engine.part_stages.__getitem__)
        self.tied_keys = sorted(k for k, stages in tied.items() if len(stages) > 1)
        self.tied_stages = tied
        self.width: int | None = None  # parameters per stage slot (the most of any stage)
        self.tied_width: int | None = None
        self.last_clean: int | None = None
        self.positions = engine.num_stages * engine.chunks
        self.pipelines = topo.data_size * topo.model_size  # each reads its own micro-batches
        self.pipeline = topo.data_rank * topo.model_size + topo.model_rank
        ep = engine.ep_group
        #: expert parallelism: each slice of experts is compared over the replicas holding it
        self.ep = ep if ep is not None and ep.size > 1 else None
        self.slices = self.ep.size if self.ep is not None else 1
        self.expert_width = 0
        self._sums: TransferSums | None = None  # the last checked batch's, after its check

    def due(self, step: int) -> bool:
        return step % self.every == 0

    def transfer_sums(self) -> TransferSums:
        """A fresh :class:`TransferSums` for a checked step's batch (the runtime's)."""
        return TransferSums(self.pipeline, self.positions, self.engine.transport.device)

    # -- what this rank contributes ---------------------------------------------------
    def _params(self) -> list[tuple[str, torch.Tensor]]:
        return [(n, p) for n, p in self.engine.module.named_parameters()
                if self.ep is None or not is_expert(p)]

    def _experts(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's slice of the experts (under expert parallelism; else none)."""
        if self.ep is None:
            return []
        return [(n, p) for n, p in self.engine.module.named_parameters() if is_expert(p)]

    def _opt_hash(self, p: torch.Tensor, device: Any) -> torch.Tensor:
        engine = self.engine
        if engine.optimizer is None or engine.parallel.zero_stage:
            return torch.zeros((), dtype=torch.int64, device=device)
        state = engine.optimizer.state.get(engine.precision.master(p), {})
        hashes = [tensor_hash(v) * (2 * i + 3) for i, (_, v) in enumerate(sorted(state.items()))
                  if isinstance(v, torch.Tensor)]
        return (torch.stack(hashes).sum().bitwise_and(_MASK) if hashes
                else torch.zeros((), dtype=torch.int64, device=device))

    def _agree_widths(self, device: Any) -> None:
        """Once: the most parameters of any stage and of any tied layer (one all-reduce)."""
        engine = self.engine
        counts = torch.zeros(2 + len(self.tied_keys), dtype=torch.int64, device=device)
        counts[0], counts[1] = len(self._params()), len(self._experts())
        for i, key in enumerate(self.tied_keys):
            if key in engine.tied_groups:
                counts[2 + i] = len(list(engine.module.tied_modules[key].parameters()))
        engine.transport.all_reduce(counts, "max")
        values = counts.tolist()
        self.width, self.expert_width = values[0], values[1]
        self.tied_width = max(values[2:], default=0)

    def _widths(self) -> tuple[int, int]:
        """``(width, tied_width)``: the parameters per stage slot and per tied slot, which
        the first check measures (``_measure``) before any slot is laid out."""
        if self.width is None or self.tied_width is None:
            raise PipelineError("the sentinel laid out its slots before measuring them",
                                hint="a bug in pipekernel/engine/sentinel.py: please report it")
        return self.width, self.tied_width

    def _bases(self) -> tuple[int, int, int]:
        """Where the tied section, the normalisation section and the end are (after the
        normalisation: the transfers, then the expert slices)."""
        width, tied_width = self._widths()
        tied = self.engine.num_stages * self.cells * width * 2
        norm = tied + len(self.tied_keys) * self.cells * tied_width
        experts = self._experts_base(norm)
        return tied, norm, experts + self._expert_cell() * self.slices * self.engine.num_stages

    def _experts_base(self, norm: int) -> int:
        return norm + _NORM + self.pipelines * self.positions * 2

    def _expert_cell(self) -> int:
        """Slots of one stage's one slice of experts (parameter and optimizer state each)."""
        return self.cells * self.expert_width * 2

    def _describe(self, index: int) -> _Slot:
        """What slot ``index`` of the vector compares (the same on every rank)."""
        tied, norm, _ = self._bases()
        width, tied_width = self._widths()
        if index < tied:
            stage = index // (self.cells * width * 2)
            check = "replicas (optimizer state)" if index % 2 else "replicas"
            return _Slot(check, f"parameter #{(index % (width * 2)) // 2}", stage)
        if index < norm:
            key = self.tied_keys[(index - tied) // (self.cells * tied_width)]
            return _Slot("tied", f"tied layer {key!r} parameter #"
                                 f"{(index - tied) % tied_width}", None,
                         f" (its copies on stages {self.tied_stages[key]})")
        if index < norm + _NORM:
            return _Slot("normalisation", _NORM_NAMES[index - norm], None)
        experts = self._experts_base(norm)
        if index < experts:
            return self._describe_transfer(index - norm - _NORM)
        rel = index - experts
        check = "replicas (experts, optimizer state)" if rel % 2 else "replicas (experts)"
        return _Slot(check, f"expert parameter #{(rel % (self.expert_width * 2)) // 2}",
                     rel // (self._expert_cell() * self.slices))

    def _describe_transfer(self, link: int) -> _Slot:
        pipeline, rest = divmod(link, self.positions * 2)
        edge, direction = divmod(rest, 2)
        stages = self.engine.part_stages
        src, dst = (edge, edge + 1) if direction == 0 else (edge + 1, edge)
        what = ("activations", "gradients")[direction]
        return _Slot("transfers", f"the hash of the {what} stage {stages[src]} sent to stage "
                                  f"{stages[dst]} (pipeline positions {src} -> {dst}, "
                                  f"pipeline {pipeline}) at its two ends", stages[dst])

    def _mine(self, device: Any) -> tuple[torch.Tensor, list[int]]:
        """This rank's hashes and the slot index of each."""
        engine, values, where = self.engine, [], []
        tied_base, norm, _ = self._bases()
        base = (engine.stage * self.cells + self.cell) * self.width * 2
        for j, (_, p) in enumerate(self._params()):
            values += [tensor_hash(p), self._opt_hash(p, device)]
            where += [base + 2 * j, base + 2 * j + 1]
        for i, key in enumerate(self.tied_keys):
            if key in engine.tied_groups:
                start = tied_base + (i * self.cells + self.cell) * self.tied_width
                for j, p in enumerate(engine.module.tied_modules[key].parameters()):
                    values.append(tensor_hash(p))
                    where.append(start + j)
        step = engine.batch_step
        scale = torch.tensor(float(getattr(step, "last_grad_scale", 1.0)), dtype=torch.float64)
        values += [torch.tensor(step.micro_batches, dtype=torch.int64, device=device),
                   tensor_hash(scale.to(device)),
                   torch.tensor(engine.runtime.micro_batches, dtype=torch.int64, device=device)]
        where += [norm, norm + 1, norm + 2]
        start = self._experts_base(norm) + (engine.stage * self.slices + self.ep.rank
                                            if self.ep is not None else 0) * self._expert_cell()
        for j, (_, p) in enumerate(self._experts()):
            values += [tensor_hash(p), self._opt_hash(p, device)]
            where += [start + self.cell * self.expert_width * 2 + 2 * j,
                      start + self.cell * self.expert_width * 2 + 2 * j + 1]
        sums = getattr(engine.runtime, "transfer_sums", None)
        self._sums = sums
        if sums is not None:  # the checked batch's transfers (armed by the engine)
            engine.runtime.transfer_sums = None
            for slot, value in sorted(sums.sums.items()):
                values.append(value)
                where.append(norm + _NORM + slot)
        return torch.stack(values), where

    # -- the check ----------------------------------------------------------------------
    def check(self) -> None:
        """Run the checks (every rank, after the step); raise :class:`ConsistencyError`
        on every rank when one fails."""
        engine = self.engine
        device = engine.transport.device
        with torch.no_grad():
            if self.width is None:
                self._agree_widths(device)
            mine, where = self._mine(device)
            index = torch.tensor(where, dtype=torch.int64, device=device)
            vec = torch.full((2, self._bases()[2]), _NONE, dtype=torch.int64, device=device)
            vec[0, index] = mine
            vec[1, index] = -mine
            engine.transport.all_reduce(vec, "max")  # the one collective of a clean check
            # slots no rank holds stay (_NONE, _NONE)
            bad = ((vec[0] != -vec[1]) & (vec[0] != _NONE)).nonzero().flatten().tolist()
        step = engine.global_steps
        if not bad:
            self.last_clean = step
            return
        # a normalisation mismatch is the cause of the others it brings: named first
        slot = min(bad, key=lambda i: (i < self._bases()[1], i))
        ranks, name = self._who(slot, where, mine, device)
        described = self._describe(slot)
        if described.check == "transfers":
            described.more = self._micro_batches(slot - self._bases()[1] - _NORM, device)
        self._raise(described, ranks, name, step, len(bad))

    def _micro_batches(self, slot: int, device: Any) -> str:
        """After a failed transfers check (every rank, one more all-reduce): which
        micro-batches' transfers on link ``slot`` differ at the two ends."""
        # Seq1F1B numbers its units (micro-batch x sequence chunk) as micro-batches
        count = self.engine.micro_batches * getattr(self.engine.schedule_cls, "seq_chunks", 1)
        vec = torch.full((2, count), _NONE, dtype=torch.int64, device=device)
        parts = self._sums.parts.get(slot, {}) if self._sums is not None else {}
        for micro_batch, h in parts.items():
            vec[0, micro_batch], vec[1, micro_batch] = h, -h
        self.engine.transport.all_reduce(vec, "max")
        differ = ((vec[0] != -vec[1]) & (vec[0] != _NONE)).nonzero().flatten().tolist()
        return f" (micro-batch(es) {differ})" if differ else ""

    def _who(self, slot: int, where: list[int], mine: torch.Tensor, device: Any
             ) -> tuple[dict[int, int], str]:
        """After a failed check (every rank): each holder's value of ``slot`` and the
        parameter's name, from one more all-reduce."""
        engine = self.engine
        world = engine.transport.world_size
        vec = torch.full((world + _NAME_BYTES,), _NONE, dtype=torch.int64, device=device)
        if slot in where:
            vec[engine.rank] = mine[where.index(slot)]
            name = self._name_of(slot).encode()[:_NAME_BYTES]
            vec[world:world + len(name)] = torch.tensor(list(name), dtype=torch.int64,
                                                        device=device)
        engine.transport.all_reduce(vec, "max")
        values = vec.tolist()
        held = {r: v for r, v in enumerate(values[:world]) if v != _NONE}
        return held, bytes(b for b in values[world:] if b > 0).decode(errors="replace")

    def _name_of(self, slot: int) -> str:
        """This rank's name for one of its own slots."""
        engine = self.engine
        tied_base, norm, _ = self._bases()
        width, tied_width = self._widths()
        if slot < tied_base:
            return self._params()[(slot % (width * 2)) // 2][0]
        experts = self._experts_base(norm)
        if slot >= experts:
            return self._experts()[((slot - experts) % (self.expert_width * 2)) // 2][0]
        if slot >= norm:
            return ""
        key = self.tied_keys[(slot - tied_base) // (self.cells * tied_width)]
        j = (slot - tied_base) % tied_width
        names = [n for n, _ in engine.module.tied_modules[key].named_parameters()]
        return f"tied layer {key!r}: {names[j]}"

    def _raise(self, slot: _Slot, held: dict[int, int], name: str, step: int,
               count: int) -> None:
        groups: dict[int, list[int]] = {}
        for rank, value in held.items():
            groups.setdefault(value, []).append(rank)
        # the odd one out: the value fewest ranks hold (with two, both are named)
        ordered = sorted(groups.values(), key=lambda ranks: (len(ranks), ranks))
        odd = ordered[0] if ordered else []
        said = "; ".join(f"rank(s) {ranks} hold {value:#x}" for value, ranks in groups.items())
        since = (f"the last clean check was after train step {self.last_clean}"
                 if self.last_clean is not None else "this was the first check")
        what = name or slot.entry
        raise ConsistencyError(
            f"consistency check {slot.check!r} failed: {what}{slot.more} differs: {said} "
            f"({count} value(s) differ in all; {since}; checks run every {self.every} "
            f"step(s))",
            hint=_HINTS[slot.check.split(" ")[0]], check=slot.check, parameter=what,
            ranks=odd, rank=odd[0] if odd else None, stage=slot.stage, train_step=step)


_HINTS = {
    "replicas": "data-parallel replicas diverged: a replica skipped a step or reduced "
                "different gradients (a custom hook, an optimizer stepped outside the "
                "engine, a non-deterministic update); restart from the last checkpoint "
                "and look for code that touches one replica's parameters",
    "tied": "a tied layer's copies diverged: its gradients were not summed over the "
            "stages holding it (ReduceTiedGrads) or one copy was changed outside the "
            "engine; restart from the last checkpoint",
    "transfers": "a stage received an activation or gradient that is not what its sender "
                 "sent (a flipped bit on the link or in memory, a buffer reused before its "
                 "transfer completed, a key such as position_ids dropped by a transport or "
                 "wire plugin); restart from the last checkpoint, and run the transport's "
                 "conformance checks (pipekernel.testing.check_transport) on these ranks",
    "normalisation": "the stages normalised the loss differently (micro-batch count or "
                     "token scale): every rank must run the same micro_batches and "
                     "loss_reduction; restart from the last checkpoint",
}
