"""A vLLM engine's chats read by vLLM's own frontend code, as `vllm serve` reads them: its request
type (ChatCompletionRequest: its validation and defaults), its tool-choice rules, its parsers
(tool calls and reasoning, chosen per engine by the spec's `frontend_args`, as `vllm serve`'s
--enable-auto-tool-choice, --tool-call-parser, --reasoning-parser), and the answer's message or
stream deltas in its shapes. What engined adds: the request may move. A stream that continues on
another engine (its delivered token ids resumed) replays the delivered text through a fresh
parser first, so the parser's state is where the first engine's was, and nothing it said is said
twice.

Imported only inside a `backend: vllm` engine child.
"""

from __future__ import annotations

import json
import os
from typing import Any

from engined.engine.backend import EngineConfigError, RequestRejected

FINISH_TOOL_CALLS = "tool_calls"


class ChatFrontend:
    """The engine's frontend options (spec `frontend_args`), loaded with the engine."""

    def __init__(self, tokenizer: Any, model_config: Any, options: dict[str, Any]) -> None:
        from pydantic import ValidationError
        from vllm.entrypoints.openai.chat_completion.protocol import (
            ChatCompletionNamedToolChoiceParam,
            ChatCompletionRequest,
        )
        from vllm.parser.parser_manager import ParserManager

        self.tokenizer, self.model_config = tokenizer, model_config
        self.request_type, self.named_type = (ChatCompletionRequest,
                                              ChatCompletionNamedToolChoiceParam)
        self.invalid = (ValidationError, ValueError, TypeError)
        self.auto_tools = bool(options.get("enable_auto_tool_choice"))
        tool_parser = options.get("tool_call_parser")
        if self.auto_tools and not tool_parser:
            raise EngineConfigError("frontend_args.enable_auto_tool_choice needs "
                                    "frontend_args.tool_call_parser (as vLLM's "
                                    "--enable-auto-tool-choice needs --tool-call-parser)")
        try:
            self.parser_cls = ParserManager.get_parser(
                tool_parser_name=tool_parser,
                reasoning_parser_name=options.get("reasoning_parser"),
                enable_auto_tools=self.auto_tools, model_name=model_config.model,
                is_harmony=False, tokenizer=tokenizer)
        except (KeyError, ValueError, TypeError, ImportError) as exc:
            raise EngineConfigError(f"vLLM rejected frontend_args: {exc}") from None
        self.exclude_tools_when_none = bool(options.get("exclude_tools_when_tool_choice_none"))
        self.template = _template(options.get("chat_template"))

    def open(self, chat: dict[str, Any]) -> Chat:
        """One chat request (the client's body); RequestRejected in vLLM's words."""
        return Chat(self, chat)


class Chat:
    """One chat: its prompt, the structured output its tool choice needs, and its output read by
    the parser: stream deltas as tokens come, or the whole message."""

    def __init__(self, frontend: ChatFrontend, body: dict[str, Any]) -> None:
        self.frontend = frontend
        try:
            request = frontend.request_type.model_validate({**body, "model": "engined"})
        except frontend.invalid as exc:
            raise RequestRejected(_words(exc)) from None
        parser_cls = frontend.parser_cls
        has_tool_parser = parser_cls is not None and parser_cls.tool_parser_cls is not None
        choice = request.tool_choice
        if not has_tool_parser and choice not in (None, "none"):
            if choice == "auto" and not frontend.auto_tools:
                raise RequestRejected('"auto" tool choice requires frontend_args '
                                      'enable_auto_tool_choice and tool_call_parser (vLLM\'s '
                                      '--enable-auto-tool-choice and --tool-call-parser)')
            if choice != "auto":
                name = (f'function "{choice.function.name}"'
                        if isinstance(choice, frontend.named_type) else f'"{choice}"')
                raise RequestRejected(f"tool_choice={name} requires frontend_args "
                                      f"tool_call_parser (vLLM's --tool-call-parser)")
        self.parser = (parser_cls(frontend.tokenizer, request.tools,
                                  chat_template_kwargs=request.chat_template_kwargs or {},
                                  model_config=frontend.model_config)
                       if parser_cls is not None else None)
        if self.parser is not None and request.tools:
            request = self.parser.adjust_request(request)
        self.request = request
        try:
            self.structured = request.extract_structured_outputs()
            self.prompt_ids = self._render()
        except frontend.invalid as exc:
            raise RequestRejected(_words(exc)) from None
        if self.parser is not None:
            self.parser.set_prompt_token_ids(self.prompt_ids)
        self.skip_special_tokens = bool(request.skip_special_tokens)
        self.called = False  # a stream's deltas held a tool call

    def _render(self) -> list[int]:
        request, frontend = self.request, self.frontend
        tools = None
        if request.tools is not None and not (request.tool_choice == "none"
                                              and frontend.exclude_tools_when_none):
            tools = [tool.model_dump() for tool in request.tools]
        messages = [_message(m) for m in request.messages]
        ids = frontend.tokenizer.apply_chat_template(
            messages, tools=tools, chat_template=frontend.template,
            add_generation_prompt=request.add_generation_prompt,
            continue_final_message=request.continue_final_message, tokenize=True,
            return_dict=False, **(request.chat_template_kwargs or {}))
        return list(ids)

    # --- output --------------------------------------------------------------------------
    def replay(self, text: str, ids: list[int]) -> None:
        """A moved stream: what the client already has goes through the parser, unsaid."""
        if self.parser is not None and ids:
            self.parser.parse_delta(text, ids, self.request, self.prompt_ids, finished=False)

    def delta(self, text: str, ids: list[int], finished: bool) -> dict[str, Any]:
        """A stream's new text as the chunk's delta (reasoning, content, tool call deltas);
        {} when the parser holds it back."""
        if self.parser is None:
            return {"content": text}
        parsed = self.parser.parse_delta(text, ids, self.request, self.prompt_ids,
                                         finished=finished)
        if parsed is None:
            return {}
        out = parsed.model_dump(exclude_none=True)
        self.called = self.called or bool(out.get("tool_calls"))
        if not self.request.include_reasoning:
            out.pop("reasoning", None)
        return out

    def message(self, text: str, ids: list[int], reason: str
                ) -> tuple[dict[str, Any], str | None]:
        """The whole answer's message, and the finish reason it implies (tool_calls), as vLLM's
        server builds them (`reason`: the generation's own)."""
        from vllm.entrypoints.generate.base.protocol import ToolCall
        from vllm.renderers.chat_utils import make_tool_call_id

        request = self.request
        if self.parser is None:
            return {"role": "assistant", "content": text}, None
        reasoning, content, calls = self.parser.parse(
            text, request, enable_auto_tools=self.frontend.auto_tools,
            model_output_token_ids=ids)
        message: dict[str, Any] = {"role": "assistant", "content": content}
        if request.include_reasoning and reasoning is not None:
            message["reasoning"] = reasoning
        choice = request.tool_choice
        named = isinstance(choice, self.frontend.named_type)
        forced = named or choice == "required"
        auto = (bool(request.tools) and choice in ("auto", None) and self.frontend.auto_tools
                and self.parser.tool_parser is not None)
        if forced or (auto and calls):
            if forced:
                message["content"] = content or ""
            message["tool_calls"] = [
                ToolCall(id=c.id or make_tool_call_id(), function=c).model_dump()
                for c in calls or []]
        called = (auto and bool(calls)) or (choice == "required" and reason == "stop")
        return message, FINISH_TOOL_CALLS if called else None

    def stream_finish(self, reason: str) -> str | None:
        """A stream's finish reason: tool_calls once it streamed a tool call (not for a named
        tool choice: OpenAI's "stop")."""
        named = isinstance(self.request.tool_choice, self.frontend.named_type)
        return FINISH_TOOL_CALLS if self.called and not named and reason == "stop" else None


def _message(message: Any) -> dict[str, Any]:
    """A request message as the chat template reads it: text parts joined, a tool call's
    arguments as a mapping (templates iterate them), other fields as sent."""
    out = dict(message) if isinstance(message, dict) else message.model_dump(exclude_none=True)
    content = out.get("content")
    if isinstance(content, list):
        out["content"] = "".join(p.get("text", "") for p in content if isinstance(p, dict))
    for call in out.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            try:
                function["arguments"] = json.loads(function["arguments"])
            except ValueError:
                pass
    return out


def _template(value: str | None) -> str | None:
    """The spec's chat_template: a file's content, or the template itself."""
    if value is None:
        return None
    if "{" not in value and os.path.exists(value):
        try:
            with open(value, encoding="utf-8") as f:
                return f.read()
        except OSError as exc:
            raise EngineConfigError(f"cannot read frontend_args.chat_template {value}: "
                                    f"{exc}") from None
    return value


def _words(exc: Exception) -> str:
    return " ".join(str(exc).split())[:2000] or type(exc).__name__
