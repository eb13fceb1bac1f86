import pytest
import torch

from slimlm.formats.quantized import QuantArgs
from slimlm.kernels import cpu_gemm, cpu_library
from slimlm.kernels.packed import dequantize
from slimlm.runtime.loader import load_model
from slimlm.runtime.model import Linear, fuse
from tests.kernels.problems import haswell_library, quantized_weight, torch_threads

needs_bf16_gemm = pytest.mark.skipif(
    not (cpu_library.available() and cpu_library.has_bf16_gemm()),
    reason="one call per layer runs on the AVX-512 BF16 GEMM",
)


def packed_linear(n: int, k: int, bits: int = 4, group: int = 32, seed: int = 0, perm=None) -> Linear:
    q, w = quantized_weight(n, k, bits, group, sym=False, seed=seed)
    if perm is not None:
        w.perm = perm
    with torch.device("meta"):
        linear = Linear(k, n, False, torch.float32)
    linear.set_packed(w)
    linear.quant_matmul = cpu_gemm.quant_matmul if cpu_library.available() else linear.quant_matmul
    return linear


def float_linear(n: int, k: int, bias: bool = False, seed: int = 0) -> Linear:
    g = torch.Generator().manual_seed(seed)
    linear = Linear(k, n, bias, torch.float32)
    linear.weight = torch.nn.Parameter(torch.randn(n, k, generator=g), requires_grad=False)
    if bias:
        linear.bias = torch.nn.Parameter(torch.randn(n, generator=g), requires_grad=False)
    return linear


@pytest.mark.parametrize("rows", [1, 5, 40])
def test_joined_packed_projections_give_the_parts_outputs_exactly(rows):
    perm = torch.randperm(128)
    parts = [packed_linear(n, 128, seed=i, perm=perm) for i, n in enumerate([192, 64, 70])]  # ragged last
    joined = fuse(parts)
    assert joined.packed.out_features == 326 and joined.weight is None
    x = torch.randn(rows, 128)
    for dtype in (torch.float32, torch.bfloat16):
        expected = torch.cat([p(x.to(dtype)) for p in parts], dim=-1)
        assert torch.equal(joined(x.to(dtype)), expected)


def test_joined_float_projections_with_bias():
    parts = [float_linear(n, 48, bias=True, seed=i) for i, n in enumerate([48, 16, 16])]
    joined = fuse(parts)
    x = torch.randn(3, 48)
    assert torch.allclose(joined(x), torch.cat([p(x) for p in parts], dim=-1), atol=1e-6)


@pytest.mark.parametrize(
    "parts",
    [
        lambda: [packed_linear(70, 64), packed_linear(64, 64)],  # a ragged part before the last
        lambda: [packed_linear(64, 64, bits=4), packed_linear(64, 64, bits=8)],
        lambda: [packed_linear(64, 64, group=32), packed_linear(64, 64, group=64)],
        lambda: [packed_linear(64, 64, perm=torch.randperm(64)), packed_linear(64, 64)],
        lambda: [packed_linear(64, 64), float_linear(64, 64)],
        lambda: [float_linear(64, 64, bias=True), float_linear(64, 64)],
    ],
)
def test_weights_that_cannot_be_joined_as_they_are_stay_apart(parts):
    assert fuse(parts()) is None


def test_the_loaded_model_runs_joined_projections(tiny_llama):
    from slimlm.runtime.llm import LLM

    model = LLM(str(tiny_llama)).engine.runner.model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.qkv == [attn.qkv_proj] and mlp.gate_up == [mlp.gate_up_proj]
    assert not hasattr(attn, "q_proj") and not hasattr(mlp, "up_proj")  # the parts' weights are gone


# ---- every layer in one call for decode steps (kernels/cpu_layer.py DecodeStack) --------------------------


@pytest.fixture(scope="module")
def joinable(tmp_path_factory):
    """A tiny Llama whose q/k/v and gate/up join (widths in whole 64-feature blocks)."""
    from tests.conftest import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("joinable") / "m", hidden=128, intermediate=128, layers=3)


@pytest.fixture(scope="module")
def joinable_w4(joinable):
    """joinable quantized RTN W4 g32."""
    from tests.conftest import make_text
    from tests.runtime.test_loader import quantize

    (joinable.parent / "calib.txt").write_text(make_text(50))
    return quantize(joinable, joinable.parent / "w4", "rtn", QuantArgs(4, 32, False))


@pytest.fixture(scope="module")
def joinable_qwen2_w4(tmp_path_factory):
    """A tiny Qwen2 (q/k/v biases, drawn large) that joins like joinable, quantized RTN W4 g32."""
    from tests.conftest import make_text
    from tests.runtime.test_loader import quantize, tiny

    root = tmp_path_factory.mktemp("joinable-qwen2")
    tiny(root / "m", "qwen2", hidden_size=128, intermediate_size=128, num_hidden_layers=3)
    (root / "calib.txt").write_text(make_text(50))
    return quantize(root / "m", root / "w4", "rtn", QuantArgs(4, 32, False))


def decode_step(model, rows: int, kv_dtype: torch.dtype, seed: int = 0):
    from slimlm.perf.offline import decode_inputs

    g = torch.Generator().manual_seed(seed)
    attn = model.model.layers[0].self_attn
    cache = torch.randn(len(model.model.layers), 2, rows * 8, 16, attn.kv_heads, attn.head_dim, generator=g)
    ids, step = decode_inputs(rows, 40, 16, seed=seed)
    return ids, step, cache.to(kv_dtype)


def forward(model, ids, step, cache):
    with torch.inference_mode():
        return model.logits(model(ids, step, cache))


@pytest.mark.parametrize("rows", [1, 3, 20])  # fp32 at 20 rows: the fused loop; 20: SiLU, rotary split in two
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("amx", [True, False], ids=["as-found", "without-amx"])
@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["kv-as-model", "int8", "fp8"])
@pytest.mark.parametrize("arch", ["llama", "qwen2"])  # qwen2: q/k/v biases, added in the C call
@pytest.mark.parametrize("isa", ["native", "avx2"])  # avx2: the int8 loop (3 and 20 rows: its panel of rows)
def test_one_call_stack_equals_the_modules(request, isa, arch, dtype, rows, amx, kv_dtype, monkeypatch):
    if isa == "avx2":
        if dtype == torch.bfloat16 or not amx:
            pytest.skip("AVX2 builds run bf16 steps through the modules, and have no AMX")
        haswell_library(monkeypatch)
        amx = False
    elif not (cpu_library.available() and cpu_library.has_bf16_gemm()):
        pytest.skip("the native one-call stack runs on the AVX-512 BF16 GEMM")
    if not amx:  # the loops a CPU without AMX runs (here too when it has none)
        monkeypatch.setattr(cpu_library, "has_amx", lambda: False)
    model = load_model(
        request.getfixturevalue(f"joinable{'_qwen2' if arch == 'qwen2' else ''}_w4"), dtype, "cpu", 128, "auto"
    )
    assert (model.model.layers[0].self_attn.qkv_proj.bias is not None) == (arch == "qwen2")
    assert model.decode_stack is not None and len(model.decode_stack.layers) == 3
    ids, step, cache = decode_step(model, rows, kv_dtype or dtype)
    if kv_dtype is not None:  # an 8-bit cache: each layer's per-head scales, as loader.set_kv_cache sets them
        g = torch.Generator().manual_seed(rows)
        for layer in model.model.layers:
            attn = layer.self_attn
            attn.k_scale, attn.v_scale = (torch.rand(attn.kv_heads, generator=g) / 8 + 0.05 for _ in range(2))
            if kv_dtype == torch.float8_e4m3fn:  # fp8 keys less their offsets (ModelRunner.set_key_offsets)
                attn.k_offset = torch.randn(attn.kv_heads, attn.head_dim, generator=g)
    fused_cache, modules_cache = cache.clone(), cache.clone()
    with torch_threads(2):
        fused = forward(model, ids, step, fused_cache)
        stack, model.decode_stack = model.decode_stack, None
        modules = forward(model, ids, step, modules_cache)
        model.decode_stack = stack
    plan = (rows, dtype, kv_dtype or dtype, cpu_gemm.quantizes_activations())
    assert model.decode_stack._plans[plan] is not None  # the stack ran (scales and all)
    if kv_dtype is not None:  # compared as codes
        fused_cache, modules_cache, cache = (c.view(torch.uint8) for c in (fused_cache, modules_cache, cache))
    if dtype == torch.bfloat16:  # the same kernels in the same order: bit for bit
        assert torch.equal(fused, modules) and torch.equal(fused_cache, modules_cache)
    else:  # SiLU's exp: C's expf against torch's vectorized one, a last-bit difference
        assert torch.allclose(fused, modules, rtol=1e-5, atol=1e-5)
        if kv_dtype is None:
            assert torch.allclose(fused_cache, modules_cache, rtol=1e-5, atol=1e-6)
        else:  # such a difference moves a value across a rounding boundary rarely, by one code
            assert (fused_cache != modules_cache).float().mean() < 1e-3
    written = step.slots  # the new tokens' K/V went where the modules put them, nothing else moved
    untouched = torch.ones(cache.shape[2] * 16, dtype=torch.bool)
    untouched[written] = False
    flat = fused_cache.flatten(2, 3)
    assert torch.equal(flat[:, :, untouched], cache.flatten(2, 3)[:, :, untouched])


@needs_bf16_gemm
@pytest.mark.parametrize("rows", [1, 3, 20])  # code tiles, the tile unit (or weight tiles), several row tiles
def test_a_bf16_float_model_runs_its_linears_as_dense_pairs(joinable, tiny_llama, rows):
    """A bf16 model's float linears are packed as bf16 pairs (loader, cpu_gemm.dense_fits): the one-call stack
    then covers it, bit for bit with the modules, and both give torch's bf16 linears' logits up to the order
    of fp32 accumulation. An fp32 model's are packed k-major for the fused fp32 loop (AVX-512 CPUs)."""
    model = load_model(joinable, torch.bfloat16, "cpu", 128, "auto")
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed is not None and m.packed.bits == 16 and m.weight is None for m in linears)
    assert model.decode_stack is not None
    reference = load_model(joinable, torch.bfloat16, "cpu", 128, "auto")
    for module in reference.modules():
        if isinstance(module, Linear):  # torch's F.linear over the same bf16 weights
            module.weight, module.packed = (
                torch.nn.Parameter(
                    dequantize(module.packed, torch.bfloat16)[: module.packed.out_features], requires_grad=False
                ),
                None,
            )
    reference.decode_stack = None
    ids, step, cache = decode_step(model, rows, torch.bfloat16)
    with torch_threads(2):
        fused = forward(model, ids, step, cache.clone())
        stack, model.decode_stack = model.decode_stack, None
        modules = forward(model, ids, step, cache.clone())
        model.decode_stack = stack
        expected = forward(reference, ids, step, cache.clone())
    assert torch.equal(fused, modules)
    assert (fused.float() - expected.float()).abs().max() < 0.05 * expected.float().abs().max()
    fp32 = [m for m in load_model(tiny_llama, torch.float32, "cpu", 128, "auto").modules() if isinstance(m, Linear)]
    assert all(m.packed is not None and m.packed.bits == 32 for m in fp32) == (cpu_library.vector_bits() == 512)


@needs_bf16_gemm
def test_steps_the_one_call_stack_does_not_cover_run_the_modules(joinable_w4, tiny_llama, monkeypatch):
    model = load_model(joinable_w4, torch.float32, "cpu", 128, "auto")

    def refuse(*args):
        raise AssertionError("the one-call stack ran")

    stack, model.decode_stack = model.decode_stack, refuse
    ids, step, cache = decode_step(model, 2, torch.float32)
    prefill = type(step)(
        step.positions, step.slots, step.block_tables, step.seq_lens, torch.tensor([0, 2], dtype=torch.int32), [2]
    )
    forward(model, ids, prefill, cache)  # a two-token chunk of one sequence: the modules
    model.decode_stack = stack
    cos, sin = torch.zeros(2, 32), torch.zeros(2, 32)
    ids, step, cache = decode_step(model, 2, torch.float16)  # a cache of another float dtype: the stack declines
    assert stack(torch.zeros(2, 128), cos, sin, step.slots, cache, step.block_tables, step.seq_lens) is None
    ids, step, cache = decode_step(model, 2, torch.float32)  # int64 block tables: read as int32 they would lie
    assert stack(torch.zeros(2, 128), cos, sin, step.slots, cache, step.block_tables.long(), step.seq_lens) is None
    monkeypatch.setattr(cpu_gemm, "dense_fits", lambda weight: False)
    assert load_model(tiny_llama, torch.float32, "cpu", 128, "auto").decode_stack is None  # float linears


@needs_bf16_gemm
def test_greedy_generation_is_the_same_with_the_one_call_stack(joinable_w4):
    from slimlm.runtime.llm import LLM
    from slimlm.runtime.sampling import SamplingParams

    for dtype in ("float32", "bfloat16"):
        llm = LLM(str(joinable_w4), dtype=dtype)
        prompts = [[5, 9, 13], [7] * 20, list(range(3, 40))]
        params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
        assert llm.engine.runner.model.decode_stack is not None
        fused = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.engine.runner.model.decode_stack = None
        assert fused == [o.outputs[0].token_ids for o in llm.generate(prompts, params)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_long_prompts_mlp_runs_in_pieces_with_the_same_result(joinable_w4, monkeypatch, dtype):
    """Above cpu_gemm.FRESH_BYTES of gate/up output (here shrunk to 40 rows' worth), the MLP takes the rows in
    pieces where the pieces run the loop the whole would; each row's result is the one the whole call gives it."""
    model = load_model(joinable_w4, dtype, "cpu", 128, "auto")
    mlp = model.model.layers[0].mlp
    x = torch.randn(100, 128).to(dtype)
    with torch.inference_mode():
        whole = mlp(x)
        monkeypatch.setattr(cpu_gemm, "FRESH_BYTES", 40 * 256 * x.element_size())
        rows = []
        call = mlp.gate_up[0].quant_matmul
        monkeypatch.setattr(mlp.gate_up[0], "quant_matmul", lambda x, w: rows.append(x.shape[0]) or call(x, w))
        pieces = mlp(x)
    loop, piece_loop = (cpu_gemm.path(m, dtype, mlp.gate_up[0].packed) for m in (100, 34))
    split = loop == piece_loop and loop != "dequant-slices"
    assert rows == ([34, 33, 33] if split else [100])
    assert torch.equal(pieces, whole)
