"""A hand-rolled WebSocket client on a raw socket: it reads only when told to."""

from __future__ import annotations

import base64
import json
import os
import socket
import struct
from typing import Any

RECV_BUFFER = 4096  # a small kernel receive buffer, so a non-reader stalls soon


class RawClient:
    """Upgrades ``ws://127.0.0.1:port/path`` and sends masked frames; reads on demand."""

    def __init__(self, port: int, path: str = "/v1/realtime", timeout: float = 10.0,
                 headers: dict[str, str] | None = None):
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RECV_BUFFER)
        self.sock.settimeout(timeout)
        self.sock.connect(("127.0.0.1", port))
        key = base64.b64encode(os.urandom(16)).decode()
        self.sock.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
                           "Upgrade: websocket\r\nConnection: Upgrade\r\n"
                           f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n"
                           + "".join(f"{k}: {v}\r\n" for k, v in (headers or {}).items())
                           + "\r\n")
                          .encode())
        self.buffer = b""
        while b"\r\n\r\n" not in self.buffer:
            self.buffer += self.sock.recv(1)  # byte by byte: leave the frames unread
        head, _, self.buffer = self.buffer.partition(b"\r\n\r\n")
        self.head = head.decode("latin-1")  # the status line and headers
        assert head.startswith(b"HTTP/1.1 101"), head

    def send_frame(self, payload: bytes, opcode: int = 0x1) -> None:
        mask = os.urandom(4)
        size = len(payload)
        if size < 126:
            header = struct.pack("!BB", 0x80 | opcode, 0x80 | size)
        elif size < 1 << 16:
            header = struct.pack("!BBH", 0x80 | opcode, 0x80 | 126, size)
        else:
            header = struct.pack("!BBQ", 0x80 | opcode, 0x80 | 127, size)
        masked = bytes(b ^ mask[i % 4] for i, b in enumerate(payload))
        self.sock.sendall(header + mask + masked)

    def send_json(self, payload: Any) -> None:
        self.send_frame(json.dumps(payload).encode())

    def _read(self, n: int) -> bytes:
        while len(self.buffer) < n:
            chunk = self.sock.recv(65536)
            if not chunk:
                raise EOFError("connection closed without a close frame")
            self.buffer += chunk
        data, self.buffer = self.buffer[:n], self.buffer[n:]
        return data

    def read_frame(self) -> tuple[int, bytes]:
        first, second = self._read(2)
        size = second & 0x7F
        if size == 126:
            size = struct.unpack("!H", self._read(2))[0]
        elif size == 127:
            size = struct.unpack("!Q", self._read(8))[0]
        return first & 0x0F, self._read(size)

    def close_frame(self, limit: int = 100_000) -> tuple[int, str] | None:
        """Read frames until the close frame: ``(code, reason)``; None on EOF."""
        for _ in range(limit):
            try:
                opcode, payload = self.read_frame()
            except (EOFError, OSError):
                return None
            if opcode == 0x8:
                return struct.unpack("!H", payload[:2])[0], payload[2:].decode()
        return None

    def close(self) -> None:
        self.sock.close()
