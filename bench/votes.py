"""Votes that count: how often a group's majority vote finds the answer most members gave,
and how accurate it is, per comparison (exact text, extracted value, embeddings clusters),
beside one sampled member and greedy decoding, in one run.

Five SmolLM2 members sample (temperature 0.8, each its own fixed seed: every group that asks
them gets the same answers) on 20 short-answer questions: capitals, arithmetic, yes/no.
Groups, all fan_out with selector majority over the five:
  exact        the answers' normalized text
  similar      clusters of all-MiniLM-L6-v2 embeddings (a sentence-embedding model, converted
               by tests/minilm_gguf.py; --embeddings --pooling mean) of the whole answers,
               per --thresholds; answers that end on different numbers or open with a
               different yes/no never cluster (distinct_numbers, distinct_yes_no: the default)
  unguarded    the same without distinct_numbers and distinct_yes_no
  short        the same over the answers to "Answer in as few words as you can."
  first        the same over the answers' first sentences (extract first_sentence + similar)
  line         the members asked for a last line "Answer: <answer>" (as `format`); one
               regex for every question reads that line's text, which is embedded
               (--line: SmolLM2-135M rarely writes that line, so this finds nothing)
  short-extract  `extract`'s regexes over the answers to "Answer in as few words as you can."
  extract      a regex per kind of question (a council for sums extracts the number) over
               the answers to "Answer the question briefly."
  format       as docs/votes.md tells users: the system prompt asks for a last line
               "Answer: <answer>"; the regex reads that line, else what `extract` reads
  json         the members answer JSON under the group's response_format; $.answer is the vote
A grader, independent of corral, reads what each answer carries (the capital it names first,
the number it gives as the result, its first yes/no). "Majority present": at least 3 of the 5
answers carry the same thing; "found": the vote's winning bloc has at least 3 answers and its
answer carries that thing.

    python bench/votes.py [--threshold 0.9] [--questions 20]
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import time
from collections import Counter
from typing import Any

import httpx

from _harness import REPO, code_note, corral, machine_note
from minilm_gguf import write_minilm_gguf

SMOL = REPO / "models" / "SmolLM2-135M-Instruct.Q4_1.gguf"
MINILM = REPO / "models" / "all-MiniLM-L6-v2.F16.gguf"
MEMBERS = [f"s{n}" for n in range(1, 6)]
SYSTEM = "Answer the question briefly."
SYSTEM_SHORT = "Answer in as few words as you can."
SYSTEM_FORMAT = ("Answer the question briefly. End with a last line of the form "
                 "'Answer: <answer>', the answer alone: a name, a number, yes or no.")
QUESTIONS: list[tuple[str, str, str]] = [  # kind, question, answer
    ("capital", "What is the capital of France?", "Paris"),
    ("capital", "What is the capital of Japan?", "Tokyo"),
    ("capital", "What is the capital of Italy?", "Rome"),
    ("capital", "What is the capital of Germany?", "Berlin"),
    ("capital", "What is the capital of Spain?", "Madrid"),
    ("capital", "What is the capital of Russia?", "Moscow"),
    ("capital", "What is the capital of Egypt?", "Cairo"),
    ("capital", "What is the capital of the United Kingdom?", "London"),
    ("sum", "What is 7 + 5?", "12"),
    ("sum", "What is 3 + 4?", "7"),
    ("sum", "What is 10 + 10?", "20"),
    ("sum", "What is 9 - 3?", "6"),
    ("sum", "What is 2 * 3?", "6"),
    ("sum", "What is 15 + 5?", "20"),
    ("yesno", "Is the sun a star? Answer yes or no.", "yes"),
    ("yesno", "Is water wet? Answer yes or no.", "yes"),
    ("yesno", "Can fish fly to the moon? Answer yes or no.", "no"),
    ("yesno", "Is ice cold? Answer yes or no.", "yes"),
    ("yesno", "Is a cat a plant? Answer yes or no.", "no"),
    ("yesno", "Is Paris in France? Answer yes or no.", "yes"),
]
# What a council for each kind of question extracts (the first group that took part).
CITY = r"[A-Z][a-z]+(?:[ -][A-Z][a-z]+)?"
REGEX = {
    # "The capital of X is Y", "Y is the capital", "It is Y", "Y." / "Le Grand Y ...".
    "capital": rf"capital(?: city)? of [\w ]+? is (?:the city of )?({CITY})"
               rf"|({CITY}),? (?:is|as|serves as) (?:the|its) capital"
               rf"|\b(?:is|called|named|in)\s+({CITY})\b|^\W*({CITY})\W*$",
    "sum": r"(?:[=:]|\bis|\bequals)\s*(-?\d+)|^\D*(-?\d+)\D*$",
    "yesno": r"(?i)\b(yes|no)\b",
}
# Asked for "Answer: <answer>": that line's value (the last such line), else the free-text
# regex. (?s) lets .* reach the last "Answer:"; at the start of the text that alternative
# comes first, so a formatted answer is read by its line.
FORMAT_VALUE = {"capital": CITY, "sum": r"-?\d+", "yesno": r"(?i:yes|no)"}
FORMAT_REGEX = {
    kind: rf"(?s)\A.*\b(?i:answer):\W*({FORMAT_VALUE[kind]})\b|"
          + re.sub(r"^\(\?i\)(.*)$", r"(?i:\1)", REGEX[kind])  # (?i) only leads a regex
    for kind in REGEX}
# The `line` groups: whatever follows the last "Answer:", for every kind of question alike.
ANSWER_LINE = r"(?s)\A.*\b(?i:answer):[ \t]*([^\n]*\S)"
# The similar families: (system prompt, what of an answer is embedded, more `similar` keys).
# `unguarded`: the whole answers without distinct_numbers and distinct_yes_no, to measure them.
UNGUARDED = {"distinct_numbers": False, "distinct_yes_no": False}
SIMILAR: dict[str, tuple[str, dict[str, Any] | None, dict[str, Any]]] = {
    "unguarded": (SYSTEM, None, UNGUARDED),
    "similar": (SYSTEM, None, {}),
    "short": (SYSTEM_SHORT, None, {}),
    "first": (SYSTEM, {"first_sentence": True}, {}),
}
LINE = ("line", (SYSTEM_FORMAT, {"regex": ANSWER_LINE}, {}))
ANSWER_SCHEMA = {"type": "json_schema", "json_schema": {"name": "answer", "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "maxLength": 40}},
    "required": ["answer"]}}}
# The grader's cities: every expected capital and the usual wrong guesses.
CITIES = ["Paris", "Tokyo", "Rome", "Berlin", "Madrid", "Moscow", "Cairo", "London", "Lyon",
          "Marseille", "Kyoto", "Osaka", "Milan", "Venice", "Munich", "Hamburg", "Barcelona",
          "Seville", "Saint Petersburg", "Alexandria", "Giza", "Manchester", "Edinburgh",
          "Washington", "Beijing", "Vienna", "Brussels", "Amsterdam", "Lisbon", "Athens"]


def carried(kind: str, text: str) -> str | None:
    """What an answer carries, as the bench's grader reads it (not corral's regex)."""
    if kind == "capital":
        found = [(m.start(), city.lower()) for city in CITIES
                 if (m := re.search(rf"\b{city}\b", text, re.IGNORECASE))]
        return min(found)[1] if found else None
    if kind == "sum":
        result = re.search(r"(?:[=:]|\bis|\bequals)\s*(-?\d+)", text)
        numbers = re.findall(r"-?\d+", text)
        return result.group(1) if result else numbers[-1] if len(numbers) == 1 else None
    word = re.search(r"(?i)\b(yes|no)\b", text)
    return word.group(1).lower() if word else None


def json_answer(text: str) -> str:
    try:
        value = json.loads(text).get("answer")
    except (ValueError, AttributeError):
        return ""
    return value if isinstance(value, str) else ""


def ask(question: str, system: str, max_tokens: int) -> dict[str, Any]:
    return {"messages": [{"role": "system", "content": system},
                         {"role": "user", "content": question}], "max_tokens": max_tokens}


def config(thresholds: list[float],
           similar: dict[str, tuple[str, dict[str, Any] | None, dict[str, Any]]]
           ) -> tuple[dict[str, Any], dict[str, Any]]:
    models: dict[str, Any] = {
        name: {"model": str(SMOL), "ctx": 1024,
               "request": {"set": {"temperature": 0.8, "seed": seed}}}
        for seed, name in enumerate(MEMBERS, 11)}
    models["greedy"] = {"model": str(SMOL), "ctx": 1024, "request": {"set": {"temperature": 0}}}
    models["embed"] = {"model": str(MINILM), "ctx": 512, "embeddings": True,
                       "args": ["--pooling", "mean"]}
    majority = {"models": MEMBERS, "type": "fan_out", "selector": "majority",
                "member_timeout": 300}
    groups = {
        "exact": majority,
        **{f"{family}-{t:g}": {**majority, "compare": {
            "similar": {"model": "embed", "threshold": t, **options},
            **({"extract": extract} if extract else {})}}
           for family, (_, extract, options) in similar.items() for t in thresholds},
        **{f"extract-{kind}": {**majority, "compare": {"extract": {"regex": regex}}}
           for kind, regex in REGEX.items()},
        **{f"short-extract-{kind}": {**majority, "compare": {"extract": {"regex": regex}}}
           for kind, regex in REGEX.items()},
        **{f"format-{kind}": {**majority, "compare": {"extract": {"regex": regex}}}
           for kind, regex in FORMAT_REGEX.items()},
        "json": {**majority, "compare": {"extract": {"json_path": "$.answer"}},
                 "response_format": ANSWER_SCHEMA},
    }
    return models, groups


class Score:
    def __init__(self) -> None:
        self.present = self.found = self.right = self.questions = self.mixed = 0
        self.clean = 0  # found by a bloc that mixes no answers
        self.member_right: list[float] = []
        # kind of question -> [majority present, found, winning bloc mixes, questions]
        self.kinds: dict[str, list[int]] = {}

    def add(self, kind: str, expected: str, answers: list[str], chosen: str,
            bloc: list[int]) -> None:
        """`bloc`: the members of the vote's winning bloc."""
        graded = [carried(kind, a) for a in answers]
        top = Counter(g for g in graded if g is not None).most_common(1)
        agree = len(bloc)
        self.questions += 1
        # A bloc is only a majority of one answer if its members carry one answer: a loose
        # comparison finds "majorities" by lumping different answers together.
        mixed = len({graded[i] for i in bloc} - {None}) > 1
        self.mixed += mixed
        present = bool(top) and top[0][1] >= 3
        found = present and agree >= 3 and carried(kind, chosen) == top[0][0]
        self.present += present
        self.found += found
        self.clean += found and not mixed
        counts = self.kinds.setdefault(kind, [0, 0, 0, 0])
        for n, value in enumerate((present, found, mixed, True)):
            counts[n] += value
        self.right += carried(kind, chosen) == expected.lower()
        self.member_right.append(sum(g == expected.lower() for g in graded) / len(graded))

    def line(self, name: str) -> str:
        found = f"{self.found}/{self.present}" + (
            f" ({100 * self.found / self.present:.0f} %)" if self.present else "")
        return (f"  {name:13} majority present {self.present:2}/{self.questions}, found "
                f"{found:12} of which unmixed {self.clean:2}, vote right {self.right:2}/"
                f"{self.questions}, one sampled member right "
                f"{sum(self.member_right):4.1f}/{self.questions}, winning bloc mixes answers "
                f"{self.mixed:2}/{self.questions}")

    def by_kind(self, name: str) -> str:
        return f"  {name:13} " + " | ".join(
            f"{kind} found {p and f'{f}/{p}':5} mixes {m}/{n}"
            for kind, (p, f, m, n) in self.kinds.items())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--thresholds", default="0.5,0.6,0.7,0.8,0.9",
                        help="the similar groups' cosine thresholds, comma-separated")
    parser.add_argument("--questions", type=int, default=len(QUESTIONS))
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--verbose", action="store_true", help="print every answer and vote")
    parser.add_argument("--line", action="store_true",
                        help="also the `line` groups (similar over an 'Answer:' line's text)")
    args = parser.parse_args()
    assert SMOL.is_file(), f"{SMOL} missing: `make demo-model`"
    if not MINILM.is_file():
        write_minilm_gguf(MINILM)
    thresholds = [float(t) for t in args.thresholds.split(",")]
    similar = dict([*SIMILAR.items(), *([LINE] if args.line else [])])
    models, groups = config(thresholds, similar)
    names = ["exact", "extract", "format", "short-extract",
             *(f"{family}-{t:g}" for family in similar for t in thresholds), "json"]
    # Groups whose members are asked another way.
    prompted = {"format": SYSTEM_FORMAT, "short-extract": SYSTEM_SHORT,
                **{f"{family}-{t:g}": system for family, (system, _, _) in similar.items()
                   if system != SYSTEM for t in thresholds}}
    scores = {name: Score() for name in names}
    greedy_right = 0
    changed = 0
    started = time.monotonic()
    with corral(models, groups=groups, policy={"max_loaded": len(models)}) as url, \
            httpx.Client(base_url=url, timeout=600) as client:
        for name in models:
            client.post(f"/admin/models/{name}/load")
        for kind, question, expected in QUESTIONS[:args.questions]:
            results = {}
            for name in names:
                group = f"{name}-{kind}" if name in ("extract", "format", "short-extract") \
                    else name
                reply = client.post("/v1/batch/execute", json={
                    **ask(question, prompted.get(name, SYSTEM), args.max_tokens),
                    "group": group})
                assert reply.status_code == 200, reply.text
                results[name] = reply.json()
            for name, result in results.items():
                answers = [m["content"] or "" for m in result["responses"]]
                chosen = result["final"]
                if name == "json":
                    answers, chosen = [json_answer(a) for a in answers], json_answer(chosen)
                scores[name].add(kind, expected, answers, chosen,
                                 result["vote"]["blocs"][0]["members"]
                                 if result["vote"]["blocs"] else [])
                if args.verbose:
                    vote = result["vote"]
                    print(f"{question} [{name}] votes {[v['vote'] for v in vote['votes']]}"
                          f" blocs {[b['members'] for b in vote['blocs']]} -> "
                          f"{chosen!r}\n    " + "\n    ".join(repr(a) for a in answers))
            texts = [[m["content"] for m in results[n]["responses"]]
                     for n in names if n != "json" and n not in prompted]
            changed += any(t != texts[0] for t in texts)
            alone = client.post("/v1/chat/completions", json={
                **ask(question, SYSTEM, args.max_tokens), "model": "greedy"})
            greedy = alone.json()["choices"][0]["message"]["content"]
            greedy_right += carried(kind, greedy) == expected.lower()
    asked = min(args.questions, len(QUESTIONS))
    print(f"votes: {asked} questions, 5 SmolLM2 members sampled (temperature 0.8, fixed "
          f"seeds), {time.monotonic() - started:.0f} s")
    for name, score in scores.items():
        print(score.line(name))
    print("  (majority present: >= 3 of 5 answers carry the same answer, as the bench's grader "
          "reads them;\n   found: the vote's winning bloc has >= 3 answers and carries it;\n"
          "   mixes answers: the winning bloc's answers carry different things;\n"
          "   unmixed: found by a winning bloc that mixes none)")
    print("  by kind of question (found: of the majorities present; mixes: of the questions)")
    for name, score in scores.items():
        print(score.by_kind(name))
    free = statistics.mean(scores["exact"].member_right) * asked
    print(f"  greedy decoding right {greedy_right}/{asked}; one sampled member (free text) "
          f"right {free:.1f}/{asked}")
    if changed:
        print(f"  note: on {changed} questions the members' free-text answers differed "
              "between groups (sampling not reproducible there)")
    print(f"  {code_note()}\n  {machine_note()}")


if __name__ == "__main__":
    main()
