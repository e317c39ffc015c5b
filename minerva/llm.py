"""The offline Python API: `LLM(model).generate(prompts, params)`."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch
from tqdm import tqdm

from minerva.engine.generate import SimpleGenerator
from minerva.engine.request import Request, RequestOutput, StreamDelta
from minerva.engine.sampler import SamplingParams
from minerva.errors import MinervaError
from minerva.formats.chat import render_chat
from minerva.models.loader import LoadedModel, load_model
from minerva.store import resolve

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
Prompt = str | list[int]


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def parse_device(device: str | None) -> torch.device:
    name = device or default_device()
    try:
        dev = torch.device(name)
    except RuntimeError:
        dev = None
    if dev is None or dev.type not in ("cpu", "cuda"):
        raise MinervaError(f"unknown device '{name}'; use cpu, cuda or cuda:N")
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise MinervaError(f"device '{name}' requested but no CUDA GPU is available; use --device cpu")
    return dev


class LLM:
    """A loaded model with its tokenizer, ready to generate.

    `model` is a pulled name (pulled on first use), a .gguf path or a Hugging
    Face directory; None means the default model.
    """

    def __init__(self, model: str | None = None, *, device: str | None = None,
                 dtype: str = "float32", auto_pull: bool = True):
        if dtype not in DTYPES:
            raise MinervaError(f"unknown dtype '{dtype}'; choose one of {', '.join(DTYPES)}")
        self.device = parse_device(device)
        self.dtype = DTYPES[dtype]
        self.path = resolve(model, auto_pull=auto_pull)
        self.loaded: LoadedModel = load_model(self.path, self.device, self.dtype)
        self.tokenizer = self.loaded.tokenizer
        self.config = self.loaded.config
        self.chat_template = self.tokenizer.resolved_chat_template
        self._generator = SimpleGenerator(self.loaded.model, self.tokenizer, self.device, self.dtype)

    # ------------------------------------------------------------ prompts

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        return render_chat(self.chat_template, messages, bos_token=self._token(self.tokenizer.bos_token_id),
                           eos_token=self._token(self.tokenizer.eos_token_id),
                           add_generation_prompt=add_generation_prompt)

    def _token(self, token_id: int | None) -> str:
        return (self.tokenizer.id_to_token(token_id) or "") if token_id is not None else ""

    def make_request(self, prompt: Prompt, params: SamplingParams | None = None) -> Request:
        params = params or SamplingParams()
        if isinstance(prompt, str):
            # A chat template already starts with the BOS token where the model wants one.
            ids = self.tokenizer.encode(prompt, add_special_tokens=not self._starts_with_bos(prompt))
            return Request(ids, params, prompt=prompt)
        if isinstance(prompt, (list, tuple)) and all(isinstance(t, int) for t in prompt):
            return Request(list(prompt), params)
        raise MinervaError("a prompt must be a string or a list of token ids")

    def _starts_with_bos(self, text: str) -> bool:
        bos = self._token(self.tokenizer.bos_token_id)
        return self.tokenizer.add_bos and bool(bos) and text.startswith(bos)

    # --------------------------------------------------------- generation

    def generate(self, prompts: Prompt | Sequence[Prompt], params: SamplingParams | None = None,
                 *, use_tqdm: bool = False) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and isinstance(prompts[0], int)):
            prompts = [prompts]
        requests = [self.make_request(p, params) for p in prompts]
        for r in requests:  # reject bad input before any work is done
            self._generator.check(r)
        return [self._generator.run(r) for r in tqdm(requests, disable=not use_tqdm, desc="generate")]

    def stream(self, prompt: Prompt, params: SamplingParams | None = None) -> Iterator[StreamDelta]:
        """Yield text deltas of one prompt as tokens are produced."""
        return self._generator.stream(self.make_request(prompt, params))

    def chat(self, messages: list[dict], params: SamplingParams | None = None) -> RequestOutput:
        return self.generate(self.apply_chat_template(messages), params)[0]
