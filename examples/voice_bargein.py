"""A voice assistant's loop, with speech simulated: the answer is "spoken" at a speaking rate as it
streams, the user barges in at a random moment, the assistant's message is cut to what was
heard, and the next turn reuses the cached prefix of the conversation.

    make serve                                   # in one terminal
    .venv/bin/python examples/voice_bargein.py   # in another

Each turn prints what was spoken and where the user cut in; the last one, heard to the end,
prints its prompt's cached tokens: the conversation so far (cut to what was heard) came from the
edge tier's cache, not from a new prefill.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys

from rtgw import RealtimeClient, Turn

SPEAKING_RATE = 15.0  # characters per second, about 150 words a minute
QUESTIONS = [
    "Tell me about the history of lighthouses.",
    "Why did they use lenses?",
    "And what replaced the keepers?",
    "Thanks. One more fact, please.",
]


async def speak(turn: Turn, interrupt_after_s: float, rate: float) -> tuple[str, bool]:
    """Play the streamed text at ``rate``; stop when the user cuts in. (what was heard, cut in?)"""
    heard = ""
    loop = asyncio.get_running_loop()
    started = loop.time()
    async for delta in turn:
        for char in delta.text:
            now = loop.time() - started
            due = len(heard) / rate
            if due > interrupt_after_s:
                return heard, True
            if due > now:
                await asyncio.sleep(due - now)
            heard += char
            print(char, end="", flush=True)
    return heard, False


async def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--model", default=None, help="default: the gateway's (the cascade)")
    parser.add_argument("--turns", type=int, default=len(QUESTIONS))
    parser.add_argument("--rate", type=float, default=SPEAKING_RATE, help="spoken characters per second")
    parser.add_argument("--seed", type=int, default=None, help="where the user cuts in")
    parser.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the gateway's)")
    args = parser.parse_args(argv)
    rng = random.Random(args.seed)
    async with RealtimeClient(args.url, api_key=args.api_key, model=args.model,
                              instructions="You are a friendly voice assistant. Answer in a few sentences.") as client:
        for n, question in enumerate((QUESTIONS * args.turns)[: args.turns]):
            print(f"\nuser> {question}\nassistant> ", end="", flush=True)
            last = n == args.turns - 1
            turn = await client.send(question, max_output_tokens=40 if last else 120, temperature=args.temperature)
            # The user cuts in after 1 to 4 s of speech; the last answer is heard to the end.
            cut_at = float("inf") if last else rng.uniform(1.0, 4.0)
            heard, cut_in = await speak(turn, cut_at, args.rate)
            if cut_in:
                result = await client.interrupt(heard_chars=len(heard))
                print(f" [user cut in after {cut_at:.1f} s: kept {len(heard)} characters]")
            else:
                result = await turn.result()
                print()
            assert result is not None
            if result.status == "cancelled":  # the engine never reported the prompt of a cut-off turn
                print(f"  turn {n + 1}: cancelled, tier {result.tier or '?'}")
            else:
                print(f"  turn {n + 1}: {result.status}, tier {result.tier or '?'}, prompt "
                      f"{result.usage.get('input_tokens', 0)} tokens, cached {result.cached_tokens}")
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
