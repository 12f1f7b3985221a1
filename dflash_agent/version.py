"""The installed package's version, for what the servers report (MCP's handshake, /props, --version)."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version


def package_version() -> str:
    """dflash-agent's version as installed; "0" when run from a tree that was never installed."""
    try:
        return version("dflash-agent")
    except PackageNotFoundError:
        return "0"
