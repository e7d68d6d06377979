"""The SFT TOML schema, read strictly.

The tables are upstream cosmos-framework's SFT TOML tables (``[job] [model] [model.ema] [optimizer]
[scheduler] [trainer] [trainer.callbacks.grad_clip] [checkpoint] [dataloader_train]``, plus the
parallelism/compile/activation-checkpointing/tokenizer sub-tables the upstream recipe carries), so a
recipe TOML runs unchanged on the upstream trainer and on the embedded one. What only the embedded
trainer needs lives in one extra table, ``[onecard]``.

``${oc.env:NAME}`` in a string value is replaced by the environment variable ``NAME`` (empty when unset),
as upstream's OmegaConf resolver does.

A key or table the schema does not know raises :class:`ConfigError` naming it and the known keys.
"""

from __future__ import annotations

import copy
import os
import re
import sys
from pathlib import Path
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


class ConfigError(ValueError):
    """The TOML is unreadable, has an unknown key, or a value of the wrong type."""


_ANY = object()

# table path -> {key: default}; the default's type is the accepted type (float accepts int).
SCHEMA: dict[str, dict[str, Any]] = {
    "job": {"task": "vfm", "experiment": "vision_sft_edge", "project": "cosmos3", "group": "sft",
            "name": "vision_sft_edge", "wandb_mode": "disabled"},
    "model": {"max_num_tokens_after_packing": 45056, "joint_attn_implementation": "two_way",
              "precision": "bfloat16"},
    "model.ema": {"enabled": True, "rate": 0.1, "iteration_shift": 0},
    "model.parallelism": {"data_parallel_shard_degree": -1, "data_parallel_replicate_degree": 1},
    "model.compile": {"enabled": True, "compile_dynamic": True},
    "model.activation_checkpointing": {"mode": "full", "save_ops_regex": ["fmha"], "preserve_rng_state": True,
                                       "determinism_check": "default"},
    "model.tokenizer": {"vae_path": ""},
    "optimizer": {"betas": [0.9, 0.95], "eps": 1.0e-6, "fused": True,
                  "keys_to_select": ["moe_gen", "time_embedder", "vae2llm", "llm2vae", "k_norm_und_for_gen"],
                  "lr": 1.0e-4, "weight_decay": 0.0},
    "scheduler": {"cycle_lengths": [1000], "f_max": [1.0], "f_min": [0.0], "f_start": [0.0],
                  "verbosity_interval": 0, "warm_up_steps": [50]},
    "trainer": {"distributed_parallelism": "fsdp", "grad_accum_iter": 2, "logging_iter": 1, "max_iter": 500},
    "trainer.callbacks.compile_tokenizer": {"compile_after_iterations": 3, "enabled": False},
    "trainer.callbacks.grad_clip": {"clip_norm": 0.1, "force_finite": True},
    "checkpoint": {"keys_to_skip_loading": ["net_ema."], "load_path": "", "save_iter": 100},
    "dataloader_train": {"max_sequence_length": 45056, "max_caption_tokens": 2048},
    # Embedded-trainer-only settings.
    "onecard": {
        "preset": "auto",        # "edge", "tiny", or "auto" (edge on a GPU, tiny without one)
        "loss_scale": 10.0,      # upstream flow-matching loss scale
        "seed": 0,
        "cfg_dropout": 0.1,      # caption dropout probability (classifier-free guidance)
        # CPU smoke (tiny preset on a machine without a GPU): >0 replaces the value, and the run says so.
        "cpu_max_iter": 0,
        "cpu_grad_accum_iter": 0,
        "cpu_max_sequence_length": 0,
    },
}

_ENV_RE = re.compile(r"\$\{oc\.env:([A-Za-z_][A-Za-z0-9_]*)\}")


def _resolve_env(value: Any) -> Any:
    if isinstance(value, str):
        return _ENV_RE.sub(lambda m: os.environ.get(m.group(1), ""), value)
    if isinstance(value, list):
        return [_resolve_env(v) for v in value]
    return value


def _check_type(path: str, key: str, value: Any, default: Any) -> Any:
    ok: bool
    if isinstance(default, bool):
        ok = isinstance(value, bool)
    elif isinstance(default, float):
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif isinstance(default, int):
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif isinstance(default, str):
        ok = isinstance(value, str)
    elif isinstance(default, list):
        ok = isinstance(value, list)
    else:
        ok = True
    if not ok:
        raise ConfigError(
            f"[{path}].{key} = {value!r} has the wrong type: expected {type(default).__name__} "
            f"like the default {default!r}"
        )
    return value


class SFTConfig:
    """A validated SFT config: ``cfg["trainer"]["grad_accum_iter"]``, ``cfg.get("model.ema", "rate")``.

    Attributes:
        tables: ``{table path: {key: value}}`` with every schema key present (defaults filled in).
        source: the TOML path it was read from (``None`` for defaults).
    """

    def __init__(self, tables: dict[str, dict[str, Any]], source: Path | None = None):
        self.tables = tables
        self.source = source

    def __getitem__(self, table: str) -> dict[str, Any]:
        return self.tables[table]

    def get(self, table: str, key: str) -> Any:
        return self.tables[table][key]


def _flatten(data: dict[str, Any], prefix: str, out: dict[str, dict[str, Any]], where: str) -> None:
    scalars = {k: v for k, v in data.items() if not isinstance(v, dict)}
    is_parent = any(t.startswith(prefix + ".") for t in SCHEMA)
    if prefix and not (is_parent and not scalars and prefix not in SCHEMA):
        if prefix not in SCHEMA:
            raise ConfigError(
                f"{where}: unknown table [{prefix}]; known tables: "
                + ", ".join(f"[{t}]" for t in SCHEMA)
            )
        out[prefix] = scalars
    elif scalars:
        raise ConfigError(f"{where}: keys outside any table: {sorted(scalars)}; put them in a [table]")
    for k, v in data.items():
        if isinstance(v, dict):
            _flatten(v, f"{prefix}.{k}" if prefix else k, out, where)


def from_dict(data: dict[str, Any], source: Path | None = None) -> SFTConfig:
    """Validate a parsed TOML dict against :data:`SCHEMA`, fill defaults, resolve ``${oc.env:...}``.

    Raises:
        ConfigError: unknown table or key, or a value of the wrong type.
    """
    where = str(source) if source else "config"
    found: dict[str, dict[str, Any]] = {}
    _flatten(data, "", found, where)
    tables: dict[str, dict[str, Any]] = {}
    for path, defaults in SCHEMA.items():
        given = found.get(path, {})
        unknown = sorted(set(given) - set(defaults))
        if unknown:
            raise ConfigError(
                f"{where}: unknown key(s) {unknown} in [{path}]; known keys: {sorted(defaults)}"
            )
        values = copy.deepcopy(defaults)
        for k, v in given.items():
            values[k] = _check_type(path, k, _resolve_env(v), defaults[k])
        tables[path] = values
    return SFTConfig(tables, source)


def load(path: str | Path) -> SFTConfig:
    """Read and validate an SFT TOML.

    Raises:
        ConfigError: the file is missing or not valid TOML, or fails :func:`from_dict`.
    """
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"SFT TOML {p} does not exist: pass an existing file (see toml/ for the recipes)")
    try:
        data = tomllib.loads(p.read_text())
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as e:
        raise ConfigError(f"{p} is not valid TOML: {e}") from None
    return from_dict(data, p)


def write_upstream_toml(src: str | Path, dst: str | Path) -> Path:
    """Write ``src`` without its ``[onecard]`` table (upstream's schema forbids unknown keys) to ``dst``.

    The recipe is validated first. The text is copied line by line, so comments and ``${oc.env:...}``
    stay as written for upstream's resolver; ``dst`` is written to a temporary name and renamed.

    Raises:
        ConfigError: ``src`` is missing, unreadable or fails the schema.
    """
    load(src)
    kept: list[str] = []
    skipping = False
    for line in Path(src).read_text().splitlines(keepends=True):
        header = re.match(r"\s*\[\s*([A-Za-z0-9_.]+)\s*\]", line)
        if header:
            skipping = header.group(1) == "onecard" or header.group(1).startswith("onecard.")
        if not skipping:
            kept.append(line)
    out = Path(dst)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tmp.write_text("".join(kept))
    os.replace(tmp, out)
    return out


def _main(argv: list[str] | None = None) -> int:
    """``python -m cosmos_framework_ext.config upstream-toml SRC DST`` (used by the launcher)."""
    args = list(sys.argv[1:] if argv is None else argv)
    if len(args) != 3 or args[0] != "upstream-toml":
        print("usage: python -m cosmos_framework_ext.config upstream-toml SRC DST", file=sys.stderr)
        return 2
    try:
        write_upstream_toml(args[1], args[2])
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(_main())
