"""Addresses, listeners and connections: ``unix:///path`` (default) and ``tcp://host:port``.

* Unix sockets are created with mode 0600 (only the owner may connect). A socket file left over
  by a dead engine is removed first -- but only if nothing answers on it; a live one, or a path
  that is not a socket, is an error.
* TCP listens on 127.0.0.1 unless a host is given; a non-loopback host needs a token. With a
  token configured, every client must present it -- on loopback TCP and Unix sockets too
  (compared in constant time by :func:`check_token`). Without one, a loopback TCP listener lets
  every local user in: :func:`preflight_listen` warns. There is no TLS: put a non-loopback
  listener behind a trusted network or a tunnel.
* :func:`preflight_listen` checks and binds the address before anything expensive happens
  (``enginecore serve`` calls it before loading the model) and turns every failure into one
  :class:`ListenError` with a clear message.
"""

from __future__ import annotations

from dataclasses import dataclass
import errno
import hmac
import ipaddress
import logging
import os
import socket
import stat
import struct
from typing import Literal
from urllib.parse import urlsplit

import anyio
from anyio.abc import ByteStream, Listener, SocketAttribute

from engine import envs

log = logging.getLogger("enginecore.ipc")

DEFAULT_TCP_HOST = "127.0.0.1"
UNIX_SOCKET_MODE = 0o600
# sun_path is 108 bytes on Linux (104 on macOS), NUL included.
_MAX_UNIX_PATH = 107


@dataclass(frozen=True)
class Address:
    """A parsed address: ``kind`` "unix" with ``path``, or "tcp" with ``host`` and ``port``."""

    kind: Literal["unix", "tcp"]
    path: str | None = None
    host: str | None = None
    port: int | None = None

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix://{self.path}"
        host = f"[{self.host}]" if self.host and ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"

    @property
    def is_loopback(self) -> bool:
        return self.kind == "unix" or is_loopback_host(self.host or DEFAULT_TCP_HOST)


def parse_address(address: str | Address) -> Address:
    """Parse ``unix:///abs/path`` (or ``unix://rel/path``) or ``tcp://host:port``.

    An empty TCP host means 127.0.0.1. Port 0 (listen on any free port) is allowed here;
    :func:`connect` refuses it. Anything else raises ``ValueError``.
    """
    if isinstance(address, Address):
        return address
    if not isinstance(address, str):
        raise ValueError(f"address must be a string, got {type(address).__name__}")
    if "\x00" in address:
        raise ValueError("address contains a NUL byte")
    if address.startswith("unix://"):
        path = address[len("unix://"):]
        if not path:
            raise ValueError(f"{address!r}: empty socket path (use unix:///absolute/path)")
        if len(os.fsencode(path)) > _MAX_UNIX_PATH:
            raise ValueError(f"{address!r}: socket path longer than {_MAX_UNIX_PATH} bytes")
        return Address("unix", path=path)
    if address.startswith("tcp://"):
        parts = urlsplit(address)
        if parts.path not in ("", "/") or parts.query or parts.fragment or parts.username or parts.password:
            raise ValueError(f"{address!r}: expected tcp://host:port and nothing else")
        try:
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"{address!r}: bad port ({exc})") from None
        if port is None:
            raise ValueError(f"{address!r}: missing port (tcp://host:port)")
        host = parts.hostname or DEFAULT_TCP_HOST
        return Address("tcp", host=host, port=port)
    raise ValueError(f"unsupported address {address!r}: use unix:///path or tcp://host:port")


def is_loopback_host(host: str) -> bool:
    """True for "localhost" and loopback IP literals; any other name counts as non-loopback."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_token(expected: str | None, given: str | None) -> bool:
    """Constant-time token check; no (or an empty) expected token lets anyone in."""
    if not expected:
        return True
    if given is None:
        return False
    return hmac.compare_digest(expected.encode("utf-8"), given.encode("utf-8"))


async def _clear_stale_socket(path: str) -> None:
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket; refusing to replace it", path)
    try:
        stream = await anyio.connect_unix(path)
    except (ConnectionRefusedError, FileNotFoundError):
        try:
            os.unlink(path)  # stale: nobody listens on it
        except FileNotFoundError:
            pass
        return
    except OSError as exc:
        # EAGAIN (backlog full), EACCES (someone else's socket), ...: do not touch it.
        raise OSError(exc.errno, f"cannot tell whether the socket is in use ({exc.strerror})", path) from None
    await stream.aclose()
    raise OSError(errno.EADDRINUSE, "another process is listening on this socket", path)


async def open_listener(address: str | Address, token: str | None = None) -> Listener[ByteStream]:
    """A listener on ``address`` (see the module docstring for the safety rules).

    Raises ``ValueError`` for a non-loopback TCP host without a token, ``OSError`` with
    ``EADDRINUSE`` if another engine listens on the Unix socket.
    """
    addr = parse_address(address)
    if addr.kind == "unix":
        assert addr.path is not None
        await _clear_stale_socket(addr.path)
        # anyio binds, chmods, then listens: nobody can connect before the mode is set.
        return await anyio.create_unix_listener(addr.path, mode=UNIX_SOCKET_MODE)
    assert addr.host is not None and addr.port is not None
    if not is_loopback_host(addr.host) and not token:
        raise ValueError(
            f"refusing to listen on non-loopback host {addr.host!r} without a token; "
            "pass a token or use 127.0.0.1 / a unix socket"
        )
    return await anyio.create_tcp_listener(local_host=addr.host, local_port=addr.port)


class ListenError(Exception):
    """The address cannot be listened on; the message says why, for an operator."""


_LISTEN_ERRNO_HINTS = {
    errno.EADDRINUSE: "address in use (another process listens there)",
    errno.EACCES: "permission denied",
    errno.EADDRNOTAVAIL: "not an address of this host",
    errno.ENOENT: "the socket's directory does not exist",
    errno.EEXIST: "the path exists and is not a socket",
}


async def preflight_listen(address: str | Address, token: str | None) -> Listener[ByteStream]:
    """Check ``address`` and bind it; the listener, or :class:`ListenError` saying why not: a
    bad address, a non-loopback host without a token, an address or socket path in use, no
    permission, an unknown host."""
    try:
        addr = parse_address(address)
    except ValueError as exc:
        raise ListenError(f"bad address: {exc}") from None
    if addr.kind == "tcp" and not addr.is_loopback and not token:
        raise ListenError(f"refusing to listen on non-loopback {addr} without a token "
                          f"(set {envs.TOKEN} or --token-file, or use 127.0.0.1 / a unix socket)")
    if addr.kind == "tcp" and not token:
        log.warning("ipc: %s has no token: every local user can connect (and drain or shut the "
                    "engine down); set %s or --token-file, or use a unix socket", addr, envs.TOKEN)
    try:
        return await open_listener(addr, token)
    except socket.gaierror as exc:
        raise ListenError(f"{addr}: cannot resolve host {addr.host!r} ({exc.strerror})") from None
    except OSError as exc:
        hint = _LISTEN_ERRNO_HINTS.get(exc.errno or 0, exc.strerror or str(exc))
        detail = f" ({exc.strerror})" if exc.strerror and exc.strerror.lower() not in hint.lower() else ""
        raise ListenError(f"{addr}: {hint}{detail}") from None
    except ValueError as exc:
        raise ListenError(str(exc)) from None


def peer_of(stream: ByteStream) -> tuple[str, str]:
    """(key, text) for the peer of an accepted stream: TCP by host ("10.0.0.7" / "10.0.0.7:5123"),
    a Unix socket by its user ("uid=1000" / "uid=1000 pid=4242", from SO_PEERCRED)."""
    try:
        remote = stream.extra(SocketAttribute.remote_address)
    except Exception:  # not a socket stream (tests)
        return "?", "?"
    if isinstance(remote, tuple) and remote:
        return str(remote[0]), f"{remote[0]}:{remote[1]}" if len(remote) > 1 else str(remote[0])
    try:
        raw = stream.extra(SocketAttribute.raw_socket)
        pid, uid, _ = struct.unpack("3i", raw.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                         struct.calcsize("3i")))
    except Exception:  # not a Unix socket, or no SO_PEERCRED here
        return "unix", "unix"
    return f"uid={uid}", f"unix uid={uid} pid={pid}"


def listener_address(listener: Listener[ByteStream], address: str | Address) -> str:
    """The concrete address clients should use (resolves TCP port 0 to the bound port)."""
    addr = parse_address(address)
    if addr.kind == "unix":
        return str(addr)
    sub = getattr(listener, "listeners", None) or [listener]
    host, port = sub[0].extra(SocketAttribute.local_address)[:2]
    return str(Address("tcp", host=str(host), port=int(port)))


async def connect(address: str | Address) -> ByteStream:
    """Open a byte stream to an engine listening on ``address``."""
    addr = parse_address(address)
    if addr.kind == "unix":
        assert addr.path is not None
        return await anyio.connect_unix(addr.path)
    assert addr.host is not None and addr.port is not None
    if addr.port == 0:
        raise ValueError(f"{addr}: cannot connect to port 0")
    return await anyio.connect_tcp(addr.host, addr.port)


async def close_listener(listener: Listener[ByteStream], address: str | Address) -> None:
    """Close a listener from :func:`preflight_listen` that will not serve (and remove its socket)."""
    inode = socket_inode(address)
    await listener.aclose()
    remove_socket(address, inode=inode)


def remove_socket(address: str | Address, *, inode: int | None = None) -> bool:
    """Remove a Unix socket file (no-op for TCP or a missing file); True if removed.

    Only a socket is removed, never another kind of file; with ``inode``, only that very socket
    (not one a newer engine bound at the same path since).
    """
    addr = parse_address(address)
    if addr.kind != "unix":
        return False
    assert addr.path is not None
    try:
        st = os.lstat(addr.path)
        if not stat.S_ISSOCK(st.st_mode) or (inode is not None and st.st_ino != inode):
            return False
        os.unlink(addr.path)
        return True
    except FileNotFoundError:
        return False


def socket_inode(address: str | Address) -> int | None:
    """The inode of a Unix socket file (to pass to :func:`remove_socket` later)."""
    addr = parse_address(address)
    if addr.kind != "unix":
        return None
    try:
        return os.lstat(addr.path).st_ino  # type: ignore[arg-type]
    except FileNotFoundError:
        return None


__all__ = [
    "Address", "parse_address", "is_loopback_host", "check_token", "open_listener",
    "listener_address", "connect", "remove_socket", "socket_inode", "DEFAULT_TCP_HOST",
    "UNIX_SOCKET_MODE", "ListenError", "preflight_listen", "peer_of", "close_listener",
]
