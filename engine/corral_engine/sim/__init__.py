"""The simulated engine: the real scheduler, block manager and server, with step times from a
performance model instead of a model (no torch). See docs/simulator.md."""
