"""POST /v1/embeddings: the final hidden state of each input's last token, L2-normalized."""

from __future__ import annotations

import asyncio

from fastapi import Request as HTTPRequest

from minerva.serve import convert
from minerva.serve import protocol as P
from minerva.serve.convert import APIError
from minerva.serve.guard import ACCESS
from minerva.serve.serving import Serving, _abort_on_disconnect


class EmbeddingServing(Serving):
    """The embeddings route."""

    async def embeddings(self, body: P.EmbeddingRequest, raw: HTTPRequest):
        self.check_model(body.model)
        width = self.llm.config.hidden_size
        if body.dimensions is not None and body.dimensions != width:
            raise APIError(400, f"this model's embeddings have {width} dimensions; leave out dimensions "
                                f"(got {body.dimensions})", "dimensions")
        ids = [self.truncated(await self.encode(p, "input"), i, body) for i, p in enumerate(body.inputs())]
        requests = await self.requests(ids, body, 1, None, "input", fixed=convert.embedding_params())
        group = self.submit(requests)
        async for _ in self.whole(group, asyncio.ensure_future(_abort_on_disconnect(raw, self.engine, group))):
            pass
        tokens = sum(map(len, ids))
        raw.scope.get(ACCESS, {})["prompt"] = tokens
        return {"object": "list", "model": body.model or self.config.served_model_name,
                "data": [{"object": "embedding", "index": i,
                          "embedding": convert.embedding_vector(r.embedding, body.encoding_format)}
                         for i, r in enumerate(requests)],
                "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}

    def truncated(self, ids: list[int], i: int, body: P.EmbeddingRequest) -> list[int]:
        """Input i's tokens within what an embedding of this model takes: its last
        truncate_prompt_tokens, or its first ones (Ollama's truncate), else all or a 400."""
        most, k = self.max_model_len - 1, body.truncate_prompt_tokens
        if k is not None:
            if k < -1 or k == 0:
                raise APIError(400, f"truncate_prompt_tokens must be -1 (as many as the model takes) or at least 1, "
                                    f"got {k}", "truncate_prompt_tokens")
            if k > most:
                raise APIError(400, f"truncate_prompt_tokens {k} is more than an embedding of this model takes "
                                    f"({most}); give at most that, or -1", "truncate_prompt_tokens")
            return ids[-(most if k == -1 else k):]
        if len(ids) > most:
            if body._keep_start:
                return ids[:most]
            raise APIError(400, f"input {i} has {len(ids)} tokens, more than an embedding of this model takes "
                                f"({most}); shorten it", "input")
        return ids
