"""Starts the real ferrite-server binary on 127.0.0.1 for the OpenAI-client tests.

The Rust test `openai_client.rs` runs pytest with FERRITE_SERVER_BIN and FERRITE_MODEL set.
"""

import os
import socket
import subprocess
import tempfile
import time

import httpx
import openai
import pytest

API_KEY = "sk-ferrite-test"
MODEL = "smol"


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, extra):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        # The server's log, for tests that check what it did.
        self.logfile = tempfile.TemporaryFile()
        self.proc = subprocess.Popen(
            [
                os.environ["FERRITE_SERVER_BIN"],
                "--model", os.environ["FERRITE_MODEL"],
                "--host", "127.0.0.1", "--port", str(self.port),
                "--served-model-name", MODEL,
                "--max-model-len", "512",
                "--api-key", API_KEY,
                *extra,
            ],
            stdout=self.logfile,
            stderr=subprocess.STDOUT,
        )
        deadline = time.time() + 120
        while time.time() < deadline:
            assert self.proc.poll() is None, "server exited early"
            try:
                if httpx.get(f"{self.base}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.05)
        raise RuntimeError("server not ready")

    def log(self):
        self.logfile.seek(0)
        return self.logfile.read().decode(errors="replace")

    def stop(self):
        self.proc.terminate()
        self.proc.wait(timeout=60)
        self.logfile.close()


@pytest.fixture(scope="session")
def server():
    # Packed weights, the CPU default that users run, are bitwise batch invariant, so seeded and
    # greedy results replay exactly.
    s = Server(["--max-num-seqs", "4", "--max-queue-len", "4"])
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    return openai.OpenAI(base_url=f"{server.base}/v1", api_key=API_KEY, max_retries=0)
