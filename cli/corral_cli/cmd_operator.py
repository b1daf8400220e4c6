"""`corral operator`: run the kopf operator that reconciles LLMDeployments."""

from __future__ import annotations

import argparse
import logging
import os
import random
from pathlib import Path

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
        help="peering priority (default: random, so replicas never tie; kopf pauses all on a tie)",
    )
    parser.add_argument(
        "--liveness",
        default="http://0.0.0.0:8080/healthz",
        metavar="URL",
        help="liveness endpoint to serve (default: http://0.0.0.0:8080/healthz; '' to disable)",
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
        "--scrape-network",
        action="append",
        default=[],
        metavar="CIDR",
        help="only scrape pods whose IP is in CIDR (repeatable; default: any)",
    )


def run(args: argparse.Namespace) -> int:
    # kopf reads the timer interval when the handlers module is imported, and logs in via $KUBECONFIG.
    os.environ["CORRAL_OPERATOR_RESYNC_SECONDS"] = str(args.resync_seconds)
    if args.kubeconfig:
        os.environ["KUBECONFIG"] = args.kubeconfig

    import corral_operator.handlers  # noqa: F401  (registers the handlers)
    import kopf
    from corral_operator.kube import Kube, load_config
    from corral_operator.metrics import FileSource, MetricsSource, PodScrapeSource
    from corral_operator.reconcile import Context

    load_config(args.kubeconfig)
    metrics: MetricsSource | None = None
    if args.metrics_file is not None:
        metrics = FileSource(args.metrics_file)
    elif not args.no_metrics:
        metrics = PodScrapeSource(allowed_networks=args.scrape_network or ("0.0.0.0/0", "::/0"))
    priority = args.priority if args.priority is not None else random.SystemRandom().randint(1, 1 << 30)
    namespaces = list(args.namespace)
    log.info(
        "corral operator: %s, peering %s (priority %d)",
        f"namespaces {namespaces}" if namespaces else "all namespaces",
        "off" if args.standalone else args.peering,
        priority,
    )
    kopf.run(
        clusterwide=not namespaces,
        namespaces=namespaces,
        standalone=args.standalone,
        peering_name=None if args.standalone else args.peering,
        priority=priority,
        liveness_endpoint=args.liveness or None,
        memo=kopf.Memo(ctx=Context(kube=Kube(), metrics=metrics)),
    )
    return 0
