"""Getting out of a locked-down cluster: an HTTPS proxy (CONNECT), NO_PROXY, a private CA bundle, and
``stepdoctor sync`` configured by the same ``STEPDOCTOR_*`` variables as the agent.

Everything is real: a CONNECT proxy thread on 127.0.0.1, an HTTPS server whose certificate is signed
by a CA made here with the ``openssl`` command, and the agent's own ``http.client`` code.
"""

from __future__ import annotations

import base64
import contextlib
import os
import select
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from stepdoctor import config, sync
from stepdoctor.spool import Spool
from support import spooling
from support.fake_server import TOKEN, FakeServer
from support.spooling import spool_traces

pytestmark = pytest.mark.filterwarnings("error::pytest.PytestUnhandledThreadExceptionWarning")
real_trace = spooling.real_trace  # a small real Kineto trace (module-scoped fixture)

NETWORK_VARS = (
    "HTTPS_PROXY",
    "https_proxy",
    "HTTP_PROXY",
    "http_proxy",
    "ALL_PROXY",
    "all_proxy",
    "NO_PROXY",
    "no_proxy",
    "STEPDOCTOR_CA_BUNDLE",
    "REQUESTS_CA_BUNDLE",
    "SSL_CERT_FILE",
    "STEPDOCTOR_SERVER",
    "STEPDOCTOR_SPOOL",
    "STEPDOCTOR_TOKEN",
)


@pytest.fixture(autouse=True)
def _clean_network_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in NETWORK_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("STEPDOCTOR_RAISE_ERRORS", "1")


# -- a private CA and a server certificate ---------------------------------------------------------


@dataclass(frozen=True)
class Pki:
    ca: Path
    cert: Path
    key: Path

    def server_context(self) -> ssl.SSLContext:
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        context.load_cert_chain(self.cert, self.key)
        return context


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True, timeout=60)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    """A CA and a ``localhost`` certificate it signed (strict enough for Python 3.13's X509 checks)."""
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command is needed to make test certificates")
    d = tmp_path_factory.mktemp("pki")
    _openssl(
        "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.pem",
        "-days", "2", "-subj", "/CN=stepdoctor test CA",
        "-addext", "basicConstraints=critical,CA:TRUE",
        "-addext", "keyUsage=critical,keyCertSign,cRLSign",
        cwd=d,
    )  # fmt: skip
    _openssl(
        "req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=localhost",
        cwd=d,
    )  # fmt: skip
    (d / "ext.cnf").write_text(
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=critical,CA:FALSE\n"
        "keyUsage=critical,digitalSignature,keyEncipherment\nextendedKeyUsage=serverAuth\n"
        "authorityKeyIdentifier=keyid\nsubjectKeyIdentifier=hash\n"
    )
    _openssl(
        "x509", "-req", "-in", "server.csr", "-CA", "ca.pem", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "server.pem", "-days", "2", "-extfile", "ext.cnf",
        cwd=d,
    )  # fmt: skip
    return Pki(ca=d / "ca.pem", cert=d / "server.pem", key=d / "server.key")


# -- a forward proxy: CONNECT tunnels and absolute-form HTTP requests ----------------------------


@dataclass
class Proxy:
    """A tiny HTTP/1.1 forward proxy; ``seen`` holds each request line and its Proxy-Authorization."""

    port: int = 0
    seen: list[tuple[str, str | None]] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


def _read_head(conn: socket.socket) -> tuple[bytes, bytes]:
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = conn.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    return head, rest


def _pipe(a: socket.socket, b: socket.socket) -> None:
    """Copy bytes both ways until either side closes (or resets: a refused certificate does)."""
    sockets = [a, b]
    with contextlib.suppress(OSError):
        while True:
            readable, _, _ = select.select(sockets, [], [], 10)
            if not readable:
                return
            for sock in readable:
                data = sock.recv(65536)
                if not data:
                    return
                (b if sock is a else a).sendall(data)


def _handle(proxy: Proxy, client: socket.socket) -> None:
    with client:
        head, rest = _read_head(client)
        lines = head.decode("latin-1").split("\r\n")
        method, target, version = lines[0].split(" ", 2)
        headers = dict(line.split(": ", 1) for line in lines[1:] if ": " in line)
        proxy.seen.append((lines[0], headers.get("Proxy-Authorization")))
        if method == "CONNECT":
            host, port = target.rsplit(":", 1)
            upstream = socket.create_connection((host, int(port)), timeout=10)
            client.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
        else:  # absolute-form: forward in origin-form
            url = urllib.parse.urlsplit(target)
            upstream = socket.create_connection((url.hostname or "", url.port or 80), timeout=10)
            origin = f"{method} {url.path}?{url.query} {version}"
            kept = [f"{k}: {v}" for k, v in headers.items() if k.lower() != "proxy-authorization"]
            upstream.sendall(("\r\n".join([origin, *kept]) + "\r\n\r\n").encode("latin-1") + rest)
        with upstream:
            _pipe(client, upstream)


@pytest.fixture
def proxy() -> Iterator[Proxy]:
    listener = socket.create_server(("127.0.0.1", 0))
    state = Proxy(port=listener.getsockname()[1])
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                client, _ = listener.accept()
            except TimeoutError:
                continue
            except OSError:
                return
            threading.Thread(target=_handle, args=(state, client), daemon=True).start()

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    yield state
    stop.set()
    thread.join(2)
    listener.close()


# -- the tests -------------------------------------------------------------------------------------


def _sync_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in NETWORK_VARS and not k.startswith("STEPDOCTOR_")}
    return {**env, "STEPDOCTOR_RAISE_ERRORS": "1", **extra}


def test_sync_uploads_over_https_through_a_connect_proxy_trusting_the_ca_bundle(
    tmp_path: Path, real_trace: bytes, pki: Pki, proxy: Proxy
) -> None:
    """The whole configuration comes from the environment, as a cluster's job script sets it."""
    with FakeServer(tls=pki.server_context()) as server:
        assert server.url.startswith("https://localhost:")
        keys = spool_traces(Spool(tmp_path), real_trace, 2, None)
        env = _sync_env(
            STEPDOCTOR_SERVER=server.url,
            STEPDOCTOR_SPOOL=str(tmp_path),
            STEPDOCTOR_TOKEN=TOKEN,
            STEPDOCTOR_CA_BUNDLE=str(pki.ca),
            HTTPS_PROXY=f"http://agent:s%40cret@127.0.0.1:{proxy.port}",
            NO_PROXY="example.invalid",
        )
        out = subprocess.run(
            [sys.executable, "-m", "stepdoctor", "sync", "--timeout", "20"],
            env=env,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        assert "2 uploaded" in out.stdout
        assert set(server.uploads) == set(keys)
    assert [line.rsplit(" ", 1)[0] for line, _ in proxy.seen] == [f"CONNECT localhost:{server.port}"] * 2
    credentials = base64.b64encode(b"agent:s@cret").decode()
    assert {auth for _, auth in proxy.seen} == {f"Basic {credentials}"}


def test_without_the_ca_bundle_the_certificate_is_refused_and_the_traces_stay(
    tmp_path: Path,
    real_trace: bytes,
    pki: Pki,
    proxy: Proxy,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with FakeServer(tls=pki.server_context()) as server:
        keys = spool_traces(Spool(tmp_path), real_trace, 1, server.url)
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        code = sync.main(
            ["--spool", str(tmp_path), "--token", TOKEN, "--timeout", "0.5", "--backoff-base", "0.05"]
        )
        assert code == 1 and server.uploads == {}
        summary = capsys.readouterr().out
        assert "1 left in" in summary and "CERTIFICATE_VERIFY_FAILED" in summary  # says why
        assert len(Spool(tmp_path).sidecars()) == len(keys)  # nothing lost
        assert proxy.seen and proxy.seen[0][0].startswith("CONNECT localhost:")


def test_no_proxy_sends_directly(
    tmp_path: Path, real_trace: bytes, pki: Pki, proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeServer(tls=pki.server_context()) as server:
        keys = spool_traces(Spool(tmp_path), real_trace, 1, server.url)
        monkeypatch.setenv("HTTPS_PROXY", proxy.url)
        monkeypatch.setenv("NO_PROXY", ".example.org,localhost")
        monkeypatch.setenv("REQUESTS_CA_BUNDLE", str(pki.ca))  # the variable requests users already set
        assert sync.main(["--spool", str(tmp_path), "--token", TOKEN, "--timeout", "10"]) == 0
        assert list(server.uploads) == keys
    assert proxy.seen == []


def test_plain_http_goes_through_the_http_proxy_in_absolute_form(
    tmp_path: Path, real_trace: bytes, proxy: Proxy, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeServer() as server:
        keys = spool_traces(Spool(tmp_path), real_trace, 1, None)
        monkeypatch.setenv("HTTP_PROXY", proxy.url)
        monkeypatch.setenv("STEPDOCTOR_SERVER", server.url)  # sync honours it like --server
        assert sync.main(["--spool", str(tmp_path), "--token", TOKEN, "--timeout", "10"]) == 0
        assert list(server.uploads) == keys
    ((line, auth),) = proxy.seen
    assert line.startswith(f"POST {server.url}/api/v1/traces?project=proj&run=r1") and auth is None


def test_ca_bundle_precedence(monkeypatch: pytest.MonkeyPatch) -> None:
    assert config.ca_bundle() is None
    monkeypatch.setenv("SSL_CERT_FILE", "/c")
    monkeypatch.setenv("REQUESTS_CA_BUNDLE", "/b")
    assert config.ca_bundle() == "/b"
    monkeypatch.setenv("STEPDOCTOR_CA_BUNDLE", "~/a.pem")
    assert config.ca_bundle() == os.path.expanduser("~/a.pem")


def test_sync_takes_spool_and_token_from_the_environment(
    tmp_path: Path, real_trace: bytes, monkeypatch: pytest.MonkeyPatch
) -> None:
    with FakeServer() as server:
        keys = spool_traces(Spool(tmp_path), real_trace, 1, None)
        monkeypatch.setenv("STEPDOCTOR_SERVER", server.url + "/")
        monkeypatch.setenv("STEPDOCTOR_SPOOL", str(tmp_path))
        monkeypatch.setenv("STEPDOCTOR_TOKEN", TOKEN)
        assert sync.main(["--timeout", "10"]) == 0
        assert list(server.uploads) == keys
