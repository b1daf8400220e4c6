"""Certificates and keys for the test control plane, made with the openssl command line tool.

One throwaway CA signs the API server's serving certificate (for 127.0.0.1 and localhost) and, on
demand, client certificates for any user and groups; a separate key pair signs ServiceAccount tokens.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass
from pathlib import Path

_CURVE = "prime256v1"  # EC keys: generating them takes milliseconds, unlike RSA.
_VALID_DAYS = "2"


class PkiError(RuntimeError):
    """openssl is missing or failed."""


@dataclass(frozen=True, slots=True)
class Pki:
    """Paths of the files the control plane components read."""

    directory: Path
    ca_cert: Path
    ca_key: Path
    serving_cert: Path
    serving_key: Path
    service_account_key: Path
    service_account_pub: Path

    def client_cert(self, user: str, groups: tuple[str, ...] = ()) -> tuple[Path, Path]:
        """Issues a client certificate: the API server reads CN as the user and O as the groups."""
        stem = _safe_file_name(user)
        key, csr, cert = (self.directory / f"client-{stem}.{ext}" for ext in ("key", "csr", "crt"))
        subject = "".join(f"/O={_escape_dn(g)}" for g in groups) + f"/CN={_escape_dn(user)}"
        _new_key(key)
        _openssl("req", "-new", "-key", key, "-subj", subject, "-out", csr)
        extensions = self.directory / f"client-{stem}.ext"
        extensions.write_text("keyUsage=critical,digitalSignature\nextendedKeyUsage=clientAuth\n")
        self._sign(csr, cert, extensions)
        return cert, key

    def _sign(self, csr: Path, cert: Path, extensions: Path) -> None:
        _openssl(
            "x509", "-req", "-in", csr, "-CA", self.ca_cert, "-CAkey", self.ca_key,
            "-CAcreateserial", "-days", _VALID_DAYS, "-extfile", extensions, "-out", cert,
        )  # fmt: skip


def create_pki(directory: Path) -> Pki:
    """Writes a fresh CA, a serving certificate for 127.0.0.1/localhost and a token signing key pair."""
    directory.mkdir(parents=True, exist_ok=True)
    pki = Pki(
        directory=directory,
        ca_cert=directory / "ca.crt",
        ca_key=directory / "ca.key",
        serving_cert=directory / "apiserver.crt",
        serving_key=directory / "apiserver.key",
        service_account_key=directory / "sa.key",
        service_account_pub=directory / "sa.pub",
    )
    _new_key(pki.ca_key)
    _openssl(
        "req", "-x509", "-new", "-key", pki.ca_key, "-subj", "/CN=corral-e2e-ca", "-days", _VALID_DAYS,
        "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        "-out", pki.ca_cert,
    )  # fmt: skip
    _new_key(pki.serving_key)
    csr = directory / "apiserver.csr"
    _openssl("req", "-new", "-key", pki.serving_key, "-subj", "/CN=kube-apiserver", "-out", csr)
    extensions = directory / "apiserver.ext"
    extensions.write_text(
        "subjectAltName=IP:127.0.0.1,DNS:localhost\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
    )
    pki._sign(csr, pki.serving_cert, extensions)
    _new_key(pki.service_account_key)
    _openssl("pkey", "-in", pki.service_account_key, "-pubout", "-out", pki.service_account_pub)
    return pki


def _new_key(path: Path) -> None:
    _openssl("genpkey", "-algorithm", "EC", "-pkeyopt", f"ec_paramgen_curve:{_CURVE}", "-out", path)


def _openssl(*args: str | Path) -> None:
    try:
        result = subprocess.run(["openssl", *map(str, args)], capture_output=True, text=True, check=False)
    except FileNotFoundError as exc:
        raise PkiError("the openssl command is not installed") from exc
    if result.returncode != 0:
        raise PkiError(f"openssl {args[0]} failed: {result.stderr.strip()}")


def _escape_dn(value: str) -> str:
    # openssl -subj uses '/' as the separator and '\' as the escape.
    return value.replace("\\", "\\\\").replace("/", "\\/").replace("=", "\\=")


def _safe_file_name(user: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in user)
