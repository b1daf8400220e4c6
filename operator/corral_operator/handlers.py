"""kopf handlers for LLMDeployment: the operator's table of contents (`build_registry` lists them all).

create / update / resume / timer run one idempotent tick (autoscale, reconcile, one status patch);
children go with their owner (owner references), so there is no delete handler. kopf still puts a
finalizer (FINALIZER) on every LLMDeployment because of the timer: it stops an object's timer task on
deletion, and kopf offers no timer without one (kopf.timer's handler requires_finalizer). So deleting
an LLMDeployment waits for a running operator (docs/operations.md, "Deleting LLMDeployments and
uninstalling").
"""

from __future__ import annotations

import functools
import logging
import socket
import time
from typing import Any

import kopf

from corral_operator import labels
from corral_operator.changes import update_event
from corral_operator.context import Context
from corral_operator.errors import error_reason, to_kopf
from corral_operator.kopf_logs import install as install_kopf_logs
from corral_operator.kube import KubeError
from corral_operator.login import login
from corral_operator.persistence import MemoryDiffBaseStorage, MemoryProgressStorage
from corral_operator.reconcile import reconcile
from corral_operator.scaling import autoscale, seed_state
from corral_operator.settings import OperatorSettings
from corral_operator.spec import GROUP, KIND, PLURAL, VERSION, SpecError
from corral_operator.status import Event

log = logging.getLogger(__name__)
RESOURCE = (GROUP, VERSION, PLURAL)
ANNOTATION_PREFIX = "operator.corral.dev"
EVENT_SOURCE = "corral-operator"
FINALIZER = f"{ANNOTATION_PREFIX}/finalizer"
# What operators before FINALIZER put on: removed from every LLMDeployment, even one being deleted
# (kopf knows one finalizer only; left there, it would block that deletion for ever).
OLD_FINALIZER = "kopf.zalando.org/KopfFinalizerMarker"


def build_registry(settings: OperatorSettings) -> kopf.OperatorRegistry:
    """Every handler on a fresh registry, configured from `settings` (nothing is read at import)."""
    registry = kopf.OperatorRegistry()
    kopf.on.startup(registry=registry)(configure)
    kopf.on.startup(registry=registry)(check_crds)
    kopf.on.login(registry=registry)(functools.partial(login, kubeconfig=settings.kubeconfig))
    kopf.on.probe(id="alive", registry=registry)(alive)
    kopf.on.create(*RESOURCE, registry=registry)(on_change)
    kopf.on.update(*RESOURCE, registry=registry)(on_update)
    kopf.on.resume(*RESOURCE, registry=registry)(on_change)
    resync_s = settings.resync_s
    kopf.timer(*RESOURCE, interval=resync_s, initial_delay=resync_s, registry=registry)(on_timer)
    managed = {labels.MANAGED_BY: labels.MANAGED_BY_VALUE}
    kopf.on.event("apps", "v1", "deployments", labels=managed, registry=registry)(on_deployment_event)
    kopf.on.event(*RESOURCE, registry=registry)(drop_old_finalizer)
    return registry


def configure(settings: kopf.OperatorSettings, **_: Any) -> None:
    # Handler progress and the last-handled spec live in the operator's memory: status stays ours and
    # `kubectl describe` shows no bookkeeping (reconcile is level-triggered, a restart loses nothing).
    settings.persistence.progress_storage = MemoryProgressStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.diffbase_storage = MemoryDiffBaseStorage(prefix=ANNOTATION_PREFIX)
    settings.persistence.finalizer = FINALIZER
    settings.posting.level = logging.WARNING  # our own Events carry the story; kopf's are noise
    # Events say who wrote them (`kubectl describe`'s From column): this operator, this pod.
    settings.posting.reporting_component = EVENT_SOURCE
    settings.posting.reporting_instance = socket.gethostname()
    settings.posting.event_name_prefix = "corral-"
    settings.scanning.disabled = True  # no cluster-wide CRD/namespace watching: less RBAC
    settings.execution.max_workers = 16
    settings.watching.server_timeout = 300
    settings.networking.request_timeout = 30
    logging.getLogger("kopf.objects").setLevel(logging.WARNING)
    install_kopf_logs()


def check_crds(memo: kopf.Memo, **_: Any) -> None:
    """Look the CRDs up once at start-up, so a stale LLMDeployment CRD is logged (an ERROR line with
    the fix) before any LLMDeployment exists; the ticks look again once a minute."""
    ctx: Context = memo["ctx"]
    try:
        ctx.installed_crds(time.time())
    except KubeError as e:  # the ticks look again; the operator must start all the same
        log.warning("could not look the CRDs up at start-up: %s", e.message)


def alive(**_: Any) -> bool:
    return True


def on_change(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    _tick(body, memo, logger, scrape=False, is_timer=False)


def on_update(
    body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, diff: kopf.Diff, old: Any = None, **_: Any
) -> None:
    """A spec change also says, in an Event, that it rolls out and what changed (kopf calls this once
    per change it sees, not on every tick)."""
    handled = ((old or {}).get("metadata") or {}).get("generation")  # persistence.py puts it there
    change = update_event(body["metadata"].get("generation"), diff, handled_generation=handled)
    _tick(body, memo, logger, scrape=False, is_timer=False, change=change)


def on_timer(body: kopf.Body, memo: kopf.Memo, logger: kopf.Logger, **_: Any) -> None:
    _tick(body, memo, logger, scrape=True, is_timer=True)


def drop_old_finalizer(body: kopf.Body, patch: kopf.Patch, **_: Any) -> None:
    """An older operator's finalizer goes in the patch kopf applies after this event (a JSON patch of
    this one entry: other controllers' finalizers stay)."""
    if OLD_FINALIZER in (body.metadata.get("finalizers") or ()):
        patch.fns.append(_without_old_finalizer)


def _without_old_finalizer(raw: Any) -> None:
    finalizers = raw.get("metadata", {}).get("finalizers") or []
    raw["metadata"]["finalizers"] = [f for f in finalizers if f != OLD_FINALIZER]


def on_deployment_event(body: kopf.Body, memo: kopf.Memo, type: str | None, **_: Any) -> None:
    """A child Deployment changed (pods became ready, a rollout moved): refresh the owner's status now."""
    owner = next((r for r in body["metadata"].get("ownerReferences") or () if r.get("kind") == KIND), None)
    if owner is None or type == "DELETED":
        return
    ctx: Context = memo["ctx"]
    namespace = body["metadata"]["namespace"]
    try:
        # Under the owner's lock, and read after taking it: a tick's status patch has landed by then.
        with ctx.object_lock(namespace, owner["name"]):
            cr = ctx.kube.get(KIND, namespace, owner["name"])
            if cr is None or cr["metadata"].get("uid") != owner.get("uid"):
                return
            outcome = reconcile(ctx, cr, apply=False)
        _post(cr, outcome.events)
    except (KubeError, SpecError) as e:
        log.debug("status refresh from Deployment %s failed: %s", body["metadata"]["name"], e)


def _post(body: Any, events: list[Any]) -> None:
    for event in events:
        kopf.event(body, type=event.type, reason=event.reason, message=event.message)


def _tick(
    body: kopf.Body,
    memo: kopf.Memo,
    logger: kopf.Logger,
    *,
    scrape: bool,
    is_timer: bool,
    change: Event | None = None,
) -> None:
    """Autoscale, then reconcile; one at a time per object (the timer and events run concurrently).
    `change` (what a spec update changed) is posted once the new spec is applied."""
    ctx: Context = memo["ctx"]
    ctx.telemetry.reconciles.inc()
    with ctx.object_lock(body["metadata"]["namespace"], body["metadata"]["name"]):
        generation = body["metadata"].get("generation")
        if isinstance(generation, int) and generation < memo.get("generation", 0):
            # Read before a tick that held the lock ran on a newer spec (a timer waits here while an
            # update, often our own replicas patch, is handled): acting on it would undo that one.
            # An update's change still happened if that tick applied this spec or a later one (a
            # timer's replicas patch can land between the apply of a change and its update handler).
            if change is not None and memo.get("applied_generation", 0) >= generation:
                _post(body, [change])
            return
        try:
            state = memo.get("autoscaler") or seed_state(body.get("status") or {})
            scaled = autoscale(ctx, body, state, now_s=time.time(), scrape=scrape)
            memo["autoscaler"] = scaled.state
            if isinstance(generation, int):
                # A replicas patch made a newer spec than this body (any later change is newer still).
                memo["generation"] = generation + 1 if scaled.patched else generation
            # What the autoscaler recorded waits in the memo until a status patch has carried it.
            recorded = memo["recorded"] = {**memo.get("recorded", {}), **scaled.status}
            outcome = reconcile(
                ctx, body, load=scaled.load, is_load_known=scaled.is_load_known, recorded=recorded
            )
            memo["recorded"] = {}
            if isinstance(generation, int) and not (outcome.spec_error or outcome.apply_error):
                memo["applied_generation"] = generation
        except (KubeError, SpecError) as e:
            ctx.telemetry.count_error(error_reason(e))
            raise to_kopf(e) from e
    is_applied = change is not None and not (outcome.spec_error or outcome.apply_error)
    _post(body, ([change] if is_applied else []) + ([scaled.event] if scaled.event else []) + outcome.events)
    if outcome.spec_error:
        ctx.telemetry.count_error("invalid_spec")
        if not is_timer:
            raise to_kopf(SpecError(outcome.spec_error))
    if outcome.apply_error:
        ctx.telemetry.count_error("apply")
        logger.warning("apply failed: %s", outcome.apply_error)
