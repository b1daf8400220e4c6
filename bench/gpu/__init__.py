"""Issue 22's GPU acceptance and benchmark run: `python3 -m bench.gpu.acceptance` (README.md here)."""
