"""`kvmesh serve --config FILE`: flag defaults from a JSON / YAML file, overridden by the command line,
and the operator's ConfigMap read by the real parser."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from kvmesh.api.server import build_parser, parse_args
from kvmesh.common.config import EngineConfig, engine_config_from_args
from kvmesh.operator import crd
from kvmesh.operator import resources as R

ROOT = Path(__file__).resolve().parents[2]


def _write(tmp_path: Path, data: object, name: str = "engine.json") -> str:
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else json.dumps(data))
    return str(path)


def _error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """The last stderr line of a parse that must fail with exit code 2."""
    with pytest.raises(SystemExit) as exc:
        parse_args(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: kvmesh serve")
    return err.strip().splitlines()[-1]


# ---- loading and precedence -----------------------------------------------------------------------
def test_file_values_become_defaults_and_the_command_line_wins(tmp_path: Path) -> None:
    path = _write(tmp_path, {"max-num-seqs": 7, "block_size": 32, "scheduling_policy": "sjf",
                             "enable-prefix-caching": False, "kv_cache_memory_fraction": 0.5,
                             "port": 9001, "redis_url": "redis://r:6379/0", "tokenizer": None})
    args = parse_args(["--config", path])
    cfg = engine_config_from_args(args)
    assert (cfg.max_num_seqs, cfg.block_size, cfg.scheduling_policy) == (7, 32, "sjf")
    assert cfg.enable_prefix_caching is False and cfg.kv_cache_memory_fraction == 0.5
    assert (args.port, args.redis_url, cfg.tokenizer) == (9001, "redis://r:6379/0", None)
    assert cfg.dtype == "auto"  # not in the file: the built-in default

    # the command line overrides the file, wherever --config appears
    args = parse_args(["--max-num-seqs", "9", "--config", path, "--enable-prefix-caching", "--port", "9002"])
    cfg = engine_config_from_args(args)
    assert (cfg.max_num_seqs, cfg.enable_prefix_caching, args.port) == (9, True, 9002)
    assert cfg.block_size == 32  # still from the file


def test_both_key_spellings_are_accepted(tmp_path: Path) -> None:
    dashes = parse_args(["--config", _write(tmp_path, {"max-num-batched-tokens": 4096}, "a.json")])
    underscores = parse_args(["--config", _write(tmp_path, {"max_num_batched_tokens": 4096}, "b.json")])
    assert dashes.max_num_batched_tokens == underscores.max_num_batched_tokens == 4096


def test_yaml_file_and_ints_for_floats(tmp_path: Path) -> None:
    path = _write(tmp_path, "max_num_seqs: 3\nswap-space: 2\nenable_chunked_prefill: false\n", "engine.yaml")
    cfg = engine_config_from_args(parse_args(["--config", path]))
    assert (cfg.max_num_seqs, cfg.swap_space, cfg.enable_chunked_prefill) == (3, 2.0, False)
    assert isinstance(cfg.swap_space, float)


def test_no_config_keeps_the_built_in_defaults() -> None:
    assert engine_config_from_args(parse_args([])) == EngineConfig()


# ---- errors: usage + `kvmesh serve: error: ...`, exit 2 ------------------------------------------------
@pytest.mark.parametrize(("data", "message"), [
    ({"max-num-seq": 4}, "unknown key 'max-num-seq' (did you mean 'max-num-seqs'?)"),
    ({"frobnicate": 1}, "unknown key 'frobnicate' (not a flag of kvmesh serve)"),
    ({"config": "other.json"}, "unknown key 'config' (not a flag of kvmesh serve)"),
    ({"help": True}, "unknown key 'help' (not a flag of kvmesh serve)"),
    ({"no-enable-prefix-caching": True},
     "unknown key 'no-enable-prefix-caching' (did you mean 'enable-prefix-caching'?)"),
    ({"max_num_seqs": "8"}, "key 'max_num_seqs' must be an integer, got string '8'"),
    ({"max_num_seqs": 8.5}, "key 'max_num_seqs' must be an integer, got number 8.5"),
    ({"max_num_seqs": True}, "key 'max_num_seqs' must be an integer, got true"),
    ({"max_num_seqs": None}, "key 'max_num_seqs' must be an integer, got null"),
    ({"max-model-len": "4k"}, "key 'max-model-len' must be an integer or null, got string '4k'"),
    ({"kv_cache_memory_fraction": "0.5"}, "key 'kv_cache_memory_fraction' must be a number, got string '0.5'"),
    ({"enable_prefix_caching": "no"}, "key 'enable_prefix_caching' must be true or false, got string 'no'"),
    ({"enable_prefix_caching": 0}, "key 'enable_prefix_caching' must be true or false, got integer 0"),
    ({"model": 7}, "key 'model' must be a string or null, got integer 7"),
    ({"hash_seed": ["a"]}, "key 'hash_seed' must be a string, got a list"),
    ({"scheduling_policy": "lifo"},
     "key 'scheduling_policy' must be one of fcfs, priority, sjf, dynamic, got string 'lifo'"),
    ({"max_num_seqs": 4, "max-num-seqs": 5}, "key 'max-num-seqs' sets the same flag as 'max_num_seqs'"),
])
def test_bad_keys_and_values(tmp_path: Path, capsys: pytest.CaptureFixture[str], data: dict,
                             message: str) -> None:
    path = _write(tmp_path, data)
    assert _error(capsys, ["--config", path]) == f"kvmesh serve: error: config file {path}: {message}"


def test_bad_files(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = str(tmp_path / "missing.json")
    assert _error(capsys, ["--config", missing]) == (
        f"kvmesh serve: error: cannot read config file {missing}: No such file or directory")
    assert _error(capsys, ["--config", str(tmp_path)]) == (
        f"kvmesh serve: error: cannot read config file {tmp_path}: Is a directory")
    path = _write(tmp_path, "{\"max_num_seqs\": 4,}")
    assert _error(capsys, ["--config", path]) == (
        f"kvmesh serve: error: config file {path} is not valid JSON: "
        "Expecting property name enclosed in double quotes: line 1 column 20 (char 19)")
    binary = tmp_path / "binary.json"
    binary.write_bytes(b"\xff\xfe{}")
    assert _error(capsys, ["--config", str(binary)]) == (
        f"kvmesh serve: error: cannot read config file {binary}: not UTF-8 text (invalid start byte)")
    path = _write(tmp_path, "null")
    assert _error(capsys, ["--config", path]) == (
        f"kvmesh serve: error: config file {path} must hold a mapping of flag names to values, got null")
    path = _write(tmp_path, "[1, 2]")
    assert _error(capsys, ["--config", path]) == (
        f"kvmesh serve: error: config file {path} must hold a mapping of flag names to values, got a list")
    path = _write(tmp_path, '{"block_size": 16, "block_size": 32}')
    assert _error(capsys, ["--config", path]) == (
        f"kvmesh serve: error: config file {path}: key 'block_size' appears twice")
    path = _write(tmp_path, "max_num_seqs: [1\n", "bad.yaml")
    assert _error(capsys, ["--config", path]) == (
        f"kvmesh serve: error: config file {path} is not valid YAML: "
        "expected ',' or ']', but got '<stream end>' (line 2, column 1)")
    path = _write(tmp_path, "- 1\n", "list.yml")
    assert _error(capsys, ["--config", path]) == (
        f"kvmesh serve: error: config file {path} must hold a mapping of flag names to values, got a list")


def test_cli_exit_code_and_message(tmp_path: Path) -> None:
    path = _write(tmp_path, {"max_num_seqs": "many"})
    res = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--config", path],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert res.stderr.strip().splitlines()[-1] == (
        f"kvmesh serve: error: config file {path}: key 'max_num_seqs' must be an integer, got string 'many'")
    # a valid file whose value the engine rejects: the engine's own message, exit 2
    path = _write(tmp_path, {"block_size": 3}, "b.json")
    res = subprocess.run([sys.executable, "-m", "kvmesh.cli", "serve", "--config", path],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "block_size must be a power of two" in res.stderr


def test_help_mentions_config() -> None:
    assert "--config FILE" in build_parser().format_help()


# ---- the operator's ConfigMap is what --config accepts ---------------------------------------------
def _full_spec() -> crd.InferenceService:
    cr = yaml.safe_load((ROOT / "manifests" / "examples" / "full.yaml").read_text())
    return crd.parse(cr["metadata"]["name"], cr["metadata"]["namespace"], cr["spec"])


@pytest.mark.parametrize("example", ["full", "builtin"])
def test_operator_config_map_is_read_by_the_real_parser(tmp_path: Path, example: str) -> None:
    svc = _full_spec() if example == "full" else crd.parse("smol", "team-a", {"model": {}})
    owner = R.Owner(name=svc.name, uid="0b6c2f4e-1111-2222-3333-444455556666")
    cm = R.build_config_map(svc, owner)
    (key, text), = cm["data"].items()
    (tmp_path / key).write_text(text)
    # the engine container's own args, with the mounted file's path pointing at the copy here
    argv = R.engine_args(svc)
    assert argv[0] == "serve"
    argv = [str(tmp_path / key) if a == R.CONFIG_FILE else a for a in argv[1:]]
    assert str(tmp_path / key) in argv
    args = parse_args(argv)
    cfg = engine_config_from_args(args)

    e, m = svc.engine, svc.model
    expected_model = {"full": "/models/Llama-3.1-8B-Instruct", "builtin": None}[example]
    assert cfg.model == expected_model
    assert cfg.served_model_name == m.served_name
    assert cfg.tokenizer == m.tokenizer
    assert cfg.max_num_seqs == e.max_num_seqs
    assert cfg.max_num_batched_tokens == e.max_num_batched_tokens
    assert cfg.block_size == e.block_size
    assert cfg.kv_cache_memory_fraction == e.kv_cache_memory_fraction
    assert cfg.scheduling_policy == e.scheduling_policy
    assert cfg.enable_prefix_caching == e.enable_prefix_caching
    assert cfg.preemption_mode == e.preemption_mode
    assert args.redis_url == R.redis_url(svc)
    assert (args.host, args.port, args.pod_id) == ("0.0.0.0", R.ENGINE_PORT, "$(POD_NAME)")
    if example == "full":  # the literal values of manifests/examples/full.yaml
        assert cfg.tokenizer == "/models/tokenizers/Llama-3.1-8B-Instruct"
        assert (cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.block_size) == (128, 16384, 32)
        assert (cfg.kv_cache_memory_fraction, cfg.scheduling_policy) == (0.85, "priority")
        assert (cfg.enable_prefix_caching, cfg.preemption_mode) == (False, "swap")
        assert args.redis_url == "rediss://redis.infra.svc:6380/2"
        assert args.otlp_traces_endpoint == "http://otel-collector.observability:4317"
    # every key of the ConfigMap is a flag; none is repeated on the command line
    flags = {a.dest for a in build_parser()._actions}
    assert set(json.loads(text)) <= flags
    assert not {f"--{k.replace('_', '-')}" for k in json.loads(text)} & set(argv)
