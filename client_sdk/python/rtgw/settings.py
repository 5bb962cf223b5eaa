"""The session's settings as the client keeps them: what ``update_session`` (and the client's
``instructions``, ``tools``...) set, in the GA session shape, sent again on every new session and
read by the on-device fallback. Pure: no I/O."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from rtgw.tools import normalize_tools

# Shortcuts of update_session() that live in the GA session's ``audio`` object.
_AUDIO_FIELDS = {"voice": ("output", "voice"), "speed": ("output", "speed"),
                 "turn_detection": ("input", "turn_detection"), "transcription": ("input", "transcription"),
                 "noise_reduction": ("input", "noise_reduction")}


def session_fields(fields: Mapping[str, Any]) -> dict[str, Any]:
    """``update_session`` keywords as the GA session object: ``voice``, ``speed``,
    ``turn_detection`` (a dict, ``"server_vad"``, ``"semantic_vad"``, or None for push to talk), ``transcription`` and
    ``noise_reduction`` go into ``audio``; ``output_modalities="audio"`` becomes ``["audio"]``."""
    out = {k: v for k, v in fields.items() if k not in _AUDIO_FIELDS}
    if isinstance(out.get("output_modalities"), str):
        out["output_modalities"] = [out["output_modalities"]]
    audio = {side: dict(values) for side, values in (out.pop("audio", None) or {}).items()}
    for name, (side, key) in _AUDIO_FIELDS.items():
        if name in fields:
            value = fields[name]
            audio.setdefault(side, {})[key] = {"type": value} if name == "turn_detection" and isinstance(value, str) \
                else value
    if audio:
        out["audio"] = audio
    return out


def merge_session(kept: dict[str, Any], update: Mapping[str, Any]) -> None:
    """``update`` into the settings ``kept`` for later sessions; ``audio`` is merged key by key."""
    for key, value in update.items():
        if key == "audio" and isinstance(kept.get("audio"), dict):
            for side, values in value.items():
                kept["audio"].setdefault(side, {}).update(values)
        else:
            kept[key] = value


class SessionSettings:
    """Settings to apply again on every new session (``fields``: a ``session.update``'s)."""

    def __init__(self, fields: Mapping[str, Any]) -> None:
        self.fields: dict[str, Any] = dict(fields)

    @property
    def instructions(self) -> str:
        return str(self.fields.get("instructions") or "")

    def update(self, fields: dict[str, Any]) -> dict[str, Any]:
        """``update_session``'s keywords, kept for later sessions; returns the ``session.update``
        fields to send now (the whole ``audio`` object: an update of its voice keeps its turn
        detection)."""
        if fields.get("tools") is not None:
            fields["tools"] = normalize_tools(fields["tools"])
        fields = session_fields(fields)
        merge_session(self.fields, fields)
        if "audio" in fields:
            fields["audio"] = self.fields["audio"]
        return fields
