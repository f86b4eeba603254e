"""Separate hosts on one machine: network namespaces on a bridge, and faults between them.

Every name this module makes carries the run's own prefix, ``lgp<pid>`` (namespaces ``lgp<pid>-<host>``,
the bridge ``lgp<pid>b``, veth ends ``lgp<pid>v<i>``, and the one root ``FORWARD`` rule, commented
with the prefix). :meth:`Net.close` removes all of it; an ``atexit`` hook does the same if a test run
dies before its finalizers, and :func:`sweep` removes what a killed earlier run (its pid gone) left.

Addresses are ``10.77.<s>.<i>/24`` inside the namespaces made here only, plus ``.1`` on the bridge,
which is where the test itself (the client, the webhook receiver) sits: traffic only ever goes to
addresses of this run's own namespaces. ``<s>`` is derived from the pid, so that two runs on one
machine do not share a subnet.

Faults are ``iptables`` DROP rules inside the two namespaces concerned (both directions, both ends,
so an established TCP connection goes silent as on a real partition rather than being reset), or a
host's link set down. Deleting a namespace deletes its rules, which is why nothing here touches the
root namespace's tables except the one FORWARD rule that lets the bridge carry traffic at all: with
``br_netfilter`` loaded (Docker loads it) bridged frames traverse the root FORWARD chain, whose
policy Docker sets to DROP.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import re
import shutil
import subprocess
from dataclasses import dataclass, field

PREFIX = "lgp"
_NAME = re.compile(rf"^{PREFIX}(\d+)")


class Unsupported(Exception):
    """Namespaces cannot be made here: the message says why (for a skip)."""


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    r = subprocess.run(list(argv), capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
    if check and r.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)} failed ({r.returncode}): {r.stderr.strip()}")
    return r


def unsupported_reason() -> str | None:
    """Why this machine cannot run the partition tests, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN); run as root, as CI does"
    for tool in ("ip", "iptables"):
        if shutil.which(tool) is None:
            hint = " (`make partition-deps` installs it)" if tool == "iptables" else ""
            return f"`{tool}` is not installed{hint}"
    probe = f"{PREFIX}{os.getpid()}-probe"
    r = _run("ip", "netns", "add", probe, check=False)
    if r.returncode != 0:
        return f"cannot make a network namespace (no CAP_NET_ADMIN?): {r.stderr.strip()}"
    try:
        ipt = _run("ip", "netns", "exec", probe, "iptables", "-S", check=False)
        if ipt.returncode != 0:
            return f"iptables does not work inside a namespace: {ipt.stderr.strip()}"
    finally:
        _run("ip", "netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _forward_rules() -> list[str]:
    r = _run("iptables", "-S", "FORWARD", check=False)
    return [line for line in r.stdout.splitlines() if f"--comment {PREFIX}" in line]


def _remove(owner: int | None) -> None:
    """Delete namespaces, links and root rules of run ``owner`` (None: of every run whose pid is gone)."""

    def mine(name: str) -> bool:
        m = _NAME.match(name)
        if not m:
            return False
        pid = int(m.group(1))
        return pid == owner if owner is not None else not _alive(pid)

    for line in _run("ip", "netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        if mine(name):
            _run("ip", "netns", "del", name, check=False)
    for line in _run("ip", "-o", "link", "show", check=False).stdout.splitlines():
        parts = line.split(":")
        if len(parts) > 1:
            name = parts[1].strip().split("@")[0]
            if mine(name):
                _run("ip", "link", "del", name, check=False)
    for rule in _forward_rules():
        m = re.search(rf"--comment {PREFIX}(\d+)", rule)
        if m and mine(f"{PREFIX}{m.group(1)}"):
            _run("iptables", *rule.replace("-A ", "-D ", 1).split(), check=False)


def sweep() -> None:
    """Remove what earlier runs that died without cleaning up left behind."""
    _remove(None)


@dataclass
class Host:
    name: str
    ns: str
    ip: str
    veth: str


@dataclass
class Cut:
    """One fault: traffic between hosts ``a`` and ``b`` dropped (both ways)."""

    a: str
    b: str


@dataclass
class Net:
    """The bridge and the namespaces of one run."""

    owner: int = field(default_factory=os.getpid)
    hosts: dict[str, Host] = field(default_factory=dict)
    cuts: list[Cut] = field(default_factory=list)
    down: set[str] = field(default_factory=set)
    _closed: bool = False

    def __post_init__(self) -> None:
        self.tag = f"{PREFIX}{self.owner}"
        self.bridge = f"{self.tag}b"
        if len(self.bridge) > 15 or len(f"{self.tag}v99") > 15:
            raise Unsupported(f"pid {self.owner} makes interface names longer than Linux allows")
        self.subnet = f"10.77.{20 + self.owner % 200}"
        self.gateway = f"{self.subnet}.1"
        atexit.register(self.close)
        sweep()
        _remove(self.owner)  # a reused pid of a dead run: its leftovers are ours now
        _run("ip", "link", "add", self.bridge, "type", "bridge")
        _run("ip", "addr", "add", f"{self.gateway}/24", "dev", self.bridge)
        _run("ip", "link", "set", self.bridge, "up")
        _run(
            "iptables", "-I", "FORWARD", "1", "-i", self.bridge, "-o", self.bridge,
            "-m", "comment", "--comment", self.tag, "-j", "ACCEPT",
        )  # fmt: skip

    def add(self, name: str) -> Host:
        i = len(self.hosts) + 10
        ns, veth = f"{self.tag}-{name}", f"{self.tag}v{i}"
        host = Host(name, ns, f"{self.subnet}.{i}", veth)
        self.hosts[name] = host
        _run("ip", "netns", "add", ns)
        _run("ip", "link", "add", veth, "type", "veth", "peer", "name", f"{self.tag}p{i}")
        _run("ip", "link", "set", f"{self.tag}p{i}", "netns", ns)
        _run("ip", "-n", ns, "link", "set", f"{self.tag}p{i}", "name", "eth0")
        _run("ip", "-n", ns, "addr", "add", f"{host.ip}/24", "dev", "eth0")
        _run("ip", "-n", ns, "link", "set", "eth0", "up")
        _run("ip", "-n", ns, "link", "set", "lo", "up")
        _run("ip", "link", "set", veth, "master", self.bridge, "up")
        return host

    def exec_prefix(self, name: str) -> list[str]:
        """The argv head that runs a command on host ``name``."""
        return ["ip", "netns", "exec", self.hosts[name].ns]

    # ------------------------------------------------------------ faults

    def _rules(self, op: str, a: Host, b: Host) -> None:
        for me, other in ((a, b), (b, a)):
            for chain, flag in (("INPUT", "-s"), ("OUTPUT", "-d")):
                _run("ip", "netns", "exec", me.ns, "iptables", op, chain, flag, other.ip, "-j", "DROP")

    def cut(self, a: str, *others: str) -> None:
        """Drop every packet between host ``a`` and each of ``others``."""
        for b in others:
            self._rules("-I", self.hosts[a], self.hosts[b])
            self.cuts.append(Cut(a, b))

    def heal(self, a: str | None = None, *others: str) -> None:
        """Remove the cuts between ``a`` and ``others`` (no arguments: every cut, every link up)."""
        keep = []
        for c in self.cuts:
            if a is None or (c.a == a and (not others or c.b in others)):
                self._rules("-D", self.hosts[c.a], self.hosts[c.b])
            else:
                keep.append(c)
        self.cuts = keep
        if a is None:
            for name in list(self.down):
                self.link(name, up=True)

    def link(self, name: str, *, up: bool) -> None:
        """Set host ``name``'s link to the bridge down (every path to it gone at once) or up."""
        _run("ip", "link", "set", self.hosts[name].veth, "up" if up else "down")
        (self.down.discard if up else self.down.add)(name)

    def dropped(self, name: str) -> int:
        """Packets host ``name``'s DROP rules have dropped (evidence that a cut really cut)."""
        out = _run("ip", "netns", "exec", self.hosts[name].ns, "iptables", "-L", "-v", "-n", "-x").stdout
        return sum(int(line.split()[0]) for line in out.splitlines() if " DROP " in f" {line} ")

    def host_of_pid(self, pid: int) -> str | None:
        """The host whose namespace process ``pid`` runs in (None: the root namespace or gone)."""
        with contextlib.suppress(OSError):
            mine = os.stat(f"/proc/{pid}/ns/net").st_ino
            for h in self.hosts.values():
                if os.stat(f"/run/netns/{h.ns}").st_ino == mine:
                    return h.name
        return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        _remove(self.owner)
        self.hosts.clear()
        self.cuts.clear()
