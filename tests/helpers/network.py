"""The check behind tests/conftest.py's `_no_network`: a socket may connect to this machine only."""
import ipaddress
import socket

_LOOPBACK_NAMES = ("localhost",)


class NetworkAccessError(AssertionError):
    """A test tried to reach a host other than this machine."""


def is_local(address) -> bool:
    """True for a loopback or unspecified IP (either family) or the name `localhost`; any other
    host name is not (resolving it already uses the network)."""
    host = address[0]
    if host in _LOOPBACK_NAMES:
        return True
    try:
        ip = ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        return False
    return ip.is_loopback or ip.is_unspecified


def guarded(method):
    """`socket.socket.connect` (or `connect_ex`) that raises NetworkAccessError, naming the
    address, for a TCP connection to an IPv4/IPv6 address that is not local. Unix sockets pass,
    and so does UDP: its connect sends nothing (weight_transfer.local_address_towards uses it
    to pick a route)."""
    def connect(sock, address):
        if (sock.family in (socket.AF_INET, socket.AF_INET6) and sock.type == socket.SOCK_STREAM
                and not is_local(address)):
            raise NetworkAccessError(f"tests never use the network: a test connected to {address!r}")
        return method(sock, address)
    return connect
