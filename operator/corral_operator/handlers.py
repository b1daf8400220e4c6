"""kopf handlers for LLMDeployment: the operator's table of contents.

create / update / resume / timer all run the same idempotent step (autoscale, then reconcile);
children are garbage-collected through owner references, so there is no delete handler and no
finalizer. `corral operator` passes the shared reconcile.Context in the global memo as `ctx`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

import kopf

from corral_operator import labels
from corral_operator.errors import to_kopf
from corral_operator.kube import KubeError
from corral_operator.reconcile import Context, autoscale, reconcile, seed_state
from corral_operator.spec import GROUP, KIND, PLURAL, VERSION, SpecError

log = logging.getLogger(__name__)
RESOURCE = (GROUP, VERSION, PLURAL)
# The timer re-asserts desired state, refreshes status and runs the autoscaler this often.
RESYNC_S = float(os.environ.get("CORRAL_OPERATOR_RESYNC_SECONDS", "15"))
ANNOTATION_PREFIX = "operator.corral.dev"


@kopf.on.startup()
def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress and the last-handled spec live in annotations, so status stays ours.
    settings.persistence.progress_storage = kopf.AnnotationsProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = kopf.AnnotationsDiffBaseStorage(prefix=ANNOTATION_PREFIX)
    settings.posting.level = logging.WARNING  # our own Events carry the story; kopf's are noise
    settings.scanning.disabled = True  # no cluster-wide CRD/namespace watching: less RBAC
    settings.execution.max_workers = 16
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 30
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)


@kopf.on.login()
def login(**kwargs: Any) -> kopf.ConnectionInfo | None:
    # An explicit kubeconfig (`corral operator --kubeconfig`) wins over the pod's service account.
    if os.environ.get("KUBECONFIG"):
        return kopf.login_with_kubeconfig(**kwargs)
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


@kopf.on.probe(id="alive")
def alive(**_: Any) -> bool:
    return True


@kopf.on.create(*RESOURCE)
@kopf.on.update(*RESOURCE)
@kopf.on.resume(*RESOURCE)
def on_change(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    _step(body, memo, logger, scrape=False, is_timer=False)


@kopf.timer(*RESOURCE, interval=RESYNC_S, initial_delay=RESYNC_S)
def on_timer(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    _step(body, memo, logger, scrape=True, is_timer=True)


@kopf.on.event("apps", "v1", "deployments", labels={labels.MANAGED_BY: labels.MANAGED_BY_VALUE})
def on_deployment_event(body: kopf.Body, memo: kopf.Memo, type: str | None, **_: Any) -> None:
    """A child Deployment changed (pods became ready, a rollout moved): refresh the owner's status now."""
    owner = next((r for r in body["metadata"].get("ownerReferences") or () if r.get("kind") == KIND), None)
    if owner is None or type == "DELETED":
        return
    ctx: Context = memo["ctx"]
    try:
        cr = ctx.kube.get(KIND, body["metadata"]["namespace"], owner["name"])
        if cr is not None and cr["metadata"].get("uid") == owner.get("uid"):
            outcome = reconcile(ctx, cr, apply=False)
            _post(cr, outcome.events)
    except (KubeError, SpecError) as e:
        log.debug("status refresh from Deployment %s failed: %s", body["metadata"]["name"], e)


def _post(body: Any, events: list[Any]) -> None:
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def _step(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, *, scrape: bool, is_timer: bool) -> None:
    """Autoscale, then reconcile; one at a time per object (the timer and events run concurrently)."""
    ctx: Context = memo["ctx"]
    lock: threading.Lock = memo.setdefault("lock", threading.Lock())
    with lock:
        try:
            state = memo.get("autoscaler") or seed_state(body.get("status") or {})
            scaled = autoscale(ctx, body, state, now_s=time.time(), scrape=scrape)
            memo["autoscaler"] = scaled.state
            outcome = reconcile(ctx, body, load=scaled.load, is_load_known=scaled.is_load_known)
        except (KubeError, SpecError) as e:
            raise to_kopf(e) from e
    _post(body, ([scaled.event] if scaled.event else []) + outcome.events)
    if outcome.spec_error and not is_timer:
        raise to_kopf(SpecError(outcome.spec_error))
    if outcome.apply_error:
        logger.warning("apply failed: %s", outcome.apply_error)
