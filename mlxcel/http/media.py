"""Images a request carries, read and decoded within the operator's limits (issue 24).

An image part names its bytes by a data URI (base64), an http(s) URL, a ``file://`` URI or a
bare path. Every way an image can be too much is a 400 naming the part (the caller's
``where``, e.g. ``messages[1].content[0]``), and none leaves anything behind:

- more than ``max_images`` parts: refused before any of them is read;
- more than ``max_payload`` bytes (base64-decoded, downloaded or on disk): refused while
  reading, so a huge or endless URL is never held whole;
- a URL that has not delivered within ``fetch_timeout`` seconds: refused then;
- local files only under ``media_path`` (symlinks resolved first, so a link cannot lead out);
  without one, local files are refused;
- bytes that Pillow cannot decode as an image;
- wider or taller than ``max_width`` / ``max_height``, or decoding to more than
  ``max_decode_alloc`` bytes: refused from the image's header, before its pixels are decoded
  (a decompression bomb is a small file that decodes to gigabytes).

Checking that the loaded model takes images at all is the caller's job, done before this
module reads anything (the contract's media guard). Decoding runs on a worker thread.
"""

from __future__ import annotations

import binascii
import contextlib
import io
import math
import warnings
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import unquote, urlparse

import attrs
import trio

from mlxcel.runtime.errors import InvalidRequest
from mlxcel.runtime.messages import GenerationRequest, ImageRef
from mlxcel.runtime.settings import Settings

if TYPE_CHECKING:
    import httpx
    from PIL import Image

__all__ = [
    "ImageLimits",
    "body_limit",
    "decode_image",
    "limits_of",
    "load_images",
    "read_image_bytes",
    "resolve",
]

MIB = 1024 * 1024
# Bytes a decoded pixel may take (RGBA): what the decode-allocation budget is counted in.
_PIXEL_BYTES = 4
_CHUNK = 64 * 1024


@attrs.frozen
class ImageLimits:
    """The operator's limits (``--max-images``, ``--max-image-payload-size``,
    ``--max-image-width/height``, ``--max-image-decode-alloc-bytes``, ``--media-path``);
    the defaults are the original server's."""

    max_images: int = 16
    max_payload: int = 64 * MIB
    max_width: int = 16_384
    max_height: int = 16_384
    max_decode_alloc: int = 512 * MIB
    # Seconds for one URL, from the request to its last byte.
    fetch_timeout: float = 10.0
    media_path: Path | None = None


def limits_of(settings: Settings) -> ImageLimits:
    return ImageLimits(
        max_images=settings.max_images,
        max_payload=settings.max_image_payload,
        max_width=settings.max_image_width,
        max_height=settings.max_image_height,
        max_decode_alloc=settings.max_image_decode_alloc,
        media_path=settings.media_path,
    )


# The body limit with images: what the image budget takes in base64, plus some bytes per part
# and of text, within 2 GiB (the contract's rule).
_PER_IMAGE = 512
_OVERHEAD = MIB
_MOST = 2 * 1024 * MIB


def body_limit(settings: Settings, *, vision: bool) -> int:
    """The largest JSON body accepted: ``--max-request-bytes``, grown to fit the image budget
    when the model takes images."""
    if not vision:
        return settings.max_request_bytes
    base64 = math.ceil(settings.max_image_payload / 3) * 4
    budget = (base64 + _PER_IMAGE) * settings.max_images + _OVERHEAD
    return max(settings.max_request_bytes, min(budget, _MOST))


async def resolve(request: GenerationRequest, settings: Settings) -> GenerationRequest:
    """The request with its image references read and decoded (a 400 naming the part when
    one is too much or not an image)."""
    refs = [r for r in request.images if isinstance(r, ImageRef)]
    if not refs:
        return request
    parts = [(r.where, r.url) for r in refs]
    images = await load_images(parts, limits_of(settings))
    return attrs.evolve(request, images=tuple(images))


async def load_images(
    parts: Sequence[tuple[str, str]],
    limits: ImageLimits,
    *,
    client: httpx.AsyncClient | None = None,
) -> list[Image.Image]:
    """Read and decode ``parts`` (``(where, url)`` pairs) in order, as RGB images."""
    if len(parts) > limits.max_images:
        where = parts[limits.max_images][0]
        raise InvalidRequest(
            f"{where}: too many images: at most {limits.max_images} per request (--max-images)",
            param=where,
        )
    images = []
    for where, url in parts:
        data = await read_image_bytes(url, where, limits, client=client)
        images.append(await trio.to_thread.run_sync(decode_image, data, where, limits))
    return images


async def read_image_bytes(
    url: str, where: str, limits: ImageLimits, *, client: httpx.AsyncClient | None = None
) -> bytes:
    """The encoded bytes ``url`` names, at most ``limits.max_payload`` of them."""
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}: the image URL is missing or empty", param=where)
    scheme = urlparse(url).scheme.lower()
    if scheme == "data":
        return _data_uri(url, where, limits)
    if scheme in ("http", "https"):
        return await _fetch(url, where, limits, client)
    if scheme == "file":
        return await _local(Path(unquote(urlparse(url).path)), where, limits)
    if scheme and len(scheme) > 1:  # (one letter is a Windows drive, not a scheme)
        raise InvalidRequest(
            f"{where}: unsupported image URL scheme {scheme!r}: use a data URI, http(s), "
            "file:// or a path",
            param=where,
        )
    return await _local(Path(url), where, limits)


def decode_image(data: bytes, where: str, limits: ImageLimits) -> Image.Image:
    """Decode ``data`` to an RGB image, checking its size from the header first. Blocking."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise InvalidRequest(
            f"{where}: the data is not an image this server can decode", param=where
        ) from None
    width, height = image.size
    if width > limits.max_width or height > limits.max_height:
        raise InvalidRequest(
            f"{where}: image is {width}x{height} pixels, larger than the allowed "
            f"{limits.max_width}x{limits.max_height} (--max-image-width/--max-image-height)",
            param=where,
        )
    need = width * height * _PIXEL_BYTES
    if need > limits.max_decode_alloc:
        raise InvalidRequest(
            f"{where}: image would take {need} bytes decoded ({width}x{height}), more than "
            f"the allowed {limits.max_decode_alloc} (--max-image-decode-alloc-bytes)",
            param=where,
        )
    try:
        with warnings.catch_warnings():
            # Our own budget above is the limit; Pillow's pixel-count warning adds nothing.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image.load()
        return image.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError, SyntaxError):
        raise InvalidRequest(
            f"{where}: the image data is truncated or corrupt", param=where
        ) from None


def _too_big(where: str, limits: ImageLimits) -> InvalidRequest:
    return InvalidRequest(
        f"{where}: image payload is larger than the allowed {limits.max_payload} bytes "
        "(--max-image-payload-size)",
        param=where,
    )


def _data_uri(url: str, where: str, limits: ImageLimits) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma or not header.lower().endswith(";base64"):
        raise InvalidRequest(
            f"{where}: a data URI image must be base64 (data:image/...;base64,...)", param=where
        )
    # The decoded size is known from the text's length: refuse before decoding any of it.
    if math.floor(len(payload) * 3 / 4) - payload.count("=") > limits.max_payload:
        raise _too_big(where, limits)
    try:
        return binascii.a2b_base64(payload, strict_mode=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(f"{where}: the data URI's base64 is invalid", param=where) from None


async def _fetch(
    url: str, where: str, limits: ImageLimits, client: httpx.AsyncClient | None
) -> bytes:
    import httpx

    failed = f"{where}: could not fetch the image from {url}"
    with trio.move_on_after(limits.fetch_timeout) as scope:
        try:
            async with (
                _http(client) as http,
                http.stream("GET", url, follow_redirects=True) as response,
            ):
                if response.status_code != 200:
                    raise InvalidRequest(f"{failed}: HTTP {response.status_code}", param=where)
                declared = response.headers.get("content-length")
                if (
                    declared is not None
                    and declared.isdigit()
                    and int(declared) > limits.max_payload
                ):
                    raise _too_big(where, limits)
                body = bytearray()
                # Past the limit, cancel rather than leave the loop: the cancellation lands in
                # httpcore's own read, which closes the connection on its way out (leaving the
                # loop would strand its body generator and socket for the GC).
                with trio.CancelScope() as cut:
                    async for chunk in response.aiter_bytes(_CHUNK):
                        body += chunk
                        if len(body) > limits.max_payload:
                            cut.cancel()
                if cut.cancelled_caught:
                    raise _too_big(where, limits)
                return bytes(body)
        except httpx.HTTPError as exc:
            raise InvalidRequest(f"{failed}: {type(exc).__name__}", param=where) from None
    assert scope.cancelled_caught
    raise InvalidRequest(
        f"{failed}: no complete answer within {limits.fetch_timeout:g} s", param=where
    )


@contextlib.asynccontextmanager
async def _http(given: httpx.AsyncClient | None) -> AsyncIterator[httpx.AsyncClient]:
    """The caller's client as is, or a fresh one closed afterwards."""
    if given is not None:
        yield given
        return
    import httpx

    async with httpx.AsyncClient(trust_env=False) as own:
        yield own


async def _local(path: Path, where: str, limits: ImageLimits) -> bytes:
    if limits.media_path is None:
        raise InvalidRequest(
            f"{where}: local image files are not enabled on this server (--media-path)",
            param=where,
        )
    root = limits.media_path.resolve()
    full = (root / path).resolve()  # an absolute path stays itself; links are followed
    if not full.is_relative_to(root):
        raise InvalidRequest(
            f"{where}: image path is outside the server's media directory", param=where
        )

    def read() -> bytes:
        try:
            if full.stat().st_size > limits.max_payload:
                raise _too_big(where, limits)
            with full.open("rb") as f:
                return f.read(limits.max_payload + 1)
        except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
            raise InvalidRequest(f"{where}: no image file at {path}", param=where) from None
        except PermissionError:
            raise InvalidRequest(f"{where}: the image file cannot be read", param=where) from None

    data = await trio.to_thread.run_sync(read)
    if len(data) > limits.max_payload:  # it grew after the size check
        raise _too_big(where, limits)
    return data
