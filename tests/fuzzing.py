"""A differential fuzzer: whole training setups drawn with hypothesis, trained by pipekernel
and by one process with gradient accumulation (:func:`pipekernel.testing.reference_train`).

A *setup* is a JSON-able dict (model layer kinds, data, schedule, stages, chunks,
micro-batches, replicas, checkpointing, loss reduction, clipping, optimizer); everything
else is built from it, on the ranks and in the reference, so a setup printed is its own
reproducer. Setups of one world size run one after another in one process world
(:func:`run_setups`); a refusal or error ends that world's list and the rest go to a new
world. The verdict of each (:func:`judge`):

* ``ok``: every rank's losses and parameters equal the reference (fp32: 1e-5 relative);
* ``refused``: the engine refused the combination by name (``ConfigError`` or
  ``ScheduleError``: what is not supported; ``DataError``: data it cannot take);
* ``mismatch``: trained, but differently from one process: a bug;
* ``error``: anything else (another exception, a hang, a reference that fails where the
  pipeline trained): a bug too.

Used by tests/test_fuzz.py (a seeded slice) and benchmarks/fuzz.py (the long run, with
shrinking of what fails). See docs/fuzzing.md.
"""
from __future__ import annotations

import json
import traceback
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch
from fuzz_layers import KINDS, build_layers
from hypothesis import HealthCheck, Phase, given, settings, strategies as st
from hypothesis import seed as hypothesis_seed
from torch import nn
from torch.nn import functional as F

import pipekernel as pk
from pipekernel.errors import ConfigError, DataError, PipelineError, ScheduleError
from pipekernel.extend.manager import make_plugin_manager, registered_schedules
from pipekernel.testing import assert_parity, reference_train, run_ranks

STEPS, VOCAB, FEATURES, OUTPUTS = 2, 11, 4, 3
#: every schedule the plugin manager knows (``inference`` included: training with it must
#: be refused by name)
SCHEDULES = sorted(registered_schedules(make_plugin_manager()))
#: what the engine may say instead of training: it does not support the combination
REFUSALS = (ConfigError, ScheduleError, DataError)


@st.composite
def setups(draw: Callable, schedule: str | None = None) -> dict[str, Any]:
    """One training setup (a JSON-able dict) with ``schedule`` (``None``: drawn too);
    hypothesis shrinks toward the first option of each choice: 2 stages, 1 replica, the
    default chunks, plain Linear blocks."""
    stages = draw(st.sampled_from([2, 2, 2, 4]))
    inputs = draw(st.sampled_from(["dense", "tokens", "dict"]))
    labels = draw(st.sampled_from(["regression", "classes"]))
    return {
        "stages": stages, "dp": draw(st.sampled_from([1, 2])) if stages == 2 else 1,
        "schedule": schedule or draw(st.sampled_from(SCHEDULES)),
        "chunks": draw(st.sampled_from([None, None, None, None, None, 1, 2, 3])),
        # any count, or a multiple of the stages (what interleaved and V schedules need)
        # (4 first: hypothesis's first draws and shrinks go to the first choice, and the
        # V schedules refuse fewer than 3 or 2 x stages)
        "micro_batches": draw(st.one_of(st.sampled_from([4, 1, 2, 3, 5, 6]),
                                        st.integers(1, 3).map(lambda k: k * stages))),
        # the second step's count, if it changes (train_batch(..., micro_batches=n))
        "ramp": draw(st.sampled_from([None, None, None, 1, 2, 4, 6])),
        # an eval_batch between the steps, which must change nothing the training sees
        "eval_between": draw(st.booleans()),
        "partition": draw(st.sampled_from(["uniform", "parameters"])),
        "width": draw(st.sampled_from([8, 12, 16])),
        "kinds": draw(st.lists(st.sampled_from(KINDS), min_size=2, max_size=8)),
        "wire_dtype": draw(st.sampled_from(["float64", "bfloat16", "float32"])),
        "inputs": inputs, "labels": labels,
        "input_dtype": draw(st.sampled_from(
            ["int64", "int32"] if inputs == "tokens" else ["float32", "float64", "bfloat16"])),
        "tie_embed": inputs == "tokens" and labels == "classes" and draw(st.booleans()),
        "vary_length": draw(st.booleans()),
        "ignore": draw(st.sampled_from([0.0, 0.3])) if labels == "classes" else 0.0,
        "checkpoint": draw(st.sampled_from([0, 0, 1, 2])),
        "loss_reduction": draw(st.sampled_from(["mean", "tokens"])),
        "max_grad_norm": draw(st.sampled_from([None, 0.05, 10.0])),
        "optimizer": draw(st.sampled_from(["sgd", "adamw"])),
        "seed": draw(st.integers(0, 999)),
    }


def key(setup: dict[str, Any]) -> str:
    """The setup as one line of JSON (its identity and its reproducer)."""
    return json.dumps(setup, sort_keys=True)


# -- the model, the loss and the data a setup describes ------------------------------------

class DenseInput(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.lin = nn.Linear(FEATURES, dim)

    def forward(self, x):
        return self.lin(x.float())


class DictInput(DenseInput):
    """A dict batch, as a Hugging Face collator makes one: ``{"x", "mask"}``."""

    def forward(self, batch):
        return super().forward(batch["x"]) * batch["mask"].unsqueeze(-1)


def _embed_head(embedding: nn.Embedding, h: torch.Tensor) -> torch.Tensor:
    return h @ embedding.weight.t()


def _ends(setup: dict[str, Any]) -> tuple[Any, Any]:
    dim = setup["width"]
    if setup["tie_embed"]:
        return (pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, dim),
                pk.TiedLayerSpec("embed", nn.Embedding, VOCAB, dim, forward_fn=_embed_head))
    first = {"dense": pk.LayerSpec(DenseInput, dim), "dict": pk.LayerSpec(DictInput, dim),
             "tokens": pk.LayerSpec(nn.Embedding, VOCAB, dim)}[setup["inputs"]]
    return first, pk.LayerSpec(nn.Linear, dim, OUTPUTS if setup["labels"] == "regression"
                               else VOCAB)


def mse_mean(out, labels):
    return F.mse_loss(out, labels)


def mse_tokens(out, labels):
    return F.mse_loss(out, labels, reduction="sum"), labels.numel()


def ce_mean(logits, labels):
    return F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)


def ce_tokens(logits, labels):
    flat = labels.reshape(-1)
    loss = F.cross_entropy(logits.reshape(-1, VOCAB), flat, ignore_index=-100, reduction="sum")
    return loss, (flat != -100).sum()


LOSSES = {("regression", "mean"): mse_mean, ("regression", "tokens"): mse_tokens,
          ("classes", "mean"): ce_mean, ("classes", "tokens"): ce_tokens}


def build_module(setup: dict[str, Any], num_stages: int | None = None) -> pk.PipelineModule:
    """The model of ``setup`` (``num_stages=None``: for the one-process reference)."""
    first, head = _ends(setup)
    layers = [first, *build_layers(setup["kinds"], setup["width"], setup["wire_dtype"],
                                   setup["dp"]), head]
    return pk.PipelineModule(layers, loss_fn=LOSSES[setup["labels"], setup["loss_reduction"]],
                             num_stages=num_stages, partition=setup["partition"],
                             seed=setup["seed"],
                             activation_checkpoint_interval=setup["checkpoint"])


def _item(setup: dict[str, Any], g: torch.Generator, length: int) -> tuple[Any, Any]:
    batch = 2
    if setup["inputs"] == "tokens":
        inputs = torch.randint(0, VOCAB, (batch, length), generator=g).to(
            getattr(torch, setup["input_dtype"]))
    else:
        inputs = torch.randn(batch, length, FEATURES, generator=g).to(
            getattr(torch, setup["input_dtype"]))
        if setup["inputs"] == "dict":
            inputs = {"x": inputs, "mask": torch.rand(batch, length, generator=g) > 0.2}
    if setup["labels"] == "regression":
        return inputs, torch.randn(batch, length, OUTPUTS, generator=g)
    labels = torch.randint(0, VOCAB, (batch, length), generator=g)
    ignored = torch.rand(batch, length, generator=g) < setup["ignore"]
    ignored[0, 0] = False  # at least one counted label per micro-batch
    return inputs, labels.masked_fill(ignored, -100)


def counts(setup: dict[str, Any]) -> list[int]:
    """The micro-batch count of each step."""
    ramp = setup.get("ramp")
    return [setup["micro_batches"]] + [ramp or setup["micro_batches"]] * (STEPS - 1)


def data(setup: dict[str, Any], step: int, replica: int) -> list[tuple[Any, Any]]:
    """The micro-batches of one step of one replica (lengths vary if the setup says so)."""
    g = torch.Generator().manual_seed(setup["seed"] * 7919 + 1000 * step + replica)
    count = counts(setup)[step] if step < STEPS else setup["micro_batches"]  # 99: eval
    lengths = (torch.randint(2, 6, (count,), generator=g).tolist()
               if setup["vary_length"] else [3] * count)
    return [_item(setup, g, n) for n in lengths]


def sgd(params):
    return torch.optim.SGD(params, lr=0.05, momentum=0.9)


def adamw(params):
    # eps 1e-3, not 1e-8: Adam's first step divides each gradient by its own size, so
    # fp32 round-off on a gradient that cancels to ~1e-8 (another summation order across
    # replicas, or a token rescale after accumulation) would become an lr-sized difference
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


OPTIMIZERS = {"sgd": sgd, "adamw": adamw}


# -- running setups on ranks ---------------------------------------------------------------

def train_setup(setup: dict[str, Any]) -> tuple:
    """One rank's part of one setup: ``("ok", losses, state)``, ``("refused", error class,
    message)``, ``("aborted", ...)`` (a PipelineError that names no refusal: a peer's
    failure, a timeout) or ``("error", exception class, traceback)``."""
    engine = None
    try:
        engine = pk.PipelineEngine(
            build_module(setup, setup["stages"]), optimizer=OPTIMIZERS[setup["optimizer"]],
            micro_batches=setup["micro_batches"], schedule=setup["schedule"],
            chunks=setup["chunks"], data_parallel_size=setup["dp"], timeout=30, transport="gloo",
            max_grad_norm=setup["max_grad_norm"], loss_reduction=setup["loss_reduction"],
            check_every=1)  # the sentinel after every step: a false alarm is an error
        losses = []
        for step, count in enumerate(counts(setup)):
            if step and setup.get("eval_between"):
                engine.eval_batch(iter(data(setup, 99, engine.data_parallel_rank)))
            losses.append(engine.train_batch(iter(data(setup, step, engine.data_parallel_rank)),
                                             micro_batches=count).item())
        state = {k: v.detach().clone() for k, v in engine.module.state_dict().items()}
        return "ok", losses, state
    except REFUSALS as err:
        return "refused", type(err).__name__, str(err)
    except PipelineError as err:
        return "aborted", type(err).__name__, traceback.format_exc()
    except Exception as err:  # what the fuzzer looks for: reported, never raised
        return "error", type(err).__name__, traceback.format_exc()
    finally:
        if engine is not None:
            try:
                engine.close()
            except Exception:
                pass  # a failed run's close: the outcome above says what happened


def world_worker(setups: list[dict[str, Any]]) -> list[tuple]:
    """Run ``setups`` in order on this rank; stop after the first that neither trains nor
    is refused (what a failed engine left behind may not be fit for the next setup)."""
    outcomes = []
    for setup in setups:
        outcomes.append(train_setup(setup))
        if outcomes[-1][0] not in ("ok", "refused"):
            break
    return outcomes


def run_setups(setups: list[dict[str, Any]], timeout_each: float = 90.0,
               progress: Callable[[str], None] | None = None) -> dict[str, list[tuple]]:
    """``{key(setup): [outcome of each rank]}`` for every setup: one world per world size
    (a new one after a setup that did not train)."""
    results: dict[str, list[tuple]] = {}
    for world in sorted({s["stages"] * s["dp"] for s in setups}):
        pending = [s for s in setups if s["stages"] * s["dp"] == world]
        while pending:
            try:
                per_rank = run_ranks(world_worker, world, pending,
                                     timeout=60 + timeout_each * len(pending))
            except Exception as err:  # the world itself failed: blame its first setup
                results[key(pending[0])] = [("error", type(err).__name__, str(err))]
                pending = pending[1:]
                continue
            done = min(len(r) for r in per_rank)
            for i in range(done):
                results[key(pending[i])] = [r[i] for r in per_rank]
            if progress is not None:
                progress(f"world of {world}: {done} setups")
            pending = pending[max(done, 1):] if done else pending[1:]
    return results


# -- the oracle ------------------------------------------------------------------------------

def reference(setup: dict[str, Any]) -> tuple[list[float], dict[str, torch.Tensor]]:
    """One process, the same work, gradient accumulation (and the same clipping)."""
    batches = [[data(setup, step, r) for r in range(setup["dp"])] for step in range(STEPS)]
    clip = setup["max_grad_norm"]
    hook = None if clip is None else (
        lambda model: torch.nn.utils.clip_grad_norm_(model.parameters(), clip))
    torch.manual_seed(0)
    return reference_train(build_module(setup), OPTIMIZERS[setup["optimizer"]], batches,
                           counts(setup), hook=hook,
                           loss_reduction=setup["loss_reduction"])


def judge(setup: dict[str, Any], outcomes: list[tuple]) -> tuple[str, str]:
    """``(verdict, detail)``: ok, refused, mismatch or error (see the module docstring)."""
    if all(o[0] == "ok" for o in outcomes):
        return _compare(setup, outcomes)
    failed = [(rank, o) for rank, o in enumerate(outcomes) if o[0] != "ok"]
    named = [(rank, o) for rank, o in failed if o[0] == "refused"]
    if named and not any(o[0] == "error" for _, o in failed):
        rank, (_, name, message) = named[0]
        return "refused", f"{name}: {message.splitlines()[0]}"
    rank, (_, name, text) = next(((r, o) for r, o in failed if o[0] == "error"), failed[0])
    try:
        reference(setup)
        blame = ""
    except Exception as err:  # a broken draw, not a pipeline bug: say so
        blame = f"(the one-process reference fails too, with {type(err).__name__}: {err})\n"
    return "error", f"{blame}rank {rank}: {name}: {text}"


def _compare(setup: dict[str, Any], outcomes: list[tuple]) -> tuple[str, str]:
    try:
        ref_losses, ref_state = reference(setup)
    except Exception:
        return "error", "the pipeline trained but the reference failed:\n" + \
            traceback.format_exc()
    covered: set[str] = set()
    for rank, (_, losses, state) in enumerate(outcomes):
        try:
            assert_parity(losses, ref_losses, state, ref_state, rtol=1e-5, atol=1e-6)
        except AssertionError as err:
            return "mismatch", f"rank {rank}: {err}"
        covered |= set(state)
    if covered != set(ref_state):
        return "mismatch", f"no rank holds {sorted(set(ref_state) - covered)}"
    return "ok", ""


def features(setup: dict[str, Any]) -> list[str]:
    """What a setup covers, for the coverage counts."""
    out = [f"schedule={setup['schedule']}", f"stages={setup['stages']}", f"dp={setup['dp']}",
           f"chunks={setup['chunks']}", f"micro_batches={setup['micro_batches']}",
           f"inputs={setup['inputs']}", f"labels={setup['labels']}",
           f"loss_reduction={setup['loss_reduction']}", f"checkpoint={setup['checkpoint']}",
           f"max_grad_norm={setup['max_grad_norm']}", f"optimizer={setup['optimizer']}",
           f"input_dtype={setup['input_dtype']}", f"ramp={setup.get('ramp')}"]
    out += [f"layer={k}" for k in sorted(set(setup["kinds"]))]
    out += [flag for flag in ("tie_embed", "vary_length", "eval_between") if setup.get(flag)]
    return out + (["ignore=-100"] if setup["ignore"] else [])


def strata(seed: int, count: int) -> list[tuple[str, int, int]]:
    """``(schedule, hypothesis seed, setups)`` of each schedule's share of a run: hypothesis
    explores around what it drew before, so one draw over every choice covers a few
    schedules many times; each schedule gets a draw of its own (and ``inference``, which
    only has to be refused, a small one)."""
    training = [name for name in SCHEDULES if name != "inference"]
    refused = [name for name in SCHEDULES if name == "inference"]
    small = max(1, count // 20) if refused else 0
    share, extra = divmod(count - small, len(training))
    sizes = [share + (i < extra) for i in range(len(training))] + ([small] if refused else [])
    # one more each: a draw's first setup is hypothesis's simplest, dropped (draw_setups)
    return [(name, seed * 1_000 + i, n + 1)
            for i, (name, n) in enumerate(zip(training + refused, sizes)) if n]


def _hypothesis(schedule: str, seed: int, count: int, prop: Callable, shrinking: bool) -> None:
    phases = [Phase.generate, Phase.shrink] if shrinking else [Phase.generate]
    settings(max_examples=count, database=None, deadline=None, phases=phases,
             suppress_health_check=list(HealthCheck), report_multiple_bugs=False)(
        hypothesis_seed(seed)(given(setups(schedule))(prop)))()


def draw_setups(seed: int, count: int) -> list[dict[str, Any]]:
    """About ``count`` setups drawn by hypothesis from ``seed``, every schedule in turn
    (duplicates dropped)."""
    per_schedule: list[list[dict[str, Any]]] = []
    for schedule, sub_seed, n in strata(seed, count):
        drawn: dict[str, dict[str, Any]] = {}
        _hypothesis(schedule, sub_seed, n, lambda setup: drawn.update({key(setup): setup}),
                    False)
        per_schedule.append(list(drawn.values())[1:])  # not the simplest: see strata()
    mixed = [group[i] for i in range(max(map(len, per_schedule), default=0))
             for group in per_schedule if i < len(group)]
    return list({key(s): s for s in mixed}.values())


def minimise(seed: int, count: int, verdicts: dict[str, tuple[str, str]], budget: int = 40
           ) -> tuple[dict[str, Any], tuple[str, str]] | None:
    """Hypothesis's minimal failing setup of the run ``(seed, count)``: it draws the
    schedule's share of the run again (their verdicts known) and shrinks the first that
    failed, running each smaller candidate in its own world (at most ``budget`` of them)."""
    failing: list[tuple[dict[str, Any], tuple[str, str]]] = []
    runs = [0]

    def prop(setup):
        k = key(setup)
        if k not in verdicts:
            if runs[0] >= budget:
                return  # out of budget: treated as passing, which ends the shrink
            runs[0] += 1
            verdicts[k] = judge(setup, run_setups([setup])[k])
        if verdicts[k][0] in ("mismatch", "error"):
            failing.append((setup, verdicts[k]))
            raise AssertionError(verdicts[k][1])

    bad = {json.loads(k)["schedule"] for k, v in verdicts.items()
           if v[0] in ("mismatch", "error")}
    for schedule, sub_seed, n in strata(seed, count):
        if schedule in bad:
            try:
                _hypothesis(schedule, sub_seed, n, prop, True)
            except Exception:
                pass  # the failure found: recorded in `failing`
            return failing[-1] if failing else None
    return None


def summary(setups: list[dict[str, Any]], verdicts: dict[str, tuple[str, str]]) -> str:
    """Coverage and outcome counts, and every refusal reason, as text."""
    kinds = Counter(verdicts[key(s)][0] for s in setups)
    lines = [f"setups: {len(setups)}  " + "  ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))]
    cover = Counter(f for s in setups for f in features(s))
    trained = Counter(f for s in setups if verdicts[key(s)][0] == "ok" for f in features(s))
    lines.append("coverage (drawn / trained and equal to one process):")
    lines += [f"  {f:<28} {n:>5} / {trained[f]}" for f, n in sorted(cover.items())]
    reasons = Counter(verdicts[key(s)][1][:150] for s in setups
                      if verdicts[key(s)][0] == "refused")
    lines.append("refusals (by name):")
    lines += [f"  {n:>4} x {reason}" for reason, n in reasons.most_common()]
    return "\n".join(lines)
