"""Real fusedlayer_server processes for the client tests.

The binary: $FUSEDLAYER_SERVER, else build/server/fusedlayer_server of this repository. Each server
runs the CPU backend on 127.0.0.1 with a port the kernel picks (--address=127.0.0.1:0); the port is
read from its startup line "serving fusedlayer.v1.FusedLayer on ... (port N)", as
tests/server/demo_server_process.h does.
"""

import os
import re
import subprocess
import threading

import numpy as np
import pytest

import fusedlayer

REPO = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..", ".."))
_PORT = re.compile(r"serving fusedlayer\.v1\.FusedLayer .*\(port ([0-9]+)\)")


class ServerProcess:
    def __init__(self, extra_args=(), demo_weights=True):
        binary = os.environ.get("FUSEDLAYER_SERVER", os.path.join(REPO, "build", "server", "fusedlayer_server"))
        if not os.access(binary, os.X_OK):
            raise RuntimeError(f"no server binary at {binary}: build it (cmake --build build --target "
                               "fusedlayer_server) or set FUSEDLAYER_SERVER")
        args = [binary, "--backend=cpu", "--cpu_threads=2", "--address=127.0.0.1:0", "--metrics_address="]
        if demo_weights:
            args.append("--demo_weights")
        self.proc = subprocess.Popen(args + list(extra_args), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                     text=True)
        self.log = []
        self.port = None
        for line in self.proc.stdout:
            self.log.append(line)
            m = _PORT.search(line)
            if m:
                self.port = int(m.group(1))
                break
        if self.port is None:
            self.proc.wait()
            raise RuntimeError("the server exited before serving:\n" + "".join(self.log))
        # Keep draining its output so a chatty server never blocks on a full pipe.
        self._drain = threading.Thread(target=lambda: self.log.extend(self.proc.stdout), daemon=True)
        self._drain.start()
        self.target = f"127.0.0.1:{self.port}"

    def stop(self):
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# The session server's receive limit; test_client.py sends one request above it.
SERVER_MAX_MESSAGE_BYTES = 16 << 20


@pytest.fixture(scope="session")
def server():
    s = ServerProcess(extra_args=[f"--max_message_bytes={SERVER_MAX_MESSAGE_BYTES}"])
    yield s
    s.stop()


@pytest.fixture
def client(server):
    with fusedlayer.Client(server.target) as c:
        yield c


# The CPU devices of the two-device server (--devices=0,1 on the CPU backend splits the cores into
# two devices, each with every weight set resident).
TWO_DEVICES = (0, 1)


@pytest.fixture(scope="session")
def devices_server():
    s = ServerProcess(extra_args=["--devices=" + ",".join(str(d) for d in TWO_DEVICES), "--allow_call_rings",
                                  "--allow_shared_memory"])
    yield s
    s.stop()


@pytest.fixture
def devices_client(devices_server):
    with fusedlayer.Client(devices_server.target) as c:
        yield c


@pytest.fixture
def rng(request):
    # A fresh seed per run (printed on failure through the test id's output) keeps inputs fresh.
    seed = int.from_bytes(os.urandom(4), "little")
    print(f"seed = {seed}")
    return np.random.default_rng(seed)


def pytest_configure(config):
    config.addinivalue_line(
        "markers", "cuda_host: needs a GPU, torch.cuda and a CUDA fusedlayer_server (FUSEDLAYER_CUDA_SERVER); "
        "CI deselects these (-m 'not cuda_host'), the GPU host runs them (-m cuda_host)")
