"""The demo's job under megatron-rl and under Hugging Face TRL's `GRPOTrainer`, side by side.

The job is `recipes/tiny/grpo.yaml`'s: the demo's tiny MoE and prompts, 16 prompts × 8 samples a
step, 16 new tokens, lr 1e-3 constant, one update per rollout, KL 0, fp32, on the CPU. Both sides
read the recipe: the same prompt records rendered by the same task (token for token: both go
through the tokenizer's chat template), the same reward (our task's `reward`, imported), the same
optimizer, clip and advantage settings where TRL has them. `settings_not_equal` lists the rest.

Each side runs in a process of its own, one after the other (ours first), for `--steps` steps. Per
side: steps/s at steady state (1 / the median wall time of a step after `--warmup` steps; ours:
`time/iteration_s`, the loop included) and with start-up
(steps / the process's wall time, imports and model load included), the mean reward of the first
and the last 10 steps, and the median of each phase. Ours: `time/rollout` (generation on the vLLM
server), `time/reward`, `time/logprobs`, `time/verify_wait` (the wait for the last sync's verification,
which ran during the rollout), `time/train`, `time/sync` (weight sync, and the verification where it is
not overlapped), `other` (the loop's logging and checkpointing: `time/iteration_s` − `time/step`);
TRL's: `generate` (`model.generate`), `reward`, `prepare` (all of generation, scoring and the
log-prob forwards before the loss) and `train` (the rest of the step: forward, backward, Adam).

TRL is a bench-only dependency, not one of the product's (`pip install 'trl==1.16.*'`). Usage:

    python bench/peer_bench.py [--steps 30] [--warmup 3] [--only ours|trl] [--seeds 1234,1,2] [--json-out F]

With several seeds each side runs once per seed (interleaved); the ratios are also given as their
median, and `reward_last10` says whether the end rewards differ by more than their noise.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench._report import emit  # noqa: E402

RECIPE = REPO / "recipes" / "tiny" / "grpo.yaml"
SIDES = ("ours", "trl")
SETTINGS_NOT_EQUAL = [
    "generation: ours on a vLLM server (HTTP, its own process), TRL with transformers' model.generate in "
    "the trainer's process (TRL's default); the two samplers draw different tokens from the same distribution",
    "ours verifies every weight sync against the server's log-probs and syncs the weights into the server "
    "each step (TRL's generator is the trained model itself: nothing to sync or verify)",
    "ours saves a checkpoint at the last step (always); TRL save_strategy='no'",
    "evaluation off on both (the demo's recipe evaluates every 10 steps)",
    "advantages: ours (r − mean) / (std + 1e-6) with the population std (the recipe's advantage_std and "
    "advantage_eps); TRL (r − mean) / (std + 1e-4) with the sample std",
    "prompt order: both shuffle with seed 1234, but by different generators (our DataOrder, TRL's "
    "RepeatSampler): the steps see different prompts",
    "TRL's model runs transformers' Qwen3-MoE (eager attention, its own MoE loop), ours megatron-core's",
]


def recipe_cfg(paths: dict[str, Path], seed: int | None = None) -> Any:
    from megatron_rl.config.loader import load_recipe

    return load_recipe(RECIPE, [f"model.init_checkpoint={paths['model']}", f"data.train_path={paths['train']}",
                                f"data.eval_path={paths['eval']}", "evaluation.interval=0",
                                *([f"trainer.seed={seed}"] if seed is not None else [])])


def demo_paths() -> dict[str, Path]:
    import yaml

    from megatron_rl.commands.demo import cache_root
    from megatron_rl.demo.prepare import prepare_demo_assets

    fields = yaml.safe_load((REPO / "recipes" / "tiny" / "base.yaml").read_text())["model"]["tiny"]
    return prepare_demo_assets(cache_root() / "demo", fields)


def summarize(step_times: list[float], rewards: list[float], phases: dict[str, list[float]], wall_s: float,
              warmup: int) -> dict[str, Any]:
    """A side's numbers from its per-step times, rewards and phase times, and its process's wall time."""
    steady = step_times[warmup:] or step_times
    median = statistics.median(steady)
    return {"steps": len(step_times), "steady_s_per_step": median, "steady_steps_per_s": 1.0 / median,
            "with_startup_steps_per_s": len(step_times) / wall_s, "process_wall_s": wall_s,
            "reward_first10": statistics.fmean(rewards[:10]), "reward_last10": statistics.fmean(rewards[-10:]),
            "phase_median_s": {k: statistics.median(v[warmup:] or v) for k, v in sorted(phases.items())}}


# ------------------------------------------------------------------------------------ ours
def run_ours(paths: dict[str, Path], steps: int, warmup: int, out: Path, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "megatron_rl.cli", "train", str(RECIPE), f"model.init_checkpoint={paths['model']}",
           f"data.train_path={paths['train']}", f"data.eval_path={paths['eval']}", "evaluation.interval=0",
           f"trainer.max_steps={steps}", f"trainer.seed={seed}", f"logging.output_dir={out}",
           f"logging.run_name=ours_{seed}"]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"failed": (done.stdout + done.stderr)[-2000:]}
    rows = [json.loads(line) for line in (out / f"ours_{seed}" / "metrics.jsonl").read_text().splitlines()
            if line.strip()]
    phases = {k[5:]: [r.get(k, 0.0) for r in rows] for k in ("time/rollout", "time/reward", "time/logprobs",
                                                             "time/verify_wait", "time/train", "time/sync")}
    phases["other"] = [r["time/iteration_s"] - r["time/step"] for r in rows]
    # A step's wall time, the loop's logging and checkpointing included (TRL's step_s includes its own).
    return summarize([r["time/iteration_s"] for r in rows], [r["reward/mean"] for r in rows], phases, wall, warmup)


# ------------------------------------------------------------------------------------- TRL
def trl_child(steps: int, out: Path, seed: int) -> None:
    """TRL's GRPOTrainer on the recipe's job; prints one JSON line of per-step records."""
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from megatron_rl.data.schema import read_prompts
    from megatron_rl.tasks import resolve_task

    paths = demo_paths()
    cfg = recipe_cfg(paths, seed)
    r, t, a = cfg.rollout, cfg.trainer, cfg.algorithm
    task = resolve_task(cfg.task, cfg.rewards.weights)
    tokenizer = AutoTokenizer.from_pretrained(str(paths["model"]))
    records = read_prompts(str(paths["train"]), on_malformed=cfg.data.on_malformed)
    rows = [{"prompt": task.task.prompt(rec), "record": json.dumps(rec.to_dict())} for rec in records]

    def reward(prompts: list, completions: list, record: list[str], **_: Any) -> list[float]:
        return [task.reward(c[0]["content"], json.loads(rec))[0] for c, rec in zip(completions, record, strict=True)]

    args = GRPOConfig(
        output_dir=str(out / f"trl_{seed}"), max_steps=steps, per_device_train_batch_size=t.global_batch_size,
        gradient_accumulation_steps=1, num_generations=r.n, max_completion_length=r.max_response_length,
        temperature=r.temperature, top_p=r.top_p, learning_rate=t.lr, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=t.weight_decay, adam_beta1=t.adam_beta1, adam_beta2=t.adam_beta2,
        adam_epsilon=t.adam_eps, max_grad_norm=t.clip_grad, beta=a.kl_beta, epsilon=a.clip_eps_low,
        epsilon_high=a.clip_eps_high, num_iterations=1, loss_type="dapo", scale_rewards="group",
        router_aux_loss_coef=0.0, seed=t.seed, bf16=False, use_cpu=True, logging_steps=1, save_strategy="no",
        report_to=[], chat_template_kwargs=dict(r.chat_template_kwargs or {}), dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(str(paths["model"]), dtype=torch.float32)
    records_out: list[dict[str, float]] = []

    class Times(TrainerCallback):
        def on_step_begin(self, *_: Any, **__: Any) -> None:
            self.start = time.perf_counter()
            phases.clear()

        def on_step_end(self, *_: Any, **__: Any) -> None:
            records_out.append({"step_s": time.perf_counter() - self.start, **phases})

        def on_log(self, _args: Any, _state: Any, _control: Any, logs: dict | None = None, **__: Any) -> None:
            if logs and "reward" in logs and records_out:
                records_out[-1]["reward"] = float(logs["reward"])

    phases: dict[str, float] = {}
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args, train_dataset=Dataset.from_list(rows),
                          processing_class=tokenizer, callbacks=[Times()])
    for name, phase in (("_generate", "generate_s"), ("_calculate_rewards", "reward_s"),
                        ("_generate_and_score_completions", "prepare_s")):
        setattr(trainer, name, _timed(getattr(trainer, name), phases, phase))
    trainer.train()
    print(json.dumps(records_out))


def _timed(fn: Any, into: dict[str, float], name: str) -> Any:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        start = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            into[name] = into.get(name, 0.0) + time.perf_counter() - start
    return wrapper


def run_trl(steps: int, warmup: int, out: Path, seed: int) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child-trl", "--steps", str(steps), "--out", str(out), "--seed", str(seed)]
    started = time.perf_counter()
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(REPO)))
    wall = time.perf_counter() - started
    if done.returncode != 0:
        return {"failed": (done.stdout + done.stderr)[-2000:]}
    rows = json.loads(done.stdout.strip().splitlines()[-1])
    phases = {k.removesuffix("_s"): [row.get(k, 0.0) for row in rows] for k in ("generate_s", "reward_s", "prepare_s")}
    phases["train"] = [row["step_s"] - row.get("prepare_s", 0.0) for row in rows]
    return summarize([row["step_s"] for row in rows], [row["reward"] for row in rows], phases, wall, warmup)


def reward_noise(per_seed: list[dict[str, Any]]) -> dict[str, Any]:
    """Each side's last-10 reward over the seeds (mean, sample sd), their gap, and whether the gap is
    within noise: |gap| ≤ 2 standard errors of the difference of the means (Welch; needs ≥ 2 seeds).
    With a few seeds, 2 is below Student's t critical value: "not within noise" may be a false alarm,
    "within noise" is not."""
    out: dict[str, Any] = {}
    for side in SIDES:
        vals = [run[side]["reward_last10"] for run in per_seed if "reward_last10" in run.get(side, {})]
        out[side] = {"values": vals, "mean": statistics.fmean(vals) if vals else None,
                     "sd": statistics.stdev(vals) if len(vals) > 1 else None}
    if out["ours"]["mean"] is None or out["trl"]["mean"] is None:
        return out
    out["gap"] = out["ours"]["mean"] - out["trl"]["mean"]
    if out["ours"]["sd"] is not None and out["trl"]["sd"] is not None:
        k_o, k_t = len(out["ours"]["values"]), len(out["trl"]["values"])
        se = (out["ours"]["sd"] ** 2 / k_o + out["trl"]["sd"] ** 2 / k_t) ** 0.5
        out["se_of_gap"], out["within_noise"] = se, abs(out["gap"]) <= 2 * se
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps left out of the steady-state median")
    parser.add_argument("--only", choices=SIDES)
    parser.add_argument("--seeds", help="comma-separated trainer seeds (prompt order, sampling; default: the "
                                         "recipe's trainer.seed), each side once per seed, interleaved; with ≥ 2 "
                                         "the end rewards' noise is measured (reward_last10)")
    parser.add_argument("--json-out", type=Path)
    parser.add_argument("--child-trl", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child_trl:
        trl_child(args.steps, args.out, args.seed)
        return
    started = time.perf_counter()
    seeds = None
    if args.seeds is not None:
        seeds = list(dict.fromkeys(int(x) for x in args.seeds.split(",") if x.strip()))   # each once: a run dir each
        if not seeds:
            parser.error("--seeds: at least one seed")
    paths = demo_paths()
    seeds = seeds or [recipe_cfg(paths).trainer.seed]
    result: dict[str, Any] = {"job": str(RECIPE.relative_to(REPO)), "steps": args.steps, "warmup": args.warmup,
                              "seeds": seeds, "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
                              "settings_not_equal": SETTINGS_NOT_EQUAL}
    per_seed: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="peer_bench_") as tmp:
        for seed in seeds:
            run: dict[str, Any] = {"seed": seed}
            if args.only in (None, "ours"):
                run["ours"] = run_ours(paths, args.steps, args.warmup, Path(tmp), seed)
            if args.only in (None, "trl"):
                run["trl"] = run_trl(args.steps, args.warmup, Path(tmp), seed)
            ours, trl = run.get("ours", {}), run.get("trl", {})
            if "steady_steps_per_s" in ours and "steady_steps_per_s" in trl:
                run["ratio_steady"] = ours["steady_steps_per_s"] / trl["steady_steps_per_s"]
                run["ratio_with_startup"] = ours["with_startup_steps_per_s"] / trl["with_startup_steps_per_s"]
            per_seed.append(run)
    result.update({k: v for k, v in per_seed[0].items() if k != "seed"})      # the first seed's, as before
    if len(per_seed) > 1:
        result["per_seed"] = per_seed
        for key in ("ratio_steady", "ratio_with_startup"):
            values = [run[key] for run in per_seed if key in run]
            if values:
                result[key + "_median"] = statistics.median(values)
    result["reward_last10"] = reward_noise(per_seed)
    emit(result, started, args.json_out)


if __name__ == "__main__":
    main()
