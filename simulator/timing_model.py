"""How long a simulated instance's steps and KV pulls take: one profile per model and hardware.

A :class:`TimingProfile` stands in for the model runner of one instance (all of its ranks
together): its KV capacity, its scheduler's limits, and the coefficients of one formula for the
time of a step, whatever the step holds (prompt chunks, decodes, or both)::

    step_seconds = step_fixed_s
                 + token_s     * sum_i(n_i)
                 + attention_s * sum_i(n_i * c_i - n_i * (n_i - 1) / 2)
                 + context_s   * sum_i(c_i)

over the step's rows ``(n_i, c_i)``: a request computing ``n_i`` new tokens, with ``c_i`` tokens
of context once they are computed (those computed before plus the new ones).

- ``step_fixed_s``: what every step pays whatever its size: reading the weights once (what
  bounds a small decode batch on a GPU), kernel launches, sampling.
- ``token_s``: the dense layers' arithmetic per token, the same for a prompt token and a decode.
- ``attention_s``: per (query, key) pair that causal attention computes. A chunk's token ``j``
  attends to the ``c_i - n_i + j`` tokens up to itself, so the pairs are
  ``n_i * c_i - n_i * (n_i - 1) / 2``: a prefill's attention grows with the square of its
  length, a decode's (one query) with its context.
- ``context_s``: per context token each row reads from the KV cache. A decode's attention is
  bound by reading its context's K and V, not by the arithmetic on them, and that read costs
  far more per key than a prefill's pair does (a prefill reuses each key it reads for a whole
  tile of queries), so one coefficient cannot serve both: with attention alone, either long
  prefills or long-context decode batches come out wrong by the ratio of the two.

This is the additive latency model of DistServe's appendix (a constant, a term linear in the
tokens, one in the squared prompt lengths for prefill, one in the total context for decode), in
one formula so that a mixed step is the sum of its parts. Memory and compute overlap on a GPU,
so adding them overestimates steps where both matter (a large decode batch); the built-in
profiles say where their figures come from in ``source`` and docs/simulator.md.

KV pulls from prefill to decode: ``pull_seconds = pull_fixed_s + num_bytes / link_bytes_per_s``.

Nothing here imports torch or the engine: simulated instances start by the dozen on one host.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field, fields
from importlib import resources
from pathlib import Path
from typing import Any, NamedTuple

# The JSON keys of a profile besides its scalar fields.
_MEASURED_STEPS = "measured_steps"
_PROFILES_PACKAGE = "simulator"
_PROFILES_FOLDER = "profiles"
DEFAULT_PROFILE = "llama-3.1-8b-h100"  # what `splitserve simulate` runs without --profile


class StepFeatures(NamedTuple):
    """The sums the step-time formula multiplies by its coefficients (module docstring)."""

    num_tokens: int  # sum of n_i: tokens computed this step
    num_attended_pairs: int  # sum of n_i * c_i - n_i * (n_i - 1) / 2: (query, key) pairs of causal attention
    num_context_tokens: int  # sum of c_i: context tokens read from the KV cache, row by row


def step_features(rows: Iterable[tuple[int, int]]) -> StepFeatures:
    """The formula's sums over ``rows`` of ``(num_new_tokens, num_context_tokens)``; raises
    ValueError for a row that cannot occur (no new token, or a context shorter than them)."""
    num_tokens = num_pairs = num_context = 0
    for num_new, num_ctx in rows:
        if num_new < 1 or num_ctx < num_new:
            raise ValueError(
                f"a step row is (num_new_tokens >= 1, num_context_tokens >= num_new_tokens), the context "
                f"counting the new tokens too; got ({num_new}, {num_ctx})"
            )
        num_tokens += num_new
        num_pairs += num_new * num_ctx - num_new * (num_new - 1) // 2
        num_context += num_ctx
    return StepFeatures(num_tokens, num_pairs, num_context)


@dataclass(frozen=True, slots=True)
class MeasuredStep:
    """One step a profile was fitted on: its rows and how long the model runner took."""

    rows: tuple[tuple[int, int], ...]  # (num_new_tokens, num_context_tokens), as step_seconds takes them
    seconds: float

    def to_dict(self) -> dict[str, Any]:
        return {"rows": [list(row) for row in self.rows], "seconds": self.seconds}

    @classmethod
    def from_dict(cls, data: Any) -> MeasuredStep:
        if not isinstance(data, dict) or set(data) != {"rows", "seconds"}:
            raise ValueError(f'each measured step is {{"rows": [[n, c], ...], "seconds": s}}; got {data!r}')
        rows = tuple((int(n), int(c)) for n, c in data["rows"])
        step_features(rows)  # refuses impossible rows
        seconds = float(data["seconds"])
        if not (math.isfinite(seconds) and seconds > 0):
            raise ValueError(f"a measured step's seconds must be a finite number > 0; got {data['seconds']!r}")
        return cls(rows, seconds)


@dataclass(frozen=True, slots=True)
class TimingProfile:
    """One instance kind's capacity and timing (the formula is in the module docstring).

    A profile describes an instance as a whole: with tensor parallelism, ``kv_bytes_per_token``
    counts every rank's KV heads and ``link_bytes_per_s`` is what all ranks pull at together.
    """

    name: str
    source: str  # where the figures come from: publications, the measuring command
    block_size: int  # tokens per KV block
    num_kv_blocks: int  # the instance's KV capacity
    kv_bytes_per_token: int  # K and V of one token, all layers: layers * 2 * kv_heads * head_dim * dtype bytes
    max_num_seqs: int  # requests one step may hold
    max_num_batched_tokens: int  # tokens one step may compute
    step_fixed_s: float
    token_s: float
    attention_s: float
    context_s: float
    link_bytes_per_s: float  # KV pulls from prefill to decode
    pull_fixed_s: float
    measured_steps: tuple[MeasuredStep, ...] = field(default=())  # what a measured profile was fitted on

    def __post_init__(self) -> None:
        for name in ("name", "source"):
            value = getattr(self, name)
            if not isinstance(value, str) or not value.strip():
                raise ValueError(f"a timing profile's {name} must be a non-empty string; got {value!r}")
        for name in ("block_size", "num_kv_blocks", "kv_bytes_per_token", "max_num_seqs", "max_num_batched_tokens"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{self.name}: {name} must be a whole number >= 1; got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(
                f"{self.name}: block_size must be a power of two, as the engine's is; got {self.block_size}"
            )
        for name in ("step_fixed_s", "token_s", "attention_s", "context_s", "pull_fixed_s"):
            _check_seconds(self.name, name, getattr(self, name))
        if self.step_fixed_s == 0 and self.token_s == 0:
            raise ValueError(
                f"{self.name}: step_fixed_s and token_s are both 0, so a step would take no time; give at least "
                "one of them a positive value"
            )
        link = self.link_bytes_per_s
        if isinstance(link, bool) or not isinstance(link, int | float) or not (math.isfinite(link) and link > 0):
            raise ValueError(
                f"{self.name}: link_bytes_per_s must be a finite number > 0 (bytes a second, e.g. 5e10 for a "
                f"400 Gb/s NIC); got {link!r}"
            )

    # ------------------------------------------------------------------ timing

    @property
    def block_bytes(self) -> int:
        """Bytes of one KV block, all layers, K and V: what a pull moves per block."""
        return self.block_size * self.kv_bytes_per_token

    def step_seconds(self, rows: Sequence[tuple[int, int]]) -> float:
        """Seconds the model runner takes for one step of ``rows``, each ``(num_new_tokens,
        num_context_tokens)`` with the context counting the new tokens. An empty step runs no
        model and takes 0."""
        features = step_features(rows)
        if not features.num_tokens:
            return 0.0
        return (
            self.step_fixed_s
            + self.token_s * features.num_tokens
            + self.attention_s * features.num_attended_pairs
            + self.context_s * features.num_context_tokens
        )

    def prefill_seconds(self, num_tokens: int, chunk: int | None = None, num_cached_tokens: int = 0) -> float:
        """Seconds to prefill a ``num_tokens`` prompt alone, ``chunk`` tokens a step (None: the
        step budget, ``max_num_batched_tokens``), its first ``num_cached_tokens`` found in the
        prefix cache. For planning; a served prefill shares its steps with other requests."""
        chunk = self.max_num_batched_tokens if chunk is None else chunk
        if chunk < 1:
            raise ValueError(f"chunk must be >= 1 token a step; got {chunk}")
        if num_tokens < 1 or not 0 <= num_cached_tokens <= num_tokens:
            raise ValueError(
                f"prefill of num_tokens >= 1 with 0 <= num_cached_tokens <= num_tokens; got {num_tokens} tokens, "
                f"{num_cached_tokens} cached"
            )
        seconds, num_computed = 0.0, num_cached_tokens
        while num_computed < num_tokens:
            num_new = min(chunk, num_tokens - num_computed)
            num_computed += num_new
            seconds += self.step_seconds([(num_new, num_computed)])
        return seconds

    def pull_seconds(self, num_bytes: int) -> float:
        """Seconds for a decode instance to pull ``num_bytes`` of KV from a prefill instance;
        0 when nothing is missing (every block a prefix-cache hit on the decode side)."""
        if num_bytes < 0:
            raise ValueError(f"num_bytes must be >= 0; got {num_bytes}")
        if num_bytes == 0:
            return 0.0
        return self.pull_fixed_s + num_bytes / self.link_bytes_per_s

    # ------------------------------------------------------------------- JSON

    def to_json(self) -> str:
        """The profile as JSON text, one measured step a line; :meth:`from_json` reads it back."""
        scalars = {f.name: getattr(self, f.name) for f in fields(self) if f.name != _MEASURED_STEPS}
        text = json.dumps(scalars, indent=2)
        if self.measured_steps:
            steps = ",\n".join("    " + json.dumps(step.to_dict()) for step in self.measured_steps)
            text = f'{text[:-2]},\n  "{_MEASURED_STEPS}": [\n{steps}\n  ]\n}}'
        return text + "\n"

    @classmethod
    def from_json(cls, path_or_text: str | Path) -> TimingProfile:
        """A profile from a JSON file, or from JSON text (a string that starts with ``{``)."""
        if isinstance(path_or_text, str) and path_or_text.lstrip().startswith("{"):
            where, text = "the JSON text", path_or_text
        else:
            path = Path(path_or_text)
            try:
                where, text = str(path), path.read_text()
            except OSError as error:
                raise ValueError(f"cannot read timing profile {path}: {error}") from error
        try:
            data = json.loads(text)
        except json.JSONDecodeError as error:
            raise ValueError(f"{where} is not valid JSON: {error}") from error
        if not isinstance(data, dict):
            raise ValueError(f"{where} must hold one JSON object, a profile; got {type(data).__name__}")
        return cls._from_dict(data, where)

    @classmethod
    def _from_dict(cls, data: dict[str, Any], where: str) -> TimingProfile:
        names = [f.name for f in fields(cls)]
        unknown = sorted(set(data) - set(names))
        missing = sorted(set(names) - set(data) - {_MEASURED_STEPS})
        if unknown or missing:
            raise ValueError(
                f"{where}: a timing profile has exactly the keys {', '.join(names)} (the last optional); "
                + (f"unknown: {', '.join(unknown)}" if unknown else "")
                + ("; " if unknown and missing else "")
                + (f"missing: {', '.join(missing)}" if missing else "")
            )
        values = dict(data)
        steps = values.pop(_MEASURED_STEPS, [])
        if not isinstance(steps, list):
            raise ValueError(f"{where}: {_MEASURED_STEPS} must be a list of steps")
        return cls(**values, measured_steps=tuple(MeasuredStep.from_dict(step) for step in steps))


def _check_seconds(profile: str, name: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"{profile}: {name} must be a finite number of seconds >= 0; got {value!r}")


# ------------------------------------------------------------- built-in profiles


def builtin_profile_names() -> list[str]:
    """The names ``load_profile`` finds without a path (simulator/profiles/*.json), sorted."""
    folder = resources.files(_PROFILES_PACKAGE) / _PROFILES_FOLDER
    return sorted(item.name.removesuffix(".json") for item in folder.iterdir() if item.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> TimingProfile:
    """A profile from a JSON file at ``name_or_path``, else the built-in profile of that name."""
    path = Path(name_or_path)
    if path.is_file():
        return TimingProfile.from_json(path)
    name = str(name_or_path)
    if name in builtin_profile_names():
        resource = resources.files(_PROFILES_PACKAGE) / _PROFILES_FOLDER / f"{name}.json"
        return TimingProfile._from_dict(json.loads(resource.read_text()), f"built-in profile {name}")
    raise ValueError(
        f"no timing profile file at {name!r} and no built-in profile of that name; give a JSON file "
        f"(python -m simulator.measure_profile writes one) or one of: {', '.join(builtin_profile_names())}"
    )
