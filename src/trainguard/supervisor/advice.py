"""What the hang supervisor tells the user to do about a rank silent past its section's timeout.

A rank that computes longer than its section's learned timeout (an evaluation every N steps, say)
is best given a section of its own, whose timeout is learned apart. Where that work runs decides
how: a plain loop wraps it in ``guard.section("eval")``; under Lightning or the Hugging Face
Trainer the script holds no ``guard`` but the callback does (``callback.guard``), and Lightning's
own validation already has a section. The framework is read from the rank's stack dump (its
frames' file paths). A rank that is stopped (SIGSTOP, a debugger: state T) computes nothing: no
advice about its work is given for it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import psutil

PLAIN = 'put such work in guard.section("eval") so its time is learned apart'
LIGHTNING = (
    "under Lightning, fit's validation has a section of its own; put other such work (in a hook, or "
    'every N steps in training_step) in `with callback.guard.section("eval"):`, callback being your '
    "TrainguardCallback, so its time is learned apart"
)
HF = (
    "under the Hugging Face Trainer, put such work (in a TrainerCallback, compute_metrics) in `with "
    'callback.guard.section("eval"):`, callback being your TrainguardCallback, so its time is learned apart'
)


def framework_of(stacks: Optional[Path]) -> Optional[str]:
    """``"lightning"``, ``"hf"`` or ``None`` (a plain loop, or no stack dump): which framework's
    frames the stack dump at ``stacks`` holds."""
    try:
        text = stacks.read_text(errors="replace") if stacks is not None else ""
    except OSError:
        return None
    if "lightning/pytorch/" in text or "pytorch_lightning/" in text:
        return "lightning"
    if "transformers/trainer" in text:
        return "hf"
    return None


def section_advice(stacks: Optional[Path]) -> str:
    """The advice for a rank busy past its section's timeout, in the terms of its framework
    (:func:`framework_of` its stack dump)."""
    return {"lightning": LIGHTNING, "hf": HF}.get(framework_of(stacks) or "", PLAIN)


def is_stopped(pid: Optional[int]) -> bool:
    """Whether process ``pid`` is stopped now (psutil's ``stopped`` or ``tracing-stop``: SIGSTOP,
    SIGTSTP, a debugger); ``False`` when it is unknown or gone."""
    if pid is None:
        return False
    try:
        return psutil.Process(pid).status() in (psutil.STATUS_STOPPED, psutil.STATUS_TRACING_STOP)
    except psutil.Error:
        return False
