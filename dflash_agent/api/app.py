"""The Litestar application: OpenAI and Anthropic routers, llama.cpp's utility endpoints, auth, and
a model that loads in the background while /health answers 503."""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from typing import Any

import msgspec
from litestar import Litestar, Request, Response, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers import BaseRouteHandler, HTTPRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.params import FromQuery, JSONBody
from litestar.plugins import InitPluginProtocol

from ..chat.chat_format import ChatOptions, LoadedModel
from ..chat.openai_messages import conversation_from_openai
from ..engine import Engine
from ..version import package_version
from .anthropic_routes import anthropic_router
from .connections import AcceptErrorLimiter
from .errors import APIError, anthropic_error, handlers, openai_error
from .lifecycle import with_lifecycle
from .metrics import CONTENT_TYPE
from .openai_routes import openai_router
from .responses_routes import responses_router
from .service import ServerSettings, ServerState, check_token_ids, host_name

log = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 64 * 1024 * 1024  # long agent contexts outgrow Litestar's 10 MB default


class TokenizeRequest(msgspec.Struct):
    content: str
    add_special: bool = False
    with_pieces: bool = False


class TokenPiece(msgspec.Struct):
    id: int
    piece: str


class TokenizeResponse(msgspec.Struct):
    tokens: list[int | TokenPiece]  # ids, or {id, piece} objects with with_pieces


class DetokenizeRequest(msgspec.Struct):
    tokens: list[int]


class DetokenizeResponse(msgspec.Struct):
    content: str


class ApplyTemplateRequest(msgspec.Struct):
    messages: list[dict[str, Any]]
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None


class ApplyTemplateResponse(msgspec.Struct):
    prompt: str


@get(["/health", "/v1/health"], opt={"public": True}, summary="200 when the model is loaded, 503 while loading")
async def health(state: State) -> Response:
    state.server.ready()
    return Response({"status": "ok"})


@get("/metrics", media_type=CONTENT_TYPE, summary="Prometheus metrics")
async def metrics(state: State) -> bytes:
    server: ServerState = state.server
    if server.model is not None:
        server.metrics.set_slots(server.model.engine.slots)
    return server.metrics.render()


class SlotView(msgspec.Struct):
    """One slot, as llama-server's GET /slots names what it shows."""

    id: int
    state: str  # idle, prefilling, decoding
    is_processing: bool
    id_task: str | None
    n_ctx: int
    n_prompt_tokens: int
    n_prompt_tokens_cache: int
    n_prompt_tokens_processed: int
    n_decoded: int
    tokens_per_second: float
    prompt_ids: list[int] | None = None


@get("/slots", summary="What each slot is doing (llama-server's /slots); prompt token ids with ?prompt=true")
async def slots(state: State, prompt: FromQuery[bool] = False) -> list[SlotView]:
    engine = state.server.ready().engine
    return [SlotView(s.id, s.state, s.state != "idle", s.request_id or None, engine.n_ctx, s.prompt_tokens,
                     s.cached_tokens, s.prefilled_tokens - s.cached_tokens, s.generated_tokens,
                     round(s.tokens_per_second, 2), list(s.prompt_ids) if prompt and s.state != "idle" else None)
            for s in engine.slots]


class GenerationSettings(msgspec.Struct):
    n_ctx: int
    params: dict[str, Any]  # what a request that sets none gets: n_predict (-1: until the context is full), sampling


class Props(msgspec.Struct):
    """llama-server's GET /props, the fields a client reads to size its requests."""

    default_generation_settings: GenerationSettings
    total_slots: int
    model_alias: str
    model_path: str
    chat_template: str
    modalities: dict[str, bool]
    build_info: str


@get("/props", summary="The context, output cap, slots and chat template (llama-server's /props)")
async def props(state: State) -> Props:
    server: ServerState = state.server
    model = server.ready()
    engine, cap = model.engine, server.settings.max_tokens
    params = {"n_predict": cap if cap is not None else -1, **engine.sampling_defaults.fields()}
    return Props(GenerationSettings(engine.n_ctx, params), engine.parallel, model.name,
                 str(engine.model_path or engine.model_name), model.chat.template.text,
                 {"vision": False, "audio": False}, f"dflash-agent {package_version()}")


# A character of /tokenize's content is at most 12 bytes of JSON (an escaped surrogate pair), a token id of
# /detokenize's list fewer; both lists are bounded by the context (ServerState.max_prompt_chars).
_BYTES_PER_UNIT = 12
_BODY_SLACK = 64 * 1024


def _body_within_context(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """Refuse a /tokenize or /detokenize body the context rules out before reading it: parsing 9M token ids
    held the event loop (and /health) for seconds."""
    server: ServerState = connection.app.state.server
    limit = server.max_prompt_chars() * _BYTES_PER_UNIT + _BODY_SLACK
    size = int(connection.headers.get("content-length") or 0)
    if size > limit:
        raise APIError(413, f"the request body is {size} bytes; {connection.url.path} takes at most {limit} with "
                       f"this context ({server.max_prompt_chars()} characters or token ids)",
                       code="request_too_large")


@post("/tokenize", status_code=200, summary="Text to token ids (llama.cpp)", guards=[_body_within_context])
async def tokenize(data: JSONBody[TokenizeRequest], state: State) -> TokenizeResponse:
    server: ServerState = state.server
    tokenizer = server.ready().engine.tokenizer
    ids = await server.encode(data.content, add_bos=data.add_special)
    if data.with_pieces:
        pieces = await asyncio.to_thread(lambda: [TokenPiece(i, tokenizer.decode([i])) for i in ids])
        return TokenizeResponse(pieces)
    return TokenizeResponse(ids)


@post("/detokenize", status_code=200, summary="Token ids to text (llama.cpp)", guards=[_body_within_context])
async def detokenize(data: JSONBody[DetokenizeRequest], state: State) -> DetokenizeResponse:
    server: ServerState = state.server
    engine = server.ready().engine
    if len(data.tokens) > (limit := server.max_prompt_chars()):
        raise APIError(400, f"tokens has {len(data.tokens)} ids; at most {limit} are accepted (the most /tokenize "
                       "can return for this context)", param="tokens")

    def decode() -> str:  # seconds for millions of ids: off the event loop, so /health answers meanwhile
        check_token_ids(data.tokens, engine.model.config.vocab_size, "tokens")
        return engine.tokenizer.decode(data.tokens)

    return DetokenizeResponse(await asyncio.to_thread(decode))


@post("/apply-template", status_code=200, summary="Render OpenAI messages with the chat template (llama.cpp)")
async def apply_template(data: JSONBody[ApplyTemplateRequest], state: State) -> ApplyTemplateResponse:
    server: ServerState = state.server
    server.ready()
    conversation = await asyncio.to_thread(conversation_from_openai, data.messages, data.tools)
    thinking = bool((data.chat_template_kwargs or {}).get("enable_thinking", False))
    options = ChatOptions(add_generation_prompt=data.add_generation_prompt, enable_thinking=thinking)
    return ApplyTemplateResponse((await server.prepare_chat(conversation, options)).prompt)


def _credentials(connection: ASGIConnection) -> str | None:
    auth = connection.headers.get("authorization", "")
    if auth.lower().startswith("bearer "):
        return auth[7:].strip()
    return connection.headers.get("x-api-key")


def _auth_guard(api_key: str) -> Callable[[ASGIConnection, BaseRouteHandler], None]:
    def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        if handler.opt.get("public"):
            return
        given = _credentials(connection)
        if given is None or not hmac.compare_digest(given.encode(), api_key.encode()):
            raise APIError(401, "invalid or missing API key: send `Authorization: Bearer KEY` or `x-api-key: KEY`",
                           code="invalid_api_key")

    return guard


def _host_guard(allowed: tuple[str, ...]) -> Callable[[ASGIConnection, BaseRouteHandler], None]:
    """421 for a Host this server does not answer to (ServerSettings.allowed_hosts): a page served from a name
    that a rebinding DNS points at 127.0.0.1 is same-origin with the server, and would read /slots' prompts and
    post to the keyless default server. In each API's error shape, as the routers' handlers give it."""

    def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        header = connection.headers.get("host")
        if header is not None and host_name(header) not in allowed:
            raise APIError(421, f"this server does not answer to the host {header!r} (serve --allowed-hosts adds "
                           "names)", code="misdirected_request")

    return guard


def _json_bodies(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """POST bodies must be declared JSON. A web page can send a text/plain or form body to 127.0.0.1 without
    asking first (a CORS "simple request"), so accepting those would let any page drive the API (CSRF);
    application/json needs a preflight, which this server does not grant."""
    if connection.scope["method"] != "POST" or not isinstance(handler, HTTPRouteHandler):
        return  # /mcp (an ASGI mount) checks Host and Origin itself
    media = connection.headers.get("content-type", "").split(";", 1)[0].strip().lower()
    if media != "application/json" and not (media.startswith("application/") and media.endswith("+json")):
        raise APIError(415, "the request body must be JSON sent with `Content-Type: application/json` "
                       f"(got {media or 'no Content-Type'})", code="unsupported_media_type")


def _not_found_or_error(request: Request, exc: Exception) -> Response:
    # Unknown paths under /v1/messages answer like Anthropic; everything else like OpenAI.
    render = anthropic_error if request.url.path.startswith("/v1/messages") else openai_error
    return render(request, exc)


def create_app(settings: ServerSettings, load: Callable[[], Engine], max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
               plugins: Callable[[ServerState], Sequence[InitPluginProtocol]] = lambda server: (),
               on_load_error: Callable[[Exception], None] | None = None,
               on_ready: Callable[[LoadedModel], None] | None = None) -> Litestar:
    """`load` builds the engine; it runs in a thread after startup, so /health answers 503 meanwhile.
    `plugins(server)` adds routes and lifespans that serve the same model (`serve` mounts MCP at /mcp).
    `on_load_error` hears why a load failed (serve exits); `on_ready`, the model once requests can use it."""
    server = ServerState(settings)

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        server.loop = loop = asyncio.get_running_loop()
        previous = loop.get_exception_handler()
        loop.set_exception_handler(AcceptErrorLimiter(previous))
        task = asyncio.create_task(_load(server, load, on_load_error, on_ready))
        try:
            yield
        finally:
            loop.set_exception_handler(previous)
            task.cancel()
            if server.model is not None and not await asyncio.to_thread(server.model.engine.close, 1.0):
                # the step in flight ends first (Engine.close): a prompt chunk on a slow CPU takes seconds
                log.warning("waiting for the model to finish its current step")
                await asyncio.to_thread(server.model.engine.close)

    guards = [_host_guard(settings.allowed_hosts)] if settings.allowed_hosts is not None else []
    guards += [_auth_guard(settings.api_key)] if settings.api_key else []
    app = Litestar(
        route_handlers=[openai_router(), responses_router(), anthropic_router(), health, metrics, slots, props,
                        tokenize, detokenize, apply_template],
        state=State({"server": server}),
        lifespan=[lifespan],
        guards=[*guards, _json_bodies],
        exception_handlers=handlers(_not_found_or_error),
        request_max_body_size=max_body_bytes,
        openapi_config=OpenAPIConfig(title="dflash-agent", version="0.1.0", path="/schema"),
        logging_config=None,
        plugins=list(plugins(server)),
    )
    # Around everything, 404s included: the access log, and cancelling a request whose client left.
    app.asgi_handler = with_lifecycle(app.asgi_handler)
    return app


async def _load(server: ServerState, load: Callable[[], Engine], on_load_error: Callable[[Exception], None] | None,
                on_ready: Callable[[LoadedModel], None] | None) -> None:
    try:
        engine = await asyncio.to_thread(load)
        await asyncio.to_thread(server.attach, engine)
        log.info("model ready: %s", server.model.name if server.model else "?")
        if on_ready is not None and server.model is not None:
            on_ready(server.model)
    except Exception as exc:
        log.debug("the model failed to load", exc_info=True)
        server.load_error = str(exc)
        if on_load_error is not None:
            on_load_error(exc)
