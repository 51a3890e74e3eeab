"""The bad-input corpus: every way a user can get a recipe or a command line wrong, through the real CLI.

The project's rule: a user's mistake gets one clear line naming the key or file and what to
change, exit status 2, no traceback, before any model, data or GPU work. Each `Case` is a
recipe (inline YAML, written to a temporary folder) and/or a command line, with a fragment its
output must contain and its exit status. The cases run in-process through Typer's CliRunner
(fast), except where a real process matters (an environment variable read at import time).
The broken recipes of tests/recipes (tests/test_recipe.py's EXPECTED) are part of the corpus
too; `test_whole_corpus_is_tracebackless_and_short` runs everything once more and checks the
shape of the output rather than its words.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from ligertune.cli import app
from tests.test_recipe import BROKEN, EXPECTED

ROOT = Path(__file__).resolve().parent.parent

# A valid recipe that needs nothing but the package: the cases add to it or replace parts of it.
SOURCES = """\
tokenizer:
  name_or_path: ligertune://tokenizer
data:
  path: ligertune://alpaca_sample.jsonl
"""
BASE = "model:\n  config: tiny-llama\n" + SOURCES

# A tiny Llama's config.json, for cases that need a local model folder.
TINY_LLAMA_CONFIG = {
    "model_type": "llama",
    "vocab_size": 2048,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 1,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
}


@dataclass(frozen=True)
class Case:
    """One bad input. In `args`, `expect` and `files`' contents, {recipe} is the path the YAML
    was written to and {tmp} the case's temporary folder."""

    id: str
    expect: str
    recipe: str | None = None
    args: tuple[str, ...] = ("validate", "{recipe}", "-f", "none")
    code: int = 2
    files: dict[str, str] = field(default_factory=dict)  # relative path -> text ("/" suffix: a folder)
    env: dict[str, str] = field(default_factory=dict)
    in_process: bool = True


def _training(body: str) -> str:
    return BASE + "training:\n" + "".join(f"  {line}\n" for line in body.splitlines())


def _model(body: str) -> str:
    return SOURCES + "model:\n" + "".join(f"  {line}\n" for line in body.splitlines())


CASES = [
    # -- 1. every numeric field has a range ------------------------------------------------
    Case(
        "grad_norm_negative",
        "training.max_grad_norm: got -1; input should be greater than or equal to 0",
        _training("max_grad_norm: -1"),
    ),
    Case("lr_zero", "training.lr: got 0; input should be greater than 0", _training("lr: 0")),
    Case("eps_one", "training.adam_eps: got 1; input should be less than 1", _training("adam_eps: 1")),
    Case(
        "weight_decay_infinite",
        "training.weight_decay: got inf; input should be a finite number",
        _training("weight_decay: .inf"),
    ),
    Case("lr_infinite", "training.lr: got inf; input should be a finite number", _training("lr: .inf")),
    Case("lr_nan", "training.lr: got nan; input should be a finite number", _training("lr: .nan")),
    Case("eps_zero", "training.adam_eps: got 0; input should be greater than 0", _training("adam_eps: 0")),
    Case(
        "beta_one",
        "training.adam_betas.1: got 1.0; input should be less than 1",
        _training("adam_betas: [0.9, 1.0]"),
    ),
    Case(
        "beta_negative",
        "training.adam_betas.0: got -0.1; input should be greater than or equal to 0",
        _training("adam_betas: [-0.1, 0.9]"),
    ),
    Case(
        "betas_three",
        "training.adam_betas: got [0.9, 0.95, 0.99]; tuple should have at most 2 items",
        _training("adam_betas: [0.9, 0.95, 0.99]"),
    ),
    Case(
        "warmup_negative",
        "training.warmup_steps: got -1; input should be greater than or equal to 0",
        _training("warmup_steps: -1"),
    ),
    Case(
        "min_lr_ratio_above_one",
        "training.min_lr_ratio: got 1.5; input should be less than or equal to 1",
        _training("min_lr_ratio: 1.5"),
    ),
    Case(
        "weight_decay_negative",
        "training.weight_decay: got -0.1; input should be greater than or equal to 0",
        _training("weight_decay: -0.1"),
    ),
    Case("epochs_zero", "training.epochs: got 0; input should be greater than 0", _training("epochs: 0")),
    Case(
        "max_steps_zero",
        "training.max_steps: got 0; input should be greater than 0",
        _training("max_steps: 0"),
    ),
    Case(
        "micro_batch_zero",
        "training.micro_batch_size: got 0; input should be greater than 0",
        _training("micro_batch_size: 0"),
    ),
    Case(
        "accumulation_zero",
        "training.gradient_accumulation_steps: got 0; input should be greater than 0",
        _training("gradient_accumulation_steps: 0"),
    ),
    Case(
        "eval_every_zero",
        "training.eval_every: got 0; input should be greater than 0",
        _training("eval_every: 0"),
    ),
    Case("seed_negative", "seed: got -1; input should be greater than or equal to 0", BASE + "seed: -1\n"),
    Case(
        "seed_too_big",
        "seed: got 4294967296; input should be less than 4294967296",
        BASE + "seed: 4294967296\n",
    ),
    Case(
        "max_seq_len_zero",
        "data.max_seq_len: got 0; input should be greater than 0",
        "model:\n  config: tiny-llama\ndata:\n  path: ligertune://alpaca_sample.jsonl\n  max_seq_len: 0\n",
    ),
    Case(
        "validation_fraction_one",
        "data.validation_fraction: got 1; input should be less than 1",
        "model:\n  config: tiny-llama\ndata:\n  path: ligertune://alpaca_sample.jsonl\n  validation_fraction: 1\n",
    ),
    Case(
        "keep_last_zero",
        "checkpoint.keep_last: got 0; input should be greater than 0",
        BASE + "checkpoint:\n  keep_last: 0\n",
    ),
    Case(
        "every_steps_zero",
        "checkpoint.every_steps: got 0; input should be greater than 0",
        BASE + "checkpoint:\n  every_steps: 0\n",
    ),
    Case(
        "log_every_zero",
        "logging.log_every: got 0; input should be greater than 0",
        BASE + "logging:\n  log_every: 0\n",
    ),
    Case(
        "throughput_warmup_negative",
        "logging.throughput_warmup_steps: got -2; input should be greater than or equal to 0",
        BASE + "logging:\n  throughput_warmup_steps: -2\n",
    ),
    # -- 2. strict types: YAML's type is the type read ---------------------------------------
    Case("lr_bool", "training.lr: got True; input should be a valid number", _training("lr: true")),
    Case("lr_quoted", "training.lr: got '1e-4'; input should be a valid number", _training("lr: '1e-4'")),
    Case(
        "batch_float",
        "training.micro_batch_size: got 2.0; input should be a valid integer",
        _training("micro_batch_size: 2.0"),
    ),
    Case(
        "batch_bool",
        "training.micro_batch_size: got True; input should be a valid integer",
        _training("micro_batch_size: yes"),
    ),
    Case(
        "grad_norm_bool",
        "training.max_grad_norm: got False; input should be a valid number",
        _training("max_grad_norm: false"),
    ),
    Case(
        "packing_int",
        "data.packing: got 1; input should be a valid boolean",
        "model:\n  config: tiny-llama\ndata:\n  path: ligertune://alpaca_sample.jsonl\n  packing: 1\n",
    ),
    Case(
        "kernel_switch_string",
        "kernels.rope: got 'enabled'; input should be a valid boolean",
        BASE + "kernels:\n  rope: enabled\n",
    ),
    Case(
        "trust_remote_code_int",
        "model.trust_remote_code: got 1; input should be a valid boolean",
        _model("config: tiny-llama\ntrust_remote_code: 1"),
    ),
    Case(
        "zero_stage_bool",
        "parallel.deepspeed.zero_stage: got True; allowed: 1, 2 or 3",
        BASE + "parallel:\n  strategy: deepspeed\n  deepspeed:\n    zero_stage: true\n",
    ),
    Case(
        "fsdp_offload_int",
        "parallel.fsdp.cpu_offload: got 0; input should be a valid boolean",
        BASE + "parallel:\n  strategy: fsdp\n  fsdp:\n    cpu_offload: 0\n",
    ),
    Case(
        "fsdp_options_without_fsdp",
        "parallel.fsdp: parallel.strategy none has no option fsdp (an option of fsdp); remove it, or set "
        "parallel.strategy to fsdp",
        BASE + "parallel:\n  fsdp:\n    cpu_offload: true\n",
    ),
    Case(
        "model_config_number",
        "model.config: got 5; expected a string, a mapping or null",
        _model("config: 5"),
    ),
    Case(
        "plugins_not_a_list", "plugins: got 'liger'; input should be a valid list", BASE + "plugins: liger\n"
    ),
    Case(
        "betas_scalar",
        "training.adam_betas: got 0.9; input should be a valid tuple",
        _training("adam_betas: 0.9"),
    ),
    Case("name_number", "name: got 2024; input should be a valid string", BASE + "name: 2024\n"),
    Case(
        "description_mapping",
        "description: got {'a': 1}; input should be a valid string",
        BASE + "description: {a: 1}\n",
    ),
    Case(
        "override_bool_for_int",
        "training.max_steps: got True; input should be a valid integer",
        BASE,
        ("validate", "{recipe}", "training.max_steps=true", "-f", "none"),
    ),
    # -- 3. names and output paths ----------------------------------------------------------
    Case(
        "name_climbs_out",
        "name: got '../../x'; a run name is a plain name (letters, digits, '.', '_', '-'); "
        "to choose where the run writes, set output_dir",
        BASE + "name: ../../x\n",
    ),
    Case("name_with_slash", "name: got 'a/b'; a run name is a plain name", BASE + "name: a/b\n"),
    Case("name_absolute", "name: got '/tmp/x'; a run name is a plain name", BASE + "name: /tmp/x\n"),
    Case("name_dotdot", "name: got '..'; a run name is a plain name", BASE + "name: ..\n"),
    Case("name_empty", "name: got ''; a run name is a plain name", BASE + "name: ''\n"),
    # -- 4. duplicate keys ------------------------------------------------------------------
    Case(
        "duplicate_section",
        "training: key given twice (lines 7 and 9); the second would replace the first",
        BASE + "training:\n  lr: 1.0e-4\ntraining:\n  max_steps: 3\n",
    ),
    Case(
        "duplicate_key_in_section",
        "training.lr: key given twice (lines 8 and 10)",
        BASE + "training:\n  lr: 1.0e-4\n  max_steps: 3\n  lr: 1.0e-3\n",
    ),
    Case(
        "duplicate_nested_key",
        "parallel.fsdp.cpu_offload: key given twice (lines 9 and 10)",
        BASE + "parallel:\n  fsdp:\n    cpu_offload: true\n    cpu_offload: false\n",
    ),
    Case(
        "duplicate_in_train",
        "training: key given twice (lines 7 and 9)",
        BASE + "training:\n  lr: 1.0e-4\ntraining:\n  max_steps: 3\n",
        ("train", "{recipe}"),
    ),
    # -- 5. output folders that cannot be written -------------------------------------------
    Case(
        "output_dir_is_a_file",
        "output_dir: {tmp}/taken is a file, not a folder; set output_dir to a folder",
        BASE + "output_dir: {tmp}/taken\n",
        files={"taken": "x"},
    ),
    Case(
        "output_dir_under_a_file",
        "output_dir: cannot create {tmp}/taken/run: {tmp}/taken is a file, not a folder",
        BASE + "output_dir: {tmp}/taken/run\n",
        files={"taken": "x"},
    ),
    Case(
        "default_output_dir_is_a_file",
        "output_dir (default runs/<name>): runs/busy is a file, not a folder",
        BASE + "name: busy\n",
        args=("validate", "{recipe}", "-f", "none"),
        files={"runs/busy": "x"},
    ),
    Case(
        "output_dir_override_under_a_file",
        "output_dir: cannot create {tmp}/taken/deeper/run",
        BASE,
        ("validate", "{recipe}", "output_dir={tmp}/taken/deeper/run"),
        files={"taken": "x"},
    ),
    # -- 6. command lines -------------------------------------------------------------------
    Case(
        "folder_as_recipe",
        "{tmp}/recipes is a folder; name a recipe file (it holds a.yaml)",
        args=("validate", "{tmp}/recipes"),
        files={"recipes/a.yaml": BASE},
    ),
    Case(
        "train_folder_as_recipe",
        "{tmp}/recipes is a folder; name a recipe file",
        args=("train", "{tmp}/recipes"),
        files={"recipes/": ""},
    ),
    Case(
        "copy_into_missing_folder",
        "cannot write {tmp}/missing_dir/x.yaml: the folder {tmp}/missing_dir does not exist; create the folder first",
        args=("recipes", "cp", "quickstart", "{tmp}/missing_dir/x.yaml"),
    ),
    Case(
        "copy_under_a_file",
        "cannot write {tmp}/taken/x.yaml: the folder {tmp}/taken is a file",
        args=("recipes", "cp", "quickstart", "{tmp}/taken/x.yaml"),
        files={"taken": "x"},
    ),
    Case(
        "copy_unknown_recipe",
        "no shipped recipe named 'quikstart'; did you mean quickstart?",
        args=("recipes", "cp", "quikstart", "{tmp}/x.yaml"),
    ),
    # A usage error is Typer's boxed message; a wide terminal keeps it on one line to match.
    Case(
        "format_unknown",
        "Invalid value for '--format' / '-f': Value error, 'foo' is not one of 'table', 'yaml', 'none'",
        BASE,
        ("validate", "{recipe}", "-f", "foo"),
        env={"COLUMNS": "200"},
    ),
    Case(
        "only_overrides",
        "name a recipe file before the key=value overrides",
        args=("validate", "training.lr=1e-4"),
    ),
    Case("recipe_missing", "recipe file not found: {tmp}/nope.yaml", args=("validate", "{tmp}/nope.yaml")),
    Case(
        "override_without_key",
        "=3: an override is written section.key=value",
        BASE,
        ("validate", "{recipe}", "=3"),
    ),
    Case(
        "override_empty_part",
        "training..lr=1: an override is written section.key=value",
        BASE,
        ("validate", "{recipe}", "training..lr=1"),
    ),
    Case(
        "override_bad_yaml",
        "training.adam_betas: cannot parse value '[0.9,' as YAML",
        BASE,
        ("validate", "{recipe}", "training.adam_betas=[0.9,"),
    ),
    Case(
        "override_into_a_value",
        "data.path.x: data.path is 'ligertune://alpaca_sample.jsonl', not a section",
        BASE,
        ("validate", "{recipe}", "data.path.x=1"),
    ),
    Case(
        "override_unknown_section",
        "trainig: unknown key; did you mean training?",
        BASE,
        ("validate", "{recipe}", "trainig.lr=1e-4"),
    ),
    Case(
        "override_unknown_kernel",
        "kernels.rmsnorm: unknown key; did you mean kernels.rms_norm?",
        BASE,
        ("validate", "{recipe}", "kernels.rmsnorm=false"),
    ),
    # -- 7, 8. model types transformers does not know, custom code --------------------------
    Case(
        "model_type_unknown",
        "model.config.model_type: model_type 'not_a_model' is not one transformers",
        _model("config: {model_type: not_a_model}"),
    ),
    Case(
        "model_type_typo",
        "model.config.model_type: model_type 'lama' is not one transformers",
        _model("config: {model_type: lama}"),
    ),
    Case("model_type_typo_suggests", "closest known: llama", _model("config: {model_type: lama}")),
    Case(
        "local_model_type_unknown",
        "model.name_or_path: {tmp}/model/config.json: model_type 'not_a_model' is not one transformers",
        _model("name_or_path: {tmp}/model"),
        files={"model/config.json": '{"model_type": "not_a_model"}'},
    ),
    Case(
        "local_custom_code_untrusted",
        "model.trust_remote_code: {tmp}/model/config.json needs the custom modeling code it names (auto_map)",
        _model("name_or_path: {tmp}/model"),
        files={"model/config.json": json.dumps({"model_type": "my_arch", "auto_map": {"AutoConfig": "c.C"}})},
    ),
    Case(
        "local_model_not_a_model_folder",
        "model.name_or_path: {tmp}/model is not a Hugging Face model folder (no config.json in it)",
        _model("name_or_path: {tmp}/model"),
        files={"model/": ""},
    ),
    Case(
        "local_model_config_not_json",
        "model.name_or_path: cannot read {tmp}/model/config.json as JSON",
        _model("name_or_path: {tmp}/model"),
        files={"model/config.json": "{model_type: llama"},
    ),
    Case(
        "train_model_type_unknown",
        "model.config.model_type: model_type 'not_a_model' is not one transformers",
        _model("config: {model_type: not_a_model}") + "training:\n  device: cpu\n  precision: fp32\n",
        ("train", "{recipe}"),
    ),
    # -- 9. loading the model fails ---------------------------------------------------------
    Case(
        "check_local_model_without_weights",
        "model.name_or_path: could not load the weights of '{tmp}/model'",
        _model("name_or_path: {tmp}/model") + "training:\n  device: cpu\n  precision: fp32\n",
        ("validate", "{recipe}", "--check", "-f", "none"),
        files={"model/config.json": json.dumps(TINY_LLAMA_CONFIG)},
    ),
    Case(
        "check_hub_model_offline",
        "model.name_or_path: could not load the config of 'meta-llama/Meta-Llama-3-8B'",
        BASE + "training:\n  device: cpu\n  precision: fp32\n",
        (
            "validate",
            "{recipe}",
            "--check",
            "-f",
            "none",
            "model.config=null",
            "model.name_or_path=meta-llama/Meta-Llama-3-8B",
        ),
        env={"HF_HUB_OFFLINE": "1"},
        in_process=False,
    ),
    # -- the kinds of case around them ------------------------------------------------------
    Case("empty_file", "model: required key is missing", ""),
    Case("only_comments", "data: required key is missing", "# nothing yet\n"),
    Case("list_at_top", "the recipe must be a YAML mapping of sections, got list", "- model\n- data\n"),
    Case(
        "missing_data_path",
        "data.path: required key is missing",
        "model:\n  config: tiny-llama\ndata:\n  format: chat\n",
    ),
    Case(
        "section_is_a_scalar", "training: got 3; input should be a valid dictionary", BASE + "training: 3\n"
    ),
    Case(
        "unknown_model_key",
        "model.nme_or_path: unknown key; did you mean model.name_or_path?",
        _model("config: tiny-llama\nnme_or_path: x"),
    ),
    Case(
        "unknown_data_key",
        "data.max_seq_length: unknown key; did you mean data.max_seq_len?",
        "model:\n  config: tiny-llama\ndata:\n  path: ligertune://alpaca_sample.jsonl\n  max_seq_length: 64\n",
    ),
    Case(
        "bad_attention",
        "model.attn_implementation: got 'flash'; allowed: 'auto', 'sdpa', 'eager', 'flex_attention' or 'flash_attention_2'",
        _model("config: tiny-llama\nattn_implementation: flash"),
    ),
    Case(
        "bad_precision",
        "training.precision: got 'fp16'; allowed: 'bf16', 'bf16-mixed' or 'fp32'",
        _training("precision: fp16"),
    ),
    Case(
        "bad_data_format",
        "data.format: got 'openai'; allowed: 'alpaca', 'chat', 'messages', 'sharegpt', 'prompt_completion', "
        "'pretokenized', 'preference', 'kto' or 'prompt'",
        "model:\n  config: tiny-llama\ndata:\n  path: ligertune://alpaca_sample.jsonl\n  format: openai\n",
    ),
    Case(
        "data_file_missing",
        "data.path: file not found: {tmp}/nope.jsonl",
        "model:\n  config: tiny-llama\ndata:\n  path: {tmp}/nope.jsonl\n",
    ),
    Case(
        "tokenizer_missing",
        "tokenizer.name_or_path: file not found: {tmp}/tok",
        "model:\n  config: tiny-llama\ntokenizer:\n  name_or_path: {tmp}/tok\n"
        "data:\n  path: ligertune://alpaca_sample.jsonl\n",
    ),
    Case(
        "resume_missing",
        "checkpoint.resume: file not found: {tmp}/ckpt",
        BASE + "checkpoint:\n  resume: {tmp}/ckpt\n",
    ),
    Case(
        "bad_plugin",
        "plugins: 'not a plugin' is not 'module:function' or a built-in plugin",
        BASE + "plugins: ['not a plugin']\n",
    ),
    Case("tab_indented", "not valid YAML at line 2", "model:\n\tconfig: tiny-llama\n"),
    Case(
        "not_utf8",
        "the file is not UTF-8 text",
        args=("validate", "{tmp}/latin1.yaml"),
        files={"latin1.yaml": "name: caf\udce9\n"},
    ),
    Case(
        "every_sample_dropped",
        "no training samples left: all 400 have no trainable token within data.max_seq_len=8",
        BASE.replace("data:\n", "data:\n  max_seq_len: 8\n", 1) + "training:\n  precision: fp32\n",
        ("train", "{recipe}"),
    ),
    Case(
        "train_bad_type",
        "training.lr: got True; input should be a valid number",
        _training("lr: true"),
        ("train", "{recipe}"),
    ),
]


# -- 10. documents and numbers that would exhaust time or memory --------------------------------
# 510 bytes: 10 values, each level ten aliases of the one below, 8 levels: 10⁹ values expanded.
ALIAS_BOMB = "    a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"    {chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n" for i in range(8)
)
BOMB_RECIPE = "model:\n  config:\n    model_type: llama\n" + ALIAS_BOMB + SOURCES
CASES += [
    Case(
        "yaml_alias_bomb",
        "the document expands to more than 100,000 values through its aliases",
        BOMB_RECIPE,
        ("validate", "{recipe}", "-f", "yaml"),
    ),
    Case("yaml_alias_bomb_train", "expands to more than 100,000 values", BOMB_RECIPE, ("train", "{recipe}")),
    Case(
        "yaml_alias_bomb_in_an_override",
        "model.config: cannot parse value",
        BASE,
        (
            "validate",
            "{recipe}",
            "model.config=[&a [x, x, x, x, x, x, x, x, x, x], "
            + ", ".join(f"&{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]" for i in range(8))
            + "]",
        ),
    ),
    Case(
        "yaml_alias_in_itself", "an alias refers to a mapping or list that contains it", BASE + "x: &a [*a]\n"
    ),
    Case(
        "recipe_file_too_large",
        "cannot read the recipe file: it is larger than 1024 KiB; a recipe is a few KB of YAML",
        args=("validate", "{tmp}/big.yaml"),
        files={"big.yaml": "# " + "x" * (1 << 20) + "\n"},
    ),
    Case(
        "accumulation_huge",
        "training.gradient_accumulation_steps: got 1000000000; input should be less than or equal to 16384",
        _training("gradient_accumulation_steps: 1000000000"),
    ),
    Case(
        "micro_batch_huge",
        "training.micro_batch_size: got 1000000000; input should be less than or equal to 65536, or auto",
        _training("micro_batch_size: 1000000000"),
    ),
    Case(
        "global_batch_huge",
        "training.global_batch_size: got 10000000000; input should be less than or equal to 1048576",
        _training("micro_batch_size: auto\nglobal_batch_size: 10000000000"),
    ),
    Case(
        "max_seq_len_huge",
        "data.max_seq_len: got 10000000000; input should be less than or equal to 4194304",
        BASE.replace("data:\n", "data:\n  max_seq_len: 10000000000\n", 1),
    ),
    Case(
        "max_samples_huge",
        "data.max_samples: got 1000000000000; input should be less than or equal to 268435456",
        BASE.replace("data:\n", "data:\n  max_samples: 1000000000000\n", 1),
    ),
    Case(
        "lora_rank_huge",
        "lora.r: got 1000000000; input should be less than or equal to 65536",
        BASE + "lora:\n  r: 1000000000\n",
    ),
    Case(
        "config_override_negative_hidden",
        "model.config_overrides: transformers refuses the config: ValueError: The hidden size (-5) is not a multiple",
        _model("config: tiny-llama\nconfig_overrides: {hidden_size: -5}"),
    ),
    Case(
        "config_override_negative_size",
        "model.config_overrides: intermediate_size is -1; it sizes the model and must be a positive integer",
        _model("config: tiny-llama\nconfig_overrides: {intermediate_size: -1}"),
    ),
    Case(
        "config_override_wrong_type",
        "model.config_overrides: transformers refuses the config: TypeError: Field 'hidden_size' expected int, got str",
        _model("config: tiny-llama\nconfig_overrides: {hidden_size: wide}"),
    ),
    Case(
        "config_mapping_zero_vocabulary",
        "model.config: vocab_size is 0; it sizes the model and must be a positive integer",
        _model("config: {model_type: llama, hidden_size: 64, num_attention_heads: 4, vocab_size: 0}"),
    ),
    Case(
        "train_config_override_negative",
        "model.config_overrides: intermediate_size is -1",
        _model("config: tiny-llama\nconfig_overrides: {intermediate_size: -1}")
        + "training:\n  precision: fp32\n",
        ("train", "{recipe}"),
    ),
]


# -- 11. data that would train silently wrong: refused, naming the file and the row -------------
def _data(path: str, fmt: str = "alpaca") -> str:
    return (
        "model:\n  config: tiny-llama\ntokenizer:\n  name_or_path: ligertune://tokenizer\n"
        f"data:\n  path: {path}\n  format: {fmt}\ntraining:\n  precision: fp32\n  max_steps: 1\n"
    )


def _jsonl(*rows: object) -> str:
    return "".join(json.dumps(row) + "\n" for row in rows)


GOOD_ROW = {"instruction": "Say hi.", "output": "Hi."}
TRAIN = ("train", "{recipe}")
CASES += [
    Case(
        "json_mixed_types_name_the_row",
        "{tmp}/d.jsonl, row 3: output must be text, got int",
        _data("{tmp}/d.jsonl"),
        TRAIN,
        files={
            "d.jsonl": _jsonl(*({"instruction": "x", "output": o} for o in ('"quoted"', "false", "null", 5)))
        },
    ),
    Case(
        "directory_mixed_file_types",
        "{tmp}/d: mixes file types: a.jsonl (json), b.csv (csv); a directory holds files of one type",
        _data("{tmp}/d"),
        TRAIN,
        files={"d/a.jsonl": _jsonl(GOOD_ROW), "d/b.csv": "instruction,output\nSay hi.,Hi.\n"},
    ),
    Case(
        "directory_file_refused_like_a_file",
        "{tmp}/d/b.jsonl, row 1: output must be text, got int",
        _data("{tmp}/d"),
        TRAIN,
        files={
            "d/a.jsonl": _jsonl(GOOD_ROW, GOOD_ROW),
            "d/b.jsonl": _jsonl(GOOD_ROW, {"instruction": "x", "output": 7}),
        },
    ),
    Case(
        "directory_file_in_no_split",
        "{tmp}/d: extra.jsonl belongs to no split",
        _data("{tmp}/d"),
        TRAIN,
        files={
            "d/train.jsonl": _jsonl(GOOD_ROW),
            "d/test.jsonl": _jsonl(GOOD_ROW),
            "d/extra.jsonl": _jsonl(GOOD_ROW),
        },
    ),
    Case(
        "pretokenized_bools",
        "{tmp}/p.jsonl, row 1: input_ids[0] is True; token ids must be integers",
        _data("{tmp}/p.jsonl", "pretokenized"),
        TRAIN,
        files={"p.jsonl": _jsonl({"input_ids": [1, 2, 3]}, {"input_ids": [True, False, True]})},
    ),
    Case(
        "pretokenized_float_names_its_row",
        "{tmp}/p.jsonl, row 2: input_ids[1] is 5.0; token ids must be integers",
        _data("{tmp}/p.jsonl", "pretokenized"),
        TRAIN,
        files={"p.jsonl": _jsonl({"input_ids": [1, 2]}, {"input_ids": [3, 4]}, {"input_ids": [4, 5.0]})},
    ),
    Case(
        "alpaca_every_output_empty",
        "{tmp}/d.jsonl, row 0: output is empty, as in 3 of the 3 rows ({tmp}/d.jsonl, row 1, {tmp}/d.jsonl, "
        "row 2); there would be nothing to train on in them: remove those rows",
        _data("{tmp}/d.jsonl"),
        TRAIN,
        files={"d.jsonl": _jsonl(*({"instruction": f"Q{i}", "output": ""} for i in range(3)))},
    ),
    Case(
        "chat_row_without_assistant_turn",
        "{tmp}/c.jsonl, row 1: the conversation has no assistant turn; there would be nothing to train on in it",
        _data("{tmp}/c.jsonl", "chat"),
        TRAIN,
        files={
            "c.jsonl": _jsonl(
                {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]},
                {"messages": [{"role": "user", "content": "Hi"}]},
            )
        },
    ),
    Case(
        "json_nan",
        "{tmp}/d.jsonl: line 2 is not valid JSON: NaN is not a JSON number",
        _data("{tmp}/d.jsonl"),
        TRAIN,
        files={"d.jsonl": _jsonl(GOOD_ROW) + '{"instruction": "x", "output": NaN}\n'},
    ),
    Case(
        "csv_ragged_row",
        "{tmp}/d.csv: line 3 has 3 fields, the header has 2",
        _data("{tmp}/d.csv"),
        TRAIN,
        files={"d.csv": "instruction,output\nSay hi.,Hi.\nSay hi.,Hi.,extra\n"},
    ),
]

# Inputs that must keep working (the strict types and new rules must not refuse them).
GOOD = [
    Case(
        "lr_without_dot", "lr: 2.0e-05", _training("lr: 2e-5"), ("validate", "{recipe}", "-f", "yaml"), code=0
    ),
    Case(
        "lr_with_dot", "lr: 2.0e-05", _training("lr: 2.0e-5"), ("validate", "{recipe}", "-f", "yaml"), code=0
    ),
    Case("lr_int", "lr: 1.0", _training("lr: 1"), ("validate", "{recipe}", "-f", "yaml"), code=0),
    Case(
        "lr_override_without_dot",
        "lr: 2.0e-05",
        BASE,
        ("validate", "{recipe}", "training.lr=2e-5", "-f", "yaml"),
        code=0,
    ),
    Case(
        "grad_norm_zero_is_no_clipping",
        "max_grad_norm: null",
        _training("max_grad_norm: 0"),
        ("validate", "{recipe}", "-f", "yaml"),
        code=0,
    ),
    Case(
        "local_custom_code_trusted",
        "✓",
        _model("name_or_path: {tmp}/model\ntrust_remote_code: true"),
        files={"model/config.json": json.dumps({"model_type": "my_arch", "auto_map": {"AutoConfig": "c.C"}})},
        code=0,
    ),
    Case(
        "local_known_type_with_auto_map",
        "✓",
        _model("name_or_path: {tmp}/model"),
        files={"model/config.json": json.dumps({**TINY_LLAMA_CONFIG, "auto_map": {"AutoConfig": "c.C"}})},
        code=0,
    ),
    Case("output_dir_not_yet_there", "✓", BASE + "output_dir: {tmp}/a/b/c\n", code=0),
    Case("format_none_prints_only_the_tick", "✓", BASE, ("validate", "{recipe}", "-f", "none"), code=0),
]


def _fill(text: str, tmp: Path) -> str:
    return text.replace("{recipe}", str(tmp / "recipe.yaml")).replace("{tmp}", str(tmp))


def run_case(case: Case, tmp: Path) -> tuple[int, str]:
    """Write the case's files, run its command line; (exit status, everything it printed)."""
    for name, text in case.files.items():
        target = tmp / name
        if name.endswith("/"):
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(_fill(text, tmp).encode("utf-8", "surrogateescape"))
    if case.recipe is not None:
        (tmp / "recipe.yaml").write_text(_fill(case.recipe, tmp), encoding="utf-8")
    args = [_fill(a, tmp) for a in case.args]
    if case.in_process:
        result = CliRunner().invoke(app, args, env=case.env)
        # An exception other than the CLI's own exit would be a traceback in a real process.
        assert result.exception is None or isinstance(result.exception, SystemExit), repr(result.exception)
        return result.exit_code, result.output
    proc = subprocess.run(
        [sys.executable, "-m", "ligertune", *args],
        capture_output=True,
        text=True,
        cwd=tmp,
        env={**os.environ, "PYTHONPATH": str(ROOT), **case.env},
        timeout=120,
    )
    return proc.returncode, proc.stdout + proc.stderr


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    """Cases run in their own folder: a default output folder (runs/<name>) lands there."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


@pytest.mark.parametrize("case", CASES + GOOD, ids=lambda c: c.id)
def test_case(case, in_tmp):
    code, output = run_case(case, in_tmp)
    assert _fill(case.expect, in_tmp) in output, output
    assert code == case.code, output


def test_every_case_has_its_own_id():
    ids = [c.id for c in CASES + GOOD]
    assert len(ids) == len(set(ids))


@pytest.fixture
def read_only_folder(tmp_path) -> Path:
    """A folder this process cannot create anything in. chmod does not stop root (tests often
    run as root), so as root take /proc/self: no one can create entries in a process's folder."""
    folder = tmp_path / "read-only"
    folder.mkdir()
    folder.chmod(0o555)
    if not os.access(folder, os.W_OK):
        return folder
    if os.path.isdir("/proc/self") and not os.access("/proc/self", os.W_OK):
        return Path("/proc/self")
    pytest.skip("no folder here refuses writes to this user (root without /proc)")


def test_output_dir_read_only(read_only_folder, in_tmp):
    case = Case(
        "output_dir_read_only",
        f"output_dir: {read_only_folder} is not writable, so {read_only_folder}/run cannot be created; "
        "set output_dir to a folder you can write",
        BASE + f"output_dir: {read_only_folder}/run\n",
    )
    code, output = run_case(case, in_tmp)
    assert case.expect in output, output
    assert code == 2
    assert not (read_only_folder / "run").exists()


def test_validation_creates_nothing(in_tmp):
    """The output-folder rule looks, it does not create: validate leaves no runs/ behind."""
    code, output = run_case(Case("clean", "✓", BASE + "output_dir: out/deeper\n", code=0), in_tmp)
    assert code == 0, output
    assert sorted(p.name for p in in_tmp.iterdir()) == ["recipe.yaml"]


def test_whole_corpus_is_tracebackless_and_short(tmp_path, monkeypatch):
    """Every bad input of the corpus, and every broken recipe of tests/recipes, through the CLI:
    exit status 2, no traceback, and the error on a few lines (a header and one line per problem;
    a usage error's box)."""
    fixtures = [
        Case(f"fixture-{name}", EXPECTED[name], args=("validate", str(BROKEN / name))) for name in EXPECTED
    ]
    bad = []
    for i, case in enumerate(CASES + fixtures):
        folder = tmp_path / str(i)
        folder.mkdir()
        monkeypatch.chdir(folder)
        code, output = run_case(case, folder)
        lines = output.strip().splitlines()
        if code != 2 or "Traceback" in output or len(lines) > 8 or any(len(line) > 600 for line in lines):
            bad.append(f"{case.id}: exit {code}, {len(lines)} lines:\n{output}")
    assert not bad, "\n".join(bad)


def test_max_grad_norm_zero_does_not_zero_the_gradients():
    """0 reaches the runtime as no clipping, and the runtime treats a literal 0 the same way."""
    from ligertune.distributed.runtime import Runtime

    model = torch.nn.Linear(4, 4)
    model(torch.ones(2, 4)).sum().backward()
    before = [p.grad.clone() for p in model.parameters()]
    norm = Runtime(torch.device("cpu")).clip_grad_norm(model, 0.0)
    assert norm > 0
    for grad, p in zip(before, model.parameters(), strict=True):
        assert torch.equal(grad, p.grad)


def test_recipes_cp_never_writes_through_a_link(in_tmp):
    """A link where the copy would go, even a dangling one, is refused: the file it points at is
    neither created nor overwritten."""
    target = in_tmp / "elsewhere.yaml"
    (in_tmp / "mine.yaml").symlink_to(target)
    code, output = run_case(
        Case("cp_onto_link", "", args=("recipes", "cp", "quickstart", "{tmp}/mine.yaml")), in_tmp
    )
    assert code == 2 and f"{in_tmp}/mine.yaml is a symbolic link (to {target}); not overwriting it" in output
    assert not target.exists()
    target.write_text("precious\n")
    code, output = run_case(
        Case("cp_onto_link", "", args=("recipes", "cp", "quickstart", "{tmp}/mine.yaml")), in_tmp
    )
    assert code == 2 and target.read_text() == "precious\n"
