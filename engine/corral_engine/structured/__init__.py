"""Structured outputs: grammars that constrain what a sequence may generate (JSON schema, regex,
choice, Lark/GBNF grammar), compiled with llguidance and applied as a token mask in the sampler.

Only `spec` is torch- and llguidance-free; import the others where the engine runs.
"""
