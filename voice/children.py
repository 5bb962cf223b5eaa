"""The environment the voice package's programs run with (the flite children, piper).

They get the few variables a program needs to run and read text (``PATH``, locale, ``HOME``,
``TMPDIR``), never the gateway's own: ``ENGINE_CORE_SECRET`` (the engine core's shared secret,
which the worker parent puts in its environment for the core and the workers to inherit), API keys
from ``GATEWAY_API_KEYS``, a Redis URL with its password. A synthesizer that misbehaves, or a
text that makes one misbehave, has nothing of the server's to show.
"""

from __future__ import annotations

import os
from collections.abc import Mapping

PASSED = ("PATH", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "HOME", "TMPDIR")


def child_env(environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """What a voice program's process is given of ``environ``."""
    return {k: environ[k] for k in PASSED if k in environ}
