"""TLS and mutual TLS with throwaway certificates made as docs/security.md shows (openssl)."""

import subprocess

import grpc
import pytest

import fusedlayer
from conftest import ServerProcess

EC = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]


def _openssl(*args, cwd):
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", *EC, "-days", "2", "-subj", "/CN=py-test-ca", "-keyout", "ca.key", "-out", "ca.pem",
             "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign", cwd=d)
    (d / "server.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    (d / "client.ext").write_text("extendedKeyUsage=clientAuth\n")
    for who in ("server", "client"):
        _openssl("req", *EC, "-subj", f"/CN={who}", "-keyout", f"{who}.key", "-out", f"{who}.csr", cwd=d)
        _openssl("x509", "-req", "-days", "2", "-in", f"{who}.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
                 "-CAcreateserial", "-extfile", f"{who}.ext", "-out", f"{who}.pem", cwd=d)
    return d


@pytest.fixture(scope="module")
def mtls_server(pki):
    # Transport only: without a token file the server needs --allow_unauthenticated_tls to start
    # (mTLS alone authorizes no rights; docs/security.md). Tokens over TLS are test_auth's.
    s = ServerProcess(extra_args=[f"--tls_cert={pki / 'server.pem'}", f"--tls_key={pki / 'server.key'}",
                                  f"--tls_client_ca={pki / 'ca.pem'}", "--allow_unauthenticated_tls"],
                      demo_weights=False)
    yield s
    s.stop()


def test_mutual_tls(mtls_server, pki):
    tls = fusedlayer.Tls(ca=str(pki / "ca.pem"), cert=str(pki / "client.pem"), key=str(pki / "client.key"))
    with fusedlayer.Client(mtls_server.target, tls=tls) as c:
        assert c.server_info().backend == "cpu"
    # The same as a dict, and with the server name given explicitly (dialling by IP).
    with fusedlayer.Client(mtls_server.target, tls={"ca": str(pki / "ca.pem"), "cert": str(pki / "client.pem"),
                                                    "key": str(pki / "client.key"), "server_name": "localhost"}) as c:
        assert c.health("") == "SERVING"


@pytest.mark.parametrize("how", ["plaintext", "no client certificate", "untrusted server"])
def test_handshake_failures_are_unavailable(mtls_server, pki, how):
    tls = {"plaintext": None, "no client certificate": fusedlayer.Tls(ca=str(pki / "ca.pem")),
           "untrusted server": fusedlayer.Tls(cert=str(pki / "client.pem"), key=str(pki / "client.key"))}[how]
    with fusedlayer.Client(mtls_server.target, tls=tls, timeout=10) as c:
        with pytest.raises(fusedlayer.Unavailable) as e:
            c.server_info()
    assert e.value.code == grpc.StatusCode.UNAVAILABLE


def test_tls_argument_errors(pki):
    with pytest.raises(ValueError, match="together"):
        fusedlayer.Client("127.0.0.1:1", tls=fusedlayer.Tls(cert=str(pki / "client.pem")))
    with pytest.raises(ValueError, match="cannot read"):
        fusedlayer.Client("127.0.0.1:1", tls=fusedlayer.Tls(ca=str(pki / "missing.pem")))
