"""Running probes in an isolated worker process: the Runner interface, the worker, its protocol
and its limits. The parent's side imports no torch."""
