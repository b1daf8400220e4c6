"""The operator against the real control plane: apply -> children -> Available; change; scale; delete."""

from __future__ import annotations

import ipaddress
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from corral_operator import labels
from corral_operator.handlers import EVENT_SOURCE

from e2e.k8s.cluster import Cluster
from e2e.operator.harness import (
    LOOPBACK,
    OperatorProcess,
    WatchLLMD,
    condition,
    events_of,
    fake_metrics,
    free_port,
    get_llmd,
    install_service_monitor_crd,
    is_available,
    llmdeployment,
    running_pods,
)

pytestmark = [pytest.mark.k8s, pytest.mark.e2e]
CHILD_KINDS = ("deployment", "service", "poddisruptionbudget")


def test_apply_creates_owned_children_running_pods_and_available_status(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    port = free_port()
    cluster.apply(yaml.safe_dump(llmdeployment("tiny", ns, replicas=2, port=port)))
    cr = cluster.wait_until(
        "Available", lambda: (o := get_llmd(cluster, ns, "tiny")) and is_available(o) and o
    )
    uid = cr["metadata"]["uid"]
    for kind in CHILD_KINDS:
        child = cluster.get_json(kind, "tiny", "-n", ns)
        (ref,) = child["metadata"]["ownerReferences"]
        assert (ref["kind"], ref["name"], ref["uid"], ref["controller"]) == (
            "LLMDeployment",
            "tiny",
            uid,
            True,
        )
        assert child["metadata"]["labels"][labels.MODEL] == "tiny"
    pods = cluster.wait_until(
        "2 pods Running", lambda: (p := running_pods(cluster, ns, "tiny")) and len(p) == 2 and p
    )
    node_names = {n.name for n in cluster.nodes}
    for pod in pods:
        assert pod["spec"]["nodeName"] in node_names
        assert ipaddress.ip_address(pod["status"]["podIP"]) in LOOPBACK
    assert cr["status"]["endpoint"] == f"http://tiny.{ns}.svc:{port}"
    assert cr["status"]["selector"] == labels.selector_string("tiny")
    # the gateway discovers replicas from the EndpointSlices of this Service, which mirror its labels
    service = cluster.get_json("service", "tiny", "-n", ns)
    assert service["metadata"]["labels"][labels.MANAGED_BY] == "corral-operator"
    assert service["spec"]["ports"] == [
        {"name": "http", "port": port, "protocol": "TCP", "targetPort": "http"}
    ]

    # live load: fake engine metrics on the pods' loopback IPs, read by the operator's real scraper
    with fake_metrics(port, waiting=3, running=1, kv_usage=0.25) as fake:
        for pod in pods:
            fake.serve_on(pod["status"]["podIP"])
        cluster.wait_until(
            "load in status",
            lambda: (
                ((get_llmd(cluster, ns, "tiny") or {}).get("status") or {})
                .get("load", {})
                .get("numRequestsWaiting")
                == 6
            ),
        )
    # the habitual wait works: Ready follows the pods that take traffic
    cluster.kubectl("wait", "--for=condition=Ready", "llmd/tiny", "-n", ns, "--timeout=60s")
    table = cluster.kubectl("get", "llmd", "-n", ns).stdout.splitlines()
    header = ["NAME", "MODEL", "ENGINE", "READY", "UP", "REPLICAS", "KV%", "WAITING", "URL", "AGE"]
    assert table[0].split() == header
    url = f"http://tiny.{ns}.svc:{port}"
    assert table[1].split()[:9] == ["tiny", "tiny", "corral", "True", "2", "2", "25", "6", url]


def test_spec_change_rolls_the_deployment_and_observed_generation_follows(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    cluster.apply(yaml.safe_dump(llmdeployment("roll", ns, replicas=1)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "roll")))

    def rolled_to(generation: int, check: Callable[[dict], bool]) -> Callable[[], bool]:
        def probe() -> bool:
            cr = get_llmd(cluster, ns, "roll") or {}
            dep = cluster.get_json("deployment", "roll", "-n", ns)
            status = dep.get("status", {})
            return (
                cr.get("metadata", {}).get("generation") == generation
                and (cr.get("status") or {}).get("observedGeneration") == generation
                and check(dep)
                and status.get("updatedReplicas") == 1
                and status.get("observedGeneration") == dep["metadata"]["generation"]
            )

        return probe

    def command(dep: dict) -> list[str]:
        return dep["spec"]["template"]["spec"]["containers"][0]["command"]

    def patch_engine(engine: str) -> None:
        cluster.kubectl(
            "patch", "llmd", "roll", "-n", ns, "--type=merge", "-p", f'{{"spec":{{"engine":{engine}}}}}'
        )

    patch_engine('{"args":{"maxNumSeqs":16}}')
    cluster.wait_until(
        "engine arg rolled",
        rolled_to(2, lambda d: command(d)[command(d).index("--max-num-seqs") + 1] == "16"),
    )
    patch_engine('{"image":"corral-engine:e2e-2"}')
    cluster.wait_until(
        "image rolled",
        rolled_to(
            3, lambda d: d["spec"]["template"]["spec"]["containers"][0]["image"] == "corral-engine:e2e-2"
        ),
    )
    replica_sets = cluster.get_json("replicasets", "-n", ns, "-l", labels.selector_string("roll"))["items"]
    assert len({rs["metadata"]["labels"]["pod-template-hash"] for rs in replica_sets}) == 3

    def rollout_events(reason: str = "RollingOut") -> list[str]:
        selector = f"involvedObject.kind=LLMDeployment,involvedObject.name=roll,reason={reason}"
        events = cluster.get_json("events", "-n", ns, "--field-selector", selector)["items"]
        return sorted(e["message"] for e in events)

    # `kubectl describe llmd` says each update rolls out, and what changed; once per generation
    cluster.wait_until("RollingOut Events", lambda: len(rollout_events()) == 2)
    assert rollout_events() == [
        "generation 2: new pods for the changed engine args",
        "generation 3: new pods for the changed image",
    ]
    # ... and when its new pods all run and are ready (the first revision, at creation, is no rollout)
    cluster.wait_until("RolledOut Events", lambda: len(rollout_events("RolledOut")) == 2)
    assert rollout_events("RolledOut") == [
        "generation 2, Deployment revision 2: 1/1 replicas run the new pods and are ready",
        "generation 3, Deployment revision 3: 1/1 replicas run the new pods and are ready",
    ]


def test_kubectl_scale_and_delete_garbage_collects(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    cluster.apply(yaml.safe_dump(llmdeployment("scaled", ns, replicas=1)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "scaled")))
    # One budget at every size (maxUnavailable 1): scaling never deletes and recreates it.
    pdb_uid = cluster.get_json("pdb", "scaled", "-n", ns)["metadata"]["uid"]
    cluster.kubectl("scale", "llmd/scaled", "-n", ns, "--replicas", "3")
    cluster.wait_until("3 pods Running", lambda: len(running_pods(cluster, ns, "scaled")) == 3)
    cluster.wait_until(
        "status.replicas 3",
        lambda: ((get_llmd(cluster, ns, "scaled") or {}).get("status") or {}).get("readyReplicas") == 3,
    )
    cluster.kubectl("scale", "llmd/scaled", "-n", ns, "--replicas", "1")
    cluster.wait_until("1 pod Running", lambda: len(running_pods(cluster, ns, "scaled")) == 1)
    pdb = cluster.get_json("pdb", "scaled", "-n", ns)
    assert pdb["metadata"]["uid"] == pdb_uid

    def disruptions_allowed() -> int | None:
        return (cluster.get_json("pdb", "scaled", "-n", ns).get("status") or {}).get("disruptionsAllowed")

    # At one replica the budget lets a drain evict it (as no budget would), rather than block it.
    cluster.wait_until("disruptionsAllowed 1 at one replica", lambda: disruptions_allowed() == 1)
    events = cluster.get_json("events", "-n", ns, "--field-selector", "involvedObject.name=scaled")["items"]
    assert not [e for e in events if e["reason"] == "Pruned"]
    cluster.kubectl("delete", "llmd", "scaled", "-n", ns)
    for kind in CHILD_KINDS:
        cluster.wait_until(
            f"{kind} garbage-collected",
            lambda kind=kind: cluster.kubectl("get", kind, "scaled", "-n", ns, check=False).returncode != 0,
        )
    cluster.wait_until(
        "pods gone",
        lambda: not cluster.get_json("pods", "-n", ns, "-l", labels.selector_string("scaled"))["items"],
    )


def test_service_monitor_when_prometheus_operator_crd_exists(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    install_service_monitor_crd(cluster)
    start_operator()
    cluster.apply(yaml.safe_dump(llmdeployment("monitored", ns, replicas=1)))
    cluster.wait_until("Available", lambda: is_available(get_llmd(cluster, ns, "monitored")))
    monitor = cluster.wait_until(
        "ServiceMonitor",
        lambda: cluster.get_json("servicemonitors", "-n", ns)["items"],
    )[0]
    assert monitor["metadata"]["ownerReferences"][0]["name"] == "monitored"
    assert monitor["spec"]["endpoints"] == [{"port": "http", "path": "/metrics", "interval": "15s"}]
    assert monitor["spec"]["selector"] == {"matchLabels": labels.selector("monitored")}


def test_pod_escape_hatches_are_accepted_by_the_api_server_and_reach_running_pods(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    # A RuntimeClass must exist for pods to name it (the API server's RuntimeClass admission).
    runtime_class = {"apiVersion": "node.k8s.io/v1", "kind": "RuntimeClass", "metadata": {"name": ns}}
    cluster.apply(yaml.safe_dump({**runtime_class, "handler": "runc"}))
    doc = llmdeployment("hatch", ns, replicas=1)
    doc["spec"]["pod"] = {
        "imagePullSecrets": ["regcred"],
        "envFrom": [{"configMapRef": {"name": "engine-env", "optional": True}}],
        "runtimeClassName": ns,
        "topologySpreadConstraints": [
            {"maxSkew": 1, "topologyKey": "kubernetes.io/hostname", "whenUnsatisfiable": "ScheduleAnyway"}
        ],
        "securityContext": {"runAsUser": 20000},
        "probes": {"startup": {"failureThreshold": 720}},
        "shmSize": "1Gi",
    }
    cluster.apply(yaml.safe_dump(doc))
    cluster.kubectl("wait", "--for=condition=Ready", "llmd/hatch", "-n", ns, "--timeout=60s")
    (pod,) = running_pods(cluster, ns, "hatch")
    spec = pod["spec"]
    assert spec["imagePullSecrets"] == [{"name": "regcred"}]
    assert spec["runtimeClassName"] == ns
    assert spec["topologySpreadConstraints"][0]["labelSelector"]["matchLabels"] == labels.selector("hatch")
    assert spec["securityContext"]["runAsUser"] == 20000
    (engine,) = spec["containers"]
    assert engine["envFrom"] == [{"configMapRef": {"name": "engine-env", "optional": True}}]
    assert engine["startupProbe"]["failureThreshold"] == 720
    dshm = next(v for v in spec["volumes"] if v["name"] == "dshm")
    assert dshm["emptyDir"] == {"medium": "Memory", "sizeLimit": "1Gi"}


def test_a_hub_model_gets_a_fetch_init_container_and_its_token_stays_in_its_secret(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    token = "hf_e2e_secret_value_never_shown"
    secret = {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hub", "namespace": ns}}
    cluster.apply(yaml.safe_dump({**secret, "stringData": {"HF_TOKEN": token}}))
    doc = llmdeployment("hub", ns, replicas=1)
    doc["spec"]["model"] = {
        "name": "org/tiny-chat",
        "uri": "hf://org/tiny-chat@main",
        "credentialsSecret": "hub",
        "cache": {"sizeLimit": "1Gi"},
    }
    cluster.apply(yaml.safe_dump(doc))
    cluster.kubectl("wait", "--for=condition=Ready", "llmd/hub", "-n", ns, "--timeout=60s")
    template = cluster.get_json("deployment", "hub", "-n", ns)["spec"]["template"]["spec"]
    (fetch,) = template["initContainers"]
    assert fetch["command"][:3] == ["corral", "fetch-model", "hf://org/tiny-chat@main"]
    assert fetch["envFrom"] == [{"secretRef": {"name": "hub"}}]
    command = template["containers"][0]["command"]
    assert command[command.index("--model") + 1] == "hf://org/tiny-chat@main"
    seen = cluster.kubectl("get", "llmd,deployment,pods,events", "-n", ns, "-o", "json").stdout
    assert token not in seen


def test_adapters_get_their_own_fetchers_and_reach_the_engine_as_lora_modules(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    doc = llmdeployment("lora", ns, replicas=1)
    doc["spec"]["model"] = {"name": "org/tiny", "uri": "hf://org/tiny", "cache": {"sizeLimit": "1Gi"}}
    doc["spec"]["adapters"] = [
        {"name": "sql-lora", "uri": "hf://org/sql-lora@v1"},
        {"name": "support", "uri": "pvc://loras/support"},
    ]
    cluster.apply(yaml.safe_dump(doc))  # the API server accepts the schema and its CEL rules

    def template() -> dict | None:
        found = cluster.kubectl("get", "deployment", "lora", "-n", ns, "-o", "json", check=False)
        return yaml.safe_load(found.stdout)["spec"]["template"]["spec"] if found.returncode == 0 else None

    pod = cluster.wait_until("the Deployment", template)
    assert [c["name"] for c in pod["initContainers"]] == ["fetch-model", "fetch-adapter-0"]
    assert pod["initContainers"][1]["command"][:3] == ["corral", "fetch-model", "hf://org/sql-lora@v1"]
    command = pod["containers"][0]["command"]
    modules = command[command.index("--lora-modules") + 1 : command.index("--host")]
    assert "--enable-lora" in command
    assert modules == ["sql-lora=/models-cache/hf/org/sql-lora/v1", "support=/mnt/pvc/loras/support"]
    claim = {"claimName": "loras", "readOnly": True}
    assert {"name": "adapters-1", "persistentVolumeClaim": claim} in pod["volumes"]
    # no such claim here: status says which one is missing, as for the model's
    cluster.wait_until(
        "Degraded for the adapters' claim",
        lambda: "'loras'" in condition(get_llmd(cluster, ns, "lora"), "Degraded").get("message", ""),
    )


def test_scale_up_and_rollout_keep_ready_and_observed_generation_only_moves_forward(
    operator_installed: Cluster,
    start_operator: Callable[..., OperatorProcess],
    k8s_namespace: str,
    tmp_path: Path,
) -> None:
    """With maxUnavailable 0 the child Deployment's Available is False for the whole of a scale-up;
    the serving model's Ready and Available must not follow it, only Progressing. And the
    Deployment-event refresh racing a tick's status patch must not write an older
    observedGeneration back, nor post a transition's Events twice."""
    cluster, ns = operator_installed, k8s_namespace
    start_operator()
    cluster.apply(yaml.safe_dump(llmdeployment("steady", ns, replicas=2)))

    def settled(replicas: int, generation: int) -> bool:
        cr = get_llmd(cluster, ns, "steady") or {}
        status = cr.get("status") or {}
        return (
            cr["metadata"]["generation"] == generation
            and status.get("observedGeneration") == generation
            and status.get("readyReplicas") == replicas
            and condition(cr, "Progressing").get("status") == "False"
        )

    cluster.wait_until("2 replicas settled", lambda: settled(2, 1))
    with WatchLLMD(cluster, ns, "steady", tmp_path / "watch.json") as watch:
        cluster.kubectl("scale", "llmd/steady", "-n", ns, "--replicas", "4")
        cluster.wait_until("4 replicas settled", lambda: settled(4, 2))
        patch = '{"spec":{"engine":{"args":{"maxNumSeqs":16}}}}'
        cluster.kubectl("patch", "llmd", "steady", "-n", ns, "--type=merge", "-p", patch)
        cluster.wait_until("rolled out", lambda: settled(4, 3))
        time.sleep(3)  # a few more Deployment events and a timer tick
        versions = watch.versions()
    assert len(versions) >= 4
    seen = [(condition(v, "Ready").get("status"), condition(v, "Available").get("status")) for v in versions]
    assert set(seen) == {("True", "True")}, seen
    generations = [(v.get("status") or {}).get("observedGeneration") for v in versions]
    assert generations == sorted(generations), generations
    progressing = {condition(v, "Progressing").get("reason") for v in versions}
    assert "RollingOut" in progressing
    events = events_of(cluster, ns, "steady")
    assert not [e for e in events if e["reason"] == "NoReplicasReady"], events
    ours = Counter(
        (e["reason"], e["message"]) for e in events if e["source"].get("component") == EVENT_SOURCE
    )
    assert ours and max(ours.values()) == 1, ours
    # the scale to 4 replaced no pods: only the rollout of generation 3 says it finished
    rolled_out = [m for (reason, m) in ours if reason == "RolledOut"]
    assert rolled_out == [
        "generation 3, Deployment revision 2: 4/4 replicas run the new pods and are ready"
    ], ours


def test_pod_security_admission_gates_what_an_llmdeployment_may_run(
    operator_installed: Cluster, start_operator: Callable[..., OperatorProcess], k8s_namespace: str
) -> None:
    """An LLMDeployment may ask for what a pod spec may (a hostPath here): the namespace's Pod Security
    level is what refuses it, and status says so (examples/README.md, "Pod escape hatches"). The
    operator's own pod defaults pass `restricted`."""
    cluster, ns = operator_installed, k8s_namespace
    cluster.kubectl("label", "namespace", ns, "pod-security.kubernetes.io/enforce=restricted")
    start_operator()
    cluster.apply(yaml.safe_dump(llmdeployment("on-host", ns, replicas=1)))
    on_pvc = llmdeployment("on-pvc", ns, replicas=1)
    on_pvc["spec"]["model"]["source"] = {"pvc": {"claimName": "models", "path": "tiny"}}
    cluster.apply(yaml.safe_dump(on_pvc))

    def refused() -> dict | None:
        degraded = condition(get_llmd(cluster, ns, "on-host"), "Degraded")
        return degraded if degraded.get("reason") == "ReplicaFailure" else None

    degraded = cluster.wait_until("on-host refused", refused)
    assert degraded["status"] == "True" and "PodSecurity" in degraded["message"], degraded
    assert "hostPath" in degraded["message"], degraded
    selector = labels.selector_string("on-pvc")
    cluster.wait_until(
        "on-pvc pod admitted", lambda: cluster.get_json("pods", "-n", ns, "-l", selector)["items"]
    )
