"""`corral operator`: run the kopf operator that reconciles LLMDeployments."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from corral_cli.flags import key_values

if TYPE_CHECKING:
    from corral_operator.settings import OperatorSettings

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    scope = parser.add_mutually_exclusive_group()
    scope.add_argument(
        "--namespace",
        "-n",
        action="append",
        default=[],
        metavar="NS",
        help="serve only this namespace (repeatable; needs a KopfPeering there unless --standalone)",
    )
    scope.add_argument("--all-namespaces", "-A", action="store_true", help="serve every namespace (default)")
    parser.add_argument(
        "--kubeconfig", default=None, help="kubeconfig path (default: in-cluster, then $KUBECONFIG)"
    )
    parser.add_argument(
        "--peering",
        default="corral",
        help="kopf peering name shared by replicas; only the highest priority one works (default: corral)",
    )
    parser.add_argument(
        "--standalone", action="store_true", help="no peering (a single replica, dev clusters)"
    )
    parser.add_argument(
        "--priority",
        type=int,
        default=None,
        help="peering priority (default: from the start time, so the newest replica works and a "
        "restarted one never waits for the one it replaces)",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        metavar="URL",
        help="liveness endpoint to serve (default: http://0.0.0.0:8080/healthz; '' to disable)",
    )
    parser.add_argument(
        "--metrics-port",
        type=int,
        default=None,
        metavar="PORT",
        help="serve the operator's own metrics (reconciles, errors) on 0.0.0.0:PORT/metrics (default: off)",
    )
    parser.add_argument(
        "--resync-seconds",
        type=float,
        default=15.0,
        help="timer interval: re-assert state, refresh status and autoscale (default: 15)",
    )
    parser.add_argument(
        "--no-metrics", action="store_true", help="do not scrape engine pods (no autoscaling)"
    )
    parser.add_argument(
        "--metrics-file",
        type=Path,
        default=None,
        help='read load from a JSON file {"NS/NAME": {"waiting": N, "running": N, "kvUsage": F}} instead',
    )
    parser.add_argument(
        "--monitor-label",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a label on each LLMDeployment's ServiceMonitor, for a Prometheus that selects monitors "
        "by label (repeatable; the chart passes monitoring.labels)",
    )
    parser.add_argument(
        "--monitor-interval",
        default="15s",
        metavar="DURATION",
        help="how often Prometheus scrapes the engines through each LLMDeployment's ServiceMonitor "
        "(e.g. 30s, 1m; default: 15s; the chart passes monitoring.interval)",
    )
    parser.add_argument(
        "--scrape-network",
        action="append",
        default=[],
        metavar="CIDR",
        help="only scrape pods whose IP is in CIDR (repeatable; default: any)",
    )


def settings_from_args(args: argparse.Namespace) -> OperatorSettings:
    """The operator's settings from the flags (raises pydantic's ValidationError on bad values)."""
    from corral_operator.settings import ANY_NETWORK, OperatorSettings

    given: dict[str, Any] = {
        "namespaces": tuple(args.namespace),
        "kubeconfig": args.kubeconfig or None,
        "peering": args.peering,
        "standalone": args.standalone,
        "liveness_url": args.liveness or None,
        "metrics_port": args.metrics_port,
        "resync_s": args.resync_seconds,
        "scrape_metrics": not args.no_metrics,
        "metrics_file": args.metrics_file,
        "scrape_networks": tuple(args.scrape_network) or ANY_NETWORK,
        "monitor_labels": key_values(args.monitor_label, "--monitor-label"),
        "monitor_interval": args.monitor_interval,
    }
    if args.priority is not None:
        given["priority"] = args.priority  # else from the start time: the newest replica works
    return OperatorSettings(**given)


def run(args: argparse.Namespace) -> int:
    import kopf
    from corral_operator.context import Context
    from corral_operator.handlers import build_registry
    from corral_operator.kube import Kube, load_config
    from corral_operator.metrics import FileSource, MetricsSource, PodScrapeSource
    from pydantic import ValidationError

    try:
        settings = settings_from_args(args)
    except (ValidationError, ValueError) as e:
        log.error("invalid operator settings: %s", e)
        return 2
    log.info("corral operator settings: %s", settings.describe())
    load_config(settings.kubeconfig)
    metrics: MetricsSource | None = None
    if settings.metrics_file is not None:
        metrics = FileSource(settings.metrics_file)
    elif settings.scrape_metrics:
        metrics = PodScrapeSource(allowed_networks=settings.scrape_networks)
    ctx = Context(
        kube=Kube(),
        metrics=metrics,
        monitor_labels=settings.monitor_labels,
        monitor_interval=settings.monitor_interval,
    )
    if settings.metrics_port is not None:
        ctx.telemetry.serve(settings.metrics_port)
    kopf.run(
        registry=build_registry(settings),
        clusterwide=not settings.namespaces,
        namespaces=list(settings.namespaces),
        standalone=settings.standalone,
        peering_name=None if settings.standalone else settings.peering,
        priority=settings.priority,
        liveness_endpoint=settings.liveness_url,
        memo=kopf.Memo(ctx=ctx),
    )
    return 0
