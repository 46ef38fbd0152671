"""Communication: the Transport protocol, the wire format (tensor metadata), collectives, agreement (the conformance suite: ``pipekernel.testing.conformance``)."""
