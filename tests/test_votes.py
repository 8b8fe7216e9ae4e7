"""Votes that count: answers compared by extracted value (regex, JSON path, last line) or by
embeddings clusters, ties, quorums under strict and partial, the metrics, `corral check`.

One daemon for the module, its members real SmolLM2 children: most answer a fixed text (a
GBNF grammar set per member, so a vote's outcome is known), three answer freely under the
group's response_format; the embeddings model is all-MiniLM-L6-v2 (a real sentence-embedding
model, converted by tests/minilm_gguf.py) under --embeddings --pooling mean."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from corral.proxy import votes
from corral.proxy.groups import GroupOutcome, GroupRunner, MemberResult, agreement_note
from corral.supervisor.config import GroupSpec, jsonpath, parse_config
from corral.supervisor.config.specs import VoteSpec

from conftest import Corral, CorralFactory
from minilm_gguf import model_dir

HF_PYTHON = Path(__file__).resolve().parents[1] / "build" / "hf-venv" / "bin" / "python"

pytestmark = pytest.mark.expect_log("proxy.group_failed")

# What each fixed member answers, whatever it is asked.
FIXED = {
    "paris-1": "The capital of France is Paris.",
    "paris-2": "Paris is the capital of France.",
    "paris-3": "It's Paris, the French capital.",
    "lyon-1": "The capital of France is Lyon.",  # paris-1's words, another answer
    "lyon-2": "Lyon, I believe.",
    "banana": "Bananas are a yellow fruit rich in potassium.",
    # Two answers that ramble on alike after different first sentences.
    "ramble-paris": "The capital of France is Paris. It has many old museums, busy markets "
                    "and a long river.",
    "ramble-lyon": "The capital of France is Lyon. It has many old museums, busy markets "
                   "and a long river.",
    # One sum said three ways: two results, and one of them in other words.
    "sum-12": "7 + 5 = 12.",
    "sum-13": "7 + 5 = 13.",
    "sum-12b": "The answer is 12.",
}
FREE = {"free-1": "You are a geography teacher.", "free-2": "You answer in one word.",
        "free-3": "You are a helpful assistant."}
CITY = {"extract": {"regex": r"(?i)\b(paris|lyon|bananas)\b"}}
CITY_SCHEMA = {"type": "json_schema", "json_schema": {"name": "city", "schema": {
    "type": "object", "properties": {"answer": {"type": "string", "enum": ["Paris", "Lyon"]}},
    "required": ["answer"]}}}
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def fan(models: list[str], compare: Any = "exact", **extra: Any) -> dict[str, Any]:
    return {"models": models, "type": "fan_out", "selector": "majority", "compare": compare,
            **extra}


GROUPS: dict[str, dict[str, Any]] = {
    "by-text": fan(["banana", "paris-1", "paris-2", "lyon-1"]),
    "by-regex": fan(["banana", "paris-1", "paris-2", "lyon-1"], CITY),
    "tie-lyon-first": fan(["lyon-1", "paris-1", "lyon-2", "paris-2"], CITY),
    "tie-paris-first": fan(["paris-1", "lyon-1", "paris-2", "lyon-2"], CITY),
    "by-meaning": fan(["banana", "paris-1", "lyon-1", "paris-2", "paris-3"],
                      {"similar": {"model": "embed", "threshold": 0.8}}),
    "rambles-whole": fan(["ramble-paris", "ramble-lyon", "paris-2"],
                         {"similar": {"model": "embed", "threshold": 0.8}}),
    "rambles-first": fan(["ramble-paris", "ramble-lyon", "paris-2"],
                         {"extract": {"first_sentence": True},
                          "similar": {"model": "embed", "threshold": 0.8}}),
    "numbers-apart": fan(["sum-12", "sum-13", "sum-12b"],
                         {"similar": {"model": "embed", "threshold": 0.5}}),
    "numbers-unguarded": fan(["sum-12", "sum-13", "sum-12b"],
                             {"similar": {"model": "embed", "threshold": 0.5,
                                          "distinct_numbers": False}}),
    "by-json": fan(list(FREE), {"extract": {"json_path": "$.answer"}},
                   response_format=CITY_SCHEMA),
    "last-line": fan(["lyon-2", "paris-1", "paris-2"], {"extract": {"last_line": True}}),
    "quorum-strict": {"models": ["paris-1", "lyon-2", "banana"], "type": "parallel",
                      "compare": CITY, "quorum": 2},
    "quorum-partial": {"models": ["paris-1", "lyon-2", "banana"], "type": "parallel",
                       "compare": CITY, "quorum": 2, "quorum_fallback": "partial"},
    "quorum-met": {"models": ["paris-1", "banana", "paris-2"], "type": "parallel",
                   "compare": CITY, "quorum": 2},
    "council": {"models": ["paris-1", "banana", "paris-3"], "type": "consensus",
                "synthesizer": "paris-2", "quorum": 2,
                "compare": {"similar": {"model": "embed", "threshold": 0.8}}},
}


@pytest.fixture(scope="module")
def corral(start_corral_module: CorralFactory, smol_model: Path, minilm_model: Path) -> Corral:
    models: dict[str, Any] = {
        name: {"model": str(smol_model), "ctx": 512,
               "request": {"set": {"grammar": f"root ::= {json.dumps(text)}",
                                   "temperature": 0}}}
        for name, text in FIXED.items()}
    models.update({name: {"model": str(smol_model), "ctx": 1024,
                          "request": {"system_prompt": prompt, "set": {"temperature": 0}}}
                   for name, prompt in FREE.items()})
    models["embed"] = {"model": str(minilm_model), "ctx": 512, "embeddings": True,
                       "args": ["--pooling", "mean"]}
    config = {"defaults": {"ttl": 600, "stop_grace": 5}, "models": models,
              "policy": {"max_loaded": len(models)}, "groups": GROUPS}
    return start_corral_module(config)


def batch(corral: Corral, group: str) -> httpx.Response:
    return corral.http.post("/v1/batch/execute", timeout=300, json={
        "group": group, "messages": QUESTION, "max_tokens": 40})


def ok(corral: Corral, group: str) -> dict[str, Any]:
    resp = batch(corral, group)
    assert resp.status_code == 200, resp.text
    result: dict[str, Any] = resp.json()
    return result


# -- with real children ------------------------------------------------------------------------

def test_exact_text_sees_no_agreement_where_the_regex_sees_two_votes(corral: Corral) -> None:
    plain = ok(corral, "by-text")
    assert [m["content"] for m in plain["responses"]] == [
        FIXED["banana"], FIXED["paris-1"], FIXED["paris-2"], FIXED["lyon-1"]]
    vote = plain["vote"]
    assert (vote["compare"], vote["agree"], vote["of"]) == ("exact", 1, 4)
    assert vote["tie"]["size"] == 1 and vote["tie"]["broken_by"] == "first in order"
    assert plain["selected"]["index"] == 0  # every answer alone: the first stands

    result = ok(corral, "by-regex")
    vote = result["vote"]
    assert [v["vote"] for v in vote["votes"]] == ["bananas", "paris", "paris", "lyon"]
    assert (vote["winner"], vote["agree"], vote["of"], vote["share"]) == ("paris", 2, 4, 0.5)
    assert vote["agreement"] == "plurality" and vote["tie"] is None
    assert vote["blocs"][0] == {"vote": "paris", "members": [1, 2], "count": 2}
    assert result["selected"]["index"] == 1 and result["final"] == FIXED["paris-1"]
    assert result["selected"]["reason"].startswith("plurality: 2 of 4 answers agree")
    assert result["complete"] is True


def test_a_tie_is_broken_by_the_group_order_and_reported(corral: Corral) -> None:
    for group, first in (("tie-lyon-first", "lyon"), ("tie-paris-first", "paris")):
        result = ok(corral, group)
        tie = result["vote"]["tie"]
        assert tie["between"] == [first, {"lyon": "paris", "paris": "lyon"}[first]]
        assert (tie["size"], tie["broken_by"], tie["winner"]) == (2, "first in order", first)
        assert result["selected"]["index"] == 0
        assert "tie broken by first in order" in result["selected"]["reason"]


def test_json_path_votes_on_the_answers_the_response_format_shaped(corral: Corral) -> None:
    result = ok(corral, "by-json")
    answers = [json.loads(m["content"])["answer"] for m in result["responses"]]
    assert set(answers) <= {"Paris", "Lyon"}  # the group's response_format reached them all
    vote = result["vote"]
    assert [v["vote"] for v in vote["votes"]] == [a.lower() for a in answers]
    top, count = Counter(a.lower() for a in answers).most_common(1)[0]
    assert (vote["winner"], vote["agree"]) == (top, count) and count >= 2
    chosen = result["responses"][result["selected"]["index"]]["content"]
    assert json.loads(chosen)["answer"].lower() == top


def test_last_line_votes(corral: Corral) -> None:
    result = ok(corral, "last-line")
    assert result["vote"]["winner"] == "lyon, i believe"  # three lines, all different
    assert result["vote"]["tie"]["broken_by"] == "first in order"


# sentence-transformers' pipeline for all-MiniLM-L6-v2 (its modules.json: the BERT model, mean
# pooling over the attention mask, L2 normalisation), run by transformers and torch from the
# Hugging Face venv the command-backend tests use (`make hf`): the reference, apart from corral.
REFERENCE = """
import json, sys, torch
from transformers import AutoModel, AutoTokenizer
folder, texts = sys.argv[1], json.loads(sys.stdin.read())
tokenizer, model = AutoTokenizer.from_pretrained(folder), AutoModel.from_pretrained(folder)
batch = tokenizer(texts, padding=True, truncation=True, return_tensors="pt")
with torch.no_grad():
    hidden = model(**batch).last_hidden_state
mask = batch["attention_mask"].unsqueeze(-1).float()
pooled = (hidden * mask).sum(1) / mask.sum(1)
print(json.dumps(torch.nn.functional.normalize(pooled, dim=1).tolist()))
"""


def test_the_converted_embeddings_model_matches_sentence_transformers(corral: Corral) -> None:
    texts = [*FIXED.values(), "12", "Yes", "Die Hauptstadt ist Berlin, natürlich — ça va?"]
    data = corral.http.post("/v1/embeddings", json={"model": "embed", "input": texts}).json()
    got = [votes._unit(row["embedding"]) for row in data["data"]]
    done = subprocess.run([str(HF_PYTHON), "-c", REFERENCE, str(model_dir())],
                          input=json.dumps(texts), capture_output=True, text=True, timeout=300,
                          env={**os.environ, "HF_HUB_OFFLINE": "1"})
    assert done.returncode == 0, done.stderr
    reference = json.loads(done.stdout)
    for text, vector, expected in zip(texts, got, reference, strict=True):
        assert votes._cos(vector, expected) >= 0.99, text


def test_paraphrases_cluster_apart_from_another_answer(corral: Corral) -> None:
    result = ok(corral, "by-meaning")
    vote = result["vote"]
    assert vote["compare"] == "similar"
    # "The capital of France is Lyon." shares all but one word with paris-1 and still stands
    # apart from the three ways of saying Paris.
    assert [b["members"] for b in vote["blocs"]] == [[1, 3, 4], [0], [2]]
    assert (vote["agree"], vote["of"], vote["agreement"]) == (3, 5, "majority")
    # The bloc speaks through the member closest to its centre: computed here from the
    # embeddings model itself.
    texts = [FIXED[n] for n in ("paris-1", "paris-2", "paris-3")]
    data = corral.http.post("/v1/embeddings", json={"model": "embed", "input": texts}).json()
    units = [votes._unit(row["embedding"]) for row in data["data"]]
    assert min(votes._cos(a, b) for a in units for b in units) >= 0.9
    centre = votes._unit([sum(u[d] for u in units) / 3 for d in range(len(units[0]))])
    closest = [1, 3, 4][max(range(3), key=lambda k: votes._cos(units[k], centre))]
    assert result["selected"]["index"] == closest
    assert result["final"] == result["responses"][closest]["content"]


def test_first_sentences_cluster_where_whole_rambling_answers_mislead(corral: Corral) -> None:
    # Whole answers: the same rambling after "...is Paris." and "...is Lyon." is what the
    # embeddings see (0.87 cosine), and the winning bloc mixes two answers.
    whole = ok(corral, "rambles-whole")["vote"]
    assert whole["compare"] == "similar"
    assert [b["members"] for b in whole["blocs"]] == [[0, 1], [2]]
    # Their first sentences: the two ways of saying Paris agree, Lyon stands apart.
    result = ok(corral, "rambles-first")
    vote = result["vote"]
    assert vote["compare"] == "extract+similar"
    assert [v["vote"] for v in vote["votes"]] == [
        "the capital of france is paris", "the capital of france is lyon",
        "paris is the capital of france"]
    assert [b["members"] for b in vote["blocs"]] == [[0, 2], [1]]
    assert "paris" in result["final"].lower() and "lyon" not in result["final"].lower()


def test_answers_that_end_on_different_numbers_never_agree(corral: Corral) -> None:
    # all-MiniLM-L6-v2 sees "7 + 5 = 12." and "7 + 5 = 13." as one sentence: unguarded, they
    # make one bloc at 0.5.
    mixed = ok(corral, "numbers-unguarded")["vote"]
    assert any({0, 1} <= set(b["members"]) for b in mixed["blocs"]), mixed["blocs"]
    # By default their last numbers keep them apart, and "The answer is 12." joins the 12.
    vote = ok(corral, "numbers-apart")["vote"]
    assert [b["members"] for b in vote["blocs"]] == [[0, 2], [1]], vote["blocs"]
    assert "13" not in vote["winner"]


def test_quorum_missed_fails_under_strict(corral: Corral) -> None:
    resp = batch(corral, "quorum-strict")
    assert resp.status_code == 502
    error = resp.json()["error"]
    assert error["code"] == "no_quorum" and error["type"] == "server_error"
    assert "no quorum: 1 of 3 answers agree (extract), quorum is 2" in error["message"]
    vote = resp.json()["group"]["vote"]
    assert (vote["quorum"], vote["quorum_met"], resp.json()["group"]["complete"]) == (
        2, False, False)


def test_quorum_missed_answers_the_best_under_partial(corral: Corral) -> None:
    result = ok(corral, "quorum-partial")
    assert result["complete"] is False
    assert result["vote"]["quorum_met"] is False and result["vote"]["agree"] == 1
    assert all(m["status"] == "ok" for m in result["responses"])

    met = ok(corral, "quorum-met")
    assert met["complete"] is True and met["vote"]["quorum_met"] is True
    assert (met["vote"]["winner"], met["vote"]["blocs"][0]["members"]) == ("paris", [0, 2])


def test_consensus_votes_before_the_synthesizer_writes(corral: Corral) -> None:
    result = ok(corral, "council")
    assert result["vote"]["blocs"][0]["members"] == [0, 2] and result["complete"] is True
    assert result["final"] == FIXED["paris-2"]  # the synthesizer's fixed answer


def test_agreement_is_counted_per_group(corral: Corral) -> None:
    ok(corral, "by-regex")
    text = corral.http.get("/metrics").text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(text) for s in family.samples}

    def value(name: str, **labels: str) -> float:
        return samples.get((name, tuple(sorted(labels.items()))), 0.0)

    assert value("corral_group_votes_total", group="by-regex", compare="extract",
                 agreement="plurality") >= 1
    assert value("corral_group_votes_total", group="by-meaning", compare="similar",
                 agreement="majority") >= 1
    runs = value("corral_group_votes_total", group="by-regex", compare="extract",
                 agreement="plurality")
    assert value("corral_group_vote_agreeing_answers_total", group="by-regex") == 2 * runs
    assert value("corral_group_vote_answers_total", group="by-regex") == 4 * runs
    assert value("corral_group_quorums_total", group="quorum-strict", result="missed") >= 1
    assert value("corral_group_quorums_total", group="quorum-met", result="met") >= 1
    assert value("corral_group_requests_total", group="quorum-strict", type="parallel",
                 result="failed") >= 1


# -- corral check ------------------------------------------------------------------------------

BAD = """\
models:
  a: {model: MODEL}
  b: {model: MODEL}
  emb: {model: MODEL, embeddings: true, args: [--pooling, mean]}
groups:
  no-group:
    models: [a, b]
    type: fan_out
    selector: majority
    compare:
      extract: {regex: 'answer: \\w+'}
  broken-regex:
    models: [a, b]
    type: parallel
    compare:
      extract: {regex: '(unclosed'}
  bad-path:
    models: [a, b]
    type: parallel
    compare:
      extract: {json_path: '$.a..b'}
  not-embeddings:
    models: [a, b]
    type: parallel
    quorum: 3
    compare:
      similar: {model: a}
  unknown:
    models: [a, b]
    type: consensus
    synthesizer: a
    compare:
      similar: {model: nope}
  chain:
    models: [a, b]
    type: chain
    quorum: 2
  two-ways:
    models: [a, b]
    type: parallel
    compare:
      extract: {regex: '(x)', last_line: true}
  fine:
    models: [a, b]
    type: parallel
    compare:
      extract: {json_path: "$.items[0]['the answer']"}
      similar: {model: emb, threshold: 0.8, distinct_numbers: false, distinct_yes_no: false}
"""


def test_corral_check_points_at_each_bad_vote(tmp_path: Path, smol_model: Path) -> None:
    path = tmp_path / "votes.yaml"
    path.write_text(BAD.replace("MODEL", str(smol_model)))
    done = subprocess.run([sys.executable, "-m", "corral.supervisor.cli", "check", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    errors = [line for line in done.stdout.splitlines() + done.stderr.splitlines()
              if line.startswith("error: ")]
    expected = [
        (11, "groups.no-group.compare.extract.regex: the regex needs a group"),
        (16, "groups.broken-regex.compare.extract.regex: regex does not compile"),
        (21, "groups.bad-path.compare.extract.json_path: bad JSON path '$.a..b' at "
             "character 4"),
        (25, "groups.not-embeddings.quorum: quorum 3 exceeds the group's 2 members"),
        (27, "groups.not-embeddings.compare.similar.model: 'a' does not serve embeddings"),
        (33, "groups.unknown.compare.similar.model: unknown model 'nope'"),
        (37, "groups.chain.quorum: quorum applies to parallel and consensus groups"),
        (42, "groups.two-ways.compare.extract: give exactly one of regex, json_path, "
             "last_line, first_sentence (got regex, last_line)"),
    ]
    assert len(errors) == len(expected), errors
    for line, (number, text) in zip(errors, expected, strict=True):
        assert line.startswith(f"error: {path}:{number}: {text}"), (line, number, text)


# -- the vote module alone ---------------------------------------------------------------------

def rule(**kw: Any) -> VoteSpec:
    return VoteSpec(**kw)


def test_extraction_rules() -> None:
    regex = rule(extract="regex", regex=r"(?i)answer:\s*(\w+)")
    assert votes.extract(regex, "Thinking...\nAnswer:  Paris.") == "paris"
    assert votes.extract(regex, "no idea") is None
    either = rule(extract="regex", regex=r"(\w+) is the capital|capital is (\w+)")
    assert votes.extract(either, "Its capital is Rome.") == "rome"  # the group that matched
    assert votes.extract(either, "Rome is the capital.") == "rome"
    path = rule(extract="json", json_path=jsonpath.parse("$.items[1]['the answer']"))
    assert votes.extract(path, '{"items": [{}, {"the answer": " Rome "}]}') == "rome"
    assert votes.extract(path, '```json\n{"items": [0, {"the answer": 4}]}\n```') == "4"
    assert votes.extract(path, '{"items": []}') is None
    assert votes.extract(path, "not json") is None
    first = rule(extract="first_sentence")
    assert votes.extract(first, "\n**Paris.** It has museums. And a river.") == "paris"
    assert votes.extract(first, "1. The answer is 3.5! Then 4.") == "the answer is 3.5"
    assert votes.extract(first, "Paris, e.g., is one.\nLyon.") == "paris, e.g., is one"
    assert votes.extract(first, "Yes\nbecause the sun is a star.") == "yes"
    assert votes.extract(first, " \n...") is None
    # A line past any sentence is cut before the search (a member can be steered into a run
    # of dots): what counts is its start, bounded.
    assert votes.first_sentence("." * 100_000 + "x") is None  # 2,000 dots: no sentence
    long = "word " * 5000
    assert votes.first_sentence(long) == long[:2000].strip()
    last = rule(extract="last_line")
    assert votes.extract(last, "Let me think.\n\n  The answer is 12.  \n") == "the answer is 12"
    assert votes.extract(rule(), "  Paris,   FRANCE. ") == "paris, france"


def test_json_path_syntax() -> None:
    assert jsonpath.parse("$") == ()
    assert jsonpath.parse("$.a.b_c[0][-1]['x y'][\"z\"]") == ("a", "b_c", 0, -1, "x y", "z")
    for bad in ("a.b", "$.", "$..a", "$[x]", "$['a]", "$.a b"):
        with pytest.raises(ValueError):
            jsonpath.parse(bad)


def cast(*values: str | None) -> list[votes.Ballot]:
    return [votes.Ballot(i, f"m{i}", v) for i, v in enumerate(values)]


def test_tally_by_value_counts_ties_and_abstentions() -> None:
    tally = votes.tally_by_value("extract", cast("b", "a", None, "a", "b"), quorum=3)
    assert [(b.vote, b.members) for b in tally.blocs] == [("b", [0, 4]), ("a", [1, 3])]
    assert tally.tie == {"between": ["b", "a"], "size": 2, "broken_by": "first in order",
                         "winner": "b"}
    assert (tally.agree, tally.voters, tally.share, tally.quorum_met) == (2, 5, 0.4, False)
    assert tally.as_dict()["votes"][2] == {"index": 2, "model": "m2", "vote": None,
                                           "bloc": None}
    assert tally.agreement == "no_majority"  # two blocs of two: no view leads
    nobody = votes.tally_by_value("extract", cast(None, None))
    assert nobody.winner is None and nobody.agreement == "none" and nobody.quorum_met


def test_a_report_shows_each_long_vote_cut_short() -> None:
    # Under `exact` a vote is the whole answer; the report names it per member, per bloc and
    # as the winner, so a long answer would come back three times whole.
    long = "paris " * 500
    report = votes.tally_by_value("exact", cast(long, long, "rome")).as_dict()
    shown = [report["winner"], report["votes"][0]["vote"], report["blocs"][0]["vote"]]
    assert all(s == long[:votes.SHOWN_CHARS] + "…" for s in shown), shown
    assert report["votes"][2]["vote"] == "rome" and report["agree"] == 2


def test_clusters_follow_average_linkage_not_chains() -> None:
    # 0 and 1 alike, 1 and 2 alike, 0 and 2 not: single linkage would chain all three.
    vectors = [[1.0, 0.0], [0.9, 0.44], [0.6, 0.8], [-1.0, 0.1]]
    assert votes.cluster(vectors, 0.85) == [[0, 1], [2], [3]]
    assert votes.cluster(vectors, 0.5) == [[0, 1, 2], [3]]
    assert votes.cluster(list(reversed(vectors)), 0.85) == [[0], [1], [2, 3]]


def test_similar_tally_speaks_through_the_centre_and_breaks_ties_by_cohesion() -> None:
    vectors = [[1.0, 0.0], [0.8, 0.6], [0.96, 0.28], [0.0, 1.0], [0.1, 0.99]]
    tally = votes.tally_similar("similar", cast("a", "b", "c", "d", "e"), vectors, 0.85)
    assert tally.blocs[0].members == [0, 1, 2] and tally.blocs[0].centre == 2
    assert tally.blocs[1].members == [3, 4] and tally.tie is None
    # Two blocs of two: the tighter one wins.
    tied = votes.tally_similar("similar", cast("a", "b", "c", "d"),
                               [[1.0, 0.0], [0.9, 0.44], [0.0, 1.0], [0.02, 1.0]], 0.85)
    assert [b.members for b in tied.blocs] == [[2, 3], [0, 1]]
    assert tied.tie is not None and tied.tie["broken_by"] == "tightest cluster"


def test_a_stance_is_the_last_number_and_the_first_bare_yes_or_no() -> None:
    twelve = votes.stance("7 + 5 is 12.")
    # The operands an answer restates come before its result: "12" says the same.
    assert twelve == votes.stance("12") == votes.stance("The answer is 12.0!")
    assert twelve.number == 12 and twelve.polarity is None
    assert twelve.contradicts(votes.stance("7 + 5 = 13"))
    assert not votes.stance("15 + 5 = 20").contradicts(votes.stance("20"))
    assert votes.stance("15 + 5 = 20").contradicts(votes.stance("5"))
    assert votes.stance("9-3=6").number == 6 and votes.stance("-4").number == -4
    assert votes.stance("about 1,000 people").number == 1000
    assert votes.stance("1.5") != votes.stance("15")
    # A number in words is no number: a spelled-out "one" is too often "one of the...".
    assert votes.stance("twelve") == votes.Stance()
    assert votes.stance("**Yes**, the sun is a star.").polarity == "yes"
    assert votes.stance('"No." Fish cannot fly.').polarity == "no"
    assert votes.stance("Yes").contradicts(votes.stance("no, it is not"))
    assert votes.stance("The answer is yes.").polarity == "yes"
    assert votes.stance("I would say **no**, fish cannot fly. Yes.").polarity == "no"
    for neutral in ("Nobody knows.", "There is no reason to think so.", "Yesterday, I saw it."):
        assert votes.stance(neutral).polarity is None, neutral
    # An answer that states nothing contradicts nobody; each check can be turned off.
    assert not votes.Stance().contradicts(twelve)
    assert votes.stance("Yes, 12", numbers=False) == votes.Stance(polarity="yes")
    assert votes.stance("Yes, 12", yes_no=False) == votes.Stance(number=twelve.number)


def test_contradicting_answers_never_share_a_cluster() -> None:
    # Four answers the embeddings call one; 0 and 2 contradict, 1 and 3 state nothing.
    vectors = [[1.0, 0.0], [0.99, 0.1], [0.98, 0.2], [0.97, 0.25]]
    twelve, thirteen = votes.stance("= 12"), votes.stance("= 13")
    stances = [twelve, votes.Stance(), thirteen, votes.Stance()]
    assert votes.cluster(vectors, 0.5) == [[0, 1, 2, 3]]
    clusters = votes.cluster(vectors, 0.5, stances)
    # Whoever joins 12 cannot also join 13: no cluster holds both, through a neutral or not.
    assert sorted(map(len, clusters)) == [2, 2]
    assert not any({0, 2} <= set(c) for c in clusters), clusters
    assert votes.cluster(vectors, 0.5, [votes.Stance()] * 4) == [[0, 1, 2, 3]]
    tally = votes.tally_similar("similar", cast("= 12", "ok", "= 13", "fine"), vectors, 0.5,
                                stances=stances)
    assert len(tally.blocs) == 2 and tally.agree == 2


def test_similar_guards_are_on_by_default_and_can_be_turned_off(smol_model: Path) -> None:
    def vote(similar: str) -> VoteSpec:
        loaded = parse_config(f"""
models:
  emb: {{model: {smol_model}, embeddings: true}}
  a: {{model: {smol_model}}}
groups:
  g:
    models: [a, emb]
    type: fan_out
    selector: majority
    compare: {{similar: {similar}}}
""")
        spec = loaded.groups["g"].vote
        assert spec is not None
        return spec

    on = vote("{model: emb, threshold: 0.6}")
    assert (on.distinct_numbers, on.distinct_yes_no, on.threshold) == (True, True, 0.6)
    off = vote("{model: emb, distinct_numbers: false, distinct_yes_no: false}")
    assert (off.distinct_numbers, off.distinct_yes_no) == (False, False)


def test_the_synthesizer_hears_which_answers_agreed() -> None:
    group = GroupSpec(
        name="g", type="consensus", models=("a", "b", "c"), required_responses=3,
        member_timeout=5, fallback="strict", replace_with={}, pinned=False,
        selector="first_ok", judge=None, synthesizer="a", template=None,
        expose_as_model=False, vote=rule(extract="last_line"))
    outcome = GroupOutcome(group, [MemberResult("a", "ok", content="Paris"),
                                   MemberResult("b", "error", error="down"),
                                   MemberResult("c", "ok", content="paris.")], 1.0)
    outcome.tally = votes.tally_by_value("extract", votes.ballots(
        group.vote or rule(), [(0, "a", "Paris"), (2, "c", "paris.")]))
    body = GroupRunner.synthesis_body(None, group, {"messages": QUESTION},  # type: ignore
                                      outcome)
    prompt = body["messages"][-1]["content"]
    assert "[Answer 1] Paris\n\n[Answer 2] paris." in prompt
    assert "Answers 1, 2 agree (2 of 2, compared by extract: 'paris')." in prompt
    assert agreement_note(None, {}) == ""
