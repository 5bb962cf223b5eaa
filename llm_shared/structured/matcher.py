"""One sequence's position in its grammar, and the row of the token bitmask (bitmask.py) that
applies it to logits. Filling a row drops the GIL in llguidance, so a tier can compute the next
step's masks on a thread while the model runs.

A matcher given a token budget (the request's ``max_tokens``) also makes the answer end within it:
once the budget left is no more than a way to close the answer (``closing.closing_tokens``) plus
EOS and twice a margin, its mask allows only that way's next token, so a model that loops inside
a JSON document ends it valid instead of being cut mid-document. The way is looked for only near
the end of the budget (from ``watch_from`` tokens left), a few times as the slack shrinks.

EOS is handled here, not by llguidance: once a grammar is complete llguidance stops and will not
consume EOS (``validate_tokens([eos])`` is 0 even though its mask allows it), so EOS is accepted
when the matcher is accepting and remembered as a flag, which a rollback undoes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
from numpy.typing import NDArray

from llm_shared.structured.bitmask import allow_only, bitmask_words
from llm_shared.structured.closing import MAX_CLOSE_STEPS, ByteTokens, closing_tokens

if TYPE_CHECKING:
    import llguidance

CLOSE_MARGIN = 8  # tokens a closing may grow by before the next look (one token can open `[{"`)
MIN_WATCH = 64  # budget left from which closings are looked for, at least


@dataclass(frozen=True)
class Budget:
    """A sequence's token budget and what the matcher needs to close its answer within it."""

    max_tokens: int  # output tokens, EOS included (the request's max_tokens)
    tokens: ByteTokens  # the model's byte tokens, for the closing walk
    shortest: int  # tokens of the grammar's shortest answer: the first look's closing, known in advance

    @property
    def watch_from(self) -> int:
        return watch_from(self.shortest)

    @property
    def margin(self) -> int:
        return closing_margin(self.shortest)


def closing_margin(shortest: int | None) -> int:
    """Tokens a closing is given to spare, beyond itself and its EOS, before it is forced: twice
    ``CLOSE_MARGIN`` for content written between looks, and the grammar's shortest answer, for a
    structure opened between looks (an object with required fields: ``"more": {`` commits the
    answer to all of them, a closing longer by about a whole answer)."""
    return 2 * CLOSE_MARGIN + (shortest or 0)


def watch_from(shortest: int | None) -> int:
    """Budget left from which a sequence looks for a way to close its answer: the grammar's
    shortest answer twice and the margin (``closing_margin``), at least MIN_WATCH (a document that
    needs long to close starts early)."""
    return max(MIN_WATCH, 2 * (shortest or 0) + closing_margin(shortest))


class SequenceMatcher:
    """A matcher for one sequence. Not thread-safe; one per sequence (a cheap copy of the compiled
    grammar's pristine matcher, see ``GrammarCompiler.matcher``)."""

    def __init__(self, matcher: llguidance.LLMatcher, *, eos_id: int, vocab_size: int,
                 budget: Budget | None = None) -> None:
        self._m = matcher
        self._eos = eos_id
        self._words = bitmask_words(vocab_size)
        self._consumed = 0  # tokens given to llguidance (EOS never is): the most a rollback can undo
        self._terminated = False  # EOS accepted
        self._budget = budget
        # The latest way to close the answer, found with `_plan_from` tokens consumed. The matcher
        # is on it while every token since then is the plan's next one (`_off_at`: where one was
        # not), so a speculation's accept-and-roll-back keeps it without walking again.
        self._plan: list[int] | None = None
        self._plan_from = 0
        self._off_at: int | None = None
        self._force = False  # the plan was found within the margin: only it is allowed
        self._next_look = 0  # tokens consumed at which to look for a closing next
        if budget is not None:  # the closing from the start is the grammar's shortest answer: look
            # first within watch_from of the end, and after half the slack that closing leaves
            slack = budget.max_tokens - (budget.shortest + 1 + budget.margin)
            self._next_look = max(budget.max_tokens - budget.watch_from, slack // 2, 0)

    @property
    def is_terminated(self) -> bool:
        """EOS was accepted: the sequence is over and no token is allowed."""
        return self._terminated

    @property
    def accepts_eos(self) -> bool:
        """The output so far is a complete answer, so EOS is allowed now."""
        return not self._terminated and self._m.is_accepting()

    @property
    def error(self) -> str | None:
        """Why the matcher can go no further (a per-step limit was hit), or None. After an error
        the mask allows only EOS; the tier ends the sequence and reports it."""
        if not self._m.is_error():
            return None
        return self._m.get_error() or "the grammar matcher stopped"

    @property
    def num_tokens(self) -> int:
        """Tokens accepted so far, EOS included."""
        return self._consumed + self._terminated

    def fill_bitmask(self, row: NDArray[np.int32]) -> None:
        """Write the allowed next tokens into ``row`` ([words] int32, C-contiguous, e.g. one row of
        ``allocate_bitmask``)."""
        if row.dtype != np.int32 or row.ndim != 1 or row.shape[0] != self._words or not row.flags.c_contiguous:
            raise ValueError(f"a bitmask row must be a contiguous int32 vector of {self._words} words")
        if self._terminated:
            allow_only(row, self._eos)
            return
        forced = self._forced()
        if forced is not None:
            allow_only(row, forced[0])
            return
        self._m.unsafe_compute_mask_ptr(row.ctypes.data, row.nbytes)

    def accept(self, token_id: int) -> bool:
        """Advance by ``token_id`` if the grammar allows it; False (and no change) if not."""
        if self._terminated:
            return False
        if token_id == self._eos:
            if not self._m.is_accepting():
                return False
            self._terminated = True
            return True
        # try_consume_tokens, unlike consume_token, leaves the matcher as it was on a refusal
        # (consume_token would put it in its error state for good).
        if self._m.try_consume_tokens([token_id]) != 1:
            return False
        if self._plan is not None and self._off_at is None:
            i = self._consumed - self._plan_from
            if i >= len(self._plan) or self._plan[i] != token_id:
                self._off_at = self._consumed
        self._consumed += 1
        return True

    def rollback(self, n: int) -> None:
        """Undo the last ``n`` accepted tokens (speculation's rejected drafts, a cascade's unverified
        tokens)."""
        if n < 0 or n > self.num_tokens:
            raise ValueError(f"cannot roll back {n} tokens: {self.num_tokens} were accepted")
        if n and self._terminated:
            self._terminated = False
            n -= 1
        if n:
            if not self._m.rollback(n):
                raise RuntimeError(f"llguidance refused to roll back {n} tokens: {self._m.get_error()}")
            self._consumed -= n
            if self._off_at is not None and self._consumed <= self._off_at:
                self._off_at = None  # back on the plan
            if self._plan is not None and self._consumed < self._plan_from:  # before the plan: look again
                self._plan, self._force, self._next_look = None, False, self._consumed

    def valid_prefix_len(self, draft: Sequence[int]) -> int:
        """How many leading tokens of ``draft`` the grammar allows from here (an EOS counts when the
        tokens before it complete the answer). Changes nothing: speculation cuts its draft to this
        length before verifying it."""
        if self._terminated or not draft:
            return 0
        forced = self._forced()
        if forced is not None:  # closing for the budget: only the closing's tokens, then EOS
            return next((i for i, (a, b) in enumerate(zip(draft, forced, strict=False)) if a != b),
                        min(len(draft), len(forced)))
        tokens = list(draft)
        head = tokens[: tokens.index(self._eos)] if self._eos in tokens else tokens
        n = self._m.validate_tokens(head) if head else 0
        if n < len(head) or len(head) == len(tokens):
            return n
        # every token before the EOS is allowed: the EOS is, if they leave the answer complete
        if not self._m.consume_tokens(head):
            raise RuntimeError(f"llguidance refused tokens it had validated: {self._m.get_error()}")
        complete = self._m.is_accepting()
        self._m.rollback(len(head))
        return n + 1 if complete else n

    def fill_draft_bitmasks(self, draft: Sequence[int], bitmask: NDArray[np.int32], first_row: int = 0) -> int:
        """The masks speculation verifies a draft under: row ``first_row + i`` is the mask for the
        token after ``draft[:i]``, for i = 0 .. the draft's valid prefix (k+1 rows for a valid draft
        of k tokens; none after an EOS). Returns the rows written; the matcher ends where it began."""
        valid = list(draft[: self.valid_prefix_len(draft)])
        self.fill_bitmask(bitmask[first_row])
        rows = 1
        for token in valid:
            if token == self._eos:
                break
            self.accept(token)
            self.fill_bitmask(bitmask[first_row + rows])
            rows += 1
        self.rollback(rows - 1)
        return rows

    # --- the budget ---------------------------------------------------------------------------

    def _forced(self) -> list[int] | None:
        """The tokens the budget forces from here (the closing, then EOS), or None: the model
        chooses. Looks for a closing when one is due: at the first step within ``watch_from`` of
        the end, then after half the slack the last look left (tokens to spare beyond the
        closing, its EOS and twice the margin), so a sequence far from its end looks a few times;
        once the slack is gone the closing is forced, and followed it needs no more looks."""
        budget = self._budget
        if budget is None or self._terminated:
            return None
        left = budget.max_tokens - self._consumed  # output slots left, the EOS's among them
        if left > budget.watch_from:
            return None
        on_plan = self._plan is not None and self._off_at is None
        if self._m.is_accepting():  # complete: a forced closing ends here; anything else (text) runs on
            return [self._eos] if self._force and on_plan else None
        if on_plan and self._force:
            assert self._plan is not None
            return [*self._plan[self._consumed - self._plan_from:], self._eos]
        if self._consumed < self._next_look:
            return None
        if on_plan:  # the model followed the plan by itself: its rest is still a way to close
            assert self._plan is not None
            closing: list[int] | None = self._plan[self._consumed - self._plan_from:]
        else:
            # a closing longer than ~6 bytes a token left could not fit: stop the walk there
            closing = closing_tokens(self._m, budget.tokens, max_steps=min(MAX_CLOSE_STEPS, 6 * left))
        if closing is None or len(closing) + 1 > left:
            # no way found, or none that fits: nothing to force; the answer may be cut by max_tokens
            self._plan, self._force, self._next_look = None, False, budget.max_tokens
            return None
        self._plan, self._plan_from, self._off_at = closing, self._consumed, None
        slack = left - (len(closing) + 1 + budget.margin)
        if slack > 0:
            self._force, self._next_look = False, self._consumed + max(1, slack // 2)
            return None
        self._force = True
        return [*closing, self._eos]
