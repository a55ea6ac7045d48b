#!/usr/bin/env python3
"""netlab: a low-bandwidth network lab built from Linux network namespaces, one or two tiers.

What it is
----------
A lab of ``hosts`` "hosts" (network namespaces) joined through learning bridges that live in a
namespace of their own, so the host's network (the root namespace) is never touched: no link,
address, route or qdisc is created outside the lab's namespaces. Each host runs
``ranks_per_host`` ranks (G; torchrun's LOCAL_WORLD_SIZE) of a command (``ip netns exec``) with a
torch.distributed-style rendezvous on host 0's lab address. Ranks are numbered host-major, as
torchrun numbers them: rank r runs on host r // G as local rank r % G.

Two tiers, as a cluster has them:

* between the ranks of one host: the host's own addresses, which the kernel delivers over its
  loopback device. Nothing shapes it: memory speed, like NVLink or PCIe next to a slow network;
* between hosts: the host's network interface(s), shaped to ``rate_mbit`` each way.

Interfaces: by default each host has one NIC, ``lab0``, shared by all its ranks (a host with one
network card), with an address in a private /24 (``10.77.<k>.0/24``; host i is ``.i+1``). With
``rails=True`` each local rank has a NIC of its own, ``lab<j>`` for local rank j, on rail j: a
bridge and a /24 of its own (``10.<77+j>.<k>.0/24``), shaped like the single NIC; so the ranks with
the same local rank on different hosts (a rail ring: Horovod's torus all-reduce, ZeRO++'s qgZ) use
rail j's links alone, and the host has G times the bandwidth. Traffic between ranks of different
local ranks on different hosts goes over a rail of one of them.

Why
---
CERAR trades fewer bytes per worker for more rounds and more arithmetic. Whether that pays off
depends on the link rate, which on a single machine is memory-bandwidth fast over loopback. The
lab gives every rank a real, rate-limited TCP link so an all-reduce's wall-clock time reflects
the bytes it moves, as it would between machines; with several ranks per host it reproduces the
two tiers a hierarchical all-reduce is built for.

Link model
----------
Star topology per rail: every host NIC is attached to an ideal (infinitely fast, non-blocking)
switch by a full-duplex link of ``rate`` Mbit/s in *each* direction:

* host -> switch: ``tbf`` on the host's ``lab<j>`` egress (in the host namespace);
* switch -> host: ``tbf`` on the bridge port's egress (``p<i>`` for rail 0, ``p<i>r<j>`` for rail
  j, in the bridge namespace).

So a host can send at ``rate`` and receive at ``rate`` at the same time (as a ring all-reduce
does), and traffic of two senders to one receiver shares that receiver's downlink; the G ranks of
a host with one NIC share its ``rate``. Rates are IP-layer rates as ``tbf`` counts them (Ethernet
payload plus headers); TCP goodput is a few percent lower. Each rank can read the bytes its host's
NICs sent and received from ``/sys/class/net/<nic>/statistics/{tx,rx}_bytes`` (``LAB_NICS`` names
them): a count of what crossed the shaped tier, loopback traffic excluded. With ``delay_ms`` > 0,
``netem`` adds that one-way delay on *both* ends of every link, so the one-way host-to-host latency
is ``2 * delay_ms`` and the RTT ``4 * delay_ms`` (plus well under 0.1 ms of kernel overhead).
``netem`` is the root qdisc with ``tbf`` as its child: a packet is delayed first, then shaped
(kernels without ``netem`` refuse ``delay_ms`` > 0 with a message naming it).

Naming, ownership and cleanup
-----------------------------
Namespaces are called ``cerarlab-<pid>-<seq>-br`` and ``cerarlab-<pid>-<seq>-h<i>`` where
``<pid>`` is the owning process and ``<seq>`` a per-process counter (the *lab id* is
``<pid>-<seq>``). Veth pairs are created directly inside the lab namespaces, so their short
names (``lab<j>``, ``p<i>``, ``p<i>r<j>``) never appear in the root namespace and vanish with the
namespaces. Teardown kills every process still inside a lab namespace and deletes the namespaces;
it runs from ``finally``/``__exit__``, on SIGINT/SIGTERM/SIGHUP (via handlers that raise) and from
``atexit``. A lab whose owner was SIGKILLed is removed by the next lab's start-up (or by
``--cleanup``): any ``cerarlab-*`` namespace whose owner pid is no longer alive is stale.

Usage
-----
CLI (needs root)::

    python scripts/lab/netlab.py --hosts 4 --rate-mbit 200 [--ranks-per-host 2 [--rails]] [--mtu 9000] \
        [--delay-ms 0.5] [--timeout 600] [--out DIR] -- python my_script.py --arg {rank}

``{rank}``, ``{world_size}``, ``{local_rank}``, ``{local_world_size}``, ``{host}``, ``{hosts}``,
``{master_addr}``, ``{master_port}``, ``{host_addr}`` (the host's first NIC's address) and
``{is_master_host}`` (1 on host 0, else 0) in the command are replaced per rank. Each rank gets the
environment variables torchrun gives a worker: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE,
GROUP_RANK (its host), GROUP_WORLD_SIZE (hosts), ROLE_RANK, ROLE_WORLD_SIZE, MASTER_ADDR (host 0's
lab address), MASTER_PORT; and LAB_RATE_MBIT, LAB_DELAY_MS, LAB_ID, LAB_HOST, LAB_ADDR (the
address of the rank's NIC), LAB_NICS (its host's NICs, comma-separated), LAB_RAILS (0 or 1) and
GLOO_SOCKET_IFNAME (its NIC: gloo must bind to the lab interface). ``--per-host`` runs one process
per host instead, with the same variables less the per-rank ones: a launcher's place, e.g. torchrun's
agents with c10d rendezvous::

    netlab.py --hosts 3 --ranks-per-host 2 --rate-mbit 200 --per-host -- torchrun --nnodes={hosts} \
        --nproc_per_node={local_world_size} --node_rank={host} --rdzv_backend=c10d \
        --rdzv_endpoint={master_addr}:{master_port} --rdzv_conf=is_host={is_master_host} \
        --local_addr={host_addr} train/main.py ...

(The hosts share the machine's hostname, so torchrun can neither tell which one holds the rendezvous
address, host 0, nor which address its workers are reached at: ``is_host`` and ``--local_addr`` say.)
The exit status is 0 only if every process exits 0.
``python scripts/lab/netlab.py --cleanup`` removes stale labs and exits.

Library::

    from scripts.lab.netlab import NetLab   # with the repository root on sys.path
    with NetLab(hosts=4, rate_mbit=200, ranks_per_host=2, mtu=9000) as lab:
        result = lab.run([sys.executable, "bench.py"], timeout=300)   # 8 ranks, 2 per host
        assert result.ok
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import ctypes
import dataclasses
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

PREFIX = "cerarlab"
LAB_IFNAME = "lab0"
DEFAULT_MASTER_PORT = 29500
_NS_RE = re.compile(rf"^{PREFIX}-(\d+)-(\d+)-(br|h\d+)$")
_MAX_HOSTS = 250
_MAX_RANKS_PER_HOST = 64
_MTU = 1500

_seq_lock = threading.Lock()
_seq = 0
_live_labs: list[NetLab] = []


class NetLabError(RuntimeError):
    """Raised when the lab cannot be built or used (not root, missing tools, bad arguments)."""


# --------------------------------------------------------------------------- helpers


def _ip(*args: str, check: bool = True, timeout: float = 20.0) -> subprocess.CompletedProcess:
    """Run ``ip <args>``; raise NetLabError naming the command on failure."""
    cmd = ["ip", *args]
    try:
        cp = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        raise NetLabError(f"command timed out after {timeout}s: {' '.join(cmd)}") from e
    if check and cp.returncode != 0:
        raise NetLabError(f"command failed ({cp.returncode}): {' '.join(cmd)}: {cp.stderr.strip()}")
    return cp


def _tc(ns: str, *args: str) -> None:
    """Run ``tc`` inside namespace ``ns``; raise NetLabError on failure."""
    cmd = ["ip", "netns", "exec", ns, "tc", *args]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if cp.returncode != 0 and "qdisc kind is unknown" in cp.stderr:
        kind = "netem" if "netem" in args else "tbf" if "tbf" in args else args[-1]
        raise NetLabError(
            f"the '{kind}' qdisc is not available in this kernel (CONFIG_NET_SCH_{kind.upper()} is off)"
            + ("; --delay-ms cannot be emulated here, use --delay-ms 0" if kind == "netem" else "")
        )
    if cp.returncode != 0:
        raise NetLabError(f"command failed ({cp.returncode}): {' '.join(cmd)}: {cp.stderr.strip()}")


def requirements_problem() -> str | None:
    """Return why a lab cannot be built here (not root, no ``ip``/``tc``), or None if it can."""
    if os.geteuid() != 0:
        return "netlab needs root (network namespaces and tc)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"netlab needs the '{tool}' tool (iproute2), which is not on PATH"
    return None


def list_lab_namespaces() -> list[str]:
    """Names of all namespaces that belong to some netlab lab (any owner)."""
    cp = _ip("netns", "list", check=False)
    names = [line.split()[0] for line in cp.stdout.splitlines() if line.strip()]
    return [n for n in names if _NS_RE.match(n)]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _ns_pids(ns: str) -> list[int]:
    cp = _ip("netns", "pids", ns, check=False)
    return [int(p) for p in cp.stdout.split() if p.isdigit()]


def _kill_ns_processes(ns: str) -> None:
    """SIGKILL every process still inside ``ns`` (so deleting it really frees it)."""
    for _ in range(5):
        pids = _ns_pids(ns)
        if not pids:
            return
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.05)


def _delete_namespaces(names: Sequence[str], attempts: int = 5) -> None:
    """Delete the namespaces ``names``: hosts first (their deletion removes both ends of each veth), the bridge
    namespace last. ``ip netns del`` can fail while another lab's ``ip netns add``/``exec`` is remounting
    /run/netns at the same moment ("Device or resource busy"); a name still listed is deleted again, up to
    ``attempts`` times, and one still listed after that is named in a NetLabError. Gone means unlisted twice,
    0.2 s apart: once, under load, a CLI interrupted in its ranks' start said "torn down" and a host's namespace
    was listed again when the test looked (issue 37's sixth session); a name that comes back is deleted again."""
    order = sorted(names, key=lambda n: n.endswith("-br"))
    pending = order
    for attempt in range(attempts):
        for ns in pending:
            _kill_ns_processes(ns)
            _ip("netns", "del", ns, check=False)
        listed = set(list_lab_namespaces())
        pending = [ns for ns in pending if ns in listed]
        if not pending:
            time.sleep(0.2)
            listed = set(list_lab_namespaces())
            pending = [ns for ns in order if ns in listed]
            if not pending:
                return
        time.sleep(0.1 * (attempt + 1))
    raise NetLabError(f"could not delete the namespaces {pending} (ip netns del failed {attempts} times)")


def cleanup_stale(all_labs: bool = False) -> list[str]:
    """Delete lab namespaces whose owner process is dead (or every lab's, if ``all_labs``).

    Returns the names removed. Labs of live owners are left alone, so concurrent labs are safe.
    """
    stale = []
    for ns in list_lab_namespaces():
        m = _NS_RE.match(ns)
        assert m is not None
        pid = int(m.group(1))
        mine = pid == os.getpid() and any(ns in lab.namespaces for lab in _live_labs)
        if all_labs and not mine or not _pid_alive(pid):
            stale.append(ns)
    _delete_namespaces(stale)
    return stale


def _sysctl(ns: str, key: str, value: int) -> None:
    """Set ``/proc/sys/<key>`` inside namespace ``ns`` (its own network settings)."""
    cmd = ["ip", "netns", "exec", ns, "sh", "-c", f"echo {int(value)} > /proc/sys/{key}"]
    cp = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    if cp.returncode != 0:
        raise NetLabError(f"command failed ({cp.returncode}): {' '.join(cmd)}: {cp.stderr.strip()}")


_STOP_SIGNALS = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}


def _set_pdeathsig() -> None:
    """preexec_fn: SIGKILL the child if the netlab process dies (e.g. is SIGKILLed itself); and the signals that
    `NetLab.run` blocks while it starts the ranks are not blocked in them (a child inherits the mask)."""
    signal.pthread_sigmask(signal.SIG_UNBLOCK, _STOP_SIGNALS)
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def tbf_params(rate_mbit: float, mtu: int = _MTU) -> tuple[int, int]:
    """(burst, limit) in bytes for a tbf at ``rate_mbit``.

    burst: about 1 ms of traffic, at least a few full frames (tbf needs burst >= MTU and splits
    larger GSO packets itself). A small burst keeps short transfers honest: the advantage a burst
    gives is one burst's worth of bytes, here <= 1 ms. limit: the queue behind the bucket, about
    20 ms of traffic and at least 64 KiB, so TCP keeps the link busy without adding much delay.
    """
    rate_bps = rate_mbit * 1e6 / 8
    burst = max(4 * mtu, int(rate_bps * 1e-3))
    limit = max(64 * 1024, int(rate_bps * 20e-3))
    return burst, limit


def shape(ns: str, dev: str, rate_mbit: float, delay_ms: float = 0.0, mtu: int = _MTU) -> None:
    """Shape the egress of ``dev`` in namespace ``ns`` to ``rate_mbit`` (+ optional netem delay)."""
    burst, limit = tbf_params(rate_mbit, mtu)
    rate = f"{rate_mbit * 1e6:.0f}bit"
    tbf = ["tbf", "rate", rate, "burst", str(burst), "limit", str(limit)]
    if delay_ms > 0:
        # netem first (root), tbf as its child: delay, then shape. netem's own queue must hold
        # everything in flight during the delay: rate*delay plus the tbf queue, in packets.
        pkts = max(1000, int(4 * (rate_mbit * 1e6 / 8 * delay_ms * 1e-3 + limit) / 1000))
        _tc(
            ns,
            "qdisc",
            "replace",
            "dev",
            dev,
            "root",
            "handle",
            "1:",
            "netem",
            "delay",
            f"{delay_ms}ms",
            "limit",
            str(pkts),
        )
        _tc(ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", *tbf)
    else:
        _tc(ns, "qdisc", "replace", "dev", dev, "root", "handle", "1:", *tbf)


# --------------------------------------------------------------------------- results


@dataclasses.dataclass
class RankResult:
    """Outcome of one rank: exit status (negative = killed by that signal) and its output."""

    rank: int
    returncode: int | None
    stdout: str
    stderr: str
    stdout_path: Path | None = None
    stderr_path: Path | None = None
    killed: bool = False
    host: int = 0  # the host it ran on (with ``per_host``, ``rank`` is that host too)


@dataclasses.dataclass
class RunResult:
    """Outcome of :meth:`NetLab.run` over all ranks."""

    ranks: list[RankResult]
    timed_out: bool
    seconds: float

    @property
    def ok(self) -> bool:
        return not self.timed_out and all(r.returncode == 0 for r in self.ranks)

    @property
    def returncode(self) -> int:
        """0 if all ranks succeeded; 124 on timeout; else the status (as 1..255) of the first rank
        that failed by itself (ranks killed by the lab only count if none failed by itself)."""
        if self.timed_out:
            return 124
        for r in sorted(self.ranks, key=lambda r: r.killed):
            if r.returncode != 0:
                rc = r.returncode if r.returncode is not None else 1
                return rc if 0 < rc < 256 else 128 + (-rc if rc < 0 else 1)
        return 0

    per_host: bool = False

    def describe(self) -> str:
        unit = "host" if self.per_host else "rank"
        parts = [f"{unit} {r.rank}: rc={r.returncode}{' (killed)' if r.killed else ''}" for r in self.ranks]
        return ("TIMEOUT; " if self.timed_out else "") + ", ".join(parts)


class _Pump(threading.Thread):
    """Copy a child's pipe to a file, an in-memory tail and (optionally) prefixed to our stream."""

    _print_lock = threading.Lock()

    def __init__(self, pipe, path: Path | None, prefix: str | None, stream, keep: int = 1 << 20):
        super().__init__(daemon=True)
        self.pipe, self.path, self.prefix, self.stream, self.keep = pipe, path, prefix, stream, keep
        self.buf = bytearray()

    def run(self) -> None:
        f = open(self.path, "wb") if self.path else None  # noqa: SIM115
        try:
            for line in iter(self.pipe.readline, b""):
                if f:
                    f.write(line)
                    f.flush()
                self.buf += line
                if len(self.buf) > 2 * self.keep:
                    del self.buf[: len(self.buf) - self.keep]
                if self.prefix is not None:
                    with self._print_lock:
                        self.stream.write(self.prefix + line.decode(errors="replace"))
                        self.stream.flush()
        finally:
            if f:
                f.close()
            self.pipe.close()

    def text(self) -> str:
        return self.buf[-self.keep :].decode(errors="replace")


# --------------------------------------------------------------------------- the lab


class NetLab:
    """A lab of ``hosts`` namespaces behind a bridge, each link shaped to ``rate_mbit`` each way,
    running ``ranks_per_host`` ranks per host (unshaped between them: the host's loopback).

    Use as a context manager; the lab is built on ``__enter__`` and always torn down on
    ``__exit__``, on SIGINT/SIGTERM/SIGHUP (handlers installed when entered from the main thread)
    and at interpreter exit. ``rate_mbit=None`` builds an unshaped lab (veth speed).

    ``mtu``: the links' MTU (1500, Ethernet's default; 9000 for jumbo frames, common in clusters).
    The emulated links cost the kernel CPU per packet, charged to the ranks; with many ranks on few
    cores jumbo frames keep that cost from setting the time instead of the rate.

    ``rails``: one NIC (and shaped link, on a bridge of its own) per local rank instead of one NIC
    shared by the host's ranks.
    """

    def __init__(
        self,
        hosts: int,
        rate_mbit: float | None,
        delay_ms: float = 0.0,
        master_port: int = DEFAULT_MASTER_PORT,
        install_signal_handlers: bool = True,
        mtu: int = _MTU,
        ranks_per_host: int = 1,
        rails: bool = False,
    ):
        if not isinstance(hosts, int) or not 1 <= hosts <= _MAX_HOSTS:
            raise NetLabError(f"hosts must be an integer in 1..{_MAX_HOSTS}, got {hosts!r}")
        if not isinstance(ranks_per_host, int) or not 1 <= ranks_per_host <= _MAX_RANKS_PER_HOST:
            raise NetLabError(f"ranks_per_host must be an integer in 1..{_MAX_RANKS_PER_HOST}, got {ranks_per_host!r}")
        if not isinstance(rails, bool):
            raise NetLabError(f"rails must be True or False, got {rails!r}")
        if rate_mbit is not None and not (rate_mbit > 0 and rate_mbit <= 100_000):
            raise NetLabError(f"rate_mbit must be in (0, 100000] Mbit/s or None, got {rate_mbit!r}")
        if not delay_ms >= 0 or delay_ms > 10_000:
            raise NetLabError(f"delay_ms must be in [0, 10000], got {delay_ms!r}")
        if not isinstance(mtu, int) or not 576 <= mtu <= 65535:
            raise NetLabError(f"mtu must be an integer in 576..65535, got {mtu!r}")
        if not 1024 <= master_port <= 65535:
            raise NetLabError(f"master_port must be in 1024..65535, got {master_port!r}")
        global _seq
        with _seq_lock:
            _seq += 1
            seq = _seq
        self.hosts = hosts
        self.ranks_per_host = ranks_per_host
        self.rails = rails
        self.rate_mbit = rate_mbit
        self.delay_ms = float(delay_ms)
        self.mtu = mtu
        self.master_port = master_port
        self.lab_id = f"{os.getpid()}-{seq}"
        self.subnet_octet = (os.getpid() * 7 + seq) % 250 + 1
        self.bridge_ns = f"{PREFIX}-{self.lab_id}-br"
        self.host_ns = [f"{PREFIX}-{self.lab_id}-h{i}" for i in range(hosts)]
        # one NIC per host, or one per local rank (rail j: its own bridge and /24)
        self.nics = [f"lab{j}" for j in range(ranks_per_host if rails else 1)]
        self.rail_addrs = [
            [f"10.{77 + j}.{self.subnet_octet}.{i + 1}" for i in range(hosts)] for j in range(len(self.nics))
        ]
        self.addrs = self.rail_addrs[0]
        self._install_handlers = install_signal_handlers
        self._old_handlers: dict[int, object] = {}
        self._up = False
        self._teardown_lock = threading.Lock()

    @property
    def namespaces(self) -> list[str]:
        return [*self.host_ns, self.bridge_ns]

    @property
    def master_addr(self) -> str:
        return self.addrs[0]

    @property
    def world_size(self) -> int:
        """Ranks in the lab: hosts x ranks_per_host."""
        return self.hosts * self.ranks_per_host

    def host_of(self, rank: int) -> int:
        """The host rank ``rank`` runs on (host-major numbering, as torchrun's)."""
        return rank // self.ranks_per_host

    def nic_of(self, rank: int) -> str:
        """The NIC rank ``rank`` binds to: its rail's with ``rails``, else the host's one NIC."""
        return self.nics[rank % self.ranks_per_host if self.rails else 0]

    # ---- lifecycle

    def __enter__(self) -> NetLab:
        self.up()
        return self

    def __exit__(self, *exc) -> None:
        self.down()

    def up(self) -> None:
        """Build the lab (removing stale labs of dead owners first)."""
        problem = requirements_problem()
        if problem:
            raise NetLabError(problem)
        cleanup_stale()
        _live_labs.append(self)
        self._up = True
        if self._install_handlers and threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):
                self._old_handlers[sig] = signal.signal(sig, _raise_on_signal)
        try:
            self._build()
        except BaseException:
            self.down()
            raise

    def _build(self) -> None:
        br = self.bridge_ns
        _ip("netns", "add", br)
        _ip("-n", br, "link", "set", "lo", "up")
        for j in range(len(self.nics)):  # one switch per rail
            _ip("-n", br, "link", "add", f"br{j}", "type", "bridge", "stp_state", "0", "forward_delay", "0")
            _ip("-n", br, "link", "set", f"br{j}", "up")
        for i, ns in enumerate(self.host_ns):
            _ip("netns", "add", ns)
            _ip("-n", ns, "link", "set", "lo", "up")
            if len(self.nics) > 1:
                # A rank bound to rail j may reach a rank of rail k != j over rail k and hear back over
                # rail j: no reverse-path filter may drop that, and ARP must speak from the rail's address.
                for key, value in (("all/rp_filter", 0), ("default/rp_filter", 0), ("all/arp_announce", 2)):
                    _sysctl(ns, f"net/ipv4/conf/{key}", value)
            for j, nic in enumerate(self.nics):
                port = f"p{i}" if j == 0 else f"p{i}r{j}"
                # Created inside the bridge namespace with its peer placed straight into the host's:
                # the pair never exists in the root namespace.
                _ip("-n", br, "link", "add", port, "type", "veth", "peer", "name", nic, "netns", ns)
                _ip("-n", br, "link", "set", port, "mtu", str(self.mtu))
                _ip("-n", ns, "link", "set", nic, "mtu", str(self.mtu))
                _ip("-n", br, "link", "set", port, "master", f"br{j}")
                _ip("-n", br, "link", "set", port, "up")
                _ip("-n", ns, "addr", "add", f"{self.rail_addrs[j][i]}/24", "dev", nic)
                _ip("-n", ns, "link", "set", nic, "up")
                if self.rate_mbit is not None:
                    shape(ns, nic, self.rate_mbit, self.delay_ms, self.mtu)  # host -> switch
                    shape(br, port, self.rate_mbit, self.delay_ms, self.mtu)  # switch -> host

    def down(self) -> None:
        """Tear the lab down: kill its processes, delete its namespaces. Idempotent."""
        with self._teardown_lock:
            if not self._up:
                return
            # Don't let a second Ctrl-C interrupt the teardown half-way.
            blocked = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
            old_mask = None
            if threading.current_thread() is threading.main_thread():
                old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, blocked)
            try:
                _delete_namespaces([ns for ns in self.namespaces if ns in set(list_lab_namespaces())])
                self._up = False
                if self in _live_labs:
                    _live_labs.remove(self)
                for sig, h in self._old_handlers.items():
                    signal.signal(sig, h)
                self._old_handlers.clear()
            finally:
                if old_mask is not None:
                    signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)

    def nic_counters(self) -> dict[tuple[int, str], tuple[int, int]]:
        """Bytes each host NIC has sent and received so far: ``{(host, nic): (tx, rx)}``.

        The shaped tier's traffic, headers included; traffic between ranks of one host never
        appears here (it stays on the host's loopback)."""
        if not self._up:
            raise NetLabError("the lab is not up (use it as a context manager or call up())")
        out = {}
        for host, ns in enumerate(self.host_ns):
            for nic in self.nics:
                cp = _ip("-n", ns, "-s", "-j", "link", "show", "dev", nic)
                stats = json.loads(cp.stdout)[0]["stats64"]
                out[(host, nic)] = (int(stats["tx"]["bytes"]), int(stats["rx"]["bytes"]))
        return out

    def leftovers(self) -> list[str]:
        """This lab's namespaces that still exist (empty after a proper teardown)."""
        return [ns for ns in list_lab_namespaces() if ns in self.namespaces]

    # ---- running

    def host_env(self, host: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Environment of a process on host ``host``: ours plus the rendezvous and lab variables.

        GLOO_SOCKET_IFNAME is the host's first NIC (``rank_env`` gives each rank its own rail's)."""
        env = dict(os.environ)
        env.update(extra or {})
        env.update(
            {
                "GROUP_RANK": str(host),
                "GROUP_WORLD_SIZE": str(self.hosts),
                "LOCAL_WORLD_SIZE": str(self.ranks_per_host),
                "WORLD_SIZE": str(self.world_size),
                "MASTER_ADDR": self.master_addr,
                "MASTER_PORT": str(self.master_port),
                "LAB_RATE_MBIT": "" if self.rate_mbit is None else f"{self.rate_mbit:g}",
                "LAB_DELAY_MS": f"{self.delay_ms:g}",
                "LAB_ID": self.lab_id,
                "LAB_HOST": str(host),
                "LAB_ADDR": self.addrs[host],
                "LAB_NICS": ",".join(self.nics),
                "LAB_RAILS": "1" if self.rails else "0",
                "GLOO_SOCKET_IFNAME": self.nics[0],
                "TP_SOCKET_IFNAME": self.nics[0],
                "PYTHONUNBUFFERED": "1",
            }
        )
        return env

    def rank_env(self, rank: int, extra: dict[str, str] | None = None) -> dict[str, str]:
        """Environment of rank ``rank``: the host's plus the per-rank variables torchrun sets."""
        host, local = self.host_of(rank), rank % self.ranks_per_host
        nic = self.nic_of(rank)
        env = self.host_env(host, extra)
        env.update(
            {
                "RANK": str(rank),
                "LOCAL_RANK": str(local),
                "ROLE_RANK": str(rank),
                "ROLE_WORLD_SIZE": str(self.world_size),
                "LAB_ADDR": self.rail_addrs[self.nics.index(nic)][host],
                "GLOO_SOCKET_IFNAME": nic,
                "TP_SOCKET_IFNAME": nic,
            }
        )
        return env

    def _placeholders(self, rank: int | None, host: int) -> dict[str, str]:
        values = {
            "{world_size}": str(self.world_size),
            "{local_world_size}": str(self.ranks_per_host),
            "{hosts}": str(self.hosts),
            "{host}": str(host),
            "{master_addr}": self.master_addr,
            "{master_port}": str(self.master_port),
            "{is_master_host}": "1" if host == 0 else "0",
            "{host_addr}": self.addrs[host],
        }
        if rank is not None:
            values.update({"{rank}": str(rank), "{local_rank}": str(rank % self.ranks_per_host)})
        return values

    def run(
        self,
        command: Sequence[str],
        timeout: float = 600.0,
        out_dir: str | Path | None = None,
        echo: bool = False,
        grace: float = 10.0,
        env: dict[str, str] | None = None,
        ranks: Sequence[int] | None = None,
        per_rank: Sequence[Sequence[str]] | None = None,
        stream=None,
        per_host: bool = False,
        hosts: Sequence[int] | None = None,
    ) -> RunResult:
        """Run one rank of ``command`` per rank (``ranks_per_host`` in each host namespace) and wait
        for all of them; with ``per_host``, one process per host (a launcher such as torchrun).

        The placeholders of the module's CLI (``{rank}``, ``{local_rank}``, ``{host}``, ...) in
        arguments are substituted. ``ranks`` runs a subset (with ``per_host``: ``hosts``, which
        without ``per_host`` is the former name of ``ranks``). ``per_rank`` gives each process its
        own command instead. Output goes to ``out_dir/rank<i>.{out,err}`` (``host<i>`` with
        ``per_host``) if given, is kept in memory (last MiB) and, with ``echo``, printed prefixed
        with ``[rank i]``. If a process exits non-zero the others get ``grace`` seconds, then are
        killed; at ``timeout`` all are killed.
        """
        if not self._up:
            raise NetLabError("the lab is not up (use it as a context manager or call up())")
        if timeout is None or not timeout > 0:
            raise NetLabError(f"timeout must be a positive number of seconds, got {timeout!r}")
        if ranks is not None and hosts is not None:
            raise NetLabError("give ranks or hosts, not both")
        unit = "host" if per_host else "rank"
        limit = self.hosts if per_host else self.world_size
        chosen = ranks if ranks is not None else hosts
        units = list(range(limit)) if chosen is None else list(chosen)
        for u in units:
            if not isinstance(u, int) or not 0 <= u < limit:
                raise NetLabError(f"{unit} {u!r} is outside this lab's {limit} {unit}s")
        if per_rank is not None:
            if len(per_rank) != len(units) or any(len(c) == 0 for c in per_rank):
                raise NetLabError(f"per_rank must hold one non-empty command per {unit} ({len(units)})")
            commands = [list(c) for c in per_rank]
        else:
            if not command:
                raise NetLabError("no command given to run in the lab")
            commands = [list(command) for _ in units]
        out = Path(out_dir) if out_dir is not None else None
        if out is not None:
            out.mkdir(parents=True, exist_ok=True)
        stream = stream or sys.stdout
        procs, pumps, host_of = [], [], []
        t0 = time.monotonic()
        # A stop signal waits until every rank is started and in ``procs``: one arriving inside a Popen would leave
        # a child that the cleanup below never sees
        main_thread = threading.current_thread() is threading.main_thread()
        old_mask = signal.pthread_sigmask(signal.SIG_BLOCK, _STOP_SIGNALS) if main_thread else None
        try:
            for u, cmd in zip(units, commands, strict=True):
                host = u if per_host else self.host_of(u)
                values = self._placeholders(None if per_host else u, host)
                for key, value in values.items():
                    cmd = [a.replace(key, value) for a in cmd]
                p = subprocess.Popen(
                    ["ip", "netns", "exec", self.host_ns[host], *cmd],
                    env=self.host_env(host, env) if per_host else self.rank_env(u, env),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    start_new_session=True,
                    preexec_fn=_set_pdeathsig,
                )
                procs.append(p)
                host_of.append(host)
                for name, pipe in (("out", p.stdout), ("err", p.stderr)):
                    pump = _Pump(
                        pipe,
                        out / f"{unit}{u}.{name}" if out else None,
                        f"[{unit} {u}{'' if name == 'out' else ' err'}] " if echo else None,
                        stream,
                    )
                    pump.start()
                    pumps.append(pump)
            if old_mask is not None:
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
                old_mask = None
            timed_out, killed = self._wait(procs, t0 + timeout, grace)
        finally:
            # Whatever happened (Ctrl-C included): no rank outlives run().
            for p in procs:
                if p.poll() is None:
                    _kill_group(p)
            for p in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(timeout=5)
            for pump in pumps:
                pump.join(timeout=5)
            if old_mask is not None:  # a start that raised: the ranks are cleaned up, now the signal may come
                signal.pthread_sigmask(signal.SIG_SETMASK, old_mask)
        results = []
        for k, (u, p) in enumerate(zip(units, procs, strict=True)):
            o, e = pumps[2 * k], pumps[2 * k + 1]
            results.append(
                RankResult(u, p.returncode, o.text(), e.text(), o.path, e.path, killed=k in killed, host=host_of[k])
            )
        return RunResult(results, timed_out, time.monotonic() - t0, per_host=per_host)

    @staticmethod
    def _wait(procs, deadline: float, grace: float) -> tuple[bool, set[int]]:
        first_fail = None
        killed: set[int] = set()
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                return False, killed
            now = time.monotonic()
            if first_fail is None and any(c not in (None, 0) for c in codes):
                first_fail = now
            if now >= deadline or (first_fail is not None and now - first_fail >= grace):
                for k, p in enumerate(procs):
                    if p.poll() is None:
                        _kill_group(p)
                        killed.add(k)
                return now >= deadline, killed
            time.sleep(0.02)


def _kill_group(p: subprocess.Popen, term_wait: float = 2.0) -> None:
    """SIGTERM the process group of ``p``, SIGKILL it if still alive after ``term_wait``."""
    for sig, wait in ((signal.SIGTERM, term_wait), (signal.SIGKILL, 0)):
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(p.pid, sig)
        try:
            p.wait(timeout=wait if wait else 5)
            if sig == signal.SIGTERM:
                # the leader is gone; make sure the rest of its group is too
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
            return
        except subprocess.TimeoutExpired:
            continue


def _raise_on_signal(signum, frame):
    """Turn SIGTERM/SIGHUP/SIGINT into exceptions so ``finally`` blocks tear the lab down."""
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise SystemExit(128 + signum)


@atexit.register
def _teardown_all() -> None:
    for lab in list(_live_labs):
        with contextlib.suppress(Exception):
            lab.down()


# --------------------------------------------------------------------------- CLI


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description="Run the ranks of a command in the hosts of a rate-limited namespace lab.",
        epilog="Example: netlab.py --hosts 4 --ranks-per-host 2 --rate-mbit 200 -- python train.py --rank {rank}",
    )
    ap.add_argument("--hosts", type=int, default=2, help="number of hosts, default 2")
    ap.add_argument(
        "--ranks-per-host",
        type=int,
        default=1,
        help="ranks per host (LOCAL_WORLD_SIZE), default 1; between them traffic is unshaped",
    )
    ap.add_argument("--rails", action="store_true", help="one shaped NIC per local rank instead of one per host")
    ap.add_argument("--mtu", type=int, default=_MTU, help="link MTU (9000: jumbo frames), default 1500")
    ap.add_argument(
        "--per-host",
        action="store_true",
        help="run one process per host (a launcher such as torchrun) instead of one per rank",
    )
    ap.add_argument(
        "--rate-mbit",
        type=float,
        default=None,
        help="link rate in Mbit/s, each direction of each host link (omit: unshaped)",
    )
    ap.add_argument(
        "--delay-ms",
        type=float,
        default=0.0,
        help="netem delay added on each end of each link (host-to-host one-way = 2x)",
    )
    ap.add_argument("--timeout", type=float, default=600.0, help="kill all ranks after this many seconds")
    ap.add_argument(
        "--grace",
        type=float,
        default=10.0,
        help="after a rank fails, kill the others after this many seconds",
    )
    ap.add_argument("--master-port", type=int, default=DEFAULT_MASTER_PORT)
    ap.add_argument("--out", type=Path, default=None, help="write rank<i>.out / rank<i>.err here")
    ap.add_argument("--quiet", action="store_true", help="don't echo rank output")
    ap.add_argument(
        "--cleanup",
        action="store_true",
        help="remove stale labs (dead owner) and exit; with --all, every lab of this project",
    )
    ap.add_argument("--all", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("command", nargs=argparse.REMAINDER, help="-- command and arguments")
    args = ap.parse_args(argv)
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command

    problem = requirements_problem()
    if problem:
        print(f"netlab: {problem}", file=sys.stderr)
        return 2
    if args.cleanup:
        removed = cleanup_stale(all_labs=args.all)
        print(f"netlab: removed {len(removed)} namespace(s)" + (f": {' '.join(removed)}" if removed else ""))
        return 0
    if not cmd:
        ap.error("no command given; put it after --")
    try:
        lab = NetLab(
            args.hosts,
            args.rate_mbit,
            args.delay_ms,
            args.master_port,
            mtu=args.mtu,
            ranks_per_host=args.ranks_per_host,
            rails=args.rails,
        )
    except NetLabError as e:
        ap.error(str(e))
    try:
        with lab:
            print(
                f"netlab: lab {lab.lab_id}: {args.hosts} hosts {', '.join(lab.addrs)} x {args.ranks_per_host} "
                f"ranks ({len(lab.nics)} NIC(s) each, mtu {args.mtu}); rate {args.rate_mbit or 'unshaped'} "
                f"Mbit/s, delay {args.delay_ms} ms per link end",
                file=sys.stderr,
                flush=True,
            )
            res = lab.run(
                cmd,
                timeout=args.timeout,
                out_dir=args.out,
                echo=not args.quiet,
                grace=args.grace,
                per_host=args.per_host,
            )
            print(f"netlab: {res.describe()} in {res.seconds:.1f}s", file=sys.stderr, flush=True)
            return res.returncode
    except KeyboardInterrupt:
        print("netlab: interrupted; lab torn down", file=sys.stderr)
        return 130
    except NetLabError as e:
        print(f"netlab: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
