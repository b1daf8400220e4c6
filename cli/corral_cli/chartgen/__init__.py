"""Generates the Helm chart's derived files (dashboards, values schema, operator RBAC, CRD copies) and
the docs' engine option table.

`python -m corral_cli.chartgen` rewrites them; `--check` only reports drift
(a unit test runs the same check).
"""
