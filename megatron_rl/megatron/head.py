"""The actor's LM head as megatron-core's GPTModel `output_processor`: log-probs and entropy from the
last hidden states through the fused head (`fused_head.py`), never the logits.

The model runs as always up to the decoder's final norm; `GPTModel._postprocess` then hands the
hidden states ``[s(/TP under SP), b, h]``, its output layer and the tied weight (None when untied) to
`fused_output` instead of calling the output layer. The TP mappings are the output layer's own
(`ColumnParallelLinear.forward` / `LinearWithGradAccumulationAndAsyncCommunication`): under sequence
parallelism the hidden states are all-gathered along the sequence and their gradient
reduce-scattered; without it, at TP > 1, the gradient is all-reduced. Both are megatron's functions.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch

from ..fused_head import fused_head_logprobs
from ..logprobs import LogProbOutput
from . import cpu_compat

cpu_compat.require_applied()

from megatron.core.tensor_parallel.mappings import (  # noqa: E402  (after the CPU patches)
    copy_to_tensor_model_parallel_region,
    gather_from_sequence_parallel_region,
)


class HeadRequest(NamedTuple):
    """What the fused head scores in one forward (`output_processor_context`)."""

    targets: torch.Tensor
    """[b, s] global token ids, position i scored against targets[:, i]."""
    temperature: float
    with_entropy: bool


def gather_for_head(hidden: torch.Tensor, output_layer: Any) -> torch.Tensor:
    """The hidden states every TP rank's vocabulary shard needs, with the output layer's gradient
    semantics (identity at TP 1)."""
    group = output_layer.tp_group
    if output_layer.sequence_parallel:
        return gather_from_sequence_parallel_region(hidden, tensor_parallel_output_grad=True, group=group)
    if group is not None and group.size() > 1:
        return copy_to_tensor_model_parallel_region(hidden, group=group)
    return hidden


def fused_output(*, hidden_states: torch.Tensor, output_layer: Any, output_weight: torch.Tensor | None,
                 context: HeadRequest, **_: Any) -> LogProbOutput:
    """`GPTModel`'s output processor: ``[b, s]`` log-probs of ``context.targets`` (and entropy when
    asked) at ``context.temperature``. An untied output layer's weight gradient goes straight into
    DDP's ``main_grad`` (as megatron's gradient-accumulation fusion would); the tied word embeddings'
    does not, because their lookup's gradient also reaches that parameter."""
    weight = output_layer.weight if output_weight is None else output_weight
    hidden = gather_for_head(hidden_states, output_layer)
    group = output_layer.tp_group if output_layer.tp_group is not None and output_layer.tp_group.size() > 1 else None
    out = fused_head_logprobs(hidden, weight, context.targets.t(), group, temperature=context.temperature,
                              with_entropy=context.with_entropy, into_main_grad=output_weight is None)
    return LogProbOutput(out.logprobs.t(), None if out.entropy is None else out.entropy.t())
