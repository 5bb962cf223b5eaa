"""Message content as typed parts: text reaches the prompt; an image or audio part is kept as sent
and refused where a prompt is made, with an error naming the part."""

from __future__ import annotations

import pytest

from llm_shared.content import AudioPart, ImagePart, TextPart, UnsupportedContentError, text_of
from llm_shared.structured import Message, render_messages


def test_text_given_as_a_string_is_one_text_part() -> None:
    assert Message("user", "hi").content == (TextPart("hi"),)
    assert Message("assistant", "").content == ()
    assert Message("user", (TextPart("a"), TextPart("b"))).text == "ab"


def test_parts_no_tier_reads_are_refused_when_the_prompt_is_made() -> None:
    image = Message("user", (TextPart("what is this?"), ImagePart("https://example.com/cat.png")))
    with pytest.raises(UnsupportedContentError, match="image content is not supported") as caught:
        render_messages([image], None, None)
    assert caught.value.code == "unsupported_content"
    with pytest.raises(UnsupportedContentError, match=r"audio .*\(messages\[2\]\.content\[0\]\)") as caught:
        text_of((AudioPart("wav", "UklGRg=="),), "messages[2].content")
    assert caught.value.param == "messages[2].content[0]"


def test_rendering_text_messages_is_unchanged() -> None:
    assert render_messages([Message("system", "be brief"), Message("user", "hi")], None, None) == [
        {"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
