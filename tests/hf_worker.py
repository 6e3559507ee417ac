"""A small Hugging Face Trainer job under trainguard (tests/test_hf.py), launched by ``trainguard run``.

``python hf_worker.py MAX_STEPS OUTPUT_DIR [--set key=value ...]``: a one-layer GPT-2 built from a
tiny config (nothing downloaded), trained on random token sequences by ``transformers.Trainer``
with DDP on the CPU (gloo) and gradient accumulation 2, guarded by
:class:`trainguard.hf.TrainguardCallback`.

For ``benchmarks/framework_overhead.py``: ``WORKER_HIDDEN`` sets the embedding width (default 32),
``WORKER_PLAIN=1`` leaves the callback out, ``WORKER_TIMES=PATH`` makes rank 0 write each step's
seconds (step end to step end) to PATH as JSON.

For tests: ``WORKER_HOLD=N`` makes every rank wait at the end of the Trainer's step N (after
trainguard's step end, so a checkpoint of that step is committed; rank 0 first writes
``OUTPUT_DIR/held``) until trainguard has received a stop signal, at most 120 s: a test signals the run at a known step whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainerCallback, TrainingArguments  # noqa: E402

import trainguard  # noqa: E402
from trainguard.hf import TrainguardCallback, last_checkpoint  # noqa: E402

warnings.filterwarnings("ignore")


class Tokens(torch.utils.data.Dataset):
    def __init__(self, n: int = 256, length: int = 16):
        self.ids = torch.randint(0, 64, (n, length), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class StepTimes(TrainerCallback):
    """Rank 0 writes the seconds between consecutive step ends to ``path`` at the end of training."""

    def __init__(self, path: str):
        self.path, self.ends = path, []
        self.pad = float(os.environ.get("WORKER_PAD_MS", 0)) / 1e3  # a sleep that lengthens each step

    def on_step_end(self, args, state, control, **kw):
        if self.pad:
            time.sleep(self.pad)
        self.ends.append(time.perf_counter())

    def on_train_end(self, args, state, control, **kw):
        if args.process_index == 0:
            with open(self.path, "w") as f:
                json.dump([b - a for a, b in zip(self.ends, self.ends[1:])], f)


class HoldForSignal(TrainerCallback):
    """At the end of step ``step``, wait (at most 120 s) until ``guard_of()``'s shutdown handler
    has received a stop signal."""

    def __init__(self, step: int, guard_of):
        self.step, self.guard_of = step, guard_of

    def on_step_end(self, args, state, control, **kw):
        if state.global_step == self.step:
            if args.process_index == 0:
                open(os.path.join(args.output_dir, "held"), "w").close()
            deadline = time.monotonic() + 120
            while self.guard_of().shutdown.received is None and time.monotonic() < deadline:
                time.sleep(0.01)


def main() -> None:
    max_steps, output_dir = int(sys.argv[1]), sys.argv[2]
    cfg = trainguard.config_from_argv(argv=sys.argv[3:])
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(
        GPT2Config(vocab_size=64, n_positions=16, n_embd=int(os.environ.get("WORKER_HIDDEN", 32)), n_layer=1, n_head=2)
    )
    args = TrainingArguments(
        output_dir,
        max_steps=max_steps,
        per_device_train_batch_size=4,
        gradient_accumulation_steps=2,
        learning_rate=1e-3,
        warmup_steps=10,
        save_strategy="no",
        logging_strategy="no",
        report_to="none",
        use_cpu=True,
        ddp_backend="gloo",
        disable_tqdm=True,
        seed=0,
        dataloader_num_workers=0,
    )
    callbacks = [StepTimes(os.environ["WORKER_TIMES"])] if "WORKER_TIMES" in os.environ else []
    if not os.environ.get("WORKER_PLAIN"):
        callbacks.append(guarded := TrainguardCallback(cfg))
        if "WORKER_HOLD" in os.environ:
            callbacks.append(HoldForSignal(int(os.environ["WORKER_HOLD"]), lambda: guarded.guard))
    trainer = Trainer(model, args, train_dataset=Tokens(), callbacks=callbacks)
    trainer.train(resume_from_checkpoint=last_checkpoint(cfg) if not os.environ.get("WORKER_PLAIN") else None)


if __name__ == "__main__":
    main()
