"""A TCP proxy on loopback that slows the bytes it carries and counts them: a slow network
between a client and a real server, so a test can kill a transfer midway, and see how many
bytes a transfer took."""
from __future__ import annotations

import socket
import threading
import time


class ThrottleProxy:
    """127.0.0.1:<port> -> 127.0.0.1:<target>; the server's answers at `bytes_per_s` per
    connection (0: no limit). `down` counts the bytes sent back to clients. With
    `cut_once_after`, the first connection to carry that many bytes back is closed there (a
    network that drops a transfer midway)."""

    def __init__(self, target_port: int, bytes_per_s: int = 0, cut_once_after: int = 0) -> None:
        self.target_port, self.bytes_per_s = target_port, bytes_per_s
        self.cut_once_after = cut_once_after
        self.cuts = 0
        self.down = 0
        self._lock = threading.Lock()
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = self._sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        self._closed = False
        self._conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.target_port))
            self._conns += [client, server]
            threading.Thread(target=self._pump, args=(client, server, False), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, True), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket, down: bool) -> None:
        piece = 16 << 10
        carried = 0
        try:
            while True:
                data = src.recv(piece)
                if not data:
                    break
                if down:
                    carried += len(data)
                    with self._lock:
                        self.down += len(data)
                        cut = self.cut_once_after and not self.cuts and carried >= self.cut_once_after
                        if cut:
                            self.cuts += 1
                    if cut:
                        break
                    if self.bytes_per_s:
                        time.sleep(len(data) / self.bytes_per_s)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def __enter__(self) -> "ThrottleProxy":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()
        for c in self._conns:
            c.close()
