"""Operator settings: built from `corral operator` flags, passed to the handler registry and the login
without touching the environment."""

from __future__ import annotations

import os
from pathlib import Path

import kopf
import pytest
import yaml
from corral_cli.cmd_operator import settings_from_args
from corral_cli.main import build_parser
from corral_operator.handlers import build_registry
from corral_operator.login import connection_from_kubeconfig
from corral_operator.settings import ANY_NETWORK, OperatorSettings
from kopf._core.intents.handlers import TimerHandler  # kopf exports no registry accessors
from pydantic import ValidationError


def settings_for(*flags: str) -> OperatorSettings:
    return settings_from_args(build_parser(only="operator").parse_args(["operator", *flags]))


def test_flags_become_settings() -> None:
    settings = settings_for("-n", "ml", "--resync-seconds", "3", "--priority", "7", "--kubeconfig", "/k")
    assert settings.namespaces == ("ml",) and settings.resync_s == 3.0 and settings.priority == 7
    assert settings.kubeconfig == Path("/k") and settings.scrape_networks == ANY_NETWORK
    assert settings.liveness_url == "http://0.0.0.0:8080/healthz" and settings.scrape_metrics
    assert settings_for("--liveness", "").liveness_url is None
    assert settings_for("--scrape-network", "127.0.0.0/8").scrape_networks == ("127.0.0.0/8",)
    assert "resync_s=3.0" in settings.describe()


def test_priority_is_drawn_once_when_not_given() -> None:
    settings = settings_for()
    assert 1 <= settings.priority < 1 << 53  # exact as a JSON number in the peering object
    assert settings.priority > 1 << 30  # outranks a replica of an older release (random, at most 2**30)
    assert f"priority={settings.priority}" in settings.describe()  # the logged value is the one used


def test_a_replica_started_later_outranks_the_one_it_replaces(monkeypatch: pytest.MonkeyPatch) -> None:
    # A crashed replica's peering record lives on for kopf's lifetime (60 s); the restarted one must
    # not pause behind it, so it must have the higher priority, whatever the draw.
    import corral_operator.settings as settings_module

    draws = iter([1 << 30, 0])  # the restarted replica draws the lower random number
    monkeypatch.setattr(
        settings_module.random.SystemRandom, "randrange", lambda _self, n: min(next(draws), n - 1)
    )
    monkeypatch.setattr(settings_module.random.SystemRandom, "randint", lambda _self, a, b: next(draws))
    monkeypatch.setattr(settings_module.time, "time", lambda: 1_800_000_000.000)
    crashed = settings_for()
    monkeypatch.setattr(settings_module.time, "time", lambda: 1_800_000_000.010)
    restarted = settings_for()
    assert restarted.priority > crashed.priority


def test_bad_values_are_refused_at_the_edge_and_settings_are_frozen() -> None:
    with pytest.raises(ValidationError):
        settings_for("--resync-seconds", "0")
    with pytest.raises(ValidationError):
        settings_for("--scrape-network", "not-a-network")
    settings = settings_for()
    with pytest.raises(ValidationError):
        settings.resync_s = 2.0  # type: ignore[misc]  # frozen: passed down, never changed


def test_the_timer_interval_comes_from_the_settings_not_the_environment() -> None:
    before = dict(os.environ)
    registry = build_registry(OperatorSettings(resync_s=3.5))
    assert dict(os.environ) == before
    # kopf keeps timers in its spawning registry (no public accessor).
    timers = [t for t in registry._spawning.get_all_handlers() if isinstance(t, TimerHandler)]
    assert [(t.id, t.interval, t.initial_delay) for t in timers] == [("on_timer", 3.5, 3.5)]
    other = build_registry(OperatorSettings(resync_s=20))._spawning.get_all_handlers()
    assert [t.interval for t in other if isinstance(t, TimerHandler)] == [20]  # its own settings


def test_every_handler_is_registered() -> None:
    registry = build_registry(OperatorSettings())
    activities = {h.id for h in registry._activities.get_all_handlers()}
    # kopf marks a resume handler by `initial`, not by a reason.
    changing = {
        (h.id, h.reason or ("resume" if h.initial else None)) for h in registry._changing.get_all_handlers()
    }
    watching = {h.id for h in registry._watching.get_all_handlers()}
    assert activities == {"configure", "check_crds", "login", "alive"}
    assert changing == {("on_change", "create"), ("on_update", "update"), ("on_change", "resume")}
    assert watching == {"on_deployment_event", "drop_old_finalizer"}


def test_login_reads_the_named_kubeconfig(tmp_path: Path) -> None:
    ca = tmp_path / "ca.crt"
    ca.write_text("not checked at login\n")
    path = tmp_path / "operator.kubeconfig"
    path.write_text(
        yaml.safe_dump(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {
                        "name": "c",
                        "cluster": {"server": "https://127.0.0.1:6443", "certificate-authority": str(ca)},
                    }
                ],
                "users": [{"name": "u", "user": {"token": "s3cret"}}],
                "contexts": [{"name": "x", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "x",
            }
        )
    )
    info = connection_from_kubeconfig(path, trust_env=True)
    assert isinstance(info, kopf.ConnectionInfo)
    assert (info.server, info.token, info.scheme) == ("https://127.0.0.1:6443", "s3cret", "Bearer")
    assert info.ca_path == str(ca) and not info.insecure and info.trust_env


def test_the_api_client_keeps_a_connection_per_handler_worker(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import multiprocessing

    from corral_operator.kube import API_POOL_SIZE, load_config
    from kubernetes import client

    # The client's default pool is 5 per CPU: on two CPUs, 10 (on a large CI machine the default
    # alone would pass).
    monkeypatch.setattr(multiprocessing, "cpu_count", lambda: 2)

    kubeconfig = tmp_path / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'https://127.0.0.1:6443'}}]\n"
        "users: [{name: u, user: {token: t}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
    )
    before = client.Configuration.get_default_copy()
    try:
        load_config(kubeconfig)
        loaded = client.Configuration.get_default_copy()
        assert loaded.host == "https://127.0.0.1:6443"
        assert loaded.connection_pool_maxsize >= API_POOL_SIZE >= 16  # kopf's max_workers
        assert client.ApiClient().rest_client.pool_manager.connection_pool_kw["maxsize"] >= API_POOL_SIZE
    finally:
        client.Configuration.set_default(before)


def test_events_name_the_operator_as_their_source() -> None:
    from corral_operator.handlers import EVENT_SOURCE, configure

    settings = kopf.OperatorSettings()
    configure(settings)
    assert settings.posting.reporting_component == EVENT_SOURCE == "corral-operator"
    assert settings.posting.reporting_instance not in ("", "dev")


def test_the_monitor_interval_comes_from_its_flag_and_a_typo_fails_at_start_up() -> None:
    parse = build_parser(only="operator").parse_args
    assert settings_from_args(parse(["operator"])).monitor_interval == "15s"
    assert settings_from_args(parse(["operator", "--monitor-interval", "30s"])).monitor_interval == "30s"
    with pytest.raises(ValueError, match="monitor_interval"):
        settings_from_args(parse(["operator", "--monitor-interval", "30 seconds"]))


def test_monitor_labels_come_from_repeated_flags() -> None:
    args = build_parser(only="operator").parse_args(
        ["operator", "--monitor-label", "release=kps", "--monitor-label", "team=a=b"]
    )
    assert settings_from_args(args).monitor_labels == {"release": "kps", "team": "a=b"}
    bad = build_parser(only="operator").parse_args(["operator", "--monitor-label", "release"])
    with pytest.raises(ValueError, match="KEY=VALUE"):
        settings_from_args(bad)
