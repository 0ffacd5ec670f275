"""Fixtures of the integration modules that define `clients` (the openai and anthropic clients of their server,
`agent_cases.sdk_clients`): each client alone."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def oai(clients):
    return clients[0]


@pytest.fixture(scope="module")
def claude(clients):
    return clients[1]
