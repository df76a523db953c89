"""Image parts read and decoded within limits (mlxcel.http.media): data URIs, http(s) from a
real server on loopback, local files under the media directory, and every limit a 400 naming
the part."""

from __future__ import annotations

import base64
import io
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import trio
from PIL import Image

from mlxcel.http.media import ImageLimits, decode_image, load_images, read_image_bytes
from mlxcel.runtime.errors import InvalidRequest


def png(width: int, height: int, color: tuple[int, int, int] = (200, 30, 30)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", (width, height), color).save(out, format="PNG")
    return out.getvalue()


def data_uri(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


class Site:
    """A real HTTP server on loopback: /img.png, /missing (404), /slow (answers after 5 s),
    /endless (streams bytes without end); counts the requests it gets."""

    def __init__(self) -> None:
        site = self
        self.hits = 0
        self.image = png(8, 6)

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                site.hits += 1
                if self.path == "/img.png":
                    self.send_response(200)
                    self.send_header("Content-Length", str(len(site.image)))
                    self.end_headers()
                    self.wfile.write(site.image)
                elif self.path == "/slow":
                    time.sleep(5)
                    self.send_response(200)
                    self.end_headers()
                elif self.path == "/endless":
                    self.send_response(200)
                    self.end_headers()
                    try:
                        while True:
                            self.wfile.write(b"\0" * 65536)
                    except OSError:
                        pass  # the client went away, as it should
                else:
                    self.send_response(404)
                    self.end_headers()

            def log_message(self, *args: object) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.base = f"http://127.0.0.1:{self.server.server_address[1]}"


@pytest.fixture(scope="module")
def site() -> Iterator[Site]:
    s = Site()
    yield s
    s.server.shutdown()
    s.server.server_close()  # the listening socket, else the GC warns in a later test


async def test_a_data_uri_image_decodes_to_rgb() -> None:
    (image,) = await load_images([("m[0]", data_uri(png(12, 7)))], ImageLimits())
    assert image.size == (12, 7) and image.mode == "RGB"
    assert image.getpixel((0, 0)) == (200, 30, 30)


@pytest.mark.parametrize(
    ("url", "match"),
    [
        ("data:image/png;base64,@@@not-base64", "base64 is invalid"),
        ("data:image/png,rawbytes", "must be base64"),
        ("data:image/png;base64," + base64.b64encode(b"hello").decode(), "not an image"),
        ("ftp://example.com/a.png", "unsupported image URL scheme 'ftp'"),
        ("", "missing or empty"),
    ],
)
async def test_bad_parts_are_400s_naming_the_part(url: str, match: str) -> None:
    with pytest.raises(InvalidRequest, match=match) as caught:
        await load_images([("messages[1].content[2]", url)], ImageLimits())
    assert caught.value.param == "messages[1].content[2]"
    assert str(caught.value).startswith("messages[1].content[2]: ")


async def test_a_truncated_image_is_a_400() -> None:
    data = png(64, 64)
    with pytest.raises(InvalidRequest, match="truncated or corrupt|not an image"):
        await load_images([("p", data_uri(data[: len(data) // 2]))], ImageLimits())


async def test_too_many_images_are_refused_before_any_is_read(site: Site) -> None:
    before = site.hits
    parts = [(f"content[{i}]", f"{site.base}/img.png") for i in range(3)]
    with pytest.raises(InvalidRequest, match=r"too many images: at most 2") as caught:
        await load_images(parts, ImageLimits(max_images=2))
    assert caught.value.param == "content[2]"
    assert site.hits == before  # nothing fetched


async def test_payload_limit_applies_to_data_uris_before_decoding() -> None:
    data = png(64, 64)
    with pytest.raises(InvalidRequest, match="larger than the allowed 100 bytes"):
        await read_image_bytes(data_uri(data), "p", ImageLimits(max_payload=100))


async def test_http_image_is_fetched(site: Site) -> None:
    (image,) = await load_images([("p", f"{site.base}/img.png")], ImageLimits())
    assert image.size == (8, 6)


async def test_http_errors_are_400s(site: Site) -> None:
    with pytest.raises(InvalidRequest, match="HTTP 404"):
        await read_image_bytes(f"{site.base}/missing", "p", ImageLimits())
    with pytest.raises(InvalidRequest, match="could not fetch"):
        await read_image_bytes("http://127.0.0.1:9/x.png", "p", ImageLimits())


async def test_a_slow_url_is_refused_within_the_time_limit(site: Site) -> None:
    start = trio.current_time()
    with pytest.raises(InvalidRequest, match=r"no complete answer within 0.5 s"):
        await read_image_bytes(f"{site.base}/slow", "p", ImageLimits(fetch_timeout=0.5))
    assert trio.current_time() - start < 2.0


async def test_an_endless_url_is_cut_at_the_payload_limit(site: Site) -> None:
    with pytest.raises(InvalidRequest, match="larger than the allowed 1048576 bytes"):
        await read_image_bytes(f"{site.base}/endless", "p", ImageLimits(max_payload=2**20))
    # Also with a declared length above the limit: refused before the body.
    with pytest.raises(InvalidRequest, match="larger than the allowed 10 bytes"):
        await read_image_bytes(f"{site.base}/img.png", "p", ImageLimits(max_payload=10))


async def test_local_files_only_under_the_media_path(tmp_path: Path) -> None:
    media = tmp_path / "media"
    media.mkdir()
    (media / "a.png").write_bytes(png(5, 4))
    outside = tmp_path / "secret.png"
    outside.write_bytes(png(3, 3))
    (media / "link.png").symlink_to(outside)
    limits = ImageLimits(media_path=media)

    for url in ("a.png", str(media / "a.png"), f"file://{media / 'a.png'}"):
        (image,) = await load_images([("p", url)], limits)
        assert image.size == (5, 4)
    for url in (str(outside), "../secret.png", "link.png", f"file://{outside}"):
        with pytest.raises(InvalidRequest, match="outside the server's media directory"):
            await read_image_bytes(url, "p", limits)
    with pytest.raises(InvalidRequest, match="no image file"):
        await read_image_bytes("nope.png", "p", limits)
    with pytest.raises(InvalidRequest, match=r"local image files are not enabled.*--media-path"):
        await read_image_bytes(str(media / "a.png"), "p", ImageLimits())


def test_dimension_limits_are_checked_from_the_header() -> None:
    with pytest.raises(InvalidRequest, match=r"100x20 pixels, larger than the allowed 64x64"):
        decode_image(png(100, 20), "p", ImageLimits(max_width=64, max_height=64))


def test_a_decompression_bomb_is_refused_before_decoding() -> None:
    # 4,000 x 4,000 of one colour: ~50 KB as PNG, 64 MB decoded.
    bomb = png(4000, 4000, (0, 0, 0))
    assert len(bomb) < 200_000
    with pytest.raises(InvalidRequest, match=r"64000000 bytes decoded .* more than the allowed"):
        decode_image(bomb, "p", ImageLimits(max_decode_alloc=16 * 2**20))
