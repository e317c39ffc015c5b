"""Structured output on SmolLM2: every constrained completion parses and validates
(jsonschema, re.fullmatch), offline and through the server, streamed or not, with n > 1,
guesses from prompt lookup, and bad constraints refused with a 400 naming the problem."""

from __future__ import annotations

import json
import re
import time

import httpx
import jsonschema
import pytest

from minerva.engine.sampler import SamplingParams
from minerva.engine.structured import StructuredOutput
from minerva.errors import MinervaError
from tests.helpers.server import running_server

SCHEMAS = [
    {"type": "object", "properties": {"name": {"type": "string", "maxLength": 20}, "age": {"type": "integer", "minimum": 0, "maximum": 120}},
     "required": ["name", "age"], "additionalProperties": False},
    {"type": "object", "properties": {"colors": {"type": "array", "items": {"enum": ["red", "green", "blue"]},
                                                 "minItems": 1, "maxItems": 3}},
     "required": ["colors"], "additionalProperties": False},
    {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16},
                                      "population": {"type": "integer", "minimum": 0, "maximum": 99999999},
                                      "capital": {"type": "boolean"}},
     "required": ["city", "population", "capital"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": -999, "maximum": 999}, "minItems": 2, "maxItems": 4},
]


def prompt(llm, text: str) -> str:
    return llm.apply_chat_template([{"role": "user", "content": text}])


@pytest.mark.parametrize("schema", SCHEMAS, ids=["person", "colors", "city", "numbers"])
def test_json_schema_outputs_validate(smollm2_llm, schema):
    params = SamplingParams(max_tokens=80, temperature=0.7, seed=3, n=3, structured=StructuredOutput(json=schema))
    out = smollm2_llm.generate(prompt(smollm2_llm, "Reply with JSON."), params)[0]
    for c in out.outputs:
        assert c.finish_reason == "stop", c.text
        jsonschema.validate(json.loads(c.text), schema)
    assert len({c.text for c in out.outputs}) > 1  # three samples, not one forced string


def test_regex_choice_grammar_and_json_object(smollm2_llm):
    p = prompt(smollm2_llm, "Give me a phone number.")
    greedy = dict(max_tokens=40, temperature=0)
    text = smollm2_llm.generate(p, SamplingParams(**greedy, structured=StructuredOutput(regex=r"\d{3}-\d{4}")))
    assert re.fullmatch(r"\d{3}-\d{4}", text[0].outputs[0].text)
    text = smollm2_llm.generate(p, SamplingParams(**greedy, structured=StructuredOutput(choice=("yes", "no, thanks"))))
    assert text[0].outputs[0].text in ("yes", "no, thanks")
    gbnf = 'root ::= "ID-" [A-F]{4} " " ("ok" | "fail")'
    text = smollm2_llm.generate(p, SamplingParams(**greedy, structured=StructuredOutput(grammar=gbnf)))
    assert re.fullmatch(r"ID-[A-F]{4} (ok|fail)", text[0].outputs[0].text)
    text = smollm2_llm.generate(p, SamplingParams(max_tokens=120, temperature=0,
                                                  structured=StructuredOutput(json_object=True)))[0].outputs[0]
    assert text.finish_reason == "stop" and isinstance(json.loads(text.text), dict)


def test_cut_off_by_max_tokens_finishes_with_length(smollm2_llm):
    schema = {"type": "object", "properties": {"story": {"type": "string"}}, "required": ["story"]}
    out = smollm2_llm.generate(prompt(smollm2_llm, "Tell a long story as JSON."),
                               SamplingParams(max_tokens=6, temperature=0, structured=StructuredOutput(json=schema)))
    c = out[0].outputs[0]
    assert c.finish_reason == "length" and len(c.token_ids) == 6
    with pytest.raises(json.JSONDecodeError):
        json.loads(c.text)


def test_constrained_and_free_requests_share_steps(smollm2_llm):
    """The same prompts together and alone, greedy: a constraint changes only its own request."""
    p = prompt(smollm2_llm, "Describe a city.")
    free = SamplingParams(max_tokens=24, temperature=0)
    constrained = SamplingParams(max_tokens=60, temperature=0, structured=StructuredOutput(json=SCHEMAS[2]))
    together = smollm2_llm.generate([p, p, p], [free, constrained, free])
    alone = [smollm2_llm.generate(p, sp)[0] for sp in (free, constrained)]
    assert together[0].outputs[0].token_ids == together[2].outputs[0].token_ids == alone[0].outputs[0].token_ids
    assert together[1].outputs[0].token_ids == alone[1].outputs[0].token_ids
    jsonschema.validate(json.loads(together[1].outputs[0].text), SCHEMAS[2])


def test_guesses_that_break_the_grammar_are_rejected(smollm2_gguf):
    """Prompt lookup proposes the prompt's own text, which here is not valid output: the
    guesses the grammar forbids are rejected and the output still validates, the same as
    without speculation."""
    from minerva import LLM

    llm = LLM(str(smollm2_gguf), dtype="float32", activations="float", speculative="ngram",
              kv_cache_memory=64 << 20)
    schema = SCHEMAS[0]
    p = prompt(llm, 'Example: {"name": "Ann", "age": 31}. {"name": "Bob", "age": 4}. Another one, as JSON:')
    sp = SamplingParams(max_tokens=40, temperature=0, structured=StructuredOutput(json=schema))
    spec = llm.generate(p, sp)[0].outputs[0]
    plain = llm.generate(p, SamplingParams(max_tokens=40, temperature=0, speculative_tokens=0,
                                           structured=StructuredOutput(json=schema)))[0].outputs[0]
    assert llm.engine.speculator.stats.num_draft_tokens > 0
    assert spec.token_ids == plain.token_ids
    jsonschema.validate(json.loads(spec.text), schema)


def test_bad_constraints_are_errors(smollm2_llm):
    p = prompt(smollm2_llm, "hi")
    for bad, words in ((StructuredOutput(json={"type": "nonsense"}), "invalid json constraint"),
                       (StructuredOutput(regex="(unclosed"), "unclosed group"),
                       (StructuredOutput(grammar="root ::= ("), "invalid GBNF grammar"),
                       (StructuredOutput(json="{not json"), "not valid JSON")):
        with pytest.raises(MinervaError, match=words):
            smollm2_llm.generate(p, SamplingParams(structured=bad))
    with pytest.raises(MinervaError, match="exactly one"):
        StructuredOutput(regex="a", choice=("b",))


# constraints that compile but that llguidance cannot follow (its lexer's limit) or that no
# token can extend: an error, never an answer that ends "stop" without holding to them
UNFOLLOWABLE = [(StructuredOutput(regex="z{1000000}"), "too many expressions"),
                (StructuredOutput(regex=r"[^\x00-\U0010FFFF]"), "no token can continue"),
                (StructuredOutput(json={"$ref": "#"}), "no token can continue")]


def test_constraints_that_cannot_be_followed_are_errors(smollm2_llm):
    p = prompt(smollm2_llm, "hi")
    for spec, words in UNFOLLOWABLE + UNFOLLOWABLE[:1]:  # twice: the compiled matcher is cached
        with pytest.raises(MinervaError, match=f"constraint could not be followed .*{words}.*simplify it"):
            smollm2_llm.generate(p, SamplingParams(max_tokens=20, temperature=0, structured=spec), use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished()
    out = smollm2_llm.generate(p, SamplingParams(max_tokens=8, temperature=0,
                                                 structured=StructuredOutput(regex="[0-9]{3}")), use_tqdm=False)
    assert re.fullmatch("[0-9]{3}", out[0].outputs[0].text)


ODD_CHOICES = ("a.b", "(x)|y", "[z]*", "back\\slash", "sl/ash", "new\nline", "tab\t", "$^{}?+", "café",
               "😀 grin", "\"quoted\"", "", "x" * 300)


def _accepts(grammars, tokenizer, spec, text: str) -> bool:
    """Whether the constraint's matcher takes `text`'s tokens and then may stop."""
    matcher = grammars.matcher(spec)
    ids = tokenizer.encode(text, add_special_tokens=False)
    return matcher.try_consume_tokens(ids) == len(ids) and matcher.is_accepting()


def test_choices_are_taken_literally(smollm2_llm):
    """Every choice, whatever characters it holds, and nothing else (not a regex it might spell)."""
    grammars, tok = smollm2_llm.engine.grammars, smollm2_llm.tokenizer
    choices = tuple(c for c in ODD_CHOICES if c)
    spec = StructuredOutput(choice=choices)
    for c in choices:
        assert _accepts(grammars, tok, spec, c), c
    for other in ("ab", "acb", "x", "y", "z", "zz", "back\\\\slash", "cafe", "x" * 299, "a.bc"):
        assert not _accepts(grammars, tok, spec, other), other


def test_thousands_of_choices_give_a_whole_choice(smollm2_llm):
    """More choices than llguidance's parser takes in one rule (2,000): the answer is one of them,
    not its first letter (as when the rule's parse failed and only the end was left allowed)."""
    choices = tuple(f"option {i:05d}" for i in range(5000))
    p = prompt(smollm2_llm, "Pick an option.")
    out = smollm2_llm.generate(p, SamplingParams(max_tokens=20, temperature=0,
                                                 structured=StructuredOutput(choice=choices)))[0].outputs[0]
    assert out.text in choices and out.finish_reason == "stop", out.text


def test_building_the_tokenizer_view_counts_against_no_constraint(smollm2_llm, monkeypatch):
    """llguidance's view of a large vocabulary takes seconds to build, once an engine: the first
    constraint's budget starts after it (a schema refused for it would stay refused, cached)."""
    import llguidance
    from minerva.engine.structured import Grammars

    real = llguidance.LLTokenizer

    def slow(*args, **kwargs):
        time.sleep(0.8)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", slow)
    grammars = Grammars(smollm2_llm.tokenizer, smollm2_llm.config.vocab_size, seconds=0.5)
    spec = StructuredOutput(json=SCHEMAS[0])
    assert grammars.compiled(spec).is_accepting() is False  # compiled, in its start state
    assert grammars.submit(spec).result()[1] is None  # and cached as a success


# ------------------------------------------------------------------ server


def test_server_response_format_and_guided_fields(smollm2_llm):
    schema = SCHEMAS[2]
    messages = [{"role": "user", "content": "Describe a city as JSON."}]
    with running_server(smollm2_llm) as (url, _):
        body = {"messages": messages, "max_tokens": 80, "temperature": 0.8, "n": 2,
                "response_format": {"type": "json_schema", "json_schema": {"name": "city", "schema": schema}}}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        for choice in r.json()["choices"]:
            assert choice["finish_reason"] == "stop"
            jsonschema.validate(json.loads(choice["message"]["content"]), schema)
        # streamed: the deltas joined validate
        with httpx.stream("POST", url + "/v1/chat/completions", json={**body, "n": 1, "stream": True},
                          timeout=60) as s:
            chunks = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: {")]
        text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
        jsonschema.validate(json.loads(text), schema)
        # text completions with vLLM's and llama.cpp's spellings
        for extra, check in (({"guided_regex": r"[0-9]{4}"}, lambda t: re.fullmatch(r"[0-9]{4}", t)),
                             ({"guided_choice": ["alpha", "beta"]}, lambda t: t in ("alpha", "beta")),
                             ({"grammar": 'root ::= "x" [yz]'}, lambda t: t in ("xy", "xz")),
                             ({"json_schema": SCHEMAS[3]}, lambda t: jsonschema.validate(json.loads(t), SCHEMAS[3])
                              or True)):
            r = httpx.post(url + "/v1/completions", json={"prompt": "Answer:", "max_tokens": 60, "temperature": 0,
                                                          **extra}, timeout=60)
            assert r.status_code == 200, (extra, r.text)
            choice = r.json()["choices"][0]
            assert choice["finish_reason"] == "stop" and check(choice["text"]), (extra, choice)
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": messages, "max_tokens": 120, "temperature": 0, "response_format": {"type": "json_object"}})
        choice = r.json()["choices"][0]
        assert choice["finish_reason"] == "stop" and isinstance(json.loads(choice["message"]["content"]), dict)
        rows = next(float(line.split()[-1]) for line in httpx.get(url + "/metrics").text.splitlines()
                    if line.startswith("minerva:structured_output_rows_total{"))
        assert rows >= r.json()["usage"]["completion_tokens"]  # every constrained token counted


@pytest.mark.parametrize("extra, words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
     "invalid field 'response_format': invalid json constraint"),
    ({"guided_regex": "(unclosed"}, "invalid field 'guided_regex'"),
    ({"guided_regex": "(unclosed"}, "unclosed group"),
    ({"guided_regex": "a", "guided_choice": ["b"]}, "at most one output constraint"),
    ({"response_format": {"type": "json_schema"}}, "json_schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"guided_regex": "z{1000000}"}, "constraint could not be followed"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#"}}}},
     "no token can continue"),
])
def test_server_refuses_bad_constraints(smollm2_llm, extra, words):
    with running_server(smollm2_llm) as (url, _):
        r = httpx.post(url + "/v1/chat/completions", timeout=60,
                       json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    assert words in r.json()["error"]["message"], r.text
    if words.startswith("invalid field"):  # a constraint that does not compile: its field is the param
        assert r.json()["error"]["param"] == words.split("'")[1], r.text


def test_server_streams_the_error_of_a_constraint_it_cannot_follow(smollm2_llm):
    with running_server(smollm2_llm) as (url, _):
        with httpx.stream("POST", url + "/v1/completions", timeout=60, json={
                "prompt": "Answer:", "max_tokens": 8, "stream": True, "guided_regex": "z{1000000}"}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and "could not be followed" in json.loads(events[-2])["error"]["message"], events
        assert not any(c.get("finish_reason") for e in events[:-2] for c in json.loads(e).get("choices") or [])
        r = httpx.post(url + "/v1/completions", timeout=60, json={"prompt": "Answer:", "max_tokens": 4,
                                                                   "temperature": 0, "guided_regex": "[0-9]{3}"})
        assert r.status_code == 200 and re.fullmatch("[0-9]{3}", r.json()["choices"][0]["text"]), r.text


@pytest.mark.parametrize("vocab", [49152, 1000, 33])
def test_mask_application_matches_the_bits(vocab):
    """apply_mask_ (the C++ kernel where it is built) sets -inf exactly where the bit is 0,
    bit j of word w standing for token 32 w + j, as numpy's little-endian unpackbits reads it;
    words of all ones and of all zeros included."""
    import numpy as np
    import torch

    from minerva.engine.structured import apply_mask_

    g = torch.Generator().manual_seed(vocab)
    mask = torch.randint(-2**31, 2**31 - 1, (4, (vocab + 31) // 32), dtype=torch.int32, generator=g)
    mask[0, 0], mask[1, -1] = -1, 0
    logits = torch.randn(4, vocab, generator=g)
    allowed = np.unpackbits(mask.numpy().view(np.uint8), axis=-1, bitorder="little")[:, :vocab].astype(bool)
    want = torch.where(torch.from_numpy(allowed), logits, float("-inf"))
    assert torch.equal(apply_mask_(logits.clone(), mask), want)


def test_required_tool_calls_keep_each_schemas_own_references(smollm2_llm):
    """tool_choice "required": each function's parameters keep their own references ($defs, the
    older definitions, "#" for the schema itself, as pydantic writes them) inside the schema of
    all the calls: jsonschema reads it as the functions' own, and llguidance compiles it and
    holds sampled calls to it."""
    from minerva.parsers.tools import make_plan
    tools = [
        {"type": "function", "function": {"name": "f", "parameters": {
            "type": "object", "properties": {"a": {"$ref": "#/$defs/A"}}, "required": ["a"],
            "$defs": {"A": {"type": "integer", "minimum": 0, "maximum": 9}}}}},
        {"type": "function", "function": {"name": "g", "parameters": {
            "type": "object", "properties": {"b": {"$ref": "#/definitions/B"}}, "required": ["b"],
            "definitions": {"B": {"enum": ["x", "y"]}}}}},
        {"type": "function", "function": {"name": "h", "parameters": {
            "type": "object", "properties": {"child": {"$ref": "#"}}, "additionalProperties": False}}}]
    schema = make_plan(tools, "required", True).constraint()
    jsonschema.validate([{"name": "f", "arguments": {"a": 3}}, {"name": "g", "arguments": {"b": "y"}},
                         {"name": "h", "arguments": {"child": {"child": {}}}}], schema)
    for wrong in ([{"name": "f", "arguments": {"a": "3"}}], [{"name": "g", "arguments": {"b": "z"}}],
                  [{"name": "h", "arguments": {"child": {"other": 1}}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(wrong, schema)
    params = SamplingParams(max_tokens=120, temperature=0.8, seed=5, n=3, structured=StructuredOutput(json=schema))
    out = smollm2_llm.generate(prompt(smollm2_llm, "Call the tools."), params)[0]
    for c in out.outputs:
        if c.finish_reason == "stop":
            jsonschema.validate(json.loads(c.text), schema)
    assert any(c.finish_reason == "stop" for c in out.outputs), [c.text for c in out.outputs]
