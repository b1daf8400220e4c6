"""`corral operator` flags (the operator itself runs in e2e/operator)."""

from __future__ import annotations

import pytest
from corral_cli.main import build_parser


def test_operator_flags_parse() -> None:
    args = build_parser(only="operator").parse_args(
        ["operator", "-n", "ml", "-n", "team-*", "--peering", "p", "--priority", "7", "--resync-seconds", "3"]
    )
    assert args.namespace == ["ml", "team-*"] and not args.all_namespaces
    assert (args.peering, args.priority, args.resync_seconds) == ("p", 7, 3.0)
    assert args.liveness == "http://0.0.0.0:8080/healthz"


def test_namespace_and_all_namespaces_exclude_each_other() -> None:
    with pytest.raises(SystemExit):
        build_parser(only="operator").parse_args(["operator", "-n", "ml", "--all-namespaces"])
