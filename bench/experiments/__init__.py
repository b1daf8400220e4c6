"""The seed whitepaper's four serving experiments on Corral's engine (`python -m bench.experiments`).

`specs` defines the runs (pure), `execute` starts engines and drives `corral bench`'s library,
`tables` and `plots` present the result JSON.
"""
