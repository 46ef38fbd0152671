"""``pipekernel.deepspeed``: run a DeepSpeed pipeline script on pipekernel (optional extra
``[deepspeed]`` only for reading DeepSpeed itself in tests; the shim needs no DeepSpeed).

Imported only when used; the core never imports it."""
