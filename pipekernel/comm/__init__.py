"""Communication: the Transport protocol, the wire format (tensor metadata), collectives, the conformance suite."""
