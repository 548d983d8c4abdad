"""One run: its diagnosis (the engine's run verdict over its stored traces), comparison with another run, the TensorBoard export, and the service its views read."""
