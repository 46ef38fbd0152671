"""Built-in transports, published under the ``pipekernel.transports`` entry-point group."""
