"""Message content as typed parts, as the OpenAI APIs send it: text, images, audio.

Every tier reads text today, so a message's parts must all be text by the time it is rendered
into a prompt; images and audio have a type here, so a parser keeps what the client sent and the
refusal is one clear error in one place (``text_of``) rather than a parse failure in each API.
A tier that reads images adds what it accepts here, not a new message shape.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from llm_shared.errors import InvalidRequestError


@dataclass(frozen=True)
class TextPart:
    text: str


@dataclass(frozen=True)
class ImagePart:
    url: str  # an http(s) or data: URL, as the client gave it (never fetched: no tier reads images)


@dataclass(frozen=True)
class AudioPart:
    format: str  # the client's name for it ("wav", "mp3", "audio/pcm"...)
    data: str  # base64, as sent (never decoded: no tier reads audio in a message)


ContentPart = TextPart | ImagePart | AudioPart


class UnsupportedContentError(InvalidRequestError):
    code = "unsupported_content"


def text_of(parts: Sequence[ContentPart], param: str | None = None) -> str:
    """The text of ``parts`` joined, or ``UnsupportedContentError`` naming the first part that is
    not text (``param``: where the parts came from, e.g. ``messages[1].content``)."""
    texts = []
    for i, part in enumerate(parts):
        if not isinstance(part, TextPart):
            kind = "image" if isinstance(part, ImagePart) else "audio"
            where = f"{param}[{i}]" if param else None
            raise UnsupportedContentError(
                f"{kind} content is not supported: the models served here read text only"
                + (f" ({where})" if where else ""), param=where)
        texts.append(part.text)
    return "".join(texts)
