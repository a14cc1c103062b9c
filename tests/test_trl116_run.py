"""TRL 1.16's run, step for step: eight `trl rloo` recipes (max_steps and num_train_epochs, whole and fractional;
steps_per_generation above and equal to gradient_accumulation_steps; num_iterations 1 and 2; prompt counts that do not
fill the last generation batch), each computed here from the committed table of TRL 1.16's RLOOConfig defaults
(plumbing/trl116_defaults.json) and TRL's own arithmetic: its RLOOConfig's generation batch, its RepeatSampler's
length, and the installed transformers' own Trainer code (set_initial_training_values, TrainerState.compute_steps,
DefaultFlowCallback, get_scheduler stepped as the Trainer steps it). Against each, rloo.py --trl_defaults 1.16 run on
the recipe, read from what it shows and writes (its start-up line, args.json, metrics.jsonl, its console lines and
checkpoints) and from the optimizer it steps, never from its own formulas."""

import json
import math
import re

import pytest
import torch

import plumbing
from helpers import TRL116_RECIPES as RECIPES
from helpers import TRL116_TABLE as TABLE
from helpers import prompt_rows, run_rloo_in_process, trl116_run, write_jsonl

def rloo_run(recipe: dict, num_prompts: int, assets, tmp_path, capsys, monkeypatch) -> dict:
    """rloo.py --trl_defaults 1.16's run of the recipe's command, as it shows and writes it."""
    rates = []

    class Recorded(torch.optim.AdamW):  # the rate of every optimizer step rloo.py takes
        def step(self, closure=None):
            rates.append(self.param_groups[0]["lr"])
            return super().step(closure)

    monkeypatch.setattr(torch.optim, "AdamW", Recorded)
    out = tmp_path / "rloo"
    words = [w for name, value in recipe.items() for w in (f"--{name}", str(value))]
    run_rloo_in_process(
        *words, "--trl_defaults", "1.16", "--model_name_or_path", assets["policy"], "--reward_fn",
        "reward_fns:count_a", "--dataset_name", write_jsonl(tmp_path / "train.jsonl", prompt_rows(num_prompts, 3)),
        "--max_prompt_length", 16, "--max_completion_length", 3, "--num_sample_generations", 0, "--output_dir", out,
        *(["--dataset_test_split", assets["test"], "--eval_max_prompts", 4] if "eval_strategy" in recipe else []))
    console = capsys.readouterr().out
    shape = re.search(r": (\d+) updates x (\d+) completions .*?, (\d+) optimizer steps \((\d+) an update", console)
    updates, per_update, steps, steps_per_update = map(int, shape.groups())
    metrics, flags = plumbing.read_metrics(out / "metrics.jsonl"), json.loads((out / "args.json").read_text())
    evaluations = [m["update"] for m in plumbing.read_metrics(out / "metrics.jsonl", evals=True) if m["update"]]
    step_of = lambda update: min(update * steps_per_update, steps)  # noqa: E731  an update's last optimizer step
    return {"steps": steps, "updates": updates, "completions": updates * per_update, "metrics": metrics,
            "steps_per_update": steps_per_update, "rates": rates, "step_of": step_of, "console": console,
            "log": [int(u) for u in re.findall(r"^update (\d+)/", console, re.M)],
            "save": sorted(int(p.name[5:]) for p in (out / "checkpoints").iterdir()), "evaluate": evaluations,
            **{name: flags[name] for name in ("bf16", "gradient_checkpointing", "seed")}}


IN_MAKE_TEST = (3, 5)  # the recipes make test runs (each kind but steps_per_generation equal to gradient_accumulation
# steps with num_iterations 1 and an evaluation schedule); all eight run in make test-bench


@pytest.mark.parametrize("recipe,num_prompts", [pytest.param(*r, id=f"recipe{i}", marks=() if i in IN_MAKE_TEST else
                                                             pytest.mark.bench) for i, r in enumerate(RECIPES, 1)])
def test_a_trl_recipe_runs_trls_run_step_for_step(recipe, num_prompts, assets, tmp_path, capsys, monkeypatch):
    trl = trl116_run(recipe, num_prompts, tmp_path)
    ours = rloo_run(recipe, num_prompts, assets, tmp_path, capsys, monkeypatch)
    for quantity in ("steps", "updates", "completions", "steps_per_update", "bf16", "gradient_checkpointing",
                     "seed"):
        assert ours[quantity] == trl[quantity], quantity
    assert len(ours["rates"]) == trl["steps"] and ours["rates"] == pytest.approx(trl["rates"], rel=1e-12, abs=0)
    assert [m["episode"] for m in ours["metrics"]] == [u * trl["completions"] // trl["updates"]
                                                      for u in range(1, trl["updates"] + 1)]
    for m in ours["metrics"]:  # TRL's learning_rate: the rate of the step it logs at, an update's last here
        assert m["learning_rate"] == pytest.approx(trl["rates"][ours["step_of"](m["update"]) - 1], rel=1e-12)
    # the intervals a recipe sets (the console line and the checkpoints keep this project's defaults: every update,
    # the end); rloo.py's console shows the last update and saves there, whatever the interval; update 0 (the initial
    # policy's evaluation, not TRL's default) apart
    last, update_of = trl["updates"], lambda step: math.ceil(step / trl["steps_per_update"])  # noqa: E731
    for act, flag in (("log", "logging_steps"), ("save", "save_steps"), ("evaluate", "eval_strategy")):
        if flag in recipe:
            assert set(ours[act]) - {last} == {update_of(s) for s in trl[act]} - {last}, act
            assert last in ours[act] and (act == "log" or last in map(update_of, trl[act])), act
    if not trl["bf16"]:
        assert "TRL 1.16's default bf16 is off here: no GPU" in ours["console"]


def test_the_eight_recipes_cover_what_they_must():
    """max_steps and num_train_epochs (whole and fractional), steps_per_generation above and equal to
    gradient_accumulation_steps, num_iterations 1 and 2, prompts that do not fill the last generation batch."""
    kinds = set()
    for recipe, num_prompts in RECIPES:
        c = TABLE | recipe
        per_generation = c["steps_per_generation"] or (c["generation_batch_size"] or 0) // c[
            "per_device_train_batch_size"] or c["gradient_accumulation_steps"]
        kinds |= {"max_steps" if c["max_steps"] > 0 else "epochs", f"iterations {c['num_iterations']}",
                  "above" if per_generation > c["gradient_accumulation_steps"] else "equal"}
        kinds |= {"fractional"} if c["max_steps"] < 0 and c["num_train_epochs"] % 1 else set()
        kinds |= {"uneven"} if num_prompts % (per_generation * c["per_device_train_batch_size"]
                                              // c["num_generations"]) else set()
    assert kinds == {"max_steps", "epochs", "fractional", "iterations 1", "iterations 2", "above", "equal", "uneven"}
