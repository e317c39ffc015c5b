"""Peers for `minerva bench --compare`: llama.cpp (through llama-cpp-python) and HF transformers.

Each runner loads the same model file in this process and measures the same
things Minerva is measured on, as its own tools do: prompt processing is one
forward over the prompt; generation feeds one token per sequence per step
(llama-bench and llama-batched-bench feed tokens without sampling, and so do
these runners; Minerva's figures include its sampling). Peers are optional:
asking for one that is not installed is a one-line error saying what to install.
"""

from __future__ import annotations

import importlib.util
import sys
import time
from pathlib import Path

import torch

from minerva.bench.report import SystemInfo
from minerva.errors import MinervaError
from minerva.machine import rss_mb

PEERS = ("llama.cpp", "transformers")
# llama.cpp's AMX matmul (built where the CPU has AMX) crashed the process on a Xeon of this
# project's: a segmentation fault in ggml_backend_amx_mul_mat at the first forward, on Q4_1 and
# Q4_K_M files alike (llama.cpp issue 20824). A crash cannot be caught, so say what to do first.
AMX_WARNING = ("warning: this llama.cpp was built with AMX, whose matmul crashes with a segmentation fault on "
               "some machines (llama.cpp issue 20824); if it does, rebuild it without: CMAKE_ARGS='-DGGML_NATIVE=OFF "
               "-DGGML_AVX512=ON -DGGML_AVX512_VBMI=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX2=ON "
               "-DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON' pip install --force-reinstall --no-deps llama-cpp-python")


TRANSFORMERS_MISSING = "--compare transformers needs transformers: pip install transformers accelerate"
LLAMA_CPP_INSTALL = "pip install llama-cpp-python (in a checkout: pip install -e '.[bench]')"


def _llama_cpp():
    """llama-cpp-python's module, or one clear error saying what to install."""
    try:
        import llama_cpp
    except Exception as e:  # not installed, installed without its dependencies, or a library that does not load
        if importlib.util.find_spec("llama_cpp") is None:
            raise MinervaError(f"--compare llama.cpp needs llama-cpp-python: {LLAMA_CPP_INSTALL}") from None
        name = getattr(e, "name", None)
        missing = f"pip install {name}" if name and not name.startswith("llama_cpp") else LLAMA_CPP_INSTALL
        raise MinervaError(f"--compare llama.cpp: llama-cpp-python is installed but does not import ({e}); "
                           f"install what it needs: {missing}") from None
    return llama_cpp


def check_peer(name: str) -> None:
    """Before anything loads: a peer of --compare that cannot run here is one clear error."""
    if name == "llama.cpp":
        _llama_cpp()
    elif name == "transformers":
        if importlib.util.find_spec("transformers") is None:
            raise MinervaError(TRANSFORMERS_MISSING)
    else:
        raise MinervaError(f"unknown peer '{name}'; choose llama.cpp or transformers")


def load_peer(name: str, model_path: Path, threads: int, n_ctx: int, n_seq: int = 1):
    if name == "llama.cpp":
        return LlamaCpp(model_path, threads, n_ctx, n_seq)
    if name == "transformers":
        return Transformers(model_path, threads)
    raise MinervaError(f"unknown peer '{name}'; choose llama.cpp or transformers")


class LlamaCpp:
    """llama.cpp's C API through llama-cpp-python's ctypes bindings."""

    def __init__(self, model_path: Path, threads: int, n_ctx: int, n_seq: int):
        lc = _llama_cpp()
        if Path(model_path).suffix != ".gguf":
            raise MinervaError("llama.cpp runs GGUF files only; give a .gguf model")
        self.lc = lc
        if "AMX_INT8 = 1" in lc.llama_print_system_info().decode(errors="replace"):
            print(AMX_WARNING, file=sys.stderr, flush=True)
        before = rss_mb()
        start = time.perf_counter()
        lc.llama_backend_init()
        mparams = lc.llama_model_default_params()
        self.model = lc.llama_model_load_from_file(str(model_path).encode(), mparams)
        if not self.model:
            raise MinervaError(f"llama.cpp could not load '{model_path}'")
        self.n_batch = 512
        self.n_seq = max(1, n_seq)
        cparams = lc.llama_context_default_params()
        cparams.n_ctx = max(n_ctx, 256)
        cparams.n_batch = self.n_batch
        cparams.n_ubatch = self.n_batch
        cparams.n_seq_max = self.n_seq
        cparams.n_threads = threads
        cparams.n_threads_batch = threads
        cparams.no_perf = True
        self.ctx = lc.llama_init_from_model(self.model, cparams)
        if not self.ctx:
            raise MinervaError("llama.cpp could not create a context (try a smaller --kv-cache-memory / context)")
        self.batch = lc.llama_batch_init(max(self.n_batch, self.n_seq), 0, 1)
        self.mem = lc.llama_get_memory(self.ctx)
        version = getattr(lc, "__version__", "?")
        self.info = SystemInfo("llama.cpp", time.perf_counter() - start, rss_mb() - before,
                               f"(growth of this process; llama-cpp-python {version}, n_ctx {cparams.n_ctx}, "
                               f"{self.n_seq} sequences)")

    # -- low level

    def _decode(self, items: list[tuple[int, int, int, bool]]) -> None:
        """items: (token, position, sequence, wants logits), at most n_batch of them."""
        b = self.batch
        for i, (tok, pos, seq, logits) in enumerate(items):
            b.token[i] = tok
            b.pos[i] = pos
            b.n_seq_id[i] = 1
            b.seq_id[i][0] = seq
            b.logits[i] = logits
        b.n_tokens = len(items)
        rc = self.lc.llama_decode(self.ctx, b)
        if rc != 0:
            raise MinervaError(f"llama.cpp llama_decode failed with code {rc} (context full?)")

    def _clear(self) -> None:
        self.lc.llama_memory_clear(self.mem, True)

    def _prefill(self, tokens: list[int], seq: int = 0, start: int = 0) -> None:
        for lo in range(0, len(tokens), self.n_batch):
            chunk = tokens[lo:lo + self.n_batch]
            last = lo + len(chunk) == len(tokens)
            self._decode([(t, start + lo + i, seq, last and i == len(chunk) - 1) for i, t in enumerate(chunk)])

    # -- measurements

    def prefill(self, prompt: list[int], depth: int = 0) -> float:
        self._clear()
        if depth:
            self._prefill(prompt[:depth])
        start = time.perf_counter()
        self._prefill(prompt[depth:], start=depth)
        return (len(prompt) - depth) / (time.perf_counter() - start)

    def decode(self, prompt: list[int], n: int) -> float:
        """tokens/s of n single-token steps after the prompt (llama-bench tg)."""
        self._clear()
        self._prefill(prompt)
        tok, pos = prompt[-1], len(prompt)
        start = time.perf_counter()
        for i in range(n):
            self._decode([(tok, pos + i, 0, True)])
        return n / (time.perf_counter() - start)

    def decode_batch(self, prompts: list[list[int]], n: int) -> float:
        """Generated tokens/s of len(prompts) sequences decoding n steps together, after
        their prompts are processed (llama-batched-bench's S_TG)."""
        if len(prompts) > self.n_seq:
            raise MinervaError(f"llama.cpp context was made for {self.n_seq} sequences, asked {len(prompts)}")
        self._clear()
        items = [(t, i, s, i == len(p) - 1) for s, p in enumerate(prompts) for i, t in enumerate(p)]
        for lo in range(0, len(items), self.n_batch):
            self._decode(items[lo:lo + self.n_batch])
        start = time.perf_counter()
        for step in range(n):
            self._decode([(p[-1], len(p) + step, s, True) for s, p in enumerate(prompts)])
        return len(prompts) * n / (time.perf_counter() - start)

    def generate_batch(self, prompts: list[list[int]], outs: list[int], max_batch: int) -> float:
        """Continuous batching as llama.cpp's server does it: up to max_batch sequences in
        flight, each step carries one token per decoding sequence plus prompt chunks of new
        ones (at most n_batch tokens a step). Returns seconds to finish all."""
        slots = min(max_batch, self.n_seq)
        self._clear()
        queue = list(range(len(prompts)))
        active: dict[int, list] = {}  # seq slot -> [request, tokens done (prompt), generated]
        free = list(range(slots))
        start = time.perf_counter()
        while queue or active:
            while queue and free:
                active[free.pop()] = [queue.pop(0), 0, 0]
            items, owners = [], []
            for seq, st in active.items():  # decodes first
                r, done, gen = st
                if done == len(prompts[r]):
                    items.append((prompts[r][-1], done + gen - 1, seq, True))
                    owners.append((seq, "gen"))
            for seq, st in active.items():  # then prompt chunks, within the step's budget
                r, done, _ = st
                p = prompts[r]
                if done < len(p) and len(items) < self.n_batch:
                    take = min(len(p) - done, self.n_batch - len(items))
                    items += [(t, done + i, seq, done + i == len(p) - 1) for i, t in enumerate(p[done:done + take])]
                    owners.append((seq, take))
            self._decode(items)
            for seq, what in owners:
                st = active[seq]
                if what == "gen":
                    st[2] += 1
                else:
                    st[1] += what
                    if st[1] == len(prompts[st[0]]):
                        st[2] = 1  # the prompt's last logits give the first token
                if st[2] >= outs[st[0]]:
                    self.lc.llama_memory_seq_rm(self.mem, seq, -1, -1)
                    del active[seq]
                    free.append(seq)
        return time.perf_counter() - start

    def close(self) -> None:
        self.lc.llama_batch_free(self.batch)
        self.lc.llama_free(self.ctx)
        self.lc.llama_model_free(self.model)


class Transformers:
    """HF transformers on the same file (it dequantizes GGUF weights to float32)."""

    def __init__(self, model_path: Path, threads: int):
        try:
            import transformers
            from transformers import AutoModelForCausalLM
        except ImportError:
            raise MinervaError(TRANSFORMERS_MISSING) from None
        torch.set_num_threads(threads)
        before = rss_mb()
        start = time.perf_counter()
        path = Path(model_path)
        if path.is_dir():
            self.model = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        else:
            self.model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name,
                                                              dtype=torch.float32)
        self.model.eval()
        self.info = SystemInfo("transformers", time.perf_counter() - start, rss_mb() - before,
                               f"(growth of this process; transformers {transformers.__version__}, float32)")

    def _forward(self, ids, cache=None):
        with torch.inference_mode():
            return self.model(input_ids=ids, past_key_values=cache, use_cache=True)

    def prefill(self, prompt: list[int], depth: int = 0) -> float:
        cache = None
        if depth:
            cache = self._forward(torch.tensor([prompt[:depth]])).past_key_values
        start = time.perf_counter()
        self._forward(torch.tensor([prompt[depth:]]), cache)
        return (len(prompt) - depth) / (time.perf_counter() - start)

    def decode(self, prompt: list[int], n: int) -> float:
        return self.decode_batch([prompt], n)

    def decode_batch(self, prompts: list[list[int]], n: int) -> float:
        if len({len(p) for p in prompts}) != 1:
            raise MinervaError("the transformers peer decodes batches of equal-length prompts only")
        ids = torch.tensor(prompts)
        out = self._forward(ids)
        cache, tok = out.past_key_values, ids[:, -1:]
        start = time.perf_counter()
        for _ in range(n):
            cache = self._forward(tok, cache).past_key_values
        return len(prompts) * n / (time.perf_counter() - start)

    def generate_batch(self, prompts, outs, max_batch) -> float:
        raise MinervaError("the transformers peer has no continuous batching; compare throughput with llama.cpp")

    def close(self) -> None:
        del self.model

