"""What every handler shares: the Kubernetes API, the metrics source, the operator's own metrics
and a little cached discovery."""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from corral_operator import crd_drift
from corral_operator.autoscalers import SCALED_OBJECT_CRD
from corral_operator.crd import expected_schema
from corral_operator.kube import Forbidden, Kube, KubeError
from corral_operator.metrics import MetricsSource
from corral_operator.render import SERVICE_MONITOR_CRD
from corral_operator.telemetry import OperatorMetrics

log = logging.getLogger(__name__)
CRD_CACHE_S = 60.0
# A spec field this operator does not know can only come from a newer CRD (a structural schema
# prunes the rest), so the served schema is re-read at once, but at most this often.
SPEC_RECHECK_S = 5.0
# Objects of these kinds only if the cluster serves them: CRD name -> kind (kube.RESOURCES).
OPTIONAL_CRDS = {SERVICE_MONITOR_CRD: "ServiceMonitor", SCALED_OBJECT_CRD: "ScaledObject"}


@dataclass
class Context:
    """Built once by `corral operator` and passed to the handlers in kopf's global memo as `ctx`."""

    kube: Kube
    metrics: MetricsSource | None = None
    monitor_labels: Mapping[str, str] = field(default_factory=dict)  # OperatorSettings.monitor_labels
    monitor_interval: str = "15s"  # OperatorSettings.monitor_interval
    telemetry: OperatorMetrics = field(default_factory=OperatorMetrics)
    _crds_checked_at: float = -1e9
    _spec_rechecked_at: float = -1e9
    _crds: frozenset[str] = frozenset()
    _refused_crds: frozenset[str] = frozenset()
    _missing_fields: tuple[str, ...] = ()  # of this operator's LLMDeployment CRD, in the served one
    _unknown_fields: tuple[str, ...] = ()  # spec fields of the served CRD this operator lacks
    _is_schema_refused: bool = False  # the last read of the served schema got a 403
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _object_locks: dict[tuple[str, str], threading.Lock] = field(default_factory=dict)

    def object_lock(self, namespace: str, name: str) -> threading.Lock:
        """One lock per LLMDeployment, shared by its ticks and by its Deployment's events, so one
        status is computed at a time (kopf's memo is per object, and the Deployment has its own).
        A lock is a few dozen bytes; the ones of deleted objects are kept."""
        with self._lock:
            return self._object_locks.setdefault((namespace, name), threading.Lock())

    def installed_crds(self, now_s: float) -> frozenset[str]:
        """Which of OPTIONAL_CRDS the cluster serves (looked up at most once a minute); one whose API
        discovery the operator may not read counts as absent, and is in `refused_crds`."""
        with self._lock:
            if now_s - self._crds_checked_at > CRD_CACHE_S:
                self._look_up(now_s)
            return self._crds

    def _look_up(self, now_s: float) -> None:
        """Read API discovery and the served LLMDeployment schema (under `_lock`)."""
        served, refused = set(), set()
        for crd, kind in OPTIONAL_CRDS.items():
            try:
                if self.kube.serves(kind):
                    served.add(crd)
            except Forbidden as e:
                refused.add(crd)
                if crd not in self._refused_crds:
                    log.warning("not allowed to read API discovery for %s: %s", kind, e.message)
        self._crds, self._refused_crds = frozenset(served), frozenset(refused)
        self._check_own_crd()
        self._crds_checked_at = now_s

    def stale_crd(self, now_s: float) -> str | None:
        """Why the installed LLMDeployment CRD is older than this operator's, or None (checked with
        `installed_crds`, at most once a minute)."""
        self.installed_crds(now_s)
        return crd_drift.stale_message(list(self._missing_fields))

    def pruned_status_fields(self, now_s: float) -> frozenset[str]:
        """Status fields the installed CRD lacks (the API server would drop them from every patch)."""
        self.installed_crds(now_s)
        return crd_drift.stale_status_fields(list(self._missing_fields))

    def known_spec(self, spec: Mapping[str, Any], now_s: float) -> Mapping[str, Any]:
        """`spec` less the fields of a newer CRD this operator does not know: it runs what it knows
        (as an older controller ignores unknown fields) rather than refuse every LLMDeployment. A
        field not seen before has the served schema read again at once (at most every SPEC_RECHECK_S)."""
        undeclared = set(crd_drift.undeclared_fields(spec, expected_schema()["properties"]["spec"]))
        with self._lock:
            is_due = now_s - self._crds_checked_at > CRD_CACHE_S
            # A CRD applied since the last look-up: the model would be an InvalidSpec until the next.
            is_new = bool(undeclared - set(self._unknown_fields))
            if is_new and now_s - self._spec_rechecked_at > SPEC_RECHECK_S:
                self._spec_rechecked_at = now_s
                is_due = True
            if is_due:
                self._look_up(now_s)
            unknown = list(self._unknown_fields)
        return crd_drift.without_fields(spec, unknown)

    def _check_own_crd(self) -> None:
        """Compare the served LLMDeployment schema with this operator's; say so once when it changes.
        A failed read keeps the last answer (an outage is not an upgrade)."""
        try:
            served = self.kube.served_schema("LLMDeployment")
        except Forbidden as e:  # RBAC or an API server that hides its OpenAPI: no check, said once
            if not self._is_schema_refused:
                log.warning(
                    "not allowed to read the served LLMDeployment schema (/openapi/v3), so a stale CRD "
                    "cannot be detected: %s",
                    e.message,
                )
            self._is_schema_refused = True
            return
        except KubeError as e:
            log.debug("cannot read the served LLMDeployment schema: %s", e.message)
            return
        self._is_schema_refused = False
        served = served or {}  # none published: nothing to compare
        missing = tuple(crd_drift.missing_fields(expected_schema(), served)) if served else ()
        unknown = tuple(
            p for p in crd_drift.missing_fields(served, expected_schema()) if p.startswith("spec.")
        )
        if unknown != self._unknown_fields and unknown:
            log.warning("%s", crd_drift.newer_message(list(unknown)))
        self._unknown_fields = unknown
        if missing != self._missing_fields:
            message = crd_drift.stale_message(list(missing))
            if message:
                log.error("%s", message)
            else:
                log.info("the installed LLMDeployment CRD now has every field this operator uses")
        self._missing_fields = missing

    def refused_crds(self) -> frozenset[str]:
        """Of OPTIONAL_CRDS, those the last lookup could not tell about (403 on API discovery)."""
        with self._lock:
            return self._refused_crds
