"""A network namespace joined to this host by a veth pair, whose link a test can cut.

For fault tests that need a real network partition rather than an injected error: a server
started inside the namespace (``prefix`` runs a command there) is reached from the host at
``inside`` over the veth pair; :meth:`Netns.cut` takes the namespace's end of the link down,
so packets to it are dropped without an answer (calls hang until their deadlines, as in a
real partition; taking the host's end down instead makes the host refuse at once), and
:meth:`Netns.heal` brings it back. Needs root and ``ip`` (iproute2); :func:`available`
says whether this machine can.

>>> with Netns() as ns:                                           # doctest: +SKIP
...     emu = start_emulator(address=ns.inside, prefix=ns.prefix)
...     ns.cut()
"""

from __future__ import annotations

import os
import shutil
import subprocess

__all__ = ["Netns", "available"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check,
                          timeout=30)


def available() -> str | None:
    """None when namespaces can be made here, else why not (for ``pytest.skip``)."""
    if shutil.which("ip") is None:
        return "no `ip` command (iproute2)"
    if os.geteuid() != 0:
        return "network namespaces need root"
    probe = f"esprobe{os.getpid()}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"cannot make a network namespace: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class Netns:
    """A namespace ``es<pid>`` with ``inside`` (its address) linked to ``outside`` (the
    host's), a /30 on 10.213.0.0/16 picked from the PID; removed on exit."""

    def __init__(self) -> None:
        n = os.getpid() % 16000
        self.name = f"es{os.getpid()}"
        self.host_link, self.ns_link = f"esh{os.getpid()}", f"esn{os.getpid()}"
        base = 4 * n
        self.outside = f"10.213.{base // 256}.{base % 256 + 1}"
        self.inside = f"10.213.{base // 256}.{base % 256 + 2}"
        self.prefix = ["ip", "netns", "exec", self.name]
        self._made = False

    def __enter__(self) -> Netns:
        _ip("netns", "add", self.name)
        self._made = True
        try:
            _ip("link", "add", self.host_link, "type", "veth", "peer", "name", self.ns_link)
            _ip("link", "set", self.ns_link, "netns", self.name)
            _ip("addr", "add", f"{self.outside}/30", "dev", self.host_link)
            _ip("link", "set", self.host_link, "up")
            _ip("netns", "exec", self.name, "ip", "addr", "add", f"{self.inside}/30",
                "dev", self.ns_link)
            _ip("netns", "exec", self.name, "ip", "link", "set", self.ns_link, "up")
            _ip("netns", "exec", self.name, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        return self

    def cut(self) -> None:
        """Take the namespace's end of the link down: packets to it vanish."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self.ns_link, "down")

    def heal(self) -> None:
        """Bring the link back up."""
        _ip("netns", "exec", self.name, "ip", "link", "set", self.ns_link, "up")

    def close(self) -> None:
        """Delete the namespace (and with it the veth pair). Idempotent."""
        if self._made:
            _ip("link", "del", self.host_link, check=False)
            _ip("netns", "del", self.name, check=False)
            self._made = False

    def __exit__(self, *exc: object) -> None:
        self.close()
