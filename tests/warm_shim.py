"""The launcher side of ``tests/warm_python.py``: run this interpreter's command in a process forked
from the warm server, or, when that cannot be done, exec the real interpreter (cold).

Standard library only, and started with ``-S`` (no site-packages): it must cost tens of
milliseconds, not the seconds it saves. See ``warm_python``'s docstring for the protocol.
"""
import json
import os
import signal
import socket
import struct
import sys

_HEADER = struct.Struct("!I")
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2)
# interpreter options that take no value and that the warm command honours (or that do not matter
# to a script's behaviour here: -B, bytecode writing; -s, -E, -I, the server's path stands)
_FLAGS = set("uBsEI")


def _parse(argv: list[str]):
    """(kind, target, argv for sys.argv, unbuffered) of a ``python`` command line, or None when it
    uses something only the real interpreter does."""
    unbuffered = False
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "-c" or arg == "-m":
            if i + 1 >= len(argv):
                return None
            kind = "code" if arg == "-c" else "module"
            rest = argv[i + 2:]
            return kind, argv[i + 1], ["-c" if kind == "code" else argv[i + 1], *rest], unbuffered
        if arg.startswith("-c") or arg.startswith("-m"):
            kind = "code" if arg[1] == "c" else "module"
            return kind, arg[2:], ["-c" if kind == "code" else arg[2:], *argv[i + 1:]], unbuffered
        if arg == "-" or not arg.startswith("-"):
            if arg == "-":
                return None
            return "path", arg, argv[i:], unbuffered
        letters = arg[1:]
        if not letters or any(c not in _FLAGS for c in letters):
            return None
        unbuffered = unbuffered or "u" in letters
        i += 1
    return None   # an interactive interpreter


def send(sock, message, fds=()):
    """A length-prefixed JSON message, ``fds`` (file descriptors) alongside it."""
    body = json.dumps(message).encode()
    data = _HEADER.pack(len(body)) + body
    if fds:
        socket.send_fds(sock, [data], list(fds))
    else:
        sock.sendall(data)


def receive(sock, max_fds=0):
    """The next message and the descriptors sent with it; (None, []) at the end of the stream."""
    fds = []
    if max_fds:
        data, fds, _, _ = socket.recv_fds(sock, _HEADER.size, max_fds)
        if not data:
            return None, fds
    else:
        data = b""
    while len(data) < _HEADER.size:
        more = sock.recv(_HEADER.size - len(data))
        if not more:
            return None, fds
        data += more
    (length,) = _HEADER.unpack(data)
    body = b""
    while len(body) < length:
        more = sock.recv(length - len(body))
        if not more:
            return None, fds
        body += more
    return json.loads(body), fds


def _open_fds(exclude: int) -> list[int]:
    listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY)
    try:
        numbers = sorted(int(name) for name in os.listdir(listing))
    finally:
        os.close(listing)
    found = []
    for n in numbers:
        if n in (exclude, listing):
            continue
        try:
            os.fstat(n)
        except OSError:
            continue
        found.append(n)
    return found


def main(real: str, script) -> None:
    """Run ``python ARGV`` (``script`` None) or the console script ``script`` with ``ARGV``."""
    argv = sys.argv[1:]
    parsed = ("path", script, [sys.argv[0], *argv], False) if script else _parse(argv)
    path = os.environ.get("WHALELIKE_WARM_SOCKET")
    cold = [real, script, *argv] if script else [real, *argv]
    if parsed is None or not path:
        os.execv(real, cold)
    kind, target, command_argv, unbuffered = parsed
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.connect(path)
    except OSError:
        sock.close()
        os.execv(real, cold)
    fds = _open_fds(sock.fileno())
    mask = os.umask(0)
    os.umask(mask)
    send(sock, {"kind": kind, "target": target, "argv": command_argv, "unbuffered": unbuffered,
                 "cwd": os.getcwd(), "env": dict(os.environ), "umask": mask, "fds": fds, "launcher": os.getpid(),
                 "executable": os.path.abspath(sys.argv[0]) if not script else os.path.join(
                     os.path.dirname(os.path.abspath(sys.argv[0])), "python")}, fds)

    def forward(signum, frame):
        try:
            send(sock, {"signal": signum})
        except OSError:   # the server is gone: the end of the stream tells the launcher so
            pass

    # from the request on, a signal goes to the command (the monitor reads it once the command runs)
    for sig in FORWARDED:
        signal.signal(sig, forward)
    started, _ = receive(sock)
    if started is None:
        sys.exit("warm python: the server closed the connection before starting the command")
    for fd in fds:
        if fd > 2:
            os.close(fd)
    ended, _ = receive(sock)
    if ended is None:
        sys.exit("warm python: the server went away while the command ran")
    status = ended["status"]
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.waitstatus_to_exitcode(status))
