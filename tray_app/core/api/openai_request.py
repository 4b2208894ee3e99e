"""What OpenAI clients send, turned into what a llama.cpp worker can run.

Pure functions over the request body: no I/O, no service state. The service
calls them after its field checks and before it counts the prompt, so the
worker, the token counter and admission all see the same request.
"""

from __future__ import annotations

import base64
import binascii
import zlib
from dataclasses import dataclass, field
from typing import Any

from llama_cpp.llama_grammar import JSON_GBNF

from ..dispatch.jobs import ANY_TOOL
from . import grammar_bounds


class InvalidRequest(Exception):
    """A request the client must change; answered in the OpenAI error envelope."""

    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.code, self.param = status, message, code, param


IMAGE_PART_TYPES = frozenset({"image_url", "input_image", "image"})
TEXT_PART_TYPES = frozenset({"text", "input_text", "refusal"})

# One image, decoded. Phone photos are 2-8 MB; the bound keeps a hostile
# part from costing more than the request body limit already allows.
MAX_IMAGE_BYTES = 20 * 1024 * 1024
# What a request's images may be once decoded, all of them together: a
# 243 KB PNG of 16000x16000 decodes to 1 GiB in the worker. Read from each
# image's header here, without decoding it; 50 megapixels is a 50 MP photo,
# or four 12 MP ones. The worker decodes each to 3 bytes a pixel and the
# projector resizes it; admission counts DECODED_BYTES_PER_PIXEL.
MAX_IMAGE_PIXELS = 50_000_000
DECODED_BYTES_PER_PIXEL = 4
# What llama.cpp's image loader (stb_image) reads, by their first bytes.
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
IMAGE_SIGNATURES = {
    PNG_SIGNATURE: "image/png",
    b"\xff\xd8\xff": "image/jpeg",
    b"GIF87a": "image/gif",
    b"GIF89a": "image/gif",
    b"BM": "image/bmp",
}


@dataclass(frozen=True)
class Vision:
    """What the model a request names can do with images, for flatten_content."""

    model: str                        # its name, for messages
    sees: bool = False                # it has a projector
    seeing_models: tuple[str, ...] = ()  # the library's models that do, for a refusal that names one
    # [server] allow_remote_images: an http(s) image URL stays in the body
    # for the service to fetch (remote_images.py); off, it is a 400.
    remote_images: bool = False


# Where an image part came from in the client's own request (Ollama's
# messages[0].images[1], Anthropic's messages.0.content.1, Responses'
# input[0].content[1]): set by a protocol's translation so that a refusal
# during validation names the part as its client numbers it. flatten_content
# rebuilds every part without it, so it never reaches a worker.
PART_NAME = "_client_part"


@dataclass(frozen=True)
class RemoteImage:
    """An http(s) image URL left in a checked body for the service to fetch."""

    message: int   # the index of its message in the OpenAI body
    part: int      # the index of its part in that message's content
    where: str     # the part's name in the client's request, for a 400
    url: str


@dataclass
class ImageParts:
    """What flatten_content found: the images, their pixels once decoded
    (inline ones; a remote one's are counted when it is fetched), and those
    still to fetch."""

    count: int = 0
    remote: list[RemoteImage] = field(default_factory=list)
    pixels: int = 0


def flatten_content(messages: list[dict[str, Any]], vision: Vision) -> ImageParts:
    """Every message's content as one string, in place; a message with images
    as a list of text and image_url parts, each image checked and rewritten as
    a base64 data: URI (a remote one, where allowed, left for the service to
    fetch). Returns the images found.

    The OpenAI chat API allows a string, a list of typed parts, or null (an
    assistant turn that only called tools). Chat templates and the worker
    take a string, so text parts are joined with newlines, the way
    llama.cpp's server joins them for templates without typed content.
    llama-server takes images as image_url parts and puts its media marker
    where each was, so those messages keep their parts.
    """
    found = ImageParts()
    for index, message in enumerate(messages):
        content = message.get("content")
        if content is None:
            message["content"] = ""
        elif isinstance(content, list):
            parts = [_part(index, number, part, vision) for number, part in enumerate(content)]
            for number, part in enumerate(parts):
                if part["type"] != "image_url":
                    continue
                found.count += 1
                url = part["image_url"]["url"]
                where = _client_name(content[number], index, number)
                if is_remote(url):
                    found.remote.append(RemoteImage(index, number, where, url))
                    continue
                found.pixels = add_image_pixels(found.pixels, data_uri_pixels(url), where)
            message["content"] = assemble_content(parts)
    return found


def image_part(url: str, where: str | None = None) -> dict[str, Any]:
    """An OpenAI image part, as llama-server takes it; `where` is the part's
    name in a translated client's request (PART_NAME)."""
    part: dict[str, Any] = {"type": "image_url", "image_url": {"url": url}}
    if where is not None:
        part[PART_NAME] = where
    return part


def is_remote(url: str) -> bool:
    return url.startswith(("http://", "https://"))


def assemble_content(parts: list[dict[str, Any]]) -> str | list[dict[str, Any]]:
    """Text and image parts, in order, as one message's content: the text
    joined with newlines when there is no image, else the parts."""
    if any(part["type"] == "image_url" for part in parts):
        return parts
    return "\n".join(part["text"] for part in parts)


def image_parts(messages: list[dict[str, Any]]) -> int:
    """How many image parts the (flattened) messages hold."""
    return sum(1 for message in messages if isinstance(message.get("content"), list)
               for part in message["content"] if part.get("type") == "image_url")


def text_only(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The messages with each image part left out, for what counts text tokens."""
    return [{**message, "content": "\n".join(part["text"] for part in message["content"] if part["type"] == "text")}
            if isinstance(message.get("content"), list) else message for message in messages]


def _client_name(part: Any, index: int, number: int) -> str:
    """The part's name as its client numbers it (PART_NAME), else OpenAI's."""
    named = part.get(PART_NAME) if isinstance(part, dict) else None
    return named if isinstance(named, str) else f"messages[{index}].content[{number}]"


def _part(index: int, number: int, part: Any, vision: Vision) -> dict[str, Any]:
    where = _client_name(part, index, number)
    if not isinstance(part, dict) or not isinstance(part.get("type"), str):
        raise InvalidRequest(400, f"{where} must be an object with a string 'type'", "invalid_type", where)
    if part["type"] in IMAGE_PART_TYPES:
        refuse_without_vision(vision, where)
        url = part.get("image_url")
        if isinstance(url, dict):
            url = url.get("url")
        if not isinstance(url, str):
            raise InvalidRequest(400, f"{where} needs 'image_url': {{\"url\": \"data:image/png;base64,...\"}}",
                                 "invalid_image", where)
        if is_remote(url):
            if not vision.remote_images:
                raise InvalidRequest(400, f"{where} is a remote image URL, and this server does not fetch images "
                                     "from URLs ([server] allow_remote_images is off). Send the image inline as a "
                                     "data: URI (data:image/png;base64,...)", "remote_image_refused", where)
            return image_part(url)  # fetched and checked by the service before admission (remote_images.py)
        return image_part(image_data_uri(url, where))
    return {"type": "text", "text": _part_text(where, part)}


def refuse_without_vision(vision: Vision, where: str) -> None:
    """The 400 for an image sent to a model that can't read it, naming one that can."""
    if vision.sees:
        return
    others = [name for name in vision.seeing_models if name != vision.model]
    hint = (f" {'These models read' if len(others) > 1 else 'This model reads'} images here: "
            f"{', '.join(others[:5])}." if others else " No model here reads images (a model reads them when its "
            "mmproj .gguf is beside it, or named by mmproj in its [[models]] entry).")
    raise InvalidRequest(400, f"{where} is an image, but the model {vision.model} has no vision: it reads text "
                         f"only. Send the text, or use a vision model.{hint}", "model_has_no_vision", where)


def image_data_uri(url: str, where: str) -> str:
    """A data: URI checked to hold one image of a format llama.cpp decodes, as
    data:<type>;base64,<data>. A remote (http(s)) URL is returned as it is:
    whether it may be fetched is [server] allow_remote_images's, decided in
    flatten_content, and the service fetches it (remote_images.py)."""
    if is_remote(url):
        return url
    header, comma, data = url.partition(",")
    if not url.startswith("data:") or not comma or not header.endswith(";base64"):
        raise InvalidRequest(400, f"{where} must be a base64 data: URI (data:image/png;base64,...)",
                             "invalid_image", where)
    return base64_image_uri(data, where)


def base64_image_uri(data: str, where: str) -> str:
    """Base64 image bytes (Ollama's images[] items) as a checked data: URI, its type read from the bytes."""
    return "data:{};base64,{}".format(image_type(decode_image(data, where), where), "".join(data.split()))


def image_bytes_uri(raw: bytes, where: str) -> str:
    """Image bytes (a fetched remote image) as a checked data: URI, as if the client had sent it inline."""
    return f"data:{image_type(raw, where)};base64,{base64.b64encode(raw).decode()}"


def decode_image(data: str, where: str) -> bytes:
    """Base64 image bytes, bounded and checked to be base64 at all."""
    # base64 is 4 characters per 3 bytes: refuse before decoding what would be too large.
    if len(data) > (MAX_IMAGE_BYTES + 2) // 3 * 4 + 64:
        raise InvalidRequest(400, f"{where} is over the {MAX_IMAGE_BYTES // (1024 * 1024)} MiB limit for one "
                             "image; send a smaller one", "image_too_large", where)
    try:
        raw = base64.b64decode("".join(data.split()), validate=True)
    except (binascii.Error, ValueError):
        raise InvalidRequest(400, f"{where} is not valid base64", "invalid_image", where) from None
    if len(raw) > MAX_IMAGE_BYTES:
        raise InvalidRequest(400, f"{where} is over the {MAX_IMAGE_BYTES // (1024 * 1024)} MiB limit for one "
                             "image; send a smaller one", "image_too_large", where)
    return raw


def image_type(raw: bytes, where: str) -> str:
    """The image's MIME type from its first bytes, checked to be whole and
    within the pixel bound; a 400 for anything llama.cpp can't decode."""
    for signature, mime in IMAGE_SIGNATURES.items():
        if raw.startswith(signature):
            problem = damage(raw, mime)
            if problem is not None:
                raise InvalidRequest(400, f"{where} is a damaged {mime.removeprefix('image/').upper()} ({problem}); "
                                     "send the file again", "invalid_image", where)
            add_image_pixels(0, image_pixels(raw), where)
            return mime
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        raise InvalidRequest(400, f"{where} is a WebP image, which llama.cpp can't decode; send PNG, JPEG, GIF "
                             "or BMP", "unsupported_image_format", where)
    raise InvalidRequest(400, f"{where} is not an image this server reads (PNG, JPEG, GIF or BMP)",
                         "invalid_image", where)


def add_image_pixels(total: int, pixels: int, where: str) -> int:
    """`total` with one more image's pixels; a 400 naming the image when
    the request's images together pass MAX_IMAGE_PIXELS."""
    if total + pixels <= MAX_IMAGE_PIXELS:
        return total + pixels
    alone = "it is" if not total else "with the images before it, the request's images are"
    raise InvalidRequest(400, f"{where}: {alone} {(total + pixels) / 1e6:.1f} megapixels once decoded; the limit is "
                         f"{MAX_IMAGE_PIXELS / 1e6:g} megapixels for a request's images together. Send a smaller "
                         "image (the model sees it at a few hundred pixels a side anyway)", "image_too_large", where)


def data_uri_pixels(uri: str) -> int:
    """The pixels of a checked data: URI's image (image_data_uri made it)."""
    return image_pixels(base64.b64decode(uri.partition(",")[2]))


def image_pixels(raw: bytes) -> int:
    """Width times height, read from a checked image's header without
    decoding it. An image whose size can't be read counts as over the bound."""
    width = height = 0
    if raw.startswith(PNG_SIGNATURE):
        width, height = int.from_bytes(raw[16:20], "big"), int.from_bytes(raw[20:24], "big")
    elif raw.startswith(b"GIF8"):
        width, height = int.from_bytes(raw[6:8], "little"), int.from_bytes(raw[8:10], "little")
    elif raw.startswith(b"BM"):
        if int.from_bytes(raw[14:18], "little") == 12:  # the old OS/2 header: 16-bit sizes
            width, height = int.from_bytes(raw[18:20], "little"), int.from_bytes(raw[20:22], "little")
        else:  # a negative height is a top-down bitmap
            width = abs(int.from_bytes(raw[18:22], "little", signed=True))
            height = abs(int.from_bytes(raw[22:26], "little", signed=True))
    elif raw.startswith(b"\xff\xd8"):
        width, height = _jpeg_size(raw)
    return width * height if width and height else MAX_IMAGE_PIXELS + 1


# JPEG's start-of-frame markers (C0-CF but C4, C8, CC, which are tables and
# arithmetic coding): the frame header holds the image's size.
_JPEG_FRAMES = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}


def _jpeg_size(raw: bytes) -> tuple[int, int]:
    """A JPEG's (width, height) from its first frame header, walking the
    segments before it (each says its own length); (0, 0) if none is found."""
    position = 2
    while position + 9 <= len(raw):
        if raw[position] != 0xFF:
            return 0, 0
        marker = raw[position + 1]
        if marker == 0xFF:  # fill byte
            position += 1
            continue
        if marker in _JPEG_FRAMES:
            # The frame header: length, precision, then height and width.
            height = int.from_bytes(raw[position + 5:position + 7], "big")
            return int.from_bytes(raw[position + 7:position + 9], "big"), height
        if 0xD0 <= marker <= 0xD9 or marker == 0x01:  # markers without a length
            position += 2
            continue
        position += 2 + int.from_bytes(raw[position + 2:position + 4], "big")
    return 0, 0


def damage(raw: bytes, mime: str) -> str | None:
    """Why an image is not whole (truncated, or corrupt where its format can
    tell without decoding pixels), or None. Decoding is the worker's; this
    catches a cut-off upload here, where the 400 can name the part, rather
    than as llama-server's "Failed to load image" for the whole request."""
    if mime == "image/png":
        return _png_damage(raw)
    end = raw.rstrip(b"\x00")
    if mime == "image/jpeg":
        return None if end.endswith(b"\xff\xd9") else "it ends before its end-of-image marker"
    if mime == "image/gif":
        return None if end.endswith(b";") else "it ends before its trailer"
    declared = int.from_bytes(raw[2:6], "little")  # BMP: the file's size, in its header
    return None if len(raw) >= declared >= 26 else f"its header says {declared} bytes, but it has {len(raw)}"


def _png_damage(raw: bytes) -> str | None:
    position = len(PNG_SIGNATURE)
    first = True
    while position + 12 <= len(raw):
        length = int.from_bytes(raw[position:position + 4], "big")
        kind = raw[position + 4:position + 8]
        end = position + 12 + length
        if end > len(raw):
            return f"its {kind.decode('latin-1')!r} chunk is cut off"
        if first and kind != b"IHDR":
            return "it does not start with a header chunk"
        if zlib.crc32(raw[position + 4:end - 4]) != int.from_bytes(raw[end - 4:end], "big"):
            return f"its {kind.decode('latin-1')!r} chunk fails its checksum"
        if kind == b"IEND":
            return None
        position, first = end, False
    return "it ends before its last chunk"


def _part_text(where: str, part: dict[str, Any]) -> str:
    kind = part["type"]
    if kind not in TEXT_PART_TYPES:
        raise InvalidRequest(400, f"{where} has type {kind!r}; this server reads text parts only "
                             "(types 'text', 'input_text', 'refusal')", "unsupported_content_part", where)
    text = part.get("refusal" if kind == "refusal" else "text")
    if not isinstance(text, str):
        raise InvalidRequest(400, f"{where} of type {kind!r} needs a string "
                             f"'{'refusal' if kind == 'refusal' else 'text'}'", "invalid_type", where)
    return text


@dataclass(frozen=True)
class Constraint:
    """What a request's answer must match, before it is a grammar.

    Validation only decides this and checks its size (grammar_bounds): the
    service never converts or parses it itself. The grammar checker's child
    process turns `schema` into GBNF, parses the grammar with llama.cpp, and
    the result becomes the body's `grammar`, which both workers get, so a
    replay is constrained the same way."""

    param: str                 # the field it came from, for the 400
    schema: Any = None         # a JSON schema to convert
    grammar: str | None = None  # or a GBNF grammar as it is
    tool: str | None = None    # the forced tool's name (tool_choice)


def constrain_output(body: dict[str, Any]) -> Constraint | None:
    """response_format or a raw `grammar`, as a Constraint; both leave the body."""
    response_format = body.pop("response_format", None)
    grammar = body.pop("grammar", None)
    constraint = _constraint_for(response_format) if response_format is not None else None
    if constraint is not None and grammar is not None:
        raise InvalidRequest(400, "send either 'response_format' or 'grammar', not both", "invalid_value",
                             "response_format")
    if constraint is not None or grammar is None:
        return constraint
    if not isinstance(grammar, str) or not grammar.strip():
        raise InvalidRequest(400, "'grammar' must be a non-empty GBNF string", "invalid_value", "grammar")
    _check_size(grammar_bounds.grammar_problem(grammar), "grammar", "the grammar is too large for llama.cpp")
    return Constraint("grammar", grammar=grammar)


def force_named_tool(body: dict[str, Any], constraint: Constraint | None) -> Constraint | None:
    """OpenAI's named tool_choice, {"type": "function", "function": {"name": F}},
    forces a call of F. llama-server does not take that form, and a template
    without tool calling (SmolLM2's) can't ask for it, so the service does it
    the same way on every engine: the answer is constrained to F's
    parameters (a grammar from their JSON schema), and the backend turns it
    into F's tool call. Returns that constraint, or the one given for any
    other tool_choice.
    """
    choice = body.get("tool_choice")
    if choice == "required":
        return _force_any_tool(body, constraint)
    if not isinstance(choice, dict):
        if choice is not None and choice not in ("none", "auto"):
            raise InvalidRequest(400, "'tool_choice' must be \"none\", \"auto\", \"required\" or "
                                 "{\"type\": \"function\", \"function\": {\"name\": ...}}", "invalid_value",
                                 "tool_choice")
        return constraint
    function = choice.get("function")
    name = function.get("name") if isinstance(function, dict) else None
    if choice.get("type") != "function" or not isinstance(name, str) or not name:
        raise InvalidRequest(400, "'tool_choice' as an object must be {\"type\": \"function\", "
                             "\"function\": {\"name\": ...}}", "invalid_value", "tool_choice")
    tools = body.get("tools") or []
    declared = next((t.get("function") for t in tools if isinstance(t, dict) and isinstance(t.get("function"), dict)
                     and t["function"].get("name") == name), None)
    if declared is None:
        raise InvalidRequest(400, f"'tool_choice' names {name!r}, which is not in 'tools'", "invalid_value",
                             "tool_choice")
    if constraint is not None:
        raise InvalidRequest(400, "a named 'tool_choice' already constrains the answer; drop 'response_format' "
                             "or 'grammar'", "invalid_value", "tool_choice")
    parameters = declared.get("parameters", {"type": "object"})
    # The tools stay in the request (a template that shows tools shows them);
    # "none": the worker must not parse the constrained answer as a call itself.
    body["tool_choice"] = "none"
    return _schema_constraint(parameters, "tools.function.parameters", tool=name)


def _force_any_tool(body: dict[str, Any], constraint: Constraint | None) -> Constraint:
    """tool_choice "required" (Anthropic's "any", LangChain's "any", the
    Agents SDK's "required"): a call of one of the tools, on every model, as
    OpenAI's contract says. llama-server leaves it to the chat template,
    and SmolLM2's answers in plain text. One tool is the named form; more
    constrain the answer to {"name": one of them, "arguments": its
    parameters}, which the backend turns into that call (ANY_TOOL)."""
    functions = [t["function"] for t in body.get("tools") or []
                 if isinstance(t, dict) and isinstance(t.get("function"), dict) and isinstance(t["function"].get("name"), str)]
    if not functions:
        raise InvalidRequest(400, "'tool_choice' is \"required\" but 'tools' names no function to call",
                             "invalid_value", "tool_choice")
    if constraint is not None:
        raise InvalidRequest(400, "tool_choice \"required\" already constrains the answer; drop 'response_format' "
                             "or 'grammar'", "invalid_value", "tool_choice")
    body["tool_choice"] = "none"  # the worker must not parse the constrained answer as a call itself
    if len(functions) == 1:
        return _schema_constraint(functions[0].get("parameters", {"type": "object"}), "tools.function.parameters",
                                  tool=functions[0]["name"])
    calls = [{"type": "object", "properties": {"name": {"const": f["name"]},
                                               "arguments": f.get("parameters", {"type": "object"})},
              "required": ["name", "arguments"], "additionalProperties": False} for f in functions]
    return _schema_constraint({"anyOf": calls}, "tools.function.parameters", tool=ANY_TOOL)


def _constraint_for(response_format: Any) -> Constraint | None:
    if not isinstance(response_format, dict) or not isinstance(response_format.get("type"), str):
        raise InvalidRequest(400, "'response_format' must be an object with a 'type'", "invalid_value",
                             "response_format")
    kind = response_format["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        schema = response_format.get("schema")
        if schema is None:
            return Constraint("response_format", grammar=JSON_GBNF)
        return _schema_constraint(schema, "response_format.schema")
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise InvalidRequest(400, "'response_format.json_schema' must be an object with a 'schema' object",
                                 "invalid_value", "response_format.json_schema")
        return _schema_constraint(spec["schema"], "response_format.json_schema.schema")
    raise InvalidRequest(400, f"response_format type {kind!r} is not one of 'text', 'json_object', 'json_schema'",
                         "invalid_value", "response_format.type")


def _schema_constraint(schema: Any, param: str, tool: str | None = None) -> Constraint:
    if not isinstance(schema, (dict, bool)):
        raise InvalidRequest(400, f"'{param}' must be a JSON schema (an object)", "invalid_json_schema", param)
    _check_size(grammar_bounds.schema_problem(schema), param, "the JSON schema is too large")
    return Constraint(param, schema=schema, tool=tool)


def _check_size(problem: str | None, param: str, what: str) -> None:
    if problem is not None:
        raise InvalidRequest(400, f"{what}: {problem}", "grammar_too_complex", param)
