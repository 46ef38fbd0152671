"""``pipekernel train``: train a small GPT-style byte-level LM with pipeline parallelism.

On one machine with no arguments it starts ``stages x data_parallel`` local
processes (CPU, gloo) through :func:`pipekernel.launcher.launch`; under ``torchrun``
(``RANK`` and ``WORLD_SIZE`` set) it runs just this rank. Rank 0 shows a
progress bar and, at the end, a per-stage time table, the partition, a sample
of generated text and the paths of the metrics CSV, the trace and the timeline
PNG written under ``--out``.

The corpus is the Python standard library's own ``.py`` sources (every machine
with Python has them; files in sorted order, at most ``corpus_bytes``) or
``--data FILE``. Every rank reads the same corpus and draws the same windows
for its replica, so no data has to travel between ranks.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path
from typing import Any

import torch

import pipekernel as pk
from pipekernel.schedules.placement import parts_of
from pipekernel.apps.config import TrainConfig, partition_method
from pipekernel.apps import hf_model
from pipekernel.apps.gpt import generate, gpt_module
from pipekernel.grid.expert_parallel import whole_state_dict
from pipekernel.plugin import all_gather_objects

__all__ = ["TrainConfig", "load_corpus", "split_corpus", "make_batch", "make_packed_batch",
           "documents", "gather_full_state", "stage_table", "partition_method", "run", "worker",
           "lr_factor", "lr_change", "last_check"]


def _positive(cfg: TrainConfig) -> None:
    for name in ("stages", "data_parallel", "micro_batches", "micro_batch_size", "steps", "dim",
                 "layers", "heads", "context", "corpus_bytes", "every", "threads"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or value < 1:
            flag = "--" + name.replace("_", "-")
            raise pk.ConfigError(f"{flag} must be a positive integer, got {value!r}",
                                 hint=f"pass {flag} 1 or more")
    for name, example in (("save_every", "100, or 0 for none"),
                          ("keep_last", "3, or 0 to keep all"),
                          ("check_every", "100, or 0 for never"),
                          ("verify_every", "100, or 0 for never")):
        value, flag = getattr(cfg, name), "--" + name.replace("_", "-")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise pk.ConfigError(f"{flag} must be 0 or a positive integer, got {value!r}",
                                 hint=f"pass {flag} {example}")
    tag = cfg.resume
    if isinstance(tag, str) and (not tag or tag.startswith(".") or "/" in tag or os.sep in tag):
        raise pk.ConfigError(f"--resume {tag!r} is not a checkpoint tag (one directory name "
                             f"under the checkpoint directory, e.g. global_step100)",
                             hint="pass the directory as --checkpoint-dir DIR and the tag "
                                  "alone: --resume global_step100")
    if cfg.dim % cfg.heads:
        raise pk.ConfigError(f"--dim {cfg.dim} is not divisible by --heads {cfg.heads}",
                             hint="pick --dim as a multiple of --heads")
    if cfg.stages > cfg.layers + 2:
        raise pk.ConfigError(
            f"{cfg.layers + 2} layers (embedding, {cfg.layers} blocks, head) cannot fill "
            f"{cfg.stages} stages",
            hint=f"pass --layers {cfg.stages - 2} or more, or fewer --stages")
    from pipekernel.grid.parallel import ParallelConfig
    ParallelConfig.make(rank_order=cfg.rank_order, zero_stage=cfg.zero_stage)  # clear errors
    _check_experts(cfg)
    if cfg.pack and cfg.hf:
        raise pk.ConfigError("--pack packs documents for the built-in GPT; --hf models take "
                             "Hugging Face's packed rows from their own collator",
                             hint="drop --pack, and see docs/sequences.md for "
                                  "DataCollatorWithFlattening through pipekernel.hf")
    _check_seq_chunks(cfg)
    if cfg.offload and (not torch.cuda.is_available() or cfg.transport == "gloo"):
        raise pk.ConfigError("--offload moves saved activations from GPU to host memory, and "
                             "these stages run on CPU", hint="run on a GPU (--transport "
                             "nccl or staged), or drop --offload; for less activation "
                             "memory on CPU, see docs/memory.md")


def _check_seq_chunks(cfg: TrainConfig) -> None:
    """``--seq-chunks``: a positive count dividing ``--context``, for the built-in GPT's
    unpacked rows (the engine refuses the rest: the schedule, Hugging Face models)."""
    k = cfg.seq_chunks
    if k < 1 or cfg.context % k:
        raise pk.ConfigError(f"--seq-chunks {k} must be >= 1 and divide --context "
                             f"{cfg.context} (every chunk has the same length)",
                             hint="pass a --seq-chunks that divides --context, e.g. 2 or 4")
    if k > 1 and (cfg.pack or cfg.hf or cfg.schedule != "1f1b"):
        what = "--pack" if cfg.pack else "--hf" if cfg.hf else f"--schedule {cfg.schedule}"
        raise pk.ConfigError(f"--seq-chunks {k} with {what}: sequence chunks run the "
                             f"built-in GPT's unpacked rows under 1f1b (docs/sequences.md)",
                             hint=f"drop {what.split()[0]} (or pass --seq-chunks 1)")


def _check_plan(cfg: TrainConfig) -> None:
    """What every rank would refuse, refused here before any process starts: the schedule
    (name, trains, chunks, its micro-batch rule, e.g. dualpipev's 2 x stages), the
    precision and transport names, and the partition where no measurement is needed."""
    from pipekernel.engine.planner import is_auto
    from pipekernel.extend.manager import (check_transport_name, make_plugin_manager,
                                           make_precision, provided_names, resolve_schedule)
    from pipekernel.schedules.placement import check_placement

    pm = make_plugin_manager()
    make_precision(pm, cfg.precision, {})
    check_transport_name(pm, cfg.transport)
    if is_auto(cfg.schedule):
        return  # the planner chooses schedule, chunks and partition on the ranks
    cls = resolve_schedule(pm, cfg.schedule)
    if not cls.trains:
        raise pk.ConfigError(f"--schedule {cfg.schedule!r} does not train",
                             hint="pass a training schedule: --schedule 1f1b (or gpipe, "
                                  "interleaved, zb-h1, zbv, dualpipev, ...)")
    chunks = cls.default_chunks if cfg.chunks is None else cfg.chunks
    for stage in range(cfg.stages):  # the schedule's own errors, as a rank would raise them
        cls(cfg.stages, stage, cfg.micro_batches, chunks)
    if chunks > 1:
        check_placement(cls.placement, chunks)
    method = partition_method(cfg.partition)
    # builtin methods that measure nothing, and names no plugin lists (to refuse them)
    known = provided_names(pm, "partition")
    if not cfg.hf and (isinstance(method, list) or method in ("parameters", "uniform")
                       or method.startswith("type:") or method not in known):
        gpt_module(cfg.dim, cfg.layers, cfg.heads, cfg.context, num_stages=cfg.stages,
                   partition=method, seed=cfg.seed, experts=cfg.experts,
                   top_k=cfg.top_k).partition(cfg.stages * chunks, pm)


def _check_inputs(cfg: TrainConfig) -> None:
    """``--data`` (readable, long enough for ``--context``) and an ``--hf`` path that does
    not exist, refused before any process starts."""
    if cfg.data is not None:
        split_corpus(load_corpus(cfg.data, cfg.corpus_bytes)[0], cfg.context)
    spec = cfg.hf
    if spec and not os.path.exists(spec) and (os.sep in spec or "/" in spec
                                              or spec.endswith(".json")):
        raise pk.ConfigError(f"--hf {spec}: no such file or directory",
                             hint="pass a save_pretrained directory, a config .json file or a "
                                  "model type such as llama")


def _check_experts(cfg: TrainConfig) -> None:
    from pipekernel.grid.expert_parallel import check_config
    if not isinstance(cfg.experts, int) or cfg.experts < 0:
        raise pk.ConfigError(f"--experts must be 0 or a positive integer, got {cfg.experts!r}",
                             hint="pass --experts 8, or 0 for dense MLPs")
    check_config(cfg.expert_parallel, cfg.data_parallel, zero_stage=cfg.zero_stage)
    if cfg.experts and cfg.experts % cfg.expert_parallel:
        raise pk.ConfigError(f"--experts {cfg.experts} is not divisible by --expert-parallel "
                             f"{cfg.expert_parallel}",
                             hint=f"pass --experts a multiple of {cfg.expert_parallel}")
    if cfg.experts and not 1 <= cfg.top_k <= cfg.experts:
        raise pk.ConfigError(f"--top-k {cfg.top_k} with --experts {cfg.experts}",
                             hint="pass --top-k between 1 and --experts")


# -- data -------------------------------------------------------------------------------


def stdlib_files() -> list[Path]:
    """The standard library's top-level ``.py`` files, in a fixed (sorted) order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    return sorted(p for p in root.glob("*.py") if p.is_file())


def load_corpus(path: str | None = None, limit: int = 2_000_000) -> tuple[bytes, str]:
    """The training bytes (at most ``limit``) and a one-line description of them."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = f.read(limit)
        except OSError as err:
            raise pk.ConfigError(f"cannot read --data {path}: {err}",
                                 hint="pass a readable text file") from err
        source = f"{path}"
    else:
        files = stdlib_files()
        root = Path(sysconfig.get_paths()["stdlib"])
        if not files:
            raise pk.ConfigError(f"found no Python standard library sources in {root}",
                                 hint="pass a text file to train on: --data FILE")
        chunks, size, used = [], 0, 0
        for file in files:
            if size >= limit:
                break
            try:
                text = file.read_bytes()
            except OSError:
                continue
            chunks.append(text[:limit - size])
            size += len(chunks[-1])
            used += 1
        data = b"".join(chunks)
        source = f"{used} Python standard library files from {root}"
    return data, source


def split_corpus(data: bytes, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Train/held-out split (the last 5%, at least two windows) as int64 byte tensors."""
    if len(data) < 4 * (context + 1):
        raise pk.ConfigError(f"the corpus has {len(data)} bytes, too few for --context {context}",
                             hint=f"use a file of at least {4 * (context + 1)} bytes or a "
                                  "smaller --context")
    ids = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.long)
    cut = len(ids) - max(len(ids) // 20, 2 * (context + 1))
    return ids[:cut], ids[cut:]


def make_batch(ids: torch.Tensor, cfg: TrainConfig, step: int, replica: int,
               salt: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """``micro_batches`` (inputs, next-byte labels) pairs of random windows.

    Deterministic in ``(seed, step, replica, salt)``: the first and the last
    stage of a pipeline draw the same windows without talking to each other.
    """
    g = torch.Generator().manual_seed(((cfg.seed * 1_000_003 + salt) * 1_000_003 + step)
                                      * 1009 + replica)
    starts = torch.randint(0, len(ids) - cfg.context - 1,
                           (cfg.micro_batches, cfg.micro_batch_size), generator=g)
    offsets = torch.arange(cfg.context + 1)
    batch = []
    for row in starts:
        windows = ids[row[:, None] + offsets]
        batch.append((windows[:, :-1].contiguous(), windows[:, 1:].contiguous()))
    return batch


def documents(ids: torch.Tensor) -> list[torch.Tensor]:
    """The corpus cut at blank lines (``\\n\\n``) into documents of at least 2 bytes, for
    ``--pack``: paragraphs of text, the top-level blocks of source files."""
    breaks = ((ids[:-1] == 10) & (ids[1:] == 10)).nonzero().reshape(-1) + 2
    cuts = [0, *breaks.tolist(), len(ids)]
    return [ids[a:b] for a, b in zip(cuts, cuts[1:]) if b - a >= 2]


def make_packed_batch(docs: list[torch.Tensor], cfg: TrainConfig, step: int, replica: int,
                      salt: int = 0) -> list[tuple[dict[str, torch.Tensor], torch.Tensor]]:
    """``micro_batches`` packed micro-batches (``--pack``): random documents packed into
    ``micro_batch_size`` rows of ``context`` bytes (:func:`pipekernel.pack`), as
    ``({"input_ids", "position_ids"}, next-byte labels, -100 at each document's end)``;
    deterministic in ``(seed, step, replica, salt)`` as :func:`make_batch`."""
    g = torch.Generator().manual_seed(((cfg.seed * 1_000_003 + salt) * 1_000_003 + step)
                                      * 1009 + replica)
    room, batch = cfg.micro_batch_size * cfg.context, []
    for _ in range(cfg.micro_batches):
        chosen: list[torch.Tensor] = []
        while sum(len(d) for d in chosen) < room:
            chosen.append(docs[int(torch.randint(len(docs), (1,), generator=g))])
        rows = pk.pack(chosen, cfg.context, cfg.micro_batch_size)
        batch.append(({"input_ids": rows["input_ids"], "position_ids": rows["position_ids"]},
                      rows["labels"]))
    return batch


# -- helpers on the engine --------------------------------------------------------------


def gather_full_state(engine: pk.PipelineEngine, module: pk.PipelineModule
                      ) -> dict[str, torch.Tensor] | None:
    """Every layer's weights (replica 0's stages) on rank 0, ``None`` elsewhere.

    Uses the transport's ``broadcast`` (so it works on any transport; spread experts are
    first gathered over their expert-parallel group): the
    rank holding stage ``s`` of replica 0 sends its ``state_dict`` as one flat
    float32 tensor; the others know its keys and shapes from a meta-device build
    of that stage (keys are global layer indices whatever the partitioning).
    """
    transport, topo = engine.transport, engine.topology
    state: dict[str, torch.Tensor] = {}
    ep = engine.ep_group  # spread experts: the first expert-parallel group gathers them
    whole = whole_state_dict(engine.module, ep) if topo.data_rank < ep.size else None
    for stage in range(engine.num_stages):
        with torch.device("meta"):
            parts = parts_of(stage, engine.num_stages, engine.chunks, engine.placement)
            shapes = {k: v.shape for k, v in module.build_stage(stage, engine.bounds, parts)
                      .state_dict().items()}
        owner = topo.rank_of(0, stage)
        if engine.rank == owner:
            flat = torch.cat([whole[k].detach().float().reshape(-1) for k in shapes])
        else:
            flat = torch.empty(sum(math.prod(s) for s in shapes.values()), dtype=torch.float32)
        flat = flat.to(transport.device)
        transport.broadcast(flat, owner)
        offset = 0
        for key, shape in shapes.items():
            n = math.prod(shape)
            state[key] = flat[offset:offset + n].view(shape).cpu()
            offset += n
    return state if engine.rank == 0 else None


def _batch(ids: Any, cfg: TrainConfig, step: int, replica: int, salt: int = 0) -> list:
    """The step's micro-batches: packed documents with ``--pack`` (``ids`` is then the
    list of documents), random windows otherwise."""
    if cfg.pack:
        return make_packed_batch(ids, cfg, step, replica, salt)
    return make_batch(ids, cfg, step, replica, salt)


def _eval_loss(engine: pk.PipelineEngine, ids: Any, cfg: TrainConfig) -> float:
    batch = _batch(ids, cfg, 0, engine.data_parallel_rank, salt=1)
    batch = hf_model.as_dicts(batch) if cfg.hf else batch
    return float(engine.eval_batch(iter(batch)))


def _describe_ranks(engine: pk.PipelineEngine, pids: list[int] | None = None) -> list[str]:
    """The rank order and which rank is which stage and replica, with its pid (nodes by
    ``LOCAL_WORLD_SIZE`` under torchrun); a summary line for more than 32 ranks."""
    from pipekernel.grid.topology import format_rank_map

    topo = engine.topology
    per_node = int(os.environ.get("LOCAL_WORLD_SIZE", "0")) or None
    zero = ", ZeRO-1 optimizer state" if engine.parallel.zero_stage else ""
    head = f"ranks (order {topo.order}, innermost first{zero}; kill -USR1 a pid, or the " \
           f"launcher's, for every rank's position):"
    lines = format_rank_map(topo, per_node, pids)
    if len(lines) > 32:
        lines = lines[:4] + [f"... ({len(lines) - 8} more)"] + lines[-4:]
    return [head, *("  " + line for line in lines)]


def _describe_partition(module: pk.PipelineModule, bounds: list[int],
                        part_stages: list[int] | None = None) -> list[str]:
    counts = module.parameter_counts()
    names = [layer.typename.__name__ for layer in module.layers]
    lines = []
    part_stages = part_stages or list(range(len(bounds) - 1))
    for part in range(len(bounds) - 1):
        stage = part_stages[part]
        lo, hi = bounds[part], bounds[part + 1]
        parts: list[str] = []
        for name in dict.fromkeys(names[lo:hi]):
            n = names[lo:hi].count(name)
            parts.append(f"{n} x {name}" if n > 1 else name)
        where = f"layers {lo}-{hi - 1}" if hi - lo > 1 else f"layer {lo}"
        label = f"stage {stage}" if len(part_stages) == len(set(part_stages)) \
            else f"part {part} (stage {stage})"
        lines.append(f"  {label}: {where} ({', '.join(parts)}), "
                     f"{sum(counts[lo:hi]) / 1e6:.2f}M parameters")
    return lines


_COLUMNS = (("forward", "forward_s"), ("backward", "backward_s"), ("wait", "wait_s"),
            ("send", "send_s"), ("drain", "drain_s"), ("other", None), ("step", "step_s"))


def stage_table(summaries: list[dict[str, Any]]) -> list[str]:
    """Milliseconds per step by rank from the monitor's per-rank totals.

    ``wait`` is time blocked in a receive, ``drain`` the end of the step spent
    waiting for the slowest stage, ``other`` everything else (loading, gradient
    reduction, optimizer, Python); ``bubble`` = (wait + drain) / step.
    """
    head = (f"  {'rank':>4} {'stage':>5} | " + " ".join(f"{name:>8}" for name, _ in _COLUMNS)
            + f" | {'bubble':>6}")
    lines = [head, "  " + "-" * (len(head) - 2)]
    for s in summaries:
        steps = max(int(s.get("steps", 1)), 1)
        ms = {key: 1000.0 * float(s.get(key, 0.0)) / steps for _, key in _COLUMNS if key}
        ms["other"] = max(0.0, ms["step_s"] - sum(v for k, v in ms.items() if k != "step_s"))
        cells = " ".join(f"{ms[key or 'other']:>8.1f}" for _, key in _COLUMNS)
        lines.append(f"  {s.get('rank', '?'):>4} {s.get('stage', '?'):>5} | {cells} | "
                     f"{100.0 * float(s.get('bubble_fraction', 0.0)):>5.1f}%")
    return lines


def last_check(summaries: list[dict[str, Any]], every: int) -> list[str]:
    """The sentinel's last check from the monitor's per-rank summaries: its step, result
    and cost (the slowest rank's), or that none ran."""
    checks = [s["last_check"] for s in summaries if s.get("last_check")]
    if not summaries:  # no monitor summaries: no table, no line
        return []
    if not every:
        return ["consistency checks: off (--check-every 0)"]
    if not checks:
        return [f"consistency checks: none ran (every {every} steps)"]
    return [f"last consistency check (every {every} steps): after step {checks[0]['step']}, "
            f"{checks[0]['result']} on {len(checks)} rank(s), "
            f"{max(c['seconds'] for c in checks) * 1e3:.1f} ms on the slowest"]


def _print(*lines: str) -> None:
    print("\n".join(lines), flush=True)


# -- the per-rank job -------------------------------------------------------------------


def lr_factor(cfg: TrainConfig) -> Any:
    """The learning rate's factor at step ``s`` (``LambdaLR``): warm up for 5% of
    ``--steps``, then cosine decay to 10% at ``--steps``. It depends on ``--steps``, so a
    resume with another ``--steps`` continues on another schedule (:func:`lr_change`)."""
    warmup = max(1, cfg.steps // 20)  # a short run still settles
    return lambda s: min((s + 1) / warmup,
                         0.1 + 0.45 * (1 + math.cos(math.pi * min(s / cfg.steps, 1.0))))


def lr_change(scheduler: Any, cfg: TrainConfig) -> str | None:
    """After a resume: a warning when this run's schedule (``--lr``, ``--steps``) gives
    another learning rate at the checkpoint's step than the saved run used there, else
    ``None``. ``scheduler`` holds the checkpoint's state (its last rates)."""
    step = scheduler.last_epoch
    saved = scheduler.get_last_lr()[0]
    now = cfg.lr * lr_factor(cfg)(step)
    if math.isclose(saved, now, rel_tol=1e-9, abs_tol=1e-15):
        return None
    return (f"warning: the learning-rate schedule changed at the resume: the checkpoint's run "
            f"had lr {saved:.3g} at step {step}; this run's (--lr {cfg.lr:g}, warm-up then "
            f"cosine decay to --steps {cfg.steps}) gives {now:.3g} there and continues on it. "
            "To keep the saved run's schedule, pass its --steps and --lr")


def recompute_option(text: str) -> Any:
    """``--recompute``: ``""`` (``None``: the planner's or none), one value for every stage
    (``1``, ``all``, ``none``) or one per stage (``1,0``)."""
    values: list[Any] = [int(v) if v.strip().isdigit() else v.strip()
                         for v in text.split(",") if v.strip()]
    if not values:
        return None
    return values[0] if len(values) == 1 else values


def _make_engine(cfg: TrainConfig, module: pk.PipelineModule, monitor: Any) -> pk.PipelineEngine:
    return pk.PipelineEngine(
        module, optimizer=lambda params: torch.optim.AdamW(params, lr=cfg.lr, betas=(0.9, 0.95),
                                                           weight_decay=0.01),
        micro_batches=cfg.micro_batches, schedule=cfg.schedule, chunks=cfg.chunks,
        transport=cfg.transport,
        precision=cfg.precision, data_parallel_size=cfg.data_parallel, plugins=[monitor],
        timeout=cfg.timeout, rank_order=cfg.rank_order, zero_stage=cfg.zero_stage,
        expert_parallel_size=cfg.expert_parallel, seq_chunks=cfg.seq_chunks,
        recompute=recompute_option(cfg.recompute),
        offload=cfg.offload or None, loss_reduction="tokens" if cfg.hf or cfg.pack else "mean",
        check_every=cfg.check_every or None, verify_every=cfg.verify_every or None,
        # the engine steps it after every step taken and saves it in checkpoints
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lr_factor(cfg)))


def _print_start(cfg: TrainConfig, engine: pk.PipelineEngine, module: pk.PipelineModule,
                 data: bytes, source: str, pids: list[int]) -> None:
    params = sum(module.parameter_counts())
    _print(f"pipekernel train: {cfg.stages} stage(s) x {cfg.data_parallel} replica(s) on "
           f"{getattr(engine.transport, 'backend', cfg.transport)} ({engine.transport.device}), schedule {cfg.schedule}, "
           f"precision {cfg.precision}",
           hf_model.describe(module, cfg) if cfg.hf else
           f"model: byte-level GPT, {params / 1e6:.2f}M parameters: embedding, {cfg.layers} "
           f"blocks (width {cfg.dim}, {cfg.heads} heads, context {cfg.context}"
           + (f", MLPs of {cfg.experts} experts, top-{cfg.top_k}" if cfg.experts else "")
           + "), head",
           f"data: {len(data) / 1e6:.2f} MB: {source}",
           f"batch: {cfg.micro_batches} micro-batches x {cfg.micro_batch_size} sequences x "
           f"{cfg.context} bytes x {cfg.data_parallel} replica(s) = {cfg.tokens_per_step} "
           f"tokens per step",
           *_describe_ranks(engine, pids),
           f"partition ({cfg.partition}):", *_describe_partition(module, engine.bounds,
                                                             engine.part_stages))


def _save(engine: pk.PipelineEngine, cfg: TrainConfig) -> None:
    """Save a checkpoint; then rank 0 deletes all but the ``--keep-last`` newest.

    ``save_checkpoint`` returns on a rank only after every rank wrote its files and rank 0
    published the checkpoint (its last agreement), and no rank writes again before the
    next save's first agreement, which waits for rank 0: so nothing is deleted while a
    rank still writes, and never the checkpoint just written."""
    from pipekernel.engine.checkpoint_files import prune

    directory = engine.save_checkpoint(cfg.checkpoints)
    if engine.rank != 0 or not cfg.keep_last:
        return
    try:
        prune(cfg.checkpoints, cfg.keep_last, os.path.basename(directory))
    except OSError as err:  # an old checkpoint left behind is no reason to stop training
        _print(f"warning: could not delete an older checkpoint under {cfg.checkpoints} "
               f"(--keep-last {cfg.keep_last}): {err}; training goes on")


def _train(engine: pk.PipelineEngine, cfg: TrainConfig, train_ids: Any,
           first_step: int) -> tuple[list[float], float]:
    """Steps ``first_step .. cfg.steps - 1``: the losses and the seconds they took."""
    bar = None
    if engine.rank == 0 and cfg.progress:
        from tqdm import tqdm
        bar = tqdm(total=cfg.steps, initial=first_step,
                   desc=f"train (resumed at step {first_step})" if first_step else "train",
                   unit="step", file=sys.stderr, dynamic_ncols=True, mininterval=0.5)
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(first_step, cfg.steps):
        t0 = time.perf_counter()
        batch = _batch(train_ids, cfg, step, engine.data_parallel_rank)
        batch = hf_model.as_dicts(batch) if cfg.hf else batch
        loss = float(engine.train_batch(iter(batch)))
        losses.append(loss)
        if cfg.save_every and (step + 1) % cfg.save_every == 0:
            _save(engine, cfg)
        if bar is not None:
            bar.set_postfix(loss=f"{loss:.3f}",
                            tok_s=f"{cfg.tokens_per_step / (time.perf_counter() - t0):,.0f}",
                            refresh=False)
            bar.update(1)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    return losses, seconds


def worker(cfg: TrainConfig) -> dict[str, Any] | None:
    """Train on this rank; rank 0 prints the report and returns the summary dict."""
    torch.set_num_threads(cfg.threads)
    data, source = load_corpus(cfg.data, cfg.corpus_bytes)
    train_ids, held_ids = split_corpus(data, cfg.context)
    if cfg.pack:
        train_ids, held_ids = documents(train_ids), documents(held_ids)
    module = hf_model.hf_module(cfg) if cfg.hf else \
        gpt_module(cfg.dim, cfg.layers, cfg.heads, cfg.context, num_stages=cfg.stages,
                   partition=partition_method(cfg.partition), seed=cfg.seed,
                   experts=cfg.experts, top_k=cfg.top_k, pack=cfg.pack)
    from pipekernel.plugins.monitor import Monitor

    # without a progress bar (logs, CI) the monitor's console line every N steps replaces it
    sinks = ("csv", "jsonl", "trace") + (() if cfg.progress else ("console",))
    monitor = Monitor(out_dir=cfg.out, sinks=sinks, every=cfg.every)
    engine = _make_engine(cfg, module, monitor)
    rank0 = engine.rank == 0
    first_step = _resume(engine, cfg) if cfg.resume else 0
    pids = all_gather_objects(engine.transport, os.getpid())  # for kill -USR1
    if rank0:
        _print_start(cfg, engine, module, data, source, pids)
    held_before = _eval_loss(engine, held_ids, cfg)
    losses, seconds = _train(engine, cfg, train_ids, first_step)
    held_after = _eval_loss(engine, held_ids, cfg)

    saved = hf_model.save(engine, cfg) if cfg.hf else None
    summaries = monitor.gather()
    state = gather_full_state(engine, module)
    cpu = _cpu_seconds(engine)
    monitor.close()
    engine.close()
    if not rank0:
        return None
    run = {"losses": losses, "seconds": seconds, "first_step": first_step,
           "heldout_before": held_before, "heldout_after": held_after,
           "bounds": list(engine.bounds), "stages": summaries, "hf": saved, "cpu": cpu}
    return _summarise(cfg, module, state, monitor, run)


def _cpu_seconds(engine: pk.PipelineEngine) -> list[float]:
    """Every rank's CPU seconds so far (user + system, all its threads, since it started),
    by rank. Each rank reads its own clock: a launcher sees none of it (its ranks are the
    fork server's children, not its own), so ``time pipekernel train`` cannot show it.
    A collective: every rank calls it at the same point."""
    from pipekernel.comm.agreement import all_gather_objects

    mine = time.process_time()
    if engine.transport.world_size == 1:
        return [mine]
    return [float(v) for v in all_gather_objects(engine.transport, mine)]


def _summarise(cfg: TrainConfig, module: pk.PipelineModule, state: dict[str, torch.Tensor],
               monitor: Any, run: dict[str, Any]) -> dict[str, Any]:
    """On rank 0: the sample, the timeline, ``train.json`` and the printed report."""
    out = Path(cfg.out)
    full = module.build_stage(0, [0, len(module.layers)])
    full.load_state_dict(state)
    sample = generate(hf_model.TakesIds(full) if cfg.hf else full, cfg.prompt.encode(),
                      cfg.sample_bytes, cfg.context, seed=cfg.seed)
    paths = dict(monitor.paths)
    timeline = None
    if paths.get("trace"):
        from pipekernel.apps.timeline import draw_trace
        timeline = str(draw_trace(paths["trace"], out / "timeline.png", last_steps=2,
                                  title=f"the last 2 of {cfg.steps}; {cfg.stages} stages, "
                                        f"{cfg.schedule}, {cfg.micro_batches} micro-batches"))
    losses, seconds = run["losses"], run["seconds"]
    summary = {
        "config": dataclasses.asdict(cfg), "losses": losses, "loss_first": losses[0],
        "loss_last": losses[-1], "loss_first5": sum(losses[:5]) / len(losses[:5]),
        "loss_last5": sum(losses[-5:]) / len(losses[-5:]),
        "heldout_before": run["heldout_before"], "heldout_after": run["heldout_after"],
        "seconds": seconds, "tokens_per_s": cfg.tokens_per_step * len(losses) / seconds,
        "cpu_seconds": run["cpu"],
        "first_step": run["first_step"], "bounds": run["bounds"], "stages": run["stages"],
        "sample": sample.decode("utf-8", "replace"),
        "paths": {**paths, "timeline": timeline, "hf": run["hf"]},
    }
    out.mkdir(parents=True, exist_ok=True)
    summary_path = out / "train.json"
    summary["paths"]["train"] = str(summary_path)
    summary_path.write_text(json.dumps(summary, indent=1))
    _report(cfg, summary)
    return summary


def _other_checkpoints(root: str, failed: str | None) -> str:
    """The fix line for checkpoint ``failed`` (``None``: the one ``latest`` names) that
    is missing or corrupt: resume from the newest one before it, naming all there are."""
    from pipekernel.engine.checkpoint_files import checkpoint_tags, latest_tag

    if failed is None:
        try:
            failed = latest_tag(root)
        except pk.DataError:
            pass
    tags = checkpoint_tags(root)
    before = tags[:tags.index(failed)] if failed in tags else tags
    others = [t for t in tags if t != failed]
    if not others:
        return (f"there is no other checkpoint under {root}: start afresh without --resume, "
                "or pass --checkpoint-dir")
    return (f"resume from another checkpoint: --resume {(before or others)[-1]} (under "
            f"{root}: {', '.join(tags)})")


def _resume(engine: pk.PipelineEngine, cfg: TrainConfig) -> int:
    """Load the checkpoint ``--resume`` asks for (alone: the latest under
    ``cfg.checkpoints``, if there is one); the step to continue from."""
    tag = cfg.resume if isinstance(cfg.resume, str) and cfg.resume != "latest" else None
    try:
        info = engine.resume(cfg.checkpoints) if tag is None else \
            engine.load_checkpoint(cfg.checkpoints, tag)
    except pk.DataError as err:  # a missing or corrupt checkpoint: name the ones there are
        err.hint = _other_checkpoints(cfg.checkpoints, tag)
        raise
    if info is None:
        if engine.rank == 0:
            _print(f"resume: no checkpoint under {cfg.checkpoints}, starting at step 0")
        return 0
    step = info["global_steps"]
    if step >= cfg.steps:
        raise pk.ConfigError(f"the checkpoint {info['directory']} is at step {step}, which "
                             f"already reaches --steps {cfg.steps}",
                             hint=f"pass --steps larger than {step} to train further")
    if engine.rank == 0:
        reshaped = "" if info["exact"] else (
            f", reshaped from {info['meta']['topology']['num_stages']} stage(s) x "
            f"{info['meta']['topology']['data_parallel_size']} replica(s)")
        _print(f"resumed from {info['directory']} at step {step}{reshaped}")
        changed = lr_change(engine.lr_scheduler, cfg)
        if changed:
            _print(changed)
    return step


def _report(cfg: TrainConfig, s: dict[str, Any]) -> None:
    lines = [
        f"loss {s['loss_first5']:.3f} -> {s['loss_last5']:.3f} (mean of first/last 5 steps); "
        f"held-out {s['heldout_before']:.3f} -> {s['heldout_after']:.3f}",
        f"{len(s['losses'])} steps in {s['seconds']:.1f}s, {s['tokens_per_s']:,.0f} tokens/s"
        + (f" (resumed at step {s['first_step']})" if s["first_step"] else ""),
        f"CPU: {sum(s['cpu_seconds']):.1f} s over {len(s['cpu_seconds'])} rank(s) (each "
        "rank's own process time since it started: user + system, all threads; the "
        "launcher's not included)",
        "time per step by stage (ms; wait = blocked on a receive, drain = waiting for the "
        "slowest stage at the end of the step, bubble = (wait + drain) / step):",
        *stage_table(s["stages"] or []),
        *last_check(s["stages"] or [], cfg.check_every),
    ]
    if cfg.sample_bytes:
        lines += [f"sample (prompt {cfg.prompt!r}, {cfg.sample_bytes} bytes):",
                  "  | " + (cfg.prompt + s["sample"]).replace("\n", "\n  | ")]
    lines.append("files:")
    names = {"csv": "metrics CSV", "jsonl": "metrics JSONL", "trace": "trace (ui.perfetto.dev)",
             "timeline": "timeline PNG", "summary": "monitor summary", "train": "run summary",
             "hf": "Hugging Face model"}
    for key, label in names.items():
        if s["paths"].get(key):
            lines.append(f"  {label:<24} {s['paths'][key]}")
    _print(*lines)


# -- entry ----------------------------------------------------------------------------


def under_torchrun() -> bool:
    """``True`` when a launcher (torchrun, SLURM wrappers) already set this rank's environment."""
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def _check_extras(cfg: TrainConfig) -> None:
    import importlib.util
    missing = [name for name in (("tqdm",) if cfg.progress else ()) + ("matplotlib",)
               if importlib.util.find_spec(name) is None]
    if missing:
        raise pk.ConfigError(f"pipekernel train needs {' and '.join(missing)}, which is not "
                             "installed", hint="pip install 'pipekernel[train]'")


def run(cfg: TrainConfig) -> dict[str, Any] | None:
    """Train: this rank only under torchrun, else ``cfg.world_size`` local processes."""
    _positive(cfg)
    _check_plan(cfg)
    _check_inputs(cfg)
    _check_extras(cfg)
    if under_torchrun():
        world = int(os.environ["WORLD_SIZE"])
        if world != cfg.world_size:
            raise pk.ConfigError(
                f"torchrun started {world} processes but --stages {cfg.stages} x "
                f"--data-parallel {cfg.data_parallel} needs {cfg.world_size}",
                hint=f"use torchrun --nproc-per-node/--nnodes so that nodes x procs = "
                     f"{cfg.world_size}, or change --stages/--data-parallel")
        return worker(cfg)
    # Every peer wait is bounded by cfg.timeout inside the transport and launch()
    # notices a dead rank, so the whole job itself needs no wall-clock limit.
    results = pk.launch(worker, cfg.world_size, (cfg,), timeout=math.inf, threads=cfg.threads)
    return results[0]
