"""What the run trains on: the tokenizer, the prompt records rendered by the task's prompt format,
CHORD's expert sequences, and the seeded, resumable order each is drawn in."""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch.distributed as dist

from ..config.schema import RecipeConfig
from ..data.prompts import prompt_token_ids
from ..data.schema import DataError, PromptRecord, read_prompts, read_sft
from ..tasks import LoadedTask


@dataclass
class DataOrder:
    """Seeded, resumable order over epochs: the state is (epoch, position) and nothing else."""

    size: int
    seed: int
    shuffle: bool = True
    epoch: int = 0
    position: int = 0

    def _permutation(self, epoch: int) -> list[int]:
        order = list(range(self.size))
        if self.shuffle:
            random.Random(self.seed * 1_000_003 + epoch).shuffle(order)
        return order

    def next_indices(self, count: int) -> list[int]:
        """The next `count` indices, continuing into the next epoch when one runs out."""
        out: list[int] = []
        while len(out) < count:
            perm = self._permutation(self.epoch)
            take = min(count - len(out), self.size - self.position)
            out += perm[self.position:self.position + take]
            self.position += take
            if self.position == self.size:
                self.epoch, self.position = self.epoch + 1, 0
        return out

    def state(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "position": self.position}

    def load(self, state: dict[str, Any]) -> None:
        self.epoch, self.position = int(state["epoch"]), int(state["position"])


@dataclass
class Prompts:
    records: list[PromptRecord]
    token_ids: list[list[int]]
    dicts: list[dict[str, Any]]

    def head(self, n: int) -> Prompts:
        return Prompts(self.records[:n], self.token_ids[:n], self.dicts[:n])


def load_prompts(path: str, tokenizer: Any, max_prompt_length: int, on_malformed: str,
                 prompt: Callable[[PromptRecord], list[dict[str, str]]],
                 chat_template_kwargs: Mapping[str, Any] | None = None) -> Prompts:
    """Prompt records rendered by the task's prompt format (and the recipe's chat-template
    variables); longer than the budget = dropped."""
    records = read_prompts(path, on_malformed=on_malformed)
    if not records:
        raise DataError(f"{path}: no prompt records (empty file, or every line skipped as malformed)")
    kept, ids = [], []
    for r in records:
        tokens = prompt_token_ids(tokenizer, prompt(r), chat_template_kwargs)
        if len(tokens) <= max_prompt_length:
            kept.append(r)
            ids.append(tokens)
    if not kept:
        raise DataError(f"{path}: none of its {len(records)} prompts fits rollout.max_prompt_length="
                        f"{max_prompt_length} (chat template included)")
    dropped = len(records) - len(kept)
    if dropped and dist.get_rank() == 0:
        print(f"[data] {dropped} prompts longer than {max_prompt_length} tokens dropped", flush=True)
    return Prompts(kept, ids, [r.to_dict() for r in kept])


def load_eval_set(cfg: RecipeConfig, tokenizer: Any, task: LoadedTask) -> Prompts | None:
    """The eval prompts (those within `rollout.max_prompt_length`), or None when evaluation is off."""
    if not cfg.evaluation.interval or not cfg.data.eval_path:
        return None
    prompts = load_prompts(cfg.data.eval_path, tokenizer, cfg.rollout.max_prompt_length, cfg.data.on_malformed,
                           task.task.prompt, cfg.rollout.chat_template_kwargs)
    return prompts.head(cfg.evaluation.max_prompts or len(prompts.records))


def load_sft_tokens(path: str, tokenizer: Any, on_malformed: str,
                    chat_template_kwargs: Mapping[str, Any] | None = None) -> list[list[int]]:
    """Expert sequences (prompt + response + EOS) for CHORD's SFT stream, with the prompt length;
    the prompt rendered as the RL prompts are (same chat-template variables)."""
    eos = require_eos(tokenizer, path)
    out = []
    records = read_sft(path, on_malformed=on_malformed)
    if not records:
        raise DataError(f"{path}: no SFT records (the file has no non-blank line)")
    for r in records:
        prompt = prompt_token_ids(tokenizer, r.messages, chat_template_kwargs)
        response = tokenizer(r.response, add_special_tokens=False)["input_ids"] + [eos]
        out.append([len(prompt)] + prompt + response)
    return out


def require_eos(tokenizer: Any, what: str) -> int:
    """The tokenizer's EOS id: responses end there and SFT sequences get one appended."""
    if tokenizer.eos_token_id is None:
        raise DataError(f"{what}: the tokenizer has no EOS token "
                        "(eos_token in tokenizer_config.json); generations and SFT sequences would never end")
    return int(tokenizer.eos_token_id)


@dataclass
class SftRows:
    """CHORD's expert stream: each row is `[prompt length, *prompt, *response]`."""

    rows: list[list[int]]
    order: DataOrder
    pad_id: int

    def next(self, count: int) -> list[list[int]]:
        return [self.rows[i] for i in self.order.next_indices(count)]


@dataclass
class TrainData:
    """The tokenizer, the training prompts and the order they are drawn in, CHORD's expert rows."""

    tokenizer: Any
    prompts: Prompts
    order: DataOrder
    sft: SftRows | None
    in_flight: list[dict[str, Any]] = field(default_factory=list)
    """Steps drawn before a checkpoint but not trained (asynchronous rollout), each
    `{"indices": [...], "order": the order's state right after its draw}`: `draw` hands them out
    again, first, after a resume."""

    @classmethod
    def load(cls, cfg: RecipeConfig, task: LoadedTask, tokenizer_dir: str) -> TrainData:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
        require_eos(tokenizer, tokenizer_dir)
        r, seed = cfg.rollout, cfg.trainer.seed
        prompts = load_prompts(_recipe_path(cfg.data.train_path, "data.train_path"), tokenizer, r.max_prompt_length,
                               cfg.data.on_malformed, task.task.prompt, r.chat_template_kwargs)
        sft = None
        if cfg.algorithm.name == "chord":
            rows = load_sft_tokens(_recipe_path(cfg.data.sft_path, "data.sft_path"), tokenizer, cfg.data.on_malformed,
                                   r.chat_template_kwargs)
            sft = SftRows(rows, DataOrder(len(rows), seed + 1), int(tokenizer.pad_token_id or 0))
        return cls(tokenizer, prompts, DataOrder(len(prompts.records), seed, cfg.data.shuffle), sft)

    @property
    def pad_id(self) -> int:
        return int(self.tokenizer.pad_token_id or 0)

    def decode(self, ids: list[int]) -> str:
        """A response as the reward functions read it (without special tokens)."""
        return str(self.tokenizer.decode(ids, skip_special_tokens=True))

    def draw(self, count: int) -> dict[str, Any]:
        """The next step's prompts, as an `in_flight` entry: a resumed run's in-flight steps first,
        then the order."""
        if self.in_flight:
            return self.in_flight.pop(0)
        indices = self.order.next_indices(count)
        return {"indices": indices, "order": self.order.state()}

    def state(self) -> dict[str, Any]:
        """What a checkpoint records of the data: where each order stands, and the drawn steps
        still to hand out."""
        return {"order": self.order.state(), "sft_order": self.sft.order.state() if self.sft else None,
                "in_flight": [dict(d) for d in self.in_flight]}

    def load_state(self, extra: dict[str, Any]) -> None:
        self.order.load(extra["order"])
        self.in_flight = [{"indices": [int(i) for i in d["indices"]], "order": dict(d["order"])}
                          for d in extra.get("in_flight", [])]
        if self.sft and extra.get("sft_order"):
            self.sft.order.load(extra["sft_order"])


def _recipe_path(value: str | None, key: str) -> str:
    if not value:
        raise DataError(f"the recipe must set {key}")
    return value
