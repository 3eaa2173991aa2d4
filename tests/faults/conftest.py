"""Fixtures of the fault matrix: one set of namespace "hosts" (fault_net.Net) and one
side-channel LinkProxy for the session; every test here is marked ``faults``."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from fault_net import Net, net_or_skip  # noqa: E402
from fault_proxy import LinkProxy  # noqa: E402


def pytest_collection_modifyitems(config, items) -> None:
    here = Path(__file__).parent
    for item in items:
        if Path(str(item.fspath)).is_relative_to(here):
            item.add_marker(pytest.mark.faults)


@pytest.fixture(scope="session")
def net() -> Iterator[Net]:
    with net_or_skip() as n:
        yield n


@pytest.fixture(scope="session")
def link_proxy(net) -> Iterator[LinkProxy]:
    p = LinkProxy()
    yield p
    p.close()


#: what each case saw (printed at the end of the run: the table in docs/RELIABILITY.md)
OUTCOMES: list[dict] = []


@pytest.fixture
def note(request):
    """note(took=seconds, status=..., error=...): record what the request under test got."""

    def record(**kw) -> None:
        OUTCOMES.append({"test": request.node.name, **kw})

    return record


def pytest_terminal_summary(terminalreporter) -> None:
    if not OUTCOMES:
        return
    terminalreporter.section("fault matrix outcomes")
    for o in OUTCOMES:
        rest = ", ".join(f"{k}={v}" for k, v in o.items() if k != "test")
        terminalreporter.write_line(f"{o['test']}: {rest}")
