"""The runtime as an lm-eval model: `@register_model("slimlm")`, so lm-eval scores what slimlm serves.

Every request runs through the engine, batched by its scheduler:
- loglikelihood: one prefill of context + continuation that returns the continuation's log-probabilities
  (prompt_logprobs_from = where the continuation starts). Requests that share the start of their tokens
  (the continuations of one context, sentences that differ after a few words) wait until the first of them
  has been computed (batch.leaders), so what they share comes from the prefix cache; where the shared part
  reaches into a continuation (two answers that begin alike), its tokens' scores are the first request's
  too — the same tokens before a position give the same logits there — and are not computed again.
- loglikelihood_rolling: lm-eval's own disjoint rolling windows, each scored the same way.
- generate_until: generation with lm-eval's stop strings and token budget (greedy unless do_sample).
Tokenization follows lm-eval's `hf` backend (TemplateLM's context/continuation split, the same special-token
rule), so the requests and the numbers compare with it.
"""

from __future__ import annotations

import torch
from lm_eval.api.model import TemplateLM
from lm_eval.api.registry import register_model
from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs
from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

from slimlm.errors import SlimlmError
from slimlm.eval import batch
from slimlm.runtime.engine import Engine, EngineConfig
from slimlm.runtime.sampling import SamplingParams
from slimlm.runtime.sequence import common_prefix

DEFAULT_MAX_GEN_TOKS = 256  # lm-eval's hf backend default


def _int_or_none(value) -> int | None:
    if value in (None, "auto") or str(value).startswith("auto"):
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        raise SlimlmError(f"batch_size must be an integer or 'auto', got {value!r}") from None


@register_model("slimlm")
class SlimlmLM(TemplateLM):
    def __init__(
        self,
        pretrained: str = "smollm2-135m",
        batch_size: int | str | None = None,
        max_batch_size: int | None = None,
        add_bos_token: bool | None = None,
        progress: bool = True,
        **engine_args,
    ) -> None:
        """`pretrained`: a checkpoint the runtime serves (asset, directory or hub id). `batch_size`: sequences
        per engine step (lm-eval's meaning; "auto" or unset: 128). Other arguments are EngineConfig fields
        (dtype, device, kv_cache_memory, max_num_batched_tokens, max_model_len, ...)."""
        super().__init__()
        known = set(EngineConfig.__dataclass_fields__)
        unknown = sorted(set(engine_args) - known)
        if unknown:
            raise SlimlmError(
                f"unknown slimlm model_args {', '.join(unknown)}; known: pretrained, batch_size, "
                f"add_bos_token, {', '.join(sorted(known))}"
            )
        if engine_args.get("device") == "cuda:0" and not torch.cuda.is_available():
            engine_args["device"] = None  # lm-eval's command line passes its default, cuda:0, on every machine
        seqs = _int_or_none(batch_size) or _int_or_none(max_batch_size) or 128
        engine_args = {"max_num_seqs": seqs, **engine_args}
        self.engine = Engine(pretrained, EngineConfig(**engine_args))
        self.tokenizer = self.engine.tokenizer
        self.add_bos_token = add_bos_token
        self.progress = progress
        self.tokens_computed = 0  # tokens the engine ran, for the tokens/s of an eval

    # ---- what TemplateLM needs ------------------------------------------------------------------------

    @property
    def eot_token_id(self) -> int:
        return self.tokenizer.eos_token_id

    @property
    def prefix_token_id(self) -> int:  # as the hf backend: BOS if the tokenizer has one, else EOS
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.tokenizer.eos_token_id

    @property
    def max_length(self) -> int:
        return self.engine.max_model_len - 1  # the longest prompt: the engine always generates one token

    @property
    def tokenizer_name(self) -> str:
        return self.tokenizer.name_or_path.replace("/", "__")

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        special = (
            {}
            if add_special_tokens is None and self.add_bos_token is None
            else {"add_special_tokens": self.add_bos_token if add_special_tokens is None else add_special_tokens}
        )
        bos = self.tokenizer.bos_token
        if add_special_tokens is None and bos and string.startswith(bos):
            special["add_special_tokens"] = False  # the text already starts with BOS
        return self.tokenizer.encode(string, **special)

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history, tokenize=False, add_generation_prompt=add_generation_prompt
        )

    # ---- scoring --------------------------------------------------------------------------------------

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        prompts, starts = [], []
        for _, context, continuation in requests:
            tokens = (context + continuation)[-self.max_length :]  # left-truncated, as the hf backend does
            prompts.append(tokens)
            starts.append(max(1, len(tokens) - len(continuation)))
        after = batch.leaders([tokens[:-1] for tokens in prompts])  # the last token is always computed
        # Scores of token t (the logits at t - 1) a request shares with its leader, which scored them: taken
        # from it. Its own scoring starts at `own`, and the prefix cache serves what is before own - 1.
        own = [
            starts[i]
            if j == i or starts[j] > starts[i]
            else max(starts[i], min(common_prefix(prompts[i], prompts[j]), len(prompts[i]) - 1))
            for i, j in enumerate(after)
        ]
        params = [SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=1, prompt_logprobs_from=f) for f in own]
        outputs = self._run(prompts, params, after, "loglikelihood", disable_tqdm)
        scores: dict[int, tuple[list[float], list[bool]]] = {}  # request -> its scored tokens' (logprob, greedy)

        def scored(i: int) -> tuple[list[float], list[bool]]:
            if i not in scores:
                out, tokens = outputs[i], prompts[i]
                greedy = [top[0][0] == t for top, t in zip(out.prompt_top_logprobs, tokens[own[i] :], strict=True)]
                logprobs, j = list(out.prompt_logprobs), after[i]
                if own[i] > starts[i]:  # the leader's scores of tokens starts[i] .. own[i] - 1 come first
                    lead_logprobs, lead_greedy = scored(j)
                    first, last = starts[i] - starts[j], own[i] - starts[j]
                    logprobs, greedy = lead_logprobs[first:last] + logprobs, lead_greedy[first:last] + greedy
                scores[i] = logprobs, greedy
            return scores[i]

        results = []
        for i, (cache_key, _, _) in enumerate(requests):
            logprobs, greedy = scored(i)
            result = (float(sum(logprobs)), all(greedy))
            if cache_key is not None:
                self.cache_hook.add_partial("loglikelihood", cache_key, result)
            results.append(result)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        windows, owner = [], []
        for i, (text,) in enumerate(req.args for req in requests):
            for context, continuation in map(
                make_disjoint_window,
                get_rolling_token_windows(
                    token_list=self.tok_encode(text),
                    prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length - 1,
                    context_len=1,
                ),
            ):
                windows.append((None, context, continuation))
                owner.append(i)
        totals = [0.0] * len(requests)
        for i, (logprob, _) in zip(owner, self._loglikelihood_tokens(windows, disable_tqdm), strict=True):
            totals[i] += logprob
        for req, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        eos = self.tokenizer.decode([self.eot_token_id])
        prompts, params = [], []
        for context, gen_kwargs in (req.args for req in requests):
            kwargs = normalize_gen_kwargs(dict(gen_kwargs), default_max_gen_toks=DEFAULT_MAX_GEN_TOKS)
            until = [s for s in handle_stop_sequences(kwargs.pop("until", None), eos=eos) if s]
            max_tokens = min(kwargs.pop("max_gen_toks"), self.max_length - 1)
            greedy = not kwargs.get("do_sample")
            prompts.append(self.tok_encode(context)[-(self.max_length - max_tokens) :])
            params.append(
                SamplingParams(
                    max_tokens=max_tokens,
                    stop=until,
                    temperature=0.0 if greedy else float(kwargs.get("temperature", 1.0)),
                    top_p=float(kwargs.get("top_p", 1.0)),
                    top_k=int(kwargs.get("top_k", 0)),
                    seed=kwargs.get("seed"),
                )
            )
        outputs = self._run(prompts, params, None, "generate_until", disable_tqdm)
        texts = [out.outputs[0].text for out in outputs]
        for req, text in zip(requests, texts, strict=True):
            self.cache_hook.add_partial("generate_until", req.args, text)
        return texts

    def _run(self, prompts, params, after, what: str, quiet: bool):
        outputs = batch.run(self.engine, prompts, params, after, f"slimlm {what}", self.progress and not quiet)
        self.tokens_computed += batch.computed_tokens(prompts, outputs)
        return outputs
