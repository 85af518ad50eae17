"""word-guess: find a hidden five-letter word in six guesses, from per-letter feedback (multi-turn state).

Each `guess` returns one mark per letter: `G` for the right letter in the right place, `Y` for a letter
that is in the word elsewhere, `.` for a letter that is not (or not that many times: duplicates are
marked as many times as the word has them, exact matches first). The state (the secret, the guesses so
far) lives on the instance across the turns of a rollout. Reward: 0 when unsolved; when solved,
1 - (guesses used - 1) / (2 * max_guesses), so a faster solve scores higher (1.0 down to about 0.58).
The secret comes from `seed` (a group shares it when its rows share the seed).
"""

from __future__ import annotations

import random
from typing import Any

from environments.base import Environment
from environments.manifest import Manifest

WORDS = tuple(
    """
    about above actor adapt admit adopt after again agent agree ahead alarm album alert alike alive allow
    alone along alter among angle angry apart apple apply arena argue arise array aside asset audio avoid
    award aware badly basic beach begin being below bench birth black blade blame blank blind block blood
    board boost brain brand bread break brick brief bring broad brown build buyer cable carry catch cause
    chain chair chart chase cheap check chest chief child civil claim class clean clear climb clock close
    cloud coach coast count court cover craft crash cream crime cross crowd cycle daily dance death delay
    depth doubt draft drama dream dress drink drive early earth eight empty enemy enjoy enter entry equal
    error event exact exist extra faith false fault fence field fifty fight final first flash fleet floor
    focus force frame fresh front fruit funny ghost giant given glass globe grace grade grain grand grant
    grass great green group guard guess guide happy heart heavy horse hotel house human ideal image index
    inner input issue joint judge knife label labor large laser later laugh layer learn lemon level light
    limit local logic loose lucky lunch magic major maker march match maybe mayor metal meter minor model
    money month moral motor mouse mouth movie music nerve never night noise north novel nurse ocean offer
    often order other owner paint panel paper party peace phase phone photo piano piece pilot pitch place
    plain plane plant plate point pound power press price pride prime print prize proof proud quick quiet
    radio raise range rapid ratio reach ready river robot rough round route royal rural scale scene scope
    score sense serve seven shape share sharp sheet shelf shell shift shirt shock shoot short sight skill
    sleep slice slide small smart smile smoke solid solve sound south space spare speak speed spend sport
    staff stage stand start state steam steel stick still stock stone store storm story study style sugar
    table taste teach thank theme thick thing think third throw tiger title today topic total touch tough
    tower track trade train treat trend trial truck trust truth twice uncle under union unity until upper
    urban usage usual valid value video visit vital voice waste watch water wheel where which while white
    whole woman world worry write wrong young youth
    """.split()  # noqa: SIM905 - a block of words reads better than 400 quoted strings
)


def feedback(guess: str, secret: str) -> str:
    """Per-letter marks for a guess (G right place, Y elsewhere in the word, . absent or used up)."""
    marks = ["."] * len(guess)
    remaining: dict[str, int] = {}
    for i, (g, s) in enumerate(zip(guess, secret, strict=True)):
        if g == s:
            marks[i] = "G"
        else:
            remaining[s] = remaining.get(s, 0) + 1
    for i, g in enumerate(guess):
        if marks[i] == "." and remaining.get(g, 0) > 0:
            marks[i] = "Y"
            remaining[g] -= 1
    return "".join(marks)


class WordGuessEnv(Environment):
    """Guess the hidden word."""

    manifest = Manifest(
        name="word-guess",
        version="1.0.0",
        description="Find a hidden five-letter word in six guesses from per-letter feedback; state carries "
        "across turns.",
        tools=("guess",),
        tool_timeout_s=5.0,
        reward_names=("solved",),
    )

    def reset(
        self, seed: int | None = None, secret: str | None = None, max_guesses: int = 6, **row: Any
    ) -> str:
        self.secret = (secret or random.Random(seed).choice(WORDS)).lower()
        self.max_guesses = max_guesses
        self.guesses: list[str] = []
        self.solved = False
        return (
            f"Find the hidden five-letter English word in at most {max_guesses} guesses. Call guess with a "
            "word; for each letter you get G (right letter, right place), Y (in the word, elsewhere) or . "
            "(not in the word)."
        )

    def guess(self, word: str) -> str:
        """Guess the hidden word and get feedback for each letter.

        Args:
            word: A five-letter English word.
        """
        if self.solved or len(self.guesses) >= self.max_guesses:
            return "The game is over: no more guesses."
        word = word.strip().lower()
        if len(word) != 5 or not word.isalpha() or not word.isascii():
            raise ValueError(f"{word!r} is not a five-letter word; guess a word of exactly five letters a-z")
        self.guesses.append(word)
        marks = feedback(word, self.secret)
        if word == self.secret:
            self.solved = True
            return f"{word.upper()} {marks}: solved in {len(self.guesses)} guesses!"
        left = self.max_guesses - len(self.guesses)
        return (
            f"{word.upper()} {marks}; {left} guesses left" if left else f"{word.upper()} {marks}; game over"
        )

    def get_reward(self) -> float:
        if not self.solved:
            return 0.0
        return 1.0 - (len(self.guesses) - 1) / (2 * self.max_guesses)
