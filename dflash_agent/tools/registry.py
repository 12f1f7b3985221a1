"""The tool registry: the declared tools as the OpenAI tool list, as neutral specs an MCP server
turns into MCP tools, and the dispatch of a call. A bad call (unknown tool, arguments that do not
fit the schema, a tool that fails) comes back as an error result the model can read, never as an
exception that would end the agent's run."""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec

from .bash import DEFAULT_DENY, Shell, bash_tool
from .files import file_tools
from .sandbox import Sandbox
from .search import search_tools
from .tool import ToolError, ToolResult, ToolSpec
from .workspace import Workspace

log = logging.getLogger(__name__)


class Registry:
    def __init__(self, tools: Sequence[ToolSpec], disabled: Mapping[str, str] | None = None) -> None:
        """`disabled`: names of tools left out on purpose, with the reason a call to one is refused."""
        self.tools = list(tools)
        self._by_name = {tool.name: tool for tool in self.tools}
        if len(self._by_name) != len(self.tools):
            raise ValueError("tool names must be unique")
        self.disabled = dict(disabled or {})

    @property
    def names(self) -> list[str]:
        return [tool.name for tool in self.tools]

    def openai_tools(self) -> list[dict[str, Any]]:
        """The `tools` of an OpenAI chat completions request."""
        return [
            {"type": "function",
             "function": {"name": t.name, "description": t.description, "parameters": t.input_schema}}
            for t in self.tools
        ]

    async def dispatch(self, name: str, arguments: Mapping[str, Any] | str | None) -> ToolResult:
        """Run one call. `arguments`: the decoded object, or the JSON text of one."""
        tool = self._by_name.get(name)
        if tool is None:
            if name in self.disabled:
                return ToolResult(f"tool {name!r} is disabled: {self.disabled[name]}", is_error=True)
            return ToolResult(f"unknown tool {name!r}; the tools are: {', '.join(self.names)}", is_error=True)
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError as exc:
                return ToolResult(f"the arguments for {name} are not valid JSON: {exc}", is_error=True)
        try:
            # Lax: a model that writes "30" for an integer still gets its call run.
            params = msgspec.convert(arguments or {}, tool.params, strict=False)
        except msgspec.ValidationError as exc:
            schema = json.dumps(tool.input_schema, ensure_ascii=False)
            return ToolResult(f"invalid arguments for {name}: {exc}. Its parameters: {schema}", is_error=True)
        try:
            return ToolResult(await tool.run(params))
        except ToolError as exc:
            return ToolResult(str(exc), is_error=True)
        except OSError as exc:  # permissions, a full disk, a path component that is a file, ...
            return ToolResult(f"{name} failed: {exc.strerror or exc}" + (f": {exc.filename}" if exc.filename else ""),
                              is_error=True)
        except Exception as exc:  # a bug in a tool must not end the run; the log keeps the traceback
            log.exception("tool %s failed on %r", name, arguments)
            return ToolResult(f"{name} failed with an internal error: {type(exc).__name__}: {exc}", is_error=True)


def workspace_tools(workspace: Workspace, deny: Sequence[str] = DEFAULT_DENY,
                    sandbox: Sandbox | None = None) -> Registry:
    """The agent's tools on one workspace. Read-only: only the tools that change nothing (no bash,
    which can change anything). `sandbox`: where the commands of bash and grep run (default: bwrap where it
    starts); one for all, so bwrap is probed once."""
    sandbox = sandbox if sandbox is not None else Sandbox()
    tools = [bash_tool(Shell(workspace, deny, sandbox=sandbox)), *file_tools(workspace),
             *search_tools(workspace, sandbox)]
    if not workspace.read_only:
        return Registry(tools)
    reason = "the workspace is read-only"
    return Registry([t for t in tools if t.read_only], {t.name: reason for t in tools if not t.read_only})
