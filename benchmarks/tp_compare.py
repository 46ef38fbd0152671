"""pipekernel's own tensor-parallel layers vs torch's DTensor plan on one small GPT (issue 28,
item 4: which TP to keep).

    python benchmarks/tp_compare.py [--rounds 6] [--stages 2] [--width 256] [--blocks 8]
                                    [--seq 128] [--micro-batches 4] [--steps 3]
                                    [--variants pk,pk-whole,dtensor,dtensor-whole,dtensor-sp]
                                    [--optimizer sgd|adamw]
    python benchmarks/tp_compare.py --quick     # d=64, 2 blocks, 1 round: a smoke run

Model: Embedding(512, d) -> ``blocks`` x pre-norm GPT block (LayerNorm, causal attention
with separate q, k, v, o projections (no biases) and max(4, d/64) heads, LayerNorm, MLP
d -> 4d -> d with GELU) -> LayerNorm -> Linear(d, 512); cross-entropy on the next token;
``micro-batches`` of 4 sequences per step; SGD(lr=0.1) (``--optimizer adamw``: AdamW(lr=1e-3),
see parity below); fp32; gloo, one thread per process.
``stages`` (1 or 2) x 2 tensor-parallel ranks; with 2 stages, explicit boundaries
(embedding + the first half of the blocks | the rest + norm + head), 1F1B.

Variants (each in processes of its own, launched fresh for every round; the order rotates):

* ``pk``            — the blocks' projections are pipekernel's ``ColumnParallelLinear`` (q, k,
  v, up) / ``RowParallelLinear`` (o, down), ``tensor_parallel_size=2``; activations cross
  stages partitioned (``partition_activations=True``, the default);
* ``pk-whole``      — the same, ``partition_activations=False``;
* ``dtensor``       — the same block built from plain ``nn.Linear``, with the plan
  ``{"*.attn.q|k|v": ColwiseParallel(), "*.attn.o": RowwiseParallel(), "*.mlp.up":
  ColwiseParallel(), "*.mlp.down": RowwiseParallel()}`` (``tensor_parallel_plan=``; the
  wire partitioned by pipekernel as for ``pk``);
* ``dtensor-whole`` — the same, ``partition_activations=False``;
* ``dtensor-sp``    — torch's sequence parallelism, the DTensor counterpart of partitioned
  activations: the embedding Rowwise with a sequence-sharded output, the norms
  ``SequenceParallel``, attention and MLP inputs gathered by ``PrepareModuleInput``, o and
  down Rowwise back to a sequence shard, the head Colwise from the shard; the residual stream,
  what each norm saves and what crosses stages are ``1/T`` of the sequence on each rank
  (``partition_activations=False``: the tensors on the wire are already shards).

Every variant trains ``2 + steps`` batches (the first, which exchanges the wire metadata, is
a warm-up; the second is measured for bytes, untimed; then ``steps`` timed ones) from the
same weights (``PipelineModule(seed=...)``) on the same tokens. Reported:

* parity: the largest |loss - one process| over the steps and ranks, and the largest
  |parameter - one process| over every element (each rank's shards against the slices of the
  one-process weights; DTensors gathered with ``full_tensor``) — fp32 round-off expected,
  printed beside the round-off floor: one process against itself with each step's
  micro-batches accumulated in reverse order. SGD by default because AdamW's first steps
  move each element by about ``lr`` whatever the size of its gradient, so round-off in
  near-zero gradient entries becomes parameter differences up to ``lr``-sized (seen at
  d=256: 6e-5 on the head's weight after 3 AdamW steps, every variant alike, while under
  SGD every parameter agrees to ~1e-7);
* step time: per round, the slowest rank's mean over the timed steps; the median over
  rounds, and each variant's ratio to ``pk`` in the same round (median, min-max);
* bytes per rank (the largest rank): parameters (a DTensor counts its local shard), the
  peak bytes autograd holds saved for backward during the second (untimed) step
  (activations: ``saved_tensors_hooks``, parameters and their views excluded, DTensors
  counted by their local shard), and the bytes sent point to point in that step (data and
  control lanes, counted at the transport; tensor-parallel collectives are not point to
  point and not counted).

**Partitioned activations and torch.** pipekernel's ``partition_activations`` acts on the
pipeline wire only: each tensor-parallel rank sends ``1/T`` of a replicated boundary
activation and the receiver all-gathers it whole, so it applies to the DTensor path as well
(``dtensor`` vs ``dtensor-whole``) and changes no saved activation (``pk`` vs ``pk-whole``).
It is not DeepSpeed's partitioning of checkpointed activations. torch's counterpart of
activations sharded over the tensor-parallel ranks is sequence parallelism
(``dtensor-sp``): the residual stream, what the norms save and what crosses stages are
sequence shards, while attention and the MLP still save whole-sequence inputs. The last
lines of the report put these as ratios.

The load average is printed before and after. Run it with nothing else on the machine; no
figures are recorded here.
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

import pipekernel as pk
import pipekernel.grid.tensor_parallel as tp
from pipekernel.testing import reference_train

sys.path.insert(0, str(Path(__file__).resolve().parent))
import vs_torch  # noqa: E402  (its counter of saved bytes)

VOCAB = 512
MICRO = 4          # sequences per micro-batch
SEED = 1234
TP = 2
VARIANTS = ("pk", "pk-whole", "dtensor", "dtensor-whole", "dtensor-sp")


# -- the model: one block class, its projections pipekernel's or plain -----------------------
def _linears(kind: str):
    """(column, row) constructors: pipekernel's parallel pair, or ``nn.Linear`` twice."""
    if kind == "pk":
        return tp.ColumnParallelLinear, tp.RowParallelLinear
    return nn.Linear, nn.Linear


class Attention(nn.Module):
    def __init__(self, d: int, heads: int, kind: str) -> None:
        super().__init__()
        col, row = _linears(kind)
        self.head_dim = d // heads
        # no biases: a key bias has a zero gradient in exact arithmetic (softmax ignores
        # a constant per query), so Adam would turn its round-off into full-size steps
        self.q, self.k, self.v = (col(d, d, bias=False) for _ in range(3))
        self.o = row(d, d, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s = x.shape[0], x.shape[1]
        # the heads this rank holds come from the projection's (local) width
        q, k, v = (proj(x).view(b, s, -1, self.head_dim).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, d: int, kind: str) -> None:
        super().__init__()
        col, row = _linears(kind)
        self.up, self.down = col(d, 4 * d), row(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(F.gelu(self.up(x)))


class Block(nn.Module):
    """Pre-norm GPT block; parameters drawn in the same order for every ``kind``."""

    def __init__(self, d: int, kind: str) -> None:
        super().__init__()
        heads = max(4, d // 64)
        self.ln1, self.attn = nn.LayerNorm(d), Attention(d, heads, kind)
        self.ln2, self.mlp = nn.LayerNorm(d), MLP(d, kind)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.attn(self.ln1(h))
        return h + self.mlp(self.ln2(h))


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def model(kind: str, d: int, blocks: int, stages: int) -> pk.PipelineModule:
    layers = [pk.LayerSpec(nn.Embedding, VOCAB, d),
              *[pk.LayerSpec(Block, d, kind) for _ in range(blocks)],
              pk.LayerSpec(nn.LayerNorm, d), pk.LayerSpec(nn.Linear, d, VOCAB)]
    bounds = [0, len(layers)] if stages == 1 else [0, 1 + blocks // 2, len(layers)]
    return pk.PipelineModule(layers, loss_fn=loss_fn, num_stages=stages, partition=bounds,
                             seed=SEED)


def plan(variant: str, blocks: int) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput,
                                                   RowwiseParallel, SequenceParallel)
    if variant != "dtensor-sp":
        return {"*.attn.q": ColwiseParallel(), "*.attn.k": ColwiseParallel(),
                "*.attn.v": ColwiseParallel(), "*.attn.o": RowwiseParallel(),
                "*.mlp.up": ColwiseParallel(), "*.mlp.down": RowwiseParallel()}
    gather = PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),))
    return {"0": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
            "*.ln1": SequenceParallel(), "*.ln2": SequenceParallel(),
            "*.attn": gather, "*.mlp": gather,
            "*.attn.q": ColwiseParallel(), "*.attn.k": ColwiseParallel(),
            "*.attn.v": ColwiseParallel(), "*.attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "*.mlp.up": ColwiseParallel(), "*.mlp.down": RowwiseParallel(output_layouts=Shard(1)),
            str(blocks + 1): SequenceParallel(),
            str(blocks + 2): ColwiseParallel(input_layouts=Shard(1), output_layouts=Replicate())}


def micro_batches(step: int, seq: int, count: int) -> list:
    g = torch.Generator().manual_seed(10_000 + step)
    ids = torch.randint(0, VOCAB, (MICRO * count, seq + 1), generator=g)
    x, y = ids[:, :-1].contiguous(), ids[:, 1:].contiguous()
    return list(zip(x.split(MICRO), y.split(MICRO)))


def adamw(params) -> torch.optim.Optimizer:
    return torch.optim.AdamW(params, lr=1e-3)


def sgd(params) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=0.1)


OPTIMIZERS = {"adamw": adamw, "sgd": sgd}


# -- measurements inside a worker ------------------------------------------------------------
def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's shard; the tensor inside an in-flight collective's wrapper."""
    while True:
        inner = getattr(t, "_local_tensor", None)   # DTensor
        if inner is None and type(t) is not torch.Tensor and \
                isinstance(getattr(t, "elem", None), torch.Tensor):
            inner = t.elem                          # AsyncCollectiveTensor
        if inner is None:
            return t
        t = inner


class SavedBytes(vs_torch.SavedBytes):
    """vs_torch's counter of the bytes autograd saves, a DTensor counting its shard."""

    @staticmethod
    def _storage(t: torch.Tensor):
        return _local(t).untyped_storage()


def _state(engine) -> dict:
    """Each parameter as this rank holds it (a DTensor gathered whole: collective over the
    stage's tensor-parallel ranks, same order on each) and its sharded dim (pk's layers)."""
    state, dims = {}, {}
    for name, p in engine.module.named_parameters():
        value = p.full_tensor() if hasattr(p, "full_tensor") else p
        state[name] = value.detach().clone()
        dims[name] = tp.sharded_dim(p)
    return {"state": state, "dims": dims}


def worker(variant: str, a: dict) -> dict:
    torch.set_num_threads(1)
    from pipekernel.plugins.counting import CountingPlugin

    kind = "pk" if variant.startswith("pk") else "plain"
    options = {"tensor_parallel_plan": plan(variant, a["blocks"])} if kind == "plain" else {}
    engine = pk.PipelineEngine(model(kind, a["width"], a["blocks"], a["stages"]),
                               optimizer=OPTIMIZERS[a["optimizer"]],
                               micro_batches=a["micro_batches"],
                               tensor_parallel_size=TP, schedule="1f1b", transport="counting",
                               plugins=[CountingPlugin()], timeout=600,
                               partition_activations=variant in ("pk", "dtensor"), **options)
    params = list(engine.module.parameters())
    param_bytes = sum(_local(p).numel() * _local(p).element_size() for p in params)
    data = [micro_batches(s, a["seq"], a["micro_batches"]) for s in range(a["steps"] + 2)]
    losses = [engine.train_batch(iter(data[0])).item()]   # warm-up: the metadata handshake
    sent = engine.transport.sent["bytes"]
    with SavedBytes(params) as saved:                     # measured, not timed
        losses.append(engine.train_batch(iter(data[1])).item())
    sent = engine.transport.sent["bytes"] - sent
    seconds = []
    for s in range(2, a["steps"] + 2):
        start = time.perf_counter()
        losses.append(engine.train_batch(iter(data[s])).item())
        seconds.append(time.perf_counter() - start)
    out = {"losses": losses, "seconds": statistics.mean(seconds), "params": param_bytes,
           "saved": saved.peak, "sent": sent, "stage": engine.stage,
           "tp_rank": engine.topology.model_rank, **_state(engine)}
    engine.close()
    return out


# -- the parent: reference, rounds, report ---------------------------------------------------
def reference(a: dict, reverse: bool = False) -> tuple[list[float], dict]:
    """One process, gradient accumulation (``reverse``: the micro-batches of each step
    accumulated in the opposite order, the same sums rounded differently)."""
    torch.set_num_threads(1)
    batches = [[micro_batches(s, a["seq"], a["micro_batches"])[::-1 if reverse else 1]]
               for s in range(a["steps"] + 2)]
    return reference_train(model("plain", a["width"], a["blocks"], 1),
                           OPTIMIZERS[a["optimizer"]], batches, a["micro_batches"])


def floor(a: dict, ref_losses: list[float], ref_state: dict) -> tuple[float, float]:
    """The round-off floor: one process against itself with the micro-batches reversed."""
    losses, state = reference(a, reverse=True)
    return (max(abs(x - y) for x, y in zip(losses, ref_losses)),
            max((state[k] - ref_state[k]).abs().max().item() for k in ref_state))


def parity(rows: list[dict], ref_losses: list[float], ref_state: dict) -> tuple[float, float]:
    loss_diff = max(abs(x - y) for r in rows for x, y in zip(r["losses"], ref_losses))
    param_diff, covered = 0.0, set()
    for r in rows:
        g = tp.TensorParallelGroup(r["tp_rank"], TP)
        for name, value in r["state"].items():
            dim = r["dims"][name]
            expected = ref_state[name] if dim is None else tp.shard(ref_state[name], dim, g)
            param_diff = max(param_diff, (value - expected).abs().max().item())
            covered.add(name)
    if covered != set(ref_state):
        raise RuntimeError(f"parameters not compared: {sorted(set(ref_state) - covered)[:4]}")
    return loss_diff, param_diff


def run(a: dict, variants: list[str], rounds: int) -> dict:
    ref_losses, ref_state = reference(a)
    loss_floor, param_floor = floor(a, ref_losses, ref_state)
    print(f"fp32 round-off floor (one process, micro-batches reversed): loss diff "
          f"{loss_floor:.1e}, param diff {param_floor:.1e}", flush=True)
    results = {v: {"times": [], "loss": 0.0, "param": 0.0} for v in variants}
    for r in range(rounds):
        order = variants[r % len(variants):] + variants[:r % len(variants)]
        for v in order:
            rows = pk.launch(worker, a["stages"] * TP, (v, a), threads=1)
            loss_diff, param_diff = parity(rows, ref_losses, ref_state)
            res = results[v]
            res["times"].append(max(row["seconds"] for row in rows))
            res["loss"], res["param"] = max(res["loss"], loss_diff), max(res["param"], param_diff)
            for key in ("params", "saved", "sent"):
                res[key] = max(row[key] for row in rows)
            print(f"  round {r}: {v:<13} step {res['times'][-1]:.3f} s, loss diff "
                  f"{loss_diff:.1e}, param diff {param_diff:.1e}", flush=True)
    return results


def report(results: dict, rounds: int) -> None:
    base = results.get("pk")
    print(f"\n| variant | max loss diff | max param diff | step s (median of {rounds}) | "
          f"vs pk (median, min-max) | params B/rank | saved act. B/rank | sent B/rank/step |")
    print("|---|---|---|---|---|---|---|---|")
    for v, res in results.items():
        step = statistics.median(res["times"])
        if base is not None:
            ratios = [t / b for t, b in zip(res["times"], base["times"])]
            vs = f"{statistics.median(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f})"
        else:
            vs = "-"
        print(f"| {v} | {res['loss']:.2e} | {res['param']:.2e} | {step:.3f} | {vs} | "
              f"{res['params']} | {res['saved']} | {res['sent']} |")
    pairs = [("pk", "pk-whole", "partition_activations under pk's layers"),
             ("dtensor", "dtensor-whole", "partition_activations under the DTensor plan"),
             ("dtensor-sp", "pk", "sequence parallelism (DTensor) against pk partitioned")]
    print()
    for a, b, what in pairs:
        if a in results and b in results:
            print(f"{what}: " + ", ".join(
                f"{key} {a}/{b} {_ratio(results[a][key], results[b][key])}"
                for key in ("params", "saved", "sent")))


def _ratio(x: int, y: int) -> str:
    return f"{x / y:.3f}" if y else ("-" if x == 0 else "inf")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--stages", type=int, default=2, choices=(1, 2))
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3,
                        help="timed steps after the warm-up and the measured step")
    parser.add_argument("--variants", default=None,
                        help=f"comma-separated, of {','.join(VARIANTS)} (default: all; "
                             f"with --stages 1 the -whole ones are left out: nothing crosses "
                             f"stages, so they equal their partitioned twins)")
    parser.add_argument("--optimizer", choices=sorted(OPTIMIZERS), default="sgd",
                        help="sgd (lr 0.1, default): parity of the gradients without AdamW's "
                             "amplification of round-off; adamw (lr 1e-3)")
    parser.add_argument("--quick", action="store_true",
                        help="d=64, 2 blocks, sequence 32, 2 steps, 1 round (a smoke run)")
    args = parser.parse_args()
    if args.quick:
        args.width, args.blocks, args.seq, args.steps, args.rounds = 64, 2, 32, 2, 1
    if args.variants is None:
        variants = [v for v in VARIANTS if args.stages == 2 or not v.endswith("-whole")]
    else:
        variants = [v for v in args.variants.split(",") if v]
    unknown = sorted(set(variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variants {unknown}; choose from {', '.join(VARIANTS)}")
    a = {"width": args.width, "blocks": args.blocks, "seq": args.seq, "stages": args.stages,
         "micro_batches": args.micro_batches, "steps": max(1, args.steps),
         "optimizer": args.optimizer}
    print(f"tp_compare: pp={a['stages']} x tp={TP}, d={a['width']}, {a['blocks']} blocks, "
          f"sequence {a['seq']}, {a['micro_batches']} x {MICRO} sequences per step, "
          f"{a['steps']} timed steps after 2 untimed, {args.rounds} rounds, "
          f"{a['optimizer']}; torch "
          f"{torch.__version__}, {os.cpu_count()} cores")
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}", flush=True)
    results = run(a, variants, args.rounds)
    print(f"load average after:  {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    report(results, args.rounds)


if __name__ == "__main__":
    main()
