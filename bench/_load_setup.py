"""What bench/load.py (and bench/limits.py) run the gateway on: the default config over synthetic tiers at a fixed token rate, and the goals its figures are read against."""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from bench._common import REPO_ROOT, dump_toml

CASCADE_THRESHOLDS = {"confident": 0.22, "escalated": 1.0}  # the synthetic tokens score 0.9


TOKENS_PER_S = 20.0


ITL_GOAL_S = 0.100


SLO_KEYS = ("ttft", "tpot", "e2el")


def synthetic_config(directory: Path, name: str, *, max_streams: int, rate: float = TOKENS_PER_S,
                     slow_client_timeout_s: float = 30.0, direct_writes: bool = True,
                     cascade_threshold: float | None = None, tables: Mapping[str, Mapping[str, Any]] | None = None,
                     ) -> Path:
    """The default config on the synthetic edge tier; with ``cascade_threshold``, the cascade over
    it and a synthetic torch tier (a fixed threshold: the load-aware relaxation off). ``tables``:
    keys set last, by table (bench/limits.py: ``[limits]``, ``server.workers``)."""
    raw = tomllib.loads((REPO_ROOT / "configs" / "default.toml").read_text(encoding="utf-8"))
    raw["routing"]["default"] = "edge"
    raw["edge"].update(backend="synthetic", synthetic_tokens_per_s=rate, synthetic_max_streams=max_streams)
    if cascade_threshold is not None:
        raw["routing"]["default"] = "cascade"
        raw["engine"].update(backend="synthetic", synthetic_tokens_per_s=rate, synthetic_max_streams=max_streams)
        # a fixed route, so an arm measures the path it names: no load-aware threshold, and no
        # spill (the synthetic torch tier starts at once, so the pace rule would take every turn)
        raw.setdefault("cascade", {}).update(threshold=cascade_threshold, min_threshold=cascade_threshold,
                                             load_aware=False, spill=False)
    raw["server"].update(
        max_sessions_per_key=20_000, max_sessions=20_000, requests_per_minute=10_000_000,
        tokens_per_minute=1_000_000_000, max_concurrent_requests_per_key=20_000, idle_timeout_s=3600.0,
        slow_client_timeout_s=slow_client_timeout_s, api_keys=[], api_keys_env="", direct_writes=direct_writes)
    for table, values in (tables or {}).items():
        raw.setdefault(table, {}).update(values)
    path = directory / f"{name}.toml"
    path.write_text(dump_toml(raw), encoding="utf-8")
    return path
