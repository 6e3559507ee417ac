"""Zoo shape: a Hugging Face ``transformers.Trainer`` with trainguard's callback, as docs/hf.md shows.

Its shape: a one-layer GPT-2 from a tiny config (nothing downloaded), ``TrainingArguments`` with
gradient accumulation 2, warm-up, ``save_strategy="no"`` (trainguard saves), the CPU and gloo;
``Trainer(...).train(resume_from_checkpoint=last_checkpoint(cfg))``; trainguard's
``TrainguardCallback`` and a callback that prints rank 0's step after it.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402
from _zoo import STEPS, say_step, write_weights_hash  # noqa: E402
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


class PrintStep(TrainerCallback):
    def on_step_end(self, args, state, control, **kw):
        say_step(args.process_index, state.global_step, STEPS)


def main() -> None:
    cfg = trainguard.config_from_env()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=1, n_head=2))
    args = TrainingArguments(
        os.path.join(str(cfg.run.dir), "hf-out"),
        max_steps=STEPS,
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
    trainer = Trainer(model, args, train_dataset=Tokens(), callbacks=[TrainguardCallback(cfg), PrintStep()])
    trainer.train(resume_from_checkpoint=last_checkpoint(cfg))
    write_weights_hash(trainer.model, args.process_index)


if __name__ == "__main__":
    sys.exit(main())
