"""Engine configuration: CLI / keyword arguments / a --config file -> one frozen, validated dataclass."""
from __future__ import annotations

import argparse
import difflib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields

from kvmesh.common.kv_transfer_config import KVTransferConfig, parse_kv_transfer_config
from kvmesh.common.speculative_config import SpeculativeConfig, parse_speculative_config

POLICIES = ("fcfs", "priority", "sjf", "dynamic")
PREEMPTION_MODES = ("recompute", "swap", "auto")
DTYPES = ("auto", "float32", "bfloat16", "float16")
# --kv-cache-dtype's names (kvmesh.kernels.kv_cache_dtype maps them to dtypes)
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2")
QUANTIZATIONS = (None, "none", "gguf", "auto",   # EngineConfig.quantization; None: auto
                 "compressed-tensors", "awq", "gptq", "fp8")   # Hugging Face quantized checkpoints


@dataclass(frozen=True, slots=True)
class DynamicPriorityWeights:
    """Weights of the token-level dynamic priority (lower score is served first)."""
    priority: float = 1.0     # per unit of the request's base priority
    progress: float = 2.0     # bonus for the fraction of max_tokens already generated
    waiting: float = 0.5      # bonus per second spent waiting (aging)


@dataclass(frozen=True, slots=True)
class EngineConfig:
    model: str | None = None               # HF directory or .gguf file; None: built-in SmolLM2
    served_model_name: str | None = None   # name in the API; default from the model
    tokenizer: str | None = None           # tokenizer directory overriding the model's own
    dtype: str = "auto"                    # the checkpoint's; float32 (and GGUF) in bfloat16 where the device computes it natively (CUDA, AVX512-BF16, AMX), else float32
    device: str = "auto"
    attention_backend: str = "auto"        # auto | triton | cpu | reference
    # GGUF weights: None / "none" dequantized to dtype at load; "gguf" served as their blocks
    # (kernels/quant: ~1/5 of the memory, slower than bf16 here); "auto": blocks where it can.
    # HF quantized checkpoints: "none" dequantized; their method (awq, ...) or "auto": quantized
    quantization: str | None = None
    max_model_len: int | None = None       # default: the model's context length
    block_size: int = 16
    num_kv_blocks: int | None = None       # explicit GPU KV block count; default from memory
    kv_cache_memory_fraction: float = 0.1  # CPU: share of free host memory for the KV cache when num_kv_blocks is unset
    # CUDA: share of the device's total memory this engine may use (weights, activations, CUDA
    # graphs and the KV cache, which gets what is left); vLLM's --gpu-memory-utilization
    gpu_memory_utilization: float = 0.9
    enforce_eager: bool = False            # CUDA: no CUDA graphs (vLLM's --enforce-eager)
    # CUDA: decode batch sizes captured as CUDA graphs (a decode step is padded to the next one);
    # None: vLLM's default list up to max_cudagraph_capture_size (vLLM's compilation_config names)
    cudagraph_capture_sizes: tuple[int, ...] | None = None
    max_cudagraph_capture_size: int | None = None  # None: min(max_num_seqs, 512)
    swap_space: float = 1.0                # GiB of CPU memory for swap preemption
    # the KV cache's element type (vLLM's --kv-cache-dtype): auto (the model's dtype), or 8-bit
    # floats, half of bf16's bytes a token: fp8 / fp8_e4m3, fp8_e5m2 (kernels/kv_cache_dtype.py)
    kv_cache_dtype: str = "auto"
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int | None = None  # per-step token budget; default 2048 (chunked) or max_model_len
    scheduling_policy: str = "fcfs"
    preemption_mode: str = "auto"
    seed: int = 0
    hash_seed: str = "kvmesh"              # prefix-hash seed; engines and router must agree
    enable_kv_events: bool = False         # record KV events (on when a prefix index consumes them)
    cpu_threads: int | None = None         # torch CPU threads (per rank); None: torch's default (all cores; cores / N with tensor parallelism)
    tensor_parallel_size: int = 1          # ranks (one per device) the model is split over; 1: no worker processes
    enable_lora: bool = False              # serve LoRA adapters (vLLM's --enable-lora)
    max_loras: int = 1                     # distinct adapters in one step (device slots)
    max_lora_rank: int = 16                # largest adapter rank; every slot is sized for it
    max_cpu_loras: int | None = None       # adapters kept read in host memory (LRU); None: max_loras
    sjf_aging_tokens_per_s: float = 64.0   # SJF: predicted work forgiven per second waited
    dynamic_weights: DynamicPriorityWeights = field(default_factory=DynamicPriorityWeights)
    # NOTE: cost model for preemption mode "auto": recompute costs tokens / throughput, swap
    # costs bytes moved twice / bandwidth. These seed values are refined by measurement.
    recompute_tokens_per_s: float = 2000.0
    swap_bytes_per_s: float = 4e9
    # speculative decoding (vLLM's --speculative-config: JSON text or a mapping); None: off
    speculative_config: SpeculativeConfig | None = None
    # prefill/decode disaggregation (vLLM's --kv-transfer-config: JSON text or a mapping); None: off
    kv_transfer_config: KVTransferConfig | None = None
    # schedule step n + 1 while step n's forward and sampling run; only n's sampled ids are
    # waited for (vLLM's --async-scheduling; engine/async_scheduling.py)
    async_scheduling: bool = False

    def __post_init__(self) -> None:
        if self.model == "":
            object.__setattr__(self, "model", None)   # "" (e.g. from a manifest) = the built-in model
        object.__setattr__(self, "speculative_config",
                           parse_speculative_config(self.speculative_config))
        object.__setattr__(self, "kv_transfer_config",
                           parse_kv_transfer_config(self.kv_transfer_config))

        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(msg)

        need(self.dtype in DTYPES, f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        need(self.quantization in QUANTIZATIONS,
             f"quantization must be one of {', '.join(q for q in QUANTIZATIONS if q)}, got {self.quantization!r}")
        need(self.attention_backend in ("auto", "triton", "cpu", "reference"),
             f"attention_backend must be auto, triton, cpu or reference, got {self.attention_backend!r}")
        need(self.block_size in (1, 2, 4, 8, 16, 32, 64, 128),
             f"block_size must be a power of two from 1 to 128, got {self.block_size}")
        need(self.max_model_len is None or self.max_model_len >= 2,
             f"max_model_len must be >= 2, got {self.max_model_len}")
        need(self.num_kv_blocks is None or self.num_kv_blocks >= 1,
             f"num_kv_blocks must be >= 1, got {self.num_kv_blocks}")
        need(0.0 < self.kv_cache_memory_fraction <= 0.95,
             f"kv_cache_memory_fraction must be in (0, 0.95], got {self.kv_cache_memory_fraction}")
        need(0.0 < self.gpu_memory_utilization <= 1.0,
             f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.cudagraph_capture_sizes is not None:
            object.__setattr__(self, "cudagraph_capture_sizes", tuple(self.cudagraph_capture_sizes))
            need(len(self.cudagraph_capture_sizes) > 0 and all(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1
                for n in self.cudagraph_capture_sizes),
                 "cudagraph_capture_sizes must be a non-empty list of integers >= 1 (use "
                 f"--enforce-eager for no CUDA graphs), got {list(self.cudagraph_capture_sizes)}")
        need(self.max_cudagraph_capture_size is None or self.max_cudagraph_capture_size >= 1,
             f"max_cudagraph_capture_size must be >= 1, got {self.max_cudagraph_capture_size}")
        need(self.swap_space >= 0, f"swap_space must be >= 0 GiB, got {self.swap_space}")
        need(self.kv_cache_dtype in KV_CACHE_DTYPES,
             f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        need(self.max_num_seqs >= 1, f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        need(self.max_num_batched_tokens is None or self.max_num_batched_tokens >= 1,
             f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        need(self.scheduling_policy in POLICIES,
             f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        need(self.preemption_mode in PREEMPTION_MODES,
             f"preemption_mode must be one of {PREEMPTION_MODES}, got {self.preemption_mode!r}")
        need(self.sjf_aging_tokens_per_s >= 0, "sjf_aging_tokens_per_s must be >= 0")
        need(self.cpu_threads is None or self.cpu_threads >= 1,
             f"cpu_threads must be >= 1, got {self.cpu_threads}")
        need(self.tensor_parallel_size >= 1,
             f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        need(self.kv_transfer_config is None or self.tensor_parallel_size == 1,
             "--kv-transfer-config needs --tensor-parallel-size 1")
        if self.async_scheduling:
            # NOTE: vLLM refuses these too: drafts are proposed from the tokens the host has,
            # and a tensor-parallel step is sent to the workers as host lists
            need(self.speculative_config is None,
                 "--async-scheduling does not support --speculative-config yet; drop one of them")
            need(self.tensor_parallel_size == 1,
                 "--async-scheduling needs --tensor-parallel-size 1")
        if self.enable_lora:
            need(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
            need(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
            need(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})")

    def token_budget(self, max_model_len: int) -> int:
        """The per-step token budget once the model's context length is known."""
        if self.max_num_batched_tokens is not None:
            if not self.enable_chunked_prefill and self.max_num_batched_tokens < max_model_len:
                raise ValueError(
                    f"max_num_batched_tokens ({self.max_num_batched_tokens}) is smaller than "
                    f"max_model_len ({max_model_len}) with chunked prefill off: a long prompt could "
                    "never be scheduled; raise --max-num-batched-tokens, lower --max-model-len or "
                    "enable chunked prefill")
            return self.max_num_batched_tokens
        return 2048 if self.enable_chunked_prefill else max(2048, max_model_len)

    def to_dict(self) -> dict:
        return asdict(self)


_ENGINE_FIELDS = {f.name for f in fields(EngineConfig)}


def engine_config_from_kwargs(model: str | None = None, **kwargs) -> EngineConfig:
    """EngineConfig from vLLM-style keyword arguments; unknown names are a clear error."""
    compilation = kwargs.pop("compilation_config", None)
    unknown = sorted(set(kwargs) - _ENGINE_FIELDS)
    if unknown:
        raise ValueError(f"unknown engine argument(s): {', '.join(unknown)}; "
                         f"known: {', '.join(sorted(_ENGINE_FIELDS | {'compilation_config'}))}")
    if compilation is not None:
        kwargs.update(_compilation_fields(compilation, kwargs))
    if isinstance(kwargs.get("dynamic_weights"), dict):
        kwargs["dynamic_weights"] = DynamicPriorityWeights(**kwargs["dynamic_weights"])
    return EngineConfig(model=model, **kwargs)


def field_default(cls: type, name: str) -> object:
    """The default of dataclass `cls`'s field `name`: the one home a flag's default is read from."""
    for f in fields(cls):
        if f.name == name:
            if f.default is MISSING:
                raise TypeError(f"{cls.__name__}.{name} has no plain default")
            return f.default
    raise AttributeError(f"{cls.__name__} has no field {name!r}")


def add_field_flag(group, cls: type, *names: str, field_name: str | None = None, **kwargs) -> None:
    """add_argument for a flag that sets dataclass field `field_name` (default: the flag's long
    name, dashes as underscores); its default is the field's, never a second literal."""
    dest = field_name or names[0].removeprefix("--").replace("-", "_")
    group.add_argument(*names, dest=dest, default=field_default(cls, dest), **kwargs)


# NOTE: vLLM's compilation_config keys that kvmesh implements (its CUDA-graph sizes)
_COMPILATION_KEYS = ("cudagraph_capture_sizes", "max_cudagraph_capture_size")


def _compilation_fields(compilation: object, kwargs: dict) -> dict:
    """The engine fields a vLLM-style `compilation_config` mapping sets; the direct keyword and
    the mapping's key are exclusive, as in vLLM."""
    if not isinstance(compilation, dict):
        raise ValueError(f"compilation_config must be a mapping, got {_describe(compilation)}")
    unknown = sorted(set(compilation) - set(_COMPILATION_KEYS))
    if unknown:
        raise ValueError(f"compilation_config: unsupported key(s) {', '.join(unknown)}; "
                         f"kvmesh reads {', '.join(_COMPILATION_KEYS)}")
    both = sorted(k for k in compilation if k in kwargs)
    if both:
        raise ValueError(f"{both[0]} and compilation_config.{both[0]} are mutually exclusive")
    return dict(compilation)


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    """Engine flags shared by `kvmesh serve` and `kvmesh generate` (vLLM's names); each default is
    EngineConfig's."""
    g = parser.add_argument_group("engine")

    def flag(*names: str, **kwargs) -> None:
        add_field_flag(g, EngineConfig, *names, **kwargs)

    flag("--model", help="HF model directory or .gguf file (default: built-in SmolLM2-135M-Instruct)")
    flag("--served-model-name")
    flag("--tokenizer", help="tokenizer directory (default: the model's)")
    flag("--dtype", choices=DTYPES,
         help="auto: the checkpoint's dtype, a float32 one (or GGUF) in bfloat16 where the device "
              "computes bf16 natively (CUDA; x86 with AVX512-BF16 or AMX), float32 elsewhere")
    flag("--quantization", choices=tuple(q for q in QUANTIZATIONS if q),
         help="auto (default): a GGUF file's block tensors served as blocks (about a third of "
              "bf16's weight memory for the built-in Q4_1 file) and a Hugging Face quantized checkpoint "
              "(config.json's quantization_config) by its own method, where the quantized kernels can "
              "run, dequantized otherwise (the log says why); gguf, compressed-tensors, awq, gptq or "
              "fp8 insist (the name must be the checkpoint's; fp8 on GPU only); none dequantizes the "
              "weights to --dtype at load")
    flag("--device")
    flag("--attention-backend", choices=("auto", "triton", "cpu", "reference"))
    flag("--max-model-len", type=int)
    flag("--block-size", type=int)
    flag("--num-kv-blocks", type=int)
    flag("--kv-cache-memory-fraction", type=float,
         help="CPU: share of free host memory for the KV cache")
    flag("--gpu-memory-utilization", type=float,
         help="CUDA: share of the device's memory for weights, activations, CUDA graphs and the "
              "KV cache (which gets the rest)")
    flag("--enforce-eager", action="store_true", help="CUDA: run every step eagerly (no CUDA graphs)")
    flag("--cudagraph-capture-sizes", type=int, nargs="+", metavar="N",
         help="CUDA: decode batch sizes to capture as CUDA graphs (default: 1 2 4 8 16 ... up to "
              "--max-cudagraph-capture-size)")
    flag("--max-cudagraph-capture-size", type=int,
         help="CUDA: largest default capture size (default: min(max-num-seqs, 512))")
    flag("--swap-space", type=float, help="GiB of CPU swap space")
    flag("--kv-cache-dtype", choices=KV_CACHE_DTYPES,
         help="the KV cache's element type: auto (the model's dtype) or 8-bit floats, twice the "
              "tokens in the same memory: fp8 (= fp8_e4m3) or fp8_e5m2, stored with scale 1.0; "
              "the cpu and reference attention backends")
    flag("--enable-prefix-caching", action=argparse.BooleanOptionalAction)
    flag("--enable-chunked-prefill", action=argparse.BooleanOptionalAction)
    flag("--max-num-seqs", type=int)
    flag("--max-num-batched-tokens", type=int)
    flag("--scheduling-policy", choices=POLICIES)
    flag("--preemption-mode", choices=PREEMPTION_MODES)
    flag("--seed", type=int)
    flag("--hash-seed")
    flag("--cpu-threads", type=int,
         help="torch CPU threads (default: all cores); 1 when processes share few cores")
    flag("--tensor-parallel-size", "-tp", type=int,
         help="split the model over N devices (worker processes; NCCL on CUDA, gloo on CPU)")
    flag("--enable-lora", action="store_true", help="serve LoRA adapters (PEFT format)")
    flag("--max-loras", type=int, help="LoRA: distinct adapters in one batch")
    flag("--max-lora-rank", type=int, help="LoRA: the largest adapter rank accepted")
    flag("--max-cpu-loras", type=int,
         help="LoRA: adapters kept read in host memory, an LRU (default: --max-loras)")
    flag("--speculative-config", metavar="JSON",
         help='speculative decoding, e.g. \'{"method": "ngram", "num_speculative_tokens": 4, '
              '"prompt_lookup_max": 4}\' (keys: method, num_speculative_tokens, prompt_lookup_min, '
              'prompt_lookup_max, model, disable_by_batch_size)')
    flag("--kv-transfer-config", metavar="JSON",
         help='prefill/decode disaggregation, e.g. \'{"kv_connector": "MooncakeConnector", '
              '"kv_role": "kv_producer"}\' (keys: kv_connector, kv_role (kv_producer | '
              'kv_consumer | kv_both), engine_id, kv_ip, kv_port, kv_connector_extra_config); '
              'see docs/DISAGGREGATION.md')
    flag("--async-scheduling", action="store_true",
         help="schedule the next step while the current one runs on the device, waiting only "
              "for its sampled tokens (a GPU feature: on CPU it is exact but no faster)")


def engine_config_from_args(ns: argparse.Namespace) -> EngineConfig:
    values = {k: v for k, v in vars(ns).items() if k in _ENGINE_FIELDS}
    if values.get("cudagraph_capture_sizes") is not None:
        values["cudagraph_capture_sizes"] = tuple(values["cudagraph_capture_sizes"])
    return EngineConfig(**values)


# ---- --config FILE: flag defaults from a JSON / YAML file (like vLLM's --config) -----------------
class ConfigFileError(ValueError):
    """A config file that cannot be read or holds a key / value the parser does not accept."""


def _describe(value: object) -> str:
    """A value as a config file's reader sees it: its JSON type, then the value."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return f"integer {value}"
    if isinstance(value, float):
        return f"number {value}"
    if isinstance(value, str):
        return f"string {value!r}"
    if isinstance(value, (list, tuple)):
        return "a list"
    if isinstance(value, dict):
        return "a mapping"
    return type(value).__name__


_FLAG_ACTIONS = (argparse._StoreAction, argparse._StoreConstAction, argparse.BooleanOptionalAction)


def config_file_flags(parser: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    """Every key a config file may set: long flag name without dashes ("max-num-seqs") -> action.

    Not settable: --help, --config itself, the negative spelling of a boolean (--no-X: write
    "X": false) and flags taking a fixed number of values (a "+" list takes a JSON / YAML list).
    """
    out: dict[str, argparse.Action] = {}
    for action in parser._actions:
        if action.dest == "config" or not isinstance(action, _FLAG_ACTIONS):
            continue
        if isinstance(action, argparse._StoreAction) and action.nargs not in (None, "+"):
            continue
        names = [s for s in action.option_strings if s.startswith("--")]
        if isinstance(action, argparse.BooleanOptionalAction):
            names = names[:1]
        for name in names:
            out[name[2:]] = action
    return out


def _coerce(action: argparse.Action, key: str, value: object, where: str) -> object:
    def bad(expected: str) -> ConfigFileError:
        return ConfigFileError(f"{where}: key {key!r} must be {expected}, got {_describe(value)}")

    if not isinstance(action, argparse._StoreAction):   # booleans and store_const flags
        if not isinstance(value, bool):
            raise bad("true or false")
        if isinstance(action, argparse.BooleanOptionalAction):
            return value
        return action.const if value else action.default
    nullable = action.default is None
    if action.nargs == "+" and value is not None:       # a list flag: each item as the flag's type
        if not isinstance(value, list) or not value:
            raise bad("a non-empty list" + (" or null" if nullable else ""))
        item = argparse._StoreAction(action.option_strings, action.dest, type=action.type,
                                     choices=action.choices, default=0)
        return [_coerce(item, f"{key}[{i}]", v, where) for i, v in enumerate(value)]
    if value is None:
        if nullable:
            return None
        kind = {int: "an integer", float: "a number"}.get(action.type, "a string")
        raise bad(kind)
    or_null = " or null" if nullable else ""
    if action.type is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise bad("an integer" + or_null)
    elif action.type is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise bad("a number" + or_null)
        value = float(value)
    elif action.type is None:
        if not isinstance(value, str):
            raise bad("a string" + or_null)
    else:
        if not isinstance(value, str):
            raise bad("a string" + or_null)
        try:
            value = action.type(value)
        except (TypeError, ValueError, argparse.ArgumentTypeError) as e:
            raise ConfigFileError(f"{where}: key {key!r}: invalid value {value!r}: {e}") from None
    if action.choices is not None and value not in action.choices:
        raise ConfigFileError(f"{where}: key {key!r} must be one of "
                              f"{', '.join(map(str, action.choices))}, got {_describe(value)}")
    return value


def _no_duplicates(pairs: list[tuple[str, object]]) -> dict:
    out: dict = {}
    for k, v in pairs:
        if k in out:
            raise ConfigFileError(f"key {k!r} appears twice")
        out[k] = v
    return out


def read_config_file(path: str) -> dict:
    """The mapping in a JSON file (YAML when it is named *.yaml / *.yml)."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise ConfigFileError(f"cannot read config file {path}: {e.strerror or e}") from None
    except UnicodeDecodeError as e:
        raise ConfigFileError(f"cannot read config file {path}: not UTF-8 text ({e.reason})") from None
    if path.lower().endswith((".yaml", ".yml")):
        import yaml
        try:
            data = yaml.safe_load(text)
        except yaml.YAMLError as e:   # its str() spans several lines: keep the problem and where
            mark = getattr(e, "problem_mark", None)
            what = getattr(e, "problem", None) or str(e).splitlines()[0]
            at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
            raise ConfigFileError(f"config file {path} is not valid YAML: {what}{at}") from None
        data = {} if data is None else data   # an empty YAML file sets nothing
    else:
        try:
            data = json.loads(text, object_pairs_hook=_no_duplicates)
        except json.JSONDecodeError as e:
            raise ConfigFileError(f"config file {path} is not valid JSON: {e}") from None
        except ConfigFileError as e:
            raise ConfigFileError(f"config file {path}: {e}") from None
    if not isinstance(data, dict):
        raise ConfigFileError(f"config file {path} must hold a mapping of flag names to values, "
                              f"got {_describe(data)}")
    return data


def config_file_defaults(parser: argparse.ArgumentParser, path: str) -> dict[str, object]:
    """Parser defaults (dest -> value) from a config file whose keys are long flag names without
    the dashes, in either spelling ("max-num-seqs" or "max_num_seqs")."""
    data = read_config_file(path)
    flags = config_file_flags(parser)
    where = f"config file {path}"
    out: dict[str, object] = {}
    seen: dict[str, str] = {}   # dest -> the key that set it
    for key, value in data.items():
        name = key.replace("_", "-") if isinstance(key, str) else None
        action = flags.get(name) if name is not None else None
        if action is None:
            hint = difflib.get_close_matches(name, flags, n=1) if name is not None else []
            raise ConfigFileError(f"{where}: unknown key {key!r}"
                                  + (f" (did you mean {hint[0]!r}?)" if hint else
                                     f" (not a flag of {parser.prog})"))
        if action.dest in seen:
            raise ConfigFileError(f"{where}: key {key!r} sets the same flag as {seen[action.dest]!r}")
        seen[action.dest] = key
        out[action.dest] = _coerce(action, key, value, where)
    return out


def parse_args_with_config(parser: argparse.ArgumentParser, argv: list[str] | None = None) -> argparse.Namespace:
    """parser.parse_args, where `--config FILE` (dest "config") supplies the defaults: command-line
    flags override the file, the file overrides the built-in defaults. Errors exit 2 via parser.error."""
    args = parser.parse_args(argv)
    path = getattr(args, "config", None)
    if path is None:
        return args
    try:
        defaults = config_file_defaults(parser, path)
    except ConfigFileError as e:
        parser.error(str(e))
    parser.set_defaults(**defaults)
    return parser.parse_args(argv)
