"""Where engine pods may run: core/v1 Toleration, Affinity and TopologySpreadConstraint as typed models.

Typed rather than open objects, so the CRD schema declares every field: a typo such as `nodeAfinity`
is refused by `kubectl apply` (strict field validation) instead of failing when the operator applies
the Deployment, and `kubectl explain llmd.spec.affinity` describes the fields. Lists default to None
so `model_dump(exclude_none=True)` renders only what the user wrote.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from corral_operator.spec_base import SpecModel

_WEIGHT = "1-100; the scheduler adds it to a node's score when the term matches."


class Toleration(SpecModel):
    """A core/v1 Toleration."""

    key: str | None = Field(default=None, description="The taint key; empty with Exists matches every taint.")
    operator: Literal["Exists", "Equal"] | None = Field(
        default=None, description="Equal (default) or Exists."
    )
    value: str | None = Field(default=None, description="The taint value (operator Equal).")
    effect: Literal["NoSchedule", "PreferNoSchedule", "NoExecute"] | None = Field(
        default=None, description="The taint effect to match; empty matches all."
    )
    toleration_seconds: int | None = Field(
        default=None, description="How long a NoExecute taint is tolerated before eviction."
    )


class LabelSelectorRequirement(SpecModel):
    """One label test: key, operator and values."""

    key: str = Field(min_length=1, description="The label key.")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="How key and values relate."
    )
    values: list[str] | None = Field(default=None, description="Values for In and NotIn; empty otherwise.")


class LabelSelector(SpecModel):
    """A metav1 LabelSelector: matchLabels and matchExpressions, ANDed."""

    match_labels: dict[str, str] | None = Field(default=None, description="Labels that must all be equal.")
    match_expressions: list[LabelSelectorRequirement] | None = Field(
        default=None, description="Label tests that must all hold."
    )


class NodeSelectorRequirement(SpecModel):
    """One node label (or field) test."""

    key: str = Field(min_length=1, description="The node label key (or field name, in matchFields).")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist", "Gt", "Lt"] = Field(
        description="How key and values relate; Gt and Lt compare one integer value."
    )
    values: list[str] | None = Field(default=None, description="Values for In, NotIn, Gt and Lt.")


class NodeSelectorTerm(SpecModel):
    """Node tests that must all hold."""

    match_expressions: list[NodeSelectorRequirement] | None = Field(
        default=None, description="Tests on the node's labels."
    )
    match_fields: list[NodeSelectorRequirement] | None = Field(
        default=None, description="Tests on the node's fields (metadata.name)."
    )


class NodeSelector(SpecModel):
    """Node terms, ORed: a node that matches any one qualifies."""

    node_selector_terms: list[NodeSelectorTerm] = Field(min_length=1, description="The terms, ORed.")


class PreferredSchedulingTerm(SpecModel):
    """A node term the scheduler prefers, with its weight."""

    weight: int = Field(ge=1, le=100, description=_WEIGHT)
    preference: NodeSelectorTerm = Field(description="The node term.")


class NodeAffinity(SpecModel):
    """Which nodes the engine pods need or prefer."""

    required_during_scheduling_ignored_during_execution: NodeSelector | None = Field(
        default=None, description="Nodes a pod must be scheduled on."
    )
    preferred_during_scheduling_ignored_during_execution: list[PreferredSchedulingTerm] | None = Field(
        default=None, description="Nodes the scheduler prefers, by weight."
    )


class PodAffinityTerm(SpecModel):
    """Pods (by labels and namespaces) that must, or must not, share a topology domain with this one."""

    topology_key: str = Field(
        min_length=1, description="The node label that names a domain, e.g. kubernetes.io/hostname."
    )
    label_selector: LabelSelector | None = Field(default=None, description="The pods this term is about.")
    namespace_selector: LabelSelector | None = Field(
        default=None, description="Namespaces (by labels) the pods are looked for in."
    )
    namespaces: list[str] | None = Field(
        default=None, description="Namespaces the pods are looked for in; empty: this pod's own."
    )
    match_label_keys: list[str] | None = Field(
        default=None, description="This pod's label keys whose values are added to labelSelector with In."
    )
    mismatch_label_keys: list[str] | None = Field(
        default=None, description="This pod's label keys whose values are added to labelSelector with NotIn."
    )


class WeightedPodAffinityTerm(SpecModel):
    """A pod term the scheduler prefers, with its weight."""

    weight: int = Field(ge=1, le=100, description=_WEIGHT)
    pod_affinity_term: PodAffinityTerm = Field(description="The pod term.")


class PodAffinity(SpecModel):
    """Pods the engine pods need or prefer to be near (or, as anti-affinity, away from)."""

    required_during_scheduling_ignored_during_execution: list[PodAffinityTerm] | None = Field(
        default=None, description="Terms a node must meet for a pod to be scheduled on it."
    )
    preferred_during_scheduling_ignored_during_execution: list[WeightedPodAffinityTerm] | None = Field(
        default=None, description="Terms the scheduler prefers, by weight."
    )


class Affinity(SpecModel):
    """A core/v1 Affinity: node affinity, pod affinity and pod anti-affinity."""

    node_affinity: NodeAffinity | None = Field(default=None, description="Node affinity.")
    pod_affinity: PodAffinity | None = Field(default=None, description="Pod affinity.")
    pod_anti_affinity: PodAffinity | None = Field(
        default=None, description="Pod anti-affinity, e.g. one replica per node."
    )


class TopologySpreadConstraint(SpecModel):
    """A core/v1 TopologySpreadConstraint; without a labelSelector it counts this deployment's pods."""

    max_skew: int = Field(ge=1, description="How unevenly the pods may spread over the domains.")
    topology_key: str = Field(min_length=1, description="The node label that names a domain.")
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"] = Field(
        description="Whether a pod that would break maxSkew stays Pending or is placed anyway."
    )
    label_selector: LabelSelector | None = Field(
        default=None, description="The pods counted; absent: this deployment's engine pods."
    )
    min_domains: int | None = Field(
        default=None, ge=1, description="Domains counted at least (DoNotSchedule only)."
    )
    match_label_keys: list[str] | None = Field(
        default=None, description="Pod label keys whose values narrow the pods counted."
    )
    node_affinity_policy: Literal["Honor", "Ignore"] | None = Field(
        default=None, description="Whether the pod's node affinity limits the domains (default Honor)."
    )
    node_taints_policy: Literal["Honor", "Ignore"] | None = Field(
        default=None, description="Whether node taints limit the domains (default Ignore)."
    )
