"""The config sections of trainguard's components (``[run]``, ``[checkpoint]``, ``[supervisor]``, ...).

Each section is a pydantic model with ``extra="forbid"``: an unknown key, a wrong type or an
out-of-range value fails validation, and :func:`trainguard.config.load_config` turns that into a
:class:`~trainguard.config.ConfigError` naming the file and the key.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, Literal, Optional, Union

from pydantic import (
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    WrapValidator,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

_DURATION = re.compile(
    r"^\s*(?:(\d+(?:\.\d+)?)d)?\s*(?:(\d+(?:\.\d+)?)h)?\s*(?:(\d+(?:\.\d+)?)m)?\s*(?:(\d+(?:\.\d+)?)s?)?\s*$"
)


def parse_duration(value: Any) -> Optional[float]:
    """Parse seconds from a number, ``"HH:MM:SS"``, or ``"1d2h30m10s"``-style text.

    Returns:
        The duration in seconds, or ``None`` for ``None``/``""``.
    Raises:
        ValueError: the text is not a duration or is negative.
    """
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise ValueError("expected a duration, got a boolean")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and ":" in value:
        parts = [float(p) for p in value.split(":")]
        seconds = 0.0
        for p in parts:
            seconds = seconds * 60 + p
    elif isinstance(value, str) and (m := _DURATION.match(value)) and any(m.groups()):
        d, h, mi, s = (float(g) if g else 0.0 for g in m.groups())
        seconds = d * 86400 + h * 3600 + mi * 60 + s
    else:
        raise ValueError(f"expected a duration such as 3600, '1h30m' or '01:30:00', got {value!r}")
    if not math.isfinite(seconds):
        raise ValueError(f"expected a finite duration, got {value!r}")
    if seconds < 0:
        raise ValueError(f"expected a non-negative duration, got {value!r}")
    return seconds


def _byte_size(value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
    """Validate a size with pydantic's ``ByteSize`` (an integer, or a number and a unit: ``B``,
    ``KB``/``MB``/``GB``/``TB`` powers of 1000, ``KiB``/``MiB``/``GiB``/``TiB`` powers of 1024,
    case-insensitive, e.g. ``"20GiB"``, ``"1.5 gib"``, ``"2GB"``); ``""`` means unset (``None``),
    a boolean is refused, and a value ``ByteSize`` cannot read gets one message that says what is expected."""
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        raise PydanticCustomError("byte_size", "expected a size in bytes, not a boolean")
    try:
        return handler(value)
    except ValidationError as e:
        if not any(err["type"] in ("byte_size", "byte_size_unit") for err in e.errors()):
            raise
        raise PydanticCustomError(
            "byte_size",
            "expected a size such as 1073741824, '512MiB' or '2GB' (a non-negative "
            "whole number of bytes, or a number and a unit: KB/MB/GB/TB = 1000^n, KiB/MiB/GiB/TiB = 1024^n)",
        ) from None


Bytes = Annotated[ByteSize, WrapValidator(_byte_size)]
"""A size in bytes (``ByteSize``, an ``int`` subclass), ≥ 0: an integer or text such as ``"20GiB"``
(see :func:`_byte_size`). Use it as ``Optional[Bytes]``, so that ``""`` can unset it."""

PositiveBytes = Annotated[ByteSize, Field(gt=0), WrapValidator(_byte_size)]
"""As :data:`Bytes`, > 0. The bound sits inside the annotation, under the ``""`` → ``None`` rule
(a ``gt`` on the field itself would be applied to that ``None``)."""

_BYTES_ADAPTER: TypeAdapter = TypeAdapter(Optional[Bytes])


def parse_bytes(value: Any) -> Optional[int]:
    """Parse a size in bytes outside a config section (as a :data:`Bytes` field does).

    Returns:
        The size in bytes (``int``), or ``None`` for ``None``/``""``.
    Raises:
        ValueError: not a size (a ``pydantic.ValidationError``, whose message says what is expected).
    """
    size = _BYTES_ADAPTER.validate_python(value)
    return None if size is None else int(size)


class Section(BaseModel):
    """Base class of every config section: unknown keys are errors, assignments are validated, and
    no number may be infinite or NaN (``inf`` seconds overflow the timers that use them; a NaN
    timeout compares false with every duration, so it would never expire)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)


class RunSection(Section):
    """``[run]``: where the run lives. The launcher's ``--run-dir`` overrides ``dir``."""

    dir: Path = Field(Path("runs/default"), description="run directory (checkpoints, events, config)")
    seed: int = Field(0, ge=0, description="base random seed; trainguard.seed_everything() uses it")


class LocalTierSection(Section):
    """``[checkpoint.local]``: the fast node-local tier (off unless ``dir`` is set)."""

    dir: Optional[str] = Field(
        None,
        description="node-local directory, e.g. '/dev/shm/trainguard/myrun' or a local NVMe path; "
        "{node}, {host} and {rank} are filled in; unset = no local tier",
    )
    interval: int = Field(10, ge=1, description="save to the local tier every N optimizer steps")
    keep_last: int = Field(2, ge=1, description="local copies kept per rank (and per replica)")
    replicate: bool = Field(
        True, description="copy each rank's part to the next node's local tier (a single node: to the persistent tier)"
    )


class JitSection(Section):
    """``[checkpoint.jit]``: the just-in-time save of the last completed step when the group restarts
    after a lost or hung rank (see :mod:`trainguard.checkpoint.jit`)."""

    enabled: bool = Field(
        True,
        description="before a group restart, the survivors save the last completed step from memory and "
        "the restarted group resumes from it (a replicated model under trainguard run with the hang supervisor on)",
    )
    timeout: float = Field(
        10.0,
        gt=0,
        description="seconds the launcher waits for the survivors' just-in-time save before it restarts the group "
        "without it; each rank gives its own save up earlier, at 2 s + 3 × its measured checkpoint write time",
    )


class CheckpointSection(Section):
    """``[checkpoint]``: the persistent checkpoint store, asynchronous saving, the local tier."""

    interval: int = Field(100, ge=1, description="save to the persistent tier every N optimizer steps")
    keep_last: int = Field(3, ge=1, description="committed checkpoints kept (the newest is never deleted)")
    dir: str = Field("checkpoints", description="store directory, relative to the run dir unless absolute")
    verify: Literal["full", "size"] = Field(
        "full", description="'full' checks every checksum on resume, 'size' only sizes"
    )
    save_final: bool = Field(True, description="save a checkpoint when the last step finishes")
    async_save: Union[Literal["auto"], bool] = Field(
        "auto",
        description="scheduled saves copy the state to host memory and write it in the background "
        "while training goes on (stop and final saves are always synchronous); 'auto': so, except where "
        "a framework writes its own checkpoint files (the Hugging Face Trainer), and a save whose "
        "parameters or optimizer states were changed in place during the copy is not committed and "
        "turns later saves synchronous; true: always (an error where impossible); false: never",
    )
    max_failures: int = Field(
        3,
        ge=0,
        description="consecutive failed saves after which the run stops (exit 76) instead of "
        "training on without checkpoints; 0 = never stop",
    )
    local: LocalTierSection = LocalTierSection()
    jit: JitSection = JitSection()

    @model_validator(mode="after")
    def _tiers(self) -> CheckpointSection:
        if self.local.dir is not None and self.local.interval > self.interval:
            raise ValueError(
                f"checkpoint.local.interval ({self.local.interval}) is larger than checkpoint.interval "
                f"({self.interval}): the fast tier would save less often than the persistent one"
            )
        return self


class PreemptionSection(Section):
    """``[preemption]``: signals that ask the run to save and exit (requeue)."""

    signals: list[str] = Field(["SIGTERM", "SIGUSR1", "SIGINT"], description="signals that request a stop")
    save_deadline: float = Field(
        300.0,
        gt=0,
        description="seconds from the signal until the process exits even if the emergency save is unfinished",
    )

    @field_validator("signals")
    @classmethod
    def _known_signals(cls, v: list[str]) -> list[str]:
        import signal

        for name in v:
            if not name.startswith("SIG") or not hasattr(signal, name):
                raise ValueError(f"unknown signal name {name!r} (expected e.g. 'SIGTERM')")
        return v


class StopSection(Section):
    """``[stop]``: stop and save conditions checked at every step boundary."""

    max_duration: Optional[float] = Field(
        None,
        description="wall-clock budget of one launch (seconds, '4h', or 'HH:MM:SS'); the run stops early enough for one more step and one save",
    )
    time_margin: float = Field(5.0, ge=0, description="extra seconds kept in reserve before max_duration")
    kill_switch: str = Field("KILL", description="file (relative to the run dir) whose presence means: save and exit")
    save_switch: str = Field("SAVE", description="file whose presence means: save, delete the file, continue")
    check_interval: int = Field(
        0,
        ge=0,
        description="check stop conditions every N steps; 0 = auto: about every check_seconds, from the measured step time",
    )
    check_seconds: float = Field(
        1.0,
        gt=0,
        description="with check_interval = 0: target seconds between two checks (the stop latency); the check is one small all-reduce",
    )

    @field_validator("max_duration", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Optional[float]:
        seconds = parse_duration(v)
        if seconds == 0:  # every stop check would stop: one step per launch, requeued forever
            raise ValueError("expected a positive duration (leave it unset for no limit), got 0")
        return seconds

    @field_validator("kill_switch", "save_switch")
    @classmethod
    def _inside_run_dir(cls, v: str) -> str:
        path = Path(v)
        if not v or path.is_absolute() or ".." in path.parts:
            raise ValueError(
                f"expected a file name relative to the run directory (the launcher deletes a save switch it "
                f"finds), got {v!r}"
            )
        return v


class LauncherSection(Section):
    """``[launcher]``: the ``trainguard run`` agent."""

    max_restarts: int = Field(3, ge=0, description="worker-group restarts after a rank dies before giving up")
    monitor_interval: float = Field(0.1, gt=0, description="seconds between checks of the workers and their heartbeats")
    stop_grace: float = Field(
        60.0,
        gt=0,
        description="seconds the launcher waits for ranks to save and exit after forwarding a stop signal, before SIGKILL",
    )
    spares: int = Field(
        1,
        ge=0,
        description="warm spare processes per node for in-process recovery ([recovery] in_process): started in advance, each waits in the script's init_process_group to take a lost rank's place (on a GPU node a spare holds no GPU until it takes the lost rank's)",
    )


class SupervisorSection(Section):
    """``[supervisor]``: hang detection in ``trainguard run`` from the ranks' heartbeats and sections.

    The ``*_timeout`` values are the conservative starting timeouts (seconds; the setup/step/
    checkpointing/out-of-section defaults are Megatron's ft_launcher recipe values); once a section
    has ``min_samples`` observed durations its timeout is learned (see
    :mod:`trainguard.supervisor.timeouts`) and saved to ``RUN_DIR/timeouts.json`` for the next launch.
    """

    enabled: bool = Field(True, description="detect hung ranks and restart the group")
    initial_timeout: float = Field(
        600.0, gt=0, description="seconds from a rank's start to its first heartbeat (Guard created)"
    )
    setup_timeout: float = Field(
        600.0, gt=0, description="from the first heartbeat until the first step completes (resume, warm-up)"
    )
    step_timeout: float = Field(180.0, gt=0, description="one training step")
    checkpointing_timeout: float = Field(600.0, gt=0, description="one checkpoint save")
    out_of_section_timeout: float = Field(300.0, gt=0, description="time between sections (code after step_end)")
    teardown_timeout: float = Field(
        600.0,
        gt=0,
        description="after the last step or a stop: evaluation, process-group teardown, exit (never learned)",
    )
    section_timeouts: dict[str, float] = Field({}, description="starting timeouts of user-named sections")
    user_section_timeout: float = Field(
        600.0, gt=0, description="starting timeout of user sections not in section_timeouts"
    )
    learn: bool = Field(True, description="learn timeouts from observed durations")
    percentile: float = Field(
        99.0, gt=0, le=100, description="percentile of observed durations the learned timeout starts from"
    )
    safety_factor: float = Field(
        3.0, ge=1, description="learned timeout = max(min_timeout, safety_factor × percentile, longest observed)"
    )
    min_timeout: float = Field(2.0, gt=0, description="floor of every learned timeout (seconds)")
    min_samples: int = Field(20, ge=1, description="observations of a section before its timeout is learned")
    kill_grace: float = Field(
        3.0, gt=0, description="seconds between SIGTERM and SIGKILL when the launcher stops a group to restart it"
    )
    stacks_wait: float = Field(
        2.0,
        ge=0,
        description="seconds to wait at most for a hung rank's stack dump (it usually ends in milliseconds: its main thread's outermost frame marks the end)",
    )
    stopped_grace: float = Field(
        0.3,
        ge=0,
        description="a silent rank whose process the launcher has seen stopped (state T: SIGSTOP) this long is hung at once, without waiting for its timeout (see trainguard.supervisor.evidence); 0 turns it off",
    )
    busy_evidence: bool = Field(
        True,
        description="a rank silent past its timeout whose main thread keeps using CPU is slow, not hung: report it (slow_section) and let it and the ranks waiting for it go on (see trainguard.supervisor.evidence)",
    )
    busy_timeout: float = Field(
        1800.0,
        gt=0,
        description="seconds of silence after which even a busy rank is hung (a loop that never ends; a host thread spinning in a CUDA synchronize behind a hung NCCL collective)",
    )
    spin_factor: float = Field(
        5.0,
        ge=2,
        description="a busy rank silent past its timeout whose main thread's stack stays the same in every dump "
        "(one per timeout) for spin_factor × that timeout is stuck in place, not slow: hung (real work moves "
        "between lines over five of its own timeouts; a single native call that long belongs in a section)",
    )
    max_no_progress_restarts: int = Field(
        3, ge=1, description="give up after this many consecutive restarts with no new checkpoint"
    )
    max_same_step_faults: int = Field(
        2, ge=2, description="give up when the group fails at the same step this many times in a row"
    )

    @field_validator("section_timeouts")
    @classmethod
    def _positive(cls, v: dict[str, float]) -> dict[str, float]:
        for name, seconds in v.items():
            if seconds <= 0:
                raise ValueError(f"timeout of section {name!r} must be > 0, got {seconds}")
        return v


class FaultSpec(Section):
    """One injected fault (``[[faults.inject]]`` or ``trainguard run --inject KIND:key=value,...``).

    Process faults: ``rank_killed``, ``rank_hung``, ``random`` (a seeded choice of both).
    ``oom`` (in ``guard.run_step()`` of step number ``step``: a real allocation that cannot be
    satisfied, inside the forward or during the backward, see ``phase``); ``slow_rank`` (in
    ``guard.run_step()`` from step ``step`` for ``repeat`` steps, the rank sleeps ``factor`` × its
    compute time after its micro-batches: a straggler); ``slow_io`` (once ``step`` steps are
    complete, the rank's main thread does slow I/O that makes progress for ``seconds``: small
    writes with fsync and reads of a temporary file, a pause between them; a stalled shared file
    system, for the hang supervisor's busy evidence).
    Numeric faults, applied inside ``guard.should_step()`` to step number ``step`` (1-based: the
    step that, once complete, makes ``step`` steps) and the ``repeat - 1`` steps after it:
    ``nan_loss`` (the rank's loss and gradients become NaN), ``loss_spike`` (its loss × ``factor``),
    ``grad_explosion`` (its gradients and gradient norm × ``factor``).
    ``sdc``: one bit of one element of one tensor of the rank flips, a silent data corruption for
    ``[sdc]`` (``target``): ``param``, once ``step`` steps are complete, bit 20 of the first
    element of the first parameter; ``grad``, in ``should_step()`` of step number ``step``, bit 20
    of the first element of the first parameter's gradient (after the all-reduce: the rank's
    optimizer step then diverges); ``activation``, in the first forward of step number ``step``,
    the highest 0 exponent bit of the first element of the model's output (its logits, or the loss
    where the forward returns it; the module inside DDP): a value 2^64 times larger or more, for the
    instability detectors (``[sdc] on_instability``); with ``persistent`` in every forward of that
    step on the rank (a bad device: the re-run and a cross-check's replay too).
    """

    kind: Literal[
        "rank_killed",
        "rank_hung",
        "random",
        "nan_loss",
        "loss_spike",
        "grad_explosion",
        "oom",
        "slow_rank",
        "sdc",
        "slow_io",
    ] = Field(
        ...,
        description="rank_killed, rank_hung, random, nan_loss, loss_spike, grad_explosion, oom, slow_rank, sdc or slow_io",
    )
    rank: Optional[int] = Field(None, ge=0, description="global rank (random: drawn)")
    step: Optional[int] = Field(
        None, ge=1, description="fire when this many steps are complete (numeric faults: in this step)"
    )
    after_seconds: Optional[float] = Field(
        None, gt=0, description="fire this long after the Guard starts instead of at a step"
    )
    hang: Literal["sigstop", "collective", "spin"] = Field(
        "sigstop",
        description="rank_hung: stop the process (SIGSTOP), block it before the next collective so the others wait "
        "inside it, or spin its main thread in place (busy, the stack unchanged)",
    )
    section: Literal["step", "checkpointing", "should_step", "stop_check"] = Field(
        "step",
        description="where a fault at a step fires: at the end of the step, inside the next checkpoint save, "
        "in should_step of the next step (before its all-reduce), or in the stop check after the step (if one is due)",
    )
    every_attempt: bool = Field(
        False, description="fire again after each restart (a recurring fault); default only in the first attempt"
    )
    attempt: Optional[int] = Field(
        None,
        ge=0,
        description="fire only in this attempt (the group's restart count: 1 is the first restart); not with every_attempt",
    )
    seed: int = Field(0, description="random: the seed of the draw")
    factor: float = Field(
        10.0,
        gt=0,
        description="loss_spike / grad_explosion: the multiplier; slow_rank: extra compute time as a fraction (0.3 = 30 % slower)",
    )
    repeat: int = Field(1, ge=1, description="numeric faults: in this many consecutive steps from 'step'")
    persistent: bool = Field(
        False,
        description="numeric faults and sdc: fire again when a rollback or a step re-run does the step again; oom: in every retry of the step too (a fault recovery cannot outrun)",
    )
    target: Literal["param", "grad", "activation"] = Field(
        "param", description="sdc: the tensor whose bit flips (a parameter, a gradient, the model's output)"
    )
    phase: Literal["forward", "backward"] = Field(
        "forward", description="oom: fail a real allocation inside the model's forward, or during backward"
    )
    seconds: float = Field(5.0, gt=0, description="slow_io: how long the main thread's slow I/O lasts (seconds)")

    @model_validator(mode="after")
    def _one_attempt_rule(self) -> FaultSpec:
        if self.attempt is not None and self.every_attempt:
            raise ValueError("attempt and every_attempt exclude each other (one attempt, or every one)")
        return self


class SDCSection(Section):
    """``[sdc]``: silent data corruption: the data-parallel replicas' parameters compared by exact
    fingerprints every ``check_interval`` steps (see :mod:`trainguard.sdc.replicas`).

    On a mismatch: ``warn`` (event and console line; the replicas stay different), ``rerun``
    (every rank reloads the newest checkpoint taken at or before the last check where the replicas
    agreed, in-process; the checkpoints after it are set aside, since a save after the corruption
    may hold the bad replica's tensors, and re-runs the steps up to the failed check), ``raise``
    (stop with the give-up code 76). The re-run classifies the fault: if the replicas then agree, the fault was transient;
    if the same ranks differ again at the same check, it is persistent (``on_persistent``).

    ``on_instability = "rerun"``: a step the ``[instability]`` detectors find non-finite or spiking
    is first done again from its inputs (same batch, same random numbers; see
    :mod:`trainguard.sdc.rerun`): a different result is a transient hardware fault (the re-run's
    result is used); the same result on every rank is the data or the model (the instability
    policy acts), unless one rank's loss alone is wrong and its partner computes that rank's forward
    differently on the same inputs: a persistent fault of that rank (``on_persistent``). Off by
    default: the step-boundary state and the step's forward inputs are then kept in memory.
    """

    check_interval: int = Field(
        100,
        ge=0,
        description="steps between fingerprint checks (0: off); one read of the parameters and one small all-reduce each",
    )
    on_mismatch: Literal["warn", "rerun", "raise"] = Field("rerun", description="what a mismatch does")
    on_persistent: Literal["exclude", "replace", "raise"] = Field(
        "exclude",
        description="a persistent fault (after a rollback the same ranks differ again at the same check; or a "
        "step re-run's cross-check): "
        "exclude (roll back, write their hosts to RUN_DIR/exclude_nodes, stop with the requeue code 75), "
        "replace (roll back, write the hosts, the bad ranks exit with 77 and warm spares take their ranks in-process; "
        "exclude without [recovery] in_process or when every rank differs) or raise (76)",
    )
    on_instability: Literal["off", "rerun"] = Field(
        "off",
        description="rerun: an unstable step (non-finite, spike) is done once more from its inputs before the "
        "[instability] policy acts, to tell a transient hardware fault (a different result) from the data (the same; "
        "a single wrong rank is cross-checked on its partner: persistent if the partner computes otherwise)",
    )


class ElasticSection(Section):
    """``[elastic]``: resuming on another number of ranks (see :mod:`trainguard.state.reshard`).

    A checkpoint written by N ranks resumes on M: the model and optimizer are resharded by
    ``torch.distributed.checkpoint``, the data position is global (a ``reshardable`` sampler), each
    rank's random number generators are derived by a documented rule, and ``guard.rank_batch()``
    gives the batch per rank under ``keep``. With ``min_ranks`` the group also shrinks in place
    when it loses a rank and takes an arriving node in place (see :mod:`trainguard.rejoin.shrink`).
    """

    keep: Literal["global_batch", "rank_batch"] = Field(
        "global_batch",
        description="on another world size, keep the global batch (each rank's batch × the world size the run "
        "started with / the current one; the learning-rate schedule still fits) or each rank's batch (the global "
        "batch changes with the world size; scale the learning rate yourself if you want)",
    )
    min_ranks: int = Field(
        0,
        ge=0,
        description="with in-process recovery on one node: a lost rank with no warm spare ready makes the others go on "
        "as a smaller group (renumbered ranks, the data position and global batch kept) while this many or more "
        "remain; 0: never shrink (the lost rank is started cold). Set, it also lets a node that arrives (--nnodes "
        "MIN:MAX) join the running group in place instead of through a checkpoint and restart",
    )
    regrow: bool = Field(
        True,
        description="after a shrink in place, start a spare for each rank that left and grow back to the launched "
        "world size when it is ready: at the ranks' next stop check, the newcomers taking the model, optimizer and "
        "data position from the others (no restart); false: stay smaller until the group restarts",
    )


class FaultsSection(Section):
    """``[faults]``: faults to inject, to test and rehearse recovery. Each injection is an event."""

    inject: list[FaultSpec] = Field([], description="the faults")


Policy = Literal["warn", "skip", "rollback", "raise"]


class InstabilitySection(Section):
    """``[instability]``: detectors run by ``guard.should_step(loss, grad_norm)`` and what each one does.

    Policies: ``warn`` (event only, the step is applied), ``skip`` (gradients zeroed, no optimizer
    or scheduler step), ``rollback`` (reload a known-good checkpoint, see ``[rollback]``), ``raise``
    (stop with the give-up exit code). A step with non-finite gradients is never applied, whatever
    the policy. Statistics run over the last ``window`` applied steps and are used once
    ``min_history`` are known.

    * Loss spike: ``loss > mean + loss_spike_factor × max(std, 1 % of |mean|)``. 7 standard
      deviations over a rolling window of 1,000 values is OLMo 2's "spike score" (Team OLMo,
      "2 OLMo 2 Furious", arXiv:2501.00656); the floor keeps a flat series from turning noise into spikes.
    * Gradient-norm spike: ``grad_norm > grad_spike_factor × mean``. Gradient norms are heavy-tailed:
      on the example GPT (batch 4, 3,000 clean steps) the largest was 5.6× the running mean but 21
      standard deviations above it, so a standard-deviation rule would fire on healthy steps; 10×
      the mean leaves that margin and still catches explosions, which are orders of magnitude.
    """

    nonfinite_loss: Policy = Field("skip", description="policy for a NaN/Inf loss on any rank")
    nonfinite_grad: Policy = Field("skip", description="policy for a NaN/Inf gradient norm on any rank")
    loss_spike: Policy = Field("skip", description="policy for a loss spike (mean loss over ranks)")
    grad_spike: Policy = Field("skip", description="policy for a gradient-norm spike")
    loss_spike_factor: float = Field(7.0, gt=0, description="loss spike: standard deviations above the running mean")
    grad_spike_factor: float = Field(10.0, gt=1, description="gradient-norm spike: multiple of the running mean")
    window: int = Field(1000, ge=2, description="applied steps in the running statistics")
    min_history: int = Field(50, ge=2, description="applied steps seen before spikes are detected")
    max_consecutive: int = Field(
        3, ge=1, description="consecutive skipped steps after which the action escalates to 'escalate'"
    )
    escalate: Literal["rollback", "raise"] = Field(
        "rollback", description="action once max_consecutive steps in a row were skipped"
    )
    max_rollbacks: int = Field(3, ge=0, description="rollbacks in the whole run (all launches) before giving up")
    known_good_after: int = Field(
        50, ge=1, description="healthy steps after a checkpoint that make it known-good (recorded in its manifest)"
    )

    @model_validator(mode="after")
    def _history_fits(self) -> InstabilitySection:
        if self.min_history > self.window:
            raise ValueError(f"min_history ({self.min_history}) must be ≤ window ({self.window})")
        return self


class RollbackSection(Section):
    """``[rollback]``: how a rollback recovers (PaLM's manual recipe, automated: restart ~100 steps
    before the spike and skip the 200–500 batches around it; Chowdhery et al. 2022, §5.1)."""

    depth: int = Field(
        0,
        ge=0,
        description="roll back to the newest known-good checkpoint at least this many steps before the bad step",
    )
    skip_batches: int = Field(
        0,
        ge=0,
        description="batches skipped after the checkpoint; at least those between the checkpoint and the bad step, which are always skipped",
    )
    lr_factor: float = Field(0.5, gt=0, le=1, description="learning-rate multiplier right after a rollback")
    lr_ramp_steps: int = Field(100, ge=0, description="steps over which the multiplier ramps linearly back to 1")


class OOMSection(Section):
    """``[oom]``: ``guard.run_step(step_fn, batch)`` recovers from out-of-memory by splitting the micro-batch.

    The batch is cut along its first dimension into micro-batches of ``micro_batch_size`` samples;
    each micro-batch's loss is weighted by its share of the batch, so the gradients (and the
    returned loss) are the whole batch's whatever the split. On an out-of-memory error on any rank,
    every rank halves the micro-batch (gradient accumulation doubles) and retries the same batch;
    after ``grow_after`` clean steps it tries the double again (a grow that runs out of memory
    before the next ``grow_after`` clean steps doubles that wait).
    """

    micro_batch_size: int = Field(
        0, ge=0, description="samples per micro-batch at the start; 0 = the whole batch (no accumulation)"
    )
    grow_after: int = Field(200, ge=1, description="clean steps after a split before the micro-batch is doubled again")
    grow: bool = Field(True, description="grow the micro-batch back after grow_after clean steps")
    bucket_mb: float = Field(
        25.0, gt=0, description="DDP models: MiB per gradient all-reduce bucket (DDP's own default is 25)"
    )


class MemorySection(Section):
    """``[memory]``: memory watchdog; over a limit, all ranks save and exit with the requeue code (75).

    A slow leak then costs one requeue instead of an out-of-memory kill (the IDEFICS-80B practice
    in Bekman's *Machine Learning Engineering*, "Dealing with slow memory leaks"). Measured every
    ``check_interval`` steps, at the next stop check; the free GPU memory is read after
    ``gc.collect()`` and ``torch.cuda.empty_cache()``, as that text advises, so cached blocks do not count.
    """

    host_percent: Optional[float] = Field(
        None,
        gt=0,
        lt=100,
        description="stop when the host's used memory exceeds this percentage (psutil's virtual_memory().percent)",
    )
    rss_limit: Optional[PositiveBytes] = Field(
        None, description="stop when a rank's resident set size exceeds this (bytes, or '20GiB')"
    )
    gpu_free_min: Optional[PositiveBytes] = Field(
        None,
        description="stop when a rank's GPU has less free memory than this (bytes, or '2GiB'); skipped without a GPU",
    )
    check_interval: int = Field(
        100, ge=1, description="measure every N steps (the GPU measurement empties the allocator cache)"
    )


class StragglerSection(Section):
    """``[straggler]``: per-rank timing, exchanged in the stop check; scores after the NVIDIA
    Resiliency Extension (relative = fastest median / this median; individual = own usual median —
    the median of its last 16 earlier windows, where NVRx takes the best — / current median; 0.7
    thresholds as there). See :mod:`trainguard.health.straggler`."""

    enabled: bool = Field(True, description="time steps (and run_step's compute) and report stragglers")
    report_interval: float = Field(
        300.0, gt=0, description="seconds between reports, converted to steps from the slowest rank's step time"
    )
    report_interval_steps: int = Field(0, ge=0, description="report every N steps instead (0 = use report_interval)")
    warmup_steps: int = Field(10, ge=0, description="first steps not timed (allocation and first-iteration work)")
    min_samples: int = Field(10, ge=1, description="steps in a window before a rank's median counts")
    relative_threshold: float = Field(
        0.7, gt=0, le=1, description="a rank whose relative score is below this is a straggler"
    )
    individual_threshold: float = Field(
        0.7, gt=0, le=1, description="a rank whose individual score is below this is a straggler"
    )
    report_ranks: int = Field(5, ge=1, description="worst and best N ranks listed in each report")
    stop_if_detected: bool = Field(
        False, description="on a straggler: save, write its host to RUN_DIR/exclude_nodes, exit with the requeue code"
    )

    @field_validator("report_interval", mode="before")
    @classmethod
    def _duration(cls, v: Any) -> Optional[float]:
        return parse_duration(v)


class HealthSection(Section):
    """``[health]``: collective liveness ping and start-up preflight. See :mod:`trainguard.health`."""

    ping: bool = Field(True, description="run the background collective liveness ping (multi-rank runs)")
    ping_interval: float = Field(
        30.0,
        gt=0,
        description="seconds between pings (seconds, not steps: the ping must also fire while the loop is stuck in a collective)",
    )
    ping_timeout: float = Field(
        60.0, gt=0, description="seconds a ping may take before the missing ranks are reported and the group restarted"
    )
    preflight: bool = Field(
        True,
        description="check before training: checkpoint dir writable, room for keep_last + 1 checkpoints, devices alike on all ranks, GPU health",
    )
    gpu_check: bool = Field(
        True,
        description="preflight: NVML GPU health and a small compute/allocation check ('skipped: no GPU' without one)",
    )


class RecoverySection(Section):
    """``[recovery]``: in-process recovery of a lost rank (:mod:`trainguard.rejoin`). With
    ``in_process`` (the default), ``trainguard run`` (one node or several, two ranks or more) replaces a rank that died while the other ranks stay
    alive, keep their memory, and redo only the interrupted step; without it (or where it does not
    apply: the Guard says why at start, or when it cannot complete) the whole group restarts from
    the newest checkpoint."""

    in_process: Union[Literal["nccl-experimental"], bool] = Field(
        True,
        description='replace a lost rank without restarting the survivors (trainguard run, two ranks or more; the Lightning and Hugging Face callbacks included; FSDP2 models roll back to an in-memory snapshot, see snapshot_interval; a lost whole node is replaced by a spare node where one waits, see spare_nodes). Verified on gloo: a job whose default group is NCCL restarts the group on a lost rank (the launcher ends the survivors at once) unless "nccl-experimental", which replaces the rank in-process with the survivors\' communicators aborted (not yet verified on two GPUs; see docs/recovery.md, NCCL)',
    )
    timeout: float = Field(
        30.0,
        gt=0,
        description="seconds the survivors wait for the replacement and the new group before falling back to a group restart",
    )
    roll_forward: bool = Field(
        True,
        description="a DDP model's lost rank caught in the backward: the survivors stay inside the interrupted step (nothing of their loop is rewound) and its replacement moves forward to meet them at the end of that backward pass, where the step's gradient buckets are all-reduced again over the new group from the inputs each rank kept (one copy of the gradients a step); a loss caught elsewhere, or a model it does not apply to (said at start), is recovered by doing the step again, checked as before; false: always the step done again. See docs/recovery.md, Roll forward",
    )
    max_replacements: int = Field(
        10, ge=0, description="in-process replacements per launch before failures restart the group instead"
    )
    spare_nodes: bool = Field(
        True,
        description="with trainguard run --nnodes MIN:MAX, the group trains on MIN nodes and the nodes beyond wait as spare nodes: a node that vanishes (its launcher and ranks) is replaced by one in-process, its ranks' own state from the copy kept in the leading node's recovery store (needs [elastic] min_ranks = 0); false: nodes beyond MIN join the group ([elastic])",
    )
    snapshot_interval: int = Field(
        10,
        ge=1,
        description="a sharded model (FSDP2): steps between in-memory snapshots of each rank's shard, each copied to a rank on the next node; a lost rank rolls every rank back to the newest one, so at most this many completed steps are trained again",
    )
    node_timeout: float = Field(
        2.0,
        gt=0,
        description="seconds without a liveness beat from another node's launcher (sent every 0.1 s from a thread of its own) before the leading node (the rendezvous store's host) calls that node lost",
    )
