"""What every handler shares: the Kubernetes API, the metrics source, the operator's own metrics
and a little cached discovery."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

from corral_operator.kube import SERVICE_MONITOR_CRD, Kube
from corral_operator.metrics import MetricsSource
from corral_operator.telemetry import OperatorMetrics

CRD_CACHE_S = 60.0


@dataclass
class Context:
    """Built once by `corral operator` and passed to the handlers in kopf's global memo as `ctx`."""

    kube: Kube
    metrics: MetricsSource | None = None
    telemetry: OperatorMetrics = field(default_factory=OperatorMetrics)
    _sm_checked_at: float = -1e9
    _has_sm: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def has_service_monitor_crd(self, now_s: float) -> bool:
        with self._lock:
            if now_s - self._sm_checked_at > CRD_CACHE_S:
                self._has_sm = self.kube.crd_exists(SERVICE_MONITOR_CRD)
                self._sm_checked_at = now_s
            return self._has_sm
