"""Fixtures of the multi-host tests: two simulated hosts (network namespaces + a veth pair).

The tests skip, saying why, only where namespaces or veth pairs cannot be made (not root, no
`unshare`/`nsenter`/`ip`); CI runs as root, so there they run.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from hosts import TwoHosts, make_two_hosts, missing_tools

pytestmark = pytest.mark.integration


@pytest.fixture(scope="session")
def two_hosts() -> Iterator[TwoHosts]:
    reason = missing_tools()
    if reason:
        pytest.skip(reason)
    try:
        hosts = make_two_hosts()
    except PermissionError as exc:
        pytest.skip(f"cannot simulate two hosts here: {exc}")
    try:
        yield hosts
    finally:
        hosts.close()
