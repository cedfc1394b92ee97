"""Both sides of the handshake (see ``ipc.messages``): the client's Hello -> Welcome exchange,
and the engine's check of a Hello. Both read through :class:`~ipc.framing.FrameReader`, which
the connection then keeps using (bytes pipelined after the first frame stay in its buffer)."""

from __future__ import annotations

import logging
from typing import Any, Optional

from engine.interface import Engine

from .errors import ConnectionClosed, ProtocolError
from .framing import MAX_HEADER_VALUE, STREAM_ENDED, FrameCodec, FrameReader
from .messages import (DEFAULT_MAX_FRAME, MAX_CHAT_TEMPLATE_LEN, MAX_NAME_LEN, PROTOCOL_VERSION,
                       EngineMessage, Error, ErrorKind, Hello, Welcome)
from .wire_errors import message_to_error

log = logging.getLogger("enginecore.ipc")

#: Seconds either side gives the handshake by default: the engine waits this long for a Hello,
#: a client (``EngineClient.connect(timeout=...)``) this long for its answer. The answer to a
#: failed authentication is held at most half of it (``ipc.auth``), a right token not at all.
HANDSHAKE_TIMEOUT = 10.0


async def client_handshake(stream: Any, token: Optional[str], client_name: str
                           ) -> tuple[Welcome, FrameCodec, FrameReader]:
    """Send Hello, read the engine's first frame: Welcome, returned with the connection's codec
    and reader (set to the Welcome's frame limit), or a fatal Error, raised as its exception."""
    codec = FrameCodec(EngineMessage)
    hello = Hello(protocol_version=PROTOCOL_VERSION, token=token,
                  client_name=client_name[:MAX_NAME_LEN])
    try:
        await stream.send(codec.encode(hello))
    except STREAM_ENDED as exc:
        raise ConnectionClosed(f"connection closed during the handshake ({type(exc).__name__})") from None
    reader = FrameReader(stream, codec, max_frame=DEFAULT_MAX_FRAME)
    try:
        msg = await reader.read()
    except ConnectionClosed as exc:
        raise ConnectionClosed(f"the engine closed the connection during the handshake: {exc}") from None
    except ProtocolError as exc:
        raise ProtocolError(f"bad handshake reply from the engine: {exc}") from None
    if isinstance(msg, Error):
        raise message_to_error(msg)
    if not isinstance(msg, Welcome):
        raise ProtocolError(f"expected Welcome, got {type(msg).__name__}")
    if msg.protocol_version != PROTOCOL_VERSION:
        raise ProtocolError(f"engine answered with protocol version {msg.protocol_version}; "
                            f"this client speaks {PROTOCOL_VERSION}")
    max_frame = min(msg.max_frame or DEFAULT_MAX_FRAME, MAX_HEADER_VALUE)
    codec.max_frame = reader.max_frame = max_frame
    return msg, codec, reader


def hello_error(msg: Any) -> Optional[Error]:
    """The fatal Error for a first frame that is not an acceptable Hello (the token is checked
    separately, see ``ipc.auth``); None if it is one."""
    if not isinstance(msg, Hello):
        return Error(kind=ErrorKind.PROTOCOL, fatal=True,
                     message=f"expected Hello, got {type(msg).__name__}")
    if msg.protocol_version != PROTOCOL_VERSION:
        return Error(kind=ErrorKind.VERSION, fatal=True,
                     message=f"protocol version {msg.protocol_version} not supported; "
                             f"this engine speaks {PROTOCOL_VERSION}")
    return None


def describe_model(engine: Engine) -> dict:
    """Welcome's fields that describe the model, from ``engine.model.llama``, ``max_model_len`` and
    ``tokenizer_info()`` (parts too long for the wire are left out)."""
    tok = engine.tokenizer_info()
    info: dict = {"model": str(engine.model)[:MAX_NAME_LEN],
                  "max_model_len": max(0, int(engine.max_model_len)),
                  "vocab_size": max(0, int(tok.vocab_size)),
                  "max_logprobs": max(0, int(tok.max_logprobs))}
    if tok.chat_template is not None:
        if len(tok.chat_template) <= MAX_CHAT_TEMPLATE_LEN:
            info["chat_template"] = tok.chat_template
        else:
            log.warning("ipc: chat template not sent (longer than %d)", MAX_CHAT_TEMPLATE_LEN)
    for name, text in (("bos_token", tok.bos_token), ("eos_token", tok.eos_token)):
        if text is not None and len(text) <= MAX_NAME_LEN:
            info[name] = text
    return info


__all__ = ["HANDSHAKE_TIMEOUT", "client_handshake", "hello_error", "describe_model"]
