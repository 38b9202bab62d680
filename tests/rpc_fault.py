"""A fault-injecting proxy in front of a ggml-rpc-server, for tests of allocation failures.

ggml's RPC protocol is request/response over one TCP connection per client: a request is
| command (1 byte) | size (8 bytes) | payload |, a response | size (8 bytes) | payload |, and the client
waits for each response before it sends the next request. The proxy forwards every byte, except that an
ALLOC_BUFFER request matching `refuse(size)` is answered by the proxy itself as a failed allocation
(remote pointer 0), which is what the server answers when its device is out of memory.
"""
from __future__ import annotations

import socket
import struct
import threading
from typing import Callable

RPC_CMD_ALLOC_BUFFER = 0


def _hang_up(*socks: socket.socket) -> None:
    # shutdown() wakes a thread blocked in recv() on the same socket (close() alone does not) and
    # tells the server the client is gone: it serves one connection at a time
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        sock.close()


class AllocRefusingProxy:
    def __init__(self, upstream: str, refuse: Callable[[int], bool] = lambda size: False):
        host, port = upstream.rsplit(":", 1)
        self.upstream = (host, int(port))
        self.refuse = refuse
        self.alloc_sizes: list[int] = []     # every ALLOC_BUFFER size seen, refused or not
        self.refused: list[int] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.endpoint = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._threads: list[threading.Thread] = []
        self._spawn(self._accept)

    def _spawn(self, target, *args) -> None:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        self._threads.append(thread)

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            server = socket.create_connection(self.upstream)
            lock = threading.Lock()
            self._spawn(self._requests, client, server, lock)
            self._spawn(self._responses, server, client, lock)

    @staticmethod
    def _read(sock: socket.socket, n: int) -> bytes:
        data = bytearray(n)
        view, got = memoryview(data), 0
        while got < n:
            read = sock.recv_into(view[got:])
            if not read:
                raise ConnectionError("closed")
            got += read
        return bytes(data)

    def _requests(self, client: socket.socket, server: socket.socket, lock: threading.Lock) -> None:
        try:
            while True:
                head = self._read(client, 9)
                cmd, size = head[0], struct.unpack("<Q", head[1:])[0]
                payload = self._read(client, size)
                if cmd == RPC_CMD_ALLOC_BUFFER:
                    _device, alloc = struct.unpack("<IQ", payload)
                    self.alloc_sizes.append(alloc)
                    if self.refuse(alloc):
                        self.refused.append(alloc)
                        with lock:  # nothing else is in flight: the client waits for this answer
                            client.sendall(struct.pack("<QQQ", 16, 0, 0))
                        continue
                server.sendall(head + payload)
        except (ConnectionError, OSError):
            _hang_up(client, server)

    @staticmethod
    def _responses(server: socket.socket, client: socket.socket, lock: threading.Lock) -> None:
        try:
            while chunk := server.recv(1 << 16):
                with lock:
                    client.sendall(chunk)
        except OSError:
            pass
        _hang_up(client, server)

    def close(self) -> None:
        """Stop listening. ggml keeps the endpoint registered for the rest of the process: it is
        marked stopped, so that device listings do not query it."""
        from pyllamapool.run.rpc import mark_stopped

        self._listener.close()
        mark_stopped(self.endpoint)
