"""Wake a model scaled to zero: annotate its LLMDeployment so the operator scales it up.

A request for a model with no replica in rotation sets `corral.dev/wake` (an RFC 3339 time) on the
LLMDeployment that serves it, at most once per `min_interval_s`; the request waits in the model's
queue until a replica is discovered. The owner comes from discovery (k8s_discovery.Discovery.owners):
the instance label the operator puts on its Services (mirrored onto EndpointSlices) and Pods.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from corral_engine import wire

logger = logging.getLogger(__name__)


def wake_patch(now_s: float) -> dict[str, Any]:
    stamp = datetime.fromtimestamp(now_s, tz=UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {"metadata": {"annotations": {wire.WAKE_ANNOTATION: stamp}}}


class Waker:
    """Rate-limited wake-ups; the API call runs in a short-lived thread (never on the event loop)."""

    def __init__(
        self,
        kubeconfig: Path | None,
        min_interval_s: float = 10.0,
        clock: Callable[[], float] = time.time,
        patch: Callable[[str, str, dict[str, Any]], None] | None = None,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.min_interval_s = min_interval_s
        self.clock = clock
        self.owners: dict[str, tuple[str, str]] = {}
        self._last_s: dict[str, float] = {}
        self._patch = patch or self._patch_with_client

    def set_owners(self, owners: dict[str, tuple[str, str]]) -> None:
        self.owners = owners

    def wake(self, model: str) -> bool:
        """Ask the operator to scale `model` up (at most once per interval); False if no owner is known."""
        owner = self.owners.get(model)
        now_s = self.clock()
        if owner is None:
            return False
        if now_s - self._last_s.get(model, -1e18) < self.min_interval_s:
            return True
        self._last_s[model] = now_s
        namespace, name = owner
        body = wake_patch(now_s)
        threading.Thread(target=self._safe_patch, args=(namespace, name, body), daemon=True).start()
        logger.info("waking model %s: annotating LLMDeployment %s/%s", model, namespace, name)
        return True

    def _safe_patch(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        from kubernetes.client.exceptions import ApiException
        from kubernetes.config.config_exception import ConfigException

        try:
            self._patch(namespace, name, body)
        except (ApiException, ConfigException, OSError, ValueError) as e:  # urllib3 errors are OSErrors
            logger.warning("could not wake LLMDeployment %s/%s: %s", namespace, name, e)

    def _patch_with_client(self, namespace: str, name: str, body: dict[str, Any]) -> None:
        from kubernetes import client, config

        if self.kubeconfig is not None:
            api_client = config.new_client_from_config(config_file=str(self.kubeconfig))
        else:
            config.load_incluster_config()
            api_client = client.ApiClient()
        client.CustomObjectsApi(api_client).patch_namespaced_custom_object(
            wire.GROUP, wire.VERSION, namespace, wire.PLURAL, name, body
        )
