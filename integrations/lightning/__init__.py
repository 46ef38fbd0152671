"""``pipekernel.lightning``: a Lightning ``PipelineStrategy`` (optional extra ``[lightning]``).

Imported only when used; the core never imports it."""
