"""The ``pipekernel`` command (an application of the core: the core never imports it).

Each subcommand is one ``_add_<name>(subparsers)`` function that declares its
arguments and sets ``func``; :func:`main` calls every function in
``SUBCOMMANDS``. The optional libraries (tqdm, matplotlib) are imported only
by the subcommand that needs them.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import Any

__all__ = ["main", "build_parser", "HelpFormatter"]


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows ``(default: X)`` once: not when the help already says its default in words,
    nor for a default of ``None`` (the option is then simply off unless given)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if "default" in text or action.default in (None, argparse.SUPPRESS, False):
            return text
        return super()._get_help_string(action)


# -- pipekernel train ----------------------------------------------------------------------


def _add_train(sub: argparse._SubParsersAction) -> None:
    from pipekernel.apps.config import TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "train", help="train a small GPT-style byte-level LM with pipeline parallelism",
        description="Train a small GPT-style byte-level language model with pipeline "
                    "parallelism. Without a launcher it starts stages x data-parallel local "
                    "processes (CPU, gloo); under torchrun it runs this rank only. Writes a "
                    "metrics CSV/JSONL, a Chrome trace and a timeline PNG under --out.",
        formatter_class=HelpFormatter)
    _train_parallelism(p.add_argument_group("parallelism"), d)
    _train_run(p, d)
    _train_memory(p, d)
    p.set_defaults(func=_run_train)


def _train_parallelism(g: argparse._ArgumentGroup, d: Any) -> None:
    """``pipekernel train``'s parallelism flags."""
    g.add_argument("--stages", type=int, default=d.stages, help="pipeline stages")
    g.add_argument("--data-parallel", type=int, default=d.data_parallel,
                   help="pipeline replicas (data parallelism)")
    g.add_argument("--rank-order", default=d.rank_order,
                   help="which rank is which, innermost axis first (tp-dp-pp: tensor-parallel "
                        "ranks adjacent, replicas next, pipeline stages outermost; any "
                        "permutation of tp, dp, pp); the mapping is printed at start")
    g.add_argument("--zero-stage", type=int, default=d.zero_stage, choices=(0, 1),
                   help="1: shard the optimizer state over the replicas (ZeRO-1)")
    g.add_argument("--expert-parallel", type=int, default=d.expert_parallel,
                   help="spread each stage's experts over this many of its replicas "
                        "(divides --data-parallel; docs/moe.md)")
    g.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="micro-batches per step")
    g.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size,
                   help="sequences per micro-batch")
    g.add_argument("--schedule", default=d.schedule,
                   help="training schedule name (1f1b, gpipe, interleaved, zb-h1, zb-h2, zbv, "
                        "dualpipev, ...)")
    g.add_argument("--chunks", type=int, default=d.chunks,
                   help="model chunks per stage for interleaved/V schedules (default: the "
                        "schedule's)")
    g.add_argument("--precision", default=d.precision, help="precision policy name")
    g.add_argument("--transport", default=d.transport,
                   help="transport name (default auto: nccl on CUDA, gloo otherwise)")
    g.add_argument("--partition", default=d.partition,
                   help="partition method (parameters, uniform, type:<regex>, ...) or "
                        "explicit layer boundaries such as 0,3,6")
    g.add_argument("--timeout", type=float, default=d.timeout,
                   help="seconds any wait on a peer may take before an error")
    g.add_argument("--threads", type=int, default=d.threads,
                   help="torch threads per local process")


def _train_memory(p: argparse.ArgumentParser, d: Any) -> None:
    """``pipekernel train``'s activation-memory flags (docs/memory.md)."""
    g = p.add_argument_group("activation memory")
    g.add_argument("--recompute", default=d.recompute, metavar="K|K,K,...",
                   help="activation recomputation: a checkpoint interval for every stage or "
                        "one per stage (0: none, 1: every layer; 'all', 'none'); default: "
                        "none, or what --schedule auto chooses under a memory budget")
    g.add_argument("--offload", action="store_true",
                   help="on CUDA, move the saved activations of micro-batches whose backward "
                        "is far away to pinned host memory and fetch them back ahead of it "
                        "(docs/memory.md; a ConfigError on CPU)")


def _train_run(p: argparse.ArgumentParser, d: Any) -> None:
    """``pipekernel train``'s training, model and output flags."""
    g = p.add_argument_group("training")
    g.add_argument("--steps", type=int, default=d.steps, help="optimizer steps")
    g.add_argument("--seed", type=int, default=d.seed, help="seed for weights and data")
    g.add_argument("--lr", type=float, default=d.lr, help="peak AdamW learning rate")
    g.add_argument("--data", default=d.data, metavar="FILE",
                   help="train on this file (default: the Python standard library's sources)")
    g.add_argument("--corpus-bytes", type=int, default=d.corpus_bytes,
                   help="read at most this many bytes of the corpus")
    g.add_argument("--save-every", type=int, default=d.save_every, metavar="N",
                   help="save a checkpoint every N steps (0: never)")
    g.add_argument("--keep-last", type=int, default=d.keep_last, metavar="N",
                   help="after each save, delete all but the N newest global_step checkpoints "
                        "(0: keep all)")
    g.add_argument("--check-every", type=int, default=d.check_every, metavar="N",
                   help="check the run-time invariants (replicas, tied copies, loss "
                        "normalisation, transfers) after every N-th step (0: never)")
    g.add_argument("--verify-every", type=int, default=d.verify_every, metavar="N",
                   help="before every N-th step, replay its batch plainly on every stage and "
                        "compare the gradients (engine.verify_batch; 0: never)")
    g.add_argument("--resume", nargs="?", const=True, default=False, metavar="TAG",
                   help="continue from checkpoint TAG (e.g. global_step100) or, with no TAG, "
                        "from the latest one if there is one")
    g.add_argument("--checkpoint-dir", default=d.checkpoint_dir, metavar="DIR",
                   help="checkpoint directory (default: <out>/checkpoints)")
    g = p.add_argument_group("model")
    g.add_argument("--dim", type=int, default=d.dim, help="model width")
    g.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    g.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    g.add_argument("--context", type=int, default=d.context, help="sequence length in bytes")
    g.add_argument("--experts", type=int, default=d.experts,
                   help="a mixture of this many experts as every block's MLP (0: dense)")
    g.add_argument("--top-k", type=int, default=d.top_k, help="experts per token")
    g.add_argument("--pack", action="store_true",
                   help="pack the corpus's documents (cut at blank lines) into rows, each "
                        "attending within its own documents (docs/sequences.md)")
    g.add_argument("--seq-chunks", type=int, default=d.seq_chunks, metavar="K",
                   help="cut every micro-batch along the sequence into K chunks that flow "
                        "through the stages one after the other (Seq1F1B, --schedule 1f1b; "
                        "docs/sequences.md)")
    g.add_argument("--hf", default=d.hf, metavar="PATH_OR_CONFIG",
                   help="train a Hugging Face causal LM instead: a save_pretrained directory, "
                        "a config (.json or directory) or a model type such as llama (random, "
                        "sized by --dim/--layers/--heads/--context)")
    g = p.add_argument_group("output")
    g.add_argument("--out", default=d.out, metavar="DIR",
                   help="directory for metrics, trace, timeline and summary")
    g.add_argument("--every", type=int, default=d.every,
                   help="with --no-progress, print a metrics line every N steps")
    g.add_argument("--sample-bytes", type=int, default=d.sample_bytes,
                   help="bytes of text to generate at the end (0: none)")
    g.add_argument("--prompt", default=d.prompt, help="prompt for the generated sample")
    g.add_argument("--no-progress", action="store_true", help="no progress bar")


def _run_train(args: argparse.Namespace) -> int:
    from pipekernel.apps.config import TrainConfig
    from pipekernel.apps.train import run

    fields = {f for f in TrainConfig.__dataclass_fields__}
    options = {k: v for k, v in vars(args).items() if k in fields}
    run(TrainConfig(**options, progress=not args.no_progress))
    return 0


# -- pipekernel plan -----------------------------------------------------------------------


def _add_plan(sub: argparse._SubParsersAction) -> None:
    from pipekernel.apps.config import TrainConfig

    d = TrainConfig()
    p = sub.add_parser(
        "plan", help="profile the train model and rank schedule x chunks x micro-batches x "
                     "partition by simulated step time",
        description="What schedule='auto' does, in one process: profile the layers of the "
                    "`pipekernel train` model (one micro-batch size per candidate count, the "
                    "batch fixed), simulate every candidate under the measured costs and "
                    "print them ranked by predicted step time, with the predicted memory of "
                    "the largest stage. Nothing is trained.",
        formatter_class=HelpFormatter)
    p.add_argument("--stages", type=int, default=d.stages, help="pipeline stages")
    p.add_argument("--micro-batches", type=int, default=d.micro_batches,
                   help="the base count: the batch is this x --micro-batch-size sequences")
    p.add_argument("--micro-batch-size", type=int, default=d.micro_batch_size,
                   help="sequences per micro-batch at the base count")
    p.add_argument("--counts", default=None, metavar="M,M,...",
                   help="micro-batch counts to consider (default: half, 1x, 2x, 4x the base)")
    p.add_argument("--schedules", default=None, metavar="NAME,...",
                   help="schedules to consider (default: every training schedule)")
    p.add_argument("--chunks", default="1,2", metavar="C,C,...", help="chunks per stage")
    p.add_argument("--memory-budget", type=_size, default=None, metavar="BYTES",
                   help="bytes per stage (suffixes KiB, MiB, GiB); default: no limit. Over "
                        "it, recomputation is searched per stage (unless --recompute fixes "
                        "it)")
    p.add_argument("--recompute", default="", metavar="K|K,K,...",
                   help="fix activation recomputation: an interval for every stage or one "
                        "per stage (0: none, 1: every layer); default: the planner chooses")
    p.add_argument("--transfer-ms", type=float, default=0.0,
                   help="milliseconds one activation/gradient transfer takes")
    p.add_argument("--split-overhead", type=float, default=1.0,
                   help="split backward (input + weight pass) time over one full backward")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per layer")
    p.add_argument("--top", type=int, default=None, help="show only the best N candidates")
    p.add_argument("--threads", type=int, default=d.threads, help="torch threads")
    p.add_argument("--seed", type=int, default=d.seed, help="seed for weights and the sample")
    g = p.add_argument_group("model")
    g.add_argument("--dim", type=int, default=d.dim, help="model width")
    g.add_argument("--layers", type=int, default=d.layers, help="transformer blocks")
    g.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    g.add_argument("--context", type=int, default=d.context, help="sequence length in bytes")
    p.set_defaults(func=_run_plan)


def _size(text: str) -> float:
    units = {"kib": 2 ** 10, "mib": 2 ** 20, "gib": 2 ** 30, "b": 1}
    lowered = text.strip().lower()
    for unit, factor in units.items():
        if lowered.endswith(unit):
            return float(lowered[:-len(unit)]) * factor
    return float(lowered)


def _ints(text: str | None) -> list[int] | None:
    return None if text is None else [int(v) for v in text.split(",") if v.strip()]


def plan_for_args(args: argparse.Namespace) -> object:
    """The :class:`~pipekernel.engine.planner.Plan` ``pipekernel plan`` prints."""
    import torch

    import pipekernel as pk
    from pipekernel.apps.gpt import gpt_module
    from pipekernel.engine.planner import plan_module
    from pipekernel.extend.manager import make_plugin_manager

    torch.set_num_threads(args.threads)
    module = gpt_module(args.dim, args.layers, args.heads, args.context,
                        num_stages=args.stages, seed=args.seed)
    g = torch.Generator().manual_seed(args.seed)
    sample = torch.randint(0, 256, (args.micro_batch_size, args.context), generator=g)
    # the train model's labels: the next byte of every position (int64, as the loader's)
    request = pk.auto(memory_budget=args.memory_budget, sample=sample,
                      labels=torch.zeros_like(sample),
                      schedules=args.schedules.split(",") if args.schedules else None,
                      chunks=_ints(args.chunks), micro_batches=_ints(args.counts),
                      transfer_s=args.transfer_ms / 1e3, repeats=args.repeats,
                      split_overhead=args.split_overhead)
    from pipekernel.apps.train import recompute_option
    from pipekernel.engine.recompute_option import resolve_recompute

    given = recompute_option(args.recompute)
    fixed = None if given is None else resolve_recompute(given, args.stages, 0)
    return plan_module(module, request, num_stages=args.stages,
                       micro_batches=args.micro_batches, pm=make_plugin_manager(),
                       recompute=fixed)


def train_command(args: argparse.Namespace, plan: object) -> str:
    """The ``pipekernel train`` command line that trains the model ``args`` planned with
    ``plan``'s choice: the same batch (so ``--micro-batch-size`` follows the chosen
    count), the chosen schedule, chunks and boundaries, the same model."""
    import shlex

    from pipekernel.apps.config import TrainConfig

    p: Any = plan
    batch = args.micro_batches * args.micro_batch_size
    argv = ["pipekernel", "train", "--stages", str(args.stages), "--schedule", p.schedule,
            "--chunks", str(p.chunks), "--micro-batches", str(p.micro_batches),
            "--micro-batch-size", str(batch // p.micro_batches),
            "--partition", ",".join(str(b) for b in p.bounds),
            "--dim", str(args.dim), "--layers", str(args.layers), "--heads", str(args.heads),
            "--context", str(args.context)]
    if any(p.recompute):
        argv += ["--recompute", ",".join(str(k) for k in p.recompute)]
    d = TrainConfig()
    for flag in ("seed", "threads"):  # the rest as train's defaults: said only when not
        if getattr(args, flag) != getattr(d, flag):
            argv += [f"--{flag}", str(getattr(args, flag))]
    return shlex.join(argv)


def _run_plan(args: argparse.Namespace) -> int:
    plan = plan_for_args(args)
    print(f"model: byte-level GPT, width {args.dim}, {args.layers} blocks, context "
          f"{args.context}; batch {args.micro_batches * args.micro_batch_size} sequences "
          f"per replica; {args.stages} stages")
    print(plan.format(top=args.top))  # type: ignore[attr-defined]
    print(f"train with it: {train_command(args, plan)}")
    return 0


# -- pipekernel schedule -------------------------------------------------------------------


def _add_schedule(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "schedule", help="simulate a schedule: ASCII grid, bubble fraction, buffers",
        description="Run a schedule on every stage at once in the simulator (no processes, "
                    "no torch work) and show one row per stage and one column per time unit "
                    "(F3 = forward of micro-batch 3, B3 = its backward, . = idle), the bubble "
                    "fraction and the buffers each stage needs.",
        formatter_class=HelpFormatter)
    p.add_argument("name", help="schedule name (1f1b, gpipe, inference, interleaved, zb-h1, "
                                "zb-h2, zbv, dualpipev, or a plugin's)")
    p.add_argument("--stages", type=int, required=True, help="pipeline stages P")
    p.add_argument("--micro-batches", type=int, required=True, help="micro-batches M")
    p.add_argument("--chunks", type=int, default=None,
                   help="model chunks (virtual stages) per rank (default: the schedule's "
                        "default_chunks, e.g. 2 for interleaved, zbv and dualpipev)")
    p.add_argument("--backward-cost", type=float, default=1.0,
                   help="duration of a backward relative to a forward (1 unit)")
    p.add_argument("--png", metavar="FILE", help="also draw the timeline to this PNG")
    p.set_defaults(func=_run_schedule)


def schedule_report(result: object, name: str) -> str:
    """The text ``pipekernel schedule`` prints for a :class:`SimulationResult`."""
    from pipekernel.schedules import format_grid

    r = result
    busy = [sum(end - start for start, end, _ in events) for events in r.timeline]
    lines = [
        f"schedule {name}: {r.num_stages} stage(s) x {r.micro_batches} micro-batch(es) x "
        f"{r.chunks} chunk(s)",
        format_grid(r),
        f"makespan: {r.makespan:g} time units; busy per stage: "
        + ", ".join(f"{b:g}" for b in busy),
        f"bubble fraction: {r.bubble_fraction:.4f} ({100 * r.bubble_fraction:.1f}% idle)",
        "span per stage (first compute to last): " + ", ".join(f"{x:g}" for x in r.spans),
        "buffers per stage: " + ", ".join(f"stage {s}: {n}" for s, n in enumerate(r.buffers)),
    ]
    return "\n".join(lines)


def _run_schedule(args: argparse.Namespace) -> int:
    from pipekernel.schedules.instructions import Backward, BackwardInput, BackwardWeight
    from pipekernel.extend.manager import make_plugin_manager, resolve_schedule
    from pipekernel.schedules import simulate

    cls = resolve_schedule(make_plugin_manager(), args.name)
    costs = {Backward: args.backward_cost, BackwardInput: args.backward_cost / 2,
             BackwardWeight: args.backward_cost / 2}
    chunks = args.chunks if args.chunks is not None else getattr(cls, "default_chunks", 1)
    result = simulate(cls, args.stages, args.micro_batches, chunks, costs=costs)
    print(schedule_report(result, args.name))
    if args.png:
        from pipekernel.apps.timeline import draw_simulation
        path = draw_simulation(result, args.png, title=(
            f"{args.name}: {args.stages} stages, {args.micro_batches} micro-batches, "
            f"{chunks} chunk(s), "
            f"bubble {100 * result.bubble_fraction:.1f}%"))
        print(f"timeline PNG: {path}")
    return 0


# -- pipekernel plugins ----------------------------------------------------------------------


def _add_plugins(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plugins", help="list installed transports, plugins, schedules, precisions, partitions",
        description="List what is installed — transports, plugins, schedules, precision "
                    "policies and partition methods — each with the distribution and version "
                    "it comes from. Transports are listed from entry-point metadata without "
                    "importing them.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.add_argument("--no-autoload", action="store_true",
                   help="do not load third-party plugins (as an embedded host would)")
    p.add_argument("--disable", action="append", default=[], metavar="NAME",
                   help="treat plugin NAME as disabled (repeatable)")
    p.set_defaults(func=_run_plugins)


def _run_plugins(args: argparse.Namespace) -> int:
    from pipekernel.extend.inventory import format_inventory, inventory

    found = inventory(autoload=False if args.no_autoload else None, disabled=args.disable)
    print(format_inventory(found, as_json=args.json))
    return 0


# -- pipekernel convert-deepspeed -------------------------------------------------------------


def _add_convert_deepspeed(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "convert-deepspeed", help="write a DeepSpeed pipeline checkpoint in pipekernel's format",
        description="Convert the checkpoint DeepSpeed's pipeline engine saved under DS_DIR "
                    "(DS_DIR/latest or --tag) into a pipekernel checkpoint under PK_DIR: "
                    "weights, LR scheduler, counters and client state (the optimizer state "
                    "needs the model: engine.load_checkpoint(DS_DIR) converts it too). "
                    "See docs/deepspeed.md.")
    p.add_argument("ds_dir", metavar="DS_DIR")
    p.add_argument("pk_dir", metavar="PK_DIR")
    p.add_argument("--tag", default=None, help="the tag to convert (default: DS_DIR/latest)")
    p.add_argument("--num-layers", type=int, default=None, metavar="N",
                   help="the model's layer count, when its last layers have no weights "
                        "(default: the highest layer file + 1)")
    p.add_argument("--trust-checkpoint", action="store_true",
                   help="unpickle the files fully, running whatever code they name: only "
                        "for a checkpoint from a source you trust (default: data only; "
                        "docs/checkpoints.md)")
    p.set_defaults(func=_run_convert_deepspeed)


def _run_convert_deepspeed(args: argparse.Namespace) -> int:
    from pipekernel.deepspeed import convert
    from pipekernel.errors import UntrustedCheckpointError

    try:
        print(convert(args.ds_dir, args.pk_dir, args.tag, num_layers=args.num_layers,
                      trust_checkpoint=args.trust_checkpoint))
    except UntrustedCheckpointError as err:
        err.hint = ("if the checkpoint comes from a source you trust, add --trust-checkpoint; "
                    "otherwise do not convert it")
        raise
    return 0


# -- the command -----------------------------------------------------------------------------

#: One function per subcommand; each adds its parser and sets ``func``.
SUBCOMMANDS = [_add_train, _add_plan, _add_schedule, _add_plugins, _add_convert_deepspeed]


def build_parser() -> argparse.ArgumentParser:
    from pipekernel import __version__

    parser = argparse.ArgumentParser(
        prog="pipekernel", description="pipekernel: pipeline-parallel training for PyTorch")
    parser.add_argument("--version", action="version", version=f"pipekernel {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return parser


def _reader_left() -> int:
    """The reader of our output went away (``pipekernel schedule ... | head -1``): stop
    quietly with 128 + SIGPIPE, what a shell reports for a tool that SIGPIPE ended.

    Standard output is pointed at ``/dev/null`` first, so the interpreter's own flush
    at exit does not fail again and print a traceback of its own."""
    import os
    import signal

    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)
    except (OSError, ValueError):  # no real descriptor (captured): nothing left to flush
        pass
    return 128 + int(getattr(signal, "SIGPIPE", 13))


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``pipekernel`` console script; returns the exit status."""
    from pipekernel.errors import PipelineError

    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader that left is then caught below
        return status
    except BrokenPipeError:
        return _reader_left()
    except PipelineError as err:
        # a user-caused error: its message says what, where and how to fix; no traceback
        original = getattr(err, "original", None)
        shown = original if isinstance(original, PipelineError) else err
        print(f"pipekernel {args.command}: error: {shown}", file=sys.stderr)
        return 1
    except KeyboardInterrupt as err:
        print(f"pipekernel {args.command}: interrupted" + (f": {err}" if str(err) else ""),
              file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
