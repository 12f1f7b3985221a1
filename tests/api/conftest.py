"""Real servers on 127.0.0.1 with the embedded model, shared by the API tests."""

from __future__ import annotations

import pytest

from dflash_agent.api.background import live_server
from dflash_agent.api.service import ServerSettings
from dflash_agent.engine.engine import Engine

API_KEY = "test-key-123"


@pytest.fixture(scope="session")
def server_url():
    with live_server(lambda: Engine.load(progress=False)) as url:
        yield url


@pytest.fixture(scope="session")
def strict_url(embedded_engine):
    """An API key, no queue behind the running request, a 64 KiB body limit and a short context."""
    settings = ServerSettings(api_key=API_KEY, max_queue=0, heartbeat_s=0.2)
    with live_server(lambda: embedded_engine(256), settings, max_body_bytes=64 * 1024) as url:
        yield url
