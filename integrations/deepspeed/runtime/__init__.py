"""``deepspeed.runtime``: the submodules scripts reach through it (``runtime.utils``,
``runtime.pipe``, ``runtime.lr_schedules``)."""
from .. import lr_schedules
from . import pipe, utils

__all__ = ["pipe", "utils", "lr_schedules"]
