"""The MCP server: the coding agent as one tool (`run_task`, a progress notification per step,
cancellable), the local model itself (`complete`, `chat`), optionally the workspace tools, and a
`status` resource.

It is built on the SDK's low-level `Server` rather than `MCPServer`'s decorators because every tool
here is declared the registry's way, once, as a msgspec Struct that is both the JSON schema the
client sees and the validator of what it sends; function signatures would be a second source."""

from __future__ import annotations

import asyncio
import json
import logging
import os
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Annotated, Any

import anyio
import msgspec
from mcp.server import Server
from mcp.server.context import ServerRequestContext
from mcp.server.session import ServerSession
from mcp.shared.exceptions import MCPError
from mcp_types import (
    INVALID_PARAMS,
    CallToolRequestParams,
    CallToolResult,
    ListResourcesResult,
    ListToolsResult,
    PaginatedRequestParams,
    ReadResourceRequestParams,
    ReadResourceResult,
    Resource,
    TextContent,
    TextResourceContents,
    Tool,
    ToolAnnotations,
)

from ..agent.backend import BackendError, ContextFull, TurnOptions
from ..agent.loop import Agent, AgentConfig, AgentEvent, RunResult, StepEnd, TurnEnd
from ..agent.prompt import system_prompt
from ..agent.transcript import Transcript, default_transcript_path
from ..chat.openai_messages import conversation_from_openai
from ..errors import UserError
from ..tools.bash import DEFAULT_DENY
from ..tools.registry import Registry, workspace_tools
from ..tools.sandbox import Sandbox
from ..tools.tool import ToolError, ToolResult, ToolSpec, struct_schema
from ..tools.workspace import Workspace
from ..version import package_version
from .model import ModelAccess
from .wire import initialize_first

log = logging.getLogger(__name__)

STATUS_URI = "dflash-agent://status"
MAX_STEPS = 200  # what one run_task may ask for
MAX_TURN_TOKENS = 32768
# Failures a caller can read and act on: they become the tool's error text, not a logged crash.
# Engine and chat errors are ValueErrors, a missing file an OSError: the caller's to fix, so a tool error.
EXPECTED_ERRORS = (ToolError, BackendError, ContextFull, ValueError, OSError)


class RunTaskArgs(msgspec.Struct, forbid_unknown_fields=True):
    task: Annotated[str, msgspec.Meta(min_length=1, description="What the coding agent should do, as you would "
                                                                  "tell a colleague.")]
    repo: Annotated[str, msgspec.Meta(description="Directory to work in, relative to the server's workspace "
                                                   "(default: the workspace itself); it must be inside it.")] = "."
    max_steps: Annotated[int, msgspec.Meta(ge=1, le=MAX_STEPS, description="Model turns before the agent "
                                                                            "stops.")] = AgentConfig.max_steps
    max_turn_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TURN_TOKENS, description=(
        "Tokens the model may write in one turn."))] = AgentConfig.max_turn_tokens
    max_tokens: Annotated[int, msgspec.Meta(ge=1, description=(
        "Tokens the model may write over the whole task, all turns together (default: no limit but "
        "max_steps x max_turn_tokens); the agent stops with what it has when they run out."))] | None = None


TEMPERATURE = "0 is greedy. Unset: the model's recommended sampling where it has one, else greedy."


class CompleteArgs(msgspec.Struct, forbid_unknown_fields=True):
    prompt: Annotated[str, msgspec.Meta(min_length=1, description="Text to continue (no chat template).")]
    max_tokens: Annotated[int, msgspec.Meta(ge=1, description="Tokens to generate at most.")] = 256
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2, description=TEMPERATURE)] | None = None


class ChatArgs(msgspec.Struct, forbid_unknown_fields=True):
    messages: Annotated[list[dict[str, Any]], msgspec.Meta(
        min_length=1, description="OpenAI chat messages: {role, content}, assistant tool_calls, tool results.")]
    tools: Annotated[list[dict[str, Any]], msgspec.Meta(
        description="OpenAI function tools the model may call; its calls come back as JSON.")] | None = None
    max_tokens: Annotated[int, msgspec.Meta(ge=1, description="Tokens to generate at most.")] = 1024
    temperature: Annotated[float, msgspec.Meta(ge=0, le=2, description=TEMPERATURE)] | None = None
    enable_thinking: Annotated[bool, msgspec.Meta(description="Let the model reason first (Gemma 4); the "
                                                             "reasoning comes back apart from the answer.")] = False


OnEvent = Callable[[AgentEvent], None]
# (workspace, limits, event sink) -> a fresh agent for one run_task call.
AgentFactory = Callable[[Workspace, AgentConfig, OnEvent], Awaitable[Agent]]
Handler = Callable[[Any, ServerRequestContext], Awaitable[CallToolResult]]


@dataclass(frozen=True)
class ServerTool:
    definition: Tool
    params: type[msgspec.Struct] | None  # None: the registry validates the arguments itself
    handler: Handler


def agent_factory(model: ModelAccess, deny: tuple[str, ...] = DEFAULT_DENY,
                  temperature: float | None = None, sandbox: Sandbox | None = None) -> AgentFactory:
    """Agents on `model` with the workspace tools, each run recorded in a transcript (as `dflash-agent
    run` records its runs). One `sandbox` for them all: bwrap is probed once."""
    sandbox = sandbox if sandbox is not None else Sandbox()

    async def make(workspace: Workspace, config: AgentConfig, on_event: OnEvent) -> Agent:
        backend = await model.backend(temperature)
        registry = workspace_tools(workspace, deny, sandbox)
        transcript = Transcript(default_transcript_path(workspace.root, workspace.read_only))
        transcript.event("start", command="mcp run_task", repo=str(workspace.root), model=model.name,
                         read_only=workspace.read_only, tools=registry.names,
                         config={"max_steps": config.max_steps, "max_turn_tokens": config.max_turn_tokens,
                                 "max_tokens": config.max_tokens, "temperature": temperature})
        return Agent(backend, registry, system_prompt(workspace), config, on_event, transcript)

    return make


def build_server(model: ModelAccess, workspace: Workspace | None = None, registry: Registry | None = None,
                 make_agent: AgentFactory | None = None) -> Server:
    """`workspace` and `make_agent` give the `run_task` tool (the agent works inside the workspace);
    `registry` exposes its tools as MCP tools. With neither, the server offers only the model."""
    tools = [*_agent_tools(workspace, make_agent), *_model_tools(model)]
    if registry is not None:
        tools += [_registry_tool(registry, spec) for spec in registry.tools]
    table = {tool.definition.name: tool for tool in tools}

    async def list_tools(ctx: ServerRequestContext, params: PaginatedRequestParams | None) -> ListToolsResult:
        return ListToolsResult(tools=[tool.definition for tool in tools])

    async def call_tool(ctx: ServerRequestContext, params: CallToolRequestParams) -> CallToolResult:
        tool = table.get(params.name)
        if tool is None:
            if registry is not None and params.name in registry.disabled:
                return error_result(f"tool {params.name!r} is disabled: {registry.disabled[params.name]}")
            return error_result(f"unknown tool {params.name!r}; the tools are: {', '.join(table)}")
        arguments: Any = params.arguments or {}
        if tool.params is not None:
            try:
                arguments = msgspec.convert(arguments, tool.params, strict=False)
            except msgspec.ValidationError as exc:
                schema = json.dumps(tool.definition.input_schema, ensure_ascii=False)
                return error_result(f"invalid arguments for {params.name}: {exc}. Its parameters: {schema}")
        try:
            return await tool.handler(arguments, ctx)
        except EXPECTED_ERRORS as exc:
            log.info("tool %s failed: %s", params.name, exc)
            return error_result(str(exc))
        except Exception as exc:  # a bug must not end the session; the log keeps the traceback
            log.exception("tool %s failed", params.name)
            return error_result(f"{params.name} failed with an internal error: {type(exc).__name__}: {exc}")

    async def list_resources(ctx: ServerRequestContext, params: PaginatedRequestParams | None) -> ListResourcesResult:
        return ListResourcesResult(resources=[Resource(
            uri=STATUS_URI, name="status", title="Model status", mime_type="application/json",
            description="The model, its context size and drafter, speed and draft acceptance of the last request, "
                        "prefix-cache hits.")])

    async def read_resource(ctx: ServerRequestContext, params: ReadResourceRequestParams) -> ReadResourceResult:
        if str(params.uri) != STATUS_URI:
            raise MCPError(INVALID_PARAMS, f"unknown resource {params.uri}; the resources are: {STATUS_URI}",
                           {"uri": str(params.uri)})
        text = json.dumps(await model.status(), indent=2, ensure_ascii=False)
        return ReadResourceResult(contents=[TextResourceContents(uri=STATUS_URI, mime_type="application/json",
                                                                 text=text)])

    server = Server("dflash-agent", version=package_version(), instructions=_instructions(workspace, registry),
                    on_list_tools=list_tools, on_call_tool=call_tool, on_list_resources=list_resources,
                    on_read_resource=read_resource)
    server.middleware.append(initialize_first)
    return server


def workspace_server(model: ModelAccess, repo: os.PathLike | str | None, expose_tools: bool = False,
                     read_only: bool = False, deny: tuple[str, ...] = DEFAULT_DENY,
                     sandbox: Sandbox | None = None) -> Server:
    """The server the `mcp` command and `serve`'s /mcp run: run_task on `repo` (when given), the
    model, and with `expose_tools` the workspace tools; `sandbox` confines their commands."""
    if repo is None:
        if expose_tools:
            raise UserError("exposing the workspace tools needs a workspace (a repo directory)")
        return build_server(model)
    workspace = Workspace(repo, read_only=read_only)
    sandbox = sandbox if sandbox is not None else Sandbox()
    registry = workspace_tools(workspace, deny, sandbox) if expose_tools else None
    return build_server(model, workspace, registry, agent_factory(model, deny, sandbox=sandbox))


# --- the tools ------------------------------------------------------------------------------------


def _agent_tools(workspace: Workspace | None, make_agent: AgentFactory | None) -> list[ServerTool]:
    if workspace is None or make_agent is None:
        return []

    async def run_task(args: RunTaskArgs, ctx: ServerRequestContext) -> CallToolResult:
        config = AgentConfig(max_steps=args.max_steps, max_turn_tokens=args.max_turn_tokens,
                             max_tokens=args.max_tokens)
        progress = StepProgress(config.max_steps)
        agent = await make_agent(_task_workspace(workspace, args.repo), config, progress.on_event)
        try:
            async with anyio.create_task_group() as tasks:
                tasks.start_soon(progress.send, ctx.session)
                try:
                    # An MCP cancel cancels this handler, so the task awaiting the run: the agent stops
                    # generation (the engine's request is cancelled) or the running command, and records it.
                    result = await agent.run(args.task)
                finally:
                    progress.close()
        finally:
            if agent.transcript is not None:
                agent.transcript.close()
        log.info("run_task: %s after %d steps", result.outcome, result.steps)
        return _run_result(result, progress.tool_calls, agent.transcript)

    writes = not workspace.read_only
    return [ServerTool(Tool(
        name="run_task", title="Run a coding task",
        description="Give the local coding agent a task in the workspace: it reads, searches"
                    + (", edits files and runs commands" if writes else " (read-only)")
                    + " with its own tools until it can answer, then returns its answer and a summary. "
                      "Sends a progress notification per step; cancel the request to stop it.",
        input_schema=struct_schema(RunTaskArgs),
        annotations=ToolAnnotations(title="Run a coding task", read_only_hint=not writes, destructive_hint=writes,
                                    idempotent_hint=False, open_world_hint=writes)),
        RunTaskArgs, run_task)]


def _model_tools(model: ModelAccess) -> list[ServerTool]:
    async def complete(args: CompleteArgs, ctx: ServerRequestContext) -> CallToolResult:
        out = await model.complete(args.prompt, args.max_tokens, args.temperature)
        return CallToolResult(content=[TextContent(type="text", text=out.text)], structured_content={
            "text": out.text, "finish_reason": out.finish_reason, "prompt_tokens": out.usage.prompt_tokens,
            "completion_tokens": out.usage.completion_tokens, "timings": out.timings})

    async def chat(args: ChatArgs, ctx: ServerRequestContext) -> CallToolResult:
        conversation = conversation_from_openai(args.messages, args.tools)
        backend = await model.backend(args.temperature)
        options = TurnOptions(max_tokens=args.max_tokens, enable_thinking=args.enable_thinking)
        turn = await backend.turn(conversation, options, lambda delta: None)
        calls = [{"id": c.id, "name": c.name, "arguments": c.arguments} for c in turn.tool_calls]
        content = [TextContent(type="text", text=turn.content)] if turn.content else []
        if calls:
            content.append(TextContent(type="text", text=json.dumps({"tool_calls": calls}, ensure_ascii=False)))
        return CallToolResult(content=content, structured_content={
            "content": turn.content, "reasoning": turn.reasoning, "tool_calls": calls,
            "finish_reason": turn.finish_reason, "prompt_tokens": turn.usage.prompt_tokens,
            "completion_tokens": turn.usage.completion_tokens})

    generation = ToolAnnotations(read_only_hint=True, open_world_hint=False)
    return [
        ServerTool(Tool(name="complete", title="Complete text with the local model",
                        description="Continue `prompt` with the local model: raw text, no chat template.",
                        input_schema=struct_schema(CompleteArgs), annotations=generation), CompleteArgs, complete),
        ServerTool(Tool(name="chat", title="Chat with the local model",
                        description="One assistant turn of the local model after OpenAI-style `messages`; with "
                                    "`tools`, the calls it makes come back as JSON.",
                        input_schema=struct_schema(ChatArgs), annotations=generation), ChatArgs, chat),
    ]


def _registry_tool(registry: Registry, spec: ToolSpec) -> ServerTool:
    async def dispatch(arguments: dict[str, Any], ctx: ServerRequestContext) -> CallToolResult:
        result: ToolResult = await registry.dispatch(spec.name, arguments)
        return CallToolResult(content=[TextContent(type="text", text=result.text)], is_error=result.is_error)

    return ServerTool(Tool(name=spec.name, description=spec.description, input_schema=spec.input_schema,
                           annotations=ToolAnnotations(read_only_hint=spec.read_only, destructive_hint=spec.destructive,
                                                       idempotent_hint=spec.idempotent)),
                      None, dispatch)


def error_result(message: str) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=message)], is_error=True)


def _task_workspace(workspace: Workspace, repo: str) -> Workspace:
    path = workspace.resolve(repo)  # ToolError outside the workspace
    if not path.is_dir():
        raise ToolError(f"repo {repo!r} is not a directory in the workspace {workspace.root}")
    if not os.access(path, os.R_OK | os.X_OK):
        raise ToolError(f"repo {repo!r} is not readable")
    return Workspace(path, read_only=workspace.read_only)


# --- run_task's progress and result ---------------------------------------------------------------


class StepProgress:
    """The agent's events as one progress notification per step (progress = step, total = max
    steps), sent in order by one task so none overtakes another or the result."""

    def __init__(self, max_steps: int) -> None:
        self.max_steps = max_steps
        self.tool_calls = 0
        self._queue: asyncio.Queue[tuple[int, str] | None] = asyncio.Queue()
        self._calls: list[str] = []

    def on_event(self, event: AgentEvent) -> None:
        if isinstance(event, TurnEnd):
            self._calls = [call.name for call in event.turn.tool_calls]
            self.tool_calls += len(self._calls)
        elif isinstance(event, StepEnd):
            summary = f"called {', '.join(self._calls)}" if self._calls else "answered"
            self._queue.put_nowait((event.step, f"step {event.step}/{self.max_steps}: {summary}"))

    def close(self) -> None:
        self._queue.put_nowait(None)

    async def send(self, session: ServerSession) -> None:
        while (item := await self._queue.get()) is not None:
            step, message = item
            await session.report_progress(step, self.max_steps, message)


_OUTCOMES = {"answered": "answered", "max_steps": "stopped: the step limit ran out",
             "max_tokens": "stopped: the token limit ran out", "context_full": "stopped: the context is full",
             "interrupted": "interrupted"}


def _run_result(result: RunResult, tool_calls: int, transcript: Transcript | None) -> CallToolResult:
    usage = result.usage
    summary = (f"[{_OUTCOMES[result.outcome]} after {result.steps} step{'s' * (result.steps != 1)}, "
               f"{tool_calls} tool call{'s' * (tool_calls != 1)}, {usage.completion_tokens:,} tokens generated, "
               f"{result.seconds:.1f} s" + (f"; transcript: {transcript.path}" if transcript else "") + "]")
    answer = result.answer.strip() or "(the agent gave no answer)"
    return CallToolResult(content=[TextContent(type="text", text=f"{answer}\n\n{summary}")], structured_content={
        "answer": result.answer, "outcome": result.outcome, "steps": result.steps, "tool_calls": tool_calls,
        "prompt_tokens": usage.prompt_tokens, "completion_tokens": usage.completion_tokens,
        "cached_tokens": usage.cached_tokens, "seconds": round(result.seconds, 3),
        "transcript": str(transcript.path) if transcript else None})


def _instructions(workspace: Workspace | None, registry: Registry | None) -> str:
    lines = ["A local Gemma model: `complete` continues text, `chat` answers OpenAI-style messages."]
    if workspace is not None:
        lines.insert(0, f"A local coding agent working in {workspace.root}"
                        + (" (read-only)" if workspace.read_only else "")
                        + ": give it a whole task with `run_task`.")
    if registry is not None:
        lines.append(f"The workspace tools are exposed too: {', '.join(registry.names)}.")
    lines.append(f"The resource {STATUS_URI} shows the model, its speed and its cache hits.")
    return "\n".join(lines)
