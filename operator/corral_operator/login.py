"""How the operator logs in to the API server: an explicit kubeconfig, else the pod's service account."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import kopf
from kubernetes import client, config


def login(*, kubeconfig: Path | None, **kwargs: Any) -> kopf.ConnectionInfo | None:
    """kopf's login handler; `kubeconfig` comes from the operator settings (`--kubeconfig`)."""
    if kubeconfig is not None:
        # An explicit kubeconfig wins over the pod's service account.
        return connection_from_kubeconfig(kubeconfig, trust_env=kwargs["settings"].networking.trust_env)
    return kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)


def connection_from_kubeconfig(path: Path, *, trust_env: bool = False) -> kopf.ConnectionInfo:
    """The current context of the kubeconfig at `path`, read by the kubernetes client's own loader.

    kopf's login_with_kubeconfig reads only $KUBECONFIG; this reads the named file, so the settings
    reach kopf without touching the environment. Read on every (re-)login: rotated tokens are seen.
    """
    cfg = client.Configuration()
    config.load_kube_config(config_file=str(path), client_configuration=cfg)
    # kubernetes >= 36 keeps the bearer token under BearerToken, older versions under authorization.
    header = cfg.get_api_key_with_prefix("BearerToken") or cfg.get_api_key_with_prefix("authorization")
    scheme, _, token = (header or "").rpartition(" ")
    return kopf.ConnectionInfo(
        server=cfg.host,
        ca_path=cfg.ssl_ca_cert,
        insecure=not cfg.verify_ssl,
        username=cfg.username or None,
        password=cfg.password or None,
        scheme=scheme or None,
        token=token or None,
        certificate_path=cfg.cert_file,
        private_key_path=cfg.key_file,
        proxy_url=cfg.proxy or None,
        trust_env=trust_env,
    )
