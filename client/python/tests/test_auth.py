"""Bearer tokens from a token file (docs/security.md): UNAUTHENTICATED / PERMISSION_DENIED, and the
client-side refusal to send a token in clear text to a non-loopback target."""

import os
import secrets

import grpc
import pytest

import fusedlayer
from conftest import ServerProcess
from helpers import mhc_weights, seam_inputs


@pytest.fixture(scope="module")
def tokens(tmp_path_factory):
    d = tmp_path_factory.mktemp("tokens")
    compute, admin = secrets.token_hex(32), secrets.token_hex(32)
    (d / "tokens").write_text(f"# test tokens\n{compute} compute\n{admin} admin\n")
    paths = {}
    for name, token in (("compute", compute), ("admin", admin), ("unknown", secrets.token_hex(32))):
        paths[name] = str(d / name)
        (d / name).write_text(token + "\n")
        os.chmod(paths[name], 0o600)
    paths["server_file"] = str(d / "tokens")
    return paths


@pytest.fixture(scope="module")
def auth_server(tokens):
    s = ServerProcess(extra_args=[f"--auth_tokens_file={tokens['server_file']}"])
    yield s
    s.stop()


def test_no_token_is_unauthenticated(auth_server, rng):
    with fusedlayer.Client(auth_server.target) as c:
        with pytest.raises(fusedlayer.Unauthenticated) as e:
            c.server_info()
        assert e.value.code == grpc.StatusCode.UNAUTHENTICATED
        with pytest.raises(fusedlayer.Unauthenticated):
            c.mhc_seam("v41-flash/demo", **seam_inputs(rng, 1, 4, 5120))
        assert c.health("") == "SERVING"  # health stays open for probes


def test_unknown_token_is_unauthenticated(auth_server, tokens):
    with fusedlayer.Client(auth_server.target, token_file=tokens["unknown"]) as c:
        with pytest.raises(fusedlayer.Unauthenticated):
            c.list_weight_sets()


def test_rights(auth_server, tokens, rng):
    w = mhc_weights(rng, 4, 64)
    with fusedlayer.Client(auth_server.target, token_file=tokens["compute"]) as c:
        assert c.server_info().backend == "cpu"
        assert c.mhc_seam("v41-flash/demo", **seam_inputs(rng, 2, 4, 5120)).report.path == "fused"
        with pytest.raises(fusedlayer.PermissionDenied) as e:
            c.load_weights(w, name="py-test/auth", mhc=dict(hc_mult=4, hidden=64))
        assert e.value.code == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(fusedlayer.PermissionDenied):
            c.unload_weight_set("v41-flash/demo")
    with fusedlayer.Client(auth_server.target, token_file=tokens["admin"]) as c:
        [info] = c.load_weights(w, name="py-test/auth", mhc=dict(hc_mult=4, hidden=64))
        assert info.name == "py-test/auth"
        with pytest.raises(fusedlayer.PermissionDenied):
            c.list_weight_sets()  # admin only: listing needs compute
        assert c.unload_weight_set("py-test/auth") > 0


def test_token_in_clear_text_to_a_remote_target_is_refused(tokens):
    with pytest.raises(ValueError, match="clear text"):
        fusedlayer.Client("10.1.2.3:50051", token_file=tokens["compute"])
    # With TLS it is allowed (the channel is created lazily: nothing is sent here).
    fusedlayer.Client("10.1.2.3:50051", tls=True, token_file=tokens["compute"]).close()


def test_token_file_errors(tmp_path):
    empty = tmp_path / "empty"
    empty.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        fusedlayer.Client("127.0.0.1:1", token_file=str(empty))
    spaced = tmp_path / "spaced"
    spaced.write_text("abc def\n")
    with pytest.raises(ValueError, match="just the token") as e:
        fusedlayer.Client("127.0.0.1:1", token_file=str(spaced))
    assert "abc" not in str(e.value)  # never quotes the token
    with pytest.raises(ValueError, match="cannot read"):
        fusedlayer.Client("127.0.0.1:1", token_file=str(tmp_path / "missing"))
