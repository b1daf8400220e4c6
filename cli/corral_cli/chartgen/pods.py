"""The pod-level Kubernetes fragments in the chart's values (security contexts, spread constraints,
environment variables), typed with Kubernetes' own field names so a typo'd key fails `helm install`.

Each optional field may be null: Helm then drops the key, so a default (runAsUser 10001) can be unset
for a platform that assigns it (OpenShift's restricted-v2 SCC).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from corral_cli.chartgen.base import Fragment

# The image's user; any UID works (the root filesystem is read-only, scratch space is an emptyDir).
IMAGE_UID = 10001
ProfileType = Literal["RuntimeDefault", "Localhost", "Unconfined"]
Id = int | None


class SeccompProfile(Fragment):
    type: ProfileType
    localhost_profile: str | None = None


class AppArmorProfile(Fragment):
    type: ProfileType
    localhost_profile: str | None = None


class SELinuxOptions(Fragment):
    level: str | None = None
    role: str | None = None
    type: str | None = None
    user: str | None = None


class Capabilities(Fragment):
    add: list[str] | None = None
    drop: list[str] | None = None


class Sysctl(Fragment):
    name: str = Field(min_length=1)
    value: str


def _runtime_default() -> SeccompProfile:
    return SeccompProfile(type="RuntimeDefault")


class PodSecurityContext(Fragment):
    """core/v1 PodSecurityContext (the Linux fields)."""

    run_as_non_root: bool | None = True
    run_as_user: Id = Field(default=IMAGE_UID, ge=0)
    run_as_group: Id = Field(default=IMAGE_UID, ge=0)
    fs_group: Id = Field(default=IMAGE_UID, ge=0)
    seccomp_profile: SeccompProfile | None = Field(default_factory=_runtime_default)
    fs_group_change_policy: Literal["Always", "OnRootMismatch"] | None = None
    supplemental_groups: list[int] | None = None
    supplemental_groups_policy: Literal["Merge", "Strict"] | None = None
    se_linux_options: SELinuxOptions | None = None
    app_armor_profile: AppArmorProfile | None = None
    sysctls: list[Sysctl] | None = None


class ContainerSecurityContext(Fragment):
    """core/v1 SecurityContext of a container (the Linux fields)."""

    allow_privilege_escalation: bool | None = False
    read_only_root_filesystem: bool | None = True
    run_as_non_root: bool | None = True
    capabilities: Capabilities | None = Field(default_factory=lambda: Capabilities(drop=["ALL"]))
    seccomp_profile: SeccompProfile | None = Field(default_factory=_runtime_default)
    run_as_user: Id = Field(default=None, ge=0)
    run_as_group: Id = Field(default=None, ge=0)
    privileged: bool | None = None
    proc_mount: Literal["Default", "Unmasked"] | None = None
    se_linux_options: SELinuxOptions | None = None
    app_armor_profile: AppArmorProfile | None = None


class TopologySpreadConstraint(Fragment):
    """core/v1 TopologySpreadConstraint; without a labelSelector the chart selects the component's pods."""

    max_skew: int = Field(ge=1)
    topology_key: str = Field(min_length=1)
    when_unsatisfiable: Literal["DoNotSchedule", "ScheduleAnyway"]
    label_selector: dict[str, Any] | None = None
    match_label_keys: list[str] | None = None
    min_domains: int | None = Field(default=None, ge=1)
    node_affinity_policy: Literal["Honor", "Ignore"] | None = None
    node_taints_policy: Literal["Honor", "Ignore"] | None = None


class EnvVarSource(Fragment):
    """core/v1 EnvVarSource: exactly one of these (Kubernetes checks the selectors' own fields)."""

    secret_key_ref: dict[str, Any] | None = None
    config_map_key_ref: dict[str, Any] | None = None
    field_ref: dict[str, Any] | None = None
    resource_field_ref: dict[str, Any] | None = None


class EnvVar(Fragment):
    """core/v1 EnvVar: a value (a string: quote numbers) or a valueFrom."""

    name: str = Field(min_length=1)
    value: str | None = None
    value_from: EnvVarSource | None = None
