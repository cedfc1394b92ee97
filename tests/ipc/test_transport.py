"""Addresses, listeners and tokens."""

from __future__ import annotations

import errno
import os
import socket
import stat

import anyio
import pytest

from ipc.transport import (
    Address,
    check_token,
    connect,
    listener_address,
    open_listener,
    parse_address,
    remove_socket,
    socket_inode,
)


@pytest.mark.parametrize(
    "text,expected",
    [
        ("unix:///tmp/e.sock", Address("unix", path="/tmp/e.sock")),
        ("unix://rel/e.sock", Address("unix", path="rel/e.sock")),
        ("tcp://127.0.0.1:5555", Address("tcp", host="127.0.0.1", port=5555)),
        ("tcp://:5555", Address("tcp", host="127.0.0.1", port=5555)),
        ("tcp://localhost:0", Address("tcp", host="localhost", port=0)),
        ("tcp://[::1]:80", Address("tcp", host="::1", port=80)),
        ("tcp://0.0.0.0:80/", Address("tcp", host="0.0.0.0", port=80)),
    ],
)
def test_parse_address(text, expected):
    assert parse_address(text) == expected
    assert parse_address(str(parse_address(text))) == expected


@pytest.mark.parametrize(
    "text",
    ["", "/tmp/x.sock", "unix://", "http://127.0.0.1:80", "tcp://127.0.0.1", "tcp://h:99999",
     "tcp://h:abc", "tcp://u:p@h:1", "tcp://h:1/path", "tcp://h:1?x=1", "zmq://x",
     "unix:///" + "a" * 200, "unix:///tmp/a\x00b"],
)
def test_parse_address_rejects(text):
    with pytest.raises(ValueError):
        parse_address(text)


def test_loopback():
    assert parse_address("tcp://127.0.0.2:1").is_loopback
    assert parse_address("tcp://[::1]:1").is_loopback
    assert parse_address("tcp://localhost:1").is_loopback
    assert not parse_address("tcp://0.0.0.0:1").is_loopback
    assert not parse_address("tcp://example.com:1").is_loopback


def test_check_token():
    assert check_token(None, None) and check_token(None, "x") and check_token("", None)
    assert check_token("s3cret", "s3cret")
    assert not check_token("s3cret", None)
    assert not check_token("s3cret", "s3creT")
    assert not check_token("s3cret", "s3cret ")
    assert not check_token("s3cret", "sécret")  # non-ASCII does not raise


@pytest.mark.asyncio
async def test_unix_listener_mode_and_cleanup(tmp_path):
    address = f"unix://{tmp_path}/e.sock"
    async with await open_listener(address) as listener:
        st = os.lstat(tmp_path / "e.sock")
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
        assert listener_address(listener, address) == address
        inode = socket_inode(address)
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: _accept_and_echo(listener))
            async with await connect(address) as c:
                await c.send(b"ping")
                assert await c.receive() == b"ping"
    assert remove_socket(address, inode=inode)
    assert not (tmp_path / "e.sock").exists()
    assert not remove_socket(address)


async def _accept_and_echo(listener):
    conn = await listener.accept()
    async with conn:
        await conn.send(await conn.receive())


@pytest.mark.asyncio
async def test_stale_socket_is_replaced(tmp_path):
    path = str(tmp_path / "stale.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)  # bound, never listening, then closed: a dead engine's leftover
    s.close()
    assert os.path.exists(path)
    async with await open_listener(f"unix://{path}"):
        assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600


@pytest.mark.asyncio
async def test_live_socket_is_not_stolen(tmp_path):
    address = f"unix://{tmp_path}/live.sock"
    async with await open_listener(address):
        inode = socket_inode(address)
        with pytest.raises(OSError) as info:
            await open_listener(address)
        assert info.value.errno == errno.EADDRINUSE
        assert socket_inode(address) == inode  # untouched


@pytest.mark.asyncio
async def test_regular_file_is_not_replaced(tmp_path):
    path = tmp_path / "file.sock"
    path.write_text("important")
    with pytest.raises(FileExistsError):
        await open_listener(f"unix://{path}")
    assert path.read_text() == "important"
    assert not remove_socket(f"unix://{path}")
    assert path.exists()


def test_remove_socket_other_inode(tmp_path):
    path = str(tmp_path / "x.sock")
    s = socket.socket(socket.AF_UNIX)
    s.bind(path)
    s.close()
    assert not remove_socket(f"unix://{path}", inode=os.lstat(path).st_ino + 1)
    assert os.path.exists(path)


@pytest.mark.asyncio
async def test_tcp_defaults_to_loopback_and_port_zero_resolves():
    async with await open_listener("tcp://:0") as listener:
        addr = parse_address(listener_address(listener, "tcp://:0"))
        assert addr.host == "127.0.0.1" and addr.port > 0
        async def echo(conn):
            async with conn:
                await conn.send(await conn.receive())

        async with anyio.create_task_group() as tg:
            tg.start_soon(listener.serve, echo)
            async with await connect(addr) as c:
                await c.send(b"x")
                assert await c.receive() == b"x"
            tg.cancel_scope.cancel()


@pytest.mark.asyncio
@pytest.mark.parametrize("host", ["0.0.0.0", "[::]", "example.com"])
async def test_non_loopback_tcp_requires_a_token(host):
    with pytest.raises(ValueError, match="token"):
        await open_listener(f"tcp://{host}:0")
    with pytest.raises(ValueError, match="token"):
        await open_listener(f"tcp://{host}:0", token="")


@pytest.mark.asyncio
async def test_non_loopback_tcp_with_token_binds():
    async with await open_listener("tcp://0.0.0.0:0", token="t0ken") as listener:
        assert parse_address(listener_address(listener, "tcp://0.0.0.0:0")).port > 0


@pytest.mark.asyncio
async def test_connect_port_zero_refused():
    with pytest.raises(ValueError):
        await connect("tcp://127.0.0.1:0")
