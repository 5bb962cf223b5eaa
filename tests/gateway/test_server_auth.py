"""API keys, the Origin allow-list, token buckets and session slots, without a server."""

import pytest

from gateway.auth import (
    ANONYMOUS,
    Authenticator,
    AuthError,
    MinuteBucket,
    key_fingerprint,
    origin_allowed,
)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_no_keys_means_anonymous() -> None:
    assert Authenticator([]).authenticate(None) == ANONYMOUS


def test_bearer_and_browser_subprotocol_keys() -> None:
    auth = Authenticator(["sk-one", "sk-two"])
    assert auth.authenticate("Bearer sk-one") == key_fingerprint("sk-one")
    assert auth.authenticate("bearer  sk-two ") == key_fingerprint("sk-two")
    assert auth.authenticate(None, ["realtime", "openai-insecure-api-key.sk-two"]) == key_fingerprint("sk-two")
    for header, protocols in [(None, []), ("Bearer", []), ("Basic sk-one", []), ("Bearer sk-three", []),
                              (None, ["openai-insecure-api-key."]), (None, ["realtime"])]:
        with pytest.raises(AuthError) as e:
            auth.authenticate(header, protocols)
        assert e.value.status == 401
        assert "sk-" not in e.value.message  # never echo a key back


def test_fingerprint_hides_the_key() -> None:
    fp = key_fingerprint("sk-secret-value")
    assert "secret" not in fp and fp.startswith("key-") and fp == key_fingerprint("sk-secret-value")


@pytest.mark.parametrize("origin, host, allowed, ok", [
    (None, "h:8000", [], True),  # not a browser
    ("http://h:8000", "h:8000", [], True),  # same host
    ("http://H:8000", "h:8000", [], True),
    ("http://evil.example", "h:8000", [], False),
    ("http://h:9000", "h:8000", [], False),
    ("https://app.example", "h:8000", ["https://app.example"], True),
    ("https://app.example:443", "h:8000", ["https://app.example"], True),
    ("https://app.example.evil", "h:8000", ["https://app.example"], False),
    ("null", "h:8000", [], False),
    ("http://[::1", "h:8000", [], False),  # unparsable
    ("http://any.example", "h:8000", ["*"], True),
])
def test_origin_allow_list(origin: str | None, host: str, allowed: list[str], ok: bool) -> None:
    assert origin_allowed(origin, host, allowed) is ok


def test_a_minute_bucket_refills_per_minute() -> None:
    clock = Clock()
    bucket = MinuteBucket(60, clock)
    assert all(bucket.take() for _ in range(60))
    assert not bucket.take()
    assert bucket.seconds_until(1) == pytest.approx(1.0)
    clock.now += 1.5
    assert bucket.take() and not bucket.take()
    bucket.charge(10)  # tokens are charged after the fact and may go into debt
    assert bucket.remaining() == 0
    clock.now += 1000
    assert bucket.remaining() == 60  # never above capacity
