"""The LLMDeployment status as pydantic models: the CRD's status schema. The operator writes status
as plain dicts (computed by status.py); these models only describe them to the API server.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from corral_operator.spec_base import SpecModel


class Condition(SpecModel):
    """One aspect of the deployment's state (docs/operations.md, "LLMDeployment status")."""

    type: Literal["Ready", "Available", "Progressing", "Degraded"] = Field(
        description="Ready: a request sent now is served. Available: at least one replica is ready. "
        "Progressing: a rollout or scale is under way. Degraded: something is wrong (see reason)."
    )
    status: Literal["True", "False", "Unknown"] = Field(description="True, False or Unknown.")
    reason: str = Field(max_length=128, description="Why, in one CamelCase word.")
    message: str = Field(default="", max_length=4096, description="Why, for a human.")
    last_transition_time: str | None = Field(default=None, description="When status last changed.")
    observed_generation: int | None = Field(
        default=None, description="The metadata.generation this condition was computed for."
    )


class LoadStatus(SpecModel):
    kv_usage_percent: int | None = Field(default=None, description="Mean KV cache usage of ready replicas.")
    num_requests_waiting: int | None = Field(default=None, description="Waiting requests, all replicas.")
    num_requests_running: int | None = Field(default=None, description="Running requests, all replicas.")
    observed_at: str | None = Field(default=None, description="When the replicas were scraped.")


class LLMDeploymentStatus(SpecModel):
    observed_generation: int | None = Field(
        default=None, description="The last metadata.generation applied to the children; never decreases."
    )
    replicas: int | None = Field(default=None, description="Engine pods (the scale subresource's count).")
    ready_replicas: int | None = Field(default=None, description="Engine pods that are ready.")
    updated_replicas: int | None = Field(default=None, description="Engine pods running the current spec.")
    selector: str | None = Field(default=None, description="Label selector of the pods (scale subresource).")
    endpoint: str | None = Field(default=None, description="In-cluster URL of the Service.")
    tensor_parallel_size: int | None = Field(
        default=None, description="Ranks (GPUs) one replica spans: --tensor-parallel-size."
    )
    rolled_out_revision: int | None = Field(
        default=None,
        description="The child Deployment's revision (deployment.kubernetes.io/revision) whose pods last "
        "all ran and were ready; a new one posts a RolledOut Event.",
    )
    rolled_out_generation: int | None = Field(
        default=None,
        description="The observedGeneration when the pods last all ran and were ready (a RolledOut "
        "Event names the generation only when it moved).",
    )
    conditions: list[Condition] = Field(
        default_factory=list, description="Ready, Available, Progressing, Degraded."
    )
    load: LoadStatus | None = Field(
        default=None, description="The engines' load at the last scrape (builtin autoscaling reads it)."
    )
    last_scale_time: str | None = Field(
        default=None, description="When the autoscaler last changed replicas."
    )
    last_active_time: str | None = Field(default=None, description="Last time a replica had work.")
