"""What the ESFT runtime assumes about vLLM's fused-MoE layers, checked and applied in one place.

The runtime widens a layer's `w13_weight` / `w2_weight` into virtual tensors of R = E + slots x
experts_per_slot rows and rewrites the router's top-k ids to rows >= E. That is right only where the
kernel computes every row an id names, and vLLM's kernels differ:

- The CPU build's kernel (CPUUnquantizedExperts) indexes weights by id: any row is computed.
- The Triton kernel (TritonExperts, CUDA) sorts the token-expert pairs into blocks per expert with
  `moe_align_block_size(topk_ids, block, global_num_experts)`, which counts only ids below
  `global_num_experts`; pairs with larger ids are silently never computed. On an H100 (vLLM 0.25) that made
  every adapter prefill wrong while one-token decodes looked right: batches with tokens x top_k x 4 <=
  global_num_experts skip the alignment and index by id. So the experts layer's `global_num_experts` (the
  RoutedExperts attribute vLLM hands the kernel; the router keeps its own E for routing) must be R
  (`widen_to_rows`). The alignment op handles fewer than 1024 experts after padding to a warp
  (KERNEL_MAX_ROWS), so a larger R is refused before vLLM starts and again here. (vLLM 0.32 aligns over
  w13's row count instead; the widening is right there too.)
- The low-latency path: vLLM's Triton kernel skips the alignment when tokens x top_k x 4 <= the expert count
  it is handed and gives every token-expert pair its own block (`_prepare_expert_assignment`, 0.25 and 0.32
  alike). Handed R, that path also ran batches past the base's bound: every pair reads its whole expert though
  pairs share experts, so on an H100 (4-layer DeepSeek-V2-Lite-shaped model, 20 adapters loaded, R = 244)
  the MoE kernels took 0.421 ms a step at batch 4 and 0.810 ms at batch 8 against plain vLLM's 0.380 and 0.581
  (benchmarks/lab/profile_step.py). `assignment` decides the path by the base's E (set per
  call by the experts layer, `base_experts`), so a step takes the path plain vLLM takes, and still aligns over R.
- Triton's variants: the kernel takes EM = tokens x top_k + experts x (BLOCK_SIZE_M - 1) as an integer, which
  Triton specializes on divisibility by 16, and compiles each new class on first use (the two GEMMs of a step:
  two compiles). Aligned over R, EM fell in classes plain vLLM's E never makes: on an H100 with R = 64 + 4 x 9 =
  100, the first eager step of 262 tokens (6 decodes beside a 256-token prompt: 262 = 6 mod 8, where EM = 6 x 262
  + 100 x 63 is divisible by 16 and the token count is not, a class CUDA-graph capture never runs) took 863 ms of
  host time against plain vLLM's 102. `aligned_count` pads the count it aligns over to the base's class mod 16:
  BLOCK_SIZE_M is a power of two, so EM lands in plain vLLM's class at every size, and the padded experts get no
  tokens, so no blocks. Since then, that step took 98 and 107 ms, plain vLLM's 71 and 106, and Triton compiled nothing
  at it (benchmarks/lab/mixed_step.py).
- Tuned tile configs: TritonExperts looks its config up by w2's row count and N (files named
  `E=..,N=..,device_name=...json`), and R matches no file, so widening alone would drop a model's tuned
  config for vLLM's default one. `kernel_config` looks the config up for the base's E and the layer uses it
  for every call. On the H100 with vLLM 0.25 it matters for e.g. Mixtral at TP 2 (E=8, N=7168 has a file);
  DeepSeek-V2-Lite (E=64, N=1408) has none there and runs the default config either way.

- Expert parallelism: vLLM gives each rank its experts' rows and an `expert_map` (global id -> local row, -1
  where another rank computes it) that the Triton kernel applies. The layer's map is extended to the adapter
  rows (`set_expert_map`; esftctl.runtime.moe_layer says how), so every rank reroutes alike and exactly one
  rank computes each rerouted pair: the one holding the expert it replaces. Without data parallelism, EP runs
  over the tensor-parallel group and sends no tokens between ranks (each computes its experts' share of every
  token, then the outputs are all-reduced as under TP): adapters change no traffic. All-to-all dispatch comes
  only with data parallelism, refused below. vLLM's CPU kernel ignores the expert map (plain vLLM crashes
  there: vllm-project/vllm#57837), so EP is refused on it.

- FP8 experts with block scales (vLLM's Fp8MoEMethod with `weight_block_size`, DeepSeek-V3 and Qwen3-MoE FP8
  checkpoints): the layer holds `w13_weight_scale_inv` [E, 2 ceil(I / bn), ceil(H / bk)] and
  `w2_weight_scale_inv` [E, ceil(H / bn), ceil(I / bk)] beside the FP8 weights, and the Triton kernel reads
  expert e's blocks at row e of both, through the quant config the kernel was built with (`_w1.scale`,
  `_w2.scale`: the same tensors as the layer's parameters). So the scales become virtual tensors with the
  weights' rows (esftctl.runtime.moe_layer) and both the layer and that quant config are handed them
  (`set_scales`). vLLM 0.25 picks the backend in `select_fp8_moe_backend`
  (model_executor/layers/fused_moe/oracle/fp8.py): on Hopper (capability 9.0), block FP8 weights with dynamic
  128-wide activation groups, and no expert parallelism, TRITON goes first (TritonExperts, whose
  `convert_to_fp8_moe_kernel_format` leaves weights and scales as loaded), so an H100 serves it with the kernel
  that aligns over `global_num_experts`, widened here like the bf16 one. VLLM_USE_DEEP_GEMM=1 (DeepGEMM, which
  requantizes the scales), expert parallelism (FlashInfer CUTLASS) or another `--moe-backend` pick others:
  refused in one line; `-- --moe-backend triton` forces Triton. Per-tensor FP8 (no block size), vLLM's CPU FP8
  kernel (it repacks the weights), and FP8 under tensor or expert parallelism are refused too (not checked).

Refused at start-up, each with one line (`check_supported`, `check_engine`): a kernel not in KERNELS
(FlashInfer's, AITER's: unchecked layouts and id handling; `-- --moe-backend triton` picks Triton),
quantized experts other than FP8 with block scales (scales that adapter rows lack), expert parallelism on a
kernel that ignores the expert map, EPLB and redundant experts (physical expert ids, which adapter rows do not
have), fused shared experts (AITER puts them at rows E.., where adapters live), zero-expert routers (ids >= E mean "no
expert" there), monolithic kernels (routing inside the kernel, where no reroute reaches), vLLM's returned
routed experts (its capture callback replaces the reroute), micro-batched or sequence-parallel MoE (the
router then sees a part of the step's tokens, not the order the per-token adapters follow), data parallelism
(its idle steps remove every adapter) and sleep mode (it frees vLLM's memory but not the virtual tensors').
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import importlib
import re
from dataclasses import dataclass

import torch

from esftctl.errors import EsftError

# vLLM's modular expert kernels the runtime serves on: class name -> whether it aligns pairs over
# `global_num_experts` (True) or indexes weights by id (False).
KERNELS = {"TritonExperts": True, "CPUUnquantizedExperts": False}
# Those of KERNELS that apply vLLM's expert map (pairs mapped to -1 are another rank's): expert parallelism.
EXPERT_MAP_KERNELS = {"TritonExperts"}
# The FP8 block scales of a layer's experts (vLLM's Fp8MoEMethod with weight_block_size), w13's then w2's.
FP8_SCALES = ("w13_weight_scale_inv", "w2_weight_scale_inv")
# The biases of experts that have them (GPT-OSS), w13's then w2's.
BIASES = ("w13_bias", "w2_bias")
# moe_align_block_size pads the expert count to a multiple of 32 and wants it below 1024.
KERNEL_MAX_ROWS = 1024 - 32
_LAYER_INDEX = re.compile(r"(?:^|\.)layers\.(\d+)\.")
# Where vLLM's Triton kernels look `_prepare_expert_assignment` up (the modular kernel imports it by name).
ASSIGNMENT_MODULES = ("vllm.model_executor.layers.fused_moe.fused_moe",
                      "vllm.model_executor.layers.fused_moe.experts.triton_moe")
TRITON_DIVISIBILITY = 16  # Triton specializes integer kernel arguments on divisibility by this
SPARSITY = 4  # vLLM's margin: tokens x top_k x 4 <= experts takes the low-latency path (0.25 and 0.32)
_base_experts: contextvars.ContextVar[int | None] = contextvars.ContextVar("esft_base_experts", default=None)


@dataclass
class EngineMoELayer:
    """vLLM's parts of one MoE layer."""

    index: int
    experts: torch.nn.Module  # RoutedExperts: w13_weight, w2_weight, quant_method, global_num_experts
    router: object  # BaseRouter: set_capture_fn
    shared: torch.nn.Module | None = None  # the model's shared-expert module the layer calls, if it has one

    @property
    def kernel(self):
        """The modular expert kernel object (its weight processing and `apply`)."""
        return self.experts.quant_method.moe_kernel.fused_experts


def find_moe_layers(model: torch.nn.Module) -> dict[int, EngineMoELayer]:
    layers = {}
    for name, module in model.named_modules():
        experts, router = getattr(module, "routed_experts", None), getattr(module, "router", None)
        if experts is None or not hasattr(experts, "w13_weight") or not hasattr(router, "set_capture_fn"):
            continue
        match = _LAYER_INDEX.search(name + ".")
        if match is None:
            raise EsftError(f"cannot tell the layer index of MoE module {name!r}")
        shared = getattr(getattr(module, "_shared_experts", None), "_layer", None)  # vLLM's SharedExperts wrapper
        layers[int(match.group(1))] = EngineMoELayer(int(match.group(1)), experts, router, shared)
    return dict(sorted(layers.items()))


def kernel_name(layer: EngineMoELayer) -> str | None:
    """The name in KERNELS the layer's kernel is (or derives from), or None."""
    quant_method = layer.experts.quant_method
    if getattr(quant_method, "is_monolithic", False):
        return None
    names = {c.__name__ for c in type(layer.kernel).__mro__}
    return next((k for k in KERNELS if k in names), None)


def check_supported(layer: EngineMoELayer) -> None:
    """Refuse, with one line, every layer configuration in which some adapter row would be computed wrongly
    or not at all."""
    experts, where = layer.experts, f"layer {layer.index}"
    quant_method = experts.quant_method
    if getattr(quant_method, "is_monolithic", False):
        raise EsftError(f"{where}: vLLM chose a monolithic MoE kernel ({type(quant_method).__name__}), which "
                        "routes inside the kernel where no reroute can reach; choose `-- --moe-backend triton`")
    if is_fp8(layer):
        check_fp8(layer)
    elif type(quant_method).__name__ != "UnquantizedFusedMoEMethod":
        raise EsftError(f"{where}: quantized experts ({type(quant_method).__name__}) are not supported; serve a "
                        "bf16/fp16 base, or an FP8 one with block scales")
    if kernel_name(layer) is None:
        raise EsftError(f"{where}: vLLM chose the MoE kernel {type(layer.kernel).__name__}, which esftctl has not "
                        f"been checked on (supported: {', '.join(KERNELS)}); choose `-- --moe-backend triton`")
    parallel = experts.moe_config.moe_parallel_config
    if (parallel.use_ep or expert_map(layer) is not None) and kernel_name(layer) not in EXPERT_MAP_KERNELS:
        raise EsftError(f"{where}: expert parallelism needs a kernel that applies vLLM's expert map, and "
                        f"{type(layer.kernel).__name__} does not (vLLM's CPU build: vllm-project/vllm#57837); serve "
                        "without --enable-expert-parallel")
    if parallel.use_ep and expert_map(layer) is None:
        raise EsftError(f"{where}: expert parallelism without an expert map is not supported")
    if hasattr(experts, "expert_global_to_physical"):
        raise EsftError(f"{where}: physical expert routing tables (EPLB) are not supported; serve without "
                        "--enable-eplb")
    if parallel.enable_eplb:
        raise EsftError(f"{where}: EPLB (redundant experts) is not supported; serve without --enable-eplb")
    logical = getattr(experts.moe_config, "num_logical_experts", None)
    if logical is not None and logical != experts.moe_config.num_experts:
        raise EsftError(f"{where}: redundant experts are not supported; serve without EPLB")
    if getattr(experts.expert_map_manager, "num_fused_shared_experts", 0):
        raise EsftError(f"{where}: shared experts fused into the routed ones take the rows adapters use; turn "
                        "shared-expert fusion off (VLLM_ROCM_USE_AITER_FUSION_SHARED_EXPERTS=0)")
    if any(getattr(experts, n, None) is not None for n in BIASES):
        check_biases(layer)
    if getattr(layer.router, "zero_expert_type", None) is not None:
        raise EsftError(f"{where}: zero-expert routing (ids past the experts mean none) is not supported")
    if getattr(parallel, "is_sequence_parallel", False):
        raise EsftError(f"{where}: sequence-parallel MoE is not supported (each rank routes part of the tokens)")


def is_fp8(layer: EngineMoELayer) -> bool:
    return type(layer.experts.quant_method).__name__ == "Fp8MoEMethod"


def check_fp8(layer: EngineMoELayer) -> None:
    """Refuse FP8 experts other than block-quantized ones on vLLM's Triton kernel, on one rank."""
    method, where = layer.experts.quant_method, f"layer {layer.index}"
    if not getattr(method, "block_quant", False):
        raise EsftError(f"{where}: FP8 experts without block scales (per-tensor fp8) are not supported; serve an FP8 "
                        "base with weight_block_size, or a bf16 one")
    backend = getattr(getattr(method, "fp8_backend", None), "value", None)
    if backend != "TRITON":
        raise EsftError(f"{where}: vLLM chose the FP8 MoE backend {backend}, which esftctl has not been checked on; "
                        "choose `-- --moe-backend triton` (and leave VLLM_USE_DEEP_GEMM unset)")
    parallel = layer.experts.moe_config.moe_parallel_config
    if parallel.tp_size > 1 or parallel.use_ep:
        raise EsftError(f"{where}: FP8 experts under tensor or expert parallelism are not supported yet; serve on one "
                        "GPU")
    if any(not hasattr(layer.experts, n) for n in FP8_SCALES):
        raise EsftError(f"{where}: this vLLM keeps FP8 block scales under other names than {', '.join(FP8_SCALES)}")


def expert_scales(layer: EngineMoELayer) -> tuple[torch.Tensor, ...]:
    """The layer's FP8 block scales (w13's, w2's) as the kernel reads them; () for unquantized experts."""
    return tuple(getattr(layer.experts, n).data for n in FP8_SCALES) if is_fp8(layer) else ()


def set_scales(layer: EngineMoELayer, w13_scale: torch.Tensor, w2_scale: torch.Tensor) -> None:
    """Hand the layer and the quant config its kernel was built with the scales' virtual tensors (after the
    weights'): the kernel reads scales from that config, which holds the layer's parameters themselves."""
    _set_config_tensors(layer, FP8_SCALES, "scale", (w13_scale, w2_scale))


def set_biases(layer: EngineMoELayer, w13_bias: torch.Tensor, w2_bias: torch.Tensor) -> None:
    """Hand the layer and the quant config its kernel was built with the biases' virtual tensors (vLLM's kernels
    read `quant_config.w1_bias`, which holds the layer's parameters themselves)."""
    _set_config_tensors(layer, BIASES, "bias", (w13_bias, w2_bias))


def _set_config_tensors(layer: EngineMoELayer, names: tuple[str, str], field: str,
                        tensors: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Replace the layer's parameters `names` by `tensors`, and in every quant config that holds them (the
    method's and the kernel's: `_w1.<field>`, `_w2.<field>`) too; refuse a config that holds other tensors."""
    experts, method = layer.experts, layer.experts.quant_method
    old = tuple(getattr(experts, n) for n in names)
    found = (getattr(method, "moe_quant_config", None), layer.kernel.quant_config)
    configs = {id(c): c for c in found if c is not None}
    for config in configs.values():
        if getattr(config._w1, field) is not old[0] or getattr(config._w2, field) is not old[1]:
            raise EsftError(f"layer {layer.index}: vLLM's MoE kernel reads other tensors than the layer's {names[0]}; "
                            "esftctl cannot extend them")
    for name, tensor in zip(names, tensors):
        delattr(experts, name)
        experts.register_parameter(name, torch.nn.Parameter(tensor, requires_grad=False))
    for config in configs.values():
        setattr(config._w1, field, getattr(experts, names[0]))
        setattr(config._w2, field, getattr(experts, names[1]))


def expert_biases(layer: EngineMoELayer) -> tuple[torch.Tensor, ...]:
    """The layer's expert biases (w13's [E, 2I], w2's [E, H]) as the kernel reads them; () for experts without
    (a layer with one of them only is refused first: `check_biases`)."""
    if getattr(layer.experts, BIASES[0], None) is None:
        return ()
    return tuple(getattr(layer.experts, n).data for n in BIASES)


def interleaves_gate_up(layer: EngineMoELayer) -> bool:
    """Whether the layer's activation reads gate and up interleaved along w13's 2I (vLLM's swigluoai: GPT-OSS)."""
    return getattr(layer.experts.activation, "value", layer.experts.activation) == "swigluoai"


def check_biases(layer: EngineMoELayer) -> None:
    """Refuse experts with biases other than unquantized ones, in the weights' dtype, on one rank."""
    experts, where = layer.experts, f"layer {layer.index}"
    if is_fp8(layer) or any(getattr(experts, n, None) is None for n in BIASES):
        raise EsftError(f"{where}: experts with biases are supported unquantized with both {' and '.join(BIASES)} "
                        "only")
    if any(getattr(experts, n).dtype != experts.w13_weight.dtype for n in BIASES):
        raise EsftError(f"{where}: this vLLM keeps expert biases in {getattr(experts, BIASES[0]).dtype}, not the "
                        f"weights' {experts.w13_weight.dtype}; esftctl cannot extend them")
    parallel = experts.moe_config.moe_parallel_config
    if parallel.tp_size > 1 or parallel.use_ep:
        raise EsftError(f"{where}: experts with biases (GPT-OSS) under tensor or expert parallelism are not "
                        "supported yet; serve on one GPU")


def check_engine(vllm_config) -> None:
    """Refuse engine options under which the reroute would be undone or misapplied. Where vLLM versions keep
    an option in different places, both are read here."""
    places = (vllm_config.model_config, getattr(vllm_config, "aux_output_config", None))  # 0.25, 0.32
    if any(getattr(place, "enable_return_routed_experts", False) for place in places):
        raise EsftError("returning routed experts is not supported: vLLM's capture of them replaces the reroute; "
                        "serve without --enable-return-routed-experts")
    parallel = vllm_config.parallel_config
    if getattr(parallel, "enable_dbo", False):
        raise EsftError("dual-batch overlap is not supported (a micro-batch's router sees part of the step's "
                        "tokens); serve without --enable-dbo")
    if getattr(parallel, "data_parallel_size", 1) > 1:
        raise EsftError("data parallelism is not supported (vLLM's idle data-parallel steps remove every adapter); "
                        "serve without --data-parallel-size")
    if getattr(vllm_config.model_config, "enable_sleep_mode", False):
        raise EsftError("sleep mode is not supported (it frees vLLM's memory, not the adapters' virtual tensors); "
                        "serve without --enable-sleep-mode")


def expert_map(layer: EngineMoELayer) -> torch.Tensor | None:
    """Under expert parallelism, vLLM's map of the layer's global experts to this rank's rows (-1: another
    rank's); None otherwise."""
    return getattr(layer.experts, "expert_map", None)


def set_expert_map(layer: EngineMoELayer, extended: torch.Tensor) -> None:
    """Hand the kernel the expert map extended to the adapter rows (VirtualMoELayer.expert_map): vLLM keeps it
    as a buffer of the experts layer, which every call reads."""
    experts = layer.experts
    name = next((n for n in ("_expert_map", "expert_map") if n in experts._buffers), None)
    if name is None:
        raise EsftError(f"layer {layer.index}: this vLLM keeps its expert map where esftctl cannot extend it; serve "
                        "without --enable-expert-parallel")
    experts.register_buffer(name, extended, persistent=False)


def max_rows(layer: EngineMoELayer) -> int | None:
    """The most expert rows the layer's kernel computes, or None where it has no limit."""
    return KERNEL_MAX_ROWS if KERNELS[kernel_name(layer)] else None


def check_rows(rows: int, limit: int | None, base_experts: int, where: str) -> None:
    if limit is not None and rows > limit:
        raise EsftError(f"{where}: {rows} expert rows per layer ({base_experts} base + slots x experts per slot) "
                        f"exceed the {limit} that vLLM's Triton MoE kernel aligns; lower --slots or "
                        "--experts-per-slot")


def widen_to_rows(layer: EngineMoELayer, rows: int) -> None:
    """Make the kernel compute every one of `rows` expert rows (the router still routes over its E)."""
    layer.experts.global_num_experts = rows


@contextlib.contextmanager
def base_experts(count: int):
    """While a widened layer runs its kernel: the base's expert count, which `assignment` decides by."""
    token = _base_experts.set(count)
    try:
        yield
    finally:
        _base_experts.reset(token)


def assignment(original, align):
    """vLLM's `_prepare_expert_assignment` deciding the low-latency path by the base's expert count inside
    `base_experts` (and as before outside it); where the base's count says align, `align` (vLLM's
    moe_align_block_size) aligns over every row the kernel computes, padded to the base's class (`aligned_count`)."""

    @functools.wraps(original)
    def prepare(topk_ids, config, num_tokens, top_k_num, global_num_experts, expert_map, **kwargs):
        base = _base_experts.get()
        if base is None or expert_map is not None or num_tokens * top_k_num * SPARSITY <= base:
            return original(topk_ids, config, num_tokens, top_k_num, global_num_experts, expert_map, **kwargs)
        return align(topk_ids, config["BLOCK_SIZE_M"], aligned_count(global_num_experts, base), expert_map,
                     ignore_invalid_experts=kwargs.get("ignore_invalid_experts", False))

    prepare.esft = True
    return prepare


def aligned_count(rows: int, base: int) -> int:
    """The expert count to align `rows` rows over: `rows` padded until it is the base's count mod 16 (so the
    kernel's EM is where plain vLLM's is mod 16: Triton compiles no variant plain vLLM does not), or `rows` where
    the padded count would pass KERNEL_MAX_ROWS."""
    padded = base + -(-(rows - base) // TRITON_DIVISIBILITY) * TRITON_DIVISIBILITY
    return padded if padded <= KERNEL_MAX_ROWS else rows


def install_assignment() -> None:
    """Put `assignment` where vLLM's Triton kernels look the function up (once per process)."""
    from vllm.model_executor.layers.fused_moe.moe_align_block_size import moe_align_block_size

    for name in ASSIGNMENT_MODULES:
        module = importlib.import_module(name)
        if not getattr(module._prepare_expert_assignment, "esft", False):
            module._prepare_expert_assignment = assignment(module._prepare_expert_assignment, moe_align_block_size)


def kernel_config(layer: EngineMoELayer, base_experts: int):
    """For aligning Triton kernels, a function num_tokens -> the tile config vLLM would pick for the base's
    own expert count (its tuned file where there is one); None for other kernels."""
    if not KERNELS[kernel_name(layer)]:
        return None
    from vllm.model_executor.layers.fused_moe.fused_moe import try_get_optimal_moe_config

    experts, kernel = layer.experts, layer.kernel
    w13_shape = (base_experts, *experts.w13_weight.shape[1:])
    w2_shape = (base_experts, *experts.w2_weight.shape[1:])
    dtype_name = kernel.quant_config.config_name(experts.w13_weight.dtype)

    @functools.lru_cache(maxsize=None)  # one lookup per batch size, not one per layer call
    def config(num_tokens: int) -> dict:
        return try_get_optimal_moe_config(w13_shape, w2_shape, experts.top_k, dtype_name, num_tokens,
                                          block_shape=kernel.block_shape)

    return config
