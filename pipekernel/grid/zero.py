"""ZeRO stage 1: the optimizer state sharded over the data-parallel replicas.

After the data-parallel all-reduce every replica holds the same full gradients
(ZeRO-1 keeps that reduction). :class:`ZeroOptimizer` then lets each replica step
only its ``1/D`` shard of the masters (the fp32 master weights under ``bf16`` /
``fp16``, the parameters themselves under ``fp32``) and all-gathers the result, so
the optimizer state (AdamW's two moments: 8 bytes per parameter) exists once per
data-parallel group instead of once per replica.

How: the masters of one dtype are moved into one flat buffer (each master's
``.data`` becomes a view of it), padded to a multiple of ``D``; replica ``r`` owns
elements ``[r*N/D, (r+1)*N/D)``. The user's optimizer factory is called over this
rank's **pieces** — one 1-D view of the flat buffer per master that overlaps the
shard — so the optimizer is the user's own class with the user's hyperparameters,
stepping in place into the masters. At each step the pieces' gradients are views
of the masters' (already unscaled and clipped) gradients; after the step the
shards are all-gathered into the flat buffer, and the precision policy casts the
masters into the low-precision parameters as usual.

What a caller may rely on:

* the wrapper is a ``torch.optim.Optimizer`` whose ``param_groups`` hold the full
  masters (so loss-scale unscaling, clipping and LR schedulers work unchanged; the
  hyperparameters are copied into the inner optimizer before every step);
* ``state_dict()`` is **collective** over the data-parallel group and returns the
  *full* state in torch's layout (per master, shaped like it), independent of
  ``D``; ``load_state_dict()`` takes that layout and keeps this rank's shard — so
  a checkpoint saved at ``D`` loads at any ``D'`` (and without ZeRO);
* exact for element-wise optimizers (SGD, Adam, AdamW, ...): splitting a tensor
  into pieces changes nothing. Optimizers that look at whole tensors (LAMB's trust
  ratio, Adafactor's factored moments, Muon) would see pieces: not supported.
  The factory must build one parameter group (it sees 1-D pieces, so grouping by
  shape or name is not possible).

Why ZeRO-1 stays beside FSDP2 (issue 28, item 4): ``data_parallel_shard=N`` (FSDP2)
shards parameters and gradients too and is the path when a stage's parameters and
gradients do not fit; ZeRO-1 serves the case where they fit and only the optimizer state
is too big, at a fraction of FSDP2's step time. Measured by
``benchmarks/parallel_memory.py`` (``benchmarks/RESULTS.md``, "Per-rank state and step
time": 8 x Linear(256, 256), fp32 AdamW, gloo, the idle 2-core CPU machine): ZeRO-1's
step is 0.91-1.44x plain DP at D = 2 and 1.18x at D = 4, FSDP2's 3.99-5.96x and 4.42x
even gathering once per batch; per rank ZeRO-1 holds 0.750 / 0.625 of the parameters +
gradients + state at D = 2 / 4, FSDP2 0.500 / 0.250. FSDP2 has no mode that shards only
the optimizer state. Not measured: GPUs and NCCL, where the balance may differ.

Why not ``torch.distributed.optim.ZeroRedundancyOptimizer``: it assigns *whole
parameters* to ranks (a model dominated by one embedding saves nothing at D=2),
wants an optimizer class rather than pipekernel's factory, talks to
``torch.distributed`` process groups directly instead of the engine's transport,
and its checkpoints need ``consolidate_state_dict`` onto one rank (the full state in
one rank's memory) in a layout keyed by its own parameter order.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from pipekernel.comm.collectives import all_gather
from pipekernel.errors import ConfigError

__all__ = ["ZeroOptimizer", "optimizer_state_bytes"]


class _Flat:
    """The masters of one dtype/device in one padded flat buffer, and this rank's shard."""

    def __init__(self, masters: list[torch.Tensor], world: int, rank: int) -> None:
        self.masters = masters
        self.sizes = [m.numel() for m in masters]
        self.offsets, total = [], 0
        for n in self.sizes:
            self.offsets.append(total)
            total += n
        self.shard = -(-total // world) if total else 0
        first = masters[0]
        self.buffer = torch.zeros(self.shard * world, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            for m, o, n in zip(masters, self.offsets, self.sizes):
                self.buffer[o:o + n].copy_(m.detach().reshape(-1))
                m.data = self.buffer[o:o + n].view(m.shape)
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        #: ``(master index, start, end)`` in the master's flattened elements, per piece
        self.spans: list[tuple[int, int, int]] = []
        for i, (o, n) in enumerate(zip(self.offsets, self.sizes)):
            a, b = max(o, self.lo), min(o + n, self.hi)
            if a < b:
                self.spans.append((i, a - o, b - o))
        self.pieces = [self.buffer[self.offsets[i] + a:self.offsets[i] + b]
                       for i, a, b in self.spans]

    def full(self, parts: torch.Tensor) -> list[torch.Tensor]:
        """Per master, its slice of a gathered flat tensor, shaped like the master."""
        flat = parts.reshape(-1)
        return [flat[o:o + n].view(m.shape) for m, o, n in zip(self.masters, self.offsets,
                                                                self.sizes)]


class ZeroOptimizer(torch.optim.Optimizer):
    """ZeRO-1 around an optimizer factory (see the module docstring).

    :param params: the masters, in the order the engine steps them.
    :param factory: ``factory(pieces) -> torch.optim.Optimizer`` (the engine's ``optimizer=``).
    :param transport: the engine's transport.
    :param group: the data-parallel group (transport group object).
    :param rank: this replica's index in the group; :param world: the group's size ``D``.
    """

    def __init__(self, params: Sequence[torch.Tensor], factory: Callable[[list], Any],
                 transport: Any, group: Any, rank: int, world: int) -> None:
        params = list(params)
        self.transport, self.group, self.dp_rank, self.dp_size = transport, group, rank, world
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for p in params:
            by_kind.setdefault((p.dtype, p.device), []).append(p)
        self._flats = [_Flat(ms, world, rank) for ms in by_kind.values()]
        pieces = [piece for flat in self._flats for piece in flat.pieces]
        # a shard holding no element still builds (and steps) the user's optimizer
        self._pieces = pieces or [torch.zeros(0, dtype=torch.float32,
                                              device=params[0].device if params else "cpu")]
        self.inner = factory(self._pieces)
        if not isinstance(self.inner, torch.optim.Optimizer):
            raise ConfigError(f"the optimizer factory returned {type(self.inner).__name__}, "
                              "not a torch.optim.Optimizer",
                              hint="optimizer=lambda params: torch.optim.AdamW(params, lr=1e-3)")
        if len(self.inner.param_groups) != 1:
            raise ConfigError(
                f"with zero_stage=1 the optimizer factory must build one parameter group, "
                f"it built {len(self.inner.param_groups)}",
                hint="ZeRO-1 calls the factory over flat 1-D shards of the masters, where "
                     "per-parameter groups cannot be told apart; use one group, or zero_stage=0")
        hyper = {k: v for k, v in self.inner.param_groups[0].items() if k != "params"}
        super().__init__(params, hyper)

    # -- stepping -----------------------------------------------------------------------
    def _sync_hyperparameters(self) -> None:
        inner = self.inner.param_groups[0]
        for key, value in self.param_groups[0].items():
            if key != "params":
                inner[key] = value

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:  # type: ignore[override]
        """Step this replica's shard, then all-gather every shard into the masters."""
        if closure is not None:
            raise ConfigError("ZeroOptimizer.step does not take a closure",
                              hint="the engine steps it; closures (LBFGS) are not supported")
        self._sync_hyperparameters()
        for flat in self._flats:
            for piece, (i, a, b) in zip(flat.pieces, flat.spans):
                grad = flat.masters[i].grad
                piece.grad = None if grad is None else grad.reshape(-1)[a:b]
        if not any(flat.pieces for flat in self._flats):
            self._pieces[0].grad = torch.zeros_like(self._pieces[0])
        self.inner.step()
        for piece in self._pieces:
            piece.grad = None
        for flat in self._flats:
            if flat.shard:
                mine = flat.buffer[flat.lo:flat.hi].clone()
                parts = all_gather(self.transport, mine, self.group, self.dp_rank, self.dp_size)
                flat.buffer.copy_(parts.reshape(-1))
        return None

    def state_bytes(self) -> int:
        """Bytes of optimizer state this rank holds (its shard)."""
        return optimizer_state_bytes(self.inner)

    # -- checkpoints: the full, D-independent layout ------------------------------------
    def state_dict(self) -> dict[str, Any]:  # type: ignore[override]
        """The full state in torch's layout (index = position in ``param_groups``).
        Collective over the data-parallel group: every replica calls it."""
        inner_state = self.inner.state
        keys, scalars = self._state_keys(inner_state)
        full: dict[int, dict[str, Any]] = {}
        index = {id(p): i for i, p in enumerate(self.param_groups[0]["params"])}
        for flat in self._flats:
            gathered = {}
            for key in keys:
                buf = torch.zeros(flat.shard, dtype=flat.buffer.dtype, device=flat.buffer.device)
                for piece, (i, a, b) in zip(flat.pieces, flat.spans):
                    value = inner_state.get(piece, {}).get(key)
                    if value is not None:
                        start = flat.offsets[i] + a - flat.lo
                        buf[start:start + b - a].copy_(value.reshape(-1))
                gathered[key] = flat.full(all_gather(self.transport, buf, self.group,
                                                     self.dp_rank, self.dp_size))
            values = self._gather_scalars(flat, scalars, inner_state)
            for j, master in enumerate(flat.masters):
                if not values[j]:
                    continue  # no replica holds state for it (never stepped)
                entry = dict(values[j])
                for key in keys:
                    entry[key] = gathered[key][j].to(self._dtype_of(key, inner_state)).clone()
                full[index[id(master)]] = entry
        groups = [{**{k: v for k, v in g.items() if k != "params"},
                   "params": [index[id(p)] for p in g["params"]]} for g in self.param_groups]
        return {"state": full, "param_groups": groups}

    @staticmethod
    def _state_keys(state: dict) -> tuple[list[str], list[str]]:
        """Element-wise (tensor of the piece's size) and scalar state keys."""
        for piece, entry in state.items():
            if entry:
                elementwise = sorted(k for k, v in entry.items() if isinstance(v, torch.Tensor)
                                     and v.dim() > 0 and v.numel() == piece.numel())
                return elementwise, sorted(k for k in entry if k not in elementwise)
        return [], []

    @staticmethod
    def _dtype_of(key: str, state: dict) -> torch.dtype:
        for entry in state.values():
            if key in entry:
                return entry[key].dtype
        return torch.float32

    def _gather_scalars(self, flat: _Flat, scalars: list[str], state: dict) -> list[dict]:
        """Per master, its scalar state (e.g. ``step``), from the replica holding its
        first element; ``{}`` where no replica stepped it. One all-reduce per flat."""
        table = torch.zeros(len(flat.masters), len(scalars) + 1, dtype=torch.float64,
                            device=flat.buffer.device)
        examples: dict[str, Any] = {}
        for piece, (i, a, _) in zip(flat.pieces, flat.spans):
            entry = state.get(piece, {})
            if a == 0 and entry:
                table[i, 0] = 1
                for k, key in enumerate(scalars):
                    table[i, k + 1] = _number(entry[key])
            for key in scalars:
                if key in entry:
                    examples[key] = entry[key]
        if self.dp_size > 1:
            self.transport.all_reduce(table, "sum", self.group)
        rows = table.cpu().tolist()
        out = []
        for row in rows:
            if not row[0]:
                out.append({})
                continue
            out.append({key: _like(examples.get(key), row[k + 1])
                        for k, key in enumerate(scalars)})
        return out

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:  # type: ignore[override]
        """Load the full layout of :meth:`state_dict` (any ``D``) and keep this shard."""
        params = self.param_groups[0]["params"]
        saved_groups = state_dict.get("param_groups") or [{}]
        for key, value in saved_groups[0].items():
            if key != "params":
                self.param_groups[0][key] = value
        self._sync_hyperparameters()
        self.inner.state.clear()
        saved = state_dict.get("state", {})
        position = {id(p): i for i, p in enumerate(params)}
        for flat in self._flats:
            for piece, (i, a, b) in zip(flat.pieces, flat.spans):
                entry = saved.get(position[id(flat.masters[i])])
                if not entry:
                    continue
                mine = {}
                for key, value in entry.items():
                    if isinstance(value, torch.Tensor) and value.dim() > 0 \
                            and value.numel() == flat.sizes[i]:
                        mine[key] = value.reshape(-1)[a:b].to(piece.device).clone()
                    elif isinstance(value, torch.Tensor):
                        mine[key] = value.clone()
                    else:
                        mine[key] = value
                self.inner.state[piece] = mine


def _number(value: Any) -> float:
    """A scalar state entry as a float (``None`` and other non-numbers: 0)."""
    if isinstance(value, (torch.Tensor, int, float)) and not isinstance(value, bool):
        return float(value)
    return 0.0


def _like(example: Any, value: float) -> Any:
    """``value`` in the type of a local ``example`` entry (a non-number stays as it is)."""
    if not isinstance(example, (torch.Tensor, int, float)) or isinstance(example, bool):
        return example
    if isinstance(example, torch.Tensor):
        return torch.tensor(value, dtype=example.dtype, device=example.device)
    if isinstance(example, int):
        return int(value)
    return value


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the tensors in ``optimizer.state`` (the inner optimizer's for ZeRO)."""
    inner = getattr(optimizer, "inner", optimizer)
    return sum(v.numel() * v.element_size() for entry in inner.state.values()
               for v in entry.values() if isinstance(v, torch.Tensor))
