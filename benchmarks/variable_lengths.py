"""Variable lengths at speed (issue 44, item 4): what a batch of micro-batches of
different lengths costs in messages and host synchronisations, against the same batch
with one length, counted (not timed) per rank and step through a real 2-rank gloo run.

Counted per train step:

* ``posted``: transport operations posted in groups by the plan (data messages, and
  the receives sized ahead of them);
* ``extra``: operations outside the plan's groups (the wire's metadata and any message
  a metadata change adds: single ``isend``/``irecv`` calls);
* ``waits``: ``Handle.wait()`` calls (each may block the host);
* ``reads``: host reads of tensors (``.tolist()``, ``.item()``, ... as
  :class:`pipekernel.testing.HostSyncs` counts them), the wire's header reads included;
* ``meta``: transfers whose metadata changed (as the senders' channels count them).

    python benchmarks/variable_lengths.py [--steps 3]
"""
from __future__ import annotations

import argparse
import collections

import torch
from torch import nn

import pipekernel as pk
from pipekernel.testing import HostSyncs, run_ranks

VOCAB, DIM, BATCH, MICRO_BATCHES = 32, 8, 2, 8
FIXED = [12] * MICRO_BATCHES
VARIABLE = [5, 12, 7, 16, 9, 3, 14, 10]  # 8 lengths, each micro-batch another


def lm(num_stages: int | None = None) -> pk.PipelineModule:
    layers = [pk.LayerSpec(nn.Embedding, VOCAB, DIM), pk.LayerSpec(nn.Linear, DIM, DIM),
              torch.tanh, pk.LayerSpec(nn.Linear, DIM, DIM), torch.tanh,
              pk.LayerSpec(nn.Linear, DIM, VOCAB)]
    return pk.PipelineModule(layers, loss_fn=loss_fn, num_stages=num_stages,
                             partition="uniform", seed=3)


class Packed(nn.Module):
    """ids -> ``{"hidden", "position_ids"}``: a packed row (documents restarting their
    positions) crossing the stage boundary as a dict of a float and an int64 tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, h: torch.Tensor) -> dict[str, torch.Tensor]:
        width = h.shape[1]
        positions = torch.arange(width) % max(1, width // 2)  # two documents per row
        return {"hidden": torch.tanh(self.lin(h)),
                "position_ids": positions.expand(h.shape[0], width).contiguous()}


class Unpack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)

    def forward(self, packed: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.tanh(self.lin(packed["hidden"])) \
            + 0.01 * packed["position_ids"].unsqueeze(-1).float()


def packed_lm(num_stages: int | None = None) -> pk.PipelineModule:
    """Stage 0 ends in :class:`Packed`: its rows of another width each micro-batch."""
    layers = [pk.LayerSpec(nn.Embedding, VOCAB, DIM), pk.LayerSpec(Packed),
              pk.LayerSpec(Unpack), pk.LayerSpec(nn.Linear, DIM, VOCAB)]
    return pk.PipelineModule(layers, loss_fn=loss_fn, num_stages=num_stages,
                             partition="uniform", seed=3)


MODELS = {"plain": lm, "packed": packed_lm}


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def batch(step: int, lengths: list[int]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(step)
    return [(torch.randint(0, VOCAB, (BATCH, n), generator=g),
             torch.randint(0, VOCAB, (BATCH, n), generator=g)) for n in lengths]


class Counts:
    """Wraps a transport's posting calls and its handles' waits, and counts them."""

    def __init__(self, transport) -> None:
        self.n: collections.Counter = collections.Counter()
        counts = self.n

        def wrap_handle(handle):
            wait = handle.wait

            def counted_wait():
                counts["waits"] += 1
                return wait()
            return _Counted(handle, counted_wait)

        inside = []  # a group posts its ops one by one through isend/irecv (gloo)

        def batch(ops, _batch=transport.batch_isend_irecv):
            counts["posted"] += len(ops)
            inside.append(True)
            try:
                return [wrap_handle(h) for h in _batch(ops)]
            finally:
                inside.pop()

        def single(kind):
            post = getattr(transport, kind)

            def counted(*args, **kwargs):
                if inside:
                    return post(*args, **kwargs)
                counts["extra"] += 1
                return wrap_handle(post(*args, **kwargs))
            return counted

        transport.batch_isend_irecv = batch
        transport.isend, transport.irecv = single("isend"), single("irecv")


class _Counted:
    __slots__ = ("_handle", "wait")

    def __init__(self, handle, wait) -> None:
        self._handle, self.wait = handle, wait

    def is_completed(self) -> bool:
        return self._handle.is_completed()


def count_worker(lengths: list[int], steps: int, model: str = "plain"
                 ) -> tuple[list[dict[str, int]], list[float], dict[str, torch.Tensor]]:
    """``(per step this rank's counts, losses, final weights)`` of ``MODELS[model]``;
    through :func:`run_ranks`, 2 ranks. Step ``s`` trains on :func:`batch` ``(s, lengths)``."""
    torch.set_num_threads(1)
    engine = pk.PipelineEngine(MODELS[model](2), optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
                               micro_batches=len(lengths), timeout=60, check_data_steps=0)
    counts = Counts(engine.transport)
    channels = engine.runtime.transfers._channels
    out, losses = [], []
    for step in range(steps):
        counts.n.clear()
        changed = sum(c.changes for c in channels.values())
        with HostSyncs() as syncs:
            loss = engine.train_batch(iter(batch(step, lengths)))
        losses.append(float(loss))  # outside the count: the caller's read
        row = dict(counts.n)
        row["reads"] = syncs.count
        row["meta"] = sum(c.changes for c in channels.values()) - changed
        out.append({k: row.get(k, 0) for k in ("posted", "extra", "waits", "reads", "meta")})
    state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
    engine.close()
    return out, losses, state


def measure(steps: int = 3) -> dict[str, list[tuple]]:
    """``{"fixed": per rank what count_worker returns, "variable": ..., "packed fixed":
    ..., "packed variable": ...}``."""
    return {f"{'packed ' if model == 'packed' else ''}{name}":
            run_ranks(count_worker, 2, lengths, steps, model, timeout=240)
            for model in MODELS for name, lengths in (("fixed", FIXED), ("variable", VARIABLE))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    results = measure(args.steps)
    print(f"fixed lengths {FIXED}, variable {VARIABLE}; 2 stages, 1f1b, gloo; packed: "
          f"a dict of hidden states and position ids crosses the boundary")
    print("| case | rank | step | posted | extra | waits | reads | meta changes |")
    print("|---|---|---|---|---|---|---|---|")
    for name, per_rank in results.items():
        for rank, (rows, _, _) in enumerate(per_rank):
            for step, row in enumerate(rows):
                print(f"| {name} | {rank} | {step} | {row['posted']} | {row['extra']} | "
                      f"{row['waits']} | {row['reads']} | {row['meta']} |")


if __name__ == "__main__":
    main()
