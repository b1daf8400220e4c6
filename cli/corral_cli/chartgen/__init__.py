"""Generates the Helm chart's derived files: dashboards, values schema, operator RBAC, CRD copies.

`python -m corral_cli.chartgen` rewrites them under charts/corral; `--check` only reports drift
(a unit test runs the same check).
"""
