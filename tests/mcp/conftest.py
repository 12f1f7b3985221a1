"""One embedded engine for the MCP tests, and a live `serve`-style server with MCP mounted at /mcp."""

from __future__ import annotations

import pytest

from dflash_agent.api.background import live_server
from dflash_agent.api.service import ServerSettings
from dflash_agent.mcp.http import MCPPlugin
from dflash_agent.serve import mcp_admission

API_KEY = "mcp-test-key"


@pytest.fixture(scope="session")
def mcp_engine(embedded_engine):
    engine = embedded_engine(1024)
    yield engine
    engine.close()


@pytest.fixture(scope="session")
def mcp_repo(tmp_path_factory):
    repo = tmp_path_factory.mktemp("mcp-repo")
    (repo / "README.md").write_text("# demo\nA demo repository for the MCP tests.\n")
    (repo / "pkg").mkdir()
    (repo / "pkg" / "mod.py").write_text("VALUE = 42\n")
    return repo


@pytest.fixture(scope="session")
def mcp_http_url(mcp_engine, mcp_repo):
    """The server's base URL; /mcp needs the API key like every other route."""
    def mcp(server):
        return [MCPPlugin(server.loaded, "the served model", mcp_repo, expose_tools=True,
                          admit=mcp_admission(server))]

    with live_server(lambda: mcp_engine, ServerSettings(api_key=API_KEY), plugins=mcp) as url:
        yield url
