"""Chapter 10b's planted bugs: eight mistakes that real projects shipped, planted into the library for a while.

SPOILER: this file is the answer key's mechanism. Diagnose each bug from what the layouts do
(:mod:`.bug_hunt`) before you read how it is planted here.

The exactness proof of chapters 05 and 10 (every layout equals one process) catches each of
them, and *which* layouts break says where to look. A bug is a set of :class:`Patch` es, each
wrapping one attribute of the library (a module's function, a class's method) for as long as
:func:`planted` is entered; the library's files are never edited, and on leaving the context
every attribute is put back exactly as it was, also when the body raised. The ranks of a bug
hunt plant the bug inside themselves (:func:`~parallel_lib.exercises.bug_hunt.hunt_worker`):
a patch in the notebook's kernel would not reach processes that import the library afresh.

Each :class:`Bug` names the library function whose line it makes wrong (``culprit``: the
diagnosis a student must give), which layouts it breaks (``breaks``, a rule on the
:class:`~parallel_lib.training.Plan`: tests/test_bug_lab.py runs every bug on every layout
of the lab and checks the rule against what happened), and the public reports of the same
mistake that we found (``reports``: repository and issue or pull-request number).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import MethodType
from typing import Any, Callable, Iterator, Mapping, Union

import torch
from torch import nn

import parallel_lib.pipeline_parallel.runtime as pipeline_runtime
import parallel_lib.tensor_parallel.convert as tp_convert
import parallel_lib.tensor_parallel.parallelize as tp_parallelize
import parallel_lib.training.run as training_run
import parallel_lib.training.step as training_step
from parallel_lib.sharding.layers import StageThreeHooks
from parallel_lib.sharding.zero import ZeroEngine
from parallel_lib.tensor_parallel.layers import ColumnParallelLinear
from parallel_lib.training.plan import Plan
from parallel_lib.training.stage_gradients import reduce_stage_gradients
from parallel_lib.training.tp_stage import stage_loss

__all__ = ["Patch", "Bug", "BUGS", "planted", "planted_now", "qualified_name"]


@dataclass(frozen=True)
class Patch:
    """One attribute of the library wrapped while a bug is planted: ``owner.name = wrap(owner.name)``.

    ``owner`` is a module (the name a caller looks up, e.g. ``training.run``'s own
    ``reduce_stage_gradients``) or a class (a method).
    """

    owner: Any
    name: str
    wrap: Callable[[Any], Any]


@dataclass(frozen=True)
class Bug:
    """A planted bug: what it changes, where the wrong line is, which layouts it breaks.

    Attributes:
        id: the letter the notebook calls it by.
        culprit: the library function whose line is wrong (the diagnosis).
        breaks: which layouts it breaks, as a rule on the plan.
        patches: what :func:`planted` wraps.
        forward_ok: the first step's loss is still right where it breaks (only a backward, a sum or
            an optimizer input is wrong); False: the loss is already wrong.
        crashes: the layouts where it raises instead of training (a rule on the plan).
        wrong_line: the mistake in one sentence (shown after the diagnosis).
        reports: public reports of the same mistake, ``"owner/repo#number"``.
        clue: a hint for a diagnosis that names the wrong function (does not name the right one).
        decoys: functions a student typically blames instead, by qualified name, each with its hint.
    """

    id: str
    culprit: Callable[..., Any]
    breaks: Callable[[Plan], bool]
    patches: tuple[Patch, ...]
    forward_ok: bool
    wrong_line: str
    reports: tuple[str, ...]
    clue: str
    decoys: Mapping[str, str] = field(default_factory=dict)
    crashes: Callable[[Plan], bool] = lambda plan: False

    @property
    def where(self) -> str:
        """The culprit's qualified name, ``module.function`` or ``module.Class.method``."""
        return qualified_name(self.culprit)


def qualified_name(fn: Callable[..., Any]) -> str:
    """``module.qualname`` of a function or method (through ``functools.wraps``)."""
    return f"{fn.__module__}.{fn.__qualname__}"


# --------------------------------------------------------------------------- the wrappers (one per bug)

def _undivided(original: Callable[..., Any]) -> Callable[..., Any]:
    """A: ZeRO-0/1's all-reduce (or reduce-scatter) keeps the replicas' SUM: the division by the group is gone."""
    @functools.wraps(original)
    def reduce_gradients(self: ZeroEngine) -> None:
        first = not self._reduced
        original(self)
        if first and self.stage <= 1:  # undo ``buffer /= self.world_size``
            for buffer in self.grad_full:
                buffer *= self.world_size
    return reduce_gradients


def _loss_over_dp_tp(original: Callable[..., Any]) -> Callable[..., Any]:
    """B: the loss divided by dp·tp ranks (every rank of a replica's stage counted as a replica)."""
    @functools.wraps(original)
    def loss_with_tp(stage: Any, labels: torch.Tensor, weights: torch.Tensor, denominator: float) -> Any:
        return original(stage, labels, weights, denominator * stage.model.tp_info.tp)
    return loss_with_tp


def _tied_not_summed(original: Callable[..., Any]) -> Callable[..., Any]:
    """C: the tied embedding's two copies (first and last stage) each step on their own part of the gradient."""
    @functools.wraps(original)
    def without_tied(axis: Any, stage: Any, pm: Any, who: str, timeout: float, comm: Any = None) -> None:
        tied, stage.tied = stage.tied, []
        try:
            original(axis, stage, pm, who, timeout, comm)
        finally:
            stage.tied = tied
    return without_tied


def _averaged_twice(original: Callable[..., Any]) -> Callable[..., Any]:
    """D: each micro-batch's loss, already divided by the step's tokens, divided by the micro-batches again."""
    @functools.wraps(original)
    def forward(self: Any, action: Any, x: Any) -> Any:
        if self.loss is None:
            return original(self, action, x)
        loss_of, m = self.loss, self.schedule.num_micro_batches
        self.loss = lambda i: (lambda y, per_batch=loss_of(i): per_batch(y) / m)
        try:
            return original(self, action, x)
        finally:
            self.loss = loss_of
    return forward


def _plain_linear(original: Callable[..., Any]) -> Callable[..., Any]:
    """E: the MLP's column-parallel ``c_fc`` is a plain ``nn.Linear`` holding this rank's rows (no ``f``)."""
    @functools.wraps(original)
    def split_block(block: Any, group: Any, sequence_parallel: bool = False, naive_qkv: bool = False) -> Any:
        block = original(block, group, sequence_parallel, naive_qkv)
        column = block.mlp.c_fc
        plain = nn.Linear(column.weight.shape[1], column.weight.shape[0], device=column.weight.device,
                          dtype=column.weight.dtype)
        with torch.no_grad():
            plain.weight.copy_(column.weight)
            plain.bias.copy_(column.bias)
        plain.group = group  # so that the run can still gather the trained shard back (return_state)
        plain.to_dense = MethodType(ColumnParallelLinear.to_dense, plain)
        block.mlp.c_fc = plain
        return block
    return split_block


def _not_gathered_for_backward(original: Callable[..., Any]) -> Callable[..., Any]:
    """F: ZeRO-3's backward hook does its bookkeeping but does not gather the group forward freed."""
    @functools.wraps(original)
    def before_backward(self: StageThreeHooks, i: int) -> None:
        self.gather = lambda i: None  # shadows the method for this call only
        try:
            original(self, i)
        finally:
            del self.gather
    return before_backward


def _mean_of_means(original: Callable[..., Any]) -> Callable[..., Any]:
    """G: each micro-batch's loss is its own tokens' mean, divided by the micro-batches (Hugging Face, 2024)."""
    @functools.wraps(original)
    def pipeline_step(stage: Any, runner: Any, link: Any, pipeline: Any, schedule: Any, j: int, batch: Any,
                      denominator: float, *args: Any, **kwargs: Any) -> Any:
        m = schedule.num_micro_batches

        def own_tokens(stage_: Any, labels: torch.Tensor, weights: torch.Tensor, _: float) -> Any:
            return stage_loss(stage_, labels, weights, float(weights.sum()) * m)

        with _swapped(training_step, "stage_loss", own_tokens):
            return original(stage, runner, link, pipeline, schedule, j, batch, denominator, *args, **kwargs)
    return pipeline_step


def _final_norm_unmarked(original: Callable[..., Any]) -> Callable[..., Any]:
    """H: under sequence parallelism the final layer norm is not marked, so its gradient is never summed over tp."""
    @functools.wraps(original)
    def parallelize_tp(model: Any, *args: Any, **kwargs: Any) -> Any:
        model = original(model, *args, **kwargs)
        for p in model.transformer.ln_f.parameters():
            p.sequence_parallel = False
        return model
    return parallelize_tp


def _zero_engine_method(name: str) -> str:
    return qualified_name(getattr(ZeroEngine, name))


_REDUCE = _zero_engine_method("reduce_gradients")
_STEP_LOSS = qualified_name(stage_loss)
_PIPELINE_STEP = "parallel_lib.training.step.pipeline_step"
_RUNTIME_FORWARD = "parallel_lib.pipeline_parallel.runtime.RankStages.forward"
_STAGE_GRADIENTS = qualified_name(reduce_stage_gradients)

BUGS: dict[str, Bug] = {bug.id: bug for bug in (
    Bug("A", ZeroEngine.reduce_gradients,
        breaks=lambda plan: plan.sync == "zero" and plan.dp > 1 and plan.zero <= 1,
        patches=(Patch(ZeroEngine, "reduce_gradients", _undivided),), forward_ok=True,
        wrong_line="ZeRO-0/1's branch all-reduces (reduce-scatters) the gradients and never divides them by the "
                   "group's size: the replicas' sum, dp times the mean",
        reports=("deepspeedai/DeepSpeed#7773",),
        clue="every layout that breaks has dp = 2 and ZeRO-0 or 1, and its first loss is right: the forward is "
             "fine, the gradients reach the optimizer at the wrong scale; ZeRO-3 with dp = 2 passes",
        decoys={_STAGE_GRADIENTS: "reduce_stage_gradients only calls the dp axis's own reduction: look inside "
                                  "what it calls for ZeRO-0 and 1",
                "parallel_lib.data_parallel.allreduce.average_gradients":
                    "chapter 01's averager is not what Plan(dp=2) runs: sync='zero' is ZeroEngine",
                _zero_engine_method("step"): "the step updates what it is given: is the gradient it is given the "
                                             "mean?"}),
    Bug("B", stage_loss, breaks=lambda plan: plan.tp > 1,
        patches=(Patch(training_step, "stage_loss", _loss_over_dp_tp),), forward_ok=False,
        wrong_line="the loss is divided by dp·tp where dp was due: the tp ranks of one replica are not replicas",
        reports=("NVIDIA/Megatron-LM#906", "ByteDance-Seed/VeOmni#338"),
        clue="only the layouts with tp = 2 break, and their very first loss is already wrong, by a whole factor",
        decoys={"parallel_lib.tensor_parallel.vocab.vocab_parallel_cross_entropy":
                    "the vocabulary-parallel cross-entropy is proved equal in chapter 07; the loss is off by a "
                    "whole factor: look at what the sum is divided by",
                _REDUCE: "dp = 2 layouts pass: the dp mean is right",
                _PIPELINE_STEP: "pipeline_step passes one denominator on; is it wrong there, or after?"}),
    Bug("C", reduce_stage_gradients, breaks=lambda plan: plan.pp > 1,
        patches=(Patch(training_run, "reduce_stage_gradients", _tied_not_summed),), forward_ok=True,
        wrong_line="the all-reduce of the tied embedding's two copies over the pipeline's first and last stage "
                   "is skipped: each copy steps on its own half of the gradient",
        reports=("NVIDIA/Megatron-LM#844", "uw-syfi/piper#13"),
        clue="only the pipelines break, with either schedule and with one micro-batch or two, and their first "
             "loss is right; look at which parameter is furthest from one process",
        decoys={_REDUCE: "dp layouts pass: the dp mean is right",
                "parallel_lib.training.tp_stage.TensorParallelStage.__init__":
                    "the last stage's copy of the embedding starts equal (the first loss is right): what keeps the "
                    "two copies equal after a step?",
                "parallel_lib.pipeline_parallel.runtime.RankStages.backward":
                    "the pipeline's backward sends the right gradients: the blocks' parameters match"}),
    Bug("D", pipeline_runtime.RankStages.forward, breaks=lambda plan: plan.micro_batches > 1,
        patches=(Patch(pipeline_runtime.RankStages, "forward", _averaged_twice),), forward_ok=False,
        wrong_line="each micro-batch's loss, already divided by the step's token count, is divided by the number "
                   "of micro-batches once more",
        reports=("pytorch/torchtitan#1733", "areal-project/AReaL#1273"),
        clue="every layout with two micro-batches breaks and both layouts with one pass, whatever the axes; the "
             "first loss is already wrong",
        decoys={_STEP_LOSS: "stage_loss divides by the token count it is handed, the step's: right with one "
                            "micro-batch as with two",
                _REDUCE: "the dp = 2 layout with one micro-batch passes: the dp mean is right",
                _PIPELINE_STEP: "pipeline_step hands every micro-batch the same denominator, the step's tokens: "
                                "what happens to the loss after that?"}),
    Bug("E", tp_parallelize.split_block, breaks=lambda plan: plan.tp > 1,
        patches=(Patch(tp_parallelize, "split_block", _plain_linear),), forward_ok=True,
        crashes=lambda plan: plan.sequence_parallel,
        wrong_line="the MLP's c_fc is built as a plain nn.Linear holding this rank's rows, not a ColumnParallelLinear:"
                   " forward is the same, but its input's gradient is never all-reduced (no f)",
        reports=("huggingface/transformers#47253",),
        clue="tp = 2 breaks with its first loss right (the forward is exact, a backward is not), and tp = 2 with "
             "sequence parallelism crashes on a shape in the MLP",
        decoys={"parallel_lib.tensor_parallel.layers.ColumnParallelLinear.forward":
                    "the column layer is proved in chapter 07; is every block's c_fc still one?",
                "parallel_lib.tensor_parallel.layers.RowParallelLinear.forward":
                    "the row layer's forward is right (so is the first loss); which layer's backward needs an "
                    "all-reduce?",
                "parallel_lib.tensor_parallel.regions.copy_to_tensor_parallel_region":
                    "f itself is right: is it still called?"}),
    Bug("F", StageThreeHooks._before_backward, breaks=lambda plan: plan.zero == 3,
        patches=(Patch(StageThreeHooks, "_before_backward", _not_gathered_for_backward),), forward_ok=False,
        crashes=lambda plan: plan.zero == 3,
        wrong_line="ZeRO-3's hook before a layer group's backward does not gather it again: backward reads "
                   "parameters that forward's hook freed",
        reports=("deepspeedai/DeepSpeed#8135", "deepspeedai/DeepSpeed#1960"),
        clue="only ZeRO-3 fails, in backward, reading a parameter whose storage has size 0",
        decoys={"parallel_lib.sharding.flat.FlatParamGroup.free":
                    "free does what it says; the question is who should have gathered the group again",
                "parallel_lib.sharding.layers.StageThreeHooks._after_forward":
                    "freeing after forward is ZeRO-3's design: memory for one layer group at a time",
                _REDUCE: "the reduction runs after backward; the error is inside backward"}),
    Bug("G", training_step.pipeline_step,
        breaks=lambda plan: plan.row_replicas * plan.micro_batches > 1,
        patches=(Patch(training_run, "pipeline_step", _mean_of_means),), forward_ok=False,
        wrong_line="each micro-batch's loss is divided by its own token count (times the micro-batches), not by the "
                   "step's: a mean of means, which weighs a short micro-batch's tokens more",
        reports=("huggingface/blog#2414", "ml-explore/mlx-lm#1413"),
        clue="everything breaks except the one layout whose step is a single micro-batch of the whole batch; the "
             "first loss is already wrong, by less than a whole factor; padded rows hold fewer tokens",
        decoys={_STEP_LOSS: "stage_loss divides by whatever it is handed: who hands it what?",
                _RUNTIME_FORWARD: "the pipeline gives every micro-batch's loss the same weight... is that the bug, "
                                  "or what each loss was divided by?",
                _REDUCE: "the pipeline with one micro-batch passes; dp alone cannot explain it"}),
    Bug("H", tp_parallelize.parallelize_tp, breaks=lambda plan: plan.sequence_parallel,
        patches=(Patch(tp_convert, "parallelize_tp", _final_norm_unmarked),), forward_ok=True,
        wrong_line="the final layer norm's parameters are not marked sequence_parallel, so their gradient (each tp "
                   "rank's tokens only) is never summed over tp",
        reports=("NVIDIA/Megatron-LM#1446", "NVIDIA-NeMo/Speech#7184"),
        clue="only sequence parallelism breaks, its first loss right; look at which parameters differ",
        decoys={"parallel_lib.tensor_parallel.sequence.sync_sequence_parallel_grads":
                    "it sums every marked parameter's gradient, right; which parameter is not marked?",
                _STAGE_GRADIENTS: "it calls the sum for the marked parameters; which are marked, and where?",
                "parallel_lib.tensor_parallel.layers.RowParallelLinear.forward":
                    "the row layers' parameters match one process"}),
)}

_ACTIVE: list[str] = []  # the bug planted in this process, if any


@contextmanager
def _swapped(owner: Any, name: str, value: Any) -> Iterator[None]:
    """``owner.name = value`` inside the block, the original back afterwards (also on error)."""
    before = getattr(owner, name)
    setattr(owner, name, value)
    try:
        yield
    finally:
        setattr(owner, name, before)


def planted_now() -> list[str]:
    """The ids of the bugs planted in this process (at most one)."""
    return list(_ACTIVE)


@contextmanager
def planted(bug: Union[str, Bug]) -> Iterator[Bug]:
    """Plant ``bug`` in this process for the block; every wrapped attribute is restored on leaving, also on error.

    Args:
        bug: a :data:`BUGS` id ("A" ... "H") or a :class:`Bug`.

    Raises:
        ValueError: an unknown id, or a bug is already planted (one at a time: two would hide each other).
    """
    if isinstance(bug, str):
        if bug not in BUGS:
            raise ValueError(f"bug must be one of {sorted(BUGS)}, got bug={bug!r}")
        bug = BUGS[bug]
    if _ACTIVE:
        raise ValueError(f"bug {_ACTIVE[0]} is planted already: plant one bug at a time (leave its `with` block "
                         f"first), got bug={bug.id!r}")
    saved: list[tuple[Any, str, Any]] = []
    _ACTIVE.append(bug.id)
    try:
        for patch in bug.patches:
            before = vars(patch.owner)[patch.name]  # the class's own function, or the module's binding
            setattr(patch.owner, patch.name, patch.wrap(getattr(patch.owner, patch.name)))
            saved.append((patch.owner, patch.name, before))
        yield bug
    finally:
        for owner, name, before in reversed(saved):
            setattr(owner, name, before)
        _ACTIVE.clear()
