"""Token sampling for a batch of rows, each with its own SamplingParams.

Randomness is counter-based: a seeded request's uniform for its n-th output token is a pure
function of (seed, n), and every row is filtered and sampled independently (inverse CDF over its
own cumulative sum). So the same seed gives the same tokens whatever else shares the
batch, and no global RNG is touched. Unseeded rows draw their seed from this sampler's own
``random.Random``. Reported logprobs are under the unmodified model distribution (temperature 1,
no top-k/top-p), as the OpenAI API reports them.

The work over the logits runs as tensor operations on their device. The host sends each row's
parameters and uniforms (``uniforms_for``: one numpy pass) and gets the chosen ids and their
logprobs back in one transfer (top logprobs in one more, when asked); which rows filter by top-k
or top-p is read from the parameters (``request_probs``), so nothing in a step waits for the
device before that transfer.
"""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
import torch

from llm_shared.contract import SamplingParams

_MASK64 = (1 << 64) - 1


class SampledToken(NamedTuple):
    """One emitted token. Immutable like a frozen dataclass, and half the cost to build: a step
    builds one per running sequence (256 of them were ~90 µs of a 2 ms host step as dataclasses)."""

    token_id: int
    logprob: float  # of token_id under the unmodified distribution
    top_logprobs: tuple[tuple[int, float], ...] = ()  # params.logprobs best (token, logprob), best first


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniform_for(seed: int, output_index: int) -> float:
    """A uniform in [0, 1) keyed by (seed, output_index): the same key, the same number."""
    return (_splitmix64(_splitmix64(seed) ^ output_index) >> 11) * 2.0**-53


def _splitmix64_array(x: np.ndarray) -> np.ndarray:
    """``_splitmix64`` of every element of a uint64 array (numpy's uint64 arithmetic wraps mod 2**64)."""
    x = x + np.uint64(0x9E3779B97F4A7C15)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def uniforms_for(seeds: Sequence[int], output_indices: Sequence[int]) -> np.ndarray:
    """float64 [n]: ``uniform_for`` of each (seed, output index) pair, bit for bit, in one pass."""
    keys = np.array([seed & _MASK64 for seed in seeds], dtype=np.uint64)
    mixed = _splitmix64_array(_splitmix64_array(keys) ^ np.array(output_indices, dtype=np.uint64))
    return (mixed >> np.uint64(11)).astype(np.float64) * 2.0**-53


# Top-p first looks for its cut among the CANDIDATES most likely tokens (topk is cheap); only rows
# whose nucleus is wider sort the whole vocabulary. torch's CPU sort is ~25x slower than numpy's
# SIMD sort on these machines, so that fallback sorts with numpy on CPU.
CANDIDATES = 256


def sampling_probs(
    logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor
) -> torch.Tensor:
    """Filtered, renormalised probabilities in vocab order.

    logits [n, V] float32; temperature [n] (> 0); top_k [n] (0 = off); top_p [n] in (0, 1].
    Top-k keeps the tokens at least as likely as the k-th; top-p then keeps the smallest
    most-likely-first prefix whose mass reaches top_p (always at least one token). Both cut by a
    probability threshold, so tokens tied at the cut are kept or dropped together.
    """
    probs = torch.softmax(logits / temperature[:, None], dim=-1)
    with_k = (top_k > 0).nonzero().squeeze(1)
    if with_k.numel():
        k = top_k[with_k].clamp(max=logits.shape[1])
        kth = probs[with_k].topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [r, 1]
        probs[with_k] = _keep_at_least(probs[with_k], kth)
    with_p = (top_p < 1.0).nonzero().squeeze(1)
    if with_p.numel():
        probs[with_p] = _keep_at_least(probs[with_p], _nucleus_floor(probs[with_p], top_p[with_p]))
    return probs


def _keep_at_least(probs: torch.Tensor, floor: torch.Tensor) -> torch.Tensor:
    kept = torch.where(probs >= floor, probs, 0.0)
    return kept / kept.sum(dim=-1, keepdim=True)


def request_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """``sampling_probs`` of rows sampled with these requests' parameters, bit for bit, read from
    the parameters on the host: which rows filter by top-k and top-p, and the widest top-k, are
    known without searching the device's tensors, so on a GPU nothing waits for the device."""
    device = logits.device
    temperatures = [p.temperature for p in params]
    probs = torch.softmax(logits if all(t == 1.0 for t in temperatures)  # x / 1 == x
                          else logits / torch.tensor(temperatures, device=device)[:, None], dim=-1)
    width = logits.shape[1]
    k_rows = [i for i, p in enumerate(params) if p.top_k > 0]
    if k_rows:
        rows = torch.tensor(k_rows, device=device)
        k = torch.tensor([min(params[i].top_k, width) for i in k_rows], device=device)
        kth = probs[rows].topk(min(max(params[i].top_k for i in k_rows), width), dim=-1).values.gather(1, (k - 1)[:, None])
        probs[rows] = _keep_at_least(probs[rows], kth)
    p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if p_rows:
        rows = torch.tensor(p_rows, device=device)
        top_p = torch.tensor([params[i].top_p for i in p_rows], device=device)
        probs[rows] = _keep_at_least(probs[rows], _nucleus_floor(probs[rows], top_p, wait_free=device.type != "cpu"))
    return probs


def _nucleus_floor(probs: torch.Tensor, top_p: torch.Tensor, *, wait_free: bool = False) -> torch.Tensor:
    """[r, 1]: the probability of the last token of each row's top-p nucleus. ``wait_free``: sort
    every row whose nucleus the head may miss, instead of finding out which do (on a GPU finding
    out waits for the device); the same floors."""
    width = min(CANDIDATES, probs.shape[1])
    head = probs.topk(width, dim=-1).values  # descending
    cut, reached = _cut(head, top_p)
    if wait_free:
        whole = _cut(probs.sort(dim=-1, descending=True).values, top_p)[0]
        return torch.where(reached[:, None], cut, whole)
    floor = torch.empty(probs.shape[0], 1, dtype=probs.dtype, device=probs.device)
    floor[reached] = cut[reached]
    rest = (~reached).nonzero().squeeze(1)
    if rest.numel():
        if probs.device.type == "cpu":
            ordered = torch.from_numpy(np.ascontiguousarray(np.sort(probs[rest].numpy(), axis=-1)[:, ::-1]))
        else:
            ordered = probs[rest].sort(dim=-1, descending=True).values
        floor[rest] = _cut(ordered, top_p[rest])[0]
    return floor


def _cut(descending: torch.Tensor, top_p: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Value at the first index whose cumulative mass reaches top_p [r, 1], and whether it was reached."""
    cumulative = torch.cumsum(descending, dim=-1)
    index = (cumulative < top_p[:, None]).sum(dim=-1, keepdim=True).clamp_(max=descending.shape[1] - 1)
    return descending.gather(1, index), cumulative[:, -1] >= top_p


def token_allowed(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """bitmask [r, W] int32 (bit t % 32 of word t // 32 set: token t allowed) -> bool [r, vocab_size]."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.unsqueeze(-1) >> shifts) & 1).reshape(bitmask.shape[0], -1)  # [r, 32 W]; bit 31 too
    if bits.shape[1] < vocab_size:  # logit columns past the tokenizer's vocabulary: never allowed
        bits = torch.nn.functional.pad(bits, (0, vocab_size - bits.shape[1]))
    return bits[:, :vocab_size].bool()


def _host_allowed(words: np.ndarray, vocab_size: int) -> torch.Tensor:
    """words [r, W] int32 -> bool [r, vocab_size] on the host (numpy unpacks 32 rows of 49k in
    ~0.1 ms, where the shifts of ``token_allowed`` take several times that on a CPU)."""
    covered = min(vocab_size, words.shape[1] * 32)
    bits = np.zeros((words.shape[0], vocab_size), dtype=bool)
    bits[:, :covered] = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little", count=covered).view(bool)
    return torch.from_numpy(bits)


def masked_logits(logits: torch.Tensor, masks: Mapping[int, np.ndarray]) -> torch.Tensor:
    """``logits`` [n, V] with the tokens each masked row may not pick at -inf (a new tensor; the
    input is left as it was). The bitmask rows are unpacked on the host on a CPU, on the logits'
    device elsewhere (the int32 words are 1/32 of the bytes to copy)."""
    rows = sorted(masks)
    words = np.stack([masks[r] for r in rows])
    if logits.device.type == "cpu":
        allowed = _host_allowed(words, logits.shape[1])
    else:
        allowed = token_allowed(torch.from_numpy(words).to(logits.device, non_blocking=True), logits.shape[1])
    refused = torch.tensor(float("-inf"), dtype=logits.dtype, device=logits.device)
    if rows == list(range(logits.shape[0])):  # every row masked: no copy of the rest
        return torch.where(allowed, logits, refused)
    index = torch.tensor(rows, dtype=torch.int64, device=logits.device)
    out = logits.clone()
    out[index] = torch.where(allowed, logits[index], refused)
    return out


def _is_allowed(mask: np.ndarray, token_id: int) -> bool:
    return token_id < mask.shape[0] * 32 and bool((int(mask[token_id >> 5]) >> (token_id & 31)) & 1)


def correct_greedy(chosen: torch.Tensor, logits: torch.Tensor, masks: Mapping[int, np.ndarray]) -> None:
    """On a CPU, for greedy rows: each masked row's argmax of the unmasked ``logits`` (in
    ``chosen``, [n] int64, changed in place) replaced, where its grammar refuses it, by the argmax
    of the masked row (the best allowed token, the first of equal ones). A model that keeps to the
    format mostly picks an allowed token, so most rows cost one bit test instead of a masked copy
    of 49k logits."""
    picks = chosen.numpy()
    refused = [row for row, mask in masks.items() if not _is_allowed(mask, int(picks[row]))]
    if refused:
        index = torch.tensor(refused, dtype=torch.int64)
        best = masked_logits(logits[index], {n: masks[row] for n, row in enumerate(refused)}).argmax(dim=-1)
        chosen[index] = best


def inverse_cdf(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """probs [r, V] (unnormalised is fine), uniforms [r] in [0, 1) -> [r]: each row's token whose
    cumulative mass first exceeds its uniform's share of the row's total."""
    cdf = torch.cumsum(probs, dim=-1)
    total = cdf[:, -1]
    # strictly below the total even after rounding, so the pick is never past the last kept token
    targets = torch.minimum(uniforms.to(cdf.dtype) * total, torch.nextafter(total, torch.zeros_like(total)))
    # first index whose cumulative mass exceeds the target: a token with positive probability
    return torch.searchsorted(cdf, targets[:, None], right=True).squeeze(1)


class PendingTokens:
    """A sampled batch not yet read back: call it for the tokens (the one transfer); ``ids`` [n]
    int64 are the chosen ids where they were computed, which a step planned ahead feeds on."""

    __slots__ = ("_read", "ids")

    def __init__(self, read: Callable[[], list[SampledToken]], ids: torch.Tensor) -> None:
        self._read = read
        self.ids = ids

    def __call__(self) -> list[SampledToken]:
        return self._read()


class Sampler:
    def __init__(self, seed: int | None = None) -> None:
        # Only for unseeded requests; seeded ones never consult it.
        self._rng = random.Random(seed if seed is not None else int.from_bytes(os.urandom(8), "little"))

    def seed_for(self, params: SamplingParams) -> int:
        """The request's seed, or a fresh one from this sampler's generator if it has none."""
        return params.seed if params.seed is not None else self._rng.getrandbits(63)

    def sample(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int]
    ) -> list[SampledToken]:
        """logits [n, V] (any float dtype) -> one token per row."""
        return self.sample_later(logits, params, output_indices)()

    def sample_later(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int],
        masks: Mapping[int, np.ndarray] | None = None,
    ) -> PendingTokens:
        """The tensor work of ``sample`` now (on a GPU: queued behind the forward), and a call that
        makes the one transfer and the tokens: an engine overlapping steps makes it after its host
        work for the previous step, so that work runs while the device computes this one.
        ``masks``: row -> the tokens that row may pick (a grammar's int32 bitmask, bit t of word
        t // 32 for token t); logprobs stay those of the unmasked distribution."""
        n = logits.shape[0]
        if n != len(params) or n != len(output_indices):
            raise ValueError(f"{n} logit rows but {len(params)} params and {len(output_indices)} output indices")
        if n == 0:
            return PendingTokens(list, torch.empty(0, dtype=torch.int64, device=logits.device))
        logits = logits.to(torch.float32)
        logprobs = torch.log_softmax(logits, dim=-1)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        greedy_masks = None
        if masks and logits.device.type == "cpu":  # greedy rows corrected after their argmax
            greedy_masks = {row: mask for row, mask in masks.items() if params[row].greedy}
            masks = {row: mask for row, mask in masks.items() if not params[row].greedy}
        if masks:
            logits = masked_logits(logits, masks)
        if len(random_rows) == n:  # every row samples: no argmax to overwrite
            chosen = self._sample_rows(logits, params, output_indices, random_rows)
        else:
            chosen = logits.argmax(dim=-1)
            if greedy_masks:
                correct_greedy(chosen, logits, greedy_masks)
            if random_rows:
                chosen[random_rows] = self._sample_rows(logits, params, output_indices, random_rows)
        # One transfer for ids and their logprobs (on a GPU each transfer waits for the device):
        # float64 holds both exactly, ids being below 2**53 and the logprobs float32.
        chosen_logprobs = logprobs.gather(1, chosen[:, None]).squeeze(1)
        both = torch.stack((chosen.double(), chosen_logprobs.double()))

        def tokens() -> list[SampledToken]:
            ids_row, logprob_row = both.tolist()
            chosen_ids = list(map(int, ids_row))
            with torch.inference_mode():
                top = self._top_logprobs(logprobs, params)
            if top is None:
                return [SampledToken(token_id, logprob) for token_id, logprob in zip(chosen_ids, logprob_row, strict=True)]
            return [SampledToken(chosen_ids[i], logprob_row[i], top[i]) for i in range(n)]

        return PendingTokens(tokens, chosen)

    def _sample_rows(
        self, logits: torch.Tensor, params: Sequence[SamplingParams], output_indices: Sequence[int], rows: list[int]
    ) -> torch.Tensor:
        device = logits.device
        every_row = len(rows) == logits.shape[0]
        chosen_params = params if every_row else [params[i] for i in rows]
        probs = request_probs(logits if every_row else logits[rows], chosen_params)
        # unseeded rows draw their seeds in row order, as one uniform_for call per row did
        seeds = [p.seed if p.seed is not None else self._rng.getrandbits(63) for p in chosen_params]
        uniforms = uniforms_for(seeds, output_indices if every_row else [output_indices[i] for i in rows])
        return inverse_cdf(probs, torch.from_numpy(uniforms).to(device=device, dtype=torch.float32))

    @staticmethod
    def _top_logprobs(logprobs: torch.Tensor, params: Sequence[SamplingParams]) -> list[tuple[tuple[int, float], ...]] | None:
        """Each row's ``params.logprobs`` best; None when no row asks for any."""
        rows = [i for i, p in enumerate(params) if p.logprobs > 0]
        if not rows:
            return None
        out: list[tuple[tuple[int, float], ...]] = [()] * len(params)
        most = min(max(params[i].logprobs for i in rows), logprobs.shape[1])
        values, ids = logprobs[rows].topk(most, dim=-1)
        for i, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
            n = params[i].logprobs
            out[i] = tuple(zip(row_ids[:n], row_values[:n], strict=True))
        return out
