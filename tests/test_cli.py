"""The `minerva` command on good and bad input: bad input gives one error line and exit 1."""

from __future__ import annotations

import subprocess
import sys

import gguf
import pytest

from tests.helpers.cli import assert_clean_error, run
from tests.helpers.hostile import retyped
from tests.helpers.hf import hf_greedy, hf_perplexity, load_hf_quantized_reference, load_hf_reference
from tests.helpers.tiny_gguf import TINY_CONTEXT, write_tiny_llama
from tests.helpers.tiny_hf import save

TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}assistant:"  # a chat template for the tiny models


def reference_tokenizer(path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def test_generate_tiny_model_streams(tiny):
    """The streamed text is transformers' greedy continuation on the same GGUF weights."""
    proc = run("generate", str(tiny), "hello", "--raw", "-n", "12", "--temperature", "0", "--ignore-eos",
               "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "12 tokens" in proc.stderr and "finish=length" in proc.stderr
    tok = reference_tokenizer(tiny)
    ref = hf_greedy(load_hf_reference(tiny), tok.encode("hello"), 12)
    assert proc.stdout == tok.decode(ref) + "\n"


def test_reference_path_is_announced(tiny):
    """Without the compiled kernels (here switched off), the load says so and why."""
    import os

    proc = subprocess.run([sys.executable, "-m", "minerva", "generate", str(tiny), "hi", "-n", "2", "--raw"],
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "MINERVA_NO_NATIVE": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "compiled kernels are unavailable (disabled by MINERVA_NO_NATIVE)" in proc.stderr, proc.stderr
    assert "reference path" in proc.stderr



def test_kernels_by_name(tiny):
    """--kernels reference runs the plain-torch path, greedy text as the C++ kernels' (float
    activations on the tiny model); a backend the device cannot run is one error line;
    --version lists the backends and where each is the default."""
    common = ("generate", str(tiny), "hello", "--raw", "-n", "8", "--temperature", "0", "--ignore-eos",
              "--dtype", "float32", "--activations", "float")
    ref, cpu = run(*common, "--kernels", "reference"), run(*common, "--kernels", "cpu")
    assert ref.returncode == 0 and cpu.returncode == 0, (ref.stderr, cpu.stderr)
    assert ref.stdout == cpu.stdout and ref.stdout.strip()
    assert_clean_error(run(*common, "--kernels", "triton"), "--kernels triton runs on cuda, not on --device cpu")
    version = run("--version")
    assert version.returncode == 0 and "kernels cpu: runs on cpu; default on cpu" in version.stdout, version.stdout
    assert "kernels reference: runs on cpu, cuda" in version.stdout

def test_missing_file(tmp_path):
    assert_clean_error(run("generate", str(tmp_path / "nope.gguf"), "hi"), "nope.gguf")


def test_unknown_name(tmp_path):
    assert_clean_error(run("generate", "no-such-model", "hi", env_home=tmp_path),
                       "no-such-model", "smollm2-135m")


def test_truncated_gguf(tiny, tmp_path):
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny.read_bytes()[: tiny.stat().st_size // 2])
    assert_clean_error(run("generate", str(cut), "hi"), "cut.gguf")


def test_corrupt_gguf(tmp_path):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + bytes(range(256)) * 40)
    assert_clean_error(run("generate", str(bad), "hi"), "bad.gguf")


def test_not_a_gguf(tmp_path):
    bad = tmp_path / "text.gguf"
    bad.write_text("hello world, definitely not a model\n" * 10)
    assert_clean_error(run("generate", str(bad), "hi"), "text.gguf")


def test_unknown_architecture(tmp_path):
    path = write_tiny_llama(tmp_path / "arch.gguf", arch="mamba9")
    assert_clean_error(run("generate", str(path), "hi"), "mamba9", "not supported")


def test_unsupported_tensor_type(tmp_path):
    path = write_tiny_llama(tmp_path / "iq.gguf", odd_tensor_type=gguf.GGMLQuantizationType.IQ2_XXS)
    assert_clean_error(run("generate", str(path), "hi"), "IQ2_XXS")


def test_metadata_inconsistent_with_tensors(tmp_path):
    path = write_tiny_llama(tmp_path / "heads.gguf", claimed_heads=4)
    assert_clean_error(run("generate", str(path), "hi"), "blk.0.attn_", "shape")


def test_zero_heads(tmp_path):
    path = write_tiny_llama(tmp_path / "zero.gguf", claimed_heads=0)
    assert_clean_error(run("generate", str(path), "hi"), "zero.gguf")


def test_prompt_from_stdin_and_empty_prompts(tiny):
    piped = run("generate", str(tiny), "--raw", "-n", "3", "--temperature", "0", "--ignore-eos", input="hello")
    given = run("generate", str(tiny), "hello", "--raw", "-n", "3", "--temperature", "0", "--ignore-eos")
    assert piped.returncode == given.returncode == 0 and piped.stdout == given.stdout
    for argv in ([str(tiny)], ["gemma3-270m"], []):
        assert_clean_error(run("generate", *argv, input=""), "the prompt is empty")
    assert_clean_error(run("generate", str(tiny), "   ", input=""), "the prompt is empty")


@pytest.mark.parametrize("flag", ["--context", "--stride"])
def test_perplexity_bad_window(tiny, flag):
    assert_clean_error(run("perplexity", str(tiny), str(tiny), flag, "0"), flag)


def test_output_into_closed_pipe(tiny):
    cmd = (f"{sys.executable} -m minerva generate {tiny} hello --raw -n 30 --temperature 0 "
           "--ignore-eos | head -c 1")
    proc = subprocess.run(cmd, shell=True, capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr and "BrokenPipe" not in proc.stderr


def test_prompt_longer_than_context(tiny):
    prompt = "x" * (TINY_CONTEXT + 10)  # one token per byte
    assert_clean_error(run("generate", str(tiny), prompt, "--raw"), f"context is {TINY_CONTEXT}")


@pytest.mark.parametrize("flag", ["--max-model-len", "--ctx-size", "-c"])
def test_max_model_len_caps_the_context(tiny, flag):
    """vLLM's --max-model-len and llama.cpp's -c / --ctx-size: a prompt within the model's
    context but not within the cap is refused naming the cap; a cap past the model's context,
    or below 2, is one clear error."""
    prompt = "x" * 40  # one token per byte
    assert run("generate", str(tiny), prompt, "--raw", "-n", "2", flag, "64").returncode == 0
    assert_clean_error(run("generate", str(tiny), prompt, "--raw", flag, "32"), "--max-model-len is 32")
    assert_clean_error(run("generate", str(tiny), "hi", flag, str(TINY_CONTEXT + 1)),
                       f"more than the model's context of {TINY_CONTEXT}")
    assert_clean_error(run("generate", str(tiny), "hi", flag, "1"), "--max-model-len must be an integer >= 2")


@pytest.mark.parametrize("flag,value", [("--temperature", "-1"), ("--top-p", "0"),
                                        ("--top-p", "1.5"), ("--max-tokens", "0"),
                                        ("--min-p", "2"), ("--top-k", "-3"),
                                        ("--repetition-penalty", "0"),
                                        ("--presence-penalty", "5")])
def test_invalid_sampling_values(tiny, flag, value):
    name = flag.lstrip("-").replace("-", "_")
    assert_clean_error(run("generate", str(tiny), "hi", flag, value), name)


def test_pickle_checkpoint_refused(tmp_path):
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text("{}")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04")
    assert_clean_error(run("generate", str(d), "hi"), "pickle")


@pytest.mark.parametrize("device", ["tpu9", "meta", "mps"])
def test_bad_device(tiny, device):
    assert_clean_error(run("generate", str(tiny), "hi", "--device", device), device)


def test_perplexity_missing_text(tiny, tmp_path):
    assert_clean_error(run("perplexity", str(tiny), str(tmp_path / "none.txt")), "none.txt")


def test_perplexity_tiny(tiny, tmp_path):
    """The printed perplexity is transformers' over the same windows, on the same GGUF weights."""
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 3)
    proc = run("perplexity", str(tiny), str(text), "--context", "16", "--stride", "8", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("perplexity ") and "KV cache k=float32 v=float32," in proc.stdout  # "auto" resolved
    ours = float(proc.stdout.split()[1])
    ref = hf_perplexity(load_hf_reference(tiny), reference_tokenizer(tiny).encode(text.read_text()), 16, 8)
    assert abs(ours - ref) / ref < 1e-4, (ours, ref)


def test_perplexity_with_quantized_kv(tiny, tmp_path):
    text = tmp_path / "t.txt"
    text.write_text("the quick brown fox jumps over the lazy dog " * 3)
    values = {}
    for kv in ("auto", "int8", "fp8"):
        proc = run("perplexity", str(tiny), str(text), "--context", "16", "--kv-cache-dtype", kv)
        assert proc.returncode == 0, proc.stderr
        values[kv] = float(proc.stdout.split()[1])
    assert abs(values["int8"] / values["auto"] - 1) < 0.02  # quantized K/V moves it slightly
    assert abs(values["fp8"] / values["auto"] - 1) < 0.1


def test_engine_flags_are_checked(tiny):
    assert_clean_error(run("generate", str(tiny), "hi", "--max-num-seqs", "0"), "max-num-seqs")
    assert_clean_error(run("generate", str(tiny), "hi", "--kv-cache-memory", "10"), "kv-cache-memory")
    assert run("generate", str(tiny), "hi", "--kv-cache-dtype", "int9").returncode == 2  # argparse


def test_chat_reset_and_eof(tiny):
    proc = run("chat", str(tiny), "-n", "3", "--temperature", "0", input="hi\n/reset\nagain\n")
    assert proc.returncode == 0, proc.stderr
    assert "history cleared" in proc.stderr
    assert proc.stderr.count("[cut off: the reply reached 3 tokens") == 2  # -n 3 cut both replies


def test_chat_commands_and_multiline(tiny):
    typed = '/help\n/nonsense\n"""\nline one\nline two\n"""\n/bye\nnever read\n'
    proc = run("chat", str(tiny), "-n", "2", "--temperature", "0", input=typed)
    assert proc.returncode == 0, proc.stderr
    assert "/bye" in proc.stderr and "unknown command /nonsense" in proc.stderr
    assert proc.stderr.count("[cut off") == 1  # one reply: to the two-line message; /bye left before the last


def test_chat_set_parameter_and_show(tiny, tmp_path):
    """Ollama's /set parameter NAME VALUE and /show; a bad name or value is one error line and
    the session goes on."""
    tiny = write_tiny_llama(tmp_path / "tiny.gguf", context=TINY_CONTEXT, chat_template=TEMPLATE)  # no cap at 256
    typed = ("/show\n/set parameter temperature 0\n/set parameter num_predict 2\n/show parameters\n"
             "/set parameter top_k lots\n/set parameter bogus 1\n/set parameter temperature -1\n/show nonsense\n/set\n"
             "hi\n")
    proc = run("chat", str(tiny), input=typed)
    assert proc.returncode == 0, proc.stderr
    err = proc.stderr
    assert f"model        {tiny}" in err and "num_predict the context" in err and "architecture" in err
    assert "temperature 0.0" in err and "num_predict 2" in err  # /show parameters after the two /set
    assert "error: top_k takes an integer, got 'lots'" in err and "error: no parameter 'bogus'" in err
    assert "error: usage: /set parameter NAME VALUE" in err and "unknown command /set" not in err  # /set alone
    assert "error: invalid sampling parameter temperature" in err and "/show nonsense: show info or parameters" in err
    assert "[cut off: the reply reached 2 tokens" in err  # num_predict took


def test_chat_replies_are_not_capped_silently(tmp_path):
    """Without -n a reply runs to its end or the context's (it was cut at 256 tokens)."""
    model = write_tiny_llama(tmp_path / "chatty.gguf", context=400, chat_template=TEMPLATE)
    proc = run("chat", str(model), "--temperature", "0", "--ignore-eos", input="hi\n")
    assert proc.returncode == 0, proc.stderr
    assert "[cut off: the reply reached the context]" in proc.stderr and "base model" not in proc.stderr


def test_a_base_models_replies_stop_at_256_tokens(tmp_path):
    """A model without a chat template of its own seldom ends a chat reply: without -n, chat
    and run stop it at 256 tokens and say why; -n and --raw are taken as they are."""
    model = write_tiny_llama(tmp_path / "base.gguf", context=400)
    for proc in (run("chat", str(model), "--temperature", "0", "--ignore-eos", input="hi\n"),
                 run("run", str(model), "hi", "--temperature", "0", "--ignore-eos")):
        assert proc.returncode == 0, proc.stderr
        assert "has no chat template of its own (a base model" in proc.stderr and "stops at 256 tokens" in proc.stderr
        assert "[cut off: the reply reached 256 tokens" in proc.stderr or "[256 tokens, finish=length" in proc.stderr
    proc = run("run", str(model), "hi", "--temperature", "0", "--ignore-eos", "-n", "300")
    assert "base model" not in proc.stderr and "[300 tokens, finish=length" in proc.stderr
    proc = run("generate", str(model), "hi", "--raw", "--temperature", "0", "--ignore-eos")  # no template: no line
    assert "base model" not in proc.stderr and "[256 tokens, finish=length" in proc.stderr


def test_run_answers_a_prompt_or_chats(tiny, monkeypatch):
    """`minerva run MODEL PROMPT` answers as generate does; `minerva run MODEL` on a terminal chats."""
    flags = ("--raw", "-n", "3", "--temperature", "0", "--ignore-eos")
    answered = run("run", str(tiny), "hello", *flags)
    assert answered.returncode == 0, answered.stderr
    assert answered.stdout == run("generate", str(tiny), "hello", *flags).stdout
    assert run("run", str(tiny), *flags, input="hello").stdout == answered.stdout  # piped in
    from minerva import cli
    chats = []
    monkeypatch.setattr(cli, "cmd_chat", lambda args: chats.append((list(args.model), args.max_tokens)) or 0)
    monkeypatch.setattr(cli.sys.stdin, "isatty", lambda: True)
    assert cli.main(["run", str(tiny)]) == 0 and cli.main(["run"]) == 0
    assert chats == [([str(tiny)], None), ([], None)]  # chat's own default: no cap


def test_list_empty_store(tmp_path):
    proc = run("list", env_home=tmp_path)
    assert proc.returncode == 0 and "no models pulled" in proc.stdout


@pytest.mark.parametrize("value", ["0", "-2", "100000"])
def test_bad_thread_count(tiny, value):
    assert_clean_error(run("generate", str(tiny), "hi", "--threads", value), "--threads")


@pytest.mark.parametrize("args, words", [
    (["--seed", "99999999999999999999999"], "seed"),  # was a traceback from torch after the load
])
def test_bad_generate_options(tiny, args, words):
    assert_clean_error(run("generate", str(tiny), "hi", "-n", "2", *args), words)


def test_a_prompt_that_is_not_utf8(tiny):
    proc = subprocess.run([sys.executable, "-m", "minerva", "generate", str(tiny), "-n", "2"],
                          input=b"hello \xff\xfe world", capture_output=True, timeout=300)
    proc.stderr = proc.stderr.decode()
    assert_clean_error(proc, "not UTF-8: byte 0xFF at character 6")


def test_stdin_closed(tiny):
    """Started with stdin closed (a daemon, `<&-`): as with an empty stdin, not a traceback."""
    proc = subprocess.run([sys.executable, "-m", "minerva", "generate", str(tiny), "-n", "2"], stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=300, close_fds=True,
                          preexec_fn=lambda: __import__("os").close(0))
    assert_clean_error(proc, "the prompt is empty")


@pytest.mark.parametrize("key, words", [("", "--api-key is empty"), ("sk-x ", "whitespace")])
def test_serve_refuses_an_unusable_api_key(tiny, key, words):
    assert_clean_error(run("serve", str(tiny), "--api-key", key, "--port", "1"), words)


@pytest.mark.parametrize("args, words", [(["-p", "-1"], "--prompt"), (["-n", "-2"], "--gen"), (["-d", "-5"], "--depth")])
def test_bench_latency_lengths(tiny, args, words):
    assert_clean_error(run("bench", "latency", str(tiny), *args), words)


def test_quantize_a_safetensors_model(tmp_path):
    """int4 text is transformers' greedy continuation with the weights quantized and
    dequantized by the gguf package."""
    path = save(tmp_path, "llama-tied")
    proc = run("generate", str(path), "hello", "--raw", "-n", "8", "--temperature", "0", "--ignore-eos",
               "--quantize", "int4", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    assert "8 tokens" in proc.stderr
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ref = hf_greedy(load_hf_quantized_reference(path, "int4"), tok.encode("hello"), 8)
    assert proc.stdout == tok.decode(ref) + "\n"


def test_quantize_refuses_gguf_and_unknown_schemes(tiny):
    assert_clean_error(run("generate", str(tiny), "hi", "--quantize", "int8"), "--quantize", "GGUF")
    assert_clean_error(run("generate", str(tiny), "hi", "--quantize", "int3"), "--quantize", code=2)


def test_mistyped_flag_gets_its_subcommands_usage_and_a_hint():
    proc = run("bench", "serve", "--num-promts", "3")
    assert proc.returncode == 2 and "usage: minerva bench serve" in proc.stderr
    assert "minerva bench serve: error: unrecognized arguments: --num-promts (did you mean --num-prompts?)" \
        in proc.stderr
    helped = run("generate", "--help")
    assert helped.returncode == 0 and "(default: 16)" in helped.stdout  # defaults are shown
    assert "else 256 for generate" in " ".join(helped.stdout.split())
    assert "(default: the model's generation config, else 0.8)" in " ".join(helped.stdout.split())
    assert "(default: None)" not in helped.stdout and "(default: False)" not in helped.stdout


def test_model_flag_is_the_model_argument(tiny):
    flags = ("--raw", "-n", "3", "--temperature", "0", "--ignore-eos")
    by_flag = run("generate", "--model", str(tiny), "hello", *flags)
    positional = run("generate", str(tiny), "hello", *flags)
    assert by_flag.returncode == positional.returncode == 0 and by_flag.stdout == positional.stdout
    assert run("generate", "-m", str(tiny), *flags, input="hello").stdout == positional.stdout  # piped prompt
    assert_clean_error(run("chat", str(tiny), "--model", str(tiny)), "give the model once")


def test_served_model_name_does_not_swallow_the_model(tiny):
    assert_clean_error(run("serve", "--served-model-name", "a", str(tiny), "--port", "0"),
                       "looks like the model; put MODEL before --served-model-name")


def test_ctrl_c_while_the_command_starts_exits_quietly(tiny):
    """A Ctrl-C in the first moments (the CLI still importing torch) ends the command with
    exit 130 and no traceback, as one later does; `import minerva` itself stays light."""
    import signal
    import time

    light = subprocess.run([sys.executable, "-c", "import sys, minerva; print('torch' in sys.modules)"],
                           capture_output=True, text=True, timeout=60)
    assert light.stdout.strip() == "False", light.stderr
    interrupted = 0
    for delay in (0.2, 0.5, 1.0):
        proc = subprocess.Popen([sys.executable, "-m", "minerva", "generate", str(tiny), "hello", "-n", "200"],
                                stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        time.sleep(delay)
        if proc.poll() is not None:  # the whole command ran within the delay (a warm, fast machine)
            proc.communicate()
            continue
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
        if proc.returncode == 0 and "finish=length" in err:  # its 200 tokens were done as the signal came
            continue
        interrupted += 1
        assert proc.returncode == 130 and "Traceback" not in err and "terminate called" not in err, err
    assert interrupted, "each command ended before its Ctrl-C: nothing was interrupted"


def test_a_model_path_that_is_not_utf8_or_too_long_is_named(tmp_path, tiny):
    import os
    odd = tmp_path / os.fsdecode(b"bad\xffname.gguf")
    odd.write_bytes(tiny.read_bytes())
    assert_clean_error(run("generate", str(odd), "hi", "-n", "1"), "is not valid UTF-8", "rename the file")
    assert_clean_error(run("generate", str(tmp_path / ("x" * 300 + ".gguf")), "hi"), "cannot be looked up",
                       "File name too long")


def test_perplexity_of_a_model_giving_nan_and_of_a_device_are_errors(tiny, tmp_path):
    """A perplexity of NaN is no measurement: the NaN-logits error; and /dev/zero (no end to
    read to) is refused before it fills the memory."""
    import math

    import torch

    from minerva import LLM, MinervaError
    from minerva.engine.perplexity import perplexity
    llm = LLM(str(tiny), dtype="float32", kv_cache_memory=4e6)
    with torch.inference_mode():
        llm.loaded.model.norm.weight.fill_(math.nan)
    with pytest.raises(MinervaError, match="the model produced NaN/inf logits"):
        perplexity(llm.loaded.model, list(range(3, 40)), context=16, device=llm.device, dtype=llm.dtype)
    assert_clean_error(run("perplexity", str(tiny), "/dev/zero"), "'/dev/zero' is not a regular file")


def test_chat_template_option(tiny, tmp_path):
    """--chat-template renders the chat with the given template (the reply is transformers'
    greedy one to what it renders); a bad one is one error line naming it."""
    template = tmp_path / "qa.jinja"
    template.write_text("{% for m in messages %}Q: {{ m.content }}\n{% endfor %}A:")
    proc = run("generate", str(tiny), "hello", "--chat-template", str(template), "-n", "8", "--temperature", "0",
               "--ignore-eos", "--dtype", "float32")
    assert proc.returncode == 0, proc.stderr
    tok = reference_tokenizer(tiny)
    assert proc.stdout == tok.decode(hf_greedy(load_hf_reference(tiny), tok.encode("Q: hello\nA:"), 8)) + "\n"
    bad = tmp_path / "bad.jinja"
    bad.write_text("{% for %}")
    assert_clean_error(run("generate", str(tiny), "hello", "--chat-template", str(bad)),
                       "invalid chat template", f"the chat template file '{bad}'")
    assert_clean_error(run("generate", str(tiny), "hello", "--chat-template", str(tmp_path / "none.jinja")),
                       "none.jinja' cannot be read")
    assert_clean_error(run("serve", str(tiny), str(tiny), "--chat-template", str(template)),
                       "--chat-template replaces one model's template")


def test_a_model_whose_template_does_not_compile(tiny, tmp_path):
    """It loads with a warning: completions work, a chat is one error naming the file and the fix."""
    broken = retyped(tiny, tmp_path / "broken.gguf", "tokenizer.chat_template", "{% for %}", gguf.GGUFValueType.STRING)
    proc = run("generate", str(broken), "hello", "-n", "2")
    assert_clean_error(proc, "invalid chat template", f"the chat template of '{broken}'", "--chat-template FILE")
    assert "chat requests will fail (completions work)" in proc.stderr
    assert run("generate", str(broken), "hello", "-n", "2", "--raw").returncode == 0


def test_flags_for_the_chat_template_with_raw_and_a_home_that_is_a_file(tiny, tmp_path):
    """--system and --chat-template with --raw: one line saying they do not go together (the
    system message was dropped without a word); MINERVA_HOME, or its models folder, a file:
    one line naming it (pull was a traceback, list said nothing was pulled)."""
    for flag, value, words in (("--system", "be terse", "--system is a message for the chat template"),
                               ("--chat-template", "{{ x }}", "--chat-template renders chats")):
        assert_clean_error(run("generate", str(tiny), "hi", "--raw", flag, value), words, "--raw")
    home = tmp_path / "home"
    home.write_text("x")
    for args in (("pull", "smollm2-135m"), ("list",)):
        assert_clean_error(run(*args, env_home=home), f"MINERVA_HOME '{home}' is a file, not a folder")
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "models").write_text("x")
    assert_clean_error(run("list", env_home=folder), f"the model store '{folder / 'models'}' is a file")


def test_a_minerva_home_that_cannot_be_used_is_one_line(tiny, tmp_path):
    """MINERVA_HOME a file, or where no folder can be made (under a file; /proc): generate with a
    model by path (the kernel cache is under it) and pull (the store is) say so in one line naming
    it, and what to do; they were tracebacks."""
    blocker = tmp_path / "file.gguf"
    blocker.write_text("x")
    writable = "; set MINERVA_HOME to a writable folder"
    for home, words in ((blocker, (f"MINERVA_HOME '{blocker}' is a file, not a folder", "point MINERVA_HOME at")),
                        (blocker / "home", (f"MINERVA_HOME '{blocker / 'home'}' cannot be created", writable)),
                        ("/proc/nope", ("MINERVA_HOME '/proc/nope' cannot be created", writable))):
        for args in (("generate", str(tiny), "hi", "-n", "2"), ("pull", "smollm2-135m")):
            assert_clean_error(run(*args, env_home=home), *words)


def test_a_minerva_isa_that_names_no_build_is_one_line(tiny):
    """MINERVA_ISA=bogus was a note and a run on the reference path, ~19x slower: an error naming
    the variable and the builds it takes."""
    import os

    proc = subprocess.run([sys.executable, "-m", "minerva", "generate", str(tiny), "hi", "-n", "2", "--raw"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "MINERVA_ISA": "bogus"})
    assert_clean_error(proc, "MINERVA_ISA='bogus' is not one of avx512, avx2", "or unset it")


@pytest.mark.parametrize("command", ["generate", "serve", "serve-several"])
def test_speculative_settings_without_speculative_are_refused(tiny, command, capsys, monkeypatch):
    """--num-speculative-tokens and --speculative-max-batch change nothing without --speculative:
    one line saying so (they were dropped without a word), as soon as the command starts (in
    this process: before a model loads or a port is bound); with it they run."""
    from minerva import cli
    from minerva.cli import main

    for serving in ("serve", "serve_several"):  # a server started would serve on: fail instead
        monkeypatch.setattr(cli if serving == "serve" else cli.several, serving,
                            lambda *a, **k: pytest.fail("the flags were taken"))

    args = {"generate": ["generate", str(tiny), "hi", "-n", "2"], "serve": ["serve", str(tiny), "--port", "0"],
            "serve-several": ["serve", str(tiny), str(tiny), "--port", "0"]}[command]
    for flags, words in ((["--num-speculative-tokens", "3"], "--num-speculative-tokens sets speculative decoding, "
                                                               "which is off: add --speculative"),
                         (["--speculative-max-batch", "0", "--num-speculative-tokens", "2"],
                          "--num-speculative-tokens and --speculative-max-batch set speculative decoding")):
        assert main([*args, *flags]) == 1
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"minerva: error: {words}"), err
    if command == "generate":
        proc = run(*args, "--raw", "--speculative", "ngram", "--num-speculative-tokens", "3")
        assert proc.returncode == 0, proc.stderr
