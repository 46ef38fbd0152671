"""The mutation suite's model, data and injected bugs (tests/test_mutations.py,
benchmarks/sentinel_cost.py --clean).

The model carries packed rows' ``position_ids`` in a dict across every stage, ties its
embedding to its head and two middle blocks to each other (layers 3 and 6: on different
stages under 1f1b and zbv/dualpipev, at 2 and 4 stages, with the explicit bounds of
:func:`bounds`), and returns a token loss (``loss_reduction="tokens"``).

Each bug is injected by the test, from outside the product (monkeypatches on the live
engine or, for a transfer, on the receiving rank's ``Channel`` class: each rank is its
own process): nothing in the engine is switched or checked when no test injects.
"""
from __future__ import annotations

import dataclasses

import torch
from torch import nn

import pipekernel as pk
from pipekernel.comm import wire
from pipekernel.schedules import instructions as isa

VOCAB, DIM, LAYERS = 11, 8, 8
#: the step each bug starts at (steps 1 and 2 run clean and are checked)
BUG_STEP = 3


class PosBlock(nn.Module):
    """Uses the row's positions; like a Hugging Face layer, falls back to 0..T-1 when the
    dict carries none (so a lost key is silent, not a KeyError). ``count``: its forward
    depends on how often it ran once ``counting`` is set (a list: outside its buffers)."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(DIM, DIM)
        self.counting = [False, 0]

    def forward(self, x):
        h, pos = x["hidden"], x.get("position_ids")
        if pos is None:
            pos = torch.arange(h.shape[1]).expand(h.shape[:2])
        out = h + torch.tanh(self.lin(h + 0.3 * torch.sin(pos[..., None].to(h.dtype))))
        if self.counting[0]:
            self.counting[1] += 1
            out = out * (1.0 + 0.05 * self.counting[1])
        return {**x, "hidden": out}


def _embed(emb, x):
    return {"hidden": emb(x["input_ids"]), "position_ids": x["position_ids"]}


def _head(emb, x):
    return x["hidden"] @ emb.weight.t()


def token_loss(logits, labels):
    return (nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1),
                                        reduction="sum"), torch.tensor(labels.numel()))


def bounds(stages, chunks):
    """Explicit bounds: layers 3 and 6 (tied "mid") on different stages in every layout."""
    parts = stages * chunks
    return {2: [0, 4, 8], 4: [0, 2, 4, 6, 8], 8: list(range(9))}[parts]


def module(stages, chunks):
    layers = [pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=_embed)]
    for index in range(1, LAYERS - 1):
        layers.append(pk.TiedLayerSpec("mid", PosBlock) if index in (3, 6)
                      else pk.LayerSpec(PosBlock))
    layers.append(pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, DIM, forward_fn=_head))
    return pk.PipelineModule(layers, loss_fn=token_loss, num_stages=stages,
                             partition=bounds(stages, chunks), seed=21)


def data(step, replica, micro_batches, batch=2, length=6):
    """Packed rows: two documents per row, positions restarting at the second."""
    g = torch.Generator().manual_seed(1_000 * step + 17 * replica)
    items = []
    for _ in range(micro_batches):
        ids = torch.randint(0, VOCAB, (batch, length + 1), generator=g)
        cut = 2 + int(torch.randint(0, length - 3, (1,), generator=g))
        pos = torch.cat([torch.arange(cut), torch.arange(length - cut)]).expand(batch, length)
        items.append(({"input_ids": ids[:, :-1], "position_ids": pos.clone()}, ids[:, 1:]))
    return items


# -- the bugs: inject(engine, step) runs before each step ---------------------------------
def scaled_twice(engine, step):
    """The last stage applies the token scale twice (DeepSpeed #8152's class)."""
    if step == BUG_STEP and engine.stage == engine.num_stages - 1:
        once = engine.batch_step._token_scale
        engine.batch_step._token_scale = lambda total: once(total) * once(total)


def dropped_micro_batch(engine, step):
    """Stage 0 loses micro-batch 1's weight gradients (NeMo-Automodel #3530's class): its
    backward runs (the input gradients still flow) and the accumulation is undone."""
    if step != BUG_STEP or engine.stage != 0:
        return
    precision = engine.precision

    def drop(handler):
        def run(ins):
            masters = [precision.master(p) for p in engine.module.parameters()]
            before = [None if m.grad is None else m.grad.clone() for m in masters]
            handler(ins)
            for m, g in zip(masters, before):
                m.grad = g
        return run
    for key, (program, handlers, bound) in list(engine._programs.items()):
        handlers = list(handlers)
        for i, ins in enumerate(program.stream):
            if isinstance(ins, (isa.Backward, isa.BackwardWeight)) and ins.micro_batch == 1:
                handlers[i] = drop(handlers[i])
        engine._programs[key] = (program, tuple(handlers), bound)


def tied_not_reduced(engine, step):
    """Every rank skips the sum of tied gradients over stages (Megatron #844's class)."""
    if step == BUG_STEP:
        engine.batch_step.reduce_tied_grads = lambda: None


def _on_receive(engine, change):
    """From now on, every object this rank receives from another stage goes through
    ``change`` once (restored after one use)."""
    original = wire.Channel.finish

    def finish(self, pending):
        obj = original(self, pending)
        wire.Channel.finish = original
        return change(obj)
    wire.Channel.finish = finish


def _receiver(engine):
    return engine.rank == engine.topology.stage_rank(1) and engine.data_parallel_rank == 0


def byte_flipped(engine, step):
    """Stage 1 of the first pipeline receives one transfer with one byte flipped."""
    if step == BUG_STEP and _receiver(engine):
        def flip(obj):
            t = wire.flatten(obj)[0][0]
            with torch.no_grad():
                t.reshape(-1).view(torch.uint8)[3] ^= 0x10
            return obj
        _on_receive(engine, flip)


def position_ids_lost(engine, step):
    """Stage 1 of the first pipeline receives an activation without its position_ids
    (KempnerForge #204's class: packing ignored past the first stage)."""
    if step == BUG_STEP and _receiver(engine):
        def lose(obj):
            inner = obj[0] if isinstance(obj, tuple) and len(obj) == 2 else obj
            if isinstance(inner, dict):
                inner.pop("position_ids", None)
            return obj
        _on_receive(engine, lose)


def normalised_after_backward(engine, step):
    """The last stage's backward starts from the loss not yet divided by the micro-batch
    count (the division comes after backward: the reported loss is right)."""
    if step == BUG_STEP and engine.stage == engine.num_stages - 1:
        runtime, begin = engine.runtime, engine.runtime.begin

        def undivided(data_iter, program, *args, **kwargs):
            # what the losses divide by is the program's count: the runtime is handed one
            # of a single micro-batch (the same stream)
            begin(data_iter, dataclasses.replace(program, micro_batches=1), *args, **kwargs)
        runtime.begin = undivided


def step_skipped(engine, step):
    """One rank skips its optimizer step once: a replica under data parallelism, else the
    stage holding tied layer 6 (the copies of "mid" then differ)."""
    holder = engine.topology.rank_of(engine.data_parallel_size - 1, 1 if engine.num_stages == 2
                                     else _stage_of_layer(engine, 6))
    if step == BUG_STEP and engine.rank == holder:
        opt, step_fn = engine.optimizer, engine.optimizer.step

        def skip(*args, **kwargs):
            opt.step = step_fn
        opt.step = skip


def _stage_of_layer(engine, layer):
    b = engine.bounds
    return next(engine.part_stages[p] for p in range(len(b) - 1) if b[p] <= layer < b[p + 1])


def counted(engine, step):
    """Layer 4's forward starts depending on how often it ran."""
    if step == BUG_STEP:
        for name, m in engine.module.named_modules():
            if name == "4":
                m.counting[0] = True


#: bug -> (inject, what names it: a sentinel check, or "replay" for verify_batch)
BUGS = {"scaled_twice": (scaled_twice, "normalisation"),
        "dropped_micro_batch": (dropped_micro_batch, "replay"),
        "tied_not_reduced": (tied_not_reduced, "tied"),
        "byte_flipped": (byte_flipped, "transfers"),
        "position_ids_lost": (position_ids_lost, "transfers"),
        "normalised_after_backward": (normalised_after_backward, "normalisation"),
        "step_skipped": (step_skipped, None),  # replicas, or tied without replicas
        "counted": (counted, "replay")}


SCHEDULES = ["1f1b", "zbv", "dualpipev"]
LAYOUTS = {"replicas": 2, "stages": 4}  # layout -> pipeline stages (4 ranks in all)


def adam(params):
    return torch.optim.AdamW(params, lr=1e-2)


def engine_for(schedule, layout, micro_batches=8):
    stages = LAYOUTS[layout]
    chunks = 1 if schedule == "1f1b" else 2
    return pk.PipelineEngine(module(stages, chunks), optimizer=adam,
                             micro_batches=micro_batches, schedule=schedule, transport="gloo",
                             data_parallel_size=4 // stages, timeout=60, check_every=1,
                             loss_reduction="tokens")


def run_case(bug, schedule, layout, steps, verify_every=1):
    """Train ``steps`` steps with ``check_every=1``, replaying every ``verify_every``-th
    batch first where the replay is the check (``bug`` ``None``: a clean run); the error's
    fields, or how far it got clean."""
    engine = engine_for(schedule, layout)
    inject, by = BUGS[bug] if bug is not None else (None, "replay")
    try:
        for step in range(1, steps + 1):
            if inject is not None:
                inject(engine, step)
            batch = data(step, engine.data_parallel_rank, engine.micro_batches)
            if by == "replay" and step % verify_every == 0:
                engine.verify_batch(iter(batch))
            engine.train_batch(iter(batch))
        return {"steps": engine.global_steps, "last_clean": engine.sentinel.last_clean}
    except pk.ConsistencyError as err:
        return {"check": err.check, "step": err.train_step, "stage": err.stage,
                "parameter": err.parameter, "text": str(err).splitlines()[0]}
    finally:
        engine.close()
