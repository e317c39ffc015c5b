"""The offline API on the real default model: sampling controls, stop rules, streaming."""

from __future__ import annotations

import pytest

from minerva import LLM, MinervaError, SamplingParams
from tests.helpers.hf import hf_greedy

pytestmark = pytest.mark.slow


def test_default_model_by_name(smollm2_gguf):
    llm = LLM()  # no name: the default model, already pulled by the fixture
    assert llm.path == smollm2_gguf
    assert llm.config.architecture == "llama"


def test_same_seed_same_text(smollm2_llm):
    p = SamplingParams(max_tokens=20, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a, b = smollm2_llm.generate(["Write a word:", "Write a word:"], p)
    assert a.token_ids == b.token_ids and len(a.token_ids) == 20
    other = smollm2_llm.generate("Write a word:", SamplingParams(**{**p.__dict__, "seed": 99}))[0]
    assert other.token_ids != a.token_ids


def test_seeds_across_the_int64_range(smollm2_llm):
    """Seeds that differ only in their high 32 bits or their sign draw apart (torch's CPU
    generator keeps 32 bits of a seed: 5 and 5 + 2^32 drew alike); n siblings of seed 2^63 - 1
    go on from -2^63 (was a 400 naming a seed never sent)."""
    def sample(seed, n=1):
        p = SamplingParams(max_tokens=12, temperature=1.5, seed=seed, n=n, ignore_eos=True)
        return [c.token_ids for c in smollm2_llm.generate("Write a word:", p)[0].outputs]

    assert sample(5) != sample(5 + 2**32) and sample(0) != sample(-2**63) and sample(-1) != sample(0)
    assert sample(2**63 - 1, n=2) == sample(2**63 - 1) + sample(-2**63)


def test_top_k_one_equals_greedy(smollm2_llm):
    greedy = smollm2_llm.generate("Tell me a fact:", SamplingParams(max_tokens=12, temperature=0))[0]
    topk1 = smollm2_llm.generate("Tell me a fact:", SamplingParams(max_tokens=12, temperature=1.5,
                                                                      top_k=1, seed=5))[0]
    assert greedy.token_ids == topk1.token_ids


def test_stream_concatenates_to_generate(smollm2_llm):
    p = SamplingParams(max_tokens=30, temperature=0)
    prompt = smollm2_llm.apply_chat_template([{"role": "user", "content": "Name three fruits."}])
    full = smollm2_llm.generate(prompt, p)[0]
    deltas = list(smollm2_llm.stream(prompt, p))
    assert "".join(d.text for d in deltas) == full.text
    assert sum((d.token_ids for d in deltas), []) == full.token_ids
    assert deltas[-1].finish_reason == full.finish_reason


def test_stop_string_truncates(smollm2_llm):
    p = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    free = smollm2_llm.generate("1, 2, 3, 4,", p)[0].text
    assert " 7" in free
    stopped = smollm2_llm.generate("1, 2, 3, 4,", SamplingParams(**{**p.__dict__, "stop": (" 7",)}))[0]
    assert stopped.finish_reason == "stop"
    assert stopped.text == free[: free.index(" 7")]
    streamed = "".join(d.text for d in smollm2_llm.stream("1, 2, 3, 4,", SamplingParams(
        **{**p.__dict__, "stop": (" 7",)})))
    assert streamed == stopped.text


def test_chat_ends_at_end_of_turn(smollm2_llm, smollm2_hf):
    """The reply is transformers' greedy reply to the same prompt ids, up to the end-of-turn
    token, which ends the output without being part of it."""
    messages = [{"role": "user", "content": "Say hello."}]
    out = smollm2_llm.chat(messages, SamplingParams(max_tokens=200, temperature=0))
    assert out.finish_reason == "stop"
    tok = smollm2_llm.tokenizer
    ref = hf_greedy(smollm2_hf, out.prompt_token_ids, 200, tok.eos_token_ids)
    assert len(ref) < 200, "the reference reply did not end within 200 tokens"
    assert out.token_ids == ref and out.text == tok.decode(ref)
    assert "<|im_end|>" not in out.text


def test_max_tokens_length(smollm2_llm):
    out = smollm2_llm.generate("Count:", SamplingParams(max_tokens=7, temperature=0, ignore_eos=True))[0]
    assert out.finish_reason == "length" and len(out.token_ids) == 7


def test_token_id_prompt(smollm2_llm):
    ids = smollm2_llm.tokenizer.encode("The capital of France is")
    a = smollm2_llm.generate([ids], SamplingParams(max_tokens=5, temperature=0))[0]
    b = smollm2_llm.generate("The capital of France is", SamplingParams(max_tokens=5, temperature=0))[0]
    assert a.token_ids == b.token_ids and a.prompt_token_ids == ids


def test_prompt_longer_than_context(smollm2_llm):
    ids = [100] * (smollm2_llm.config.max_position + 5)
    with pytest.raises(MinervaError, match="context"):
        smollm2_llm.generate([ids], SamplingParams(max_tokens=1))
    with pytest.raises(MinervaError, match="token ids"):
        smollm2_llm.generate([[10**9]], SamplingParams(max_tokens=1))


@pytest.mark.parametrize("args, words", [
    (({"prompt": "hi"},), "prompts must be"),  # a dict was read as its keys
    (("hi", {"max_tokens": 3}), "params must be"),
    ((None,), "prompts must be"), ((5,), "prompts must be"),
    ((["hi"], [{"max_tokens": 3}]), "params must be"),
])
def test_generate_misuse_is_a_clear_error(smollm2_llm, args, words):
    with pytest.raises(MinervaError, match=words):
        smollm2_llm.generate(*args, use_tqdm=False)
    assert not smollm2_llm.engine.has_unfinished()


@pytest.mark.parametrize("kwargs, words", [(dict(model=123), "model must be"),
                                           (dict(model="smollm2-135m", lora=["a"]), "lora must be"),
                                           (dict(model="smollm2-135m", threads=10**6), "threads")])
def test_llm_misuse_is_a_clear_error_before_loading(kwargs, words):
    with pytest.raises(MinervaError, match=words):
        LLM(**kwargs)


def test_gemma_chat_uses_builtin_template(gemma3_llm, gemma3_hf):
    prompt = gemma3_llm.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n")
    out = gemma3_llm.generate(prompt, SamplingParams(max_tokens=40, temperature=0))[0]
    tok = gemma3_llm.tokenizer
    assert out.prompt_token_ids.count(tok.bos_token_id) == 1
    # the reply is transformers' greedy reply to the same ids, ended by <end_of_turn> or length
    ref = hf_greedy(gemma3_hf, out.prompt_token_ids, 40, tok.eos_token_ids)
    assert ref and out.token_ids == ref and out.text == tok.decode(ref)


def test_chat_takes_a_list_of_conversations(smollm2_llm, capsys):
    """Several conversations run together, each answered as it is alone; the progress bar says
    the output tokens/s; repr says what is loaded."""
    conversations = [[{"role": "user", "content": "Hi"}], [{"role": "user", "content": "Name a fruit."}]]
    greedy = SamplingParams(max_tokens=8, temperature=0)
    together = smollm2_llm.chat(conversations, greedy)
    assert "output:" in capsys.readouterr().err  # the bar, on stderr
    alone = [smollm2_llm.chat(c, greedy, use_tqdm=False) for c in conversations]
    assert [o.outputs[0].token_ids for o in together] == [o.outputs[0].token_ids for o in alone]
    assert capsys.readouterr().err == ""
    for out, c in zip(together, conversations):  # the rendered prompt, as text and as the ids that ran
        assert out.prompt == smollm2_llm.apply_chat_template(c)
        assert out.prompt_token_ids == smollm2_llm.encode_prompt(out.prompt)
    encode, calls = smollm2_llm.tokenizer.encode, []

    def counted(*args, **kwargs):
        calls.append(args[0])
        return encode(*args, **kwargs)

    smollm2_llm.tokenizer.encode = counted  # (an attribute of this instance, removed below)
    try:
        smollm2_llm.chat(conversations, use_tqdm=False)  # without parameters: the model's defaults fitted
    finally:
        del smollm2_llm.tokenizer.encode
    assert sorted(calls) == sorted(o.prompt for o in together)  # each rendered prompt tokenized once
    assert repr(smollm2_llm).startswith("LLM('SmolLM2-135M-Instruct.Q4_1.gguf': llama, 30 layers")


def test_chat_template_given_as_a_file_or_as_text(tiny, tmp_path):
    """LLM(chat_template=...) renders as transformers' apply_chat_template does with that
    template; a missing, empty-named, broken or non-UTF-8 one is a one-line error."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    template = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n"
                "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
    path = tmp_path / "chatml.jinja"
    path.write_text(template)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    ref = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(WordLevel({"<s>": 0, "</s>": 1}, unk_token="<s>")),
                                  bos_token="<s>", eos_token="</s>")
    for given in (path, str(path), template):
        llm = LLM(str(tiny), chat_template=given, kv_cache_memory=1 << 20)
        bos = llm.tokenizer.id_to_token(llm.tokenizer.bos_token_id) or ""
        ref.bos_token = bos or None
        expected = ref.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=True)
        assert llm.apply_chat_template(messages) == expected
        assert llm.chat(messages, SamplingParams(max_tokens=2), use_tqdm=False).finish_reason in ("length", "stop")
    for given, words in ((tmp_path / "none.jinja", "cannot be read"), ("", "must be a Jinja file's path"),
                         ("{% if %}", "invalid chat template.*the chat template given")):
        with pytest.raises(MinervaError, match=words):
            LLM(str(tiny), chat_template=given, kv_cache_memory=1 << 20)
    (tmp_path / "latin1.jinja").write_bytes("{{ 'caf\xe9' }}".encode("latin-1"))
    with pytest.raises(MinervaError, match="not UTF-8"):
        LLM(str(tiny), chat_template=tmp_path / "latin1.jinja", kv_cache_memory=1 << 20)


def test_a_tokenizer_larger_than_the_embedding(tmp_path, caplog):
    """Tokens past the embedding's rows: a warning at load, and a prompt holding one refused
    with an error that blames the model's files (not an out-of-range id), the rest usable."""
    from transformers import LlamaConfig

    from tests.helpers.tiny_hf import COMMON, save

    path = save(tmp_path, "short-embedding", config=LlamaConfig(**{**COMMON, "vocab_size": 200}))
    with caplog.at_level("WARNING", logger="minerva"):
        llm = LLM(str(path), kv_cache_memory=1 << 20)
    assert "the model's tokenizer has 257 tokens and its embedding 200 rows" in caplog.text
    assert llm.generate("hello", SamplingParams(max_tokens=2), use_tqdm=False)[0].outputs[0].token_ids
    with pytest.raises(MinervaError, match=r"the prompt holds token ' ' \(id \d+\), which the model's tokenizer has "
                                           r"and its embedding of 200 rows lacks"):
        llm.generate("hello world", SamplingParams(max_tokens=2), use_tqdm=False)
