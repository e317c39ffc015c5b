"""POST /v1/chat/completions: a conversation through the model's chat template, with tools,
reasoning and structured output."""

from __future__ import annotations

from fastapi import Request as HTTPRequest
from fastapi.responses import Response

from minerva.serve import convert
from minerva.serve.convert import APIError
from minerva.serve import protocol as P
from minerva.serve.serving import Serving
from minerva.serve.truncation import fitting


class ChatServing(Serving):
    """The chat completions route."""

    async def chat_completions(self, body: P.ChatCompletionRequest, raw: HTTPRequest) -> Response:
        self.check_model(body.model)
        convert.check_supported(body)
        if body._thinks and self.llm.reasoning is None:
            raise APIError(400, f"'{body.model or self.config.served_model_name}' does not think (it is no reasoning "
                                "model); leave think out", "think")
        variables = convert.template_variables(body)
        tools = convert.tool_plan(body, self.llm.tool_format)
        if tools is not None and tools.forced:
            await self.check_parameters(tools)
        prompt, ids = await self.chat_ids(body, variables, tools)
        requests = await self.requests([ids], body, convert.chat_max_tokens(body), convert.chat_logprobs_count(body),
                                 "messages", chat=True, tools=tools)
        fmt = self.llm.reasoning  # a model that reasons first: each choice split by a parser of its own
        if tools is not None and tools.held_to_json(self.llm.tool_format):
            fmt = None  # the reply is the call's JSON from its first token: there is no reasoning to split
        parsers = [fmt.parser(prompt) for _ in requests] if fmt is not None else None
        callers = None
        if tools is not None and tools.choice != "none":  # harmony's calls are read by its reasoning parser
            callers = [tools.parser(self.llm.tool_format, parsers[i] if parsers else None)
                       for i in range(len(requests))]
        return await self.answer(raw, requests, body, True, body.logprobs, len(ids), [""] * len(requests),
                                 parsers, callers)

    async def chat_ids(self, body: P.ChatCompletionRequest, variables: dict, tools) -> tuple[str, list[int]]:
        """The prompt and its token ids; a request that asks (`_truncate`) drops the oldest
        turns of a conversation that does not fit the context with the tokens it asks for."""
        async def attempt(messages: list[P.ChatMessage]) -> tuple[str, list[int]]:
            prompt = await self.chat_prompt(messages, body.add_generation_prompt, variables,
                                            tools.prompt_tools if tools else None, body.continue_final_message)
            ids = await self.encode(prompt, "messages")
            if body._truncate:  # the 400 the engine's requests would give, raised here to try a shorter one
                convert.max_tokens_within(len(ids), convert.chat_max_tokens(body), self.max_model_len, "messages",
                                          body._to_context)
            return prompt, ids

        if not body._truncate:
            return await attempt(body.messages)
        return await fitting(body.messages, [m.role for m in body.messages], attempt)
