"""The offline API: `LLM(model=None, **engine_args).generate(...)` and `.chat(...)`."""
from __future__ import annotations

import atexit
import gc
import itertools
from typing import Any, Sequence

from kvmesh.common.config import engine_config_from_kwargs
from kvmesh.common.gc_freeze import freeze_after_startup
from kvmesh.engine.engine import LLMEngine
from kvmesh.engine.input_processor import EngineRequest
from kvmesh.engine.lora.request import LoRARequest
from kvmesh.engine.outputs import RequestOutput
from kvmesh.engine.pooling_params import PoolingParams
from kvmesh.engine.sampling_params import SamplingParams

Message = dict[str, Any]


def _is_token_ids(x: Any) -> bool:
    return isinstance(x, (list, tuple)) and len(x) > 0 and all(
        isinstance(t, int) and not isinstance(t, bool) for t in x)


def _prompt_input(prompt: Any) -> Any:
    """A prompt as the engine takes it: text or token ids. vLLM's prompt dicts are accepted as
    vLLM takes them: TextPrompt {"prompt": text} and TokensPrompt {"prompt_token_ids": ids}
    (exactly one of the two; ValueError naming any other key)."""
    if not isinstance(prompt, dict):
        return prompt
    given = [k for k in ("prompt", "prompt_token_ids") if k in prompt]
    other = sorted(set(prompt) - {"prompt", "prompt_token_ids"})
    if other:
        raise ValueError(f"unsupported prompt key(s) {other}: a prompt dict takes 'prompt' (text) or "
                         "'prompt_token_ids' (token ids)")
    if len(given) != 1:
        raise ValueError("a prompt dict takes exactly one of 'prompt' (text) and 'prompt_token_ids' "
                         f"(token ids), got {given or 'neither'}")
    value = prompt[given[0]]
    if given[0] == "prompt" and not isinstance(value, str):
        raise ValueError(f"'prompt' must be a string, got {type(value).__name__}")
    if given[0] == "prompt_token_ids" and isinstance(value, str):
        raise ValueError("'prompt_token_ids' must be a list of token ids, got a string")
    return value


class LLM:
    """Offline batched generation on the paged-KV engine (vLLM's engine-argument names)."""

    def __init__(self, model: str | None = None, **engine_args: Any) -> None:
        self.engine = LLMEngine(engine_config_from_kwargs(model, **engine_args))
        self._ids = itertools.count()
        # NOTE: as `kvmesh serve` (and vLLM's engine core) does: what start-up built leaves the
        # collector, whose passes over it took ~2% of a decode-heavy run's CPU samples
        # (docs/BENCHMARKS.md); shutdown() hands it back
        freeze_after_startup()
        atexit.unregister(gc.unfreeze)      # once, however many LLMs a process makes
        atexit.register(gc.unfreeze)        # an LLM never shut down: collected at exit as before

    def shutdown(self) -> None:
        """Stop the engine's tensor-parallel worker processes (none with one rank) and return
        what start-up froze to the garbage collector (so a process that makes engines one after
        another does not keep their cycles)."""
        self.engine.shutdown()
        gc.unfreeze()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: str | Sequence[int] | dict | Sequence[str | Sequence[int] | dict],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        priority: Sequence[int] | None = None,
        cache_salt: str | None = None,
        lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None,
    ) -> list[RequestOutput]:
        """Generate for each prompt (a string, a list of token ids, or vLLM's {"prompt": text} /
        {"prompt_token_ids": ids}); outputs in prompt order.
        `lora_request`: the adapter of every prompt, or one per prompt (None: the base model;
        the engine needs enable_lora=True)."""
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        prompts = [_prompt_input(p) for p in prompts]
        if not prompts:
            raise ValueError("prompts must not be empty")
        params = self._params_list(sampling_params, len(prompts))
        if priority is not None and len(priority) != len(prompts):
            raise ValueError("priority must have one entry per prompt")
        loras = self._lora_list(lora_request, len(prompts))
        # NOTE: validate everything first, so a bad prompt leaves the engine untouched.
        requests = [self.engine.input_processor.process(
                        f"llm-{next(self._ids)}", prompt, p,
                        priority=priority[i] if priority else 0, cache_salt=cache_salt,
                        lora_request=loras[i])
                    for i, (prompt, p) in enumerate(zip(prompts, params))]
        for lora in dict.fromkeys(r for r in loras if r is not None):
            if lora.lora_int_id not in self.engine.list_loras():
                self.engine.add_lora(lora)     # a bad adapter fails before any request is added
        return self._run(requests)

    @staticmethod
    def _lora_list(lora_request, n: int) -> list[LoRARequest | None]:
        if lora_request is None or isinstance(lora_request, LoRARequest):
            return [lora_request] * n
        loras = list(lora_request)
        if len(loras) != n:
            raise ValueError(f"got {len(loras)} LoRA requests for {n} prompts")
        return loras

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them; `tools`
        (OpenAI tool objects) are rendered as the server renders them (kvmesh.prompt)."""
        if not messages:
            raise ValueError("messages must not be empty")
        conversations = [messages] if isinstance(messages[0], dict) else list(messages)
        prompts = [self.tokenizer.apply_chat_template(conv, add_generation_prompt=add_generation_prompt,
                                                      tools=tools)
                   for conv in conversations]
        return self.generate(prompts, sampling_params)

    def embed(self, prompts: str | Sequence[int] | Sequence[str | Sequence[int]],
              pooling: PoolingParams | str = "last") -> list[RequestOutput]:
        """One pooled embedding per prompt (`RequestOutput.embedding`), in prompt order: the
        hidden states after the final norm, last-token or mean pooled, L2-normalised."""
        if isinstance(pooling, str):
            pooling = PoolingParams(pooling)
        if isinstance(prompts, (str, dict)) or _is_token_ids(prompts):
            prompts = [prompts]
        prompts = [_prompt_input(p) for p in prompts]
        if not prompts:
            raise ValueError("prompts must not be empty")
        params = SamplingParams(max_tokens=1, temperature=0.0)
        requests = [self.engine.input_processor.process(f"llm-{next(self._ids)}", prompt, params,
                                                        pooling=pooling)
                    for prompt in prompts]
        return self._run(requests)

    def _params_list(self, sp, n: int) -> list[SamplingParams]:
        if sp is None:
            return [SamplingParams() for _ in range(n)]
        if isinstance(sp, SamplingParams):
            return [sp] * n
        sp = list(sp)
        if len(sp) != n:
            raise ValueError(f"got {len(sp)} sampling params for {n} prompts")
        return sp

    def _run(self, requests: list[EngineRequest]) -> list[RequestOutput]:
        ids = []
        try:
            for request in requests:
                self.engine.add_request(request)
                ids.append(request.request_id)
            final: dict[str, RequestOutput] = {}
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            self.engine.abort_request(ids)
            raise
        return [final[rid] for rid in ids]
