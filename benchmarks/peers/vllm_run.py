"""Greedy tokens from vLLM's own LLM on a checkpoint. Runs in vLLM's venv (benchmarks/peers/vllm_venv.sh).

    python vllm_run.py --model DIR [--model DIR:fp8 ...] --prompts prompts.json --max-tokens 16 [--dtype float32]

prompts.json holds lists of token ids; prints one JSON object, by model: the greedy ids per prompt, and which
WNA16 configs ran on the stand-in below rather than on one of vLLM's kernels. DIR:fp8 serves DIR with an fp8 KV
cache (vLLM reads the checkpoint's kv_cache_scheme scales only when asked for one).

The model is loaded with `LLM(model=DIR)`: vLLM reads config.json, quantization_config and the safetensors with
its own code. Only where this machine's vLLM build has no kernel for a layer does a stand-in multiply: vLLM's CPU
kernel (cpu_gemm_wna16) reads 4-bit codes only, multiplies bf16/fp16 activations only, and is missing from its
AVX2 build. The stand-in takes vLLM's loaded parameters, unpacks them with vLLM's own helper, dequantizes them
by the compressed-tensors definition (codes − zero point, or − the type's bias, times the group's scale) and
multiplies in the activations' dtype.
"""

import argparse
import gc
import json
import os

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in this process: the stand-in is in it
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the default takes a share of the machine's memory

import torch  # noqa: E402
import vllm._custom_ops  # noqa: E402, F401  (loads vllm._C, the CPU ops)
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402
from vllm.model_executor.kernels import linear  # noqa: E402
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import MPLinearKernel  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import unpack_quantized_values_into_int32  # noqa: E402
from vllm.platforms import current_platform  # noqa: E402

STAND_IN = []  # the configs that used it
VLLM_KERNELS = list(linear._POSSIBLE_KERNELS[current_platform._enum])
# vLLM's CPU kernel calls this op, which its AVX2 build lacks (while the kernel still says it can)
MISSING = set() if hasattr(torch.ops._C, "cpu_gemm_wna16") else {"CPUWNA16LinearKernel"}


class StandInWNA16(MPLinearKernel):
    @classmethod
    def get_min_capability(cls) -> int:
        return -1

    @classmethod
    def can_implement(cls, c) -> tuple[bool, str | None]:
        if c.act_type != torch.float32 and any(
            k.can_implement(c)[0] for k in VLLM_KERNELS if k.__name__ not in MISSING
        ):
            return False, "one of vLLM's kernels runs it"
        STAND_IN.append(f"{c.weight_type} g{c.group_size} zp={c.zero_points} {c.act_type} {list(c.full_weight_shape)}")
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        codes = unpack_quantized_values_into_int32(getattr(layer, self.w_q_name).data, self.config.weight_type, 1)
        scale = getattr(layer, self.w_s_name).data
        columns = codes.shape[1]
        if self.config.zero_points:
            zeros = getattr(layer, self.w_zp_name).data
            zero = unpack_quantized_values_into_int32(zeros, self.config.weight_type, 0)[: codes.shape[0]]
        else:
            zero = torch.full_like(scale, self.config.weight_type.bias, dtype=torch.int32)
        per_group = columns // scale.shape[1]
        weight = (codes - zero.repeat_interleave(per_group, 1)) * scale.float().repeat_interleave(per_group, 1)
        layer.stand_in_weight = torch.nn.Parameter(weight.to(self.config.act_type), requires_grad=False)

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        return torch.nn.functional.linear(x, layer.stand_in_weight.to(x.dtype), bias)


def key_scales(model: torch.nn.Module) -> list[float]:
    return [float(m._k_scale) for m in model.modules() if hasattr(m, "_k_scale")]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", action="append", required=True)
    p.add_argument("--prompts", required=True)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--dtype", default="float32")
    a = p.parse_args()

    linear._POSSIBLE_KERNELS[current_platform._enum].insert(0, StandInWNA16)
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in json.loads(open(a.prompts).read())]
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0, ignore_eos=True)
    results = {}
    for spec in a.model:  # one process for all: vLLM's start-up is most of the time
        model, _, kv = spec.partition(":")
        STAND_IN.clear()
        llm = LLM(model=model, dtype=a.dtype, kv_cache_dtype=kv or "auto", max_model_len=512, enforce_eager=True)
        outputs = llm.generate(prompts, params, use_tqdm=False)
        results[spec] = {
            "tokens": [list(o.outputs[0].token_ids) for o in outputs],
            "stand_in": sorted(set(STAND_IN)),
            "k_scales": llm.apply_model(key_scales)[0],  # what vLLM's attention layers hold, in layer order
        }
        del llm, outputs
        gc.collect()
    print(json.dumps(results))


if __name__ == "__main__":
    main()
