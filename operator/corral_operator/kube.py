"""Every Kubernetes API call the operator makes, and how failures map to a few error types.

404 means "absent" (None / False / nothing to delete) everywhere; 409 is a Conflict the caller
retries; 400/422 are Invalid and 403 Forbidden (both reported in status, not crashed on);
5xx and connection failures are Unavailable (retried), except a 500 that says the patch itself
cannot be typed (server-side apply's answer to duplicate list keys or fields a schema lacks inside
open objects such as affinity): that is Invalid too, as no retry can fix it.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import urllib3
from kubernetes import client, config
from kubernetes.client.exceptions import ApiException

from corral_operator import labels
from corral_operator.spec import GROUP, PLURAL, VERSION

Obj = dict[str, Any]

# kind -> (API path prefix, plural). Only kinds in this table are ever touched.
RESOURCES: dict[str, tuple[str, str]] = {
    "Deployment": ("/apis/apps/v1", "deployments"),
    "Service": ("/api/v1", "services"),
    "PodDisruptionBudget": ("/apis/policy/v1", "poddisruptionbudgets"),
    "ServiceMonitor": ("/apis/monitoring.coreos.com/v1", "servicemonitors"),
    "Pod": ("/api/v1", "pods"),
    "PersistentVolumeClaim": ("/api/v1", "persistentvolumeclaims"),
    "HorizontalPodAutoscaler": ("/apis/autoscaling/v2", "horizontalpodautoscalers"),
    "ScaledObject": ("/apis/keda.sh/v1alpha1", "scaledobjects"),
    "LLMDeployment": (f"/apis/{GROUP}/{VERSION}", PLURAL),
}


class KubeError(Exception):
    """An API call failed; `status` is the HTTP status (0 when the server was unreachable)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


class Conflict(KubeError):
    """409: someone else changed the object; retry with fresh state."""


class Invalid(KubeError):
    """400/422: the server rejected what we sent (usually a consequence of the spec)."""


class Forbidden(KubeError):
    """403: RBAC does not allow it."""


class Unavailable(KubeError):
    """5xx, timeouts, connection errors: transient."""


# Connections kept to the API server: kopf's handler workers (16) and its watchers share the
# client, whose default pool is 5 per CPU (10 on two cores), so it logged "Connection pool is full,
# discarding connection" under load and opened a new connection each time.
API_POOL_SIZE = 32


def load_config(kubeconfig: Path | None = None) -> None:
    """An explicit kubeconfig, else the in-cluster service account, else $KUBECONFIG / ~/.kube/config."""
    if kubeconfig is not None:
        config.load_kube_config(config_file=str(kubeconfig))
    else:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    settings = client.Configuration.get_default_copy()
    settings.connection_pool_maxsize = max(settings.connection_pool_maxsize, API_POOL_SIZE)
    client.Configuration.set_default(settings)


# Server-side apply answers 500 when the applied object does not fit the kind's schema; the same
# patch fails the same way every time, so it is the sender's mistake, not an outage.
INVALID_PATCH_MARKERS = ("failed to create typed patch object",)


def _error(status: int, body: bytes | str | None) -> KubeError:
    message = body.decode("utf-8", "replace") if isinstance(body, bytes) else (body or "")
    with contextlib.suppress(ValueError, AttributeError):
        message = json.loads(message).get("message", message)
    if status == 409:
        return Conflict(status, message)
    if status in (400, 422) or (status == 500 and any(m in message for m in INVALID_PATCH_MARKERS)):
        return Invalid(status, message)
    if status == 403:
        return Forbidden(status, message)
    if status == 404:
        return KubeError(status, message)
    return Unavailable(status, message)


class Kube:
    def __init__(self, api: client.ApiClient | None = None, timeout_s: float = 15.0) -> None:
        self._api = api or client.ApiClient()
        self._timeout_s = timeout_s

    def _request(
        self,
        method: str,
        path: str,
        *,
        query: list[tuple[str, str]] | None = None,
        body: Any = None,
        content_type: str | None = None,
    ) -> Obj | None:
        """One HTTP call; the JSON response, None on 404, a KubeError subclass otherwise."""
        headers = {"Accept": "application/json"}
        if content_type:
            headers["Content-Type"] = content_type
        try:
            m, url, hdrs, data, post = self._api.param_serialize(
                method,
                path,
                query_params=query or [],
                header_params=headers,
                body=body,
                auth_settings=["BearerToken"],
            )
            response = self._api.call_api(
                m, url, header_params=hdrs, body=data, post_params=post, _request_timeout=self._timeout_s
            )
            response.read()
        except ApiException as e:
            if e.status == 404:
                return None
            raise _error(e.status or 0, e.body) from e
        except (urllib3.exceptions.HTTPError, OSError) as e:
            raise Unavailable(0, f"API server unreachable: {e}") from e
        if response.status == 404:
            return None
        if not 200 <= response.status <= 299:
            raise _error(response.status, response.data)
        return json.loads(response.data) if response.data else {}

    @staticmethod
    def _path(kind: str, namespace: str, name: str | None = None) -> str:
        prefix, plural = RESOURCES[kind]
        path = f"{prefix}/namespaces/{namespace}/{plural}"
        return f"{path}/{name}" if name else path

    def apply(self, obj: Mapping[str, Any]) -> Obj:
        """Server-side apply as the operator's field manager (force: the operator owns these fields)."""
        meta = obj["metadata"]
        result = self._request(
            "PATCH",
            self._path(obj["kind"], meta["namespace"], meta["name"]),
            query=[("fieldManager", labels.FIELD_MANAGER), ("force", "true")],
            body=dict(obj),
            content_type="application/apply-patch+yaml",
        )
        if result is None:  # 404 on apply: the namespace is gone
            raise Conflict(404, f"namespace {meta['namespace']} not found")
        return result

    def get(self, kind: str, namespace: str, name: str) -> Obj | None:
        return self._request("GET", self._path(kind, namespace, name))

    def list(self, kind: str, namespace: str, label_selector: str) -> list[Obj]:
        result = self._request("GET", self._path(kind, namespace), query=[("labelSelector", label_selector)])
        return list((result or {}).get("items") or [])

    def delete(self, kind: str, namespace: str, name: str, uid: str) -> bool:
        """Delete exactly this object (uid precondition); False when it is already gone or replaced."""
        body = {"propagationPolicy": "Background", "preconditions": {"uid": uid}}
        try:
            return self._request("DELETE", self._path(kind, namespace, name), body=body) is not None
        except Conflict:
            return False

    def patch_status(
        self, namespace: str, name: str, status: Mapping[str, Any], resource_version: str | None = None
    ) -> None:
        """Merge `status` in; with `resource_version`, only into that version of the object (else
        Conflict): status computed from an older read must not overwrite a newer one."""
        body: Obj = {"status": dict(status)}
        if resource_version:
            body["metadata"] = {"resourceVersion": resource_version}
        self._request(
            "PATCH",
            self._path("LLMDeployment", namespace, name) + "/status",
            query=[("fieldManager", labels.FIELD_MANAGER)],
            body=body,
            content_type="application/merge-patch+json",
        )

    def patch_replicas(self, namespace: str, name: str, replicas: int) -> None:
        """Write spec.replicas through the scale subresource, as HPA, KEDA or `kubectl scale` would;
        as the operator's field manager, so a GitOps tool's server-side apply conflict names it."""
        self._request(
            "PATCH",
            self._path("LLMDeployment", namespace, name) + "/scale",
            query=[("fieldManager", labels.FIELD_MANAGER)],
            body={"spec": {"replicas": replicas}},
            content_type="application/merge-patch+json",
        )

    def serves(self, kind: str) -> bool:
        """Whether the API server serves `kind` (a CRD's, such as ServiceMonitor): its group version's
        API discovery lists it. Discovery is readable by every authenticated user (the system:discovery
        role), so this needs no cluster-scoped rule and works for a namespaced operator; Forbidden
        when even that is refused."""
        prefix, plural = RESOURCES[kind]
        listing = self._request("GET", prefix)  # None: the group version is not served (404)
        return listing is not None and any(r.get("name") == plural for r in listing.get("resources") or ())

    def served_schema(self, kind: str) -> Obj | None:
        """The schema the API server validates and prunes `kind` with (its OpenAPI v3 document, which
        every authenticated user may read, as API discovery); None when it publishes none."""
        prefix, _ = RESOURCES[kind]
        document = self._request("GET", "/openapi/v3" + prefix)
        for schema in ((document or {}).get("components") or {}).get("schemas", {}).values():
            for gvk in schema.get("x-kubernetes-group-version-kind") or ():
                if gvk.get("kind") == kind and prefix == f"/apis/{gvk.get('group')}/{gvk.get('version')}":
                    return dict(schema)
        return None
