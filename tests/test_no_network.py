"""The suite-wide guard (tests/conftest.py `_no_network`): a connection to a host other than
this machine fails the test, naming the address; loopback still works (the servers tests start)."""
import socket

import pytest

from tests.helpers.network import NetworkAccessError


@pytest.mark.parametrize("address", [("192.0.2.1", 80), ("2001:db8::1", 80, 0, 0), ("pypi.org", 443)])
def test_a_connection_off_this_machine_fails_by_address(address):
    family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.2)
        with pytest.raises(NetworkAccessError, match=f"connected to .*{address[0]}"):
            sock.connect(address)
        with pytest.raises(NetworkAccessError):
            sock.connect_ex(address)


def test_loopback_connects():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        with socket.create_connection(server.getsockname(), timeout=5):
            pass
