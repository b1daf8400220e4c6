"""`corral gateway`: one OpenAI-compatible endpoint in front of many engine replicas."""

from __future__ import annotations

import argparse
import logging
import typing
from pathlib import Path
from typing import Any

from corral_gateway.settings import PolicyName

from corral_cli import tracing
from corral_cli.flags import port_number
from corral_cli.heap import freeze_startup_heap

logger = logging.getLogger(__name__)

POLICY_CHOICES = typing.get_args(PolicyName)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=None, help="address to listen on (default: 127.0.0.1)")
    parser.add_argument("--port", type=port_number, default=None, help="port to listen on (default: 8000)")
    parser.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="FILE",
        help="YAML settings file: the fields of corral_gateway/settings.py's GatewaySettings, snake_case "
        "(e.g. backends, policy, queue_timeout_s); the flags win over it",
    )
    parser.add_argument(
        "--backend",
        action="append",
        default=[],
        metavar="MODEL=URL",
        help="a replica serving MODEL at URL (repeatable), e.g. demo=http://127.0.0.1:8100",
    )
    parser.add_argument("--policy", choices=POLICY_CHOICES, default=None, help="routing policy")
    parser.add_argument("--api-keys-file", type=Path, default=None, help="API keys (text or YAML)")
    parser.add_argument(
        "--otlp-traces-endpoint",
        default=None,
        metavar="URL",
        help="send OpenTelemetry traces over OTLP/HTTP here, e.g. http://127.0.0.1:4318 "
        "(default: $OTEL_EXPORTER_OTLP_TRACES_ENDPOINT or $OTEL_EXPORTER_OTLP_ENDPOINT, else no tracing)",
    )
    parser.add_argument(
        "--kubernetes",
        action="store_true",
        help="discover replicas from EndpointSlices labelled by the operator",
    )


def settings_from_args(args: argparse.Namespace) -> Any:
    from corral_gateway.settings import load_settings

    overrides: dict[str, Any] = {
        "host": args.host,
        "port": args.port,
        "policy": args.policy,
        "api_keys_file": args.api_keys_file,
    }
    if getattr(args, "kubernetes", False):
        overrides["kubernetes"] = {"enabled": True}
    return load_settings(args.config, overrides, args.backend)


def settings_problems(error: Any) -> str:
    """A ValidationError's problems by setting, without the values given: pydantic's own text
    quotes them, and one may be a secret (upstream_api_key, or a key misspelt)."""
    return "; ".join(
        f"{'.'.join(str(part) for part in problem['loc'])}: {problem['msg']}"
        for problem in error.errors(include_url=False, include_input=False)
    )


def run(args: argparse.Namespace) -> int:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per proxied request otherwise
    import uvicorn
    from corral_engine.http_limits import uvicorn_options
    from corral_gateway.app import create_app
    from corral_gateway.drain import GRACEFUL_CLOSE_S, DrainingServer
    from pydantic import ValidationError

    try:
        settings = settings_from_args(args)
    except ValidationError as e:
        logger.error("invalid gateway settings: %s", settings_problems(e))
        return 2
    except (ValueError, OSError) as e:
        logger.error("invalid gateway settings: %s", e)
        return 2
    if not settings.backends and not settings.kubernetes.enabled:
        logger.error("no replicas: pass --backend MODEL=URL, a --config with backends, or --kubernetes")
        return 2
    try:
        tracing.configure("corral-gateway", args.otlp_traces_endpoint)
    except tracing.TracingUnavailable as e:
        logger.error("%s", e)
        return 2
    app = create_app(settings)
    effective = settings.model_dump(mode="json")
    if effective.get("upstream_api_key"):
        effective["upstream_api_key"] = "(set)"  # never log a secret
    logger.info("gateway settings: %s", effective)
    logger.info(
        "gateway on http://%s:%d, policy %s, models %s",
        settings.host,
        settings.port,
        settings.policy,
        ", ".join(settings.backends) or "(from Kubernetes)",
    )
    freeze_startup_heap()
    # log_config=None: uvicorn's own lines go through the process's logging (--log-format); the
    # gateway writes its own access lines.
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level="warning",
        access_log=False,
        log_config=None,
        timeout_graceful_shutdown=GRACEFUL_CLOSE_S,  # after the drain: the ended answers' last bytes
        **uvicorn_options(),  # a bound on each request's headers
    )
    DrainingServer(config, app.drain).run()  # SIGTERM: drain for settings.drain_timeout_s, then stop
    return 0
