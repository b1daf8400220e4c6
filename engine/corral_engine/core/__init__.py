"""The engine's pure core: sequences, the paged block pool and the scheduler (no torch, no I/O)."""
