"""What the transformers backend computes from the model's logits itself, where `generate` has
no parameter for it: vLLM's logprobs (the raw distribution's log-probabilities, a position's
token with its rank and the likeliest others, the prompt's positions) and the sampling fields
applied row by row (logit_bias, presence and frequency penalties, min_tokens).

Imported only with the transformers backend (torch and transformers are imported where used).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from engined.engine.backend import Admission, PromptLogprobs, first_position

if TYPE_CHECKING:
    from engined.engine.protocol import Position


def prompt_logprobs(model: Any, tokenizer: Any, torch: Any, device: str,
                    request: Admission) -> PromptLogprobs | None:
    """One forward over the prompt alone: each token's logprob given the ones before it (None:
    the request did not ask)."""
    top = request.sampling.prompt_logprobs
    if top is None:
        return None
    ids = request.prompt_ids
    logits = model(input_ids=torch.tensor([ids], device=device)).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    return PromptLogprobs(request.id, [first_position(ids[0], token_text(tokenizer, ids[0]))] + [
        position(torch, tokenizer, logprobs[i - 1], ids[i], top) for i in range(1, len(ids))])


def position(torch: Any, tokenizer: Any, logprobs: Any, token: int, top: int) -> Position:
    """`token`'s logprob and rank in one position's distribution, then the `top` likeliest
    (vLLM's order: the token first, each token once)."""
    from engined.engine.protocol import TokenLogprob

    chosen = float(logprobs[token])
    rank = int((logprobs > chosen).sum()) + 1
    best = torch.topk(logprobs, top) if top else None
    pairs = [(token, chosen, rank)]
    if best is not None:
        pairs += [(int(t), float(v), r) for r, (v, t) in
                  enumerate(zip(best.values.tolist(), best.indices.tolist()), start=1)
                  if int(t) != token]
    return [TokenLogprob(t, v, r, token_text(tokenizer, t)) for t, v, r in pairs]


def token_text(tokenizer: Any, token: int) -> str:
    """A token alone as text, its leading space kept (SentencePiece's marker), as vLLM shows
    tokens in logprobs."""
    text = str(tokenizer.decode([token]))
    raw = tokenizer.convert_ids_to_tokens(token) or ""
    markers = len(raw) - len(raw.lstrip("\u2581"))
    missing = markers - (len(text) - len(text.lstrip(" ")))
    return " " * missing + text if missing > 0 else text


class RowLogits:
    """What `generate` has no per-row parameter for, applied row by row: `logit_bias`, the
    presence and frequency penalties over each row's output (its resumed tokens included: a
    moved request continues as if it had not moved), and `min_tokens` (no end of sequence nor
    stop token before it)."""

    def __init__(self, torch: Any, eos_token_id: int | None, requests: list[Admission],
                 width: int) -> None:
        self.torch, self.eos_token_id = torch, eos_token_id
        self.requests, self.width = requests, width
        sampling = requests[0].sampling if requests else None
        self.active = sampling is not None and bool(
            sampling.logit_bias or sampling.presence_penalty or sampling.frequency_penalty
            or any(r.sampling.min_tokens > r.resumed for r in requests))

    def processors(self) -> Any:
        from transformers import LogitsProcessor, LogitsProcessorList

        if not self.active:
            return LogitsProcessorList()
        adjust = self

        class _Adjust(LogitsProcessor):
            def __call__(self, input_ids: Any, scores: Any) -> Any:
                return adjust(input_ids, scores)

        return LogitsProcessorList([_Adjust()])

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        torch = self.torch
        for i, request in enumerate(self.requests):
            sampling = request.sampling
            for token, bias in sampling.logit_bias.items():
                if 0 <= token < scores.shape[1]:
                    scores[i, token] += bias
            if sampling.presence_penalty or sampling.frequency_penalty:
                output = input_ids[i, self.width - request.resumed:]
                if output.numel():
                    counts = torch.bincount(output, minlength=scores.shape[1])[:scores.shape[1]]
                    scores[i] -= (sampling.frequency_penalty * counts
                                  + sampling.presence_penalty * (counts > 0))
            generated = input_ids.shape[1] - self.width + request.resumed
            if generated < sampling.min_tokens:
                ends = [*sampling.stop_token_ids]
                if not sampling.ignore_eos and self.eos_token_id is not None:
                    ends.append(self.eos_token_id)
                for token in ends:
                    if 0 <= token < scores.shape[1]:
                        scores[i, token] = -float("inf")
        return scores


class RawLogits:
    """While a batch that asks for logprobs generates: the model's raw logits at the last
    position of each forward (a hook on its output layer), as log-probabilities, before any
    temperature, penalty or bias (vLLM's default logprobs)."""

    def __init__(self, model: Any, top: int | None) -> None:
        self.model, self.wanted = model, top is not None
        self.last: Any = None
        self.handle: Any = None

    def __enter__(self) -> RawLogits | None:
        if not self.wanted:
            return None
        self.handle = self.model.get_output_embeddings().register_forward_hook(self._keep)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.handle is not None:
            self.handle.remove()
        self.last = None

    def _keep(self, module: Any, inputs: Any, output: Any) -> None:
        self.last = output[:, -1, :]

    def logprobs(self) -> Any:
        import torch

        return None if self.last is None else torch.log_softmax(self.last.float(), dim=-1)
