"""Which network interface the weight group's members advertise to each other.

gloo advertises the address the machine's host name resolves to; Debian and Ubuntu map the
host name to a loopback address in /etc/hosts, so a trainer or actor on another machine is
told to connect to 127.0.0.1 and the group never forms. `choose_interface` picks the interface
that routes to the weight store's host instead, in that order:

1. `GLOO_SOCKET_IFNAME` (gloo) / `NCCL_SOCKET_IFNAME` (NCCL) set in the environment: the
   user's choice; torch and NCCL read it themselves.
2. `sync.interface` (the `configured` argument): that interface.
3. The store on a loopback address (every role on one machine): nothing changes.
4. The host name resolves to an address on the interface that routes to the store: nothing
   changes (that address reaches the others).
5. Otherwise (loopback, unresolved, or another interface): the interface holding the local
   source address of the route to the store, found by connecting a UDP socket (no packet is
   sent) and reading its own address.
Where no route or no interface is found, a `RuntimeError` names the key and the variables.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import ipaddress
import logging
import os
import socket
from dataclasses import dataclass

logger = logging.getLogger(__name__)

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
ENV_VARS = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}
_HELP = ("set sync.interface to the name of the interface that reaches the trainer and every "
         "actor (see `ip -o addr`), or GLOO_SOCKET_IFNAME (gloo) / NCCL_SOCKET_IFNAME (NCCL) "
         "in the environment of every role")


class _Sockaddr(ctypes.Structure):
    _fields_ = [("sa_family", ctypes.c_ushort), ("sa_data", ctypes.c_ubyte * 14)]


class _Ifaddrs(ctypes.Structure):
    pass


_Ifaddrs._fields_ = [  # struct ifaddrs (glibc, musl)
    ("ifa_next", ctypes.POINTER(_Ifaddrs)),
    ("ifa_name", ctypes.c_char_p),
    ("ifa_flags", ctypes.c_uint),
    ("ifa_addr", ctypes.POINTER(_Sockaddr)),
    ("ifa_netmask", ctypes.POINTER(_Sockaddr)),
    ("ifa_ifu", ctypes.POINTER(_Sockaddr)),
    ("ifa_data", ctypes.c_void_p),
]


def interface_addresses() -> dict[str, list[IPAddress]]:
    """Every interface's IPv4 and IPv6 addresses (secondary ones too), by interface name.

    getifaddrs(3) through ctypes: the stdlib has no call for it, and an interface's secondary
    addresses are missing from the SIOCGIFADDR ioctl."""
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    head = ctypes.POINTER(_Ifaddrs)()
    if libc.getifaddrs(ctypes.byref(head)) != 0:
        raise OSError(ctypes.get_errno(), "getifaddrs failed")
    out: dict[str, list[IPAddress]] = {}
    try:
        node = head
        while node:
            ifa = node.contents
            if ifa.ifa_addr:
                family = ifa.ifa_addr.contents.sa_family
                raw = ctypes.string_at(ifa.ifa_addr, 28)  # sockaddr_in6 is the larger
                packed = (raw[4:8] if family == socket.AF_INET
                          else raw[8:24] if family == socket.AF_INET6 else None)
                if packed is not None:
                    out.setdefault(ifa.ifa_name.decode(), []).append(
                        ipaddress.ip_address(packed))
            node = ifa.ifa_next
    finally:
        libc.freeifaddrs(head)
    return out


def _resolve(host: str) -> IPAddress | None:
    """The first address `host` resolves to, as gloo takes it; None if it does not."""
    try:
        info = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except socket.gaierror:
        return None
    return ipaddress.ip_address(info[0][4][0]) if info else None


def route_source(dest: IPAddress) -> IPAddress:
    """The local address the kernel picks to reach `dest`: a connected UDP socket sends
    nothing, but the routing decision sets its own address. OSError where there is no route."""
    family = socket.AF_INET6 if dest.version == 6 else socket.AF_INET
    with socket.socket(family, socket.SOCK_DGRAM) as s:
        s.connect((str(dest), 9))  # any port: nothing is sent
        return ipaddress.ip_address(s.getsockname()[0].split("%")[0])


def interface_of(addr: IPAddress) -> str | None:
    """The interface that holds `addr`, if any."""
    for name, addrs in interface_addresses().items():
        if addr in addrs:
            return name
    return None


def route_interface(dest: str) -> str:
    """The interface the route to `dest` (an address or a host name) leaves from: the one
    holding the route's local source address (`lo` for 127.0.0.1)."""
    ip = _resolve(dest)
    if ip is None:
        raise RuntimeError(f"cannot resolve {dest!r}")
    source = route_source(ip)
    name = interface_of(source)
    if name is None:
        raise RuntimeError(f"no interface holds {source}, the local address of the route to "
                           f"{ip}")
    return name


@dataclass(frozen=True)
class InterfaceChoice:
    interface: str | None  # None: leave it to torch / NCCL (their defaults or the variable)
    reason: str


def choose_interface(store_host: str, backend: str, configured: str = "") -> InterfaceChoice:
    """The interface the weight group of `backend` ("gloo" or "nccl") should use to reach
    the store at `store_host` and the other members (the order is in the module's doc)."""
    var = ENV_VARS[backend]
    if value := os.environ.get(var):
        if configured and configured != value:
            logger.warning("sync.interface=%s is ignored: %s=%s is set in the environment",
                           configured, var, value)
        return InterfaceChoice(None, f"{var}={value} set in the environment")
    if configured:
        if configured not in interface_addresses():
            raise RuntimeError(f"sync.interface={configured}: no such interface with an "
                               f"address on this machine (have: "
                               f"{', '.join(sorted(interface_addresses()))})")
        return InterfaceChoice(configured, f"sync.interface={configured}")
    store_ip = _resolve(store_host)
    if store_ip is None:
        raise RuntimeError(f"weight store host {store_host!r} (sync.init_method) does not "
                           f"resolve, so the interface to reach it cannot be chosen; {_HELP}")
    if store_ip.is_loopback:
        return InterfaceChoice(None, f"the store is on loopback ({store_ip}): one machine")
    try:
        source = route_source(store_ip)
    except OSError as e:
        raise RuntimeError(f"no route to the weight store's host {store_ip} "
                           f"(sync.init_method): {e}; {_HELP}") from e
    chosen = interface_of(source)
    if chosen is None:
        raise RuntimeError(f"no interface holds {source}, the local address of the route to the "
                           f"weight store's host {store_ip}; {_HELP}")
    hostname = socket.gethostname()
    advertised = _resolve(hostname)
    if (advertised is not None and not advertised.is_loopback
            and interface_of(advertised) == chosen):
        return InterfaceChoice(None, f"host name {hostname} resolves to {advertised} on "
                                     f"{chosen}, which routes to the store at {store_ip}")
    why = ("does not resolve" if advertised is None
           else f"resolves to loopback {advertised}" if advertised.is_loopback
           else f"resolves to {advertised}, not on the route to the store")
    return InterfaceChoice(chosen, f"host name {hostname} {why}; {chosen} (local address "
                                   f"{source}) routes to the store at {store_ip}")
