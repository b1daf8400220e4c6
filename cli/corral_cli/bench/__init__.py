"""`corral bench`: an async load generator and latency/throughput report for OpenAI-compatible servers.

Pure parts (workload sampling, arrivals, aggregation, /metrics parsing) are separate from I/O
(client, runner) and presentation (report).
"""
