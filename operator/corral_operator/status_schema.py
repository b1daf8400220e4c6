"""The LLMDeployment status as pydantic models: the CRD's status schema. The operator writes status
as plain dicts (computed by status.py); these models only describe them to the API server.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from corral_operator.spec_base import SpecModel


class Condition(SpecModel):
    type: Literal["Ready", "Available", "Progressing", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(max_length=128)
    message: str = Field(default="", max_length=4096)
    last_transition_time: str | None = None
    observed_generation: int | None = None


class LoadStatus(SpecModel):
    kv_usage_percent: int | None = Field(default=None, description="Mean KV cache usage of ready replicas.")
    num_requests_waiting: int | None = Field(default=None, description="Waiting requests, all replicas.")
    num_requests_running: int | None = None
    observed_at: str | None = None


class LLMDeploymentStatus(SpecModel):
    observed_generation: int | None = None
    replicas: int | None = None
    ready_replicas: int | None = None
    updated_replicas: int | None = None
    selector: str | None = Field(default=None, description="Label selector of the pods (scale subresource).")
    endpoint: str | None = Field(default=None, description="In-cluster URL of the Service.")
    tensor_parallel_size: int | None = Field(
        default=None, description="Ranks (GPUs) one replica spans: --tensor-parallel-size."
    )
    conditions: list[Condition] = Field(default_factory=list)
    load: LoadStatus | None = None
    last_scale_time: str | None = None
    last_active_time: str | None = Field(default=None, description="Last time a replica had work.")
