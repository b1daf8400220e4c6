"""The Event a spec update posts: what changed, in a user's words, once per change."""

from __future__ import annotations

import logging
from typing import Any

import kopf
import pytest
from corral_operator import handlers, labels
from corral_operator.changes import update_event
from corral_operator.status import Event

from tests.operator.invalid_cases import valid_spec
from tests.operator.test_operator_reconcile import FakeKube, body, make_ctx


def _diff(*paths: tuple[str, ...]) -> list[tuple[str, tuple[str, ...], Any, Any]]:
    return [("change", path, "old", "new") for path in paths]


def test_a_pod_template_change_says_it_rolls_out_and_names_what_changed() -> None:
    diff = _diff(("spec", "engine", "image"), ("spec", "engine", "args", "maxNumSeqs"), ("spec", "replicas"))
    assert update_event(4, diff) == Event(
        "Normal", "RollingOut", "generation 4: new pods for the changed image, engine args"
    )
    model = _diff(
        ("spec", "model", "uri"), ("spec", "resources", "memory"), ("spec", "autoscaling", "maxReplicas")
    )
    assert update_event(5, model) == Event(
        "Normal", "RollingOut", "generation 5: new pods for the changed model, resources (autoscaling too)"
    )


def test_an_adapter_change_rolls_out_as_it_changes_the_pod_template() -> None:
    # kopf's diff of a list: the whole list when an item is added or removed
    assert update_event(6, _diff(("spec", "adapters"))) == Event(
        "Normal", "RollingOut", "generation 6: new pods for the changed adapters"
    )


def test_a_change_no_pod_sees_is_noted_and_a_scale_or_metadata_change_is_not() -> None:
    assert update_event(2, _diff(("spec", "autoscaling", "maxReplicas"))) == Event(
        "Normal", "Updated", "generation 2: autoscaling changed"
    )
    assert update_event(3, _diff(("spec", "replicas"))) is None  # the autoscaler's own patch, kubectl scale
    assert update_event(3, _diff(("metadata", "annotations", "corral.dev/wake"))) is None


@pytest.fixture
def posted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str, str]]:
    events: list[tuple[str, str, str]] = []
    monkeypatch.setattr(
        kopf, "event", lambda _body, type, reason, message: events.append((type, reason, message))
    )
    return events


def _update(kube: FakeKube, spec: dict[str, Any], generation: int, diff: list[Any], memo: kopf.Memo) -> None:
    cr = kopf.Body(body(spec, generation=generation))  # type: ignore[arg-type]
    handlers.on_update(body=cr, memo=memo, logger=logging.getLogger("test"), diff=diff)  # type: ignore[arg-type]


def test_an_update_that_changes_the_image_posts_rolling_out_once(posted: list[tuple[str, str, str]]) -> None:
    kube = FakeKube()
    memo = kopf.Memo(ctx=make_ctx(kube))
    spec = valid_spec()
    spec["engine"]["image"] = "engine:v2"
    _update(kube, spec, 2, _diff(("spec", "engine", "image")), memo)
    (engine,) = kube.objects[("Deployment", "ml", "tiny")]["spec"]["template"]["spec"]["containers"]
    assert engine["image"] == "engine:v2"
    assert [p for p in posted if p[1] == "RollingOut"] == [
        ("Normal", "RollingOut", "generation 2: new pods for the changed image")
    ]
    posted.clear()
    # the timer's ticks and a later scale say nothing more about it
    tick = kopf.Body(body(spec, generation=2))  # type: ignore[arg-type]
    handlers.on_timer(body=tick, memo=memo, logger=logging.getLogger("test"))
    _update(kube, spec | {"replicas": 3}, 3, _diff(("spec", "replicas")), memo)
    assert [p for p in posted if p[1] in ("RollingOut", "Updated")] == []


def test_an_update_that_is_not_applied_says_nothing_of_a_rollout(posted: list[tuple[str, str, str]]) -> None:
    kube = FakeKube()
    kube.reject_kind = "Deployment"  # e.g. an admission webhook refuses it
    spec = valid_spec()
    spec["engine"]["image"] = "engine:v2"
    _update(kube, spec, 2, _diff(("spec", "engine", "image")), kopf.Memo(ctx=make_ctx(kube)))
    assert [p[1] for p in posted] == ["ApplyFailed"]


def test_a_change_applied_by_a_tick_that_raced_its_update_handler_still_posts_rolling_out(
    posted: list[tuple[str, str, str]],
) -> None:
    """A tick took the lock first, applied generation 2 (a new image) and patched replicas (a wake
    here): its update handler then sees an older generation than the memo's and skips the body, but
    the rollout it describes is under way."""
    kube = FakeKube()
    memo = kopf.Memo(ctx=make_ctx(kube))
    spec = valid_spec() | {"replicas": 0, "autoscaling": {"minReplicas": 0, "maxReplicas": 2}}
    spec["engine"]["image"] = "engine:v2"
    woken = body(spec, generation=2)
    woken["metadata"]["annotations"] = {labels.WAKE_ANNOTATION: "1970-01-01T00:25:00Z"}
    handlers.on_change(body=kopf.Body(woken), memo=memo, logger=logging.getLogger("test"))  # type: ignore[arg-type]
    assert ("replicas", 1) in kube.writes and memo["generation"] == 3
    posted.clear()
    _update(kube, spec, 2, _diff(("spec", "engine", "image")), memo)
    assert posted == [("Normal", "RollingOut", "generation 2: new pods for the changed image")]


def test_a_skipped_update_whose_spec_no_tick_applied_posts_nothing(
    posted: list[tuple[str, str, str]],
) -> None:
    kube = FakeKube()
    memo = kopf.Memo(ctx=make_ctx(kube), generation=3)  # a tick patched replicas, but its apply failed
    spec = valid_spec()
    spec["engine"]["image"] = "engine:v2"
    _update(kube, spec, 2, _diff(("spec", "engine", "image")), memo)
    assert posted == [] and kube.writes == []
