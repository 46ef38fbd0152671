"""Built-in plugins, published under the ``pipekernel.plugins`` entry-point group."""
