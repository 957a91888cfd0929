"""A private network namespace for test servers that listen on every interface.

Ray's gcs_server and raylet bind 0.0.0.0 whatever `--node-ip-address` says, and
its runtime-env agent binds the host's address: a test cluster started plainly is
reachable from the network. Started inside a namespace of their own (holding only
a loopback interface) they are reachable from nowhere else. Processes that must
talk to them (the trajstore commands under test) enter the namespace too
(`NetNamespace.enter` as a `preexec_fn`), and the servers they need from the host
(the S3 server, PostgreSQL) are forwarded in on the same loopback ports
(`NetNamespace.forward`). Making and entering a namespace needs CAP_SYS_ADMIN.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import socket
import struct
import subprocess
import sys
import threading
from collections.abc import Callable

CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS, _SIOCSIFFLAGS, _IFF_UP = 0x8913, 0x8914, 0x1
_libc = ctypes.CDLL(None, use_errno=True)


def _check(rc: int, what: str) -> None:
    if rc != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _loopback_up() -> None:
    """Bring `lo` up in the calling thread's namespace (a new one has it down)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        req = struct.pack("16sH14s", b"lo", 0, b"")
        flags = struct.unpack("16sH14s", fcntl.ioctl(s, _SIOCGIFFLAGS, req))[1]
        fcntl.ioctl(s, _SIOCSIFFLAGS, struct.pack("16sH14s", b"lo", flags | _IFF_UP, b""))


def _new_namespace() -> None:  # preexec_fn of the holder
    _check(_libc.unshare(CLONE_NEWNET), "unshare(CLONE_NEWNET)")
    _loopback_up()


def _setns(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        _check(_libc.setns(fd, CLONE_NEWNET), f"setns({path})")
    finally:
        os.close(fd)


class NetNamespace:
    """A new network namespace, held by an idle process until `close`."""

    def __init__(self) -> None:
        self._holder = subprocess.Popen(
            [sys.executable, "-c", "import signal; signal.pause()"], preexec_fn=_new_namespace
        )
        self.path = f"/proc/{self._holder.pid}/ns/net"
        self._listeners: list[socket.socket] = []

    @property
    def inode(self) -> str:
        """The namespace's identity (`net:[<inode>]`), as /proc/<pid>/ns/net reads."""
        return os.readlink(self.path)

    def interfaces(self) -> list[str]:
        """The network interfaces inside the namespace."""
        with open(f"/proc/{self._holder.pid}/net/dev") as f:
            return [line.split(":", 1)[0].strip() for line in f.readlines()[2:]]

    def enter(self) -> Callable[[], None]:
        """A `preexec_fn`: the child runs inside the namespace."""
        path = self.path
        return lambda: _setns(path)

    def forward(self, port: int) -> None:
        """Listen on 127.0.0.1:`port` inside the namespace and relay each connection to
        127.0.0.1:`port` outside (where this process runs)."""
        made: list[socket.socket | BaseException] = []

        def listen_inside() -> None:  # a thread of its own: only it enters the namespace
            try:
                _setns(self.path)
                made.append(socket.create_server(("127.0.0.1", port)))
            except BaseException as e:  # noqa: BLE001 - raised in the caller below
                made.append(e)

        t = threading.Thread(target=listen_inside)
        t.start()
        t.join()
        if isinstance(made[0], BaseException):
            raise made[0]
        server = made[0]
        self._listeners.append(server)
        threading.Thread(target=self._accept, args=(server, port), daemon=True).start()

    def _accept(self, server: socket.socket, port: int) -> None:
        while True:
            try:
                inside, _ = server.accept()
            except OSError:
                return  # closed
            try:
                outside = socket.create_connection(("127.0.0.1", port))
            except OSError:
                inside.close()
                continue
            threading.Thread(target=_relay, args=(inside, outside), daemon=True).start()

    def close(self) -> None:
        for server in self._listeners:
            server.close()
        self._holder.send_signal(signal.SIGKILL)
        self._holder.wait()


def _relay(a: socket.socket, b: socket.socket) -> None:
    """Copy both ways until both sides are done, then close both."""
    back = threading.Thread(target=_pump, args=(b, a), daemon=True)
    back.start()
    _pump(a, b)
    back.join()
    a.close()
    b.close()


def _pump(src: socket.socket, dst: socket.socket) -> None:
    with contextlib.suppress(OSError):
        while data := src.recv(1 << 16):
            dst.sendall(data)
    with contextlib.suppress(OSError):
        dst.shutdown(socket.SHUT_WR)
