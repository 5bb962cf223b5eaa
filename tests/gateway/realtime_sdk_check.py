"""Strict check of our server events against the openai SDK's own pydantic models.

The SDK parses received events leniently (``construct_type_unchecked``), so any dict would
"parse"; here each event is validated for real against the model its ``type`` names, in the
GA (``openai.types.realtime``) or beta (``openai.types.beta.realtime``) flavour. Only the
deviations documented in docs/protocol.md are tolerated.
"""

from __future__ import annotations

import typing
from functools import cache
from typing import Any

import pydantic
from openai.types.beta.realtime import realtime_server_event as beta_events
from openai.types.realtime import realtime_server_event as ga_events

# status_details.reason values the SDK's Literal does not list (documented extensions).
EXTENSION_CANCEL_REASONS = frozenset({"client_too_slow", "server_shutdown", "client_disconnected", "engine_aborted"})


@cache
def _models(beta: bool) -> dict[str, type[pydantic.BaseModel]]:
    union = (beta_events if beta else ga_events).RealtimeServerEvent
    members = typing.get_args(typing.get_args(union)[0])  # Annotated[Union[...], PropertyInfo]
    by_type = {}
    for model in members:
        (name,) = typing.get_args(model.model_fields["type"].annotation)
        by_type[name] = model
    return by_type


def _tolerated(error: Any, event: dict[str, Any], beta: bool) -> bool:
    loc = tuple(error["loc"])
    if loc[-2:] == ("status_details", "reason") and error["input"] in EXTENSION_CANCEL_REASONS:
        return True
    # The beta SDK types session.model as a closed list of OpenAI model names.
    return beta and loc == ("session", "model") and isinstance(error["input"], str)


def check_server_event(event: dict[str, Any], *, beta: bool) -> pydantic.BaseModel | None:
    """Raise AssertionError unless ``event`` validates as the SDK's model for its type."""
    model = _models(beta).get(event.get("type"))  # type: ignore[arg-type]
    assert model is not None, f"{event.get('type')!r} is not a {'beta' if beta else 'GA'} server event of the SDK"
    try:
        return model.model_validate(event)
    except pydantic.ValidationError as e:
        bad = [err for err in e.errors() if not _tolerated(err, event, beta)]
        assert not bad, f"{event['type']} does not match the SDK model {model.__name__}: {bad}\n{event}"
        return None
