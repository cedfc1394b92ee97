"""Finding 8 (startup): a refused listen address was found only after the model had loaded, and
was reported as "unhandled errors in a TaskGroup". Now ``enginecore serve`` checks and binds the
address first: exit 2 with one clear line, before any loading."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
ENV.pop("ENGINECORE_TOKEN", None)


def _serve(listen: str) -> tuple[int, str]:
    proc = subprocess.run([sys.executable, "-m", "entrypoints.cli", "serve", "--model", "random:tiny-llama",
                           "--listen", listen], env=ENV, capture_output=True, text=True, timeout=120)
    return proc.returncode, proc.stderr


@pytest.fixture
def busy_tcp_port():
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    yield s.getsockname()[1]
    s.close()


@pytest.fixture
def busy_unix_socket(tmp_path):
    path = str(tmp_path / "busy.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.listen(1)
    yield path
    s.close()


@pytest.mark.parametrize("case", ["non-loopback without token", "tcp port in use",
                                  "socket path in use", "bad address"])
def test_bad_listen_address_exits_2_before_loading(case, request):
    if case == "non-loopback without token":
        listen, expect = "tcp://0.0.0.0:0", "refusing to listen on non-loopback"
    elif case == "tcp port in use":
        listen, expect = f"tcp://127.0.0.1:{request.getfixturevalue('busy_tcp_port')}", "address in use"
    elif case == "socket path in use":
        listen, expect = f"unix://{request.getfixturevalue('busy_unix_socket')}", "address in use"
    else:
        listen, expect = "http://127.0.0.1:80", "bad address"
    code, err = _serve(listen)
    assert code == 2, err
    lines = [ln for ln in err.splitlines() if ln.startswith("enginecore: cannot listen on")]
    assert len(lines) == 1 and expect in lines[0], err
    assert "loading" not in err and "TaskGroup" not in err and "Traceback" not in err, err
