"""A stage's transfers: what the runtime posts by the program, waits on and hands off.

Talks to peers only through a :class:`~pipekernel.comm.transport.Transport`, and posts
communication by the :class:`~pipekernel.schedules.program.Program` the engine gives it
(read, never changed or cached here; :meth:`Transfers.bind` makes its channels and groups
once per program): each
posting point's sends and receives go out as one group (``batch_isend_irecv``), receives
ahead of the compute that needs them, and a receive is waited on only at its own
instruction. Sends never block compute: a send is waited (its buffer freed) once this stage
knows its peer posted the matching receive — an activation's when its gradient arrives, the
others at their release point (:mod:`~pipekernel.schedules.send_release`: a message the peer
posted after that receive arrived) — else when the batch ends.
Transfers between two chunks of this stage are hand-offs (no transport). Skip connections
are transfers like the others.

It knows no buffers: what a posted send carries and what a received object stands for are
the runtime's (``payload``, given at construction, and ``arrived``, per batch).
"""
from __future__ import annotations

from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

from pipekernel.comm.wire import Channel
from pipekernel.errors import PipelineError
from pipekernel.nested import map_tensors
from pipekernel.schedules import instructions as isa
from pipekernel.schedules.send_release import release_points
from pipekernel.schedules.program import Program

__all__ = ["Transfers"]

#: How a send names what it carries in errors (the kernel adds stage and micro-batch).
_WHAT: dict[type, str] = {isa.SendActivation: "outputs", isa.SendGrad: "input gradients",
         isa.SendSkip: "stashed skip values", isa.SendSkipGrad: "skip gradients"}


class Transfers:
    """The point-to-point traffic of one stage.

    :param transport: the communication backend (``batch_isend_irecv``, ``control``).
    :param stage_rank: ``stage -> global rank`` of this pipeline's ranks.
    :param payload: ``payload(instruction)``: what the posted send ``instruction`` carries.
    """

    def __init__(self, transport: Any, stage_rank: Callable[[int], int],
                 payload: Callable[[Any], Any]) -> None:
        self.transport = transport
        self._stage_rank, self._payload = stage_rank, payload
        self._arrived: Callable[[Any, Any], Any] | None = None  # the batch's (begin())
        self._channels: dict[tuple[type, int, int | None], Channel] = {}
        # the batch's (the engine's, read only): begin() sets it before any other call
        self._program: Program = None  # type: ignore[assignment]
        self._by_index: Sequence[Any] = ()  # its channel of each stream index (bind())
        self._recvs: dict[int, Any] = {}   # stream index -> PendingRecv
        # sends in flight as (op, handle): an activation's by its (micro-batch, chunk),
        # waited when its gradient arrives (settle()); the others oldest first
        self._acts: dict[tuple | int, list[tuple]] = {}
        self._sends: deque[tuple] = deque()
        self._local: dict[int, Any] = {}   # receive's stream index -> hand-off to it
        # per stream index: the sends (their _acts keys) waited once the receive there arrived
        self._release: Sequence[tuple[int, ...]] = ()

    def bind(self, program: Program, programs: Sequence[Program] = ()) -> tuple[
            tuple[Channel | None, ...], tuple[tuple, ...], tuple[tuple[int, ...], ...]]:
        """``(channels, groups)`` of ``program`` here: per stream index, the channel of a
        remote transfer (one per channel key, made on first use and shared by every program
        of this stage) and the group posted there as ``(index, is_send, channel, what,
        key)``, ``key`` the ``(micro-batch, chunk)`` of an activation send whose gradient
        returns, the stream index of another send with a release point, else ``None``; and
        the release points (per stream index, the sends waited once the receive there
        arrived) from ``programs``, every stage's (``()``: none)."""
        mine = [self._channel(spec) for spec in program.channels]
        channels = tuple(None if number is None else mine[number]
                         for number in program.channel_of)
        stream, spec = program.stream, program.channels
        # only an activation whose gradient comes back in this program is settled by it;
        # the others (inference) are freed oldest first like every other send
        returns = {(i.micro_batch, i.chunk) for i in stream if isinstance(i, isa.RecvGrad)}
        points = release_points(programs, program.stage) if programs else {}
        keys = [[_key(stream[index], returns, index) for index in group]
                for group in program.posts]
        # a send settled by its gradient (a tuple key) is not released again
        released = {k for group in keys for k in group if k.__class__ is int}
        release = tuple(tuple(j for j in points.get(i, ()) if j in released)
                        for i in range(len(stream)))
        waited = {j for js in release for j in js}  # the others: freed oldest first
        keys = [[k if k.__class__ is not int or k in waited else None for k in group]
                for group in keys]
        groups = tuple(tuple((index, spec[program.channel_of[index]].send,  # type: ignore[index]
                              channels[index], _WHAT.get(type(stream[index]), "value"), key)
                             for index, key in zip(group, group_keys))
                       for group, group_keys in zip(program.posts, keys))
        return channels, groups, release

    def begin(self, program: Program, channels: Sequence[Channel | None],
              arrived: Callable[[Any, Any], Any] | None = None,
              release: Sequence[tuple[int, ...]] = ()) -> None:
        """Start a batch running ``program`` with its ``channels`` (:meth:`bind`'s); the
        sends of the last batch waited for. ``arrived(instruction, obj)``: what a received
        ``obj`` stands for (``None``: itself). ``release``: per stream index, the sends to
        wait once the receive there arrived (:meth:`bind`'s; ``()``: none)
        (:func:`~pipekernel.schedules.send_release.release_points`)."""
        self.flush()
        self._program, self._by_index, self._recvs, self._local = program, channels, {}, {}
        self._arrived = arrived
        self._release = release or ((),) * len(program.stream)

    def _channel(self, spec: Any) -> Channel:
        """The channel of ``spec`` (a :class:`~pipekernel.schedules.program.ChannelSpec`),
        made on first use."""
        channel = self._channels.get(spec.key)
        if channel is None:
            channel = Channel(self.transport, self._stage_rank(spec.peer_stage), tag=spec.lane)
            self._channels[spec.key] = channel
        return channel

    def post(self, group: Sequence[tuple]) -> None:
        """Post one group: every op of ``group`` on the data lane in one call (and the
        headers on the control lane, when the transport has one, just before)."""
        data: list[Any] = []
        control: list[Any] = []
        spans = []
        stream = self._program.stream
        for index, is_send, channel, what, key in group:
            if is_send:
                ops, ctrl = channel.send_ops(self._payload(stream[index]), what)
                spans.append((None, key, ops, ctrl))
            else:
                pending = channel.recv_ops()
                self._recvs[index] = pending
                ops, ctrl = pending.ops, pending.control_ops
                spans.append((pending, None, ops, ctrl))
            data += ops
            control += ctrl
        # zip(ops, handles) takes exactly one handle per op from the shared iterator
        control_handles = iter(self.transport.control.batch_isend_irecv(control)) \
            if control else ()
        handles = iter(self.transport.batch_isend_irecv(data)) if data else ()
        # drop the oldest sends that completed (wait() re-raises a failed one), so a send
        # buffer lives about as long as its transfer: a query, no device sync
        sends = self._sends
        while sends and sends[0][1].is_completed():
            sends.popleft()[1].wait()
        for pending, key, ops, ctrl in spans:
            if pending is None:
                if key.__class__ is int:  # one send per release key: no merging (fewer calls)
                    entries = self._acts[key] = [*zip(ops, handles)]
                    if ctrl:
                        entries += zip(ctrl, control_handles)
                    continue
                sink = self._sends if key is None else self._acts.setdefault(key, [])
                sink.extend(zip(ops, handles))
                if ctrl:
                    sink.extend(zip(ctrl, control_handles))
            else:
                pending.handles = [h for _, h in zip(ops, handles)]
                pending.control_handles = [h for _, h in zip(ctrl, control_handles)] \
                    if ctrl else []

    def receive(self, index: int, instruction: isa.MicroBatchInstruction) -> Any:
        """What the receive ``instruction`` at stream ``index`` brought (waited for here)."""
        if self._program.local[index]:
            if index not in self._local:
                raise PipelineError(f"{instruction} comes before the matching send on this "
                                    "stage",
                                    hint="check the schedule with pipekernel.schedules.simulate")
            return self._local.pop(index)
        obj = self._by_index[index].finish(self._recvs.pop(index))
        released = self._release[index]
        if released:  # the peer posted their receives before what just arrived: no blocking
            acts = self._acts
            for send in released:
                entries = acts[send]  # held() keeps the key, so it is there
                del acts[send]
                for _, handle in entries:
                    handle.wait()
        return obj if self._arrived is None else self._arrived(instruction, obj)

    def send(self, index: int, obj: Any) -> None:
        """The send at stream ``index`` of ``obj``: a hand-off to a chunk of this stage is
        kept for the receive it fills; a remote one was posted with its group."""
        program = self._program
        if program.local[index]:
            fills = program.handoffs[index]
            if fills is not None:
                self._local[fills] = _detach_like(obj)

    def flush(self) -> None:
        """Wait for every send still in flight."""
        sends, acts = self._sends, self._acts
        self._sends, self._acts = deque(), {}
        for _, handle in sends:
            handle.wait()
        for entries in acts.values() if acts else ():
            for _, handle in entries:
                handle.wait()

    def settle(self, what: tuple | int) -> None:
        """Wait for the sends of ``what``: ``(micro-batch, chunk)`` of an activation whose
        gradient just arrived (the peer computed that gradient from them, so they were
        received and ``wait`` returns at once), or the stream index of a send whose receive
        the peer has posted (its release point). A gloo send reports ``is_completed()``
        only after ``wait()``, so without this every send stayed in memory until the
        step's end (under 1F1B, a stage's memory grew with the micro-batch count)."""
        entries = self._acts.pop(what, None)
        if entries:
            for _, handle in entries:
                handle.wait()

    def held(self) -> list[Any]:
        """Send buffers whose transfer has not completed, posted receives and hand-offs."""
        for handle in [h for _, h in self._sends if h.is_completed()]:
            handle.wait()
        self._sends = deque(s for s in self._sends if not s[1].is_completed())
        for key, entries in list(self._acts.items()):
            left = [s for s in entries if not s[1].is_completed()]
            if left or key.__class__ is int:  # a release point finds its key (receive())
                self._acts[key] = left
            else:
                del self._acts[key]
        sends = list(self._sends) + [s for entries in self._acts.values() for s in entries]
        return [op.tensor for op, _ in sends] + list(self._recvs.values()) \
            + list(self._local.values())

    def abandon(self) -> None:
        """Forget every transfer in flight after a failure (nothing waits on them any
        more; the process group is destroyed by the transport's ``close()``)."""
        self._sends, self._acts, self._recvs, self._local = deque(), {}, {}, {}

    def payload_bytes(self) -> dict[str, int]:
        """Tensor bytes sent to peers so far, by dtype name."""
        total: dict[str, int] = {}
        for channel in self._channels.values():
            for name, count in channel.payload.items():
                total[name] = total.get(name, 0) + count
        return total


def _key(instruction: Any, returns: set[tuple], index: int) -> tuple | int | None:
    """What a send is held by: the ``(micro-batch, chunk)`` of an activation whose gradient
    ``returns`` (the program's ``RecvGrad``s; :meth:`Transfers.settle` waits it); for another
    send its stream ``index`` (waited at its release point, if it has one, else ``None``:
    freed oldest first once complete); ``None`` for receives."""
    if isinstance(instruction, isa.SendActivation):
        key = (instruction.micro_batch, instruction.chunk)
        if key in returns:
            return key
    return index if isinstance(instruction, (isa.SendActivation, isa.SendGrad)) else None


def _detach_like(obj: Any) -> Any:
    """A hand-off to another chunk of this stage: new autograd leaves sharing storage."""
    return map_tensors(lambda t: t.detach().requires_grad_(t.requires_grad), obj)
