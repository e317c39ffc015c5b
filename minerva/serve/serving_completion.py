"""POST /v1/completions: text completion of one prompt or several (strings or token ids)."""

from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from minerva.serve import convert
from minerva.serve import protocol as P
from minerva.serve.serving import Serving


class CompletionServing(Serving):
    """The text completions route."""

    async def completions(self, body: P.CompletionRequest, raw: HTTPRequest) -> Response:
        self.check_model(body.model)
        convert.check_supported(body)
        prompts = convert.completion_prompts(body)
        ids = [await self.encode(p, "prompt") for p in prompts]
        requests = await self.requests(ids, body, body.max_tokens, body.logprobs, "prompt")
        prefixes = [""] * len(requests)
        if body.echo:
            prefixes = [p if isinstance(p, str) else self.tokenizer.decode(i)
                        for p, i in zip(prompts, ids) for _ in range(body.n)]
        return await self.answer(raw, requests, body, False, body.logprobs is not None, sum(map(len, ids)),
                                 prefixes)
