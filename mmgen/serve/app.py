"""The routes of `mmgen serve` (FastAPI): the OpenAI Videos and Images shapes, models, health, metrics.

Thin by design: each route checks its input through the request value (protocol.py), writes or
reads a job row (service.py) and answers. No route waits on GPU work, except POST
/v1/images/generations and /v1/images/edits, which the Images API answers when done: they await the
jobs' rows without holding a thread. With an API key every route but /health and the static page at
/ needs `Authorization: Bearer KEY` (the scheme in any case, RFC 7235; the key compared in constant
time; a browser cannot send it when opening the page; the page asks for the key and sends it with
each of its requests).

Until the model has loaded every route but /health, the static page and /metrics answers 503 with
Retry-After (GET /v1/models too, so a client polling it for readiness then finds POST working); a
POST that creates jobs is first judged without the model, so a bad size is a 400 even then. While a
`--gpus N` server's group restarts after a fault (mmgen.serve.cli), GETs of /v1/videos answer too.

Bodies are bounded before they are read: Content-Length at most ServeSettings.max_body_bytes (a
multipart form's files), a JSON body at most max_json_bytes, nested at most protocol.MAX_JSON_DEPTH,
no key given twice (as a form refuses a repeated field); what a job stores of its request is thus
bounded too, and so is every GET that shows it.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import hmac
import time
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.concurrency import run_in_threadpool
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, Response
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException as StarletteHTTPException

from mmgen.serve.protocol import (
    UPLOADS,
    ApiError,
    ImageData,
    ImagesResponse,
    ModelCard,
    ModelList,
    UploadField,
    VideoDeleted,
    VideoPage,
    bad_request,
    coerce_form,
    parse_json,
)
from mmgen.serve.queue import valid_job_id
from mmgen.serve.service import FINISHED, ServeSettings, Service

PAGE = Path(__file__).with_name("page.html")
# No key needed: the health probe, and the static page (it holds no data; its requests send the key).
OPEN_PATHS = frozenset({"/health", "/"})
# Answered while the model loads: the probe, the static page (it shows what /health says) and the
# metrics (a loading server is scraped too). The routes that create jobs answer for themselves.
LOADING_PATHS = frozenset({"/health", "/", "/metrics"})
CREATE_PATHS = frozenset({"/v1/videos", "/v1/images/generations", "/v1/images/edits"})
FORM_TYPES = ("multipart/form-data", "application/x-www-form-urlencoded")
MAX_PAGE = 100
IMAGE_POLL_S = 0.1


def create_app(service: Service) -> FastAPI:
    """The FastAPI app over `service` (started and stopped with the app's lifespan)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        service.start()
        try:
            yield
        finally:
            service.stop()

    app = FastAPI(title="mmgen serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    settings = service.settings
    key = None if settings.api_key is None else settings.api_key.encode()

    @app.middleware("http")
    async def guard(request: Request, call_next: Any) -> Response:
        path = request.url.path
        if key is not None and path not in OPEN_PATHS:
            if not _authorized(request.headers.get("authorization", ""), key):
                error = ApiError(401, "missing or wrong API key (Authorization: Bearer KEY)")
                return JSONResponse(error.body(), 401, headers={"WWW-Authenticate": "Bearer"})
        creates = request.method == "POST" and path in CREATE_PATHS
        # While a restarted group loads, the job rows stay readable: the one its fault failed included.
        reads = request.method == "GET" and service.restarting is not None and path.startswith("/v1/videos")
        refusal = None if path in LOADING_PATHS or creates or reads else service.unavailable()
        if refusal is not None:
            return _error(refusal)
        if request.method in ("POST", "PUT", "PATCH"):
            length = request.headers.get("content-length")
            if length is None or not length.isdigit():
                return _error(ApiError(411, "a request body needs a Content-Length"))
            if int(length) > settings.max_body_bytes:
                return _error(
                    ApiError(
                        413,
                        f"the request body is {length} bytes; this server takes at most "
                        f"{settings.max_body_bytes} (and at most {settings.max_upload_bytes} per uploaded file)",
                    )
                )
        return await call_next(request)

    @app.exception_handler(ApiError)
    async def api_error(request: Request, err: ApiError) -> JSONResponse:
        return _error(err)

    @app.exception_handler(RequestValidationError)
    async def query_error(request: Request, err: RequestValidationError) -> JSONResponse:
        first = err.errors()[0] if err.errors() else {}
        param = str(first.get("loc", ["", ""])[-1])
        return _error(bad_request(f"{param}: {first.get('msg', 'invalid')}", param))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, err: StarletteHTTPException) -> JSONResponse:
        return _error(ApiError(err.status_code, str(err.detail)))

    @app.exception_handler(Exception)
    async def server_error(request: Request, err: Exception) -> JSONResponse:
        return _error(ApiError(500, f"internal error ({type(err).__name__})"))

    @app.get("/", include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(PAGE.read_text() if PAGE.is_file() else "<p>mmgen serve</p>")

    @app.get("/health")
    def health() -> JSONResponse:
        worker = service.worker
        if worker.ready:
            # "outputs" tells a client (the page at /) which route makes this model's work.
            outputs = "video" if service.makes_video else "image"
            body = {
                "status": "ok",
                "model": service.model,
                "outputs": outputs,
                "uploads": service.upload_fields,
                "capabilities": service.capabilities.to_json(),
            }
            return JSONResponse(body)
        if worker.alive and service.restarting is not None:  # the launcher restarted the group: why
            return JSONResponse({"status": "restarting", "reason": service.restarting}, 503)
        state = "loading" if worker.alive else f"worker down: {worker.load_error or 'stopped'}"
        return JSONResponse({"status": state}, 503)

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(service.metrics.exposition(), media_type=service.metrics.content_type)

    @app.get("/v1/models")
    def models() -> ModelList:
        capabilities = None if service.capabilities is None else service.capabilities.to_json()
        return ModelList(
            data=[ModelCard(id=service.model, created=service.started_at, capabilities=capabilities)]
        )

    @app.post("/v1/videos")
    async def create_video(request: Request) -> JSONResponse:
        body, uploads = await _read_body(request, settings, UPLOADS)
        job = await run_in_threadpool(service.submit_video, body, uploads)
        return JSONResponse(service.video_view(job).model_dump(exclude_none=True))

    @app.get("/v1/videos")
    def list_videos(after: str | None = None, limit: int = 20, order: str = "desc") -> VideoPage:
        if not 1 <= limit <= MAX_PAGE:
            raise bad_request(f"limit = {limit}: must be in [1, {MAX_PAGE}]", "limit")
        if order not in ("asc", "desc"):
            raise bad_request(f"order = {order!r}: allowed values are asc, desc", "order")
        if after is not None and not valid_job_id(after, "video"):
            raise bad_request(f"after = {after!r}: not a video id", "after")
        jobs, more = service.store.page("video", after=after, limit=limit, order=order)
        data = [service.video_view(job, record=False) for job in jobs]
        return VideoPage(
            data=data,
            first_id=data[0].id if data else None,
            last_id=data[-1].id if data else None,
            has_more=more,
        )

    @app.get("/v1/videos/{video_id}")
    def get_video(video_id: str) -> JSONResponse:
        return JSONResponse(service.video_view(service.job(video_id, "video")).model_dump(exclude_none=True))

    @app.get("/v1/videos/{video_id}/content")
    def video_content(video_id: str, variant: str = "video") -> FileResponse:
        if variant != "video":
            raise bad_request(f"variant = {variant!r}: this server makes only 'video'", "variant")
        path = service.output(video_id, "video")
        return FileResponse(path, media_type="video/mp4", filename=f"{video_id}.mp4")

    @app.delete("/v1/videos/{video_id}")
    def delete_video(video_id: str) -> VideoDeleted:
        # A finished job is deleted (deleted: true); an unfinished one is cancelled and kept, to be
        # deleted by a DELETE once it has ended (deleted: false; GET shows it cancelled).
        return VideoDeleted(id=video_id, deleted=service.delete(video_id))

    @app.post("/v1/images/generations")
    async def create_images(request: Request) -> JSONResponse:
        body, _ = await _read_body(request, settings, {})
        jobs = await run_in_threadpool(service.submit_images, body)
        return await _images_answer(service, jobs, request)

    @app.post("/v1/images/edits")
    async def edit_images(request: Request) -> JSONResponse:
        body, uploads = await _read_body(request, settings, service.edit_uploads)
        jobs = await run_in_threadpool(service.submit_edits, body, uploads)
        return await _images_answer(service, jobs, request)

    @app.get("/v1/images/{image_id}/content")
    def image_content(image_id: str) -> FileResponse:
        return FileResponse(service.output(image_id, "image"), media_type="image/png")

    return app


def _authorized(header: str, key: bytes) -> bool:
    """`Authorization: Bearer KEY`, the scheme in any case (RFC 7235), the key compared in constant time."""
    scheme, _, token = header.strip().partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(token.strip().encode(), key)


def _error(err: ApiError) -> JSONResponse:
    headers = {"Retry-After": "5"} if err.status in (429, 503) else None
    return JSONResponse(err.body(), err.status, headers=headers)


async def _read_body(
    request: Request, settings: ServeSettings, rules: Mapping[str, UploadField]
) -> tuple[dict[str, Any], dict[str, list[bytes]]]:
    """The body's fields (JSON, or a form coerced by the request's annotations) and its uploaded files
    per form field, those `rules` names (the route's: protocol.UPLOADS for /v1/videos, edit_uploads
    for /v1/images/edits, none for /v1/images/generations). A file field named OpenAI's way for a
    list (`image[]`) is read as its plain name."""
    kind = request.headers.get("content-type", "").split(";")[0].strip().lower()
    max_upload = settings.max_upload_bytes
    if kind not in FORM_TYPES:
        length = int(request.headers.get("content-length", "0"))  # the middleware checked it
        if length > settings.max_json_bytes:
            await _drain(request)
            raise ApiError(
                413,
                f"a JSON body of {length} bytes; this server takes at most {settings.max_json_bytes} "
                "(a prompt and settings are far less; files go in a multipart form)",
            )
        body = parse_json(await request.body() or b"null", None)
        if not isinstance(body, dict):
            raise bad_request("the body must be a JSON object", None)
        return body, {}
    # One file more than the route takes, so that a file too many is refused naming its field.
    most = sum(rule.most for rule in rules.values()) + 1
    try:  # a text field is bounded as a JSON body is
        form = await request.form(max_files=most, max_fields=200, max_part_size=settings.max_json_bytes)
    except StarletteHTTPException as err:  # the form parser's refusal: a part too large, a bad form
        await _drain(request)
        status = 413 if "maximum size" in str(err.detail) else 400
        raise ApiError(status, f"the multipart form: {err.detail}") from None
    texts: dict[str, list[str]] = {}
    uploads: dict[str, list[bytes]] = {}
    for name, value in form.multi_items():
        if not isinstance(value, UploadFile):
            texts.setdefault(name, []).append(value)
            continue
        name = name.removesuffix("[]")
        if not rules:
            raise bad_request(f"{name}: this route takes no files", name)
        if name not in rules:
            raise bad_request(f"{name}: a file is allowed only as {', '.join(rules)}", name)
        if len(uploads.get(name, ())) >= rules[name].most:
            raise bad_request(f"{name}: at most {rules[name].most} file(s)", name)
        data = await value.read(max_upload + 1)
        if len(data) > max_upload:
            raise ApiError(413, f"{name}: larger than {max_upload} bytes", param=name)
        uploads.setdefault(name, []).append(data)
    return coerce_form(texts), uploads


async def _drain(request: Request) -> None:
    """Read and drop the rest of a refused body (at most max_body_bytes, the middleware's bound), so a
    client still sending it gets the answer rather than a reset connection."""
    while True:
        message = await request.receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


async def _images_answer(service: Service, jobs: list[Any], request: Request) -> JSONResponse:
    """The Images API's answer once every one of `jobs` is finished: each PNG as b64_json or url."""
    done = await _wait_for(service, [job.id for job in jobs], request)
    data = []
    for job in done:
        if job.status != "completed":
            error = job.error or {"code": "cancelled", "message": "cancelled"}
            status = 400 if error["code"] == "invalid_request" else 500
            raise ApiError(status, f"image job {job.id} {job.status}: {error['message']}")
        if jobs[0].options["response_format"] == "url":
            data.append(ImageData(url=f"{request.base_url}v1/images/{job.id}/content"))
        else:
            data.append(ImageData(b64_json=base64.b64encode(Path(job.output).read_bytes()).decode()))
    return JSONResponse(ImagesResponse(created=int(time.time()), data=data).model_dump(exclude_none=True))


async def _wait_for(service: Service, ids: list[str], request: Request) -> list[Any]:
    """The jobs `ids` once each is finished; a client that goes away cancels those still unfinished."""
    deadline = time.monotonic() + service.settings.image_wait_s
    while True:
        jobs = [service.store.get(job_id) for job_id in ids]
        if all(job is not None and job.status in FINISHED for job in jobs):
            return jobs
        if time.monotonic() > deadline or await request.is_disconnected():
            for job_id in ids:
                service.cancel(job_id)
            raise ApiError(504, "the image jobs did not finish in time; they were cancelled")
        await asyncio.sleep(IMAGE_POLL_S)
