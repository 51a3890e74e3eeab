"""grpo: the recipe's rules, the prompt data, the reward functions and advantages (against values
written out by hand from the papers), the sampler (its KV cache against full forwards, top-p,
stop strings and EOS), and the objective on a tiny model: the fused and materialised losses, the
loop's normalisation (accumulation invariance), and the generation batch (seeded by step, the old
policy's and the reference's log-probs)."""

from __future__ import annotations

import json
import math
import sys
from fractions import Fraction

import pytest
import torch

from ligertune.config import RecipeError, load_recipe
from ligertune.data.prompts import PROMPTS, Prompt
from ligertune.objectives.rewards import (
    STD_EPSILON,
    advantages,
    final_answer,
    length_penalty,
    load_rewards,
    normalise_answer,
    score,
)
from ligertune.objectives.rollout import (
    Completions,
    RowNoise,
    Sampling,
    completion_rows,
    generate,
    sample_next,
    split_rows,
)
from tests.helpers import PLAIN_RUN, ROOT, TINY_MODEL, assert_same_outcomes, tiny_llama, window_outcomes

QUICKSTART_GRPO = ROOT / "recipes" / "quickstart-grpo.yaml"


def _recipe(*extra: str, path=QUICKSTART_GRPO):
    return load_recipe(path, [*TINY_MODEL, *PLAIN_RUN, "training.device=cpu", *extra])


def _setup(recipe):
    from ligertune.training.trainer import Trainer

    trainer = Trainer(recipe)
    trainer.setup()
    return trainer


# --------------------------------------------------------------------------------------------
# The recipe
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.format=alpaca", "data.path=ligertune://alpaca_sample.jsonl"], "trains on data.format prompt"),
        (["objective.max_new_tokens=64"], "objective.max_new_tokens: 64 leaves no room"),
        (["objective.rewards=[]"], "objective.rewards: grpo needs at least one reward"),
        (
            ["objective.rewards=[{fn: no_colon}]"],
            r"objective.rewards\[0\].fn: 'no_colon' is not 'module:function'",
        ),
        (
            ["objective.rewards=[{builtin: regex}]"],
            r"objective.rewards\[0\].pattern: needed by builtin regex",
        ),
        (["objective.rewards=[{builtin: regex, pattern: '('}]"], "not a regular expression"),
        (["objective.rewards=[{builtin: exact_match, pattern: x}]"], "pattern: only for builtin regex"),
        (["objective.rewards=[{builtin: exact_match, fn: a:b}]"], "set exactly one of fn"),
        (["objective.rewards=[{builtin: exact_match}, {builtin: exact_match}]"], "exact_match named twice"),
        (
            ["objective.reference_model={config: tiny-llama}"],
            "objective.reference_model: not used, beta is 0",
        ),
        (["data.validation_fraction=0.1"], "data.validation_fraction: grpo has no validation loss"),
        (["training.compile=true"], "training.compile: grpo generates"),
        (
            ["objective.generation_cache=static", "parallel.strategy=fsdp"],
            "objective.generation_cache: static is not supported with parallel.strategy fsdp",
        ),
        (
            ["parallel.strategy=deepspeed"],
            "objective.name grpo: not supported with parallel.strategy deepspeed",
        ),
        (["data.packing=true"], "data.packing: a prompt row is completed by the policy"),
        (["objective.num_generations=1"], "num_generations"),
    ],
)
def test_recipe_rules_refuse(overrides, message):
    with pytest.raises(RecipeError, match=message):
        _recipe(*overrides)


def test_prompt_data_needs_an_objective_that_generates():
    with pytest.raises(
        RecipeError,
        match="data.format: prompt data needs an online RL objective .objective.name: grpo., not sft",
    ):
        load_recipe(ROOT / "recipes" / "quickstart.yaml", ["data.format=prompt", "data.packing=false"])


def test_clip_and_scaling_defaults_follow_each_paper():
    def options(*extra):
        return _recipe(*extra).objective

    assert options().clip() == (0.2, 0.2) and options().reward_scaling() == "group"
    assert options("objective.loss_type=dapo").clip() == (0.2, 0.28)
    assert options("objective.loss_type=gspo").clip() == (3e-4, 4e-4)
    assert options("objective.loss_type=dr_grpo").reward_scaling() == "none"
    assert options("objective.loss_type=dapo", "objective.epsilon=0.1").clip() == (0.1, 0.1)
    assert options("objective.epsilon=0.1", "objective.epsilon_high=0.3").clip() == (0.1, 0.3)


# --------------------------------------------------------------------------------------------
# The prompt data
# --------------------------------------------------------------------------------------------


def test_prompts_are_left_padded_and_carry_their_answers(tmp_path):
    trainer = _setup(_recipe(f"output_dir={tmp_path}"))
    try:
        batch = next(trainer.parts.data.loader.iter_epoch(0))
        tokenizer = trainer.parts.data.tokenizer
    finally:
        trainer.cleanup()
    ids, mask, prompts = batch["input_ids"], batch["attention_mask"], batch[PROMPTS]
    assert ids.shape[0] == mask.shape[0] == len(prompts) == 4
    assert (mask[:, -1] == 1).all() and (mask.diff(dim=1) >= 0).all()  # padding on the left only
    assert (ids[mask == 0] == tokenizer.pad_token_id).all()
    for row, prompt in zip(range(4), prompts, strict=True):
        real = ids[row][mask[row] == 1].tolist()
        assert real[0] == tokenizer.bos_token_id and tokenizer.decode(real[1:]) == prompt.text
        assert prompt.text.startswith("Question: ") and prompt.text.endswith("\nAnswer:")
        assert prompt.answer.isdigit() and prompt.metadata["steps"] in (1, 2)
        assert "arithmetic_sample.jsonl, row " in prompt.where


def test_long_prompts_are_cut_from_the_left(tmp_path):
    """A row holds prompt and completion: max_seq_len 24 with 8 new tokens leaves 16 for the
    prompt, cut from the left (BOS and the question's end kept) and counted."""
    trainer = _setup(_recipe("data.max_seq_len=24", f"output_dir={tmp_path}"))
    try:
        data = trainer.parts.data
        rows = [data.datasets.train[i] for i in range(len(data.datasets.train))]
        stats, tokenizer = data.datasets.stats, data.tokenizer
    finally:
        trainer.cleanup()
    assert stats.num_truncated == len(rows) and "cut to fit 24 tokens" in stats.describe()
    for row in rows:
        ids = row["input_ids"].tolist()
        assert len(ids) == 16 and ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids[1:]).endswith("\nAnswer:") and row["prompt"].text.endswith(
            tokenizer.decode(ids[1:])
        )


def test_chat_prompts_end_with_the_generation_prompt(tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = [
        {"prompt": [{"role": "user", "content": f"What is {i} plus {i}?"}], "answer": 2 * i} for i in range(8)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    trainer = _setup(_recipe(f"data.path={data}", f"output_dir={tmp_path / 'run'}", "data.max_seq_len=64"))
    try:
        batch = next(trainer.parts.data.loader.iter_epoch(0))
        tokenizer = trainer.parts.data.tokenizer
    finally:
        trainer.cleanup()
    prompt = batch[PROMPTS][0]
    assert prompt.text.endswith("<|im_start|>assistant\n") and isinstance(prompt.answer, int)
    real = batch["input_ids"][0][batch["attention_mask"][0] == 1].tolist()
    assert tokenizer.decode(real) == prompt.text  # the template writes BOS itself: no second one


# --------------------------------------------------------------------------------------------
# Rewards and advantages
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the total is \\boxed{\\frac{3}{4}} in the end", "\\frac{3}{4}"),
        ("First 2 + 3 = 5.\n#### 1,250", "1,250"),
        ("The answer is 42 apples.\nThanks", "42 apples."),
        ("Answer: -7", "-7"),
        ("I add 12 and 7 to get 19", "19"),
        ("no digits at all", None),
    ],
)
def test_final_answer(text, answer):
    assert final_answer(text) == answer


@pytest.mark.parametrize(
    ("a", "b", "equal"),
    [
        ("1,250", "1250", True),
        ("\\frac{1}{2}", "0.5", True),
        ("1/2", "0.50", True),
        ("$42$", "42", True),
        ("42.", 42, True),
        ("\\text{seven}", "Seven", True),
        ("41", "42", False),
        ("1,2", "12", False),  # not a thousands separator
    ],
)
def test_normalise_answer(a, b, equal):
    assert (normalise_answer(a) == normalise_answer(b)) is equal


def _rewards(*specs, directory=None, max_new_tokens=8):
    recipe = _recipe(
        f"objective.rewards={json.dumps(list(specs))}", f"objective.max_new_tokens={max_new_tokens}"
    )
    return load_rewards(recipe.objective.rewards, directory, max_new_tokens)


def test_builtin_rewards():
    rewards = _rewards(
        {"builtin": "exact_match"},
        {"builtin": "regex", "pattern": "^\\s*\\d+\\s*$", "match": "full", "name": "number"},
        {"builtin": "regex", "pattern": "\\d", "name": "digit"},
        {"builtin": "length_penalty", "buffer": 4},
    )
    prompt = Prompt("Question: 2 + 2?\nAnswer:", "4", None, "x, row 0")
    values, error = score(rewards, [prompt], [" 4", " 4 apples", "four", " 4 "], [2, 5, 7, 8], group=4)
    assert error is None
    # max_new_tokens 8, buffer 4: free up to 4 tokens, then (4 − L)/4, and −1 at 8 (DAPO eq. 13)
    assert values.tolist() == [
        [1.0, 1.0, 1.0, 0.0],
        [1.0, 0.0, 1.0, -0.25],
        [0.0, 0.0, 0.0, -0.75],
        [1.0, 1.0, 1.0, -1.0],
    ]
    assert [length_penalty(n, 10, 5) for n in (5, 6, 9, 10)] == [0.0, -0.2, -0.8, -1.0]


def test_user_rewards_are_imported_next_to_the_recipe(tmp_path):
    (tmp_path / "my_grpo_rewards.py").write_text(
        "def shouting(prompt, completion, answer, metadata):\n"
        "    return sum(c.isupper() for c in completion) / max(len(completion), 1)\n"
        "def raises(**_):\n    raise ZeroDivisionError('boom')\n"
        "def text(**_):\n    return 'high'\n"
        "def nan(**_):\n    return float('nan')\n"
    )
    path = list(sys.path)
    rewards = _rewards(
        {"fn": "my_grpo_rewards:shouting", "weight": 2.0},
        {"fn": "my_grpo_rewards:raises"},
        {"fn": "my_grpo_rewards:text"},
        {"fn": "my_grpo_rewards:nan"},
        directory=tmp_path,
    )
    assert sys.path == path  # the recipe's folder was on it for the import only
    assert rewards[0].label == "shouting" and rewards[0].weight == 2.0
    prompts = [Prompt("p", None, None, "data.jsonl, row 12")]
    values, error = score(rewards[:1], prompts, ["ABcd", "ab"], [2, 1], group=2)
    assert error is None and values[:, 0].tolist() == [0.5, 0.0]
    for reward, said in zip(
        rewards[1:], ("raised ZeroDivisionError: boom", "returned 'high'", "returned nan"), strict=True
    ):
        _, error = score([reward], prompts, ["x", "yes it is"], [1, 3], group=2)
        assert error.startswith(f"{reward.key} (my_grpo_rewards:{reward.label}) {said}"), error
        assert "completion 1 of 2 of the prompt at data.jsonl, row 12 ('x')" in error
    with pytest.raises(RecipeError, match=r"objective.rewards\[0\].fn: cannot load 'no_such_module:f'"):
        _rewards({"fn": "no_such_module:f"}, directory=tmp_path)


def test_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0], dtype=torch.float64)
    adv, agree = advantages(rewards, group=4, scaling="group")
    # group 1: mean 0.5, sample std sqrt((4 · 0.25) / 3); group 2: all equal, advantage 0
    std = math.sqrt(1.0 / 3.0)
    a = 0.5 / (std + STD_EPSILON)
    assert adv[:4].tolist() == pytest.approx([a, -a, -a, a])
    assert adv[4:].tolist() == [0.0] * 4 and agree.tolist() == [False, True]
    centred, _ = advantages(rewards, group=4, scaling="none")
    assert centred.tolist() == [0.5, -0.5, -0.5, 0.5, 0.0, 0.0, 0.0, 0.0]
    scaled, _ = advantages(rewards, group=4, scaling="batch", batch_std=2.0)
    assert scaled.tolist() == pytest.approx([x / (2.0 + STD_EPSILON) for x in centred.tolist()])


# --------------------------------------------------------------------------------------------
# The sampler
# --------------------------------------------------------------------------------------------


def test_top_p_keeps_the_nucleus():
    """p = (0.5, 0.3, 0.15, 0.05), top_p 0.7: the mass before token 2 is 0.8 ≥ 0.7, so only tokens
    0 and 1 are drawn, in the ratio 5 : 3."""
    logits = torch.tensor([0.5, 0.3, 0.15, 0.05]).log().repeat(4000, 1)
    drawn = sample_next(logits, Sampling(1, top_p=0.7), torch.rand(4000))
    counts = torch.bincount(drawn, minlength=4).tolist()
    assert counts[2] == counts[3] == 0
    assert counts[0] / 4000 == pytest.approx(0.625, abs=0.04)
    everything = torch.bincount(sample_next(logits, Sampling(1), torch.rand(4000)), minlength=4).tolist()
    assert everything[3] / 4000 == pytest.approx(0.05, abs=0.02) and min(everything) > 0
    # The inverse of the cumulative distribution: a draw in (0.5, 0.8) is token 1, (0.95, 1) token 3.
    edges = torch.tensor([0.0, 0.4999, 0.5001, 0.7999, 0.8001, 0.9501, 0.9999])
    assert sample_next(logits[:7], Sampling(1), edges).tolist() == [0, 0, 1, 1, 2, 3, 3]


def _left_padded(vocab, lengths):
    width = max(lengths)
    ids = torch.randint(3, vocab, (len(lengths), width))
    mask = torch.zeros(len(lengths), width, dtype=torch.int64)
    for row, n in enumerate(lengths):
        mask[row, width - n :] = 1
    return torch.where(mask == 1, ids, 0), mask


def test_generation_with_the_kv_cache_equals_full_forwards():
    """Each sampled token from the cache (left-padded prompts of several lengths) is the one a
    full forward over prompt + tokens so far draws from the same generator state: same logits
    (float64, to 1e-10), so the same draw."""
    torch.manual_seed(torch.seed() % 2**31)
    model = tiny_llama(vocab_size=97, hidden_size=32, intermediate_size=64).double().eval()
    ids, mask = _left_padded(97, [5, 2, 7])
    sampling = Sampling(6, temperature=0.7)
    seed = torch.seed() % 2**31
    done = generate(
        model, ids, mask, sampling, RowNoise([seed], [3], "cpu"), eos_token_id=None, pad_token_id=0
    )
    noise = RowNoise([seed], [3], "cpu")
    tokens = ids
    for step in range(6):
        full_mask = torch.cat([mask, torch.ones(3, step, dtype=torch.int64)], dim=1)
        positions = (full_mask.cumsum(-1) - 1).clamp_min(0)
        with torch.no_grad():
            logits = model(
                input_ids=tokens, attention_mask=full_mask, position_ids=positions, use_cache=False
            ).logits
        token = sample_next(logits[:, -1], sampling, noise())
        assert torch.equal(token, done.ids[:, step]), step
        tokens = torch.cat([tokens, token[:, None]], dim=1)
    assert done.mask.all() and not done.stopped.any()


def test_eos_and_stop_strings_end_a_completion():
    """The same seed twice: once without EOS, once with EOS set to the token row 0 drew second,
    which then ends row 0 there (kept, inside the mask; padding after), leaving the draws before
    it as they were. Stop strings: every completion ends with the first token whose text holds
    one; what it generated before holds none."""
    from ligertune.data import load_tokenizer

    tokenizer = load_tokenizer(_recipe())
    torch.manual_seed(torch.seed() % 2**31)
    model = tiny_llama(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64).eval()
    ids, mask = _left_padded(len(tokenizer), [4, 6, 3, 5])
    sampling = Sampling(10)
    seed = torch.seed() % 2**31

    def run(eos, stop=()):
        return generate(
            model, ids, mask, Sampling(10, stop=stop), RowNoise([seed], [4], "cpu"),
            eos_token_id=eos, pad_token_id=tokenizer.pad_token_id, tokenizer=tokenizer,
        )  # fmt: skip

    free = run(None)
    eos = int(free.ids[0, 1])
    ended = run(eos)
    first = int((free.ids[0] == eos).nonzero()[0])  # the first time row 0 drew it
    assert ended.mask[0].tolist() == [True] * (first + 1) + [False] * (ended.ids.shape[1] - first - 1)
    assert torch.equal(ended.ids[0, : first + 1], free.ids[0, : first + 1]) and bool(ended.stopped[0])
    assert (ended.ids[0, first + 1 :] == tokenizer.pad_token_id).all()
    assert sampling.max_new_tokens == 10 and free.ids.shape[1] == 10 and not free.stopped.any()
    stop = ("e",)
    stopped = run(None, stop)
    assert stopped.stopped.any()  # "e" is in many of the bundled tokenizer's tokens
    for row in range(4):
        length = int(stopped.mask[row].sum())
        text = tokenizer.decode(stopped.ids[row, :length].tolist())
        if stopped.stopped[row]:
            assert "e" in tokenizer.decode(stopped.ids[row, length - 1 : length].tolist())
            assert "e" not in tokenizer.decode(stopped.ids[row, : length - 1].tolist())
        else:
            assert length == 10 and "e" not in text


def test_a_window_generated_as_one_batch_equals_its_micro_batches_alone():
    """Two micro-batches of prompts of other lengths, generated together (padded to the longest,
    each row drawing from its micro-batch's generator) and cut back (`split_rows`), give each
    micro-batch what generating it alone gives: its own prompt columns, its completions, its
    trimmed length (float64: the padding moves the logits' last bits only)."""
    torch.manual_seed(torch.seed() % 2**31)
    model = tiny_llama(vocab_size=97, hidden_size=32, intermediate_size=64).double().eval()
    first, second = _left_padded(97, [3, 5]), _left_padded(97, [8, 2, 4])
    seeds, sampling = [torch.seed() % 2**31, torch.seed() % 2**31], Sampling(7, temperature=1.3)
    width = 8
    ids = torch.cat([torch.nn.functional.pad(x, (width - x.shape[1], 0)) for x in (first[0], second[0])])
    mask = torch.cat([torch.nn.functional.pad(m, (width - m.shape[1], 0)) for m in (first[1], second[1])])
    eos = 5  # a token the random model draws now and then: completions of several lengths
    together = generate(
        model, ids, mask, sampling, RowNoise(seeds, [2, 3], "cpu"), eos_token_id=eos, pad_token_id=0
    )
    for (part_ids, part_mask, done), (alone_ids, alone_mask), seed in zip(
        split_rows(ids, mask, together, [2, 3]), (first, second), seeds, strict=True
    ):
        alone = generate(
            model,
            alone_ids,
            alone_mask,
            sampling,
            RowNoise([seed], [len(alone_ids)], "cpu"),
            eos_token_id=eos,
            pad_token_id=0,
        )
        assert torch.equal(part_ids, alone_ids) and torch.equal(part_mask, alone_mask)
        assert torch.equal(done.mask, alone.mask) and torch.equal(done.stopped, alone.stopped)
        assert torch.equal(torch.where(done.mask, done.ids, -1), torch.where(alone.mask, alone.ids, -1))


@pytest.mark.parametrize("ending", ["eos", "stop", "top_p"])
def test_the_static_cache_generates_what_the_dynamic_one_does(ending):
    """The static decode (preallocated cache, mask and positions updated in place; eager on the
    CPU) against the dynamic one, fp32, prompts of four lengths left-padded, two micro-batches'
    generators: the same tokens, masks and stops. With a 5-token vocabulary an EOS ends every row
    early, at a step the every-16-tokens check of `done` does not fall on, and the completions
    come back as long as the longest, as a check at every token gives; with the bundled tokenizer
    a stop string ends some rows (the host looks every token); top-p with neither runs to
    max_new_tokens."""
    from ligertune.data import load_tokenizer

    tokenizer = load_tokenizer(_recipe())
    torch.manual_seed(1234)
    vocab = 5 if ending == "eos" else len(tokenizer)
    model = tiny_llama(vocab_size=vocab, hidden_size=32, intermediate_size=64).eval()
    ids, mask = _left_padded(vocab, [4, 9, 1, 6])
    ids = ids.remainder(vocab)
    sampling = Sampling(
        40,
        temperature=1.2,
        top_p=0.8 if ending == "top_p" else 1.0,
        stop=("th", "7") if ending == "stop" else (),
    )
    eos = 4 if ending == "eos" else None

    def run(cache):
        return generate(
            model, ids, mask, sampling, RowNoise([11, 12], [2, 2], "cpu"),
            eos_token_id=eos, pad_token_id=0, tokenizer=tokenizer, cache=cache,
        )  # fmt: skip

    dynamic, static = run("dynamic"), run("static")
    assert torch.equal(static.ids, dynamic.ids) and torch.equal(static.mask, dynamic.mask)
    assert torch.equal(static.stopped, dynamic.stopped)
    lengths = static.mask.sum(1)
    assert static.ids.shape[1] == int(lengths.max())  # trimmed to the longest completion
    if ending == "eos":
        assert static.stopped.all() and int(lengths.max()) < 40 and int(lengths.max()) % 16 != 0
    elif ending == "stop":
        assert static.stopped.any() and not static.stopped.all()
    else:
        assert not static.stopped.any() and static.ids.shape[1] == 40


def test_generation_cache_auto_is_static_on_a_gpu_where_the_strategy_allows_graphs():
    from types import SimpleNamespace

    from ligertune.catalog.strategies import STRATEGIES
    from ligertune.objectives.grpo import _generation_cache

    options = _recipe().objective
    for strategy, device, cache in [
        ("none", "cuda", "static"),
        ("ddp", "cuda", "static"),
        ("fsdp", "cuda", "dynamic"),
        ("none", "cpu", "dynamic"),
    ]:
        runtime = SimpleNamespace(options_model=STRATEGIES.named(strategy), device=torch.device(device))
        assert _generation_cache(options, runtime) == cache, (strategy, device)
    forced = options.model_copy(update={"generation_cache": "static"})
    assert (
        _generation_cache(forced, SimpleNamespace(options_model=None, device=torch.device("cpu"))) == "static"
    )


def test_completion_rows_layout():
    prompt = torch.tensor([[0, 0, 5, 6], [0, 7, 8, 9]])
    mask = torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]])
    done = Completions(
        torch.tensor([[11, 12, 2], [13, 0, 0]]),
        torch.tensor([[True, True, True], [True, False, False]]),
        torch.tensor([True, True]),
    )
    rows = completion_rows(prompt, mask, done)
    assert rows["input_ids"].tolist() == [[0, 0, 5, 6, 11, 12, 2], [0, 7, 8, 9, 13, 0, 0]]
    assert rows["attention_mask"].tolist() == [[0, 0, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0]]
    assert rows["position_ids"].tolist() == [[0, 0, 0, 1, 2, 3, 4], [0, 0, 1, 2, 3, 3, 3]]
    assert rows["labels"].tolist() == [[-100] * 4 + [11, 12, 2], [-100] * 4 + [13, -100, -100]]


# --------------------------------------------------------------------------------------------
# The objective on a tiny model
# --------------------------------------------------------------------------------------------


def _window(trainer, batches=1):
    return [b for _, b in zip(range(batches), trainer.parts.data.loader.iter_epoch(0), strict=False)]


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "gspo"])
def test_fused_and_materialised_losses_agree(loss_type, tmp_path):
    """The same generated rows through the fused lm_head (the policy loss chunk by chunk inside
    the lm_head's call, on the completion positions only) and through HF's logits: same loss,
    metrics and gradients. With μ = 2 and β > 0, so that the ratio, clip and KL all take part
    (the policy is moved away from the old and reference log-probs first)."""
    extra = [f"objective.loss_type={loss_type}", "objective.num_iterations=2", "objective.beta=0.05"]
    extra += ["objective.epsilon=0.01", "objective.epsilon_high=0.02", "training.micro_batch_size=2"]
    extra += ["objective.num_generations=4"]
    results = []
    for kernels in ("kernels.fused_linear_cross_entropy=true", "kernels=none"):
        trainer = _setup(_recipe(*extra, kernels, f"output_dir={tmp_path / kernels[:9]}"))
        try:
            objective, model = trainer.parts.objective, trainer.parts.model
            batch = objective.prepare(model, _window(trainer), 0).batches[0]
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(
                        torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())), alpha=0.02
                    )
            n = torch.tensor(objective.count(batch))
            out = objective(model, batch, n)
            out.loss.backward()
            grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
            results.append(
                (
                    objective.fused,
                    out.loss.detach(),
                    {k: v.item() for k, v in out.metrics.items()},
                    grads,
                    batch,
                )
            )
        finally:
            trainer.cleanup()
    (f1, l1, m1, g1, b1), (f2, l2, m2, g2, b2) = results
    assert (f1, f2) == (True, False)
    assert torch.equal(b1["input_ids"], b2["input_ids"])  # the same completions: same seed, same weights
    assert m1["clip_fraction"] > 0 and m1["kl"] > 0
    torch.testing.assert_close(l1, l2, rtol=1e-5, atol=1e-6)
    assert m1 == pytest.approx(m2, rel=1e-4, abs=1e-6)
    for a, b in zip(g1, g2, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_accumulation_invariance(loss_type, tmp_path):
    """One micro-batch of 4 prompts (32 rows) = four micro-batches of one prompt, with the
    loop's N (completions for grpo, tokens for dapo)."""
    trainer = _setup(
        _recipe(f"objective.loss_type={loss_type}", "objective.num_iterations=2", f"output_dir={tmp_path}")
    )
    try:
        objective, model = trainer.parts.objective, trainer.parts.model
        whole = objective.prepare(model, _window(trainer), 0).batches[0]
        with torch.no_grad():
            for p in model.parameters():
                p.add_(torch.randn_like(p), alpha=0.01)
        group = objective.options.num_generations
        singles = [{k: v[i * group : (i + 1) * group] for k, v in whole.items()} for i in range(4)]
        one, four = window_outcomes(trainer, [[whole], singles])
    finally:
        trainer.cleanup()
    assert one[0].items == four[0].items == (32 if loss_type == "grpo" else whole["completion_mask"].sum())
    assert_same_outcomes(one, four)


def test_generation_batch_is_seeded_by_step_and_scored(tmp_path):
    """Preparing step 0 twice gives the same completions; step 1 (another generation, μ = 1)
    others. Each batch: whole groups, advantages of mean 0 per group, the rewards' metrics."""
    trainer = _setup(_recipe(f"output_dir={tmp_path}"))
    try:
        objective, model = trainer.parts.objective, trainer.parts.model
        window = _window(trainer)
        first, again, later = (objective.prepare(model, window, step) for step in (0, 0, 1))
    finally:
        trainer.cleanup()
    batch = first.batches[0]
    assert torch.equal(batch["input_ids"], again.batches[0]["input_ids"])
    assert not torch.equal(batch["input_ids"], later.batches[0]["input_ids"])
    assert batch["input_ids"].shape[0] == 32 and batch["completion_mask"].shape[1] <= 8
    assert batch["advantages"].view(4, 8).sum(-1).abs().max() < 1e-5
    assert set(batch) == {
        "input_ids",
        "attention_mask",
        "position_ids",
        "labels",
        "completion_mask",
        "advantages",
    }
    assert {"reward_mean", "reward_format_mean", "reward_exact_match_std", "zero_std_fraction"} <= set(
        first.metrics
    )
    assert 0 <= first.metrics["reward_format_mean"] <= 1 and first.metrics["completion_length"] <= 8


@pytest.mark.parametrize("lora", [False, True])
def test_old_and_reference_logps_start_at_the_policy(lora, tmp_path):
    """μ = 2 and β > 0: the rows carry the old policy's and the reference's log-probs of the
    completion tokens. At the start the reference (a frozen copy from the same seed; with LoRA
    the adapters-off policy) is the policy, so both equal the policy's own log-probs, the ratio
    is 1 and the KL 0."""
    from ligertune.objectives.logps import completion_logps

    extra = ["objective.num_iterations=2", "objective.beta=0.04", f"output_dir={tmp_path}"]
    trainer = _setup(_recipe(*extra, *(["lora={r: 4, alpha: 8}"] if lora else [])))
    try:
        objective, model = trainer.parts.objective, trainer.parts.model
        assert objective.reference.kind == ("adapters_off" if lora else "frozen")
        batch = objective.prepare(model, _window(trainer), 0).batches[0]
        with torch.no_grad():
            now = completion_logps(model, batch, objective.fused)
        out = objective(model, batch, torch.tensor(objective.count(batch)))
    finally:
        trainer.cleanup()
    mask = batch["completion_mask"]
    assert (batch["old_logps"][~mask] == 0).all() and (batch["old_logps"][mask] < 0).all()
    torch.testing.assert_close(batch["old_logps"], now)
    torch.testing.assert_close(batch["ref_logps"], now)
    assert (
        out.metrics["kl"].item() == pytest.approx(0.0, abs=1e-6)
        and out.metrics["clip_fraction"].item() == 0.0
    )


def test_a_failing_reward_stops_the_run_in_one_line(tmp_path):
    from ligertune.training import train

    (tmp_path / "failing_reward.py").write_text("def f(**kw):\n    return None\n")
    recipe_file = tmp_path / "r.yaml"
    recipe_file.write_text(QUICKSTART_GRPO.read_text())
    recipe = _recipe(
        "objective.rewards=[{fn: 'failing_reward:f'}]", f"output_dir={tmp_path / 'run'}", path=recipe_file
    )
    with pytest.raises(RecipeError) as raised:
        train(recipe)
    (line,) = raised.value.problems
    assert line.startswith(
        "objective.rewards[0] (failing_reward:f) returned None (not a finite number) on completion 1"
    )
    assert "arithmetic_sample.jsonl, row" in line


def test_fraction_type_of_the_normaliser():
    assert normalise_answer("\\dfrac{6}{8}") == Fraction(3, 4)


def test_checkpoints_between_updates_hold_the_generation_batch(tmp_path):
    """μ = 2, a checkpoint every step: steps 1 and 3 fall between the two updates of a
    generation batch and hold this rank's rows (exactly those the next step trains on), step 2
    does not (its resume generates again). A resume that finds them missing says so in one line."""
    from ligertune.run.manifest import load_file
    from ligertune.training import train
    from ligertune.training.windows import Windows, prepared_file

    overrides = ["objective.num_iterations=2", "checkpoint.every_steps=1", "checkpoint.keep_last=3"]
    result = train(_recipe(*overrides, "training.max_steps=4", f"output_dir={tmp_path}"))
    root = tmp_path / "checkpoints"
    assert result.steps == 4
    held = {p.parent.name for p in root.glob(f"step-*/{prepared_file(0)}")}
    assert held == {"step-3"} and sorted(p.name for p in root.iterdir()) == ["step-2", "step-3", "step-4"]
    batches = load_file(root / "step-3" / prepared_file(0))["batches"]
    assert len(batches) == 1 and batches[0]["input_ids"].shape[0] == 32 and "advantages" in batches[0]
    windows = Windows(None, None, None, accumulation=1, updates=2, rank=0)
    windows.restore(root / "step-3", 3)
    assert torch.equal(windows.current.batches[0]["input_ids"], batches[0]["input_ids"])
    windows.restore(root / "step-2", 2)  # a window's first step: nothing to restore
    with pytest.raises(
        RecipeError, match=r"saved at step 1, between the 2 updates .* has no prepared-rank0.pt"
    ):
        windows.restore(root / "step-2", 1)


def test_the_bundled_arithmetic_answers_are_right():
    """Every bundled problem's answer, recomputed from the numbers in its text in the order the
    question states them, by the operation(s) its metadata names (one or two steps)."""
    import operator
    import re

    from ligertune.paths import ASSETS_DIR

    ops = {"addition": operator.add, "subtraction": operator.sub, "multiplication": operator.mul}
    ops["division"] = operator.floordiv
    rows = [json.loads(line) for line in (ASSETS_DIR / "arithmetic_sample.jsonl").read_text().splitlines()]
    assert len(rows) == 400 and len({r["prompt"] for r in rows}) == 400
    for row in rows:
        numbers = [int(n) for n in re.findall(r"\d+", row["prompt"])]
        steps = row["metadata"]["operation"].split(", ")
        assert len(numbers) == len(steps) + 1 == row["metadata"]["steps"] + 1, row
        value = numbers[0]
        for op, number in zip(steps, numbers[1:], strict=True):
            value = ops[op](value, number)
        assert row["answer"] == str(value) and value > 0, row
        assert row["prompt"].startswith("Question: ") and row["prompt"].endswith("\nAnswer:")
