"""Writes a checkpoint the way pipekernel wrote sharded stages before issue 45 (one
``torch.distributed.checkpoint`` directory in the tag, ``"format": "dcp"`` in
``meta.json``): the fixture behind the tests that such directories stay readable. Not part
of the product, which writes one format (docs/checkpoints.md, "One writer")."""
from __future__ import annotations

import json
import os
import shutil
from typing import Any

from pipekernel.engine import checkpoint as ckpt
from pipekernel.engine import checkpoint_dcp
from pipekernel.engine.checkpoint_files import FORMAT_VERSION, _write_file, rank_file
from pipekernel.engine.checkpoint_layout import layout, on_every_rank

__all__ = ["save_dcp"]


def _meta(engine: Any) -> bytes:
    meta = ckpt._meta(engine)
    for entry in meta["layers"]:
        entry.pop("file", None)  # the tensors are in dcp/, not in layer files
    meta.update(format=checkpoint_dcp.FORMAT, format_version=FORMAT_VERSION,
                topology=layout(engine),
                files=sorted([f"{checkpoint_dcp.DCP_DIR}/.metadata"]
                             + [rank_file(r) for r in range(engine.transport.world_size)]))
    return json.dumps(meta, indent=1).encode()


def save_dcp(engine: Any, root: str, tag: str, client_state: Any = None) -> str:
    """Every rank: ``root/tag`` as a DCP checkpoint of ``engine``, ``latest`` pointing at it."""
    import torch.distributed.checkpoint as dcp

    rank, transport = engine.rank, engine.transport
    final, tmp = os.path.join(root, tag), os.path.join(root, f".tmp-{tag}")
    engine.runtime.flush()
    state, _ = checkpoint_dcp._state(engine)
    mine = ckpt._rank_payload(engine, client_state)
    meta = _meta(engine) if rank == 0 else None
    if rank == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(os.path.join(tmp, checkpoint_dcp.DCP_DIR))
    on_every_rank(transport, lambda: None)  # a barrier
    if meta is not None:
        _write_file(os.path.join(tmp, "meta.json"), meta)
    _write_file(os.path.join(tmp, rank_file(rank)), mine)
    on_every_rank(transport, lambda: dcp.save(state, checkpoint_id=os.path.join(
        tmp, checkpoint_dcp.DCP_DIR)))
    if rank == 0:
        ckpt._publish(root, tag, tmp, final)
    on_every_rank(transport, lambda: None)  # a barrier
    return final
